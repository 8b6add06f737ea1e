"""The embedded engine's server process: a stand-in for SGLang that speaks SGLang's native HTTP API on CPU
or one GPU.

``python -m agentrl.embedded.server --model DIR --host 127.0.0.1 --port N [--device cpu|cuda]
[--dtype float32|bfloat16] [--api-key K] [--max-batch-size B]`` serves a Hugging Face checkpoint directory
with the endpoints of ``sglang.launch_server`` (:mod:`agentrl.embedded.native_api`, which also lists where
the embedded engine differs) and OpenAI's (:mod:`agentrl.engine.openai_api`). Generation runs in
:class:`~agentrl.embedded.engine.EmbeddedEngine` (continuous batching over a slot KV cache, CUDA graphs for
decode on a GPU, prefix reuse across turns).

Security: it binds 127.0.0.1 by default and refuses a non-loopback ``--host`` without a key (``--api-key``,
or ``$AGENTRL_API_KEY``, which keeps it out of the process list). With a key, every endpoint except
``/health`` and ``/health_generate`` requires ``Authorization: Bearer KEY``.

:func:`agentrl.embedded.launch.start_embedded_server` runs it as a subprocess (own process group, waits for
``/health``) without importing the engine, and returns a handle with ``.url`` and ``.stop()``; tests and
``train_async.py`` use it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web

from agentrl.cluster import API_KEY_ENV, is_loopback
from agentrl.embedded.engine import EmbeddedEngine
from agentrl.embedded.lora import LORA_APPLY
from agentrl.embedded.native_api import ENGINE_NAME, build_app
from agentrl.embedded.speculative import SpeculativeConfig

__all__ = ["build_app", "main"]

log = logging.getLogger("agentrl.embedded.server")


# ---------------------------------------------------------------------------------------------- CLI
def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m agentrl.embedded.server",
        description="Embedded engine speaking SGLang's native HTTP API (a stand-in for SGLang).",
    )
    p.add_argument("--model", "--model-path", dest="model", required=True, help="HF checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless --api-key is given)")
    p.add_argument("--port", type=int, default=30000, help="port; 0 picks a free one (see --port-file)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"required as 'Authorization: Bearer KEY' on every endpoint (default: ${API_KEY_ENV})",
    )
    p.add_argument("--max-batch-size", type=int, default=64, help="requests decoded together at most")
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=None,
        help="tokens per prefill step (default 16384 GPU, 2048 CPU)",
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
    p.add_argument(
        "--memory-mode",
        default="auto",
        choices=["auto", "virtual", "copy"],
        help="how /release_memory_occupation frees the weights and KV cache: virtual (GPU, "
        "torch_memory_saver: addresses kept, CUDA graphs stay valid), copy (to host memory and back; "
        "graphs captured again), auto: virtual when it works here, else copy",
    )
    p.add_argument("--no-cuda-graphs", action="store_true", help="GPU: decode without CUDA graphs")
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's tokens and logprobs are the same bits alone or batched, at any batch position, "
        "with or without prefix reuse, whatever the prefill chunking (agentrl.batch_invariant kernels; "
        "no torch.compile); what deterministic runs use",
    )
    p.add_argument(
        "--quantization",
        default=None,
        choices=["fp8"],
        help="fp8: the layers' projections served in float8 with a scale per output channel, quantized "
        "again after every weight update (agentrl.embedded.fp8); needs compute capability 8.9+ on a GPU",
    )
    p.add_argument(
        "--lora-apply",
        default="unmerged",
        choices=list(LORA_APPLY),
        help="how a LoRA adapter (/load_lora_adapter...) is served: unmerged = beside the weights, "
        "x W^T + s (x A^T) B^T as the trainer computes it, a sync copying only the adapters into buffers "
        "of --max-lora-rank; merged = W + s B A written into the weights from host copies of the base "
        "(agentrl.embedded.lora)",
    )
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=0,
        help="unmerged LoRA: the adapter buffers' rank, made at start so the CUDA graphs include them "
        "(0: made at the first adapter; a larger adapter makes them again and drops the graphs)",
    )
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
    p.add_argument(
        "--speculative",
        default=None,
        choices=["ngram"],
        help="speculative decoding: ngram drafts each request's next tokens from its own context and one "
        "forward verifies them; with --spec-acceptance exact no token or logprob changes "
        "(agentrl.embedded.speculative)",
    )
    p.add_argument("--spec-k", type=int, default=4, help="--speculative: tokens drafted per request and step")
    p.add_argument("--spec-ngram", type=int, default=3, help="--speculative: the longest suffix looked up")
    p.add_argument(
        "--spec-min-ngram", type=int, default=2, help="--speculative: the shortest suffix looked up"
    )
    p.add_argument(
        "--spec-shared-tokens",
        type=int,
        default=0,
        help="--speculative: also look a request's suffix up in what the other requests generated, this "
        "many tokens remembered (0: its own context only)",
    )
    p.add_argument(
        "--spec-acceptance",
        default="exact",
        choices=["exact", "rejection"],
        help="--speculative: exact keeps a drafted token only where it equals the token sampled there; "
        "rejection is standard speculative sampling (the target distribution, not the same tokens)",
    )
    p.add_argument(
        "--spec-always",
        action="store_true",
        help="--speculative: verify at every decode step with a draft, also where it does not pay (by "
        "default the engine speculates only while a verify step emits more tokens per second than a "
        "decode step)",
    )
    p.add_argument("--default-max-new-tokens", type=int, default=128)
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the seeds given to requests without a sampling_seed (default: fresh entropy, so that "
        "two servers never draw alike; the server log names it)",
    )
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
        if args.quantization == "fp8":  # checked here too: the run's config check may have seen no GPU
            from agentrl.embedded.fp8 import check_fp8_device

            try:
                check_fp8_device(torch.device("cuda", torch.cuda.current_device()))
            except ValueError as err:
                sys.exit(str(err))
    try:
        _speculative(args)
    except ValueError as err:  # the flags' combination, checked before the model loads
        sys.exit(f"--speculative: {err}")
    # The generation step runs in a worker thread beside the HTTP loop; a short GIL switch interval keeps
    # either from waiting the default 5 ms for the other.
    sys.setswitchinterval(0.0005)
    weights = f"{args.dtype}, {args.quantization} projections" if args.quantization else args.dtype
    log.info("%s: loading %s on %s (%s)", ENGINE_NAME, args.model, args.device, weights)
    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(8), "little") >> 1
    log.info("seed of unseeded sampling: %d", args.seed)
    asyncio.run(_serve(args))


def _speculative(args: argparse.Namespace) -> SpeculativeConfig | None:
    if args.speculative is None:
        return None
    return SpeculativeConfig(
        method=args.speculative,
        num_draft_tokens=args.spec_k,
        max_ngram=args.spec_ngram,
        min_ngram=args.spec_min_ngram,
        shared_tokens=args.spec_shared_tokens,
        acceptance=args.spec_acceptance,
        adaptive=not args.spec_always,
    )


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
        memory_mode=args.memory_mode,
        batch_invariant=args.batch_invariant,
        quantization=args.quantization,
        lora_apply=args.lora_apply,
        max_lora_rank=args.max_lora_rank,
        speculative=_speculative(args),
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


if __name__ == "__main__":
    main()
