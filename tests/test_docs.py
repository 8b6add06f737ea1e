"""The documentation is code: every code block of README.md and docs/guide/*.md runs or is checked here.

* ```python blocks run: each file's blocks in order, in one namespace, in a fresh interpreter whose
  working directory is a temp dir (so a block that writes files leaves nothing behind).
* A block right after ``<!-- include: PATH -->`` (or ``<!-- include: PATH [readme:NAME] -->``) is an
  excerpt of a file that CI runs: it must equal that file (or its lines between the ``# [readme:NAME]``
  and ``# [readme:NAME-end]`` markers). An included python block also runs with the file's other
  blocks, so the excerpt works copied on its own.
* The README's env, verifier and run (examples/custom_env.py, custom_verifier.py, custom_env.yaml) are
  run here: the env through the checker, the verifier on a trajectory, the run config through the
  start-up check that decides who scores the episodes, and the run itself for one step (a tiny model
  standing in for the pretrained one).
* The README's ```bash blocks are exactly its two commands, and CI runs the second (.ci/run).
* ```yaml blocks are run configs: each is validated as ``--config`` would be (recipe, every field).
* ```text and ```bash blocks of the README and every page under docs/: each ``python train_async.py ...``
  line is parsed and validated as the job would (config file, overrides); each ``python -m agentrl.X``
  or ``python path/to/file.py`` names a module or file that exists, and the flags it shows appear in its
  own ``--help``. Train commands with placeholders in capitals (``DIR``, ``S``) are not validated.
* The config reference (docs/reference/config.md) is generated; the test fails when it is stale.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
INCLUDE = re.compile(r"<!--\s*include:\s*(\S+)(?:\s+\[(readme:[\w-]+)\])?\s*-->\s*$")
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z_]{1,}\b")


@dataclass
class Block:
    file: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    include: tuple[str, str | None] | None

    @property
    def where(self) -> str:
        return f"{self.file.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        inc = INCLUDE.search(before)
        out.append(Block(path, line, m.group(1), m.group(2), (inc.group(1), inc.group(2)) if inc else None))
    return out


def all_blocks() -> list[Block]:
    return [b for f in DOC_FILES for b in blocks(f)]


def excerpt(path: Path, marker: str | None) -> str:
    text = path.read_text()
    if marker is None:
        return text
    lines = text.splitlines(keepends=True)
    starts = [i for i, x in enumerate(lines) if x.strip() == f"# [{marker}]"]
    ends = [i for i, x in enumerate(lines) if x.strip() == f"# [{marker}-end]"]
    assert len(starts) == 1 and len(ends) == 1 and starts[0] < ends[0], (
        f"{path.relative_to(ROOT)}: needs exactly one '# [{marker}]' line and one '# [{marker}-end]' after it"
    )
    return "".join(lines[starts[0] + 1 : ends[0]]).strip("\n") + "\n"


def test_doc_files_have_code_blocks() -> None:
    assert (ROOT / "README.md") in DOC_FILES and len(DOC_FILES) >= 5, DOC_FILES
    for f in DOC_FILES:
        langs = {b.lang for b in blocks(f)}
        assert langs, f"{f.relative_to(ROOT)} has no code block"
        unknown = langs - {"python", "yaml", "text", "bash"}
        assert not unknown, (
            f"{f.relative_to(ROOT)}: blocks of language {unknown}: use python, yaml, text or bash"
        )


@pytest.mark.parametrize("block", [b for b in all_blocks() if b.include], ids=lambda b: b.where)
def test_included_block_equals_its_file(block: Block) -> None:
    assert block.include is not None
    path, marker = block.include
    want = excerpt(ROOT / path, marker)
    assert block.code == want, (
        f"{block.where}: the block is not the current text of {path}"
        + (f" between its '# [{marker}]' markers" if marker else "")
        + "; copy it again"
    )


@pytest.mark.parametrize(
    "doc",
    [f for f in DOC_FILES if any(b.lang == "python" for b in blocks(f))],
    ids=lambda f: str(f.relative_to(ROOT)),
)
def test_python_blocks_run(doc: Path, tmp_path: Path) -> None:
    """The file's python blocks, in order, in one namespace; a failure names the block's line."""
    runnable = [b for b in blocks(doc) if b.lang == "python"]
    script = ["import sys, traceback", "_ns = {'__name__': '__main__'}"]
    for b in runnable:
        script += [
            f"print('--- block at line {b.line}', flush=True)",
            "try:",
            f"    exec(compile({b.code!r}, {b.where!r}, 'exec'), _ns)",
            "except BaseException:",
            "    traceback.print_exc()",
            f"    print('FAILED: the block at {b.where}', file=sys.stderr)",
            "    sys.exit(1)",
        ]
    proc = subprocess.run(
        [sys.executable, "-c", "\n".join(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _yaml_blocks() -> list[Block]:
    return [b for b in all_blocks() if b.lang == "yaml"]


@pytest.mark.parametrize("block", _yaml_blocks(), ids=lambda b: b.where)
def test_yaml_blocks_are_valid_run_configs(block: Block, tmp_path: Path) -> None:
    from agentrl.recipe import load_run_config

    cfg = tmp_path / "run.yaml"
    cfg.write_text(block.code)
    load_run_config(cfg)  # raises ConfigError naming the bad field


CMD_FILES = [
    ROOT / "README.md",
    *sorted(p for p in (ROOT / "docs").rglob("*.md") if "reference" not in p.parts),
]
FLAG = re.compile(r"^--?[A-Za-z][\w-]*")
OPTIONAL = re.compile(r"\[(\s*--?[A-Za-z][^\]]*)\]")  # an optional flag, [--steps 8]: taken as given


def _argvs() -> list[tuple[str, list[str]]]:
    """(where, argv) of every ``python ...`` command in a text or bash block of the README and docs/."""
    out = []
    for f in CMD_FILES:
        for b in blocks(f):
            if b.lang not in ("text", "bash"):
                continue
            for line in b.code.replace("\\\n", " ").splitlines():
                for part in line.split(" #", 1)[0].split("&&"):
                    if not part.strip().startswith(("python ", "/usr/bin/time python ")):
                        continue
                    argv = shlex.split(OPTIONAL.sub(r"\1", part.strip()))
                    if argv[:1] == ["/usr/bin/time"]:
                        argv = argv[1:]
                    if len(argv) >= 2 and argv[0] == "python":
                        out.append((b.where, argv))
    return out


def _target(argv: list[str]) -> tuple[str, ...] | None:
    """``("-m", module)`` or ``(script,)`` for a command of this repository; None for other programs."""
    if argv[1] == "-m":
        return ("-m", argv[2]) if argv[2].startswith("agentrl") else None
    return None if argv[1].startswith("-") else (argv[1],)


def test_shell_commands_name_real_modules_and_files() -> None:
    argvs = _argvs()
    assert len(argvs) >= 20, argvs
    for where, argv in argvs:
        target = _target(argv)
        if target is None:
            continue
        if target[0] == "-m":
            assert importlib.util.find_spec(target[1]) is not None, f"{where}: no module {target[1]}"
        else:
            assert (ROOT / target[0]).is_file(), f"{where}: {target[0]} is not a file of the repository"


def test_train_async_commands_are_valid_runs() -> None:
    """Every ``python train_async.py ...`` without placeholders parses and validates as the job would."""
    runs = [
        (w, a[2:])
        for w, a in _argvs()
        if a[1] == "train_async.py" and not PLACEHOLDER.search(" ".join(a[2:]))
    ]
    assert runs, "no python train_async.py command found in the docs"
    code = (
        "import json, sys; sys.path.insert(0, '.'); import train_async\n"
        "for where, argv in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        train_async.parse_args(argv)\n"
        "    except BaseException as err:\n"
        "        sys.exit(f'{where}: python train_async.py {\" \".join(argv)}\\n{err}')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(runs)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_command_line_flags_in_docs_exist() -> None:
    """Each command's ``--flags`` appear in its own ``--help`` (subcommands and positionals kept)."""
    wanted: dict[tuple[str, ...], tuple[set[str], set[str]]] = {}
    for where, argv in _argvs():
        target = _target(argv)
        if target is None or target == ("train_async.py",):
            continue  # train_async.py commands are parsed whole by the test above
        rest = argv[1 + len(target) :]
        lead = []
        while rest and not rest[0].startswith("-"):
            lead.append(rest.pop(0))
        flags = {m.group(0) for tok in rest if (m := FLAG.match(tok))}
        key = (*target, *lead[:1])  # a subcommand (convert hf-to-mcore) or a positional
        got = wanted.setdefault(key, (set(), set()))
        got[0].update(flags)
        got[1].add(where)
    assert wanted

    def help_of(key: tuple[str, ...]) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, *key, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300
        )

    # the commands' --help at once (each is mostly its imports): a 2 vCPU machine runs two side by side
    with ThreadPoolExecutor(max_workers=4) as pool:
        helps = dict(zip(wanted, pool.map(help_of, wanted), strict=True))
    for key, (flags, wheres) in sorted(wanted.items()):
        proc = helps[key]
        assert proc.returncode == 0, (
            f"{sorted(wheres)}: python {' '.join(key)} --help failed\n{proc.stderr[-2000:]}"
        )
        missing = sorted(
            f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", proc.stdout)
        )
        assert not missing, f"{sorted(wheres)}: python {' '.join(key)} has no {missing}"


