"""One device shared by an engine and a trainer (CPU): the embedded engine's sleep and wake over SGLang's
endpoints (its state machine, requests in flight, weight updates while asleep), weights handed over in
memory (``/update_weights_from_tensor``) equal to a disk update bit for bit, the trainer's offload, after
which the next step is bit-identical to one without it, and the hand-over back to the engines, which does
not wait for that offload."""

from __future__ import annotations

import asyncio
import contextlib
import json
import mmap
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from aiohttp import web

from agentrl.embedded.engine import EmbeddedEngine, RequestSampling
from agentrl.embedded.native_api import build_app
from agentrl.engine.client import EngineClient, EngineRequestError
from agentrl.engine.named_tensors import pack_named_tensors, unpack_named_tensors
from agentrl.host_buffers import HUGE_PAGE, HostBuffers, advise_huge_pages
from agentrl.storage_offload import HostCopy, StorageOffload
from agentrl.weight_sync import WeightUpdate

TESTS = str(Path(__file__).parent)


# ---------------------------------------------------------------------------------------------- pieces
def test_storage_offload_frees_and_restores_shared_storages_bit_for_bit() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4)
    flat = torch.randn(64)
    view = flat[16:32].view(4, 4)  # a view: its storage is flat's and moves once
    before = [lin.weight.detach().clone(), lin.bias.detach().clone(), flat.clone()]
    kept = StorageOffload([lin.weight, lin.bias, flat, view])
    dropped_buf = torch.randn(10)
    dropped = StorageOffload([dropped_buf], keep=False)
    assert len(kept.storages) == 3 and kept.nbytes == (32 + 4 + 64) * 4

    kept.offload()
    dropped.offload()
    assert all(s.nbytes() == 0 for s in kept.storages) and dropped_buf.untyped_storage().nbytes() == 0
    assert kept.offload().storages == 0  # a second offload is a no-op
    kept.onload()
    dropped.onload()
    assert torch.equal(lin.weight, before[0]) and torch.equal(lin.bias, before[1])
    assert torch.equal(flat, before[2]) and torch.equal(view, before[2][16:32].view(4, 4))
    assert torch.equal(dropped_buf, torch.zeros(10))  # not kept: zeros, never stale bits
    lin(torch.ones(2, 8)).sum().backward()  # the parameters still train
    assert lin.weight.grad is not None


def test_host_buffers_are_exact_sized_and_kept_across_offloads() -> None:
    """The host copies are of each storage's exact size, come from the pool given (one shared by two
    offload objects) and are reused by the next offload of the same sizes: no new host memory after the
    first. A size the pool has not seen gets a new buffer. (Pageable buffers are kept only when asked, as
    here: on the CPU the pool lets them go by default.)"""
    pool = HostBuffers(keep_pageable=True)
    a, b = torch.randn(1000), torch.randn(333)
    first = StorageOffload([a, b], host=pool)
    first.offload()
    bufs = [t.data_ptr() for t in first._host if t is not None]
    assert [t.numel() for t in first._host if t is not None] == [4000, 1332]  # not rounded up
    assert pool.held_bytes == 5332 and pool.pinned_bytes == 0  # nothing pinned on the CPU
    first.onload()
    second = StorageOffload([a, b], host=pool)  # a new object over the same state (the trainer's way)
    second.offload()
    assert [t.data_ptr() for t in second._host if t is not None] == bufs
    assert pool.held_bytes == 5332
    second.onload()
    c = torch.randn(10)
    third = StorageOffload([a, b, c], host=pool)
    third.offload()
    assert pool.held_bytes == 5332 + 40
    third.onload()
    assert pool.take_all([4000, 40, 4000], pin=False)[1].numel() == 40  # in the order asked
    pool.close()
    assert pool.held_bytes == 0
    default = StorageOffload([a, b])  # its own pool, which keeps no pageable buffer after the onload
    default.offload()
    assert default.host.held_bytes == 5332
    default.onload()
    assert default.host.held_bytes == 0 and default.host._free == {}


