"""The Megatron trainer: one instance per rank turns batches of Trajectories into policy updates, keeps
the policy version, syncs weights to engines and checkpoints itself.

A ``train_step(trajectories)`` call (every rank gets the same full list; each data-parallel rank takes
its slice):

1. drops failed / unrewarded trajectories (counted, never fatal) and asserts the staleness bound
   ``policy_version - min_token_version <= max_staleness`` when the caller passes η
   (:func:`agentrl.buffer.check_staleness`);
2. computes advantages over the whole batch (groups by ``group_id``);
3. splits the batch into ``num_mini_batches`` mini-batches of right-padded micro-batches (by sequence
   count or a token budget);
4. recomputes π_old for every micro-batch with the current weights before any update (decoupled mode;
   bypass mode uses the rollout logprobs μ), plus reference logprobs when a KL term is on;
5. runs ``ppo_epochs`` passes of one optimizer step per mini-batch (gradient accumulation over
   micro-batches with losses scaled by the mini-batch's global token / sequence counts, TP-aware
   gradient-norm clipping, AdamW, LR schedule) and returns averaged metrics.

Backends: on CPU (gloo) a plain ``torch.optim.AdamW`` with an explicit data-parallel gradient all-reduce
and this module's micro-batch loop (pipeline size 1; megatron's DDP, distributed optimizer and pipeline
schedules are CUDA-bound, see :mod:`agentrl.trainer.mcore_compat`). On GPU (NCCL) megatron-core's
``DistributedDataParallel`` + ``get_megatron_optimizer`` (distributed optimizer, fp32 main weights for
bf16) + ``OptimizerParamScheduler``, and its pipeline schedule when ``pp > 1``.

Ray: :mod:`agentrl.trainer.ray_actor` wraps this class, one actor per rank.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from pydantic import Field

from agentrl.buffer import check_staleness
from agentrl.cluster import free_port
from agentrl.config import ConfigModel
from agentrl.trainer.logprobs import vocab_parallel_logprobs
from agentrl.trainer.losses import (
    Denominators,
    LossConfig,
    MetricSums,
    compute_advantages,
    policy_loss,
)
from agentrl.trainer.mcore_compat import apply_cpu_patches
from agentrl.trainer.model import (
    ModelArch,
    build_gpt_model,
    hf_to_mcore_shards,
    load_hf_state_dict,
    mcore_to_hf,
    save_hf_dir,
)
from agentrl.types import Status, Trajectory


class TrainerConfig(ConfigModel):
    """Model, parallelism, optimizer, batching and loss of the Megatron trainer."""

    model_path: str = Field(..., description="HF model directory the weights (and shape) are loaded from")
    mcore_path: str | None = Field(
        None, description="optional agentrl.convert Megatron dir to load instead of model_path's weights"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="parameter dtype (bf16: fp32 main weights in the GPU optimizer)"
    )
    tp: int = Field(1, ge=1, description="tensor-parallel size")
    pp: int = Field(1, ge=1, description="pipeline-parallel size (GPU only)")
    vocab_divisible_by: int = Field(
        1, ge=1, description="pad the vocabulary to a multiple of tp * this (128 is GPU-friendly)"
    )
    recompute_activations: bool = Field(
        False, description="full activation recomputation (memory for compute)"
    )
    seed: int = Field(1234, description="seed of torch / numpy / python RNGs")

    lr: float = Field(1e-6, gt=0, description="peak learning rate")
    min_lr: float = Field(0.0, ge=0, description="final learning rate of the decay")
    lr_warmup_steps: int = Field(0, ge=0, description="linear warmup, in optimizer steps")
    lr_decay_steps: int | None = Field(
        None, ge=1, description="decay length in optimizer steps (None: constant after warmup)"
    )
    lr_decay_style: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="LR decay after warmup"
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
    adam_beta2: float = Field(0.98, ge=0, lt=1, description="AdamW beta2")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    grad_clip: float = Field(1.0, ge=0, description="clip the global gradient norm to this (0 = off)")
    optimizer: Literal["auto", "megatron", "torch"] = Field(
        "auto", description="auto: megatron DDP + distributed optimizer on GPU, torch AdamW on CPU"
    )

    micro_batch_size: int = Field(4, ge=1, description="sequences per micro-batch")
    max_tokens_per_micro_batch: int | None = Field(
        None, ge=1, description="if set, micro-batches are filled up to this many padded tokens instead"
    )
    num_mini_batches: int = Field(1, ge=1, description="optimizer steps per train_step (per epoch)")
    ppo_epochs: int = Field(1, ge=1, description="passes over the batch per train_step")
    loss: LossConfig = Field(default_factory=LossConfig, description="advantages and policy loss")
    weight_sync_bucket_mb: int = Field(
        512, ge=1, description="bucket size of the distributed weight broadcast"
    )


# ---- distributed setup ----------------------------------------------------------------------------
def _resolve_device(cfg: TrainerConfig) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def init_distributed(cfg: TrainerConfig, device: torch.device) -> None:
    """torch.distributed from the env (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; defaults: one
    process on loopback) and megatron's parallel_state for ``tp`` x ``pp`` x dp."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            if world > 1:
                raise RuntimeError("MASTER_PORT must be set when WORLD_SIZE > 1")
            os.environ["MASTER_PORT"] = str(free_port())
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world)
    if dist.get_world_size() % (cfg.tp * cfg.pp):
        raise ValueError(f"world size {dist.get_world_size()} is not a multiple of tp*pp = {cfg.tp * cfg.pp}")
    if ps.model_parallel_is_initialized():
        if (
            ps.get_tensor_model_parallel_world_size() != cfg.tp
            or ps.get_pipeline_model_parallel_world_size() != cfg.pp
        ):
            raise RuntimeError("megatron parallel_state is already initialized with other sizes")
        return
    ps.initialize_model_parallel(tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp)


