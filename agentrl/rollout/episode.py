"""One episode, token-in/token-out: the part of the rollout that talks to the env and the engine.

:class:`EpisodeRunner` runs one multi-turn episode for the :class:`~agentrl.rollout.orchestrator.
Orchestrator` (which decides *which* episodes run and *when*; this module decides nothing about
admission, groups or the buffer):

    prompt_ids = chat template of ``await env.reset(task)`` (rendered once, with ``env.tools``)
    loop: ``/generate`` with the exact ids so far -> sampled ids + logprobs + ``weight_version``
          (loss_mask 1) -> ``await env.step(decoded action)`` -> its observation (``messages`` when
          given, rendered together, else ``observation``) tokenized once, alone (loss_mask 0) -> until
          terminated / truncated / max_turns / max_total_tokens / context length.
    reward: the env's, else ``run_verifier(name)`` with the run's verifier, resolved once by the
    orchestrator (``rollout.verifier``, else the env's own; a raising verifier marks it FAILED).

A turn survives weight updates: while the orchestrator's ``engine_open`` gate is closed it waits; an
aborted request is resubmitted with everything sampled so far and goes on under the new version
(``interrupt_mode: continue``), or the episode restarts (:class:`Restart`). A training episode whose
oldest token could no longer be trained within the staleness bound (:func:`agentrl.buffer.within_bound`)
restarts instead of finishing.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from agentrl.buffer import StalenessController, within_bound
from agentrl.chat import ChatTokenizer
from agentrl.engine.client import EngineClient, EngineError, EngineRequestError
from agentrl.engine.types import SamplingParams
from agentrl.envs.base import Env, StepResult
from agentrl.envs.fork import EpisodeLog
from agentrl.rewards.base import run_verifier
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.dataset import Draw
from agentrl.rollout.lockstep import request_seed
from agentrl.rollout.metrics import RolloutMetrics
from agentrl.types import Status, Trajectory

log = logging.getLogger(__name__)
T = TypeVar("T")


WARNINGS = {
    "steps_without_observation": "%s.step returned neither observation nor messages and did not end the "
    "episode: the model's next turn sees nothing new (counted in rollout/steps_without_observation)",
    "episodes_without_tool_calls": "%s: an episode ended without one tool call the env parsed (none made, or "
    "each malformed; counted in rollout/episodes_without_tool_calls): a model that never calls its tools in "
    "the env's format learns nothing about them; a warm start teaches the format (docs/guide/warm-start.md)",
}


@dataclass
class LiveEpisode:
    """An episode in progress: its env, its trajectory so far, and what an error would be blamed on.
    A tree rollout forks one into several (:mod:`agentrl.rollout.tree`)."""

    draw: Draw
    traj: Trajectory
    env: Env | None = None  # None: not started yet, or closed
    stop: list[str] = field(default_factory=list)
    phase: str = "env"  # env | tokenizer | engine | verifier: what a failure now is blamed on
    status: Status = Status.TRUNCATED  # how it ends unless something ends it first
    ended: bool = False  # no more turns: terminated, truncated, over a limit, or failed
    tool_time: float = 0.0
    log: EpisodeLog | None = None  # its task, actions and results, kept to fork it by replay
    t0: float = field(default_factory=time.monotonic)


class Restart(Exception):  # control flow, not an error
    """Re-run an episode from scratch (too stale to be trained, or interrupted with
    interrupt_mode=restart)."""


def _seed_key(draw: Draw, traj: Trajectory) -> str:
    """What a request seed is drawn from besides the sample and turn: the draw, and in a tree rollout the
    branch taken (child 0 continues its parent's draws, so a tree that never branches samples as a flat
    episode does)."""
    tree = traj.tree
    if tree is None or not any(tree.path):
        return draw.uid
    return f"{draw.uid}/{'.'.join(map(str, tree.path))}"


def parse_version(v: str | None, fallback: int) -> int:
    """The engine's weight_version as an int; SGLang's initial "default" (or anything else) -> fallback."""
    if v is None:
        return fallback
    try:
        return int(v)
    except ValueError:
        return fallback


class EpisodeRunner:
    """Runs episodes against ``engine`` with envs from ``env_factory`` (see the module docstring).

    ``controller`` gives the current policy version and the bound η; ``engine_open`` is set while the
    engines generate and cleared by the orchestrator during a weight update.
    """

    def __init__(
        self,
        config: RolloutConfig,
        engine: EngineClient,
        chat: ChatTokenizer,
        env_factory: Callable[[], Env],
        controller: StalenessController,
        engine_open: asyncio.Event,
        deterministic: bool = False,
    ) -> None:
        self.cfg = config
        self.deterministic = deterministic  # the run's switch: seeded requests
        self.engine = engine
        self.chat = chat
        self.env_factory = env_factory
        self.controller = controller
        self.engine_open = engine_open
        self._rid = itertools.count()
        self._warned: set[str] = set()
        # the run's verifier, resolved once (rollout.verifier, else the env's own) by the orchestrator
        self.verifier: str | None = None

    def _doomed(self, min_version: int | None) -> bool:
        """Tokens this old can never be trained within the bound: re-run instead of finishing."""
        return not within_bound(self.controller.version, min_version, self.controller.max_staleness)

    async def score(self, traj: Trajectory, env: Env, m: RolloutMetrics, missing: str) -> None:
        """Reward ``traj`` with the run's verifier (:attr:`verifier`); with none it fails with ``missing``
        (a verifier that fails or times out is counted, and leaves the trajectory failed by it)."""
        verifier = self.verifier
        if verifier is None:
            traj.status = Status.FAILED
            traj.error = missing
            m.failure("reward", missing)
        elif not await run_verifier(verifier, traj, traj.label, self.cfg.verifier_timeout):
            m.failure("verifier", traj.error)

    async def env_call(self, aw: Awaitable[T]) -> T:
        """``await aw`` (an env's reset, step or fork), bounded by ``rollout.env_step_timeout``."""
        if self.cfg.env_step_timeout is None:
            return await aw
        try:
            return await asyncio.wait_for(aw, self.cfg.env_step_timeout)
        except TimeoutError:  # say which limit ended it (the bare error has no text)
            raise TimeoutError(
                f"took longer than rollout.env_step_timeout ({self.cfg.env_step_timeout} s)"
            ) from None

    def new_episode(self, draw: Draw, i: int) -> LiveEpisode:
        """Sample ``i`` of ``draw``'s task, not started yet (:meth:`advance` starts it)."""
        traj = Trajectory(
            task_id=draw.task_id,
            group_id=draw.uid,
            prompt_ids=[],
            sample_index=i,
            label=draw.task.get("label"),
        )
        return LiveEpisode(draw, traj)

    async def run(
        self, draw: Draw, i: int, sampling: SamplingParams, m: RolloutMetrics, train: bool
    ) -> Trajectory:
        """Sample ``i`` of ``draw``'s task, to its end; never raises for an env, tool, verifier or engine
        error (the trajectory comes back FAILED with it). Raises :class:`Restart` when ``train`` and the
        episode must be re-run from scratch (too stale, or interrupted with ``interrupt_mode: restart``)."""
        ep = self.new_episode(draw, i)
        await self.advance(ep, sampling, m, train)
        return ep.traj

    async def advance(
        self,
        ep: LiveEpisode,
        sampling: SamplingParams,
        m: RolloutMetrics,
        train: bool,
        until_turn: int | None = None,
    ) -> bool:
        """Play ``ep`` (starting it first when new) until it ends, or until it has ``until_turn`` model
        turns and goes on (a tree's branch point): then True, with its env still open. Otherwise the
        episode is over (scored, or FAILED with the error), its env closed, and False. Raises as
        :meth:`run` does, its env closed."""
        paused = False
        try:
            if ep.env is None:
                ep.env = self.env_factory()
                messages = await self.env_call(ep.env.reset(dict(ep.draw.task)))
                if ep.log is not None:
                    ep.log.messages = messages
                ep.phase = "tokenizer"
                ep.traj.prompt_ids = self.chat.prompt_ids(messages, getattr(ep.env, "tools", None))
                ep.stop = [*sampling.stop, *(getattr(ep.env, "stop", None) or [])]
            await self._play(ep, sampling, m, train, until_turn)
            if not ep.ended:
                paused = True
                return True
            await self._finish(ep, m)
        except (Restart, asyncio.CancelledError):
            raise
        except Exception as err:
            self.fail(ep, err, m)
        finally:
            if not paused:
                await self.close(ep, m)
        self.ended(ep, m)
        return False

    def ended(self, ep: LiveEpisode, m: RolloutMetrics) -> None:
        """Time and count an episode that is over."""
        traj = ep.traj
        traj.timings["episode_s"] = time.monotonic() - ep.t0
        m.episode(traj.status.value, len(traj.response_ids), traj.num_turns)

    def fail(self, ep: LiveEpisode, err: Exception, m: RolloutMetrics) -> None:
        """Mark ``ep`` FAILED with ``err``, blamed on the engine or on the phase it was in."""
        kind = "engine" if isinstance(err, EngineError) else ep.phase
        ep.traj.status = Status.FAILED
        ep.traj.error = f"{kind}: {type(err).__name__}: {err}"
        ep.ended = True
        m.failure(kind)

    async def close(self, ep: LiveEpisode, m: RolloutMetrics) -> None:
        """Close ``ep``'s env (once); a failing ``close`` is counted, never raised."""
        env, ep.env = ep.env, None
        if env is not None:
            try:
                await env.close()
            except Exception:
                m.failure("env_close")

    async def _play(
        self,
        ep: LiveEpisode,
        sampling: SamplingParams,
        m: RolloutMetrics,
        train: bool,
        until_turn: int | None,
    ) -> None:
        """Turns until the episode ends (``ep.ended``) or has ``until_turn`` model turns."""
        traj, env, draw = ep.traj, ep.env, ep.draw
        assert env is not None
        limit = self.cfg.token_limit
        while True:
            if traj.num_turns >= self.cfg.max_turns:
                break  # max_turns reached: truncated
            if until_turn is not None and traj.num_turns >= until_turn:
                return
            room = limit - len(traj.prompt_ids) - len(traj.response_ids)
            if room <= 0:
                break
            ep.phase = "engine"
            ids, lps, vers = await self._generate_turn(draw, traj, sampling, ep.stop, room, m, train)
            ep.phase = "tokenizer"
            text = self.chat.action_text(ids)
            traj.append_model_tokens(ids, lps, vers, text)
            m.turn(len(ids))
            if len(traj.prompt_ids) + len(traj.response_ids) >= limit:
                break
            ep.phase = "env"
            ts = time.monotonic()
            res = await self.env_call(env.step(text))
            step_time = time.monotonic() - ts
            ep.tool_time += step_time
            if ep.log is not None:
                ep.log.steps.append((text, res))
            if res.info:
                traj.info.update(res.info)
            # the calls the env ran for this action, on its turn (what episode dumps show)
            calls = list(getattr(res, "tool_calls", None) or [])
            traj.turns[-1].tool_calls = calls
            # tool latency: the calls' own time when the env reports its calls with their latency;
            # an env that reports none has its whole step timed instead
            timed = [c.latency_s for c in calls if c.latency_s is not None]
            for latency in timed or [step_time]:
                m.tool(latency)
            if res.reward is not None:
                traj.reward = float(res.reward)
            if res.terminated:
                ep.status = Status.COMPLETED
                break
            if res.truncated:
                break
            ep.phase = "tokenizer"
            obs, obs_text = self._observation(res, ids[-1] if ids else None)
            if not obs:
                # the episode goes on, but the model is shown nothing new: almost always an env bug
                m.count("steps_without_observation")
                self._warn_once("steps_without_observation", env)
                continue
            if len(traj.prompt_ids) + len(traj.response_ids) + len(obs) >= limit:
                break  # the observation does not fit the context: truncated
            traj.append_observation_tokens(obs, obs_text)
            m.observation(len(obs))
        ep.ended = True

    async def _finish(self, ep: LiveEpisode, m: RolloutMetrics) -> None:
        """Status, tool time, the tool calls' count (failed ones apart), and, when the env gave none, the
        verifier's reward. A tool env's episode with no call it parsed is counted and warned about."""
        traj, env = ep.traj, ep.env
        calls = [c for t in traj.turns for c in t.tool_calls]
        if calls:
            m.count("tool_calls", len(calls))
            # malformed, raised, timed out, a sandbox run killed: each an error result the model was shown
            m.count("tool_call_errors", sum(1 for c in calls if c.error is not None))
        if getattr(env, "tools", None) and not any(c.name is not None for c in calls):
            m.count("episodes_without_tool_calls")
            self._warn_once("episodes_without_tool_calls", env)
        traj.status = ep.status
        traj.timings["tool_s"] = ep.tool_time
        if traj.reward is None:
            ep.phase = "verifier"
            await self.score(
                traj,
                env,
                m,
                "no reward: the env gave none, names no verifier, and rollout.verifier is not set",
            )

    def _observation(self, res: StepResult, last_token_id: int | None) -> tuple[list[int], str]:
        """The observation ids of one step (loss_mask 0) and their text: ``res.messages`` when the env gave
        several messages (rendered together by the chat template), else ``res.observation``."""
        fmt = getattr(res, "observation_format", "message")
        messages = getattr(res, "messages", None)
        if messages:
            if fmt != "message":
                raise ValueError(
                    f"StepResult.messages needs observation_format 'message', not {fmt!r}: raw text "
                    "continues the assistant's own message, so give it as StepResult.observation"
                )
            text = "\n".join(str(msg.get("content", "")) for msg in messages)
            return self.chat.observation_messages_ids(messages, last_token_id), text
        if res.observation:
            return self.chat.observation_ids(res.observation, last_token_id, fmt, res.observation_role), (
                res.observation
            )
        return [], ""

    def _warn_once(self, what: str, env: Env) -> None:
        if what in self._warned:
            return
        self._warned.add(what)
        log.warning(WARNINGS[what], type(env).__name__)

    async def _generate_turn(
        self,
        draw: Draw,
        traj: Trajectory,
        sampling: SamplingParams,
        stop: list[str],
        room: int,
        m: RolloutMetrics,
        train: bool,
    ) -> tuple[list[int], list[float], list[int]]:
        """One model turn; survives interruptions (resubmits the tokens so far) and engine restarts."""
        # versions never decrease within an episode, so the oldest model token is the first one
        traj_min = next((v for v, mk in zip(traj.policy_versions, traj.loss_mask, strict=True) if mk), None)
        ids: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        errors = aborts = 0
        while True:
            if not self.engine_open.is_set():
                await self.engine_open.wait()
            oldest = (
                min(vers[0], traj_min) if vers and traj_min is not None else (vers[0] if vers else traj_min)
            )
            if train and self._doomed(oldest):
                m.count("stale_episode_restarts")
                raise Restart("too stale")
            max_new = min(sampling.max_new_tokens - len(ids), room - len(ids))
            if max_new <= 0:
                return ids, lps, vers
            update = {"max_new_tokens": max_new, "stop": stop}
            if self.deterministic and sampling.sampling_seed is None:  # same draws whenever it runs
                turn = traj.num_turns
                update["sampling_seed"] = request_seed(
                    self.cfg.seed, _seed_key(draw, traj), traj.sample_index, turn
                )
            sp = sampling.model_copy(update=update)
            sent_version = self.controller.version
            m.request_started(len(traj.prompt_ids) + len(traj.response_ids) + len(ids))
            t = time.monotonic()
            # MoE routing replay: the engine's experts of every input position (asked only when needed, so
            # engines without the option are not sent it)
            routed = {"return_routed_experts": True} if self.cfg.return_routed_experts else {}
            try:
                res = await self.engine.generate(
                    traj.prompt_ids + traj.response_ids + ids,
                    sp,
                    rid=f"{draw.uid}/{traj.sample_index}/{next(self._rid)}",
                    **routed,
                )
            except EngineRequestError:
                raise  # the engine rejected the request: re-sending the same one will not help
            except EngineError:
                errors += 1
                m.count("engine_errors")
                if errors > self.cfg.engine_retries:
                    raise
                await asyncio.sleep(min(self.cfg.engine_retry_backoff * 2 ** (errors - 1), 4.0))
                continue
            finally:
                m.request_ended(time.monotonic() - t)
            v = parse_version(res.weight_version, sent_version)
            if v > self.controller.version:
                # the engine serves weights the trainer has not announced: a setup error, never silent
                m.count("engine_version_ahead")
                if m.counters["engine_version_ahead"] == 1:
                    log.warning(
                        "engine reports weight_version %s but the policy version is %d; call "
                        "resume_after_update(version) with the version the engines were given",
                        res.weight_version,
                        self.controller.version,
                    )
            cached = res.meta.get("cached_tokens")
            if isinstance(cached, int):  # prompt tokens the engine's prefix cache served (SGLang, embedded)
                m.count("cached_input_tokens", cached)
            ids += res.output_ids
            lps += res.logprobs
            vers += [v] * len(res.output_ids)
            if routed and res.meta.get("routed_experts") is not None:
                traj.routed_experts = res.meta["routed_experts"]  # the latest covers every earlier position
            elif routed and res.output_ids:
                # replay asked for the routing and the engine gave none: the trainer routes those rows itself
                m.count("requests_without_routing")
                if m.counters["requests_without_routing"] == 1:
                    log.warning(
                        "routing replay is on but the engine returned no routed_experts (counted in "
                        "rollout/requests_without_routing); the trainer routes those tokens itself. An "
                        "SGLang server needs --enable-return-routed-experts, and the model must be a "
                        "mixture of experts"
                    )
            if not res.aborted:
                return ids, lps, vers
            aborts += 1
            m.count("interrupted_requests")
            if aborts > 10_000:
                raise EngineError("a request was aborted 10000 times in a row")
            if train and self.cfg.interrupt_mode == "restart":
                m.count("interrupt_restarts")
                raise Restart("interrupted")
            # continue: resubmit prompt + everything sampled so far, under the new version
