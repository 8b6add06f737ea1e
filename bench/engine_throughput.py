"""Throughput of the embedded engine (over HTTP, through EngineClient) against HF ``generate``.

For each concurrency C in ``--concurrency`` (default 1,16,64) it runs 2*C requests with at most C in
flight against ``python -m agentrl.embedded.server`` and reports generated tokens/s; then, in the same
run and on the same device, HF ``model.generate`` on batches of C prompts of the same length and the same
number of new tokens (sampling at temperature 1, EOS ignored). ``--multi-turn K`` adds agent-like
episodes: ``--concurrency``'s largest C episodes at once, each K turns whose prompt is the previous
prompt + output + ``--obs-len`` new tokens, and reports prefill tokens computed against submitted (what
prefix reuse saves). Each round of the embedded engine carries the engine's own account of it
(``engine_time``: the share its device was busy, rows and device milliseconds a decode step against the
round's wall time per step). Prints ONE JSON line.

CPU (default): the tiny test model. GPU: ``--device cuda --shape qwen2.5-0.5b --dtype bfloat16`` builds a
randomly initialised model with Qwen2.5-0.5B's exact shape (151,936 vocab, 24 layers, hidden 896);
``--shape qwen3-moe-1b`` a 1B Qwen3-MoE shape (16 experts, top-2); ``--shape qwen2.5-7b`` Qwen2.5-7B's
exact shape (152,064 vocab, 28 layers, hidden 3584, untied LM head), its random weights made in
``--dtype`` on ``--device`` (no float32 copy, no host-side init pass) and saved as safetensors shards.
``--server-args "--no-cuda-graphs"`` (etc.) passes flags to the server, to measure one lever at a time.
``--deterministic`` serves the same rounds a second time with ``--batch-invariant`` (what deterministic
and true on-policy runs use) and reports its tokens/s beside the default's, and their ratio. With
``--rounds N`` (N > 1) both servers stay up side by side (each KV cache at ``--mem-fraction 0.4`` on a GPU
unless ``--server-args`` sets one) and each round serves every concurrency on the default server, then on
the batch-invariant one: the tokens/s are medians over the rounds and the ratio is the median of the
rounds' paired ratios, so a drift of the host's load reaches both modes alike.

``--backends embedded,sglang`` (or ``--backend sglang``, the same A/B) serves the same rounds (and the
multi-turn episodes) on a real SGLang server too, one engine after the other on the same device, and
reports both side by side with SGLang's own account of its configuration (``/get_server_info``: version,
attention and sampling backends, CUDA graphs). SGLang gets ``--mem-fraction-static`` from
``--sglang-mem-fraction``, ``--cuda-graph-max-bs`` from the largest concurrency and token ids only
(``--skip-tokenizer-init``); ``--sglang-args '{"attention-backend": "fa3"}'`` passes more flags (JSON).
Multi-turn prefill accounting comes from each answer's ``meta_info`` (``prompt_tokens - cached_tokens``),
which both engines report.

``--quantizations none,fp8`` serves the same rounds (and the multi-turn episodes) on the embedded engine
unquantized and then with ``--quantization fp8`` (:mod:`agentrl.embedded.fp8`), one server after the
other on the same device, and reports per concurrency ``fp8_tok_s`` beside ``engine_tok_s`` and
``ratio_fp8_over_unquantized``. Under ``"fp8"`` it reports the quantization seconds the fp8 server
measured (``quantize_s`` of its ``/get_server_info``): ``quantize_load_s`` at start (the runner's whole
construction, the KV cache's allocation included) and ``quantize_update_s`` after one weight update, which
the bench makes by pushing the same checkpoint again through ``/update_weights_from_disk`` once the rounds
are done (``update_wall_s``: that whole update, the checkpoint's read from disk included). The fp8 server
keeps the bf16 weights beside their fp8 copies, so its KV cache may be planned smaller: its
``context_len`` and ``prefix_cache_slots`` are reported too.

``--split`` times prefill and decode apart at each concurrency: before the round, a round of the same
prompts with one new token each (``prefill_s``: the 2*C prompts prefilled, C at a time); the round itself
then finds the prompts cached, so its seconds over its 2 x ``--max-new-tokens`` decode steps are
``decode_step_ms`` (the C requests of a wave finish together, EOS ignored). Reported per engine
(``engine_split``, ``sglang_split``).

``--speculative`` serves the same rounds (and the multi-turn episodes) on the embedded engine without
and then with speculative decoding (``--spec-args``, default ``--speculative ngram --spec-k 4
--spec-ngram 3``: :mod:`agentrl.embedded.speculative`), one server after the other on the same device,
and reports per concurrency ``spec_tok_s`` beside ``engine_tok_s``, ``ratio_spec_over_plain`` and the
speculating server's account (``spec_time``): its verify steps, the rows they verified, the tokens
drafted and accepted, ``accepted_per_verify_row`` (tokens a request gains per verify step beyond the one
a decode step gives) and ``acceptance_rate`` (accepted over drafted).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from agentrl.embedded.launch import start_embedded_server
from agentrl.engine.account import speculation_account, where_time_went
from agentrl.engine.client import EngineClient
from agentrl.engine.types import SamplingParams
from agentrl.metrics import engine_metrics
from agentrl.models.random_weights import build_shape_model, parameter_counts
from agentrl.models.tiny import FULL_SHAPES

SHAPES = ("tiny", *FULL_SHAPES)


def build_model(shape: str, dtype: str, out: Path, device: str = "cpu") -> Path:
    """A model directory: the tiny test model, or a random model of a full-size shape (made on
    ``device``): :func:`agentrl.models.random_weights.build_shape_model`."""
    if shape not in SHAPES:
        raise SystemExit(f"unknown --shape {shape!r}")
    return build_shape_model(shape, out, dtype, device)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 600), (n, length), generator=g).tolist()


async def engine_round(
    url: str, conc: int, prompt_len: int, new_tokens: int, vocab: int, account: dict[str, float] | None = None
) -> tuple[int, float]:
    """2*C requests with C in flight, after a warm-up: (tokens generated, seconds). ``account``, when
    given, is filled with the engine's own account of the timed round (:func:`where_time_went`)."""
    sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
    sem = asyncio.Semaphore(conc)
    async with EngineClient(url, timeout=3600) as client:

        async def one(p: list[int]) -> int:
            async with sem:
                return len((await client.generate(p, sp)).output_ids)

        # warm-up: the round's prefill shapes (C prompts at once) and a few decode steps, so that no kernel
        # compiles inside the timed round
        short = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
        await asyncio.gather(*(client.generate(p, short) for p in prompts(conc, prompt_len, vocab, seed=1)))
        batch = prompts(2 * conc, prompt_len, vocab, seed=conc)
        before = await engine_metrics(client) if account is not None else {}
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in batch))
        seconds = time.perf_counter() - t0
        if account is not None:
            account.update(where_time_went(before, await engine_metrics(client), seconds))
        return sum(counts), seconds


