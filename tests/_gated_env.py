"""A math env that admits a fixed number of distinct tasks and holds the episodes of any other task until
the process ends: a job on it can train the steps those tasks fill and no more, however late whoever
watches the job acts (the kill points of the resume test stay before the job's next checkpoint)."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from agentrl.envs.base import Message
from agentrl.envs.math import MathEnv


class GatedMathEnv(MathEnv):
    """:class:`MathEnv` whose ``reset`` waits forever for a task beyond the first ``admit`` distinct ones
    (per process; a task admitted once, redrawn later, is admitted again). ``admit=None``: no gate."""

    admitted: ClassVar[set[str]] = set()

    def __init__(self, admit: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.admit = admit

    async def reset(self, task: dict[str, Any]) -> list[Message]:
        key = str(task.get("task_id", task.get("prompt")))
        if self.admit is not None and key not in GatedMathEnv.admitted:
            if len(GatedMathEnv.admitted) >= self.admit:
                await asyncio.Event().wait()
            GatedMathEnv.admitted.add(key)
        return await super().reset(task)
