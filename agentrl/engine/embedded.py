"""The embedded engine: continuous batching over a slot KV cache, with what an RL rollout engine needs.

One asyncio task owns the schedule. Between steps it applies aborts and retractions, admits waiting
requests into free slots (copying the longest cached prefix of their tokens, :mod:`.prefix_cache`), and
picks the next step: a **prefill** of the requests that still have tokens to run (chunked by a token
budget), or else a **decode** of every running request (:mod:`.runner`, a CUDA graph per batch/length
bucket on a GPU). The step itself runs in a worker thread, so HTTP keeps being served; it samples on the
device (:mod:`.sampling`) and hands back ids and logprobs with one host sync.

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
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agentrl.engine.prefix_cache import PrefixCache
from agentrl.engine.runner import ExtendBatch, ModelRunner, plan_kv_cache
from agentrl.engine.sampling import EngineBadRequest, RequestSampling, sample_tokens
from agentrl.engine.weights import DrainLock, WeightGroups, check_weights, copy_weights, load_checkpoint

log = logging.getLogger("agentrl.engine")


class EngineFailed(RuntimeError):
    """The generation loop failed on a request (answered 500)."""


@dataclass
class GenerationRecord:
    """What one finished request produced (the server turns it into SGLang's JSON)."""

    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: dict[str, Any]
    weight_version: str
    latency: float
    cached_tokens: int = 0


@dataclass(eq=False)
class _Request:
    rid: str
    prompt_ids: list[int]
    sampling: RequestSampling
    seed: int
    stop_ids: set[int]
    seq: list[int] = field(default_factory=list)  # prompt + output: what the next step continues
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    abort: bool = False
    poke: asyncio.Event = field(default_factory=asyncio.Event)  # abort while waiting for continue
    outcome: asyncio.Future | None = None  # set by the loop when the request leaves the engine
    slot: int = -1
    cached: int = 0  # positions of seq whose KV is in the slot
    prefilling: bool = True
    epoch: int = 0  # prefix-cache epoch at admission (KV from older weights is never cached)
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    created: float = field(default_factory=time.perf_counter)


class EmbeddedEngine:
    """One HF causal LM served with continuous batching (see the module docstring)."""

    ADMIT_EVERY = 4  # decode steps between admissions while sequences are decoding

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
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = str(model_path)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.default_max_new_tokens = default_max_new_tokens
        self.max_batch_size = max_batch_size
        on_gpu = self.device.type == "cuda"
        self.max_prefill_tokens = max_prefill_tokens or (8192 if on_gpu else 2048)
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
        ).result()
        self.prefix_cache = (
            PrefixCache(list(range(max_batch_size, max_batch_size + slots))) if slots else None
        )
        log.info(
            "KV cache: %d running + %d prefix slots x %d tokens (%.2f GiB)",
            max_batch_size, slots, self.context_len,
            2 * self.runner.k.numel() * self.runner.k.element_size() / 2**30,
        )  # fmt: skip

        self.weight_version = "default"
        self._rng = random.Random(seed)
        self._requests: dict[str, _Request] = {}  # rid -> request
        self._waiting: deque[_Request] = deque()
        self._active: list[_Request] = []  # index = slot
        self._epoch = 0
        self._retract = False
        self._since_prefill = 0
        # slot copies (src, dst, n, start) decided since the last step, run before the next one
        self._copies: list[tuple[int, int, int, int]] = []
        self._drain = DrainLock()
        self._step_lock = asyncio.Lock()
        self._work = asyncio.Event()
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self.paused_mode: str | None = None
        self.groups = WeightGroups(self.device)
        self._task: asyncio.Task | None = None
        self._fatal: BaseException | None = None
        self.stats = {"prompt_tokens": 0, "prefill_tokens": 0, "cached_tokens": 0, "decode_steps": 0}

    def _load(self, auto_model, mem_fraction, prefix_cache_slots, context_len, cuda_graphs, compile) -> int:
        """Device thread: the model, the KV cache plan and the runner; returns the prefix-cache slots."""
        max_batch_size, on_gpu = self.max_batch_size, self.device.type == "cuda"
        if on_gpu:
            torch.cuda.set_device(self.device)  # the current device is per thread
        model = auto_model.from_pretrained(self.model_path, dtype=self.dtype)
        self.model = model.to(self.device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.eos_ids = self._eos_ids()

        per_token = ModelRunner.kv_bytes_per_token(self.model)
        if on_gpu:
            free = torch.cuda.mem_get_info(self.device)[0]
            # logits, sampling and prefill activations
            reserve = 6 * max_batch_size * self.vocab_size * 4 + 2**30
            budget = int((mem_fraction or 0.8) * free) - reserve
        else:
            budget = 2 * 2**30
        model_context = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 20)
        slots = max_batch_size if prefix_cache_slots is None else prefix_cache_slots
        self.context_len, slots = plan_kv_cache(
            budget, per_token, max_batch_size, slots, model_context, context_len
        )
        self.runner = ModelRunner(
            self.model,
            max_batch_size + slots,
            self.context_len,
            max_batch_size,
            cuda_graphs=cuda_graphs,
            compile=compile,
        )
        return slots

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
        if self.runner.compiled:
            for rows, width in ((1, 1), (1, 8), (2, 1), (2, 8)):
                logits = self.runner.extend(ExtendBatch(list(range(rows)), [[0] * width] * rows, [0] * rows))
                with torch.inference_mode():
                    sample_tokens(logits, [RequestSampling()] * rows, [0] * rows, [width] * rows)
        return graphs

    def memory_info(self) -> dict[str, float]:
        """GPU memory of this engine's process (GiB): peak allocated by torch (weights, KV cache,
        activations) and reserved now; empty on CPU."""
        if self.device.type != "cuda":
            return {}
        return {
            "peak_gpu_mem_gb": torch.cuda.max_memory_allocated(self.device) / 2**30,
            "reserved_gpu_mem_gb": torch.cuda.memory_reserved(self.device) / 2**30,
        }

    @property
    def healthy(self) -> bool:
        return self._fatal is None and (self._task is None or not self._task.done())

    @property
    def max_context(self) -> int:
        """Longest prompt + output a request may ask for (a KV slot's length)."""
        return self.context_len

    @property
    def num_running(self) -> int:
        return len(self._requests)

    def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._device_thread.shutdown(wait=False, cancel_futures=True)
        self.groups.abort_all()  # shutting down: no waiting on a trainer that may be gone

    # ------------------------------------------------------------------ requests (event loop)
    async def generate(self, input_ids: list[int], sampling: RequestSampling, rid: str) -> GenerationRecord:
        if rid in self._requests:
            raise EngineBadRequest(f"request id {rid!r} is already in flight")
        if not input_ids:
            raise EngineBadRequest("input_ids is empty")
        bad = [i for i in input_ids if not 0 <= i < self.vocab_size]
        if bad:
            raise EngineBadRequest(f"input_ids out of the vocabulary (size {self.vocab_size}): {bad[:5]}")
        if len(input_ids) + sampling.max_new_tokens > self.max_context:
            raise EngineBadRequest(
                f"prompt ({len(input_ids)}) + max_new_tokens ({sampling.max_new_tokens}) exceeds the engine's "
                f"context of {self.max_context} tokens"
            )
        if not self.healthy:
            raise EngineFailed(f"the generation loop is not running: {self._fatal!r}")
        seed = sampling.sampling_seed if sampling.sampling_seed is not None else self._rng.getrandbits(63)
        stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else self.eos_ids)
        req = _Request(rid=rid, prompt_ids=list(input_ids), sampling=sampling, seed=seed, stop_ids=stop_ids)
        req.seq = list(input_ids)
        self._requests[rid] = req
        try:
            if sampling.max_new_tokens == 0:
                req.finish = {"type": "length", "length": 0}
            while req.finish is None:
                # Held while paused; then enter the engine unless a weight update is draining it.
                while not self._unpaused.is_set():
                    if await self._wait_or_abort(req):
                        break
                if req.finish is not None:
                    break
                async with self._drain.read():
                    if not self._unpaused.is_set():
                        continue  # paused between the two checks: wait again outside the lock
                    await self._run(req)
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
        )

    async def _wait_or_abort(self, req: _Request) -> bool:
        """Wait for ``continue``; True if the request was aborted meanwhile."""
        waiter = asyncio.ensure_future(self._unpaused.wait())
        poked = asyncio.ensure_future(req.poke.wait())
        await asyncio.wait({waiter, poked}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        poked.cancel()
        if req.abort:
            req.finish = {"type": "abort", "message": "aborted while waiting"}
            return True
        return False

    async def _run(self, req: _Request) -> None:
        """One stay of ``req`` in the engine: until it finishes, is aborted or is retracted."""
        if req.abort:
            req.finish = {"type": "abort", "message": "aborted"}
            return
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="agentrl-engine-loop")
        req.outcome = asyncio.get_running_loop().create_future()
        req.prefilling = True
        self._waiting.append(req)
        self._work.set()
        try:
            await req.outcome
        finally:
            if not req.outcome.done():  # our caller was cancelled (client gone): take it out at the next step
                req.abort = True
                self._work.set()
        err = req.outcome.result()
        if err is not None:
            raise EngineFailed(f"generation failed: {err}")

    def abort(self, rid: str | None = None) -> int:
        """Abort one request or all (``rid=None``); they answer finish_reason abort. Returns how many."""
        reqs = list(self._requests.values()) if rid is None else [r for r in [self._requests.get(rid)] if r]
        for r in reqs:
            r.abort = True
            r.poke.set()
        self._work.set()
        return len(reqs)

    def pause(self, mode: str = "abort") -> int:
        if mode not in ("abort", "retract", "in_place"):
            raise EngineBadRequest(f"pause mode must be abort, retract or in_place, not {mode!r}")
        self._unpaused.clear()
        self.paused_mode = mode
        if mode == "abort":
            return self.abort(None)
        inside = len(self._active) + len(self._waiting)
        self._retract = True
        self._work.set()
        return inside

    def continue_generation(self) -> None:
        self.paused_mode = None
        self._unpaused.set()

    # ------------------------------------------------------------------ the schedule (event loop)
    async def _loop(self) -> None:
        try:
            while True:
                await self._work.wait()
                self._control()
                step = self._plan()
                if step is None:
                    self._work.clear()
                    continue
                try:
                    async with self._step_lock:
                        result = await self._on_device(self._execute, *step)
                except Exception as err:  # one bad step fails its requests, not the engine
                    log.exception("engine step failed")
                    self._fail(step[1], err)
                    continue
                self._commit(step, result)
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # a bug in the schedule: fail everything, report unhealthy
            log.exception("the generation loop died")
            self._fatal = err
            self._fail(list(self._active) + list(self._waiting), err)
            raise

    def _control(self) -> None:
        """Apply aborts and a pending retraction between steps."""
        if self._retract:
            self._retract = False
            for r in list(self._waiting):
                self._leave(r, None)
            self._waiting.clear()
            for r in sorted(self._active, key=lambda r: -r.slot):
                self._leave(r, None)
        if any(r.abort for r in self._waiting):
            keep = deque()
            for r in self._waiting:
                if r.abort:
                    self._leave(r, {"type": "abort", "message": "aborted"})
                else:
                    keep.append(r)
            self._waiting = keep
        for r in sorted((r for r in self._active if r.abort), key=lambda r: -r.slot):
            self._leave(r, {"type": "abort", "message": "aborted"})

    def _admit(self) -> None:
        while self._waiting and len(self._active) < self.max_batch_size:
            r = self._waiting.popleft()
            r.slot, r.cached, r.epoch = len(self._active), 0, self._epoch
            self._active.append(r)
            self.stats["prompt_tokens"] += len(r.seq)
            if self.prefix_cache is not None:
                src, n = self.prefix_cache.lookup(r.seq, len(r.seq) - 1)
                if src is not None:
                    self._copies.append((src, r.slot, n, 0))
                    r.cached = n
                    if not r.output_ids:
                        r.cached_tokens = n
                    self.stats["cached_tokens"] += n

    def _plan(self) -> tuple[str, list[_Request], ExtendBatch | None, list[int]] | None:
        """The next step: ("prefill", rows, ExtendBatch, sampling) or ("decode", rows, None, sampling), with
        ``sampling`` the indices of the rows that get a token (a prefill row only once its prompt is all in);
        None if idle.

        Requests that arrive one by one while others decode are gathered for a few decode steps
        (``ADMIT_EVERY``) and prefilled together: every prefill step stalls all decoding rows once."""
        if self._waiting and (
            not any(not r.prefilling for r in self._active)
            or self._since_prefill >= self.ADMIT_EVERY
            or len(self._waiting) >= self.max_batch_size - len(self._active)
            or sum(len(r.seq) for r in self._waiting) >= self.max_prefill_tokens // 2
        ):
            self._admit()
        rows = [r for r in self._active if r.prefilling]
        if rows:
            picked, tokens, start, width = [], [], [], 0
            for r in rows:
                todo = len(r.seq) - r.cached
                take = min(todo, self.max_prefill_tokens)
                if picked and (len(picked) + 1) * max(width, take) > self.max_prefill_tokens:
                    break
                width = max(width, take)
                picked.append(r)
                tokens.append(r.seq[r.cached : r.cached + take])
                start.append(r.cached)
            self._since_prefill = 0
            done = [i for i, r in enumerate(picked) if r.cached + len(tokens[i]) == len(r.seq)]
            return "prefill", picked, ExtendBatch([r.slot for r in picked], tokens, start), done
        if self._active:
            self._since_prefill += 1
            return "decode", list(self._active), None, list(range(len(self._active)))
        return None

    def _on_device(self, fn, *args) -> asyncio.Future:
        """Run ``fn`` on the engine's one device thread: every forward, slot copy and weight copy happens
        there, in order (on CPU a second thread of torch work would fight it for the cores)."""
        return asyncio.get_running_loop().run_in_executor(self._device_thread, fn, *args)

    def _execute(self, kind: str, rows: list[_Request], batch: ExtendBatch | None, done: list[int]):
        """Device thread: the slot copies queued since the last step (prefix hits, cache inserts,
        compaction, in the order they were decided), then one forward + sampling. Returns (ids,
        logprobs) of the rows that sample."""
        copies, self._copies = self._copies, []
        for src, dst, n, start in copies:
            self.runner.copy_slot(src, dst, n, start=start)
        if kind == "prefill":
            logits = self.runner.extend(batch)
            if not done:
                return [], []
            logits = logits[done] if len(done) < len(rows) else logits
        else:
            logits = self.runner.decode([r.seq[-1] for r in rows], [len(r.seq) - 1 for r in rows])
        sampled = [rows[i] for i in done]
        with torch.inference_mode():
            return sample_tokens(
                logits,
                [r.sampling for r in sampled],
                [r.seed for r in sampled],
                [len(r.seq) for r in sampled],
            )

    def _commit(
        self,
        step: tuple[str, list[_Request], ExtendBatch | None, list[int]],
        result: tuple[list[int], list[float]],
    ) -> None:
        kind, rows, batch, done = step
        ids, lps = result
        if kind == "prefill":
            for r, new in zip(rows, batch.tokens, strict=True):
                r.cached += len(new)
                self.stats["prefill_tokens"] += len(new)
        else:
            self.stats["decode_steps"] += 1
            for r in rows:
                r.cached += 1
        sampled = [rows[i] for i in done]
        for r in sampled:
            r.prefilling = False
        finished = [r for r, t, lp in zip(sampled, ids, lps, strict=True) if self._append(r, t, lp)]
        for r in sorted(finished, key=lambda r: -r.slot):
            self._leave(r, r.finish)

    def _append(self, r: _Request, token: int, logprob: float) -> bool:
        """Take one sampled token; True once the request is finished."""
        r.seq.append(token)
        r.output_ids.append(token)
        r.logprobs.append(logprob)
        s = r.sampling
        if token in r.stop_ids:
            r.finish = {"type": "stop", "matched": token}
        elif s.stop and (matched := self._match_stop(r.output_ids, s.stop)) is not None:
            r.finish = {"type": "stop", "matched": matched}
        elif len(r.output_ids) >= s.max_new_tokens or len(r.seq) >= self.max_context:
            r.finish = {"type": "length", "length": s.max_new_tokens}
        return r.finish is not None

    def _match_stop(self, ids: list[int], stops: list[str]) -> str | None:
        # Only the tail can hold a stop string that the newest token completed; a generous token window
        # covers byte-level tokens that are a fraction of a character.
        window = max(len(x.encode()) for x in stops) + 2
        tail = self.tokenizer.decode(ids[-window:], skip_special_tokens=False)
        for x in stops:
            if x in tail:
                return x
        return None

    def _leave(self, r: _Request, finish: dict[str, Any] | None, error: BaseException | None = None) -> None:
        """Take ``r`` out of the engine (finished, aborted, or retracted when ``finish`` is None): keep its
        KV in the prefix cache, free its slot (the last running request moves into it) and wake its caller."""
        if finish is not None:
            r.finish = finish
        if r.slot >= 0:  # running (a waiting request has no slot yet)
            pc = self.prefix_cache
            if pc is not None and r.epoch == self._epoch and r.cached >= pc.block:
                dst, have = pc.insert(r.seq[: r.cached])
                if dst is not None:
                    self._copies.append((r.slot, dst, r.cached, have))
            last = self._active.pop()
            if last is not r:
                self._copies.append((last.slot, r.slot, last.cached, 0))
                last.slot = r.slot
                self._active[r.slot] = last
            r.slot = -1
        if r.outcome is not None and not r.outcome.done():
            r.outcome.set_result(error)

    def _fail(self, rows: list[_Request], err: BaseException) -> None:
        """Take ``rows`` out with an error (answered 500); their KV may be half-written, so it is not cached."""
        for r in sorted(rows, key=lambda r: -r.slot):
            r.epoch = -1
            if r in self._waiting:
                self._waiting.remove(r)
            self._leave(r, None, error=err)

    # ------------------------------------------------------------------ cache and weights
    def _flush_prefix_cache(self) -> None:
        self._epoch += 1
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    async def flush_cache(self) -> None:
        if self._active or self._waiting:
            raise EngineBadRequest("cache not flushed: there are requests in flight")
        async with self._drain.write(), self._step_lock:
            self._flush_prefix_cache()

    async def _update(self, apply, abort_all: bool, weight_version: str | None, flush: bool = True) -> None:
        if abort_all:
            self.abort(None)
        async with self._drain.write(), self._step_lock:
            await self._on_device(apply)
            if flush:
                self._flush_prefix_cache()
            if weight_version is not None:
                self.weight_version = str(weight_version)

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None, abort_all: bool, flush: bool = True
    ) -> None:
        path = Path(model_path)
        if not await asyncio.to_thread(path.is_dir):
            raise EngineBadRequest(f"model_path {model_path!r} is not a directory")
        # Read the checkpoint before taking the lock: on a GPU generation continues meanwhile; on CPU the read
        # (torch work) runs on the device thread, between steps.
        load = functools.partial(load_checkpoint, path, self.dtype)
        try:
            tensors = await (asyncio.to_thread(load) if self.device.type == "cuda" else self._on_device(load))
        except (OSError, ValueError) as err:
            raise EngineBadRequest(f"cannot load weights from {model_path!r}: {err}") from None
        check_weights(self.model, tensors)
        await self._update(lambda: copy_weights(self.model, tensors), abort_all, weight_version, flush)
        self.model_path = str(path)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        await self.groups.join(master_address, master_port, rank_offset, world_size, group_name, backend)

    async def destroy_weights_update_group(self, group_name: str, timeout: float = 30.0) -> bool:
        """Leave the group (the trainer leaves its end at the same time); bounded, aborts past ``timeout``."""
        return await self.groups.leave(group_name, timeout)

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None,
        abort_all: bool,
        flush: bool = True,
    ) -> None:
        # Receive first (the trainer is blocked in broadcast until we do), even if the names turn out to be
        # wrong: refusing before receiving would leave the trainer hanging in its collective.
        tensors = await self.groups.receive(group_name, names, dtypes, shapes)
        check_weights(self.model, tensors)
        await self._update(lambda: copy_weights(self.model, tensors), abort_all, weight_version, flush)


__all__ = ["EmbeddedEngine", "EngineBadRequest", "EngineFailed", "GenerationRecord", "RequestSampling"]