def seed_everything(seed: int, device: torch.device) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if device.type == "cuda":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---- batches --------------------------------------------------------------------------------------
@dataclass
class MicroBatch:
    """Right-padded ``[b, s]`` tensors over input positions; index ``i`` predicts token ``i + 1``."""

    tokens: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    traj_index: list[int]
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def to(self, device: torch.device) -> MicroBatch:
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return MicroBatch(
            mv(self.tokens),
            mv(self.targets),
            mv(self.loss_mask),
            mv(self.rollout_logprobs),
            mv(self.advantages),
            self.traj_index,
            mv(self.old_logprobs),
            mv(self.ref_logprobs),
        )  # type: ignore[arg-type]


def make_micro_batch(
    trajs: list[Trajectory],
    index: list[int],
    advantages: list[torch.Tensor],
    pad_id: int = 0,
    seq_len: int | None = None,
    num_rows: int | None = None,
) -> MicroBatch:
    """Pack trajectories ``index`` into one right-padded micro-batch (``advantages[i]``: per response token)."""
    lengths = [len(trajs[i].prompt_ids) + len(trajs[i].response_ids) - 1 for i in index]
    s = max(lengths) if seq_len is None else seq_len
    b = len(index) if num_rows is None else num_rows
    tokens = torch.full((b, s), pad_id, dtype=torch.long)
    targets = torch.full((b, s), pad_id, dtype=torch.long)
    mask = torch.zeros(b, s)
    mu = torch.zeros(b, s)
    adv = torch.zeros(b, s)
    for row, i in enumerate(index):
        t = trajs[i]
        full = t.prompt_ids + t.response_ids
        n = len(full) - 1
        p = len(t.prompt_ids)
        r = len(t.response_ids)
        tokens[row, :n] = torch.tensor(full[:-1])
        targets[row, :n] = torch.tensor(full[1:])
        mask[row, p - 1 : p - 1 + r] = torch.tensor(t.loss_mask, dtype=torch.float32)
        mu[row, p - 1 : p - 1 + r] = torch.tensor(t.rollout_logprobs, dtype=torch.float32)
        adv[row, p - 1 : p - 1 + r] = advantages[i]
    mu = mu * mask
    return MicroBatch(tokens, targets, mask, mu, adv * mask, list(index))


def split_micro_batches(lengths: list[int], micro_batch_size: int, max_tokens: int | None) -> list[list[int]]:
    """Positions grouped into micro-batches, in order: ``micro_batch_size`` sequences each, or (with
    ``max_tokens``) as many as fit ``rows x longest <= max_tokens`` (a longer sequence goes alone)."""
    out: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if max_tokens is None:
            if len(cur) == micro_batch_size:
                out.append(cur)
                cur = []
        elif cur and (len(cur) + 1) * max(longest, n) > max_tokens:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    return out


