"""Retrain: train a run's steps again from its episode dumps, with no engine and no env.

    python -m agentrl.retrain --run runs/x --step 12                # step 12 again, from checkpoint 11
    python -m agentrl.retrain --run runs/x --step 12 --compare      # ... and check it against checkpoint 12
    python -m agentrl.retrain --run runs/x --steps 3:8 --save out/  # steps 3 to 8 in a row, then save

The trainer is built in this process (one rank) from the config the run recorded
(``trajectories/run.json``), restored from the checkpoint written after the step before the first one
retrained (``<run>/checkpoints/step_00000011``; step 1 starts from the initial weights), and fed each
step's dumped training batch (the ``train`` records, in the order the trainer got them). On CPU, with the
thread count the run's trainer used, a retrained step's update is the original's bit for bit. Each step
prints one JSON line of the trainer's metrics. What it is for: debugging the trainer (a loss change, a
numerics question) on the exact batches of a run, and reproducing one step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from agentrl.episodes import DumpError, read_dump, read_run_info, step_path, to_trajectory


def _steps(arg_step: int | None, arg_steps: str | None) -> list[int]:
    if arg_steps is None:
        return [arg_step] if arg_step is not None else []
    first, _, last = arg_steps.partition(":")
    try:
        lo, hi = int(first), int(last or first)
    except ValueError:
        raise SystemExit(f"--steps: expected FIRST:LAST (e.g. 3:8), got {arg_steps!r}") from None
    if lo < 1 or hi < lo:
        raise SystemExit(f"--steps: expected 1 <= FIRST <= LAST, got {arg_steps!r}")
    return list(range(lo, hi + 1))


def checkpoint_before(run_dir: Path, step: int) -> Path | None:
    """The checkpoint written after step ``step - 1`` (None for step 1: the initial weights)."""
    if step == 1:
        return None
    from agentrl.trainer.checkpoint import step_dir

    path = step_dir(run_dir / "checkpoints", step - 1)
    if not path.is_dir():
        raise SystemExit(
            f"{path} does not exist: retraining step {step} needs the checkpoint of step {step - 1} "
            "(checkpoint.interval: 1 keeps one per step), or pass --checkpoint"
        )
    return path


def build_trainer(run_dir: Path, device: str | None = None) -> tuple[Any, dict[str, Any]]:
    """The run's trainer (one rank, in this process) from ``trajectories/run.json``, at the run's thread
    count; and the run info."""
    import torch

    info = read_run_info(run_dir)
    if "trainer" not in info:
        raise SystemExit(f"{run_dir}/trajectories/run.json names no trainer config")
    from agentrl.trainer.trainer import MegatronTrainer, TrainerConfig

    recorded = dict(info["trainer"])
    # the run's deterministic switch; runs recorded before it left the trainer config carry it there
    legacy = recorded.pop("deterministic", False)
    deterministic = bool(info.get("deterministic", legacy))
    cfg = TrainerConfig.model_validate(recorded)
    if device is not None:
        cfg = cfg.model_copy(update={"device": device})
    if cfg.tp * cfg.pp > 1:
        raise SystemExit(f"retrain runs one trainer rank; the run's trainer has tp={cfg.tp}, pp={cfg.pp}")
    if info.get("trainer_threads"):
        torch.set_num_threads(int(info["trainer_threads"]))
    # a world of its own, one rank (which takes no port): a torch.distributed world inherited from the
    # caller's environment (a launcher's RANK / WORLD_SIZE) is not ours
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    return MegatronTrainer(cfg, deterministic=deterministic), info


def retrain(
    run_dir: str | Path,
    steps: list[int],
    checkpoint: str | Path | None = None,
    save: str | Path | None = None,
    device: str | None = None,
) -> list[dict[str, float]]:
    """Train ``steps`` (consecutive) of the run in ``run_dir``; the trainer's metrics of each. ``save``:
    write the trainer's checkpoint there afterwards (``save/step_{N}/rank_00000.pt``)."""
    run_dir = Path(run_dir)
    if not steps or steps != list(range(steps[0], steps[0] + len(steps))):
        raise ValueError(f"steps must be consecutive, got {steps}")
    batches = []
    for step in steps:  # every batch read (and checked) before the trainer is built
        path = step_path(run_dir, step)
        if not path.is_file():
            raise SystemExit(f"{path} does not exist: step {step} was not dumped (rollout.dump)")
        batch = [to_trajectory(r) for r in read_dump(path, kind="train")]
        if not batch:
            raise SystemExit(f"{path} holds no training batch (kind 'train')")
        batches.append(batch)
    start = checkpoint if checkpoint is not None else checkpoint_before(run_dir, steps[0])
    trainer, info = build_trainer(run_dir, device)
    try:
        if start is not None:
            trainer.load_checkpoint(start)
        out = []
        for step, batch in zip(steps, batches, strict=True):
            metrics = trainer.train_step(batch, info.get("max_staleness"))
            out.append({"retrained_step": float(step), **metrics})
        if save is not None:
            trainer.save_checkpoint(save)
        return out
    finally:
        trainer.shutdown()


