"""Which chat template a runtime renders chats with, chosen as llama-server chooses it.

Read once when a runtime opens (``RuntimeLifecycle``): a ``ConfigError`` here stops the start.
"""

from __future__ import annotations

import structlog

from llamactor.protocol.errors import ConfigError
from llamactor.runtime.engine.builtin_templates import builtin_template_names
from llamactor.runtime.engine.model import Model
from llamactor.runtime.service.chat import ChatTemplate
from llamactor.runtime.service.config import RuntimeConfig

log = structlog.get_logger("llamactor.runtime")


def load_chat_template(cfg: RuntimeConfig, model: Model) -> ChatTemplate:
    """The chat template, as llama-server chooses it: --chat-template (Jinja source; "chatml";
    with --no-jinja the name of a llama.cpp built-in template), else --chat-template-file,
    else the GGUF's own, else ChatML. Its ``origin`` says which."""
    source, builtin, origin = _chat_template_choice(cfg, model)
    return ChatTemplate(
        source,
        bos_token=model.token_text(model.bos),
        eos_token=model.token_text(model.eos),
        builtin=builtin,
        origin=origin,
    )


def _chat_template_choice(cfg: RuntimeConfig, model: Model) -> tuple[str | None, bool, str]:
    """(Jinja source or a built-in's name, whether it is a built-in, where it came from)."""
    given = cfg.chat_template
    if given is not None:
        if given in builtin_template_names():
            if not cfg.jinja:
                return given, True, "llama.cpp built-in (--chat-template --no-jinja)"
            if given != "chatml":  # "chatml" is ChatML with Jinja too, as in llama-server
                log.warning(
                    "chat_template_is_a_name",
                    template=given,
                    warning=f"--chat-template {given!r} names a llama.cpp built-in template, but with Jinja on "
                    "it is read as Jinja source (as llama-server does): add --no-jinja to use the built-in",
                )
        if given == "chatml":
            return None, False, "--chat-template chatml"
        return given, False, "--chat-template"
    if cfg.chat_template_file is not None:
        try:
            with open(cfg.chat_template_file, encoding="utf-8") as f:
                return f.read(), False, f"--chat-template-file {cfg.chat_template_file}"
        except OSError as exc:
            raise ConfigError(f"cannot read --chat-template-file {cfg.chat_template_file}: {exc.strerror}") from None
    source = model.chat_template()
    if source is None:
        return None, False, "fallback: the GGUF has no chat template"
    return source, False, "gguf (tokenizer.chat_template)"
