"""The embedded engine's schedule: continuous batching of requests over a slot KV cache.

One asyncio task (:meth:`Scheduler.loop`) owns it. Between steps it applies aborts and retractions, admits
waiting requests into free slots (copying the longest cached prefix of their tokens,
:mod:`.prefix_cache`), and picks the next step: a **prefill** of the requests that still have tokens to
run (chunked by a token budget), or else a **decode** of every running request (:mod:`.runner`); with
speculation on, a decode step is a **verify** step wherever a request has a draft (:mod:`.verify_steps`). The
step itself runs on the engine's device thread, so HTTP keeps being served; it samples on the device
(:mod:`.sampling`) and hands back ids and logprobs with one host sync. A request leaves the schedule when
it finishes (stop id, stop string, length), is aborted, or is retracted (its KV goes to the prefix cache);
its slot is then filled by the last running request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from agentrl.embedded.prefix_cache import PrefixCache
from agentrl.embedded.request import EngineFailed, EngineRequest
from agentrl.embedded.runner import ExtendBatch, ModelRunner
from agentrl.embedded.sampling import sample_tokens
from agentrl.embedded.speculative import SpeculationGate, SpeculativeConfig, make_drafter
from agentrl.embedded.verify_steps import VerifySteps

log = logging.getLogger("agentrl.engine")

# (kind, rows, batch, which rows sample) or, for a verify step, (kind, rows, batch, each row's draft)
Step = tuple[str, list[EngineRequest], ExtendBatch | None, list]


def prefill_takes(todo: list[int], budget: int, padded: bool) -> list[int]:
    """The next prefill step over rows with ``todo`` tokens left each, in order: how many tokens each of
    the leading rows it takes gets (a long row is chunked to ``budget``). The rows' own tokens stay within
    ``budget``; with ``padded`` also the rectangle the step computes (rows x the widest row) within
    :attr:`Scheduler.PADDED_CELLS` times it. The first row always goes."""
    takes: list[int] = []
    width = real = 0
    for n in todo:
        take = min(n, budget)
        if takes and (
            real + take > budget
            or (padded and (len(takes) + 1) * max(width, take) > Scheduler.PADDED_CELLS * budget)
        ):
            break
        width, real = max(width, take), real + take
        takes.append(take)
    return takes


class Scheduler(VerifySteps):
    """Waiting and running requests, the slot copies between steps, and the loop that runs the steps."""

    ADMIT_EVERY = 4  # decode steps between admissions while sequences are decoding, at least
    # A prefill step has a fixed cost (a forward's launches over every layer) that does not shrink with
    # its rows; admissions wait for as many decode steps as one prefill step costs, so that the prefills
    # take at most about half of the time while requests keep arriving one by one (agent turns).
    ADAPTIVE_ADMISSION = True
    PADDED_CELLS = 4  # a prefill step's rows x width, at most, in units of max_prefill_tokens
    # Decode steps the device thread runs back to back while nothing changes the schedule: each return to
    # the event loop between steps costs two thread hand-offs and the loop's own turn (about as long as a
    # small model's decode step on a GPU). The rows' tokens are the same for any value.
    DECODE_RUN = 8
    DRAFT_BACKOFF = 16  # plans between two proposals, at most, while proposals give no draft

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Any,
        on_device: Callable[..., asyncio.Future],
        max_batch_size: int,
        max_prefill_tokens: int,
        max_context: int,
        prefix_cache: PrefixCache | None,
        stats: dict[str, int],
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.on_device = on_device  # runs a function on the engine's one device thread
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.max_context = max_context
        self.prefix_cache = prefix_cache
        self.stats = stats
        self.speculative = speculative
        self.drafter = make_drafter(speculative) if speculative is not None else None
        self.gate = SpeculationGate(speculative.adaptive if speculative is not None else False)
        self.waiting: deque[EngineRequest] = deque()
        self.active: list[EngineRequest] = []  # index = slot
        self.epoch = 0
        self.step_lock = asyncio.Lock()  # held by a step; taken by weight updates and cache flushes
        self._running_step: tuple[str, float] | None = None  # (kind, start) of the step on the device
        self._retract = False
        self._since_prefill = 0
        self._draft_misses = 0  # proposals in a row that gave no row a draft
        self._draft_wait = 0  # decode steps left before the next proposal
        self._verified = 0  # tokens the last run of verify steps emitted (read by the gate)
        self._step_s = {
            "prefill": 0.0,
            "decode": 0.0,
            "verify": 0.0,
        }  # running means of each step kind's duration
        self._pieces: dict[int, str] = {}  # token id -> its text alone (stop-string screening)
        # slot copies (src, dst, n, start) decided since the last step, run before the next one
        self._copies: list[tuple[int, int, int, int]] = []
        self._work = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.fatal: BaseException | None = None

    # ------------------------------------------------------------------ control (event loop)
    @property
    def healthy(self) -> bool:
        return self.fatal is None and (self._task is None or not self._task.done())

    @property
    def in_flight(self) -> int:
        """Requests inside the schedule: running or waiting for a slot."""
        return len(self.active) + len(self.waiting)

    def wake(self) -> None:
        """Something changed (an abort flag): look again before the next step."""
        self._work.set()

    def retract_all(self) -> int:
        """Take every request out at the next step, keeping its tokens; returns how many are inside."""
        inside = self.in_flight
        self._retract = True
        self._work.set()
        return inside

    def flush_prefix_cache(self) -> None:
        """Forget every cached prefix and any drafter state: both were made with the weights that go."""
        self.epoch += 1
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        if self.drafter is not None:
            self.drafter.reset()

    def drop_slot_copies(self) -> None:
        """Forget the slot copies queued for the next step (the KV cache they would copy was released)."""
        self._copies.clear()

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def run(self, req: EngineRequest) -> None:
        """One stay of ``req`` in the engine: until it finishes, is aborted or is retracted."""
        if req.abort:
            req.finish = {"type": "abort", "message": "aborted"}
            return
        if self._task is None:
            self._task = asyncio.create_task(self.loop(), name="agentrl-engine-loop")
        req.outcome = asyncio.get_running_loop().create_future()
        req.prefilling = True
        self.waiting.append(req)
        self._work.set()
        try:
            await req.outcome
        finally:
            # Our caller was cancelled (client gone), which cancels the future it awaited: take the request
            # out at the next step instead of generating on for nobody.
            if not req.outcome.done() or req.outcome.cancelled():
                req.abort = True
                self._work.set()
        err = req.outcome.result()
        if err is not None:
            raise EngineFailed(f"generation failed: {err}")

    # ------------------------------------------------------------------ the schedule (event loop)
    async def loop(self) -> None:
        try:
            while True:
                await self._work.wait()
                self._control()
                step = self._plan()
                if step is None:
                    self._work.clear()
                    continue
                try:
                    async with self.step_lock:
                        t_step = time.perf_counter()
                        self._running_step = (step[0], t_step)
                        try:
                            ids, lps, steps = await self.on_device(self._execute, *step)
                        finally:
                            self._running_step = None
                        # device busy time: what an idle fraction of the engine itself is measured against,
                        # in all and per step kind (prefill / decode), to show where an engine's time goes
                        took = time.perf_counter() - t_step
                        mean, each = self._step_s[step[0]], took / steps
                        self._step_s[step[0]] = each if mean == 0.0 else 0.9 * mean + 0.1 * each
                        self.stats["busy_s"] = self.stats.get("busy_s", 0.0) + took
                        self.stats[f"{step[0]}_busy_s"] = self.stats.get(f"{step[0]}_busy_s", 0.0) + took
                        self._since_prefill += steps - 1 if step[0] != "prefill" else 0
                        if step[0] in ("decode", "verify"):  # tokens emitted: every row's, every step
                            emitted = self._verified if step[0] == "verify" else len(ids) * steps
                            self.gate.ran(step[0], emitted, steps, took)
                except Exception as err:  # one bad step fails its requests, not the engine
                    log.exception("engine step failed")
                    self._fail(step[1], err)
                    continue
                self._commit(step, (ids, lps))
        except asyncio.CancelledError:
            raise
        except BaseException as err:  # a bug in the schedule: fail everything, report unhealthy
            log.exception("the generation loop died")
            self.fatal = err
            self._fail(list(self.active) + list(self.waiting), err)
            raise

    def busy_so_far(self) -> dict[str, float]:
        """The device busy seconds, in all and of each step kind, up to now: the finished steps' and the
        running step's time so far. Two reads then bound the engine's busy time between them, however
        long a step that spans one of them runs."""
        out = {k: v for k, v in self.stats.items() if k.endswith("busy_s")}
        if self._running_step is not None:
            kind, started = self._running_step
            elapsed = time.perf_counter() - started
            out["busy_s"] = out.get("busy_s", 0.0) + elapsed
            out[f"{kind}_busy_s"] = out.get(f"{kind}_busy_s", 0.0) + elapsed
        return out

    def _control(self) -> None:
        """Apply aborts and a pending retraction between steps."""
        if self._retract:
            self._retract = False
            for r in list(self.waiting):
                self._leave(r, None)
            self.waiting.clear()
            for r in sorted(self.active, key=lambda r: -r.slot):
                self._leave(r, None)
        if any(r.abort for r in self.waiting):
            keep = deque()
            for r in self.waiting:
                if r.abort:
                    self._leave(r, {"type": "abort", "message": "aborted"})
                else:
                    keep.append(r)
            self.waiting = keep
        for r in sorted((r for r in self.active if r.abort), key=lambda r: -r.slot):
            self._leave(r, {"type": "abort", "message": "aborted"})

    def _admit(self) -> None:
        while self.waiting and len(self.active) < self.max_batch_size:
            r = self.waiting.popleft()
            r.slot, r.cached, r.epoch = len(self.active), 0, self.epoch
            self.active.append(r)
            self.stats["prompt_tokens"] += len(r.seq)
            if self.prefix_cache is not None:
                src, n = self.prefix_cache.lookup(r.seq, len(r.seq) - 1)
                if src is not None:
                    self._copies.append((src, r.slot, n, 0))
                    r.cached = n
                    if not r.output_ids:
                        r.cached_tokens = n
                    self.stats["cached_tokens"] += n

    def _plan(self) -> Step | None:
        """The next step: ("prefill", rows, ExtendBatch, sampling) or ("decode", rows, None, sampling), with
        ``sampling`` the indices of the rows that get a token (a prefill row only once its prompt is all in);
        None if idle.

        Requests that arrive one by one while others decode are gathered for a few decode steps
        (``ADMIT_EVERY``) and prefilled together: every prefill step stalls all decoding rows once."""
        if self.waiting and (
            not any(not r.prefilling for r in self.active)
            or self._since_prefill >= self._admit_every()
            or len(self.waiting) >= self.max_batch_size - len(self.active)
            or sum(len(r.seq) for r in self.waiting) >= self.max_prefill_tokens // 2
        ):
            self._admit()
        rows = [r for r in self.active if r.prefilling]
        if rows:
            # The budget counts the rows' own tokens; the padded rectangle the step computes (rows x the
            # widest row) may reach PADDED_CELLS times it. Counting the rectangle against the budget
            # itself let one long row (an agent's whole history after a cache flush) keep a step to a few
            # rows, and a wave of such rows took one prefill step, with its fixed cost, per few rows.
            takes = prefill_takes(
                [len(r.seq) - r.cached for r in rows],
                self.max_prefill_tokens,
                padded=not self.runner.packed_prefill,  # packed steps compute no padding
            )
            picked = rows[: len(takes)]
            tokens = [r.seq[r.cached : r.cached + take] for r, take in zip(picked, takes, strict=True)]
            start = [r.cached for r in picked]
            self._since_prefill = 0
            done = [i for i, r in enumerate(picked) if r.cached + len(tokens[i]) == len(r.seq)]
            return "prefill", picked, ExtendBatch([r.slot for r in picked], tokens, start), done
        if self.active:
            self._since_prefill += 1
            drafts = self._drafts(self.active) if self._speculates() else None
            if drafts is not None:
                tokens = [[r.seq[-1], *d] for r, d in zip(self.active, drafts, strict=True)]
                batch = ExtendBatch(
                    [r.slot for r in self.active], tokens, [len(r.seq) - 1 for r in self.active]
                )
                return "verify", list(self.active), batch, drafts
            return "decode", list(self.active), None, list(range(len(self.active)))
        return None

    def _admit_every(self) -> int:
        """Decode steps to gather arriving requests for before a prefill step stalls the decoding rows:
        ``ADMIT_EVERY``, or as many decode steps as one prefill step takes (measured), if more."""
        prefill, decode = self._step_s["prefill"], self._step_s["decode"]
        if not self.ADAPTIVE_ADMISSION or prefill == 0.0 or decode == 0.0:
            return self.ADMIT_EVERY
        return max(self.ADMIT_EVERY, min(64, round(prefill / decode)))

    def _execute(self, kind: str, rows: list[EngineRequest], batch: ExtendBatch | None, done: list[int]):
        """Device thread: the slot copies queued since the last step (prefix hits, cache inserts,
        compaction, in the order they were decided), then one forward + sampling, or a run of decode steps
        (:meth:`_decode_run`). Returns (ids, logprobs) of the rows that sample at the last step, and the
        number of steps taken."""
        copies, self._copies = self._copies, []
        self.stats["slot_copies"] = self.stats.get("slot_copies", 0) + len(copies)
        self.runner.copy_slots(copies)
        if kind == "decode":
            return self._decode_run(rows)
        if kind == "verify":
            return self._verify(rows, batch, done)
        logits = self.runner.extend(batch)
        if not done:
            return [], [], 1
        logits = logits[done] if len(done) < len(rows) else logits
        return (*self._sample(logits, [rows[i] for i in done]), 1)

    def _sample(self, logits: torch.Tensor, rows: list[EngineRequest]) -> tuple[list[int], list[float]]:
        return self._sample_at(logits, rows, [len(r.seq) for r in rows])

    def _sample_at(
        self, logits: torch.Tensor, rows: list[EngineRequest], positions: list[int]
    ) -> tuple[list[int], list[float]]:
        """Sample logits row ``i`` as ``rows[i]`` samples position ``positions[i]``. Batch-invariant mode
        samples at most ``max_batch`` rows at once, the shapes every decode step samples with."""
        invariant = self.runner.max_batch if self.runner.batch_invariant else None
        chunk = invariant or len(rows)
        ids: list[int] = []
        lps: list[float] = []
        with torch.inference_mode():
            for a in range(0, len(rows), chunk):
                i, lp = sample_tokens(
                    logits[a : a + chunk],
                    [r.sampling for r in rows[a : a + chunk]],
                    [r.seed for r in rows[a : a + chunk]],
                    positions[a : a + chunk],
                    invariant_rows=invariant,
                )
                ids += i
                lps += lp
        return ids, lps

    def _decode_run(self, rows: list[EngineRequest]) -> tuple[list[int], list[float], int]:
        """Device thread: decode steps of ``rows`` back to back, up to :attr:`DECODE_RUN` of them, for as
        long as the schedule would plan the same step again: no row finishes (:meth:`_finish_of`, which
        :meth:`_append` asks too), nothing is aborted or retracted, no admission is due. The tokens of every
        step but the last are taken here; the last step's go to :meth:`_commit` on the event loop, which
        finishes rows and answers their callers. Returns the last step's ids and logprobs and the number of
        steps."""
        limit = self.DECODE_RUN if not any(r.on_token is not None for r in rows) else 1
        steps = 0
        while True:
            logits = self.runner.decode([r.seq[-1] for r in rows], [len(r.seq) - 1 for r in rows])
            ids, lps = self._sample(logits, rows)
            steps += 1
            if steps >= limit or self._decode_run_ends(rows, ids, steps):
                return ids, lps, steps
            for r, t, lp in zip(rows, ids, lps, strict=True):
                r.seq.append(t)
                r.output_ids.append(t)
                r.logprobs.append(lp)
                r.cached += 1
            self.stats["decode_steps"] += 1
            self.stats["decode_rows"] = self.stats.get("decode_rows", 0) + len(rows)

    def _decode_run_ends(self, rows: list[EngineRequest], ids: list[int], steps: int) -> bool:
        """Whether the decode step just sampled must go back to the event loop: :meth:`_run_yields`, or
        a row finishes with its token."""
        if self._run_yields(rows, steps):
            return True
        return any(self._finish_of(r, t) is not None for r, t in zip(rows, ids, strict=True))

    def _run_yields(self, rows: list[EngineRequest], steps: int) -> bool:
        """Whether a run of steps must go back to the event loop after ``steps`` of them: a retraction or
        an abort, or an admission due (read from the device thread: the event loop only appends to
        ``waiting`` and sets flags meanwhile)."""
        if self._retract or any(r.abort for r in rows):
            return True
        waiting = len(self.waiting)  # what _plan would admit before the next step (its token count aside)
        return bool(waiting) and (
            self._since_prefill + steps - 1 >= self._admit_every()
            or waiting >= self.max_batch_size - len(rows)
        )

    def _commit(self, step: Step, result: tuple[list, list]) -> None:
        kind, rows, batch, done = step
        ids, lps = result
        if kind == "verify":
            self._commit_verify(rows, done, ids, lps)
            return
        if kind == "prefill":
            self.stats["prefill_steps"] = self.stats.get("prefill_steps", 0) + 1
            self.stats["prefill_rows"] = self.stats.get("prefill_rows", 0) + len(rows)
            for r, new in zip(rows, batch.tokens, strict=True):
                r.cached += len(new)
                self.stats["prefill_tokens"] += len(new)
        else:
            self.stats["decode_steps"] += 1
            self.stats["decode_rows"] = self.stats.get("decode_rows", 0) + len(rows)
            for r in rows:
                r.cached += 1
        sampled = [rows[i] for i in done]
        for r in sampled:
            r.prefilling = False
        finished = [r for r, t, lp in zip(sampled, ids, lps, strict=True) if self._append(r, t, lp)]
        for r in sorted(finished, key=lambda r: -r.slot):
            self._leave(r, r.finish)

    def _append(self, r: EngineRequest, token: int, logprob: float) -> bool:
        """Take one sampled token; True once the request is finished."""
        finish = self._finish_of(r, token)
        r.seq.append(token)
        r.output_ids.append(token)
        r.logprobs.append(logprob)
        if r.on_token is not None:
            r.on_token(token, logprob)
        if finish is not None:
            r.finish = finish
        return r.finish is not None

    def _finish_of(self, r: EngineRequest, token: int, before: Sequence[int] = ()) -> dict[str, Any] | None:
        """How taking ``token`` would finish ``r`` (a stop id, a stop string, the length), or None, after
        the tokens ``before`` it were taken; nothing changes (the device thread asks it during decode and
        verify runs, :meth:`_append` when it takes the token)."""
        s = r.sampling
        if token in r.stop_ids:
            return {"type": "stop", "matched": token}
        if s.stop and self._may_stop(token, s.stop):
            matched = self._match_stop([*r.output_ids, *before, token], s.stop)
            if matched is not None:
                return {"type": "stop", "matched": matched}
        taken = len(before) + 1
        if len(r.output_ids) + taken >= s.max_new_tokens or len(r.seq) + taken >= self.max_context:
            return {"type": "length", "length": s.max_new_tokens}
        return None

    def _may_stop(self, token: int, stops: list[str]) -> bool:
        """False when ``token`` cannot have completed a stop string: the text it adds holds no stop string's
        last character. Checked per sampled token, so the tail is decoded only for the few tokens that
        can end a stop (a decode step of 100+ rows with stop strings otherwise spends milliseconds in the
        tokenizer). Tokens whose text alone is empty or a partial character are always checked."""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        if not piece or "\ufffd" in piece:
            return True
        return any(x[-1] in piece for x in stops if x)

    def _match_stop(self, ids: list[int], stops: list[str]) -> str | None:
        # Only the tail can hold a stop string that the newest token completed; a generous token window
        # covers byte-level tokens that are a fraction of a character.
        window = max(len(x.encode()) for x in stops) + 2
        tail = self.tokenizer.decode(ids[-window:], skip_special_tokens=False)
        for x in stops:
            if x in tail:
                return x
        return None

    def _leave(
        self, r: EngineRequest, finish: dict[str, Any] | None, error: BaseException | None = None
    ) -> None:
        """Take ``r`` out of the engine (finished, aborted, or retracted when ``finish`` is None): keep its
        KV in the prefix cache, free its slot (the last running request moves into it) and wake its caller."""
        if finish is not None:
            r.finish = finish
        if r.slot >= 0 and finish is not None and self.runner.routed is not None:
            # MoE: the experts every input position went to (the slot's copies run only at the next step)
            r.routed_experts = self.runner.routed_experts(r.slot, len(r.seq) - 1)
        if r.slot >= 0:  # running (a waiting request has no slot yet)
            pc = self.prefix_cache
            if pc is not None and r.epoch == self.epoch and r.cached >= pc.block:
                dst, have = pc.insert(r.seq[: r.cached])
                if dst is not None:
                    self._copies.append((r.slot, dst, r.cached, have))
            last = self.active.pop()
            if last is not r:
                self._copies.append((last.slot, r.slot, last.cached, 0))
                last.slot = r.slot
                self.active[r.slot] = last
            r.slot = -1
        if r.outcome is not None and not r.outcome.done():
            r.outcome.set_result(error)

    def _fail(self, rows: list[EngineRequest], err: BaseException) -> None:
        """Take ``rows`` out with an error (answered 500); their KV may be half-written, so it is not
        cached."""
        for r in sorted(rows, key=lambda r: -r.slot):
            r.epoch = -1
            if r in self.waiting:
                self.waiting.remove(r)
            self._leave(r, None, error=err)


__all__ = ["Scheduler", "prefill_takes"]
