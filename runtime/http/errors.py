"""Every HTTP error shape is made here, in the OpenAI shape: ``{"error": {"message", "type", "code"}}``.

``error_response`` maps any exception to a response in one place: llamactor's own errors
carry their status; foreign ones (msgspec validation, a body that is not UTF-8) are mapped
explicitly; anything else is a 500 that never leaks a traceback.
"""

from __future__ import annotations

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
    headers = {"Retry-After": str(Overloaded.retry_after_s)} if err.status == 503 else None
    return Response(_encode(error_body(err)), status_code=err.status, media_type="application/json", headers=headers)