def _vm_flags(address: int) -> list[str]:
    """The kernel's flags on the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_large_host_buffers_ask_for_huge_pages() -> None:
    """A buffer to be pinned is marked for transparent huge pages before its pages are touched: where the
    kernel grants them on request (``madvise`` or ``always``), the mapping of its aligned inside carries
    the kernel's huge-page flag (``hg``), so its faults take 2 MB pages whenever free ones exist (whether
    they do depends on the host's fragmentation, not on the buffer). A buffer too small to hold one
    aligned huge page is left alone."""
    assert advise_huge_pages(torch.empty(100, dtype=torch.uint8)) is False
    # a mapping of its own: a malloc'd buffer may come from heap memory an earlier test already advised
    region = mmap.mmap(-1, 64 * 2**20)
    big = torch.frombuffer(region, dtype=torch.uint8)
    inside = -(-big.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    assert "hg" not in _vm_flags(inside)
    advised = advise_huge_pages(big)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    mode = thp.read_text() if thp.exists() else "[never]"
    if "[madvise]" in mode or "[always]" in mode:
        assert advised
        assert "hg" in _vm_flags(inside) and "hg" in _vm_flags(inside + 32 * 2**20)
    else:  # the kernel has them off: the advice is refused or changes nothing, and nothing fails
        assert isinstance(advised, bool)
    big.zero_()
    del big
    region.close()


def test_host_copy_saves_and_restores_the_bytes_in_place() -> None:
    """HostCopy keeps the bytes of shared storages across a loss of their content (what CUDA virtual
    memory's unmap and map do to the engine's weights) and writes them back into the same storages,
    every view included, as many times as asked; the host buffer is allocated once."""
    flat = torch.randn(1000)
    a, b = flat[:300].view(10, 30), flat[300:]
    saved = HostCopy([a, b, a])
    assert len(saved.storages) == 1
    want = flat.clone()
    for _ in range(2):
        saved.save()
        host = saved._host[0]
        flat.zero_()  # the content is gone, the tensors and addresses stay
        saved.restore()
        assert saved._host[0] is host
        assert torch.equal(flat, want) and torch.equal(a, want[:300].view(10, 30))
        flat.add_(1.0)
        want = flat.clone()


def test_offload_finds_the_state_of_every_optimizer_in_megatrons_chain() -> None:
    """With expert parallelism megatron chains two optimizers (dense and expert parameters), and a chain
    of more than one refuses ``.optimizer``: the offload walks the chain and finds both's parameters and
    Adam moments."""
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    from agentrl.trainer.offload import trainer_state_tensors

    dense, experts = torch.nn.Linear(4, 4), torch.nn.Linear(3, 3)
    adams = [torch.optim.AdamW(m.parameters()) for m in (dense, experts)]
    for m, adam in zip((dense, experts), adams, strict=True):
        m(torch.randn(2, m.in_features)).sum().backward()
        adam.step()
    chain = ChainedOptimizer(adams)
    with pytest.raises(AssertionError):
        chain.optimizer  # noqa: B018 - the property the walk must not touch
    kept, _ = trainer_state_tensors(torch.nn.Module(), chain, [])
    held = {id(t) for t in kept}
    for adam in adams:
        for p, state in adam.state.items():
            assert id(p) in held and id(state["exp_avg"]) in held and id(state["exp_avg_sq"]) in held


def test_named_tensors_in_shared_memory_round_trip_and_bad_payloads_are_refused() -> None:
    named = [
        ("a", torch.randn(3, 5).to(torch.bfloat16)),
        ("b", torch.arange(7)),
        ("c", torch.randn(2, 2, 2)),
    ]
    packed = pack_named_tensors(named)
    assert packed.load_format == "shared_memory"
    got, release = unpack_named_tensors(packed.payload, packed.load_format)
    assert [n for n, _ in got] == ["a", "b", "c"]
    assert all(torch.equal(x, y) and x.dtype == y.dtype for (_, x), (_, y) in zip(named, got, strict=True))
    release()
    packed.close()
    with pytest.raises(ValueError, match="shared-memory tensors"):  # the block is gone once closed
        unpack_named_tensors(packed.payload, packed.load_format)

    meta = json.loads(pack_named_tensors([("x", torch.zeros(4))]).payload)  # leaked on purpose: closed below
    meta["tensors"][0][3] = 10_000
    with pytest.raises(ValueError, match="outside the block"):
        unpack_named_tensors(json.dumps(meta), "shared_memory")
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(name=meta["shm"])
    shm.close()
    shm.unlink()

    import base64
    import pickle

    evil = base64.b64encode(pickle.dumps([("x", os.getcwd)])).decode()  # a pickle that would call a function
    with pytest.raises(ValueError, match="may not reference"):
        unpack_named_tensors(evil)
    with pytest.raises(ValueError, match="load_format"):
        unpack_named_tensors("{}", "flattened_bucket")


# ------------------------------------------------------------------------------------- engine endpoints
@contextlib.asynccontextmanager
async def served(engine: EmbeddedEngine) -> AsyncIterator[EngineClient]:
    """The engine behind its real HTTP app on loopback, and a client of it."""
    runner = web.AppRunner(build_app(engine), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = EngineClient(f"http://127.0.0.1:{port}", timeout=120, max_retries=0)
    try:
        yield client
    finally:
        await client.close()
        await runner.cleanup()
        engine.shutdown()


def _greedy(n: int) -> RequestSampling:
    return RequestSampling(temperature=0.0, max_new_tokens=n, ignore_eos=True)


def _param_bytes(engine: EmbeddedEngine) -> int:
    return sum(p.untyped_storage().nbytes() for p in engine.model.parameters())


async def test_sleep_and_wake_state_machine_over_http(tiny_model_dir: Path) -> None:
    engine = EmbeddedEngine(tiny_model_dir, max_batch_size=2, prefix_cache_slots=2)
    prompt = list(range(20, 40))
    async with served(engine) as client:
        ref = await engine.generate(prompt, _greedy(8), "ref")
        info = (await client.server_info())[0]
        assert info["memory_mode"] == "copy" and not info["asleep"] and info["released"] == []
        assert info["kv_cache_bytes"] == 2 * engine.runner.k.numel() * 4

        # a wake without a sleep is a caller's bug: 400, saying so
        with pytest.raises(EngineRequestError, match="nothing is released"):
            await client.resume_memory_occupation()
        with pytest.raises(EngineRequestError, match="unknown memory tags"):
            await client.release_memory_occupation(["optimizer"])

        await client.release_memory_occupation()  # both tags
        info = (await client.server_info())[0]
        assert info["asleep"] and info["released"] == ["kv_cache", "weights"]
        assert _param_bytes(engine) == 0 and engine.runner.k.untyped_storage().nbytes() == 0
        with pytest.raises(EngineRequestError, match="already released"):
            await client.release_memory_occupation(["kv_cache"])

        # a request sent while asleep waits for the wake; health stays green
        waiting = asyncio.create_task(engine.generate(prompt, _greedy(8), "asleep"))
        await asyncio.sleep(0.3)
        assert not waiting.done() and await client.health()
        await client.resume_memory_occupation(["weights"])  # slime's order: weights, then the cache
        await asyncio.sleep(0.2)
        assert not waiting.done() and engine.asleep  # the KV cache is still released
        with pytest.raises(EngineRequestError, match="weights not released"):
            await client.resume_memory_occupation(["weights"])
        await client.resume_memory_occupation(["kv_cache"])
        rec = await asyncio.wait_for(waiting, 300)
        assert not engine.asleep
        # the weights came back bit for bit, the cache empty: the same greedy tokens and logprobs
        assert rec.output_ids == ref.output_ids and rec.logprobs == ref.logprobs


async def test_sleep_with_requests_in_flight_loses_nothing(tiny_model_dir: Path) -> None:
    engine = EmbeddedEngine(tiny_model_dir, max_batch_size=3)
    long = RequestSampling(temperature=1.0, max_new_tokens=120, ignore_eos=True)
    prompts = [list(range(30 + i, 50 + i)) for i in range(5)]  # 3 running, 2 waiting for a slot
    async with served(engine) as client:
        tasks = [asyncio.create_task(engine.generate(p, long, f"r{i}")) for i, p in enumerate(prompts)]
        while engine.stats["decode_steps"] < 3:
            await asyncio.sleep(0.005)
        await client.release_memory_occupation()
        assert not engine.scheduler.in_flight  # taken out, tokens kept, held until the wake
        made = [len(engine._requests[f"r{i}"].output_ids) for i in range(5)]
        assert any(made) and not any(t.done() for t in tasks)
        await client.resume_memory_occupation()
        recs = await asyncio.wait_for(asyncio.gather(*tasks), 300)
    assert [r.finish_reason["type"] for r in recs] == ["length"] * 5
    assert all(len(r.output_ids) == 120 for r in recs)
    assert all(r.output_ids[:n] == list(r.output_ids[:n]) for r, n in zip(recs, made, strict=True))
    assert not engine.scheduler.in_flight and not engine._requests


async def test_weight_update_while_asleep(tiny_model_dir: Path) -> None:
    engine = EmbeddedEngine(tiny_model_dir, max_batch_size=2)
    new = {n: p.detach() + 0.01 for n, p in engine.model.named_parameters()}
    async with served(engine) as client:
        await client.release_memory_occupation()
        packed = pack_named_tensors(list(new.items()))
        try:  # weights released: refused, and nothing changes
            with pytest.raises(EngineRequestError, match="resume_memory_occupation with tags"):
                await client.update_weights_from_tensor([packed.payload], packed.load_format, "1")
            with pytest.raises(EngineRequestError, match="the weights are released"):
                await client.update_weights_from_disk(str(tiny_model_dir), "1")
            await client.resume_memory_occupation(["weights"])
            # only the KV cache released: the update applies (nothing is generating)
            await client.update_weights_from_tensor([packed.payload], packed.load_format, "2")
        finally:
            packed.close()
        await client.resume_memory_occupation(["kv_cache"])
        assert engine.weight_version == "2"
        got = dict(engine.model.named_parameters())
        assert all(torch.equal(got[n], t) for n, t in new.items())
        rec = await engine.generate(list(range(10, 30)), _greedy(4), "after")
        assert rec.weight_version == "2" and len(rec.output_ids) == 4


# ------------------------------------------------------------------------- trainer: offload, in memory
def _trainer_job(model_dir: str, out: str, offload: bool) -> None:
    """Three train steps (offload + onload between them when asked), then the weights to two engines:
    one in memory, one by disk. Writes the trainer's final weights and the engines' weights."""
    import warnings

    warnings.filterwarnings("ignore")
    sys.path.insert(0, TESTS)
    from _trainer_helpers import dist_env, make_trajectories

    from agentrl.cluster import free_port

    dist_env(0, 1, free_port())
    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.trainer import MegatronTrainer

    cfg = TrainerConfig(model_path=model_dir, lr=1e-3, micro_batch_size=2, weight_decay=0.01)
    tr = MegatronTrainer(cfg)
    moved = 0.0
    for step in range(3):
        tr.train_step(make_trajectories(tr.arch.vocab_size, seed=step, version=tr.policy_version))
        if offload:
            moved = tr.offload()["offload_gb"]
            assert all(p.untyped_storage().nbytes() == 0 for p in tr.module.parameters())
            try:
                tr.train_step(make_trajectories(tr.arch.vocab_size, seed=99))
                raise AssertionError("trained while offloaded")
            except RuntimeError as err:
                assert "offloaded" in str(err)
            tr.onload()
    result = {"weights": tr.hf_state_dict(), "moved_gb": moved}

    async def to_engines() -> None:
        a = EmbeddedEngine(model_dir, max_batch_size=2)
        b = EmbeddedEngine(model_dir, max_batch_size=2)
        async with served(a) as ca, served(b) as cb:
            await tr.connect_engines(WeightUpdate("tensor"), ca)
            await tr.sync_weights()
            await tr.disconnect_engines()
            await tr.connect_engines(WeightUpdate("disk", out_dir=f"{out}.hf"), cb)
            await tr.sync_weights()
            await tr.disconnect_engines()
            result["tensor"] = {n: p.detach().clone() for n, p in a.model.state_dict().items()}
            result["disk"] = {n: p.detach().clone() for n, p in b.model.state_dict().items()}
            result["versions"] = (a.weight_version, b.weight_version)

    asyncio.run(to_engines())
    torch.save(result, out)
    tr.shutdown()


def _run_job(model_dir: Path, out: Path, offload: bool) -> dict:
    code = (
        f"import sys; sys.path.insert(0, {TESTS!r}); from test_colocate import _trainer_job; "
        f"_trainer_job({str(model_dir)!r}, {str(out)!r}, {offload})"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


def test_trainer_offload_keeps_steps_bit_identical_and_tensor_sync_equals_disk(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    plain = _run_job(tiny_model_dir, tmp_path / "plain.pt", offload=False)
    moved = _run_job(tiny_model_dir, tmp_path / "offload.pt", offload=True)
    assert moved["moved_gb"] > 0
    # after offload + onload between every step, the next steps are the same bits
    assert plain["weights"].keys() == moved["weights"].keys()
    assert all(torch.equal(plain["weights"][k], moved["weights"][k]) for k in plain["weights"])
    # weights handed over in memory equal the ones loaded from disk, bit for bit
    for run in (plain, moved):
        assert run["versions"] == ("1", "2")
        assert run["tensor"].keys() == run["disk"].keys()
        assert all(torch.equal(run["tensor"][k], run["disk"][k]) for k in run["tensor"])
    from agentrl.trainer.model import load_hf_state_dict

    init = load_hf_state_dict(tiny_model_dir)["model.embed_tokens.weight"]
    assert not torch.equal(plain["tensor"]["model.embed_tokens.weight"], init)  # the trained weights arrived


# ------------------------------------------------------------------------- the trainer's onload, ahead
class _Trainer:
    """Records when each onload ran (and that none ran before the offload it follows ended)."""

    def __init__(self, offloaded: asyncio.Future | None = None) -> None:
        self.onloads: list[float] = []
        self.offloaded = offloaded

    async def onload(self) -> dict[str, float]:
        assert self.offloaded is None or self.offloaded.done(), "onload before the offload ended"
        self.onloads.append(time.monotonic())
        return {}


async def test_onload_ahead_starts_at_its_lead_or_when_the_batch_is_in() -> None:
    from agentrl.handover import OnloadAhead

    assert OnloadAhead(enabled=False).start(_Trainer(), None) is None
    ahead = OnloadAhead(enabled=True)
    assert ahead.lead is None and ahead.start(_Trainer(), None) is None  # nothing measured yet
    ahead.observe(0.9, {"time/train_s": 1.0})  # a step without an onload teaches nothing
    assert ahead.lead is None
    ahead.observe(0.9, {"time/trainer_onload_s": 0.3})
    ahead.observe(0.6, {"time/trainer_onload_s": 0.1})
    assert ahead.lead == pytest.approx(0.6 - 0.3 - OnloadAhead.MARGIN_S)  # earliest batch, slowest onload
    for _ in range(OnloadAhead.HISTORY):
        ahead.observe(5.0, {"time/trainer_onload_s": 0.1})
    assert ahead.lead == pytest.approx(5.0 - 0.1 - OnloadAhead.MARGIN_S)  # the old steps are forgotten

    # no batch before the lead: the onload starts at it
    ahead.waits, ahead.onloads = [0.5], [0.1]
    trainer = _Trainer()
    t0 = time.monotonic()
    seconds = await ahead.start(trainer, None)
    assert 0.3 <= trainer.onloads[0] - t0 < 2.0 and seconds >= 0
    # the batch in before the lead: the onload starts then
    ahead.waits = [30.0]
    t0 = time.monotonic()
    onloading = ahead.start(trainer, None)
    await asyncio.sleep(0.05)
    assert len(trainer.onloads) == 1
    ahead.now()
    await asyncio.wait_for(onloading, 5)
    assert trainer.onloads[1] - t0 < 5.0
    # a lead of 0 still waits for the last step's offload to end
    ahead.waits, ahead.onloads = [0.0], [0.0]
    offloading = asyncio.get_running_loop().create_future()
    trainer = _Trainer(offloading)
    onloading = ahead.start(trainer, offloading)
    await asyncio.sleep(0.05)
    assert not trainer.onloads
    offloading.set_result(0.2)
    await asyncio.wait_for(onloading, 5)
    assert len(trainer.onloads) == 1 and offloading.result() == 0.2  # still there for Handover.to_trainer


# ------------------------------------------------------------------- the hand-over back to the engines
class _OneCallAtATime:
    """A trainer that answers one call at a time, as each rank's Ray actor does; its offload takes
    ``offload_s``."""

    def __init__(self, offload_s: float) -> None:
        self.offload_s = offload_s
        self.busy = asyncio.Lock()
        self.offload_done: float | None = None

    async def _call(self, seconds: float = 0.0, answer: object = None) -> object:
        async with self.busy:
            await asyncio.sleep(seconds)
            return answer

    async def sync_weights(self) -> object:
        return await self._call(0.01, 1)

    async def last_sync_stats(self) -> object:
        return await self._call(0.0, {"gather_seconds": 0.002, "pack_seconds": 0.003, "seconds": 0.008})

    async def release_cached_memory(self) -> object:
        return await self._call()

    async def offload(self) -> object:
        await self._call(self.offload_s)
        self.offload_done = time.monotonic()
        return {}


class _Engines:
    async def resume_memory_occupation(self, tags: list[str]) -> None:
        await asyncio.sleep(0.01)  # a request to every engine: the offload's call goes out meanwhile


async def test_engines_get_the_gpu_back_while_the_trainer_still_offloads() -> None:
    from types import SimpleNamespace

    from agentrl.handover import Handover

    colocation = SimpleNamespace(mode="turns", engine_release="all", trainer_offload="after_batch")
    cfg = SimpleNamespace(placement="colocated", colocation=colocation)
    trainer = _OneCallAtATime(offload_s=1.5)
    handover = Handover(cfg, trainer, rollout=None, control=_Engines())  # type: ignore[arg-type]
    t0 = time.monotonic()
    assert await handover.to_engines() == 1
    returned = time.monotonic()
    # the rollout resumes now; the offload goes on beside the next generation
    assert returned - t0 < 1.0 and trainer.offload_done is None
    assert handover.phases["time/weight_sync_push_s"] == pytest.approx(0.005)
    assert handover._offloading is not None
    assert await asyncio.wait_for(handover._offloading, 5) >= 1.4
    assert trainer.offload_done is not None and trainer.offload_done > returned
