"""Judging random-workload runs: medians over pairs, ratios to the reference, the noise band,
and wins / ties / losses (pure: finished runs in, figures, tables and JSON out).

Per seed and server, each metric is the median over the pairs. A server's ratio to the
reference (the first server) is taken within each pair, where the machine's drift is smallest,
and the median over pairs is the figure quoted, as ``ops.bench.compare`` does for ``--vs``.

The noise band says how far a server's ratio to *itself* strays: the reference run against a
second instance of the same command, on every seed. Per metric, the band is the largest
|log ratio| of that self/self comparison across seeds (at least ``MIN_BAND``). A server then
wins a seed on a metric when its ratio is better than the band allows (lower for times, higher
for goodput), loses when worse, and ties inside it. Ratios are compared as logs so that 0.8 and
1.25 are equally far from 1; a goodput of 0 against 0 is a ratio of 1, any goodput against 0 is
an unbounded win (``inf`` in the log, ``null`` as a ratio in JSON).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llamactor.ops.bench.report import fmt, grid

MIN_BAND = math.log(1.01)  # a band never narrower than +-1 %: figures are rounded, clocks jitter
DEFAULT_BAND = math.log(1.05)  # used when no band was measured or given


@dataclass(frozen=True)
class Metric:
    key: str  # a key of RandomResult.figures()
    label: str
    lower_is_better: bool


METRICS = (
    Metric("ttft_mean_ms", "TTFT mean ms", True),
    Metric("ttft_p50_ms", "TTFT p50 ms", True),
    Metric("itl_p99_ms", "ITL p99 ms", True),
    Metric("goodput", "goodput", False),
    Metric("goodput_pct", "goodput pct", False),
    Metric("makespan_s", "makespan s", True),
)
METRIC_KEYS = tuple(m.key for m in METRICS)


def log_ratio(ref: float | None, other: float | None) -> float | None:
    """log(other / ref); equal values (0 and 0 too) give 0, a zero reference +-inf."""
    if ref is None or other is None:
        return None
    if ref == other:
        return 0.0
    if ref == 0:
        return math.inf
    if other == 0:
        return -math.inf
    return math.log(other / ref)


def middle(values: Sequence[float | None]) -> float | None:
    """The median of the values given (None left out); with an even count the mean of the two
    middle ones, or, when one of them is infinite, the one nearer to zero."""
    kept = sorted(v for v in values if v is not None)
    if not kept:
        return None
    n = len(kept)
    if n % 2:
        return kept[n // 2]
    a, b = kept[n // 2 - 1], kept[n // 2]
    if math.isfinite(a) and math.isfinite(b):
        return (a + b) / 2
    return a if abs(a) <= abs(b) else b


def as_ratio(lr: float | None) -> float | None:
    return math.exp(lr) if lr is not None and math.isfinite(lr) else None


@dataclass(frozen=True)
class SeedTable:
    """One seed: per server, the median of each metric over pairs and the median pair log
    ratio to the reference (``None`` where not measured)."""

    seed: int
    servers: list[str]  # in run order; the first is the reference
    medians: dict[str, dict[str, float | None]]
    log_ratios: dict[str, dict[str, float | None]]  # the reference itself not included


def seed_table(seed: int, servers: Sequence[str], figures: dict[tuple[str, int], dict[str, Any]]) -> SeedTable:
    """``figures[(server, pair)]`` are a run's figures; pairs missing a run are left out."""
    pairs = sorted({p for _, p in figures})
    ref = servers[0]
    medians = {
        s: {k: middle([figures[(s, p)].get(k) for p in pairs if (s, p) in figures]) for k in METRIC_KEYS}
        for s in servers
    }
    logs = {
        s: {
            k: middle(
                [
                    log_ratio(figures[(ref, p)].get(k), figures[(s, p)].get(k))
                    for p in pairs
                    if (ref, p) in figures and (s, p) in figures
                ]
            )
            for k in METRIC_KEYS
        }
        for s in servers[1:]
    }
    return SeedTable(seed, list(servers), medians, logs)


