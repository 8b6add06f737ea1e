"""The embedded engine: one HF causal LM served with continuous batching, with what an RL rollout engine
needs.

:class:`EmbeddedEngine` loads the model and plans the KV cache on its one device thread, checks requests,
holds them while paused or while a weight update drains the engine, and hands them to its
:class:`~agentrl.embedded.scheduler.Scheduler`, which batches them over a slot KV cache (prefill in chunks,
then decode; the forward in :mod:`.runner`, a CUDA graph per batch/length bucket on a GPU; sampling on
the device in :mod:`.sampling`). A request's state and its finished record are in :mod:`.request`. What
controls the serving has a module each: the gate a request passes (pause, sleep, the drain of a weight
update) in :mod:`.gate`, sleep and wake of the device memory in :mod:`.sleep`, the weight updates in
:mod:`.weight_updates` (LoRA adapters in :mod:`.lora`).

RL semantics kept from SGLang:

* **Exact logprobs.** ``log_softmax`` of the raw fp32 logits at the sampled id, for greedy and sampled
  requests alike, with per-request temperature / top-p / top-k / min-p and reproducible seeds.
* **Stop strings and stop ids.** Stop ids (plus EOS unless ``ignore_eos``) end a request with the id in
  its output; stop strings are checked on the decoded tail after every token.
* **Abort / pause / weight updates.** Aborting answers the tokens made so far with ``finish_reason``
  abort. ``pause(abort)`` aborts everything in flight and holds new requests until ``continue``;
  ``pause(retract|in_place)`` takes the requests out (their KV goes to the prefix cache), keeps their
  tokens and resubmits them on ``continue``. A weight update first aborts (if asked), then waits for
  in-flight requests to finish while holding new ones, copies the weights in place (CUDA graphs stay
  valid) and clears the prefix cache, so no request mixes weights within a step and no KV computed with
  old weights is reused.
* **Speculative decoding** (``speculative``, :mod:`.speculative`): drafts from each request's own context,
  verified in one forward; a drafted token is kept only where it equals the token the request samples
  there, so speculation changes no token and no logprob.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from agentrl.embedded import fp8
from agentrl.embedded.buckets import plan_kv_cache
from agentrl.embedded.gate import RequestGate
from agentrl.embedded.lora import AdapterEndpoints
from agentrl.embedded.memory import EngineMemory, MemoryMode
from agentrl.embedded.prefix_cache import PrefixCache
from agentrl.embedded.request import EngineFailed, EngineRequest, GenerationRecord, TokenDelta, TokenStream
from agentrl.embedded.runner import ExtendBatch, ModelRunner
from agentrl.embedded.sampling import EngineBadRequest, RequestSampling, sample_tokens
from agentrl.embedded.scheduler import Scheduler
from agentrl.embedded.sleep import SleepWake
from agentrl.embedded.speculative import SpeculativeConfig
from agentrl.embedded.weight_updates import WeightUpdates
from agentrl.embedded.weights import pack_parameters
from agentrl.metrics import SPEC_COUNTERS

log = logging.getLogger("agentrl.engine")


class EmbeddedEngine(AdapterEndpoints):
    """One HF causal LM served with continuous batching (see the module docstring)."""

    def __init__(
        self,
        model_path: str | Path,
        device: str = "cpu",
        dtype: str = "float32",
        max_batch_size: int = 64,
        max_prefill_tokens: int | None = None,
        context_len: int | None = None,
        prefix_cache_slots: int | None = None,
        seed: int = 0,
        default_max_new_tokens: int = 128,
        mem_fraction: float | None = None,
        cuda_graphs: bool = True,
        compile: bool = False,
        memory_mode: MemoryMode = "auto",
        batch_invariant: bool = False,
        quantization: str | None = None,
        lora_apply: str = "unmerged",
        max_lora_rank: int = 0,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = str(model_path)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.default_max_new_tokens = default_max_new_tokens
        self.max_batch_size = max_batch_size
        # a request's tokens and logprobs do not depend on what else runs (agentrl.batch_invariant)
        self.batch_invariant = batch_invariant
        # fp8: the layers' projections served in fp8, quantized again after every weight update (.fp8)
        self.quantization = quantization
        on_gpu = self.device.type == "cuda"
        self.max_prefill_tokens = max_prefill_tokens or (16384 if on_gpu else 2048)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        # All torch work runs on one device thread, from loading on: on CPU a second thread running torch
        # ops gets its own OpenMP team, and the two teams made each decode step 2-3x slower on 2 cores.
        self._device_thread = ThreadPoolExecutor(1, thread_name_prefix="agentrl-engine")
        slots = self._device_thread.submit(
            self._load,
            AutoModelForCausalLM,
            mem_fraction,
            prefix_cache_slots,
            context_len,
            cuda_graphs,
            compile,
            memory_mode,
            speculative,
        ).result()
        self.prefix_cache = (
            PrefixCache(list(range(max_batch_size, max_batch_size + slots))) if slots else None
        )
        log.info(
            "KV cache: %d running + %d prefix slots x %d tokens (%.2f GiB)",
            max_batch_size,
            slots,
            self.context_len,
            2 * self.runner.k.numel() * self.runner.k.element_size() / 2**30,
        )

        self.weight_version = "default"
        self._rng = random.Random(seed)
        self._requests: dict[str, EngineRequest] = {}  # rid -> request
        self.gate = RequestGate()  # paused, asleep, or drained for a weight update
        self.updates = WeightUpdates(self)
        # LoRA adapters applied merged or unmerged (.lora), unmerged ones in buffers of max_lora_rank (0: made
        # at the first adapter); and the weights' memory tag, which holds those buffers too
        self._device_thread.submit(self._init_adapters, lora_apply, max_lora_rank).result()
        self.stats = {"prompt_tokens": 0, "prefill_tokens": 0, "cached_tokens": 0, "decode_steps": 0}
        if quantization is not None:  # seconds the last quantization of the weights took (load or update)
            self.stats["quantize_s"] = self._quantize_s
        if speculative is not None:
            for key in SPEC_COUNTERS:
                self.stats[key] = 0
        self.scheduler = Scheduler(
            self.runner,
            self.tokenizer,
            self._on_device,
            max_batch_size,
            self.max_prefill_tokens,
            self.max_context,
            self.prefix_cache,
            self.stats,
            speculative,
        )
        self.sleep_wake = SleepWake(self.memory, self.gate, self.scheduler, self.runner, self._on_device)

    def _load(
        self,
        auto_model,
        mem_fraction,
        prefix_cache_slots,
        context_len,
        cuda_graphs,
        compile,
        memory_mode,
        speculative,
    ) -> int:
        """Device thread: the model, the KV cache plan and the runner; returns the prefix-cache slots."""
        max_batch_size, on_gpu = self.max_batch_size, self.device.type == "cuda"
        if on_gpu:
            torch.cuda.set_device(self.device)  # the current device is per thread
        self.memory = EngineMemory(self.device, memory_mode)
        model = auto_model.from_pretrained(self.model_path, dtype=self.dtype)
        with self.memory.region("weights"):  # one buffer (the parameters' views keep it): one region
            pack_parameters(model, self.device)
        self.model = model.to(self.device).eval()  # the buffers (RoPE tables) follow, outside the region
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.eos_ids = self._eos_ids()

        per_token = ModelRunner.kv_bytes_per_token(self.model)
        budget = self._kv_budget(mem_fraction) if on_gpu else 2 * 2**30
        model_context = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 20)
        slots = max_batch_size if prefix_cache_slots is None else prefix_cache_slots
        self.context_len, slots = plan_kv_cache(
            budget, per_token, max_batch_size, slots, model_context, context_len
        )
        t0 = time.perf_counter()
        self.runner = ModelRunner(
            self.model,
            max_batch_size + slots,
            self.context_len,
            max_batch_size,
            cuda_graphs=cuda_graphs,
            compile=compile,
            batch_invariant=self.batch_invariant,
            quantization=self.quantization,
            weights_region=(lambda: self.memory.region("weights")) if self.memory.mode == "virtual" else None,
            # virtual memory: the cache lives in its releasable region from the start (allocating it
            # elsewhere first left those blocks in the caching allocator)
            kv_region=(lambda: self.memory.region("kv_cache")) if self.memory.mode == "virtual" else None,
            verify_tokens=max_batch_size * (1 + speculative.num_draft_tokens) if speculative else 0,
        )
        self._quantize_s = time.perf_counter() - t0 if self.quantization else 0.0  # the runner quantizes
        routed = [] if self.runner.routed is None else [self.runner.routed]  # MoE: experts of cached tokens
        self.memory.register("kv_cache", [self.runner.k, self.runner.v, *routed])
        return slots

    def _kv_budget(self, mem_fraction: float | None) -> int:
        """Device thread, on a GPU: the bytes the KV cache may take, ``mem_fraction`` (default 0.8) of the
        free memory less what serving needs beside it and the fp8 copies of the weights."""
        free = torch.cuda.mem_get_info(self.device)[0]
        # logits and sampling, and a prefill step's activations (its padded rectangle may reach
        # Scheduler.PADDED_CELLS x max_prefill_tokens tokens: hidden states, q/k/v and the MLP's widths)
        cfg = self.model.config
        hidden = int(cfg.hidden_size)
        inter = int(getattr(cfg, "intermediate_size", None) or 4 * hidden)
        cells = Scheduler.PADDED_CELLS * self.max_prefill_tokens
        act = cells * (3 * inter + 6 * hidden) * self.dtype.itemsize
        reserve = 6 * self.max_batch_size * self.vocab_size * 4 + act + 2**29
        return int((mem_fraction or 0.8) * free) - reserve - fp8.copies_bytes(self.model, self.quantization)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.model.config):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list | tuple):
                ids.update(int(e) for e in eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return {i for i in ids if i >= 0}

    def warmup(self, max_length: int = 2048) -> int:
        """Capture the decode CUDA graphs of attention lengths up to ``max_length`` now, and with
        ``compile`` compile the prefill and sampling shapes (torch.compile treats sizes 1 and >1 apart), so
        no request pays for either. Call before serving; returns the number of graphs."""
        return self._device_thread.submit(self._warmup, max_length).result()

    def _warmup(self, max_length: int) -> int:
        graphs = self.runner.capture_all(max_length)
        shapes: tuple[tuple[int, int], ...] = ()
        if self.runner.compiled:
            shapes = ((1, 1), (1, 8), (2, 1), (2, 8))
        elif self.runner.batch_invariant and self.device.type == "cuda":
            # the Triton kernels' variants of prefill: a matmul's tiling follows its row count (1 to 64,
            # 128, 256, 512 and more tokens; sequences at once for the LM head), as does the attention's
            shapes = ((1, 40), (1, 100), (1, 200), (1, 400), (1, 600), (80, 2), (2, 8))
        invariant = self.runner.max_batch if self.runner.batch_invariant else None
        for rows, width in shapes:
            if rows > self.max_batch_size or width > self.context_len:
                continue  # only running slots 0..max_batch_size-1 may be written: with one slot and no
                # prefix cache, slot 1 was past the KV cache (a device-side assert)
            logits = self.runner.extend(ExtendBatch(list(range(rows)), [[0] * width] * rows, [0] * rows))
            with torch.inference_mode():
                sample_tokens(logits, [RequestSampling()] * rows, [0] * rows, [width] * rows, invariant)
        return graphs

    def memory_info(self) -> dict[str, float]:
        """GPU memory of this engine's process (GiB): peak allocated by torch (weights, KV cache,
        activations) and reserved now; empty on CPU."""
        if self.device.type != "cuda":
            return {}
        return {
            "peak_gpu_mem_gb": torch.cuda.max_memory_allocated(self.device) / 2**30,
            "reserved_gpu_mem_gb": torch.cuda.memory_reserved(self.device) / 2**30,
            "allocated_gpu_mem_gb": torch.cuda.memory_allocated(self.device) / 2**30,
            "free_gpu_mem_gb": torch.cuda.mem_get_info(self.device)[0] / 2**30,
        }

    def memory_state(self) -> dict[str, object]:
        """How the engine frees memory (virtual or copy), what is released now, and each tag's bytes."""
        return self.sleep_wake.state()

    @property
    def healthy(self) -> bool:
        return self.scheduler.healthy

    @property
    def max_context(self) -> int:
        """Longest prompt + output a request may ask for (a KV slot's length)."""
        return self.context_len

    @property
    def num_running(self) -> int:
        """Requests the engine holds: waiting for ``continue``, or in the schedule (an abandoned one until
        its abort is applied at the next step)."""
        return len({*self._requests.values(), *self.scheduler.active, *self.scheduler.waiting})

    @property
    def num_in_batch(self) -> int:
        """Requests in the running batch: admitted, prefilling or decoding (not waiting for admission)."""
        return len(self.scheduler.active)

    def shutdown(self) -> None:
        self.scheduler.cancel()
        self._device_thread.shutdown(wait=False, cancel_futures=True)
        self.updates.groups.abort_all()  # shutting down: no waiting on a trainer that may be gone

    # ------------------------------------------------------------------ requests (event loop)
    async def generate(
        self,
        input_ids: list[int],
        sampling: RequestSampling,
        rid: str,
        on_token: Callable[[int, float], None] | None = None,
    ) -> GenerationRecord:
        """Sample a completion of ``input_ids``; ``on_token(id, logprob)`` (which must not raise) sees each
        token as it is sampled. Cancelling the call aborts the request."""
        if rid in self._requests:
            raise EngineBadRequest(f"request id {rid!r} is already in flight")
        if not input_ids:
            raise EngineBadRequest("input_ids is empty")
        bad = [i for i in input_ids if not 0 <= i < self.vocab_size]
        if bad:
            raise EngineBadRequest(f"input_ids out of the vocabulary (size {self.vocab_size}): {bad[:5]}")
        if len(input_ids) + sampling.max_new_tokens > self.max_context:
            raise EngineBadRequest(
                f"prompt ({len(input_ids)}) + max_new_tokens ({sampling.max_new_tokens}) exceeds the "
                f"engine's context of {self.max_context} tokens"
            )
        if not self.healthy:
            raise EngineFailed(f"the generation loop is not running: {self.scheduler.fatal!r}")
        seed = sampling.sampling_seed if sampling.sampling_seed is not None else self._rng.getrandbits(63)
        stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else self.eos_ids)
        req = EngineRequest(
            rid=rid,
            prompt_ids=list(input_ids),
            sampling=sampling,
            seed=seed,
            stop_ids=stop_ids,
            on_token=on_token,
        )
        req.seq = list(input_ids)
        self._requests[rid] = req
        try:
            if sampling.max_new_tokens == 0:
                req.finish = {"type": "length", "length": 0}
            while req.finish is None:
                # Held while paused; then enter the engine unless a weight update is draining it.
                while not self.gate.is_open:
                    if await self.gate.wait_or_abort(req):
                        break
                if req.finish is not None:
                    break
                async with self.gate.drain.read():
                    if not self.gate.is_open:
                        continue  # paused between the two checks: wait again outside the lock
                    await self.scheduler.run(req)
        finally:
            self._requests.pop(rid, None)
        return GenerationRecord(
            rid=rid,
            prompt_ids=req.prompt_ids,
            output_ids=req.output_ids,
            logprobs=req.logprobs,
            finish_reason=req.finish,
            weight_version=self.weight_version,
            latency=time.perf_counter() - req.created,
            cached_tokens=req.cached_tokens,
            routed_experts=req.routed_experts,
        )

    def stream(self, input_ids: list[int], sampling: RequestSampling, rid: str) -> TokenStream:
        """:meth:`generate` as an async iterator of the newly sampled tokens (see :class:`TokenStream`);
        the request starts now."""
        return TokenStream(lambda on_token: self.generate(input_ids, sampling, rid, on_token))

    def abort(self, rid: str | None = None) -> int:
        """Abort one request or all (``rid=None``); they answer finish_reason abort. Returns how many."""
        reqs = list(self._requests.values()) if rid is None else [r for r in [self._requests.get(rid)] if r]
        for r in reqs:
            r.abort = True
            r.poke.set()
        self.scheduler.wake()
        return len(reqs)

    def pause(self, mode: str = "abort") -> int:
        """Hold new requests until :meth:`continue_generation`; ``abort`` aborts those in flight, ``retract``
        and ``in_place`` take them out keeping their tokens. Returns how many."""
        self.gate.pause(mode)
        if mode == "abort":
            return self.abort(None)
        return self.scheduler.retract_all()

    def continue_generation(self) -> None:
        """End a pause; requests enter again unless the engine is asleep (then they wait for the wake)."""
        self.gate.unpause()

    @property
    def paused_mode(self) -> str | None:
        """The mode of the pause in force (abort, retract or in_place), None when not paused."""
        return self.gate.paused_mode

    def _on_device(self, fn, *args) -> asyncio.Future:
        """Run ``fn`` on the engine's one device thread: every forward, slot copy and weight copy happens
        there, in order (on CPU a second thread of torch work would fight it for the cores)."""
        return asyncio.get_running_loop().run_in_executor(self._device_thread, fn, *args)

    # ------------------------------------------------------------------ sleep and wake (.sleep)
    @property
    def asleep(self) -> bool:
        """From the start of a release until every released tag is resumed; requests wait meanwhile."""
        return self.gate.sleeping

    async def release_memory_occupation(self, tags: list[str] | None = None) -> list[str]:
        """Sleep: free the device memory of ``tags`` (default both). Requests in flight are taken out
        keeping their tokens (as ``pause(retract)``) and wait, with new ones, until every tag is resumed;
        then they continue where they were (their KV recomputed). Releasing a tag that is already released
        is refused. Returns the tags released."""
        return await self.sleep_wake.release(tags)

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> list[str]:
        """Wake: give ``tags`` (default: every released one) their memory back; the weights with their
        content, the KV cache empty. Resuming a tag that is not released is refused (400): a wake without
        a sleep is a caller's bug. Once nothing is released, waiting requests enter again (unless paused).
        Returns the tags resumed."""
        return await self.sleep_wake.resume(tags)

    # ------------------------------------------------------------------ cache and weights (.weight_updates)
    async def flush_cache(self) -> None:
        if self.scheduler.in_flight:
            raise EngineBadRequest("cache not flushed: there are requests in flight")
        async with self.gate.drain.write(), self.scheduler.step_lock:
            self.scheduler.flush_prefix_cache()

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None,
        weight_version: str | None,
        abort_all: bool,
        flush: bool = True,
    ) -> None:
        """SGLang's ``/update_weights_from_tensor``: the tensors arrive as views of the sender's memory
        (CUDA IPC handles, or shared memory on the CPU: :mod:`agentrl.engine.named_tensors`); they are
        checked, copied in place and let go of before this returns."""
        await self.updates.from_tensor(
            serialized_named_tensors, load_format, weight_version, abort_all, flush
        )

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None, abort_all: bool, flush: bool = True
    ) -> None:
        """SGLang's ``/update_weights_from_disk``: a HF checkpoint directory."""
        await self.updates.from_disk(model_path, weight_version, abort_all, flush)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        await self.updates.groups.join(
            master_address, master_port, rank_offset, world_size, group_name, backend
        )

    async def destroy_weights_update_group(self, group_name: str, timeout: float = 30.0) -> bool:
        """Leave the group (the trainer leaves its end at the same time); bounded, aborts past ``timeout``."""
        return await self.updates.groups.leave(group_name, timeout)

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None,
        abort_all: bool,
        flush: bool = True,
        load_format: str | None = None,
    ) -> None:
        """SGLang's ``/update_weights_from_distributed``: the tensors the trainer broadcasts in the group
        (``load_format: flattened_bucket``: as one broadcast of their bytes)."""
        await self.updates.from_distributed(
            names, dtypes, shapes, group_name, weight_version, abort_all, flush, load_format
        )

    # the weight-update steps the LoRA endpoints (AdapterEndpoints) take
    async def _update(self, apply, abort_all: bool, weight_version: str | None, flush: bool = True) -> None:
        await self.updates.apply(apply, abort_all, weight_version, flush)

    def _requantize(self) -> None:
        self.updates.requantize()

    def _check_weights_resident(self) -> None:
        self.updates.check_resident()

    async def _unpacked(self, payload: str, load_format: str | None) -> tuple:
        return await self.updates.unpacked(payload, load_format)


__all__ = [
    "EmbeddedEngine",
    "EngineBadRequest",
    "EngineFailed",
    "GenerationRecord",
    "RequestSampling",
    "TokenDelta",
    "TokenStream",
]
