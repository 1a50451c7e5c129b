"""Cost-aware stopping: hard budgets, the payoff and plateau rules, state across a resume."""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch
from test_callbacks_runlog import TOKENS_PER_MICRO_BATCH, events, fit

from nanolab.callbacks import CallbackConfigError, CostBudget, MetricsLog, RotatingCheckpoint
from nanolab.training.callback_settings import check_budget


def test_token_budget_stops_with_a_checkpoint_and_reason(tmp_path, char_dataset):
    run = tmp_path / "run"
    budget = CostBudget(max_tokens=5 * TOKENS_PER_MICRO_BATCH)
    trainer = fit(
        run, char_dataset, [MetricsLog(), RotatingCheckpoint(every_n_steps=None), budget],
        max_steps=50, eval_every=100,
    )  # fmt: skip
    # The check stops *before* the next step would pass the budget: 5 steps of a 5-step
    # budget are trained (it stopped one step early when reaching the limit counted as passing).
    assert trainer.global_step == 5
    end = events(run / "metrics.jsonl", "end")[-1]
    limit = 5 * TOKENS_PER_MICRO_BATCH
    assert end["reason"] == "budget" and end["tokens"] == limit
    assert end["detail"] == f"{limit} of max_tokens {limit} spent"  # what it spent, truly
    decision = [r for r in events(run / "metrics.jsonl", "budget") if r["decision"] == "stop"]
    assert decision and decision[0]["budget"] == "max_tokens"
    assert decision[0]["projected_at_next_check"] == 6 * TOKENS_PER_MICRO_BATCH
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 5  # the final state is saved


def test_a_token_budget_that_stops_before_max_steps_is_where_progress_counts_to(
    tmp_path, char_dataset, capsys
):
    """``trainer.max_steps`` 50 and a token budget that stops the run at step 6: the banner
    said ``0 -> 6`` but the progress lines counted to 50 (``step 2/50 (4%)``) and the start
    record gave only ``planned_steps`` 50, which status counted to. The start record now says
    where the launch ends (``expected_end``; ``planned_steps`` stays the LR plan's), and the
    progress lines count to it, the last line once."""
    from nanolab.callbacks import StepProgressBar

    run = tmp_path / "run"
    bar = StepProgressBar(refresh_rate=2, mode="plain", plain_every_s=0)
    budget = CostBudget(max_tokens=6 * TOKENS_PER_MICRO_BATCH)
    fit(run, char_dataset, [MetricsLog(), budget, bar], max_steps=50, eval_every=2,
        enable_progress_bar=True)  # fmt: skip
    (start,) = events(run / "metrics.jsonl", "start")
    assert start["planned_steps"] == 50  # the cosine's plan: max_steps
    assert start["expected_end"] == {"step": 6, "by": "budget.max_tokens", "estimated": False}
    out = capsys.readouterr().out
    assert "  steps      0 -> 6 (budget.max_tokens)" in out
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/6", "4/6", "6/6"], lines
    assert lines[0].startswith("step 2/6 (33%)")


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
    assert trainer.global_step == 2  # not one step more: the budget was spent at the start
    end = events(run / "metrics.jsonl", "end")[-1]
    assert end["reason"] == "budget" and end["gpu_hours"] >= spent
    assert end["cost"] == pytest.approx(end["gpu_hours"] * 3.0) and end["currency"] == "EUR"


