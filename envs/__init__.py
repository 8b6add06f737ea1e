"""Environments: the async Env contract, a registry, a checker, and the built-in envs."""

from .base import Env, Message, StepResult

__all__ = ["Env", "Message", "StepResult"]
