"""The Megatron trainer: one instance per rank turns batches of Trajectories into policy updates, keeps
the policy version, syncs weights to engines and checkpoints itself.

A ``train_step(trajectories)`` call (every rank gets the same full list; each data-parallel rank takes
its slice):

1. drops failed / unrewarded trajectories (counted, never fatal) and asserts the staleness bound
   ``policy_version - min_token_version <= max_staleness`` when the caller passes η
   (:func:`agentrl.buffer.check_staleness`);
2. computes advantages over the whole batch (groups by ``group_id``, an episode of several rows once);
3. splits the batch into ``num_mini_batches`` mini-batches of right-padded micro-batches (by sequence
   count or a token budget);
4. gets π_old, the current weights' logprobs (decoupled mode; bypass mode uses the rollout logprobs μ):
   when the step makes a single optimizer step they are the update's own forward, detached (the same
   weights, no second pass); otherwise a no-grad pass over every micro-batch before any update. Plus
   reference logprobs when a KL term is on;
5. runs ``ppo_epochs`` passes of one optimizer step per mini-batch (gradient accumulation over
   micro-batches with losses scaled by the mini-batch's global token / sequence counts, TP-aware
   gradient-norm clipping, AdamW, LR schedule) and returns averaged metrics.

Weights reach the engines in three verbs: ``connect_engines(update)`` once (an
:class:`agentrl.weight_sync.WeightUpdate`: ``disk``, ``tensor`` or ``distributed``), ``sync_weights()``
after each step (version += 1), ``disconnect_engines()`` at the end. The trainer produces the tensors;
:mod:`agentrl.weight_sync` moves them (the trainer does not import it: the update builds this rank's side).

Its parts live beside it: process world and RNGs in :mod:`~agentrl.trainer.distributed`, the model and
its compile warm-up in :mod:`~agentrl.trainer.build`, steps 1-3 in :mod:`~agentrl.trainer.batch`, the
optimizer paths (plain torch AdamW on CPU; megatron-core DDP + distributed optimizer + pipeline schedule
on GPU, see :mod:`agentrl.trainer.mcore_compat`) in :mod:`~agentrl.trainer.optim` and checkpoints in
:mod:`~agentrl.trainer.checkpoint`. With ``trainer.lora`` the model is frozen and low-rank adapters train
(:mod:`~agentrl.trainer.lora`); the weight sync then carries only the adapters.

Ray: :class:`agentrl.trainer.ray_actor.TrainerGroup` runs one instance per rank, one actor each.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from agentrl.buffer import check_staleness
from agentrl.exactness import Exactness
from agentrl.host_buffers import HostBuffers
from agentrl.trainer.batch import (
    MicroBatch,
    MiniBatch,
    batch_advantages,
    input_length,
    make_micro_batch,
    plan_mini_batches,
    recorded_by_position,
    response_logprobs,
    response_mask,
    select_usable,
    split_micro_batches,
)
from agentrl.trainer.build import build_logprobs, build_rank_model, compile_warmup
from agentrl.trainer.checkpoint import (
    TrainerCounters,
    latest_checkpoint,
    load_checkpoint,
    load_local_state,
    save_checkpoint,
)
from agentrl.trainer.config import LORA_NOT_EXACT, TrainerConfig
from agentrl.trainer.distributed import (
    all_reduce_scalar,
    init_distributed,
    reduce_metrics,
    resolve_device,
    rng_state,
    seed_everything,
    set_rng_state,
)
from agentrl.trainer.lora import merge_into_hf, peft_state_dict, save_peft_dir
from agentrl.trainer.losses import Denominators, MetricSums, policy_loss
from agentrl.trainer.mcore_compat import apply_cpu_patches, import_megatron
from agentrl.trainer.model import ModelArch, gather_hf_state_dict, save_hf_dir
from agentrl.trainer.moe import attach_routing, pop_aux_loss, set_aux_loss_scale
from agentrl.trainer.offload import TrainerOffload
from agentrl.trainer.optim import MicroLoss, build_optimizer
from agentrl.types import Trajectory

__all__ = [
    "MegatronTrainer",
    "MicroBatch",
    "TrainerConfig",
    "init_distributed",
    "load_local_state",
    "make_micro_batch",
    "rng_state",
    "seed_everything",
    "set_rng_state",
    "split_micro_batches",
]


class MegatronTrainer:
    """One rank of the trainer. Construct it on every rank of the torch.distributed world.

    ``deterministic``: the run's deterministic switch. The kernels it and ``cfg.true_on_policy`` choose come
    from :class:`~agentrl.exactness.Exactness`: on a GPU the logprobs then come from the true on-policy
    forward (batch-invariant kernels) and its attention backward runs torch's math kernel, since the flash
    backward accumulates dq in a varying order; on CPU nothing changes.
    ``store``: where the ranks meet (see :func:`~agentrl.trainer.distributed.init_distributed`)."""

    def __init__(self, cfg: TrainerConfig, deterministic: bool = False, store: Any = None) -> None:
        if deterministic and cfg.lora is not None:  # the run config refuses it at load; so does the class
            raise ValueError(LORA_NOT_EXACT.format(field="deterministic"))
        self.cfg = cfg
        self.deterministic = deterministic
        self.device = resolve_device(cfg)
        self.compile_kernels = (
            self.device.type == "cuda" if cfg.compile_kernels is None else cfg.compile_kernels
        )
        import_megatron(self.compile_kernels)  # (mcore_compat, point 6)
        from megatron.core import parallel_state as ps

        if self.device.type == "cpu":
            apply_cpu_patches()
        if self.device.type == "cpu" and cfg.pp > 1:
            raise ValueError("pipeline parallelism needs CUDA (megatron's pipeline schedules are CUDA-bound)")
        init_distributed(cfg, self.device, store)
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
        if self.use_megatron_optim and self.device.type != "cuda":  # device auto resolved to the CPU
            raise ValueError("optimizer=megatron needs CUDA; use optimizer=torch on CPU")
        if cfg.pp > 1 and not self.use_megatron_optim:
            raise ValueError("pp > 1 needs the megatron optimizer path")
        if self.arch.moe is None and (cfg.ep > 1 or cfg.moe.routing_replay):
            raise ValueError(
                f"ep > 1 and moe.routing_replay need a mixture-of-experts model; {cfg.model_path} is a "
                f"dense {self.arch.model_type} model"
            )
        # routing replay: each micro-batch carries the engine's recorded experts (see agentrl.trainer.moe)
        self.replay_routing = self.arch.moe is not None and cfg.moe.routing_replay
        grouped = cfg.moe.grouped_gemm
        # the experts' layout (agentrl.trainer.experts); both load the same shards, converted on load
        self.grouped_experts = self.arch.moe is not None and (
            self.device.type == "cuda" if grouped == "auto" else grouped
        )

        exactness = Exactness.resolve(deterministic, cfg.true_on_policy)
        kernels = exactness.trainer_kernels(on_gpu=self.device.type == "cuda")
        self.logprobs = build_logprobs(cfg, self.arch, ps, kernels, self.compile_kernels)
        if kernels.deterministic_backward:  # cuBLAS picks one workspace layout per stream: same sums
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        how = (self.params_dtype, self.compile_kernels, self.grouped_experts, self.device)
        model = build_rank_model(cfg, self.arch, ps, *how)
        self.ref_model = (
            build_rank_model(cfg, self.arch, ps, *how, frozen=True) if cfg.loss.kl_coef > 0 else None
        )
        self.optim = build_optimizer(
            cfg,
            model,
            self.logprobs,
            ps,
            self.device,
            self.use_megatron_optim,
            self.params_dtype,
            self.arch.qk_norm,
        )
        self.model = self.optim.model  # inside megatron's DDP wrapper on the megatron path

        # one optimizer step per train_step: π_old are the weights of the update's own forward
        self._old_from_update = (
            cfg.old_logprobs == "auto"
            and cfg.num_mini_batches * cfg.ppo_epochs == 1
            and cfg.loss.mode != "sft"
            and cfg.loss.off_policy == "decoupled"
        )
        self.step = 0  # train_step calls completed
        self.optimizer_steps = 0
        self.policy_version = 0  # weight syncs done; the engines' weights carry this version
        # the policy version when the weights last changed (an optimizer step, a checkpoint load): while it
        # is below policy_version the trainer holds the weights of that version
        self._changed_at: int | None = None
        self._engines: Any = None  # this rank's side of the weight update (connect_engines)
        # rank 0's figures of its last weight push (the transport's, plus gather_seconds; empty before one)
        self.last_sync_stats: dict[str, float] = {}
        self._offload: TrainerOffload | None = None  # the state while it is off the device
        self._host_buffers = HostBuffers()  # its host memory, kept from one offload to the next
        # compiled layers: compile now, not in the first train step (not with pipelines or experts,
        # whose forward runs through other paths)
        warm = cfg.compile_layers and self.device.type == "cuda" and cfg.pp == 1 and self.arch.moe is None
        self.warmup_seconds = compile_warmup(self) if warm else 0.0

    @property
    def module(self) -> torch.nn.Module:
        """The bare GPTModel (inside megatron's DDP wrapper on GPU)."""
        return self.model.module if hasattr(self.model, "module") else self.model

    def current_lr(self) -> float:
        return self.optim.current_lr()

    # ---- forward --------------------------------------------------------------------------------
    @torch.no_grad()
    def compute_logprobs(self, trajectories: list[Trajectory]) -> list[list[float]]:
        """Per-response-token logprobs of the current weights (every rank; full list; pp == 1)."""
        if self.cfg.pp > 1:
            raise NotImplementedError("compute_logprobs with pp > 1")
        zero = [torch.zeros(len(t.response_ids)) for t in trajectories]
        lengths = [input_length(t) for t in trajectories]
        out: list[list[float]] = [[] for _ in trajectories]
        self.model.eval()
        c = self.cfg
        for idx in split_micro_batches(
            lengths, c.micro_batch_size, c.max_tokens_per_micro_batch, c.pack_sequences
        ):
            mb = make_micro_batch(trajectories, idx, zero, self.pad_id, pack=c.pack_sequences).to(self.device)
            self._attach_routing(mb, trajectories)
            lp = self.logprobs.of(self.model, mb)[0].float().cpu()
            for row, i in enumerate(idx):
                out[i] = response_logprobs(lp, row, trajectories[i])
        return out

    def _attach_routing(self, mb: MicroBatch, trajectories: list[Trajectory]) -> None:
        """MoE models: ``mb``'s padding mask and, with routing replay, its rows' recorded experts."""
        if self.arch.moe is not None:
            rows = [trajectories[i] for i in mb.traj_index]
            moe, layers = self.arch.moe, self.arch.num_layers
            attach_routing(mb, rows, moe, layers, self.replay_routing, self.device)

    def _logprobs_no_grad(self, model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
        if self.cfg.pp > 1:
            return self.optim.pipeline_logprobs(mb)  # type: ignore[attr-defined]
        was_training = model.training
        model.eval()
        lp, _ = self.logprobs.of(model, mb)
        model.train(was_training)
        return lp.float().detach()

    # ---- train step -----------------------------------------------------------------------------
    def train_step(
        self, trajectories: list[Trajectory], max_staleness: int | None = None, record_logprobs: bool = False
    ) -> dict[str, float]:
        """One RL (or SFT) update on a batch; every rank must receive the same list. Returns metrics.
        ``max_staleness`` (η, the rollout's) is asserted on the batch
        (:func:`agentrl.buffer.check_staleness`). ``record_logprobs``: keep the trainer's logprobs of the
        batch for :meth:`last_logprobs`."""
        self._check_onloaded()
        t_start = time.perf_counter()
        cfg, lcfg = self.cfg, self.cfg.loss
        changed = self._changed_at
        held = self.policy_version if changed is None or changed < self.policy_version else None
        usable, dropped = select_usable(trajectories, sft=lcfg.mode == "sft")
        staleness = check_staleness(usable, self.policy_version, max_staleness)
        resp_mask = response_mask(usable)
        plan = self._plan(usable, batch_advantages(usable, resp_mask, lcfg), resp_mask)
        t_old = time.perf_counter()
        # recorded logprobs are π_old where the step computes it (its own pass, or the update's forward,
        # taken in _micro_loss); otherwise (bypass, SFT) a no-grad pass of the step's starting weights
        recorded: list[tuple[MicroBatch, torch.Tensor]] | None = [] if record_logprobs else None
        self._starting_logprobs(plan, recorded)
        old_seconds = time.perf_counter() - t_old

        metrics = MetricSums()
        losses, grad_norms = [], []
        t_train = time.perf_counter()
        tokens_processed = 0
        aux_losses: list[float] = []
        for _ in range(cfg.ppo_epochs):
            for mini in plan:
                self.model.train()
                # the load-balancing loss: a mean over micro-batches and dp ranks
                if self.arch.moe is not None:
                    dp_sum = 1 if self.use_megatron_optim else self.dp_size  # megatron's DDP averages over dp
                    set_aux_loss_scale(1.0 / (len(mini.micro_batches) * dp_sum), self.device)
                loss, gnorm = self.optim.update(
                    mini.micro_batches, self._micro_loss(mini.denom, metrics, recorded, held)
                )
                if self.arch.moe is not None:
                    aux = pop_aux_loss(len(mini.micro_batches))
                    if aux is not None:
                        aux_losses.append(aux)
                self.optimizer_steps += 1
                self._changed_at = self.policy_version
                losses.append(loss)
                grad_norms.append(gnorm)
                tokens_processed += sum(int((mb.tokens != self.pad_id).sum()) for mb in mini.micro_batches)
        train_seconds = time.perf_counter() - t_train
        self.step += 1
        self._last_logprobs = (
            None if recorded is None else self._gather_logprobs(trajectories, usable, recorded)
        )

        out = reduce_metrics(metrics, self.ps, cfg.pp, self.device)
        dp_group = self.ps.get_data_parallel_group()
        total_tokens = all_reduce_scalar(float(tokens_processed), dp_group, self.device)
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
        if aux_losses:  # megatron's normalization: 1 when the routing is uniform
            aux_sum = all_reduce_scalar(float(np.mean(aux_losses)), dp_group, self.device)
            out["moe_aux_loss"] = aux_sum / self.dp_size
        if self.device.type == "cuda":  # the peak since the process started, this rank's GPU
            out["peak_gpu_mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return out

    def _plan(
        self, usable: list[Trajectory], advantages: list[torch.Tensor], resp_mask: torch.Tensor
    ) -> list[MiniBatch]:
        """The step's mini-batches of this data-parallel rank, their micro-batches on the device with the
        engine's routing attached (MoE routing replay)."""
        cfg = self.cfg
        plan = plan_mini_batches(
            usable,
            advantages,
            resp_mask,
            cfg.num_mini_batches,
            cfg.micro_batch_size,
            cfg.max_tokens_per_micro_batch,
            self.dp_rank,
            self.dp_size,
            self.pad_id,
            fixed_shape=cfg.pp > 1,
            pack=cfg.pack_sequences,
            same_shape_across_ranks=cfg.ep > 1,
        )
        for mini in plan:
            mini.micro_batches = [mb.to(self.device) for mb in mini.micro_batches]
            for mb in mini.micro_batches:
                self._attach_routing(mb, usable)
        return plan

    @torch.no_grad()
    def _starting_logprobs(
        self, plan: list[MiniBatch], recorded: list[tuple[MicroBatch, torch.Tensor]] | None
    ) -> None:
        """π_old (and π_ref) of every micro-batch with the weights the step starts from, before any
        update; ``recorded`` (when kept) gets the logprobs the step reports."""
        lcfg = self.cfg.loss
        need_old = lcfg.mode != "sft" and lcfg.off_policy == "decoupled" and not self._old_from_update
        for mini in plan:
            for mb in mini.micro_batches:
                if need_old:
                    mb.old_logprobs = self._logprobs_no_grad(self.model, mb)
                elif not self._old_from_update:
                    mb.old_logprobs = mb.rollout_logprobs
                if self.ref_model is not None:
                    mb.ref_logprobs = self._logprobs_no_grad(self.ref_model, mb)
                if recorded is not None and not self._old_from_update:
                    lp = mb.old_logprobs if need_old else self._logprobs_no_grad(self.model, mb)
                    recorded.append((mb, lp))

    def _micro_loss(
        self,
        denom: Denominators,
        metrics: MetricSums,
        recorded: list[Any] | None = None,
        held: int | None = None,
    ) -> MicroLoss:
        """The policy loss of one micro-batch of a mini-batch with global counts ``denom``; π_old taken
        from the update's own forward is appended to ``recorded`` when given. ``held``: the policy version
        of the weights π_old comes from (None: weights no engine has had), for the same-version mismatch."""

        def loss(mb: MicroBatch, lp_ent: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            lp, ent = lp_ent
            old = lp.detach() if mb.old_logprobs is None else mb.old_logprobs
            if recorded is not None and mb.old_logprobs is None:
                recorded.append((mb, old))
            return policy_loss(
                lp,
                old,
                mb.advantages,
                mb.loss_mask,
                self.cfg.loss,
                denom,
                rollout_logprobs=mb.rollout_logprobs,
                entropy=ent,
                ref_logprobs=mb.ref_logprobs,
                metrics=metrics,
                same_version=None if held is None or mb.versions is None else mb.versions == held,
            )

        return loss

    def _gather_logprobs(
        self,
        trajectories: list[Trajectory],
        usable: list[Trajectory],
        recorded: list[tuple[MicroBatch, torch.Tensor]],
    ) -> list[list[float] | None]:
        """Per trajectory of the batch (None for the ones not trained), the recorded logprobs of its
        response tokens; every rank's share, gathered (collective)."""
        # tensor-parallel ranks hold the same full logprobs: the first of them tells
        mine = recorded_by_position(trajectories, usable, recorded) if self.tp_rank == 0 else {}
        parts: list[Any] = [None] * self.world_size
        if self.world_size > 1:
            dist.all_gather_object(parts, mine)
        else:
            parts = [mine]
        merged = {k: v for part in parts for k, v in part.items()}
        return [merged.get(i) for i in range(len(trajectories))]

    def last_logprobs(self) -> dict[str, Any]:
        """The trainer's logprobs of the last ``train_step(..., record_logprobs=True)``: ``logprobs`` per
        trajectory of its batch (response tokens; None for the ones not trained) and the CPU ``threads``
        it computed with (a replay needs the same count to match bit for bit)."""
        return {"logprobs": getattr(self, "_last_logprobs", None), "threads": torch.get_num_threads()}

    # ---- sharing the GPU with an engine (placement: colocated) -------------------------------------
    def offload(self) -> dict[str, float]:
        """Move this rank's weights, gradients and optimizer state to host memory and free the device
        memory (:mod:`agentrl.trainer.offload`); :meth:`onload` brings them back bit for bit. Until then
        training, weight syncs and checkpoints refuse to run. Returns bytes, seconds and GPU memory."""
        if self._offload is None or not self._offload.offloaded:  # collected now: Adam state appears late
            extra = [self.ref_model] if self.ref_model is not None else []
            self._offload = TrainerOffload(
                self.model, self.optim.optimizer, self.device, extra, host=self._host_buffers
            )
        return self._offload.offload()

    def release_cached_memory(self) -> None:
        """Hand the blocks the allocator caches (a step's activations) back to the driver, keeping the
        state: what a colocated engine may take while this rank's state moves off the GPU."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def onload(self) -> dict[str, float]:
        """Bring the state :meth:`offload` moved back to the device (no-op when it is there)."""
        return {} if self._offload is None else self._offload.onload()

    def _check_onloaded(self) -> None:
        if self._offload is not None and self._offload.offloaded:
            raise RuntimeError("the trainer's state is offloaded: call onload() first")

    # ---- weights out ------------------------------------------------------------------------------
    def hf_state_dict(self, device: torch.device | str | None = "cpu") -> dict[str, torch.Tensor]:
        """The full HF-named state dict, assembled on every rank (collective over TP and PP); with LoRA
        the adapters merged into the base weights. ``device=None``: this rank takes part for the others
        and gets ``{}`` (see :func:`agentrl.trainer.model.gather_hf_state_dict`)."""
        self._check_onloaded()
        hf = gather_hf_state_dict(self.module, self.arch, self.ps, device)
        if self.cfg.lora is None:
            return hf
        adapters = self.lora_state_dict()  # collective too
        if device is None:
            return hf
        adapters = {k: v.to(device) for k, v in adapters.items()}
        return merge_into_hf(hf, adapters, self.cfg.lora.alpha / self.cfg.lora.rank)

    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA adapters as a PEFT state dict (HF module names, on the CPU), assembled on every rank
        (collective over TP and PP; :func:`agentrl.trainer.lora.peft_state_dict`)."""
        if self.cfg.lora is None:
            raise RuntimeError("no adapters: trainer.lora is not set")
        self._check_onloaded()
        return peft_state_dict(self.module, self.arch, self.cfg.lora, self.ps)

    def save_lora(self, out_dir: str | Path) -> Path | None:
        """Write the adapters as a PEFT dir (rank 0 writes; collective). Returns the dir on rank 0."""
        tensors, lora = self.lora_state_dict(), self.cfg.lora
        out = save_peft_dir(tensors, lora, out_dir, self.cfg.model_path) if self.rank == 0 else None  # type: ignore[arg-type]
        dist.barrier()
        return out

    def save_hf(self, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path | None:
        """Write the current weights as an HF dir (rank 0 writes; collective). Returns the dir on rank 0."""
        hf = self.hf_state_dict("cpu" if self.rank == 0 else None)
        out = save_hf_dir(hf, out_dir, self.cfg.model_path, dtype=dtype) if self.rank == 0 else None
        dist.barrier()
        return out

    async def connect_engines(self, update: Any, client: Any = None) -> None:
        """Connect this rank to the engines :meth:`sync_weights` pushes to, as ``update`` says (an
        :class:`agentrl.weight_sync.WeightUpdate`: the transport, the engine URLs this rank picks its own
        from, and the transport's fields; see :mod:`agentrl.weight_sync`). ``client``: an EngineClient of
        the engines this rank pushes to, instead of the URLs. A ``disk`` update without engines writes the
        HF dir only; ``distributed`` opens the broadcast group with the engines now. Every rank calls it."""
        if self._engines is not None:
            raise RuntimeError("engines already connected: disconnect_engines() first")
        self._engines = await update.connect(
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
            model_path=self.cfg.model_path,
            lora=self.cfg.lora,
            client=client,
            bucket_bytes=self.cfg.weight_sync_bucket_mb << 20,
            flatten=self.cfg.weight_sync_flatten,
        )

    async def sync_weights(self, new_version: bool = True) -> int:
        """Push the current weights to the connected engines: every rank gathers the HF-named weights
        (with LoRA the adapters only, PEFT-named), the version goes up by one, the ranks with engines
        push them (rank 0; in memory, every rank to the engines on its GPU), then a barrier. Collective;
        the version pushed. ``new_version=False``: push them under the version they already carry (a
        resume hands the engines the checkpoint's weights as the version they were saved at)."""
        if self._engines is None:
            raise RuntimeError("connect_engines() first")
        t0 = time.perf_counter()
        if self.cfg.lora is not None:  # only the adapters travel; the engines keep the base
            hf = await asyncio.to_thread(self.lora_state_dict)
        else:  # a rank that hands nothing over only takes part in the gather (device None)
            device = self._engines.gather_device if self._engines.pushes else None
            hf = await asyncio.to_thread(self.hf_state_dict, device)
        gathered = time.perf_counter() - t0
        if new_version:
            self.policy_version += 1
        else:
            self._changed_at = None  # the engines now hold exactly the weights of this version
        if self._engines.pushes:
            stats = await self._engines.push(hf, self.policy_version)
            self.last_sync_stats = {**stats, "gather_seconds": gathered}
        del hf  # freed before the barrier: a colocated engine may need the memory
        await asyncio.to_thread(dist.barrier)
        return self.policy_version

    async def disconnect_engines(self, timeout: float = 30.0) -> bool:
        """Let go of the engines, bounded (a broadcast group is left together with them, see
        :meth:`agentrl.weight_sync.broadcast.WeightBroadcaster.close`); True when it ended cleanly or
        nothing was connected."""
        engines, self._engines = self._engines, None
        return True if engines is None else await engines.close(timeout)

    # ---- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self, ckpt_dir: str | Path) -> Path:
        """``ckpt_dir/step_{N}/rank_{R}.pt`` (model, optimizer, LR schedule, RNG, step, version); then
        ``ckpt_dir/latest`` names it (see :mod:`agentrl.trainer.checkpoint`). With LoRA the adapters also
        go to ``step_{N}/adapter/`` as a PEFT dir. Collective."""
        self._check_onloaded()
        progress = TrainerCounters(self.step, self.optimizer_steps, self.policy_version)
        # what the weights were trained under: the config and the numerics switch the trainer got
        config = {**self.cfg.model_dump(mode="json"), "deterministic": self.deterministic}
        step_dir = save_checkpoint(
            ckpt_dir, self.module, self.optim, progress, config, self.rank, self.world_size
        )
        if self.cfg.lora is not None:  # what peft and other servers load, beside the trainer's own files
            self.save_lora(step_dir / "adapter")
        return step_dir

    @staticmethod
    def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
        return latest_checkpoint(ckpt_dir)

    def load_checkpoint(self, path: str | Path) -> int:
        """Restore everything :meth:`save_checkpoint` wrote (``path``: a step dir or the root); returns
        the restored step."""
        self.step, self.optimizer_steps, self.policy_version = load_checkpoint(
            path, self.module, self.optim, self.rank
        )
        self._changed_at = self.policy_version  # not the engines' until pushed (sync_weights)
        return self.step

    def shutdown(self) -> None:
        """Let go of the engines (if still connected), megatron's parallel state and the process group.

        Call :meth:`disconnect_engines` first, on the event loop the engines' client lives on: here a
        broadcast group is left on a loop of its own, which may end in an abort after the timeout.
        """
        if self._engines is not None:
            asyncio.run(self.disconnect_engines())
        if self.ps.model_parallel_is_initialized():
            self.ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
