"""LoRA adapters in the embedded engine: an adapter update merges ``W = W_base + s · B @ A`` into the
served weights in place (the forward and its CUDA graphs are unchanged), with a copy of each adapted
base weight kept in host memory so that the next adapter merges from the base, not from the previous
merge.

An adapter is PEFT's form: tensors ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and
``...lora_B.weight`` ``[out, r]`` per HF module, and ``adapter_config.json``'s ``r`` and ``lora_alpha``
(``s = alpha / r``; ``alpha / sqrt(r)`` with ``use_rslora``); an adapter broadcast over a weight-update
group (``/update_weights_from_distributed``, whose protocol has no place for the scale) arrives with
``s · B`` in place of ``B`` and merges with scale 1. :func:`agentrl.models.lora.merged_weight` is the one
merge formula; the trainer's merged HF weights use it too, so an engine that merged an adapter and one
that loaded the trainer's merged weights serve the same bits.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import torch

from agentrl.embedded.sampling import EngineBadRequest
from agentrl.models.lora import merged_weight

PEFT_PREFIX = "base_model.model."


def is_adapter_tensor(name: str) -> bool:
    """Whether ``name`` is a PEFT LoRA tensor's name."""
    return name.startswith(PEFT_PREFIX) and name.endswith((".lora_A.weight", ".lora_B.weight"))


