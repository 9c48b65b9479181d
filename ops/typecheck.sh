#!/usr/bin/env bash
# Static type check (run by `make test`): mypy over the whole llamactor package, strict on
# protocol/ and the policy API. The folders install as llamactor.* through a package-dir
# mapping that mypy cannot follow, so mypy reads them through a link tree .venv/typecheck/llamactor.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
TREE=.venv/typecheck
mkdir -p "$TREE/llamactor"
for d in protocol runtime actors ops; do ln -sfn "$ROOT/$d" "$TREE/llamactor/$d"; done
cd "$TREE"
MYPY="$ROOT/.venv/bin/mypy --config-file $ROOT/pyproject.toml"
$MYPY -p llamactor
$MYPY --strict -p llamactor.protocol -p llamactor.actors.policy -p llamactor.actors.policies
