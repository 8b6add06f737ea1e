"""The embedded engine's core: transformers' continuous batching plus what an RL rollout engine needs.

transformers' ``ContinuousBatchingManager`` (``model.init_continuous_batching``) owns scheduling, the paged
KV cache, prefix sharing and the background generation thread. What it does not offer is wrapped around
it here, with no home-made batcher:

* **Per-request sampling and exact logprobs.** The manager's sampler applies one ``do_sample`` flag to
  every request, has no per-request seed and returns the logprob of the *processed* (temperature /
  top-k / top-p) distribution. We replace its ``ModelRunner._sample`` hook with :meth:`CBEngine._sample`,
  which maps each logits row to its request, samples with that request's temperature / top-p / top-k /
  min-p (temperature 0 = greedy) and optional ``sampling_seed`` (a per-request ``torch.Generator``), and
  returns ``log_softmax`` of the **raw fp32 logits** at the sampled id -- the quantity a trainer recomputes
  (SGLang with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``, which agentrl's launcher sets). The manager is therefore built with no logits processors, without CUDA graphs
  or torch.compile (the hook is Python that reads request state) and with synchronous batching (so the
  rows of a step are the requests of that step).
* **Stop strings and stop token ids.** Stop ids (plus EOS unless ``ignore_eos``) go in as the request's
  EOS set. Stop strings are checked on the decoded tail after every streamed token; on a match the
  request is cancelled and the output ends at the matching token.
* **Abort / pause / weight updates.** Aborting cancels the request in the manager and answers the tokens
  and logprobs produced so far with ``finish_reason`` abort. ``pause(abort)`` aborts everything in flight
  and holds new requests until ``continue``; ``pause(retract|in_place)`` takes requests out of the
  manager, keeps their tokens and resubmits them (prompt + partial output) on ``continue`` -- so their KV
  is recomputed with whatever weights are current then. Weight updates first abort (if asked), then wait
  for in-flight requests to finish while holding new ones (SGLang's behaviour), pause the generation loop,
  copy the weights in place and flush the prefix cache, so no request ever mixes weights within a step
  and no cached prefix from old weights is reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("agentrl.engine")

_ABORT = "abort"
_RETRACT = "retract"


class EngineBadRequest(ValueError):
    """The request is invalid (answered 400)."""


class EngineFailed(RuntimeError):
    """The generation loop failed on a request (answered 500)."""


@dataclass
class RequestSampling:
    """Validated SGLang ``sampling_params`` for one request."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None

    @classmethod
    def from_sglang(cls, d: dict[str, Any] | None, default_max_new_tokens: int) -> RequestSampling:
        d = dict(d or {})
        known = set(cls.__dataclass_fields__)
        # SGLang accepts more knobs (penalties, regex, json_schema, n ...); those we cannot honour are errors,
        # not silently ignored, except the few that do not change sampling.
        harmless = {"spaces_between_special_tokens", "logit_bias", "custom_params", "stream_interval"}
        unknown = sorted(k for k in d if k not in known and k not in harmless and d[k] is not None)
        penalties = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "n": 1}
        unknown = [k for k in unknown if not (k in penalties and d[k] == penalties[k])]
        if d.get("logit_bias"):
            unknown.append("logit_bias")
        if unknown:
            raise EngineBadRequest(
                f"sampling_params not supported by the embedded engine: {', '.join(unknown)}"
            )
        kw: dict[str, Any] = {k: d[k] for k in known if d.get(k) is not None}
        if isinstance(kw.get("stop"), str):
            kw["stop"] = [kw["stop"]]
        if isinstance(kw.get("stop_token_ids"), int):
            kw["stop_token_ids"] = [kw["stop_token_ids"]]
        kw.setdefault("max_new_tokens", default_max_new_tokens)
        try:
            s = cls(**kw)
            s.temperature = float(s.temperature)
            s.top_p = float(s.top_p)
            s.top_k = int(s.top_k)
            s.min_p = float(s.min_p)
            s.max_new_tokens = int(s.max_new_tokens)
            s.stop = [str(x) for x in s.stop]
            s.stop_token_ids = [int(x) for x in s.stop_token_ids]
            s.sampling_seed = None if s.sampling_seed is None else int(s.sampling_seed)
        except (TypeError, ValueError) as err:
            raise EngineBadRequest(f"invalid sampling_params: {err}") from None
        if s.temperature < 0:
            raise EngineBadRequest("sampling_params.temperature must be >= 0")
        if not 0.0 < s.top_p <= 1.0:
            raise EngineBadRequest("sampling_params.top_p must be in (0, 1]")
        if s.top_k == 0 or s.top_k < -1:
            raise EngineBadRequest("sampling_params.top_k must be -1 (off) or >= 1")
        if not 0.0 <= s.min_p <= 1.0:
            raise EngineBadRequest("sampling_params.min_p must be in [0, 1]")
        if s.max_new_tokens < 0:
            raise EngineBadRequest("sampling_params.max_new_tokens must be >= 0")
        if any(not x for x in s.stop):
            raise EngineBadRequest("sampling_params.stop must not contain empty strings")
        return s


