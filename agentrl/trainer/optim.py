"""The trainer's two optimizer paths behind one small interface, :class:`TrainerOptimizer`: one update
is gradient accumulation over a mini-batch's micro-batches, gradient clipping and one optimizer + LR
schedule step.

* :class:`TorchOptimizer` (CPU / gloo, pipeline size 1): ``torch.optim.AdamW`` with a ``LambdaLR``
  schedule, an explicit gradient all-reduce over data-parallel ranks (and of the q/k-norm gradients over
  tensor-parallel ranks) and a TP-aware global-norm clip.
* :class:`MegatronOptimizer` (CUDA / NCCL): megatron-core's ``DistributedDataParallel`` +
  ``get_megatron_optimizer`` (distributed optimizer, fp32 main weights for bf16; it clips) +
  ``OptimizerParamScheduler``, and megatron's pipeline schedule when ``pp > 1``.

Losses are already divided by the mini-batch's global token / sequence counts, so the gradients are
summed, never averaged, over data-parallel ranks.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from agentrl.trainer.batch import MicroBatch
from agentrl.trainer.distributed import all_reduce_scalar
from agentrl.trainer.logprobs import ModelLogprobs, position_ids

if TYPE_CHECKING:
    from agentrl.trainer.config import TrainerConfig

MicroLoss = Callable[[MicroBatch, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]
"""``(micro-batch, (logprobs, entropy)) -> loss``: one micro-batch's share of the mini-batch loss."""


class TrainerOptimizer(Protocol):
    """What the train step needs of an optimizer path."""

    model: torch.nn.Module  # the module to run forward/backward on (may wrap the GPTModel)

    def update(self, micro_batches: list[MicroBatch], micro_loss: MicroLoss) -> tuple[float, float]:
        """Zero the gradients, accumulate them over ``micro_batches``, clip and step the optimizer and
        the LR schedule. Returns (loss summed over micro-batches and data-parallel ranks, grad norm)."""
        ...

    def current_lr(self) -> float: ...

    def state_dict(self) -> dict[str, Any]:
        """``{"optimizer": ..., "scheduler": ...}`` (this rank's)."""
        ...

    def save_sharded_state(self, step_dir: Path) -> None:
        """Write what ``state_dict`` leaves out (the distributed optimizer's parameter state)."""
        ...

    def load_state_dict(self, state: dict[str, Any], step_dir: Path) -> None:
        """Restore ``state_dict()``'s output and what ``save_sharded_state`` wrote to ``step_dir``."""
        ...


def build_optimizer(
    cfg: TrainerConfig,
    model: torch.nn.Module,
    logprobs: ModelLogprobs,
    ps: Any,
    device: torch.device,
    use_megatron: bool,
    params_dtype: torch.dtype = torch.float32,
    qk_norm: bool = False,
) -> TrainerOptimizer:
    """The optimizer path for ``model`` (``ps``: megatron's parallel_state). The megatron path wraps the
    model in its DDP: train ``.model`` of the result."""
    if use_megatron:
        return MegatronOptimizer(cfg, model, logprobs, ps, device, params_dtype)
    return TorchOptimizer(cfg, model, logprobs, ps, device, qk_norm)


def lr_at(cfg: TrainerConfig, step: int) -> float:
    """The learning rate of optimizer step ``step``: linear warmup, then constant, linear or cosine decay."""
    c = cfg
    if c.lr_warmup_steps and step < c.lr_warmup_steps:
        return c.lr * (step + 1) / c.lr_warmup_steps
    if c.lr_decay_style == "constant" or c.lr_decay_steps is None:
        return c.lr
    frac = min(1.0, (step - c.lr_warmup_steps) / max(1, c.lr_decay_steps - c.lr_warmup_steps))
    if c.lr_decay_style == "linear":
        return c.min_lr + (c.lr - c.min_lr) * (1 - frac)
    return c.min_lr + (c.lr - c.min_lr) * 0.5 * (1 + math.cos(math.pi * frac))


