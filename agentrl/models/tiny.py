"""Tiny random models with locally trained tokenizers, written as standard HF model directories.

``python -m agentrl.models.tiny --out DIR --arch qwen2|qwen3|llama|qwen3_moe [--vocab-corpus FILE]`` trains a
byte-level BPE tokenizer with the ``tokenizers`` library (on the given corpus, or on a small built-in
text), builds a small randomly initialised transformers model of the chosen family, and writes
config.json, generation_config.json, model.safetensors, tokenizer.json and tokenizer_config.json
(with a ChatML chat template that renders system/user/assistant/tool messages, tool schemas and
assistant ``tool_calls``). Nothing here is special-cased later: every consumer loads the directory
with ``AutoTokenizer`` / ``AutoModelForCausalLM``, exactly as it would load a real HF checkpoint.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Agent-format tags get one token each: tiny models learn the protocol far faster, and stop strings
# such as "</search>" then always end on a token boundary.
TAG_TOKENS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<search>",
    "</search>",
    "<answer>",
    "</answer>",
    "<information>",
    "</information>",
]

# ChatML in the style of Qwen2.5: tool schemas go in the system turn, consecutive tool messages share
# one user turn wrapped in <tool_response>, assistant tool_calls render as <tool_call> JSON.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}"
    "{% else %}You are a helpful assistant.{% endif %}"
    "{{ '\\n\\n' }}# Tools\n\nYou may call one or more functions. Function signatures:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools>\n\nFor each call return a JSON object inside <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% elif message.role == 'user' %}"
    "<|im_start|>user\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n{% if message.content %}{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls | default([]) %}"
    "{% set fn = call.function if call.function is defined else call %}"
    "{% if loop.first and message.content %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ fn.name }}", "arguments": '
    "{% if fn.arguments is string %}{{ fn.arguments }}{% else %}{{ fn.arguments | tojson }}{% endif %}"
    "}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2.5-0.5B's shape (random weights of this shape are what the GPU benchmarks measure)
QWEN25_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)

# Qwen2.5-1.5B's shape (28 layers, hidden 1536, 12 query / 2 key-value heads; tied embeddings)
QWEN25_15B = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)

# Qwen2.5-3B's shape (36 layers, hidden 2048, 16 query / 2 key-value heads; tied embeddings)
QWEN25_3B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=11008,
    num_hidden_layers=36,
    num_attention_heads=16,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)

# Qwen2.5-7B's shape (28 layers, hidden 3584, 28 query / 4 key-value heads, an untied LM head; the
# Instruct model's 32,768-token context)
QWEN25_7B = dict(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

# SmolLM2-135M's shape (Llama family: 30 layers, hidden 576, 9 query / 3 key-value heads)
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)

# A Qwen3-MoE shape of about 1B parameters (0.96B; 0.30B active per token: 2 of 16 experts per layer)
QWEN3_MOE_1B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=20,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)

# Qwen3-30B-A3B's shape (48 layers, hidden 2048, 32 query / 4 key-value heads of 128; 128 experts of 768, 8
# a token: 30.5B parameters, 3.3B active a token; an untied LM head)
QWEN3_30B_A3B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

# The named full-size shapes the GPU benchmarks build with random weights: name -> (family, shape)
FULL_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2.5-0.5b": ("qwen2", QWEN25_05B),
    "qwen2.5-1.5b": ("qwen2", QWEN25_15B),
    "qwen2.5-3b": ("qwen2", QWEN25_3B),
    "qwen2.5-7b": ("qwen2", QWEN25_7B),
    "qwen3-moe-1b": ("qwen3_moe", QWEN3_MOE_1B),
    "qwen3-30b-a3b": ("qwen3_moe", QWEN3_30B_A3B),
    "smollm2-135m": ("llama", SMOLLM2_135M),
}


def shape_config(name: str, num_layers: int | None = None) -> Any:
    """The transformers config of the full-size shape ``name`` (:data:`FULL_SHAPES`), with the tiny
    tokenizer's end-of-sequence (2) and padding (0) ids; ``num_layers``: that many of its decoder layers
    (None: all), the same model cut to what a machine holds."""
    import transformers

    if name not in FULL_SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose {', '.join(FULL_SHAPES)}")
    arch, dims = FULL_SHAPES[name]
    families = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3_moe": transformers.Qwen3MoeConfig,
    }
    cls = families[arch]
    if num_layers is not None:
        dims = {**dims, "num_hidden_layers": num_layers}
    return cls(**dims, eos_token_id=2, pad_token_id=0)


_BUILTIN_TEXT = """
Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get
new information. After reasoning, if you find you lack some knowledge, you can call a search engine by
<search> query </search> and it will return the top searched results between <information> and
</information>. You can search as many times as your want. If you find no further external knowledge
needed, you can directly provide the answer inside <answer> and </answer>, without detailed illustrations.
For example, <answer> Beijing </answer>. Question: Doc 1(Title: Paris) Paris is the capital of France.
My previous action is invalid. If I want to search, I should put the query between <search> and </search>.
If I want to give the final answer, I should put the answer between <answer> and </answer>. Let me try again.
You are a helpful assistant. Call the python tool to run code, then answer. The result is 42.
{"name": "python", "arguments": {"code": "print(1 + 1)"}} def main(): return x * y + 3 import math
What is the capital of the country? Who founded the company? In which year was it founded? born in the city
located on the river. 0 1 2 3 4 5 6 7 8 9 10 100 1999 2024 + - * / = ( ) [ ] { } : ; , . ! ? ' "
the of and to in is was a an for on with as by at from that this it he she they we you I
"""


def train_tokenizer(texts: list[str], vocab_size: int = 1024) -> Any:
    """Train a byte-level BPE ``tokenizers.Tokenizer`` (every byte is representable, so no UNK)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return tok


