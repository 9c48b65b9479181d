"""The one exception hierarchy of llamactor.

    LlamactorError
    ├── ConfigError        invalid configuration or CLI arguments (raised at startup)
    ├── RequestError       bad input from a client: HTTP 400
    │   ├── ExceedContextSize  the prompt does not fit the slot context: HTTP 400
    │   ├── NotFound       unknown slot, file or route: HTTP 404
    │   └── SlotBusy       the slot is serving a request: HTTP 409
    ├── Unauthorized       missing or wrong API key: HTTP 401
    ├── NotSupported       a feature this server was not started with (embeddings, rerank): HTTP 501
    ├── Overloaded         a bounded queue or mailbox is full: HTTP 503 with Retry-After
    ├── Unavailable        loading, or a group is down past its restart limit: HTTP 503
    ├── EngineError        llama.cpp failed while serving a request: HTTP 500
    ├── ModelLoadFailed    the model a request names could not be loaded (router mode): HTTP 500
    └── Closed             the runtime is shutting down or closed: HTTP 503

Foreign errors (msgspec validation, anyio stream errors, OS errors) are mapped to these at
the boundary in one place: ``runtime.http.errors``. An error that crosses a request's stream or
the link to an engine process travels as its class name and message (``events.Failed``) and is
made again by ``error_from``, the one decoder.
"""

from __future__ import annotations


class LlamactorError(Exception):
    """Root of every error llamactor raises on purpose."""

    status = 500
    kind = "server_error"


class ConfigError(LlamactorError):
    status = 500
    kind = "config_error"


class RequestError(LlamactorError):
    status = 400
    kind = "invalid_request_error"


class ExceedContextSize(RequestError):
    """llama-server's ``exceed_context_size_error``; the body also carries both sizes."""

    kind = "exceed_context_size_error"

    def __init__(self, message: str, *, n_prompt_tokens: int = 0, n_ctx: int = 0) -> None:
        super().__init__(message)
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx


class NotFound(RequestError):
    status = 404
    kind = "not_found_error"


class SlotBusy(RequestError):
    status = 409
    kind = "invalid_request_error"


class Unauthorized(LlamactorError):
    status = 401
    kind = "authentication_error"


class NotSupported(LlamactorError):
    """llama-server's ``not_supported_error``: the endpoint exists, this server does not offer it."""

    status = 501
    kind = "not_supported_error"


class Overloaded(LlamactorError):
    status = 503
    kind = "unavailable_error"
    retry_after_s = 1


class Unavailable(LlamactorError):
    status = 503
    kind = "unavailable_error"


class EngineError(LlamactorError):
    status = 500
    kind = "server_error"


class ModelLoadFailed(LlamactorError):
    """The router mode: the model a request named failed to load; the message is the loader's."""

    status = 500
    kind = "server_error"


class Closed(LlamactorError):
    status = 503
    kind = "unavailable_error"


def _subclasses(cls: type[LlamactorError]) -> list[type[LlamactorError]]:
    return [cls, *(sub for child in cls.__subclasses__() for sub in _subclasses(child))]


ERRORS: dict[str, type[LlamactorError]] = {cls.__name__: cls for cls in _subclasses(LlamactorError)}


def error_from(name: str, message: str) -> LlamactorError:
    """The error named ``name`` (a class of this module) with ``message``; an unknown name is an
    ``EngineError``. The one decoder of errors that crossed a stream or a process boundary."""
    return ERRORS.get(name, EngineError)(message)
