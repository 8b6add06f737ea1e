"""The embedded engine: a stand-in for SGLang that speaks SGLang's native HTTP API on CPU or one GPU.

``python -m agentrl.engine.embedded_server --model DIR --host 127.0.0.1 --port N [--device cpu|cuda]
[--dtype float32|bfloat16] [--api-key K] [--max-batch-size B]`` serves a Hugging Face checkpoint directory
with the same endpoints and JSON shapes as ``sglang.launch_server`` (see the SGLang reference notes):
``/generate``, ``/abort_request``, ``/pause_generation``, ``/continue_generation``, ``/flush_cache``,
``/update_weights_from_disk``, ``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``, ``/update_weight_version``, ``/get_weight_version``,
``/get_model_info``, ``/get_server_info``, ``/health``, ``/health_generate``. agentrl's
:class:`~agentrl.engine.client.EngineClient` cannot tell it from SGLang. Generation runs in
:class:`~agentrl.engine.embedded.EmbeddedEngine` (continuous batching over a slot KV cache, CUDA graphs for
decode on a GPU, prefix reuse across turns).

Semantics worth knowing (all as SGLang, unless marked):

* ``meta_info.output_token_logprobs`` holds ``[logprob, token_id, null]`` per sampled token, where logprob
  is ``log_softmax`` of the raw model logits in fp32 -- *before* temperature / top-p / top-k (the value the
  trainer recomputes), for greedy and sampled requests alike. That is SGLang with
  ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``, which :mod:`agentrl.engine.launcher` sets (SGLang's own default
  is the logprob of the temperature-scaled distribution).
* ``weight_version`` starts at ``"default"`` and changes only when an update names one.
* A weight update waits for in-flight requests (or aborts them with ``abort_all_requests``), holds new
  ones, then swaps weights and flushes the prefix cache.
* OpenAI's API: ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``
  (:mod:`agentrl.engine.openai_api`: chat template, tool calls, streaming, OpenAI-style errors).
* Not supported on ``/generate`` (400 with a clear message): ``stream``, ``n > 1``, penalties, regex /
  JSON constraints. ``pause_generation`` modes ``retract`` and ``in_place`` both keep the
  requests and recompute their KV on ``continue`` (SGLang's in_place keeps the old KV instead).

Security: it binds 127.0.0.1 by default and refuses a non-loopback ``--host`` without ``--api-key``. With
a key, every endpoint except ``/health`` and ``/health_generate`` requires ``Authorization: Bearer KEY``.

:func:`start_embedded_server` runs it as a subprocess (own process group, waits for ``/health``) and returns a
handle with ``.url`` and ``.stop()``; tests and ``train_async.py`` use it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import os
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from agentrl.engine._proc import ServerProcess, ServerStartError, is_loopback
from agentrl.engine.embedded import EmbeddedEngine, EngineBadRequest, EngineFailed, RequestSampling
from agentrl.engine.openai_api import EmbeddedBackend, add_openai_routes

__all__ = ["EmbeddedServer", "ServerStartError", "build_app", "is_loopback", "main", "start_embedded_server"]

log = logging.getLogger("agentrl.engine.embedded_server")

_OPEN_PATHS = {"/health", "/health_generate"}
ENGINE_NAME = "agentrl-embedded (stand-in for SGLang)"


def _error(status: int, message: str) -> web.Response:
    # SGLang answers errors as {"error": {"message": ...}} (OpenAI style) or {"success": false, "message"}.
    return web.json_response(
        {"error": {"message": message, "code": status}, "success": False, "message": message}, status=status
    )


async def _json_body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except (json.JSONDecodeError, ValueError):
        raise EngineBadRequest("request body is not valid JSON") from None
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise EngineBadRequest("request body must be a JSON object")
    return body


def build_app(
    engine: EmbeddedEngine, api_key: str | None = None, served_model_path: str | None = None
) -> web.Application:
    """The aiohttp application answering SGLang's native endpoints for ``engine``."""

    @web.middleware
    async def guard(request: web.Request, handler):
        if api_key and request.path not in _OPEN_PATHS:
            given = request.headers.get("Authorization", "")
            token = given[7:] if given.startswith("Bearer ") else ""
            if not hmac.compare_digest(token.encode(), api_key.encode()):
                return _error(401, "missing or invalid API key (Authorization: Bearer <key>)")
        try:
            return await handler(request)
        except EngineBadRequest as err:
            return _error(400, str(err))
        except EngineFailed as err:
            return _error(500, str(err))
        except web.HTTPException:
            raise
        except Exception as err:
            log.exception("unhandled error on %s", request.path)
            return _error(500, f"{type(err).__name__}: {err}")

    tok = engine.tokenizer

    def answer(rec, return_logprob: bool, skip_special: bool, trim_stop: bool) -> dict[str, Any]:
        text = tok.decode(rec.output_ids, skip_special_tokens=skip_special)
        fr = rec.finish_reason
        if trim_stop and fr.get("type") == "stop" and isinstance(fr.get("matched"), str):
            cut = text.rfind(fr["matched"])
            if cut >= 0:
                text = text[:cut]
        meta: dict[str, Any] = {
            "id": rec.rid,
            "finish_reason": fr,
            "prompt_tokens": len(rec.prompt_ids),
            "completion_tokens": len(rec.output_ids),
            "cached_tokens": rec.cached_tokens,
            "weight_version": rec.weight_version,
            "e2e_latency": rec.latency,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(rec.logprobs, rec.output_ids, strict=True)
            ]
        return {"text": text, "output_ids": rec.output_ids, "meta_info": meta}

    async def generate_one(
        ids: list[int], sp: dict[str, Any], rid: str, return_logprob: bool
    ) -> dict[str, Any]:
        sampling = RequestSampling.from_sglang(sp, engine.default_max_new_tokens)
        rec = await engine.generate(ids, sampling, rid)
        return answer(rec, return_logprob, sampling.skip_special_tokens, not sampling.no_stop_trim)

    async def generate(request: web.Request) -> web.Response:
        body = await _json_body(request)
        if body.get("stream"):
            raise EngineBadRequest("stream=true is not supported by the embedded engine")
        ids = body.get("input_ids")
        text = body.get("text")
        if ids is None and text is None:
            raise EngineBadRequest("give input_ids or text")
        if ids is None:
            texts = text if isinstance(text, list) else [text]
            batch = [tok.encode(t) for t in texts]
            single = not isinstance(text, list)
        else:
            single = not (isinstance(ids, list) and ids and isinstance(ids[0], list))
            batch = [ids] if single else ids
        try:
            batch = [[int(i) for i in b] for b in batch]
        except (TypeError, ValueError):
            raise EngineBadRequest("input_ids must be a list of integers (or a list of such lists)") from None
        sp = body.get("sampling_params") or {}
        rids = body.get("rid")
        n = len(batch)
        sps = sp if isinstance(sp, list) else [sp] * n
        if isinstance(rids, list):
            if len(rids) != n:
                raise EngineBadRequest("rid list and input batch differ in length")
        else:
            rids = (
                [rids or uuid.uuid4().hex]
                if single
                else [f"{rids or uuid.uuid4().hex}_{i}" for i in range(n)]
            )
        if len(sps) != n:
            raise EngineBadRequest("sampling_params list and input batch differ in length")
        return_logprob = bool(body.get("return_logprob", False))
        outs = await asyncio.gather(
            *(generate_one(b, s, str(r), return_logprob) for b, s, r in zip(batch, sps, rids, strict=True))
        )
        return web.json_response(outs[0] if single else outs)

    async def abort_request(request: web.Request) -> web.Response:
        body = await _json_body(request)
        if body.get("abort_all"):
            engine.abort(None)
        elif body.get("rid"):
            engine.abort(str(body["rid"]))
        return web.json_response({"success": True})

    async def pause_generation(request: web.Request) -> web.Response:
        body = await _json_body(request)
        engine.pause(str(body.get("mode", "abort")))
        return web.json_response({"status": "ok", "success": True})

    async def continue_generation(request: web.Request) -> web.Response:
        engine.continue_generation()
        return web.json_response({"status": "ok", "success": True})

    async def flush_cache(request: web.Request) -> web.Response:
        await engine.flush_cache()
        return web.json_response({"success": True, "message": "Cache flushed."})

    async def update_weights_from_disk(request: web.Request) -> web.Response:
        body = await _json_body(request)
        if not body.get("model_path"):
            raise EngineBadRequest("model_path is required")
        try:
            await engine.update_weights_from_disk(
                str(body["model_path"]),
                body.get("weight_version"),
                bool(body.get("abort_all_requests", False)),
                bool(body.get("flush_cache", True)),
            )
        except EngineBadRequest as err:
            return web.json_response(
                {"success": False, "message": str(err), "num_paused_requests": 0}, status=400
            )
        return web.json_response(
            {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        )

    async def init_weights_update_group(request: web.Request) -> web.Response:
        body = await _json_body(request)
        missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in body]
        if missing:
            raise EngineBadRequest(f"missing fields: {', '.join(missing)}")
        try:
            await engine.init_weights_update_group(
                str(body["master_address"]),
                int(body["master_port"]),
                int(body["rank_offset"]),
                int(body["world_size"]),
                str(body.get("group_name", "weight_update_group")),
                str(body.get("backend", "nccl")),
            )
        except EngineBadRequest as err:
            return web.json_response({"success": False, "message": str(err)}, status=400)
        except (RuntimeError, ValueError) as err:
            return web.json_response({"success": False, "message": f"init group failed: {err}"}, status=400)
        return web.json_response(
            {"success": True, "message": "Succeeded to initialize custom process group."}
        )

    async def destroy_weights_update_group(request: web.Request) -> web.Response:
        body = await _json_body(request)
        clean = await engine.destroy_weights_update_group(str(body.get("group_name", "weight_update_group")))
        message = (
            "Succeeded to destroy custom process group." if clean else "Aborted the custom process group."
        )
        return web.json_response({"success": True, "message": message})

    async def update_weights_from_distributed(request: web.Request) -> web.Response:
        body = await _json_body(request)
        try:
            await engine.update_weights_from_distributed(
                list(body.get("names") or []),
                list(body.get("dtypes") or []),
                list(body.get("shapes") or []),
                str(body.get("group_name", "weight_update_group")),
                body.get("weight_version"),
                bool(body.get("abort_all_requests", False)),
                bool(body.get("flush_cache", True)),
            )
        except EngineBadRequest as err:
            return web.json_response({"success": False, "message": str(err)}, status=400)
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    async def update_weight_version(request: web.Request) -> web.Response:
        body = await _json_body(request)
        if body.get("new_version") is None:
            raise EngineBadRequest("new_version is required")
        if body.get("abort_all_requests", True):  # SGLang's default
            engine.abort(None)
        engine.weight_version = str(body["new_version"])
        return web.json_response(
            {"success": True, "message": "weight version updated", "new_version": engine.weight_version}
        )

    async def get_weight_version(request: web.Request) -> web.Response:
        return web.json_response({"weight_version": engine.weight_version})

    async def get_model_info(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": served_model_path or engine.model_path,
                "tokenizer_path": served_model_path or engine.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": engine.weight_version,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": getattr(engine.model.config, "model_type", None),
                "architectures": getattr(engine.model.config, "architectures", None),
            }
        )

    async def get_server_info(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "engine": ENGINE_NAME,
                "version": "agentrl-embedded",
                "model_path": engine.model_path,
                "tp_size": 1,
                "dp_size": 1,
                "device": str(engine.device),
                "dtype": str(engine.dtype).removeprefix("torch."),
                "max_running_requests": engine.max_batch_size,
                "context_length": engine.max_context,
                "weight_version": engine.weight_version,
                "num_running_requests": engine.num_running,
                "paused": engine.paused_mode,
                "api_key_required": bool(api_key),
                "context_len": engine.context_len,
                "prefix_cache_slots": 0 if engine.prefix_cache is None else engine.prefix_cache.num_slots,
                **engine.stats,
                **engine.memory_info(),
            }
        )

    async def health(request: web.Request) -> web.Response:
        if not engine.healthy:
            return _error(503, "generation loop is not running")
        return web.Response(text="")

    async def health_generate(request: web.Request) -> web.Response:
        if not engine.healthy:
            return _error(503, "generation loop is not running")
        if engine.paused_mode is not None:
            return web.Response(text="")  # paused on purpose: healthy, but a generate would wait
        sampling = RequestSampling(temperature=0.0, max_new_tokens=1)
        await asyncio.wait_for(engine.generate([0], sampling, f"health-{uuid.uuid4().hex}"), timeout=60)
        return web.Response(text="")

    app = web.Application(middlewares=[guard], client_max_size=64 * 1024**2)
    app.add_routes(
        [
            web.post("/generate", generate),
            web.post("/abort_request", abort_request),
            web.post("/pause_generation", pause_generation),
            web.post("/continue_generation", continue_generation),
            web.post("/flush_cache", flush_cache),
            web.get("/flush_cache", flush_cache),
            web.post("/update_weights_from_disk", update_weights_from_disk),
            web.post("/init_weights_update_group", init_weights_update_group),
            web.post("/destroy_weights_update_group", destroy_weights_update_group),
            web.post("/update_weights_from_distributed", update_weights_from_distributed),
            web.post("/update_weight_version", update_weight_version),
            web.get("/get_weight_version", get_weight_version),
            web.get("/get_model_info", get_model_info),
            web.get("/get_server_info", get_server_info),
            web.get("/health", health),
            web.get("/health_generate", health_generate),
        ]
    )
    add_openai_routes(app, EmbeddedBackend(engine, served_model_path))  # /v1/* (OpenAI's API)
    return app


