"""The ``agentrl`` command: ``agentrl train`` runs the training job, ``agentrl list`` names what a config can
name.

    agentrl train                                         # the Search-R1 CPU demo
    agentrl train --config my.yaml rollout.group_size=8   # a run config of your own, with overrides
    agentrl list                                          # registered envs, tools, verifiers, recipes

``agentrl train ARGS`` is ``python train_async.py ARGS``: the same ``main`` of the same file, with the same
flags (``agentrl train --help``). Both run :func:`train`, which puts the working directory first on
``sys.path``, so a config names the user's code by ``module:attr`` (``env.name: my_env:UnitEnv`` for
``./my_env.py``), and the run hands the directory to every Ray worker through Ray's runtime environment
(:func:`agentrl.cluster.user_code_env`; on a cluster the named modules are uploaded to every host). Names
that do not resolve, and misspelled fields, fail before anything starts, with the nearest known name.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import io
import os
import signal
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from agentrl.config import ConfigError
from agentrl.node_watch import NodeLost

JOB = Path(__file__).resolve().parent.parent / "train_async.py"  # the checkout's job (pip install -e .)
COMMANDS = {
    "train": "run the training job: python train_async.py with the same arguments",
    "sft": "supervised warm start from demonstrations (agentrl sft --help)",
    "list": "registered envs, tools, verifiers and recipes (what env.name, env.kwargs.tools, "
    "rollout.verifier and recipe can name)",
}


def put_cwd_on_path() -> str:
    """The working directory, first on ``sys.path`` (``python train_async.py`` puts the script's directory
    there instead, and the user's env module sits in the directory the command runs in)."""
    cwd = os.getcwd()
    if not sys.path or sys.path[0] != cwd:
        sys.path.insert(0, cwd)
    return cwd


def config_module_names(cfg: Any) -> list[str]:
    """Every ``module:attr`` name a run config gives (recipe, env, verifiers, tools): the user code that
    every Ray worker must import."""
    kwargs = cfg.env.kwargs
    names = [cfg.recipe, cfg.env.name, cfg.rollout.verifier, kwargs.get("verifier")]
    for key in ("tools", "extra_tools"):
        specs = kwargs.get(key)
        for spec in specs if isinstance(specs, list) else [specs]:
            if isinstance(spec, dict):
                spec = spec.get("name", next(iter(spec), None)) if spec else None
            names.append(spec)
    return [n for n in names if isinstance(n, str) and ":" in n]


TRAIN_HELP = """
your code: the job puts the directory it runs in first on sys.path and hands it to every Ray worker
  (PYTHONPATH; with --ray-address, the modules the config names as module:attr are also uploaded to every
  host), so env.name: my_env:MyEnv imports ./my_env.py in the driver and in the workers.
names: env.name, rollout.verifier (or the env's own) and the tools of env.kwargs.tools are checked before
  anything starts, as are the config's fields; a miss names the nearest known one. agentrl list prints the
  registered names."""


def load_job(path: Path = JOB) -> ModuleType:
    """``train_async.py`` as a module (not entered in ``sys.modules``: Ray pickles its functions by value,
    as it does for a script run by path)."""
    if not path.is_file():
        sys.exit(
            f"agentrl train runs {path.name} of an agentrl checkout and found "
            f"none at {path}: install agentrl from a clone with pip install -e ."
        )
    spec = importlib.util.spec_from_file_location("train_async", path)
    assert spec is not None and spec.loader is not None
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    return job


def train(job: ModuleType, argv: list[str] | None = None, prog: str | None = None) -> None:
    """Run the training job ``job`` (train_async.py's module) with command-line ``argv``: the working
    directory on ``sys.path``, the config parsed and checked, ``job.main`` run; exits with a one-line error
    for a bad config, and says so after a Ctrl-C or a kill (everything was shut down)."""
    put_cwd_on_path()
    # Ctrl-C and a kill both give the clean shutdown, also when the job was started with SIGINT ignored
    # (a background job of a non-interactive shell inherits that, and then ran on to its last step)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)
    argv0 = sys.argv[0]
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        if prog:
            sys.argv[0] = prog  # argparse names the program in its usage and --help after sys.argv[0]
        if "-h" in args or "--help" in args:  # the job's help, then what this command adds to it
            with contextlib.redirect_stdout(io.StringIO()) as text, contextlib.suppress(SystemExit):
                job.parse_args(["--help"])
            print(text.getvalue().rstrip("\n") + "\n" + TRAIN_HELP)
            return
        config, cli = job.parse_args(args)
    except ConfigError as err:
        sys.exit(str(err))
    finally:
        sys.argv[0] = argv0
    try:
        asyncio.run(job.main(config, resume=cli.resume))
    except ConfigError as err:  # a bad name (before anything starts), or found once Ray is up
        # raised in an actor (a rollout that cannot progress), Ray wraps it: its text is a traceback
        sys.exit(str(getattr(err, "cause", None) or err))
    except NodeLost as err:  # a host of the run is gone: one line naming it and what ran there
        sys.exit(str(err))
    except KeyboardInterrupt:
        sys.exit("interrupted: everything was shut down")


def list_names() -> str:
    """The registered names a run config can use, one kind a line."""
    from agentrl.envs.registry import ENVS
    from agentrl.recipe import recipes
    from agentrl.rewards.base import VERIFIERS
    from agentrl.tools.registry import TOOLS

    kinds = {
        "envs (env.name)": ENVS,
        "tools (env.kwargs.tools)": TOOLS,
        "verifiers (rollout.verifier)": VERIFIERS,
        "recipes (recipe)": recipes,
    }
    lines = [f"{kind}: {', '.join(reg.names())}" for kind, reg in kinds.items()]
    return "\n".join([*lines, "each also takes module:attr for code of your own (e.g. my_env:UnitEnv)"])


def main(argv: list[str] | None = None) -> None:
    """The ``agentrl`` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(
        prog="agentrl",
        description="agentrl: asynchronous agentic RL. Run in the directory that holds your env module.",
        epilog="\n".join(
            [
                "commands:",
                *(f"  {name:<6} {about}" for name, about in COMMANDS.items()),
                "",
                "agentrl train --help shows the job's flags, config fields and example configs. The working",
                "directory goes first on sys.path and to every Ray worker (PYTHONPATH; on a cluster the",
                "modules a config names are uploaded), so env.name: my_env:UnitEnv imports ./my_env.py",
                "everywhere. agentrl-convert converts checkpoints (HF <-> Megatron).",
            ]
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=sorted(COMMANDS), help="what to do (see below)")
    if not argv or argv[0].startswith("-"):
        parser.parse_args(argv[:1] or ["--help"])  # prints the help, or names the unknown flag
        return
    if argv[0] not in COMMANDS:
        from agentrl.registry import did_you_mean

        parser.error(
            f"unknown command {argv[0]!r}; {did_you_mean(argv[0], COMMANDS)}known: {', '.join(COMMANDS)}"
        )
    command, rest = argv[0], argv[1:]
    if command == "list":
        put_cwd_on_path()
        print(list_names())
        return
    if command == "sft":
        from agentrl.sft import main as sft_main

        sft_main(rest, prog="agentrl sft")
        return
    train(load_job(), rest, prog="agentrl train")


if __name__ == "__main__":
    main()
