"""A preset section's keys as the serve command line's flags, and the words and INI they are shown as.

A key is any spelling of a ``runtime.cliflags`` option without its dashes, or its variable
(``preset_keys``); ``section_options`` reads a section into ``PresetOptions``, which give the
argv each model is parsed from (``preset_parser``) and what ``GET /models`` shows.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from llamactor.protocol.errors import ConfigError
from llamactor.runtime import cliargs, cliflags

LOAD_ON_STARTUP, STOP_TIMEOUT, DEDUP_CACHE_MODELS = "load-on-startup", "stop-timeout", "dedup-cache-models"
PRESET_ONLY = (LOAD_ON_STARTUP, STOP_TIMEOUT, DEDUP_CACHE_MODELS)
# The router's own: dropped from a preset (llama-server's unset_reserved_args), and from the
# command line's layer the model's name and file.
ROUTER_FLAGS = frozenset(
    {
        "--host",
        "--port",
        "--api-key",
        "--api-key-file",
        "--ssl-key-file",
        "--ssl-cert-file",
        "--models-dir",
        "--models-preset",
        "--models-max",
        "--models-autoload",
    }
)
ROUTER_FIELDS = frozenset({"model", "alias", "aliases"})  # set per model, not by the command line
_TRUE = frozenset({"on", "enabled", "true", "1"})
_FALSE = frozenset({"off", "disabled", "false", "0"})


@dataclass(frozen=True)
class PresetKey:
    """A key a preset may use: the option it sets, and whether its spelling reverses a switch."""

    opt: cliargs.Opt
    use: cliargs.Use
    negated: bool  # given by a --no- spelling: its value is reversed


def preset_keys() -> dict[str, PresetKey]:
    """Every key a preset may use: each spelling without dashes, and each variable."""
    keys: dict[str, PresetKey] = {}
    for group, o in cliargs.entries(cliflags.GROUPS):
        for name in o.names:
            keys[name.lstrip("-")] = PresetKey(o, group.use, False)
        for name in o.neg:
            keys[name.lstrip("-")] = PresetKey(o, group.use, True)
        if o.env:
            keys[o.env] = PresetKey(o, group.use, False)
    return keys


def _long(o: cliargs.Opt) -> str:
    return next((n for n in reversed(o.names) if n.startswith("--")), o.names[-1])


def switch_value(text: str) -> bool:
    return text.strip().lower() not in _FALSE


@dataclass
class PresetOptions:
    """One preset section's flags, keyed by option (a later value for the same option wins)."""

    values: dict[cliargs.Opt, str] = field(default_factory=dict)
    only: dict[str, str] = field(default_factory=dict)  # preset-only keys

    def merged(self, over: PresetOptions) -> PresetOptions:
        return PresetOptions({**self.values, **over.values}, {**self.only, **over.only})

    def argv(self, *, joined: bool = True, redact: bool = False) -> list[str]:
        """The command-line words these options amount to (llama-server's ``to_args``).
        ``joined``: ``--flag=value``, so that a value starting with "-" stays a value (for the
        parser); else ``--flag value`` (to show). ``redact``: the values of ``SECRET_FLAGS``
        shown as ``REDACTED`` (what ``GET /models`` shows)."""
        words: list[str] = []
        for o, value in self.values.items():
            if redact and _long(o) in SECRET_FLAGS:
                value = REDACTED
            if o.value is None:
                if switch_value(value):
                    words.append(_long(o))
                elif o.neg:
                    words.append(o.neg[-1])
            elif " " in o.value:
                words += [_long(o), *value.split()]
            elif joined and _long(o).startswith("--"):
                words.append(f"{_long(o)}={value}")
            else:
                words += [_long(o), value]
        return words

    def ini(self, name: str, *, redact: bool = False) -> str:
        """The section as llama-server prints a preset (``GET /models``' ``status.preset``)."""
        lines = [f"[{name}]"]
        lines += [
            f"{_long(o).lstrip('-')} = {REDACTED if redact and _long(o) in SECRET_FLAGS else value}"
            for o, value in self.values.items()
        ]
        lines += [f"{key} = {value}" for key, value in self.only.items()]
        return "\n".join(lines) + "\n\n"


# flags whose values are secrets or reach other machines (an MCP server's tokens, an ssh target,
# keys): never shown by GET /models
SECRET_FLAGS = frozenset({"--api-key", "--mcp-servers-json", "--tools-runtime", "--hf-token", "--ssl-key-file"})
REDACTED = "REDACTED"


def shown_options(argv: Sequence[str]) -> PresetOptions:
    """The router's command line as preset options, to show with each model's as llama-server
    shows them (``GET /models``' ``status.args`` and ``preset``): the flags that are each
    model's, as given; the router's own and the process's left out."""
    spellings = {n: (group, o) for group, o in cliargs.entries(cliflags.GROUPS) for n in o.spellings}
    out = PresetOptions()
    i = 0
    while i < len(argv):
        word = argv[i]
        i += 1
        flag, eq, inline = word.partition("=") if word.startswith("--") else (word, "", "")
        if flag not in spellings:
            continue
        group, o = spellings[flag]
        if o.value is None:
            value = "false" if flag in o.neg else "true"
        elif eq:
            value = inline
        elif o.optional is not None and (i >= len(argv) or argv[i].startswith("-")):
            value = str(o.optional)
        else:
            n = len(o.value.split())
            value = " ".join(argv[i : i + n])
            i += n
        if group.use is not cliargs.Use.PROCESS and o.field not in ROUTER_FIELDS and not ROUTER_FLAGS & set(o.names):
            out.values[o] = value
    return out


def section_options(section: Mapping[str, str], where: str, keys: Mapping[str, PresetKey]) -> PresetOptions:
    out = PresetOptions()
    for key, value in section.items():
        if key == "version":
            continue
        if key in PRESET_ONLY:
            out.only[key] = value
            continue
        found = keys.get(key)
        if found is None:
            raise ConfigError(f"{where}: option {key!r} is not one of llama-server's flags")
        if any(n in ROUTER_FLAGS for n in found.opt.names):
            continue  # the router's, as llama-server drops them from a preset
        if found.opt.value is None and found.negated:
            value = "false" if switch_value(value) else "true"
        out.values[found.opt] = value
    return out


class PresetParser(argparse.ArgumentParser):
    """The serve command line's options, for a preset's flags: errors are ConfigErrors."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def preset_parser() -> PresetParser:
    parser = PresetParser(prog="preset", add_help=False, allow_abbrev=False)
    cliargs.add_arguments(parser, cliflags.GROUPS)
    return parser


__all__ = [
    "LOAD_ON_STARTUP",
    "ROUTER_FIELDS",
    "STOP_TIMEOUT",
    "PresetOptions",
    "PresetParser",
    "preset_keys",
    "preset_parser",
    "section_options",
    "shown_options",
    "switch_value",
]
