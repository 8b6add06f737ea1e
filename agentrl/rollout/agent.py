"""One agent episode: run the user's openai-SDK agent against a recording proxy, return its trajectories.

:class:`AgentRunner` is to an :class:`~agentrl.envs.agent.AgentEnv` what
:class:`~agentrl.rollout.episode.EpisodeRunner` is to an Env: the orchestrator calls ``run`` for each
sample of a group, under the same admission, staleness and failure rules. Per episode it opens a
session on the :class:`~agentrl.rollout.agent_proxy.AgentProxy`, hands the agent
``openai.AsyncOpenAI(base_url=<the session's URL>)``, awaits ``agent(task, client)`` and closes the
session (later calls answer 410). The rows it returns are the session's leaf trajectories (usually one;
more when the agent forked or its history drifted), the main one first, all with the episode's reward
and one ``episode_id`` (so GRPO counts the episode once in its group's baseline):

* the agent's return value, or (None) the verifier's score of the main row, copied to the others;
* FAILED with the error when the agent raises, times out, made no model call, or an engine call failed;
  TRUNCATED when it went past ``rollout.max_turns`` calls or the token limit;
* a too-stale or interrupted (``interrupt_mode: restart``) call cancels the agent and raises
  :class:`~agentrl.rollout.episode.Restart`, so the orchestrator re-runs the episode.

Each row's ``info`` says ``agent_rows`` (rows of its episode) and ``agent_calls``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from agentrl.engine.types import SamplingParams
from agentrl.envs.agent import AgentEnv
from agentrl.rollout.agent_proxy import AgentProxy
from agentrl.rollout.dataset import Draw
from agentrl.rollout.episode import EpisodeRunner, Restart
from agentrl.rollout.metrics import RolloutMetrics
from agentrl.types import Status, Trajectory


class AgentRunner:
    """Runs agent episodes through one proxy (started on first use, on the running event loop)."""

    def __init__(self, episodes: EpisodeRunner) -> None:
        self.episodes = episodes
        self.cfg = episodes.cfg
        self.proxy = AgentProxy(episodes)
        self._http: Any = None
        self._lock = asyncio.Lock()

    async def _start(self) -> None:
        if self._http is not None:
            return
        async with self._lock:
            if self._http is None:
                import httpx

                await self.proxy.start()
                # every episode's client reaches the proxy in process (no socket, no second HTTP hop);
                # its base URL is still the proxy's, for agents that hand it to another HTTP client
                self._http = httpx.AsyncClient(transport=self.proxy.transport(), timeout=httpx.Timeout(None))

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        await self.proxy.stop()

    async def run(
        self, draw: Draw, i: int, sampling: SamplingParams, m: RolloutMetrics, train: bool
    ) -> list[Trajectory]:
        """Sample ``i`` of ``draw``'s task as an agent episode; never raises for an agent, engine or
        verifier error. Raises :class:`Restart` when the episode must be re-run from scratch."""
        import openai

        await self._start()
        t0 = time.monotonic()
        env = self.episodes.env_factory()
        if not isinstance(env, AgentEnv):
            raise TypeError(f"AgentRunner needs an AgentEnv, got {type(env).__name__}")
        session = self.proxy.open(draw, i, sampling, m, train)
        client = openai.AsyncOpenAI(
            base_url=self.proxy.base_url(session), api_key="agentrl", http_client=self._http, max_retries=0
        )
        task = asyncio.ensure_future(env.agent(dict(draw.task), client, **env.kwargs))
        session.on_restart = task.cancel
        reward: float | None = None
        error: str | None = None
        try:
            reward = await asyncio.wait_for(asyncio.shield(task), env.timeout) if env.timeout else await task
            if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
                error = f"agent returned {type(reward).__name__}, expected float or None"
                reward = None
        except asyncio.CancelledError:
            if session.restart is None:
                raise  # cancelled from outside (shutdown)
        except TimeoutError:
            error = f"agent timed out after {env.timeout}s"
        except Exception as err:
            error = f"{type(err).__name__}: {err}"
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            self.proxy.close(session)
        if session.restart is not None:  # counted where it was decided (EpisodeRunner._generate_turn)
            raise Restart(session.restart)

        rows = session.leaves()
        main = (
            rows[0]
            if rows
            else Trajectory(
                task_id=draw.task_id,
                group_id=draw.uid,
                prompt_ids=[],
                sample_index=i,
                label=draw.task.get("label"),
            )
        )
        rows = rows or [main]
        if session.engine_error is not None:
            main.status, main.error = Status.FAILED, f"engine: {session.engine_error}"
            m.failure("engine", main.error)
        elif error is not None:
            main.status, main.error = Status.FAILED, f"agent: {error}"
            m.failure("agent", main.error)
        elif session.calls == 0:
            main.status, main.error = Status.FAILED, "agent: made no model call"
            m.failure("agent", main.error)
        else:
            main.status = Status.TRUNCATED if session.truncated else Status.COMPLETED
            if reward is not None:
                main.reward = float(reward)
            else:
                await self.episodes.score(
                    main,
                    env,
                    m,
                    "no reward: the agent returned None and no verifier is set (rollout.verifier)",
                )
        dt = time.monotonic() - t0
        for t in rows:
            if t is not main:
                t.status, t.error, t.reward, t.reward_parts = (
                    main.status,
                    main.error,
                    main.reward,
                    dict(main.reward_parts),
                )
            t.episode_id = f"{draw.uid}/{i}"  # GRPO counts the episode once, not once per row
            t.info.update({"agent_rows": len(rows), "agent_calls": session.calls})
            t.timings["episode_s"] = dt
        if len(rows) > 1:
            m.count("agent_extra_rows", len(rows) - 1)
        m.episode(main.status.value, sum(len(t.response_ids) for t in rows), session.calls)
        return rows