def test_a_rerun_after_a_budget_stop_trains_no_further_step(tmp_path, char_dataset, capsys):
    """A budget stop stands: the same command again (or a resume from its last checkpoint)
    ends at once with the same reason, and rewrites no checkpoint; a larger budget goes on.
    Before, every rerun trained one more step past the spent budget."""
    run = tmp_path / "run"
    ckpts = run / "checkpoints"

    def again(max_tokens: int) -> L.Trainer:
        budget = CostBudget(max_tokens=max_tokens)
        return fit(
            run, char_dataset, [MetricsLog(), RotatingCheckpoint(every_n_steps=None), budget],
            max_steps=50, eval_every=100, ckpt_path=ckpts / "last.ckpt" if ckpts.exists() else None,
        )  # fmt: skip

    assert again(5 * TOKENS_PER_MICRO_BATCH).global_step == 5
    saved = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in ckpts.iterdir()}
    capsys.readouterr()
    assert again(5 * TOKENS_PER_MICRO_BATCH).global_step == 5
    limit = 5 * TOKENS_PER_MICRO_BATCH
    assert f"stopped at step 5 (budget: {limit} of max_tokens {limit} spent)" in (
        capsys.readouterr().err
    )
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in ckpts.iterdir()} == saved
    ends = events(run / "metrics.jsonl", "end")
    assert [(e["step"], e["reason"]) for e in ends] == [(5, "budget"), (5, "budget")]
    assert again(9 * TOKENS_PER_MICRO_BATCH).global_step == 9  # a raised budget goes on


def test_a_plateau_stop_stands_until_its_patience_is_raised(tmp_path, char_dataset, capsys):
    run = tmp_path / "run"
    vals = [3.0, 2.0, 2.5, 2.6, 2.7, 2.8, 2.9, 3.0]

    def again(patience: int, val_losses: list[float]) -> L.Trainer:
        ckpt = run / "checkpoints" / "last.ckpt"
        return fit(
            run, char_dataset, [MetricsLog(), RotatingCheckpoint(every_n_steps=2),
                                CostBudget(patience=patience)],
            max_steps=40, eval_every=2, ckpt_path=ckpt if ckpt.exists() else None,
            module_kwargs={"val_losses": val_losses},
        )  # fmt: skip

    assert again(2, vals).global_step == 8  # 2.0 at step 4, then two evaluations no better
    capsys.readouterr()
    assert again(2, vals[4:]).global_step == 8
    assert "stopped at step 8 (plateau: no val improvement" in capsys.readouterr().err
    assert again(4, vals[4:]).global_step == 12  # two more evaluations without improvement
    reasons = [(e["step"], e["reason"]) for e in events(run / "metrics.jsonl", "end")]
    assert reasons == [(8, "plateau"), (8, "plateau"), (12, "plateau")]


def test_a_budget_stops_extra_evaluation_is_not_one_of_the_plateau_rules(tmp_path, char_dataset):
    """A budget stop at step 5 evaluates the final model off the every-2-steps schedule; that
    evaluation counted toward the patience, so the run continued with the budget lifted stopped
    at step 6, where the same run never budget-stopped stops at step 8."""
    vals = [3.0, 2.0, 2.5, 2.6, 2.7, 2.8]

    def launch(run, budget: CostBudget, val_losses: list[float]) -> L.Trainer:
        ckpt = run / "checkpoints" / "last.ckpt"
        return fit(
            run, char_dataset, [MetricsLog(), RotatingCheckpoint(every_n_steps=2), budget],
            max_steps=40, eval_every=2, ckpt_path=ckpt if ckpt.exists() else None,
            module_kwargs={"val_losses": val_losses},
        )  # fmt: skip

    assert launch(tmp_path / "a", CostBudget(patience=2), vals).global_step == 8
    run = tmp_path / "b"
    stopped = launch(run, CostBudget(patience=2, max_tokens=5 * TOKENS_PER_MICRO_BATCH), vals)
    assert stopped.global_step == 5
    assert [r["step"] for r in events(run / "metrics.jsonl", "val")] == [2, 4, 5]  # logged
    assert launch(run, CostBudget(patience=2), vals[3:]).global_step == 8
    assert [(e["step"], e["reason"]) for e in events(run / "metrics.jsonl", "end")] == [
        (5, "budget"),
        (8, "plateau"),
    ]


