"""Token-in/token-out helpers: the only places the rollout turns text into ids or ids into text.

- :meth:`ChatTokenizer.prompt_ids`: the initial messages, rendered ONCE with the model's chat template
  (``add_generation_prompt=True``, the env's tool schemas).
- :meth:`ChatTokenizer.observation_ids`: one observation, tokenized once on its own. A chat-message
  observation is the *template delta*: what the template adds after the assistant's content when a
  ``tool``/``user`` message and the next generation prompt follow (the standard trick: render a fixed
  dummy conversation with and without the new message and keep the difference). The model's own
  end-of-turn token is present exactly once: kept from the sampled ids when the model emitted it,
  added (loss_mask 0) when the turn ended otherwise (stop string, length). A raw observation
  (Search-R1 style, continuing the assistant text) is tokenized alone, no special tokens.
- :meth:`ChatTokenizer.observation_messages_ids`: several observation messages of one step (one per tool
  call), rendered together by the template, so a template that groups them renders them as it would in a
  whole conversation.
- :meth:`ChatTokenizer.action_text`: the decoded action passed to ``env.step``.

History is never decoded and re-tokenized: ids only ever get appended.
"""

from __future__ import annotations

import json
from typing import Any

_MARK = "\u2063AGENTRL_ASSISTANT_MARK\u2063"
_OBS = "\u2063AGENTRL_OBSERVATION\u2063"
_BASE: list[dict[str, Any]] = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot express an observation as an append-only delta."""


class ChatTokenizer:
    """Wraps a HF tokenizer (``AutoTokenizer.from_pretrained(model_dir)``) for the rollout."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        # The Rust tokenizer behind a fast HF tokenizer: same ids, 2-4x less Python overhead per call.
        self._fast = (
            getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        )
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError("the tokenizer has no chat template")
        base = self._render(_BASE, add_generation_prompt=False)
        pos = base.rfind(_MARK)
        if pos < 0:
            raise ChatTemplateError("the chat template does not render assistant content verbatim")
        self._prefix = base[: pos + len(_MARK)]
        # What the template puts after assistant content, e.g. "<|im_end|>\n"; its first token is the
        # model's end-of-turn token (which the engine samples and includes in output_ids).
        tail = base[pos + len(_MARK) :]
        tail_ids = self.encode(tail) if tail else []
        eot: set[int] = set()
        if tail_ids:
            eot.add(tail_ids[0])
        eos = getattr(tokenizer, "eos_token_id", None)
        if isinstance(eos, int):
            eot.add(eos)
        self.eot_ids = eot
        self._eot_in_tail = tail_ids[0] if tail_ids else None
        self._delta_cache: dict[str, tuple[str, str] | None] = {}
        self._prompt_cache: dict[str, list[int]] = {}
        self._split_cache: dict[str, tuple[list[int], str, str, list[int]] | None] = {}
        self._bare_cache: dict[str, bool] = {}
        self._added = (
            sorted((t for t in tokenizer.get_added_vocab() if t), key=len, reverse=True)
            if hasattr(tokenizer, "get_added_vocab")
            else []
        )

    # ---- rendering ---------------------------------------------------------------------------------
    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: Any = None) -> str:
        kw: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
        if tools:
            kw["tools"] = tools
        out = self.tok.apply_chat_template(messages, **kw)
        if not isinstance(out, str):
            raise ChatTemplateError(f"apply_chat_template(tokenize=False) returned {type(out).__name__}")
        return out

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=False).ids
        return list(self.tok.encode(text, add_special_tokens=False))

    def prompt_ids(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Render the initial messages once (with the generation prompt) and tokenize them.

        The samples of a group share their prompt: a small cache keyed by the exact messages and tools
        renders it once per group instead of once per sample (the result is the same list of ids).
        """
        try:
            key = json.dumps([messages, tools], sort_keys=True)
        except (TypeError, ValueError):  # not JSON-able (unusual content objects): no caching
            return self.encode(self._render(messages, add_generation_prompt=True, tools=tools))
        ids = self._prompt_cache.get(key)
        if ids is None:
            ids = self.encode(self._render(messages, add_generation_prompt=True, tools=tools))
            if len(self._prompt_cache) >= 4096:
                self._prompt_cache.pop(next(iter(self._prompt_cache)))  # FIFO eviction
            self._prompt_cache[key] = ids
        return list(ids)

    # ---- observations ------------------------------------------------------------------------------
    def _delta_text(self, role: str, content: str) -> str:
        """Template text from right after the assistant's content to the next generation prompt."""
        parts = self._delta_cache.get(role, ...)
        if parts is ...:
            parts = self._split_delta(role)
            self._delta_cache[role] = parts
        if parts is not None:  # the template inserts content verbatim: fast path, no jinja per call
            return parts[0] + content + parts[1]
        return self._slow_delta(role, content)

    def _slow_delta(self, role: str, content: str) -> str:
        full = self._render([*_BASE, {"role": role, "content": content}], add_generation_prompt=True)
        if not full.startswith(self._prefix):
            raise ChatTemplateError(
                f"adding a {role!r} message changes how earlier "
                "messages render; observations cannot be appended"
            )
        return full[len(self._prefix) :]

    def _split_delta(self, role: str) -> tuple[str, str] | None:
        text = self._slow_delta(role, _OBS)
        if text.count(_OBS) != 1:
            return None
        pre, post = text.split(_OBS)
        for probe in ("a b", "  x\n\ny  ", '{"k": [1, 2]}'):  # verify the fast path renders identically
            if self._slow_delta(role, probe) != pre + probe + post:
                return None
        return pre, post

    def _segments(self, role: str) -> tuple[list[int], str, str, list[int]] | None:
        """The delta split at its last/first added token around the content: (head ids, text before the
        content, text after it, tail ids). A fast tokenizer encodes the text between added tokens on its
        own anyway, so encoding only that middle segment gives the same ids as encoding the whole delta
        (checked on probes at first use; any difference turns this off for the role)."""
        if role in self._split_cache:
            return self._split_cache[role]
        result = None
        parts = self._delta_cache.get(role)
        if parts is not None and self._fast is not None and self._added:
            pre, post = parts
            k = max((pre.rfind(t) + len(t) for t in self._added if t in pre), default=-1)
            j = min((post.find(t) for t in self._added if t in post), default=-1)
            if k > 0 and j >= 0:
                result = (self.encode(pre[:k]), pre[k:], post[:j], self.encode(post[j:]))
                head, a, b, tail = result
                for probe in ("x", " lead", "trail \n", "\n\nnl\n", "mixed <tool_call> tag", "ü ñ 中文", ""):
                    if head + self.encode(a + probe + b) + tail != self.encode(pre + probe + post):
                        result = None
                        break
        self._split_cache[role] = result
        return result

    def observation_ids(
        self, text: str, last_token_id: int | None, fmt: str = "message", role: str = "tool"
    ) -> list[int]:
        """Token ids to append (loss_mask 0) after the model's turn ending in ``last_token_id``."""
        if fmt == "raw":
            return self.encode(text)
        if fmt != "message":
            raise ValueError(f"unknown observation format {fmt!r} (expected 'message' or 'raw')")
        delta = self._delta_text(role, text)
        seg = self._segments(role)
        if seg is not None:
            head, a, b, tail = seg
            ids = head + self.encode(a + text + b) + tail
        else:
            ids = self.encode(delta)
        return self._after_turn(ids, last_token_id)

    def observation_messages_ids(
        self, messages: list[dict[str, Any]], last_token_id: int | None
    ) -> list[int]:
        """Token ids of several observation messages at once (e.g. one ``tool`` message per call), rendered
        together by the chat template, so that a template which groups consecutive tool messages (Qwen's
        one ``user`` turn of ``<tool_response>`` blocks) renders them as it would in a whole conversation.

        One message that the template renders like a bare ``{role, content}`` message takes the cached
        path of :meth:`observation_ids`; anything else is rendered in full after a fixed dummy turn."""
        if not messages:
            raise ValueError("observation messages: the list is empty")
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
                raise ValueError(f"observation message {i} needs a 'role' string: {msg!r}")
            if not isinstance(msg.get("content"), str):
                raise ValueError(f"observation message {i} needs 'content' as a string: {msg!r}")
        if len(messages) == 1 and self._renders_bare(messages[0]):
            return self.observation_ids(messages[0]["content"], last_token_id, "message", messages[0]["role"])
        full = self._render([*_BASE, *messages], add_generation_prompt=True)
        if not full.startswith(self._prefix):
            raise ChatTemplateError(
                "adding observation messages changes how earlier messages render; they cannot be appended"
            )
        return self._after_turn(self.encode(full[len(self._prefix) :]), last_token_id)

    def _renders_bare(self, msg: dict[str, Any]) -> bool:
        """Whether the template renders ``msg`` exactly as ``{role, content}`` alone: its other keys (a tool
        message's ``name`` or ``tool_call_id``) are not shown. Probed once per role and set of keys."""
        extra = tuple(sorted(k for k in msg if k not in ("role", "content")))
        if not extra:
            return True
        key = f"{msg['role']}|{','.join(extra)}"
        bare = self._bare_cache.get(key)
        if bare is None:
            probe = {"role": msg["role"], "content": "probe", **{k: f"probe_{k}" for k in extra}}
            full = self._render([*_BASE, probe], add_generation_prompt=True)
            bare = full[len(self._prefix) :] == self._slow_delta(msg["role"], "probe")
            self._bare_cache[key] = bare
        return bare

    def _after_turn(self, ids: list[int], last_token_id: int | None) -> list[int]:
        """The delta starts with the end-of-turn token; drop it when the model already sampled it."""
        if (
            last_token_id is not None
            and last_token_id in self.eot_ids
            and ids
            and ids[0] == self._eot_in_tail
        ):
            return ids[1:]
        return ids

    # ---- actions -----------------------------------------------------------------------------------
    def action_text(self, ids: list[int]) -> str:
        """The text of one model turn for env.step (the trailing end-of-turn token left out)."""
        if ids and ids[-1] in self.eot_ids:
            ids = ids[:-1]
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=False)
        return self.tok.decode(ids, skip_special_tokens=False)
