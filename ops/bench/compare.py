"""Sweeps and A/B comparisons: the order runs happen in, and the ratios between them.

This machine's speed drifts (other tenants, thermal state), so two servers are never measured
one after the other in blocks: for each sweep point, ``--pairs`` repetitions each run A then B
with identical prompts, and a ratio is taken within each pair, where drift is smallest. The
median over pairs is the figure to quote.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from llamactor.ops.bench.progress import Progress
from llamactor.ops.bench.prompts import run_seed
from llamactor.ops.bench.runner import Workload, probe_prompt_ids, run_workload
from llamactor.ops.bench.stats import median, ratio
from llamactor.ops.bench.targets import Target

SWEEPABLE_TYPES = (int, float)  # float: poisson's rate


@dataclass(frozen=True)
class Run:
    target: Target
    point: str | None  # "users=8" in a sweep, else None
    pair: int
    result: Any


@dataclass(frozen=True)
class PairRatio:
    point: str | None
    pair: int | None  # None: the median over all pairs of this point
    ratios: dict[str, float | None]  # B / A for each headline figure


def parse_sweep(spec: str, workload: Workload[Any]) -> list[tuple[str, Workload[Any]]]:
    """``"users=8,16,32"`` -> ``[("users=8", workload with users=8), ...]``; ``rate=1.5,3``
    for a float setting (poisson's rate)."""
    name, sep, values = spec.partition("=")
    name = name.strip().replace("-", "_")
    fields = dataclasses.fields(cast(Any, workload))  # every workload is a dataclass
    names = [f.name for f in fields if isinstance(getattr(workload, f.name), SWEEPABLE_TYPES)]
    if not sep or name not in names:
        raise ValueError(f"--sweep takes NAME=V1,V2,... with NAME one of {', '.join(names)}; got {spec!r}")
    kind: type = int if isinstance(getattr(workload, name), int) else float
    try:
        points = [kind(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise ValueError(
            f"--sweep values of {name} must be {'integers' if kind is int else 'numbers'}, got {values!r}"
        ) from None
    if not points:
        raise ValueError(f"--sweep {spec!r} lists no values")
    return [(f"{name}={v}", dataclasses.replace(cast(Any, workload), **{name: v})) for v in points]


async def run_matrix(
    targets: list[Target],
    points: list[tuple[str | None, Workload[Any]]],
    pairs: int,
    progress: Callable[[str, int], Progress],
) -> list[Run]:
    """Every point, ``pairs`` times, every target in turn (A B A B ...); prompts from A's probe.

    ``progress(label, n_requests)`` makes the progress bar of one run.
    """
    ids = await probe_prompt_ids(targets[0].running_url(), points[0][1].common.api_key)
    runs = []
    for p_index, (point, workload) in enumerate(points):
        for pair in range(pairs):
            seed = run_seed(workload.common.seed, p_index, pair)
            for target in targets:
                label = " ".join(x for x in (target.label, point, f"pair {pair + 1}/{pairs}" if pairs > 1 else "") if x)
                result = await run_workload(
                    target.running_url(),
                    workload,
                    seed=seed,
                    prompt_ids=ids,
                    progress=progress(label, workload.n_requests),
                )
                runs.append(Run(target, point, pair, result))
    return runs


def pair_ratios(runs: list[Run], a: str = "A", b: str = "B") -> list[PairRatio]:
    """B/A of each headline figure per (point, pair), then one median row per point."""
    by_key = {(r.point, r.pair, r.target.label): r.result for r in runs}
    out: list[PairRatio] = []
    for point in dict.fromkeys(r.point for r in runs):
        rows = []
        for pair in sorted({r.pair for r in runs if r.point == point}):
            ra, rb = by_key.get((point, pair, a)), by_key.get((point, pair, b))
            if ra is None or rb is None:
                continue
            fa, fb = ra.figures(), rb.figures()
            rows.append(PairRatio(point, pair, {k: ratio(fb[k], fa[k]) for k in ra.headline}))
        out += rows
        if rows:
            keys = rows[0].ratios.keys()
            out.append(PairRatio(point, None, {k: median(r.ratios[k] for r in rows) for k in keys}))
    return out


__all__ = ["PairRatio", "Run", "pair_ratios", "parse_sweep", "run_matrix"]
