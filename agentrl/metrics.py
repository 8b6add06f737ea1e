"""Metrics and progress: the one place every component reports numbers through.

:class:`MetricsLogger` appends one JSON object per ``log`` call to ``metrics.jsonl`` (always) and
writes TensorBoard scalars when ``tensorboard`` is installed. :class:`ProgressLine` is a one-line console
display (a bar plus a few chosen metrics, the latest held-out figures marked as such, the failures so far)
that redraws in place on a terminal and prints plain lines otherwise; above it, the first error of each
failure kind is printed once with its count (the episodes fail in the rollout's workers, whose logs the
console does not show). Components keep their own counters and hand them over as flat
``{name: number}`` dicts. The training loop's own figures live here too: :func:`batch_metrics` of a
step's batch (mean reward, and each verifier part as ``reward/<part>``), :func:`engine_metrics` read from
the engines, and :func:`step_time_summary` of a whole run.

With ``metrics.wandb`` set (:class:`WandbConfig`), the logger also sends every row to a wandb run (the
same keys as ``metrics.jsonl``; wandb's own step is the row's ``step``) and :meth:`MetricsLogger.log_table`
tables (the held-out episodes of each evaluation). Without an API key (``WANDB_API_KEY``) the wandb run is
offline: it is written under ``<output_dir>/wandb/`` and can be uploaded later with ``wandb sync``.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TextIO

from pydantic import Field

from agentrl.config import ConfigModel

if TYPE_CHECKING:
    from agentrl.types import Trajectory

FAILURES = "rollout/failures/"  # + kind: failed episodes (agentrl.rollout.metrics)
FIRST_ERROR = "rollout/first_error/"  # + kind: the text of that kind's first failure


class WandbConfig(ConfigModel):
    """A wandb run beside metrics.jsonl and TensorBoard (``metrics.wandb``)."""

    project: str = Field(description="wandb project")
    name: str | None = Field(None, description="run name (None: the name of output_dir)")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None,
        description="None: online when WANDB_API_KEY is set, else offline (files under <output_dir>/wandb)",
    )
    entity: str | None = Field(None, description="wandb entity (team or user); None: the default")
    tags: list[str] = Field(default_factory=list, description="tags of the wandb run")


class MetricsConfig(ConfigModel):
    """Where a run's metrics go besides ``metrics.jsonl`` (always written)."""

    tensorboard: bool = Field(True, description="TensorBoard scalars under <output_dir>/tb (when installed)")
    wandb: WandbConfig | None = Field(None, description="a wandb run, e.g. {project: agentrl}; None: off")


