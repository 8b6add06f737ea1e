"""LoRA weight sync to engines that serve adapters by name: SGLang launched with ``--enable-lora`` keeps
the base weights resident and applies an adapter only to the requests that name it, so every sync loads
the trainer's adapters as a new adapter, ``agentrl-v{version}``, has the engines' clients name it, and
unloads the previous one (:class:`NamedAdapterSync`: the ``lora_named`` payload, chosen by
:func:`agentrl.weight_sync.registry.connect` for engines whose server info says ``enable_lora``, over
every transport).

What it relies on, read in SGLang 0.5.16's source (``srt/lora/lora_registry.py``,
``srt/lora/lora_manager.py``, ``srt/lora/lora.py``, ``srt/managers/tokenizer_control_mixin.py``,
``tokenizer_manager.py``, ``tp_worker.py``, ``srt/entrypoints/http_server.py``):

* ``/load_lora_adapter {lora_name, lora_path, pinned}`` reads a PEFT dir;
  ``/load_lora_adapter_from_tensors {lora_name, config_dict, serialized_tensors, load_format, pinned}``
  takes the adapter in the request: ``serialized_tensors`` is one string (not one per TP rank) that every
  TP rank unpickles (``MultiprocessingSerializer.deserialize``: base64, then a pickle restricted to torch,
  builtins and collections, among others) into a ``{PEFT name: tensor}`` dict. A plain pickle of CPU
  tensors carries their bytes, so it needs no shared memory and no CUDA IPC handle; the adapters are
  small (1.5-3% of the model at rank 8-16). A name that is loaded already is refused (400, "already
  loaded"), so every version gets its own: ``agentrl-v{version}``
  (:func:`agentrl.engine.adapters.adapter_name`). A load leaves the reported weight version as it was:
  ``/update_weight_version`` (with ``abort_all_requests`` false; SGLang's default is true) follows it.
* ``/unload_lora_adapter {lora_name}`` takes the name away from new requests at once, then waits until
  every running request that uses the adapter has ended before freeing it (a per-adapter count of
  requests, ``LoRARegistry.wait_for_unload``); so the old version is unloaded right after the new one
  serves, without waiting on the requests here. A request that still names the old adapter is refused,
  or SGLang loads that adapter again from the path it was loaded from (it remembers every name it has
  loaded): a tensor load's path (``__tensor__``) cannot be loaded again, and a disk load's directory is
  removed before the unload, so such a request fails (the client then names the new adapter,
  :mod:`agentrl.engine.adapters`) instead of running a stale adapter. SGLang's prefix cache is keyed by the
  adapter's id, so no KV computed under one version is reused under another.
* In a run the engines are paused for the sync (``/pause_generation`` in abort mode returns once no request
  is left), so no request uses the old adapter when it is unloaded. A request that reaches a paused
  SGLang waits, and looks its adapter name up only once generation continues; the requests the rollout
  resubmits after the update are built after ``continue_generation``, and name the new adapter.
* SGLang stacks the PEFT modules of a layer into its fused ``qkv_proj`` and ``gate_up_proj``
  (``LoRAAdapter.normalize_qkv_proj`` and ``normalize_gate_up_proj``): q/k/v need ``q_proj`` and ``v_proj``
  (a missing ``k_proj`` is filled with zeros), gate/up need ``gate_proj`` (a lone ``up_proj`` is not
  applied to those layers). agentrl's trainer fuses them the same way, one ``A`` per layer with the rows of
  ``B`` of non-target modules masked to zero, so :func:`complete_fused_groups` sends the missing modules of
  a group as they are in the trainer (the same ``A``, a zero ``B``): the function served is the trainer's
  for every choice of ``trainer.lora.target_modules``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import pickle
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from agentrl.engine.adapters import adapter_name, adapter_version
from agentrl.engine.client import EngineRequestError
from agentrl.trainer.lora import PEFT_PREFIX, adapter_config, save_peft_dir
from agentrl.weight_sync.update import RankSide, WeightUpdate, push_stats

log = logging.getLogger("agentrl.weight_sync")

__all__ = [
    "FUSED_GROUPS",
    "NamedAdapterSync",
    "adapter_payload",
    "complete_fused_groups",
    "connect_named_adapters",
]


# the HF modules one fused layer of the trainer (and of SGLang) computes, with the prefix of their PEFT names
FUSED_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("self_attn.", ("q_proj", "k_proj", "v_proj")),
    ("mlp.", ("gate_proj", "up_proj")),
)


def _module_rows(model_path: str | Path) -> dict[str, int]:
    """The output rows of each adaptable HF module, from the model's ``config.json``."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    kv = int(cfg.get("num_key_value_heads") or heads) * head_dim
    ffn = int(cfg["intermediate_size"])
    return {"q_proj": heads * head_dim, "k_proj": kv, "v_proj": kv, "gate_proj": ffn, "up_proj": ffn}


