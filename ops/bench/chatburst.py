"""A burst of long distinct chat prompts, servers side by side: the first-token figures a
scheduler's prompt order decides.

``python -m llamactor.ops.bench.chatburst --url A --vs B``: ``--users`` closed-loop users (32) each
send ``--requests`` (2) chat turns through ``/v1/chat/completions``, streamed; every turn is a
distinct user message of about ``--words`` words (about 1,000 tokens) and asks for
``--max-tokens`` (32) tokens, ignoring end of stream. All users start at once and each sends its
next turn when its previous one ends. Printed per run: TTFT mean and p50 as the client saw them
(the first streamed content), makespan; then B/A per pair and the median over ``--pairs``
(A and B interleaved, A first). Pair k sends the prompts of seed ``--seed`` + k: no pair meets
prompts a server cached in an earlier one.

Kept apart from the benchmark's own burst on purpose: a second client, written from the
workload's description, so that a scheduler cannot be tuned to one generator's quirks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time

import httpx

_WORD_TEXT = (
    "river bridge harvest market winter letter garden window station engine village "
    "teacher record council summer morning history picture circle number country "
    "doctor kitchen mountain weather library journey silver orange cotton measure "
    "question answer minute season corner pocket ladder hammer candle mirror"
)
WORDS = _WORD_TEXT.split()
RETRIES = 1  # a request the server closed without a response is sent once more


def prompt(user: int, turn: int, words: int, seed: int) -> str:
    rng = random.Random(f"{seed}:{user}:{turn}")  # distinct per request, the same for every server
    return f"Note {user}-{turn}: " + " ".join(rng.choice(WORDS) for _ in range(words))


async def one(client: httpx.AsyncClient, url: str, text: str, max_tokens: int) -> tuple[float, float]:
    """Send one streamed chat turn; its TTFT and end (seconds since the epoch of the run)."""
    body = {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "cache_prompt": False,
    }
    for attempt in range(RETRIES + 1):
        sent = time.perf_counter()
        first = None
        answered = False
        try:
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                answered = True
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                async for line in r.aiter_lines():
                    if first is None and line.startswith("data: ") and line != "data: [DONE]":
                        delta = json.loads(line[6:])["choices"][0].get("delta", {})
                        if delta.get("content"):
                            first = time.perf_counter()
        except httpx.RemoteProtocolError:
            # a kept-alive connection the server closed between runs, before any answer: sent
            # again on a new one (a stream cut after its answer began is an error)
            if answered or attempt == RETRIES:
                raise
            continue
        break
    if first is None:
        raise RuntimeError("no content streamed")
    return first - sent, time.perf_counter()


async def run(url: str, a: argparse.Namespace, seed: int) -> dict[str, float]:
    limits = httpx.Limits(max_connections=a.users, max_keepalive_connections=a.users)
    async with httpx.AsyncClient(timeout=httpx.Timeout(a.timeout), limits=limits) as client:
        start = time.perf_counter()

        async def user(u: int) -> list[float]:
            return [(await one(client, url, prompt(u, t, a.words, seed), a.max_tokens))[0] for t in range(a.requests)]

        ttfts = [t for per_user in await asyncio.gather(*(user(u) for u in range(a.users))) for t in per_user]
        makespan = time.perf_counter() - start
    return {"ttft_mean_s": statistics.fmean(ttfts), "ttft_p50_s": statistics.median(ttfts), "makespan_s": makespan}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llamactor.ops.bench.chatburst", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="server A")
    p.add_argument("--vs", help="server B, run after A in each pair")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--users", type=int, default=32)
    p.add_argument("--requests", type=int, default=2, help="turns per user")
    p.add_argument("--words", type=int, default=970, help="words per user message (970: ~1,000 tokens)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0)
    a = p.parse_args(argv)
    urls = [a.url] + ([a.vs] if a.vs else [])
    ratios: dict[str, list[float]] = {}
    for pair in range(a.pairs):
        figures = []
        for url in urls:
            f = asyncio.run(run(url, a, a.seed + pair))
            figures.append(f)
            print(f"pair {pair} {url}: " + " ".join(f"{k} {v:.2f}" for k, v in f.items()), flush=True)
        if a.vs:
            for k in figures[0]:
                ratios.setdefault(k, []).append(figures[1][k] / figures[0][k])
    if ratios:
        print("B/A median over pairs: " + " ".join(f"{k} {statistics.median(v):.2f}" for k, v in ratios.items()))
        print("B/A per pair: " + json.dumps({k: [round(x, 2) for x in v] for k, v in ratios.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
