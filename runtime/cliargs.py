"""The machinery behind ``runtime.cliflags``' table: options as data, parsed with argparse.

An option (``Opt``) belongs to a ``Group`` whose ``Use`` says what it does; the same option
may come from the command line or from its environment variable. Parsing only records what
was given and how it was spelled; ``read`` then sorts it into field values, ignored flags and
refused flags. Nothing here knows llama-server's flags or llamactor's config.
"""

from __future__ import annotations

import argparse
import enum
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llamactor.protocol.errors import ConfigError

_TRUE = frozenset({"1", "true", "yes", "on", "enabled"})
_FALSE = frozenset({"0", "false", "no", "off", "disabled"})


class Use(enum.Enum):
    CONFIG = "config"  # sets a RuntimeConfig field
    SAMPLING = "sampling"  # sets a field of the server's default SamplingParams
    PROCESS = "process"  # belongs to the process (listen address, TLS, logs), not the runtime
    IGNORE = "ignore"  # accepted; one log line says why it has no effect
    REFUSE = "refuse"  # a feature not built: startup stops naming it


@dataclass(frozen=True)
class Ignored:
    """What a ``convert`` returns for a value that is accepted but has no effect here."""

    why: str


@dataclass(frozen=True)
class Sets:
    """What a ``convert`` returns for a flag that sets several fields (``--reranking``)."""

    fields: Mapping[str, Any]


@dataclass(frozen=True)
class Opt:
    names: tuple[str, ...]  # every spelling llama-server accepts, in its order
    field: str = ""  # CONFIG/SAMPLING/PROCESS: the field it sets
    value: str | None = "N"  # metavar; None: a switch (True, or False when spelled as ``neg``)
    neg: tuple[str, ...] = ()  # the --no-… spellings of a switch
    env: str | None = None
    parse: Callable[[str], Any] = str  # one command-line word to a value (ValueError: bad word)
    many: bool = False  # may repeat: the values are kept in order, as a tuple
    convert: Callable[[Any], Any] | None = None  # parsed value to field value, or Ignored, or None (unset)
    ok: Callable[[Any], bool] | None = None  # IGNORE/REFUSE: values accepted silently
    optional: Any = None  # a value-taking option given bare means this (legacy ``-fa``)
    help: str = ""
    shared: str = ""  # ``many`` options with the same name fill one tuple, in command-line order

    @property
    def spellings(self) -> tuple[str, ...]:
        return self.names + self.neg


@dataclass(frozen=True)
class Group:
    title: str
    use: Use
    why: str  # IGNORE/REFUSE: shown in the log line or the error; others: the README table's note
    opts: tuple[Opt, ...]


def opt(*names: str, **kw: Any) -> Opt:
    return Opt(names=names, **kw)


def switch(*names: str, **kw: Any) -> Opt:
    return Opt(names=names, value=None, **kw)


def entries(groups: Sequence[Group]) -> Iterator[tuple[Group, Opt]]:
    for group in groups:
        for o in group.opts:
            yield group, o


def _dest(group: Group, o: Opt) -> str:
    """One argparse destination per option (several options may set one field)."""
    if group.use in (Use.IGNORE, Use.REFUSE):
        return f"flag:{o.names[0]}"
    return f"{group.use.value}:{o.field}:{o.shared or o.names[0]}"


class _Store(argparse.Action):
    """Stores a flag's value and how it was spelled (for the messages)."""

    def __init__(self, option_strings: list[str], dest: str, *, spec: Opt, **kw: Any) -> None:
        self.spec = spec
        if spec.value is None:
            kw["nargs"] = 0
        elif spec.optional is not None:
            kw.update(nargs="?", const=spec.optional)
        elif " " in spec.value:
            kw["nargs"] = len(spec.value.split())
        super().__init__(option_strings, dest, default=None, **kw)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        value = (option_string not in self.spec.neg) if self.spec.value is None else values
        _store(namespace, self.dest, self.spec, value, option_string or self.spec.names[0])


def _store(namespace: Any, dest: str, spec: Opt, value: Any, spelling: str) -> None:
    if spec.many:
        value = (*(getattr(namespace, dest, None) or ()), value)
    setattr(namespace, dest, value)
    namespace.__dict__.setdefault("_spelled", {})[dest] = spelling