async def multi_turn_round(
    url: str, episodes: int, turns: int, prompt_len: int, obs_len: int, new_tokens: int, vocab: int
) -> dict[str, float]:
    """``episodes`` agent episodes at once, ``turns`` turns each (each turn's prompt is the previous one +
    its output + ``obs_len`` new tokens, so every turn after the first can reuse a cached prefix); returns
    tokens/s and prefill accounting (tokens submitted, and computed: submitted less the cached tokens each
    answer reports), and a speculating engine's :func:`speculation_account` of the episodes."""
    sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
    async with EngineClient(url, timeout=3600) as client:
        before = await engine_metrics(client)

        async def episode(e: int) -> tuple[int, int, int]:
            seq = prompts(1, prompt_len, vocab, seed=10_000 + e)[0]
            made = submitted = cached = 0
            for t in range(turns):
                if t:
                    seq = seq + prompts(1, obs_len, vocab, seed=20_000 + e * turns + t)[0]
                submitted += len(seq)
                out = await client.generate(seq, sp)
                cached += int(out.meta.get("cached_tokens", 0))
                seq = seq + out.output_ids
                made += len(out.output_ids)
            return made, submitted, cached

        t0 = time.perf_counter()
        done = await asyncio.gather(*(episode(e) for e in range(episodes)))
        wall = time.perf_counter() - t0
        spec = speculation_account(before, await engine_metrics(client))
    submitted = sum(s for _, s, _ in done)
    computed = submitted - sum(c for _, _, c in done)
    return {
        "episodes": episodes,
        "turns": turns,
        "obs_len": obs_len,
        "engine_tok_s": round(sum(m for m, _, _ in done) / wall, 1),
        "prefill_tokens_submitted": submitted,
        "prefill_tokens_computed": computed,
        "computed_over_submitted": round(computed / submitted, 3) if submitted else None,
        **({"spec": spec} if spec else {}),
    }


