"""How the trainer loads megatron-core (agentrl.trainer.mcore_compat, point 6). Compiling no kernels (the
CPU default), a trainer rank loads megatron-core without the ``torch.compile`` decorations of its fused
kernels, so it never loads inductor's code generators (1-2 CPU-seconds per rank) and the kernels are the
plain functions; with ``compile_kernels`` on, megatron-core loads as it is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

TRAINER_ON_CPU = """
import sys
import warnings

warnings.filterwarnings("ignore")
import torch

from agentrl.trainer.config import TrainerConfig
from agentrl.trainer.trainer import MegatronTrainer

compile_kernels = sys.argv[2] == "on"
cfg = TrainerConfig(
    model_path=sys.argv[1], lr=1e-3, micro_batch_size=2, device="cpu", compile_kernels=compile_kernels
)
tr = MegatronTrainer(cfg)
import megatron.core.jit
from megatron.core.fusions.fused_bias_swiglu import swiglu

if not compile_kernels:  # the plain function (compiled, it would compile C++ on its first call here)
    x = torch.randn(4, 6)
    a, b = torch.chunk(x, 2, -1)
    assert torch.equal(swiglu(x), torch.nn.functional.silu(a) * b)
print(sorted(m for m in ("torch._inductor.compile_fx", "torch._inductor.codegen") if m in sys.modules))
print(megatron.core.jit.jit_fuser is torch.compile, hasattr(swiglu, "_torchdynamo_orig_callable"))
print(torch.compile.__module__)
tr.shutdown()
"""


@pytest.mark.parametrize(
    ("kernels", "loaded", "compiled"),
    [
        ("off", "[]", "False False"),
        ("on", "['torch._inductor.codegen', 'torch._inductor.compile_fx']", "True True"),
    ],
    ids=["kernels_off", "kernels_on"],
)
def test_a_trainer_rank_compiles_megatrons_kernels_only_when_asked(
    tiny_model_dir: Path, kernels: str, loaded: str, compiled: str
) -> None:
    out = subprocess.run(
        [sys.executable, "-c", TRAINER_ON_CPU, str(tiny_model_dir), kernels],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    lines = out.stdout.split("\n")
    assert lines[0] == loaded  # inductor's code generators, loaded by the compile decorations only
    assert lines[1] == compiled  # megatron's jit_fuser and its SwiGLU: compiled, or the plain function
    assert lines[2] == "torch"  # torch.compile is torch's own after the import either way