# ---------------------------------------------------------------------------------------------- CLI
def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m agentrl.engine.embedded_server",
        description="Embedded engine speaking SGLang's native HTTP API (a stand-in for SGLang).",
    )
    p.add_argument("--model", "--model-path", dest="model", required=True, help="HF checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless --api-key is given)")
    p.add_argument("--port", type=int, default=30000, help="port; 0 picks a free one (see --port-file)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--api-key", default=None, help="required as 'Authorization: Bearer KEY' on every endpoint"
    )
    p.add_argument("--max-batch-size", type=int, default=64, help="requests decoded together at most")
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=None,
        help="tokens per prefill step (default 8192 GPU, 2048 CPU)",
    )
    p.add_argument(
        "--context-len",
        type=int,
        default=None,
        help="KV slot length = longest prompt + output (default: the model's, up to 8192, as memory allows)",
    )
    p.add_argument(
        "--prefix-cache-slots",
        type=int,
        default=None,
        help="finished sequences kept for prefix reuse (default: max-batch-size; 0 turns reuse off)",
    )
    p.add_argument(
        "--mem-fraction",
        type=float,
        default=None,
        help="GPU: share of the memory free after loading the model that the KV cache may take "
        "(default 0.8; lower it when a trainer shares the GPU)",
    )
    p.add_argument("--no-cuda-graphs", action="store_true", help="GPU: decode without CUDA graphs")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="GPU: torch.compile the layer pieces and the sampler (about 1.5x the decode speed, ~30 s more "
        "start-up); --no-compile to skip",
    )
    p.add_argument(
        "--warmup-len",
        type=int,
        default=2048,
        help="GPU: capture the decode graphs of attention lengths up to this at start-up (0: on first use)",
    )
    p.add_argument("--default-max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    p.add_argument("--port-file", default=None, help="write the bound port here once serving")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not is_loopback(args.host) and not args.api_key:
        sys.exit(
            f"refusing to serve on non-loopback address {args.host!r} without --api-key "
            "(anyone reaching it could generate, abort requests or replace the weights)"
        )
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            sys.exit("--device cuda but no CUDA device is available")
        dev = torch.device(args.device)
        torch.cuda.set_device(dev.index if dev.index is not None else 0)  # plain "cuda" means GPU 0
    # The generation step runs in a worker thread beside the HTTP loop; a short GIL switch interval keeps
    # either from waiting the default 5 ms for the other.
    sys.setswitchinterval(0.0005)
    log.info("%s: loading %s on %s (%s)", ENGINE_NAME, args.model, args.device, args.dtype)
    asyncio.run(_serve(args))


async def _serve(args: argparse.Namespace) -> None:
    import signal

    engine = EmbeddedEngine(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        max_prefill_tokens=args.max_prefill_tokens,
        context_len=args.context_len,
        prefix_cache_slots=args.prefix_cache_slots,
        mem_fraction=args.mem_fraction,
        seed=args.seed,
        default_max_new_tokens=args.default_max_new_tokens,
        cuda_graphs=not args.no_cuda_graphs,
        compile=args.compile,
    )
    if args.warmup_len:
        t0 = time.perf_counter()
        n = await asyncio.to_thread(engine.warmup, args.warmup_len)
        if n:
            log.info("captured %d decode CUDA graphs in %.1f s", n, time.perf_counter() - t0)
    app = build_app(engine, api_key=args.api_key)
    # handler_cancellation: a client that disconnects (timeout, crash) cancels its generation instead of
    # leaving it to run to max_new_tokens.
    runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host.strip("[]"), args.port))
    site = web.SockSite(runner, sock)
    await site.start()
    port = sock.getsockname()[1]
    if args.port_file:
        _write_port_file(args.port_file, port)
    log.info("serving on http://%s:%d", args.host, port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def watch_parent() -> None:
        while args.parent_pid and not stop.is_set():
            try:
                os.kill(args.parent_pid, 0)
            except ProcessLookupError:
                log.warning("parent %d is gone: shutting down", args.parent_pid)
                stop.set()
            await asyncio.sleep(1.0)

    watcher = asyncio.create_task(watch_parent())
    await stop.wait()
    watcher.cancel()
    engine.abort(None)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(runner.cleanup(), timeout=5)
    await asyncio.to_thread(engine.shutdown)


def _write_port_file(path: str, port: int) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(str(port))
    tmp.replace(path)  # atomic: a reader never sees a partial number


# ---------------------------------------------------------------------------------------------- helper
class EmbeddedServer:
    """Handle of an embedded-engine subprocess (from :func:`start_embedded_server`)."""

    def __init__(self, process: ServerProcess, host: str, port: int, api_key: str | None) -> None:
        self.process = process
        self.host = host
        self.port = port
        self.api_key = api_key
        h = f"[{host}]" if ":" in host else host
        self.url = f"http://{h}:{port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def log_file(self) -> Path:
        return self.process.log_file

    def alive(self) -> bool:
        return self.process.alive()

    def stop(self) -> int | None:
        """Stop the server and everything it started (SIGTERM, then SIGKILL, to its process group)."""
        return self.process.stop()

    def __enter__(self) -> EmbeddedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_embedded_server(
    model_dir: str | Path,
    port: int = 0,
    host: str = "127.0.0.1",
    device: str = "cpu",
    dtype: str = "float32",
    api_key: str | None = None,
    max_batch_size: int = 64,
    extra_args: Sequence[str] = (),
    timeout: float = 180.0,
    log_file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
) -> EmbeddedServer:
    """Start ``python -m agentrl.engine.embedded_server`` in its own process group and wait for ``/health``.

    ``port=0`` lets the server pick a free port (reported back through a file, so there is no race).
    Raises :class:`ServerStartError` with the server's log tail if it exits or is not healthy in time.
    """
    workdir = Path(tempfile.mkdtemp(prefix="agentrl-engine-"))
    port_file = workdir / "port"
    log_path = Path(log_file) if log_file is not None else workdir / "server.log"
    argv = [
        sys.executable,
        "-m",
        "agentrl.engine.embedded_server",
        "--model",
        str(model_dir),
        "--host",
        host,
        "--port",
        str(port),
        "--device",
        device,
        "--dtype",
        dtype,
        "--max-batch-size",
        str(max_batch_size),
        "--port-file",
        str(port_file),
        "--parent-pid",
        str(os.getpid()),
        *extra_args,
    ]
    if api_key:
        argv += ["--api-key", api_key]
    proc = ServerProcess(argv, log_path, env=env, scratch_dir=workdir)  # removed when it stops
    t0 = time.monotonic()
    proc.wait_until(port_file.exists, timeout, "listening")
    bound = int(port_file.read_text())
    h = f"[{host}]" if ":" in host else host
    proc.wait_healthy(f"http://{h}:{bound}/health", timeout=max(1.0, timeout - (time.monotonic() - t0)))
    return EmbeddedServer(proc, host, bound, api_key)


if __name__ == "__main__":
    main()
