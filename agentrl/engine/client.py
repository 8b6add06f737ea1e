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

Distributed weight updates follow SGLang's protocol: the trainer is rank 0 of a new process group and
the engines' ranks start at ``rank_offset``. Both ``init_weights_update_group`` and
``update_weights_from_distributed`` only return once the trainer side has joined (the group's
rendezvous) or broadcast the tensors, so the trainer must await them *concurrently* with its own
``init_process_group`` / ``broadcast`` calls (e.g. ``asyncio.gather`` with work in a thread).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp

from agentrl.engine.adapters import AdapterNaming
from agentrl.engine.endpoint import (
    Endpoint,
    EngineError,
    EngineRequestError,
    EngineTimeout,
    EngineUnavailable,
)
from agentrl.engine.json_body import JSON_HEADERS, dumps_json, loads_json
from agentrl.engine.types import GenerateResult, SamplingParams

__all__ = [
    "EngineClient",
    "EngineError",
    "EngineRequestError",
    "EngineTimeout",
    "EngineUnavailable",
]


def _normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return url


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
        self.endpoints = [Endpoint(_normalize_url(u)) for u in urls]
        self.api_key = api_key
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self.backoff = float(backoff)
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._rr = itertools.count()
        self._rid_endpoint: dict[str, Endpoint] = {}
        self.router = router
        self._workers: dict[str, Endpoint] = {}  # router mode: the router's workers, by URL

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.endpoints]

    # ------------------------------------------------------------------ plumbing
    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        # A session is bound to the loop it was created in; a client reused from another loop (e.g. two
        # asyncio.run calls) gets a fresh one instead of failing deep inside aiohttp.
        if self._session is None or self._session.closed or self._session_loop is not loop:
            # No connection cap: the number of concurrent requests is the orchestrator's decision.
            connector = aiohttp.TCPConnector(limit=0, force_close=False)
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers())
            self._session_loop = loop
        return self._session

    def _pick(self, exclude: set[str]) -> Endpoint:
        now = time.monotonic()
        candidates = [e for e in self.endpoints if e.url not in exclude and e.down_until <= now]
        if not candidates:
            candidates = [e for e in self.endpoints if e.url not in exclude] or self.endpoints
        least = min(e.in_flight for e in candidates)
        tied = [e for e in candidates if e.in_flight == least]
        return tied[next(self._rr) % len(tied)]

    def _delay(self, attempt: int) -> float:
        return self.backoff * (2**attempt) * (0.75 + 0.5 * random.random())

    async def _call(
        self,
        ep: Endpoint,
        method: str,
        path: str,
        payload: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Any:
        """One HTTP call, no retries. Raises the typed errors; 5xx/connection errors as _Retryable."""
        session = self._get_session()
        url = ep.url + path
        t = aiohttp.ClientTimeout(total=timeout if timeout is not None else self.timeout)
        # the body serialized here (not aiohttp's json=, the standard library's encoder) and the answer
        # read and parsed once: a /generate's JSON was a tenth of the rollout loop's time
        data, headers = (None, None) if payload is None else (dumps_json(payload), JSON_HEADERS)
        try:
            async with session.request(method, url, data=data, headers=headers, timeout=t) as resp:
                raw = await resp.read()
                if resp.status >= 400:
                    text = await resp.text()
                    if resp.status >= 500:
                        raise _Retryable(f"{method} {url} answered {resp.status}: {text[:500]}")
                    raise EngineRequestError(
                        f"{method} {url} answered {resp.status}: {_server_message(text)}", resp.status, url
                    )
                if not raw:
                    return {}
                if not raw.strip():  # what aiohttp's resp.json() answered for a blank body
                    return None
                try:
                    return loads_json(raw)
                except ValueError:
                    return await resp.text()
        except TimeoutError as err:
            raise EngineTimeout(
                f"{method} {url} did not answer within {t.total:.1f}s (raise EngineClient(timeout=...))"
            ) from err
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as err:
            raise _Retryable(f"{method} {url}: {type(err).__name__}: {err}") from err

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
        """A call with retries; ``endpoint=None`` routes to the least-loaded endpoint (and fails over).

        ``rid`` records which endpoint serves that request while it runs, so ``abort(rid)`` finds it.
        ``prepare(endpoint)``, when given, makes the payload for the endpoint picked (a ``/generate`` names
        that endpoint's adapter).
        """
        tried: set[str] = set()
        last = ""
        for attempt in range(self.max_retries + 1):
            ep = endpoint or self._pick(tried)
            ep.in_flight += 1
            if rid is not None:
                self._rid_endpoint[rid] = ep
            try:
                body = payload if prepare is None else await prepare(ep)
                result = await self._call(ep, method, path, body, timeout)
                ep.down_until = 0.0
                return result
            except _Retryable as err:
                last = str(err)
                tried.add(ep.url)
                ep.down_until = time.monotonic() + self._delay(attempt)
                if len(tried) == len(self.endpoints):
                    tried.clear()  # every endpoint failed once: start over after backing off
            finally:
                ep.in_flight -= 1
                if rid is not None:
                    self._rid_endpoint.pop(rid, None)
            if attempt < self.max_retries:
                await asyncio.sleep(self._delay(attempt))
        raise EngineUnavailable(f"engine unavailable after {self.max_retries + 1} attempts: {last}")

    async def control_endpoints(self) -> list[Endpoint]:
        """Where control calls go: the endpoints, or in router mode the router's workers."""
        if not self.router:
            return self.endpoints
        found: list[Endpoint] = []
        for ep in self.endpoints:
            body = await self._request("GET", "/workers", endpoint=ep)
            for w in body.get("workers", []) if isinstance(body, dict) else []:
                url = _normalize_url(str(w["url"]))
                found.append(self._workers.setdefault(url, Endpoint(url)))
        if not found:
            raise EngineUnavailable(f"the router(s) {self.urls} list no workers (GET /workers)")
        return found

    async def worker_urls(self) -> list[str]:
        """The engines that control calls and weight syncs reach: the URLs, or a router's workers now."""
        return [ep.url for ep in await self.control_endpoints()]

    async def _broadcast(
        self, method: str, path: str, payloads: Sequence[dict[str, Any] | None]
    ) -> list[Any]:
        """The same control call on every control endpoint at once (one payload per endpoint)."""
        endpoints = await self.control_endpoints()
        if len(payloads) != len(endpoints):
            raise ValueError(f"{len(payloads)} payloads for {len(endpoints)} endpoints")
        results = await asyncio.gather(
            *(self._request(method, path, p, endpoint=ep) for ep, p in zip(endpoints, payloads, strict=True)),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        for ep, r in zip(endpoints, results, strict=True):
            if isinstance(r, dict) and r.get("success") is False:
                raise EngineRequestError(f"{ep.url}{path} failed: {r.get('message', r)}", 200, ep.url)
        return list(results)

    async def _all(self, method: str, path: str, payload: dict[str, Any] | None = None) -> list[Any]:
        return await self._broadcast(method, path, [payload] * len(await self.control_endpoints()))

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
        ep = None if self.router else self._rid_endpoint.get(rid)
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

    # ------------------------------------------------------------------ weights
    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
    ) -> None:
        """Every endpoint reloads its weights from ``model_path`` (a HF checkpoint directory)."""
        payload: dict[str, Any] = {"model_path": str(model_path), "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        await self._all("POST", "/update_weights_from_disk", payload)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int | list[int],
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Every endpoint joins the trainer's weight-broadcast group (trainer = rank 0).

        ``rank_offset`` is the first engine rank of the first endpoint; with several endpoints each
        following one starts after the previous one's ``tp_size`` ranks (read from
        ``/get_server_info``), or pass one offset per endpoint as a list.
        """
        endpoints = await self.control_endpoints()
        if isinstance(rank_offset, int):
            offsets = [rank_offset]
            if len(endpoints) > 1:
                infos = await self._all("GET", "/get_server_info")
                for info in infos[:-1]:
                    tp = int(info.get("tp_size", 1)) if isinstance(info, dict) else 1
                    offsets.append(offsets[-1] + tp)
        else:
            offsets = [int(o) for o in rank_offset]
            if len(offsets) != len(endpoints):
                raise ValueError(f"{len(offsets)} rank offsets for {len(endpoints)} endpoints")
        payloads: list[dict[str, Any] | None] = [
            {
                "master_address": master_address,
                "master_port": int(master_port),
                "rank_offset": off,
                "world_size": int(world_size),
                "group_name": group_name,
                "backend": backend,
            }
            for off in offsets
        ]
        await self._broadcast("POST", "/init_weights_update_group", payloads)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        """Every endpoint leaves the weight-broadcast group (SGLang's ``/destroy_weights_update_group``)."""
        await self._all("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> None:
        """Announce one broadcast bucket; the trainer (rank 0) then broadcasts each tensor in order."""
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError("names, dtypes and shapes must have the same length")
        payload: dict[str, Any] = {
            "names": list(names),
            "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [list(map(int, s)) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        await self._all("POST", "/update_weights_from_distributed", payload)

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> None:
        """Every endpoint copies in the named tensors of a payload from
        :func:`agentrl.engine.named_tensors.pack_named_tensors` (one entry per tensor-parallel rank of
        the engine; the same payload for each). The engines must share the sender's machine (and GPU)."""
        payload: dict[str, Any] = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if load_format is not None:
            payload["load_format"] = load_format
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        await self._all("POST", "/update_weights_from_tensor", payload)

    async def load_lora_adapter(
        self,
        lora_name: str,
        lora_path: str,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
    ) -> None:
        """Every endpoint loads the PEFT adapter dir ``lora_path`` as ``lora_name`` (the embedded engine
        serves it to every request, as version ``weight_version``; SGLang to requests that name it)."""
        payload: dict[str, Any] = {
            "lora_name": lora_name,
            "lora_path": str(lora_path),
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        await self._all("POST", "/load_lora_adapter", payload)

    async def load_lora_adapter_from_tensors(
        self,
        lora_name: str,
        config_dict: dict[str, Any],
        serialized_tensors: str,
        load_format: str | None = None,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
    ) -> None:
        """Every endpoint loads an adapter handed over in memory: a PEFT state dict packed by
        :func:`agentrl.engine.named_tensors.pack_named_tensors` and its ``adapter_config.json`` mapping."""
        payload: dict[str, Any] = {
            "lora_name": lora_name,
            "config_dict": config_dict,
            "serialized_tensors": serialized_tensors,
            "abort_all_requests": abort_all_requests,
        }
        if load_format is not None:
            payload["load_format"] = load_format
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        await self._all("POST", "/load_lora_adapter_from_tensors", payload)

    async def unload_lora_adapter(self, lora_name: str, urls: list[str] | None = None) -> None:
        """Every endpoint (or those of ``urls``) unloads the adapter ``lora_name`` (SGLang's
        ``/unload_lora_adapter``: the name is refused to new requests at once, and the adapter freed once
        the running requests that use it end; the embedded engine takes its adapter off every request)."""
        endpoints = [ep for ep in await self.control_endpoints() if urls is None or ep.url in urls]
        body = {"lora_name": lora_name}
        await asyncio.gather(
            *(self._request("POST", "/unload_lora_adapter", body, endpoint=ep) for ep in endpoints)
        )

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Every endpoint frees the GPU memory of ``tags`` (``weights``, ``kv_cache``, and on SGLang
        ``cuda_graph``; None: all) and holds requests until :meth:`resume_memory_occupation` (SGLang needs
        ``--enable-memory-saver``, and asserts that it is idle: pause generation first). Weights released on
        an SGLang server without ``--enable-weights-cpu-backup`` come back as garbage: push new ones."""
        await self._all("POST", "/release_memory_occupation", {} if tags is None else {"tags": list(tags)})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Every endpoint takes back the memory of ``tags`` (None: everything released)."""
        await self._all("POST", "/resume_memory_occupation", {} if tags is None else {"tags": list(tags)})

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> None:
        """Set the version string the engines report (SGLang's own default would abort everything)."""
        await self._all(
            "POST",
            "/update_weight_version",
            {"new_version": str(new_version), "abort_all_requests": abort_all_requests},
        )

    # ------------------------------------------------------------------ info
    async def health(self) -> bool:
        """True when every endpoint answers ``/health`` with 200 (one try, short timeout)."""

        async def one(ep: Endpoint) -> bool:
            try:
                await self._call(ep, "GET", "/health", None, timeout=min(self.timeout, 10.0))
                return True
            except (EngineError, _Retryable):
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
        if self._session is not None and not self._session.closed:
            try:
                await self._session.close()
            except RuntimeError:  # created in a loop that is gone
                pass
        self._session = None

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _Retryable(Exception):
    """Internal: a connection error or 5xx answer worth another try."""


def _server_message(text: str) -> str:
    """The human part of an error body (SGLang answers {"error": {"message": ...}} or {"message": ...})."""
    try:
        body = json.loads(text)
    except ValueError:
        return text[:1000]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("message", "error_message", "detail", "error"):
            if key in body:
                return str(body[key])
    return text[:1000]