async def update_round(url: str, model_dir: Path) -> dict[str, float]:
    """Push the served checkpoint again (``/update_weights_from_disk``, nothing in flight): the update's
    wall seconds and the seconds the server reports its re-quantization took (``quantize_s``)."""
    async with EngineClient(url, timeout=3600) as client:
        t0 = time.perf_counter()
        await client.update_weights_from_disk(str(model_dir), weight_version="bench-update")
        wall = time.perf_counter() - t0
        info = (await client.server_info())[0]
    return {"update_wall_s": round(wall, 3), "quantize_update_s": round(float(info["quantize_s"]), 6)}


def launch(a: argparse.Namespace, model_dir: Path, log_file: Path, max_batch: int, extra: list[str]) -> Any:
    """An embedded engine server for the bench: ``--server-args`` and then ``extra`` as its flags."""
    return start_embedded_server(
        model_dir,
        device=a.device,
        dtype=a.dtype,
        max_batch_size=max_batch,
        timeout=1800,
        log_file=log_file,
        extra_args=shlex.split(a.server_args) + extra,
    )


SGLANG_INFO = (
    "version",
    "attention_backend",
    "sampling_backend",
    "disable_cuda_graph",
    "cuda_graph_max_bs",
    "cuda_graph_max_bs_decode",
    "mem_fraction_static",
    "skip_tokenizer_init",
    "disable_radix_cache",
    "chunked_prefill_size",
    "max_running_requests",
    "enable_deterministic_inference",
    "dtype",
)


def launch_sglang(a: argparse.Namespace, model_dir: Path, log_file: Path, max_batch: int) -> Any:
    """A real SGLang server for the bench (token ids only, graphs up to the largest concurrency)."""
    from agentrl.engine.launcher import SGLangConfig, SGLangLauncher

    extra = {"cuda-graph-max-bs": max_batch, "dtype": a.dtype, **json.loads(a.sglang_args)}
    cfg = SGLangConfig(
        model_path=str(model_dir),
        port=0,
        mem_fraction_static=a.sglang_mem_fraction,
        skip_tokenizer_init=True,
        extra_args=extra,
        log_file=str(log_file),
        startup_timeout=1800,
    )
    return SGLangLauncher(cfg).start()


