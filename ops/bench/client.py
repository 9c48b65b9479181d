"""Network side of the harness: one streaming completion, the metrics scrape, the prompt-id probe.

This module and ``http1`` are the only ones that do network I/O. Timestamps are taken with
``time.perf_counter()`` the moment a network chunk arrives, before it is parsed (see
``http1``), so the client's own parsing never delays a measured token; every SSE event in one
chunk shares that chunk's receive time, which is exactly what a client of the server observes.
Measured requests go through ``http1``; the probes through httpx.
"""

from __future__ import annotations

import time
from types import TracebackType

import httpx
import msgspec

from llamactor.ops.bench.apis import APIS, Api, SseDecoder, Vocabulary
from llamactor.ops.bench.http1 import Http1Pool, ProtocolError
from llamactor.ops.bench.stats import RequestRecord

TOKENS_PREDICTED_METRIC = "llamacpp:tokens_predicted_total"
PROMPT_TOKENS_METRIC = "llamacpp:prompt_tokens_total"  # prompt tokens evaluated, cached ones not counted
IN_FLIGHT_METRICS = ("llamacpp:requests_processing", "llamacpp:requests_deferred")  # running, queued
HTTP_OK = 200
CONNECT_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 10.0
ERROR_BODY_CHARS = 200

# Prompts are drawn from the ids this passage tokenizes to: ordinary text tokens of whatever
# model the server runs, never control tokens. Used only when /tokenize answers.
PROMPT_ID_PASSAGE = (
    "The committee met on a cold morning in the old library to discuss the harvest, the river, "
    "the new bridge and the price of bread. Several members argued that the records from 1987 "
    "were incomplete; others wanted to publish everything at once, with maps, letters, photographs "
    "and a short history of the village written by the children of the school."
)
FALLBACK_PROMPT_IDS = range(1, 200)  # ids below 200 exist in every vocabulary
MIN_PROMPT_IDS = 16  # fewer distinct ids than this and the passage probe is not trusted

_encode = msgspec.json.Encoder().encode


def parse_metric(text: str, name: str) -> float | None:
    """The sum over all series of ``name`` in Prometheus text, or ``None`` if absent.

    llamactor labels each series by ``group``; llama-server has one unlabelled series.
    """
    total, seen = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        rest = line[len(name) :]
        if rest[:1] not in ("{", " ", "\t"):
            continue  # a longer name sharing the prefix
        value = rest.rsplit("}", 1)[-1].split()
        if value:
            total += float(value[0])
            seen = True
    return total if seen else None


