"""The step cost of the replay's fake engine, fitted from a trace's recorded steps.

Two least-squares fits over the recorded steps, each ``ms = a + b * prompt_tokens +
c * generated_tokens``, plus ``d * kv_cells`` (the KV cells the step's slots hold) when that
term costs something (d > 0) and cuts the squared error by at least ``KV_MIN_GAIN``:

- **decode**: the decode step itself (what the group's ``StepCosts`` learns, and so what a
  policy sees in ``GroupView.ms_per_step`` / ``ms_per_prompt_token``);
- **loop**: the group's own time after a step before the next one starts (delivering the
  step's tokens, draining the mailbox, planning: the next step's recorded ``gap_ms``). Steps
  followed by an idle wait have none; with fewer than ``MIN_LOOP_STEPS`` such steps the loop
  cost is the median recorded gap.

A simulated step lasts decode + loop: that is what a stream waits between two tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from llamactor.ops.replay.tracefile import Step

KV_MIN_GAIN = 0.05  # the KV term is kept when it removes at least 5 % of the squared error
MIN_LOOP_STEPS = 8  # fewer steps with a known loop gap: use the median gap
MIN_STEP_MS = 0.01  # a simulated step always takes some time (the clock must advance)
_NOISE = 1e-9  # improvements below this share of the total variance are rounding, not signal


class FitError(ValueError):
    pass


@dataclass(frozen=True)
class Linear:
    """``ms = intercept + per_prompt * prompt + per_generated * generated [+ per_kv * kv]``."""

    intercept_ms: float
    per_prompt_ms: float = 0.0  # per prompt token in the step
    per_generated_ms: float = 0.0  # per token sampled in the step
    per_kv_ms: float = 0.0  # per KV cell held by the step's slots (0 unless ``uses_kv``)
    uses_kv: bool = False
    r2: float | None = None  # coefficient of determination (None: a constant, not fitted)
    n_steps: int = 0  # steps the fit used

    def ms(self, prompt: int, generated: int, kv: int) -> float:
        value = self.intercept_ms + self.per_prompt_ms * prompt + self.per_generated_ms * generated
        if self.uses_kv:
            value += self.per_kv_ms * kv
        return value

    def formula(self) -> str:
        text = (
            f"{self.intercept_ms:.4g} + {self.per_prompt_ms:.4g}*prompt_tokens "
            f"+ {self.per_generated_ms:.4g}*generated_tokens"
        )
        if self.uses_kv:
            text += f" + {self.per_kv_ms:.4g}*kv_cells"
        return text.replace("+ -", "- ")

    def describe(self) -> str:
        r2 = "" if self.r2 is None else f", R^2 = {self.r2:.3f}"
        return f"{self.formula()} ms ({self.n_steps} steps{r2})"


@dataclass(frozen=True)
class CostModel:
    decode: Linear
    loop: Linear

    def decode_ms(self, prompt: int, generated: int, kv: int) -> float:
        return max(MIN_STEP_MS, self.decode.ms(prompt, generated, kv))

    def ms(self, prompt: int, generated: int, kv: int) -> float:
        """A step's period: its decode plus the loop time before the next step."""
        return self.decode_ms(prompt, generated, kv) + max(0.0, self.loop.ms(prompt, generated, kv))

    def describe(self) -> str:
        loop = self.loop.describe() if self.loop.r2 is not None else f"{self.loop.intercept_ms:.4g} ms (median gap)"
        return f"step cost fit (least squares): decode = {self.decode.describe()}; loop = {loop}"


def fit_costs(steps: Sequence[Step]) -> CostModel:
    """Fit both costs from ``steps`` (sorted by group, then start, as ``load_trace`` gives them)."""
    if not steps:
        raise FitError("the trace has no decode steps: nothing to fit a step cost from")
    decode = _fit(list(steps), np.asarray([s.ms for s in steps]))
    followed = [(s, nxt.gap_ms) for s, nxt in pairwise(steps) if nxt.group == s.group and nxt.gap_ms is not None]
    if len(followed) >= MIN_LOOP_STEPS:
        loop = _fit([s for s, _ in followed], np.asarray([max(g or 0.0, 0.0) for _, g in followed]))
    else:
        gaps = [s.gap_ms for s in steps if s.gap_ms is not None]
        loop = Linear(float(np.median(gaps)) if gaps else 0.0, n_steps=len(gaps))
    return CostModel(decode, loop)


def _fit(rows: list[Step], y: np.ndarray) -> Linear:
    """Least squares with no negative cost per token (a step never gets cheaper with more tokens
    in it); the KV column is kept when every step has it, it costs (a positive coefficient) and
    it explains enough."""
    base = np.column_stack([np.ones(len(rows)), [s.prompt for s in rows], [s.generated for s in rows]])
    coef, ss = _lstsq(base, y)
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    kv_coef, uses_kv = 0.0, False
    if all(s.kv is not None for s in rows):
        with_kv = np.column_stack([base, [float(s.kv or 0) for s in rows]])
        coef_kv, ss_kv = _lstsq(with_kv, y)
        if coef_kv[3] > 0 and ss - ss_kv > max(KV_MIN_GAIN * ss, _NOISE * ss_tot):
            coef, ss, uses_kv, kv_coef = coef_kv[:3], ss_kv, True, float(coef_kv[3])
    scale = max(float(np.sum(y**2)), 1.0)
    if ss_tot > _NOISE * scale:
        r2 = max(0.0, 1.0 - ss / ss_tot)
    else:
        r2 = 1.0 if ss <= _NOISE * scale else 0.0  # every step cost the same
    return Linear(float(coef[0]), float(coef[1]), float(coef[2]), kv_coef, uses_kv, r2, len(rows))


def _lstsq(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Least squares whose per-token coefficients (every column after the intercept) are not
    negative: the most negative one is fixed at 0 and the rest fitted again, until none is.
    Steps whose token counts move together (a trace where most requests were cancelled, say, so
    nearly every step carries as many prompt tokens as the last) can otherwise trade a negative
    cost for one column against a large one for another, which a replay then turns into steps
    that cost less the more they hold."""
    free = list(range(x.shape[1]))
    while True:
        part, *_ = np.linalg.lstsq(x[:, free], y, rcond=None)
        coef = np.zeros(x.shape[1])
        coef[free] = part
        negative = [i for i in free[1:] if coef[i] < 0]
        if not negative:
            break
        free.remove(min(negative, key=lambda i: coef[i]))
    resid = y - x @ coef
    return coef, float(resid @ resid)


__all__ = ["CostModel", "FitError", "Linear", "fit_costs"]
