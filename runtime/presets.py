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

The files are read by ``runtime.presetfiles`` and their keys by ``runtime.presetflags``; this
module layers each model's flags and makes its spec.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgspec

from llamactor.protocol.errors import ConfigError
from llamactor.protocol.sampling import SamplingParams
from llamactor.runtime import cliargs, cliflags
from llamactor.runtime.presetfiles import DEFAULT_SECTION, GLOBAL_SECTION, parse_ini, scan_models_dir
from llamactor.runtime.presetflags import (
    LOAD_ON_STARTUP,
    ROUTER_FIELDS,
    STOP_TIMEOUT,
    PresetOptions,
    PresetParser,
    preset_keys,
    preset_parser,
    section_options,
    shown_options,
    switch_value,
)
from llamactor.runtime.service.config import RuntimeConfig, name_set, size_per_slot
from llamactor.runtime.service.modeltable import DEFAULT_STOP_TIMEOUT_S, ModelSpec


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
    keys = preset_keys()
    found: dict[str, tuple[str, PresetOptions]] = {}  # name -> (source, options)
    if models_dir:
        for name, section in scan_models_dir(models_dir).items():
            found[name] = ("models_dir", section_options(section, f"--models-dir model {name}", keys))
    common = PresetOptions()
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
            common = section_options(sections.pop(GLOBAL_SECTION), f"--models-preset [{GLOBAL_SECTION}]", keys)
        for name, section in sections.items():
            options = section_options(section, f"--models-preset [{name}]", keys)
            _, before = found.get(name, ("", PresetOptions()))
            found[name] = ("preset", before.merged(options))
    if not found:
        given = (("--models-dir", models_dir), ("--models-preset", preset_file))
        where = " and ".join(f"{flag} {value}" for flag, value in given if value)
        raise ConfigError(f"no model found in {where}")
    env, flags = _split_command_line(command_line)
    shown = shown_options(argv)
    parser = preset_parser()
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
                load_on_startup=switch_value(options.only.get(LOAD_ON_STARTUP, "false")),
                stop_timeout_s=_stop_timeout(options.only.get(STOP_TIMEOUT)),
            )
        )
    return Models(tuple(specs), tuple(ignored))


def _parse(parser: PresetParser, argv: Sequence[str], name: str) -> cliargs.Parsed:
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
