"""One namespace (``llamactor.*``), one direction of dependencies, no cycles.

- every module of ``llamactor.*`` imports on its own (in a process forked from a fresh
  interpreter started outside the repository, before that loaded any of llamactor), and loads
  no module of a higher layer than its own;
- the bare names ``runtime``, ``actors``, ``protocol`` and ``ops`` are not importable there;
- the AST layering check passes on the tree, and fails on a fixture tree with an upward import;
- pyproject's import-linter contracts (the same layers, read by both) hold, and break on a copy
  of the package with an upward import, a bare import, an import of the public surface from
  below, and a cycle;
- the public surfaces (the embedding API, the policy API) are pinned by ``__all__``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib
from pathlib import Path

import pytest
from layering import LAYERS, PACKAGE_DIRS, PYPROJECT, cycles, layer_of, modules, violations

ROOT = Path(__file__).resolve().parent.parent

# Every module is imported in a process of its own, forked from one fresh interpreter that has
# loaded the third-party packages the modules use and no module of llamactor: what a module loads
# of llamactor is what importing it alone loads, at a fraction of an interpreter start each (the
# suite's slowest test when each module started its own interpreter: 30 s on 2 cores).
PROBE = """
import importlib, json, multiprocessing, sys, traceback
for dep in ("numpy", "msgspec", "anyio", "llama_cpp", "starlette", "httpx", "structlog", "jinja2", "hypercorn"):
    try:
        importlib.import_module(dep)
    except ImportError:
        pass
assert not any(m.startswith("llamactor") for m in sys.modules)

def probe(module):
    try:
        importlib.import_module(module)
    except BaseException:
        return module, 1, traceback.format_exc()
    return module, 0, json.dumps(sorted(m for m in sys.modules if m.startswith("llamactor")))

modules = json.loads(sys.stdin.read())
with multiprocessing.get_context("fork").Pool(2, maxtasksperchild=1) as pool:
    print(json.dumps(pool.map_async(probe, modules, chunksize=1).get(timeout=300)))
