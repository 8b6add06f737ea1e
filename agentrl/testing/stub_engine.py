"""A TEST STAND-IN for an SGLang server: the native HTTP protocol with no model behind it.

It answers ``/generate`` with random (seeded) or scripted token ids and logprobs, in SGLang's JSON, and
implements the control endpoints the rollout relies on: ``/pause_generation`` (abort mode: in-flight
requests return at once with ``finish_reason`` abort and the tokens "generated" so far; requests that
arrive while paused wait for ``/continue_generation``), ``/abort_request``, ``/update_weights_from_disk``,
``/update_weight_version``, ``/flush_cache``, ``/health``, ``/get_model_info``, ``/v1/models``, and with
``enable_lora`` SGLang's LoRA endpoints and ``lora_path`` on ``/generate`` (:mod:`agentrl.testing.stub_lora`,
which says what of SGLang's behaviour it keeps). Latency is a model, not
a computation: ``base_latency + per_token_time * n`` seconds per request (0 = zero-latency), and
failures are injected at configurable rates (HTTP 500, or a hang that ends in a client timeout).

It exists for tests and benchmarks of the orchestrator (real HTTP, no GPU). It is not an inference
engine: the embedded engine (``agentrl.embedded.server``) and SGLang are.

Run it in its own process (what tests and benches do, so it never shares their event loop)::

    python -m agentrl.testing.stub_engine --port 0 --per-token-time 0.001 --fail-rate 0.05

It prints ``STUB_SERVER_LISTENING <port>`` once it accepts connections. :func:`start_stub_server`
does that from Python and returns a handle with ``.url``, ``.stop()``, ``.kill()`` and ``.restart()``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

from aiohttp import web

from agentrl.testing.stub_lora import AdapterError, StubAdapters

READY_LINE = "STUB_SERVER_LISTENING"


@dataclass
class StubEngineConfig:
    """Behaviour of the stand-in engine (all latencies in seconds)."""

    vocab_low: int = 3  # sampled token ids are drawn from [vocab_low, vocab_high)
    vocab_high: int = 600
    eos_id: int = 2  # appended when a sampled response ends before max_new_tokens
    min_tokens: int = 1  # response length model: uniform in [min_tokens, max_tokens] ...
    max_tokens: int = 16
    length_sigma: float = 0.0  # ... or, when > 0, log-normal with median (min+max)/2 and this sigma
    base_latency: float = 0.0  # seconds per request
    per_token_time: float = 0.0  # seconds per sampled token (0 and base 0: zero-latency)
    fail_rate: float = 0.0  # fraction of /generate answered with HTTP 500
    hang_rate: float = 0.0  # fraction of /generate that hang for hang_time (client timeout)
    hang_time: float = 30.0
    update_latency: float = 0.0  # time a weight update takes
    weight_version: str = "0"
    seed: int = 0
    script: list[list[int]] = field(default_factory=list)  # if set: request i answers script[i % len]
    # SGLang's --enable-lora, --max-lora-rank, --lora-target-modules, --max-loaded-loras (0: no limit)
    enable_lora: bool = False
    max_lora_rank: int = 0
    lora_target_modules: list[str] = field(default_factory=list)
    max_loaded_loras: int = 0
    # abort-mode /pause_generation as SGLang 0.5.16 does it: abort everything, then, while a request is
    # still running, sleep this long before aborting and looking again (0: return at once)
    pause_poll_interval: float = 0.0


def _lognormal_length(rng: random.Random, cfg: StubEngineConfig) -> int:
    median = (cfg.min_tokens + cfg.max_tokens) / 2
    return int(
        min(cfg.max_tokens, max(cfg.min_tokens, round(median * math.exp(rng.gauss(0, cfg.length_sigma)))))
    )


class StubEngine:
    """The aiohttp application and its state; see the module docstring."""

    def __init__(self, cfg: StubEngineConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.weight_version = cfg.weight_version
        self.paused = False
        self._resume = asyncio.Event()
        self._resume.set()
        # rid -> event that, when set, makes the request return early with finish_reason abort
        self._inflight: dict[str, asyncio.Event] = {}
        # set as each /generate request arrives: an in-process caller clears it and waits for the next one
        self.arrived = asyncio.Event()
        self.counters: dict[str, int] = {
            "generate": 0,
            "generated_tokens": 0,
            "aborted": 0,
            "failed": 0,
            "hung": 0,
            "updates": 0,
            "pause_polls": 0,  # abort-mode pauses that found requests still running (pause_poll_interval)
        }
        self._rid_seq = 0
        self.lora = StubAdapters(
            cfg.enable_lora, cfg.max_lora_rank, cfg.lora_target_modules, cfg.max_loaded_loras
        )

    # ---- app -----------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_route("*", "/flush_cache", self.ok)
        r.add_get("/health", self.ok)
        r.add_get("/health_generate", self.ok)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/v1/models", self.models)
        r.add_post("/load_lora_adapter", self.load_lora_adapter)
        r.add_post("/load_lora_adapter_from_tensors", self.load_lora_adapter_from_tensors)
        r.add_post("/unload_lora_adapter", self.unload_lora_adapter)
        r.add_get("/stub_stats", self.stats)
        return app

    async def ok(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": "stub",
                "tokenizer_path": None,
                "is_generation": True,
                "weight_version": self.weight_version,
                "stub": True,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "stub": True,
                "config": asdict(self.cfg),
                "weight_version": self.weight_version,
                **self.lora.server_args(),
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": self.lora.model_cards("stub")})

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        return await self._lora_update(self.lora.load(await _json_or_empty(request), from_tensors=False))

    async def load_lora_adapter_from_tensors(self, request: web.Request) -> web.Response:
        return await self._lora_update(self.lora.load(await _json_or_empty(request), from_tensors=True))

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = await _json_or_empty(request)
        return await self._lora_update(self.lora.unload(str(body.get("lora_name"))))

    async def _lora_update(self, update: Any) -> web.Response:
        """SGLang's LoRAUpdateOutput: 200 with the loaded adapters, or 400 with the error."""
        try:
            await update
        except AdapterError as err:
            body = {"success": False, "error_message": str(err), "loaded_adapters": None}
            return web.json_response(body, status=400)
        loaded = {a.name: a.path for a in self.lora.loaded.values()}
        return web.json_response({"success": True, "error_message": None, "loaded_adapters": loaded})

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                **self.counters,
                "inflight": len(self._inflight),
                "paused": self.paused,
                "weight_version": self.weight_version,
                "lora_log": list(self.lora.log),  # the adapter each /generate ran with ("base": none)
                "lora_loaded": list(self.lora.loaded),
                "lora_unloaded": list(self.lora.unloaded),
            }
        )

    # ---- generation ----------------------------------------------------------------------------
    def _sample(self, max_new: int, stop_ids: set[int]) -> tuple[list[int], list[float], str, int | None]:
        cfg = self.cfg
        if cfg.script:
            ids = list(cfg.script[self.counters["generate"] % len(cfg.script)])
            if len(ids) > max_new:
                return ids[:max_new], [-0.5] * max_new, "length", None
            for j, t in enumerate(ids):
                if t in stop_ids or t == cfg.eos_id:
                    return ids[: j + 1], [-0.5] * (j + 1), "stop", t
            return ids, [-0.5] * len(ids), "stop", None
        rng = self.rng
        n = (
            _lognormal_length(rng, cfg)
            if cfg.length_sigma > 0
            else rng.randint(cfg.min_tokens, cfg.max_tokens)
        )
        ids: list[int] = []
        for _ in range(min(n, max_new)):
            t = rng.randrange(cfg.vocab_low, cfg.vocab_high)
            ids.append(t)
            if t in stop_ids:
                lps = [-rng.random() * 4 for _ in ids]
                return ids, lps, "stop", t
        if n < max_new:
            ids.append(cfg.eos_id)  # the model's own end-of-turn token, as SGLang includes it
            reason, matched = "stop", cfg.eos_id
        else:
            reason, matched = "length", None
        return ids, [-rng.random() * 4 for _ in ids], reason, matched

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.counters["generate"] += 1
        self.arrived.set()
        rng = self.rng
        if self.cfg.fail_rate and rng.random() < self.cfg.fail_rate:
            self.counters["failed"] += 1
            return web.json_response({"error": "stub: injected internal error"}, status=500)
        if self.cfg.hang_rate and rng.random() < self.cfg.hang_rate:
            self.counters["hung"] += 1
            await asyncio.sleep(self.cfg.hang_time)
        input_ids = body.get("input_ids") or []
        sp = body.get("sampling_params") or {}
        max_new = int(sp.get("max_new_tokens", 128))
        stop_ids = {int(t) for t in sp.get("stop_token_ids") or []}
        if not sp.get("ignore_eos"):
            stop_ids.add(self.cfg.eos_id)
        self._rid_seq += 1
        rid = str(body.get("rid") or f"stub-{self._rid_seq}")
        abort = asyncio.Event()
        self._inflight[rid] = abort
        adapter_id = None
        try:
            if not self._resume.is_set():  # paused: queue until /continue_generation (or an abort)
                waiters = [asyncio.ensure_future(self._resume.wait()), asyncio.ensure_future(abort.wait())]
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                for w in waiters:
                    w.cancel()
                if abort.is_set():
                    self.counters["aborted"] += 1
                    return self._answer(rid, input_ids, [], [], "abort", None)
            try:  # as SGLang: the adapter's name is looked up once the request may run
                adapter_id = await self.lora.acquire(body.get("lora_path"))
            except AdapterError as err:
                return web.json_response({"error": {"message": str(err)}}, status=400)
            ids, lps, reason, matched = self._sample(max_new, stop_ids)
            version = self.weight_version
            delay = self.cfg.base_latency + self.cfg.per_token_time * len(ids)
            if delay > 0:
                t0 = time.monotonic()
                try:
                    await asyncio.wait_for(abort.wait(), delay)
                except TimeoutError:
                    pass
                else:  # aborted: return what was "generated" so far
                    elapsed = time.monotonic() - t0 - self.cfg.base_latency
                    done = (
                        0 if self.cfg.per_token_time <= 0 else int(max(elapsed, 0) / self.cfg.per_token_time)
                    )
                    done = min(done, len(ids) - 1) if ids else 0
                    ids, lps, reason, matched = ids[:done], lps[:done], "abort", None
                    self.counters["aborted"] += 1
        finally:
            self._inflight.pop(rid, None)
            self.lora.release(adapter_id)
        self.counters["generated_tokens"] += len(ids)
        return self._answer(rid, input_ids, ids, lps, reason, matched, version)

    def _answer(
        self,
        rid: str,
        input_ids: list[int],
        ids: list[int],
        lps: list[float],
        reason: str,
        matched: int | None,
        version: str | None = None,
    ) -> web.Response:
        fr: dict[str, Any] = (
            {"type": reason, "matched": matched}
            if reason != "length"
            else {"type": "length", "length": len(ids)}
        )
        return web.json_response(
            {
                "text": "",
                "output_ids": ids,
                "meta_info": {
                    "id": rid,
                    "finish_reason": fr,
                    "prompt_tokens": len(input_ids),
                    "completion_tokens": len(ids),
                    "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids, strict=True)],
                    "weight_version": self.weight_version if version is None else version,
                },
            }
        )

    def _abort_all(self) -> int:
        n = len(self._inflight)
        for ev in self._inflight.values():
            ev.set()
        return n

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await _json_or_empty(request)
        self.paused = True
        self._resume.clear()
        if body.get("mode", "abort") == "abort":
            self._abort_all()
            while self.cfg.pause_poll_interval > 0 and self._inflight:
                self.counters["pause_polls"] += 1
                await asyncio.sleep(self.cfg.pause_poll_interval)
                self._abort_all()
        return web.json_response({"status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.paused = False
        self._resume.set()
        return web.json_response({"status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _json_or_empty(request)
        if body.get("abort_all"):
            self._abort_all()
        elif (ev := self._inflight.get(str(body.get("rid")))) is not None:
            ev.set()
        return web.json_response({"status": "ok"})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await _json_or_empty(request)
        if body.get("abort_all_requests"):
            self._abort_all()
        if self.cfg.update_latency:
            await asyncio.sleep(self.cfg.update_latency)
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        self.counters["updates"] += 1
        return web.json_response(
            {"success": True, "message": "stub: weights not loaded (test stand-in)", "num_paused_requests": 0}
        )

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await _json_or_empty(request)
        if body.get("abort_all_requests", True):  # SGLang's default is True
            self._abort_all()
        self.weight_version = str(body.get("new_version"))
        return web.json_response({"success": True, "new_version": self.weight_version})


async def _json_or_empty(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except json.JSONDecodeError:
        return {}
    return body if isinstance(body, dict) else {}


@contextlib.asynccontextmanager
async def stub_engine_in_process(**cfg: Any) -> AsyncIterator[tuple[StubEngine, str]]:
    """The stand-in on the caller's event loop (real HTTP on loopback): ``async with ... as (engine, url)``.

    Cheaper than a subprocess for tests; benchmarks use :func:`start_stub_server` instead so the
    server never competes with the client for the same event loop.
    """
    engine = StubEngine(StubEngineConfig(**cfg))
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield engine, f"http://127.0.0.1:{port}"
    finally:
        engine._abort_all()
        await runner.cleanup()


async def serve(cfg: StubEngineConfig, host: str, port: int) -> None:
    """Serve until SIGTERM/SIGINT; prints the READY line with the bound port."""
    engine = StubEngine(cfg)
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True, backlog=4096)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    print(f"{READY_LINE} {bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def _parse_args(argv: list[str] | None) -> tuple[StubEngineConfig, str, int]:
    p = argparse.ArgumentParser(description="SGLang-protocol test stand-in (no model).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--config-json", default=None, help="StubEngineConfig fields as JSON")
    for f, default in asdict(StubEngineConfig()).items():
        if isinstance(default, list | bool):  # script, enable_lora, lora_target_modules: --config-json
            continue
        p.add_argument("--" + f.replace("_", "-"), type=type(default), default=None)
    a = p.parse_args(argv)
    data = json.loads(a.config_json) if a.config_json else {}
    for f in asdict(StubEngineConfig()):
        v = getattr(a, f, None)
        if v is not None:
            data[f] = v
    return StubEngineConfig(**data), a.host, a.port


def main(argv: list[str] | None = None) -> None:
    cfg, host, port = _parse_args(argv)
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("the stub engine only listens on loopback")
    asyncio.run(serve(cfg, host, port))


# ---- subprocess handle --------------------------------------------------------------------------
class StubServerHandle:
    """A stub engine in its own process. ``restart()`` brings it back on the same port."""

    def __init__(self, cfg: StubEngineConfig, port: int = 0, startup_timeout: float = 30.0) -> None:
        self.cfg = cfg
        self.port = port
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[str] | None = None
        self._start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _start(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "agentrl.testing.stub_engine",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--config-json",
            json.dumps(asdict(self.cfg)),
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        deadline = time.monotonic() + self.startup_timeout
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if line.startswith(READY_LINE):
                self.port = int(line.split()[1])
                break
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"stub engine exited with {self.proc.returncode} before listening")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("stub engine did not start in time")

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/stub_stats", timeout=5) as r:  # loopback only
            return json.loads(r.read())

    def kill(self) -> None:
        """SIGKILL, as a crashed engine dies: in-flight connections break."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def restart(self, **changes: Any) -> None:
        """Kill (if alive) and start again on the same port, optionally with changed config fields."""
        self.kill()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        for k, v in changes.items():
            setattr(self.cfg, k, v)
        self._start()

    def __enter__(self) -> StubServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_stub_server(port: int = 0, **cfg: Any) -> StubServerHandle:
    """Start the stand-in engine in a subprocess and wait until it listens:
    ``start_stub_server(per_token_time=1e-3)``."""
    return StubServerHandle(StubEngineConfig(**cfg), port=port)


if __name__ == "__main__":
    main()
