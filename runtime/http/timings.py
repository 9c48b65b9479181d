"""The ``timings`` of llama-server's bodies and stream chunks, and a progress chunk's
``prompt_progress``: the same numbers for every API (native, OpenAI, Responses, Anthropic).
"""

from __future__ import annotations

from typing import Any

from llamactor.protocol.events import Done, Progress, Token
from llamactor.protocol.wire import Timings
from llamactor.runtime.service.results import Completion


def _timings(
    n_prompt: int,
    n_cached: int,
    n_predicted: int,
    prompt_ms: float,
    predicted_ms: float,
    n_draft: int = 0,
    n_draft_accepted: int = 0,
) -> Timings:
    """llama-server's formulas (server_slot_stats): the first generated token comes from the
    prompt's logits, so generation rates count ``n_predicted - 1`` decode steps. ``draft_n`` and
    ``draft_n_accepted`` only when drafts were verified, as llama-server adds them."""
    n_eval = n_prompt - n_cached
    steps = max(n_predicted - 1, 0)
    return Timings(
        cache_n=n_cached,
        prompt_n=n_eval,
        prompt_ms=prompt_ms,
        prompt_per_token_ms=prompt_ms / n_eval if n_eval > 0 else 0.0,
        prompt_per_second=n_eval / prompt_ms * 1e3 if prompt_ms > 0 else 0.0,
        predicted_n=n_predicted,
        predicted_ms=predicted_ms,
        predicted_per_token_ms=predicted_ms / steps if steps > 0 else 0.0,
        predicted_per_second=steps / predicted_ms * 1e3 if predicted_ms > 0 else 0.0,
        draft_n=n_draft if n_draft > 0 else None,
        draft_n_accepted=n_draft_accepted if n_draft > 0 else None,
    )


def token_timings(ev: Token) -> Timings | None:
    """timings_per_token: the timings so far that a streamed token carries (None: not asked)."""
    return None if ev.clock is None else _timings(*ev.clock)


def progress_timings(ev: Progress) -> Timings | None:
    """timings_per_token: a progress chunk's timings, the prompt's so far (nothing predicted yet)."""
    return _timings(ev.processed, ev.cache, 0, ev.time_ms, 0.0) if ev.timed else None


def done_timings(ev: Done) -> Timings:
    """A finished choice's ``timings``."""
    return _timings(
        ev.n_prompt, ev.n_cached, ev.n_predicted, ev.prompt_ms, ev.predicted_ms, ev.n_draft, ev.n_draft_accepted
    )


def completion_timings(c: Completion) -> Timings:
    """A whole answer's ``timings`` (all its choices)."""
    return _timings(c.n_prompt, c.n_cached, c.n_predicted, c.prompt_ms, c.predicted_ms, c.n_draft, c.n_draft_accepted)


def progress_json(ev: Progress) -> dict[str, Any]:
    return {"total": ev.total, "cache": ev.cache, "processed": ev.processed, "time_ms": round(ev.time_ms)}