"""


def _import_each_alone(mods: list[str], cwd: Path) -> list[tuple[str, int, str]]:
    r = subprocess.run(
        [sys.executable, "-c", PROBE], input=json.dumps(mods), cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return [tuple(row) for row in json.loads(r.stdout)]


@pytest.mark.slow
def test_every_module_imports_alone_and_loads_no_higher_layer(tmp_path):
    mods = sorted(modules(ROOT, PACKAGE_DIRS))
    assert len(mods) > 40
    results = _import_each_alone(mods, tmp_path)
    failed = [(m, out[-400:]) for m, rc, out in results if rc != 0]
    assert not failed, failed
    upward = []
    for module, _, out in results:
        mine = layer_of(module)
        loaded_all = json.loads(out)
        for loaded in loaded_all:
            # A package __init__ runs on the way down to its submodules: an implicit parent, not an
            # import (what an eager __init__ would import shows up as modules of its own).
            parent = any(other.startswith(loaded + ".") for other in loaded_all)
            if not parent and layer_of(loaded) > mine:
                upward.append(f"{module} loads {loaded}")
    assert not upward, upward


@pytest.mark.parametrize("bare", ["runtime", "actors", "protocol", "ops"])
def test_bare_top_level_names_are_not_installed(tmp_path, bare):
    r = subprocess.run([sys.executable, "-c", f"import {bare}"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, r.stderr


def test_layers_point_one_way_and_modules_form_no_cycle():
    assert violations(ROOT) == []  # an upward import, a bare import, or a module in no layer
    assert cycles(ROOT) == []


def _fixture_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for folder in PACKAGE_DIRS:
        (root / folder).mkdir(exist_ok=True)
        (root / folder / "__init__.py").touch()
    return root


def test_the_check_catches_an_upward_import_a_bare_import_and_a_cycle(tmp_path):
    """A deliberately broken fixture tree: the engine imports the service layer, an actor
    imports a bare top-level package, two service modules import each other, and a new module
    sits in no layer."""
    tree = _fixture_tree(
        tmp_path,
        {
            "runtime/engine/__init__.py": "",
            "runtime/engine/context.py": "from llamactor.runtime.service.metrics import Metrics\n",
            "runtime/service/__init__.py": "",
            "runtime/service/metrics.py": "from . import core\nclass Metrics: ...\n",
            "runtime/service/core.py": "def f():\n    from llamactor.runtime.service import metrics\n",
            "actors/group.py": "import protocol.messages\n",
            "protocol/plan.py": "from llamactor.protocol import errors\n",
            "protocol/errors.py": "",
            "runtime/newcomer.py": "from llamactor.runtime.http import app\n",
        },
    )
    found = violations(tree)
    assert any("llamactor.runtime.engine.context" in v and "higher layer" in v for v in found), found
    assert any("bare package 'protocol.messages'" in v for v in found), found
    assert any("llamactor.runtime.newcomer is in no layer" in v for v in found), found
    assert len(found) == 3, found  # protocol.plan -> protocol.errors is fine
    assert cycles(tree) == [["llamactor.runtime.service.core", "llamactor.runtime.service.metrics"]]


def test_layer_table_covers_the_four_folders():
    prefixes = {p for _, ps in LAYERS for p in ps}
    assert set(PACKAGE_DIRS.values()) <= prefixes | {"llamactor.runtime"}


CONTRACTS = {c["id"]: c["name"] for c in tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]}


def _lint_imports(cwd: Path, search_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    """pyproject's import-linter contracts over the installed package, or over the ``llamactor``
    package under ``search_path`` alone (python -S: the venv's .pth entries, which install the
    real one, are not read)."""
    env = {**os.environ, "COLUMNS": "200"}
    cmd = [sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()"]
    if search_path is not None:
        cmd.insert(1, "-S")
        env["PYTHONPATH"] = f"{search_path}{os.pathsep}{sysconfig.get_paths()['purelib']}"
    cmd += ["--config", str(PYPROJECT), "--no-cache"]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_import_linter_contracts_hold_on_the_installed_package(tmp_path):
    r = _lint_imports(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    for name in CONTRACTS.values():
        assert f"{name} KEPT" in r.stdout, r.stdout


def test_import_linter_contracts_break_on_a_copy_with_violations(tmp_path):
    """The real package copied, plus modules that break each contract: the engine imports the
    service layer, an actor imports the embedding API's package, an actor imports a bare
    ``runtime``, and two protocol modules import each other (one inside a function)."""
    for folder, package in PACKAGE_DIRS.items():
        shutil.copytree(
            ROOT / folder, tmp_path / Path(*package.split(".")), ignore=shutil.ignore_patterns("__pycache__")
        )
    bad = {
        "runtime/engine/zz_upward.py": "from llamactor.runtime.service import config\n",
        "actors/zz_surface.py": "from llamactor.runtime import RuntimeConfig\n",
        "actors/zz_bare.py": "import runtime.engine\n",
        "protocol/zz_one.py": "from llamactor.protocol import zz_two\n",
        "protocol/zz_two.py": "def f():\n    from llamactor.protocol import zz_one\n",
    }
    for rel, text in bad.items():
        (tmp_path / "llamactor" / rel).write_text(text)
    r = _lint_imports(tmp_path, search_path=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    for name in CONTRACTS.values():
        assert f"{name} BROKEN" in r.stdout, r.stdout
    for module in ("runtime.engine.zz_upward", "actors.zz_surface", "actors.zz_bare"):
        assert f"llamactor.{module}" in r.stdout, r.stdout
    assert "in llamactor.protocol" in r.stdout and "zz_one" in r.stdout, r.stdout  # the cycle, and where


def test_public_surface_of_the_policy_api():
    """The policy API custom scheduling actors use is explicit and pinned."""
    from llamactor.actors import policy

    assert sorted(policy.__all__) == [
        "Grant",
        "GroupView",
        "IDLE_PLAN",
        "PhaseEvent",
        "PlanProblem",
        "Policy",
        "PolicyStatus",
        "SlotView",
        "StepPlan",
        "check_plan",
        "fair_share",
        "fill_prefill",
        "generating",
    ]
    for name in policy.__all__:
        assert getattr(policy, name) is not None