class TorchOptimizer:
    """AdamW + LambdaLR with explicit gradient all-reduces and a TP-aware clip (any device, pp == 1)."""

    def __init__(
        self,
        cfg: TrainerConfig,
        model: torch.nn.Module,
        logprobs: ModelLogprobs,
        ps: Any,
        device: torch.device,
        qk_norm: bool = False,
    ) -> None:
        self.cfg = cfg
        self.model = model
        self.logprobs = logprobs
        self.ps = ps
        self.device = device
        self.qk_norm = qk_norm
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )
        # a plain lambda: LambdaLR's state_dict skips functions (it would store a callable object's fields)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_at(cfg, s) / cfg.lr)

    def update(self, micro_batches: list[MicroBatch], micro_loss: MicroLoss) -> tuple[float, float]:
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for mb in micro_batches:
            loss = micro_loss(mb, self.logprobs.of(self.model, mb))
            loss.backward()
            total += float(loss.detach())
        self.all_reduce_grads()
        gnorm = self.clip_grads()
        self.optimizer.step()
        self.scheduler.step()
        total = all_reduce_scalar(total, self.ps.get_data_parallel_group(), self.device)
        return total, gnorm

    def all_reduce_grads(self) -> None:
        """Sum q/k-norm gradients over TP ranks (each rank saw only its heads; megatron's
        ``finalize_model_grads`` does the same) and all gradients over data-parallel ranks (losses
        are already divided by global counts, so a sum is the full-batch gradient)."""
        params = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the base is frozen
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.cfg.tp > 1 and self.qk_norm:
            tp_group = self.ps.get_tensor_model_parallel_group()
            for name, p in self.model.named_parameters():
                if ("q_layernorm" in name or "k_layernorm" in name) and p.grad is not None:
                    dist.all_reduce(p.grad, group=tp_group)
        if self.dp_size == 1:
            return
        group = self.ps.get_data_parallel_group()
        # MoE expert parallelism: a rank's experts (megatron marks them allreduce=False) are replicated
        # only over the expert-data-parallel ranks, the ranks holding the same experts
        expert_group = self.ps.get_expert_data_parallel_group() if self.cfg.ep > 1 else None
        for p in params:
            if getattr(p, "allreduce", True):
                dist.all_reduce(p.grad, group=group)
            elif dist.get_world_size(expert_group) > 1:
                dist.all_reduce(p.grad, group=expert_group)

    def clip_grads(self) -> float:
        """Global L2 norm over all model-parallel shards (TP-duplicated params counted once); clip."""
        sq = torch.zeros((), dtype=torch.float64)
        sq_experts = torch.zeros((), dtype=torch.float64)  # expert-parallel shards (MoE, ep > 1)
        params = [p for p in self.model.parameters() if p.grad is not None]
        for p in params:
            sharded = getattr(p, "tensor_model_parallel", False)
            if sharded or self.tp_rank == 0:
                part = p.grad.detach().double().pow(2).sum().cpu()
                if getattr(p, "allreduce", True):
                    sq += part
                else:
                    sq_experts += part
        if self.cfg.tp * self.cfg.pp > 1:
            dist.all_reduce(sq, group=self.ps.get_model_parallel_group())
        if self.cfg.ep > 1:
            dist.all_reduce(sq_experts, group=self.ps.get_expert_tensor_model_pipeline_parallel_group())
            sq += sq_experts
        norm = float(sq.sqrt())
        if self.cfg.grad_clip > 0 and norm > self.cfg.grad_clip:
            scale = self.cfg.grad_clip / (norm + 1e-6)
            for p in params:
                p.grad.mul_(scale)
        return norm

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def save_sharded_state(self, step_dir: Path) -> None:
        pass  # everything is in state_dict()

    def load_state_dict(self, state: dict[str, Any], step_dir: Path) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


