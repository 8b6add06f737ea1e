"""How the engine client reaches its engines: HTTP calls to a set of endpoints, with retries, routing and
failover.

:class:`EngineTransport` keeps the endpoints (:class:`~agentrl.engine.endpoint.Endpoint`) and one
``aiohttp`` session per event loop, and makes three kinds of call:

* one call to one endpoint, no retries (:meth:`EngineTransport.call`); a 4xx answer raises
  :class:`EngineRequestError` with the server's message, a run past ``timeout`` :class:`EngineTimeout`;
* a call with retries (:meth:`EngineTransport.request`): connection errors and 5xx answers are tried
  again after ``backoff * 2**attempt`` seconds (jittered); without an endpoint given, each try goes to the
  endpoint with the fewest requests in flight from this client, another one than those that failed;
* the same call on every control endpoint at once (:meth:`EngineTransport.broadcast`): the endpoints, or
  behind an ``sglang-router`` its workers, listed by ``GET /workers`` at each control call (the router
  answers 404 to control calls itself).
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

from agentrl.engine.endpoint import Endpoint, EngineRequestError, EngineTimeout, EngineUnavailable
from agentrl.engine.json_body import JSON_HEADERS, dumps_json, loads_json


def normalize_url(url: str) -> str:
    """``url`` without trailing slashes, ``http://`` added where it names no scheme."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return url


class Retryable(Exception):
    """A connection error or 5xx answer worth another try."""


class EngineTransport:
    """Calls to a set of engine endpoints (see the module docstring)."""

    def __init__(
        self,
        urls: list[str],
        api_key: str | None,
        timeout: float,
        max_retries: int,
        backoff: float,
        router: bool,
    ) -> None:
        self.endpoints = [Endpoint(normalize_url(u)) for u in urls]
        self.api_key = api_key
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self.backoff = float(backoff)
        self.router = router
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._rr = itertools.count()
        self.rid_endpoint: dict[str, Endpoint] = {}  # the endpoint serving each request in flight, by rid
        self._workers: dict[str, Endpoint] = {}  # router mode: the router's workers, by URL

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.endpoints]

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

    async def call(
        self,
        ep: Endpoint,
        method: str,
        path: str,
        payload: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Any:
        """One HTTP call, no retries. Raises the typed errors; 5xx/connection errors as :class:`Retryable`."""
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
                        raise Retryable(f"{method} {url} answered {resp.status}: {text[:500]}")
                    raise EngineRequestError(
                        f"{method} {url} answered {resp.status}: {server_message(text)}", resp.status, url
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
            raise Retryable(f"{method} {url}: {type(err).__name__}: {err}") from err

    async def request(
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

        ``rid`` records which endpoint serves that request while it runs (:attr:`rid_endpoint`), so an
        abort of it finds it. ``prepare(endpoint)``, when given, makes the payload for the endpoint picked (a
        ``/generate`` names that endpoint's adapter).
        """
        tried: set[str] = set()
        last = ""
        for attempt in range(self.max_retries + 1):
            ep = endpoint or self._pick(tried)
            ep.in_flight += 1
            if rid is not None:
                self.rid_endpoint[rid] = ep
            try:
                body = payload if prepare is None else await prepare(ep)
                result = await self.call(ep, method, path, body, timeout)
                ep.down_until = 0.0
                return result
            except Retryable as err:
                last = str(err)
                tried.add(ep.url)
                ep.down_until = time.monotonic() + self._delay(attempt)
                if len(tried) == len(self.endpoints):
                    tried.clear()  # every endpoint failed once: start over after backing off
            finally:
                ep.in_flight -= 1
                if rid is not None:
                    self.rid_endpoint.pop(rid, None)
            if attempt < self.max_retries:
                await asyncio.sleep(self._delay(attempt))
        raise EngineUnavailable(f"engine unavailable after {self.max_retries + 1} attempts: {last}")

    async def control_endpoints(self) -> list[Endpoint]:
        """Where control calls go: the endpoints, or in router mode the router's workers."""
        if not self.router:
            return self.endpoints
        found: list[Endpoint] = []
        for ep in self.endpoints:
            body = await self.request("GET", "/workers", endpoint=ep)
            for w in body.get("workers", []) if isinstance(body, dict) else []:
                url = normalize_url(str(w["url"]))
                found.append(self._workers.setdefault(url, Endpoint(url)))
        if not found:
            raise EngineUnavailable(f"the router(s) {self.urls} list no workers (GET /workers)")
        return found

    async def broadcast(self, method: str, path: str, payloads: Sequence[dict[str, Any] | None]) -> list[Any]:
        """The same control call on every control endpoint at once (one payload per endpoint)."""
        endpoints = await self.control_endpoints()
        if len(payloads) != len(endpoints):
            raise ValueError(f"{len(payloads)} payloads for {len(endpoints)} endpoints")
        results = await asyncio.gather(
            *(self.request(method, path, p, endpoint=ep) for ep, p in zip(endpoints, payloads, strict=True)),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        for ep, r in zip(endpoints, results, strict=True):
            if isinstance(r, dict) and r.get("success") is False:
                raise EngineRequestError(f"{ep.url}{path} failed: {r.get('message', r)}", 200, ep.url)
        return list(results)

    async def all(self, method: str, path: str, payload: dict[str, Any] | None = None) -> list[Any]:
        """:meth:`broadcast` with one payload for every control endpoint."""
        return await self.broadcast(method, path, [payload] * len(await self.control_endpoints()))

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            try:
                await self._session.close()
            except RuntimeError:  # created in a loop that is gone
                pass
        self._session = None


def server_message(text: str) -> str:
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


__all__ = ["EngineTransport", "Retryable", "normalize_url", "server_message"]
