"""The trainer bench's batches and its two extra modes (bench/trainer_gpu.py): made-up RL batches (uniform or
long-tail response lengths), the true on-policy steps interleaved with default ones, and a long-tail batch
trained padded and packed."""

from __future__ import annotations

import random
import time

import torch


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def long_tail_lengths(n: int, mean: int, seed: int, sigma: float = 1.0) -> list[int]:
    """Lognormal response lengths (as the synthetic agent envs draw them) rescaled to ``n * mean`` tokens in
    all, each at least 8: the same total work as ``n`` responses of ``mean`` tokens, in a long tail."""
    rng = random.Random(seed)
    raw = [rng.lognormvariate(0.0, sigma) for _ in range(n)]
    scale = n * mean / sum(raw)
    return [max(8, round(x * scale)) for x in raw]


def make_batch(
    n: int,
    prompt_len: int,
    resp_len: int,
    vocab: int,
    group: int,
    seed: int,
    resp_lens: list[int] | None = None,
) -> list:
    from agentrl.types import Trajectory

    rng = random.Random(seed)
    out = []
    for i in range(n):
        resp_len = resp_lens[i] if resp_lens else resp_len
        t = Trajectory(
            task_id=str(i),
            group_id=str(i // group),
            prompt_ids=[rng.randrange(3, vocab) for _ in range(prompt_len)],
        )
        t.append_model_tokens(
            [rng.randrange(3, vocab) for _ in range(resp_len)],
            [-rng.random() * 3 for _ in range(resp_len)],
            0,
        )
        t.reward = float(rng.random())
        out.append(t)
    return out


def true_on_policy(trainer, a, batch: int, plen: int, rlen: int, vocab: int) -> dict:
    """The same batches with the trainer's logprobs (π_old and the loss's) from the true on-policy forward,
    in steps interleaved with default ones (each round trains one batch in both modes), so that a shared
    GPU's drift reaches both alike; the ratio is of the modes' median step times. ``deterministic``: the
    true on-policy steps with the deterministic mode's attention backward (torch's math kernel)."""
    import statistics

    from agentrl.trainer.true_on_policy import TrueOnPolicyLogprobs

    saved = trainer.logprobs
    modes = {"default": saved, "exact": TrueOnPolicyLogprobs(trainer.arch)}
    if a.deterministic_backward:
        modes["deterministic"] = TrueOnPolicyLogprobs(trainer.arch, deterministic_backward=True)

    def timed(logprobs: object, seed: int) -> tuple[float, dict]:
        trainer.logprobs = trainer.optim.logprobs = logprobs
        step_batch = make_batch(batch, plen, rlen, vocab, group=8, seed=seed)
        t0 = time.perf_counter()
        metrics = trainer.train_step(step_batch)
        sync(a.device)
        return time.perf_counter() - t0, metrics

    times: dict[str, list[float]] = {name: [] for name in modes}
    metrics: dict[str, dict] = {}
    try:
        for name in list(modes)[1:]:
            timed(modes[name], 0)  # warm-up (Triton compiles)
        for s in range(a.steps):
            for name, lp in modes.items():
                took, metrics[name] = timed(lp, s + 1)
                times[name].append(took)
    finally:
        trainer.logprobs = trainer.optim.logprobs = saved
    med = {name: statistics.median(t) for name, t in times.items()}
    extra = {}
    if "deterministic" in med:
        extra = {
            "deterministic_step_s": med["deterministic"],
            "deterministic_over_default_step": med["default"] / med["deterministic"],
        }
    return {
        "step_s": med["exact"],
        "default_step_s": med["default"],
        "step_tokens_per_s": batch * (plen + rlen - 1) / med["exact"],
        "over_default_step": med["default"] / med["exact"],
        **extra,
        "step_times_s": {name: [round(x, 4) for x in t] for name, t in times.items()},
        "grad_norm": {name: m.get("grad_norm") for name, m in metrics.items()},
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if a.device == "cuda" else None,
    }


def long_tail(trainer, a, batch: int, plen: int, rlen: int, vocab: int) -> dict:
    """The same long-tail batch trained padded (``micro_batch_size`` rows) and packed (budget
    ``--pack-budget``, default ``micro_batch_size x (prompt + response)`` real tokens): real tokens/s of each
    and the padding share."""
    lens = long_tail_lengths(batch, rlen, seed=7)
    cfg = trainer.cfg
    saved = (cfg.pack_sequences, cfg.max_tokens_per_micro_batch)
    out: dict = {
        "response_len_min": min(lens),
        "response_len_max": max(lens),
        "total_tokens": sum(lens) + batch * plen,
    }
    pack_budget = a.pack_budget or a.micro_batch_size * (plen + rlen)
    out["pack_budget"] = pack_budget
    for name, pack, budget in (("padded", False, None), ("packed", True, pack_budget)):
        cfg.max_tokens_per_micro_batch, cfg.pack_sequences = budget, pack
        trainer.train_step(make_batch(batch, plen, rlen, vocab, group=8, seed=100, resp_lens=lens))  # warm-up
        rates, walls = [], []
        for s in range(a.steps):
            step_batch = make_batch(batch, plen, rlen, vocab, group=8, seed=101 + s, resp_lens=lens)
            t0 = time.perf_counter()
            m = trainer.train_step(step_batch)
            sync(a.device)
            walls.append(time.perf_counter() - t0)
            rates.append(m["tokens_per_s"])
        out[f"{name}_update_tokens_per_s"] = sum(rates) / len(rates)
        out[f"{name}_step_s"] = sum(walls) / len(walls)
    cfg.pack_sequences, cfg.max_tokens_per_micro_batch = saved
    real = [plen + n - 1 for n in lens]
    padded_positions = sum(
        len(real[i : i + a.micro_batch_size]) * max(real[i : i + a.micro_batch_size])
        for i in range(0, batch, a.micro_batch_size)
    )
    out["padding_fraction_padded"] = 1 - sum(real) / padded_positions
    out["packed_over_padded"] = out["packed_update_tokens_per_s"] / out["padded_update_tokens_per_s"]
    return out
