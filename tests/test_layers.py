"""Issue 10: one namespace (``llamactor.*``), one direction of dependencies, no cycles.

- every module of ``llamactor.*`` imports on its own in a fresh interpreter started outside the
  repository, and loads no module of a higher layer than its own;
- the bare names ``runtime``, ``actors``, ``protocol`` and ``ops`` are not importable there;
- the AST layering check passes on the tree, and fails on a fixture tree with an upward import;
- the public surfaces (the embedding API, the policy API) are pinned by ``__all__``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from layering import LAYERS, PACKAGE_DIRS, cycles, layer_of, modules, violations

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(m for m in sys.modules if m.startswith("llamactor"))))
"""


def _import_alone(module: str, cwd: Path) -> tuple[str, int, str]:
    r = subprocess.run([sys.executable, "-c", PROBE, module], cwd=cwd, capture_output=True, text=True, timeout=120)
    return module, r.returncode, r.stdout if r.returncode == 0 else r.stderr


def test_every_module_imports_alone_and_loads_no_higher_layer(tmp_path):
    mods = sorted(modules(ROOT, PACKAGE_DIRS))
    assert len(mods) > 40
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda m: _import_alone(m, tmp_path), mods))
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
    assert violations(ROOT) == []
    assert cycles(ROOT) == []
    every = modules(ROOT, PACKAGE_DIRS)
    outside = [m for m in every if layer_of(m) < 0]
    assert not outside, f"modules in no layer: {outside}"


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
    imports a bare top-level package, and two service modules import each other."""
    tree = _fixture_tree(tmp_path, {
        "runtime/engine/__init__.py": "",
        "runtime/engine/context.py": "from llamactor.runtime.service.metrics import Metrics\n",
        "runtime/service/__init__.py": "",
        "runtime/service/metrics.py": "from . import core\nclass Metrics: ...\n",
        "runtime/service/core.py": "def f():\n    from llamactor.runtime.service import metrics\n",
        "actors/group.py": "import protocol.messages\n",
        "protocol/plan.py": "from llamactor.protocol import errors\n",
        "protocol/errors.py": "",
    })
    found = violations(tree)
    assert any("llamactor.runtime.engine.context" in v and "higher layer" in v for v in found), found
    assert any("bare package 'protocol.messages'" in v for v in found), found
    assert len(found) == 2, found  # protocol.plan -> protocol.errors is fine
    assert cycles(tree) == [["llamactor.runtime.service.core", "llamactor.runtime.service.metrics"]]


def test_layer_table_covers_the_four_folders():
    prefixes = {p for _, ps in LAYERS for p in ps}
    assert set(PACKAGE_DIRS.values()) <= prefixes | {"llamactor.runtime"}


def test_public_surface_of_the_policy_api():
    """The policy API custom scheduling actors use is explicit and pinned."""
    from llamactor.actors import policy

    assert sorted(policy.__all__) == [
        "Grant", "GroupView", "IDLE_PLAN", "PhaseEvent", "Policy", "PolicyStatus", "SlotView", "StepPlan",
        "fair_share", "fill_prefill", "generating",
    ]
    for name in policy.__all__:
        assert getattr(policy, name) is not None
