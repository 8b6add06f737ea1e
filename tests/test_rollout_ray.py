"""The orchestrator as an async Ray actor (local Ray, one module-scoped cluster), against the stub engine
(a labelled SGLang stand-in) in its own process: batches, a weight update, checkpoint state and stats
all go through the actor handle (its generic ``call``).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import ray

from agentrl.engine.client import EngineClient
from agentrl.engine.types import SamplingParams
from agentrl.rollout import OrchestratorSpec, RolloutConfig, make_rollout_actor
from agentrl.testing.envs import SyntheticEnv
from agentrl.testing.stub_engine import start_stub_server


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


async def test_orchestrator_as_ray_actor(ray_local: None, tiny_model_dir: Path) -> None:
    srv = start_stub_server(per_token_time=0.0005, max_tokens=10)
    try:
        cfg = RolloutConfig(
            group_size=2,
            batch_size=2,
            max_staleness=1,
            max_concurrency=8,
            max_turns=2,
            sampling=SamplingParams(max_new_tokens=12),
            filter_zero_variance=False,
        )
        spec = OrchestratorSpec(
            cfg,
            srv.url,
            str(tiny_model_dir),
            functools.partial(SyntheticEnv, turns=2),
            [{"prompt": f"q{i}"} for i in range(20)],
            engine_timeout=30,
        )
        actor = make_rollout_actor(spec)
        await actor.call.remote("start")
        batch = await actor.call.remote("buffer.get_batch", timeout=60)
        assert len(batch) == 4 and len({t.group_id for t in batch}) == 2
        await actor.call.remote("pause_for_update")
        client = EngineClient(srv.url, timeout=10)
        await client.update_weight_version("1")
        await client.close()
        await actor.call.remote("resume_after_update", 1)
        batch2 = await actor.call.remote("buffer.get_batch", timeout=60)
        assert not {t.group_id for t in batch} & {t.group_id for t in batch2}
        stats = await actor.call.remote("stats")
        assert stats["staleness/version"] == 1 and stats["rollout/turns"] > 0
        state = await actor.call.remote("state_dict")
        acc = await actor.call.remote("accounting")
        assert len(state["pending"]) == acc["in_flight"] and acc["balanced"] == 1
        await actor.stop.remote()
    finally:
        srv.stop()
