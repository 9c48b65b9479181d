"""The router mode's models: those of ``--models-dir`` and the sections of ``--models-preset``.

llama-server's formats (its tools/server/README.md, "Using multiple models"):

- ``--models-dir PATH``: each ``NAME.gguf`` file in the folder is a model named NAME; each
  subfolder holding a ``.gguf`` file is a model named after the subfolder (its first shard
  ``*-00001-of-*.gguf`` when the model is split). Files named ``mmproj*`` (projectors) and
  ``mtp-*``, ``dspark-*``, ``dflash-*`` (drafts) are companions, never models of their own; a
  subfolder's draft becomes its model's ``--model-draft``.
- ``--models-preset FILE``: an INI file. Each ``[section]`` is a model, ``[*]`` holds options for
  every model, and a section named as a models-dir model adds options to it. Keys are
  llama-server's flags without their dashes (``c``, ``ctx-size``, ``n-gpu-layers``, ``model``) or
  their ``LLAMA_ARG_*`` variables; a switch takes true/false (a ``no-`` spelling reverses it);
  ``;`` and ``#`` start comments; keys before the first section (``version = 1``) are skipped.
  Keys of presets only: ``load-on-startup``, ``stop-timeout`` (seconds, default 10) and
  ``dedup-cache-models`` (there is no download cache here: accepted, no effect).

A model's flags, lowest first: the ``LLAMA_ARG_*`` variables of the router's environment, the
preset's ``[*]``, the model's section, the router's command line (llama-server's precedence:
its children inherit the environment, and the router's own flags win). The router's own flags
(listen address, API keys, TLS, the models-* flags) are the router's: in a preset they are
dropped, as llama-server drops them, and the model's name is its ``--alias``. Each model's flags
are read by the command line's own table (``runtime.cliflags``): one llamactor refuses stops
startup naming the model, one it ignores is reported for a log line.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import msgspec

from llamactor.protocol.errors import ConfigError
from llamactor.protocol.sampling import SamplingParams
from llamactor.runtime import cliargs, cliflags
from llamactor.runtime.service.config import RuntimeConfig, name_set, size_per_slot
from llamactor.runtime.service.modelset import DEFAULT_STOP_TIMEOUT_S, ModelSpec

GLOBAL_SECTION = "*"
DEFAULT_SECTION = "default"  # keys before the first section; dropped when that is only "version"
COMPANION_PREFIXES = ("mtp-", "dspark-", "dflash-")  # draft models beside a model, in a subfolder
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
_SECTION = re.compile(r"^\[[ \t]*([^\]]*?)[ \t]*\][ \t]*(?:[;#].*)?$")
_KEY_VALUE = re.compile(r"^([A-Za-z_][A-Za-z0-9_.-]*)[ \t]*=[ \t]*([^;#\r\n]*?)[ \t]*(?:[;#].*)?$")
_COMMENT_OR_BLANK = re.compile(r"^[ \t]*(?:[;#].*)?$")
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)


# ---- the INI format ---------------------------------------------------------------------------


def parse_ini(text: str, source: str = "the preset file") -> dict[str, dict[str, str]]:
    """Sections of llama-server's preset INI, each ``{key: value}`` in file order. A section
    given twice starts over (as llama-server's parser); ConfigError names a line it cannot read."""
    sections: dict[str, dict[str, str]] = {}
    current = DEFAULT_SECTION
    for number, line in enumerate(text.splitlines(), 1):
        if _COMMENT_OR_BLANK.match(line):
            continue
        header = _SECTION.match(line)
        if header is not None:
            current = _canonical_section(header.group(1))
            sections[current] = {}
            continue
        pair = _KEY_VALUE.match(line)
        if pair is None:
            raise ConfigError(f"failed to parse {source}, line {number}: {line.strip()!r}")
        sections.setdefault(current, {})[pair.group(1)] = pair.group(2)
    return sections


def _canonical_section(name: str) -> str:
    """A ``repo:tag`` section with its tag as llama-server writes it (``:q8_0`` is ``:Q8_0``)."""
    if name in (GLOBAL_SECTION, DEFAULT_SECTION):
        return name
    head, colon, tag = name.rpartition(":")
    if not colon:
        return name
    found = _TAG.search(tag)
    return f"{head}:{(found.group(1) if found else tag).upper()}"


# ---- the models folder -----------------------------------------------------------------------


def scan_models_dir(folder: str | Path) -> dict[str, dict[str, str]]:
    """Each model of a models folder as preset options (``model``, maybe ``model-draft``), by name."""
    root = Path(folder)
    if not root.is_dir():
        raise ConfigError(f"--models-dir {folder}: does not exist or is not a directory")
    out: dict[str, dict[str, str]] = {}
    for entry in sorted(root.iterdir()):
        if entry.is_dir():
            options = _scan_subfolder(entry)
            if options:
                out[entry.name] = options
        elif entry.is_file() and entry.name.endswith(".gguf") and not _companion(entry.name):
            out[entry.name.replace(".gguf", "")] = {"model": str(entry)}
    return out


def _companion(name: str) -> bool:
    return "mmproj" in name or name.startswith(COMPANION_PREFIXES)


def _scan_subfolder(folder: Path) -> dict[str, str]:
    model = first_shard = draft = None
    for file in sorted(folder.iterdir()):
        if not (file.is_file() and file.name.endswith(".gguf")):
            continue
        if "mmproj" in file.name:
            continue  # a multimodal projector: not built here (--mmproj is refused)
        if file.name.startswith(COMPANION_PREFIXES):
            draft = draft or file
        elif "-00001-of-" in file.name:
            first_shard = file
        else:
            model = file
    path = first_shard or model
    if path is None:
        return {}
    options = {"model": str(path)}
    if draft is not None:
        options["model-draft"] = str(draft)
    return options


# ---- a model's flags --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Key:
    opt: cliargs.Opt
    use: cliargs.Use
    negated: bool  # given by a --no- spelling: its value is reversed


def _keys() -> dict[str, _Key]:
    """Every key a preset may use: each spelling without dashes, and each variable."""
    keys: dict[str, _Key] = {}
    for group, o in cliargs.entries(cliflags.GROUPS):
        for name in o.names:
            keys[name.lstrip("-")] = _Key(o, group.use, False)
        for name in o.neg:
            keys[name.lstrip("-")] = _Key(o, group.use, True)
        if o.env:
            keys[o.env] = _Key(o, group.use, False)
    return keys


def _long(o: cliargs.Opt) -> str:
    return next((n for n in reversed(o.names) if n.startswith("--")), o.names[-1])


def _switch_value(text: str) -> bool:
    return text.strip().lower() not in _FALSE


@dataclass
class _Options:
    """One preset section's flags, keyed by option (a later value for the same option wins)."""

    values: dict[cliargs.Opt, str] = field(default_factory=dict)
    only: dict[str, str] = field(default_factory=dict)  # preset-only keys

    def merged(self, over: _Options) -> _Options:
        return _Options({**self.values, **over.values}, {**self.only, **over.only})

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
                if _switch_value(value):
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


def shown_options(argv: Sequence[str]) -> _Options:
    """The router's command line as preset options, to show with each model's as llama-server
    shows them (``GET /models``' ``status.args`` and ``preset``): the flags that are each
    model's, as given; the router's own and the process's left out."""
    spellings = {n: (group, o) for group, o in cliargs.entries(cliflags.GROUPS) for n in o.spellings}
    out = _Options()
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


def _options(section: Mapping[str, str], where: str, keys: Mapping[str, _Key]) -> _Options:
    out = _Options()
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
            value = "false" if _switch_value(value) else "true"
        out.values[found.opt] = value
    return out


class _Parser(argparse.ArgumentParser):
    """The serve command line's options, for a preset's flags: errors are ConfigErrors."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def _parser() -> _Parser:
    parser = _Parser(prog="preset", add_help=False, allow_abbrev=False)
    cliargs.add_arguments(parser, cliflags.GROUPS)
    return parser


# ---- the router's models ---------------------------------------------------------------------


@dataclass(frozen=True)
class Models:
    """What the router serves: a spec per model, and the flags its preset gives that are ignored."""

    specs: tuple[ModelSpec, ...]
    ignored: tuple[tuple[str, str, str], ...] = ()  # (model, flag, why): one log line each


def load_models(
    models_dir: str | None,
    preset_file: str | None,
    command_line: cliargs.Parsed,
    argv: Sequence[str] = (),
) -> Models:
    """The router's models from its folder and preset file, each with its flags under the
    command line's (``command_line``: what ``cliargs.read`` made of the router's own flags and
    variables; ``argv``, its words, only to show them with each model's). ConfigError for a
    file that cannot be read, a flag refused, no model at all."""
    keys = _keys()
    found: dict[str, tuple[str, _Options]] = {}  # name -> (source, options)
    if models_dir:
        for name, section in scan_models_dir(models_dir).items():
            found[name] = ("models_dir", _options(section, f"--models-dir model {name}", keys))
    common = _Options()
    if preset_file:
        try:
            text = Path(preset_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"--models-preset {preset_file}: {exc.strerror}") from None
        sections = parse_ini(text, f"--models-preset {preset_file}")
        default = sections.pop(DEFAULT_SECTION, {})
        if any(key != "version" for key in default):
            sections[DEFAULT_SECTION] = default  # keys before any section: a model named "default"
        if GLOBAL_SECTION in sections:
            common = _options(sections.pop(GLOBAL_SECTION), f"--models-preset [{GLOBAL_SECTION}]", keys)
        for name, section in sections.items():
            options = _options(section, f"--models-preset [{name}]", keys)
            _, before = found.get(name, ("", _Options()))
            found[name] = ("preset", before.merged(options))
    if not found:
        given = (("--models-dir", models_dir), ("--models-preset", preset_file))
        where = " and ".join(f"{flag} {value}" for flag, value in given if value)
        raise ConfigError(f"no model found in {where}")
    env, flags = _split_command_line(command_line)
    shown = shown_options(argv)
    parser = _parser()
    specs: list[ModelSpec] = []
    ignored: list[tuple[str, str, str]] = []
    for name, (source, own) in sorted(found.items()):
        options = common.merged(own)
        model_key = keys["model"].opt
        if model_key not in options.values:
            raise ConfigError(
                f"--models-preset [{name}]: no model file (give model = FILE, or put {name}.gguf in --models-dir)"
            )
        parsed = _parse(parser, options.argv(), name)
        ignored += [(name, flag, why) for flag, why in parsed.ignored]
        config = _config([env, parsed, flags], name)
        specs.append(
            ModelSpec(
                name=name,
                config=config,
                source=source,
                aliases=tuple(a for a in config.aliases if a != name),
                tags=config.tags,
                args=("llamactor", "serve", *options.merged(shown).argv(joined=False, redact=True), "--alias", name),
                preset=options.merged(shown).ini(name, redact=True),
                load_on_startup=_switch_value(options.only.get(LOAD_ON_STARTUP, "false")),
                stop_timeout_s=_stop_timeout(options.only.get(STOP_TIMEOUT)),
            )
        )
    return Models(tuple(specs), tuple(ignored))


def _parse(parser: _Parser, argv: Sequence[str], name: str) -> cliargs.Parsed:
    where = f"model {name} (--models-preset, --models-dir)"
    try:
        parsed = cliargs.read(parser.parse_args(list(argv)), cliflags.GROUPS)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if parsed.refused:
        raise ConfigError(f"{where}: " + "; ".join(f"{flag} is not supported: {why}" for flag, why in parsed.refused))
    for field_name in parsed.process:
        flag = parsed.spelled.get(field_name, field_name)
        parsed.ignored.append((flag, "the router process's own flag: give it on the command line"))
    return parsed


def _split_command_line(parsed: cliargs.Parsed) -> tuple[cliargs.Parsed, cliargs.Parsed]:
    """The router's command line as two layers: what came from variables (below the presets, as
    llama-server's children inherit them) and what came from flags (above them)."""
    env, flags = cliargs.Parsed(), cliargs.Parsed()
    for kind in ("config", "sampling"):
        for name, value in getattr(parsed, kind).items():
            if name in ROUTER_FIELDS:
                continue
            by_variable = not parsed.spelled.get(name, "-").startswith("-")
            getattr(env if by_variable else flags, kind)[name] = value
    return env, flags


def _config(layers: Iterable[cliargs.Parsed], name: str) -> RuntimeConfig:
    """The model's RuntimeConfig: the layers' fields, each over the one before; named ``name``."""
    config: dict[str, Any] = {}
    sampling: dict[str, Any] = {}
    for layer in layers:
        config.update(layer.config)
        sampling.update(layer.sampling)
    config["alias"] = name
    config["aliases"] = name_set(config.get("aliases", ()))
    size_per_slot(config)
    try:
        made = RuntimeConfig(**config)
        if sampling:
            made = replace(made, sampling=msgspec.structs.replace(SamplingParams(), **sampling))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model {name}: {exc}") from None
    return made


def _stop_timeout(value: str | None) -> float:
    if value is None:
        return DEFAULT_STOP_TIMEOUT_S
    try:
        return float(int(value))
    except ValueError:
        return DEFAULT_STOP_TIMEOUT_S  # as llama-server: an invalid stop-timeout is the default
