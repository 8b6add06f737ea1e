"""The Search-R1 data format: QA tasks in parquet, a passage corpus in jsonl, and their loaders.

One code path for real and synthetic data. A task row (Search-R1's ``data_process/nq_search.py``) is
``{"data_source", "prompt": [{"role": "user", "content": <template with the question>}], "reward_model":
{"style": "rule", "ground_truth": {"target": [answers]}}, "extra_info": {...}}``, optionally with the raw
``question`` / ``golden_answers`` / ``id`` columns; a corpus line is ``{"id": str, "contents": "\\"Title\\"\\n
text"}`` (wiki-18). :func:`load_tasks` turns rows into agentrl task dicts ``{"task_id", "prompt": question
text, "label": [answers], "data_source", "info"}``; :func:`iter_corpus` streams passages. The synthetic
world (``world.py``) writes exactly this format and is read back through these same functions.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypedDict

from agentrl.tools.search import format_docs as _format_docs

# Search-R1's prompt (``nq_search.py``) verbatim, typo "as your want" included: the real data and
# checkpoints trained on it use this text, and so does SearchEnv. The question comes last, so it can
# always be recovered from a templated prompt (:func:`extract_question`).
SEARCH_R1_TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time "
    "you get new information. After reasoning, if you find you lack some knowledge, you can call a search "
    "engine by <search> query </search> and it will return the top searched results between <information> "
    "and </information>. You can search as many times as your want. If you find no further external "
    "knowledge needed, you can directly provide the answer inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)
_QUESTION_RE = re.compile(r"Question:\s*(.*?)\s*$", re.S)


class Task(TypedDict):
    """One QA task as the orchestrator and the envs see it."""

    task_id: str
    prompt: str  # the raw question (the env wraps it in its prompt template)
    label: list[str]  # gold answers; exact match against any of them
    data_source: str
    info: dict[str, Any]  # the row's extra_info (hops, entities, split, ...)


class Passage(TypedDict):
    """One corpus passage: ``contents`` is ``"Title"`` on the first line, then the text."""

    id: str
    contents: str


def make_prompt(question: str) -> str:
    """The Search-R1 user prompt for ``question``."""
    return SEARCH_R1_TEMPLATE.format(question=question.strip())


def extract_question(prompt: str) -> str:
    """The question inside a Search-R1 prompt (text after the last ``Question:``), else the prompt."""
    idx = prompt.rfind("Question:")
    if idx < 0:
        return prompt.strip()
    m = _QUESTION_RE.match(prompt, idx)
    return m.group(1) if m else prompt.strip()


def split_contents(contents: str) -> tuple[str, str]:
    """``'"Title"\\ntext'`` -> ``("Title", "text")`` (the title line's surrounding quotes dropped)."""
    title, _, text = contents.partition("\n")
    title = title.strip()
    if len(title) >= 2 and title[0] == title[-1] == '"':
        title = title[1:-1]
    return title, text.strip()


def make_contents(title: str, text: str) -> str:
    """The inverse of :func:`split_contents`."""
    return f'"{title}"\n{text}'


def format_docs(docs: Iterable[dict[str, Any]]) -> str:
    """Search-R1's ``_passages2string``: ``Doc {i}(Title: {title line}) {text}\n`` per retrieved passage.

    The title is the raw first line of ``contents``, quotes included, as in Search-R1 and in
    :class:`agentrl.envs.search.SearchEnv` (whose renderer this is, so demos and rollouts agree byte for
    byte). Accepts passages (``{"id", "contents"}``) or /retrieve hits (``{"document": {...}, "score"}``).
    """
    return _format_docs(list(docs))


def _as_list(value: Any) -> list[Any]:
    """Parquet list columns come back as numpy arrays or lists; a bare scalar means one element."""
    if value is None:
        return []
    if isinstance(value, str | bytes):
        return [value]
    if hasattr(value, "tolist"):
        value = value.tolist()
    return list(value) if isinstance(value, Sequence | tuple) else [value]


def row_to_task(row: dict[str, Any], index: int, split: str) -> Task:
    """One Search-R1 parquet row -> a :class:`Task`. Raises ``ValueError`` naming what is missing."""
    extra = dict(row.get("extra_info") or {})
    question = row.get("question") or extra.get("question")
    if not question:
        prompt = row.get("prompt")
        if isinstance(prompt, str):
            text = prompt
        else:
            messages = _as_list(prompt)
            user = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
            if not user:
                raise ValueError(f"row {index}: no question column and no user message in 'prompt'")
            text = user[-1]["content"]
        question = extract_question(text)
    gt = ((row.get("reward_model") or {}).get("ground_truth")) or {}
    answers = _as_list(gt.get("target")) if isinstance(gt, dict) else _as_list(gt)
    if not answers:
        answers = _as_list(row.get("golden_answers"))
    answers = [str(a) for a in answers if str(a).strip()]
    if not answers:
        raise ValueError(f"row {index}: no gold answers (reward_model.ground_truth.target is empty)")
    data_source = str(row.get("data_source") or "unknown")
    # Real test files merge sources whose ids restart per source ("test_0" in nq and in hotpotqa).
    row_id = row.get("id")
    task_id = extra.get("task_id") or (
        f"{data_source}-{row_id}"
        if row_id is not None
        else f"{data_source}-{split}-{extra.get('index', index)}"
    )
    info = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in extra.items()}
    info.setdefault("split", split)
    return Task(task_id=str(task_id), prompt=str(question), label=answers, data_source=data_source, info=info)