def test_a_completed_run_with_a_plateau_rule_is_extended(tmp_path, char_dataset):
    """A run that reached max_steps with patience used up was not stopped by the rule: raising
    max_steps goes on (the standing-stop check read the counter alone and refused it)."""
    run = tmp_path / "run"
    vals = [3.0, 2.0, 2.5, 2.6, 2.7, 2.8]

    def again(max_steps: int, val_losses: list[float]) -> L.Trainer:
        ckpt = run / "checkpoints" / "last.ckpt"
        return fit(
            run, char_dataset, [MetricsLog(), RotatingCheckpoint(every_n_steps=2),
                                CostBudget(patience=1)],
            max_steps=max_steps, eval_every=2, ckpt_path=ckpt if ckpt.exists() else None,
            module_kwargs={"val_losses": val_losses},
        )  # fmt: skip

    assert again(6, vals).global_step == 6  # 2.0 at step 4, 2.5 at 6: the last step, complete
    assert again(20, vals[3:]).global_step == 8  # extended; the rule stops it at its next eval
    reasons = [(e["step"], e["reason"]) for e in events(run / "metrics.jsonl", "end")]
    assert reasons == [(6, "completed"), (8, "plateau")]


def test_a_budget_stop_of_a_checkpoint_from_before_stands_too(tmp_path, char_dataset):
    """A checkpoint saved before the spend per step was stored: the projection falls back to
    the run's average, so the rerun still trains no step past the budget."""
    run = tmp_path / "run"
    ckpts = run / "checkpoints"

    def again() -> L.Trainer:
        return fit(
            run, char_dataset,
            [MetricsLog(), RotatingCheckpoint(every_n_steps=None),
             CostBudget(max_tokens=5 * TOKENS_PER_MICRO_BATCH)],
            max_steps=50, eval_every=100, ckpt_path=ckpts / "last.ckpt" if ckpts.exists() else None,
        )  # fmt: skip

    assert again().global_step == 5
    for path in ckpts.glob("step-*.ckpt"):  # as an older nanolab wrote it
        ckpt = torch.load(path, weights_only=True)
        for key in ("per_step", "decided"):
            ckpt["callbacks"]["CostBudget"].pop(key)
        torch.save(ckpt, path)
    assert again().global_step == 5


def test_a_signal_at_the_step_a_budget_stops_leaves_the_budget_stop(tmp_path, char_dataset):
    """SIGTERM during the step at which the budget stops the run: the run ends as the budget
    said (final save, exit 0, `end` reason budget), not as preempted; a rerun would otherwise
    train past the budget."""
    from cli_probes import SignalAt

    from nanolab.callbacks.preemption import PreemptionHandler

    run = tmp_path / "run"
    callbacks = [MetricsLog(), RotatingCheckpoint(every_n_steps=None),
                 CostBudget(max_tokens=5 * TOKENS_PER_MICRO_BATCH), PreemptionHandler(),
                 SignalAt(4)]  # fmt: skip
    trainer = fit(run, char_dataset, callbacks, max_steps=50, eval_every=100)
    assert trainer.global_step == 5
    end = events(run / "metrics.jsonl", "end")[-1]
    assert end["reason"] == "budget" and end["step"] == 5
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 5


def test_an_evaluation_a_preemption_saved_before_is_run_by_the_resume(tmp_path, char_dataset):
    """``preemption.finish_validation: false`` and a SIGTERM in step 4, an evaluation step: the
    checkpoint comes before that evaluation, and the resumed run evaluates step 4 before it
    trains. Its val records (numbers too), plateau stop and in-loop task steps are then those of
    the run never stopped; Lightning alone skipped the evaluation, so the plateau rule stopped at
    step 12 instead of 8 and the tasks (every 2nd evaluation) came at step 12. When that
    evaluation is what stops the run, its checkpoint is saved again: the same command then
    stands by the stop instead of evaluating the step once more."""
    from cli_probes import SignalAt

    from nanolab.callbacks.downstream import DownstreamEval
    from nanolab.callbacks.preemption import Preempted, PreemptionHandler

    def launch(run, signal_at: int | None = None) -> L.Trainer:
        L.seed_everything(0)
        ckpt = run / "checkpoints" / "last.ckpt"
        callbacks = [DownstreamEval("builtin:shakespeare", every_n_evals=2, limit=20),
                     MetricsLog(), RotatingCheckpoint(every_n_steps=None),
                     CostBudget(patience=1, min_delta=10.0),  # no evaluation improves enough
                     PreemptionHandler(finish_validation=False)]  # fmt: skip
        if signal_at is not None:
            callbacks.append(SignalAt(signal_at))
        return fit(
            run, char_dataset, callbacks, max_steps=16, eval_every=4,
            ckpt_path=ckpt if ckpt.exists() else None,
        )  # fmt: skip

    def logged(run, kind: str, *keys: str) -> list[tuple]:
        return [tuple(r[k] for k in keys) for r in events(run / "metrics.jsonl", kind)]

    assert launch(tmp_path / "a").global_step == 8
    for at, run in ((3, tmp_path / "b"), (7, tmp_path / "c")):  # stopped at step 4, at step 8
        with pytest.raises(Preempted):
            launch(run, signal_at=at)
        assert launch(run).global_step == 8
        for kind, keys in (("val", ("step", "val_loss")), ("tasks", ("step", "tasks/core"))):
            assert logged(run, kind, *keys) == logged(tmp_path / "a", kind, *keys), (at, kind)
        ends = logged(run, "end", "step", "reason")
        assert ends == [(at + 1, "preempted"), (8, "plateau")]
    assert launch(tmp_path / "c").global_step == 8  # the stop stands: no evaluation again
    assert [r[0] for r in logged(tmp_path / "c", "val", "step")] == [4, 8]


