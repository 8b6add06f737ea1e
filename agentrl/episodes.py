"""Episode dumps: every trained and evaluated trajectory of a run, written to disk and read back.

With ``rollout.dump`` on, ``train_async.py`` writes under ``<output_dir>/trajectories/``:

* ``step_000012.jsonl.gz``: one JSON record per line, the episodes of step 12's training batch
  (``"kind": "train"``, in the order the trainer got them), the training episodes that failed while it
  was gathered (``"kind": "failed"``: status failed, with the error; never trained) and, when an
  evaluation ran after that step, its episodes (``"kind": "eval"``; step 0 holds the evaluation before
  training);
* ``run.json``: what a retrain (:mod:`agentrl.retrain`) needs besides the episodes (the trainer's config, η,
  its thread count);
* ``tokens.json``: the text of every token id (what the viewer shows per token).

A record is the :class:`~agentrl.types.Trajectory` (``to_dict``: token ids, loss mask, rollout logprobs,
policy version per token, turns with the tool calls the env ran for each model turn, reward and its parts,
status and error, timings, info, and for a tree rollout's leaf its ``tree`` position: tree id, path,
branch turns and offsets) plus: ``kind``, ``step``, ``trained`` (a train record the trainer used:
not failed, rewarded), ``trainer_logprobs`` (π_old of the same response tokens, as the trainer computed
them; ``null`` for eval records and for tokens it did not train), ``prompt_text`` and ``messages``
(prompt, model text and observations in order). The tool calls are what the env reported
(``StepResult.tool_calls``: name, arguments, result or error, latency), never re-parsed from the text,
so an env with a call format of its own dumps its calls as they ran.

Reading: :func:`read_dump` (one file), :func:`iter_steps` (a run, step by step), :func:`to_trajectory`.
A corrupt or truncated file raises :class:`DumpError` naming the file and the line; with
``errors="skip"`` the readable records are kept and each problem is reported as a warning.
"""

from __future__ import annotations

import gzip
import json
import re
import warnings
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from agentrl.config import ConfigModel
from agentrl.types import Status, Trajectory

DUMP_DIR = "trajectories"
FORMAT = 2  # 2: tool calls as the env reported them, on the turns (1: one list parsed from the text)
_STEP_FILE = re.compile(r"^step_(\d+)\.jsonl\.gz$")
_TRAJ_FIELDS = {f.name for f in fields(Trajectory)}
Errors = Literal["raise", "skip"]


class DumpConfig(ConfigModel):
    """Which steps' trajectories ``train_async.py`` writes (``rollout.dump``). Shorthands:
    ``dump: all`` (or ``true``) is every step, ``dump: 5`` every 5th, ``dump: off`` (or ``false``) none."""

    every: int = Field(
        0, ge=0, description="write the trajectories of every N-th training step (1: all; 0: off)"
    )
    eval: bool = Field(True, description="also write the evaluated episodes (kind 'eval') when dumping is on")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        if isinstance(data, bool):
            return {"every": int(data)}
        if isinstance(data, int):
            return {"every": data}
        if isinstance(data, str):
            word = data.strip().lower()
            if word in ("all", "on"):
                return {"every": 1}
            if word in ("off", "none"):
                return {"every": 0}
            raise ValueError(f"expected all, off, a step interval or {{every: N, eval: bool}}; got {data!r}")
        return data

    @property
    def enabled(self) -> bool:
        return self.every > 0

    def wants(self, step: int) -> bool:
        """Whether training step ``step`` (1-based) is written."""
        return self.enabled and step % self.every == 0


class DumpError(ValueError):
    """A dump file that cannot be read: names the file and the line."""

    def __init__(self, path: str | Path, line: int, reason: str) -> None:
        self.path, self.line, self.reason = str(path), line, reason
        super().__init__(f"{self.path}, line {line}: {reason}")


def step_path(run_dir: str | Path, step: int) -> Path:
    """``<run_dir>/trajectories/step_000012.jsonl.gz``."""
    return Path(run_dir) / DUMP_DIR / f"step_{step:06d}.jsonl.gz"


