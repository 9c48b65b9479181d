"""How `make test` runs the suite (ops/run_suite.sh): the tests not marked `serial` on pytest-xdist
workers, then the `serial` ones alone; its exit status is pytest's, and a run that tested
nothing fails. Shown with a stand-in for pytest that records its arguments and exits as told."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "ops" / "run_suite.sh"

# exits $PART1 for the first part (-m "not serial"), $PART2 for the second
FAKE_PYTEST = """#!/usr/bin/env bash
echo "$*" >> "$LOG"
for a in "$@"; do [ "$a" = "not serial" ] && exit "$PART1"; done
exit "$PART2"
"""


def _run(tmp_path: Path, part1: int, part2: int, *args: str, workers: str = "2") -> tuple[int, list[str]]:
    fake = tmp_path / "pytest"
    fake.write_text(FAKE_PYTEST)
    fake.chmod(0o755)
    log = tmp_path / "calls.log"
    log.write_text("")
    env = {"PATH": "/usr/bin:/bin", "LOG": str(log), "PART1": str(part1), "PART2": str(part2), "WORKERS": workers}
    r = subprocess.run(["bash", str(SCRIPT), str(fake), "--", *args], env=env, capture_output=True, text=True)
    return r.returncode, log.read_text().splitlines()


def test_two_parts_the_first_on_workers_the_second_alone(tmp_path: Path) -> None:
    rc, calls = _run(tmp_path, 0, 0, "-k", "abc")
    assert rc == 0
    assert calls == ["-q -n 2 --dist loadfile -m not serial -k abc", "-q -p no:xdist -m serial -k abc"]
    rc, calls = _run(tmp_path, 0, 0, workers="0")
    assert rc == 0 and calls[0] == "-q -m not serial"


@pytest.mark.parametrize(
    ("part1", "part2", "status", "parts_run"),
    [
        (1, 0, 1, 1),  # a failure in the first part stops the run there
        (2, 0, 2, 1),  # (pytest's 2: interrupted)
        (0, 1, 1, 2),
        (5, 0, 0, 2),  # one part selecting nothing is fine...
        (0, 5, 0, 2),
        (5, 5, 5, 2),  # ...both is pytest's "no tests ran", a failure
    ],
)
def test_the_exit_status_is_pytests(tmp_path: Path, part1: int, part2: int, status: int, parts_run: int) -> None:
    rc, calls = _run(tmp_path, part1, part2)
    assert (rc, len(calls)) == (status, parts_run)


@pytest.mark.parametrize("arg", ["-m", "-mslow", "-n", "-n4", "--numprocesses=4"])
def test_markers_and_workers_are_the_scripts_to_choose(tmp_path: Path, arg: str) -> None:
    rc, calls = _run(tmp_path, 0, 0, arg, "x")
    assert rc == 2 and calls == []
