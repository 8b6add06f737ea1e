"""The episode viewer: one self-contained HTML page for a run's dumps (:mod:`agentrl.episodes`).

    python -m agentrl.viewer runs/x -o view.html       # write the page
    python -m agentrl.viewer runs/x --serve            # serve it on 127.0.0.1 (a free port; --port N)

The page shows the steps (mean reward each), the episodes of every step and group with their rewards
and status, filters (train / eval, status such as failed or truncated, a reward range, task or group
text), and one episode at a time: its prompt, model turns and observations told apart, the tool calls
the env ran (arguments, result or error, latency), the reward parts and any error, and its tokens
coloured by rollout logprob or by the engine-trainer mismatch ``|rollout logprob - trainer logprob|``.
A leaf of a tree rollout shows its path in the list (``3 · 1.0``: tree 3, child 1 then child 0), the
other leaves of its tree with their rewards, and its turns before each branch point marked as shared.

It stays fast at tens of thousands of episodes: the page embeds one compact row per episode (parsed at
load), and each episode's detail as one line of JSON in a plain-text block that is parsed only when the
episode is opened; the list renders only the rows in view. Token texts come from the run's
``trajectories/tokens.json`` (only the ids the episodes use are embedded).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from importlib.resources import files
from pathlib import Path
from typing import Any

from agentrl.episodes import Errors, iter_steps, read_tokens

_PLACEHOLDER = re.compile(r"__(TITLE|META|ROWS|VOCAB|DETAILS)__")


def _round(xs: list[float] | None, digits: int = 4) -> list[float | None] | None:
    if xs is None:
        return None
    return [None if x is None else round(float(x), digits) for x in xs]


def _gap(rec: dict[str, Any]) -> float | None:
    """The largest |rollout - trainer| logprob gap over the model tokens (None without trainer logprobs)."""
    tlp = rec.get("trainer_logprobs")
    if not tlp:
        return None
    gaps = [
        abs(a - b)
        for a, b, m in zip(rec["rollout_logprobs"], tlp, rec["loss_mask"], strict=False)
        if m and b is not None
    ]
    return round(max(gaps), 6) if gaps else None


RESULT_CHARS = 300  # of a call's result in the calls table (the observation turn shows it whole)


def _calls(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """The tool calls of a record as the env reported them on its turns, each with ``turn`` (its model
    turn, from 0) and its result cut to ``RESULT_CHARS``; a format-1 dump kept one list parsed from the
    text."""
    assistant = [t for t in rec.get("turns", []) if t["role"] == "assistant"]
    calls = [{"turn": i, **c} for i, t in enumerate(assistant) for c in t.get("tool_calls") or []]
    for c in calls:
        if isinstance(c.get("result"), str) and len(c["result"]) > RESULT_CHARS:
            c["result"] = c["result"][:RESULT_CHARS] + " ..."
    return calls or rec.get("tool_calls") or []


def _path(rec: dict[str, Any]) -> str | None:
    """A tree leaf's path as ``"1.0"`` (the child taken at each branch point); None for a flat episode."""
    tree = rec.get("tree")
    return None if not tree else ".".join(map(str, tree.get("path", []))) or "root"


def _json(obj: Any) -> str:
    # ASCII only, so the page's character offsets are the same in Python and JavaScript, and no "<" so
    # no text can close the <script> block it sits in
    return json.dumps(obj, ensure_ascii=True, separators=(",", ":"), default=str).replace("<", "\\u003c")


KIND_CODES = {"train": 0, "eval": 1, "failed": 2}  # a row's kind column (page.html names them again)


def page_html(records: Iterable[dict[str, Any]], tokens: list[str] | None, title: str = "run") -> str:
    """The viewer page for dump records (any order; shown by step, kind, group, sample)."""
    recs = sorted(
        records,
        key=lambda r: (
            r.get("step", 0),
            r.get("kind") != "train",
            str(r.get("group_id")),
            r.get("sample_index", 0),
            (r.get("tree") or {}).get("path", []),  # a tree's leaves in path order
        ),
    )
    rows, details, used = [], [], set()
    offset = 0
    for rec in recs:
        ids = rec.get("response_ids") or []
        used.update(ids)
        detail = _json(
            {
                "prompt": rec.get("prompt_text"),
                "turns": [[t["role"], t["start"], t["end"], t.get("text", "")] for t in rec.get("turns", [])],
                "ids": ids,
                "mask": rec.get("loss_mask") or [],
                "lp": _round(rec.get("rollout_logprobs")) or [],
                "tlp": _round(rec.get("trainer_logprobs")),
                "v": rec.get("policy_versions") or [],
                "calls": _calls(rec),
                "parts": rec.get("reward_parts") or {},
                "error": rec.get("error"),
                "tree": rec.get("tree"),
            }
        )
        rows.append(
            [
                rec.get("step", 0),
                KIND_CODES.get(rec.get("kind"), 1),
                str(rec.get("group_id", "")),
                rec.get("sample_index", 0),
                str(rec.get("task_id", "")),
                None if rec.get("reward") is None else round(float(rec["reward"]), 6),
                rec.get("status", "completed"),
                sum(1 for t in rec.get("turns", []) if t["role"] == "assistant"),
                len(ids),
                offset,
                len(detail),
                1 if rec.get("trained") else 0,
                _gap(rec),
                _path(rec),
            ]
        )
        details.append(detail)
        offset += len(detail) + 1  # the newline between lines
    vocab = {str(i): tokens[i] for i in sorted(used) if tokens is not None and 0 <= i < len(tokens)}
    meta = {"title": title, "episodes": len(rows), "select": 0 if rows else None}
    values = {
        "TITLE": title.replace("&", "&amp;").replace("<", "&lt;"),
        "META": _json(meta),
        "ROWS": _json(rows),
        "VOCAB": _json(vocab),
        "DETAILS": "\n".join(details),
    }
    template = files("agentrl.viewer").joinpath("page.html").read_text(encoding="utf-8")
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def build_page(run_dir: str | Path, out: str | Path | None = None, errors: Errors = "skip") -> str:
    """The viewer page of a run (every dump file; a corrupt one loses only what cannot be read, with a
    warning naming the file and line, unless ``errors="raise"``); written to ``out`` when given."""
    run_dir = Path(run_dir)
    records = [r for _, recs in iter_steps(run_dir, errors=errors) for r in recs]
    html = page_html(records, read_tokens(run_dir), title=run_dir.resolve().name)
    if out is not None:
        Path(out).write_text(html, encoding="utf-8")
    return html
