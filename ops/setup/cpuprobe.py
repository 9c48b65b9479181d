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

RUN_TIMEOUT_S = 10.0  # a probe program computes a few vectors: anything this slow is broken
COMPILE_TIMEOUT_S = 60.0
OK = "ran"  # the verdict of a candidate whose program ran and printed the right answer

# The programs read their inputs from argc so that the compiler cannot fold the intrinsics into
# constants (and so emit no instruction at all), and are compiled with -O0 for the same reason.
_PRELUDE = """
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
"""

_AMX_SETUP = """
typedef struct { uint8_t palette; uint8_t start_row; uint8_t reserved[14];
                 uint16_t colsb[16]; uint8_t rows[16]; } __attribute__((packed)) tilecfg;
static int amx_permission(void) {
    /* Linux: ask for the tile data state (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) */
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}
static void amx_config(int rows, int colsb) {
    tilecfg c; memset(&c, 0, sizeof c); c.palette = 1;
    for (int i = 0; i < 3; i++) { c.colsb[i] = colsb; c.rows[i] = rows; }
    _tile_loadconfig(&c);
}
"""

# ggml's AMX kernels configure the tiles from a struct on the stack (ggml-cpu/amx/mmq.cpp,
# ggml_tile_config_init). Some compilers (GCC 12 among them) give ``ldtilecfg`` a memory operand
# of 8 bytes, not 64, and drop the stores of the rows and column widths as dead: the tiles are
# left unconfigured and the first tile instruction traps (SIGILL), on a CPU whose AMX works. The
# plain program above cannot see that (it configures through memset and a loop); this one is
# ggml's function, as ggml's build compiles it.
_AMX_GGML_FORM = """
#include <immintrin.h>
#include <cstdint>
#include <cstdio>
#include <unistd.h>
#include <sys/syscall.h>
struct tile_config_t {
    uint8_t palette_id = 0; uint8_t start_row = 0; uint8_t reserved_0[14] = {0};
    uint16_t colsb[16] = {0}; uint8_t rows[16] = {0};
};
inline void tile_config_init(void) {
    static thread_local bool done = false;
    if (done) return;
    alignas(64) tile_config_t tc = {};
    tc.palette_id = 1; tc.start_row = 0;
    tc.rows[0] = 8;  tc.colsb[0] = 64;  tc.rows[1] = 8;  tc.colsb[1] = 64;
    tc.rows[2] = 16; tc.colsb[2] = 32;  tc.rows[3] = 16; tc.colsb[3] = 32;
    tc.rows[4] = 16; tc.colsb[4] = 64;  tc.rows[5] = 16; tc.colsb[5] = 64;
    tc.rows[6] = 16; tc.colsb[6] = 64;  tc.rows[7] = 16; tc.colsb[7] = 64;
    _tile_loadconfig(&tc);
    done = true;
}
int main(int argc, char **) {
    if (syscall(SYS_arch_prctl, 0x1023, 18)) return 3;
    tile_config_init();
    alignas(64) static int32_t r[16 * 16]; r[0] = 7;
    _tile_zero(4); _tile_stored(4, r, 64); _tile_release();
    if (r[0] == 0 && argc == 1) puts("ok");
    return 0;
}
"""
GGML_FORM_LEVELS = ("-O1", "-O2", "-O3")  # ggml builds with -O3; what survives depends on inlining


@dataclass(frozen=True)
class Candidate:
    """One ggml instruction-set option (``GGML_<name>``) and the program that proves it runs."""

    name: str
    flags: tuple[str, ...]  # the compiler's flags for it (those ggml's CMake adds for the option)
    requires: tuple[str, ...]  # options that must also be kept (ggml's code assumes them)
    body: str  # C statements of main(int argc, ...): print "ok" when the answer is right
    support: str = ""  # C declarations the body uses
    # a C++ program written the way ggml's kernels use the set, compiled at each of
    # GGML_FORM_LEVELS by the C++ compiler: the set is kept only if it runs too (see AMX_TILE)
    ggml_form: str = ""


