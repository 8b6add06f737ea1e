"""Episode dumps, retraining a step, the viewer on a real run, and wandb (agentrl.episodes, agentrl.retrain,
agentrl.viewer, agentrl.metrics).

One real ``train_async.py`` run (tiny Search-R1 config, two steps, dumps on, a checkpoint per step, wandb
offline) serves the run-level tests: what the dumps hold, a retrained step bit for bit, the wandb history
against metrics.jsonl, and the viewer page of the run in headless Chromium. The reader's handling of
corrupt and truncated files is tested on files written here.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from agentrl.config import ConfigError, build_config
from agentrl.episodes import (
    DumpConfig,
    DumpError,
    EpisodeDump,
    episode_record,
    iter_dump,
    iter_steps,
    read_dump,
    read_run_info,
    step_path,
    to_trajectory,
)
from agentrl.metrics import MetricsConfig, read_metrics
from agentrl.rollout.config import RolloutConfig
from agentrl.testing.configs import TINY_SEARCH_R1
from agentrl.testing.episodes import synthetic_run

ROOT = Path(__file__).resolve().parent.parent

CONFIG = (
    TINY_SEARCH_R1
    + """output_dir: {out}
steps: 2
rollout: {{group_size: 4, batch_size: 2, max_staleness: 1, max_concurrency: 16, max_turns: 3,
          max_total_tokens: 600, sampling: {{temperature: 1.0, max_new_tokens: 24}},
          eval_sampling: {{temperature: 0.0, max_new_tokens: 24}},
          verifier: "agentrl.testing.verifiers:length_parity", filter_zero_variance: true, dump: all}}
