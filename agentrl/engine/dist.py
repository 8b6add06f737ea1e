"""The weight-broadcast process group of SGLang's distributed-update protocol, usable on either side.

SGLang's ``/init_weights_update_group`` makes each engine rank join a *new* torch.distributed group next to
(not instead of) any default group: a TCP rendezvous at ``tcp://master_address:master_port``, a store
prefixed with ``group_name``, the trainer as rank 0 and engine ranks from ``rank_offset``. Tensors then
arrive by ``torch.distributed.broadcast(t, src=0, group=pg)`` in the order of the announced ``names``.

:func:`init_custom_process_group` reproduces SGLang's helper exactly, so a trainer that already runs a
default group (Megatron) can open the extra group to real SGLang engines or to the embedded engine alike.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["init_custom_process_group", "parse_dtype"]


def init_custom_process_group(
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: float | datetime.timedelta = 600.0,
    device_id: torch.device | None = None,
) -> Any:
    """Create a process group that is not the default one (SGLang's ``init_custom_process_group``).

    ``init_method`` is ``tcp://HOST:PORT``; rank 0 hosts the rendezvous store. Blocks until all
    ``world_size`` ranks have joined. Returns the group to pass as ``group=`` to collectives.
    """
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    kwargs: dict[str, Any] = {"group_name": group_name, "backend_options": None, "timeout": timeout}
    if device_id is not None:
        kwargs["device_id"] = device_id
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, **kwargs)
    # Global rank i is group rank i, so broadcast(src=0, group=pg) means "from the trainer".
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_process_group(pg: Any) -> None:
    """Tear down a group made by :func:`init_custom_process_group` (ignores one already gone)."""
    try:
        dist.destroy_process_group(pg)
    except (ValueError, RuntimeError, KeyError):
        pass


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` / ``"torch.bfloat16"`` / ``torch.bfloat16`` -> ``torch.bfloat16``."""
    if isinstance(name, torch.dtype):
        return name
    attr = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(attr, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return attr
