"""An engine's own account of a timed window: where its device time went, and what speculation did.

The embedded engine counts its busy seconds, steps and rows (and, speculating, its verify steps, drafted
and accepted tokens) in ``/get_server_info``; :func:`agentrl.metrics.engine_metrics` reads them. Read
before and after a window, these functions turn the difference into the figures the benches report. An
engine without these counters (SGLang) gets an empty account.
"""

from __future__ import annotations

from agentrl.metrics import ENGINE_COUNTERS, SPEC_COUNTERS


def speculation_account(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """A speculating engine's account of a round, from its counters before and after it (empty for an
    engine that does not speculate): verify steps and rows, the decode steps its gate chose not to
    speculate on, tokens drafted and accepted, accepted tokens per verified row and accepted over
    drafted."""
    if not all(f"engine/{k}" in after for k in SPEC_COUNTERS):
        return {}
    d = {k: after[f"engine/{k}"] - before.get(f"engine/{k}", 0.0) for k in SPEC_COUNTERS}
    return {
        "verify_steps": int(d["spec_verify_steps"]),
        "verify_rows": int(d["spec_verify_rows"]),
        "skipped_steps": int(d["spec_skipped_steps"]),
        "draft_tokens": int(d["spec_draft_tokens"]),
        "accepted_tokens": int(d["spec_accepted_tokens"]),
        "accepted_per_verify_row": round(d["spec_accepted_tokens"] / max(d["spec_verify_rows"], 1.0), 3),
        "acceptance_rate": round(d["spec_accepted_tokens"] / max(d["spec_draft_tokens"], 1.0), 3),
    }


def where_time_went(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """The embedded engine's account of a timed round of ``seconds``, from its counters as
    :func:`agentrl.metrics.engine_metrics` reads them before and after it: the share of the round its
    device was busy (in all, on decode steps, on prefill steps), its decode steps, rows a decode step,
    and the milliseconds a decode step took on the device against the round's wall time over its decode
    steps (prefill included; what the device was not busy for, it waited on the host: scheduling,
    sampling's host side, HTTP). A speculating engine adds its verify steps' busy share and
    :func:`speculation_account`. Empty for an engine without these counters (SGLang)."""
    keys = [f"engine/{k}" for k in ENGINE_COUNTERS]
    if not all(k in before and k in after for k in keys):
        return {}
    d = {k: after[f"engine/{k}"] - before[f"engine/{k}"] for k in ENGINE_COUNTERS}
    steps = max(d["decode_steps"], 1.0)
    return {
        "device_busy_frac": round(d["busy_s"] / seconds, 3),
        "decode_busy_frac": round(d["decode_busy_s"] / seconds, 3),
        "prefill_busy_frac": round(d["prefill_busy_s"] / seconds, 3),
        "decode_steps": int(d["decode_steps"]),
        "prefill_steps": int(d["prefill_steps"]),
        "rows_per_decode_step": round(d["decode_rows"] / steps, 1),
        "decode_device_ms_per_step": round(d["decode_busy_s"] / steps * 1e3, 3),
        "wall_ms_per_decode_step": round(seconds / steps * 1e3, 3),
        **(
            {"verify_busy_frac": round((after[vb] - before.get(vb, 0.0)) / seconds, 3)}
            if (vb := "engine/verify_busy_s") in after
            else {}
        ),
        **speculation_account(before, after),
    }