@dataclass
class _Request:
    rid: str
    prompt_ids: list[int]
    sampling: RequestSampling
    generator: torch.Generator | None
    queue: asyncio.Queue
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    internal_id: str | None = None  # the id under which the manager currently knows it
    consumed: int = 0  # tokens of the current submission already taken into output_ids
    created: float = field(default_factory=time.perf_counter)


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


class _DrainLock:
    """Readers = requests inside the manager; the writer (a weight update) waits for them to finish and
    holds new ones back meanwhile (writer preference, so a steady request stream cannot starve updates)."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextlib.asynccontextmanager
    async def read(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and self._writers_waiting == 0)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def write(self):
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and self._readers == 0)
            finally:
                self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            async with self._cond:
                self._writer = False
                self._cond.notify_all()


class CBEngine:
    """One HF causal LM served through transformers' continuous batching (see the module docstring)."""

    def __init__(
        self,
        model_path: str | Path,
        device: str = "cpu",
        dtype: str = "float32",
        max_batch_size: int = 64,
        max_batch_tokens: int | None = None,
        num_blocks: int | None = None,
        page_size: int | None = None,
        prefix_sharing: bool = True,
        seed: int = 0,
        default_max_new_tokens: int = 128,
        mem_fraction: float | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = str(model_path)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.default_max_new_tokens = default_max_new_tokens
        self.max_batch_size = max_batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=self.dtype, attn_implementation="sdpa"
        )
        self.model = model.to(self.device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)
        self.eos_ids = self._eos_ids()
        self.weight_version = "default"
        self._gen = torch.Generator(device=self.device).manual_seed(seed)
        self._live: dict[str, _Request] = {}  # internal id -> request (read by the generation thread)
        self._requests: dict[str, _Request] = {}  # rid -> request, for abort
        self._ids = itertools.count()
        self._drain = _DrainLock()
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self.paused_mode: str | None = None
        self._groups: dict[str, Any] = {}
        self._manager = self._start_manager(
            max_batch_size, max_batch_tokens, num_blocks, page_size, prefix_sharing, seed, mem_fraction
        )

    # ------------------------------------------------------------------ set-up
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

    def _start_manager(
        self, max_batch_size, max_batch_tokens, num_blocks, page_size, prefix_sharing, seed, mem_fraction
    ):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        # No temperature/top-k/top-p here: the manager must hand our sampler the raw logits.
        gen_cfg = GenerationConfig(
            do_sample=True, temperature=1.0, top_k=None, top_p=None, eos_token_id=-1, max_new_tokens=128
        )
        on_cpu = self.device.type == "cpu"
        cb_cfg = ContinuousBatchingConfig(
            return_logprobs=True,  # the output buffer gets a logprob row, which our sampler fills
            use_cuda_graph=False,
            use_async_batching=False,
            default_compile_level=0,
            max_requests_per_batch=max_batch_size,
            max_batch_tokens=max_batch_tokens or (512 if on_cpu else None),
            num_blocks=num_blocks or (1024 if on_cpu else None),
            page_size=page_size or (32 if on_cpu else 256),
            allow_block_sharing=prefix_sharing,
            # sdpa stays: switching to flash kernels may try to fetch them from the network
            auto_switch_to_flash=False,
            seed=seed,
            **({"max_memory_percent": mem_fraction} if mem_fraction is not None else {}),
        )
        mgr = self.model.init_continuous_batching(
            generation_config=gen_cfg, continuous_batching_config=cb_cfg
        )
        if mgr.logit_processor.do_processing:
            raise RuntimeError(
                f"continuous batching built logits processors we do not want: {mgr.logit_processor}"
            )
        mgr.warmup()  # creates the batch processor now, so the sampler hook is in place before the loop runs
        runner = mgr.batch_processor.model_runner
        if not hasattr(runner, "_sample"):
            raise RuntimeError("this transformers version has no ModelRunner._sample hook to sample with")
        runner._sample = self._sample
        self._io = mgr.batch_processor.inputs_and_outputs
        mgr.start()
        return mgr

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
        m = self._manager
        return m.is_running() and m.background_thread_status.fatal_error is None

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self._manager.stop(block=True, timeout=10, hard_stop=True)
        from agentrl.engine.dist import abort_process_group

        for name in list(self._groups):  # shutting down: no waiting on a trainer that may be gone
            abort_process_group(self._groups.pop(name)[0])

    # ------------------------------------------------------------------ sampling (generation thread)
    @torch.no_grad()
    def _sample(self, scores: torch.Tensor, output_ids: torch.Tensor) -> None:
        """Replaces ``ModelRunner._sample``: per-request sampling, raw-model logprobs of the sampled ids."""
        logits = scores[0].float()  # [rows, vocab]; rows follow the requests that get a new token
        rows = logits.shape[0]
        states = [fs.state for fs in self._io.requests_in_batch if fs.has_new_token]
        reqs = [self._live.get(s.request_id) for s in states[:rows]]
        reqs += [None] * (rows - len(reqs))
        default = RequestSampling(temperature=0.0)
        params = [r.sampling if r is not None else default for r in reqs]

        logp = torch.log_softmax(logits, dim=-1)
        dev = logits.device
        tokens = logits.argmax(dim=-1)  # temperature 0 = greedy
        sample_rows = [i for i, p in enumerate(params) if p.temperature > 0.0]
        if sample_rows:
            idx = torch.tensor(sample_rows, device=dev)
            temps = torch.tensor(
                [params[i].temperature for i in sample_rows], device=dev, dtype=torch.float32
            )
            x = logits.index_select(0, idx) / temps.unsqueeze(-1)
            x = _filter_logits(x, [params[i] for i in sample_rows])
            probs = torch.softmax(x, dim=-1)
            seeded = [
                j for j, i in enumerate(sample_rows) if reqs[i] is not None and reqs[i].generator is not None
            ]
            seeded_set = set(seeded)
            unseeded = [j for j in range(len(sample_rows)) if j not in seeded_set]
            picked = torch.empty(len(sample_rows), dtype=torch.long, device=dev)
            if unseeded:
                u = torch.tensor(unseeded, device=dev)
                picked[u] = torch.multinomial(probs.index_select(0, u), 1, generator=self._gen).squeeze(-1)
            for j in seeded:
                gen = reqs[sample_rows[j]].generator
                picked[j] = torch.multinomial(probs[j : j + 1], 1, generator=gen).squeeze(-1)[0]
            tokens[idx] = picked
        lp = logp.gather(1, tokens.unsqueeze(-1)).squeeze(-1)
        output_ids[0, :rows].copy_(tokens)
        output_ids[1, :rows].copy_(lp.contiguous().view(dtype=torch.int32))

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
                f"prompt ({len(input_ids)}) + max_new_tokens ({sampling.max_new_tokens}) exceeds the model's "
                f"context of {self.max_context} tokens"
            )
        gen = None
        if sampling.sampling_seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(sampling.sampling_seed)
        req = _Request(
            rid=rid, prompt_ids=list(input_ids), sampling=sampling, generator=gen, queue=asyncio.Queue()
        )
        self._requests[rid] = req
        try:
            if sampling.max_new_tokens == 0:
                req.finish = {"type": "length", "length": 0}
            while req.finish is None:
                # Held while paused; then enter the manager unless a weight update is draining it.
                while not self._unpaused.is_set():
                    if await self._wait_or_abort(req):
                        break
                if req.finish is not None:
                    break
                async with self._drain.read():
                    if not self._unpaused.is_set():
                        continue  # paused between the two checks: wait again outside the lock
                    await self._run_in_manager(req)
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
        )

    async def _wait_or_abort(self, req: _Request) -> bool:
        """Wait for ``continue``; True if the request was aborted meanwhile."""
        waiter = asyncio.ensure_future(self._unpaused.wait())
        getter = asyncio.ensure_future(req.queue.get())
        done, _ = await asyncio.wait({waiter, getter}, return_when=asyncio.FIRST_COMPLETED)
        for t in (waiter, getter):
            if t not in done:
                t.cancel()
        if getter in done and getter.result() == _ABORT:
            req.finish = {"type": "abort", "message": "aborted while waiting"}
            return True
        return False

    async def _run_in_manager(self, req: _Request) -> None:
        """One submission of ``req`` to the manager, until it finishes, is aborted or is retracted."""
        s = req.sampling
        iid = f"{req.rid}#{next(self._ids)}"
        stop_ids = set(s.stop_token_ids) | (set() if s.ignore_eos else self.eos_ids)
        remaining = s.max_new_tokens - len(req.output_ids)
        req.internal_id, req.consumed = iid, 0
        self._live[iid] = req
        mgr = self._manager
        mgr.register_result_handler(iid, req.queue.put_nowait)
        submitted = False
        try:
            got = mgr.add_request(
                input_ids=req.prompt_ids + req.output_ids,
                request_id=iid,
                max_new_tokens=remaining,
                streaming=True,
                eos_token_id=sorted(stop_ids),
            )
            if got is None:
                raise EngineFailed("the generation loop is not accepting requests (stopped or crashed)")
            submitted = True
            while True:
                item = await req.queue.get()
                if item == _ABORT:
                    req.finish = {"type": "abort", "message": "aborted"}
                    return
                if item == _RETRACT:
                    return  # resubmitted (prompt + partial output) after continue
                if item.request_id != iid:
                    continue  # late output of an earlier submission
                if item.error is not None:
                    raise EngineFailed(f"generation failed: {item.error}")
                if self._take_tokens(req, item):
                    if not item.is_finished():
                        return  # a stop string ended it early: cancelled in `finally`
                    submitted = False
                    return
                if item.is_finished():
                    submitted = False
                    last = req.output_ids[-1] if req.output_ids else None
                    if last is not None and last in stop_ids:
                        req.finish = {"type": "stop", "matched": last}
                    else:
                        req.finish = {"type": "length", "length": s.max_new_tokens}
                    return
        finally:
            if submitted:
                mgr.cancel_request(iid)
            with mgr.output_router._lock:
                mgr.output_router.result_handlers.pop(iid, None)
            self._live.pop(iid, None)
            req.internal_id = None

    def _take_tokens(self, req: _Request, out: Any) -> bool:
        """Append the new tokens of a streamed output; True once the request is finished by a stop string
        (its output then ends at the matching token) or by EOS/stop id/length (handled by the caller)."""
        toks, lps = out.generated_tokens, out.logprobs
        s = req.sampling
        for k in range(req.consumed, len(toks)):
            req.output_ids.append(int(toks[k]))
            req.logprobs.append(float(lps[k]))
            req.consumed = k + 1
            if s.stop:
                matched = self._match_stop(req.output_ids, s.stop)
                if matched is not None:
                    req.finish = {"type": "stop", "matched": matched}
                    return True
        return False

    def _match_stop(self, ids: list[int], stops: list[str]) -> str | None:
        # Only the tail can hold a stop string that the newest token completed; a generous token window
        # covers byte-level tokens that are a fraction of a character.
        window = max(len(x.encode()) for x in stops) + 2
        tail = self.tokenizer.decode(ids[-window:], skip_special_tokens=False)
        for x in stops:
            if x in tail:
                return x
        return None

    def abort(self, rid: str | None = None) -> int:
        """Abort one request or all (``rid=None``); they answer finish_reason abort. Returns how many."""
        reqs = list(self._requests.values()) if rid is None else [r for r in [self._requests.get(rid)] if r]
        for r in reqs:
            r.queue.put_nowait(_ABORT)
        return len(reqs)

    def pause(self, mode: str = "abort") -> int:
        if mode not in ("abort", "retract", "in_place"):
            raise EngineBadRequest(f"pause mode must be abort, retract or in_place, not {mode!r}")
        self._unpaused.clear()
        self.paused_mode = mode
        if mode == "abort":
            return self.abort(None)
        inside = [r for r in self._requests.values() if r.internal_id is not None]
        for r in inside:
            r.queue.put_nowait(_RETRACT)
        return len(inside)

    def continue_generation(self) -> None:
        self.paused_mode = None
        self._unpaused.set()

    @property
    def num_running(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ cache and weights
    async def _wait_manager_idle(self, timeout: float = 30.0) -> None:
        """Cancellations reach the scheduler asynchronously; wait until it holds no request at all."""
        deadline = time.monotonic() + timeout
        while True:
            bp = self._manager.batch_processor
            sched = bp.scheduler if bp is not None else None
            busy = sched is not None and (sched.active_requests or sched.waiting_requests)
            if not busy and self._manager.input_queue.empty() and self._manager.cancel_queue.empty():
                return
            if time.monotonic() > deadline:
                raise EngineFailed("the generation loop did not become idle")
            await asyncio.sleep(0.005)

    def _flush_prefix_cache_paused(self) -> None:
        """Drop every cached KV block (called with the loop paused and no request in the manager)."""
        bp = self._manager.batch_processor
        if bp is None:
            return
        bp.cache.evict_cached_blocks()
        for alloc in bp.cache.cache_allocators.values():
            if alloc.ledger.hash_to_block:
                raise EngineFailed("prefix cache still references blocks after the flush")

    async def flush_cache(self) -> None:
        if self._requests and any(r.internal_id is not None for r in self._requests.values()):
            raise EngineBadRequest("cache not flushed: there are requests in flight")
        async with self._drain.write():
            await self._wait_manager_idle()
            await asyncio.to_thread(self._paused_call, self._flush_prefix_cache_paused)

    def _paused_call(self, fn, *args):
        with self._manager.pause():
            return fn(*args)

    async def _update(self, apply, abort_all: bool, weight_version: str | None, flush: bool = True) -> None:
        if abort_all:
            self.abort(None)
        async with self._drain.write():
            await self._wait_manager_idle()

            def work():
                apply()
                if flush:
                    self._flush_prefix_cache_paused()

            await asyncio.to_thread(self._paused_call, work)
            if weight_version is not None:
                self.weight_version = str(weight_version)

    def _check_and_copy(self, tensors: dict[str, torch.Tensor]) -> None:
        # state_dict(keep_vars) names tied weights under both names (named_parameters drops duplicates).
        params = self.model.state_dict(keep_vars=True)
        errors = []
        for name, t in tensors.items():
            if name not in params:
                errors.append(f"unknown parameter {name!r}")
            elif tuple(params[name].shape) != tuple(t.shape):
                errors.append(f"{name}: shape {tuple(t.shape)} != model's {tuple(params[name].shape)}")
        if errors:
            raise EngineBadRequest("; ".join(errors[:10]))
        for name, t in tensors.items():
            params[name].data.copy_(t.to(device=params[name].device, dtype=params[name].dtype))

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None, abort_all: bool, flush: bool = True
    ) -> None:
        from transformers import AutoModelForCausalLM

        path = Path(model_path)
        if not await asyncio.to_thread(path.is_dir):
            raise EngineBadRequest(f"model_path {model_path!r} is not a directory")

        def load() -> dict[str, torch.Tensor]:
            new = AutoModelForCausalLM.from_pretrained(str(path), dtype=self.dtype)
            return {k: v for k, v in new.state_dict().items()}

        # Read the checkpoint before taking the lock: generation continues while the disk is read.
        try:
            tensors = await asyncio.to_thread(load)
        except (OSError, ValueError) as err:
            raise EngineBadRequest(f"cannot load weights from {model_path!r}: {err}") from None
        self._validate(tensors)
        await self._update(lambda: self._check_and_copy(tensors), abort_all, weight_version, flush)
        self.model_path = str(path)

    def _validate(self, tensors: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.state_dict())
        errors = [
            f"{n}: {('unknown' if n not in params else f'shape {tuple(t.shape)} != {tuple(params[n].shape)}')}"
            for n, t in tensors.items()
            if n not in params or tuple(params[n].shape) != tuple(t.shape)
        ]
        if errors:
            raise EngineBadRequest("weights do not fit the served model: " + "; ".join(errors[:10]))

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        from agentrl.engine.dist import init_custom_process_group

        if group_name in self._groups:
            raise EngineBadRequest(f"weight update group {group_name!r} already exists")
        if backend == "nccl" and self.device.type != "cuda":
            raise EngineBadRequest("backend nccl needs the engine on cuda; use gloo on CPU")
        # The engine has one rank (tp_size 1): rank_offset + 0.
        pg = await asyncio.to_thread(
            init_custom_process_group,
            backend,
            f"tcp://{master_address}:{int(master_port)}",
            int(world_size),
            int(rank_offset),
            group_name,
        )
        self._groups[group_name] = (pg, backend)

    async def destroy_weights_update_group(self, group_name: str, timeout: float = 30.0) -> bool:
        """Leave the group (the trainer leaves its end at the same time); bounded, aborts past ``timeout``."""
        from agentrl.engine.dist import leave_process_group

        entry = self._groups.pop(group_name, None)
        if entry is None:
            raise EngineBadRequest(f"no weight update group {group_name!r}")
        return await leave_process_group(entry[0], timeout)

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
        from agentrl.engine.dist import parse_dtype

        if group_name not in self._groups:
            raise EngineBadRequest(
                f"no weight update group {group_name!r}; call /init_weights_update_group first"
            )
        if not (len(names) == len(dtypes) == len(shapes)):
            raise EngineBadRequest("names, dtypes and shapes must have the same length")
        pg, backend = self._groups[group_name]
        recv_device = self.device if backend == "nccl" else torch.device("cpu")
        try:
            specs = [
                (n, parse_dtype(d), [int(x) for x in s])
                for n, d, s in zip(names, dtypes, shapes, strict=True)
            ]
        except ValueError as err:
            raise EngineBadRequest(str(err)) from None

        def receive() -> dict[str, torch.Tensor]:
            import torch.distributed as dist

            out = {}
            for name, dt, shape in specs:
                t = torch.empty(shape, dtype=dt, device=recv_device)
                dist.broadcast(t, src=0, group=pg)
                out[name] = t
            return out

        # Receive first (the trainer is blocked in broadcast until we do), even if the names turn out to be
        # wrong: refusing before receiving would leave the trainer hanging in its collective.
        tensors = await asyncio.to_thread(receive)
        self._validate(tensors)
        await self._update(lambda: self._check_and_copy(tensors), abort_all, weight_version, flush)


