"""Metrics and progress: the one place every component reports numbers through.

:class:`MetricsLogger` appends one JSON object per ``log`` call to ``metrics.jsonl`` (always) and
writes TensorBoard scalars when ``tensorboard`` is installed. :class:`ProgressLine` is a one-line console
display (a bar plus a few chosen metrics) that redraws in place on a terminal and prints plain lines
otherwise. Components keep their own counters and hand them over as flat ``{name: number}`` dicts.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Protocol, TextIO


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


class MetricsLogger:
    """JSONL (always) + TensorBoard (when installed) scalar logger."""

    def __init__(self, out_dir: str | Path, tensorboard: bool = True) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        self._file = self.path.open("a", buffering=1)
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

                self._tb = SummaryWriter(str(self.out_dir / "tb"))
            except Exception:  # tensorboard not installed: JSONL alone
                self._tb = None
        self.history: list[dict[str, float]] = []

    @property
    def tensorboard_enabled(self) -> bool:
        return self._tb is not None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        row = {"step": float(step), "time": time.time(), **_clean(metrics)}
        self.history.append(row)
        self._file.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k not in ("step", "time"):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """Rows of a metrics.jsonl file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class ProgressLine:
    """A console progress line: ``step 3/20 [#####-----] reward=0.41 em=0.38 stale=0.6 12.3 tok/s``."""

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

    def update(self, done: int, metrics: dict[str, Any] | None = None) -> str:
        frac = min(max(done / self.total, 0.0), 1.0)
        filled = int(frac * self.width)
        parts = [f"{self.label} {done}/{self.total}", "[" + "#" * filled + "-" * (self.width - filled) + "]"]
        for short, key in self.keys.items():
            v = (metrics or {}).get(key)
            if isinstance(v, int | float):
                parts.append(f"{short}={v:.3g}")
        parts.append(f"{time.monotonic() - self.start:.0f}s")
        line = " ".join(parts)
        self.last_line = line
        if self._tty:
            self.stream.write("\r" + line.ljust(100)[:160])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        return line

    def close(self) -> None:
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()
