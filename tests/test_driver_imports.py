"""The driver (``train_async.py``) starts without torch: it loads a run's config, writes its metrics and
the rollout's state, and checks a CPU run's host memory with none of torch, transformers or
megatron-core loaded. Those load in the processes that compute (the trainer, the engine, the rollout's
tokenizer), each of which pays for them once; the driver paid about 3 CPU-seconds more per run. The
checkpoint converter's command line answers ``--help`` and usage errors without them too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

HEAVY = ("torch", "transformers", "megatron")

CODE = """
import sys
from pathlib import Path

import train_async
from agentrl.host_memory import host_bytes
from agentrl.metrics import MetricsLogger
from agentrl.recipe import load_run_config
from agentrl.trainer.checkpoint import latest_checkpoint, load_rollout_state, save_rollout_state
from agentrl.weight_sync import WeightUpdate, check_transport

out = Path(sys.argv[1])
cfg = load_run_config(Path(train_async.DEFAULT_CONFIG), [f"output_dir={out}"])
assert host_bytes(cfg, out).total == 0  # a CPU run: nothing pinned, no model read
logger = MetricsLogger(out)
logger.log({"reward/mean": 0.5}, 1)
logger.close()
save_rollout_state(out / "checkpoints", 1, {"cursor": 3})
assert load_rollout_state(out / "checkpoints", 1) == {"cursor": 3}
assert latest_checkpoint(out / "checkpoints") is None
print(" ".join(sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[2:]))))
"""


def test_the_driver_loads_no_torch(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", CODE, str(tmp_path), *HEAVY],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip() == "", f"the driver imported {out.stdout.strip()}"


HELP = """
import runpy
import sys

sys.argv = ["agentrl.convert", *sys.argv[1:]]
try:
    runpy.run_module("agentrl.convert", run_name="__main__")
except SystemExit as err:
    print("exit", err.code)
print(" ".join(sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))))
"""


def test_the_converters_help_and_usage_errors_load_no_torch() -> None:
    """``python -m agentrl.convert`` loads torch, transformers and megatron-core for a conversion only."""
    for argv, code in ((["hf-to-mcore", "--help"], "0"), (["hf-to-mcore"], "2")):
        out = subprocess.run(
            [sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{HELP}", *argv],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.stdout.splitlines()[-2:] == [f"exit {code}", ""], (argv, out.stdout, out.stderr)
