"""HF checkpoints in and out of the trainer's sharded Megatron layout (the trainer's runtime mapping,
:mod:`agentrl.trainer.model`, applied to whole directories).

A Megatron dir holds ``agentrl_mcore.json`` (tp, pp, vocab padding, the HF config) and one
``mp_rank_{TT}_{PPP}/model.safetensors`` per (tensor, pipeline) rank with megatron-core ``GPTModel``
local state-dict names (megatron-LM's ``mp_rank_TT_PPP`` layout, safetensors instead of pickles); an MoE
model sharded over expert-parallel ranks has one ``mp_rank_{TT}_{PPP}_{EEE}`` per (tensor, pipeline,
expert) rank, as megatron-LM names them. Experts are stored one tensor per expert (``SequentialMLP``'s
names); a trainer running grouped-GEMM experts stacks them on load. Every tensor is kept in its dtype, so
HF -> Megatron -> HF is bit-exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from agentrl.trainer.model import ModelArch, hf_to_mcore_shards, load_hf_state_dict, mcore_to_hf, save_hf_dir

META = "agentrl_mcore.json"


def _rank_dir(root: Path, tp_rank: int, pp_rank: int, ep_rank: int | None = None) -> Path:
    tail = "" if ep_rank is None else f"_{ep_rank:03d}"
    return root / f"mp_rank_{tp_rank:02d}_{pp_rank:03d}{tail}"


def hf_to_mcore(
    hf_dir: str | Path,
    out_dir: str | Path,
    tp: int = 1,
    pp: int = 1,
    vocab_divisible_by: int = 1,
    ep: int = 1,
) -> Path:
    """Convert an HF dir into a Megatron dir sharded for ``tp`` x ``pp`` (x ``ep`` for an MoE model)."""
    from safetensors.torch import save_file

    hf_dir, out = Path(hf_dir), Path(out_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    arch = ModelArch.from_hf_config(config)
    shards = hf_to_mcore_shards(load_hf_state_dict(hf_dir), arch, tp, pp, vocab_divisible_by, ep=ep)
    for key, sd in shards.items():
        d = _rank_dir(out, key[1], key[0], key[2] if ep > 1 else None)
        d.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in sd.items()},
            str(d / "model.safetensors"),
            metadata={"format": "pt"},
        )
    meta = {"tp": tp, "pp": pp, "ep": ep, "vocab_divisible_by": vocab_divisible_by, "hf_config": config}
    (out / META).write_text(json.dumps(meta, indent=2))
    return out


def read_meta(mcore_dir: str | Path) -> dict:
    f = Path(mcore_dir) / META
    if not f.is_file():
        raise FileNotFoundError(f"{mcore_dir} is not an agentrl Megatron dir (no {META})")
    return json.loads(f.read_text())


def load_mcore_shard(
    mcore_dir: str | Path, pp_rank: int, tp_rank: int, tp: int, pp: int, ep_rank: int = 0, ep: int = 1
) -> dict[str, torch.Tensor]:
    """One rank's local state dict; the dir must have been written for the same ``tp``, ``pp`` and ``ep``."""
    from safetensors.torch import load_file

    meta = read_meta(mcore_dir)
    have = (meta["tp"], meta["pp"], meta.get("ep", 1))
    if have != (tp, pp, ep):
        raise ValueError(
            f"{mcore_dir} is sharded for tp={have[0]} pp={have[1]} ep={have[2]}, "
            f"not tp={tp} pp={pp} ep={ep}; convert it to HF and back to reshard"
        )
    d = _rank_dir(Path(mcore_dir), tp_rank, pp_rank, ep_rank if ep > 1 else None)
    return load_file(str(d / "model.safetensors"))


def mcore_to_hf_dir(mcore_dir: str | Path, hf_template: str | Path, out_dir: str | Path) -> Path:
    """Merge a Megatron dir back into an HF dir (config/tokenizer files copied from ``hf_template``)."""
    meta = read_meta(mcore_dir)
    arch = ModelArch.from_hf_config(meta["hf_config"])
    ep = meta.get("ep", 1)
    shards = {
        ((p, t) if ep == 1 else (p, t, e)): load_mcore_shard(mcore_dir, p, t, meta["tp"], meta["pp"], e, ep)
        for p in range(meta["pp"])
        for t in range(meta["tp"])
        for e in range(ep)
    }
    return save_hf_dir(mcore_to_hf(shards, arch), out_dir, hf_template)
