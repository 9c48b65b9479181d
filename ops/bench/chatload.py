"""The multi-turn chat workload (``llamactor bench --workload chat``).

``conversations`` conversations of ``turns`` turns each. At most ``users`` turns are in flight
at a time, taken round-robin across conversations (turn 1 of every conversation, then turn 2
of every conversation, ...), so with more conversations than the server has slots, a
conversation's slot has usually served others before its next turn comes.

Each turn's prompt is the conversation's history as exact token ids: the system text
(``prefix_npp`` tokens, the same for every conversation of a run), then for every earlier turn
its user text and the server's own reply (the ids streamed back), then a new user text of
``npp`` tokens; the reply is ``ntg`` tokens. The turns are one conversation book
(``ops.bench.conversations``), which builds a turn from the previous one and its reply; a
failed turn skips the rest of its conversation (counted in ``skipped``). Requests ask for
``cache_prompt``, so a server may reuse whatever it still holds of the history;
``prompt_processed`` (the delta of the server's ``llamacpp:prompt_tokens_total``) against
``prompt_sent`` shows how much it did.

llama-server leaves out of its stream the id of a token whose text ends inside a UTF-8
sequence; such a reply is counted in ``short_replies``, and the next turn's history lacks the
missing ids (its prompt then diverges from what the server holds from that point on).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import cast

from llamactor.ops.bench.conversations import AfterFailure, Conversations, Turn, TurnFeed, conversation_notes
from llamactor.ops.bench.latency import latency_of, ratio_keys
from llamactor.ops.bench.loadgen import error_sample
from llamactor.ops.bench.phase import WARMUP_NTG, Job, PhaseResult, Request
from llamactor.ops.bench.prompts import PromptSource
from llamactor.ops.bench.runner import Common
from llamactor.ops.bench.slo import LatencyReport
from llamactor.ops.bench.stats import CrossCheck, RequestRecord, ratio


class ChatFeed(TurnFeed):
    """The turns of one run as one conversation book, handed out round-robin to the workers
    (one ``phase.Feed`` shared by them all).

    Turn ``t`` of conversation ``c`` is the book's request ``t * conversations + c`` and follows
    turn ``t - 1`` of ``c``, so the book's order is the round-robin order. A failed turn skips
    the rest of its conversation: a history lacking one of its answers is not the conversation
    the server holds. Requests are tagged ``(conversation, turn)``, both from 0. Built once per
    run by ``Chat.plan``; read by ``Chat.summarize`` after the phase.
    """

    def __init__(self, system: list[int], user_texts: list[list[list[int]]], ntg: int) -> None:
        self.conversations = n = len(user_texts)
        n_turns = len(user_texts[0]) if user_texts else 0
        head = tuple(system)
        turns = [
            Turn(tuple(user_texts[c][t]), ntg, follows=(t - 1) * n + c if t else None, system=None if t else head)
            for t in range(n_turns)
            for c in range(n)
        ]
        # every reply's ids kept, the last turns' too: the records hold them and short_replies counts them
        super().__init__(Conversations(turns, AfterFailure.SKIP, keep_all=True), range(len(turns)))

    async def take(self) -> Request | None:
        request = await super().take()
        if request is None:
            return None
        t, c = divmod(cast(int, request.tag), self.conversations)
        return replace(request, tag=(c, t))

    def done(self, request: Request, record: RequestRecord) -> None:
        c, t = request.tag
        self.book.done(t * self.conversations + c, record)

    @property
    def records(self) -> dict[tuple[int, int], RequestRecord]:
        """Every turn sent, by (conversation, turn)."""
        n = self.conversations
        return {(i % n, i // n): r for i, r in self.book.records.items()}

    @property
    def skipped(self) -> int:
        return self.book.skipped

    @property
    def short_replies(self) -> int:
        return self.book.short_replies


@dataclass(frozen=True)
class Chat:
    name = "chat"

    conversations: int = 24
    turns: int = 4
    users: int = 8  # turns in flight at most
    prefix_npp: int = 200  # system text, shared by every conversation
    npp: int = 64  # new user text per turn
    ntg: int = 64  # reply per turn
    common: Common = Common()

    def __post_init__(self) -> None:
        if self.common.api != "native":
            raise ValueError(
                "--workload chat needs --api native: the replies' token ids come from /completion's stream"
            )

    @property
    def n_requests(self) -> int:
        return self.conversations * self.turns

    def plan(self, prompts: PromptSource) -> tuple[list[Job], list[Job]]:
        warm = (
            [
                Job(
                    "warmup",
                    tuple(
                        Request(prompts.take(self.prefix_npp + self.npp), WARMUP_NTG) for _ in range(self.common.warmup)
                    ),
                )
                for _ in range(self.users)
            ]
            if self.common.warmup > 0
            else []
        )
        system = prompts.take(self.prefix_npp)
        texts = [[prompts.take(self.npp) for _ in range(self.turns)] for _ in range(self.conversations)]
        feed = ChatFeed(system, texts, self.ntg)
        return warm, [Job("turn", (), feed=feed) for _ in range(min(self.users, self.conversations))]

    def summarize(self, phase: PhaseResult, warmup_failed: int) -> ChatResult:
        feed = cast(ChatFeed, phase.jobs[0].feed)
        turns = sorted(feed.records.items(), key=lambda kv: (kv[0][1], kv[0][0]))  # round-robin order
        records = [r for _, r in turns]
        first = [r for (_, t), r in turns if t == 0]
        later = [r for (_, t), r in turns if t > 0]
        ok = [r for r in records if r.ok]
        generated = sum(r.n_generated for r in ok)
        sent = sum(r.n_prompt_sent for r in records)
        return ChatResult(
            conversations=self.conversations,
            turns=self.turns,
            users=self.users,
            prefix_npp=self.prefix_npp,
            npp=self.npp,
            ntg=self.ntg,
            api=self.common.api,
            ok=len(ok),
            failed=len(records) - len(ok),
            skipped=feed.skipped,
            warmup_failed=warmup_failed,
            errors=error_sample(records),
            makespan_s=phase.wall_s,
            generated_tokens=generated,
            tok_s=ratio(float(generated), phase.wall_s),
            first_turns=latency_of(first, phase.wall_s, self.common),
            later_turns=latency_of(later, phase.wall_s, self.common),
            prompt_tokens_sent=sent,
            prompt_tokens_server=phase.server_prompt_tokens,
            short_replies=feed.short_replies,
            cross_check=phase.cross_check,
            client_cpu_s=phase.client_cpu_s,
            slo=latency_of(records, phase.wall_s, self.common),
            records=records,
        )


@dataclass(frozen=True)
class ChatResult:
    conversations: int
    turns: int
    users: int
    prefix_npp: int
    npp: int
    ntg: int
    api: str
    ok: int
    failed: int
    skipped: int  # turns not sent because an earlier turn of their conversation failed
    warmup_failed: int
    errors: list[str]
    makespan_s: float
    generated_tokens: int
    tok_s: float | None
    first_turns: LatencyReport  # TTFT etc. of every conversation's first turn
    later_turns: LatencyReport  # ... of the turns after it
    prompt_tokens_sent: int  # over every turn sent
    prompt_tokens_server: int | None  # delta of llamacpp:prompt_tokens_total; None: not exposed
    short_replies: int
    cross_check: CrossCheck
    client_cpu_s: float
    slo: LatencyReport  # over every turn
    records: list[RequestRecord] = field(repr=False, compare=False, metadata={"report": False})

    workload = "chat"
    headline = ratio_keys("later_ttft_p50_ms", "first_ttft_p50_ms", "prompt_processed", "tok_s")

    def notes(self) -> list[str]:
        out = conversation_notes(skipped=self.skipped, short_replies=self.short_replies)
        if self.conversations <= self.users:
            out.append(
                "no more conversations than --users: each turn waits for its own conversation's previous "
                "turn; use more --conversations than the server has slots"
            )
        return out

    def figures(self) -> dict[str, float | int | None]:
        f, later = self.first_turns, self.later_turns
        return {
            "first_ttft_mean_ms": f.ttft_mean_ms,
            "first_ttft_p50_ms": f.ttft_p50_ms,
            "first_ttft_p99_ms": f.ttft_p99_ms,
            "later_ttft_mean_ms": later.ttft_mean_ms,
            "later_ttft_p50_ms": later.ttft_p50_ms,
            "later_ttft_p99_ms": later.ttft_p99_ms,
            "prompt_sent": self.prompt_tokens_sent,
            "prompt_processed": self.prompt_tokens_server,
            "processed_share": ratio(self.prompt_tokens_server, self.prompt_tokens_sent),
            "tok_s": self.tok_s,
            "ok": self.ok,
            "failed": self.failed,
            "server_tokens": self.cross_check.server_tokens,
            "diff_percent": self.cross_check.diff_percent,
            **self.slo.figures(),
        }


__all__ = ["Chat", "ChatFeed", "ChatResult"]
