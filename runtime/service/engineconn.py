"""One engine process's socket, as the API process sees it: a writer queue that never waits,
the calls waiting for their answers, and the frames read from it (``protocol.enginelink``).

A connection lives as long as one engine process: when it dies its queue dies with it, and
``ProcessEngine`` resubmits from the journal what the next one needs.
"""

from __future__ import annotations

import anyio
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from llamactor.protocol import enginelink as link


class EngineConnection:
    """One engine process's socket: its writer queue and its calls waiting for answers."""

    def __init__(self, stream: SocketStream) -> None:
        self.stream = stream
        self.outbox: list[bytes] = []
        self.wake = anyio.Event()
        self.waiting: dict[int, tuple[anyio.Event, list[link.Answer]]] = {}

    def send(self, msg: link.ToEngine) -> None:
        self.outbox.append(link.frame(msg))
        self.wake.set()

    async def write(self) -> None:
        """Send what is queued, all of it in one write, until the socket breaks."""
        while True:
            await self.wake.wait()
            self.wake = anyio.Event()
            data, self.outbox = b"".join(self.outbox), []
            try:
                await self.stream.send(data)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                return  # the reader sees the end

    def answered(self, answer: link.Answer) -> None:
        waiter = self.waiting.pop(answer.call_id, None)
        if waiter is not None:
            waiter[1].append(answer)
            waiter[0].set()

    def fail_calls(self) -> None:
        waiting, self.waiting = self.waiting, {}
        for done, _ in waiting.values():
            done.set()


async def receive_frame(reader: BufferedByteReceiveStream) -> bytes:
    header = await reader.receive_exactly(link.HEADER.size)
    return await reader.receive_exactly(link.HEADER.unpack(header)[0])
