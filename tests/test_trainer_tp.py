"""Tensor parallelism on CPU: two gloo ranks (TP=2) give the same loss, gradients and updated weights
as one rank (TP=1), within 1e-5, for a full RL train step (π_old recompute, TIS, PPO); and so do the
chunked LM head (``logprob_chunk_tokens``) and packed micro-batches (``pack_sequences``), on one and on
two ranks."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from _trainer_helpers import (
    dist_env,
    make_trajectories,
    offset_rollout_logprobs,
    spawn_ranks,
    sync_to_disk,
)


def _worker(rank: int, world: int, port: int, model_dirs: list[str], out: str, extra: dict) -> None:
    warnings.filterwarnings("ignore")
    dist_env(rank, world, port)
    results = [_train_once(rank, world, d, extra) for d in model_dirs]  # one process group for all archs
    if rank == 0:
        torch.save(results, out)
    torch.distributed.destroy_process_group()


def _train_once(rank: int, world: int, model_dir: str, extra: dict) -> dict:
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.model import mcore_to_hf
    from agentrl.trainer.trainer import MegatronTrainer

    cfg = TrainerConfig(
        model_path=model_dir,
        tp=world,
        lr=1e-3,
        grad_clip=0.0,
        micro_batch_size=2,
        vocab_divisible_by=4,
        **extra,
    )
    tr = MegatronTrainer(cfg)
    trajs = make_trajectories(tr.arch.vocab_size, seed=3)
    offset_rollout_logprobs(trajs, tr.compute_logprobs(trajs))
    metrics = tr.train_step(trajs)
    # gradients of the (last) mini-batch, gathered over TP and renamed to HF names
    grads = {k: p.grad.detach().clone() for k, p in tr.module.named_parameters()}
    gathered: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for name, g in grads.items():
        parts = [torch.empty_like(g) for _ in range(world)]
        torch.distributed.all_gather(parts, g, group=tr.ps.get_tensor_model_parallel_group())
        for r, part in enumerate(parts):
            gathered.setdefault((0, r), {})[name] = part
    hf_grads = mcore_to_hf(gathered, tr.arch)
    return {"metrics": metrics, "grads": hf_grads, "weights": tr.hf_state_dict()}


def _run(world: int, model_dirs: list[Path], out: Path, **extra) -> list[dict]:
    spawn_ranks(_worker, world, [str(d) for d in model_dirs], str(out), extra)
    return torch.load(out, weights_only=False)


def test_tp2_matches_tp1(tiny_model_factory, tmp_path: Path) -> None:
    # qwen2: sharded qkv bias; qwen3: q/k norms whose gradients are summed over TP ranks
    dirs = [tiny_model_factory("qwen2"), tiny_model_factory("qwen3")]
    ones = _run(1, dirs, tmp_path / "tp1.pt")
    twos = _run(2, dirs, tmp_path / "tp2.pt")
    for one, two in zip(ones, twos, strict=True):
        _compare(one, two)


def test_chunked_lm_head_matches_full_logits(tiny_model_factory, tmp_path: Path) -> None:
    # the LM head + logprobs in chunks of 7 tokens (the last chunk partial; padded vocabulary rows),
    # on one rank and on two TP ranks, give the full-logits path's loss, gradients and update (with an
    # entropy bonus, so the entropy's gradient is compared too)
    dirs, loss = [tiny_model_factory("qwen2")], {"entropy_coef": 0.01}
    full = _run(1, dirs, tmp_path / "full.pt", loss=loss)
    for world in (1, 2):
        chunked = _run(world, dirs, tmp_path / f"chunk{world}.pt", loss=loss, logprob_chunk_tokens=7)
        for one, two in zip(full, chunked, strict=True):
            _compare(one, two)


def test_packed_micro_batches_match_padded(tiny_model_factory, tmp_path: Path) -> None:
    # sequences packed end to end (attention within each, budget 30 real tokens per micro-batch) give the
    # padded path's loss, gradients and update: on one rank, and on two TP ranks with the chunked head
    dirs, loss = [tiny_model_factory("qwen2"), tiny_model_factory("qwen3")], {"entropy_coef": 0.01}
    padded = _run(1, dirs, tmp_path / "padded.pt", loss=loss)
    for world, chunk in ((1, None), (2, 7)):
        packed = _run(
            world,
            dirs,
            tmp_path / f"packed{world}.pt",
            loss=loss,
            pack_sequences=True,
            max_tokens_per_micro_batch=30,
            logprob_chunk_tokens=chunk,
        )
        for one, two in zip(padded, packed, strict=True):
            _compare(one, two)


def _gather_worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    import asyncio

    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.model import gather_hf_state_dict
    from agentrl.trainer.trainer import MegatronTrainer

    warnings.filterwarnings("ignore")
    dist_env(rank, world, port)
    tr = MegatronTrainer(TrainerConfig(model_path=model_dir, tp=world, vocab_divisible_by=4))
    full = tr.hf_state_dict()
    # rank 1 takes part in the gather without keeping anything; rank 0 still gets every tensor
    kept = gather_hf_state_dict(tr.module, tr.arch, tr.ps, "cpu" if rank == 0 else None)
    # a sync whose rank 0 alone writes: the other rank gathers for it, keeping nothing
    calls: list[object] = []
    gather = tr.hf_state_dict
    tr.hf_state_dict = lambda device="cpu": calls.append(device) or gather(device)  # type: ignore[method-assign]
    version = asyncio.run(sync_to_disk(tr, str(Path(out).parent / "synced")))
    torch.save({"full": full, "kept": kept, "calls": calls, "version": version}, f"{out}.{rank}")
    torch.distributed.destroy_process_group()


def test_ranks_that_push_nothing_keep_no_gathered_weights(tiny_model_factory, tmp_path: Path) -> None:
    from agentrl.trainer.model import load_hf_state_dict

    spawn_ranks(_gather_worker, 2, str(tiny_model_factory("qwen2")), str(tmp_path / "out"))
    zero, one = (torch.load(tmp_path / f"out.{r}", weights_only=False) for r in (0, 1))
    assert zero["kept"].keys() == zero["full"].keys() and zero["full"]
    for name, t in zero["full"].items():
        assert torch.equal(zero["kept"][name], t), name
    assert one["kept"] == {}
    assert zero["calls"] == ["cpu"] and one["calls"] == [None]
    assert zero["version"] == one["version"] == 1
    written = load_hf_state_dict(tmp_path / "synced")
    assert written.keys() == zero["full"].keys()
    for name, t in zero["full"].items():
        assert torch.equal(written[name], t), name


def _compare(one: dict, two: dict) -> None:
    m1, m2 = one["metrics"], two["metrics"]
    assert m1["loss"] != 0.0
    assert m1["mismatch_kl"] > 0  # the off-policy path is exercised
    assert abs(m1["loss"] - m2["loss"]) <= 1e-5
    for k in ("ppo_kl", "entropy", "mismatch_kl", "tis_weight_mean"):
        assert abs(m1[k] - m2[k]) <= 1e-5, k
    assert abs(m1["grad_norm"] - m2["grad_norm"]) <= 1e-5
    assert set(one["grads"]) == set(two["grads"])
    for k, g1 in one["grads"].items():
        assert g1.abs().max() > 0 or "norm" in k, k
        assert (g1 - two["grads"][k]).abs().max() <= 1e-5, k
    # after one AdamW step (lr 1e-3): Adam's first update is ~lr * g / |g|, so entries whose gradient
    # is ~0 amplify 1e-12 differences; 0.1 * lr still separates "same update" from "different update"
    for k, w1 in one["weights"].items():
        assert (w1 - two["weights"][k]).abs().max() <= 1e-4, k
