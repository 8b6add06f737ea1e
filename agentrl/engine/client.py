"""The async client of SGLang's native HTTP API, for one engine, several engines or an sglang-router.

:class:`EngineClient` is the only way agentrl talks to an inference engine (a real SGLang server, an
``sglang-router`` in front of several, or the embedded engine in :mod:`agentrl.embedded.server`):

* ``generate`` sends ``input_ids`` (token-in/token-out) and returns a :class:`GenerateResult` with the
  sampled ids, their logprobs, the finish reason and the engine's ``weight_version``. With several
  URLs each request goes to the endpoint with the fewest requests in flight from this client
  (least-loaded routing); a router URL is just one endpoint that speaks the same API.
* Control calls (abort, pause/continue, flush_cache, weight updates) go to every endpoint at once.
* Connection errors and 5xx answers are retried with exponential backoff (``backoff * 2**attempt``,
  jittered); a ``generate`` retry prefers another endpoint. A 4xx answer is not retried: it raises
  :class:`EngineRequestError` carrying the server's message. A request that runs past ``timeout``
  raises :class:`EngineTimeout` (not retried: the engine may still be working on it).
* ``api_key`` is sent as ``Authorization: Bearer <key>``, which is what SGLang's ``--api-key`` checks.
* ``router=True``: the URL is an ``sglang-router`` (``python -m sglang_router.launch_router``).
  ``generate`` goes through it, but the router (0.3.2) answers 404 to ``/abort_request``,
  ``/pause_generation``, ``/continue_generation``, the weight-update endpoints and
  ``/get_weight_version``; so every control call goes to its workers, listed by the router's
  ``GET /workers`` (asked again at each control call, so workers added later are reached too).

LoRA adapters that SGLang serves by name: ``generate`` adds ``lora_path`` naming the adapter each endpoint
serves now, which the client looks up in the engine's adapter list (:mod:`agentrl.engine.adapters`).

The calls themselves (retries, least-loaded routing, router workers) are :mod:`agentrl.engine.transport`'s;
the weight-update verbs' bodies are :mod:`agentrl.engine.weight_calls`'s (which says how the trainer awaits
a distributed update).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from agentrl.engine.adapters import AdapterNaming
from agentrl.engine.endpoint import (
    Endpoint,
    EngineError,
    EngineRequestError,
    EngineTimeout,
    EngineUnavailable,
)
from agentrl.engine.transport import EngineTransport, Retryable
from agentrl.engine.types import GenerateResult, SamplingParams
from agentrl.engine.weight_calls import WeightUpdateCalls

__all__ = [
    "EngineClient",
    "EngineError",
    "EngineRequestError",
    "EngineTimeout",
    "EngineUnavailable",
]


class EngineClient(AdapterNaming):
    """Async client of one or more SGLang-protocol engines (see the module docstring)."""

    def __init__(
        self,
        urls: str | list[str],
        api_key: str | None = None,
        timeout: float = 600.0,
        max_retries: int = 3,
        backoff: float = 0.5,
        router: bool = False,
    ) -> None:
        if isinstance(urls, str):
            urls = [u for u in urls.split(",") if u.strip()]
        if not urls:
            raise ValueError("EngineClient needs at least one engine URL")
        self.transport = EngineTransport(urls, api_key, timeout, max_retries, backoff, router)
        self.weights = WeightUpdateCalls(self.transport)

    @property
    def urls(self) -> list[str]:
        return self.transport.urls

    # ------------------------------------------------------------------ the transport's (.transport)
    @property
    def endpoints(self) -> list[Endpoint]:
        return self.transport.endpoints

    @property
    def router(self) -> bool:
        return self.transport.router

    @property
    def timeout(self) -> float:
        return self.transport.timeout

    async def _call(
        self,
        ep: Endpoint,
        method: str,
        path: str,
        payload: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Any:
        return await self.transport.call(ep, method, path, payload, timeout)

    async def _request(
        self,
        method: str,
        path: str,
        payload: dict[str, Any] | None = None,
        endpoint: Endpoint | None = None,
        timeout: float | None = None,
        rid: str | None = None,
        prepare: Callable[[Endpoint], Awaitable[dict[str, Any]]] | None = None,
    ) -> Any:
        return await self.transport.request(method, path, payload, endpoint, timeout, rid, prepare)

    async def control_endpoints(self) -> list[Endpoint]:
        """Where control calls go: the endpoints, or in router mode the router's workers."""
        return await self.transport.control_endpoints()

    async def worker_urls(self) -> list[str]:
        """The engines that control calls and weight syncs reach: the URLs, or a router's workers now."""
        return [ep.url for ep in await self.control_endpoints()]

    async def _broadcast(
        self, method: str, path: str, payloads: Sequence[dict[str, Any] | None]
    ) -> list[Any]:
        return await self.transport.broadcast(method, path, payloads)

    async def _all(self, method: str, path: str, payload: dict[str, Any] | None = None) -> list[Any]:
        return await self.transport.all(method, path, payload)

    # ------------------------------------------------------------------ generation
    async def generate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        rid: str | None = None,
        return_logprob: bool = True,
        return_routed_experts: bool = False,
    ) -> GenerateResult:
        """Sample a continuation of ``input_ids`` on the least-loaded endpoint. ``return_routed_experts``
        (MoE models): ``meta["routed_experts"]`` holds the experts every input position was routed to
        (SGLang's field; an SGLang server needs ``--enable-return-routed-experts``)."""
        payload: dict[str, Any] = {
            "input_ids": list(map(int, input_ids)),
            "sampling_params": sampling.to_sglang(),
            "return_logprob": bool(return_logprob),
            "stream": False,
        }  # logprob_start_len left at SGLang's default (-1): logprobs of the output tokens only
        if return_routed_experts:
            payload["return_routed_experts"] = True
        if rid is not None:
            payload["rid"] = rid
        named: dict[str, str | None] = {}  # endpoint URL -> the adapter its request named

        async def prepare(ep: Endpoint) -> dict[str, Any]:
            named[ep.url] = adapter = await self._adapter_of(ep)
            return payload if adapter is None else {**payload, "lora_path": adapter}

        try:
            body = await self._request("POST", "/generate", rid=rid, prepare=prepare)
        except EngineRequestError as err:
            # refused while naming an adapter: the sync may have replaced it since it was looked up
            ep = next((e for e in self.endpoints if err.url.startswith(e.url + "/")), None)
            if ep is None or named.get(ep.url) is None:
                raise
            ep.adapter_known = False
            if await self._adapter_of(ep) in (None, named[ep.url]):  # never fall back to the base silently
                raise
            body = await self._request("POST", "/generate", endpoint=ep, rid=rid, prepare=prepare)
        if isinstance(body, list):  # SGLang answers a list for batched input; we send one prompt
            body = body[0]
        if not isinstance(body, dict):
            raise EngineError(f"/generate answered something that is not a JSON object: {str(body)[:200]}")
        try:
            result = GenerateResult.from_sglang(body)
        except (ValueError, TypeError, KeyError, IndexError) as err:
            raise EngineError(f"/generate answer could not be parsed: {err}") from err
        if return_logprob and len(result.logprobs) != len(result.output_ids):
            raise EngineError("/generate answered without output_token_logprobs although they were asked for")
        return result

    async def abort(self, rid: str | None = None) -> None:
        """Abort one request (by ``rid``) or, with ``None``, every request on every endpoint."""
        if rid is None:
            await self._all("POST", "/abort_request", {"abort_all": True})
            return
        ep = None if self.router else self.transport.rid_endpoint.get(rid)
        if ep is not None:
            await self._request("POST", "/abort_request", {"rid": rid}, endpoint=ep)
        else:  # not (or no longer) ours in flight: tell everyone, harmless where unknown
            await self._all("POST", "/abort_request", {"rid": rid})

    async def pause(self, mode: str = "abort") -> None:
        """Pause generation on every endpoint; ``abort`` returns in-flight requests as aborted."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode must be abort, retract or in_place, not {mode!r}")
        await self._all("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        """Every endpoint continues; each one's adapter is looked up again before its next ``/generate``
        (a weight update's pause ends here, and the update may have loaded a new adapter)."""
        await self._all("POST", "/continue_generation", {})
        self.forget_adapters()

    async def flush_cache(self) -> None:
        await self._all("POST", "/flush_cache", None)

    # ------------------------------------------------------------------ weights (.weights)
    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
    ) -> None:
        """Every endpoint reloads its weights from ``model_path`` (a HF checkpoint directory)."""
        await self.weights.update_weights_from_disk(model_path, weight_version, abort_all_requests)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int | list[int],
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Every endpoint joins the trainer's weight-broadcast group (trainer = rank 0; ``rank_offset``:
        :meth:`WeightUpdateCalls.init_weights_update_group`)."""
        await self.weights.init_weights_update_group(
            master_address, master_port, rank_offset, world_size, group_name, backend
        )

    async def destroy_weights_update_group(self, group_name: str) -> None:
        """Every endpoint leaves the weight-broadcast group (SGLang's ``/destroy_weights_update_group``)."""
        await self.weights.destroy_weights_update_group(group_name)

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        load_format: str | None = None,
    ) -> None:
        """Announce one broadcast bucket; the trainer (rank 0) then broadcasts each tensor in order, or
        with ``load_format: flattened_bucket`` the bucket's bytes in one broadcast."""
        await self.weights.update_weights_from_distributed(
            names, dtypes, shapes, group_name, weight_version, flush_cache, abort_all_requests, load_format
        )

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> None:
        """Every endpoint copies in the named tensors of a payload from
        :func:`agentrl.engine.named_tensors.pack_named_tensors` (the engines share the sender's GPU)."""
        await self.weights.update_weights_from_tensor(
            serialized_named_tensors, load_format, weight_version, flush_cache, abort_all_requests
        )

    async def load_lora_adapter(
        self,
        lora_name: str,
        lora_path: str,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
    ) -> None:
        """Every endpoint loads the PEFT adapter dir ``lora_path`` as ``lora_name``."""
        await self.weights.load_lora_adapter(lora_name, lora_path, weight_version, abort_all_requests)

    async def load_lora_adapter_from_tensors(
        self,
        lora_name: str,
        config_dict: dict[str, Any],
        serialized_tensors: str,
        load_format: str | None = None,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
    ) -> None:
        """Every endpoint loads an adapter handed over in memory (a packed PEFT state dict)."""
        await self.weights.load_lora_adapter_from_tensors(
            lora_name, config_dict, serialized_tensors, load_format, weight_version, abort_all_requests
        )

    async def unload_lora_adapter(self, lora_name: str, urls: list[str] | None = None) -> None:
        """Every endpoint (or those of ``urls``) unloads the adapter ``lora_name``."""
        await self.weights.unload_lora_adapter(lora_name, urls)

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> None:
        """Set the version string the engines report (SGLang's own default would abort everything)."""
        await self.weights.update_weight_version(new_version, abort_all_requests)

    # ------------------------------------------------------------------ memory
    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Every endpoint frees the GPU memory of ``tags`` (``weights``, ``kv_cache``, and on SGLang
        ``cuda_graph``; None: all) and holds requests until :meth:`resume_memory_occupation` (SGLang needs
        ``--enable-memory-saver``, and asserts that it is idle: pause generation first). Weights released on
        an SGLang server without ``--enable-weights-cpu-backup`` come back as garbage: push new ones."""
        await self._all("POST", "/release_memory_occupation", {} if tags is None else {"tags": list(tags)})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Every endpoint takes back the memory of ``tags`` (None: everything released)."""
        await self._all("POST", "/resume_memory_occupation", {} if tags is None else {"tags": list(tags)})

    # ------------------------------------------------------------------ info
    async def health(self) -> bool:
        """True when every endpoint answers ``/health`` with 200 (one try, short timeout)."""

        async def one(ep: Endpoint) -> bool:
            try:
                await self._call(ep, "GET", "/health", None, timeout=min(self.timeout, 10.0))
                return True
            except (EngineError, Retryable):
                return False

        return all(await asyncio.gather(*(one(ep) for ep in self.endpoints)))

    async def model_info(self) -> dict:
        """``/get_model_info`` of the first endpoint (all endpoints serve the same model)."""
        return await self._request("GET", "/get_model_info", endpoint=self.endpoints[0])

    async def weights_by_name(self, name: str, truncate_size: int = 100) -> list[list[float]]:
        """SGLang's ``/get_weights_by_name`` of every endpoint: the parameter's first values, flattened."""
        return await self._all("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    async def server_info(self) -> list[dict]:
        """``/get_server_info`` of every endpoint."""
        return await self._all("GET", "/get_server_info")

    async def close(self) -> None:
        await self.transport.close()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
