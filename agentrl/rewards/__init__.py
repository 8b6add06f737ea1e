"""Reward verifiers, registered by name. See :mod:`agentrl.rewards.base` for the contract."""

from agentrl.rewards.base import (
    RewardResult,
    Verifier,
    VerifierConfigError,
    VerifierError,
    get_verifier,
    list_verifiers,
    register_verifier,
    resolve_verifier,
    run_verifier,
)

__all__ = [
    "RewardResult",
    "Verifier",
    "VerifierConfigError",
    "VerifierError",
    "get_verifier",
    "list_verifiers",
    "register_verifier",
    "resolve_verifier",
    "run_verifier",
]
