"""Routing replay (R3) on a tiny Qwen3-MoE: the train/inference mismatch with and without replaying the
engine's routing in the trainer. Prints one JSON line.

The embedded engine samples trajectories (temperature 1) and reports each token's experts per layer
(SGLang's ``meta_info.routed_experts``); the Megatron trainer (fp32, CPU) then recomputes π_old of the
same tokens twice: with its own routing, and with the engine's routing replayed. Reported per engine dtype
(bf16: the usual serving precision; fp32: the trainer's own), both ways: the mismatch KL (k3 of KL(μ‖π_old),
the trainer's ``mismatch_kl`` metric), the largest |log μ - log π_old|, and the share of (token, layer)
pairs whose top-k expert set the trainer's router picked the same as the engine's.

    python bench/moe_replay.py [--trajectories 32] [--new-tokens 32] [--experts 8] [--layers 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
import warnings
from pathlib import Path

import torch


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _sample(model_dir: Path, dtype: str, prompts: list[list[int]], new_tokens: int, seed: int) -> list:
    from agentrl.embedded.engine import EmbeddedEngine
    from agentrl.embedded.sampling import RequestSampling
    from agentrl.models.moe import encode_routed_experts
    from agentrl.types import Trajectory

    engine = EmbeddedEngine(model_dir, dtype=dtype, max_batch_size=16)
    try:
        recs = await asyncio.gather(
            *(
                engine.generate(
                    p,
                    RequestSampling(
                        temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, sampling_seed=seed + i
                    ),
                    f"r{i}",
                )
                for i, p in enumerate(prompts)
            )
        )
    finally:
        engine.shutdown()
    out = []
    for i, (p, rec) in enumerate(zip(prompts, recs, strict=True)):
        t = Trajectory(task_id=f"t{i}", group_id=f"g{i}", prompt_ids=list(p), reward=0.0)
        t.append_model_tokens(rec.output_ids, rec.logprobs, 0)
        t.routed_experts = encode_routed_experts(rec.routed_experts)
        out.append(t)
    return out


def measure(trainer, trajs: list, replay: bool) -> dict[str, float]:
    """The mismatch between the trajectories' μ and the trainer's π_old, and the routing agreement."""
    from agentrl.models.moe import decode_routed_experts
    from agentrl.trainer.moe import record_routing

    trainer.replay_routing = replay
    kl_sum = k1_sum = n = 0.0
    worst = 0.0
    same = total = 0
    arch = trainer.arch
    for t in trajs:  # one at a time: the recorded routing is in this trajectory's token order
        with record_routing(trainer.module) as chosen:
            (lp,) = trainer.compute_logprobs([t])
        d = torch.tensor(t.rollout_logprobs, dtype=torch.float64) - torch.tensor(lp, dtype=torch.float64)
        kl_sum += float((torch.exp(-d) - 1 + d).sum())
        k1_sum += float(d.sum())
        n += d.numel()
        worst = max(worst, float(d.abs().max()))
        engine = torch.from_numpy(
            decode_routed_experts(t.routed_experts, arch.num_layers, arch.moe.topk).copy()
        )
        ours = torch.stack(chosen, 1)  # [tokens, layers, k] (one sequence: router order = position order)
        m = min(len(engine), len(ours))
        same += int((engine[:m].sort(-1).values == ours[:m].sort(-1).values.to(engine.dtype)).all(-1).sum())
        total += m * arch.num_layers
    return {
        "mismatch_kl": kl_sum / n,
        "mismatch_k1": k1_sum / n,
        "logprob_abs_diff_max": worst,
        "routing_agreement": same / total,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trajectories", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
    )
    from agentrl.models.tiny import build_tiny_model
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import MegatronTrainer

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(
            Path(tmp) / "moe",
            arch="qwen3_moe",
            seed=a.seed,
            hidden_size=a.hidden,
            num_hidden_layers=a.layers,
            num_experts=a.experts,
            num_experts_per_tok=a.topk,
        )
        g = torch.Generator().manual_seed(a.seed)
        vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        prompts = [
            torch.randint(3, vocab, (a.prompt_tokens,), generator=g).tolist() for _ in range(a.trajectories)
        ]
        trainer = MegatronTrainer(
            TrainerConfig(model_path=str(model_dir), micro_batch_size=8, moe={"routing_replay": True})
        )
        results = {}
        try:
            for dtype in ("bfloat16", "float32"):
                trajs = asyncio.run(_sample(model_dir, dtype, prompts, a.new_tokens, a.seed))
                results[dtype] = {
                    "no_replay": measure(trainer, trajs, replay=False),
                    "replay": measure(trainer, trajs, replay=True),
                }
        finally:
            trainer.shutdown()
    print(
        json.dumps(
            {
                "bench": "moe_replay",
                "model": f"qwen3_moe tiny: {a.layers} layers, hidden {a.hidden}, "
                f"{a.experts} experts top-{a.topk}",
                "trajectories": a.trajectories,
                "new_tokens": a.new_tokens,
                "trainer": "megatron fp32 CPU",
                "engine_bf16": results["bfloat16"],
                "engine_fp32": results["float32"],
                "cpu": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads(),
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