def complete_fused_groups(
    peft: dict[str, torch.Tensor], lora: Any, model_path: str | Path
) -> tuple[dict[str, torch.Tensor], Any]:
    """``peft`` with every module of each touched fused group (q/k/v, gate/up), and the LoRA config naming
    them. A module that is no target gets the group's ``A`` (shared by the fused layer) and a zero ``B``,
    which is what the trainer's masked fused adapter computes for it; SGLang then stacks complete groups
    (module docstring). ``peft`` itself is returned when every group is complete already."""
    targets = set(lora.target_modules)
    missing = {m for _, group in FUSED_GROUPS if targets & set(group) for m in group} - targets
    if not missing:
        return peft, lora
    rows = _module_rows(model_path)
    out = dict(peft)
    for name, a in peft.items():
        if not name.endswith(".lora_A.weight"):
            continue
        stem = name.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")  # model.layers.3.mlp.up_proj
        layer, _, module = stem.rpartition(".")
        for prefix, group in FUSED_GROUPS:
            if module not in group or not layer.endswith(prefix.rstrip(".")):
                continue
            b = peft[name.replace(".lora_A.", ".lora_B.")]
            for other in group:
                key = f"{PEFT_PREFIX}{layer}.{other}.lora_%s.weight"
                if other in missing and key % "A" not in out:
                    out[key % "A"] = a.clone()  # a tensor of its own: a PEFT file holds no shared ones
                    out[key % "B"] = torch.zeros(rows[other], b.shape[1], dtype=b.dtype)
    return out, lora.model_copy(update={"target_modules": sorted(targets | missing)})


def adapter_payload(tensors: dict[str, torch.Tensor]) -> str:
    """SGLang's ``serialized_tensors`` of ``/load_lora_adapter_from_tensors``: the base64 of a pickle of
    ``{name: tensor}`` with CPU tensors, which carries their bytes (module docstring). The storages are
    named as torch's own ``torch.storage._load_from_bytes`` (:func:`_storages_named_by_torch`)."""
    named = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in tensors.items()}
    with _storages_named_by_torch():
        blob = pickle.dumps(named, protocol=pickle.HIGHEST_PROTOCOL)
    return base64.b64encode(blob).decode()


_PICKLE_LOCK = threading.Lock()


@contextlib.contextmanager
def _storages_named_by_torch() -> Iterator[None]:
    """While pickling: a CPU storage pickles as a call of ``torch.storage._load_from_bytes``, the function
    found there when it is pickled. megatron-core 0.19 puts a function of its own there at import
    (``megatron.core.safe_globals.safe_load_from_bytes``), which a pickle then names, and SGLang's restricted
    unpickler refuses every module outside torch and a few others. For the pickle, the name holds a function
    that says it is torch's (and calls the one in place); the unpickling process, without megatron, finds
    torch's own there."""
    current = torch.storage._load_from_bytes
    if getattr(current, "__module__", None) == "torch.storage":
        yield
        return

    def _load_from_bytes(b: bytes) -> Any:
        return current(b)

    _load_from_bytes.__module__ = "torch.storage"
    _load_from_bytes.__qualname__ = "_load_from_bytes"
    with _PICKLE_LOCK:
        torch.storage._load_from_bytes = _load_from_bytes
        try:
            yield
        finally:
            torch.storage._load_from_bytes = current


