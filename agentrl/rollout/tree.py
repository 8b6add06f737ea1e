"""Tree rollouts: an episode that branches, so that its turns can be compared with their siblings.

With ``rollout.tree: {branch_at: [t1, t2, ...], k: K}`` each member of a group is a tree instead of one
episode. The root episode plays to model turn ``t1`` (and its observation); there it forks into ``K``
children: child 0 is the episode itself, the others get a fork of its env (:mod:`agentrl.envs.fork`) and
a copy of its trajectory, so every child's next request starts with the same token ids and the engine's
prefix cache serves them. Each child plays on to ``t2`` and forks again, and so on. Every leaf is an
ordinary :class:`~agentrl.types.Trajectory` (token-exact, loss masks as in a flat episode) that records its
place (:class:`~agentrl.types.TreePosition`: tree id, path of child indices, and the turn and response
offset of each branch point).

An episode that ends (completed or truncated) before its next branch point is a leaf there. With ``fill``
(the default) the tree keeps its ``B = k ** len(branch_at)`` leaves all the same: the root has a budget of
``B`` leaves; a node that reaches its branch point forks into ``n = min(k, b)`` children and splits its
budget ``b`` among them as evenly as possible (the first ``b % n`` get one more), and a node that ends
early is one leaf and, when its budget ``b > 1``, is sampled again from where it started with budget
``b - 1`` (and so on), as a sibling of the episode that ended early:

* the root's re-samples are fresh episodes of the task: the tree records a branch at model turn 0 (the
  early root becomes child 0, branch turn 0, offset 0; re-sample ``r`` is child ``r + 1``, which its
  request seeds in a deterministic run depend on);
* a child's re-samples are forks of a spare taken at its parent's branch point beside the children when
  one of them has a budget over one leaf (its env forked, its trajectory copied, no child index of its
  own; closed when the children are done): re-sample ``r``
  of child ``c`` is child ``c + k * (r + 1)`` there, a function of the tree's shape alone, whatever the
  timing. A spare or a re-sample whose fork fails is counted (``tree_fork_failures``) and the early leaf
  stands; a failed episode is never sampled again.

With ``k = 1``, or no ``branch_at``, the budget is one leaf: nothing is sampled again, and a tree samples as
a flat episode. Leaves come back in path order.

A group's leaves are its trajectories: admission, staleness and policy versions are those of groups
(:mod:`agentrl.buffer`); a tree counts ``k ** len(branch_at)`` episodes toward ``max_concurrency``, and the
budget keeps the episodes it generates at once within that (spares generate nothing). A child too stale to
finish restarts the whole tree, as a flat episode restarts; a child that fails is a failed leaf (the
group's ``failed_member_policy`` decides, and the tree is re-run on retry).

The trainer gives each turn the advantage of its subtree against its siblings (the per-turn term, from
the mean reward of the leaves below each child), on top of the tree's GRPO advantage against the other
trees of its task (:func:`agentrl.trainer.losses.compute_tree_advantages`).

Figures (counters, ``rollout/tree_*``): ``tree_trees``, ``tree_leaves``, ``tree_forks`` (env forks,
spares included), ``tree_fork_failures``, ``tree_refills`` (re-samples started),
``tree_generated_tokens`` (model tokens sampled, a shared one once),
``tree_leaf_model_tokens`` (model tokens of all leaves: what the trainer sees) and
``tree_shared_prefix_tokens`` (prompt and response tokens a child starts from instead of generating
them: a root's re-sample, the prompt); :func:`tree_stats` gives the same per trained batch (``tree/...``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from agentrl.engine.types import SamplingParams
from agentrl.envs.base import Env
from agentrl.envs.fork import EpisodeLog, fork_env
from agentrl.rollout.config import TreeConfig
from agentrl.rollout.dataset import Draw
from agentrl.rollout.episode import EpisodeRunner, LiveEpisode
from agentrl.rollout.metrics import RolloutMetrics
from agentrl.types import Status, Trajectory, TreePosition


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
        tree_id = f"{draw.uid}/{i}"
        root = self._fresh(draw, i, TreePosition(tree_id))

        async def again(r: int) -> LiveEpisode:  # re-sample r of the root: a fresh episode, child r + 1
            pos = root.traj.tree
            assert pos is not None
            if r == 0:  # the root ended before its first branch point: it becomes child 0 of turn 0
                assert not pos.path
                pos.path, pos.branch_turns, pos.branch_offsets = [0], [0], [0]
            m.count("tree_refills")
            m.count("tree_shared_prefix_tokens", len(root.traj.prompt_ids))
            return self._fresh(draw, i, TreePosition(tree_id, [r + 1], [0], [0]))

        leaves = await self._node(root, 0, self.tree.leaves, again, sampling, m, train)
        leaves.sort(key=lambda t: t.tree.path if t.tree is not None else [])
        m.count("tree_trees")
        m.count("tree_leaves", len(leaves))
        m.count("tree_leaf_model_tokens", sum(t.num_model_tokens for t in leaves))
        m.count("tree_generated_tokens", generated_tokens(leaves))
        return leaves

    def _fresh(self, draw: Draw, i: int, pos: TreePosition) -> LiveEpisode:
        """A new episode of sample ``i`` at ``pos``, not started yet (its env comes with ``advance``)."""
        ep = self.episodes.new_episode(draw, i)
        ep.traj.tree = pos
        ep.log = EpisodeLog(dict(draw.task), [])  # what forking a deterministic env by replay needs
        return ep

    async def _node(
        self,
        ep: LiveEpisode,
        level: int,
        budget: int,
        again: Callable[[int], Awaitable[LiveEpisode | None]] | None,
        sampling: SamplingParams,
        m: RolloutMetrics,
        train: bool,
    ) -> list[Trajectory]:
        """Grow ``ep`` with ``budget`` leaves (:meth:`_grow`); while it (or its latest re-sample) ends before
        its branch point with leaves left to spend and ``fill`` is on, grow re-sample ``r = 0, 1, ...``
        from ``again(r)`` (None: it could not be made) with one leaf fewer."""
        leaves: list[Trajectory] = []
        r = 0
        while True:
            below, early = await self._grow(ep, level, budget, sampling, m, train)
            leaves += below
            if not (early and budget > 1 and self.tree.fill and again is not None):
                return leaves
            nxt = await again(r)
            if nxt is None:
                return leaves
            ep, budget, r = nxt, budget - 1, r + 1

    async def _grow(
        self,
        ep: LiveEpisode,
        level: int,
        budget: int,
        sampling: SamplingParams,
        m: RolloutMetrics,
        train: bool,
    ) -> tuple[list[Trajectory], bool]:
        """Play ``ep`` to branch point ``level``, fork it there and grow the children, splitting ``budget``
        among them: the leaves below, and whether ``ep`` ended before the branch point (not failed)."""
        branch_at = self.tree.branch_at
        until = branch_at[level] if level < len(branch_at) else None
        if not await self.episodes.advance(ep, sampling, m, train, until):
            # a leaf: ended (or failed) before the next branch point, or after the last
            return [ep.traj], until is not None and ep.traj.status != Status.FAILED
        pos = ep.traj.tree
        assert pos is not None and until is not None
        n = min(self.tree.k, budget)
        budgets = [budget // n + (c < budget % n) for c in range(n)]
        pos.branch_turns.append(until)
        pos.branch_offsets.append(len(ep.traj.response_ids))
        children = [ep]
        spare: LiveEpisode | None = None
        try:
            for j in range(1, n):
                children.append(await self._fork(ep, j, m))
        except Exception as err:  # a fork failed: the episode ends there, a failed leaf
            for child in children[1:]:
                await self.episodes.close(child, m)
            del pos.branch_turns[-1], pos.branch_offsets[-1]
            m.count("tree_fork_failures")
            self.episodes.fail(ep, err, m)
            await self.episodes.close(ep, m)
            self.episodes.ended(ep, m)
            return [ep.traj], False
        except BaseException:
            await self._clean_up([], children, m)
            raise
        if self.tree.fill and max(budgets) > 1:  # a child may end early: keep this state to re-sample it
            try:
                spare = await self._fork(ep, None, m)
            except Exception:  # no spare: a child that ends early stays a leaf
                m.count("tree_fork_failures")
            except BaseException:
                await self._clean_up([], children, m)
                raise
        pos.path.append(0)
        forking = asyncio.Lock()  # one fork of the spare at a time, as the children's forks were made

        def resampler(c: int) -> Callable[[int], Awaitable[LiveEpisode | None]] | None:
            if spare is None:
                return None

            async def again(r: int) -> LiveEpisode | None:  # re-sample r of child c: child c + k (r + 1)
                assert spare is not None
                async with forking:
                    try:
                        child = await self._fork(spare, c + self.tree.k * (r + 1), m)
                    except Exception:  # the early leaf stands
                        m.count("tree_fork_failures")
                        return None
                m.count("tree_refills")
                return child

            return again

        tasks = [
            asyncio.ensure_future(self._node(child, level + 1, b, resampler(c), sampling, m, train))
            for c, (child, b) in enumerate(zip(children, budgets, strict=True))
        ]
        try:
            below = await asyncio.gather(*tasks)
        except BaseException:  # a Restart or a cancellation: stop every branch
            await self._clean_up(tasks, [*children, spare], m)
            raise
        await self._clean_up([], [spare], m)
        return [leaf for leaves in below for leaf in leaves], False

    async def _clean_up(
        self, tasks: list[asyncio.Future[list[Trajectory]]], eps: list[LiveEpisode | None], m: RolloutMetrics
    ) -> None:
        """Stop ``tasks`` (cancel those not being cancelled yet, wait for all) and close the envs of ``eps``
        (a branch cancelled before it started never ran to close its own), to the end even when cancelled
        meanwhile; such a cancellation is raised once it is done."""

        async def clean_up() -> None:
            for t in tasks:
                if not t.done() and not t.cancelling():
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for ep in eps:
                if ep is not None:
                    await self.episodes.close(ep, m)

        job = asyncio.ensure_future(clean_up())
        cancelled = False
        while not job.done():
            try:
                await asyncio.shield(job)
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError

    async def _fork(self, ep: LiveEpisode, j: int | None, m: RolloutMetrics) -> LiveEpisode:
        """Child ``j`` of ``ep`` at its branch point: a fork of its env, a copy of its trajectory. ``j`` None:
        the branch point's spare (its path not extended; it generates nothing, it is forked again)."""
        assert ep.env is not None and ep.traj.tree is not None
        ep.phase = "env"
        replay_log = ep.log.copy() if ep.log is not None else None
        env: Env = await self.episodes.env_call(
            fork_env(ep.env, replay_log or EpisodeLog({}, []), self.episodes.env_factory)
        )
        traj = Trajectory.from_dict(ep.traj.to_dict())
        assert traj.tree is not None
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
        if j is not None:
            traj.tree.path.append(j)
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
