"""End to end with LoRA: ``python train_async.py ... trainer.lora.rank=8`` on the CI-sized Search-R1 config
trains, syncing only the adapters to the embedded engine by broadcast each step; the engine's logprobs of
its tokens match the trainer's, and the checkpoint holds the trained adapters, also as a PEFT dir."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_train_async_e2e import CONFIG, _left_after, _leftovers, _run

from agentrl.metrics import read_metrics


@pytest.mark.slow
def test_train_async_with_lora(tmp_path: Path, search_r1_cache: Path) -> None:
    assert not _leftovers(), "processes from an earlier test are still running"
    cfg = tmp_path / "e2e.yaml"
    out = tmp_path / "run"
    cfg.write_text(CONFIG.format(out=out, cache=search_r1_cache))

    # an entropy bonus: a gradient even when a tiny model's rewards in a group are all equal
    lora = ["trainer.lora.rank=8", "trainer.loss.entropy_coef=0.01", "trainer.lr=1e-2"]
    _run(["--config", str(cfg), "steps=2", "eval.num_tasks=2", *lora])
    rows = read_metrics(out / "metrics.jsonl")
    train = [r for r in rows if "policy_version" in r]
    assert [r["policy_version"] for r in train] == [1, 2]
    assert all(r["trainer/grad_norm"] > 0 for r in train)
    # tokens the engine sampled with the adapters merged, scored by the trainer's unmerged forward of the
    # same weights, agree to rounding (when a batch holds tokens of the weights it trains from)
    for r in train:
        if r["trainer/same_version_token_frac"] > 0:
            assert r["trainer/mismatch_logprob_abs_diff_max_same_version"] <= 1e-4
    # the checkpoint holds trained adapters and the base as loaded
    state = torch.load(out / "checkpoints" / "step_00000002" / "rank_00000.pt", weights_only=False)["model"]
    b = [t for n, t in state.items() if n.endswith("adapter.lora_B")]
    assert len(b) == 2 * 4 and all(t.abs().max() > 0 for t in b)  # 2 layers x (qkv, proj, fc1, fc2)
    # and beside it, the adapters as a PEFT dir: 2 layers x 7 HF modules x (A, B), B trained
    peft_dir = out / "checkpoints" / "step_00000002" / "adapter"
    assert json.loads((peft_dir / "adapter_config.json").read_text())["r"] == 8
    tensors = load_file(str(peft_dir / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 7 * 2
    assert all(t.abs().max() > 0 for n, t in tensors.items() if "lora_B" in n)
    assert not _left_after(), "the run left processes behind"
