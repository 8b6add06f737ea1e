"""Trainer-to-engine weight broadcast across two GPUs, as ``weight_sync: distributed`` does it, and the link's
NCCL all-reduce bus bandwidth measured in the same run.

The sender is this process on ``--trainer-device`` (default cuda:0): a model's HF-named weights, random,
in bf16 on that GPU (what trainer rank 0 holds once it gathered them; no model, no optimizer), pushed by
agentrl's own sender (:func:`agentrl.weight_sync.connect`: BroadcastSync over a
WeightBroadcaster, buckets of ``--bucket-mb``). The receiver is a process of its own on
``--engine-device`` (default cuda:1) serving the engine's side of the protocol over HTTP: the embedded
engine's endpoints (:class:`agentrl.embedded.native_api.NativeAPI`) over its broadcast groups
(:class:`agentrl.embedded.weights.WeightGroups`), which receive each bucket into new tensors, as the
engine does before it copies them into its model (the copy is not timed here). The receiver answers the
last bucket once its GPU holds every byte, so a push's time is until the engine has the weights.
``--flatten`` sends each bucket as one broadcast of its bytes (``trainer.weight_sync_flatten``, SGLang's
``load_format: flattened_bucket``) instead of one broadcast a tensor.

Per shape (``--shapes``, default qwen2.5-0.5b and qwen2.5-7b): one push that checks every byte arrived (a
checksum on both sides), then ``--repeats`` timed pushes: seconds (median) and GB/s (1e9 bytes). Then,
between the same two processes: all-reduce of ``--collective-mb`` and one broadcast of that size,
``--iters`` times after a warm-up, with nccl-tests' bus bandwidth (all-reduce: algbw x 2(n-1)/n).

``--receivers embedded,sglang`` also pushes the same weights, after the receiver above, to a real SGLang
server on the engine's GPU holding a model of the shape (random weights): SGLang's own receiving side, a
request a bucket and each tensor loaded into its model, as a disaggregated run with SGLang engines pays
it. Per shape it reports SGLang's push (one untimed, then ``--repeats`` timed) beside the receiver's, their
ratio and the difference a tensor. Both receivers then run with the NCCL setting SGLang's servers need
(:data:`agentrl.weight_sync.SGLANG_PEER_ENV`), so that the receiving side is all that differs.

    python bench/weight_broadcast.py                       # 2 GPUs: NCCL, 0.5B and 7B shapes
    python bench/weight_broadcast.py --receivers embedded,sglang   # and SGLang's receiving side
    python bench/weight_broadcast.py --device cpu          # gloo, tiny shape (the CPU test runs this)

Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

# The one shape of its own: the CPU test's (HF config fields); the others are the full-size shapes
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=600,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
}


def full_size(name: str) -> tuple[str, int | None]:
    """A full-size shape's name (:data:`agentrl.models.tiny.FULL_SHAPES`) and its decoder layers:
    ``qwen3-30b-a3b:12`` is its first 12 layers, a bare name all of them (None)."""
    base, _, layers = name.partition(":")
    return base, int(layers) if layers else None


def shape_config(name: str) -> dict[str, Any]:
    """The HF config of shape ``name``: ``tiny``, or a full-size shape (:func:`full_size`)."""
    from agentrl.models.tiny import shape_config

    if name in SHAPES:
        return {"model_type": "qwen2", **SHAPES[name]}
    return shape_config(*full_size(name)).to_dict()


def random_weights(
    name: str, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> dict[str, torch.Tensor]:
    """The HF-named weights of shape ``name``, random, on ``device``: what the sender holds for a push."""
    from agentrl.trainer.arch import ModelArch
    from agentrl.trainer.model import hf_param_shapes

    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = hf_param_shapes(ModelArch.from_hf_config(shape_config(name)))
    return {n: torch.randn(s, dtype=dtype, device=device, generator=gen) for n, s in shapes.items()}


def checksum(tensors: Any) -> int:
    """Sum of every byte (exact, order-free): equal on both sides when every byte arrived."""
    return int(sum(int(t.contiguous().view(torch.uint8).sum(dtype=torch.int64)) for t in tensors))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bus_bandwidth(op: str, nbytes: int, seconds: float, ranks: int = 2) -> dict[str, float]:
    """nccl-tests' figures of one collective of ``nbytes`` taking ``seconds``: algbw = bytes / time, busbw
    = algbw x 2(n-1)/n for all-reduce, algbw for broadcast (GB/s, 1e9 bytes)."""
    algbw = nbytes / seconds / 1e9
    factor = 2 * (ranks - 1) / ranks if op == "all_reduce" else 1.0
    return {"algbw_gbps": algbw, "busbw_gbps": algbw * factor}


def run_collective(
    op: str, numel: int, dtype: torch.dtype, device: torch.device, group: Any, iters: int, warmup: int
) -> float:
    """Seconds per ``op`` (all_reduce or broadcast from rank 0) of ``numel`` elements in ``group``."""
    import torch.distributed as dist

    buf = torch.ones(numel, dtype=dtype, device=device)

    def once() -> None:
        if op == "all_reduce":
            dist.all_reduce(buf, group=group)
        else:
            dist.broadcast(buf, src=0, group=group)

    for _ in range(warmup):
        once()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        once()
    sync(device)
    return (time.perf_counter() - t0) / iters


# ---- the engine's side: a process of its own --------------------------------------------------------------


class BroadcastReceiver:
    """The embedded engine's broadcast endpoints without a model: each bucket is received (WeightGroups, as
    the engine does) and dropped; the last one answers once the device holds it. ``verify``: keep a
    checksum of what arrived."""

    tokenizer = None  # NativeAPI reads it; the broadcast endpoints never use it

    def __init__(self, device: torch.device) -> None:
        from agentrl.embedded.weights import WeightGroups

        self.device = device
        self.groups = WeightGroups(device)
        self.verify = False
        self.received = {"bytes": 0, "tensors": 0, "checksum": 0}

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
        load_format: str | None = None,
    ) -> None:
        tensors = await self.groups.receive(group_name, names, dtypes, shapes, load_format)
        if weight_version is not None:  # the last bucket: the engine has the weights once the device does
            await asyncio.to_thread(sync, self.device)
        self.received["bytes"] += sum(t.numel() * t.element_size() for t in tensors.values())
        self.received["tensors"] += len(tensors)
        if self.verify:
            self.received["checksum"] += checksum(tensors.values())


async def serve_receiver(device: torch.device) -> None:
    """Serve the receiver on a free loopback port; print its URL; exit when stdin closes (the bench ended)."""
    from aiohttp import web

    from agentrl.embedded.native_api import NativeAPI
    from agentrl.engine.dist import init_custom_process_group, leave_process_group

    if device.type == "cuda":
        torch.cuda.set_device(device)
    receiver = BroadcastReceiver(device)
    api = NativeAPI(receiver)  # type: ignore[arg-type]  # the three broadcast endpoints need no model

    async def verify(request: web.Request) -> web.Response:
        body = await request.json()
        receiver.verify = bool(body["on"])
        receiver.received = {"bytes": 0, "tensors": 0, "checksum": 0}
        return web.json_response({"success": True})

    async def received(request: web.Request) -> web.Response:
        return web.json_response(receiver.received)

    async def collective(request: web.Request) -> web.Response:
        b = await request.json()
        group = await asyncio.to_thread(
            init_custom_process_group,
            b["backend"],
            f"tcp://{b['master_address']}:{b['master_port']}",
            2,
            1,
            f"bench_{b['op']}",
        )
        dtype = getattr(torch, b["dtype"])
        await asyncio.to_thread(
            run_collective, b["op"], b["numel"], dtype, device, group, b["iters"], b["warmup"]
        )
        await leave_process_group(group)
        return web.json_response({"success": True})

    app = web.Application(client_max_size=64 * 1024**2)
    app.add_routes(
        [
            web.post("/init_weights_update_group", api.init_weights_update_group),
            web.post("/update_weights_from_distributed", api.update_weights_from_distributed),
            web.post("/destroy_weights_update_group", api.destroy_weights_update_group),
            web.post("/bench/verify", verify),
            web.get("/bench/received", received),
            web.post("/bench/collective", collective),
        ]
    )
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    print(json.dumps({"url": f"http://127.0.0.1:{sock.getsockname()[1]}"}), flush=True)
    loop = asyncio.get_running_loop()
    closed = loop.create_future()

    def wait_for_eof() -> None:
        sys.stdin.read()
        loop.call_soon_threadsafe(closed.set_result, None)

    threading.Thread(target=wait_for_eof, daemon=True).start()
    await closed
    receiver.groups.abort_all()
    await runner.cleanup()


# ---- the trainer's side ----------------------------------------------------------------------------------


class Receiver:
    """The receiver process (started on ``device``) and an HTTP session to its bench endpoints."""

    def __init__(self, device: str) -> None:
        env = dict(os.environ)
        if device.startswith("cuda"):  # the engine sees its own GPU only, as a Ray actor with one GPU does
            env["CUDA_VISIBLE_DEVICES"] = device.partition(":")[2] or "0"
            device = "cuda:0"
        cmd = [sys.executable, os.path.abspath(__file__), "--serve-receiver", device]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the receiver did not start (exit code {self.proc.wait()})")
        self.url = json.loads(line)["url"]
        self._session: Any = None

    async def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600))
        async with self._session.request(method, self.url + path, json=body) as r:
            r.raise_for_status()
            return await r.json()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # the receiver leaves when its stdin closes
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def timed_pushes(
    hf: dict[str, torch.Tensor],
    client: Any,
    a: argparse.Namespace,
    device: torch.device,
    backend: str,
    first: Any = None,
) -> dict[str, Any]:
    """Open a weight-update group with the engine behind ``client``, push ``hf`` once untimed (it sets
    the communicator up; ``first``, when given, is awaited around it: the receiver's check), then
    ``a.repeats`` timed pushes, as trainer rank 0 pushes."""
    from agentrl.weight_sync import BroadcastGroup, WeightUpdate, connect

    nbytes = sum(t.numel() * t.element_size() for t in hf.values())
    sync(device)
    t0 = time.perf_counter()
    group = BroadcastGroup(backend=backend, bucket_bytes=int(a.bucket_mb * 2**20), flatten=a.flatten)
    update = WeightUpdate("distributed", group=group)
    engine_sync = await connect(update, rank=0, world_size=1, device=device, model_path="", client=client)
    group_init_s = time.perf_counter() - t0
    try:
        checked = await first(engine_sync.push(hf, 1)) if first else await engine_sync.push(hf, 1)
        sync(device)
        times = []
        for r in range(a.repeats):
            t0 = time.perf_counter()
            stats = await engine_sync.push(hf, 2 + r)
            sync(device)
            times.append(time.perf_counter() - t0)
    finally:
        await engine_sync.close()
    seconds = statistics.median(times)
    return {
        "buckets": int(stats["num_buckets"]),
        "broadcasts": int(stats["num_broadcasts"]),
        "verified": checked if first else None,
        "group_init_s": group_init_s,
        "seconds": seconds,
        "seconds_min": min(times),
        "gbps": nbytes / seconds / 1e9,
    }


async def push_shape(
    client: Any,
    receiver: Receiver,
    name: str,
    a: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    backend: str,
) -> dict[str, Any]:
    """One checked push of shape ``name`` to the receiver, then ``a.repeats`` timed ones; with
    ``a.receivers`` naming sglang, the same to an SGLang server (:func:`push_to_sglang`)."""
    hf = random_weights(name, dtype, device)
    nbytes = sum(t.numel() * t.element_size() for t in hf.values())
    sent_sum = checksum(hf.values())

    async def checked(push: Any) -> bool:
        await receiver.call("POST", "/bench/verify", {"on": True})
        await push
        sync(device)
        got = await receiver.call("GET", "/bench/received")
        await receiver.call("POST", "/bench/verify", {"on": False})
        return got["bytes"] == nbytes and got["tensors"] == len(hf) and got["checksum"] == sent_sum

    out = {
        "shape": name,
        "params": sum(t.numel() for t in hf.values()),
        "tensors": len(hf),
        "bytes": nbytes,
        **await timed_pushes(hf, client, a, device, backend, checked),
    }
    if "sglang" in a.receivers:
        sglang = await push_to_sglang(hf, name, a, device, backend)
        sglang["ratio_over_embedded_receiver"] = sglang["seconds"] / out["seconds"]
        sglang["extra_per_tensor_us"] = (sglang["seconds"] - out["seconds"]) / len(hf) * 1e6
        out["sglang"] = sglang
    return out


async def push_to_sglang(
    hf: dict[str, torch.Tensor], name: str, a: argparse.Namespace, device: torch.device, backend: str
) -> dict[str, Any]:
    """The pushes of :func:`timed_pushes` to a real SGLang server on ``a.engine_device`` that holds a
    model of shape ``name`` (random weights, saved first): SGLang's receiving side."""
    import tempfile

    from agentrl.engine.client import EngineClient
    from agentrl.engine.launcher import SGLangLauncher
    from agentrl.engine.sglang_config import SGLangConfig
    from agentrl.models.random_weights import build_shape_model

    with tempfile.TemporaryDirectory(prefix="agentrl-bench-") as tmp:
        base, layers = full_size(name)
        model_dir = build_shape_model(base, Path(tmp) / "model", "bfloat16", str(device), layers)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        cfg = SGLangConfig(
            model_path=str(model_dir),
            port=0,
            mem_fraction_static=a.sglang_mem_fraction,
            skip_tokenizer_init=True,
            env={"CUDA_VISIBLE_DEVICES": a.engine_device.partition(":")[2] or "0"},
            extra_args={"dtype": "bfloat16", "disable-cuda-graph": True},
            log_file=str(Path(tmp) / "sglang.log"),
            startup_timeout=1800,
        )
        t0 = time.perf_counter()
        server = SGLangLauncher(cfg).start()
        start_s = time.perf_counter() - t0
        try:
            async with EngineClient(server.url, timeout=3600, max_retries=0) as client:
                pushed = await timed_pushes(hf, client, a, device, backend)
        finally:
            server.stop()
    return {"server_start_s": start_s, **pushed}


async def collective(
    receiver: Receiver, op: str, a: argparse.Namespace, device: torch.device, dtype: torch.dtype, backend: str
) -> dict[str, Any]:
    """``op`` between this process (rank 0) and the receiver (rank 1), in a group of their own."""
    from agentrl.cluster import free_port
    from agentrl.engine.dist import init_custom_process_group, leave_process_group

    numel = (a.collective_mb << 20) // dtype.itemsize
    port = free_port()
    body = {
        "op": op,
        "backend": backend,
        "master_address": "127.0.0.1",
        "master_port": port,
        "numel": numel,
        "dtype": str(dtype).removeprefix("torch."),
        "iters": a.iters,
        "warmup": a.warmup,
    }

    def mine() -> float:
        group = init_custom_process_group(backend, f"tcp://127.0.0.1:{port}", 2, 0, f"bench_{op}")
        try:
            return run_collective(op, numel, dtype, device, group, a.iters, a.warmup)
        finally:
            asyncio.run(leave_process_group(group))

    seconds, _ = await asyncio.gather(
        asyncio.to_thread(mine), receiver.call("POST", "/bench/collective", body)
    )
    nbytes = numel * dtype.itemsize
    return {"bytes": nbytes, "iters": a.iters, "seconds": seconds, **bus_bandwidth(op, nbytes, seconds)}


async def bench(a: argparse.Namespace) -> dict[str, Any]:
    from agentrl.engine.client import EngineClient

    cuda = a.device == "cuda"
    device = torch.device(a.trainer_device or ("cuda:0" if cuda else "cpu"))
    engine_device = a.engine_device = a.engine_device or ("cuda:1" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = getattr(torch, a.dtype or ("bfloat16" if cuda else "float32"))
    backend = a.backend or ("nccl" if cuda else "gloo")
    shapes = a.shapes.split(",") if a.shapes else (["qwen2.5-0.5b", "qwen2.5-7b"] if cuda else ["tiny"])
    out: dict[str, Any] = {
        "bench": "weight_broadcast",
        "device": a.device,
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "trainer_device": str(device),
        "engine_device": engine_device,
        "receivers": a.receivers,
        "backend": backend,
        "dtype": str(dtype).removeprefix("torch."),
        "bucket_mb": a.bucket_mb,
        "flatten": a.flatten,
        "repeats": a.repeats,
        "torch": torch.__version__,
    }
    receiver = Receiver(engine_device)
    client = EngineClient(receiver.url, timeout=3600, max_retries=0)
    try:
        out["shapes"] = []
        for name in shapes:
            out["shapes"].append(await push_shape(client, receiver, name, a, device, dtype, backend))
            if cuda:
                torch.cuda.empty_cache()
        out["all_reduce"] = await collective(receiver, "all_reduce", a, device, dtype, backend)
        out["broadcast"] = await collective(receiver, "broadcast", a, device, dtype, backend)
    finally:
        await client.close()
        await receiver.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cuda: NCCL; cpu: gloo")
    p.add_argument("--trainer-device", default=None, help="the sender's device (default cuda:0, or cpu)")
    p.add_argument("--engine-device", default=None, help="the receiver's device (default cuda:1, or cpu)")
    p.add_argument(
        "--shapes",
        default=None,
        help=f"comma-separated, of {', '.join(SHAPES)} and the full-size shapes "
        "(qwen3-30b-a3b:12: its first 12 decoder layers)",
    )
    p.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument(
        "--backend", default=None, choices=["nccl", "gloo"], help="default nccl on cuda, gloo on cpu"
    )
    p.add_argument(
        "--bucket-mb", type=float, default=None, help="default: TrainerConfig.weight_sync_bucket_mb"
    )
    p.add_argument(
        "--flatten", action="store_true", help="each bucket as one broadcast of its bytes (flattened_bucket)"
    )
    p.add_argument("--repeats", type=int, default=None, help="timed pushes per shape (default 5, 2 on cpu)")
    p.add_argument("--collective-mb", type=int, default=None, help="all-reduce size (default 1024, 1 on cpu)")
    p.add_argument("--iters", type=int, default=None, help="timed collectives (default 20, 3 on cpu)")
    p.add_argument("--warmup", type=int, default=None, help="untimed collectives first (default 5, 1 on cpu)")
    p.add_argument(
        "--receivers",
        default="embedded",
        help="embedded, or embedded,sglang: also push to a real SGLang server on the engine's GPU",
    )
    p.add_argument(
        "--sglang-mem-fraction", type=float, default=0.3, help="the SGLang server's --mem-fraction-static"
    )
    p.add_argument("--serve-receiver", default=None, metavar="DEVICE", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve_receiver:
        asyncio.run(serve_receiver(torch.device(a.serve_receiver)))
        return
    a.receivers = [r.strip() for r in a.receivers.split(",") if r.strip()]
    if a.receivers not in (["embedded"], ["embedded", "sglang"]):
        p.error(f"--receivers: embedded, or embedded,sglang, not {','.join(a.receivers)!r}")
    if "sglang" in a.receivers:
        if a.device != "cuda":
            p.error("--receivers embedded,sglang: SGLang runs on a GPU (--device cuda)")
        from agentrl.weight_sync import trainer_env

        os.environ.update(trainer_env("sglang"))  # before NCCL starts; the receiver inherits it
    from agentrl.trainer.config import TrainerConfig

    cuda = a.device == "cuda"
    if a.bucket_mb is None:
        a.bucket_mb = TrainerConfig.model_fields["weight_sync_bucket_mb"].default
    a.repeats = a.repeats or (5 if cuda else 2)
    a.collective_mb = a.collective_mb or (1024 if cuda else 1)
    a.iters = a.iters or (20 if cuda else 3)
    a.warmup = a.warmup if a.warmup is not None else (5 if cuda else 1)
    print(json.dumps(asyncio.run(bench(a))))


if __name__ == "__main__":
    sys.exit(main())
