"""The async rollout: orchestrator, staleness-gated admission, group sampling and filtering.

- :class:`Orchestrator` (``orchestrator.py``): admits groups of episodes under the staleness bound,
  judges them and feeds whole groups into the staleness-bounded buffer; pauses for weight updates.
- :class:`EpisodeRunner` (``episode.py``): one multi-turn episode against SGLang-protocol engines,
  token-in/token-out, scored by the env or a verifier.
- :class:`TreeRunner` (``tree.py``): tree rollouts (``rollout.tree``), episodes that branch into
  children sharing their tokens; every leaf a trajectory.
- :class:`RolloutConfig` (``config.py``): every knob, validated (:class:`TreeConfig`: ``rollout.tree``).
- :class:`DatasetCursor` (``dataset.py``): checkpointable task cursor; every draw has a uid.
- :class:`ChatTokenizer` (``tokenize.py``): the prompt render and observation deltas (never re-tokenize).
- :class:`RolloutMetrics` (``metrics.py``): counters and rates through ``agentrl.metrics``.
- :func:`make_rollout_actor` / :class:`RolloutWorker` (``ray_actor.py``): the same thing as a Ray actor.
- :class:`RolloutGroup` / :func:`shard_specs` (``shards.py``): ``rollout.shards`` orchestrators, each its
  own process with its own engines and tasks, as one.

The staleness invariant and its owner live in :mod:`agentrl.buffer`.
"""

from agentrl.buffer import DataExhausted, Group, StalenessController, TrajectoryBuffer
from agentrl.chat import ChatTemplateError, ChatTokenizer
from agentrl.rollout.config import RolloutConfig, TreeConfig
from agentrl.rollout.dataset import DatasetCursor, Draw
from agentrl.rollout.episode import EpisodeRunner
from agentrl.rollout.metrics import RolloutMetrics
from agentrl.rollout.orchestrator import Orchestrator
from agentrl.rollout.ray_actor import OrchestratorSpec, RolloutWorker, make_rollout_actor
from agentrl.rollout.shards import RolloutGroup, shard_specs
from agentrl.rollout.tree import TreeRunner

__all__ = [
    "ChatTemplateError",
    "ChatTokenizer",
    "DataExhausted",
    "DatasetCursor",
    "Draw",
    "EpisodeRunner",
    "Group",
    "Orchestrator",
    "OrchestratorSpec",
    "RolloutConfig",
    "RolloutGroup",
    "RolloutMetrics",
    "RolloutWorker",
    "StalenessController",
    "TrajectoryBuffer",
    "TreeConfig",
    "TreeRunner",
    "make_rollout_actor",
    "shard_specs",
]
