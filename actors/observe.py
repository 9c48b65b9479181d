"""What the actors record, and the recorder they record into (implemented by the service
layer's ``Metrics``). Actors depend on these protocols, never on the metrics module above them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from llamactor.runtime.engine.context import StepResult


@dataclass
class GroupCounters:
    """Per-group counters, bumped by the group that decoded (so a sum over groups counts nothing twice)."""

    prompt_tokens: int = 0  # decoded: cached ones are not
    prompt_cached: int = 0  # reused from the KV, the prompt cache or another slot
    tokens_predicted: int = 0
    prompt_seconds: float = 0.0
    predicted_seconds: float = 0.0
    n_decode: int = 0
    n_busy_slots: int = 0  # summed over decodes: busy slots per decode = this / n_decode
    requests_processing: int = 0
    tokens_max: int = 0
    requests_failed: int = 0  # failed alone (bad settings, a sampling error): the group went on
    # speculative decoding, llama-server's spec_decode_* counters
    n_draft_tokens: int = 0  # draft tokens sent to verification
    n_draft_accepted: int = 0  # of those, accepted
    n_drafts: int = 0  # verification steps (drafts verified)
    drafts_by_accepted: list[int] = field(default_factory=list)  # [a]: drafts that had a tokens accepted
    prefix_shares: int = 0  # prompts that copied a prefix from another slot's KV
    prefix_tokens_shared: int = 0  # prompt tokens copied that way instead of prefilled

    def accepted_per_pos(self) -> list[int]:
        """Accepted tokens per draft position (llama-server's ``n_accepted_per_pos``): a draft
        with ``a`` tokens accepted counts once at each of the positions 0 … a-1."""
        out = [0] * max(len(self.drafts_by_accepted) - 1, 0)
        running = 0
        for a in range(len(self.drafts_by_accepted) - 1, 0, -1):
            running += self.drafts_by_accepted[a]
            out[a - 1] = running
        return out


class GroupMetrics(Protocol):
    @property
    def groups(self) -> Sequence[GroupCounters]: ...

    def step(self, group: int, res: StepResult) -> None: ...

    def request_done(self, group: int, prompt_s: float, predicted_s: float, n_tokens: int) -> None: ...

    def ttft(self, group: int, seconds: float) -> None: ...

    def queue_time(self, group: int, seconds: float) -> None: ...


class CoordinatorMetrics(Protocol):
    def cohort_released(self, group: int, size: int, barrier_wait_s: float) -> None: ...
