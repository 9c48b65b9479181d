"""Request lengths for the open-loop shapes: token-count distributions and the ``--lengths`` file.

``LengthDist`` is what ``--npp-dist`` / ``--ntg-dist`` parse to (``fixed:N``, ``uniform:LO:HI``,
``lognormal:MEDIAN:SIGMA``); ``load_lengths`` reads a JSONL file of per-request lengths, which may
carry their own arrival times. Used by the Poisson shape (``traffic``), the random workloads and
the capacity shapes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DIST_FORMS = "fixed:N, uniform:LO:HI or lognormal:MEDIAN:SIGMA"


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts: ``fixed:N``, ``uniform:LO:HI`` (inclusive) or
    ``lognormal:MEDIAN:SIGMA`` (rounded, clamped to at least 1)."""

    kind: str
    a: float
    b: float = 0.0

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}:{int(self.b)}"
        return f"lognormal:{self.a:g}:{self.b:g}"

    @classmethod
    def parse(cls, text: str, flag: str) -> LengthDist:
        """``text`` as a distribution; a ValueError naming ``flag`` when it is not one."""
        kind, _, rest = text.strip().partition(":")
        args = rest.split(":") if rest else []
        want = {"fixed": 1, "uniform": 2, "lognormal": 2}.get(kind)
        if want is None or len(args) != want:
            raise ValueError(f"{flag} {text!r}: expected {DIST_FORMS}")
        try:
            if kind == "lognormal":
                median, sigma = float(args[0]), float(args[1])
            else:
                values = [int(x) for x in args]
        except ValueError:
            raise ValueError(
                f"{flag} {text!r}: {'numbers' if kind == 'lognormal' else 'integers'} expected after {kind}:"
            ) from None
        if kind == "lognormal":
            if not (math.isfinite(median) and median > 0 and math.isfinite(sigma) and sigma >= 0):
                raise ValueError(f"{flag} {text!r}: lognormal needs MEDIAN > 0 and SIGMA >= 0")
            return cls(kind, median, sigma)
        if kind == "fixed":
            if values[0] < 1:
                raise ValueError(f"{flag} {text!r}: N must be at least 1")
            return cls(kind, values[0])
        if not 1 <= values[0] <= values[1]:
            raise ValueError(f"{flag} {text!r}: uniform needs 1 <= LO <= HI")
        return cls(kind, values[0], values[1])

    def draw(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "fixed":
            return [int(self.a)] * n
        if self.kind == "uniform":
            return [int(x) for x in rng.integers(int(self.a), int(self.b) + 1, size=n)]
        z = rng.standard_normal(n)
        return [max(1, int(round(self.a * math.exp(self.b * float(x))))) for x in z]


@dataclass(frozen=True)
class Shape:
    """One request of an open-loop trace: prompt and output tokens, arrival time (None: drawn)."""

    npp: int
    ntg: int
    at: float | None = None


def load_lengths(path: str, flag: str = "--lengths") -> tuple[Shape, ...]:
    """Read a JSONL file of ``{"npp": int, "ntg": int}`` or ``{"npp", "ntg", "at": seconds}``
    objects (blank lines skipped); a ValueError naming ``flag``, the file and line otherwise."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{flag} {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc})") from None
    shapes = []
    for no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{flag} {path} line {no}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f'{where}: expected an object like {{"npp": 128, "ntg": 64}}')
        npp, ntg, at = obj.get("npp"), obj.get("ntg"), obj.get("at")
        for name, value in (("npp", npp), ("ntg", ntg)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f'{where}: "{name}" must be an integer >= 1, got {value!r}')
        if at is not None and (
            isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at) or at < 0
        ):
            raise ValueError(f'{where}: "at" must be a number of seconds >= 0, got {at!r}')
        shapes.append(Shape(npp, ntg, None if at is None else float(at)))  # type: ignore[arg-type]
    if not shapes:
        raise ValueError(f"{flag} {path}: no lines")
    timed = sum(s.at is not None for s in shapes)
    if 0 < timed < len(shapes):
        raise ValueError(f'{flag} {path}: "at" on {timed} of {len(shapes)} lines; give it on all or none')
    return tuple(shapes)


DEFAULT_LENGTHS = LengthDist("fixed", 128)  # prompt and output lengths when none are given


__all__ = ["DEFAULT_LENGTHS", "DIST_FORMS", "LengthDist", "Shape", "load_lengths"]
