"""Chat templates: the GGUF's Jinja template rendered in a jinja2 sandbox (API-4).

The template comes from the model (``tokenizer.chat_template``); a model without one gets
ChatML. The sandbox is immutable (no attribute writes) and has only the helpers HF templates
expect: ``raise_exception`` and ``strftime_now``.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llamactor.protocol.errors import ConfigError, RequestError

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _raise(message: str) -> None:
    raise RequestError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
        self.source = source or CHATML
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateError as exc:
            raise ConfigError(f"the model's chat template does not compile: {exc}") from exc
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True, **extra: Any) -> str:
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except RequestError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, ValueError) as exc:
            raise RequestError(f"chat template failed on these messages: {exc}") from exc
