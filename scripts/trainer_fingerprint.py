"""Fingerprint of MegatronTrainer behaviour: parameters, optimizer/checkpoint state and metrics of a few
train steps under several configs, with fixed seeds. Timing metrics are left out (they vary run to run).

    python scripts/trainer_fingerprint.py [--device cpu|cuda] [--only NAME,...] > fp.txt

Run it before and after a change that must not move numbers (a refactor) and diff the two outputs.

``agentrl`` is whatever is importable (PYTHONPATH picks the code under test); the trajectory helper
comes from ``<repo>/tests/_trainer_helpers.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import io
import json
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

TIMING = {"tokens_per_s", "old_logprob_seconds", "update_seconds", "step_seconds", "peak_gpu_mem_gb"}


def hash_obj(obj, h) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(obj.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, np.ndarray):
        h.update(f"N{obj.dtype}{obj.shape}".encode())
        h.update(np.ascontiguousarray(obj).tobytes())
    elif isinstance(obj, dict):
        h.update(b"{")
        for k in sorted(obj, key=repr):
            h.update(repr(k).encode())
            hash_obj(obj[k], h)
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for x in obj:
            hash_obj(x, h)
        h.update(b"]")
    elif isinstance(obj, io.BytesIO):
        h.update(b"BytesIO")
    else:
        h.update(repr(obj).encode())


def digest(obj) -> str:
    h = hashlib.sha256()
    hash_obj(obj, h)
    return h.hexdigest()


def params_digest(tr) -> str:
    sd = tr.module.state_dict()
    return digest({k: v for k, v in sd.items() if isinstance(v, torch.Tensor)})


def fmt_metrics(m: dict) -> str:
    return json.dumps({k: m[k] for k in sorted(m) if k not in TIMING})


def trajectories(tr, step: int, perturb: bool, sft: bool):
    from _trainer_helpers import make_trajectories

    from agentrl.types import Status

    trajs = make_trajectories(tr.arch.vocab_size, num_groups=4, group_size=2, seed=10 + step, version=0)
    if perturb:
        for t, lp in zip(trajs, tr.compute_logprobs(trajs), strict=True):
            t.rollout_logprobs = [
                (x + 0.05 * ((i % 3) - 1)) * m for i, (x, m) in enumerate(zip(lp, t.loss_mask, strict=True))
            ]
    if sft:
        for t in trajs:
            t.reward = None
    if step == 0:  # one failed and (outside SFT) one unrewarded trajectory: dropped and counted
        extra = make_trajectories(tr.arch.vocab_size, num_groups=1, group_size=2, seed=99)
        extra[0].status, extra[0].error = Status.FAILED, "tool crashed"
        if not sft:
            extra[1].reward = None
        trajs = trajs + extra
    return trajs


def run_config(name: str, model_dir: str, kw: dict, lines: list[str], workdir: str) -> None:
    from _trainer_helpers import sync_to_disk

    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import MegatronTrainer

    cfg = TrainerConfig(model_path=model_dir, **kw)
    tr = MegatronTrainer(cfg)
    p = lambda s: lines.append(f"[{name} r{tr.rank}] {s}")  # noqa: E731
    sft = cfg.loss.mode == "sft"
    p(f"init params {params_digest(tr)} lr {tr.current_lr()!r}")
    for step in range(3):
        trajs = trajectories(tr, step, perturb=not sft, sft=sft)
        m = tr.train_step(trajs, max_staleness=1)
        p(f"step {step} metrics {fmt_metrics(m)}")
        p(f"step {step} params {params_digest(tr)} lr {tr.current_lr()!r}")
    probe = trajectories(tr, 7, perturb=False, sft=False)
    p(f"logprobs {digest(tr.compute_logprobs(probe))}")
    p(f"hf_state_dict {digest(tr.hf_state_dict())}")
    ckpt = Path(workdir) / f"ckpt_{name}"
    v = asyncio.run(sync_to_disk(tr, str(Path(workdir) / f"hf_{name}")))
    p(f"sync_weights_from_disk version {v}")
    d = tr.save_checkpoint(ckpt)
    p(f"checkpoint dir {d.name} latest {MegatronTrainer.latest_checkpoint(ckpt).name}")
    state = torch.load(d / f"rank_{tr.rank:05d}.pt", map_location="cpu", weights_only=False)
    state["config"]["model_path"] = Path(state["config"]["model_path"]).name  # a temp dir
    for key in sorted(state):
        p(f"checkpoint {key} {digest(state[key])}")
    trajs = trajectories(tr, 3, perturb=not sft, sft=sft)
    m1 = tr.train_step(trajs, max_staleness=1)
    after1 = params_digest(tr)
    tr.load_checkpoint(ckpt)
    p(f"restored params {params_digest(tr)} step {tr.step} version {tr.policy_version}")
    trajs = trajectories(tr, 3, perturb=not sft, sft=sft)
    m2 = tr.train_step(trajs, max_staleness=1)
    p(f"step 3 metrics {fmt_metrics(m1)}")
    p(f"step 3 params {after1}")
    p(f"step 3 after restore metrics {fmt_metrics(m2)}")
    p(f"step 3 after restore params {params_digest(tr)} lr {tr.current_lr()!r}")
    tr.shutdown()


def _worker(rank: int, world: int, port: int, name: str, model_dir: str, kw: dict, workdir: str) -> None:
    warnings.filterwarnings("ignore")
    from _trainer_helpers import dist_env

    dist_env(rank, world, port)
    lines: list[str] = []
    run_config(name, model_dir, kw, lines, workdir)
    Path(workdir, f"{name}.rank{rank}.txt").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repo", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    sys.path.insert(0, str(Path(a.repo) / "tests"))
    warnings.filterwarnings("ignore")
    work = tempfile.mkdtemp(prefix="trainer_fp_")
    try:
        fingerprint(a, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def fingerprint(a: argparse.Namespace, work: str) -> None:
    """Print the fingerprint of every selected config; models and rank outputs go under ``work``."""
    from _trainer_helpers import dist_env

    from agentrl.cluster import free_port
    from agentrl.models.tiny import build_tiny_model

    models = {
        arch: str(build_tiny_model(Path(work) / f"tiny_{arch}", arch=arch, seed=0))
        for arch in ("qwen2", "qwen3")
    }
    from agentrl.trainer.model import load_hf_state_dict

    for arch, d in models.items():
        print(f"model {arch} {digest(load_hf_state_dict(d))}")

    dev = {"device": a.device}
    base = {**dev, "lr": 1e-3}
    if a.device == "cpu":
        configs = [
            ("default", "qwen2", 1, dict(dev)),
            (
                "torch_mbs2_mini2_sched",
                "qwen2",
                1,
                {
                    **base,
                    "optimizer": "torch",
                    "micro_batch_size": 2,
                    "num_mini_batches": 2,
                    "lr_warmup_steps": 2,
                    "lr_decay_steps": 6,
                    "lr_decay_style": "cosine",
                    "weight_decay": 0.01,
                },
            ),
            ("token_budget", "qwen2", 1, {**base, "max_tokens_per_micro_batch": 40, "grad_clip": 0.5}),
            (
                "kl_entropy_epochs",
                "qwen3",
                1,
                {
                    **base,
                    "micro_batch_size": 3,
                    "ppo_epochs": 2,
                    "loss": {"kl_coef": 0.5, "kl_estimator": "k3", "entropy_coef": 0.01, "tis": "token"},
                },
            ),
            (
                "bypass_linear",
                "qwen2",
                1,
                {
                    **base,
                    "num_mini_batches": 3,
                    "lr_decay_steps": 4,
                    "lr_decay_style": "linear",
                    "min_lr": 1e-4,
                    "loss": {"off_policy": "bypass", "mode": "gspo"},
                },
            ),
            ("sft", "qwen2", 1, {**dev, "lr": 1e-2, "micro_batch_size": 5, "loss": {"mode": "sft"}}),
            (
                "tp2_qwen3",
                "qwen3",
                2,
                {
                    **base,
                    "tp": 2,
                    "vocab_divisible_by": 4,
                    "micro_batch_size": 2,
                    "num_mini_batches": 2,
                    "loss": {"kl_coef": 0.1},
                },
            ),
            (
                "dp2_token_budget",
                "qwen2",
                2,
                {
                    **base,
                    "max_tokens_per_micro_batch": 50,
                    "num_mini_batches": 2,
                    "loss": {"entropy_coef": 0.01},
                },
            ),
        ]
    else:
        configs = [
            ("cuda_megatron_fp32", "qwen2", 1, {**base, "optimizer": "megatron"}),
            (
                "cuda_megatron_bf16_mini2_kl",
                "qwen3",
                1,
                {
                    **base,
                    "dtype": "bfloat16",
                    "micro_batch_size": 2,
                    "num_mini_batches": 2,
                    "lr_warmup_steps": 2,
                    "lr_decay_steps": 6,
                    "lr_decay_style": "cosine",
                    "loss": {"kl_coef": 0.5},
                },
            ),
            ("cuda_megatron_token_budget", "qwen2", 1, {**base, "max_tokens_per_micro_batch": 40}),
            ("cuda_torch", "qwen2", 1, {**base, "optimizer": "torch", "micro_batch_size": 2}),
        ]
    only = set(filter(None, a.only.split(",")))
    for name, arch, world, kw in configs:
        if only and name not in only:
            continue
        print(f"== {name} world {world} {json.dumps(kw, sort_keys=True)}", flush=True)
        if world == 1:
            lines: list[str] = []
            dist_env(0, 1, free_port())
            run_config(name, models[arch], kw, lines, work)
            print("\n".join(lines), flush=True)
        else:
            mp.spawn(
                _worker, args=(world, free_port(), name, models[arch], kw, work), nprocs=world, join=True
            )
            for r in range(world):
                print(Path(work, f"{name}.rank{r}.txt").read_text(), end="", flush=True)


if __name__ == "__main__":
    main()
