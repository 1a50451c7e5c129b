"""Cost-aware stopping: hard budgets, the payoff and plateau rules, state across a resume."""

from __future__ import annotations

import pytest
import torch
from test_callbacks_runlog import TOKENS_PER_MICRO_BATCH, events, fit

from nanolab.callbacks import CallbackConfigError, CostBudget, MetricsLog, RotatingCheckpoint
from nanolab.callbacks.budget import linear_slope


def test_token_budget_stops_with_a_checkpoint_and_reason(tmp_path, char_dataset):
    run = tmp_path / "run"
    budget = CostBudget(max_tokens=5 * TOKENS_PER_MICRO_BATCH)
    trainer = fit(
        run, char_dataset, [MetricsLog(), RotatingCheckpoint(every_n_steps=None), budget],
        max_steps=50, eval_every=100,
    )  # fmt: skip
    # The check stops *before* the next step would overrun the budget.
    assert trainer.global_step == 4
    end = events(run / "metrics.jsonl", "end")[-1]
    assert end["reason"] == "budget" and "max_tokens" in end["detail"]
    assert end["tokens"] <= 5 * TOKENS_PER_MICRO_BATCH
    decision = [r for r in events(run / "metrics.jsonl", "budget") if r["decision"] == "stop"]
    assert decision and decision[0]["budget"] == "max_tokens"
    assert decision[0]["projected_at_next_check"] == 5 * TOKENS_PER_MICRO_BATCH
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 4  # the final state is saved


def test_gpu_hour_budget_counts_across_resume(tmp_path, char_dataset):
    run = tmp_path / "run"
    callbacks = [MetricsLog(), RotatingCheckpoint(every_n_steps=2)]
    fit(run, char_dataset, callbacks, max_steps=2, eval_every=100)
    spent = events(run / "metrics.jsonl", "end")[-1]["gpu_hours"]
    # Resume with a budget the first process already used up: the resumed run stops at once.
    budget = CostBudget(max_gpu_hours=spent * 0.9, price_per_gpu_hour=3.0, currency="eur")
    trainer = fit(
        run, char_dataset, [MetricsLog(), RotatingCheckpoint(every_n_steps=2), budget],
        max_steps=50, eval_every=100, ckpt_path=run / "checkpoints" / "last.ckpt",
    )  # fmt: skip
    assert trainer.global_step == 3
    end = events(run / "metrics.jsonl", "end")[-1]
    assert end["reason"] == "budget" and end["gpu_hours"] > spent
    assert end["cost"] == pytest.approx(end["gpu_hours"] * 3.0) and end["currency"] == "EUR"


def test_payoff_rule_uses_the_recent_improvement_rate(tmp_path, char_dataset):
    run = tmp_path / "run"
    vals = [3.0, 2.99, 2.985, 2.983, 2.982, 2.981]
    budget = CostBudget(payoff_threshold=0.5, payoff_window=3)
    fit(
        run, char_dataset, [MetricsLog(), budget], max_steps=40, eval_every=2,
        module_kwargs={"val_losses": vals},
    )  # fmt: skip
    records = events(run / "metrics.jsonl", "budget")
    assert [r["decision"] for r in records] == ["continue", "continue", "stop"]
    stop = records[-1]
    assert stop["rule"] == "payoff" and stop["step"] == 6
    hours = [h for _, h, _ in budget.history]
    logged = [v for _, _, v in budget.history]  # the scripted values, as float32 round-trips
    assert logged == pytest.approx(vals[:3], abs=1e-6)
    expected_rate = -linear_slope(hours, logged)
    payoff = stop["payoff"]
    assert payoff["improvement_per_gpu_hour"] == pytest.approx(expected_rate)
    assert payoff["limited_by"] == "trainer.max_steps" and payoff["remaining_gpu_hours"] > 0
    assert payoff["projected_gain"] == pytest.approx(expected_rate * payoff["remaining_gpu_hours"])
    assert payoff["projected_gain"] < 0.5
    end = events(run / "metrics.jsonl", "end")[-1]
    assert end["reason"] == "budget" and end["detail"].startswith("payoff")


def test_plateau_rule(tmp_path, char_dataset):
    run = tmp_path / "run"
    vals = [3.0, 2.0, 2.5, 1.95, 2.1, 2.2]
    budget = CostBudget(patience=2, min_delta=0.1)
    fit(
        run, char_dataset, [MetricsLog(), budget], max_steps=40, eval_every=2,
        module_kwargs={"val_losses": vals},
    )  # fmt: skip
    records = events(run / "metrics.jsonl", "budget")
    # 1.95 is not 0.1 better than 2.0: evals 3 and 4 both count as no improvement.
    assert [r["plateau"]["evals_since_best"] for r in records] == [0, 0, 1, 2]
    assert records[-1]["rule"] == "plateau" and records[-1]["decision"] == "stop"
    assert events(run / "metrics.jsonl", "end")[-1]["reason"] == "plateau"


def test_budget_state_survives_resume(tmp_path, char_dataset):
    run = tmp_path / "run"
    vals = [3.0, 2.0, 2.5, 2.6, 2.7]

    def callbacks():
        return [MetricsLog(), RotatingCheckpoint(every_n_steps=2), CostBudget(patience=3)]

    fit(
        run,
        char_dataset,
        callbacks(),
        max_steps=6,
        eval_every=2,
        module_kwargs={"val_losses": vals},
    )
    first = events(run / "metrics.jsonl", "budget")
    assert [r["plateau"]["evals_since_best"] for r in first] == [0, 0, 1]
    # The resumed process replays the scripted losses from the 4th evaluation on.
    resumed = callbacks()
    fit(
        run, char_dataset, resumed, max_steps=40, eval_every=2,
        ckpt_path=run / "checkpoints" / "last.ckpt", module_kwargs={"val_losses": vals[3:]},
    )  # fmt: skip
    budget = resumed[-1]
    assert [h[0] for h in budget.history] == [2, 4, 6, 8, 10]
    assert budget.best == 2.0 and budget.evals_since_best == 3
    end = events(run / "metrics.jsonl", "end")[-1]
    assert end["reason"] == "plateau" and end["step"] == 10


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_gpu_hours": 0}, r"budget\.max_gpu_hours must be > 0"),
        ({"max_gpu_hours": -1.0}, r"budget\.max_gpu_hours must be > 0"),
        ({"max_tokens": 0}, r"budget\.max_tokens must be > 0"),
        ({"max_wall_hours": -2}, r"budget\.max_wall_hours"),
        ({"max_cost": 10.0}, r"budget\.max_cost needs budget\.price_per_gpu_hour"),
        ({"price_per_gpu_hour": -2.5}, r"budget\.price_per_gpu_hour must be a number >= 0"),
        ({"price_per_gpu_hour": 2.5, "currency": "DOLLARS"}, r"budget\.currency 'DOLLARS'"),
        ({"payoff_window": 1}, r"budget\.payoff_window"),
        ({"patience": 0}, r"budget\.patience"),
        ({"min_delta": -0.1}, r"budget\.min_delta"),
    ],
)
def test_bad_budgets_are_refused(kwargs, message):
    with pytest.raises(CallbackConfigError, match=message):
        CostBudget(**kwargs)


def test_linear_slope():
    assert linear_slope([0.0, 1.0, 2.0], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert linear_slope([1.0, 1.0], [3.0, 2.0]) is None
