"""Output of ``llamactor bench``: a plain-text table, notes that flag untrustworthy figures,
and the same data as JSON. Pure: takes finished runs, returns strings and dicts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from llamactor.ops.bench.compare import PairRatio, Run
from llamactor.ops.bench.latency import LATENCY_KEYS

CLIENT_CPU_WARN_FRACTION = 0.5  # of one core: above this the client may have slowed the run
UNAUTHORIZED = "HTTP 401"  # how a record's error starts when the server wants an API key
HEADERS = {
    "tok_s": "tok/s",
    "ttft_p50_ms": "TTFT p50 ms",
    "ttft_p99_ms": "TTFT p99 ms",
    "tpot_p50_ms": "TPOT p50 ms",
    "gap_p50_ms": "gap p50 ms",
    "gap_p99_ms": "gap p99 ms",
    "gap_max_ms": "gap max ms",
    "ok": "ok",
    "failed": "failed",
    "wall_s": "wall s",
    "server_tokens": "srv tokens",
    "diff_percent": "diff %",
    "arrival_ttft_p50_ms": "arr TTFT p50 ms",
    "arrival_ttft_max_ms": "arr TTFT max ms",
    "prefill_tok_s": "prefill tok/s",
    "makespan_s": "makespan s",
    "overlap": "overlap",
    "all_prefilled_s": "all prefilled s",
    "gen_tok_s": "gen tok/s",
    "ttft_mean_ms": "TTFT mean ms",
    "itl_p50_ms": "ITL p50 ms",
    "itl_p99_ms": "ITL p99 ms",
    "goodput": "goodput",
    "goodput_rps": "good req/s",
    "prompt_sent": "prompt sent",
    "prompt_processed": "prompt processed",
    "processed_share": "processed/sent",
    "first_ttft_mean_ms": "1st TTFT mean ms",
    "first_ttft_p50_ms": "1st TTFT p50 ms",
    "first_ttft_p99_ms": "1st TTFT p99 ms",
    "later_ttft_mean_ms": "later TTFT mean ms",
    "later_ttft_p50_ms": "later TTFT p50 ms",
    "later_ttft_p99_ms": "later TTFT p99 ms",
    "offered_rps": "offered req/s",
    "done_rps": "done req/s",
    "lag_max_ms": "send lag max ms",
}


def fmt(value: Any) -> str:
    """A figure for a table: ``-`` for not measured, 3 significant-ish digits for floats."""
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def grid(header: list[str], rows: list[list[str]], *, names_left: bool = False) -> str:
    """A plain-text table: columns two spaces apart, each as wide as its widest cell, cells
    right-aligned (figures line up by their last digit); ``names_left`` left-aligns the first
    column, for tables whose rows are named by it."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if names_left and i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    return "\n".join([line(header), *(line(r) for r in rows)])


def _run_label_columns(runs: list[Run]) -> tuple[list[str], list[list[str]]]:
    header, cells = ["server"], [[r.target.label] for r in runs]
    if any(r.point for r in runs):
        header.append("point")
        for c, r in zip(cells, runs):
            c.append(r.point or "")
    if any(r.pair for r in runs):
        header.append("pair")
        for c, r in zip(cells, runs):
            c.append(str(r.pair + 1))
    return header, cells


def render_runs(runs: list[Run]) -> str:
    """One row per run, in the order the runs happened: the workload's own figures, then a
    second table of the figures every workload reports (TTFT, inter-token, makespan, goodput)."""
    if not runs:
        return "(no runs)"
    header, cells = _run_label_columns(runs)
    figs = [r.result.figures() for r in runs]
    own = [k for k in figs[0] if k not in LATENCY_KEYS]
    common = [k for k in LATENCY_KEYS if k in figs[0]]
    out = grid(header + [HEADERS.get(k, k) for k in own], [c + [fmt(f[k]) for k in own] for c, f in zip(cells, figs)])
    if common:
        slo = getattr(runs[0].result, "slo", None)
        title = (
            ""
            if slo is None
            else (f"good request: TTFT <= {slo.slo_ttft_ms:g} ms and time per output token <= {slo.slo_itl_ms:g} ms")
        )
        out += (
            "\n\n"
            + (title + "\n" if title else "")
            + grid(
                header + [HEADERS.get(k, k) for k in common],
                [c + [fmt(f[k]) for k in common] for c, f in zip(cells, figs)],
            )
        )
    return out


