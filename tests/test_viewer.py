"""The episode viewer (agentrl.viewer) in headless Chromium: a page of 10,000 synthetic episodes loads,
renders only the rows in view, filters, and opens an episode's turns, tool calls and tokens on demand;
the page is self-contained, and the command line writes and serves it."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

from agentrl.episodes import iter_steps
from agentrl.testing.browser import Chromium
from agentrl.testing.episodes import synthetic_run
from agentrl.viewer import build_page

ROOT = Path(__file__).resolve().parent.parent


def _set(field: str, value: str) -> str:
    return (
        f"(() => {{ const e = document.getElementById('{field}'); e.value = {json.dumps(value)}; "
        "e.dispatchEvent(new Event('input')); return window.agentrlViewer.shown().length; })()"
    )


def test_ten_thousand_episodes_load_filter_and_open(tmp_path: Path, chromium: str) -> None:
    run = synthetic_run(tmp_path / "run", episodes=10_000)
    page = tmp_path / "view.html"
    html = build_page(run, page)
    # self-contained: no script, style or image from anywhere else
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", html)
    records = _all(run)

    async def drive() -> dict:
        async with Chromium(executable=chromium) as b:
            await b.goto(page.as_uri())
            await b.wait_for("window.agentrlViewerReady")
            out = {
                "rows": await b.evaluate("ROWS.length"),
                "dom_rows": await b.evaluate("document.querySelectorAll('.row').length"),
                "count": await b.evaluate("document.getElementById('count').textContent"),
            }
            # steps 1 and 2 only (click their chips in turn), then the filters on top
            out["step1"] = await b.evaluate(
                "document.querySelector('#steps span[data-step=\"1\"]').click(); "
                "window.agentrlViewer.shown().length"
            )
            await b.evaluate("document.querySelector('#steps span[data-step=\"\"]').click()")
            out["failed"] = await b.evaluate(_set("f-status", "failed"))
            out["truncated"] = await b.evaluate(_set("f-status", "truncated"))
            await b.evaluate(_set("f-status", ""))
            out["reward1"] = await b.evaluate(_set("f-rmin", "1"))
            await b.evaluate(_set("f-rmin", ""))
            # the last episode: scroll to it, click its row, read its detail
            await b.evaluate("document.getElementById('list').scrollTop = 1e9")
            await b.evaluate("new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
            last = await b.evaluate("ROWS.length - 1")
            await b.evaluate(f"document.querySelector('.row[data-i=\"{last}\"]').click()")
            out["detail"] = await b.evaluate("document.getElementById('detail').innerText")
            out["reward"] = await b.evaluate("document.getElementById('detail-reward').textContent")
            out["tokens_text_mode"] = await b.evaluate("document.querySelectorAll('#detail .tok').length")
            out["tokens"] = await b.evaluate(
                _set("f-color", "logprob") + " && document.querySelectorAll('#detail .tok').length"
            )
            out["errors"] = b.page_errors()
            await b.screenshot(tmp_path / "viewer.png")
            return out

    out = asyncio.run(drive())
    assert out["errors"] == []
    assert out["rows"] == 10_000 and out["count"] == "10000 of 10000 episodes"
    assert 0 < out["dom_rows"] < 100  # only the rows in view exist
    assert out["step1"] == 32
    assert out["failed"] == sum(r["status"] == "failed" for r in records) > 0
    assert out["truncated"] == sum(r["status"] == "truncated" for r in records) > 0
    assert out["reward1"] == sum(r["reward"] == 1.0 for r in records) > 0
    last = records[-1]
    assert out["reward"] == ("-" if last["reward"] is None else f"{last['reward']:.4f}")
    assert last["turns"][0]["text"] in out["detail"] and last["turns"][1]["text"] in out["detail"]
    assert "search" in out["detail"] and " ms" in out["detail"]  # the tool call and its latency
    assert out["tokens_text_mode"] == 0 and out["tokens"] == len(last["response_ids"])
    assert (tmp_path / "viewer.png").stat().st_size > 10_000


def _all(run: Path) -> list[dict]:
    """Every record of a run, in the page's order."""
    return sorted(
        (r for _, recs in iter_steps(run) for r in recs),
        key=lambda r: (r["step"], r["group_id"], r["sample_index"]),
    )


