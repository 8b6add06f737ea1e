"""Test verifiers: rewards that need no trained model (stand-ins, not built-in verifiers)."""

from __future__ import annotations

from typing import Any

from agentrl.types import Trajectory


async def length_parity(trajectory: Trajectory, label: Any) -> float:
    """1.0 when the model wrote an odd number of tokens: a reward with variance within a group for any
    model that samples, so a few GRPO steps change the weights (``rollout.verifier:
    agentrl.testing.verifiers:length_parity``)."""
    return float(len(trajectory.response_ids) % 2)
