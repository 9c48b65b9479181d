"""Delivery: one step's events go straight from the group to each request's result stream, never through the supervisor.

Called by the group on the event loop once per decode step (anyio streams are not thread-safe,
so the step in the worker thread only collects events). Sending never waits: a full or closed
stream means the client left (its request is cancelled); any other failure while sending is that request's alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import anyio

from llamactor.protocol.errors import RequestError
from llamactor.protocol.events import Event, Failed
from llamactor.protocol.messages import EventSink, Task
from llamactor.runtime.engine.context import StepResult
from llamactor.runtime.engine.hooks import GroupHooks

Send = Callable[[Task, Event], None]


@dataclass
class Delivered:
    """What sending a step's events found out, by task id."""

    failed: dict[int, Exception] = field(default_factory=dict)  # end with an error event
    gone: set[int] = field(default_factory=set)  # the client closed its stream: end silently


def send_step(res: StepResult, send: Send) -> Delivered:
    """Send every event of the step except those of requests that failed in it."""
    out = Delivered({s.task.id: exc for s, exc in res.failed if s.task is not None})
    for task, event in res.events:
        if task.id in out.failed:
            continue
        try:
            send(task, event)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock):
            out.gone.add(task.id)
        except Exception as exc:
            out.failed.setdefault(task.id, exc)
    return out


def send_event(task: Task, event: Event) -> None:
    task.sink.send_nowait(event)


def hooked_send(hooks: GroupHooks, group: int) -> Send:
    """``send_event`` with the test seam in front (bound once; unhooked groups pay nothing)."""

    def send(task: Task, event: Event) -> None:
        hooks.before_send(group, task)
        task.sink.send_nowait(event)

    return send


def failure(exc: Exception, context: str) -> Failed:
    """The error event for a request-scoped failure: 400 for bad input, 500 otherwise."""
    if isinstance(exc, RequestError):
        return Failed.of(exc)
    return Failed(f"{context}: {exc}", "EngineError")


def send_final(sink: EventSink, event: Failed) -> None:
    """The last event of a request (if its stream still has room), then close the stream."""
    try:
        sink.send_nowait(event)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock):
        pass
    sink.close()