trainer: {{device: cpu, lr: 1.0e-3, micro_batch_size: 8}}
eval: {{num_tasks: 4}}
checkpoint: {{interval: 1}}
metrics: {{wandb: {{project: agentrl-ci, name: episodes}}}}
"""
)


# ---------------------------------------------------------------- config
def test_dump_config_shorthands_and_errors_name_the_field() -> None:
    def dump(value: Any) -> Any:
        return build_config(RolloutConfig, {"dump": value}, "run.yaml").dump

    assert (dump("all").every, dump(5).every, dump(False).every, dump("off").every) == (1, 5, 0, 0)
    assert not dump({"every": 0}).enabled and dump({"every": 2, "eval": False}).wants(4)
    assert not dump(2).wants(3) and not RolloutConfig().dump.enabled  # off by default
    with pytest.raises(ConfigError, match=r"dump: expected all, off"):
        dump("sometimes")
    with pytest.raises(ConfigError, match=r"dump\.evry: unknown field"):
        dump({"evry": 2})
    with pytest.raises(ConfigError, match=r"wandb\.project: Field required"):
        build_config(MetricsConfig, {"wandb": {"name": "x"}}, "run.yaml")
    with pytest.raises(ConfigError, match=r"wandb\.mode: Input should be 'online', 'offline' or 'disabled'"):
        build_config(MetricsConfig, {"wandb": {"project": "p", "mode": "cloud"}}, "run.yaml")


def test_train_async_names_bad_dump_and_wandb_fields() -> None:
    proc = subprocess.run(
        [sys.executable, "train_async.py", "rollout.dump=sometimes", "metrics.wandb.projekt=x"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "rollout.dump: expected" in proc.stderr and "metrics.wandb.projekt: unknown field" in proc.stderr


# ---------------------------------------------------------------- the trainer's logprobs
def _trainer(model_dir: Path, **kw: Any) -> Any:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import MegatronTrainer

    return MegatronTrainer(TrainerConfig(model_path=str(model_dir), lr=1e-3, micro_batch_size=2, **kw))


@pytest.mark.parametrize(
    "mode",
    [
        {},  # π_old from the update's own forward (one optimizer step)
        {"num_mini_batches": 2},  # π_old from a separate pass before the updates
        {"loss": {"off_policy": "bypass"}},  # no π_old: a no-grad pass only because it is recorded
    ],
    ids=["from_update", "recompute", "bypass"],
)
def test_recorded_trainer_logprobs_are_the_step_weights_and_change_no_update(
    tiny_model_dir: Path, mode: dict[str, Any]
) -> None:
    from _trainer_helpers import make_trajectories

    from agentrl.types import Status

    trajs = make_trajectories(600, seed=1, version=0)
    trajs[3].status, trajs[3].error = Status.FAILED, "verifier: ValueError: boom"  # not trained: no logprobs
    weights = []
    for record in (True, False):
        tr = _trainer(tiny_model_dir, **mode)
        try:
            before = tr.compute_logprobs(trajs)  # the step's starting weights, no grad
            tr.train_step(trajs, record_logprobs=record)
            got = tr.last_logprobs()
            if record:
                assert got["threads"] == torch.get_num_threads()
                lps = got["logprobs"]
                assert len(lps) == len(trajs) and lps[3] is None
                for i, (lp, ref) in enumerate(zip(lps, before, strict=True)):
                    if i != 3:
                        assert lp == pytest.approx(ref, abs=1e-5)
            else:
                assert got["logprobs"] is None
            weights.append(
                {k: v.detach().clone() for k, v in tr.module.state_dict().items() if torch.is_tensor(v)}
            )
        finally:
            tr.shutdown()
    for k, v in weights[0].items():  # recording changes nothing in the update, bit for bit
        assert v.numpy().tobytes() == weights[1][k].numpy().tobytes(), k


# ---------------------------------------------------------------- tool calls
def test_records_hold_the_calls_the_env_reported_not_a_parse_of_the_text() -> None:
    from agentrl.types import ToolCallRecord, Trajectory
    from agentrl.viewer import page_html

    t = Trajectory(task_id="t", group_id="g", prompt_ids=[1])
    # a call format no parser knows, reported by its env; then Hermes-looking text the env did not run
    t.append_model_tokens([2, 3], [-0.1, -0.2], 0, "!lookup key=a")
    t.turns[-1].tool_calls = [ToolCallRecord("lookup", {"key": "a"}, "alpha", latency_s=0.002, id="c0")]
    t.append_observation_tokens([4], "alpha")
    t.append_model_tokens(
        [5], [-0.3], 0, '<tool_call>{"name": "lookup", "arguments": {"key": "b"}}</tool_call>'
    )
    rec = json.loads(json.dumps(episode_record(t, "train", 1)))  # as written to and read from disk
    assert "tool_calls" not in rec  # one place for them: the turns
    assert [turn["tool_calls"] for turn in rec["turns"]] == [
        [
            {
                "name": "lookup",
                "arguments": {"key": "a"},
                "result": "alpha",
                "error": None,
                "latency_s": 0.002,
                "id": "c0",
            }
        ],
        [],
        [],
    ]
    assert to_trajectory(rec) == t
    # the viewer's detail of the episode: the reported call with its turn, nothing for the unrun text
    block = re.search(r'id="data-details">(.*?)</script>', page_html([rec], None), re.DOTALL)
    assert block is not None
    assert json.loads(block.group(1))["calls"] == [{"turn": 0, **rec["turns"][0]["tool_calls"][0]}]


# ---------------------------------------------------------------- bad files
def _write(path: Path, lines: list[str]) -> Path:
    with gzip.open(path, "wb") as f:
        f.write("".join(lines).encode())
    return path


def test_failed_training_episodes_are_dumped_marked_and_never_trained(tmp_path: Path) -> None:
    from agentrl.types import Status, Trajectory

    dump = EpisodeDump(tmp_path, DumpConfig(every=1))
    ok = Trajectory(task_id="a", group_id="g", prompt_ids=[1, 2], reward=1.0)
    bad = Trajectory(task_id="b", group_id="h", prompt_ids=[1, 2], status=Status.FAILED, error="env: boom")
    dump.train(1, [ok], {"logprobs": [[]], "threads": 1})
    dump.failed(1, [bad])
    assert dump.failed(1, []) is None  # nothing to write
    assert [r["task_id"] for r in read_dump(step_path(tmp_path, 1), kind="train")] == ["a"]
    [rec] = read_dump(step_path(tmp_path, 1), kind="failed")
    assert rec["status"] == "failed" and rec["error"] == "env: boom" and not rec["trained"]
    assert to_trajectory(rec) == bad
    dump.train(1, [ok], {"logprobs": [[]]})  # a resumed run rewrites its step: the old records go
    assert read_dump(step_path(tmp_path, 1), kind="failed") == []


def test_reader_names_file_and_line_of_a_bad_record_and_keeps_the_rest(tmp_path: Path) -> None:
    good = json.dumps({"kind": "train", "step": 1, "task_id": "t"}) + "\n"
    path = _write(tmp_path / "step_000001.jsonl.gz", [good, good, "{not json\n", good, '{"kind": "tr'])
    with pytest.raises(DumpError) as err:
        read_dump(path)
    assert err.value.path == str(path) and err.value.line == 3
    assert f"{path}, line 3: not a JSON record" in str(err.value)
    with pytest.warns(UserWarning) as caught:
        records = read_dump(path, errors="skip")
    assert len(records) == 3  # lines 1, 2 and 4
    messages = [str(w.message) for w in caught]
    assert messages == [
        f"{path}, line 3: not a JSON record (Expecting property name enclosed in double quotes: line 1 "
        "column 2 (char 1))",
        f"{path}, line 5: truncated record",
    ]
    _write(tmp_path / "x.gz", ["[1, 2]\n"])
    with pytest.raises(
        DumpError, match=r"x\.gz, line 1: not a JSON record \(a record is a JSON object, got list\)"
    ):
        read_dump(tmp_path / "x.gz")


def test_reader_names_a_cut_or_corrupt_gzip_file_and_reads_the_other_files(tmp_path: Path) -> None:
    run = synthetic_run(tmp_path / "run", episodes=96, groups_per_step=4, group_size=8)  # 3 steps of 32
    whole = step_path(run, 2).read_bytes()
    step_path(run, 2).write_bytes(whole[: len(whole) // 2])  # cut short, as by a crash mid-write
    with pytest.raises(DumpError) as err:
        read_dump(step_path(run, 2))
    assert err.value.path == str(step_path(run, 2)) and "the gzip stream is cut short" in str(err.value)
    assert err.value.line > 1  # the lines before the cut were read
    with pytest.warns(UserWarning, match=r"step_000002\.jsonl\.gz, line \d+: the gzip stream is cut short"):
        steps = dict(iter_steps(run, errors="skip"))
    assert len(steps[1]) == 32 and len(steps[3]) == 32  # the other files are whole
    assert 0 < len(steps[2]) < 32 and len(steps[2]) == err.value.line - 1

    step_path(run, 3).write_bytes(b"\x1f\x8b" + bytes(40))  # a gzip header with garbage behind it
    with pytest.raises(DumpError, match=r"step_000003\.jsonl\.gz, line 1: the gzip stream is corrupt"):
        read_dump(step_path(run, 3))
    step_path(run, 3).write_bytes(b"plain text, not gzip\n")
    with pytest.raises(DumpError, match=r"step_000003\.jsonl\.gz, line 1: the gzip stream is corrupt"):
        list(iter_dump(step_path(run, 3)))


# ---------------------------------------------------------------- a real run
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, search_r1_cache: Path) -> Path:
    tmp = tmp_path_factory.mktemp("episodes")
    cfg = tmp / "run.yaml"
    cfg.write_text(CONFIG.format(out=tmp / "run", cache=search_r1_cache))
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}  # no API key: offline
    proc = subprocess.run(
        [sys.executable, "train_async.py", "--config", str(cfg)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return tmp / "run"


@pytest.mark.slow
def test_run_dumps_every_trained_and_evaluated_episode(run_dir: Path) -> None:
    steps = dict(iter_steps(run_dir))
    assert sorted(steps) == [0, 1, 2]  # evaluation before training, then the two steps
    assert [r["kind"] for r in steps[0]] == ["eval"] * 4
    for step in (1, 2):
        train = [r for r in steps[step] if r["kind"] == "train"]
        assert len(train) == 8 and all(r["step"] == step for r in train)  # 2 groups x 4 samples
        for r in train:
            n = len(r["response_ids"])
            assert len(r["loss_mask"]) == len(r["rollout_logprobs"]) == len(r["policy_versions"]) == n
            assert r["trained"] and len(r["trainer_logprobs"]) == n
            # tokens sampled with the weights the trainer had (version step - 1): the same policy on both
            # sides (fp32 on CPU), up to rounding; older tokens (η = 1) differ by the update between
            fresh = zip(
                r["rollout_logprobs"],
                r["trainer_logprobs"],
                r["policy_versions"],
                r["loss_mask"],
                strict=True,
            )
            assert all(abs(a - b) < 1e-3 for a, b, v, m in fresh if m and v == step - 1)
            assert {v for v, m in zip(r["policy_versions"], r["loss_mask"], strict=True) if m} <= {
                step - 1,
                step - 2,
            }
            assert r["reward"] in (0.0, 1.0) and r["status"] in ("completed", "truncated")
            assert r["messages"][0]["role"] == "prompt" and "Question:" in r["messages"][0]["content"]
            assert [m["role"] for m in r["messages"][1:]] == [t["role"] for t in r["turns"]]
            for turn in r["turns"]:  # the searches SearchEnv ran, on the model turn that asked for them
                for call in turn["tool_calls"]:
                    assert turn["role"] == "assistant" and call["name"] == "search" and call["latency_s"] > 0
                    assert call["arguments"]["query"] in turn["text"]
                    assert (call["result"] is None) != (call["error"] is None)
        assert to_trajectory(train[0]).response_ids == train[0]["response_ids"]
    assert [r["kind"] for r in steps[2] if r["kind"] == "eval"] == ["eval"] * 4  # after the last step
    info = read_run_info(run_dir)
    assert info["max_staleness"] == 1 and info["trainer"]["lr"] == 1e-3 and info["trainer_threads"] >= 1


def _weights(step_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(step_dir / "rank_00000.pt", map_location="cpu", weights_only=False)["model"]


@pytest.mark.slow
def test_retrained_step_is_bit_identical_to_the_original(run_dir: Path, tmp_path: Path) -> None:
    """Step 2 trained again from its dump and the checkpoint of step 1, with no engine and no env, gives
    the weights the run had after step 2, byte for byte."""
    out = tmp_path / "retrained"
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.retrain", "--run", str(run_dir), "--step", "2", "--save", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads(proc.stdout.strip().splitlines()[-1])
    assert metrics["retrained_step"] == 2 and metrics["num_trajectories"] == 8
    before = _weights(run_dir / "checkpoints" / "step_00000001")
    original = _weights(run_dir / "checkpoints" / "step_00000002")
    retrained = _weights(out / "step_00000002")
    tensors = [k for k, v in original.items() if isinstance(v, torch.Tensor)]
    assert tensors and retrained.keys() == original.keys()
    assert any(before[k].numpy().tobytes() != original[k].numpy().tobytes() for k in tensors)  # it trained
    for k in tensors:  # the same bytes (torch.equal would pass -0.0 == 0.0)
        assert retrained[k].numpy().tobytes() == original[k].numpy().tobytes(), f"{k} differs"
    # the same loss as the run logged for its step 2
    logged = next(r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("policy_version") == 2)
    assert metrics["loss"] == logged["trainer/loss"] and metrics["grad_norm"] == logged["trainer/grad_norm"]


def _wandb_records(path: Path) -> list[Any]:
    """The records of a wandb run file: a 7-byte header (``:W&B``, key, version), then a LevelDB-style log
    of 32 KiB blocks whose chunks (CRC, length, type) carry serialized ``Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb run file"
    pos, buf, out, block = 7, b"", [], 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


