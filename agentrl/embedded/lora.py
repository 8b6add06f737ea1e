"""LoRA adapters in the embedded engine, applied one of two ways (``--lora-apply``, a run's
``engine.lora_apply``); every request runs base + adapter either way (one adapter at a time):

* **unmerged** (:class:`UnmergedAdapter`, the default): each adapted projection serves
  ``x W^T (+ bias) + (x A^T) (s · B)^T`` (:func:`agentrl.models.lora.lora_linear`), the trainer's own
  formula, from :class:`~agentrl.models.lora.LoraWeight` records that hold the layer's weight (a tensor,
  or its fp8 record with ``--quantization fp8``) and ``A`` / ``s · B`` buffers of a fixed rank, all in one
  device buffer. An adapter update copies the adapters into those buffers in place: no base weight is
  read or written, captured CUDA graphs stay valid, and a sync costs the adapters' bytes. Unloading zeroes
  ``B``: the adapter then adds exact zeros, the base model's bits, and the graphs stay valid (switching the
  records off would change the traced forward and need every graph captured again). The buffers' rank is
  ``--max-lora-rank`` (a run passes ``trainer.lora.rank``), so the graphs captured at start include them;
  without it they are made at the first adapter, and an adapter of a larger rank makes them again (the
  graphs then go and are captured again as buckets are used).
* **merged** (:class:`MergedAdapter`): an adapter update merges ``W = W_base + s · B @ A`` into the served
  weights in place (the forward and its CUDA graphs are unchanged), with a copy of each adapted base weight
  kept in host memory so that the next adapter merges from the base, not from the previous merge. A sync
  then moves every adapted base weight from host memory and back, the adapters' size many times over.

An adapter is PEFT's form: tensors ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and
``...lora_B.weight`` ``[out, r]`` per HF module, and ``adapter_config.json``'s ``r`` and ``lora_alpha``
(``s = alpha / r``; ``alpha / sqrt(r)`` with ``use_rslora``); an adapter broadcast over a weight-update
group (``/update_weights_from_distributed``, whose protocol has no place for the scale) arrives with
``s · B`` in place of ``B`` and applies with scale 1. :mod:`agentrl.models.lora` holds both formulas; the
trainer's merged HF weights use :func:`~agentrl.models.lora.merged_weight` too, so a merging engine and one
that loaded the trainer's merged weights serve the same bits. The engine serves HF's separate projections
(q, k, v; gate, up), so every PEFT pair has one weight; the trainer's fused layers share one ``A`` among
their modules, which the PEFT export repeats per module.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Literal

import torch

from agentrl.embedded import fp8
from agentrl.embedded.runner import ModelRunner
from agentrl.embedded.sampling import EngineBadRequest
from agentrl.models.decoder import PROJECTION_FIELDS, DecoderOps
from agentrl.models.lora import LoraWeight, lora_linear, merged_weight, scaled_b

LoraApply = Literal["unmerged", "merged"]
LORA_APPLY = ("unmerged", "merged")

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


def adapter_rank(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> int:
    """The largest rank among an adapter's pairs (:func:`adapter_pairs`)."""
    return max(a.shape[0] for a, _ in pairs.values())


class MergedAdapter:
    """The served model's base copies of its adapted weights, and the merges of adapters into it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.base: dict[str, torch.Tensor] = {}  # weight name -> the base weight (a host copy)
        self.name: str | None = None  # the loaded adapter's lora_name
        self.writes_weights = True  # a load writes the parameters (fp8 copies are quantized again)

    def check(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Any weight of the model merges (:func:`adapter_pairs` checked the shapes)."""

    def reserve(self, rank: int) -> bool:
        """Nothing to allocate: merges write the weights themselves."""
        return False

    @torch.no_grad()
    def load(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float, name: str) -> None:
        """Merge an adapter (:func:`adapter_pairs`) into the model's weights in place; weights a previous
        adapter changed and this one does not get their base back."""
        params = self.model.state_dict(keep_vars=True)
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
    def unload(self) -> None:
        """Put the base weights back and forget them."""
        params = self.model.state_dict(keep_vars=True)
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

    def tensors(self) -> list[torch.Tensor]:
        """Device memory of its own: none (the base copies are in host memory)."""
        return []

    @property
    def num_bytes(self) -> int:
        """Memory the base copies take (host)."""
        return sum(t.numel() * t.element_size() for t in self.base.values())


