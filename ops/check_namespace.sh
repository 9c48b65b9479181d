#!/usr/bin/env bash
# Namespace check, run by .ci/run after the tests: the registry's `ops` package (Canonical's
# charm framework) installed into the same venv leaves both working, since llamactor installs
# only the `llamactor` import package. Uninstalls `ops` afterwards (the test suite checks that a
# fresh venv has no bare `ops`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(pwd)/.venv/bin/python
$PY -m pip install -q ops
trap '$PY -m pip uninstall -q -y ops >/dev/null 2>&1 || true' EXIT
cd "$(mktemp -d)"
$PY - <<'PY'
import importlib, pathlib, sys
import ops
assert hasattr(ops, "CharmBase"), f"`ops` is not the charm framework: {ops.__file__}"
import llamactor.ops.bench.cli, llamactor.runtime, llamactor.actors.group
from llamactor.runtime import Runtime, RuntimeConfig
assert "site-packages" in ops.__file__ and pathlib.Path(llamactor.ops.bench.cli.__file__).parent.parent.name == "ops"
print(f"ops {ops.__version__} at {ops.__file__}; llamactor.ops at {llamactor.ops.bench.cli.__file__}: both import")
PY
# and llamactor still serves with the charm framework installed
cd - >/dev/null
$PY -m pytest -q -p no:randomly tests/test_embedding.py tests/test_cli.py::test_serve_process_end_to_end
