"""``llamactor bench --plot FILE.png``: the pictures of a finished benchmark.

- closed loop (a sweep, or one point): aggregate tok/s and TTFT (p50 solid, p99 dashed)
  against the swept setting (users unless ``--sweep`` names another), one line per server
  (A, and B with ``--vs``; the median over ``--pairs``);
- mixed: the inter-token gaps of the generating streams over time, one panel per run, the
  arrivals of the long prompts marked: where a policy stalls the streams, the spikes show;
- cohort: TTFT of each prompt against its length, one line per run;
- capacity (``save_capacity_plot``): attainment against the request rate, one line per
  server, the target and each server's capacity marked.

Pure apart from writing the file: it reads the results ``run_matrix`` returned. matplotlib is
an optional extra (``pip install 'llamactor[plot]'``); ``require_matplotlib`` is called before
any request is sent, so a missing extra costs no benchmark. Drawn with matplotlib's object API
(``Figure``, no pyplot): no global state, no display needed.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llamactor.ops.bench.compare import Run

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

MS_PER_S = 1000.0
INCHES_WIDE = 11.0
INCHES_PER_ROW = 3.6
DPI = 110
INSTALL_HINT = "pip install 'llamactor[plot]' (or: pip install matplotlib)"


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def require_matplotlib() -> None:
    """Raise ``PlotUnavailable`` with the install command when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.figure import Figure  # noqa: F401
    except ImportError as exc:
        raise PlotUnavailable(f"--plot needs matplotlib, which is not installed: {INSTALL_HINT} ({exc})") from None


def save_plot(runs: Sequence[Run], path: str | Path) -> Path:
    """Draw ``runs`` (all of one workload) into the PNG ``path``; returns the path written."""
    require_matplotlib()
    from matplotlib.figure import Figure

    if not runs:
        raise ValueError("nothing to plot: no run finished")
    kind = runs[0].result.workload
    if kind == "mixed":
        fig = Figure(figsize=(INCHES_WIDE, INCHES_PER_ROW * len(runs)), dpi=DPI, layout="constrained")
        _mixed(fig, runs)
    elif kind == "cohort":
        fig = Figure(figsize=(INCHES_WIDE, INCHES_PER_ROW * 1.2), dpi=DPI, layout="constrained")
        _cohort(fig, runs)
    else:
        fig = Figure(figsize=(INCHES_WIDE, INCHES_PER_ROW * 1.2), dpi=DPI, layout="constrained")
        _sweep(fig, runs)
    out = Path(path)
    fig.savefig(out, format="png")
    return out


def _server(run: Run) -> str:
    return f"{run.target.label}: {run.target.url}"


def _x_of(run: Run) -> tuple[str, float]:
    """The swept setting and its value for this run (``users`` when nothing was swept)."""
    if run.point:
        name, _, value = run.point.partition("=")
        return name, float(value)
    return "users", float(getattr(run.result, "users", 0))


def _sweep(fig: Figure, runs: Sequence[Run]) -> None:
    tok_ax, ttft_ax = fig.subplots(1, 2)
    x_name = _x_of(runs[0])[0]
    servers = list(dict.fromkeys(_server(r) for r in runs))
    for server in servers:
        points: dict[float, list[dict[str, Any]]] = {}
        for r in runs:
            if _server(r) == server:
                points.setdefault(_x_of(r)[1], []).append(r.result.figures())
        xs = sorted(points)
        line = tok_ax.plot(xs, [_median(points[x], "tok_s") for x in xs], marker="o", label=server)[0]
        color = line.get_color()
        ttft_ax.plot(
            xs, [_median(points[x], "ttft_p50_ms") for x in xs], marker="o", color=color, label=f"{server} p50"
        )
        ttft_ax.plot(
            xs,
            [_median(points[x], "ttft_p99_ms") for x in xs],
            marker=".",
            linestyle="--",
            color=color,
            label=f"{server} p99",
        )
    tok_ax.set(title="throughput", xlabel=x_name, ylabel="generated tok/s")
    ttft_ax.set(title="time to first token", xlabel=x_name, ylabel="TTFT ms")
    for ax in (tok_ax, ttft_ax):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"closed loop: {_settings(runs[0].result)}")


def _median(figs: list[dict[str, Any]], key: str) -> float:
    values = [f[key] for f in figs if f.get(key) is not None]
    return statistics.median(values) if values else float("nan")