ARCHS = ("qwen2", "qwen3", "llama", "qwen3_moe")


def model_config(arch: str, vocab_size: int, eos_id: int, pad_id: int, **shape: Any) -> Any:
    """A transformers config of the family ``arch`` with a small default shape (``qwen3_moe``: 8 experts
    of ``moe_intermediate_size`` = hidden, top-2, renormalized gates)."""
    import transformers

    hidden = shape.pop("hidden_size", 64)
    heads = shape.pop("num_attention_heads", 4)
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=shape.pop("intermediate_size", hidden * 3),
        num_hidden_layers=shape.pop("num_hidden_layers", shape.pop("num_layers", 2)),
        num_attention_heads=heads,
        num_key_value_heads=shape.pop("num_key_value_heads", max(1, heads // 2)),
        max_position_embeddings=shape.pop("max_position_embeddings", 2048),
        rms_norm_eps=shape.pop("rms_norm_eps", 1e-6),
        rope_theta=shape.pop("rope_theta", 10000.0),
        tie_word_embeddings=shape.pop("tie_word_embeddings", arch != "llama"),
        initializer_range=shape.pop("initializer_range", 0.02),
        bos_token_id=None if arch != "llama" else eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(**common, **shape)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=shape.pop("head_dim", hidden // heads), **shape)
    elif arch == "llama":
        cfg = transformers.LlamaConfig(**common, **shape)
    elif arch == "qwen3_moe":
        # every layer a mixture of experts: num_experts SwiGLU experts of moe_intermediate_size, top-k routed
        cfg = transformers.Qwen3MoeConfig(
            **common,
            head_dim=shape.pop("head_dim", hidden // heads),
            num_experts=shape.pop("num_experts", 8),
            num_experts_per_tok=shape.pop("num_experts_per_tok", 2),
            moe_intermediate_size=shape.pop("moe_intermediate_size", hidden),
            norm_topk_prob=shape.pop("norm_topk_prob", True),
            router_aux_loss_coef=shape.pop("router_aux_loss_coef", 0.001),
            **shape,
        )
    else:
        raise ValueError(f"unknown arch {arch!r}; choose {', '.join(ARCHS)}")
    return cfg


def build_tiny_model(
    out_dir: str | Path,
    arch: str = "qwen2",
    vocab_corpus: str | Path | list[str] | None = None,
    seed: int = 0,
    vocab_size: int = 1024,
    dtype: str = "float32",
    **shape: Any,
) -> Path:
    """Write a standard HF model directory for a small random ``arch`` model; returns ``out_dir``.

    ``vocab_corpus`` is a text file (one document per line) or a list of strings to train the BPE
    tokenizer on. ``shape`` overrides config fields (hidden_size, num_hidden_layers, ...).
    """
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if vocab_corpus is None:
        texts = [line for line in _BUILTIN_TEXT.splitlines() if line.strip()]
    elif isinstance(vocab_corpus, list):
        texts = vocab_corpus
    else:
        texts = Path(vocab_corpus).read_text().splitlines()
    texts = texts + TAG_TOKENS  # keeps the tags' neighbours ("<", "/", ">") in the base vocabulary
    tok = train_tokenizer(texts, vocab_size=vocab_size)
    tok.save(str(out / "tokenizer.json"))
    eos_id = tok.token_to_id("<|im_end|>")
    pad_id = tok.token_to_id("<|endoftext|>")

    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": shape.get("max_position_embeddings", 2048),
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2)
    )

    cfg = model_config(arch, tok.get_vocab_size(), eos_id, pad_id, **dict(shape))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=cfg.bos_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output HF model directory")
    p.add_argument("--arch", default="qwen2", choices=list(ARCHS))
    p.add_argument("--vocab-corpus", default=None, help="text file to train the tokenizer on")
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--num-experts", type=int, default=8, help="qwen3_moe: experts per layer")
    p.add_argument("--experts-per-token", type=int, default=2, help="qwen3_moe: top-k")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = p.parse_args(argv)
    moe = (
        {"num_experts": a.num_experts, "num_experts_per_tok": a.experts_per_token}
        if a.arch == "qwen3_moe"
        else {}
    )
    out = build_tiny_model(
        a.out,
        arch=a.arch,
        vocab_corpus=a.vocab_corpus,
        seed=a.seed,
        vocab_size=a.vocab_size,
        dtype=a.dtype,
        hidden_size=a.hidden_size,
        num_hidden_layers=a.num_layers,
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads,
        **moe,
    )
    print(out)


if __name__ == "__main__":
    main()