def same_weights(a: str | Path, b: str | Path) -> list[str]:
    """The parameter names whose bytes differ between two rank-0 checkpoint step dirs (empty: identical)."""
    import torch

    wa = torch.load(Path(a) / "rank_00000.pt", map_location="cpu", weights_only=False)["model"]
    wb = torch.load(Path(b) / "rank_00000.pt", map_location="cpu", weights_only=False)["model"]
    names = sorted(set(wa) | set(wb))
    return [
        k
        for k in names
        if isinstance(wa.get(k), torch.Tensor) or isinstance(wb.get(k), torch.Tensor)
        if k not in wa or k not in wb or wa[k].numpy().tobytes() != wb[k].numpy().tobytes()
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m agentrl.retrain", description="Train from a run's episode dumps (no engine, no env)."
    )
    p.add_argument("--run", required=True, help="the run's output_dir (with trajectories/ and checkpoints/)")
    p.add_argument("--step", type=int, help="the training step to train again (1-based)")
    p.add_argument("--steps", help="FIRST:LAST, consecutive steps to train again in a row")
    p.add_argument("--checkpoint", help="start from this checkpoint dir instead of the step before's")
    p.add_argument("--save", help="write the trainer's checkpoint here afterwards")
    p.add_argument("--device", choices=["cpu", "cuda"], help="override the run's trainer device")
    p.add_argument(
        "--compare",
        action="store_true",
        help="check the weights after the last step against the run's checkpoint of that step, bit for bit",
    )
    args = p.parse_args(argv)
    steps = _steps(args.step, args.steps)
    if not steps:
        p.error("give --step N or --steps FIRST:LAST")
    run_dir = Path(args.run)
    save = args.save
    if args.compare and save is None:
        import tempfile

        save = tempfile.mkdtemp(prefix="agentrl-retrain-")
    try:
        for row in retrain(run_dir, steps, args.checkpoint, save, args.device):
            print(json.dumps(row), flush=True)
    except DumpError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.compare:
        import shutil

        from agentrl.trainer.checkpoint import latest_checkpoint, step_dir

        mine = latest_checkpoint(save)
        theirs = step_dir(run_dir / "checkpoints", steps[-1])
        try:
            if not theirs.is_dir():
                print(f"error: {theirs} does not exist: nothing to compare with", file=sys.stderr)
                return 2
            differ = same_weights(mine, theirs)
        finally:
            if args.save is None:
                shutil.rmtree(save, ignore_errors=True)
        verdict = {"compare": str(theirs), "bit_identical": not differ, "differing": differ[:10]}
        print(json.dumps(verdict), flush=True)
        return 0 if not differ else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
