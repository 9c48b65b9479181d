"""Type checkers see the installed package and its annotations.

``mypy --strict`` runs in a directory outside the repository, so it knows llamactor only as the
installed package (the editable install's .pth link tree and the py.typed markers): the examples
and a custom policy written against the public policy API type-check cleanly, and a misspelled
keyword or a wrong type in a ``Runtime`` call is an error there, before anything runs.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow  # one mypy --strict run over the package's import graph, cold: seconds

POLICY = '''
from __future__ import annotations

from llamactor.actors.policy import (
    IDLE_PLAN, Grant, GroupView, PhaseEvent, Policy, PolicyStatus, SlotView, StepPlan, fill_prefill, generating,
)


class TenantFirst(Policy):
    """Prompts of one tenant (the ``tenant`` tag) first, then by priority and arrival."""

    name = "tenant-first"

    def __init__(self, group: int = 0, tenant: str = "a", **options: object) -> None:
        super().__init__(group, **options)
        self.tenant = tenant
        self.events = 0

    def on_event(self, event: PhaseEvent) -> Grant | None:
        self.events += 1
        return None

    def plan(self, view: GroupView, grant: Grant | None) -> StepPlan:
        if not view.slots:
            return IDLE_PLAN

        def key(s: SlotView) -> tuple[bool, int, int]:
            return (s.tags.get("tenant") != self.tenant, s.priority, s.order)

        generate = generating(view)
        waiting = sorted((s for s in view.slots if s.prompt_left > 0), key=key)
        return StepPlan(prefill=fill_prefill(waiting, view.n_batch - len(generate)), generate=generate)

    def status(self) -> PolicyStatus:
        return PolicyStatus(self.phase, waiting=self.waiting())
'''

CALL = """
from llamactor.runtime import Runtime


async def ask(rt: Runtime) -> str:
    out = await rt.complete("x", {arguments})
    return out.text
"""


def _mypy(folder: Path, files: list[str]) -> dict[str, list[str]]:
    """``mypy --strict`` over ``files`` in ``folder``; error lines by file."""
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--cache-dir", str(folder / ".mypy"), *files],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode in (0, 1), r.stdout + r.stderr  # 2: mypy itself failed (a crash, a bad option)
    errors: dict[str, list[str]] = {f: [] for f in files}
    for line in r.stdout.splitlines():
        m = re.match(r"(.+?):\d+: error: (.*)", line)
        if m:
            errors.setdefault(m.group(1), []).append(m.group(2))
    assert (r.returncode == 0) == (not any(errors.values())), r.stdout
    return errors


def test_installed_package_type_checks_from_outside_the_repository(tmp_path):
    examples = sorted(p.name for p in (ROOT / "examples").glob("*.py") if p.name != "__init__.py")
    assert examples, "no examples found"
    for name in examples:
        shutil.copy(ROOT / "examples" / name, tmp_path / name)
    (tmp_path / "tenant_policy.py").write_text(textwrap.dedent(POLICY))
    (tmp_path / "misspelled_keyword.py").write_text(CALL.format(arguments="max_tokenz=5"))
    (tmp_path / "wrong_type.py").write_text(CALL.format(arguments='max_tokens=5, temperature="hot"'))
    (tmp_path / "right_call.py").write_text(CALL.format(arguments="max_tokens=5, temperature=0.5, stop=['.']"))

    errors = _mypy(tmp_path, [*examples, "tenant_policy.py", "right_call.py", "misspelled_keyword.py", "wrong_type.py"])

    for name in [*examples, "tenant_policy.py", "right_call.py"]:
        assert errors.pop(name) == [], f"{name}: {errors}"
    assert any('Unexpected keyword argument "max_tokenz"' in e for e in errors["misspelled_keyword.py"]), errors
    assert any('Argument "temperature"' in e and '"str"' in e for e in errors["wrong_type.py"]), errors
    assert set(errors) == {"misspelled_keyword.py", "wrong_type.py"}, errors  # nothing else complained
