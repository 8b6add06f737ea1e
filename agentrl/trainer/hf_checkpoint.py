"""HF checkpoints in and out of the trainer's sharded Megatron layout (the trainer's runtime mapping,
:mod:`agentrl.trainer.model`, applied to whole directories).

A Megatron dir holds ``agentrl_mcore.json`` (tp, pp, vocab padding, the HF config) and one
``mp_rank_{TT}_{PPP}/model.safetensors`` per (tensor, pipeline) rank with megatron-core ``GPTModel``
local state-dict names (megatron-LM's ``mp_rank_TT_PPP`` layout, safetensors instead of pickles). Every
tensor is kept in its dtype, so HF -> Megatron -> HF is bit-exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from agentrl.trainer.model import ModelArch, hf_to_mcore_shards, load_hf_state_dict, mcore_to_hf, save_hf_dir

META = "agentrl_mcore.json"


def _rank_dir(root: Path, tp_rank: int, pp_rank: int) -> Path:
    return root / f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def hf_to_mcore(
    hf_dir: str | Path, out_dir: str | Path, tp: int = 1, pp: int = 1, vocab_divisible_by: int = 1
) -> Path:
    """Convert an HF dir into a Megatron dir sharded for ``tp`` x ``pp``."""
    from safetensors.torch import save_file

    hf_dir, out = Path(hf_dir), Path(out_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    arch = ModelArch.from_hf_config(config)
    shards = hf_to_mcore_shards(load_hf_state_dict(hf_dir), arch, tp, pp, vocab_divisible_by)
    for (p, t), sd in shards.items():
        d = _rank_dir(out, t, p)
        d.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in sd.items()},
            str(d / "model.safetensors"),
            metadata={"format": "pt"},
        )
    meta = {"tp": tp, "pp": pp, "vocab_divisible_by": vocab_divisible_by, "hf_config": config}
    (out / META).write_text(json.dumps(meta, indent=2))
    return out


def read_meta(mcore_dir: str | Path) -> dict:
    f = Path(mcore_dir) / META
    if not f.is_file():
        raise FileNotFoundError(f"{mcore_dir} is not an agentrl Megatron dir (no {META})")
    return json.loads(f.read_text())


def load_mcore_shard(
    mcore_dir: str | Path, pp_rank: int, tp_rank: int, tp: int, pp: int
) -> dict[str, torch.Tensor]:
    """One rank's local state dict; the dir must have been written for the same ``tp`` and ``pp``."""
    from safetensors.torch import load_file

    meta = read_meta(mcore_dir)
    if (meta["tp"], meta["pp"]) != (tp, pp):
        raise ValueError(
            f"{mcore_dir} is sharded for tp={meta['tp']} pp={meta['pp']}, not tp={tp} pp={pp}; "
            "convert it to HF and back to reshard"
        )
    return load_file(str(_rank_dir(Path(mcore_dir), tp_rank, pp_rank) / "model.safetensors"))


def mcore_to_hf_dir(mcore_dir: str | Path, hf_template: str | Path, out_dir: str | Path) -> Path:
    """Merge a Megatron dir back into an HF dir (config/tokenizer files copied from ``hf_template``)."""
    meta = read_meta(mcore_dir)
    arch = ModelArch.from_hf_config(meta["hf_config"])
    shards = {
        (p, t): load_mcore_shard(mcore_dir, p, t, meta["tp"], meta["pp"])
        for p in range(meta["pp"])
        for t in range(meta["tp"])
    }
    return save_hf_dir(mcore_to_hf(shards, arch), out_dir, hf_template)
