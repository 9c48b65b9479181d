"""Errors (OpenAI shape, STYLE): one hierarchy; every foreign error is mapped in one place."""

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


def _foreign_exception_classes() -> list[type[BaseException]]:
    """Every exception class the HTTP boundary can meet from outside llamactor: the builtins
    (ValueError, OSError, UnicodeDecodeError, TimeoutError, ...), msgspec's, anyio's (streams),
    and Starlette's."""
    import builtins

    import anyio
    import starlette.exceptions

    found: set[type[BaseException]] = set()
    for module in (builtins, msgspec, anyio, starlette.exceptions):
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, Exception):
                found.add(value)
    return sorted(found, key=lambda c: (c.__module__, c.__qualname__))


def _instance(cls: type[BaseException]) -> BaseException | None:
    for args in (("boom secret",), (), ("utf-8", b"\xff", 0, 1, "boom secret"), (1, "boom secret")):
        try:
            return cls(*args)
        except Exception:
            continue
    return None


def test_every_foreign_error_is_mapped():
    """Not a hand-picked list: every foreign exception class maps to a llamactor error with an
    HTTP status and an OpenAI-shaped body, and none leaks its message unless it is a 4xx whose
    message is the client's own input problem."""
    classes = _foreign_exception_classes()
    assert len(classes) > 60
    mapped = 0
    for cls in classes:
        exc = _instance(cls)
        if exc is None:
            continue
        err = map_exception(exc)
        body = error_body(exc)
        assert isinstance(err, errors.LlamactorError), cls
        assert 400 <= err.status <= 599 and body.error.code == err.status and body.error.type == err.kind, cls
        if err.status >= 500:
            assert "boom secret" not in body.error.message, cls  # no internals leak
        mapped += 1
    assert mapped > 60
