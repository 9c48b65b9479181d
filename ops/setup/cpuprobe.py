"""What this CPU really executes, decided by running it: the probe behind setup's llama.cpp build.

    python3 ops/setup/cpuprobe.py [--backend cpu|cuda|vulkan|rocm|metal] [--record FILE] [--cmake]

A CPU's flags (cpuid, ``/proc/cpuinfo``) say what it advertises, not what it runs: a VM can list
AMX and be granted the tile permission by its kernel, and still trap on the first tile
instruction. A build made with ``-march=native`` (llama.cpp's default, ``GGML_NATIVE=ON``) then
compiles AMX in because the CPU says it has it, and every decode dies by SIGILL. So each
candidate instruction set here is a tiny C program compiled with that set's ``-m`` flags and run
in a child process; a set is kept only when its program ran to the end and printed the answer
the instructions compute. AMX is also run as ggml's kernels are written and compiled (C++,
optimised): a compiler can drop the tile configuration's stores, and such a build traps on a CPU
whose AMX works. Setup then builds, and checks the built library by decoding a prompt of a
quantised model in a child process; a build that dies there is rebuilt without the sets named
by ``--drop``. The build then names every ggml instruction-set option explicitly
(``GGML_NATIVE=OFF``, ``GGML_AVX2=ON``, ``GGML_AMX_TILE=OFF``, ...), so llama.cpp is compiled for
exactly what ran here: AMX where it works (on the CPUs that really have it, it is llama.cpp's
fastest prompt path), nothing that traps.

The probe covers x86-64 (where the instruction-set options are). Elsewhere (ARM, POWER, ...)
it decides nothing and the build keeps llama.cpp's own detection.

The candidates and their programs are the table in ops/setup/cpusets.py; the GPU backend's options
come from ops/setup/gpubackends.py.

Standard library only: setup runs it with the system's Python before the venv has anything.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING or __package__:
    from .cpusets import CANDIDATES, GGML_FORM_LEVELS, Candidate
    from .gpubackends import BACKENDS, backend_options
else:  # run as a script (setup, with the system's Python, before llamactor is installed)
    from cpusets import CANDIDATES, GGML_FORM_LEVELS, Candidate
    from gpubackends import BACKENDS, backend_options

RUN_TIMEOUT_S = 10.0  # a probe program computes a few vectors: anything this slow is broken
COMPILE_TIMEOUT_S = 60.0
OK = "ran"  # the verdict of a candidate whose program ran and printed the right answer


@dataclass
class Verdict:
    """What running one candidate gave."""

    name: str
    verdict: str  # OK, or why not: "trapped (SIGILL)", "wrong answer", "the compiler lacks it", ...
    flags: tuple[str, ...] = ()

    @property
    def ran(self) -> bool:
        return self.verdict == OK


@dataclass
class Probe:
    """The probe's whole answer: each candidate's verdict and the build options that follow."""

    machine: str
    cpu: str
    compiler: str
    verdicts: dict[str, Verdict] = field(default_factory=dict)

    @property
    def decides(self) -> bool:
        """False where the probe has nothing to say (not x86-64, or no compiler)."""
        return bool(self.verdicts)

    def kept(self) -> list[str]:
        return kept_options(self.verdicts)

    def to_json(self) -> dict[str, object]:
        return {
            "machine": self.machine,
            "cpu": self.cpu,
            "compiler": self.compiler,
            "verdicts": {name: asdict(v) for name, v in self.verdicts.items()},
            "kept": self.kept(),
        }


def kept_options(verdicts: Mapping[str, Verdict]) -> list[str]:
    """The options that ran, and whose required options are kept too (in CANDIDATES order).
    A set that ran but needs one that did not (AVX2 without FMA, AMX-INT8 without AVX512-VNNI) is
    dropped: ggml's code for it assumes the other."""
    kept: list[str] = []
    for cand in CANDIDATES:
        v = verdicts.get(cand.name)
        if v is not None and v.ran and all(req in kept for req in cand.requires):
            kept.append(cand.name)
    return kept


