"""LoRA adapters named per request: the names a LoRA run gives its adapters, and how the engine client
learns which one to name.

SGLang (0.5.16, launched with ``--enable-lora``) keeps the base weights resident and applies an adapter
only to a ``/generate`` that names it, in ``lora_path`` (the adapter's *name*, despite the field's name;
``lora_id`` is filled in by SGLang's tokenizer manager). The trainer's weight sync loads each version of
its adapters under a name of its own, :func:`adapter_name` (``agentrl-v{version}``: SGLang refuses to
load a name that is loaded already), and unloads the previous one
(:class:`agentrl.weight_sync.named_adapters.NamedAdapterSync`).

The engine client (:class:`~agentrl.engine.client.EngineClient`, which mixes :class:`AdapterNaming` in)
holds per endpoint the adapter its ``/generate`` names and adds ``lora_path`` to each of them. The
trainer's client is told the name (:meth:`AdapterNaming.use_adapter`); the rollout's client, in another
process, asks the engine: before its first ``/generate`` to an endpoint, and again after every
``continue_generation`` (the call that ends a weight update's pause, so every request resubmitted after
an update names the new adapter), it reads ``GET /v1/models``, where SGLang lists each loaded adapter as
a card whose ``parent`` is the base model (``http_server.available_models``), and names the newest
``agentrl-v*`` one. None there: the base model, which is exactly version 0 of a LoRA run (``B`` starts at
zero). An engine that lists no adapter, such as the embedded engine (which applies the one adapter it
holds to every request), is sent no ``lora_path``. A ``/generate`` that named an adapter and was refused
(SGLang answers 400 for an adapter no longer loaded) is sent once more when the engine now lists
another one.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from agentrl.engine.endpoint import Endpoint, EngineError, EngineRequestError

__all__ = ["ADAPTER_PREFIX", "AdapterNaming", "adapter_name", "adapter_version"]

ADAPTER_PREFIX = "agentrl-v"  # the trainer's adapters are loaded as agentrl-v{policy version}
_ADAPTER = re.compile(re.escape(ADAPTER_PREFIX) + r"(\d+)")


def adapter_name(version: int | str) -> str:
    """The name a LoRA weight sync loads policy version ``version``'s adapter under:
    ``agentrl-v{version}``."""
    return f"{ADAPTER_PREFIX}{int(version)}"


def adapter_version(name: str) -> int | None:
    """The policy version of an adapter named by :func:`adapter_name`, None for any other name."""
    m = _ADAPTER.fullmatch(name)
    return int(m.group(1)) if m else None


class AdapterNaming:
    """The engine client's adapter names (see the module docstring); mixed into ``EngineClient``, whose
    ``endpoints``, ``router``, ``timeout``, ``_call``, ``_request``, ``_all`` and ``control_endpoints`` it
    uses."""

    endpoints: list[Endpoint]
    router: bool
    timeout: float
    _call: Any
    _request: Any
    _all: Any
    control_endpoints: Any

    @property
    def adapters(self) -> dict[str, str | None]:
        """The adapter each endpoint's ``/generate`` names (None: none; looked up where not known yet)."""
        return {ep.url: ep.adapter for ep in self.endpoints}

    def use_adapter(self, name: str | None) -> None:
        """Name adapter ``name`` (None: none, the base model) in every later ``/generate`` of this client,
        on every endpoint, without asking the engines (until the next ``continue_generation``)."""
        for ep in self.endpoints:
            ep.adapter, ep.adapter_known = name, True

    def forget_adapters(self) -> None:
        """Ask the engines again, before the next ``/generate`` to each, which adapter to name (a question
        under way is not waited for: it may have been asked before the change)."""
        for ep in self.endpoints:
            ep.adapter_known, ep.lookup = False, None

    async def serves_adapters_by_name(self) -> bool:
        """Whether the engines apply a LoRA adapter only to the requests that name it: SGLang launched with
        ``--enable-lora`` (its ``/get_server_info`` holds its server arguments, ``enable_lora`` true), not
        the embedded engine (which applies its adapter to every request). Engines of both kinds: an error."""
        infos = await self._all("GET", "/get_server_info")
        named = [isinstance(i, dict) and i.get("enable_lora") is True for i in infos]
        if any(named) and not all(named):
            raise EngineError(
                "some engines serve LoRA adapters by name (SGLang --enable-lora), others do not"
            )
        return all(named)

    async def loaded_adapters(self) -> dict[str, list[str]]:
        """The adapters each engine has loaded, by engine URL (SGLang's ``GET /v1/models`` cards whose
        ``parent`` is the base model; none for an engine that lists none)."""
        endpoints = await self.control_endpoints()
        found = await asyncio.gather(*(self._listed_adapters(ep) for ep in endpoints))
        return {ep.url: names for ep, names in zip(endpoints, found, strict=True)}

    async def _listed_adapters(self, ep: Endpoint, once: bool = False) -> list[str]:
        """The adapter cards of ``ep``'s ``GET /v1/models``; ``once``: one try, a connection error or 5xx
        raised as retryable (asked for a ``/generate``, whose retry then fails over to another endpoint)."""
        try:
            if once:
                body = await self._call(ep, "GET", "/v1/models", None, min(self.timeout, 30.0))
            else:
                body = await self._request("GET", "/v1/models", endpoint=ep)
        except EngineRequestError as err:
            if err.status == 404:  # no OpenAI model list: an engine that names no adapters
                return []
            raise
        cards = body.get("data") if isinstance(body, dict) else None
        return [str(c["id"]) for c in cards or [] if isinstance(c, dict) and c.get("parent") and c.get("id")]

    async def _newest_adapter(self, ep: Endpoint) -> str | None:
        """The newest ``agentrl-v*`` adapter ``ep`` serves (behind a router: one that all its workers
        have)."""
        if self.router:
            lists = list((await self.loaded_adapters()).values())
            names = set(lists[0]).intersection(*lists[1:]) if lists else set()
        else:
            names = set(await self._listed_adapters(ep, once=True))
        ours = [(v, n) for n in names if (v := adapter_version(n)) is not None]
        return max(ours)[1] if ours else None

    async def _adapter_of(self, ep: Endpoint) -> str | None:
        """The adapter a ``/generate`` to ``ep`` names, asked of the engine where not known (one question at
        a time per endpoint, however many requests wait for it)."""
        if ep.adapter_known:
            return ep.adapter
        loop = asyncio.get_running_loop()
        if ep.lookup is None or ep.lookup.done() or ep.lookup.get_loop() is not loop:
            ep.lookup = loop.create_task(self._newest_adapter(ep))
        lookup = ep.lookup
        adapter = await asyncio.shield(lookup)
        if ep.lookup is lookup:  # no newer question was started meanwhile
            ep.adapter, ep.adapter_known, ep.lookup = adapter, True, None
        return adapter
