"""Runs on the machine in front of it: the CPU probe, the warm-up decode, what the build reports.

- The probe behind setup's llama.cpp build (ops/setup/cpuprobe.py) decides by executing: an
  instruction set whose program traps is left out of the build, whatever the CPU's flags say.
  Shown with instruction sets no current x86 CPU runs (AMD's XOP and FMA4, gone since Zen:
  they trap exactly as AMX traps on a machine that advertises it and traps), and with faked
  verdicts for the other cases (a requirement that did not run, a machine the probe does not
  cover, the GPU backends' options). A set is also run as ggml's kernels are compiled (a
  compiler can drop AMX's tile configuration, and that build traps on a CPU whose AMX works).
- After each build, setup decodes a prompt with the built library in a child process
  (ops/setup/buildcheck.py); a death there is reported as such (setup then rebuilds without AMX).
- An engine whose warm-up decode dies by SIGILL (what such a build does on its first decode)
  makes startup fail once, saying the cause and the remedy, instead of a server that answers
  every request with a 500 after four restarts; one that dies so in a restart takes the engine
  down at once, with the same words at /health.
- ``/props`` shows the build: the CPU features compiled in, the probe's verdicts, the devices.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import httpx
import pytest
from conftest import free_port

from llamactor.ops.setup import buildcheck, cpuprobe
from llamactor.protocol.errors import Unavailable
from llamactor.runtime import Runtime
from llamactor.runtime.engine import backends

HOOKS = str(Path(__file__).with_name("enginehooks.py"))
LLAMACTOR = [sys.executable, "-m", "llamactor.runtime.cli"]
x86_only = pytest.mark.skipif(not cpuprobe.is_x86_64(), reason="the probe decides on x86-64 only")

# Instruction sets of AMD's Bulldozer family that no later x86 CPU (Intel's or AMD's) runs.
FOREIGN = (
    cpuprobe.Candidate(
        "FMA4",
        ("-mfma4",),
        (),
        "float o[4]; __m128 x = _mm_set1_ps((float)argc); _mm_storeu_ps(o, _mm_macc_ps(x, x, x));"
        ' if (o[0] == 2.0f) puts("ok");',
        "#include <x86intrin.h>\n",
    ),
    cpuprobe.Candidate(
        "XOP",
        ("-mxop",),
        (),
        "int o[4]; __m128i v = _mm_set1_epi32(argc); _mm_storeu_si128((__m128i *)o, _mm_roti_epi32(v, 1));"
        ' if (o[0] == 2) puts("ok");',
        "#include <x86intrin.h>\n",
    ),
)


def _ran(*names: str) -> dict[str, cpuprobe.Verdict]:
    return {n: cpuprobe.Verdict(n, cpuprobe.OK) for n in names}


ALL = [c.name for c in cpuprobe.CANDIDATES]


def _on(options: list[str]) -> set[str]:
    return {o.split("=")[0].removeprefix("-DGGML_") for o in options if o.endswith("=ON")}


# ---- the probe ---------------------------------------------------------------------------------


@x86_only
def test_the_probe_leaves_out_what_traps() -> None:
    """Each foreign instruction set's program is compiled and run in a child process, and ends by
    a signal (SIGILL) here; a candidate that traps is never kept, and every real candidate the
    probe did not see run is OFF in the build's options (on an AMD machine: AMX)."""
    probe = cpuprobe.probe((*cpuprobe.CANDIDATES, *FOREIGN))
    trapped = {n for n, v in probe.verdicts.items() if v.verdict.startswith("trapped")}
    assert {"FMA4", "XOP"} & trapped, probe.verdicts  # no CPU made since 2017 runs either
    assert not trapped & set(probe.kept())
    real = cpuprobe.Probe(probe.machine, probe.cpu, probe.compiler)
    real.verdicts = {n: v for n, v in probe.verdicts.items() if n in ALL}
    options = cpuprobe.cmake_options(real)
    assert "-DGGML_NATIVE=OFF" in options  # every option named: nothing left to -march=native
    assert _on(options) == set(real.kept())
    for name, v in real.verdicts.items():
        if not v.ran:
            assert f"-DGGML_{name}=OFF" in options


@x86_only
def test_the_build_was_made_for_what_the_probe_ran() -> None:
    """The installed build's record (written by setup) names the probe's verdicts and its CMake
    arguments; every instruction-set option it turned on ran here."""
    record = backends.build_record()
    if record is None:
        pytest.skip("llama-cpp-python was not installed by ops/setup_venv.sh")
    kept = set(record["probe"]["kept"])
    assert _on(record["cmake_args"].split()) - {"RPC"} <= kept


