"""Environments: the async Env contract, a registry, a checker, and the built-in envs.

Built-ins (registered names): ``search`` (:class:`SearchEnv`, Search-R1), ``tool`` (:class:`ToolEnv`),
``python`` (:class:`PythonToolEnv`), ``math`` (:class:`MathEnv`). Agents written on the openai SDK
become envs through :class:`AgentEnv` (``agent.py``).
"""

from .agent import AgentEnv, is_agent
from .base import Env, Message, StepResult
from .checker import EnvCheckError, check_env
from .math import MathEnv
from .registry import get_env_factory, list_envs, make_env, register_env
from .search import SearchEnv
from .tool_env import PythonToolEnv, ToolEnv

__all__ = [
    "AgentEnv",
    "Env",
    "EnvCheckError",
    "MathEnv",
    "Message",
    "PythonToolEnv",
    "SearchEnv",
    "StepResult",
    "ToolEnv",
    "check_env",
    "get_env_factory",
    "is_agent",
    "list_envs",
    "make_env",
    "register_env",
]
