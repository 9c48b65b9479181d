"""Benchmark harness (placeholder until the bench issue lands)."""

from __future__ import annotations

from typing import Any


def add_bench_parser(sub: Any) -> None:
    sub.add_parser("bench", help="benchmark a llama-server-compatible URL")


def run_bench(args: Any) -> int:
    raise SystemExit("bench: not implemented yet")
