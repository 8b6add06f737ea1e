"""Reward verifiers, registered by name. See :mod:`agentrl.rewards.base` for the contract."""

from agentrl.rewards.base import (
    RewardResult,
    Verifier,
    VerifierError,
    get_verifier,
    list_verifiers,
    register_verifier,
    run_verifier,
)

__all__ = [
    "RewardResult",
    "Verifier",
    "VerifierError",
    "get_verifier",
    "list_verifiers",
    "register_verifier",
    "run_verifier",
]