def _parquet_file(path: Path, split: str | None) -> tuple[Path, str]:
    if path.is_dir():
        if split is None:
            raise ValueError(f"{path} is a directory: say which split to load (e.g. split='train')")
        path = path / f"{split}.parquet"
    if not path.exists():
        raise FileNotFoundError(f"no task file at {path}")
    return path, split or path.stem


def load_tasks(
    path: str | Path,
    split: str | None = None,
    limit: int | None = None,
    data_sources: Sequence[str] | None = None,
) -> list[Task]:
    """Load Search-R1 parquet tasks from a file, or ``<dir>/<split>.parquet``.

    ``task_id`` is ``extra_info["task_id"]`` if present, else ``"{data_source}-{id}"``, made unique.

    ``data_sources`` keeps only those sources (the real test set mixes nq, hotpotqa, ...); ``limit``
    keeps the first N rows after that filter.
    """
    import pyarrow.parquet as pq

    file, split_name = _parquet_file(Path(path), split)
    rows = pq.read_table(file).to_pylist()
    tasks: list[Task] = []
    seen: set[str] = set()
    for i, row in enumerate(rows):
        if data_sources is not None and row.get("data_source") not in data_sources:
            continue
        task = row_to_task(row, i, split_name)
        if task["task_id"] in seen:  # ids group GRPO samples, so they must be unique
            task["task_id"] = f"{task['task_id']}-{i}"
        seen.add(task["task_id"])
        tasks.append(task)
        if limit is not None and len(tasks) >= limit:
            break
    return tasks


def write_tasks(path: str | Path, rows: Sequence[dict[str, Any]]) -> Path:
    """Write Search-R1 parquet rows (see the module docstring) to ``path``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(list(rows)), path)
    return path


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def iter_corpus(path: str | Path) -> Iterator[Passage]:
    """Stream passages from a jsonl (or jsonl.gz) corpus; a malformed line raises with its line number."""
    path = Path(path)
    with _open_text(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
                yield Passage(id=str(doc["id"]), contents=str(doc["contents"]))
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"{path}:{lineno}: not a corpus line {{'id', 'contents'}}: {err}") from None


def write_corpus(path: str | Path, passages: Iterable[dict[str, Any]]) -> Path:
    """Write passages as Search-R1 corpus jsonl (one ``{"id", "contents"}`` per line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for p in passages:
            f.write(json.dumps({"id": str(p["id"]), "contents": p["contents"]}, ensure_ascii=False) + "\n")
    return path