class MetricsSink(Protocol):
    """What a component needs to report: ``log({"rollout/turns_per_s": 3.2}, step=7)``."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...


def _clean(metrics: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, bool):
            v = float(v)
        if isinstance(v, int | float) and math.isfinite(float(v)):
            out[k] = float(v)
    return out


class _ScalarWriter:
    """TensorBoard scalars through the ``tensorboard`` package's own event writer (no torch: the driver
    does not load it for its metrics)."""

    def __init__(self, writer: Any, event: Any, summary: Any) -> None:
        self._writer, self._event, self._summary = writer, event, summary

    @classmethod
    def open(cls, logdir: Path) -> _ScalarWriter | None:
        """A writer of event files under ``logdir``, or None where tensorboard is not installed."""
        try:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:  # tensorboard not installed: JSONL alone
            return None
        return cls(EventFileWriter(str(logdir)), Event, Summary)

    def add_scalar(self, tag: str, value: float, step: int, wall_time: float) -> None:
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=float(value))])
        self._writer.add_event(self._event(wall_time=wall_time, step=int(step), summary=summary))

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


class MetricsLogger:
    """JSONL (always) + TensorBoard (when installed) + wandb (when configured) logger."""

    def __init__(
        self,
        out_dir: str | Path,
        tensorboard: bool = True,
        wandb: WandbConfig | None = None,
        run_config: dict[str, Any] | None = None,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        # one write call per row on an append-only descriptor: a reader of a live run sees whole lines,
        # and at most a last line still without its newline (read_metrics leaves that one out)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._tb = _ScalarWriter.open(self.out_dir / "tb") if tensorboard else None
        self._wandb = None if wandb is None else _start_wandb(wandb, self.out_dir, run_config)
        self.history: list[dict[str, float]] = []

    @property
    def tensorboard_enabled(self) -> bool:
        return self._tb is not None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        row = {"step": float(step), "time": time.time(), **_clean(metrics)}
        self.history.append(row)
        if self._fd is not None:
            os.write(self._fd, (json.dumps(row) + "\n").encode())
        if self._tb is not None:
            for k, v in row.items():
                if k not in ("step", "time"):
                    self._tb.add_scalar(k, v, step, row["time"])
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k != "step"}, step=step)

    def log_table(self, name: str, columns: list[str], rows: list[list[Any]], step: int) -> None:
        """A table (e.g. the held-out episodes of an evaluation) to wandb; nothing without wandb."""
        if self._wandb is not None:
            import wandb

            self._wandb.log({name: wandb.Table(columns=columns, data=rows)}, step=step)

    @property
    def wandb_run(self) -> Any:
        """The wandb run, or None."""
        return self._wandb

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _start_wandb(cfg: WandbConfig, out_dir: Path, run_config: dict[str, Any] | None) -> Any:
    """A wandb run writing under ``out_dir``; offline unless an API key is set or ``mode`` says so."""
    try:
        import wandb
    except ImportError:
        raise ImportError(
            "metrics.wandb is set but wandb is not installed: pip install 'agentrl[wandb]'"
        ) from None
    mode = cfg.mode or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    return wandb.init(
        project=cfg.project,
        name=cfg.name or out_dir.resolve().name,
        entity=cfg.entity,
        tags=cfg.tags or None,
        mode=mode,
        dir=str(out_dir),
        config=run_config,
        # no stdout capture (the progress line redraws in place) and no system-metrics sampler
        settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
    )


# A speculating embedded engine's counters (agentrl.embedded.speculative), in its stats and summed over
# engines into engine/...: verify steps, the rows they ran, drafted / accepted / emitted tokens, the
# decode steps the speculation gate chose not to verify drafts at, and the drafts taken from what other
# requests generated (engine.speculative.shared_tokens).
SPEC_COUNTERS = (
    "spec_verify_steps",
    "spec_verify_rows",
    "spec_draft_tokens",
    "spec_accepted_tokens",
    "spec_emitted_tokens",
    "spec_skipped_steps",
    "spec_shared_drafts",
)


# The keys of a metrics row that depend on wall-clock time: durations, rates, latencies and idle shares; the
# engines' batching counters and the prefix-cache hits the rollout reads from them (which prefixes are still
# cached when a turn comes depends on what else ran meanwhile); the rollout loop's and the retrieval
# servers' work; GPU memory peaks (the caching allocator's history). Two deterministic runs of one config
# agree on everything else (docs/design/deterministic-mode.md).
TIMING_KEYS = re.compile(
    r"^time$|^time/|_s$|_seconds$|per_s$|latency|idle_frac|_mem_gb$|^engine/|^engine_"
    r"|^rollout/(shard\d+/)?(loop_|cached_input_tokens$|prefix_cache_hit_rate$)|^retrieval/(?!workers$)"
)


def without_timings(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` less its :data:`TIMING_KEYS`: what two deterministic runs of one config give alike."""
    return {k: v for k, v in row.items() if not TIMING_KEYS.search(k)}


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """Rows of a metrics.jsonl file. A last line without its newline is a row a live run is still writing:
    it is left out."""
    text = Path(path).read_text()
    lines = text.split("\n")
    lines = lines[:-1]  # "" after a final newline, or the unfinished last row
    return [json.loads(line) for line in lines if line.strip()]