@dataclass(frozen=True)
class Band:
    """Per metric, the largest |log ratio| a server shows against itself."""

    log_band: dict[str, float]
    source: str  # "measured on N seeds", "FILE", "default"
    seeds: list[int] = field(default_factory=list)

    def percent(self, key: str) -> float:
        return (math.exp(self.log_band[key]) - 1) * 100

    def to_json(self) -> dict[str, Any]:
        return {
            "log_band": self.log_band,
            "percent": {k: round(self.percent(k), 3) for k in self.log_band},
            "source": self.source,
            "seeds": self.seeds,
        }

    @classmethod
    def from_json(cls, obj: Any, source: str) -> Band:
        """A band written by ``to_json``; a ValueError when ``obj`` is not one."""
        logs = obj.get("log_band") if isinstance(obj, dict) else None
        if not isinstance(logs, dict):
            raise ValueError(f"{source}: not a noise band (no log_band object)")
        out: dict[str, float] = {}
        for m in METRICS:
            v = logs.get(m.key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{source}: log_band.{m.key} must be a number >= 0, got {v!r}")
            out[m.key] = float(v)
        seeds = obj.get("seeds") or []
        return cls(out, source, [int(s) for s in seeds if isinstance(s, int)])


def default_band() -> Band:
    return Band(dict.fromkeys(METRIC_KEYS, DEFAULT_BAND), "not measured: the default; --noise-band measures one")


def measure_band(tables: Sequence[SeedTable], twin: str) -> Band:
    """The band from the reference against its second instance ``twin`` on every seed."""
    out = {}
    for k in METRIC_KEYS:
        spreads = [abs(v) for t in tables if (v := t.log_ratios.get(twin, {}).get(k)) is not None]
        finite_spreads = [v for v in spreads if math.isfinite(v)]
        out[k] = max([MIN_BAND, *finite_spreads])
    return Band(out, f"measured on {len(tables)} seed(s)", [t.seed for t in tables])


@dataclass(frozen=True)
class Tally:
    wins: int = 0
    ties: int = 0
    losses: int = 0
    unmeasured: int = 0

    def __str__(self) -> str:
        text = f"{self.wins}/{self.ties}/{self.losses}"
        return text + (f" ({self.unmeasured} n/a)" if self.unmeasured else "")


def verdict(lr: float | None, metric: Metric, band: float) -> str:
    """``win``, ``tie``, ``loss`` or ``n/a`` for one log ratio (other / reference)."""
    if lr is None:
        return "n/a"
    better = -lr if metric.lower_is_better else lr
    if better > band:
        return "win"
    if better < -band:
        return "loss"
    return "tie"


def tally(tables: Sequence[SeedTable], servers: Sequence[str], band: Band) -> dict[str, dict[str, Tally]]:
    """Per server (not the reference) and metric: wins, ties and losses over the seeds."""
    out: dict[str, dict[str, Tally]] = {}
    for s in servers:
        out[s] = {}
        for m in METRICS:
            counts = {"win": 0, "tie": 0, "loss": 0, "n/a": 0}
            for t in tables:
                counts[verdict(t.log_ratios.get(s, {}).get(m.key), m, band.log_band[m.key])] += 1
            out[s][m.key] = Tally(counts["win"], counts["tie"], counts["loss"], counts["n/a"])
    return out


def geo_mean_ratio(tables: Sequence[SeedTable], server: str, key: str) -> float | None:
    """The geometric mean over seeds of a server's ratio to the reference (finite ones)."""
    logs = [v for t in tables if (v := t.log_ratios.get(server, {}).get(key)) is not None and math.isfinite(v)]
    return math.exp(sum(logs) / len(logs)) if logs else None


# ---- text ------------------------------------------------------------------------------------


def _ratio_text(lr: float | None) -> str:
    if lr is None:
        return "x-"
    if math.isinf(lr):
        return "x+inf" if lr > 0 else "x0"
    return f"x{math.exp(lr):.2f}"


def render_seed(table: SeedTable, extra: dict[str, dict[str, Any]] | None = None) -> str:
    """One row per server: each metric's median over pairs, with its ratio to the reference;
    ``extra`` adds columns per server (ok / failed)."""
    extra = extra or {}
    extra_keys = list(next(iter(extra.values()), {}))
    header = ["server", *(m.label for m in METRICS), *extra_keys]
    rows = []
    for s in table.servers:
        cells = [s]
        for m in METRICS:
            value = fmt(table.medians[s][m.key])
            cells.append(value if s == table.servers[0] else f"{value} {_ratio_text(table.log_ratios[s][m.key])}")
        cells += [fmt(extra.get(s, {}).get(k)) for k in extra_keys]
        rows.append(cells)
    return grid(header, rows, names_left=True)


def render_summary(
    tables: Sequence[SeedTable],
    servers: Sequence[str],
    reference: str,
    band: Band,
    tallies: dict[str, dict[str, Tally]],
) -> str:
    """The band, then wins/ties/losses and the geometric-mean ratio per server and metric."""
    lines = [
        f"noise band ({band.source}; a tie is a ratio within it): "
        + ", ".join(f"{m.label.removesuffix(' ms').removesuffix(' s')} +-{band.percent(m.key):.1f}%" for m in METRICS)
    ]
    if not servers:
        return "\n".join(lines)
    lines.append(f"wins/ties/losses against {reference} over {len(tables)} seed(s):")
    rows = []
    for s in servers:
        rows.append([s, *(str(tallies[s][m.key]) for m in METRICS)])
        rows.append(["  geo-mean ratio", *(fmt(geo_mean_ratio(tables, s, m.key)) for m in METRICS)])
    lines.append(grid(["server", *(m.label for m in METRICS)], rows, names_left=True))
    return "\n".join(lines)


def table_json(table: SeedTable) -> dict[str, Any]:
    return {
        "medians": table.medians,
        "ratios": {s: {k: as_ratio(v) for k, v in r.items()} for s, r in table.log_ratios.items()},
        "log_ratios": {
            s: {
                k: (None if v is None else v if math.isfinite(v) else ("inf" if v > 0 else "-inf"))
                for k, v in r.items()
            }
            for s, r in table.log_ratios.items()
        },
    }


__all__ = [
    "DEFAULT_BAND",
    "METRICS",
    "METRIC_KEYS",
    "MIN_BAND",
    "Band",
    "Metric",
    "SeedTable",
    "Tally",
    "default_band",
    "geo_mean_ratio",
    "log_ratio",
    "measure_band",
    "middle",
    "render_seed",
    "render_summary",
    "seed_table",
    "table_json",
    "tally",
    "verdict",
]
