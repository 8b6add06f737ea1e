"""The weight-broadcast process group of SGLang's distributed-update protocol, usable on either side.

SGLang's ``/init_weights_update_group`` makes each engine rank join a *new* torch.distributed group next to
(not instead of) any default group: a TCP rendezvous at ``tcp://master_address:master_port``, a store
prefixed with ``group_name``, the trainer as rank 0 and engine ranks from ``rank_offset``. Tensors then
arrive by ``torch.distributed.broadcast(t, src=0, group=pg)`` in the order of the announced ``names``; with
``load_format: flattened_bucket`` (:data:`FLATTENED`) a bucket arrives as one broadcast of a byte buffer,
each tensor's bytes after the last's in ``names`` order (SGLang's ``FlattenedTensorBucket`` layout:
:func:`flatten_bucket`, :func:`unflatten_bucket`), one collective a bucket instead of one a tensor.

:func:`init_custom_process_group` reproduces SGLang's helper exactly, so a trainer that already runs a
default group (Megatron) can open the extra group to real SGLang engines or to the embedded engine alike.

Teardown is where NCCL bites: destroying one end of a group waits for the other ends, so a trainer that
destroys its end while an engine still holds its own blocks forever. :func:`leave_process_group` is the
one way both sides leave: the destroy runs in a daemon thread (a hang never blocks an event loop or the
interpreter's exit) and, past a bounded timeout, the group is aborted instead, which waits on no peer.
The trainer asks the engines to leave (``/destroy_weights_update_group``) *concurrently* with its own
leave, so in the normal case both ends finish together.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import math
import os
import socket
import threading
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

__all__ = [
    "FLATTENED",
    "abort_process_group",
    "bucket_bytes",
    "destroy_process_group",
    "flatten_bucket",
    "flattens",
    "host_store",
    "in_daemon_thread",
    "init_custom_process_group",
    "leave_process_group",
    "parse_dtype",
    "unflatten_bucket",
]

log = logging.getLogger("agentrl.dist")


def host_store(world_size: int, timeout: float | datetime.timedelta = 600.0) -> Any:
    """Rank 0's rendezvous store, listening on every interface on a port the OS picks (``store.port``).

    Handing that port to the other ranks leaves no moment in which another process can take it, as a
    port found free and bound later can be (any outgoing connection may draw it meanwhile)."""
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    return dist.TCPStore("0.0.0.0", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)


def gloo_interface(peer: str) -> str | None:
    """The name of this host's network interface that reaches ``peer`` (None for a loopback peer, or when
    no interface holds the address the route to it leaves from)."""
    from agentrl.cluster import is_loopback

    host = peer.strip("[]")
    if not host or is_loopback(host):
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:  # a route lookup: nothing is sent
            s.connect((host, 9))
            local = s.getsockname()[0]
    except OSError:
        return None
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == local for a in addresses):
            return name
    return None


def use_gloo_interface_for(peer: str) -> None:
    """Have this process's gloo groups talk over the interface that reaches ``peer`` (the rendezvous
    host), unless ``GLOO_SOCKET_IFNAME`` says otherwise. Gloo advertises the address its host name
    resolves to, which on many hosts is a loopback one that peers on other hosts cannot reach."""
    if "GLOO_SOCKET_IFNAME" not in os.environ and (name := gloo_interface(peer)) is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
        log.info("gloo groups use interface %s (the route to %s)", name, peer)


def init_custom_process_group(
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: float | datetime.timedelta = 600.0,
    device_id: torch.device | None = None,
    store: Any = None,
) -> Any:
    """Create a process group that is not the default one (SGLang's ``init_custom_process_group``).

    ``init_method`` is ``tcp://HOST:PORT``; rank 0 hosts the rendezvous store there, or passes the one
    it already hosts (``store``, from :func:`host_store`). Blocks until all ``world_size`` ranks have
    joined. Returns the group to pass as ``group=`` to collectives.
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
    if str(backend) == "gloo":
        use_gloo_interface_for(urlsplit(init_method).hostname or "")
    if store is None:
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
    """Tear down a group made by :func:`init_custom_process_group` (ignores one already gone).

    With NCCL this waits for the other ranks to tear down theirs: call it through
    :func:`leave_process_group` unless the peers are known to be leaving too.
    """
    try:
        dist.destroy_process_group(pg)
    except (ValueError, RuntimeError, KeyError):
        pass


def abort_process_group(pg: Any) -> None:
    """Tear down ``pg`` without waiting for any peer (NCCL: ``ncclCommAbort``); ignores one already gone."""
    from torch.distributed import distributed_c10d as c10d

    try:
        abort = getattr(c10d, "_abort_process_group", None)
        if abort is not None:
            abort(pg)
        else:  # older torch: abort the backend, then drop the group from the registry
            pg.abort()
            dist.destroy_process_group(pg)
    except (ValueError, RuntimeError, KeyError, AttributeError) as err:
        log.warning("aborting the process group failed (%s); leaving it to process exit", err)


async def in_daemon_thread(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a daemon thread: unlike ``asyncio.to_thread``, a call that never returns neither
    keeps the event loop's executor from shutting down nor the interpreter from exiting."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not fut.done():
            fut.set_result(result) if error is None else fut.set_exception(error)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as err:  # handed to the awaiting coroutine
            result, error = None, err
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits for this any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="agentrl-leave-group", daemon=True).start()
    return await fut


async def leave_process_group(pg: Any, timeout: float = 30.0) -> bool:
    """Destroy this rank's end of ``pg`` within ``timeout`` seconds, else abort it. Never blocks longer.

    Returns True when the group was destroyed cleanly, False when it had to be aborted. Peers should be
    leaving at the same time (the trainer tells the engines to), since an NCCL destroy waits for them.
    """
    try:
        await asyncio.wait_for(asyncio.shield(in_daemon_thread(destroy_process_group, pg)), timeout)
        return True
    except TimeoutError:
        log.warning("the weight-sync group did not tear down within %.0f s: aborting it", timeout)
    try:
        await asyncio.wait_for(asyncio.shield(in_daemon_thread(abort_process_group, pg)), timeout)
    except TimeoutError:
        log.error("aborting the weight-sync group hung too; its thread is left to process exit")
    return False


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` / ``"torch.bfloat16"`` / ``torch.bfloat16`` -> ``torch.bfloat16``."""
    if isinstance(name, torch.dtype):
        return name
    attr = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(attr, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return attr


# SGLang's load_format for a bucket broadcast as one byte buffer
FLATTENED = "flattened_bucket"


def flattens(specs: list[tuple[torch.dtype, list[int]]]) -> bool:
    """Whether a bucket of tensors (``(dtype, shape)`` each) can travel as one byte buffer: each tensor's
    bytes must start at a multiple of its element size, or its slice cannot be viewed as its dtype."""
    offset = 0
    for dtype, shape in specs:
        if offset % dtype.itemsize:
            return False
        offset += _nbytes(dtype, shape)
    return True


def flatten_bucket(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes, one after another in order, as one uint8 tensor on their device."""
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])


def unflatten_bucket(flat: torch.Tensor, specs: list[tuple[torch.dtype, list[int]]]) -> list[torch.Tensor]:
    """The tensors of :func:`flatten_bucket`'s layout, as views of ``flat`` (``(dtype, shape)`` each)."""
    total = bucket_bytes(specs)
    if total != flat.numel():
        raise ValueError(f"a flattened bucket of {flat.numel()} bytes holds tensors of {total}")
    out, offset = [], 0
    for dtype, shape in specs:
        nbytes = _nbytes(dtype, shape)
        out.append(flat[offset : offset + nbytes].view(dtype).view(shape))
        offset += nbytes
    return out


def bucket_bytes(specs: list[tuple[torch.dtype, list[int]]]) -> int:
    """The bytes of a flattened bucket of these tensors."""
    return sum(_nbytes(dtype, shape) for dtype, shape in specs)


def _nbytes(dtype: torch.dtype, shape: list[int]) -> int:
    return dtype.itemsize * math.prod(int(x) for x in shape)