# ---- the trainer ----------------------------------------------------------------------------------
class MegatronTrainer:
    """One rank of the trainer. Construct it on every rank of the torch.distributed world."""

    def __init__(self, cfg: TrainerConfig) -> None:
        from megatron.core import parallel_state as ps

        self.cfg = cfg
        self.device = _resolve_device(cfg)
        if self.device.type == "cpu":
            apply_cpu_patches()
        if self.device.type == "cpu" and cfg.pp > 1:
            raise ValueError("pipeline parallelism needs CUDA (megatron's pipeline schedules are CUDA-bound)")
        init_distributed(cfg, self.device)
        self.ps = ps
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.is_last_stage = self.pp_rank == cfg.pp - 1
        seed_everything(cfg.seed, self.device)

        self.arch = ModelArch.from_hf_dir(cfg.model_path)
        self.params_dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
        self.pad_id = 0
        self.use_megatron_optim = cfg.optimizer == "megatron" or (
            cfg.optimizer == "auto" and self.device.type == "cuda"
        )
        if self.use_megatron_optim and self.device.type != "cuda":
            raise ValueError("optimizer=megatron needs CUDA; use optimizer=torch on CPU")
        if cfg.pp > 1 and not self.use_megatron_optim:
            raise ValueError("pp > 1 needs the megatron optimizer path")
        if cfg.pp > 1 and (cfg.max_tokens_per_micro_batch is not None or cfg.loss.kl_coef > 0):
            raise ValueError(
                "pp > 1 needs fixed-size micro-batches (no max_tokens_per_micro_batch) and no KL reference model"
            )

        self.model = self._build_model()
        self._load_initial_weights()
        self.model.to(self.device)
        self.ref_model = self._build_ref_model() if cfg.loss.kl_coef > 0 else None
        self._setup_optimizer()

        self.step = 0  # train_step calls completed
        self.optimizer_steps = 0
        self.policy_version = 0  # weight syncs done; the engines' weights carry this version
        self._broadcaster: Any = None

    # ---- construction ---------------------------------------------------------------------------
    def _build_model(self) -> torch.nn.Module:
        return build_gpt_model(
            self.arch,
            tp=self.cfg.tp,
            pp=self.cfg.pp,
            pp_rank=self.pp_rank,
            params_dtype=self.params_dtype,
            vocab_divisible_by=self.cfg.vocab_divisible_by,
            recompute=self.cfg.recompute_activations,
        )

    def _local_shard(self) -> dict[str, torch.Tensor]:
        key = (self.pp_rank, self.tp_rank)
        if self.cfg.mcore_path is not None:
            from agentrl.convert import load_mcore_shard

            return load_mcore_shard(self.cfg.mcore_path, self.pp_rank, self.tp_rank, self.cfg.tp, self.cfg.pp)
        hf = load_hf_state_dict(self.cfg.model_path)
        return hf_to_mcore_shards(
            hf, self.arch, self.cfg.tp, self.cfg.pp, self.cfg.vocab_divisible_by, ranks=[key]
        )[key]

    def _load_initial_weights(self, module: torch.nn.Module | None = None) -> None:
        module = self.model if module is None else module
        shard = self._local_shard()
        load_local_state(module, shard)

    def _build_ref_model(self) -> torch.nn.Module:
        ref = self._build_model()
        self._load_initial_weights(ref)
        ref.to(self.device)
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def _lr_at(self, step: int) -> float:
        c = self.cfg
        if c.lr_warmup_steps and step < c.lr_warmup_steps:
            return c.lr * (step + 1) / c.lr_warmup_steps
        if c.lr_decay_style == "constant" or c.lr_decay_steps is None:
            return c.lr
        frac = min(1.0, (step - c.lr_warmup_steps) / max(1, c.lr_decay_steps - c.lr_warmup_steps))
        if c.lr_decay_style == "linear":
            return c.min_lr + (c.lr - c.min_lr) * (1 - frac)
        return c.min_lr + (c.lr - c.min_lr) * 0.5 * (1 + math.cos(math.pi * frac))

    def _setup_optimizer(self) -> None:
        c = self.cfg
        if not self.use_megatron_optim:
            self.optimizer = torch.optim.AdamW(
                [p for p in self.model.parameters() if p.requires_grad],
                lr=c.lr,
                betas=(c.adam_beta1, c.adam_beta2),
                eps=c.adam_eps,
                weight_decay=c.weight_decay,
            )
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lambda s: self._lr_at(s) / c.lr
            )
            return
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        tf_config = self.model.config
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=True,
            check_for_nan_in_grad=False,
        )
        self.model = DistributedDataParallel(config=tf_config, ddp_config=ddp_config, module=self.model)
        opt_cfg = OptimizerConfig(
            optimizer="adam",
            lr=c.lr,
            min_lr=c.min_lr,
            weight_decay=c.weight_decay,
            adam_beta1=c.adam_beta1,
            adam_beta2=c.adam_beta2,
            adam_eps=c.adam_eps,
            clip_grad=c.grad_clip,
            bf16=self.params_dtype == torch.bfloat16,
            params_dtype=self.params_dtype,
            use_distributed_optimizer=True,
        )
        self.optimizer = get_megatron_optimizer(opt_cfg, [self.model])
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

    @property
    def module(self) -> torch.nn.Module:
        """The bare GPTModel (inside megatron's DDP wrapper on GPU)."""
        return self.model.module if hasattr(self.model, "module") else self.model

    # ---- forward --------------------------------------------------------------------------------
    def _forward_logprobs(self, model: torch.nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = mb.tokens
        pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        logits = model(tokens, pos, None)
        return vocab_parallel_logprobs(
            logits, mb.targets, self.arch.vocab_size, self.tp_rank, self.ps.get_tensor_model_parallel_group()
        )

    @torch.no_grad()
    def compute_logprobs(self, trajectories: list[Trajectory]) -> list[list[float]]:
        """Per-response-token logprobs of the current weights (every rank; full list; pp == 1)."""
        if self.cfg.pp > 1:
            raise NotImplementedError("compute_logprobs with pp > 1")
        zero = [torch.zeros(len(t.response_ids)) for t in trajectories]
        lengths = [len(t.prompt_ids) + len(t.response_ids) - 1 for t in trajectories]
        out: list[list[float]] = [[] for _ in trajectories]
        self.model.eval()
        for idx in split_micro_batches(
            lengths, self.cfg.micro_batch_size, self.cfg.max_tokens_per_micro_batch
        ):
            mb = make_micro_batch(trajectories, idx, zero, self.pad_id).to(self.device)
            lp, _ = self._forward_logprobs(self.model, mb)
            for row, i in enumerate(idx):
                p, r = len(trajectories[i].prompt_ids), len(trajectories[i].response_ids)
                out[i] = lp[row, p - 1 : p - 1 + r].float().cpu().tolist()
        return out

    # ---- train step -----------------------------------------------------------------------------
    def train_step(
        self, trajectories: list[Trajectory], max_staleness: int | None = None
    ) -> dict[str, float]:
        """One RL (or SFT) update on a batch; every rank must receive the same list. Returns metrics.
        ``max_staleness`` (η, the rollout's) is asserted on the batch (:func:`agentrl.buffer.check_staleness`)."""
        t_start = time.perf_counter()
        cfg, lcfg = self.cfg, self.cfg.loss
        usable = [
            t
            for t in trajectories
            if t.status != Status.FAILED
            and len(t.prompt_ids) >= 1
            and (t.reward is not None or lcfg.mode == "sft")
        ]
        dropped = len(trajectories) - len(usable)
        if not usable:
            raise ValueError(f"train_step got no usable trajectory ({dropped} failed or unrewarded)")
        for t in usable:
            t.validate()
        staleness = check_staleness(usable, self.policy_version, max_staleness)

        # advantages over the whole batch, per response token
        rmax = max(1, max(len(t.response_ids) for t in usable))
        resp_mask = torch.zeros(len(usable), rmax)
        for i, t in enumerate(usable):
            resp_mask[i, : len(t.response_ids)] = torch.tensor(t.loss_mask, dtype=torch.float32)
        if lcfg.mode == "sft":
            adv_full = torch.zeros_like(resp_mask)
        else:
            rewards = torch.tensor([float(t.reward) for t in usable])  # type: ignore[arg-type]
            adv_full = compute_advantages(rewards, [t.group_id for t in usable], resp_mask, lcfg)
        advantages = [adv_full[i, : len(t.response_ids)] for i, t in enumerate(usable)]

        # mini-batches (global), each sliced per data-parallel rank into micro-batches
        n = len(usable)
        k = min(cfg.num_mini_batches, n)
        bounds = [round(j * n / k) for j in range(k + 1)]
        plan: list[tuple[Denominators, list[MicroBatch]]] = []
        for j in range(k):
            mini = list(range(bounds[j], bounds[j + 1]))
            m = resp_mask[mini]
            denom = Denominators(num_tokens=float(m.sum()), num_seqs=float((m.sum(-1) > 0).sum()))
            local = mini[self.dp_rank :: self.dp_size]
            lengths = [len(usable[i].prompt_ids) + len(usable[i].response_ids) - 1 for i in local]
            groups = split_micro_batches(lengths, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch)
            if cfg.pp > 1:  # fixed p2p shapes: one length and row count for the whole mini-batch
                seq = max(lengths) if lengths else 1
                mbs = [
                    make_micro_batch(
                        usable, [local[g] for g in grp], advantages, self.pad_id, seq, cfg.micro_batch_size
                    )
                    for grp in groups
                ]
            else:
                mbs = [
                    make_micro_batch(usable, [local[g] for g in grp], advantages, self.pad_id)
                    for grp in groups
                ]
            plan.append((denom, [mb.to(self.device) for mb in mbs]))

        # π_old (and π_ref) with the weights of this step, before any update
        t_old = time.perf_counter()
        need_old = lcfg.mode != "sft" and lcfg.off_policy == "decoupled"
        with torch.no_grad():
            for _, mbs in plan:
                for mb in mbs:
                    if need_old:
                        mb.old_logprobs = self._logprobs_no_grad(self.model, mb)
                    else:
                        mb.old_logprobs = mb.rollout_logprobs
                    if self.ref_model is not None:
                        mb.ref_logprobs = self._logprobs_no_grad(self.ref_model, mb)
        old_seconds = time.perf_counter() - t_old

        metrics = MetricSums()
        losses, grad_norms = [], []
        t_train = time.perf_counter()
        tokens_processed = 0
        for _ in range(cfg.ppo_epochs):
            for denom, mbs in plan:
                loss, gnorm = self._update(mbs, denom, metrics)
                losses.append(loss)
                grad_norms.append(gnorm)
                tokens_processed += sum(int((mb.tokens != self.pad_id).sum()) for mb in mbs)
        train_seconds = time.perf_counter() - t_train
        self.step += 1

        out = self._reduce_metrics(metrics)
        total_tokens = self._all_reduce_scalar(float(tokens_processed), self.ps.get_data_parallel_group())
        out.update(
            loss=float(np.mean(losses)),
            grad_norm=float(np.mean(grad_norms)),
            grad_norm_max=float(np.max(grad_norms)),
            lr=self.current_lr(),
            step=float(self.step),
            optimizer_steps=float(self.optimizer_steps),
            policy_version=float(self.policy_version),
            staleness_max=float(staleness),
            num_trajectories=float(len(usable)),
            dropped_trajectories=float(dropped),
            reward_mean=float(np.mean([t.reward for t in usable if t.reward is not None]))
            if lcfg.mode != "sft"
            else 0.0,
            response_tokens=float(resp_mask.sum()),
            tokens_per_s=total_tokens / max(train_seconds, 1e-9),
            old_logprob_seconds=old_seconds,
            update_seconds=train_seconds,
            step_seconds=time.perf_counter() - t_start,
        )
        if self.device.type == "cuda":  # the peak since the process started, this rank's GPU
            out["peak_gpu_mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return out

    def _logprobs_no_grad(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        if self.cfg.pp > 1:
            return self._pp_forward_only(model, mb)
        was_training = model.training
        model.eval()
        lp, _ = self._forward_logprobs(model, mb)
        model.train(was_training)
        return lp.float().detach()

    def _micro_loss(
        self,
        mb: MicroBatch,
        logits_or_lp: tuple[torch.Tensor, torch.Tensor],
        denom: Denominators,
        metrics: MetricSums,
    ) -> torch.Tensor:
        lp, ent = logits_or_lp
        return policy_loss(
            lp,
            mb.old_logprobs,
            mb.advantages,
            mb.loss_mask,
            self.cfg.loss,
            denom,  # type: ignore[arg-type]
            rollout_logprobs=mb.rollout_logprobs,
            entropy=ent,
            ref_logprobs=mb.ref_logprobs,
            metrics=metrics,
        )

    def _update(self, mbs: list[MicroBatch], denom: Denominators, metrics: MetricSums) -> tuple[float, float]:
        """Gradient accumulation over ``mbs`` and one optimizer step; returns (loss, grad norm)."""
        self.model.train()
        if self.use_megatron_optim:
            return self._update_megatron(mbs, denom, metrics)
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for mb in mbs:
            loss = self._micro_loss(mb, self._forward_logprobs(self.model, mb), denom, metrics)
            loss.backward()
            total += float(loss.detach())
        self._all_reduce_grads()
        gnorm = self._clip_grads()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer_steps += 1
        total = self._all_reduce_scalar(total, self.ps.get_data_parallel_group())
        return total, gnorm

    def _all_reduce_grads(self) -> None:
        """Sum q/k-norm gradients over TP ranks (each rank saw only its heads; megatron's
        ``finalize_model_grads`` does the same) and all gradients over data-parallel ranks (losses
        are already divided by global counts, so a sum is the full-batch gradient)."""
        for p in self.model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.cfg.tp > 1 and self.arch.qk_norm:
            tp_group = self.ps.get_tensor_model_parallel_group()
            for name, p in self.model.named_parameters():
                if "q_layernorm" in name or "k_layernorm" in name:
                    dist.all_reduce(p.grad, group=tp_group)
        if self.dp_size == 1:
            return
        group = self.ps.get_data_parallel_group()
        for p in self.model.parameters():
            dist.all_reduce(p.grad, group=group)

    def _clip_grads(self) -> float:
        """Global L2 norm over all model-parallel shards (TP-duplicated params counted once); clip."""
        sq = torch.zeros((), dtype=torch.float64)
        params = [p for p in self.model.parameters() if p.grad is not None]
        for p in params:
            sharded = getattr(p, "tensor_model_parallel", False)
            if sharded or self.tp_rank == 0:
                sq += p.grad.detach().double().pow(2).sum().cpu()
        if self.cfg.tp * self.cfg.pp > 1:
            dist.all_reduce(sq, group=self.ps.get_model_parallel_group())
        norm = float(sq.sqrt())
        if self.cfg.grad_clip > 0 and norm > self.cfg.grad_clip:
            scale = self.cfg.grad_clip / (norm + 1e-6)
            for p in params:
                p.grad.mul_(scale)
        return norm

    def _all_reduce_scalar(self, x: float, group: Any) -> float:
        if dist.get_world_size(group) == 1:
            return x
        t = torch.tensor([x], dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t, group=group)
        return float(t.item())

    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _reduce_metrics(self, metrics: MetricSums) -> dict[str, float]:
        """Sum metric sums/counts over data-parallel ranks (on the last pipeline stage), max the maxes."""
        names = sorted(metrics.sums)
        group = self.ps.get_data_parallel_group()
        if dist.get_world_size(group) > 1 and names:
            t = torch.tensor(
                [[metrics.sums[k], metrics.counts[k]] for k in names],
                dtype=torch.float64,
                device=self._comm_device(),
            )
            dist.all_reduce(t, group=group)
            for k, row in zip(names, t.cpu().tolist(), strict=True):
                metrics.sums[k], metrics.counts[k] = row
            mx = sorted(metrics.maxes)
            if mx:
                m = torch.tensor(
                    [metrics.maxes[k] for k in mx], dtype=torch.float64, device=self._comm_device()
                )
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
                metrics.maxes.update(zip(mx, m.cpu().tolist(), strict=True))
        out = metrics.means()
        if self.cfg.pp > 1:  # metrics live on the last stage; broadcast them to every stage
            obj = [out]
            dist.broadcast_object_list(
                obj,
                src=dist.get_global_rank(self.ps.get_pipeline_model_parallel_group(), self.cfg.pp - 1),
                group=self.ps.get_pipeline_model_parallel_group(),
            )
            out = obj[0]
        return out

    # ---- GPU path: megatron DDP + distributed optimizer (+ pipeline schedule) -----------------------
    def _update_megatron(
        self, mbs: list[MicroBatch], denom: Denominators, metrics: MetricSums
    ) -> tuple[float, float]:
        from megatron.core.distributed import finalize_model_grads

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        # megatron's DDP averages gradients over dp ranks; our losses are already global sums
        dp_scale = float(self.dp_size)
        if self.cfg.pp > 1:
            total = self._pp_forward_backward(mbs, denom, metrics, dp_scale)
            finalize_model_grads([self.model])  # dp all-reduce + tied-embedding grads across stages
        else:
            total = 0.0
            for mb in mbs:
                loss = self._micro_loss(mb, self._forward_logprobs(self.model, mb), denom, metrics)
                (loss * dp_scale).backward()
                total += float(loss.detach())
            finalize_model_grads([self.model])
        ok, gnorm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
        self.optimizer_steps += 1
        total = self._all_reduce_scalar(total, self.ps.get_data_parallel_group())
        return total, float(gnorm or 0.0)

    def _pp_forward_backward(
        self,
        mbs: list[MicroBatch],
        denom: Denominators,
        metrics: MetricSums,
        scale: float,
        forward_only: bool = False,
    ) -> Any:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        store: list[Any] = []
        n_mb = len(mbs)

        def step_func(data_iter: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
            mb = next(data_iter)
            pos = torch.arange(mb.tokens.shape[1], device=mb.tokens.device).unsqueeze(0).expand_as(mb.tokens)
            out = model(mb.tokens, pos, None)

            def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, dict]:
                lp, ent = vocab_parallel_logprobs(
                    logits,
                    mb.targets,
                    self.arch.vocab_size,
                    self.tp_rank,
                    self.ps.get_tensor_model_parallel_group(),
                )
                if forward_only:
                    store.append(lp.float().detach())
                    return lp.sum() * 0, {}
                loss = self._micro_loss(mb, (lp, ent), denom, metrics)
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

    def _pp_forward_only(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        out = self._pp_forward_backward([mb], Denominators(1, 1), MetricSums(), 1.0, forward_only=True)
        lp = out[0] if out else torch.zeros_like(mb.loss_mask)
        # the result lives on the last stage; broadcast it so every stage holds π_old
        group = self.ps.get_pipeline_model_parallel_group()
        lp = lp.contiguous().to(self.device)
        dist.broadcast(lp, src=dist.get_global_rank(group, self.cfg.pp - 1), group=group)
        return lp

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # ---- weights out ------------------------------------------------------------------------------
    def hf_state_dict(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The full HF-named state dict, assembled on every rank (collective over TP and PP)."""
        local = {
            k: v.detach()
            for k, v in self.module.state_dict().items()
            if not k.endswith("_extra_state") and v is not None
        }
        shards: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        tp_group = self.ps.get_tensor_model_parallel_group()
        names = sorted(local)
        for name in names:
            t = local[name].contiguous()
            if self.cfg.tp > 1:
                parts = [torch.empty_like(t) for _ in range(self.cfg.tp)]
                dist.all_gather(parts, t, group=tp_group)
            else:
                parts = [t]
            for r, part in enumerate(parts):
                shards.setdefault((self.pp_rank, r), {})[name] = part.to(device)
        if self.cfg.pp > 1:
            group = self.ps.get_pipeline_model_parallel_group()
            mine = [{key: v for key, v in shards.items()}]
            gathered: list[Any] = [None] * self.cfg.pp
            dist.all_gather_object(
                gathered, {k: {n: v.cpu() for n, v in d.items()} for k, d in mine[0].items()}, group=group
            )
            shards = {
                k: {n: v.to(device) for n, v in d.items()} for part in gathered for k, d in part.items()
            }
        return mcore_to_hf(shards, self.arch)

    def save_hf(self, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path | None:
        """Write the current weights as an HF dir (rank 0 writes; collective). Returns the dir on rank 0."""
        hf = self.hf_state_dict("cpu")
        out = None
        if self.rank == 0:
            out = save_hf_dir(hf, out_dir, self.cfg.model_path, dtype=dtype)
        dist.barrier()
        return out

    async def sync_weights_from_disk(
        self, client: Any, out_dir: str | Path, abort_all_requests: bool = False
    ) -> int:
        """Save HF weights to ``out_dir`` and make the engines load them; version += 1. Collective."""
        await asyncio.to_thread(self.save_hf, out_dir)
        self.policy_version += 1
        if self.rank == 0 and client is not None:
            await client.update_weights_from_disk(
                str(out_dir), weight_version=str(self.policy_version), abort_all_requests=abort_all_requests
            )
        return self.policy_version

    async def init_weight_sync_group(
        self,
        client: Any,
        num_engine_ranks: int = 1,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        backend: str | None = None,
        group_name: str = "agentrl_weight_sync",
        bucket_bytes: int | None = None,
    ) -> None:
        """Rank 0 opens the broadcast group with the engines (see :mod:`agentrl.trainer.weight_sync`)."""
        from agentrl.trainer.weight_sync import WeightBroadcaster

        if self.rank != 0:
            return
        backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self._broadcaster = WeightBroadcaster(
            client, group_name, bucket_bytes or (self.cfg.weight_sync_bucket_mb << 20)
        )
        self._sync_backend = backend
        await self._broadcaster.connect(master_address, master_port or free_port(), num_engine_ranks, backend)

    async def sync_weights_distributed(self, client: Any = None) -> int:
        """Broadcast the HF weights to the engines in buckets; version += 1. Collective over ranks."""
        device = (
            "cpu"
            if self.device.type == "cpu" or getattr(self, "_sync_backend", "gloo") == "gloo"
            else self.device
        )
        hf = await asyncio.to_thread(self.hf_state_dict, device)
        self.policy_version += 1
        if self.rank == 0:
            if self._broadcaster is None:
                raise RuntimeError("init_weight_sync_group() first")
            self.last_sync_stats = await self._broadcaster.push(list(hf.items()), str(self.policy_version))
        await asyncio.to_thread(dist.barrier)
        return self.policy_version

    async def close_weight_sync_group(self, timeout: float = 30.0) -> bool:
        """Leave the broadcast group together with the engines, bounded (see ``WeightBroadcaster.close``)."""
        if self._broadcaster is None:
            return True
        broadcaster, self._broadcaster = self._broadcaster, None
        return await broadcaster.close(timeout)

    # ---- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self, ckpt_dir: str | Path) -> Path:
        """``ckpt_dir/step_{N}/rank_{R}.pt`` (model, optimizer, LR schedule, RNG, step, version); then
        ``ckpt_dir/latest`` names it (written last, atomically, so a kill never leaves a torn "latest")."""
        root = Path(ckpt_dir)
        d = root / f"step_{self.step:08d}"
        d.mkdir(parents=True, exist_ok=True)
        state = {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(),
            "step": self.step,
            "optimizer_steps": self.optimizer_steps,
            "policy_version": self.policy_version,
            "config": self.cfg.model_dump(mode="json"),
        }
        tmp = d / f"rank_{self.rank:05d}.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(d / f"rank_{self.rank:05d}.pt")
        if self.use_megatron_optim and hasattr(self.optimizer, "save_parameter_state"):
            self.optimizer.save_parameter_state(str(d / "optimizer_param_state.pt"))
        dist.barrier()
        if self.rank == 0:
            (d / "meta.json").write_text(
                json.dumps(
                    {"step": self.step, "policy_version": self.policy_version, "world_size": self.world_size}
                )
            )
            tmp_latest = root / "latest.tmp"
            tmp_latest.write_text(d.name)
            tmp_latest.replace(root / "latest")
        dist.barrier()
        return d

    @staticmethod
    def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
        f = Path(ckpt_dir) / "latest"
        return Path(ckpt_dir) / f.read_text().strip() if f.is_file() else None

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore everything :meth:`save_checkpoint` wrote (``path``: a step dir or the root)."""
        p = Path(path)
        if (p / "latest").is_file():
            p = p / (p / "latest").read_text().strip()
        state = torch.load(p / f"rank_{self.rank:05d}.pt", map_location="cpu", weights_only=False)
        load_local_state(self.module, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.use_megatron_optim and (p / "optimizer_param_state.pt").exists():
            self.optimizer.load_parameter_state(str(p / "optimizer_param_state.pt"))
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.optimizer_steps = int(state["optimizer_steps"])
        self.policy_version = int(state["policy_version"])
        dist.barrier()

    def shutdown(self) -> None:
        """Release the weight-sync group (if still open), megatron's parallel state and the process group.

        The group should have been closed with :meth:`close_weight_sync_group` first, which tells the
        engines to leave too; here it is left without them, so it may end in an abort after the timeout.
        """
        if self._broadcaster is not None:
            asyncio.run(self.close_weight_sync_group())
        if self.ps.model_parallel_is_initialized():
            self.ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def load_local_state(module: torch.nn.Module, shard: dict[str, torch.Tensor]) -> None:
    """Copy ``shard`` into ``module`` in place; every parameter must be covered (extra_state may not)."""
    own = module.state_dict()
    missing = [k for k in own if k not in shard and not k.endswith("_extra_state")]
    unexpected = [k for k in shard if k not in own]
    if missing or unexpected:
        raise KeyError(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for k, v in shard.items():
            if k.endswith("_extra_state"):
                continue
            if own[k].shape != v.shape:
                raise ValueError(
                    f"{k}: checkpoint shape {tuple(v.shape)} != model shape {tuple(own[k].shape)}"
                )
            own[k].copy_(v)
