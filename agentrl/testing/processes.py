"""Processes as tests see them: whether one is still running."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists and has not exited: a zombie (exited, not yet reaped by its
    parent) counts as gone, a process of another user as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:  # state follows the command name, which may hold spaces
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


__all__ = ["pid_alive"]