def _filter_logits(x: torch.Tensor, params: list[RequestSampling]) -> torch.Tensor:
    """Per-row top-k, top-p and min-p on temperature-scaled logits (rows without a filter pass through)."""
    neg = torch.finfo(x.dtype).min
    dev = x.device
    top_k = torch.tensor([p.top_k if p.top_k > 0 else x.shape[-1] for p in params], device=dev)
    if bool((top_k < x.shape[-1]).any()):
        sorted_desc = torch.sort(x, dim=-1, descending=True).values
        kth = sorted_desc.gather(1, (top_k - 1).clamp(max=x.shape[-1] - 1).unsqueeze(-1))
        x = x.masked_fill(x < kth, neg)
    top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=torch.float32)
    if bool((top_p < 1.0).any()):
        sorted_asc, order = torch.sort(x, dim=-1)
        cum = torch.softmax(sorted_asc, dim=-1).cumsum(-1)
        remove = cum <= (1.0 - top_p).unsqueeze(-1)
        remove[:, -1] = False  # always keep the most likely token
        x = x.masked_fill(remove.scatter(1, order, remove), neg)
    min_p = torch.tensor([p.min_p for p in params], device=dev, dtype=torch.float32)
    if bool((min_p > 0).any()):
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < min_p.unsqueeze(-1) * probs.max(dim=-1, keepdim=True).values, neg)
    return x


__all__ = ["CBEngine", "EngineBadRequest", "EngineFailed", "GenerationRecord", "RequestSampling"]
