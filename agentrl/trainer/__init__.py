"""The off-policy Megatron trainer: losses (pure torch), the megatron-core model built from HF configs
with HF <-> Megatron weight conversion, the train step, weight sync to engines and checkpoints.

Heavy imports (megatron-core, ray) stay inside the submodules: ``from agentrl.trainer.losses import
LossConfig`` works without them.
"""