class ProgressLine:
    """A console progress line, e.g.
    ``step 3/20 [###--] train_reward=0.41 stale=0.6 | held-out@10 exact_match=0.38 | train_failed=2 45s``.

    ``keys`` maps a short label to a metric of the step (``train_reward``: the training batch's mean reward,
    new every step); ``held_out`` (``update``) is the latest held-out evaluation, ``(step, figures)``,
    shown after ``held-out@<step>`` so it is never taken for the training reward. The first error of each
    failure kind in the step's rollout figures (``rollout/first_error/<kind>``) is printed once, above the
    line, with its count (``rollout/failures/<kind>``); the line shows the failed training episodes so far
    (``train_failed=``)."""

    def __init__(
        self,
        total: int,
        keys: dict[str, str] | None = None,
        stream: TextIO | None = None,
        width: int = 24,
        label: str = "step",
    ) -> None:
        self.total = max(total, 1)
        self.keys = keys or {}
        self.stream = stream or sys.stderr
        self.width = width
        self.label = label
        self.start = time.monotonic()
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.last_line = ""
        self.reported: set[str] = set()  # failure kinds whose first error was printed

    def failure_notes(self, metrics: dict[str, Any]) -> list[str]:
        """One line per failure kind seen for the first time: its count so far and its first error."""
        notes = []
        for key in sorted(metrics):
            if not key.startswith(FAILURES):
                continue
            kind, count = key.removeprefix(FAILURES), metrics[key]
            if kind in self.reported or not isinstance(count, int | float) or count <= 0:
                continue
            self.reported.add(kind)
            first = metrics.get(FIRST_ERROR + kind)
            about = f"the first: {first}" if first else "see the rollout workers' logs"
            notes.append(f"rollout: {count:g} {kind} failure(s) so far; {about}")
        return notes

    def update(
        self,
        done: int,
        metrics: dict[str, Any] | None = None,
        held_out: tuple[int, dict[str, float]] | None = None,
    ) -> str:
        metrics = metrics or {}
        frac = min(max(done / self.total, 0.0), 1.0)
        filled = int(frac * self.width)
        parts = [f"{self.label} {done}/{self.total}", "[" + "#" * filled + "-" * (self.width - filled) + "]"]
        for short, key in self.keys.items():
            v = metrics.get(key)
            if isinstance(v, int | float):
                parts.append(f"{short}={v:.3g}")
        if held_out and held_out[1]:
            figures = " ".join(f"{k.rsplit('/', 1)[-1]}={v:.3g}" for k, v in held_out[1].items())
            parts.append(f"| held-out@{held_out[0]} {figures}")
        failed = metrics.get("rollout/failures_total")
        if isinstance(failed, int | float) and failed > 0:
            parts.append(f"| train_failed={failed:g}")
        parts.append(f"{time.monotonic() - self.start:.0f}s")
        line = " ".join(parts)
        self.last_line = line
        notes = self.failure_notes(metrics)
        if self._tty:
            self.stream.write(
                "".join("\r" + n.ljust(100) + "\n" for n in notes) + "\r" + line.ljust(100)[:160]
            )
        else:
            self.stream.write("".join(n + "\n" for n in notes) + line + "\n")
        self.stream.flush()
        return line

    def close(self) -> None:
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()


# ---- the training loop's own figures of a step, and of the run ---------------------------------------
def batch_metrics(batch: list[Trajectory], version: int) -> dict[str, float]:
    """The loop's own figures for a training batch (the recipe may add its own): the mean reward, the mean
    of each part a verifier named (``RewardResult.parts``) as ``reward/<part>``, turns, tokens, staleness;
    for tree rollouts the tree figures (``tree/...``: :func:`agentrl.rollout.tree.tree_stats`)."""
    from agentrl.rollout.tree import tree_stats  # the rollout package imports this module

    rewards = [t.reward or 0.0 for t in batch]
    stale = [version - t.min_policy_version for t in batch if t.min_policy_version is not None]
    parts: dict[str, list[float]] = {}  # the verifier's named parts, each over the trajectories that have it
    for t in batch:
        for name, value in t.reward_parts.items():
            parts.setdefault(name, []).append(float(value))
    return {
        "batch/reward": sum(rewards) / max(1, len(rewards)),
        **{f"reward/{name}": sum(vals) / len(vals) for name, vals in parts.items()},
        "batch/turns": sum(t.num_turns for t in batch) / max(1, len(batch)),
        "batch/response_tokens": sum(len(t.response_ids) for t in batch) / max(1, len(batch)),
        "batch/staleness_mean": sum(stale) / max(1, len(stale)),
        "batch/staleness_max": float(max(stale, default=0)),
        **tree_stats(batch),
    }


# the embedded engine's counters of where its device time went (agentrl.engine.account reads a window's)
ENGINE_COUNTERS = (
    "busy_s",
    "prefill_busy_s",
    "decode_busy_s",
    "decode_steps",
    "decode_rows",
    "prefill_steps",
)


