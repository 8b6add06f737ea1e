"""How the trainer loads megatron-core (agentrl.trainer.mcore_compat, point 6): with its kernels not
compiled (the CPU default), a trainer rank never loads inductor's code generators, which megatron's
import-time ``torch.compile`` decorations would load (1-2 CPU-seconds per rank; dynamo itself loads
anyway, with the first optimizer's param group); a deferred decoration compiles
once, on the first call, with the options it was given, and a call from inside a graph being traced runs
the plain function."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from agentrl.trainer.mcore_compat import _compiled_on_first_call

ROOT = Path(__file__).resolve().parent.parent

TRAINER_ON_CPU = """
import sys
import warnings

warnings.filterwarnings("ignore")
from agentrl.trainer.config import TrainerConfig
from agentrl.trainer.trainer import MegatronTrainer

tr = MegatronTrainer(TrainerConfig(model_path=sys.argv[1], lr=1e-3, micro_batch_size=2, device="cpu"))
import megatron.core.jit
import torch

print(sorted(m for m in ("torch._inductor.compile_fx", "torch._inductor.codegen") if m in sys.modules))
print(megatron.core.jit.jit_fuser is torch.compile, torch.compile.__module__)
tr.shutdown()
"""


def test_a_cpu_trainer_rank_loads_no_compiler(tiny_model_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", TRAINER_ON_CPU, str(tiny_model_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    loaded, compile_after = out.stdout.split("\n")[:2]
    assert loaded == "[]", f"the trainer loaded {loaded}"
    # megatron's kernels hold the deferred decoration; torch.compile is torch's own again
    assert compile_after == "False torch"


def _counting_compile() -> tuple[list[dict[str, Any]], Any]:
    calls: list[dict[str, Any]] = []

    def compile_fn(fn: Any, **options: Any) -> Any:
        calls.append(options)
        return lambda *a, **k: fn(*a, **k) * 10  # marks a call that went through the "compiled" fn

    return calls, compile_fn


def test_a_deferred_kernel_compiles_once_on_its_first_call() -> None:
    calls, compile_fn = _counting_compile()
    deferred = _compiled_on_first_call(compile_fn)

    @deferred
    def double(x: int) -> int:
        """Doubles."""
        return 2 * x

    @deferred(mode="max-autotune")
    def triple(x: int) -> int:
        return 3 * x

    assert calls == [] and double.__name__ == "double" and double.__doc__ == "Doubles."
    assert [double(1), double(2), triple(1)] == [20, 40, 30]
    assert calls == [{}, {"mode": "max-autotune"}]  # once each, with its options
    deferred(torch.nn.Linear(2, 2))
    assert len(calls) == 3  # a module is handed to the compiler at once


def test_a_deferred_kernel_inside_a_traced_graph_runs_the_plain_function() -> None:
    calls, compile_fn = _counting_compile()

    @_compiled_on_first_call(compile_fn)
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    outer = torch.compile(lambda x: scaled(x) + 1, backend="eager", fullgraph=True)
    assert torch.equal(outer(torch.ones(3)), torch.full((3,), 3.0))  # one graph, no break
    assert calls == []
    assert torch.equal(scaled(torch.ones(3)), torch.full((3,), 20.0)) and len(calls) == 1
