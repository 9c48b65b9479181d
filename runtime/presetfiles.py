"""The router mode's model sources read as sections: the ``--models-preset`` INI file and the ``--models-dir`` folder.

Each gives ``{name: {key: value}}``, the keys llama-server's flags without their dashes
(``runtime.presets`` describes both formats); ``runtime.presetflags`` reads the keys as flags.
"""

from __future__ import annotations

import re
from pathlib import Path

from llamactor.protocol.errors import ConfigError

GLOBAL_SECTION = "*"
DEFAULT_SECTION = "default"  # keys before the first section; dropped when that is only "version"
COMPANION_PREFIXES = ("mtp-", "dspark-", "dflash-")  # draft models beside a model, in a subfolder
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


__all__ = ["DEFAULT_SECTION", "GLOBAL_SECTION", "parse_ini", "scan_models_dir"]
