"""Tree rollouts: an episode that branches, so that its turns can be compared with their siblings.

With ``rollout.tree: {branch_at: [t1, t2, ...], k: K}`` each member of a group is a tree instead of one
episode. The root episode plays to model turn ``t1`` (and its observation); there it forks into ``K``
children: child 0 is the episode itself, the others get a fork of its env (:mod:`agentrl.envs.fork`) and
a copy of its trajectory, so every child's next request starts with the same token ids and the engine's
prefix cache serves them. Each child plays on to ``t2`` and forks again, and so on; an episode that ends
before a branch point is a leaf there. Every leaf is an ordinary :class:`~agentrl.types.Trajectory`
(token-exact, loss masks as in a flat episode) that records its place (:class:`~agentrl.types.TreePosition`:
tree id, path of child indices, and the turn and response offset of each branch point).

A group's leaves are its trajectories: admission, staleness and policy versions are those of groups
(:mod:`agentrl.buffer`); a tree counts ``k ** len(branch_at)`` episodes toward ``max_concurrency``. A
child too stale to finish restarts the whole tree, as a flat episode restarts; a child that fails is a
failed leaf (the group's ``failed_member_policy`` decides, and the tree is re-run on retry).

The trainer gives each turn the advantage of its subtree against its siblings (the per-turn term, from
the mean reward of the leaves below each child), on top of the tree's GRPO advantage against the other
trees of its task (:func:`agentrl.trainer.losses.compute_tree_advantages`).

Figures (counters, ``rollout/tree_*``): ``tree_trees``, ``tree_leaves``, ``tree_forks``,
``tree_fork_failures``, ``tree_generated_tokens`` (model tokens sampled, a shared one once),
``tree_leaf_model_tokens`` (model tokens of all leaves: what the trainer sees) and
``tree_shared_prefix_tokens`` (prompt and response tokens a child starts from instead of generating
them); :func:`tree_stats` gives the same per trained batch (``tree/...``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from agentrl.engine.types import SamplingParams
from agentrl.envs.base import Env
from agentrl.envs.fork import EpisodeLog, fork_env
from agentrl.rollout.config import TreeConfig
from agentrl.rollout.dataset import Draw
from agentrl.rollout.episode import EpisodeRunner, LiveEpisode
from agentrl.rollout.metrics import RolloutMetrics
from agentrl.types import Trajectory, TreePosition


class TreeRunner:
    """Grows trees of episodes with ``episodes`` (see the module docstring)."""

    def __init__(self, episodes: EpisodeRunner, tree: TreeConfig) -> None:
        self.episodes = episodes
        self.tree = tree

    async def run(
        self, draw: Draw, i: int, sampling: SamplingParams, m: RolloutMetrics, train: bool
    ) -> list[Trajectory]:
        """Tree ``i`` of ``draw``'s task: its leaves, in path order. Raises as
        :meth:`EpisodeRunner.run` does (a :class:`~agentrl.rollout.episode.Restart` restarts the tree)."""
        root = self.episodes.new_episode(draw, i)
        root.traj.tree = TreePosition(f"{draw.uid}/{i}")
        root.log = EpisodeLog(dict(draw.task), [])  # what forking a deterministic env by replay needs
        leaves = await self._grow(root, 0, sampling, m, train)
        m.count("tree_trees")
        m.count("tree_leaves", len(leaves))
        m.count("tree_leaf_model_tokens", sum(t.num_model_tokens for t in leaves))
        m.count("tree_generated_tokens", generated_tokens(leaves))
        return leaves

    async def _grow(
        self, ep: LiveEpisode, depth: int, sampling: SamplingParams, m: RolloutMetrics, train: bool
    ) -> list[Trajectory]:
        """Play ``ep`` to its next branch point, fork it there and grow the children: the leaves below."""
        branch_at = self.tree.branch_at
        until = branch_at[depth] if depth < len(branch_at) else None
        if not await self.episodes.advance(ep, sampling, m, train, until):
            return [ep.traj]  # a leaf: ended (or failed) before the next branch point, or after the last
        pos = ep.traj.tree
        assert pos is not None and until is not None
        pos.branch_turns.append(until)
        pos.branch_offsets.append(len(ep.traj.response_ids))
        children = [ep]
        try:
            for j in range(1, self.tree.k):
                children.append(await self._fork(ep, j, m))
        except Exception as err:  # a fork failed: the episode ends there, a failed leaf
            for child in children[1:]:
                await self.episodes.close(child, m)
            del pos.branch_turns[-1], pos.branch_offsets[-1]
            m.count("tree_fork_failures")
            self.episodes.fail(ep, err, m)
            await self.episodes.close(ep, m)
            self.episodes.ended(ep, m)
            return [ep.traj]
        except BaseException:
            for child in children:
                await self.episodes.close(child, m)
            raise
        pos.path.append(0)
        tasks = [asyncio.ensure_future(self._grow(c, depth + 1, sampling, m, train)) for c in children]
        try:
            below = await asyncio.gather(*tasks)
        except BaseException:  # a Restart or a cancellation: stop every branch (each closes its env)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return [leaf for leaves in below for leaf in leaves]

    async def _fork(self, ep: LiveEpisode, j: int, m: RolloutMetrics) -> LiveEpisode:
        """Child ``j`` of ``ep`` at its branch point: a fork of its env, a copy of its trajectory."""
        assert ep.env is not None and ep.traj.tree is not None
        ep.phase = "env"
        replay_log = ep.log.copy() if ep.log is not None else None
        env: Env = await self.episodes.env_call(
            fork_env(ep.env, replay_log or EpisodeLog({}, []), self.episodes.env_factory)
        )
        traj = Trajectory.from_dict(ep.traj.to_dict())
        assert traj.tree is not None
        traj.tree.path.append(j)
        child = LiveEpisode(
            ep.draw,
            traj,
            env=env,
            stop=list(ep.stop),
            status=ep.status,
            tool_time=ep.tool_time,
            log=replay_log,
            t0=ep.t0,
        )
        m.count("tree_forks")
        m.count("tree_shared_prefix_tokens", len(traj.prompt_ids) + len(traj.response_ids))
        return child


def generated_tokens(leaves: Sequence[Trajectory]) -> int:
    """Model tokens sampled to grow ``leaves``: each node's own segment once, however many leaves share it."""
    seen: set[tuple[str, tuple[int, ...]]] = set()
    total = 0
    for t in leaves:
        pos = t.tree
        if pos is None:
            total += t.num_model_tokens
            continue
        bounds = [0, *pos.branch_offsets, len(t.response_ids)]
        for d in range(len(bounds) - 1):
            key = (pos.tree_id, tuple(pos.path[:d]))
            if key in seen:
                continue
            seen.add(key)
            total += sum(t.loss_mask[bounds[d] : bounds[d + 1]])
    return total