def _settings(result: Any) -> str:
    parts = [
        f"{name}={getattr(result, name)}"
        for name in ("npp", "ntg", "requests_per_user", "api")
        if hasattr(result, name)
    ]
    return " ".join(parts)


def _label(run: Run) -> str:
    return " · ".join(x for x in (_server(run), run.point or "", f"pair {run.pair + 1}" if run.pair else "") if x)


def _mixed(fig: Figure, runs: Sequence[Run]) -> None:
    axes: list[Axes] = list(fig.subplots(len(runs), 1, sharex=True, squeeze=False)[:, 0])
    for ax, run in zip(axes, runs):
        res = run.result
        records = res.records
        if not records:
            ax.set_title(f"{_label(run)}: no requests")
            continue
        t0 = min(r.sent_s for r in records)
        for i, rec in enumerate(records[: res.streams]):
            times = rec.event_times
            ax.plot(
                [t - t0 for t in times[1:]],
                [(b - a) * MS_PER_S for a, b in zip(times, times[1:])],
                linewidth=1,
                drawstyle="steps-pre",
                label=f"stream {i + 1}",
            )  # a gap spans up to its token
        for j, rec in enumerate(records[res.streams :]):
            ax.axvline(
                rec.sent_s - t0,
                color="black",
                linestyle=":",
                linewidth=1,
                label="long prompt arrives" if j == 0 else None,
            )
            if rec.ttft_s is not None:
                ax.axvspan(
                    rec.sent_s - t0,
                    rec.sent_s - t0 + rec.ttft_s,
                    color="grey",
                    alpha=0.15,
                    label="its prefill (until its first token)" if j == 0 else None,
                )
        figs = res.figures()
        ax.set_title(
            f"{_label(run)}  (gap p99 {_fmt(figs.get('gap_p99_ms'))} ms, max {_fmt(figs.get('gap_max_ms'))} ms, "
            f"arrival TTFT p50 {_fmt(figs.get('arrival_ttft_p50_ms'))} ms)",
            fontsize="medium",
        )
        ax.set_ylabel("inter-token gap ms")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small", loc="upper right", ncols=2)
    axes[-1].set_xlabel("seconds since the measured phase began")
    first = runs[0].result
    fig.suptitle(
        f"mixed workload: {first.streams} streams of {first.ntg} tokens, "
        f"long prompts of {first.arrival_npp} tokens arriving"
    )


def _cohort(fig: Figure, runs: Sequence[Run]) -> None:
    ax = fig.subplots()
    for run in runs:
        res = run.result
        pairs = sorted((n, t) for n, t in zip(res.npps, res.ttft_ms) if t is not None)
        ax.plot([n for n, _ in pairs], [t for _, t in pairs], marker="o", label=_label(run))
    ax.set(title="cohort: time to first token per prompt", xlabel="prompt tokens", ylabel="TTFT ms")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def save_capacity_plot(figures: dict[str, Any], path: str | Path) -> Path:
    """Draw ``--capacity``'s attainment curves (its JSON figures) into the PNG ``path``."""
    require_matplotlib()
    from matplotlib.figure import Figure

    fig = Figure(figsize=(INCHES_WIDE * 0.7, INCHES_PER_ROW * 1.4), dpi=DPI, layout="constrained")
    ax = fig.subplots()
    for name, curve in figures["curve"].items():
        srv = figures["servers"][name]
        line = ax.plot(
            [p["rate"] for p in curve],
            [p["attainment"] for p in curve],
            marker="o",
            label=f"{name}: {srv['url']} ({srv['capacity_rps']:.3g} req/s)",
        )[0]
        if srv["capacity_rps"] > 0:
            ax.axvline(srv["capacity_rps"], color=line.get_color(), linestyle=":", linewidth=1)
    ax.axhline(figures["target"], color="black", linestyle="--", linewidth=1, label=f"target {figures['target']:.0%}")
    ax.set_xscale("log")
    ax.set(xlabel="request rate (req/s, log scale)", ylabel="share meeting both SLOs", ylim=(-0.02, 1.02))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    ratio = figures.get("ratio")
    fig.suptitle(
        f"capacity: {figures['shape']}, {figures['arrivals']} arrivals, SLO scale {figures['slo_scale']:g}"
        + (f", B/A {ratio:.2f}" if ratio is not None else "")
    )
    out = Path(path)
    fig.savefig(out, format="png")
    return out


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x:.0f}"


__all__ = ["INSTALL_HINT", "PlotUnavailable", "require_matplotlib", "save_capacity_plot", "save_plot"]