CANDIDATES: tuple[Candidate, ...] = (
    Candidate(
        "SSE42",
        ("-msse4.2",),
        (),
        'unsigned c = _mm_crc32_u32(0, (unsigned)argc); if (c == _mm_crc32_u32(0, 1u) && c != 0) puts("ok");',
    ),
    Candidate(
        "AVX",
        ("-mavx",),
        ("SSE42",),
        "float o[8]; __m256 x = _mm256_set1_ps((float)argc); _mm256_storeu_ps(o, _mm256_add_ps(x, x));"
        ' if (o[7] == 2.0f) puts("ok");',
    ),
    Candidate(
        "F16C",
        ("-mf16c",),
        ("AVX",),
        "float o[4]; __m128i h = _mm_cvtps_ph(_mm_set1_ps(1.5f * argc), 0); _mm_storeu_ps(o, _mm_cvtph_ps(h));"
        ' if (o[3] == 1.5f) puts("ok");',
    ),
    Candidate(
        "FMA",
        ("-mfma",),
        ("AVX",),
        "float o[8]; __m256 x = _mm256_set1_ps((float)argc);"
        ' _mm256_storeu_ps(o, _mm256_fmadd_ps(x, x, x)); if (o[0] == 2.0f) puts("ok");',
    ),
    Candidate(
        "BMI2",
        ("-mbmi2",),
        (),
        'if (_pdep_u32(3u * argc, 0xF0u) == 0x30u) puts("ok");',
    ),
    Candidate(
        "AVX2",
        ("-mavx2",),
        ("AVX", "FMA", "F16C"),
        "int o[8]; __m256i x = _mm256_set1_epi32(argc); _mm256_storeu_si256((__m256i *)o, _mm256_add_epi32(x, x));"
        ' if (o[5] == 2) puts("ok");',
    ),
    Candidate(
        "AVX_VNNI",
        ("-mavxvnni",),
        ("AVX2",),
        "int o[8]; __m256i a = _mm256_set1_epi8((char)argc), b = _mm256_set1_epi8(2);"
        " _mm256_storeu_si256((__m256i *)o, _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b));"
        ' if (o[0] == 8) puts("ok");',
    ),
    Candidate(
        # ggml's GGML_AVX512 turns on all five of these together: each gets an instruction here
        "AVX512",
        ("-mavx512f", "-mavx512cd", "-mavx512vl", "-mavx512dq", "-mavx512bw"),
        ("AVX2",),
        "int o[16]; __m512i x = _mm512_set1_epi32(argc);"
        " __m512i f = _mm512_add_epi32(x, x);"  # F
        " __m512i c = _mm512_conflict_epi32(x);"  # CD: every lane equals all lanes before it
        " __m512i b = _mm512_add_epi8(x, x);"  # BW
        " __m512d d = _mm512_cvtepi64_pd(_mm512_set1_epi64(argc));"  # DQ
        " __m256i v = _mm256_maskz_add_epi32(0x0F, _mm256_set1_epi32(argc), _mm256_set1_epi32(argc));"  # VL
        " int s = 0; double dd[8]; int vv[8];"
        " _mm512_storeu_si512(o, f); s += o[15] == 2;"
        " _mm512_storeu_si512(o, c); s += o[15] == 0x7FFF;"
        " _mm512_storeu_si512(o, b); s += o[0] == 2;"
        " _mm512_storeu_pd(dd, d); s += dd[7] == 1.0;"
        " _mm256_storeu_si256((__m256i *)vv, v); s += vv[0] == 2 && vv[7] == 0;"
        ' if (s == 5) puts("ok");',
    ),
    Candidate(
        "AVX512_VBMI",
        ("-mavx512vbmi",),
        ("AVX512",),
        "char o[64]; __m512i idx = _mm512_set1_epi8((char)argc), t = _mm512_set_epi8("
        "63,62,61,60,59,58,57,56,55,54,53,52,51,50,49,48,47,46,45,44,43,42,41,40,39,38,37,36,35,34,33,32,"
        "31,30,29,28,27,26,25,24,23,22,21,20,19,18,17,16,15,14,13,12,11,10,9,8,7,6,5,4,3,2,1,0);"
        ' _mm512_storeu_si512(o, _mm512_permutexvar_epi8(idx, t)); if (o[9] == 1) puts("ok");',
    ),
    Candidate(
        "AVX512_VNNI",
        ("-mavx512vnni",),
        ("AVX512",),
        "int o[16]; __m512i a = _mm512_set1_epi8((char)argc), b = _mm512_set1_epi8(3);"
        ' _mm512_storeu_si512(o, _mm512_dpbusd_epi32(_mm512_setzero_si512(), a, b)); if (o[15] == 12) puts("ok");',
    ),
    Candidate(
        "AVX512_BF16",
        ("-mavx512bf16",),
        ("AVX512",),
        "float o[16]; __m512 x = _mm512_set1_ps((float)argc); __m512bh h = _mm512_cvtne2ps_pbh(x, x);"
        ' _mm512_storeu_ps(o, _mm512_dpbf16_ps(_mm512_setzero_ps(), h, h)); if (o[0] == 2.0f) puts("ok");',
    ),
    Candidate(
        "AMX_TILE",
        ("-mamx-tile",),
        ("AVX512",),
        "static int32_t r[16 * 16]; r[0] = 7; if (!amx_permission()) return 3; amx_config(16, 64);"
        ' _tile_zero(0); _tile_stored(0, r, 64); _tile_release(); if (r[0] == 0 && argc == 1) puts("ok");',
        _AMX_SETUP,
        _AMX_GGML_FORM,
    ),
    Candidate(
        # ggml's AMX kernels need AVX512-VNNI beside the tiles (ggml-cpu/amx: __AMX_INT8__ && __AVX512VNNI__)
        "AMX_INT8",
        ("-mamx-tile", "-mamx-int8"),
        ("AMX_TILE", "AVX512_VNNI"),
        "static int8_t a[16 * 64], b[16 * 64]; static int32_t r[16 * 16];"
        " for (int i = 0; i < 16 * 64; i++) { a[i] = (int8_t)argc; b[i] = 2; }"
        " if (!amx_permission()) return 3; amx_config(16, 64);"
        " _tile_zero(0); _tile_loadd(1, a, 64); _tile_loadd(2, b, 64); _tile_dpbssd(0, 1, 2);"
        ' _tile_stored(0, r, 64); _tile_release(); if (r[0] == 128) puts("ok");',
        _AMX_SETUP,
    ),
    Candidate(
        "AMX_BF16",
        ("-mamx-tile", "-mamx-bf16"),
        ("AMX_TILE", "AVX512_BF16"),
        "static uint16_t a[16 * 32], b[16 * 32]; static float r[16 * 16];"
        " for (int i = 0; i < 16 * 32; i++) { a[i] = 0x3F80 * argc; b[i] = 0x3F80; }"  # bf16 1.0
        " if (!amx_permission()) return 3; amx_config(16, 64);"
        " _tile_zero(0); _tile_loadd(1, a, 64); _tile_loadd(2, b, 64); _tile_dpbf16ps(0, 1, 2);"
        ' _tile_stored(0, r, 64); _tile_release(); if (r[0] == 32.0f) puts("ok");',
        _AMX_SETUP,
    ),
)


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
    main = f"int main(int argc, char **argv) {{ (void)argv; {cand.body} return 0; }}"
    src.write_text(f"{_PRELUDE}{cand.support}\n{main}\n")
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


