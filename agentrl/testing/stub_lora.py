"""The TEST STAND-IN's LoRA adapters (:mod:`agentrl.testing.stub_engine` with ``enable_lora``): SGLang
0.5.16's adapter endpoints and their bookkeeping, with no model behind them.

What it keeps of SGLang (read in its source; see :mod:`agentrl.weight_sync.named_adapters` for the files):

* ``/load_lora_adapter {lora_name, lora_path}`` reads a PEFT dir (``adapter_config.json``,
  ``adapter_model.safetensors``); ``/load_lora_adapter_from_tensors {lora_name, config_dict,
  serialized_tensors, load_format}`` takes a base64 pickle of a ``{PEFT name: tensor}`` dict (the stand-in
  unpickles torch, builtins and collections only, as SGLang's restricted unpickler allows). A loaded name
  is refused; so is an adapter of a rank above ``--max-lora-rank`` or with a module outside
  ``--lora-target-modules`` (HF names normalized to SGLang's fused ``qkv_proj`` / ``gate_up_proj``). The
  modules of a layer are stacked as SGLang stacks them: q/k/v need ``q_proj`` and ``v_proj``, and an
  ``up_proj`` without ``gate_proj`` is not applied (:attr:`StubAdapter.applied` lists what would be).
  Failures answer 400 ``{"success": false, "error_message": ...}``. Beyond ``max_loaded_loras`` the least
  recently used adapter is unloaded after a load.
* ``/unload_lora_adapter {lora_name}`` refuses an unknown name; otherwise the name goes at once and the
  adapter once the requests using it have ended.
* ``/generate`` with ``lora_path`` (the adapter's name) waits out a pause first, then looks the name up:
  LoRA off, or a name never loaded, answers 400; a name loaded once and unloaded since is loaded again
  from its path (a tensor load's path, ``__tensor__``, cannot be: 400).
* ``GET /v1/models``: the base model's card, then one per adapter with ``parent`` the base model.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import pickle
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FUSED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
TENSOR_PATH = "__tensor__"  # SGLang's lora_path of an adapter loaded from tensors


class AdapterError(ValueError):
    """A refused adapter operation (SGLang answers 400 with the message)."""


@dataclass
class StubAdapter:
    """One loaded adapter: its id (new at every load, as SGLang's), path, rank and the modules it applies."""

    name: str
    path: str
    rank: int
    applied: set[str]
    id: str = field(default_factory=lambda: uuid.uuid4().hex)


class _TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] in ("torch", "builtins", "collections", "copyreg"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"not allowed: {module}.{name}")


def _normalized(modules: list[str]) -> set[str]:
    return {FUSED.get(m.split(".")[-1], m.split(".")[-1]) for m in modules}


def _applied_modules(names: list[str]) -> set[str]:
    """The modules SGLang applies from these PEFT tensor names (its stacking per layer, see the docstring)."""
    by_layer: dict[str, set[str]] = {}
    for n in names:
        if ".lora_A." in n:
            stem = n.split(".lora_A.")[0]
            layer, _, module = stem.rpartition(".")
            by_layer.setdefault(layer, set()).add(module)
    applied: set[str] = set()
    for layer, modules in sorted(by_layer.items()):
        if modules & {"q_proj", "k_proj", "v_proj"}:
            missing = {"q_proj", "v_proj"} - modules
            if missing:  # SGLang's normalize_qkv_proj looks them up: a KeyError, the load fails
                raise AdapterError(f"'{layer}.{sorted(missing)[0]}.lora_A.weight'")
            applied.add("qkv_proj")
        if "gate_proj" in modules:
            applied.add("gate_up_proj")  # a missing up_proj is filled with zeros
        applied |= modules - set(FUSED)  # o_proj, down_proj; an up_proj without gate_proj is not applied
    return applied


