"""SGLang's native HTTP API for an in-process :class:`~agentrl.embedded.engine.EmbeddedEngine`.

:func:`build_app` answers (a handler per endpoint, on :class:`NativeAPI`), with the same endpoints and
JSON shapes as ``sglang.launch_server`` (see the SGLang reference notes): ``/generate``,
``/abort_request``, ``/pause_generation``, ``/continue_generation``, ``/flush_cache``,
``/update_weights_from_disk``, ``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``, ``/update_weight_version``, ``/get_weight_version``, ``/get_model_info``,
``/get_server_info``, ``/health``, ``/health_generate``, plus OpenAI's ``/v1/chat/completions``,
``/v1/completions`` and ``/v1/models`` (:mod:`agentrl.engine.openai_api`: chat template, tool calls,
streaming, OpenAI-style errors). agentrl's :class:`~agentrl.engine.client.EngineClient` cannot tell it from
SGLang.

Semantics worth knowing (all as SGLang, unless marked):

* ``meta_info.output_token_logprobs`` holds ``[logprob, token_id, null]`` per sampled token, where logprob
  is ``log_softmax`` of the raw model logits in fp32 -- *before* temperature / top-p / top-k (the value the
  trainer recomputes), for greedy and sampled requests alike. That is SGLang with
  ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``, which :mod:`agentrl.engine.launcher` sets (SGLang's own default
  is the logprob of the temperature-scaled distribution).
* ``weight_version`` starts at ``"default"`` and changes only when an update names one.
* Mixture-of-experts models: ``return_routed_experts: true`` adds ``meta_info.routed_experts``, base64 of
  int32 ``[tokens, layers, k]``, the experts every input position (all tokens but the last) was routed
  to, prefix-cache hits included (SGLang needs ``--enable-return-routed-experts`` for it; not on streams).
* A weight update waits for in-flight requests (or aborts them with ``abort_all_requests``), holds new
  ones, then swaps weights and flushes the prefix cache.
* ``/generate`` with ``stream: true`` (one request, not a batch) answers server-sent events as SGLang
  does: each ``data:`` is the answer so far (cumulative ``text``, ``output_ids`` and logprobs,
  ``finish_reason`` null until the last), then ``data: [DONE]``; an event goes out per engine step that
  sampled a token for it. A client that disconnects aborts its request, streamed or not.
* Not supported on ``/generate`` (400 with a clear message): ``n > 1``, penalties, regex /
  JSON constraints. ``pause_generation`` modes ``retract`` and ``in_place`` both keep the
  requests and recompute their KV on ``continue`` (SGLang's in_place keeps the old KV instead).
* ``/release_memory_occupation`` and ``/resume_memory_occupation`` take ``tags`` (``weights``,
  ``kv_cache``; none: both, or on resume every released one). A release takes requests in flight out
  keeping their tokens and holds them, with new ones, until everything is resumed; they then continue.
  Releasing what is released, or resuming what is not, answers 400. A weight update while the weights
  are released answers 400 (resume ``weights`` first); with only the KV cache released it is applied.
  See :mod:`agentrl.embedded.memory` for how the memory is freed (CUDA virtual memory or copies).
* ``/update_weights_from_tensor`` takes SGLang's ``serialized_named_tensors`` (one entry: tp_size 1),
  CUDA IPC handles or, with ``load_format: "shared_memory"``, a shared-memory block on the CPU
  (:mod:`agentrl.engine.named_tensors`).
* ``/load_lora_adapter`` (``lora_name``, ``lora_path``: a PEFT dir), ``/load_lora_adapter_from_tensors``
  (``lora_name``, ``config_dict``, ``serialized_tensors``, ``load_format``) and ``/unload_lora_adapter``
  take SGLang's names, but the adapter is applied to every request, one adapter at a time, beside the
  weights or merged into them (``--lora-apply``), and a load takes ``weight_version`` like a weight update
  (:mod:`agentrl.embedded.lora`). SGLang serves adapters by name per request instead.
* With an API key, every endpoint except ``/health`` and ``/health_generate`` requires
  ``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from agentrl.cluster import bearer_matches
from agentrl.embedded.engine import (
    EmbeddedEngine,
    EngineBadRequest,
    EngineFailed,
    GenerationRecord,
    RequestSampling,
)
from agentrl.embedded.openai_backend import EmbeddedBackend
from agentrl.engine.openai_api import add_openai_routes

__all__ = ["ENGINE_NAME", "build_app"]

log = logging.getLogger("agentrl.embedded.server")

_OPEN_PATHS = {"/health", "/health_generate"}
ENGINE_NAME = "agentrl-embedded (stand-in for SGLang)"


def _error(status: int, message: str) -> web.Response:
    # SGLang answers errors as {"error": {"message": ...}} (OpenAI style) or {"success": false, "message"}.
    return web.json_response(
        {"error": {"message": message, "code": status}, "success": False, "message": message}, status=status
    )


def _event(obj: Any) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


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


class NativeAPI:
    """SGLang's native endpoints over one engine, a handler per endpoint (the routes in :meth:`routes`)."""

    def __init__(
        self, engine: EmbeddedEngine, api_key: str | None = None, served_model_path: str | None = None
    ) -> None:
        self.engine = engine
        self.api_key = api_key
        self.served_model_path = served_model_path
        self.tok = engine.tokenizer

    def _answer(self, rec, return_logprob: bool, skip_special: bool, trim_stop: bool) -> dict[str, Any]:
        text = self.tok.decode(rec.output_ids, skip_special_tokens=skip_special)
        fr = rec.finish_reason
        if fr is None:  # a streamed answer so far: no half character at the end
            text = text.rstrip("\ufffd")
        elif trim_stop and fr.get("type") == "stop" and isinstance(fr.get("matched"), str):
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

    async def _generate_one(
        self, ids: list[int], sp: dict[str, Any], rid: str, return_logprob: bool, return_routed: bool = False
    ) -> dict[str, Any]:
        sampling = RequestSampling.from_sglang(sp, self.engine.default_max_new_tokens)
        rec = await self.engine.generate(ids, sampling, rid)
        out = self._answer(rec, return_logprob, sampling.skip_special_tokens, not sampling.no_stop_trim)
        if return_routed and rec.routed_experts is not None:  # SGLang's R3 field: base64 int32 [t, layers, k]
            from agentrl.models.moe import encode_routed_experts

            out["meta_info"]["routed_experts"] = encode_routed_experts(rec.routed_experts)
        return out

    async def _stream_one(
        self, request: web.Request, ids: list[int], sp: dict[str, Any], rid: str, return_logprob: bool
    ) -> web.StreamResponse:
        """SGLang's streamed ``/generate``: server-sent events, each the answer so far (cumulative text,
        ids and logprobs; ``finish_reason`` null until the last one), then ``[DONE]``."""
        sampling = RequestSampling.from_sglang(sp, self.engine.default_max_new_tokens)
        args = (return_logprob, sampling.skip_special_tokens, not sampling.no_stop_trim)
        stream = self.engine.stream(ids, sampling, rid)
        try:
            delta = await anext(stream, None)  # a refused request raises here: a plain 400 / 500
            resp = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await resp.prepare(request)
            out, lps, t0 = [], [], time.perf_counter()
            try:
                while delta is not None:
                    out, lps = out + delta.ids, lps + delta.logprobs
                    so_far = GenerationRecord(
                        rid, ids, out, lps, None, self.engine.weight_version, time.perf_counter() - t0
                    )
                    await resp.write(_event(self._answer(so_far, *args)))
                    delta = await anext(stream, None)
                await resp.write(_event(self._answer(stream.record, *args)))
            except (EngineBadRequest, EngineFailed) as err:  # after the first event: SGLang sends it as one
                await resp.write(_event({"error": {"message": str(err)}}))
            await resp.write(_event("[DONE]"))
            await resp.write_eof()
            return resp
        finally:
            await stream.aclose()  # a client that left cancels this handler: abort its request

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        ids = body.get("input_ids")
        text = body.get("text")
        if ids is None and text is None:
            raise EngineBadRequest("give input_ids or text")
        if ids is None:
            texts = text if isinstance(text, list) else [text]
            batch = [self.tok.encode(t) for t in texts]
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
        if body.get("stream"):
            if not single:
                raise EngineBadRequest("stream=true takes one request, not a batch")
            return await self._stream_one(request, batch[0], sps[0], str(rids[0]), return_logprob)
        return_routed = bool(body.get("return_routed_experts", False))
        outs = await asyncio.gather(
            *(
                self._generate_one(b, s, str(r), return_logprob, return_routed)
                for b, s, r in zip(batch, sps, rids, strict=True)
            )
        )
        return web.json_response(outs[0] if single else outs)

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if body.get("abort_all"):
            self.engine.abort(None)
        elif body.get("rid"):
            self.engine.abort(str(body["rid"]))
        return web.json_response({"success": True})

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        self.engine.pause(str(body.get("mode", "abort")))
        return web.json_response({"status": "ok", "success": True})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.engine.continue_generation()
        return web.json_response({"status": "ok", "success": True})

    async def flush_cache(self, request: web.Request) -> web.Response:
        await self.engine.flush_cache()
        return web.json_response({"success": True, "message": "Cache flushed."})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if not body.get("model_path"):
            raise EngineBadRequest("model_path is required")
        try:
            await self.engine.update_weights_from_disk(
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

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in body]
        if missing:
            raise EngineBadRequest(f"missing fields: {', '.join(missing)}")
        try:
            await self.engine.init_weights_update_group(
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

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        clean = await self.engine.destroy_weights_update_group(
            str(body.get("group_name", "weight_update_group"))
        )
        message = (
            "Succeeded to destroy custom process group." if clean else "Aborted the custom process group."
        )
        return web.json_response({"success": True, "message": message})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        try:
            await self.engine.update_weights_from_distributed(
                list(body.get("names") or []),
                list(body.get("dtypes") or []),
                list(body.get("shapes") or []),
                str(body.get("group_name", "weight_update_group")),
                body.get("weight_version"),
                bool(body.get("abort_all_requests", False)),
                bool(body.get("flush_cache", True)),
                body.get("load_format"),
            )
        except EngineBadRequest as err:
            return web.json_response({"success": False, "message": str(err)}, status=400)
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if "serialized_named_tensors" not in body:
            raise EngineBadRequest("serialized_named_tensors is required")
        try:
            await self.engine.update_weights_from_tensor(
                body["serialized_named_tensors"],
                body.get("load_format"),
                body.get("weight_version"),
                bool(body.get("abort_all_requests", False)),
                bool(body.get("flush_cache", True)),
            )
        except EngineBadRequest as err:
            return web.json_response({"success": False, "message": str(err)}, status=400)
        return web.json_response({"success": True, "message": "Succeeded to update model weights."})

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if not body.get("lora_name") or not body.get("lora_path"):
            raise EngineBadRequest("lora_name and lora_path are required")
        await self.engine.load_lora_adapter(
            str(body["lora_name"]),
            str(body["lora_path"]),
            body.get("weight_version"),
            bool(body.get("abort_all_requests", False)),
            bool(body.get("flush_cache", True)),
        )
        return web.json_response(
            {"success": True, "message": "LoRA adapter loaded (merged into the weights)."}
        )

    async def load_lora_adapter_from_tensors(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if (
            not body.get("lora_name")
            or "serialized_tensors" not in body
            or not isinstance(body.get("config_dict"), dict)
        ):
            raise EngineBadRequest("lora_name, config_dict and serialized_tensors are required")
        await self.engine.load_lora_adapter_from_tensors(
            str(body["lora_name"]),
            body["config_dict"],
            body["serialized_tensors"],
            body.get("load_format"),
            body.get("weight_version"),
            bool(body.get("abort_all_requests", False)),
            bool(body.get("flush_cache", True)),
        )
        return web.json_response(
            {"success": True, "message": "LoRA adapter loaded (merged into the weights)."}
        )

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        await self.engine.unload_lora_adapter(str(body.get("lora_name", "")))
        return web.json_response({"success": True, "message": "LoRA adapter unloaded."})

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        tags = await self.engine.release_memory_occupation(body.get("tags"))
        return web.json_response({"success": True, "message": f"released {', '.join(tags)}"})

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        tags = await self.engine.resume_memory_occupation(body.get("tags"))
        return web.json_response({"success": True, "message": f"resumed {', '.join(tags)}"})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if body.get("new_version") is None:
            raise EngineBadRequest("new_version is required")
        if body.get("abort_all_requests", True):  # SGLang's default
            self.engine.abort(None)
        self.engine.weight_version = str(body["new_version"])
        return web.json_response(
            {"success": True, "message": "weight version updated", "new_version": self.engine.weight_version}
        )

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """SGLang's debugging read of one parameter: its first ``truncate_size`` values, flattened, as
        floats (exact for fp32 / bf16 weights)."""
        body = await _json_body(request)
        name = body.get("name")
        params = dict(self.engine.model.named_parameters())
        if name not in params:
            raise EngineBadRequest(f"no parameter named {name!r}")
        n = int(body.get("truncate_size", 100))
        values = await self.engine._on_device(
            lambda: params[name].detach().flatten()[:n].float().cpu().tolist()
        )
        return web.json_response(values)

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.engine.weight_version})

    async def get_model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.served_model_path or self.engine.model_path,
                "tokenizer_path": self.served_model_path or self.engine.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.engine.weight_version,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": getattr(self.engine.model.config, "model_type", None),
                "architectures": getattr(self.engine.model.config, "architectures", None),
            }
        )

    async def get_server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "engine": ENGINE_NAME,
                "version": "agentrl-embedded",
                "model_path": self.engine.model_path,
                "tp_size": 1,
                "dp_size": 1,
                "device": str(self.engine.device),
                "dtype": str(self.engine.dtype).removeprefix("torch."),
                "max_running_requests": self.engine.max_batch_size,
                "context_length": self.engine.max_context,
                "weight_version": self.engine.weight_version,
                "num_running_requests": self.engine.num_running,
                "num_batch_requests": self.engine.num_in_batch,
                "paused": self.engine.paused_mode,
                "api_key_required": bool(self.api_key),
                "context_len": self.engine.context_len,
                "prefix_cache_slots": 0
                if self.engine.prefix_cache is None
                else self.engine.prefix_cache.num_slots,
                **self.engine.stats,
                **self.engine.scheduler.busy_so_far(),  # a step under way counts so far
                **self.engine.memory_info(),
                **self.engine.memory_state(),
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        if not self.engine.healthy:
            return _error(503, "generation loop is not running")
        return web.Response(text="")

    async def health_generate(self, request: web.Request) -> web.Response:
        if not self.engine.healthy:
            return _error(503, "generation loop is not running")
        if self.engine.paused_mode is not None or self.engine.asleep:
            return web.Response(text="")  # paused or asleep on purpose: healthy, but a generate would wait
        sampling = RequestSampling(temperature=0.0, max_new_tokens=1)
        await asyncio.wait_for(self.engine.generate([0], sampling, f"health-{uuid.uuid4().hex}"), timeout=60)
        return web.Response(text="")

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/generate", self.generate),
            web.post("/abort_request", self.abort_request),
            web.post("/pause_generation", self.pause_generation),
            web.post("/continue_generation", self.continue_generation),
            web.post("/flush_cache", self.flush_cache),
            web.get("/flush_cache", self.flush_cache),
            web.post("/update_weights_from_disk", self.update_weights_from_disk),
            web.post("/init_weights_update_group", self.init_weights_update_group),
            web.post("/destroy_weights_update_group", self.destroy_weights_update_group),
            web.post("/update_weights_from_distributed", self.update_weights_from_distributed),
            web.post("/update_weights_from_tensor", self.update_weights_from_tensor),
            web.post("/load_lora_adapter", self.load_lora_adapter),
            web.post("/load_lora_adapter_from_tensors", self.load_lora_adapter_from_tensors),
            web.post("/unload_lora_adapter", self.unload_lora_adapter),
            web.post("/release_memory_occupation", self.release_memory_occupation),
            web.post("/resume_memory_occupation", self.resume_memory_occupation),
            web.post("/update_weight_version", self.update_weight_version),
            web.get("/get_weight_version", self.get_weight_version),
            web.post("/get_weights_by_name", self.get_weights_by_name),
            web.get("/get_weights_by_name", self.get_weights_by_name),
            web.get("/get_model_info", self.get_model_info),
            web.get("/get_server_info", self.get_server_info),
            web.get("/health", self.health),
            web.get("/health_generate", self.health_generate),
        ]


def _auth_guard(api_key: str | None):
    """Middleware: the API key check (all but the health endpoints) and errors answered in SGLang's shape."""

    @web.middleware
    async def guard(request: web.Request, handler):
        if api_key and request.path not in _OPEN_PATHS:
            if not bearer_matches(request.headers.get("Authorization", ""), api_key):
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

    return guard


def build_app(
    engine: EmbeddedEngine, api_key: str | None = None, served_model_path: str | None = None
) -> web.Application:
    """The aiohttp application answering SGLang's native endpoints (and OpenAI's) for ``engine``."""
    app = web.Application(middlewares=[_auth_guard(api_key)], client_max_size=64 * 1024**2)
    app.add_routes(NativeAPI(engine, api_key, served_model_path).routes())
    add_openai_routes(app, EmbeddedBackend(engine, served_model_path))  # /v1/* (OpenAI's API)
    return app