def _payoff_records(run):
    return [r for r in events(run / "metrics.jsonl", "budget") if r["rule"] in ("none", "payoff")]


@pytest.mark.parametrize(("threshold", "fires"), [(0.3, True), (1e-4, False)])
def test_payoff_rule_decides_from_the_forecast_on_a_real_run(
    tmp_path, char_dataset, threshold, fires, capsys
):
    """A real 80-step run of the tiny model, validated every 4 steps (warmup 2, cosine to step
    80): the payoff rule waits for 5 validations, then forecasts the val loss at max_steps with
    the run's own LR schedule. With threshold 0.3 it stops the run before max_steps, at the
    first validation where even the optimistic edge of the band promises less than 0.3, and the
    end record's detail says the forecast numbers; with 1e-4 the run completes.

    Mutations caught: the gain taken from the point forecast instead of the band's optimistic
    edge (stops earlier, while the band still allows more); the rule deciding before it has 5
    points; the end step taken from the current step (no gain ever: stops at once); the
    console not saying why.
    """
    run = tmp_path / "run"
    budget = CostBudget(payoff_threshold=threshold, payoff_bootstrap=30)
    trainer = fit(run, char_dataset, [MetricsLog(), budget], max_steps=80, eval_every=4)
    records = _payoff_records(run)
    waiting = [r for r in records if r["payoff"]["model"] is None]
    assert [r["step"] for r in waiting] == [4, 8, 12, 16]
    assert all("waiting for 5 validations" in r["payoff"]["note"] for r in waiting)
    decided = records[len(waiting) :]
    for r in decided:
        p = r["payoff"]
        assert p["model"] == "schedule" and p["end_step"] == 80
        lo, hi = p["forecast_end_band"]
        assert lo <= p["forecast_end"] <= hi
        assert p["gain_optimistic"] == pytest.approx(max(0.0, p["forecast_now"] - lo))
        assert abs(p["forecast_now"] - r["val_loss"]) < 0.1  # the fit follows the curve
        assert (r["decision"] == "stop") == (p["gain_optimistic"] < threshold)
    end = events(run / "metrics.jsonl", "end")[-1]
    if fires:
        assert trainer.global_step < 80 and decided[-1]["decision"] == "stop"
        assert end["reason"] == "budget"
        p = decided[-1]["payoff"]
        assert end["detail"].startswith(
            f"payoff: forecast val loss {p['forecast_now']:.4f} now -> {p['forecast_end']:.4f}"
        )
        assert (
            "at step 80 (trainer.max_steps" in end["detail"] and "< threshold 0.3" in end["detail"]
        )
        assert f"stopping: {end['detail']}\n" in capsys.readouterr().out
    else:
        assert trainer.global_step == 80 and end["reason"] == "completed"
        assert all(r["decision"] == "continue" for r in records)


