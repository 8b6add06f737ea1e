"""Cluster glue: Ray actors that own the run's server processes (inference engines, tool servers).

A :class:`ServiceActor` starts one server process inside its actor (so Ray places it: an engine actor
asks for the GPUs its engine uses) and hands back the server's URL; ``stop()`` stops the process group.
The driver keeps every actor it started and stops them all in a ``finally`` (:func:`stop_all`), so a
Ctrl-C or an error leaves no server behind; the embedded engine and the retrieval server also exit on
their own when their parent dies. :func:`location` tells where a process runs (its Ray node).

:func:`start_ray` starts (or joins) Ray with its workers at normal priority; :func:`free_port` is the
one way agentrl picks a port for something it starts (servers, process-group rendezvous).

What a service runs is a picklable zero-argument ``start`` callable returning a handle with ``.url`` and
``.stop()`` (``start_embedded_server``, ``SGLangLauncher``, ``start_retrieval_server``...).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from typing import Any, Protocol

WILDCARD_HOSTS = {"0.0.0.0", "::", "[::]"}


def start_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """``ray.init`` for a run (a local instance, or ``address`` of an existing cluster).

    Workers run at the driver's priority. Ray starts them at niceness 15 by default, and every process
    they start inherits it: the engine, the trainer, the rollout and the env's servers then got about 3%
    of a core each against one busy process at niceness 0, so on a loaded machine a start-up or a Ctrl-C
    took minutes instead of seconds. ``RAY_worker_niceness`` set in the environment still wins.
    """
    import ray

    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(
        address=address,
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free on ``host`` a moment ago (whoever needs it binds it shortly after)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]") if host not in WILDCARD_HOSTS else "", 0))
        return int(s.getsockname()[1])


def location() -> dict[str, Any]:
    """Where the calling process runs: its Ray node's id and IP (None outside Ray) and its pid."""
    import ray

    node_id = node_ip = None
    if ray.is_initialized():
        node_id, node_ip = ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
    return {"node_id": node_id, "node_ip": node_ip, "pid": os.getpid()}


class ServiceHandle(Protocol):
    url: str

    def stop(self) -> None: ...


class ServiceWorker:
    """The actor body (usable without Ray too): one server process, its URL, and a stop."""

    def __init__(self, name: str, start: Callable[[], ServiceHandle]) -> None:
        self.name = name
        self._handle: ServiceHandle | None = start()

    def url(self) -> str:
        if self._handle is None:
            raise RuntimeError(f"service {self.name} is stopped")
        return self._handle.url

    def pid(self) -> int:
        return os.getpid()

    def location(self) -> dict[str, Any]:
        return location()

    def stop(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            handle.stop()


def start_service(
    name: str,
    start: Callable[[], ServiceHandle],
    num_cpus: float = 0,
    num_gpus: float = 0,
    scheduling: Any = None,
    resources: dict[str, float] | None = None,
    wait: bool = True,
) -> Any:
    """A Ray actor running ``start()``; blocks until the server is up and returns the actor handle
    (``wait=False``: returns at once; ``actor.url.remote()`` then waits for it and surfaces a failure).
    ``scheduling``: a Ray scheduling strategy (a placement group's bundle, agentrl.placement);
    ``resources``: custom Ray resources the actor asks for (which nodes may take it)."""
    import ray

    options = {"scheduling_strategy": scheduling} if scheduling is not None else {}
    actor = (
        ray.remote(ServiceWorker)
        .options(name=None, num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or {}, **options)
        .remote(name, start)
    )
    if wait:
        ray.get(actor.url.remote())  # surfaces a start failure here, with the server's log tail
    return actor


def stop_all(actors: list[Any], timeout: float = 60.0) -> None:
    """Stop every service actor (best effort, each independently), then kill the actors."""
    import ray

    for actor in reversed(actors):
        with contextlib.suppress(Exception):
            ray.get(actor.stop.remote(), timeout=timeout)
        with contextlib.suppress(Exception):
            ray.kill(actor)
    actors.clear()