class MegatronOptimizer:
    """megatron-core DDP + distributed optimizer + OptimizerParamScheduler (CUDA), pipeline schedule
    when ``pp > 1``."""

    def __init__(
        self,
        cfg: TrainerConfig,
        model: torch.nn.Module,
        logprobs: ModelLogprobs,
        ps: Any,
        device: torch.device,
        params_dtype: torch.dtype = torch.float32,
    ) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.cfg = cfg
        self.logprobs = logprobs
        self.ps = ps
        self.device = device
        self.dp_size = ps.get_data_parallel_world_size()
        c = cfg
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=True,
            check_for_nan_in_grad=False,
        )
        self.model = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
        opt_cfg = OptimizerConfig(
            optimizer="adam",
            lr=c.lr,
            min_lr=c.min_lr,
            weight_decay=c.weight_decay,
            adam_beta1=c.adam_beta1,
            adam_beta2=c.adam_beta2,
            adam_eps=c.adam_eps,
            clip_grad=c.grad_clip,
            bf16=params_dtype == torch.bfloat16,
            params_dtype=params_dtype,
            use_distributed_optimizer=True,
            # CPU Adam (slime's --optimizer-cpu-offload): states and step on the host, all of them. With
            # the precision-aware optimizer (as slime pairs them) the distributed optimizer makes no fp32
            # main weights and hands the bf16 shards to the host optimizer, which keeps fp32 copies and
            # the moments: the GPU keeps the bf16 weights and the fp32 grad buffer (6 bytes a parameter,
            # 12 fewer than GPU Adam). Without it the fp32 main weights stay on the GPU (only 8 fewer)
            optimizer_cpu_offload=c.optimizer_cpu_offload,
            optimizer_offload_fraction=1.0 if c.optimizer_cpu_offload else 0.0,
            use_precision_aware_optimizer=c.optimizer_cpu_offload,
        )
        self.optimizer = get_megatron_optimizer(opt_cfg, [self.model])
        fuse_torch_adam(self.optimizer)
        decay_steps = c.lr_decay_steps or 10**9
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if c.lr_warmup_steps else c.lr,
            max_lr=c.lr,
            min_lr=c.min_lr,
            lr_warmup_steps=c.lr_warmup_steps,
            lr_decay_steps=max(decay_steps, c.lr_warmup_steps + 1),
            lr_decay_style=c.lr_decay_style,
            start_wd=c.weight_decay,
            end_wd=c.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
        )

    def update(self, micro_batches: list[MicroBatch], micro_loss: MicroLoss) -> tuple[float, float]:
        from megatron.core.distributed import finalize_model_grads

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        # megatron's DDP averages gradients over dp ranks; our losses are already global sums
        dp_scale = float(self.dp_size)
        if self.cfg.pp > 1:
            total = self._pipeline(micro_batches, micro_loss, dp_scale)
            finalize_model_grads([self.model])  # dp all-reduce + tied-embedding grads across stages
        else:
            total = torch.zeros((), dtype=torch.float64, device=self.device)  # read once, after the step
            for mb in micro_batches:
                loss = micro_loss(mb, self.logprobs.of(self.model, mb))
                (loss * dp_scale).backward()
                total += loss.detach()
            finalize_model_grads([self.model])
        ok, gnorm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
        total = all_reduce_scalar(float(total), self.ps.get_data_parallel_group(), self.device)
        return total, float(gnorm or 0.0)

    def pipeline_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """Forward-only logprobs of ``mb`` through the pipeline (``pp > 1``), on every stage."""
        out = self._pipeline([mb], None, 1.0)
        lp = out[0] if out else torch.zeros_like(mb.loss_mask)
        # the result lives on the last stage; broadcast it so every stage holds π_old
        group = self.ps.get_pipeline_model_parallel_group()
        lp = lp.contiguous().to(self.device)
        dist.broadcast(lp, src=dist.get_global_rank(group, self.cfg.pp - 1), group=group)
        return lp

    def _pipeline(self, mbs: list[MicroBatch], micro_loss: MicroLoss | None, scale: float) -> Any:
        """megatron's forward/backward schedule over ``mbs``: the summed loss, or with no ``micro_loss``
        (forward only) the last stage's per-micro-batch logprobs."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        forward_only = micro_loss is None
        store: list[Any] = []
        n_mb = len(mbs)

        def step_func(data_iter: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
            mb = next(data_iter)
            out = model(mb.tokens, position_ids(mb.tokens), None)

            def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
                lp, ent = self.logprobs.from_logits(logits, mb.targets)
                if micro_loss is None:
                    store.append(lp.float().detach())
                    return lp.sum() * 0, {}
                loss = micro_loss(mb, (lp, ent))
                store.append(float(loss.detach()))
                return loss * scale * n_mb, {}  # the schedule divides by the number of micro-batches

            return out, loss_func

        fb = get_forward_backward_func()
        fb(
            forward_step_func=step_func,
            data_iterator=iter(mbs),
            model=[self.model],
            num_microbatches=n_mb,
            seq_length=mbs[0].tokens.shape[1],
            micro_batch_size=mbs[0].tokens.shape[0],
            forward_only=forward_only,
        )
        if forward_only:
            return store
        return sum(store)

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def save_sharded_state(self, step_dir: Path) -> None:
        if hasattr(self.optimizer, "save_parameter_state"):
            self.optimizer.save_parameter_state(str(step_dir / "optimizer_param_state.pt"))

    def load_state_dict(self, state: dict[str, Any], step_dir: Path) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if (step_dir / "optimizer_param_state.pt").exists():
            with _adam_steps_set_aside(self.optimizer):
                self.optimizer.load_parameter_state(str(step_dir / "optimizer_param_state.pt"))
        self.scheduler.load_state_dict(state["scheduler"])
        fuse_torch_adam(self.optimizer)  # a checkpoint's param groups bring their own flags


def _torch_adams(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch Adam / AdamW optimizers inside megatron's (chained) optimizer."""
    inners = [getattr(o, "optimizer", None) for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    return [o for o in inners if isinstance(o, torch.optim.Adam | torch.optim.AdamW)]


@contextlib.contextmanager
def _adam_steps_set_aside(optimizer: Any) -> Iterator[None]:
    """Hold torch Adam's per-parameter ``step`` out of its state while megatron loads the parameter
    state: megatron copies every tensor of a parameter's state from the file, which has no ``step`` (the
    step comes from the param groups), so a tensor step there fails the load with ``KeyError: 'step'``."""
    held = [
        (o.state[p], o.state[p].pop("step"))
        for o in _torch_adams(optimizer)
        for p in list(o.state)
        if "step" in o.state[p]
    ]
    try:
        yield
    finally:
        for state, step in held:
            state["step"] = step


def fuse_torch_adam(optimizer: Any) -> int:
    """Run megatron's torch AdamW fallback (what it uses without Transformer Engine or apex) as torch's
    fused CUDA kernel instead of its default multi-tensor loop: one kernel over all of a shard's fp32
    main parameters (at the 0.5B shape on an H100, 13 ms of a 0.3 s step went to the loop). Steps already
    in the state move to the parameters' device, where fused AdamW keeps them. Returns how many inner
    optimizers now run fused (0 off CUDA or with TE / apex's own fused Adam)."""
    fused = 0
    for inner in _torch_adams(optimizer):
        params = [p for g in inner.param_groups for p in g["params"]]
        if not params or not all(p.is_cuda and p.dtype == torch.float32 for p in params):
            continue
        for g in inner.param_groups:
            g["fused"], g["foreach"] = True, False
        for p in params:
            state = inner.state.get(p, {})
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
        fused += 1
    return fused