def interleaved(
    a: argparse.Namespace, model_dir: Path, tmp: Path, concs: list[int], vocab: int
) -> tuple[dict[int, tuple[int, float]], dict[int, tuple[int, float]], dict[int, list[float]], dict]:
    """``--rounds`` rounds of every concurrency on the default server, then on the batch-invariant one, both
    up side by side. Returns each mode's median round as (tokens, seconds), the paired ratios and the
    default server's info."""
    both: list[str] = []
    if a.device.startswith("cuda") and "--mem-fraction" not in shlex.split(a.server_args):
        both = ["--mem-fraction", "0.4"]  # two KV caches on one GPU
    servers = [
        launch(a, model_dir, tmp / f"server_{name}.log", max(concs), both + extra)
        for name, extra in (("default", []), ("batch_invariant", ["--batch-invariant"]))
    ]
    rates: list[dict[int, list[tuple[int, float]]]] = [{c: [] for c in concs}, {c: [] for c in concs}]
    try:
        for _ in range(a.rounds):
            for c in concs:
                for server, mine in zip(servers, rates, strict=True):
                    mine[c].append(
                        asyncio.run(engine_round(server.url, c, a.prompt_len, a.max_new_tokens, vocab))
                    )
        info = asyncio.run(_server_info(servers[0].url))
    finally:
        for server in servers:
            server.stop()

    def median_round(runs: list[tuple[int, float]]) -> tuple[int, float]:
        return sorted(runs, key=lambda r: r[0] / r[1])[len(runs) // 2]

    paired = {
        c: [(bt / bs) / (et / es) for (et, es), (bt, bs) in zip(rates[0][c], rates[1][c], strict=True)]
        for c in concs
    }
    return (
        {c: median_round(r) for c, r in rates[0].items()},
        {c: median_round(r) for c, r in rates[1].items()},
        paired,
        info,
    )


@torch.no_grad()
def hf_round(
    model, conc: int, prompt_len: int, new_tokens: int, vocab: int, device: str
) -> tuple[int, float]:
    def run(batch: list[list[int]]) -> int:
        ids = torch.tensor(batch, device=device)
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=True,
            temperature=1.0,
            top_k=None,
            top_p=None,
            pad_token_id=0,
        )
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]

    run(prompts(min(conc, 4), prompt_len, vocab, seed=1))  # warm-up
    batch = prompts(2 * conc, prompt_len, vocab, seed=conc)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    total = sum(run(batch[i : i + conc]) for i in range(0, len(batch), conc))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return total, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--shape", default="tiny", choices=SHAPES)
    p.add_argument("--model", default=None, help="use this HF model directory instead of building one")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--multi-turn", type=int, default=0, help="turns per agent episode (0: no multi-turn case)"
    )
    p.add_argument("--obs-len", type=int, default=200, help="multi-turn: new tokens per observation")
    p.add_argument("--server-args", default="", help="extra flags for the engine server (quoted)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF generate baseline")
    p.add_argument("--split", action="store_true", help="time prefill and a decode step apart")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="also serve the rounds with --batch-invariant and compare",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --deterministic: interleaved rounds of both servers (medians)",
    )
    p.add_argument(
        "--quantizations",
        default="none",
        help="none, or none,fp8: the embedded engine also serves the rounds with --quantization fp8",
    )
    p.add_argument(
        "--speculative",
        action="store_true",
        help="the embedded engine also serves the rounds with speculative decoding (--spec-args)",
    )
    p.add_argument(
        "--spec-args",
        default="--speculative ngram --spec-k 4 --spec-ngram 3",
        help="--speculative: the speculating server's flags (quoted)",
    )
    p.add_argument(
        "--backends", default="embedded", help="engines that serve the same workload: embedded,sglang"
    )
    p.add_argument("--backend", default=None, help="--backend sglang: the A/B, as --backends embedded,sglang")
    p.add_argument("--sglang-mem-fraction", type=float, default=0.7, help="SGLang's --mem-fraction-static")
    p.add_argument(
        "--sglang-args", default="{}", help='more SGLang flags, JSON: {"attention-backend": "fa3"}'
    )
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error("--rounds: must be at least 1")
    concs = [int(c) for c in a.concurrency.split(",")]
    backends = (
        ["embedded", a.backend] if a.backend else [b.strip() for b in a.backends.split(",") if b.strip()]
    )
    if not set(backends) <= {"embedded", "sglang"} or not backends:
        p.error(f"--backends: embedded and/or sglang, not {backends}")
    quantizations = [q.strip() for q in a.quantizations.split(",") if q.strip()]
    if quantizations not in (["none"], ["none", "fp8"]):
        p.error(f"--quantizations: none, or none,fp8 (the A/B), not {a.quantizations!r}")
    fp8_ab = "fp8" in quantizations and "embedded" in backends

    tmp = Path(tempfile.mkdtemp(prefix="agentrl-bench-"))
    atexit.register(shutil.rmtree, tmp, True)  # also when a round fails or Ctrl-C stops the bench
    model_dir = Path(a.model) if a.model else build_model(a.shape, a.dtype, tmp / "model", a.device)
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size

    def serve(
        extra: list[str], backend: str = "embedded", log: str = "server", update: bool = False
    ) -> tuple[dict[int, tuple[int, float]], dict[str, float] | None, dict]:
        """Every round (and the multi-turn episodes) on one server; its ``/get_server_info`` (and, with
        ``update``, an :func:`update_round` after the rounds under ``"update"``)."""
        engine: dict[int, tuple[int, float]] = {}
        accounts: dict[int, dict[str, float]] = {c: {} for c in concs}
        if backend == "sglang":
            server = launch_sglang(a, model_dir, tmp / "sglang.log", max(concs))
        else:
            server = launch(a, model_dir, tmp / f"{log}.log", max(concs), extra)
        multi: dict[str, float] | None = None
        split: dict[int, dict[str, float]] = {}
        try:
            for c in concs:
                if a.split:  # the prompts once, one new token each: prefill, and the round finds them cached
                    _, prefill = asyncio.run(engine_round(server.url, c, a.prompt_len, 1, vocab))
                    split[c] = {"prefill_s": round(prefill, 4)}
                engine[c] = asyncio.run(
                    engine_round(server.url, c, a.prompt_len, a.max_new_tokens, vocab, accounts[c])
                )
            if a.multi_turn:
                multi = asyncio.run(
                    multi_turn_round(
                        server.url, max(concs), a.multi_turn, a.prompt_len, a.obs_len, a.max_new_tokens, vocab
                    )
                )
            info = asyncio.run(_server_info(server.url))
            info["rounds"] = {c: acc for c, acc in accounts.items() if acc}
            for c, part in split.items():
                part["decode_step_ms"] = round(engine[c][1] * 1000 / (2 * a.max_new_tokens), 3)
            info["split"] = split
            if update:
                info["update"] = asyncio.run(update_round(server.url, model_dir))
        finally:
            server.stop()  # frees the device before the next server or the baseline runs
        return engine, multi, info

    per_round: dict[int, list[float]] = {}
    engine: dict[int, tuple[int, float]] = {}
    multi = multi_invariant = multi_sglang = None
    invariant: dict[int, tuple[int, float]] = {}
    info: dict = {}
    if "embedded" in backends:
        if a.deterministic and a.rounds > 1:
            engine, invariant, per_round, info = interleaved(a, model_dir, tmp, concs, vocab)
        else:
            engine, multi, info = serve([])
            invariant, multi_invariant, _ = (
                serve(["--batch-invariant"]) if a.deterministic else ({}, None, {})
            )
    fp8: dict[int, tuple[int, float]] = {}
    multi_fp8 = None
    fp8_info: dict = {}
    if fp8_ab:  # after the unquantized server, on the same device
        fp8, multi_fp8, fp8_info = serve(["--quantization", "fp8"], log="server_fp8", update=True)
    spec: dict[int, tuple[int, float]] = {}
    multi_spec = None
    spec_info: dict = {}
    if a.speculative and "embedded" in backends:  # after the plain server, on the same device
        spec, multi_spec, spec_info = serve(shlex.split(a.spec_args), log="server_spec")
    sglang: dict[int, tuple[int, float]] = {}
    sglang_info: dict = {}
    if "sglang" in backends:
        sglang, multi_sglang, sglang_info = serve([], "sglang")

    hf: dict[int, tuple[int, float]] = {}
    if not a.no_hf:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, a.dtype)).to(a.device)
        hf = {c: hf_round(model.eval(), c, a.prompt_len, a.max_new_tokens, vocab, a.device) for c in concs}

    results: dict[str, dict[str, Any]] = {}
    for c in concs:
        results[str(c)] = {"requests": 2 * c}
        if c in sglang:
            results[str(c)]["sglang_tok_s"] = round(sglang[c][0] / sglang[c][1], 1)
            if c in sglang_info.get("split", {}):
                results[str(c)]["sglang_split"] = sglang_info["split"][c]
        if c not in engine:
            continue
        e_tok, e_s = engine[c]
        results[str(c)]["engine_tok_s"] = round(e_tok / e_s, 1)
        if c in info.get("rounds", {}):
            results[str(c)]["engine_time"] = info["rounds"][c]
        if c in info.get("split", {}):
            results[str(c)]["engine_split"] = info["split"][c]
        if c in sglang:
            results[str(c)]["ratio_sglang_over_embedded"] = round(
                (sglang[c][0] / sglang[c][1]) / (e_tok / e_s), 3
            )
        if c in fp8:
            f_tok, f_s = fp8[c]
            results[str(c)]["fp8_tok_s"] = round(f_tok / f_s, 1)
            results[str(c)]["ratio_fp8_over_unquantized"] = round((f_tok / f_s) / (e_tok / e_s), 3)
        if c in spec:
            s_tok, s_s = spec[c]
            results[str(c)]["spec_tok_s"] = round(s_tok / s_s, 1)
            results[str(c)]["ratio_spec_over_plain"] = round((s_tok / s_s) / (e_tok / e_s), 3)
            if c in spec_info.get("rounds", {}):
                results[str(c)]["spec_time"] = spec_info["rounds"][c]
        if c in invariant:
            i_tok, i_s = invariant[c]
            results[str(c)]["batch_invariant_tok_s"] = round(i_tok / i_s, 1)
            results[str(c)]["ratio_batch_invariant_over_default"] = round((i_tok / i_s) / (e_tok / e_s), 3)
        if c in per_round:  # interleaved rounds: the median of the paired ratios
            results[str(c)]["ratio_batch_invariant_over_default"] = round(statistics.median(per_round[c]), 3)
            results[str(c)]["ratio_per_round"] = [round(r, 3) for r in per_round[c]]
        if c in hf:
            h_tok, h_s = hf[c]
            results[str(c)]["hf_generate_tok_s"] = round(h_tok / h_s, 1)
            results[str(c)]["ratio_engine_over_hf"] = round((e_tok / e_s) / (h_tok / h_s), 3)
    print(
        json.dumps(
            {
                "bench": "engine_throughput",
                "device": a.device,
                "gpu": torch.cuda.get_device_name() if a.device.startswith("cuda") else None,
                "dtype": a.dtype,
                "shape": a.shape if not a.model else str(a.model),
                "params_m": round(parameter_counts(model_dir)[0] / 1e6, 1),
                "prompt_len": a.prompt_len,
                "max_new_tokens": a.max_new_tokens,
                "results": results,
                "multi_turn": multi,
                "multi_turn_batch_invariant": multi_invariant,
                "multi_turn_sglang": multi_sglang,
                "multi_turn_fp8": multi_fp8,
                "multi_turn_spec": multi_spec,
                "spec_args": a.spec_args if a.speculative else None,
                "backends": backends,
                "quantizations": quantizations,
                "fp8": (
                    {
                        "quantize_load_s": round(float(fp8_info["quantize_s"]), 6),
                        **fp8_info["update"],
                        **{k: fp8_info.get(k) for k in ("context_len", "prefix_cache_slots")},
                    }
                    if fp8_info
                    else None
                ),
                "server_args": a.server_args,
                "engine_info": {k: info.get(k) for k in ("engine", "context_len", "prefix_cache_slots")},
                "sglang_config": {k: sglang_info.get(k) for k in SGLANG_INFO} if sglang_info else None,
                "note": "engine: HTTP + continuous batching, 2*C requests with C in flight; "
                "hf: generate on batches of C",
            }
        )
    )


async def _server_info(url: str) -> dict:
    async with EngineClient(url, timeout=60) as client:
        return (await client.server_info())[0]


if __name__ == "__main__":
    sys.exit(main())
