"""The run's exactness (agentrl.exactness): what ``deterministic`` and ``trainer.true_on_policy`` turn on,
decided in one record that the placement, the trainer and the orchestrator read."""

from __future__ import annotations

import asyncio
from typing import Any

from agentrl.buffer import Group, StalenessController, TrajectoryBuffer
from agentrl.exactness import Exactness, TrainerKernels
from agentrl.placement import colocated_bundles, engine_starter
from agentrl.recipe import load_run_config
from agentrl.rollout.lockstep import FreeRunningSchedule, LockstepSchedule

CPU_RUN = ["model_path=/m", "data.path=/d", "env.name=math"]


def test_each_switch_turns_on_its_parts() -> None:
    fast = Exactness.resolve(deterministic=False)
    assert fast == Exactness()
    assert (fast.batch_invariant_engine, fast.seeded_requests, fast.schedule) == (
        False,
        False,
        "free_running",
    )
    assert fast.trainer_kernels(on_gpu=True) == TrainerKernels(False, False)

    det = Exactness.resolve(deterministic=True)
    assert (det.batch_invariant_engine, det.deterministic_sglang, det.seeded_requests) == (True, True, True)
    assert det.schedule == "lockstep"
    assert det.trainer_kernels(on_gpu=False) == TrainerKernels(False, False)  # the CPU's sums are fixed
    assert det.trainer_kernels(on_gpu=True) == TrainerKernels(True, True)

    exact = Exactness.resolve(deterministic=False, true_on_policy=True)
    assert (exact.batch_invariant_engine, exact.deterministic_sglang, exact.seeded_requests) == (
        True,
        False,
        False,
    )
    assert exact.schedule == "free_running"
    assert exact.trainer_kernels(on_gpu=False) == TrainerKernels(True, False)


def test_the_schedule_follows_the_record() -> None:
    assert isinstance(Exactness().make_schedule(4, 1), FreeRunningSchedule)
    lockstep = Exactness.resolve(deterministic=True).make_schedule(4, 1)
    assert isinstance(lockstep, LockstepSchedule) and (lockstep.batch_size, lockstep.max_staleness) == (4, 1)


def test_free_running_puts_each_group_as_it_comes() -> None:
    async def run() -> list[str]:
        controller = StalenessController(max_staleness=0, batch_size=1)
        buffer = TrajectoryBuffer(controller)
        assert controller.try_start()
        assert await FreeRunningSchedule().deliver(Group("a", [], 0), buffer)
        return buffer.queued_uids()

    assert asyncio.run(run()) == ["a"]


def test_the_engines_flags_come_from_the_record() -> None:
    fast = engine_starter(load_run_config(None, CPU_RUN), "/m", 0)
    assert "--batch-invariant" not in fast.keywords["extra_args"]
    for switch in ("deterministic=true", "trainer.true_on_policy=true"):
        cfg = load_run_config(None, [*CPU_RUN, switch])
        assert cfg.exactness.batch_invariant_engine
        assert "--batch-invariant" in engine_starter(cfg, "/m", 0).keywords["extra_args"]


def test_each_engine_draws_unseeded_samples_of_its_own() -> None:
    """A group's samples spread over the engines by their load: engines with one seed would give the
    group's requests the same draws, and the samples would come out alike."""

    def seeds(cfg: Any) -> list[int]:
        extra = [engine_starter(cfg, "/m", i).keywords["extra_args"] for i in range(4)]
        return [int(args[args.index("--seed") + 1]) for args in extra]

    run = load_run_config(None, [*CPU_RUN, "engine.num_engines=4"])
    assert len(set(seeds(run))) == 4 and seeds(run) == seeds(run)  # its own, and a function of the run
    other = load_run_config(None, [*CPU_RUN, "engine.num_engines=4", "seed=1"])
    assert not set(seeds(run)) & set(seeds(other))


def test_colocated_on_gpus_has_one_owner() -> None:
    cpu = load_run_config(None, [*CPU_RUN, "placement=colocated", "weight_sync=tensor"])
    assert not cpu.colocated_on_gpus() and colocated_bundles(cpu) == 0
    gpu = load_run_config(
        None,
        [*CPU_RUN, "placement=colocated", "weight_sync=tensor", "engine.device=cuda", "trainer.device=cuda"],
    )
    assert gpu.colocated_on_gpus() and colocated_bundles(gpu) == gpu.trainer_world_size