def test_faked_verdicts_give_the_options_of_other_machines() -> None:
    """AMX that traps: AVX-512 kept, the tile options off. AVX-512 that traps: what needs it off
    too (VNNI-512, BF16, AMX), AVX2 kept. FMA with a wrong answer: AVX2 and everything above it
    off. Not x86-64 (or no compiler): llama.cpp's own detection."""
    amx_traps = cpuprobe.Probe("x86_64", "t", "cc", _ran(*ALL[:-3]))
    amx_traps.verdicts["AMX_TILE"] = cpuprobe.Verdict("AMX_TILE", "trapped (SIGILL)")
    amx_traps.verdicts.update(_ran("AMX_INT8", "AMX_BF16"))  # a tile op that "ran" without tiles is not kept
    assert _on(cpuprobe.cmake_options(amx_traps)) == set(ALL[:-3])

    no512 = cpuprobe.Probe("x86_64", "t", "cc", _ran(*ALL))
    no512.verdicts["AVX512"] = cpuprobe.Verdict("AVX512", "trapped (SIGILL)")
    assert _on(cpuprobe.cmake_options(no512)) == {"SSE42", "AVX", "F16C", "FMA", "BMI2", "AVX2", "AVX_VNNI"}

    bad_fma = cpuprobe.Probe("x86_64", "t", "cc", _ran(*ALL))
    bad_fma.verdicts["FMA"] = cpuprobe.Verdict("FMA", "wrong answer")
    assert _on(cpuprobe.cmake_options(bad_fma)) == {"SSE42", "AVX", "F16C", "BMI2"}

    arm = cpuprobe.probe(machine="aarch64")
    assert not arm.decides and cpuprobe.cmake_options(arm) == ["-DGGML_NATIVE=ON"]
    assert "not x86-64" in cpuprobe.describe(arm)


def test_gpu_backends_are_modules_with_the_cpu_probed() -> None:
    """A GPU backend is built as a loadable module (a machine without its driver still serves on
    the CPU); CUDA links no driver library and takes one architecture from the environment (or
    nvidia-smi); the CPU options stay the probe's."""
    env = {"CUDA_ARCHITECTURES": "90"}
    cuda = cpuprobe.backend_options("cuda", env)
    assert {"-DGGML_BACKEND_DL=ON", "-DGGML_CUDA=ON", "-DGGML_CUDA_NO_VMM=ON", "-DCMAKE_CUDA_ARCHITECTURES=90"} <= set(
        cuda
    )
    assert "-DGGML_VULKAN=ON" in cpuprobe.backend_options("vulkan", env)
    assert "-DGGML_HIP=ON" in cpuprobe.backend_options("rocm", {"AMDGPU_TARGETS": "gfx1100"})
    assert cpuprobe.backend_options("cpu", env) == []
    probed = cpuprobe.Probe("x86_64", "t", "cc", _ran(*ALL))
    options = cpuprobe.build_options("cpu", probed)
    assert options[0] == "-DGGML_RPC=ON" and "-DGGML_AMX_INT8=ON" in options
    with pytest.raises(ValueError, match="unknown backend"):
        cpuprobe.backend_options("opencl", env)


