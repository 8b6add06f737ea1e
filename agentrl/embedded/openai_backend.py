"""The embedded engine as a backend of the OpenAI front end (:mod:`agentrl.engine.openai_api`):
``/v1/chat/completions`` and ``/v1/completions`` generate in process, on the engine's own scheduler."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch

from agentrl.chat import ChatTokenizer
from agentrl.embedded.request import EngineFailed
from agentrl.embedded.sampling import EngineBadRequest, RequestSampling
from agentrl.engine.openai_api import Generation, OpenAIError, Prompt, TokenHook


class EmbeddedBackend:
    """:class:`CompletionBackend` over an in-process :class:`~agentrl.embedded.engine.EmbeddedEngine`.

    ``top_logprobs`` come from one teacher-forced forward of prompt + completion on the engine's device
    thread after sampling (the engine itself returns the sampled token's logprob only); the sampled
    tokens' own ``logprob`` values are the engine's.
    """

    def __init__(self, engine: Any, served_model: str | None = None) -> None:
        self.engine = engine
        self.model = served_model or engine.model_path
        self._aliases = {self.model, engine.model_path, Path(engine.model_path).name}
        self.chat = ChatTokenizer(engine.tokenizer)

    @property
    def context_len(self) -> int:
        return int(self.engine.max_context)

    def accepts_model(self, name: str) -> bool:
        return name in self._aliases

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Prompt:
        return Prompt(self.chat.prompt_ids(messages, tools), messages, tools)

    async def generate(
        self,
        prompt: Prompt,
        sampling: dict[str, Any],
        rid: str,
        top_logprobs: int,
        on_tokens: TokenHook | None = None,
    ) -> Generation:
        try:
            sp = RequestSampling.from_sglang(sampling, self.engine.default_max_new_tokens)
            if on_tokens is None:
                rec = await self.engine.generate(prompt.ids, sp, rid)
            else:  # the engine's token stream: each step's new tokens go to the hook as they come
                stream = self.engine.stream(prompt.ids, sp, rid)
                try:
                    async for delta in stream:
                        on_tokens(delta.ids, delta.logprobs)
                finally:
                    await stream.aclose()
                rec = stream.record
        except EngineBadRequest as err:
            raise OpenAIError(str(err)) from None
        except EngineFailed as err:
            raise OpenAIError(str(err), status=500, type="server_error") from None
        except asyncio.CancelledError:  # the client went away: nothing may keep generating for it
            self.engine.abort(rid)
            raise
        fr = rec.finish_reason or {}
        matched = fr.get("matched") if isinstance(fr.get("matched"), str) else None
        top = None
        if top_logprobs and rec.output_ids:
            top = await self.engine._on_device(self._top_logprobs, prompt.ids, rec.output_ids, top_logprobs)
        return Generation(
            rec.output_ids,
            rec.logprobs,
            str(fr.get("type", "stop")),
            len(prompt.ids),
            rec.cached_tokens,
            rec.weight_version,
            matched,
            top,
        )

    def _top_logprobs(self, prompt: list[int], output: list[int], k: int) -> list[list[tuple[int, float]]]:
        model = self.engine.model
        with torch.inference_mode():
            ids = torch.tensor([prompt + output[:-1]], device=next(model.parameters()).device)
            logits = model(ids).logits[0, len(prompt) - 1 :].float().log_softmax(-1)
            vals, idx = logits.topk(k, dim=-1)
        return [list(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(idx, vals, strict=True)]

    def on_reply(self, gen: Generation, message: dict[str, Any] | None) -> None:
        pass