# ---- writing ---------------------------------------------------------------------------------------
def episode_record(
    traj: Trajectory,
    kind: str,
    step: int,
    trainer_logprobs: list[float] | None = None,
    prompt_text: str | None = None,
    trained: bool = False,
) -> dict[str, Any]:
    """One dump record (see the module docstring)."""
    messages = [{"role": "prompt", "content": prompt_text}] if prompt_text is not None else []
    messages += [{"role": t.role, "content": t.text} for t in traj.turns]
    return {
        "kind": kind,
        "step": step,
        "trained": trained,
        **traj.to_dict(),
        "trainer_logprobs": trainer_logprobs,
        "prompt_text": prompt_text,
        "messages": messages,
    }


def episode_table(trajs: Sequence[Trajectory], max_chars: int = 2000) -> tuple[list[str], list[list[Any]]]:
    """Columns and rows of a table of episodes (what a wandb evaluation table shows): task, reward,
    status, turns, response tokens, error and the model's text (cut to ``max_chars``)."""
    columns = ["task_id", "reward", "status", "turns", "response_tokens", "error", "text"]
    rows = [
        [
            t.task_id,
            t.reward,
            t.status.value,
            t.num_turns,
            len(t.response_ids),
            t.error,
            "".join(u.text for u in t.turns)[:max_chars],
        ]
        for t in trajs
    ]
    return columns, rows


class EpisodeDump:
    """Writes a run's dumps (see the module docstring). ``model_dir``: its tokenizer gives the prompt
    text and ``tokens.json``; ``run_info``: what :mod:`agentrl.retrain` needs (trainer config, η)."""

    def __init__(
        self,
        output_dir: str | Path,
        cfg: DumpConfig,
        model_dir: str | None = None,
        run_info: dict[str, Any] | None = None,
    ) -> None:
        self.cfg = cfg
        self.dir = Path(output_dir) / DUMP_DIR
        self.run_info = {"format": FORMAT, **(run_info or {})}
        self.model_dir = model_dir
        self._tok: Any = None
        if cfg.enabled:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._write_json("run.json", self.run_info)

    def _write_json(self, name: str, obj: Any) -> None:
        tmp = self.dir / f"{name}.tmp"
        tmp.write_text(json.dumps(obj))
        tmp.replace(self.dir / name)

    def _tokenizer(self) -> Any:
        if self._tok is None and self.model_dir is not None:
            from transformers import AutoTokenizer

            try:
                self._tok = AutoTokenizer.from_pretrained(self.model_dir)
            except Exception as err:  # the dumps stay whole without it: only the texts are missing
                warnings.warn(
                    f"episode dumps: no tokenizer in {self.model_dir} "
                    f"({err}); prompt and token texts left out",
                    stacklevel=2,
                )
                self.model_dir = None
                return None
            n = len(self._tok)
            # one string per id, decoded alone (a multi-byte character split over ids shows as U+FFFD)
            self._write_json("tokens.json", self._tok.batch_decode([[i] for i in range(n)]))
        return self._tok

    def _prompt_text(self, traj: Trajectory) -> str | None:
        tok = self._tokenizer()
        return None if tok is None else tok.decode(traj.prompt_ids)

    def _write(self, step: int, records: list[dict[str, Any]], mode: str) -> Path:
        path = step_path(self.dir.parent, step)
        data = "".join(json.dumps(r, default=str) + "\n" for r in records).encode()
        # one gzip member per write: the eval records of a step are appended to its train records; the
        # train records start the file anew (a resumed run rewrites its steps), written aside and moved in,
        # so a run killed meanwhile leaves the old file or the new one, never a cut-short one
        out = path if mode == "ab" else path.with_name(path.name + ".tmp")
        with gzip.open(out, mode) as f:
            f.write(data)
        if out != path:
            out.replace(path)
        return path

    def train(self, step: int, batch: Sequence[Trajectory], got: dict[str, Any]) -> Path | None:
        """Write step ``step``'s training batch, with the trainer's logprobs of the step it just ran
        (``got``: what ``trainer.last_logprobs()`` answered; it must have been asked to record them);
        None when the step is not dumped."""
        if not self.cfg.wants(step):
            return None
        if "trainer_threads" not in self.run_info:  # a retrain computes with the same thread count
            self.run_info["trainer_threads"] = got.get("threads")
            self._write_json("run.json", self.run_info)
        lps = got.get("logprobs") or [None] * len(batch)
        records = [
            episode_record(t, "train", step, lp, self._prompt_text(t), trained=lp is not None)
            for t, lp in zip(batch, lps, strict=True)
        ]
        return self._write(step, records, "wb")

    def failed(self, step: int, trajs: Sequence[Trajectory]) -> Path | None:
        """Append the training episodes that failed while step ``step``'s batch was gathered (kind
        ``"failed"``, never trained: their groups were dropped or they were removed from them); None when
        the step is not dumped or there are none."""
        if not (self.cfg.wants(step) and trajs):
            return None
        return self._write(
            step, [episode_record(t, "failed", step, None, self._prompt_text(t)) for t in trajs], "ab"
        )

    def evaluation(self, step: int, trajs: Sequence[Trajectory]) -> Path | None:
        """Write the episodes of the evaluation after step ``step`` (0: before training)."""
        if not (self.cfg.enabled and self.cfg.eval):
            return None
        return self._write(
            step, [episode_record(t, "eval", step, None, self._prompt_text(t)) for t in trajs], "ab"
        )