class BenchClient:
    """The client of one server URL; one per run, used by every simulated user.

    Its pool keeps one keep-alive connection per concurrent user, so connection set-up is paid
    during the warm-up, not in the measured phase. Needs the asyncio event loop.
    """

    def __init__(self, url: str, api: str | Api, *, timeout_s: float, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.api = APIS[api] if isinstance(api, str) else api
        self.timeout_s = timeout_s
        # llama-server's --api-key: every request and probe (/tokenize, /metrics) carries it
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._pool = Http1Pool(self.url, headers)
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(PROBE_TIMEOUT_S, connect=CONNECT_TIMEOUT_S), headers=headers
        )

    async def __aenter__(self) -> BenchClient:
        await self._http.__aenter__()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._pool.close()
        await self._http.__aexit__(et, e, tb)

    async def complete(
        self,
        prompt: list[int],
        n_predict: int,
        temperature: float,
        *,
        cache_prompt: bool = False,
        keep_ids: bool = False,
    ) -> RequestRecord:
        """Send one streaming completion and record it; never raises for a failed request.

        Called once per request by a simulated user; concurrent calls share the pool.
        ``cache_prompt`` lets the server reuse a cached prefix; ``keep_ids`` keeps the answer
        for a later turn: its token ids in ``token_ids`` (native API), its text in
        ``TextRecord.text`` (the text dialects).
        """
        body = _encode(self.api.body(prompt, n_predict, temperature, cache_prompt, keep_ids))
        rec = self.api.new_record(len(prompt), keep_ids)
        decoder = SseDecoder()
        error_body = bytearray()
        api = self.api

        def on_sent() -> None:
            rec.sent_s = time.perf_counter()

        def sink(status: int, piece: bytes, now: float) -> None:
            if status != HTTP_OK:
                error_body.extend(piece[: ERROR_BODY_CHARS - len(error_body)])
                return
            for field, value in decoder.feed(piece):
                api.apply(rec, field, value, now)

        try:
            status = await self._pool.post(api.path, body, sink, on_sent, self.timeout_s)
            if status != HTTP_OK:
                rec.error = f"HTTP {status}: {error_body.decode('utf-8', 'replace')}"
            else:
                api.finish(rec)
        except (OSError, ProtocolError, TimeoutError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        finally:
            rec.ended_s = time.perf_counter()
        return rec

    async def tokens_predicted_total(self) -> float | None:
        """The server's ``llamacpp:tokens_predicted_total`` (summed over series), or ``None``
        when /metrics is off (llama-server without ``--metrics``) or unreachable."""
        return (await self.counters())[0]

    async def counters(self) -> tuple[float | None, float | None]:
        """``llamacpp:tokens_predicted_total`` and ``llamacpp:prompt_tokens_total`` from one
        scrape of /metrics (each ``None`` when absent or /metrics is unavailable)."""
        try:
            resp = await self._http.get(self.url + "/metrics", timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError:
            return None, None
        if resp.status_code != httpx.codes.OK:
            return None, None
        return parse_metric(resp.text, TOKENS_PREDICTED_METRIC), parse_metric(resp.text, PROMPT_TOKENS_METRIC)

    async def in_flight(self) -> int | None:
        """Requests the server is running or holding in its queue (``requests_processing`` +
        ``requests_deferred`` of /metrics), or ``None`` when /metrics is unavailable: after a
        phase cut short, the caller waits for 0 so the next phase finds the server idle."""
        try:
            resp = await self._http.get(self.url + "/metrics", timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError:
            return None
        if resp.status_code != httpx.codes.OK:
            return None
        counts = [parse_metric(resp.text, name) for name in IN_FLIGHT_METRICS]
        return None if counts[0] is None else int(sum(c or 0.0 for c in counts))

    async def prompt_ids(self) -> list[int]:
        """Distinct ids to draw prompts from: the passage's tokens, else ids below 200."""
        try:
            resp = await self._http.post(
                self.url + "/tokenize",
                json={"content": PROMPT_ID_PASSAGE, "add_special": False},
                timeout=PROBE_TIMEOUT_S,
            )
            tokens = resp.json().get("tokens") if resp.status_code == httpx.codes.OK else None
        except (httpx.HTTPError, ValueError):
            tokens = None
        ids = sorted({t for t in tokens or () if isinstance(t, int)})
        return ids if len(ids) >= MIN_PROMPT_IDS else list(FALLBACK_PROMPT_IDS)

    async def vocabulary(self) -> Vocabulary | None:
        """The passage's tokens with their text pieces (``/tokenize`` with ``with_pieces``), or
        ``None`` when the server gives fewer than ``MIN_PROMPT_IDS`` usable ones. A piece that
        is not whole UTF-8 text (llama-server sends such a piece as a list of bytes) or is blank
        is left out, so every prompt drawn from the ids renders to clean text."""
        try:
            resp = await self._http.post(
                self.url + "/tokenize",
                json={"content": PROMPT_ID_PASSAGE, "add_special": False, "with_pieces": True},
                timeout=PROBE_TIMEOUT_S,
            )
            tokens = resp.json().get("tokens") if resp.status_code == httpx.codes.OK else None
        except (httpx.HTTPError, ValueError):
            tokens = None
        pieces: dict[int, str] = {}
        for tok in tokens or ():
            if not isinstance(tok, dict):
                continue
            tid, piece = tok.get("id"), tok.get("piece")
            if isinstance(tid, int) and isinstance(piece, str) and piece.strip() and "\ufffd" not in piece:
                pieces[tid] = piece
        return Vocabulary(pieces) if len(pieces) >= MIN_PROMPT_IDS else None


__all__ = [
    "FALLBACK_PROMPT_IDS",
    "PROMPT_ID_PASSAGE",
    "PROMPT_TOKENS_METRIC",
    "TOKENS_PREDICTED_METRIC",
    "BenchClient",
    "parse_metric",
]
