"""Chat and embeddings served at once by one server: the embeddings' cost to the chat streams.

    python -m llamactor.ops.bench.embed_bench --url http://127.0.0.1:8080 [--streams 8] [--ntg 128]
                                        [--embed-clients 2] [--embed-batch 32] [--embed-words 48]
                                        [--seconds 20] [--json]

Three phases against one running server (started with ``--embedding --pooling mean``):

1. embeddings alone: ``--embed-clients`` clients send ``/v1/embeddings`` requests of
   ``--embed-batch`` distinct inputs each, back to back, for ``--seconds``;
2. chat alone: ``--streams`` concurrent streaming ``/completion`` requests of ``--ntg`` tokens;
3. both: the same chat streams while the same embedding load runs the whole time.

Reported per phase: embedding throughput (inputs/s and tokens/s, tokens as the server counts
them in ``usage``) and the chat streams' inter-token gap p50/p99/max and generated tok/s.
Times are taken when each SSE line arrives. Every request must succeed (exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field

import anyio
import httpx
import numpy as np

WORDS = [
    "river",
    "bridge",
    "harvest",
    "library",
    "morning",
    "committee",
    "village",
    "letter",
    "record",
    "price",
    "bread",
    "history",
    "school",
    "photograph",
    "map",
    "cold",
    "old",
    "new",
    "short",
    "long",
    "bright",
    "quiet",
    "garden",
    "window",
]
MS_PER_S = 1000.0
TIMEOUT_S = 600.0


@dataclass
class Phase:
    name: str
    seconds: float = 0.0
    embed_requests: int = 0
    embed_inputs: int = 0
    embed_tokens: int = 0
    chat_tokens: int = 0
    gaps_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, object]:
        gaps = np.asarray(self.gaps_ms) if self.gaps_ms else None
        s = self.seconds or float("nan")
        return {
            "phase": self.name,
            "seconds": round(self.seconds, 2),
            "embed_inputs_per_s": round(self.embed_inputs / s, 1) if self.embed_inputs else None,
            "embed_tokens_per_s": round(self.embed_tokens / s, 1) if self.embed_tokens else None,
            "chat_tok_per_s": round(self.chat_tokens / s, 1) if self.chat_tokens else None,
            "itl_p50_ms": round(float(np.percentile(gaps, 50)), 1) if gaps is not None else None,
            "itl_p99_ms": round(float(np.percentile(gaps, 99)), 1) if gaps is not None else None,
            "itl_max_ms": round(float(gaps.max()), 1) if gaps is not None else None,
            "errors": len(self.errors),
        }


def _texts(n: int, words: int, salt: int) -> list[str]:
    rng = np.random.default_rng(salt)
    return [f"{salt}-{i}: " + " ".join(rng.choice(WORDS, words)) for i in range(n)]


async def _embed_loop(
    client: httpx.AsyncClient, phase: Phase, args: argparse.Namespace, stop: anyio.Event, salt: int
) -> None:
    k = 0
    while not stop.is_set():
        k += 1
        r = await client.post(
            "/v1/embeddings",
            json={"input": _texts(args.embed_batch, args.embed_words, salt * 100003 + k), "encoding_format": "base64"},
        )
        if r.status_code != 200:
            phase.errors.append(f"embeddings {r.status_code}: {r.text[:200]}")
            return
        if stop.is_set():
            return  # finished after the phase ended: not part of the measured window
        body = r.json()
        phase.embed_requests += 1
        phase.embed_inputs += len(body["data"])
        phase.embed_tokens += body["usage"]["prompt_tokens"]


async def _stream(client: httpx.AsyncClient, phase: Phase, args: argparse.Namespace, i: int) -> None:
    body = {
        "prompt": f"Stream {i}: tell me about the {WORDS[i % len(WORDS)]}",
        "n_predict": args.ntg,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    last = None
    async with client.stream("POST", "/completion", json=body) as resp:
        if resp.status_code != 200:
            phase.errors.append(f"completion {resp.status_code}: {(await resp.aread())[:200]!r}")
            return
        async for line in resp.aiter_lines():
            now = time.perf_counter()
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("stop"):
                break
            phase.chat_tokens += 1
            if last is not None:
                phase.gaps_ms.append((now - last) * MS_PER_S)
            last = now


async def _run_phase(url: str, name: str, args: argparse.Namespace, *, chat: bool, embed: bool) -> Phase:
    phase = Phase(name)
    limits = httpx.Limits(max_connections=args.streams + args.embed_clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S, limits=limits) as client:
        stop = anyio.Event()
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            if embed:
                for c in range(args.embed_clients):
                    tg.start_soon(_embed_loop, client, phase, args, stop, c + 1)
            if chat:
                async with anyio.create_task_group() as streams:
                    for i in range(args.streams):
                        streams.start_soon(_stream, client, phase, args, i)
            else:
                await anyio.sleep(args.seconds)
            phase.seconds = time.perf_counter() - t0
            stop.set()
    return phase


async def run(args: argparse.Namespace) -> list[Phase]:
    async with httpx.AsyncClient(base_url=args.url, timeout=60) as client:
        probe = await client.post("/v1/embeddings", json={"input": "probe"})
        if probe.status_code != 200:
            raise SystemExit(
                f"the server does not serve embeddings ({probe.status_code}: {probe.text[:200]}); "
                f"start it with --embedding --pooling mean"
            )
        await client.post("/completion", json={"prompt": "warm up", "n_predict": 4})
    return [
        await _run_phase(args.url, "embeddings", args, chat=False, embed=True),
        await _run_phase(args.url, "chat", args, chat=True, embed=False),
        await _run_phase(args.url, "chat+embeddings", args, chat=True, embed=True),
    ]


def render(rows: list[dict[str, object]]) -> str:
    cols = (
        "phase",
        "seconds",
        "embed_inputs_per_s",
        "embed_tokens_per_s",
        "chat_tok_per_s",
        "itl_p50_ms",
        "itl_p99_ms",
        "itl_max_ms",
        "errors",
    )
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("-" if r[c] is None else str(r[c]) for c in cols) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--streams", type=int, default=8, help="concurrent chat streams")
    p.add_argument("--ntg", type=int, default=128, help="tokens per chat stream")
    p.add_argument("--embed-clients", type=int, default=2, help="concurrent embedding clients")
    p.add_argument("--embed-batch", type=int, default=32, help="inputs per embedding request")
    p.add_argument("--embed-words", type=int, default=48, help="words per embedding input")
    p.add_argument("--seconds", type=float, default=20.0, help="length of the embeddings-alone phase")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    phases = anyio.run(run, args)
    rows = [ph.summary() for ph in phases]
    if args.json:
        print(json.dumps({"settings": vars(args), "phases": rows}, indent=2))
    else:
        print(render(rows))
    errors = [e for ph in phases for e in ph.errors]
    for e in errors[:5]:
        print("error:", e, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