# ---- the backend (GPU) part of the build ----------------------------------------------------

BACKENDS = ("cpu", "cuda", "vulkan", "rocm", "metal")


def backend_options(backend: str, env: Mapping[str, str] | None = None) -> list[str]:
    """The ``-D`` options of a GPU backend. GPU backends are built as loadable modules
    (``GGML_BACKEND_DL``): on a machine without the GPU's driver or runtime the module fails to
    load and the server runs on the CPU, instead of the whole library failing to import.
    The CPU backend is then a module too, built for what the probe ran, as above."""
    env = os.environ if env is None else env
    if backend == "cpu":
        return []
    if backend == "metal":
        return ["-DGGML_METAL=ON"]  # macOS: Metal is llama.cpp's default there; no module needed
    dl = ["-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=OFF"]
    if backend == "cuda":
        archs = env.get("CUDA_ARCHITECTURES") or cuda_architectures()
        # without VMM, ggml-cuda links the CUDA runtime only, not the driver library: a toolkit
        # without the driver's stubs (a build machine without a GPU) still links it
        return [*dl, "-DGGML_CUDA=ON", "-DGGML_CUDA_NO_VMM=ON", f"-DCMAKE_CUDA_ARCHITECTURES={archs}"]
    if backend == "vulkan":
        return [*dl, "-DGGML_VULKAN=ON"]
    if backend == "rocm":
        targets = env.get("AMDGPU_TARGETS") or rocm_targets()
        return [*dl, "-DGGML_HIP=ON", f"-DAMDGPU_TARGETS={targets}"]
    raise ValueError(f"unknown backend {backend!r}: one of {', '.join(BACKENDS)}")


DEFAULT_CUDA_ARCH = "80"  # with no GPU to ask (a build machine): one architecture, Ampere and newer run it


def cuda_architectures() -> str:
    """The compute capabilities of the GPUs nvidia-smi lists (e.g. "90"), or DEFAULT_CUDA_ARCH."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        caps = sorted({line.strip().replace(".", "") for line in out.splitlines() if line.strip()})
        if caps:
            return ";".join(caps)
    return DEFAULT_CUDA_ARCH


def rocm_targets() -> str:
    """The gfx names rocminfo lists, or llama.cpp's common targets."""
    if shutil.which("rocminfo"):
        try:
            out = subprocess.run(["rocminfo"], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        names = sorted({w for w in out.split() if w.startswith("gfx") and w[3:].isalnum() and w != "gfx000"})
        if names:
            return ";".join(names)
    return "gfx1030;gfx1100"


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
