"""Building one trainer rank's model: the megatron-core GPTModel of this rank's (pp, tp, ep) place, its
initial weights (from the HF dir, or from a Megatron dir when ``mcore_path`` is set), a frozen copy for
the KL reference, how it computes logprobs, and the compile warm-up that compiles the layers before the
first train step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from agentrl.trainer.batch import batch_advantages, plan_mini_batches, response_mask
from agentrl.trainer.checkpoint import load_local_state
from agentrl.trainer.config import TrainerConfig
from agentrl.trainer.hf_checkpoint import load_mcore_shard
from agentrl.trainer.logprobs import ModelLogprobs
from agentrl.trainer.model import LazyHFStateDict, ModelArch, build_gpt_model, hf_to_mcore_shards
from agentrl.trainer.moe import expert_layout
from agentrl.types import Trajectory

if TYPE_CHECKING:
    from agentrl.trainer.true_on_policy import TrueOnPolicyLogprobs

# the compile warm-up's two batches, sequence lengths: the second has other lengths and more sequences
WARMUP_LENGTHS = ((384, 384), (200, 330, 460, 590, 720))


def build_rank_model(
    cfg: TrainerConfig,
    arch: ModelArch,
    ps: Any,
    params_dtype: torch.dtype,
    fused_swiglu: bool,
    grouped_experts: bool,
    device: torch.device,
    frozen: bool = False,
) -> torch.nn.Module:
    """This rank's GPTModel (``ps``: megatron's parallel_state) with its initial weights, on ``device``.
    ``frozen``: in eval mode without gradients (the KL reference model)."""
    model = build_gpt_model(
        arch,
        tp=cfg.tp,
        pp=cfg.pp,
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        params_dtype=params_dtype,
        vocab_divisible_by=cfg.vocab_divisible_by,
        recompute=cfg.recompute_activations,
        fused_swiglu=fused_swiglu,
        compile_layers=cfg.compile_layers,
        ep=cfg.ep,
        moe_aux_loss_coef=cfg.moe.aux_loss_coef,
        grouped_experts=grouped_experts,
    )
    load_local_state(model, initial_shard(cfg, arch, ps, grouped_experts))
    if cfg.lora is not None and not frozen:  # the KL reference stays the base model
        from agentrl.trainer.lora import add_lora

        first_layer = arch.layer_range(ps.get_pipeline_model_parallel_rank(), cfg.pp)[0]
        add_lora(model, cfg.lora, arch, cfg.tp, ps.get_tensor_model_parallel_rank(), first_layer, cfg.seed)
    model.to(device)
    if frozen:
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
    return model


def build_logprobs(
    cfg: TrainerConfig, arch: ModelArch, ps: Any, kernels: Any, compile_kernels: bool
) -> ModelLogprobs | TrueOnPolicyLogprobs:
    """How this rank turns hidden states into logprobs: the vocabulary-parallel LM head in chunks, or,
    where ``kernels`` (:meth:`agentrl.exactness.Exactness.trainer_kernels`) ask for exact logprobs, the
    true on-policy forward in the batch-invariant engine's kernels."""
    if kernels.exact_logprobs:
        from agentrl.trainer.true_on_policy import TrueOnPolicyLogprobs

        return TrueOnPolicyLogprobs(
            arch, cfg.tp, cfg.pp, deterministic_backward=kernels.deterministic_backward
        )
    return ModelLogprobs(
        arch.vocab_size,
        ps.get_tensor_model_parallel_rank(),
        ps.get_tensor_model_parallel_group(),
        cfg.logprob_chunk_tokens,
        compile_kernels,
    )


def initial_shard(
    cfg: TrainerConfig, arch: ModelArch, ps: Any, grouped_experts: bool
) -> dict[str, torch.Tensor]:
    """This rank's share of the initial weights, in megatron's names and the experts' layout."""
    pp_rank, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    key: tuple[int, ...] = (pp_rank, tp_rank)
    ep_rank = ps.get_expert_model_parallel_rank() if cfg.ep > 1 else 0
    if cfg.ep > 1:
        key = (*key, ep_rank)
    if cfg.mcore_path is not None:  # a Megatron dir holds one tensor per expert
        shard = load_mcore_shard(cfg.mcore_path, pp_rank, tp_rank, cfg.tp, cfg.pp, ep_rank, cfg.ep)
        return expert_layout(shard, grouped_experts)
    # read lazily: a rank holds its own share (its experts, its slices' tensors), not the whole checkpoint
    return hf_to_mcore_shards(
        LazyHFStateDict(cfg.model_path),
        arch,
        cfg.tp,
        cfg.pp,
        cfg.vocab_divisible_by,
        ranks=[key],
        ep=cfg.ep,
        grouped_experts=grouped_experts,
    )[key]


def compile_warmup(trainer: Any, shapes: tuple[tuple[int, ...], ...] = WARMUP_LENGTHS) -> float:
    """A forward and backward of ``trainer``'s model (a MegatronTrainer, built but before its first step) over
    made-up micro-batches of two shapes, so that compiled layers are compiled before the first train step: the
    first with static shapes, the second (other lengths, more sequences) making the token dimension and the
    sequence count dynamic, as the first steps' changing batches would. Gradients are dropped; weights,
    optimizer state and RNGs are not touched. Returns the seconds it took."""
    tr, cfg = trainer, trainer.cfg
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    vocab = min(tr.arch.vocab_size, 1000)
    for lengths in shapes:
        trajs = []
        for i, n in enumerate(lengths):
            prompt = torch.randint(vocab, (n // 2,), generator=g).tolist()
            response = torch.randint(vocab, (n - n // 2,), generator=g).tolist()
            t = Trajectory(task_id="warmup", group_id="warmup", prompt_ids=prompt, sample_index=i)
            t.append_model_tokens(response, [0.0] * len(response), 0)
            t.reward = float(i % 2)
            trajs.append(t)
        mask = response_mask(trajs)
        plan = plan_mini_batches(
            trajs,
            batch_advantages(trajs, mask, cfg.loss),
            mask,
            1,
            cfg.micro_batch_size,
            cfg.max_tokens_per_micro_batch,
            tr.dp_rank,
            tr.dp_size,
            tr.pad_id,
            pack=cfg.pack_sequences,
        )
        tr.model.train()
        for mb in plan[0].micro_batches:
            lp, ent = tr.logprobs.of(tr.model, mb.to(tr.device))
            (lp.float().sum() + (0.0 if ent is None else ent.float().sum())).backward()
    if tr.use_megatron_optim:
        tr.model.zero_grad_buffer()
    tr.model.zero_grad(set_to_none=True)
    if tr.device.type == "cuda":
        torch.cuda.synchronize(tr.device)
    return time.perf_counter() - t0