def test_viewer_command_writes_and_serves_the_page(tmp_path: Path) -> None:
    run = synthetic_run(tmp_path / "run", episodes=40)
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.viewer", str(run), "-o", str(tmp_path / "v.html")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "task1_0" in (tmp_path / "v.html").read_text()
    server = subprocess.Popen(
        [sys.executable, "-m", "agentrl.viewer", str(run), "--serve"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert url, line
        with urllib.request.urlopen(url.group(0), timeout=30) as r:
            body = r.read().decode()
        assert r.status == 200 and "task1_0" in body and "agentrlViewerReady" in body
    finally:
        server.terminate()
        server.wait(30)


def test_viewer_command_names_a_missing_run(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.viewer", str(tmp_path / "nope")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and f"{tmp_path / 'nope'}/trajectories does not exist" in proc.stderr


def test_page_escapes_script_closing_text(tmp_path: Path) -> None:
    """Episode text that contains </script> or HTML stays text: the page still parses and shows it."""
    from agentrl.viewer import page_html

    rec = {
        "kind": "train",
        "step": 1,
        "group_id": "g",
        "sample_index": 0,
        "task_id": "</script><b>x",
        "reward": 1.0,
        "status": "completed",
        "response_ids": [0],
        "loss_mask": [1],
        "rollout_logprobs": [-0.5],
        "policy_versions": [0],
        "turns": [{"role": "assistant", "start": 0, "end": 1, "text": "</script>é"}],
    }
    html = page_html([rec], ["</script>"])
    assert html.count("</script>") == html.count("<script")  # only the page's own script tags close
    assert "\\u003c/script>" in html


def test_calls_table_cuts_long_results_and_reads_format_1_dumps() -> None:
    """A call's result is cut in the page (the observation turn holds it whole); a dump written before
    turns carried their calls shows its one list of calls."""
    from agentrl.viewer import RESULT_CHARS, page_html

    def detail(rec: dict) -> dict:
        block = re.search(r'id="data-details">(.*?)</script>', page_html([rec], None), re.DOTALL)
        assert block is not None
        return json.loads(block.group(1))

    call = {
        "name": "python",
        "arguments": {"code": "print('x' * 5000)"},
        "result": "x" * 5000,
        "error": None,
        "latency_s": 0.5,
        "id": None,
    }
    rec = {
        "kind": "train",
        "step": 1,
        "group_id": "g",
        "sample_index": 0,
        "task_id": "t",
        "reward": 1.0,
        "status": "completed",
        "response_ids": [0, 1],
        "loss_mask": [1, 0],
        "rollout_logprobs": [-0.5, 0.0],
        "policy_versions": [0, -1],
        "turns": [
            {"role": "assistant", "start": 0, "end": 1, "text": "a", "tool_calls": [call]},
            {"role": "observation", "start": 1, "end": 2, "text": "x" * 5000},
        ],
    }
    [shown] = detail(rec)["calls"]
    assert shown["result"] == "x" * RESULT_CHARS + " ..." and shown["turn"] == 0 and shown["latency_s"] == 0.5
    assert rec["turns"][0]["tool_calls"][0]["result"] == "x" * 5000  # the record itself is left whole
    old = {
        **rec,
        "turns": [{k: v for k, v in t.items() if k != "tool_calls"} for t in rec["turns"]],
        "tool_calls": [{"turn": 0, "name": "search", "arguments": {"query": "q"}, "latency_s": 0.1}],
    }
    assert detail(old)["calls"] == old["tool_calls"]