@pytest.mark.slow
def test_wandb_offline_history_has_the_metrics_jsonl_rows(run_dir: Path) -> None:
    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    history: dict[int, dict[str, Any]] = {}
    for rec in _wandb_records(files[0]):
        if rec.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            history.setdefault(int(items["_step"]), {}).update(items)
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert sorted(history) == sorted({int(r["step"]) for r in rows}) == [0, 1, 2]
    for row in rows:  # every key and value of metrics.jsonl, at its step
        logged = history[int(row["step"])]
        for key, value in row.items():
            if key == "time":  # two rows of one step (the last step and the evaluation after it) differ
                assert isinstance(logged[key], float)
            elif key != "step":
                assert logged[key] == pytest.approx(value, rel=1e-12), key
    assert "trainer/loss" in history[1] and "batch/reward" in history[2]
    prefix = (
        "eval/episodes/"  # a logged table is a reference to its file: eval/episodes/{_type,path,nrows,...}
    )
    tables = {
        s: {k[len(prefix) :]: v for k, v in h.items() if k.startswith(prefix)} for s, h in history.items()
    }
    tables = {s: t for s, t in tables.items() if t}
    assert sorted(tables) == [0, 2] and all(
        t["_type"] == "table-file" and t["nrows"] == 4 for t in tables.values()
    )
    table = json.loads((files[0].parent / "files" / tables[2]["path"]).read_text())
    assert table["columns"][:3] == ["task_id", "reward", "status"] and len(table["data"]) == 4
    assert (run_dir / "tb").is_dir()  # TensorBoard stays