def test_config_reference_is_current() -> None:
    proc = subprocess.run(
        [sys.executable, "scripts/gen_config_reference.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (
        "docs/reference/config.md is stale (a config field, type, default or description changed): "
        "regenerate it with `python scripts/gen_config_reference.py` and commit it\n" + proc.stderr
    )


def test_readme_commands_are_the_ones_ci_runs() -> None:
    bash = [b.code.strip() for b in blocks(ROOT / "README.md") if b.lang == "bash"]
    install = (
        "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && pip install -e . "
        "&& python train_async.py"
    )
    assert bash == [install, "./scripts/test.sh"], f"README bash blocks changed: {bash}"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "\n./scripts/test.sh" in ci, ".ci/run no longer runs ./scripts/test.sh, the README's test command"
    assert "torch==2.13.0" in (ROOT / "scripts" / "test.sh").read_text(), (
        "scripts/test.sh pins another torch than the README's install command"
    )
    for b in [b for f in DOC_FILES[1:] for b in blocks(f)]:
        assert b.lang != "bash", (
            f"{b.where}: a bash block CI does not run; use ```text (its commands are checked)"
        )


def test_readme_env_verifier_and_run_work_as_shown() -> None:
    import asyncio

    from agentrl.envs import check_env, make_env
    from agentrl.examples.custom_verifier import AddEnv, score
    from agentrl.recipe import load_run_config, read_tasks, task_file
    from agentrl.rewards import resolve_verifier

    cfg = load_run_config(ROOT / "examples" / "custom_env.yaml")
    env = make_env(cfg.env.name, **cfg.env.kwargs)
    # the start-up check that failed for an env naming no verifier: this one scores itself
    assert resolve_verifier(cfg.rollout.verifier, env.verifier, type(env).__name__, env.scores_itself) is None
    task = {"label": 7, "lo": 1, "hi": 10}
    assert (
        asyncio.run(check_env(env, task, ["<guess>5</guess>", "<guess>9</guess>", "<guess>7</guess>"])) == []
    )
    data = ROOT / cfg.data.path
    for split in (cfg.data.train_split, cfg.data.test_split):
        tasks = read_tasks(task_file(data, split))
        assert tasks and all(
            {"label", "lo", "hi"} <= set(t) and t["lo"] <= t["label"] <= t["hi"] for t in tasks
        )

    assert resolve_verifier(None, AddEnv.verifier, "AddEnv", AddEnv.scores_itself) == "last_number"
    assert asyncio.run(check_env(AddEnv, {"prompt": "2 + 5?", "label": 7}, ["7"])) == []
    hit, miss = asyncio.run(score("2 + 5 = 7", 7)), asyncio.run(score("no idea", 7))
    assert (hit.reward, hit.reward_parts) == (1.0, {"wrote_number": 1.0})
    assert (miss.reward, miss.reward_parts) == (0.0, {"wrote_number": 0.0})

    out = subprocess.run(
        [sys.executable, "-m", "agentrl.examples.custom_env"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr


@pytest.mark.slow
def test_readme_run_trains_one_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The README's run as shown, with a tiny model for SmolLM2 and one small step: it starts and trains."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "train_async.py",
            "--config",
            "examples/custom_env.yaml",
            f"model_path={tiny_model_dir}",
            f"output_dir={out}",
            "steps=1",
            "rollout.group_size=2",
            "rollout.batch_size=2",
            "rollout.max_turns=2",
            "env.kwargs.max_turns=2",
            "rollout.sampling.max_new_tokens=8",
            "rollout.eval_sampling.max_new_tokens=8",
            "eval.num_tasks=2",
            "ray.num_cpus=2",
            "rollout.filter_zero_variance=false",  # a random model's groups are all 0: train on them anyway
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"train_async failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows if "policy_version" in r] == [1]
    assert json.loads((out / "summary.json").read_text())["accounting"]["trained"] >= 1


def test_relative_links_resolve() -> None:
    """Every relative link of the README and docs/ points at a file of the repository."""
    broken = []
    for f in CMD_FILES + [p for p in (ROOT / "docs").rglob("*.md") if "reference" in p.parts]:
        for m in re.finditer(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", f.read_text()):
            target = m.group(1)
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (f.parent / target).exists():
                broken.append(f"{f.relative_to(ROOT)}: {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)
