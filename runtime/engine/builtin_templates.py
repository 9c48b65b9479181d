"""llama.cpp's own chat templates, chosen by name (``chatml``, ``llama3``, ``gemma``, ...).

llama-server renders these with ``llama_chat_apply_template`` when it runs with ``--no-jinja``
and ``--chat-template NAME``; ``runtime.service.chat`` does the same through this module. The
names are the library's (``llama_chat_builtin_templates``), so they follow the vendored
llama.cpp. Both calls are pure string work on the caller's thread, no model or context: a few
microseconds per chat, made once per request when its prompt is rendered.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import llama_cpp

from llamactor.protocol.errors import RequestError


@functools.cache
def builtin_template_names() -> frozenset[str]:
    """The names ``llama_chat_apply_template`` takes as a template (read once per process)."""
    n = llama_cpp.llama_chat_builtin_templates(None, 0)
    if n <= 0:
        return frozenset()
    names = (ctypes.c_char_p * n)()
    llama_cpp.llama_chat_builtin_templates(names, n)
    return frozenset(name.decode() for name in names if name)


def apply_builtin_template(name: str, messages: Sequence[tuple[str, str]], *, add_assistant: bool) -> str:
    """``messages`` as (role, content) rendered by llama.cpp's template ``name``; with
    ``add_assistant`` the prompt ends where the assistant's answer begins.

    Raises RequestError when the template cannot render them (llama.cpp returns a negative
    length: a role or an order that template has no form for)."""
    chat = (llama_cpp.llama_chat_message * len(messages))()
    keep = []  # the encoded strings must outlive the call
    for i, (role, content) in enumerate(messages):
        role_b, content_b = role.encode(), content.encode()
        keep += [role_b, content_b]
        chat[i].role, chat[i].content = role_b, content_b
    tmpl = name.encode()
    size = max(256, 2 * sum(len(b) for b in keep))
    for _ in range(2):  # the first answer may be the length needed
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(tmpl, chat, len(messages), add_assistant, buf, size)
        if n < 0:
            raise RequestError(f"chat template {name!r} (llama.cpp's built-in) cannot render these messages")
        if n <= size:
            return buf.raw[:n].decode("utf-8", "replace")
        size = n
    raise RequestError(f"chat template {name!r}: llama.cpp gave no stable prompt length")


__all__ = ["apply_builtin_template", "builtin_template_names"]
