"""The off-policy Megatron trainer: losses (pure torch), the megatron-core model built from HF configs
with HF <-> Megatron weight conversion, the train step, the weights it hands to the engines (moved by
:mod:`agentrl.weight_sync`, which this package never imports) and checkpoints.

Heavy imports (megatron-core, ray) stay inside the submodules: ``from agentrl.trainer.losses import
LossConfig`` works without them.
"""
