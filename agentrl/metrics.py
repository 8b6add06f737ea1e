"""Metrics and progress: the one place every component reports numbers through.

:class:`MetricsLogger` appends one JSON object per ``log`` call to ``metrics.jsonl`` (always) and
writes TensorBoard scalars when ``tensorboard`` is installed. :class:`ProgressLine` is a one-line console
display (a bar plus a few chosen metrics) that redraws in place on a terminal and prints plain lines
otherwise. Components keep their own counters and hand them over as flat ``{name: number}`` dicts.

With ``metrics.wandb`` set (:class:`WandbConfig`), the logger also sends every row to a wandb run (the
same keys as ``metrics.jsonl``; wandb's own step is the row's ``step``) and :meth:`MetricsLogger.log_table`
tables (the held-out episodes of each evaluation). Without an API key (``WANDB_API_KEY``) the wandb run is
offline: it is written under ``<output_dir>/wandb/`` and can be uploaded later with ``wandb sync``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Literal, Protocol, TextIO

from pydantic import Field

from agentrl.config import ConfigModel


class WandbConfig(ConfigModel):
    """A wandb run beside metrics.jsonl and TensorBoard (``metrics.wandb``)."""

    project: str = Field(description="wandb project")
    name: str | None = Field(None, description="run name (None: the name of output_dir)")
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="None: online when WANDB_API_KEY is set, else offline (files under <output_dir>/wandb)"
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
        self._file = self.path.open("a", buffering=1)
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

                self._tb = SummaryWriter(str(self.out_dir / "tb"))
            except Exception:  # tensorboard not installed: JSONL alone
                self._tb = None
        self._wandb = None if wandb is None else _start_wandb(wandb, self.out_dir, run_config)
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
            self._tb.flush()
            self._tb.close()
            self._tb = None
        if not self._file.closed:
            self._file.close()
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
        raise ImportError("metrics.wandb is set but wandb is not installed: pip install 'agentrl[wandb]'") from None
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