def test_payoff_rule_forecasts_to_where_a_budget_ends_the_run(tmp_path, char_dataset):
    """With a token budget that ends the run at step 40 of a 200-step schedule, the forecast is
    taken at step ~40 (where the budget ends it), not at max_steps, and says which limit set it;
    ``payoff_per_gpu_hour`` compares the optimistic gain per GPU-hour left.

    Mutations caught: the end always at max_steps (a budget-limited run promised the annealing
    it will never reach); the per-GPU-hour rate divided by the GPU-hours spent; the rate logged
    as ``gain_per_gpu_hour`` though it is the optimistic gain's.
    """
    run = tmp_path / "run"
    budget = CostBudget(
        max_tokens=40 * TOKENS_PER_MICRO_BATCH, payoff_per_gpu_hour=1e-9, payoff_bootstrap=30
    )
    fit(run, char_dataset, [MetricsLog(), budget], max_steps=200, eval_every=4)
    decided = [r for r in _payoff_records(run) if r["payoff"]["model"] is not None]
    assert decided
    for r in decided:
        p = r["payoff"]
        assert p["limited_by"] == "max_tokens" and 38 <= p["end_step"] <= 41
        if p["remaining_gpu_hours"] > 0:
            # named for what it is: the optimistic gain, not ``gain``, per GPU-hour left
            assert "gain_per_gpu_hour" not in p
            assert p["gain_optimistic_per_gpu_hour"] == pytest.approx(
                p["gain_optimistic"] / p["remaining_gpu_hours"]
            )


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
        ({"payoff_min_evals": 4}, r"budget\.payoff_min_evals must be >= 5"),
        ({"payoff_per_gpu_hour": 0}, r"budget\.payoff_per_gpu_hour must be > 0"),
        ({"patience": 0}, r"budget\.patience"),
        ({"min_delta": -0.1}, r"budget\.min_delta"),
    ],
)
def test_bad_budgets_are_refused(kwargs, message):
    with pytest.raises(CallbackConfigError, match=message):
        CostBudget(**kwargs)
    with pytest.raises(CallbackConfigError, match=message):  # the rule queue add checks
        check_budget(kwargs)


def test_the_payoff_floor_is_the_forecasts_fewest_points():
    """The light rule holds its own copy (the forecast is a layer above): the two agree."""
    from nanolab.forecast import MIN_POINTS
    from nanolab.training.callback_settings import PAYOFF_MIN_EVALS

    assert PAYOFF_MIN_EVALS == MIN_POINTS