def peft_scale(config: dict) -> float:
    """The adapter's output scale from a PEFT ``adapter_config.json`` mapping."""
    try:
        r = int(config["r"])
        alpha = float(config.get("lora_alpha", r))
    except (KeyError, TypeError, ValueError):
        raise EngineBadRequest("the adapter config needs r (and lora_alpha)") from None
    if r <= 0:
        raise EngineBadRequest(f"the adapter config's r must be positive, not {r}")
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def read_peft_dir(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """``adapter_config.json`` and the tensors of ``adapter_model.safetensors`` in a PEFT dir."""
    from safetensors.torch import load_file

    d = Path(path)
    if not (d / "adapter_config.json").is_file() or not (d / "adapter_model.safetensors").is_file():
        raise EngineBadRequest(
            f"{str(d)!r} is not a PEFT adapter dir (adapter_config.json, adapter_model.safetensors)"
        )
    return json.loads((d / "adapter_config.json").read_text()), load_file(
        str(d / "adapter_model.safetensors")
    )


def adapter_pairs(
    params: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{weight name: (A, B)}`` of a PEFT state dict for a model with parameters ``params``; raises
    :class:`EngineBadRequest` naming every tensor that has no partner, no target weight or no fitting shape
    (before anything changes)."""
    pairs, errors = {}, []
    for name, a in tensors.items():
        if name.endswith(".lora_B.weight"):
            if name.replace(".lora_B.", ".lora_A.") not in tensors:
                errors.append(f"{name}: no lora_A")
            continue
        if not name.endswith(".lora_A.weight"):
            errors.append(f"{name}: not a LoRA tensor")
            continue
        b = tensors.get(name.replace(".lora_A.", ".lora_B."))
        weight = name.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight") + ".weight"
        w = params.get(weight)
        if b is None:
            errors.append(f"{name}: no lora_B")
        elif w is None:
            errors.append(f"{name}: no weight {weight} in the served model")
        elif (
            a.dim() != 2
            or b.dim() != 2
            or (b.shape[0], a.shape[1]) != tuple(w.shape)
            or a.shape[0] != b.shape[1]
        ):
            errors.append(
                f"{name}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit {weight} {tuple(w.shape)}"
            )
        else:
            pairs[weight] = (a, b)
    if errors:
        raise EngineBadRequest("the adapter does not fit the served model: " + "; ".join(errors[:10]))
    if not pairs:
        raise EngineBadRequest("the adapter holds no LoRA tensors")
    return pairs


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in host memory (pinned when ``t`` is on a GPU: the GPU keeps the weights once, and a
    memory release frees them as before)."""
    if t.device.type == "cuda":
        return t.detach().to("cpu", copy=True).pin_memory()
    return t.detach().clone()


class MergedAdapter:
    """The served model's base copies of its adapted weights, and the merges of adapters into it."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}  # weight name -> the base weight (a host copy)
        self.name: str | None = None  # the loaded adapter's lora_name

    @torch.no_grad()
    def load(
        self,
        model: torch.nn.Module,
        pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
        scale: float,
        name: str,
    ) -> None:
        """Merge an adapter (:func:`adapter_pairs`) into ``model``'s weights in place; weights a previous
        adapter changed and this one does not get their base back."""
        params = model.state_dict(keep_vars=True)
        for weight in list(self.base):
            if weight not in pairs:
                params[weight].data.copy_(self.base.pop(weight))
        for weight, (a, b) in pairs.items():
            dst = params[weight].data
            base = self.base.get(weight)
            if base is None:  # the first adapter on this weight: keep its base (once, not at every merge)
                base = self.base[weight] = _host_copy(dst)
            dst.copy_(merged_weight(base.to(dst.device, non_blocking=True), a, b, scale))
        self.name = name

    @torch.no_grad()
    def unload(self, model: torch.nn.Module) -> None:
        """Put the base weights back and forget them."""
        params = model.state_dict(keep_vars=True)
        for weight, base in self.base.items():
            params[weight].data.copy_(base)
        self.base.clear()
        self.name = None

    def forget(self, names: list[str]) -> None:
        """A full weight update replaced ``names``: they are the new base, their old copies go."""
        for n in names:
            self.base.pop(n, None)
        if not self.base:
            self.name = None

    @property
    def num_bytes(self) -> int:
        """Memory the base copies take."""
        return sum(t.numel() * t.element_size() for t in self.base.values())


class AdapterEndpoints:
    """SGLang's LoRA endpoints on the embedded engine (mixed into :class:`~agentrl.embedded.engine.
    EmbeddedEngine`, whose ``model``, ``device``, ``lora`` (a :class:`MergedAdapter`), ``_update``,
    ``_on_device``, ``_unpacked`` and ``_check_weights_resident`` they use): an adapter is merged into
    the served weights, so every request runs base + adapter."""

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, weight_version: str | None, abort_all: bool, flush: bool = True
    ) -> None:
        """SGLang's ``/load_lora_adapter`` (a PEFT dir), merged into the served weights: every request then
        runs base + adapter (:mod:`agentrl.embedded.lora`; SGLang instead serves it by name per request)."""
        try:
            config, tensors = await asyncio.to_thread(read_peft_dir, lora_path)
        except (OSError, ValueError) as err:
            raise EngineBadRequest(f"cannot load the adapter from {lora_path!r}: {err}") from None
        await self._merge_adapter(lora_name, config, tensors, abort_all, weight_version, flush)

    async def load_lora_adapter_from_tensors(
        self,
        lora_name: str,
        config_dict: dict,
        serialized_tensors: str,
        load_format: str | None,
        weight_version: str | None,
        abort_all: bool,
        flush: bool = True,
    ) -> None:
        """SGLang's ``/load_lora_adapter_from_tensors``: a PEFT state dict in memory (a payload of
        :func:`agentrl.engine.named_tensors.pack_named_tensors`) and its ``adapter_config.json`` mapping,
        merged into the served weights as :meth:`load_lora_adapter` does."""
        self._check_weights_resident()
        named, release = await self._unpacked(serialized_tensors, load_format)
        try:
            await self._merge_adapter(lora_name, config_dict, dict(named), abort_all, weight_version, flush)
        finally:
            named = None
            await self._on_device(release)

    async def _merge_adapter(
        self,
        lora_name: str,
        config: dict,
        tensors: dict[str, torch.Tensor],
        abort_all: bool,
        weight_version: str | None,
        flush: bool,
    ) -> None:
        scale = peft_scale(config)
        pairs = adapter_pairs(self.model.state_dict(keep_vars=True), tensors)

        def apply() -> None:
            self.lora.load(self.model, pairs, scale, lora_name)
            if self.device.type == "cuda":  # done reading the sender's memory before it is freed
                torch.cuda.synchronize(self.device)

        await self._update(apply, abort_all, weight_version, flush)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """SGLang's ``/unload_lora_adapter``: the base weights back."""
        if self.lora.name != lora_name:
            raise EngineBadRequest(f"no adapter {lora_name!r} is loaded (loaded: {self.lora.name})")
        await self._update(lambda: self.lora.unload(self.model), False, None)
