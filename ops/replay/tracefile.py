"""Reading a ``--record-trace`` file: JSON lines written by ``actors.recorder``.

One header line, then request and step lines in the order they were written (requests when
they ended). ``load_trace`` validates every line against the types below and returns the
requests in submission order and the steps in time order per group. Unknown fields are
ignored, so a newer recorder's trace still loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import msgspec

ENDED_BADLY = ("cancelled", "error")  # a request that did not complete (not ``ok``)


class TraceError(Exception):
    """The file is missing, unreadable or not a llamactor trace (the message says which line)."""


class Header(msgspec.Struct, tag="header", tag_field="type"):
    version: int
    groups: int
    n_slots: int  # per group
    n_batch: int
    policy: str  # as given to --scheduler: a built-in name or module:Class
    model: str = ""
    n_ubatch: int = 0
    n_ctx_slot: int = 0
    kv_unified: bool = False
    threads: int = 0
    policy_name: str = ""
    policy_options: dict[str, float] = msgspec.field(default_factory=dict)


class Request(msgspec.Struct, tag="request", tag_field="type"):
    """One request, written when it ended; times in seconds from the runtime's start."""

    group: int
    submitted: float
    prompt: int  # prompt tokens, cached prefix included
    generated: int  # tokens generated, all choices together
    assigned: float | None = None
    cached: int = 0  # prompt tokens reused from a slot's KV (not decoded again)
    n_predict: int = -1
    n: int = 1
    choices: list[int] | None = None  # tokens per choice when n > 1
    first_token: float | None = None
    finished: float | None = None  # the last token
    finish: str = "stop"  # stop | length | cancelled | error

    @property
    def ok(self) -> bool:
        return self.finish not in ENDED_BADLY

    @property
    def per_choice(self) -> tuple[int, ...]:
        if self.choices is not None and len(self.choices) == self.n:
            return tuple(self.choices)
        share, extra = divmod(self.generated, max(self.n, 1))
        return tuple(share + (1 if i < extra else 0) for i in range(max(self.n, 1)))


class Step(msgspec.Struct, tag="step", tag_field="type"):
    """One decode step of one group."""

    group: int
    start: float
    ms: float  # the decode step itself
    prompt: int  # prompt tokens in the batch
    generated: int  # tokens sampled in the step
    slots: int = 0  # slots in the batch
    kv: int | None = None  # KV cells the step's slots hold after it
    gap_ms: float | None = None  # from the group's previous step's end to this start; None after idle


_Line = Header | Request | Step


@dataclass(frozen=True)
class Trace:
    path: str
    header: Header
    requests: tuple[Request, ...]  # by submission time
    steps: tuple[Step, ...]  # by group, then start time
    notes: tuple[str, ...] = field(default=())

    @property
    def generated_tokens(self) -> int:
        return sum(r.generated for r in self.requests)


def load_trace(path: str | Path) -> Trace:
    """Parse and check a trace file; raise TraceError naming the problem and the line."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise TraceError(f"cannot read {p}: {exc.strerror or exc}") from None
    decoder = msgspec.json.Decoder(_Line)
    lines = raw.split(b"\n")
    notes: list[str] = []
    if lines and not lines[-1].strip():
        lines.pop()
    elif lines and len(lines) > 1:
        # A server killed mid-write leaves a partial last line: keep everything before it.
        try:
            decoder.decode(lines[-1])
        except (msgspec.DecodeError, msgspec.ValidationError):
            lines.pop()
            notes.append("the last line was incomplete and was skipped (the server stopped while writing)")
    if not lines:
        raise TraceError(f"{p} is empty: not a llamactor trace (llamactor serve --record-trace FILE)")
    header: Header | None = None
    requests: list[Request] = []
    steps: list[Step] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = decoder.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            if number == 1:
                raise TraceError(
                    f"{p} is not a llamactor trace (line 1: {exc}); record one with llamactor serve --record-trace FILE"
                ) from None
            raise TraceError(f"{p} line {number}: {exc}") from None
        if number == 1 and not isinstance(item, Header):
            raise TraceError(f"{p} is not a llamactor trace: its first line is not a header")
        if isinstance(item, Header):
            if header is not None:
                raise TraceError(f"{p} line {number}: a second header (two traces in one file?)")
            if item.groups < 1 or item.n_slots < 1 or item.n_batch < 1:
                raise TraceError(f"{p}: the header needs groups, n_slots and n_batch >= 1")
            header = item
        elif isinstance(item, Request):
            _check_request(p, number, item, header)
            requests.append(item)
        else:
            if not 0 <= item.group < header.groups:  # type: ignore[union-attr]
                raise TraceError(f"{p} line {number}: step of group {item.group}, the trace has {header.groups}")  # type: ignore[union-attr]
            steps.append(item)
    assert header is not None
    order = sorted(range(len(requests)), key=lambda i: (requests[i].submitted, i))
    steps.sort(key=lambda s: (s.group, s.start))
    return Trace(str(p), header, tuple(requests[i] for i in order), tuple(steps), tuple(notes))


def _check_request(p: Path, number: int, r: Request, header: Header | None) -> None:
    assert header is not None
    if not 0 <= r.group < header.groups:
        raise TraceError(f"{p} line {number}: request of group {r.group}, the trace has {header.groups}")
    if r.prompt < 1 or not 0 <= r.cached < r.prompt or r.generated < 0 or not 1 <= r.n <= header.n_slots:
        raise TraceError(
            f"{p} line {number}: a request needs prompt >= 1, 0 <= cached < prompt, "
            f"generated >= 0 and 1 <= n <= n_slots"
        )


__all__ = ["ENDED_BADLY", "Header", "Request", "Step", "Trace", "TraceError", "load_trace"]
