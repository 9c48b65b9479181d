#!/usr/bin/env bash
# Static type check (run by `make test`): mypy over the whole llamactor package, strict on
# protocol/ and the policy API. mypy runs inside the link tree that ops/setup_venv.sh makes
# (.venv/llamactor-links/llamactor/<name> -> <folder>, pyproject's package-dir mapping), so it
# reads the folders as the llamactor.* modules they install as, and reports their errors as
# errors of source files (tests/test_typing.py checks the installed package from outside).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
TREE=.venv/llamactor-links
[ -d "$TREE/llamactor" ] || { echo "error: $TREE is missing: run ops/setup_venv.sh (make install)" >&2; exit 1; }
cd "$TREE"
MYPY="$ROOT/.venv/bin/mypy --config-file $ROOT/pyproject.toml --cache-dir $ROOT/.mypy_cache"
$MYPY -p llamactor
$MYPY --strict -p llamactor.protocol -p llamactor.actors.policy -p llamactor.actors.policies
