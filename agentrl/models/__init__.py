"""Model builders: tiny random HF models with locally trained tokenizers (agentrl.models.tiny)."""
