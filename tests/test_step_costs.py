"""ops/bench/step_costs.py: the step-cost probe behind the chat workload's analysis (README, Engine features)."""

from __future__ import annotations

from llamactor.ops.bench.step_costs import main, wave_floor


def test_wave_floor_finds_the_best_split():
    """Four turns: one at a time gives 10, 20, 30, 40 (p50 25, mean 25); two steps of two give
    14, 14, 28, 28 (p50 and mean 21, the best mean); two, then one and one give 14, 14, 24, 34
    (p50 19, the best p50, mean 21.5); all at once 28."""
    cost = {1: 10.0, 2: 14.0, 3: 22.0, 4: 28.0}
    assert wave_floor(cost, 4) == (19.0, 21.0, (2, 1, 1), (2, 2))
    p50, _, split, _ = wave_floor({1: 10.0}, 1)
    assert (p50, split) == (10.0, (1,))


def test_step_costs_runs_on_a_model(tiny_model, capsys):
    assert (
        main(
            [
                str(tiny_model),
                "--slots",
                "3",
                "--history",
                "20",
                "--new",
                "6",
                "--threads",
                "1",
                "--ctx",
                "192",
                "--repeat",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| generate | 3 |" in out and "| prefill 3 × 6 | 18 |" in out
    assert "a wave of 3 turns at once" in out and "first token p50 >=" in out