# ---- reading ---------------------------------------------------------------------------------------
def iter_dump(path: str | Path, errors: Errors = "raise") -> Iterator[dict[str, Any]]:
    """The records of one dump file, in order. A line that is not a JSON object, or a file whose gzip
    stream is corrupt or cut short, raises :class:`DumpError` naming the file and the line; with
    ``errors="skip"`` the other lines are still read (a gzip stream cut short ends the file) and each
    problem is a warning."""
    path = Path(path)
    line_no = 0
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    if not isinstance(rec, dict):
                        raise ValueError(f"a record is a JSON object, got {type(rec).__name__}")
                except ValueError as err:
                    reason = "truncated record" if not line.endswith("\n") else f"not a JSON record ({err})"
                    _problem(DumpError(path, line_no, reason), errors)
                    continue
                yield rec
    except (EOFError, OSError, zlib.error, UnicodeDecodeError) as err:
        if isinstance(err, FileNotFoundError):
            raise
        what = "cut short" if isinstance(err, EOFError) else "corrupt"
        _problem(DumpError(path, line_no + 1, f"the gzip stream is {what} ({err})"), errors)


def _problem(err: DumpError, errors: Errors) -> None:
    if errors == "raise":
        raise err
    warnings.warn(str(err), stacklevel=3)


def read_dump(path: str | Path, kind: str | None = None, errors: Errors = "raise") -> list[dict[str, Any]]:
    """The records of one dump file (``kind``: only "train", "failed" or "eval" ones); see
    :func:`iter_dump`."""
    return [r for r in iter_dump(path, errors) if kind is None or r.get("kind") == kind]


def dump_steps(run_dir: str | Path) -> list[int]:
    """The steps a run has dump files for, ascending."""
    d = Path(run_dir) / DUMP_DIR
    if not d.is_dir():
        raise FileNotFoundError(f"{d} does not exist: the run wrote no dumps (set rollout.dump)")
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := _STEP_FILE.match(p.name)))


def iter_steps(
    run_dir: str | Path, kind: str | None = None, errors: Errors = "raise"
) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """``(step, records)`` for every dump file of a run, ascending. With ``errors="skip"`` a corrupt file
    loses only what cannot be read; the other files are read whole."""
    for step in dump_steps(run_dir):
        yield step, read_dump(step_path(run_dir, step), kind, errors)


def read_run_info(run_dir: str | Path) -> dict[str, Any]:
    """``trajectories/run.json`` of a run (trainer config, η, thread count)."""
    path = Path(run_dir) / DUMP_DIR / "run.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist: the run wrote no dumps (set rollout.dump)") from None
    except ValueError as err:
        raise DumpError(path, 1, f"not JSON ({err})") from None


def read_tokens(run_dir: str | Path) -> list[str] | None:
    """The text of each token id (``trajectories/tokens.json``), or None when the run has none."""
    path = Path(run_dir) / DUMP_DIR / "tokens.json"
    return json.loads(path.read_text()) if path.is_file() else None


def to_trajectory(record: dict[str, Any]) -> Trajectory:
    """The Trajectory a record was written from, field for field (what the trainer got)."""
    traj = Trajectory.from_dict({k: v for k, v in record.items() if k in _TRAJ_FIELDS})
    traj.status = Status(traj.status)
    return traj
