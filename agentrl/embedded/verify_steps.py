"""Speculative steps of the embedded engine's schedule: drafts proposed, verified, and their tokens taken.

With speculation on (:mod:`.speculative`), the schedule's decode step is a **verify** step wherever a
request has a draft: one forward over every row's last token and draft, which emits each row's accepted
drafted tokens and one sample after them. :class:`VerifySteps` is that part of the
:class:`~.scheduler.Scheduler`: whether the next step speculates (the gate) and with which drafts (the
drafter, with its back-off where drafts never come), runs of verify steps back to back on the device
thread (as decode steps run, so the event loop is not crossed at every step), and taking the emitted
tokens in order, as decode steps would, up to the one that finishes a request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from agentrl.embedded.request import EngineRequest
from agentrl.embedded.runner import ExtendBatch
from agentrl.embedded.speculative import accepted_exact, rejection_verify

if TYPE_CHECKING:
    from agentrl.embedded.runner import ModelRunner
    from agentrl.embedded.speculative import Drafter, SpeculationGate, SpeculativeConfig


class VerifySteps:
    """The speculative part of :class:`~.scheduler.Scheduler` (a mixin: the attributes below are the
    scheduler's)."""

    DECODE_RUN: int
    DRAFT_BACKOFF: int
    runner: ModelRunner
    stats: dict[str, Any]
    speculative: SpeculativeConfig | None
    drafter: Drafter | None
    gate: SpeculationGate
    max_context: int
    _draft_wait: int
    _draft_misses: int
    _verified: int

    def _speculates(self) -> bool:
        """Whether the next decode step verifies drafts (:class:`.speculative.SpeculationGate`)."""
        if self.drafter is None:
            return False
        if self.gate.speculate():
            return True
        self.stats["spec_skipped_steps"] = self.stats.get("spec_skipped_steps", 0) + 1
        return False

    def _drafts(self, rows: list[EngineRequest]) -> list[list[int]] | None:
        """Each row's draft, or None when no row has one (a plain decode step, with its graphs, then).
        A draft never reaches past the request's max_new_tokens or the KV slot: the step emits at most
        one token more than it holds. With the adaptive gate, proposals that give no row a draft back
        off: the drafter is skipped the next 1, 3, 7, then 15 times a decode step is planned (its search
        costs host time at every step, drafts or not), until a proposal gives a draft."""
        if self._draft_wait > 0:
            self._draft_wait -= 1
            return None
        k = self.speculative.num_draft_tokens
        if self.runner.verify_buckets:
            # within the largest verify graph: an eager verify step costs as much as several graphed ones
            k = min(k, self.runner.verify_buckets[-1] // len(rows) - 1)
        budgets = [
            max(
                0,
                min(k, r.sampling.max_new_tokens - len(r.output_ids) - 1, self.max_context - len(r.seq) - 1),
            )
            for r in rows
        ]
        drafts = self.drafter.propose([r.seq for r in rows], budgets)
        self.stats["spec_shared_drafts"] = getattr(self.drafter, "shared_drafts", 0)
        if any(drafts):
            self._draft_misses = 0
            return drafts
        if self.speculative.adaptive:  # where drafts never come (random text), stop paying for the search
            self._draft_misses += 1
            self._draft_wait = min(2**self._draft_misses, self.DRAFT_BACKOFF) - 1
        return None

    def _verify(
        self, rows: list[EngineRequest], batch: ExtendBatch, drafts: list[list[int]]
    ) -> tuple[list[list[int]], list[list[float]], int]:
        """Device thread: verify steps of ``rows`` back to back, up to :attr:`DECODE_RUN` of them, as
        :meth:`_decode_run` runs decode steps: while no row can finish, nothing is aborted or retracted, no
        admission is due, and the next proposal gives a draft. The tokens of every step but the last are
        taken here (:meth:`_take_verified`), the next drafts proposed here, and ``drafts`` is updated in
        place to the last step's, which :meth:`_commit_verify` counts with that step's tokens on the event
        loop; a run that stops after taking its last step's tokens (no draft for the next) returns no
        tokens. Returns (ids, logprobs, steps), a list of tokens per row; :attr:`_verified` is every token
        the run emitted."""
        limit = self.DECODE_RUN if not any(r.on_token is not None for r in rows) else 1
        steps = self._verified = 0
        while True:
            ids, lps = self._verify_step(rows, batch, drafts)
            steps += 1
            self._verified += sum(map(len, ids))
            if steps >= limit or self._run_yields(rows, steps) or self._verified_may_finish(rows, ids):
                return ids, lps, steps
            self._take_verified(rows, drafts, ids, lps)
            nxt = self._drafts(rows) if self.gate.speculate() else None
            if nxt is None:
                return [[] for _ in rows], [[] for _ in rows], steps
            drafts[:] = nxt
            tokens = [[r.seq[-1], *d] for r, d in zip(rows, nxt, strict=True)]
            batch = ExtendBatch([r.slot for r in rows], tokens, [len(r.seq) - 1 for r in rows])

    def _verify_step(
        self, rows: list[EngineRequest], batch: ExtendBatch, drafts: list[list[int]]
    ) -> tuple[list[list[int]], list[list[float]]]:
        """One forward over every row's last token and draft, then each row's emitted tokens and logprobs
        (:mod:`.speculative`): the accepted drafted tokens and one sample after them. The KV written past
        them is never read (a query reads keys up to its own position) and is overwritten as the row goes
        on."""
        logits = self.runner.extend(batch, every_token=True)
        flat = [r for r, toks in zip(rows, batch.tokens, strict=True) for _ in toks]
        positions = [
            len(r.seq) + i for r, toks in zip(rows, batch.tokens, strict=True) for i in range(len(toks))
        ]
        ids, lps = self._sample_at(logits, flat, positions)
        out_ids: list[list[int]] = []
        out_lps: list[list[float]] = []
        at = 0
        for r, d in zip(rows, drafts, strict=True):
            m = len(d) + 1
            if self.speculative.acceptance == "rejection" and d:
                toks = rejection_verify(logits[at : at + m], r.sampling, r.seed, len(r.seq), d)
                out_ids.append(toks)
                out_lps.append(self._raw_logprobs(logits[at : at + len(toks)], toks))
            else:
                n = accepted_exact(ids[at : at + m], d)
                out_ids.append(ids[at : at + n])
                out_lps.append(lps[at : at + n])
            at += m
        return out_ids, out_lps

    def _verified_may_finish(self, rows: list[EngineRequest], ids: list[list[int]]) -> bool:
        """Whether taking a verify step's tokens finishes a row: :meth:`_finish_of` of each token after
        the ones before it."""
        return any(
            self._finish_of(r, t, toks[:i]) is not None
            for r, toks in zip(rows, ids, strict=True)
            for i, t in enumerate(toks)
        )

    def _raw_logprobs(self, logits: torch.Tensor, tokens: list[int]) -> list[float]:
        """log_softmax of the raw logits at ``tokens`` (one per row), as :func:`sample_tokens` gives them."""
        with torch.inference_mode():
            ids = torch.tensor(tokens, device=logits.device)
            if self.runner.batch_invariant:
                from agentrl.batch_invariant import token_logprobs

                return token_logprobs(logits, ids).double().tolist()
            picked = logits.gather(1, ids[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
            return picked.double().tolist()

    def _commit_verify(
        self, rows: list[EngineRequest], drafts: list[list[int]], ids: list[list[int]], lps: list[list[float]]
    ) -> None:
        """Take each row's emitted tokens in order, as decode steps would, up to the one that finishes it;
        count the drafted and accepted tokens. No tokens: the run took its last step's itself."""
        if not any(ids):
            return
        finished = self._take_verified(rows, drafts, ids, lps)
        for r in sorted(finished, key=lambda r: -r.slot):
            self._leave(r, r.finish)

    def _take_verified(
        self, rows: list[EngineRequest], drafts: list[list[int]], ids: list[list[int]], lps: list[list[float]]
    ) -> list[EngineRequest]:
        """Append one verify step's tokens to its rows (each up to the token that finishes it) and count
        the step, its drafted and its accepted tokens; the rows it finished."""
        st = self.stats
        st["spec_verify_steps"] = st.get("spec_verify_steps", 0) + 1
        st["spec_verify_rows"] = st.get("spec_verify_rows", 0) + len(rows)
        st["spec_draft_tokens"] = st.get("spec_draft_tokens", 0) + sum(len(d) for d in drafts)
        finished = []
        for r, toks, row_lps in zip(rows, ids, lps, strict=True):
            st["spec_accepted_tokens"] = st.get("spec_accepted_tokens", 0) + len(toks) - 1
            for t, lp in zip(toks, row_lps, strict=True):
                r.cached += 1  # the token before it has its KV now
                st["spec_emitted_tokens"] = st.get("spec_emitted_tokens", 0) + 1
                if self._append(r, t, lp):
                    finished.append(r)
                    break
        return finished