def add_arguments(parser: argparse.ArgumentParser, groups: Sequence[Group]) -> None:
    """Every option of ``groups`` on ``parser``, in argparse groups named as the table's."""
    for group in groups:
        section = parser.add_argument_group(f"{group.title} ({group.use.value})", group.why or None)
        for o in group.opts:
            kw: dict[str, Any] = {} if o.value is None else {"type": o.parse}
            section.add_argument(
                *o.spellings,
                action=_Store,
                dest=_dest(group, o),
                spec=o,
                metavar=tuple(o.value.split()) if o.value and " " in o.value else o.value,
                help=(o.help + (f" (env: {o.env})" if o.env else "")) or None,
                **kw,
            )


def apply_env(
    parser: argparse.ArgumentParser, namespace: Any, groups: Sequence[Group], environ: Mapping[str, str] = os.environ
) -> None:
    """Fill options not given on the command line from their variables (the command line wins).

    A switch's variable is a boolean; ``LLAMA_ARG_NO_<X>`` turns a switch with --no- spellings
    off, as llama-server reads them. A bad value exits through ``parser.error`` naming it.
    """
    spelled = namespace.__dict__.setdefault("_spelled", {})
    given = frozenset(spelled)  # on the command line (options sharing a destination add up from variables)
    for group, o in entries(groups):
        dest = _dest(group, o)
        if o.env is None or dest in given:
            continue
        neg_env = o.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_") if o.neg and "LLAMA_ARG_" in o.env else None
        raw = environ.get(o.env)
        if neg_env is not None and neg_env in environ:
            value: Any = False
        elif raw is None:
            continue
        elif o.value is None:
            if raw.lower() not in _TRUE | _FALSE:
                parser.error(f"{o.env}={raw!r}: expected a boolean (1/0, true/false, on/off)")
            value = raw.lower() in _TRUE
        else:
            try:
                value = o.parse(raw)
            except (ValueError, argparse.ArgumentTypeError) as exc:
                parser.error(f"{o.env}={raw!r}: {exc or 'invalid value'}")
        _store(namespace, dest, o, value, o.env)


@dataclass
class Parsed:
    """What the command line asked for, by destination; only what was given."""

    config: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    process: dict[str, Any] = field(default_factory=dict)
    ignored: list[tuple[str, str]] = field(default_factory=list)  # (spelling, why)
    refused: list[tuple[str, str]] = field(default_factory=list)
    spelled: dict[str, str] = field(default_factory=dict)  # field -> the flag (or variable) that set it


def read(namespace: Any, groups: Sequence[Group]) -> Parsed:
    """Sort the given options into field values, ignored flags and refused flags.

    Raises ConfigError when two flags set one field to different values (``-nocb`` with
    ``--scheduler cohort``); repeatable ones (``--api-key`` and ``--api-key-file``) add up.
    """
    out = Parsed()
    spelled: dict[str, str] = namespace.__dict__.get("_spelled", {})
    by_dest = {_dest(g, o): (g, o) for g, o in entries(groups)}
    setters = out.spelled
    for dest, spelling in spelled.items():
        (group, spec), value = by_dest[dest], getattr(namespace, dest)
        why = group.why + (f" ({spec.help})" if spec.help else "")
        if group.use in (Use.IGNORE, Use.REFUSE):
            if spec.ok is None or not spec.ok(value):
                (out.ignored if group.use is Use.IGNORE else out.refused).append((spelling, why))
            continue
        if spec.convert is not None:
            value = spec.convert(value)
        if isinstance(value, Ignored):
            out.ignored.append((spelling, value.why))
            continue
        if value is None:
            continue
        kind, target, _ = dest.split(":")
        fields: dict[str, Any] = getattr(out, kind)
        for name, v in (value.fields if isinstance(value, Sets) else {target: value}).items():
            if name in fields and spec.many:
                v = (*fields[name], *v)
            elif name in fields and fields[name] != v:
                raise ConfigError(f"{setters[name]} and {spelling} disagree; give one of them")
            fields[name] = v
            setters[name] = spelling
    return out
