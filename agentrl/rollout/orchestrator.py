"""The async rollout orchestrator: many multi-turn episodes at once, token-exact, staleness-bounded.

One :class:`Orchestrator` draws tasks from a :class:`DatasetCursor`, starts a *group* of
``group_size`` episodes per task whenever the staleness controller admits it (``accepted + running <
(η + v + 1)·B`` and the concurrency cap; see :mod:`agentrl.buffer`, the one owner of that invariant),
runs every episode against the engine(s) through :class:`EngineClient`, scores it, filters the group
and puts it into the :class:`TrajectoryBuffer` the trainer reads from.

An episode, turn by turn, token-in/token-out, is :class:`~agentrl.rollout.episode.EpisodeRunner`'s
(``episode.py``); an agent episode (an ``async def agent(task, client)`` on the openai SDK, run through a
recording proxy) is :class:`~agentrl.rollout.agent.AgentRunner`'s (``agent.py``) and may give several
rows (trajectories) of one episode. This module decides which episodes run and when, and what becomes of
their groups.
The reward is the env's, else ``rollout.verifier``'s or, when that is unset, the env's own ``verifier``,
resolved once at start-up (:meth:`Orchestrator.check_verifier`; with neither, start-up fails).

Weight updates (the trainer's loop)::

    await orch.pause_for_update()          # engines pause (abort mode); in-flight requests come back
    await engine.update_weights_from_disk(path, weight_version=str(v + 1))
    await orch.resume_after_update(v + 1)  # engines continue; interrupted episodes resubmit their
                                           # tokens and go on under v + 1 (mixed versions), or restart

Failure isolation: an env, tool, verifier or engine error ends only that episode (status FAILED with
the error), which is re-run with a fresh env up to ``max_retries`` times (``rollout/retries``);
``/generate`` itself is re-sent up to ``engine_retries`` times across engine restarts. When an
episode's retries run out, ``failed_member_policy`` decides: ``drop_group`` drops its whole group with
the reason ``failed:<kind>`` (``env``, ``engine``, ``verifier``, ... from the error; counted in
``rollout/dropped_groups/failed:<kind>`` and logged with the error text), ``drop_member`` trains the
rest (down to ``min_group_size``). Nothing is skipped silently: every drawn task is accounted for
exactly once as trained, dropped (by reason) or in flight (running, buffered, or pending re-draw):
:meth:`Orchestrator.accounting`; with ``record_outcomes`` each draw's outcome and every failed attempt's
error text are kept too (``outcomes``, ``failed_attempts``). A run that cannot progress (every group
dropped, every episode or tool call failing) stops admitting and ``get_batch`` raises
:class:`~agentrl.buffer.NoProgressError` naming the cause (:mod:`agentrl.rollout.progress`).

Checkpointing: :meth:`state_dict` holds the dataset cursor, every task in flight (re-drawn first on
resume, with the same uid, in the order their groups would have reached the trainer) and the counters;
:meth:`load_state_dict(state, version)` restores them and
resets the staleness controller to the trainer's version (AReaL #1388).

Public API (what ``train_async.py`` uses)::

    orch = Orchestrator(RolloutConfig(...), EngineClient(urls), AutoTokenizer.from_pretrained(d),
                        env_factory=lambda: MyEnv(), dataset=tasks)        # buffer made from config
    await orch.start()
    batch = await orch.buffer.get_batch()         # batch_size whole groups (NoProgressError: none can come)
    await orch.pause_for_update(); ...; await orch.resume_after_update(version)
    metrics = orch.stats(); orch.log_metrics(step)   # also through the MetricsSink given as metrics=
    state = orch.state_dict(); orch.load_state_dict(state, version)   # before start()
    evals = await orch.evaluate(tasks)            # greedy, one sample per task, no staleness gating
    await orch.stop()
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from agentrl.buffer import Group, NoProgressError, StalenessController, TrajectoryBuffer
from agentrl.chat import ChatTokenizer
from agentrl.engine.client import EngineClient
from agentrl.engine.types import SamplingParams
from agentrl.envs.agent import AgentEnv
from agentrl.envs.base import Env
from agentrl.envs.fork import check_forkable
from agentrl.exactness import Exactness
from agentrl.metrics import MetricsSink
from agentrl.rewards.base import resolve_verifier
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.dataset import DatasetCursor, Draw
from agentrl.rollout.episode import EpisodeRunner, Restart
from agentrl.rollout.heap import freeze_setup_heap
from agentrl.rollout.ledger import DrawLedger, GroupRun
from agentrl.rollout.lockstep import LockstepSchedule, RolloutSchedule
from agentrl.rollout.loop_monitor import LoopMonitor
from agentrl.rollout.metrics import RolloutMetrics
from agentrl.rollout.progress import ProgressWatch, failure_kind
from agentrl.rollout.tree import TreeRunner
from agentrl.sandboxes.shared import close_shared_sandboxes
from agentrl.types import Status, Trajectory

if TYPE_CHECKING:
    from agentrl.rollout.agent import AgentRunner

log = logging.getLogger(__name__)
FAILED_EPISODES_KEPT = 256  # a shard keeps at most this many failed episodes between two takes


class Orchestrator:
    """See the module docstring.

    ``deterministic``: the run's switch, read through :class:`~agentrl.exactness.Exactness`: seeded
    requests and the lockstep schedule. ``schedule``: the schedule to run instead of the one it picks
    (:mod:`agentrl.rollout.lockstep`; free running by default).
    """

    def __init__(
        self,
        config: RolloutConfig,
        engine_client: EngineClient,
        tokenizer: Any,
        env_factory: Callable[[], Env],
        dataset: DatasetCursor | Sequence[dict[str, Any]] | Iterable[dict[str, Any]],
        buffer: TrajectoryBuffer | None = None,
        metrics: MetricsSink | None = None,
        deterministic: bool = False,
        schedule: RolloutSchedule | None = None,
    ) -> None:
        exactness = Exactness.resolve(deterministic)
        self.cfg = config
        self.engine = engine_client
        self.chat = tokenizer if isinstance(tokenizer, ChatTokenizer) else ChatTokenizer(tokenizer)
        self.env_factory = env_factory
        self.cursor = (
            dataset
            if isinstance(dataset, DatasetCursor)
            else DatasetCursor(
                dataset,
                shuffle=config.shuffle and isinstance(dataset, Sequence),
                seed=config.seed,
                epochs=config.epochs,
            )
        )
        if buffer is None:
            buffer = TrajectoryBuffer(
                StalenessController(config.max_staleness, config.batch_size, config.extra_running_groups)
            )
        c = buffer.controller
        if (c.max_staleness, c.batch_size) != (config.max_staleness, config.batch_size):
            raise ValueError(
                f"buffer's staleness controller (max_staleness={c.max_staleness}, batch_size={c.batch_size}) "
                f"disagrees with the rollout config ({config.max_staleness}, {config.batch_size})"
            )
        self.buffer = buffer
        self.controller = c
        self.sink = metrics
        self.m = RolloutMetrics()
        self.eval_m = RolloutMetrics()
        self.loop_monitor = LoopMonitor()  # how loaded this event loop is (rollout/loop_*), from start()
        buffer.on_taken.append(self._on_taken)
        buffer.on_refused.append(self._on_refused)

        # where every drawn task is: running, buffered, pending re-draw (agentrl.rollout.ledger)
        self.ledger = DrawLedger(self.cursor, config.record_outcomes)
        self._episode_slots = 0  # episodes reserved by running groups (concurrency cap)
        # which batch a draw joins, when it starts and reaches the buffer (agentrl.rollout.lockstep)
        self.schedule = (
            schedule if schedule is not None else exactness.make_schedule(c.batch_size, c.max_staleness)
        )
        self._engine_open = asyncio.Event()  # cleared while a weight update pauses the engines
        self._engine_open.set()
        self.episodes = EpisodeRunner(
            config,
            engine_client,
            self.chat,
            env_factory,
            self.controller,
            self._engine_open,
            exactness.seeded_requests,
        )
        self.agents: AgentRunner | None = None  # set by check_verifier when the env is an agent
        # rollout.tree: each group member grows into a tree of episodes (agentrl.rollout.tree)
        self.trees = TreeRunner(self.episodes, config.tree) if config.tree is not None else None
        self._paused = False
        self._stopping = False
        self._loop_task: asyncio.Task[None] | None = None
        # (uid, sample index, attempt, error text) of every failed attempt, when config.record_outcomes
        self.failed_attempts: list[tuple[str, int, int, str]] = []
        # the failed training episodes since the driver last took them (episode dumps show them, marked)
        self.failed_episodes: deque[Trajectory] = deque(maxlen=FAILED_EPISODES_KEPT)
        self._verifier_checked = False
        # a run that can never form a batch stops with the reason (agentrl.rollout.progress)
        self.watch = ProgressWatch.defaults(
            config.batch_size,
            config.group_size,
            self.cursor.size,
            config.no_progress_groups,
            config.no_progress_failures,
        )
        self.no_progress: NoProgressError | None = None

    # ================================================================ lifecycle
    @property
    def version(self) -> int:
        return self.controller.version

    @property
    def drawn(self) -> int:
        return self.ledger.drawn

    @property
    def trained(self) -> int:
        return self.ledger.trained

    @property
    def outcomes(self) -> list[tuple[str, str]]:
        """(uid, ``"trained"`` or ``"dropped:<reason>"``) of every draw, when ``record_outcomes``."""
        return self.ledger.outcomes

    @property
    def lockstep(self) -> LockstepSchedule | None:
        """The schedule when it is the lockstep one (deterministic mode), else None."""
        return self.schedule if isinstance(self.schedule, LockstepSchedule) else None

    async def check_verifier(self) -> str | None:
        """The verifier that scores episodes the env gives no reward, resolved once and handed to the
        episodes: ``rollout.verifier`` (in a run, the name ``train_async.py`` resolved at load), else the
        env's ``verifier`` (read from one env built and closed here). Raises
        :class:`~agentrl.rewards.base.VerifierConfigError` when there is none, so a run fails at start-up
        instead of failing every episode; None for an env that ``scores_itself``. ``start`` and ``evaluate``
        call it."""
        env = self.env_factory()
        if isinstance(env, AgentEnv) and self.agents is None:
            from agentrl.rollout.agent import AgentRunner  # imports openai_api, which imports this package

            self.agents = AgentRunner(self.episodes)
        try:
            if self.cfg.tree is not None:  # tree rollouts fork the env: refuse one that cannot branch
                check_forkable(type(env), type(env).__name__)
            name = resolve_verifier(
                self.cfg.verifier, env.verifier, f"env {type(env).__name__}", env.scores_itself
            )
        finally:
            await env.close()
        self.episodes.verifier = name  # what scores the episodes from now on
        self._verifier_checked = True
        return name

    async def start(self) -> None:
        """Start admitting groups (returns at once; work runs in the background on this loop)."""
        if self._loop_task is not None:
            raise RuntimeError("orchestrator already started")
        if not self._verifier_checked:
            await self.check_verifier()
        self._stopping = False
        freeze_setup_heap()  # full collections skip the setup's objects (agentrl.rollout.heap)
        self.buffer.mark_producing()
        self.loop_monitor.start()
        self._loop_task = asyncio.create_task(self._admission_loop(), name="rollout-admission")

    async def stop(self) -> None:
        """Cancel running groups (they stay in flight: re-drawn on resume), stop admitting, and close the
        sandboxes the episodes shared."""
        self._stopping = True
        self.controller.notify()
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        tasks = [g.task for g in self.ledger.running.values() if g.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._engine_open.set()  # nobody waits forever on a pause that will never be lifted
        if self.agents is not None:
            await self.agents.close()
        await close_shared_sandboxes()  # the run's warm sandbox pools (a later start makes new ones)
        self.loop_monitor.stop()
        await self.buffer.set_exhausted(True)

    # ================================================================ admission
    async def _admission_loop(self) -> None:
        ctl, n, ledger = self.controller, self.cfg.group_episodes, self.ledger
        while not self._stopping:
            ctl.changed.clear()  # cleared before checking: no wake-up is lost (single event loop)
            blocked = (
                self._paused
                or self.no_progress is not None
                or self._episode_slots + n > self.cfg.max_concurrency
                or ctl.capacity() <= 0
                or not self.schedule.may_start(ctl.version)
            )
            draw = None if blocked else ledger.next_draw()
            if draw is None:
                if not blocked and not ledger.running and not ledger.has_work():
                    await self.buffer.set_exhausted(True)  # nothing left: get_batch must not hang
                await ctl.changed.wait()
                continue
            if not ctl.try_start():  # cannot happen after capacity() > 0; keep the draw
                ledger.pending.appendleft(draw)
                continue
            self._episode_slots += n
            self.schedule.start(draw.uid)
            g = GroupRun(draw, ctl.version)
            ledger.running[draw.uid] = g
            g.task = asyncio.create_task(self._run_group(g), name=f"group-{draw.uid}")

    # ================================================================ groups
    async def _run_group(self, g: GroupRun) -> None:
        uid, ledger = g.draw.uid, self.ledger
        try:
            members = await asyncio.gather(*(self._run_member(g, i) for i in range(self.cfg.group_size)))
            trajs = [t for rows in members for t in rows]
            kept, reason = self._judge(trajs)
            if kept is None:
                await self._drop(g.draw, reason, trajs)
                return
            self.watch.kept()
            ledger.buffered[uid] = g.draw
            if await self.schedule.deliver(Group(uid, kept, g.start_version), self.buffer):
                return  # accepted (the buffer told the controller), or held for its batch
            # Rule 2 of agentrl.buffer: it would be trained too stale (a straggler, or an over-sampled
            # surplus). Hand the task back to be re-run from scratch once admission allows.
            del ledger.buffered[uid]
            g.draw.stale_requeues += 1
            self.m.count("stale_group_requeues")
            if g.draw.stale_requeues > self.cfg.max_stale_restarts:
                await self._drop(g.draw, "stale")
                return
            ledger.pending.appendleft(g.draw)
            self.controller.finish(accepted=False)
        except asyncio.CancelledError:
            if self._stopping:  # stays in flight: re-drawn on resume
                ledger.buffered.pop(uid, None)
                ledger.pending.append(g.draw)
                self.controller.finish(accepted=False)
            raise
        except Exception as err:  # a bug in this file or a user callback; never kill the loop
            log.exception("group %s crashed", uid)
            self.m.failure("internal")
            await self._drop(g.draw, f"internal:{type(err).__name__}")
        finally:
            ledger.running.pop(uid, None)
            self._episode_slots -= self.cfg.group_episodes
            self.controller.notify()

    def _judge(self, trajs: list[Trajectory]) -> tuple[list[Trajectory] | None, str]:
        """Failure policy, then dynamic filtering. Returns (kept, "") or (None, drop reason)."""
        failed = [t for t in trajs if t.status == Status.FAILED]
        kept = trajs
        self.failed_episodes.extend(failed)
        if failed:
            reason = f"failed:{failure_kind(failed[0])}"
            if self.cfg.failed_member_policy == "drop_group":
                return None, reason
            kept = [t for t in trajs if t.status != Status.FAILED]
            self.m.count("failed_members_removed", len(failed))
            if len(kept) < self.cfg.min_group_size:
                return None, reason
        aborted = [t for t in kept if t.status == Status.ABORTED]
        if aborted:
            return None, "aborted"
        if self.cfg.filter_zero_variance and self.cfg.group_episodes > 1:
            rewards = {t.reward for t in kept}
            if len(rewards) <= 1:
                return None, "zero_variance"
        return kept, ""

    def take_failed(self) -> list[Trajectory]:
        """The failed training episodes since the last call (at most the latest
        ``FAILED_EPISODES_KEPT``), oldest first; the driver writes them to the episode dumps, marked."""
        out = list(self.failed_episodes)
        self.failed_episodes.clear()
        return out

    async def _drop(self, draw: Draw, reason: str, trajs: Sequence[Trajectory] = ()) -> None:
        self.schedule.dropped(draw.uid)  # lockstep: the batch takes the next draw in its place
        self.m.drop(reason)
        self.controller.finish(accepted=False)  # frees its capacity: dropping never deadlocks
        self.ledger.dropped(draw.uid, reason)
        n = self.m.dropped[reason]
        if reason.startswith(("failed", "internal")) and n & (n - 1) == 0:  # the 1st, 2nd, 4th, ...: bounded
            errors = sorted({t.error for t in trajs if t.status == Status.FAILED and t.error})
            log.warning(
                "group %s dropped (%s, %d so far): %s", draw.uid, reason, n, "; ".join(errors) or reason
            )
        await self._no_progress(self.watch.dropped_group(reason, list(trajs)))

    async def _no_progress(self, error: NoProgressError | None) -> None:
        """The watch found that the run cannot progress: stop admitting, and let ``get_batch`` raise it."""
        if error is None or self.no_progress is not None:
            return
        self.no_progress = error
        log.error("%s", error)
        await self.buffer.fail(error)
        self.controller.notify()

    def _on_taken(self, groups: list[Group]) -> None:
        for grp in groups:
            if not self.ledger.taken(grp.uid):  # a duplicate; loud, it must never happen
                log.error("group %s handed to the trainer twice", grp.uid)
                self.m.count("duplicate_groups")

    def _on_refused(self, grp: Group) -> None:
        # Rule 3 fired (should not happen): re-run the task; it is still in flight.
        draw = self.ledger.buffered.pop(grp.uid, None) or Draw(grp.uid, {})
        self.ledger.pending.appendleft(draw)
        self.m.count("refused_stale_requeued")
        self.buffer.mark_producing()
        self.controller.notify()

    # ================================================================ episodes
    async def _episode(
        self, draw: Draw, i: int, sampling: SamplingParams, m: RolloutMetrics, train: bool
    ) -> list[Trajectory]:
        """One episode's rows: one for an Env episode, one or more for an agent's, a tree's leaves in a
        tree rollout (training only: evaluation runs flat episodes)."""
        if self.trees is not None and train:
            return await self.trees.run(draw, i, sampling, m, train)
        if self.agents is not None:
            return await self.agents.run(draw, i, sampling, m, train)
        return [await self.episodes.run(draw, i, sampling, m, train)]

    async def _run_member(self, g: GroupRun, i: int) -> list[Trajectory]:
        """Sample ``i`` of the group: its episode, re-run (fresh env) while it fails and retries are left."""
        attempt = stale = 0
        while True:
            gave_up = False
            try:
                rows = await self._episode(g.draw, i, self.cfg.sampling, self.m, train=True)
            except Restart as why:
                if not (why.args and why.args[0] == "too stale"):
                    continue
                stale += 1
                if stale <= self.cfg.max_stale_restarts:
                    continue
                # e.g. an engine that still reports old weights after an update; not retried
                self.m.failure("stale")
                rows = [
                    Trajectory(
                        task_id=g.draw.task_id,
                        group_id=g.draw.uid,
                        prompt_ids=[],
                        sample_index=i,
                        label=g.draw.task.get("label"),
                        status=Status.FAILED,
                        error=f"stale: restarted {stale - 1} times and still more than "
                        f"{self.controller.max_staleness} versions behind version {self.controller.version} "
                        "(does the engine report the updated weight_version?)",
                    )
                ]
                gave_up = True
            failed = [t for t in rows if t.status == Status.FAILED]
            if self.cfg.record_outcomes:
                self.failed_attempts += [(g.draw.uid, i, attempt, t.error or "") for t in failed]
            if not failed or gave_up or attempt >= self.cfg.max_retries:
                for t in rows:
                    t.info["attempts"] = attempt + 1
                    await self._no_progress(self.watch.episode(t))
                return rows
            attempt += 1
            self.m.count("retries")

    # ================================================================ weight updates
    async def pause_for_update(self) -> None:
        """Stop admitting, pause the engines (abort mode) and wait for in-flight requests to come back.
        The lockstep schedule first waits, without interrupting anything, until every batch generated
        under the live version is complete (the free-running one goes ahead at once)."""
        await self.controller.wait_until(
            lambda: (
                self._stopping
                or self.schedule.caught_up(self.version)
                or (not self.ledger.running and not self.ledger.has_work())
            )
        )
        self._paused = True
        self._engine_open.clear()
        deadline = time.monotonic() + self.cfg.pause_timeout
        # Abort first and pause once the requests are back: SGLang's abort-mode pause aborts, finds
        # requests still running and sleeps a whole second before it looks again; with none left it
        # returns at once. The engine's pause then only shuts the gate.
        await self.engine.abort(None)
        await self._drain(deadline, every=0.1)  # every: again for a request sent just as the gate shut
        await self.engine.pause(mode="abort")
        await self._drain(deadline, every=1.0)  # a request that reached the engine after the pause

    async def _drain(self, deadline: float, every: float) -> None:
        """Until no request is in flight (or ``deadline``), aborting all of them again every ``every`` s."""
        next_abort = time.monotonic() + every
        while self.m.inflight_requests + self.eval_m.inflight_requests > 0 and time.monotonic() < deadline:
            if time.monotonic() >= next_abort:
                await self.engine.abort(None)
                next_abort = time.monotonic() + every
            await asyncio.sleep(0.002)

    async def resume_after_update(self, version: int) -> None:
        """The engines now serve ``version``: continue generation and admission under it."""
        self.controller.set_version(version)
        await self.engine.continue_generation()
        self._paused = False
        self._engine_open.set()
        self.controller.notify()

    # ================================================================ evaluation
    async def evaluate(
        self,
        tasks: Sequence[dict[str, Any]],
        sampling: SamplingParams | None = None,
        concurrency: int | None = None,
    ) -> list[Trajectory]:
        """Held-out evaluation: one episode per task (greedy by default), no staleness gating, in order."""
        if not self._verifier_checked:
            await self.check_verifier()
        sp = sampling or self.cfg.eval_sampling
        sem = asyncio.Semaphore(concurrency or self.cfg.max_concurrency)

        async def one(idx: int, task: dict[str, Any]) -> Trajectory:
            g = GroupRun(Draw(f"eval:{idx}", task), self.controller.version)
            async with sem:
                attempt = 0
                while True:
                    traj = (await self._episode(g.draw, 0, sp, self.eval_m, train=False))[0]
                    if traj.status != Status.FAILED or attempt >= self.cfg.max_retries:
                        return traj
                    attempt += 1

        return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))

    # ================================================================ accounting, metrics, state
    def accounting(self) -> dict[str, int]:
        """drawn == trained + dropped + in_flight, always (in_flight = running + buffered + pending;
        :meth:`agentrl.rollout.ledger.DrawLedger.counts`)."""
        return self.ledger.counts(sum(self.m.dropped.values()))

    def stats(self, reset_window: bool = True) -> dict[str, float]:
        """Rollout metrics (rates since the last call), accounting and buffer/staleness figures, and the
        load of this event loop (``rollout/loop_busy_frac``, ``rollout/loop_lag_ms_p90``, ...: see
        :mod:`agentrl.rollout.loop_monitor`) once started."""
        acc = self.accounting()
        out = self.m.snapshot(
            reset_window,
            **self.loop_monitor.snapshot(reset_window),
            running_groups=acc["running"],
            running_episode_slots=self._episode_slots,
            pending_groups=acc["pending"],
            drawn=acc["drawn"],
            trained_groups=acc["trained"],
            dataset_epoch=self.cursor.epoch,
        )
        out.update(self.buffer.stats())
        return out

    def log_metrics(self, step: int) -> dict[str, float]:
        stats = self.stats()
        if self.sink is not None:
            self.sink.log(stats, step)
        return stats

    def state_dict(self) -> dict[str, Any]:
        """The version, the cursor, every task in flight (in the order their groups would have reached
        the trainer: :meth:`agentrl.rollout.ledger.DrawLedger.in_flight`), counters and metrics."""
        queued, open_batch = self.buffer.queued_uids(), self.schedule.open_uids()
        return {
            "version": self.controller.version,
            **self.ledger.state_dict(queued, open_batch),
            "metrics": self.m.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], version: int | None = None) -> None:
        """Restore before :meth:`start`; ``version`` is the trainer's resumed policy version."""
        if self._loop_task is not None:
            raise RuntimeError("load_state_dict must be called before start()")
        self.ledger.load_state_dict(state)
        self.m.load_state_dict(state.get("metrics", {}))
        self.controller.on_resume(int(state["version"] if version is None else version))
        self.schedule.resume(self.controller.version)  # lockstep: batches restart at the resumed version
