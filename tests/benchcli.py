"""``llamactor bench`` as the bench tests run it: its arguments parsed, run in a worker thread."""

from __future__ import annotations

import argparse
import json

import anyio
import pytest

from llamactor.ops.bench.cli import add_bench_parser, run_bench


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


async def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``llamactor bench ARGV`` in a worker thread (it runs its own event loop): rc, stdout, stderr."""
    capsys.readouterr()
    rc = await anyio.to_thread.run_sync(run_bench, bench_args(*argv))
    out, err = capsys.readouterr()
    return rc, out, err


def json_of(out: str) -> dict:
    """The JSON document ``--json`` printed (an in-process server logs to the same stdout)."""
    start = 0 if out.startswith("{") else out.index("\n{\n") + 1
    return json.JSONDecoder().raw_decode(out, start)[0]
