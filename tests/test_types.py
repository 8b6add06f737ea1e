"""The Trajectory record's plain-dict form: what goes to the trainer actors and into episode dumps."""

from __future__ import annotations

from dataclasses import asdict

from agentrl.types import Status, ToolCallRecord, Trajectory, Turn


def _trajectory() -> Trajectory:
    t = Trajectory(
        task_id="t1",
        group_id="g1",
        prompt_ids=[5, 6, 7],
        label={"answers": ["x"]},
        info={"searches": [{"query": "q", "hits": 2}]},
        reward=1.0,
        reward_parts={"em": 1.0},
    )
    t.append_model_tokens([8, 9], [-0.5, -0.25], 3, text="ab")
    t.turns[-1].tool_calls = [
        ToolCallRecord("search", {"query": "q", "filters": {"year": 2024}}, "c", latency_s=0.25, id="call0"),
        ToolCallRecord(None, error="tool call #2: invalid JSON"),
    ]
    t.append_observation_tokens([10], text="c")
    t.status, t.timings = Status.TRUNCATED, {"generate_s": 0.1}
    return t


def test_to_dict_is_asdict_with_fresh_containers_and_round_trips() -> None:
    t = _trajectory()
    d = t.to_dict()
    assert d == {**asdict(t), "status": "truncated"}
    d["prompt_ids"].append(0)
    d["info"]["searches"][0]["hits"] = 9
    d["turns"][0]["end"] = 99
    d["label"]["answers"].append("y")
    assert t.prompt_ids == [5, 6, 7] and t.info["searches"][0]["hits"] == 2
    assert t.turns[0] == Turn("assistant", 0, 2, "ab", _trajectory().turns[0].tool_calls)
    assert t.label == {"answers": ["x"]}
    back = Trajectory.from_dict(t.to_dict())
    assert back == t and Trajectory.from_json(t.to_json()) == t


def test_tool_calls_round_trip_as_records_and_old_dicts_read_without_them() -> None:
    t = _trajectory()
    d = t.to_dict()
    assert d["turns"][0]["tool_calls"][0] == {
        "name": "search",
        "arguments": {"query": "q", "filters": {"year": 2024}},
        "result": "c",
        "error": None,
        "latency_s": 0.25,
        "id": "call0",
    }
    d["turns"][0]["tool_calls"][0]["arguments"]["filters"]["year"] = 1999  # a copy, not the record
    assert t.turns[0].tool_calls[0].arguments["filters"] == {"year": 2024}
    back = Trajectory.from_json(t.to_json())
    assert all(isinstance(c, ToolCallRecord) for c in back.turns[0].tool_calls)
    assert back.turns[0].tool_calls == t.turns[0].tool_calls and back.turns[1].tool_calls == []
    # a dict written before turns carried tool calls (an older episode dump) reads back with none
    for turn in d["turns"]:
        del turn["tool_calls"]
    assert [turn.tool_calls for turn in Trajectory.from_dict(d).turns] == [[], []]
