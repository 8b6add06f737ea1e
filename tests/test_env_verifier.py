"""Which verifier scores an episode: ``rollout.verifier`` when set, else the env's own ``verifier``, else
the run fails at start-up (not per episode).

Every built-in env runs through the real orchestrator against the embedded engine (tiny model, real
sampling over HTTP) with ``rollout.verifier`` unset; a spy wrapped around each built-in verifier records
which one scored the episodes.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from agentrl.config import ConfigError
from agentrl.embedded.launch import start_embedded_server
from agentrl.engine.client import EngineClient
from agentrl.engine.types import SamplingParams
from agentrl.envs import make_env
from agentrl.rewards import VerifierConfigError, get_verifier, register_verifier, resolve_verifier
from agentrl.rollout import Orchestrator, RolloutConfig
from agentrl.types import Status, Trajectory

ROOT = Path(__file__).resolve().parent.parent
TASKS = [{"prompt": "What is 2 + 3?", "label": "5"}, {"prompt": "Who wrote Hamlet?", "label": "Shakespeare"}]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Any]:
    srv = start_embedded_server(tiny_model_dir, max_batch_size=8)
    yield srv
    srv.stop()


@pytest.fixture
def spies() -> Iterator[dict[str, list[str]]]:
    """Wrap the built-in verifiers so each call is recorded by name; restored afterwards."""
    calls: dict[str, list[str]] = {}
    originals = {name: get_verifier(name) for name in ("math", "exact_match")}
    for name, fn in originals.items():

        def spy(traj: Trajectory, label: Any, _fn: Callable = fn, _name: str = name) -> Any:
            calls.setdefault(_name, []).append(traj.task_id)
            return _fn(traj, label)

        register_verifier(name, overwrite=True)(spy)
    register_verifier("test_constant", overwrite=True)(lambda traj, label: 0.25)
    yield calls
    for name, fn in originals.items():
        register_verifier(name, overwrite=True)(fn)


def _orchestrator(engine: Any, tiny_model_dir: Path, env: str, rollout_verifier: str | None, **kw: Any):
    cfg = RolloutConfig(
        group_size=1,
        batch_size=1,
        max_turns=2,
        max_total_tokens=400,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=8),
        eval_sampling=SamplingParams(temperature=0.0, max_new_tokens=8),
        verifier=rollout_verifier,
        max_retries=0,
    )
    client = EngineClient(engine.url, timeout=120)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return Orchestrator(cfg, client, tok, lambda: make_env(env, **kw), TASKS), client


@pytest.mark.parametrize(
    ("env", "kwargs", "expected"),
    [
        ("math", {}, "math"),
        ("search", {"max_turns": 1}, "exact_match"),
        ("python", {"backend": "process"}, "math"),
        ("tool", {"verifier": "exact_match"}, "exact_match"),  # ToolEnv names none unless told
    ],
)
async def test_each_builtin_env_is_scored_by_its_own_verifier(
    engine: Any, tiny_model_dir: Path, spies: dict[str, list[str]], env: str, kwargs: dict, expected: str
) -> None:
    orch, client = _orchestrator(engine, tiny_model_dir, env, None, **kwargs)
    try:
        assert await orch.check_verifier() == expected
        trajs = await orch.evaluate(TASKS)
    finally:
        await client.close()
    for t in trajs:
        assert t.status != Status.FAILED, t.error
        assert t.reward in (0.0, 1.0)
    assert sorted(spies.get(expected, [])) == sorted(t.task_id for t in trajs)
    assert set(spies) == {expected}  # no other verifier ran


async def test_the_configured_verifier_wins(
    engine: Any, tiny_model_dir: Path, spies: dict[str, list[str]]
) -> None:
    orch, client = _orchestrator(engine, tiny_model_dir, "math", "test_constant")
    try:
        trajs = await orch.evaluate(TASKS)
    finally:
        await client.close()
    assert [t.reward for t in trajs] == [0.25, 0.25]
    assert spies == {}  # the env's math verifier never ran


async def test_no_verifier_anywhere_fails_at_start_up_naming_the_field(
    engine: Any, tiny_model_dir: Path
) -> None:
    orch, client = _orchestrator(engine, tiny_model_dir, "tool", None)
    try:
        for call in (orch.start, lambda: orch.evaluate(TASKS)):
            with pytest.raises(
                VerifierConfigError, match=r"rollout\.verifier: not set and env ToolEnv names no"
            ):
                await call()
        assert orch.drawn == 0  # nothing ran
    finally:
        await client.close()


def test_an_unknown_verifier_is_named_with_the_known_ones() -> None:
    with pytest.raises(
        ConfigError,
        match=r"rollout\.verifier: unknown verifier 'exact_mach'; "
        r"did you mean 'exact_match'\? known.*exact_match",
    ):
        resolve_verifier("exact_mach", "math")
    with pytest.raises(ConfigError, match=r"env 'x''s verifier attribute: unknown verifier 'nope'"):
        resolve_verifier(None, "nope", "env 'x'")
    assert resolve_verifier(None, "math") == "math"


async def test_train_async_checks_the_verifier_before_starting_engines() -> None:
    spec = importlib.util.spec_from_file_location("train_async", ROOT / "train_async.py")
    assert spec is not None and spec.loader is not None
    train_async = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_async)
    from agentrl.run_config import RunConfig

    run = {"model_path": "/m", "data": {"path": "/d"}}
    cfg = RunConfig.model_validate({**run, "env": {"name": "tool"}, "rollout": {"verifier": None}})
    with pytest.raises(ConfigError, match=r"rollout\.verifier: not set"):
        await train_async.check_verifier(cfg, {})
    cfg = RunConfig.model_validate({**run, "env": {"name": "math"}, "rollout": {"verifier": None}})
    assert await train_async.check_verifier(cfg, {}) == "math"


def test_an_env_that_scores_itself_needs_no_verifier() -> None:
    assert resolve_verifier(None, None, "env GuessEnv", scores_itself=True) is None
    assert (
        resolve_verifier("math", None, "env GuessEnv", scores_itself=True) == "math"
    )  # the config still wins