def test_setup_prints_and_records_the_decision(tmp_path: Path) -> None:
    """`python3 ops/setup/cpuprobe.py` (what setup runs, with the system's Python) prints each verdict on
    stderr and the build's options on stdout, and records both."""
    record = tmp_path / "build.json"
    script = Path(cpuprobe.__file__)
    drop = "AMX_TILE=the build check died by SIGILL"  # what setup passes after a build died in its check
    out = subprocess.run(
        [sys.executable, str(script), "--cmake", "--record", str(record), "--drop", drop],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split()[0] == "-DGGML_RPC=ON"
    assert "CPU probe" in out.stderr
    saved = json.loads(record.read_text())
    assert saved["cmake_args"] == out.stdout.split()
    if cpuprobe.is_x86_64():
        assert set(saved["probe"]["verdicts"]) == set(ALL)
        assert saved["probe"]["verdicts"]["AMX_TILE"]["verdict"] == "turned off: the build check died by SIGILL"
        assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(saved["cmake_args"])
    bad = subprocess.run([sys.executable, str(script), "--drop", "AMX9=x"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown instruction set(s): AMX9" in bad.stderr


@x86_only
def test_a_set_is_kept_only_if_it_runs_as_ggml_compiles_it() -> None:
    """A candidate whose plain program runs but whose ggml-form program (C++, optimised, as ggml's
    kernels are built) traps is left out, and its verdict says so: the case of a compiler that
    drops AMX's tile configuration, shown with a ggml form that traps on any CPU."""
    sse = next(c for c in cpuprobe.CANDIDATES if c.name == "SSE42")
    traps = "int main() { __builtin_trap(); }\n"  # ud2: SIGILL
    runs = '#include <cstdio>\nint main() { std::puts("ok"); }\n'
    probe = cpuprobe.probe(
        (
            cpuprobe.Candidate("SSE42", sse.flags, (), sse.body, ggml_form=runs),
            cpuprobe.Candidate("AVX", ("-mavx",), ("SSE42",), sse.body, ggml_form=traps),
        )
    )
    assert probe.verdicts["SSE42"].ran
    why = probe.verdicts["AVX"].verdict
    assert why.startswith("runs, but trapped (SIGILL) when compiled as ggml's kernels are (C++ -O1)"), why
    assert probe.kept() == ["SSE42"]
    amx = next(c for c in cpuprobe.CANDIDATES if c.name == "AMX_TILE")
    assert "_tile_loadconfig(&tc)" in amx.ggml_form  # ggml's own tile configuration function


def test_the_build_check_decodes_in_a_child_and_reports_its_death(tiny_model: Path, tmp_path: Path) -> None:
    """ops/setup/buildcheck.py (run by setup after each build) decodes a prompt with the installed
    llama.cpp in a child process; a child that dies by SIGILL is reported so, not as a crash of
    setup."""
    ran, what = buildcheck.check(tiny_model)
    assert ran and what.startswith("decoded a prompt of"), what
    dying = tmp_path / "python"
    dying.write_text("#!/bin/sh\nkill -ILL $$\n")
    dying.chmod(0o755)
    assert buildcheck.check(tiny_model, python=str(dying)) == (False, "the decode died by SIGILL")


# ---- the warm-up decode -------------------------------------------------------------------------


@pytest.mark.slow
def test_a_warmup_that_dies_by_sigill_stops_startup_once(tiny_model: Path) -> None:
    """The engine's warm-up decode dies by SIGILL: the server exits non-zero within seconds, its
    log says once what happened, where and the remedy, and the engine was not restarted."""
    port = free_port()
    argv = [*LLAMACTOR, "serve", "-m", str(tiny_model), "-t", "1", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--engine-hooks", f"{HOOKS}:IllegalInWarmup"]
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert time.monotonic() - started < 60
    records = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    (cannot,) = [r for r in records if r.get("event") == "engine_cannot_start"]
    assert "SIGILL" in cannot["cause"] and "warm-up decode" in cannot["cause"] and "make install" in cannot["cause"]
    assert not [r for r in records if r.get("event") in ("engine_restarting", "engine_ready")]


@pytest.mark.slow
async def test_a_restart_whose_warmup_dies_takes_the_engine_down_at_once(make_config, tmp_path, monkeypatch) -> None:
    """The first engine serves; killed, its replacement dies by SIGILL in its warm-up. The engine
    is DOWN after that one restart (not after four), /health's 503 gives the cause, and a request
    is refused at once with it (503), not a 500 after restarts."""
    monkeypatch.setenv("LLAMACTOR_TEST_MARKS", str(tmp_path))
    cfg = make_config(parallel=2, engine_hooks=f"{HOOKS}:IllegalInLaterWarmup")
    async with Runtime.open(cfg, isolate=True) as rt:
        out = await rt.complete("hello", max_tokens=2, temperature=0)
        assert out.n_predicted == 2
        os.kill(rt.engine.process.pid, signal.SIGKILL)
        with anyio.fail_after(60):
            while rt.engine_status().state != "down":
                await anyio.sleep(0.05)
        status = rt.engine_status()
        assert status.restarts == 1 and "SIGILL" in status.last_exit
        with pytest.raises(Unavailable, match="SIGILL"):
            await rt.complete("hello", max_tokens=2)
        transport = httpx.ASGITransport(app=rt.asgi_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            health = await client.get("/health")
        assert health.status_code == 503 and "SIGILL" in health.json()["error"]["message"]


@pytest.mark.slow
async def test_props_show_the_build(make_config) -> None:
    """/props' engine.build: the CPU features compiled in (llama.cpp's own list), the probe's
    verdicts where setup built it, and every device with its memory, as the engine process saw them."""
    async with Runtime.open(make_config(parallel=1), isolate=True) as rt:
        transport = httpx.ASGITransport(app=rt.asgi_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            build = (await client.get("/props")).json()["engine"]["build"]
    assert build["cpu_features"] == list(backends.cpu_features())
    assert [d["name"] for d in build["devices"]] == [d.name for d in backends.devices()]
    cpu = next(d for d in build["devices"] if d["type"] == "cpu")
    assert cpu["memory_total"] > 0
    record = backends.build_record()
    if record is not None:
        assert build["cmake_args"] == record["cmake_args"] and build["probed"] == record["probe"]["kept"]
