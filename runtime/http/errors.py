"""Every HTTP error shape is made here, in the OpenAI shape: ``{"error": {"message", "type", "code"}}``,
and on the Anthropic endpoints in Anthropic's: ``{"type": "error", "error": {"type", "message"}}``.

``error_response`` maps any exception to a response in one place: llamactor's own errors
carry their status; foreign ones (msgspec validation, a body that is not UTF-8) are mapped
explicitly; anything else is a 500 that never leaks a traceback. ``anthropic_error_response``
is the same response with Anthropic's body (the same status; Anthropic's error type for it),
so that Anthropic's SDKs raise their own error classes with the message.
"""

from __future__ import annotations

from typing import Any

import msgspec
import structlog
from starlette.responses import Response

from llamactor.protocol.errors import ExceedContextSize, LlamactorError, Overloaded, RequestError, Unavailable
from llamactor.protocol.wire import ErrorBody, ErrorResponse

log = structlog.get_logger("llamactor.http")

_encode = msgspec.json.Encoder().encode


class BodyTooLarge(RequestError):
    status = 413
    kind = "invalid_request_error"


def map_exception(exc: BaseException) -> LlamactorError:
    """The one place foreign errors become llamactor errors."""
    if isinstance(exc, LlamactorError):
        return exc
    if isinstance(exc, msgspec.ValidationError):
        return RequestError(f"invalid request: {exc}")
    if isinstance(exc, msgspec.DecodeError):
        return RequestError(f"malformed JSON: {exc}")
    if isinstance(exc, UnicodeDecodeError):
        return RequestError("the request body is not valid UTF-8")
    if isinstance(exc, TimeoutError):
        return Unavailable("timed out waiting for the engine; try again")
    log.exception("unhandled_error", exc_info=exc)
    return LlamactorError("internal server error")


def error_body(exc: BaseException) -> ErrorResponse:
    err = map_exception(exc)
    body = ErrorBody(message=str(err) or err.kind, type=err.kind, code=err.status)
    if isinstance(err, ExceedContextSize):  # llama-server adds both sizes
        body.n_prompt_tokens, body.n_ctx = err.n_prompt_tokens, err.n_ctx
    return ErrorResponse(body)


def error_response(exc: BaseException) -> Response:
    err = map_exception(exc)
    return _response(error_body(err), err.status)


# Anthropic's error type of each status (its API's "Errors" page); another 4xx is an
# invalid_request_error, another 5xx an api_error. Anthropic answers overloaded_error with its
# own 529: here the status stays llamactor's 503, with that type.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    return ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error_body(exc: BaseException) -> dict[str, Any]:
    err = map_exception(exc)
    return {"type": "error", "error": {"type": anthropic_error_type(err.status), "message": str(err) or err.kind}}


def anthropic_error_response(exc: BaseException) -> Response:
    err = map_exception(exc)
    return _response(anthropic_error_body(err), err.status)


def _response(body: Any, status: int) -> Response:
    headers = {"Retry-After": str(Overloaded.retry_after_s)} if status == 503 else None
    return Response(_encode(body), status_code=status, media_type="application/json", headers=headers)