def render_ratios(ratios: list[PairRatio]) -> str:
    if not ratios:
        return ""
    keys = list(ratios[0].ratios)
    header = ["point", "pair"] + [f"B/A {HEADERS.get(k, k)}" for k in keys]
    rows = [
        [r.point or "", "median" if r.pair is None else str(r.pair + 1)] + [fmt(r.ratios[k]) for k in keys]
        for r in ratios
    ]
    return grid(header, rows)


def notes(runs: list[Run]) -> list[str]:
    """Warnings about figures that should not be trusted as they stand."""
    out = []
    for r in runs:
        res, where = r.result, " ".join(x for x in (r.target.label, r.target.url, r.point or "") if x)
        if res.failed:
            out.append(f"{where}: {res.failed} request(s) failed: {'; '.join(res.errors)}")
        if res.warmup_failed:
            out.append(f"{where}: {res.warmup_failed} warm-up request(s) failed")
        unauthorized = any(e.startswith(UNAUTHORIZED) for e in res.errors)
        if unauthorized:
            # /metrics wants the key too: no "add --metrics" advice for what the key explains
            out.append(
                f"{where}: the server refused requests for want of an API key (HTTP 401): "
                "give its key with --api-key KEY or LLAMA_API_KEY"
            )
        cc = res.cross_check
        if getattr(res, "prompt_tokens_server", 0) is None and cc.server_tokens is not None:
            out.append(f"{where}: no llamacpp:prompt_tokens_total on /metrics; prompt tokens processed not measured")
        if cc.server_tokens is None and not unauthorized:
            out.append(
                f"{where}: no llamacpp:tokens_predicted_total on /metrics (llama-server: add --metrics); "
                "token count not cross-checked"
            )
        elif cc.diff_percent != 0.0:
            out.append(
                f"{where}: client counted {cc.client_tokens} generated tokens, the server "
                f"{cc.server_tokens} (another client on this server?)"
            )
        out += [f"{where}: {text}" for text in res.notes()]
        wall = elapsed_s(res)
        if wall > 0 and res.client_cpu_s / wall > CLIENT_CPU_WARN_FRACTION:
            out.append(f"{where}: the client used {res.client_cpu_s / wall:.0%} of a core; figures may be client-bound")
    return out


def elapsed_s(res: Any) -> float:
    """How long a run's measured phase took: its makespan (open-loop and phased workloads) or
    its wall time (closed loop)."""
    makespan = getattr(res, "makespan_s", None)
    return float(makespan if makespan is not None else res.wall_s)


def describe(workload: Any, targets: list[Any], sweep: str | None = None) -> str:
    """Lines naming the servers, the workload and its settings, printed above the table."""
    swept, _, values = (sweep or "").partition("=")
    swept = swept.strip().replace("-", "_")
    parts = [
        f"{f.name}={values if f.name == swept else getattr(workload, f.name)}"
        for f in dataclasses.fields(workload)
        if f.name != "common" and f.metadata.get("report", True)
    ]
    common = workload.common
    parts += [
        f"api={common.api}",
        f"warmup={common.warmup}",
        f"temperature={common.temperature}",
        f"seed={common.seed}",
        f"slo_ttft_ms={common.slo_ttft_ms:g}",
        f"slo_itl_ms={common.slo_itl_ms:g}",
    ]
    servers = [f"{t.label} = {t.url}" for t in targets] if len(targets) > 1 else [f"server {targets[0].url}"]
    return "\n".join(servers + [f"workload {workload.name}: " + " ".join(parts)])


def plain(obj: Any) -> Any:
    """Dataclasses to dicts, leaving out fields marked ``metadata={"report": False}``."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.metadata.get("report", True)}
    if isinstance(obj, (list, tuple)):
        return [plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    return obj


def to_json(runs: list[Run], ratios: list[PairRatio]) -> dict[str, Any]:
    return {
        "runs": [
            {
                "server": r.target.label,
                "url": r.target.url,
                "point": r.point,
                "pair": r.pair,
                "workload": r.result.workload,
                "figures": r.result.figures(),
                "result": plain(r.result),
            }
            for r in runs
        ],
        "ratios": [plain(x) for x in ratios],
        "notes": notes(runs),
    }


__all__ = ["describe", "fmt", "grid", "notes", "plain", "render_ratios", "render_runs", "to_json"]
