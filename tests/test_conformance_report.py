"""`make conformance`'s comparison of two JUnit files (ops/conformance/report.py), on made-up runs."""

from __future__ import annotations

from pathlib import Path

from llamactor.ops.conformance import report

REFERENCE = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="unit.test_metrics" name="test_metrics_disabled"/>
<testcase classname="unit.test_metrics" name="test_metrics_prometheus_format"/>
<testcase classname="unit.test_security" name="test_cors_options[localhost]"/>
<testcase classname="unit.test_sleep" name="test_server_sleep"/>
<testcase classname="unit.test_basic" name="test_load_split_model">
  <skipped type="pytest.skip" message="needs a hub model (split GGUF) with no local substitute"/>
</testcase>
<testcase classname="unit.test_rerank" name="test_rerank"><failure message="assert 0 == 2">x</failure></testcase>
</testsuite></testsuites>
"""

CANDIDATE = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="unit.test_metrics" name="test_metrics_disabled"/>
<testcase classname="unit.test_metrics" name="test_metrics_prometheus_format">
  <failure message="KeyError: 'llamacpp:n_tokens_max'">trace</failure>
</testcase>
<testcase classname="unit.test_security" name="test_cors_options[localhost]">
  <failure message="AssertionError: assert 'Access-Control-Allow-Origin' in {}">trace</failure>
</testcase>
<testcase classname="unit.test_sleep" name="test_server_sleep">
  <error message="failed on setup with &quot;RuntimeError: Server process died with return code 2&quot;">trace</error>
  <system-out>llamactor serve: error: unrecognized arguments: --sleep-idle-seconds 1</system-out>
</testcase>
<testcase classname="unit.test_basic" name="test_load_split_model">
  <skipped type="pytest.skip" message="needs a hub model (split GGUF) with no local substitute"/>
</testcase>
<testcase classname="unit.test_rerank" name="test_rerank"/>
</testsuite></testsuites>
"""


def _compare(tmp_path: Path) -> report.Comparison:
    (tmp_path / "ref.xml").write_text(REFERENCE)
    (tmp_path / "cand.xml").write_text(CANDIDATE)
    return report.compare(report.read_junit(tmp_path / "ref.xml"), report.read_junit(tmp_path / "cand.xml"))


def test_counts_per_file_and_the_tests_only_llama_server_passes(tmp_path: Path) -> None:
    result = _compare(tmp_path)
    metrics = result.rows["test_metrics.py"]
    assert (metrics.tests, metrics.reference, metrics.candidate, metrics.both) == (2, 2, 1, 1)
    assert result.rows["test_basic.py"].tests == 0  # skipped by both: not counted
    assert result.skips == {"needs a hub model (split GGUF) with no local substitute": 1}
    total = result.total()
    assert (total.tests, total.reference, total.candidate, total.both) == (5, 4, 2, 1)
    assert result.extra == ["test_rerank.py::test_rerank"]
    reasons = {test: why for test, why, _ in result.regressions}
    assert reasons == {
        "test_metrics.py::test_metrics_prometheus_format": "/metrics",
        "test_security.py::test_cors_options[localhost]": "CORS",
        "test_sleep.py::test_server_sleep": (
            "server does not start: llamactor serve: error: unrecognized arguments: --sleep-idle-seconds 1"
        ),
    }


def test_markdown_page_has_the_counts_the_table_and_the_skips(tmp_path: Path) -> None:
    page = report.render_markdown(
        _compare(tmp_path),
        command="make conformance",
        date="2026-12-02 00:00 UTC",
        source="llama.cpp",
        skipped_files={"test_router.py": "router mode"},
    )
    assert "**llama-server passed 4 of 5 tests; llamactor passed 1 of those 4**" in page
    assert "| `test_metrics.py` | 2 | 2 | 1 | 1 |" in page
    assert "| `test_security.py::test_cors_options[localhost]` | CORS |" in page
    assert "- `test_router.py`: router mode" in page
    assert "- 1: needs a hub model (split GGUF) with no local substitute" in page
    text = report.render_text(_compare(tmp_path))
    assert "llama-server passes, llamactor does not (3):" in text