class NamedAdapterSync:
    """LoRA, every mode, to engines that apply an adapter only to the requests that name it (SGLang
    launched with ``--enable-lora``; the base weights stay resident and are never pushed).

    Each push loads the adapters of version ``v`` under their own name, ``agentrl-v{v}``: from a PEFT dir
    ``out_dir/agentrl-v{v}`` (``disk``) or in the request (the other modes: SGLang has no broadcast path for
    adapters, and in the request they need neither shared memory nor CUDA IPC). Then the engines report
    version ``v`` (``/update_weight_version``), this rank's client names the new adapter in every later
    ``/generate`` (the rollout's client finds it in the engines' adapter list, see
    :mod:`agentrl.engine.adapters`), and the previous version's adapter is unloaded (SGLang lets running
    requests that use it finish first) and its dir removed. The first push also unloads ``agentrl-v*``
    adapters an earlier trainer left on the engines. Module docstring: the SGLang facts this rests on."""

    gather_device = "cpu"

    def __init__(
        self, client: Any, model_path: str | Path, lora: Any, out_dir: str | Path | None = None
    ) -> None:
        self.client = client
        self.pushes = client is not None
        self.model_path = model_path
        self.lora = lora
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.loaded: str | None = None  # the adapter this sync loaded last (the one served)
        self._swept = False

    async def push(self, hf: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        name = adapter_name(version)
        tensors, lora = complete_fused_groups(hf, self.lora, self.model_path)
        if not self._swept:  # engines kept from an earlier trainer may hold its adapters
            await self._unload_stale()
            self._swept = True
        if self.loaded == name:  # the same version once more (a resume's push): it replaces the loaded one
            await self._retire(name)
            self.loaded = None
        pack_seconds = 0.0
        if self.out_dir is not None:
            path = self.out_dir / name
            await asyncio.to_thread(save_peft_dir, tensors, lora, path, str(self.model_path))
            await self.client.load_lora_adapter(name, str(path))
        else:
            payload = await asyncio.to_thread(adapter_payload, tensors)
            pack_seconds = time.perf_counter() - t0
            config = adapter_config(lora, str(self.model_path))
            await self.client.load_lora_adapter_from_tensors(name, config, payload)
        await self.client.update_weight_version(str(version), abort_all_requests=False)
        self.client.use_adapter(name)
        previous, self.loaded = self.loaded, name
        if previous is not None:
            await self._retire(previous)
        return {**push_stats(t0, tensors), "pack_seconds": pack_seconds}

    async def _retire(self, name: str) -> None:
        """Remove ``name``'s dir (so SGLang cannot load it again for a late request), then unload it. An
        engine that no longer holds it (SGLang unloads the least recently used adapter beyond
        ``--max-loaded-loras`` by itself) is only logged: the new adapter serves either way."""
        if self.out_dir is not None:
            await asyncio.to_thread(shutil.rmtree, self.out_dir / name, True)
        try:
            await self.client.unload_lora_adapter(name)
        except EngineRequestError as err:
            log.warning("adapter %s was not unloaded: %s", name, err)

    async def _unload_stale(self) -> None:
        """Unload, engine by engine, the ``agentrl-v*`` adapters an earlier trainer left loaded."""
        for url, names in (await self.client.loaded_adapters()).items():
            for name in sorted(n for n in names if adapter_version(n) is not None):
                log.info("unloading adapter %s that an earlier trainer left on %s", name, url)
                await self.client.unload_lora_adapter(name, urls=[url])

    async def close(self, timeout: float = 30.0) -> bool:
        return True


async def connect_named_adapters(update: WeightUpdate, side: RankSide) -> NamedAdapterSync:
    """The adapters under a name per version, from a PEFT dir under ``out_dir`` (disk) or in the request."""
    disk = update.transport == "disk"
    if disk and update.out_dir is None:
        raise ValueError("weight sync from disk needs out_dir (where the PEFT dirs are written)")
    return NamedAdapterSync(side.client, side.model_path, side.lora, update.out_dir if disk else None)
