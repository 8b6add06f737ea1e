"""Fault injection over real HTTP: the stub engine (a labelled SGLang stand-in) runs in its own process,
answers 5% of /generate with HTTP 500 or a hang past the client's timeout, the env raises on 10% of
steps, and the engine process is killed (SIGKILL) and restarted mid-run. Zero tasks lost, zero
duplicated, and training goes on after the restart.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from transformers import AutoTokenizer

from agentrl.buffer import DataExhausted
from agentrl.engine.client import EngineClient
from agentrl.engine.types import SamplingParams
from agentrl.rollout import Orchestrator, RolloutConfig
from agentrl.testing.envs import SyntheticEnv, lognormal
from agentrl.testing.stub_engine import start_stub_server

N_TASKS = 48


async def test_faults_zero_lost_zero_duplicated(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    srv = start_stub_server(
        fail_rate=0.03,
        hang_rate=0.02,
        hang_time=5.0,
        per_token_time=0.001,
        min_tokens=2,
        max_tokens=12,
        seed=3,
    )
    try:
        # client: 5xx retried twice inside the client; a hang ends in EngineTimeout after 1 s
        client = EngineClient(srv.url, timeout=1.0, max_retries=2, backoff=0.05)
        cfg = RolloutConfig(
            group_size=2,
            batch_size=2,
            max_staleness=1,
            max_concurrency=16,
            max_turns=3,
            max_total_tokens=512,
            sampling=SamplingParams(max_new_tokens=12),
            filter_zero_variance=False,
            max_retries=1,
            engine_retries=10,
            engine_retry_backoff=0.1,
            failed_member_policy="drop_group",
            epochs=1,
            record_outcomes=True,
        )
        orch = Orchestrator(
            cfg,
            client,
            tok,
            lambda: SyntheticEnv(turns=2, fail_rate=0.1, tool_latency=lognormal(0.003, 0.8)),
            [{"prompt": f"q{i}"} for i in range(N_TASKS)],
        )
        await orch.start()
        trained: list[str] = []
        steps = killed_at = 0
        restarted = False
        t0 = time.monotonic()
        try:
            while True:
                batch = await orch.buffer.get_batch(timeout=90)
                trained += sorted({t.group_id for t in batch})
                steps += 1
                if steps == 3:  # kill the engine mid-run; it comes back 1.5 s later on the same port
                    killed_at = steps
                    srv.kill()
                    await asyncio.sleep(1.5)  # episodes keep running into connection errors meanwhile
                    await asyncio.to_thread(srv.restart, weight_version=str(orch.version))
                    restarted = True
                await orch.pause_for_update()
                await client.update_weight_version(str(orch.version + 1))
                await orch.resume_after_update(orch.version + 1)
        except DataExhausted:
            pass
        assert restarted
        elapsed = time.monotonic() - t0
        await orch.stop()
        await client.close()
        stats = srv.stats()
    finally:
        srv.stop()

    acc = orch.accounting()
    # zero lost: every drawn task is trained, dropped with a reason, or (less than a batch) left over
    assert acc["drawn"] == N_TASKS and acc["running"] == 0 and acc["pending"] == 0
    assert acc["trained"] + acc["dropped"] + acc["buffered"] == N_TASKS and acc["buffered"] < cfg.batch_size
    # zero duplicated
    assert len(trained) == len(set(trained))
    assert len({u for u, _ in orch.outcomes}) == len(orch.outcomes)
    # the run went on after the engine came back
    assert steps > killed_at + 2
    assert acc["trained"] >= N_TASKS // 3
    # the faults happened and were absorbed by the retries
    assert orch.m.counters["engine_errors"] > 0  # the kill, the hangs (timeouts), 5xx beyond client retries
    assert orch.m.failures["env"] > 0
    assert stats["failed"] + stats["hung"] > 0  # counters of the restarted process
    dropped_reasons = set(orch.m.dropped)
    assert dropped_reasons <= {"failed:env", "failed:engine"}, dropped_reasons
    assert elapsed < 90