def test_a_branch_from_a_plateau_stopped_run_trains(tmp_path, char_dataset):
    """A new run from a plateau-stopped run's checkpoint (another run.name: a branch, e.g. a
    fine-tune on other data) decides anew; the same command again stays stopped."""
    from conftest import QUICKSTART, nanolab_here, tiny_overrides, write_config

    from nanolab.runlog import read_records

    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=20)
    cfg["run"]["eval_every_steps"] = 2
    cfg["budget"] = {"patience": 1, "min_delta": 10.0}  # no evaluation is 10 better: stops at 4
    config = write_config(tmp_path / "p.yaml", cfg)
    base = ["fit", "--config", str(QUICKSTART), "--config", str(config)]
    for _ in range(2):
        assert nanolab_here(*base, cwd=tmp_path).returncode == 0
    ends = read_records(tmp_path / "runs" / "tiny" / "metrics.jsonl", "end")
    assert [(e["step"], e["reason"]) for e in ends] == [(4, "plateau"), (4, "plateau")]
    last = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    res = nanolab_here(*base, "--run.name", "branch", "--run.resume", str(last), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    ends = read_records(tmp_path / "runs" / "branch" / "metrics.jsonl", "end")
    assert [(e["step"], e["reason"]) for e in ends] == [(6, "plateau")]


def test_every_budget_stops_when_the_next_check_would_pass_it_and_says_what_was_spent():
    """Time, GPU-hour and money budgets follow the token budget's rule: reaching a limit at the
    next check is within it, passing it stops now; the reason gives the spend, not the limit."""
    from nanolab.callbacks.budget import stops_now

    assert not stops_now(0.25, 0.5, 0.5)  # the next check lands on the limit: train on
    assert stops_now(0.3, 0.55, 0.5)  # it would pass it
    assert stops_now(0.5, 0.5, 0.5)  # nothing left (a resume between checks projects nothing)
    budget = CostBudget(max_cost=20, price_per_gpu_hour=2.5, currency="eur", max_wall_hours=0.5)
    assert budget.spend_detail("wall_hours", 0.123456, 0.5) == (
        "0.1235 of max_wall_hours 0.5 spent"
    )
    assert budget.spend_detail("cost", 17.5, 20) == "17.5 of max_cost 20 EUR spent"
    assert budget.spend_detail("tokens", 896, 1024) == "896 of max_tokens 1024 spent"


def test_a_branch_budget_counts_the_tokens_the_branch_trains(tmp_path, char_dataset):
    """budget.max_tokens of a branch (another run.name from a run's checkpoint) counts what the
    branch itself trains, as its hours do (docs/guarantees.md): a budget the parent already
    spent trains that many tokens more. Before, the parent's tokens counted: the launch said
    "stopped at step 4 (...); nothing to train" of a branch that had trained nothing. Rerun,
    the branch stays stopped, and says so with its own spend."""
    from conftest import QUICKSTART, nanolab_here, tiny_overrides, write_config

    from nanolab.runlog import read_records

    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=4)
    config = write_config(tmp_path / "p.yaml", cfg)
    base = ["fit", "--config", str(QUICKSTART), "--config", str(config)]
    assert nanolab_here(*base, cwd=tmp_path).returncode == 0
    parent = read_records(tmp_path / "runs" / "tiny" / "metrics.jsonl", "end")[-1]["tokens"]
    last = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    branch = [*base, "--run.name", "branch", "--run.resume", str(last), "--trainer.max_steps"]
    branch += ["-1", "--budget.max_tokens", str(parent)]
    res = nanolab_here(*branch, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "nothing to train" not in res.stderr
    log = tmp_path / "runs" / "branch" / "metrics.jsonl"
    assert read_records(log, "start")[0]["planned_steps"] == 8  # 4 steps of its own
    (end,) = read_records(log, "end")
    assert (end["step"], end["reason"]) == (8, "budget")
    assert end["detail"] == f"{parent} of max_tokens {parent} spent"
    assert end["tokens"] == 2 * parent  # the model's tokens: its parent's and its own
    again = nanolab_here(*branch, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"stopped at step 8 (budget: {parent} of max_tokens {parent} spent)" in again.stderr
    assert [e["step"] for e in read_records(log, "end")] == [8, 8]


def test_the_step_a_token_budget_stops_at_is_the_one_its_checks_decide():
    """token_stop_step (what max_steps -1 plans for, the start record's planned_steps) agrees
    with the budget's checks from any step and spend: a branch's starts at its parent's step."""
    from nanolab.callbacks.budget import stops_now, token_stop_step

    def checked(step: int, spent: int, per: int, every: int, limit: int) -> int:
        if spent >= limit or (step > 0 and step % every == 0 and spent + per * every > limit):
            return step  # the restored run stops before its first step
        while True:
            step, spent = step + 1, spent + per
            if step % every == 0 and stops_now(spent, spent + per * every, limit):
                return step

    for step in range(12):
        for spent in range(0, 40, 4):
            for every in (1, 2, 3):
                for limit in range(1, 60, 3):
                    want = checked(step, spent, 4, every, limit)
                    assert token_stop_step(step, spent, 4, every, limit) == want


def _scheduled_trainer(schedule):
    from types import SimpleNamespace

    scheduler = SimpleNamespace(lr_lambdas=[schedule] if schedule is not None else None)
    return SimpleNamespace(lr_scheduler_configs=[SimpleNamespace(scheduler=scheduler)])


def test_payoff_rule_fits_a_bounded_number_of_validations(monkeypatch):
    """A 100k-step run validated every 50 steps has 1,200 validations at step 60,000: the
    payoff rule fits at most ``PAYOFF_POINTS`` of them (the newest always, those before warmup
    never), so a validation's cost stops growing with the run; its forecast stays that of all
    the points. The power law (an optimizer without a LambdaLR) is thinned the same way.

    Mutations caught: the whole history fitted at every validation (a refit of 4,000 points
    took 8 s); the newest validation left out of the fit; warmup points let in.
    """
    import nanolab.callbacks.budget as budget_module
    from nanolab.forecast import CurveInputs, fit_curve
    from nanolab.training.optim import WarmupCosine

    fitted: list[list[float]] = []

    def spy(inputs, bootstrap):
        fitted.append([s for s, _, _ in inputs.points])
        return fit_curve(inputs, bootstrap=bootstrap)

    monkeypatch.setattr(budget_module, "fit_curve", spy)
    schedule = WarmupCosine(100, 100_000, 0.1)
    steps = range(50, 60_001, 50)
    noise = np.random.default_rng(0).normal(0.0, 0.005, len(steps))
    losses = 2.0 + 3.0 * (np.array(steps) / 100) ** -0.3 + noise
    points = [(float(s), float(s), float(v)) for s, v in zip(steps, losses, strict=True)]
    budget = CostBudget(payoff_threshold=0.1, payoff_bootstrap=10)
    trainer = _scheduled_trainer(schedule)
    now, end, _, model = budget._forecast(trainer, points, 100, 60_000, 100_000)
    assert model == "schedule" and len(fitted) == 1
    assert len(fitted[0]) <= budget_module.PAYOFF_POINTS and fitted[0][-1] == 60_000
    assert min(fitted[0]) >= 100
    inputs = CurveInputs(points, 100_000, schedule_for=lambda _s: schedule, warmup_steps=100)
    whole = fit_curve(inputs, bootstrap=10)
    assert end == pytest.approx(whole.predict(100_000), abs=0.01)
    assert now == pytest.approx(whole.predict(60_000), abs=0.01)

    counted: list[int] = []
    real_law = budget_module.fit_loss_curve

    def law_spy(xs, ys, bootstrap):
        counted.append(len(xs))
        return real_law(xs, ys, bootstrap=bootstrap)

    monkeypatch.setattr(budget_module, "fit_loss_curve", law_spy)
    plain = _scheduled_trainer(None)
    assert budget._forecast(plain, points, 100, 60_000, 100_000)[3] == "power law"
    assert len(counted) == 1 and counted[0] <= budget_module.PAYOFF_POINTS


@pytest.mark.parametrize("rank", [0, 1])
def test_payoff_rule_is_forecast_on_rank_zero_and_sent_to_every_rank(monkeypatch, rank):
    """On a run over several devices only rank 0 fits the forecast (a second of CPU a
    validation, on every rank before), and every rank takes rank 0's numbers and decision:
    each rank's own spend per step projected its own end and GPU-hours left, so ranks could
    decide apart. One device forecasts itself, with no collective.

    Mutations caught: every rank forecasting; a rank deciding from its own numbers; the
    broadcast sent from another rank than 0.
    """
    from types import SimpleNamespace

    budget = CostBudget(payoff_threshold=0.1)
    forecasts: list[int] = []
    rank0 = {"decision": "stop", "gain_optimistic": 0.01}

    def payoff(trainer):
        forecasts.append(trainer.global_rank)
        return rank0 if trainer.global_rank == 0 else {"decision": "continue"}

    def broadcast(obj, src=0):
        sent.append((obj, src))
        return rank0

    sent: list[tuple] = []
    monkeypatch.setattr(budget, "payoff", payoff)
    strategy = SimpleNamespace(broadcast=broadcast)
    trainer = SimpleNamespace(
        world_size=2, global_rank=rank, is_global_zero=rank == 0, strategy=strategy
    )
    assert budget.agreed_payoff(trainer) == rank0
    assert forecasts == ([0] if rank == 0 else [])
    assert sent == [(rank0 if rank == 0 else None, 0)]
    alone = SimpleNamespace(world_size=1, global_rank=0, is_global_zero=True, strategy=strategy)
    assert budget.agreed_payoff(alone) == rank0 and len(sent) == 1
