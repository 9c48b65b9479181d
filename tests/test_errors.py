"""Errors (API-7, STYLE): one hierarchy; every foreign error is mapped in one place."""

from __future__ import annotations

import msgspec
import pytest

from llamactor.protocol import errors
from llamactor.runtime.http.errors import error_body, map_exception


@pytest.mark.parametrize(
    ("exc", "status", "kind"),
    [
        (msgspec.ValidationError("Expected `int`"), 400, "invalid_request_error"),
        (msgspec.DecodeError("truncated"), 400, "invalid_request_error"),
        (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), 400, "invalid_request_error"),
        (TimeoutError(), 503, "unavailable_error"),
        (RuntimeError("boom"), 500, "server_error"),
    ],
)
def test_foreign_errors_are_mapped(exc, status, kind):
    err = map_exception(exc)
    assert isinstance(err, errors.LlamactorError)
    assert (err.status, err.kind) == (status, kind)
    body = error_body(exc)
    assert body.error.code == status and body.error.type == kind and body.error.message
    if status == 500:
        assert "boom" not in body.error.message  # no internals leak


def test_every_llamactor_error_has_a_status_and_kind():
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.LlamactorError)]
    assert len(classes) >= 10
    for cls in classes:
        assert 400 <= cls.status <= 599 and cls.kind
