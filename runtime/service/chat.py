"""Chat templates: the GGUF's Jinja template rendered in a jinja2 sandbox.

The template comes from the model (``tokenizer.chat_template``), or from --chat-template /
--chat-template-file; a model without one gets ChatML. With --no-jinja, a --chat-template that
names one of llama.cpp's built-in templates (``llama3``, ``gemma``, ...) is that template,
rendered by llama.cpp (``runtime.engine.builtin_templates``), as llama-server does: it sees
role and content only (no tools, no ``chat_template_kwargs``). The sandbox is immutable (no
attribute writes) and has only the helpers HF templates expect: ``raise_exception``,
``strftime_now``, a ``tojson`` that writes JSON as ``transformers`` does (no HTML escaping:
tool schemas reach the model as written) and the ``break``/``continue`` loop controls. Extra
variables (``tools``, ``enable_thinking``, ``chat_template_kwargs``) are passed by
``runtime.service.chatprepare``.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llamactor.protocol.errors import ConfigError, RequestError
from llamactor.runtime.engine.builtin_templates import apply_builtin_template

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _raise(message: str) -> None:
    raise RequestError(f"chat template: {message}")


class _Undefined(jinja2.Undefined):
    """An undefined variable added to a string is the string, as llama.cpp's Jinja engine has it
    (firefunction-v2's template adds ``functions``, which llama.cpp never defines)."""

    def __add__(self, other: Any) -> Any:
        return other if isinstance(other, str) else super().__add__(other)

    def __radd__(self, other: Any) -> Any:
        return other if isinstance(other, str) else super().__radd__(other)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """``transformers``' tojson filter (jinja2's own escapes <, > and & for HTML)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """The template every chat of a runtime is rendered with; made once at startup.

    ``source`` is Jinja source (None: ChatML), or with ``builtin`` the name of a llama.cpp
    template. ``origin`` says where it came from (the startup log line names it).
    """

    def __init__(
        self,
        source: str | None,
        *,
        bos_token: str = "",
        eos_token: str = "",
        builtin: bool = False,
        origin: str = "",
    ) -> None:
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.builtin = builtin
        self.origin = origin
        self.source = source or CHATML
        if builtin:
            assert source, "a built-in template is chosen by its name"
            return
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], undefined=_Undefined
        )
        env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateError as exc:
            raise ConfigError(f"the model's chat template does not compile: {exc}") from exc

    @property
    def name(self) -> str:
        """What the startup log calls it: the built-in's name, "chatml", or "jinja"."""
        return self.source if self.builtin else "chatml" if self.source == CHATML else "jinja"

    def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt of ``messages``; ``extra`` are template variables (a built-in has none)."""
        if self.builtin:
            rows = [(str(m["role"]), str(m["content"])) for m in messages]
            return apply_builtin_template(self.source, rows, add_assistant=add_generation_prompt)
        try:
            now = datetime.datetime.now()
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                # today, as llama.cpp gives every template (Llama 3.x's system prompt shows it);
                # chat_template_kwargs may set them
                **{"date_string": now.strftime("%d %b %Y"), "datetime": now.strftime("%b %d %Y"), **extra},
            )
        except RequestError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, ValueError) as exc:
            raise RequestError(f"chat template failed on these messages: {exc}") from exc