@pytest.mark.slow
def test_viewer_shows_an_episode_of_the_run_in_chromium(run_dir: Path, chromium: str, tmp_path: Path) -> None:
    from agentrl.testing.browser import Chromium

    page = tmp_path / "view.html"
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.viewer", str(run_dir), "-o", str(page)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    train = [r for r in read_dump(step_path(run_dir, 2), kind="train")]
    rewarded = next(r for r in train if r["reward"] == 1.0)

    async def look() -> tuple[str, str, str, int, list[str]]:
        async with Chromium(executable=chromium) as b:
            await b.goto(page.as_uri())
            await b.wait_for("window.agentrlViewerReady")
            # open the rewarded episode: step 2, its group and sample
            index = await b.evaluate(
                "ROWS.findIndex(r => r[0] === 2 && r[1] === 0 && r[2] === "
                f"{json.dumps(rewarded['group_id'])} && r[3] === {rewarded['sample_index']})"
            )
            await b.evaluate(f"window.agentrlViewer.select({index})")
            text = await b.evaluate("document.getElementById('detail').innerText")
            turn = await b.evaluate("document.querySelector('#detail .turn.assistant').textContent")
            reward = await b.evaluate("document.getElementById('detail-reward').textContent")
            await b.evaluate("document.getElementById('f-color').value = 'mismatch'")
            await b.evaluate("document.getElementById('f-color').dispatchEvent(new Event('input'))")
            tokens = await b.evaluate("document.querySelectorAll('#detail .tok').length")
            await b.screenshot(tmp_path / "viewer.png")
            return text, turn, reward, tokens, b.page_errors()

    text, turn, reward, tokens, errors = asyncio.run(look())
    assert not errors
    assert reward == "1.0000"
    first = rewarded["turns"][0]
    shown = re.sub(
        r"[\x00-\x08\x0b-\x1f\x7f]",
        lambda m: chr(0x2421 if m[0] == "\x7f" else 0x2400 + ord(m[0])),
        first["text"],
    )
    assert turn == f"model (tokens {first['start']}-{first['end']})" + shown  # the model's text, whole
    assert "Question:" in text and ("observation" in text) == any(
        t["role"] == "observation" for t in rewarded["turns"]
    )
    assert tokens == len(rewarded["response_ids"])  # one coloured span per response token
    assert (tmp_path / "viewer.png").stat().st_size > 10_000
