"""Engine step trace and its invariant checks for the phase coordinator's phase exclusion.

When tracing is on (``RuntimeConfig.trace_steps``; tests turn it on), each group records one
``StepRecord`` per step: which slots contributed prompt tokens, which generated, which were
released from the barrier, and the cohort of each. ``check_phase_exclusion`` then proves, over
a whole run, that no batch mixed phases and that no member of a cohort generated before every
member of that cohort had finished its prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from llamactor.protocol.lora import LoraSet


class StepRecord(NamedTuple):
    group: int
    step: int
    prefill: tuple[int, ...]  # local slots that decoded prompt tokens
    generate: tuple[int, ...]  # local slots that decoded one generated token
    release: tuple[int, ...]  # READY slots sampled from kept logits
    cohort: dict[int, int]  # local slot -> cohort id (0 when the policy has none)
    lora: dict[int, LoraSet] = {}  # local slot (prefill or generate) -> its request's LoRA set


class TraceViolation(AssertionError):
    pass


def check_phase_exclusion(trace: Sequence[StepRecord]) -> None:
    """Raise TraceViolation unless every step is all-prompt or all-generation and every
    cohort generates only after all its members finished prefill."""
    last_prefill: dict[tuple[int, int], int] = {}  # (group, cohort) -> index of its last prefill step
    first_output: dict[tuple[int, int], int] = {}  # (group, cohort) -> first generate/release step
    for i, rec in enumerate(trace):
        if rec.prefill and (rec.generate or rec.release):
            raise TraceViolation(
                f"group {rec.group} step {rec.step} mixes prompt {rec.prefill} "
                f"and generated tokens {rec.generate or rec.release}"
            )
        for s in rec.prefill:
            last_prefill[(rec.group, rec.cohort.get(s, 0))] = i
        for s in (*rec.generate, *rec.release):
            first_output.setdefault((rec.group, rec.cohort.get(s, 0)), i)
    for key, first in first_output.items():
        if key[1] and last_prefill.get(key, -1) > first:
            raise TraceViolation(
                f"cohort {key[1]} of group {key[0]} generated at step {first} "
                f"before its prefill ended at step {last_prefill[key]}"
            )


def check_lora_exclusion(trace: Sequence[StepRecord]) -> None:
    """Raise TraceViolation if a step decoded requests of different LoRA sets together."""
    for rec in trace:
        sets = set(rec.lora.values())
        if len(sets) > 1:
            raise TraceViolation(f"group {rec.group} step {rec.step} mixes LoRA sets {sorted(sets)}")
