"""What a replay gives: each request as the simulated client saw it, and the run's totals.

The output data of ops/replay/simulate.py, read by the replay reports (``llamactor replay``,
the capacity and random-suite replays).
"""

from __future__ import annotations

from dataclasses import dataclass

from llamactor.ops.bench.slo import Sample


@dataclass(frozen=True)
class Outcome:
    """One request as the simulated client sees it."""

    finished: bool  # it ended in the simulation (False: the policy never ran it to the end)
    ok: bool  # finished, and completed in the recording too (not cancelled, not failed)
    submitted: float
    ended: float | None
    ttft_s: float | None
    gaps_s: tuple[float, ...]
    n_generated: int

    def sample(self) -> Sample:
        return Sample(self.ok, self.ttft_s, self.gaps_s, self.n_generated)


@dataclass(frozen=True)
class SimResult:
    policy: str
    outcomes: tuple[Outcome, ...]  # in trace order (by submission)
    steps: int
    prompt_tokens: int

    @property
    def unfinished(self) -> int:
        return sum(not o.finished for o in self.outcomes)

    @property
    def generated_tokens(self) -> int:
        return sum(o.n_generated for o in self.outcomes)

    @property
    def makespan_s(self) -> float:
        if not self.outcomes:
            return 0.0
        ends = [o.ended for o in self.outcomes if o.ended is not None]
        start = min(o.submitted for o in self.outcomes)
        return max(ends) - start if ends else 0.0

    def samples(self) -> list[Sample]:
        return [o.sample() for o in self.outcomes]


__all__ = ["Outcome", "SimResult"]