def cmake_options(probe: Probe | None) -> list[str]:
    """The ``-D`` options for ggml's CPU backend: each x86 instruction-set option named ON or OFF
    from the probe, or llama.cpp's own detection (``GGML_NATIVE=ON``) where the probe decides nothing."""
    if probe is None or not probe.decides:
        return ["-DGGML_NATIVE=ON"]
    kept = set(probe.kept())
    return ["-DGGML_NATIVE=OFF"] + [f"-DGGML_{c.name}={'ON' if c.name in kept else 'OFF'}" for c in CANDIDATES]


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _compiler() -> str | None:
    for name in (os.environ.get("CC", ""), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cxx_compiler() -> str | None:
    for name in (os.environ.get("CXX", ""), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _build_and_run(compiler: str, level: str, flags: Sequence[str], src: Path, exe: Path) -> str:
    """Compile and run one program: OK, or what went wrong."""
    try:
        built = subprocess.run(
            [compiler, level, *flags, str(src), "-o", str(exe)],
            capture_output=True,
            text=True,
            timeout=COMPILE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return "the compiler timed out"
    if built.returncode != 0:
        return "the compiler lacks it"
    try:
        ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return "hung"
    if ran.returncode < 0:
        return f"trapped ({_signal_name(ran.returncode)})"
    if ran.returncode == 3:
        return "the kernel refused the AMX tile permission"
    if ran.returncode != 0 or ran.stdout.strip() != "ok":
        return "wrong answer"
    return OK


def run_candidate(cand: Candidate, cc: str, work: Path, cxx: str | None = None) -> Verdict:
    """Compile ``cand``'s program with its flags and run it in a child process; then, for a set
    with a ggml form, that program as ggml's build would compile it."""
    src = work / f"{cand.name}.c"
    exe = work / cand.name
    src.write_text(cand.source())
    verdict = _build_and_run(cc, "-O0", cand.flags, src, exe)
    if verdict != OK or not cand.ggml_form or cxx is None:
        return Verdict(cand.name, verdict, cand.flags)
    src = work / f"{cand.name}-ggml.cpp"
    src.write_text(cand.ggml_form)
    for level in GGML_FORM_LEVELS:
        got = _build_and_run(cxx, level, cand.flags, src, exe)
        if got.startswith("trapped"):
            return Verdict(
                cand.name,
                f"runs, but {got} when compiled as ggml's kernels are (C++ {level}): this compiler"
                " drops the tile configuration's stores",
                cand.flags,
            )
        if got != OK:
            return Verdict(cand.name, f"{got} when compiled as ggml's kernels are (C++ {level})", cand.flags)
    return Verdict(cand.name, OK, cand.flags)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def is_x86_64(machine: str | None = None) -> bool:
    return (machine or platform.machine()).lower() in ("x86_64", "amd64")


def probe(
    candidates: Iterable[Candidate] = CANDIDATES,
    *,
    machine: str | None = None,
    dropped: Mapping[str, str] | None = None,
) -> Probe:
    """Run every candidate (x86-64 only; elsewhere an empty, undeciding probe). ``dropped`` names
    sets turned off without running them, each with the reason (setup's fallback after a built
    library died in its check)."""
    machine = machine or platform.machine()
    dropped = dropped or {}
    cc = _compiler()
    cxx = _cxx_compiler()
    result = Probe(machine=machine, cpu=_cpu_name(), compiler=" and ".join(filter(None, (cc, cxx))) or "none")
    if not is_x86_64(machine) or cc is None:
        return result
    with tempfile.TemporaryDirectory(prefix="llamactor-cpuprobe-") as tmp:
        for cand in candidates:
            if cand.name in dropped:
                result.verdicts[cand.name] = Verdict(cand.name, "turned off: " + dropped[cand.name], cand.flags)
            else:
                result.verdicts[cand.name] = run_candidate(cand, cc, Path(tmp), cxx)
    return result


def build_options(backend: str, probed: Probe | None) -> list[str]:
    """Every ``-D`` option of the llama.cpp build: ggml-rpc (the layer split over workers), the
    CPU instruction sets, the GPU backend."""
    return ["-DGGML_RPC=ON", *cmake_options(probed), *backend_options(backend)]


def describe(p: Probe) -> str:
    """The decision as setup prints it."""
    if not p.decides:
        why = "not x86-64" if not is_x86_64(p.machine) else "no C compiler"
        return f"CPU probe: {p.cpu} ({p.machine}): {why}; llama.cpp detects the instruction sets itself"
    lines = [f"CPU probe: {p.cpu}: each instruction set run in a child process"]
    kept = set(p.kept())
    for name, v in p.verdicts.items():
        mark = "use " if name in kept else "skip"
        why = (
            v.verdict
            if not v.ran or name in kept
            else "ran, but needs "
            + ", ".join(r for r in next(c for c in CANDIDATES if c.name == name).requires if r not in kept)
        )
        lines.append(f"  {mark} {name:<12} {why}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cpu", choices=BACKENDS)
    ap.add_argument("--record", type=Path, help="write the probe and the build options here (JSON)")
    ap.add_argument("--cmake", action="store_true", help="print the build's -D options on stdout")
    ap.add_argument("--quiet", action="store_true", help="do not print the decision on stderr")
    ap.add_argument(
        "--drop",
        action="append",
        default=[],
        metavar="SET=WHY",
        help="turn an instruction set off without running it (repeatable), e.g. AMX_TILE='the build check died'",
    )
    args = ap.parse_args(argv)
    dropped = dict(item.partition("=")[::2] for item in args.drop)
    unknown = set(dropped) - {c.name for c in CANDIDATES}
    if unknown:
        ap.error(f"unknown instruction set(s): {', '.join(sorted(unknown))}")
    p = probe(dropped=dropped)
    options = build_options(args.backend, p)
    if not args.quiet:
        print(describe(p), file=sys.stderr)
    if args.record:
        record = {"backend": args.backend, "cmake_args": options, "probe": p.to_json()}
        args.record.write_text(json.dumps(record, indent=1) + "\n")
    if args.cmake:
        print(" ".join(options))
    return 0


if __name__ == "__main__":
    sys.exit(main())