async def engine_metrics(client: Any) -> dict[str, float]:
    """The engines' peak GPU memory (GiB, the largest over engines) as they report it in
    ``/get_server_info``, and their cumulative counters summed over engines (the embedded engine's: device
    busy seconds in all and by step kind, decode steps and rows, prefill steps, rows and tokens, cached
    tokens, slot copies, speculative verify steps and rows, drafted and accepted tokens); empty when none
    reports them."""
    try:
        infos = await client.server_info()
    except Exception:  # a metric is not worth failing a step for
        return {}
    peaks = [float(i["peak_gpu_mem_gb"]) for i in infos if isinstance(i.get("peak_gpu_mem_gb"), int | float)]
    out = {"engine/peak_gpu_mem_gb": max(peaks)} if peaks else {}
    counters = (
        *ENGINE_COUNTERS,
        "prefill_rows",
        "prefill_tokens",
        "cached_tokens",
        "slot_copies",
        # speculative decoding (agentrl.embedded.speculative): its verify steps and their tokens
        "verify_busy_s",
        *SPEC_COUNTERS,
    )
    for key in counters:
        vals = [float(i[key]) for i in infos if isinstance(i.get(key), int | float)]
        if vals:
            out[f"engine/{key}"] = sum(vals)
    if "engine/busy_s" in out:  # when the counters were read, and over how many engines they are summed
        out["engine/read_time"] = time.time()
        out["engine/engines"] = float(sum(isinstance(i.get("busy_s"), int | float) for i in infos))
    return out


# figures of a step's window whose run means summary.json keeps (as ``rollout_loop_busy_frac``, ...)
WINDOW_LOAD_PREFIXES = ("rollout/loop_", "retrieval/")


def step_time_summary(history: list[dict[str, float]]) -> dict[str, float]:
    """Means over the run's steps of the step-time breakdown (every ``time/*`` figure: waiting for the
    batch, training, syncing, and when colocated the sleep / wake / offload phases inside them), the
    engines' idle fraction and generated tokens/s over the loop, the load of the rollout's event loop and
    of the retrieval server (:data:`WINDOW_LOAD_PREFIXES`; weighted by step time like the idle fraction),
    and the peak GPU memory seen."""
    out: dict[str, float] = {}
    steps = [r for r in history if "time/step_s" in r]
    for key in sorted({k for r in steps for k in r if k.startswith("time/")}):
        vals = [r[key] for r in steps if key in r]
        out[f"mean_{key.removeprefix('time/')}"] = sum(vals) / len(vals)
    # the rollout's figures cover the window since the previous step: weight them by its length
    windowed = {
        "rollout/engine_idle_frac": "engine_idle_frac",
        "rollout/model_tokens_per_s": "generated_tokens_per_s",
    }
    for key in sorted({k for r in steps for k in r if k.startswith(WINDOW_LOAD_PREFIXES)}):
        windowed[key] = key.replace("/", "_")  # the event loop's and the retrieval server's load
    for key, name in windowed.items():
        rows = [r for r in steps if key in r]
        wall = sum(r["time/step_s"] for r in rows)
        if wall > 0:
            out[name] = sum(r[key] * r["time/step_s"] for r in rows) / wall
    busy = [r for r in steps if "engine/busy_s" in r]
    if len(busy) > 1:  # the engines' own device time (a mean over them) over the wall time between reads
        first, last = busy[0], busy[-1]
        delta = {k: last[k] - first.get(k, 0.0) for k in last if k.startswith("engine/")}
        # engine_metrics stamps every read that has busy_s, with the count of engines it sums
        out["engine_device_busy_frac"] = (
            delta["engine/busy_s"] / delta["engine/read_time"] / last["engine/engines"]
        )
        if delta.get("engine/decode_steps"):
            out["engine_decode_steps_per_step"] = delta["engine/decode_steps"] / (len(busy) - 1)
            out["engine_rows_per_decode_step"] = (
                delta.get("engine/decode_rows", 0.0) / delta["engine/decode_steps"]
            )
        out["engine_prefill_tokens_per_step"] = delta.get("engine/prefill_tokens", 0.0) / (len(busy) - 1)
        for kind in ("prefill", "decode", "verify"):  # where the engines' device time goes, per RL step
            if f"engine/{kind}_busy_s" in delta:
                out[f"engine_{kind}_busy_s_per_step"] = delta[f"engine/{kind}_busy_s"] / (len(busy) - 1)
        if delta.get("engine/spec_verify_rows"):  # tokens a verify step adds per request, beyond one
            out["engine_spec_accepted_per_verify_row"] = (
                delta.get("engine/spec_accepted_tokens", 0.0) / delta["engine/spec_verify_rows"]
            )
        if delta.get("engine/prefill_steps"):
            out["engine_prefill_steps_per_step"] = delta["engine/prefill_steps"] / (len(busy) - 1)
    for key in ("trainer/peak_gpu_mem_gb", "engine/peak_gpu_mem_gb"):
        vals = [r[key] for r in history if key in r]
        if vals:
            out[key.replace("/", "_")] = max(vals)
    return out
