"""Parse a `llamactor serve` command line (and environment) the way the CLI does, without a server."""

from __future__ import annotations

import argparse

from llamactor.runtime import cli, cliargs, cliflags


def parse_serve(argv: list[str], environ: dict[str, str] | None = None) -> cli.ServeOptions:
    parser = argparse.ArgumentParser(prog="llamactor", exit_on_error=False)
    sub = parser.add_subparsers(dest="command")
    serve_parser = cli._serve_parser(sub)
    args = parser.parse_args(["serve", *argv])
    cliargs.apply_env(serve_parser, args, cliflags.GROUPS, environ or {})
    return cli.serve_options(args)