def lora_ops(ops: DecoderOps) -> DecoderOps:
    """``ops`` whose ``linear`` also takes :class:`~agentrl.models.lora.LoraWeight` records, each product by
    the ops' own ``linear`` (the same ops back if they take them already)."""
    if isinstance(ops.linear, partial) and ops.linear.func is lora_linear:
        return ops
    return replace(ops, linear=partial(lora_linear, linear=ops.linear))


class UnmergedAdapter:
    """:class:`~agentrl.models.lora.LoraWeight` records over a runner's layer weights (every projection
    named in the model), the buffers of their adapters, and the copies of adapters into them."""

    def __init__(self, model: torch.nn.Module, runner: ModelRunner) -> None:
        self.model, self.runner = model, runner
        self.name: str | None = None
        self.writes_weights = False  # a load writes only the adapter buffers
        self.rank = 0  # the buffers' rank (0: none yet)
        self.records: dict[str, LoraWeight] = {}  # weight name -> its record
        self.loaded: set[str] = set()  # weights whose B holds an adapter
        self._flat: torch.Tensor | None = None  # every record's A and B, one buffer
        self._names = {id(p): n for n, p in model.state_dict(keep_vars=True).items()}
        self.adaptable = {self._names[id(p)] for _, _, p in self._projections()}

    def _projections(self) -> Iterator[tuple[int, str, torch.Tensor]]:
        """(layer index, field, parameter) of every projection of the runner's layers named in the model (a
        field's fp8 record by its source parameter)."""
        for i, w in enumerate(self.runner.weights):
            for field in PROJECTION_FIELDS:
                base = getattr(w, field)
                param = base.source if isinstance(base, fp8.Fp8Weight) else base
                if param is not None and id(param) in self._names:
                    yield i, field, param

    def check(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Refuse an adapter on weights that are not a layer's projection (before anything changes)."""
        other = sorted(set(pairs) - self.adaptable)
        if other:
            raise EngineBadRequest(
                f"unmerged LoRA serves the layers' projections (q/k/v/o, gate/up/down); {other[:5]} are not: "
                "serve this adapter with --lora-apply merged"
            )

    @torch.no_grad()
    def reserve(self, rank: int) -> bool:
        """Records of rank ``rank`` at least: True when it made new buffers (an adapter in the old ones is
        copied over; the runner then serves the new records and has dropped its graphs). Call inside the
        weights' memory region: the new buffers belong to the weights, and the old ones are freed there."""
        if rank <= self.rank:
            return False
        projections = list(self._projections())
        sizes = [rank * (p.shape[0] + p.shape[1]) for _, _, p in projections]
        first = projections[0][2]
        flat = torch.zeros(sum(sizes), dtype=first.dtype, device=first.device)
        fields: list[dict[str, LoraWeight]] = [{} for _ in self.runner.weights]
        records: dict[str, LoraWeight] = {}
        at = 0
        for (i, field, param), size in zip(projections, sizes, strict=True):
            out, inp = param.shape
            a = flat[at : at + rank * inp].view(rank, inp)
            b = flat[at + rank * inp : at + size].view(out, rank)
            at += size
            name = self._names[id(param)]
            old = self.records.get(name)
            if old is not None:
                a[: self.rank].copy_(old.a)
                b[:, : self.rank].copy_(old.b)
            fields[i][field] = records[name] = LoraWeight(getattr(self.runner.weights[i], field), a, b)
        served = [replace(w, **f) for w, f in zip(self.runner.weights, fields, strict=True)]
        self.records, self.rank, self._flat = records, rank, flat
        self.runner.serve(served, lora_ops(self.runner.ops))
        return True

    @torch.no_grad()
    def load(self, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float, name: str) -> None:
        """Copy an adapter (:func:`adapter_pairs`, rank at most the buffers') into the records' buffers, ``B``
        as ``scale · B``; the records it does not cover get ``B`` zero."""
        for weight in self.loaded - set(pairs):
            self.records[weight].b.zero_()
        for weight, (a, b) in pairs.items():
            rec, r = self.records[weight], a.shape[0]
            rec.a[:r].copy_(a)
            rec.a[r:].zero_()
            rec.b[:, :r].copy_(scaled_b(b, scale, rec.b.dtype))
            rec.b[:, r:].zero_()
        self.loaded = set(pairs)
        self.name = name

    @torch.no_grad()
    def unload(self) -> None:
        """``B`` zero everywhere: the base model's bits, the buffers and graphs kept."""
        self.forget(list(self.loaded))

    @torch.no_grad()
    def forget(self, names: list[str]) -> None:
        """A full weight update replaced ``names``: they serve the new weights alone (``B`` zero), as a merged
        engine's would."""
        for n in set(names) & self.loaded:
            self.records[n].b.zero_()
            self.loaded.discard(n)
        if not self.loaded:
            self.name = None

    def tensors(self) -> list[torch.Tensor]:
        """The records' device buffer (released and resumed with the weights)."""
        return [] if self._flat is None else [self._flat]

    @property
    def num_bytes(self) -> int:
        """Memory the adapter buffers take (on the device)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


LoraServing = MergedAdapter | UnmergedAdapter


def lora_serving(apply: str, model: torch.nn.Module, runner: ModelRunner) -> LoraServing:
    """How the engine applies adapters: ``unmerged`` or ``merged`` (see the module docstring)."""
    if apply == "merged":
        return MergedAdapter(model)
    if apply == "unmerged":
        return UnmergedAdapter(model, runner)
    raise ValueError(f"lora_apply: unmerged or merged, not {apply!r}")


class AdapterEndpoints:
    """SGLang's LoRA endpoints on the embedded engine (mixed into :class:`~agentrl.embedded.engine.
    EmbeddedEngine`, whose ``model``, ``runner``, ``memory``, ``device``, ``_update``, ``_requantize``,
    ``_on_device``, ``_unpacked`` and ``_check_weights_resident`` they use; they set its ``lora``, a
    :data:`LoraServing`): one adapter applied to every request, merged or unmerged (see the module
    docstring)."""

    def _init_adapters(self, apply: str, max_rank: int) -> None:
        """Device thread, at start: how adapters are applied (``apply``), unmerged ones' buffers of
        ``max_rank`` (0: none until the first adapter), and the weights' memory tag registered with them."""
        self.lora = lora_serving(apply, self.model, self.runner)
        with self.memory.region("weights"):
            self.lora.reserve(max_rank)
        self._register_weights()

    def _register_weights(self) -> None:
        """Device thread: what the weights' memory tag releases and resumes: the parameters, their fp8
        copies and the unmerged adapters' buffers."""
        extra = [*fp8.quantized_tensors(self.runner.weights), *self.lora.tensors()]
        self.memory.register("weights", [*self.model.parameters(), *extra])

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, weight_version: str | None, abort_all: bool, flush: bool = True
    ) -> None:
        """SGLang's ``/load_lora_adapter`` (a PEFT dir), applied to every request (merged or unmerged: the
        module docstring; SGLang instead serves it by name per request)."""
        try:
            config, tensors = await asyncio.to_thread(read_peft_dir, lora_path)
        except (OSError, ValueError) as err:
            raise EngineBadRequest(f"cannot load the adapter from {lora_path!r}: {err}") from None
        await self._apply_adapter(lora_name, config, tensors, abort_all, weight_version, flush)

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
        applied as :meth:`load_lora_adapter` does."""
        self._check_weights_resident()
        named, release = await self._unpacked(serialized_tensors, load_format)
        try:
            await self._apply_adapter(lora_name, config_dict, dict(named), abort_all, weight_version, flush)
        finally:
            named = None
            await self._on_device(release)

    async def _apply_adapter(
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
        self.lora.check(pairs)

        def apply() -> None:
            # larger buffers belong to the weights' memory (and the old ones are freed in its region)
            with self.memory.region("weights"):
                if self.lora.reserve(adapter_rank(pairs)):
                    self._register_weights()
            self.lora.load(pairs, scale, lora_name)
            if self.lora.writes_weights:
                self._requantize()
            if self.device.type == "cuda":  # done reading the sender's memory before it is freed
                torch.cuda.synchronize(self.device)

        await self._update(apply, abort_all, weight_version, flush)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """SGLang's ``/unload_lora_adapter``: the base model's answers back."""
        if self.lora.name != lora_name:
            raise EngineBadRequest(f"no adapter {lora_name!r} is loaded (loaded: {self.lora.name})")

        def unload() -> None:
            self.lora.unload()
            if self.lora.writes_weights:
                self._requantize()

        await self._update(unload, False, None)
