"""The orchestrator against the embedded engine (real model, real sampling) with the tiny model:
response ids are exactly what the engine sampled, nothing is decoded and re-tokenized, observation
tokens carry loss_mask 0, and a pause/update/continue cycle keeps every token's version right.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from agentrl.embedded.launch import start_embedded_server
from agentrl.engine.client import EngineClient
from agentrl.engine.types import GenerateResult, SamplingParams
from agentrl.rollout import ChatTokenizer, Orchestrator, RolloutConfig
from agentrl.testing.envs import SyntheticEnv
from agentrl.types import OBSERVATION_VERSION


class RecordingClient(EngineClient):
    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.calls: list[tuple[list[int], GenerateResult]] = []

    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> GenerateResult:
        res = await super().generate(input_ids, sampling, rid, return_logprob)
        self.calls.append((list(input_ids), res))
        return res


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    srv = start_embedded_server(tiny_model_dir, max_batch_size=16)
    yield srv
    srv.stop()


async def test_embedded_engine_token_exact(engine: Any, tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    client = RecordingClient(engine.url, timeout=120)
    cfg = RolloutConfig(
        group_size=2,
        batch_size=2,
        max_staleness=1,
        max_concurrency=8,
        max_turns=3,
        max_total_tokens=400,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=24),
        filter_zero_variance=False,
        shuffle=False,
    )
    tasks = [{"prompt": f"Compute {i} * 7.", "turns": 2} for i in range(8)]
    orch = Orchestrator(cfg, client, tok, lambda: SyntheticEnv(turns=2), tasks)
    await orch.start()
    first = await orch.buffer.get_batch(timeout=120)
    await asyncio.sleep(0.2)  # let some requests be in flight when the update comes
    await orch.pause_for_update()
    await client.update_weight_version("1")  # same weights, new version name: what a disk update reports
    await orch.resume_after_update(1)
    second = await orch.buffer.get_batch(timeout=120)
    await orch.stop()
    await client.close()

    chat = ChatTokenizer(tok)
    answers: dict[tuple[int, ...], list[GenerateResult]] = {}
    for inp, res in client.calls:
        answers.setdefault(tuple(inp), []).append(res)
    seen_versions: set[int] = set()
    for t in first + second:
        t.validate()
        assert orch.version - t.min_policy_version <= cfg.max_staleness
        ids_so_far = list(t.prompt_ids)
        for turn in t.turns:
            seg = t.response_ids[turn.start : turn.end]
            if turn.role == "assistant":
                # an uninterrupted turn is one engine answer for exactly the ids so far; an interrupted
                # one is the concatenation of its answers, each request carrying the ids before it
                pos, k = 0, turn.start
                while pos < len(seg):
                    cands = [
                        r
                        for r in answers[tuple(ids_so_far + seg[:pos])]
                        if seg[pos : pos + len(r.output_ids)] == r.output_ids and r.output_ids
                    ]
                    assert cands, "model tokens differ from what the engine sampled"
                    r = cands[0]
                    assert t.rollout_logprobs[k : k + len(r.output_ids)] == r.logprobs
                    pos += len(r.output_ids)
                    k += len(r.output_ids)
                assert all(lp <= 0.0 for lp in t.rollout_logprobs[turn.start : turn.end])
                assert set(t.loss_mask[turn.start : turn.end]) == {1}
                seen_versions |= set(t.policy_versions[turn.start : turn.end])
            else:
                assert set(t.loss_mask[turn.start : turn.end]) == {0}
                assert set(t.policy_versions[turn.start : turn.end]) == {OBSERVATION_VERSION}
                # the observation ids are the template delta of its text, tokenized once on its own
                prev = t.response_ids[turn.start - 1]
                assert seg == chat.observation_ids(turn.text, prev)
            ids_so_far += seg
    assert seen_versions <= {0, 1} and 0 in seen_versions
