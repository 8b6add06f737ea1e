"""agentrl: asynchronous agentic RL.

An async rollout orchestrator drives multi-turn tool-use episodes against SGLang-protocol engines,
streams token-exact trajectories into a staleness-bounded buffer, and an off-policy Megatron trainer
consumes them with truncated importance sampling, then pushes new weights back to the engines.

The user-facing folders ``envs/``, ``tools/``, ``sandboxes/`` and ``examples/`` install as
``agentrl.envs``, ``agentrl.tools``, ``agentrl.sandboxes`` and ``agentrl.examples``.
"""

from agentrl.types import Status, ToolCallRecord, Trajectory, Turn

__all__ = ["Status", "ToolCallRecord", "Trajectory", "Turn"]
__version__ = "0.1.0"
