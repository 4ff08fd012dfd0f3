"""Text in, text out for ``runtime.server``: prompts, chat templates, decoding (streamed
with stop strings: ``runtime.server.stop``).

A checkpoint with ``tokenizer.json`` takes and returns text (the ``tokenizers``
package, loaded the way ``runtime.serve.prompts`` loads it). Chat requests are rendered with
the checkpoint's chat template (``tokenizer_config.json`` ``chat_template``, a Jinja
template rendered in a sandbox with ``messages``, ``add_generation_prompt=True``,
``bos_token`` and ``eos_token``, as transformers does); without one, with the plain
fallback::

    system: <content>
    user: <content>
    assistant:

The presets (``tiny``, ``small``) have no tokenizer: ``/v1/completions`` then takes the
prompt as a list of token ids (the OpenAI API's ``prompt: [int, ...]`` form) and every
response carries the generated ids in ``choices[i].token_ids``, the answer of a model
without text (its ``text`` is ""); ``stop`` strings need a tokenizer (token ids:
``stop_token_ids``); chat needs a tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runtime.serve.prompts import load_tokenizer

PLAIN_CHAT_FALLBACK = "plain"
"""The name of the fallback chat format (``role: content`` lines)."""


class TextCodec:
    """Turns request prompts into token ids and ids back into text.

    ``tokenizer``: a ``tokenizers.Tokenizer`` or None (ids only). ``chat_template``: a
    Jinja source or None (plain fallback). Thread-safe for reading (no mutation after
    construction)."""

    def __init__(
        self,
        vocab_size: int,
        tokenizer: Any = None,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.special_tokens = dict(special_tokens or {})
        self.eos_token_ids = tuple(eos_token_ids)
        """Where generation stops (the checkpoint's end-of-sequence ids; empty: never)."""
        self._template = _compile(chat_template) if chat_template else None

    @classmethod
    def from_checkpoint_dir(
        cls, directory: Path | None, vocab_size: int, eos_token_ids: tuple[int, ...] = ()
    ) -> TextCodec:
        """The codec of a checkpoint directory (None: a preset, ids only)."""
        if directory is None:
            return cls(vocab_size)
        tokenizer_file = directory / "tokenizer.json"
        tokenizer = load_tokenizer(tokenizer_file if tokenizer_file.is_file() else None)
        template, special = None, {}
        config_file = directory / "tokenizer_config.json"
        if config_file.is_file():
            tok_config = json.loads(config_file.read_text())
            template = tok_config.get("chat_template")
            if isinstance(template, list):  # named templates: take "default"
                named = {t.get("name"): t.get("template") for t in template}
                template = named.get("default")
            for name in ("bos_token", "eos_token"):
                value = tok_config.get(name)
                if isinstance(value, dict):
                    value = value.get("content")
                if isinstance(value, str):
                    special[name] = value
        if not eos_token_ids and tokenizer is not None and "eos_token" in special:
            found = tokenizer.token_to_id(special["eos_token"])
            eos_token_ids = () if found is None else (found,)
        return cls(vocab_size, tokenizer, template, special, eos_token_ids)

    @property
    def has_text(self) -> bool:
        return self.tokenizer is not None

    @property
    def chat_format(self) -> str:
        """``"template"`` (the checkpoint's) or the plain fallback's name."""
        return "template" if self._template is not None else PLAIN_CHAT_FALLBACK

    def encode_prompt(self, prompt: Any) -> list[int]:
        """Token ids of a completion ``prompt``: a string (needs a tokenizer), a list of
        ints, or a one-element list of either. ``ValueError`` naming what is wrong."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "this model has no tokenizer (a preset): give 'prompt' as a list of "
                    f"token ids in range({self.vocab_size})"
                )
            return self._checked(self.tokenizer.encode(prompt).ids)
        if isinstance(prompt, list) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in prompt
        ):
            return self._checked(prompt)
        raise ValueError(
            "'prompt' must be a string, a list of token ids, or a list of either (a batch)"
        )

    def encode_prompts(self, prompt: Any) -> list[list[int]]:
        """The prompts of a completion request: one (a string, a list of ids) or a batch
        (a list of strings or of id lists). ``ValueError`` naming what is wrong."""
        if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
            return [self.encode_prompt(p) for p in prompt]
        return [self.encode_prompt(prompt)]

    def token_text(self, token: int) -> str:
        """One token's text (log-probabilities name tokens by it); without a tokenizer
        ``"token_id:N"`` (vLLM's ``return_tokens_as_token_ids`` form)."""
        if self.tokenizer is None:
            return f"token_id:{token}"
        return str(self.tokenizer.decode([token], skip_special_tokens=False))

    def encode_chat(self, messages: Any) -> list[int]:
        """Token ids of a chat: the template (or the plain fallback) rendered with a
        generation prompt, then tokenized. ``ValueError`` for malformed messages."""
        if self.tokenizer is None:
            raise ValueError(
                "chat needs a checkpoint with tokenizer.json; this model (a preset) takes "
                "token ids on /v1/completions"
            )
        turns = _messages(messages)
        if self._template is not None:
            try:
                text = self._template.render(
                    messages=turns, add_generation_prompt=True, **self.special_tokens
                )
            except Exception as err:  # a template's raise_exception or a render error
                raise ValueError(f"chat template failed: {err}") from None
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        else:
            text = "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:"
            ids = self.tokenizer.encode(text).ids
        return self._checked(ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special tokens skipped); without a tokenizer "" (the ids are
        the answer: ``choices[i].token_ids``)."""
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def _checked(self, ids: Sequence[int]) -> list[int]:
        ids = list(ids)
        if not ids:
            raise ValueError("the prompt has no tokens")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} not in range({self.vocab_size})")
        return ids


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text parts carry text here
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise ValueError(f"messages[{i}]: only text content parts are supported")
                parts.append(str(part.get("text", "")))
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or text parts")
        out.append({"role": message["role"], "content": content})
    return out


def _compile(source: str) -> Any:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)
