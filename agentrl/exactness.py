"""Exactness: which kernels and which rollout schedule a run uses, decided once from its two switches.

A run has two promises of exactness, each a config field users set:

* ``deterministic`` (top level): two runs with one seed give bit-identical weights and metrics on one
  machine. It needs requests seeded by (run seed, draw, sample, turn), batches and versions fixed by the
  step (the lockstep schedule, :mod:`agentrl.rollout.lockstep`), engines whose bits do not depend on the
  batch (the embedded engine's batch-invariant kernels, SGLang's deterministic inference) and, on a GPU, a
  trainer whose sums come out the same every run.
* ``trainer.true_on_policy``: the engine's logprobs equal the trainer's bit for bit (μ = π_old). It needs
  the trainer's forward for π_old and the loss to run the engine's batch-invariant kernels, on every
  device, and the engines to serve with them.

:class:`Exactness` is the record of what those switches turn on, resolved by :meth:`Exactness.resolve`
(``RunConfig.exactness`` for a run). The placement reads the engines' kernels from it, the trainer its
own (:meth:`Exactness.trainer_kernels`, which depend on the device a rank runs on) and the orchestrator
whether requests are seeded and which schedule it runs (:meth:`Exactness.make_schedule`). Nobody
re-derives them from the switches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from agentrl.rollout.lockstep import RolloutSchedule


@dataclass(frozen=True)
class TrainerKernels:
    """The kernels of one trainer rank, on its device."""

    exact_logprobs: bool
    """π_old and the loss's logprobs come from the engine's batch-invariant forward
    (:class:`~agentrl.trainer.true_on_policy.TrueOnPolicyLogprobs`)."""
    deterministic_backward: bool
    """The attention backward runs torch's math kernel (the flash backward accumulates dq in a varying
    order) and cuBLAS keeps one workspace layout per stream: the same sums every run."""


@dataclass(frozen=True)
class Exactness:
    """What a run's exactness switches turn on (see the module docstring). The default is the fast path:
    ordinary kernels, unseeded requests, the free-running schedule."""

    batch_invariant_engine: bool = False
    """Embedded engines run the batch-invariant kernels (``--batch-invariant``): a request's bits depend
    neither on what else the engine batches nor, for true on-policy, on who computes them."""
    deterministic_sglang: bool = False
    """SGLang engines start with their deterministic inference."""
    exact_trainer: bool = False
    """The trainer's π_old and loss logprobs come from the engine's batch-invariant forward on every
    device (true on-policy)."""
    deterministic_trainer: bool = False
    """The trainer gives the same sums every run: on a GPU that takes the exact forward and the
    deterministic backward; on the CPU the ordinary kernels already do."""
    seeded_requests: bool = False
    """Every ``/generate`` carries a seed derived from (run seed, draw, sample, turn)."""
    schedule: Literal["free_running", "lockstep"] = "free_running"
    """The rollout's schedule: free running, or lockstep (batches and versions by the step)."""

    @classmethod
    def resolve(cls, deterministic: bool, true_on_policy: bool = False) -> Exactness:
        """The exactness of a run with these switches (``deterministic``, ``trainer.true_on_policy``)."""
        return cls(
            batch_invariant_engine=deterministic or true_on_policy,
            deterministic_sglang=deterministic,
            exact_trainer=true_on_policy,
            deterministic_trainer=deterministic,
            seeded_requests=deterministic,
            schedule="lockstep" if deterministic else "free_running",
        )

    def trainer_kernels(self, on_gpu: bool) -> TrainerKernels:
        """The kernels of a trainer rank on a GPU (``on_gpu``) or on the CPU."""
        gpu_deterministic = self.deterministic_trainer and on_gpu
        return TrainerKernels(
            exact_logprobs=self.exact_trainer or gpu_deterministic,
            deterministic_backward=gpu_deterministic,
        )

    def make_schedule(self, batch_size: int, max_staleness: int) -> RolloutSchedule:
        """A fresh schedule of the rollout (:mod:`agentrl.rollout.lockstep`) for batches of
        ``batch_size`` groups within staleness ``max_staleness``."""
        from agentrl.rollout.lockstep import FreeRunningSchedule, LockstepSchedule

        if self.schedule == "lockstep":
            return LockstepSchedule(batch_size, max_staleness)
        return FreeRunningSchedule()
