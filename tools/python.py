"""The ``python`` tool: runs model-written code in a sandbox and returns what it printed."""

from __future__ import annotations

from agentrl.sandboxes.base import Sandbox
from agentrl.sandboxes.shared import shared_sandbox

from .base import DEFAULT_MAX_OUTPUT_CHARS, Tool


def python_tool(
    sandbox: Sandbox | None = None,
    timeout: float = 10.0,
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
    backend: str | None = None,
) -> Tool:
    """A ``python(code)`` tool that runs in ``sandbox`` (a :class:`DockerSandbox` or :class:`ProcessSandbox`);
    None: the process-wide shared sandbox of ``backend`` (docker | process | auto), taken at each call, so
    one warm sandbox serves every episode of the run.

    The code's own failures are part of the text the model sees. A run that exits on its own (an exception,
    a nonzero exit) is a normal result; a run the sandbox stopped (timeout, memory, CPU time, a signal) is
    an error result with the same text, so the env's call records and the rollout's metrics count it.
    """

    async def python(code: str) -> str:
        """Run Python code in a fresh sandbox and return its stdout and stderr. Use print() to see values.

        Args:
            code: the Python source to run
        """
        sb = sandbox if sandbox is not None else shared_sandbox(backend)
        result = await sb.run(code, timeout=timeout)
        return result.text_or_raise()

    # The tool's own timeout is a backstop above the sandbox's, which kills the code itself.
    return Tool(python, timeout=timeout + 30.0, max_output_chars=max_output_chars)