def tree_stats(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Tree figures of one batch (``tree/...``): leaves per task and per tree, model tokens generated and
    trained, shared-prefix tokens; empty for a batch of flat episodes."""
    rows = [t for t in trajs if t.tree is not None]
    if not rows:
        return {}
    trees = {t.tree.tree_id for t in rows if t.tree is not None}
    tasks = {t.group_id for t in rows}
    return {
        "tree/leaves_per_task": len(rows) / len(tasks),
        "tree/leaves_per_tree": len(rows) / len(trees),
        "tree/generated_tokens": float(generated_tokens(rows)),
        "tree/leaf_model_tokens": float(sum(t.num_model_tokens for t in rows)),
        "tree/shared_prefix_tokens": float(shared_prefix_tokens(rows)),
    }


def shared_prefix_tokens(leaves: Sequence[Trajectory]) -> int:
    """Tokens the branches of ``leaves`` started from instead of generating them: at each branch point,
    prompt + response so far, once for every child but the first (what the engine's prefix cache can
    serve)."""
    children: dict[tuple[str, tuple[int, ...]], set[int]] = {}
    length: dict[tuple[str, tuple[int, ...]], int] = {}
    for t in leaves:
        pos = t.tree
        if pos is None:
            continue
        for d, offset in enumerate(pos.branch_offsets):
            key = (pos.tree_id, tuple(pos.path[:d]))
            children.setdefault(key, set()).add(pos.path[d])
            length[key] = len(t.prompt_ids) + offset
    return sum((len(c) - 1) * length[key] for key, c in children.items())