class StubAdapters:
    """The adapters of one stand-in engine (see the module docstring)."""

    def __init__(self, enable: bool, max_rank: int, target_modules: list[str], max_loaded: int) -> None:
        self.enable = enable
        self.max_rank = max_rank
        self.targets = _normalized(target_modules)
        self.max_loaded = max_loaded  # 0: no limit
        self.loaded: OrderedDict[str, StubAdapter] = OrderedDict()  # least recently used first
        self.paths: dict[str, str] = {}  # every name ever loaded -> its path (SGLang reloads from it)
        self.users: Counter[str] = Counter()  # adapter id -> requests using it
        self.freed = asyncio.Event()
        self.log: list[str] = []  # the adapter (or "base") of every /generate, in the order they ran
        self.refused: list[str] = []  # the adapters of the /generate refused (not loaded, cannot load)
        self.unloaded: list[str] = []

    def server_args(self) -> dict[str, Any]:
        """SGLang's server arguments about LoRA, as ``/get_server_info`` reports them."""
        return {
            "enable_lora": True if self.enable else None,
            "max_lora_rank": self.max_rank or None,
            "lora_target_modules": sorted(self.targets) or None,
            "max_loaded_loras": self.max_loaded or None,
        }

    def model_cards(self, base: str) -> list[dict[str, Any]]:
        cards = [{"id": base, "object": "model", "root": base, "parent": None}]
        return cards + [
            {"id": a.name, "object": "model", "root": a.path, "parent": base} for a in self.loaded.values()
        ]

    # ---- load / unload ---------------------------------------------------------------------------
    async def load(self, body: dict[str, Any], from_tensors: bool) -> StubAdapter:
        if not self.enable:
            raise AdapterError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        name = str(body.get("lora_name") or "")
        if name in self.loaded:
            raise AdapterError(f"Failed to load LoRA adapter {name} because it is already loaded")
        if from_tensors:
            config, names, path = body["config_dict"], self._tensor_names(body), TENSOR_PATH
        else:
            path = str(body.get("lora_path") or "")
            config, names = self._read_dir(path)
        rank = int(config["r"])
        if rank > self.max_rank or not _normalized(list(config["target_modules"])) <= self.targets:
            raise AdapterError(
                f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA memory pool "
                "configuration (--max-lora-rank, --lora-target-modules)"
            )
        adapter = StubAdapter(name, path, rank, _applied_modules(names))
        self.loaded[name] = adapter
        self.paths[name] = path
        while self.max_loaded and len(self.loaded) > self.max_loaded:  # the least recently used goes
            await self.unload(next(iter(self.loaded)))
        return adapter

    @staticmethod
    def _read_dir(path: str) -> tuple[dict[str, Any], list[str]]:
        from safetensors import safe_open

        try:
            config = json.loads((Path(path) / "adapter_config.json").read_text())
            with safe_open(str(Path(path) / "adapter_model.safetensors"), "pt") as f:
                return config, list(f.keys())
        except (OSError, ValueError) as err:
            raise AdapterError(f"cannot load the adapter from {path}: {err}") from None

    @staticmethod
    def _tensor_names(body: dict[str, Any]) -> list[str]:
        import torch

        if body.get("load_format") not in (None, ""):
            raise AdapterError(f"the stand-in reads load_format None only, not {body.get('load_format')!r}")
        try:
            data = _TensorUnpickler(io.BytesIO(base64.b64decode(body["serialized_tensors"]))).load()
        except (KeyError, ValueError, pickle.UnpicklingError, EOFError) as err:
            raise AdapterError(f"serialized_tensors: {err}") from None
        if not isinstance(data, dict) or not all(torch.is_tensor(t) for t in data.values()):
            raise AdapterError("serialized_tensors must hold a {name: tensor} dict")
        return list(data)

    async def unload(self, name: str) -> None:
        adapter = self.loaded.pop(name, None)
        if adapter is None:
            raise AdapterError(f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.loaded)}")
        while self.users[adapter.id] > 0:  # the name is gone; the adapter stays for its running requests
            self.freed.clear()
            await self.freed.wait()
        self.users.pop(adapter.id, None)
        self.unloaded.append(name)

    # ---- requests --------------------------------------------------------------------------------
    async def acquire(self, name: str | None) -> str | None:
        """The adapter id a ``/generate`` naming ``name`` runs with (counted until :meth:`release`)."""
        if not name:
            self.log.append("base")
            return None
        try:
            await self._look_up(name)
        except AdapterError:
            self.refused.append(name)
            raise
        self.loaded.move_to_end(name)
        self.log.append(name)
        adapter = self.loaded[name]
        self.users[adapter.id] += 1
        return adapter.id

    async def _look_up(self, name: str) -> None:
        if not self.enable:
            raise AdapterError(f"LoRA adapter '{name}' was requested, but LoRA is not enabled.")
        if name not in self.loaded:
            if name not in self.paths:
                raise AdapterError(f"Got LoRA adapter that has never been loaded: {name}")
            try:  # SGLang loads a once-loaded adapter again from its path
                await self.load({"lora_name": name, "lora_path": self.paths[name]}, from_tensors=False)
            except AdapterError as err:
                raise AdapterError(f"Failed to implicitly load LoRA adapter {name}: {err}") from None

    def release(self, adapter_id: str | None) -> None:
        if adapter_id is not None:
            self.users[adapter_id] -= 1
            self.freed.set()
