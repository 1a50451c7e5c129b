"""The loss forecaster (``nanolab.forecast``) on curves with a known answer, and ``nanolab report
--forecast --target-loss`` over run logs written the way ``nanolab fit`` writes them.

Each test names, in its docstring, the mutation of nanolab it was seen to catch.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

from nanolab.forecast import ForecastError, fit_loss_curve
from nanolab.report import main
from nanolab.runs import si

E, A, ALPHA, D0 = 1.8, 2.5, 0.35, 2000.0
TOKENS = np.linspace(D0, 100 * D0, 40)


def curve(d: np.ndarray | float) -> np.ndarray | float:
    return E + A * (np.asarray(d) / D0) ** -ALPHA


def test_exact_curve_is_recovered() -> None:
    """A noiseless power law gives back its parameters, its loss anywhere and the tokens at
    which it reaches a target (the inverse of the curve).

    Mutations caught: alpha searched on a grid without refinement (1% off); D0 not the first
    point (A scaled wrongly); tokens_to with the exponent not inverted.
    """
    fit = fit_loss_curve(TOKENS, curve(TOKENS), bootstrap=10)
    fitted = (fit.E, fit.A, fit.alpha)
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(fitted, (E, A, ALPHA), strict=True))
    assert fit.rmse < 1e-8
    far = 1000 * D0
    assert fit.predict(far) == pytest.approx(curve(far), rel=1e-6)
    assert fit.tokens_to(2.0) == pytest.approx(D0 * (A / (2.0 - E)) ** (1 / ALPHA), rel=1e-5)
    assert math.isinf(fit.tokens_to(E - 0.01))  # below the floor: never


@pytest.mark.parametrize(("fraction", "mean_error"), [(0.3, 0.02), (0.5, 0.01)])
def test_noisy_early_curve_forecasts_the_end_within_its_band(fraction, mean_error) -> None:
    """Fitted on the first 30% / 50% of a noisy curve (sd 0.01), the loss at 100x the first
    point's tokens is forecast to within ``mean_error`` on average over 10 noise draws, and the
    true value lies inside the 5-95% band in at least 7 of them.

    Mutations caught: a bootstrap that resamples points instead of residuals around the fit
    (bands far too wide or too narrow: coverage fails); E forced to 0 (mean error ~0.3).
    """
    errors, inside = [], 0
    k = int(len(TOKENS) * fraction)
    for seed in range(10):
        noisy = curve(TOKENS) + np.random.default_rng(seed).normal(0, 0.01, len(TOKENS))
        fit = fit_loss_curve(TOKENS[:k], noisy[:k], bootstrap=100, seed=seed)
        truth = float(curve(TOKENS[-1]))
        errors.append(abs(fit.predict(TOKENS[-1]) - truth))
        lo, hi = fit.band(TOKENS[-1])
        inside += lo <= truth <= hi
    assert float(np.mean(errors)) < mean_error, errors
    assert inside >= 7, inside


def test_a_curve_without_saturation_is_flagged() -> None:
    """A loss still falling in a straight line has no power-law knee to fit: the floor E would
    go negative, is held at zero, and the fit says it is degenerate.

    Mutations caught: E unconstrained (a floor of -60 on such a line); the flag missing."""
    tokens = np.linspace(1000, 10_000, 12)
    fit = fit_loss_curve(tokens, 3.0 - tokens / 10_000, bootstrap=10)
    assert fit.degenerate and fit.E >= 0.0
    assert not fit_loss_curve(TOKENS, curve(TOKENS), bootstrap=10).degenerate


def test_too_few_points_is_one_clear_error() -> None:
    """Mutations caught: a fit on 3 points (exact and meaningless) instead of an error."""
    with pytest.raises(ForecastError, match="needs at least 5"):
        fit_loss_curve([1, 2, 3, float("nan"), 0], [3.0, 2.5, 2.2, 2.0, 1.9])


def _write_run(root: Path, name: str, seed: int, max_steps: int = 400, last: int = 160) -> None:
    """A run log as ``nanolab fit`` writes it: 1000 tokens per step, val every 10 steps on the
    known curve (plus noise), GPU-hours and cost counted per step."""
    run = root / name
    run.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    config = {"seed_everything": seed, "trainer": {"max_steps": max_steps}, "run": {"name": name}}
    lines = [{"event": "start", "time": 0.0, "step": 0, "config": config}]
    for step in range(10, last + 1, 10):  # by default 160 of 400 steps so far (still running)
        tokens = 1000 * step
        lines.append({"event": "train", "time": float(step), "step": step, "tokens": tokens,
                      "loss": 3.0, "gpu_hours": step * 1e-3, "cost": step * 2e-3})  # fmt: skip
        loss = float(curve(tokens * D0 / 10_000) + rng.normal(0, 0.002))
        lines.append({"event": "val", "time": float(step), "step": step, "tokens": tokens,
                      "val_loss": loss})  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_report_forecast_and_target_loss(tmp_path: Path, capsys) -> None:
    """``report --forecast --target-loss`` on two seeds of a run 40% done: each run's forecast
    at max_steps (400 steps x 1000 tokens) is close to the curve's true value there, the tokens
    to reach the target are near the true ones, GPU-hours and cost scale from the run's own rate
    (1e-6 GPU-h and 2e-6 $ per token), the seed group is fitted on both runs' points, and the
    table says all of it. A target below the fitted floor is called unreachable.

    Mutations caught: final tokens from the current step instead of max_steps; cost per token
    taken from the GPU-hours; the group forecast left out.
    """
    for i, name in enumerate(("exp-s1", "exp-s2")):
        _write_run(tmp_path, name, seed=i + 1)
    target = 2.2
    assert main([str(tmp_path), "--json", "--target-loss", str(target)]) == 0
    data = json.loads(capsys.readouterr().out)
    scale = D0 / 10_000  # tokens of the log -> tokens of the curve
    truth_final = float(curve(400_000 * scale))
    truth_tokens = D0 * (A / (target - E)) ** (1 / ALPHA) / scale
    for name in ("exp-s1", "exp-s2"):
        f = data["forecasts"][name]
        assert f["final_tokens"] == 400_000 and f["points"] == 16
        assert f["final_loss"] == pytest.approx(truth_final, abs=0.02)
        lo, hi = f["final_band"]
        assert lo <= f["final_loss"] <= hi
        assert f["target_tokens"] == pytest.approx(truth_tokens, rel=0.25)
        assert f["target_gpu_hours"] == pytest.approx(f["target_tokens"] * 1e-6, rel=1e-9)
        assert f["target_cost"] == pytest.approx(f["target_tokens"] * 2e-6, rel=1e-9)
    (group,) = data["group_forecasts"].values()
    assert group["points"] == 32 and group["final_loss"] == pytest.approx(truth_final, abs=0.02)
    assert main([str(tmp_path), "--forecast", "--target-loss", "1.0"]) == 0
    table = capsys.readouterr().out
    assert "without a known schedule L = E + A*D^-alpha" in table and "power law E=1.8" in table
    assert "at max_steps (400k tokens)" in table
    assert "1.0: the fitted floor" in table and "not reachable" in table
    assert "group exp" in table


def test_a_target_the_log_already_crossed_is_reported_with_or_without_a_fit(
    tmp_path: Path, capsys
) -> None:
    """``report --target-loss X`` on a run whose validations crossed X says where, read off the
    log (interpolated between the validations either side), however few they are: with 3
    validations it only said "no forecast (3 usable validation point(s) ...)"; with 16, the
    fitted curve's crossing stood in for the one the log shows. A target not crossed yet is
    said so without a fit, and left to the forecast with one.

    Mutations caught: the target read only through the fit; the crossing taken at the first
    validation below X (no interpolation)."""
    _write_run(tmp_path, "short", seed=1, last=30)  # 3 validations: too few to fit
    _write_run(tmp_path, "long", seed=2)  # 16: fitted
    vals = {
        name: {r["step"]: (r["tokens"], r["val_loss"])
               for r in map(json.loads, (tmp_path / name / "metrics.jsonl").open())
               if r["event"] == "val"}
        for name in ("short", "long")
    }  # fmt: skip
    (_, v10), (_, v20) = vals["short"][10], vals["short"][20]
    target = round((v10 + v20) / 2, 6)  # crossed between the validations at steps 10 and 20
    share = (v10 - target) / (v10 - v20)
    assert main([str(tmp_path), "--forecast", "--target-loss", str(target)]) == 0
    table = capsys.readouterr().out
    (short,) = [ln for ln in table.splitlines() if ln.startswith("  short:")]
    assert "no forecast (3 usable validation point(s)" in short
    assert (
        f"; {target} reached at ~{si(10_000 + share * 10_000)} tokens (step ~{10 + 10 * share:.1f}), "
        "interpolated between the validations at steps 10 and 20"
    ) in short
    (long,) = [ln for ln in table.splitlines() if ln.startswith("  long:")]
    assert f"; {target} reached at ~" in long and " tokens [" not in long.split(f"; {target}")[1]
    assert main([str(tmp_path), "--json", "--target-loss", str(target)]) == 0
    reached = json.loads(capsys.readouterr().out)["forecasts"]["short"]["reached"]
    assert reached["before"] == 10 and reached["after"] == 20
    assert reached["step"] == pytest.approx(10 + 10 * share)
    assert reached["tokens"] == pytest.approx(10_000 + share * 10_000)
    below = round(min(v for _, v in vals["short"].values()) - 0.5, 3)
    assert main([str(tmp_path), "--forecast", "--target-loss", str(below)]) == 0
    (short,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  short:")]
    assert short.endswith(
        f"; {below} not reached by its validations (the last: {vals['short'][30][1]:.4f})"
    )


def test_forecast_check_bench_on_a_finished_run(tmp_path: Path, capsys) -> None:
    """``benches/forecast_check.py`` cuts a finished run's curve at 30% and 50% of its tokens,
    forecasts the final val loss from each part and prints the error: small on a run that
    follows the power law (noise sd 0.002). Unfinished runs are left out.

    Mutations caught: the cut compared with the first point's tokens instead of the last's;
    running runs checked against a final loss they have not reached.
    """
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "forecast_check", Path(__file__).resolve().parents[1] / "benches" / "forecast_check.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    _write_run(tmp_path, "live", seed=3)  # still running: skipped
    _write_run(tmp_path, "done", seed=4, max_steps=400, last=400)
    with (tmp_path / "done" / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"event": "end", "time": 401.0, "step": 400, "reason": "completed",
                            "tokens": 400_000}) + "\n")  # fmt: skip
    assert bench.main([str(tmp_path), "--cuts", "0.3", "0.5"]) == 0
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("done ")]
    assert [(r[1], r[2]) for r in rows] == [("30%", "12"), ("50%", "20")], out
    assert all(abs(float(r[-2])) < 0.05 for r in rows), out
    assert "live" not in out and "fitted on the first 30%: mean |error|" in out


# -- the schedule-aware forecast -------------------------------------------------------------
SCHED = {"warmup_steps": 20, "decay_steps": None, "min_lr_ratio": 0.1}
TRUE = {
    "L0": 1.5,
    "A": 3.0,
    "alpha": 0.4,
    "C": 0.02,
}  # decay 0.9 (of DECAYS): C*S2 = 0.18 at the end


def _planned(max_steps: int):
    from nanolab.training.optim import ScheduleConfig, lr_schedule

    return lr_schedule(ScheduleConfig(**SCHED), max_steps)


def schedule_curve(steps: np.ndarray, max_steps: int = 400, decay: float = 0.9) -> np.ndarray:
    from nanolab.forecast.annealing import multipliers_array, schedule_areas

    s1, s2 = schedule_areas(multipliers_array(_planned(max_steps), max_steps), decay)
    return TRUE["L0"] + TRUE["A"] * s1[steps] ** -TRUE["alpha"] - TRUE["C"] * s2[steps]


def test_schedule_areas_are_the_recurrence() -> None:
    """The chunked cumulative sums equal the plain recurrence (warmup increases not counted as
    annealing), across chunk boundaries (decay 0.9: chunks of 569 steps, 3000 steps run).

    Mutations caught: the momentum not carried into the next chunk; warmup counted as a
    negative annealing; S1 including the step not yet taken.
    """
    from nanolab.forecast.annealing import multipliers_array, schedule_areas

    mult = multipliers_array(_planned(3000), 3000)
    for decay in (0.0, 0.9, 0.999):
        s1, s2 = schedule_areas(mult, decay)
        mom, acc, ref = 0.0, 0.0, [0.0]
        for i in range(len(mult)):
            mom = decay * mom + (max(mult[i - 1] - mult[i], 0.0) if i else 0.0)
            acc += mom
            ref.append(acc)
        assert np.allclose(s2, ref, rtol=1e-9, atol=1e-9), decay
        assert s1[1] == mult[0] and s1[-1] == pytest.approx(mult.sum())


def test_schedule_fit_recovers_a_known_curve_and_constant_lr_is_the_power_law() -> None:
    """A noiseless curve of the model (warmup + cosine, decay 0.9) gives back L0, A, alpha, C
    and the decay; fitted on its first half it forecasts the end exactly. Under a constant LR
    (no warmup) S2 is 0, S1 is the step count, and the fit is the power law in tokens: the same
    forecast as ``fit_loss_curve`` on the same points.

    Mutations caught: the areas evaluated at the step after the point (a one-step shift: C off
    by 2%); the decay not searched (fixed 0.999: end forecast off by 0.03).
    """
    from nanolab.forecast import fit_loss_curve, fit_schedule_curve

    steps = np.arange(20, 401, 10)
    y = schedule_curve(steps)
    fit = fit_schedule_curve(steps, y, _planned(400), 400, bootstrap=10)
    assert fit.decay == 0.9
    for name, value in TRUE.items():
        assert getattr(fit, name) == pytest.approx(value, rel=2e-3), name
    half = steps <= 200
    early = fit_schedule_curve(steps[half], y[half], _planned(400), 400, bootstrap=10)
    assert early.predict(400) == pytest.approx(float(y[-1]), abs=2e-3)
    # Constant LR: the power law in steps (x 1000 tokens per step).
    law = E + A * (steps / steps[0]) ** -ALPHA
    const = fit_schedule_curve(steps[half], law[half], [1.0] * 400, 400, bootstrap=10)
    tokens = fit_loss_curve(steps[half] * 1000.0, law[half], bootstrap=10)
    assert const.C == 0.0 and float(const.s2_at(400)) == 0.0
    assert const.predict(400) == pytest.approx(tokens.predict(400_000), abs=1e-4)
    assert const.predict(400) == pytest.approx(float(law[-1]), abs=1e-4)


@pytest.mark.parametrize(("fraction", "max_mean_error"), [(0.3, 0.35), (0.5, 0.05)])
def test_schedule_forecast_of_a_noisy_curve_lands_in_its_band(fraction, max_mean_error) -> None:
    """Fitted on the first 30% / 50% of the model's own curve with noise (sd 0.003), the final
    loss (after the cosine's whole annealing) is forecast to within ``max_mean_error`` on
    average over 10 noise draws, and the truth lies inside the 5-95% band in at least 8.

    At 30% the LR has fallen only to 0.84 of its peak: how much the annealing will give is
    barely determined yet, and the band says so (about 1.0 wide, vs 0.25 at 50%).

    Mutations caught: the forecast evaluated on S2 of the observed part only (no annealing
    ahead: +0.18); the band from the bootstrap alone, without the backtest's miss (coverage 4/10
    at 30%).
    """
    from nanolab.forecast import fit_schedule_curve

    steps = np.arange(20, 401, 10)
    y = schedule_curve(steps)
    k = steps <= fraction * 400
    errors, inside = [], 0
    for seed in range(10):
        noisy = y + np.random.default_rng(seed).normal(0, 0.003, len(y))
        fit = fit_schedule_curve(steps[k], noisy[k], _planned(400), 400, bootstrap=50, seed=seed)
        errors.append(abs(fit.predict(400) - y[-1]))
        lo, hi = fit.band(400)
        inside += lo <= y[-1] <= hi
    assert float(np.mean(errors)) < max_mean_error, errors
    assert inside >= 8, inside


def test_the_fits_are_the_previous_fits_on_the_same_points() -> None:
    """The power law (alpha refined by scipy's bounded minimize_scalar) and the schedule fit
    ((L0, A, C) >= 0 by scipy.optimize.nnls) give what their hand-written predecessors (a
    golden-section search; every subset of free coefficients solved) gave on the same noisy
    points: parameters, the forecast and its band to 1e-6 relative (seen: 3e-9 at most).

    Mutations caught: the refinement's tolerance at 1e-3 (E off by 1.5e-5); the annealing
    column dropped from nnls (C = 0).
    """
    from nanolab.forecast import fit_schedule_curve

    noisy = curve(TOKENS) + np.random.default_rng(3).normal(0, 0.01, len(TOKENS))
    fit = fit_loss_curve(TOKENS[:12], noisy[:12], bootstrap=50, seed=3)
    previous = (1.915747321727442, 2.4029764879850637, 0.38386060249803133, 0.01261143272917774)
    assert (fit.E, fit.A, fit.alpha, fit.rmse) == pytest.approx(previous, rel=1e-6)
    assert fit.band(TOKENS[-1]) == pytest.approx((2.3019970420988107, 2.3423953276630605), rel=1e-6)
    steps = np.arange(20, 401, 10)
    y = schedule_curve(steps) + np.random.default_rng(3).normal(0, 0.003, len(steps))
    half = steps <= 200
    fit = fit_schedule_curve(steps[half], y[half], _planned(400), 400, bootstrap=50, seed=3)
    previous = (1.5716811255589316, 3.104775262545333, 0.43986893324017845, 0.21115372795302856)
    assert (fit.L0, fit.A, fit.alpha, fit.C) == pytest.approx(previous, rel=1e-6)
    assert fit.decay == 0.0
    assert fit.predict(400) == pytest.approx(1.6726630488271368, rel=1e-6)
    assert fit.band(400) == pytest.approx((1.521280493815438, 1.7243332191610676), rel=1e-6)


def _write_scheduled_run(root: Path, name: str, last: int, max_steps: int = 400,
                         lr_shift: float = 1.0, older_log: int = 0,
                         by_budget: bool | None = None) -> None:  # fmt: skip
    """A run log with the schedule in its config and the LR in its train records (the rate the
    step trained with, as ``nanolab fit`` logs it; up to step ``older_log``: the next step's, as
    it logged before; ``lr_shift`` != 1 makes the log disagree). ``by_budget``: a run of
    ``trainer.max_steps -1`` that ``budget.max_tokens`` planned for ``max_steps`` (False: a log
    from before the start record said so)."""
    run = root / name
    run.mkdir(parents=True)
    planned = _planned(max_steps)
    trainer = {"max_steps": -1 if by_budget is not None else max_steps}
    config = {"seed_everything": 1, "trainer": trainer, "run": {"name": name},
              "model": {"schedule": SCHED, "optimizer": {"lr": 1e-3}}}  # fmt: skip
    lines = [{"event": "start", "time": 0.0, "step": 0, "config": config}]
    if by_budget:
        lines[0]["planned_steps"] = max_steps
    rng = np.random.default_rng(7)
    for step in range(1, last + 1):
        lines.append({"event": "train", "time": float(step), "step": step, "tokens": 1000 * step,
                      "loss": 3.0, "lr": 1e-3 * planned(step - (step > older_log)) * lr_shift,
                      "gpu_hours": step * 1e-3})  # fmt: skip
        if step % 10 == 0:
            loss = float(schedule_curve(np.array([step]))[0] + rng.normal(0, 0.002))
            lines.append({"event": "val", "time": float(step), "step": step,
                          "tokens": 1000 * step, "val_loss": loss})  # fmt: skip
    if last == max_steps:
        lines.append({"event": "end", "time": last + 1.0, "step": last, "reason": "completed",
                      "tokens": 1000 * last})  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_report_forecast_reads_the_schedule_and_checks_it_against_the_log(tmp_path, capsys):
    """``report --forecast`` on a run 50% done whose config holds its schedule: the schedule
    model is used and the final loss is forecast near the truth, inside its band, the fitted
    curve runs to max_steps, and a target reached only by a longer run of the same recipe is
    given in tokens. When the logged LRs disagree with the config's schedule (a module with
    its own schedule), the power law in tokens is used instead.

    Mutations caught: the logged LR compared with one alignment only (every real run of the
    other falls back to the power law); the target searched only within the plan.
    """
    _write_scheduled_run(tmp_path, "sched", last=200)
    _write_scheduled_run(tmp_path, "older", last=200, older_log=120)  # resumed across releases
    _write_scheduled_run(tmp_path, "other", last=200, lr_shift=1.5)
    truth = float(schedule_curve(np.array([400]))[0])
    assert main([str(tmp_path), "--json", "--target-loss", str(truth - 0.02)]) == 0
    data = json.loads(capsys.readouterr().out)["forecasts"]
    f = data["sched"]
    assert f["model"] == "schedule" and f["final_tokens"] == 400_000
    assert f["final_loss"] == pytest.approx(truth, abs=0.03)
    assert f["final_band"][0] <= truth <= f["final_band"][1]
    assert f["curve"][-1][0] == 400_000
    assert f["curve"][0][0] == 20_000  # drawn from the end of warmup, where the fit starts
    assert f["target_band"][0] <= f["target_tokens"] <= f["target_band"][1]
    assert f["target_tokens"] > 400_000 and f["target_gpu_hours"] == pytest.approx(
        f["target_tokens"] * 1e-6
    )
    assert data["older"]["model"] == "schedule"
    assert data["older"]["final_loss"] == pytest.approx(f["final_loss"], rel=1e-6)
    assert data["other"]["model"] == "power law"


def test_report_forecast_reads_the_planned_end_of_a_run_a_token_budget_planned(tmp_path, capsys):
    """``trainer.max_steps -1``: fit plans the cosine to where ``budget.max_tokens`` stops the
    run, and the start record says where (``planned_steps``). The forecast rebuilt the schedule
    from ``trainer.max_steps`` (-1: 10,000 steps), the logged LRs disagreed, and every such run
    fell back to the power law with no end. A log without the record keeps that rule."""
    _write_scheduled_run(tmp_path, "sched", last=200)
    _write_scheduled_run(tmp_path, "budget", last=200, by_budget=True)
    _write_scheduled_run(tmp_path, "older", last=200, by_budget=False)
    assert main([str(tmp_path), "--json", "--forecast"]) == 0
    data = json.loads(capsys.readouterr().out)["forecasts"]
    assert data["budget"]["model"] == "schedule" and data["budget"]["final_tokens"] == 400_000
    assert data["budget"]["final_loss"] == pytest.approx(data["sched"]["final_loss"], rel=1e-6)
    assert data["older"]["model"] == "power law" and data["older"]["final_tokens"] is None


def test_until_a_quarter_of_the_annealing_is_seen_the_forecast_counts_none() -> None:
    """At 30% of a cosine run little of the annealing area has been seen: its size is a guess
    (on the quickstart's first 30% the best fit's final loss ranged from 1.45 to -2.96 with the
    annealing memory), so the forecast ahead counts none (the fit with C = 0) and the band spans
    both it and the fit with annealing. At 60% more than a quarter has been seen: the fit's own
    forecast and band.

    Mutations caught: the no-annealing bound left out of the band; the share computed over the
    observed part only (always 1: never used).
    """
    from nanolab.forecast import fit_schedule_curve

    steps = np.arange(20, 401, 10)
    y = schedule_curve(steps) + np.random.default_rng(3).normal(0, 0.001, len(steps))
    early = fit_schedule_curve(steps[steps <= 120], y[steps <= 120], _planned(400), 400,
                               bootstrap=30)  # fmt: skip
    assert early.annealing_seen() < 0.25 and not early.annealing_known
    L0, A, alpha = early.no_annealing
    s1, s2 = early.areas[early.decay][0][400], early.areas[early.decay][1][400]
    plain = L0 + A * s1**-alpha + early.offset
    annealed = early.L0 + early.A * s1**-early.alpha - early.C * s2 + early.offset
    assert early.predict(400) == pytest.approx(plain) and annealed < plain - 0.05
    lo, hi = early.band(400)
    assert lo <= annealed and plain <= hi
    late = fit_schedule_curve(steps[steps <= 240], y[steps <= 240], _planned(400), 400,
                              bootstrap=30)  # fmt: skip
    assert late.annealing_seen() >= 0.25 and late.annealing_known
    assert late.predict(400) == pytest.approx(float(schedule_curve(np.array([400]))[0]), abs=0.02)
    assert late.band(400)[1] - late.band(400)[0] < hi - lo


def test_forecast_starts_where_the_curve_is() -> None:
    """A curve the model cannot follow at its front (the last points fall 0.03-0.05 below the
    law): the forecast from the last point on is shifted by the mean residual of the last two
    points, so at a finished run's last step it is the loss it logged (within 0.01), not the
    fit's 0.04 misfit.

    Mutations caught: no shift (0.04 off at the end); the shift applied before the last point too
    (the fitted history moved).
    """
    from nanolab.forecast import fit_schedule_curve

    steps = np.arange(20, 401, 10)
    y = schedule_curve(steps)
    y[-3:] -= (0.03, 0.04, 0.05)
    fit = fit_schedule_curve(steps, y, _planned(400), 400, bootstrap=20)
    assert fit.offset < -0.01
    assert fit.predict(400) == pytest.approx(float(y[-1]), abs=0.01)
    assert fit.predict(200) == pytest.approx(float(y[steps == 200][0]), abs=0.01)


@pytest.mark.slow  # a row of a kind the default run covers (the suite's time)
def test_forecast_check_compares_both_forecasters_and_replays_the_payoff_rule(tmp_path, capsys):
    """``benches/forecast_check.py --payoff`` on a finished run whose config holds its schedule:
    both forecasters' rows (the schedule one near the truth and inside its band), and where the
    payoff rule would have stopped it (a loose threshold: before the end, with the loss given
    up; a tight one: never).

    Mutations caught: the replay's gain taken at the band's high edge (stops at once); the
    schedule forecaster's row silently using the power law.
    """
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "forecast_check", Path(__file__).resolve().parents[1] / "benches" / "forecast_check.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    _write_scheduled_run(tmp_path, "done", last=400)
    assert bench.main([str(tmp_path), "--cuts", "0.5", "--payoff", "0.1", "--bootstrap", "30"]) == 0
    out = capsys.readouterr().out
    (row,) = [ln.split() for ln in out.splitlines() if ln.startswith("done ")]
    assert row[1] == "50%" and abs(float(row[8])) < 0.03 and row[9] == "in", out
    (replay,) = [ln for ln in out.splitlines() if ln.startswith("payoff 0.1: done")]
    step = int(replay.split("stops at step ")[1].split()[0])
    assert 60 <= step < 400 and "given up" in replay, replay
    assert (
        bench.main([str(tmp_path), "--cuts", "0.5", "--payoff", "1e-9", "--bootstrap", "30"]) == 0
    )
    assert "payoff 1e-09: done runs to the end" in capsys.readouterr().out


def test_a_finished_seed_groups_final_loss_is_the_mean_of_its_seeds() -> None:
    """A group's curve holds one point per seed at each validation: "final val loss" is their
    mean at the last step (it was the worst seed's, the tuple max)."""
    from nanolab.forecast.run import CurveInputs, forecast

    seeds = [(s, s * 100.0, 4.0 - s / 100 + k * 0.01) for s in (10, 20, 30, 40) for k in range(3)]
    f = forecast(CurveInputs(points=seeds, max_steps=40, tokens_per_step=100.0), bootstrap=10)
    assert f.finished and f.last_loss == pytest.approx(3.6 + 0.01)  # 3.60, 3.61, 3.62


def test_a_later_validate_is_no_point_of_the_forecast_curve(tmp_path, capsys) -> None:
    """``nanolab validate`` after training appends a ``val`` record at the checkpoint's step,
    marked ``evaluated_by`` and without tokens. The forecast kept the last record per step, so
    that one replaced training's last point, was then dropped for its missing tokens: a
    finished run read as 39 points and forecast, and the group's final loss was the mean
    without it. The plot's val curve drew the validate's loss as training's too.

    Mutations caught: the forecast or the plot reading every ``val`` record."""
    from nanolab.report import plot_runs, summarize_run

    for name in ("done-s1", "done-s2"):
        _write_scheduled_run(tmp_path, name, last=400)
    assert main([str(tmp_path), "--json", "--forecast"]) == 0
    before = json.loads(capsys.readouterr().out)
    log = tmp_path / "done-s1" / "metrics.jsonl"
    with log.open("a") as f:
        f.write(json.dumps({"event": "val", "time": 500.0, "step": 400, "val_loss": 9.0,
                            "evaluated_by": "nanolab validate", "checkpoint": "x.ckpt"}) + "\n")  # fmt: skip
    assert main([str(tmp_path), "--json", "--forecast"]) == 0
    after = json.loads(capsys.readouterr().out)
    run = after["forecasts"]["done-s1"]
    assert run["finished"] and run["points"] == 40
    assert run["last_loss"] == before["forecasts"]["done-s1"]["last_loss"]
    assert after["group_forecasts"] == before["group_forecasts"]
    assert main([str(tmp_path), "--forecast"]) == 0
    assert "done-s1: finished (40 val points)" in capsys.readouterr().out
    summary = summarize_run("done-s1", tmp_path / "done-s1")
    (drawn,) = plot_runs([(summary, tmp_path / "done-s1")], tmp_path / "loss.png", "tokens")
    assert drawn["val_band"][-1][1] == pytest.approx(run["last_loss"])


def test_a_forecast_counts_steps_not_the_copies_a_group_pools(tmp_path, capsys) -> None:
    """A seed group fits its seeds' points together, and they share their steps: two runs of 3
    validations each are 3 places on the curve, not 6. They were fitted (exactly: rmse ~0)
    while one run alone needed 5 points.

    Mutations caught: the minimum counting points rather than distinct steps (or tokens)."""
    from nanolab.forecast.annealing import fit_schedule_curve

    steps = [10, 20, 30] * 2
    losses = [float(schedule_curve(np.array([s]))[0]) for s in steps]
    with pytest.raises(ForecastError, match=r"6 usable validation point.* at 3 distinct steps; "
                       r"a forecast needs at least 5 steps"):  # fmt: skip
        fit_schedule_curve(steps, losses, _planned(400), 400, bootstrap=5)
    with pytest.raises(ForecastError, match="at 3 distinct token counts"):
        fit_loss_curve([1000, 2000, 3000] * 2, [3.0, 2.5, 2.2] * 2, bootstrap=5)
    for name in ("short-s1", "short-s2"):
        _write_scheduled_run(tmp_path, name, last=30)
    assert main([str(tmp_path), "--json", "--forecast"]) == 0
    (group,) = json.loads(capsys.readouterr().out)["group_forecasts"].values()
    assert group["fit"] is None and "at 3 distinct steps" in group["note"]


def test_nanolabs_cosine_gives_its_whole_schedule_at_once() -> None:
    """``WarmupCosine.multipliers`` is every step's ``__call__`` (warmup, cosine, the floor
    past ``decay_steps``, a warmup longer than the decay), and the forecast reads the schedule
    through it, not one Python call per step (200,000 calls a refit on a long run).

    Mutations caught: ``multipliers_array`` calling the schedule per step; the floor applied
    from ``decay_steps + 1``; warmup counted from 0 instead of 1/(warmup+1).
    """
    from nanolab.forecast.annealing import multipliers_array
    from nanolab.training.optim import WarmupCosine

    for cosine in (WarmupCosine(50, 300, 0.1), WarmupCosine(0, 1, 0.0), WarmupCosine(10, 5, 0.2)):
        steps = cosine.decay_steps + 40
        assert cosine.multipliers(steps).tolist() == [cosine(i) for i in range(steps)]

    class Uncalled(WarmupCosine):
        def __call__(self, step: int) -> float:
            raise AssertionError("called per step")

    planned = Uncalled(700, 1_000_000, 0.1)
    assert multipliers_array(planned, 1_000_000)[-1] == pytest.approx(0.1)


def test_a_schedule_is_evaluated_once_for_every_refit_under_it() -> None:
    """Refits under the same schedule (the payoff rule's, one per validation) read its
    multipliers once: again for the same planned length, and for a shorter one (a budget
    moving the end step) the areas are the first steps of the longer plan's, equal to a fresh
    computation. Another schedule (other settings) is computed anew.

    Mutations caught: no cache (the schedule called again at every refit); a shorter plan
    given the longer plan's whole areas (its annealing measured against the wrong end); a
    cache keyed by length only (another cosine given the first one's areas).
    """
    calls = []

    def schedule(step: int) -> float:
        calls.append(step)
        return 1.0 if step < 300 else 0.5 + 0.5 * math.cos(math.pi * (step - 300) / 700)

    from nanolab.forecast import fit_schedule_curve

    steps = np.arange(100, 501, 50)
    losses = 2.0 + 3.0 * (steps / 100.0) ** -0.3
    for _ in range(3):  # three validations' refits
        fit_schedule_curve(steps, losses, schedule, 1000, bootstrap=10)
    assert len(calls) == 1000  # once, not once a refit
    calls.clear()

    from nanolab.forecast.annealing import AreasCache, multipliers_array, schedule_areas

    cache = AreasCache()
    first = cache.areas(schedule, 1000, (0.0, 0.999))
    assert len(calls) == 1000
    again = cache.areas(schedule, 1000, (0.0, 0.999))
    shorter = cache.areas(schedule, 600, (0.0, 0.999))
    assert len(calls) == 1000  # neither evaluated it again
    assert np.array_equal(again[0.999][1], first[0.999][1])
    fresh = schedule_areas(multipliers_array(schedule, 600), 0.999)
    assert len(shorter[0.999][0]) == 601
    assert np.array_equal(shorter[0.999][0], fresh[0]) and np.array_equal(
        shorter[0.999][1], fresh[1]
    )

    from nanolab.training.optim import WarmupCosine

    one, other = WarmupCosine(10, 500, 0.1), WarmupCosine(10, 500, 0.5)
    low, high = cache.areas(one, 500, (0.0,)), cache.areas(other, 500, (0.0,))
    assert low[0.0][0][-1] < high[0.0][0][-1]  # the higher floor: more forward area
    assert np.array_equal(cache.areas(WarmupCosine(10, 500, 0.1), 500, (0.0,))[0.0][0], low[0.0][0])


def test_even_points_bound_a_refit_and_keep_the_newest() -> None:
    """``even_points`` keeps at most ``limit`` points, the first and the newest among them,
    evenly spaced; from one validation to the next the kept older points stay the same (until
    the stride doubles), so a thinned forecast does not jump; under the limit it keeps all.

    Mutations caught: the newest point dropped (the forecast ignores the latest validation);
    a stride of ``n // limit`` (the kept set shifting at every validation); more than
    ``limit`` kept.
    """
    from nanolab.forecast import even_points

    assert even_points(list(range(7)), 10) == list(range(7))
    for n in (101, 150, 1000, 4001):
        kept = even_points(list(range(n)), 100)
        assert len(kept) <= 100 and kept[0] == 0 and kept[-1] == n - 1
        gaps = {b - a for a, b in itertools.pairwise(kept[:-1])}
        assert len(gaps) <= 1
    now, later = even_points(list(range(1000)), 100), even_points(list(range(1001)), 100)
    assert now[:-1] == later[:-1][: len(now) - 1]


def test_a_forecast_fits_a_bounded_even_sample_with_the_newest_steps_and_lands_the_same(
    monkeypatch,
) -> None:
    """A run validated very often (here 1,500 points, the cap lowered to 200) is fitted on an
    even sample of its validation steps plus the newest ones whole (a seed group: every seed's
    point at each step kept), and forecasts the same end, inside the full fit's band; a run
    under the cap is fitted on every point, unchanged.

    Mutations caught: every point fitted (the refits' cost grows with the log: 41,666 points
    took 32 s); the newest steps dropped (the offset comes from the last residuals).
    """
    from nanolab.forecast import run
    from nanolab.forecast.run import CurveInputs, forecast

    fitted: list[list[float]] = []
    real = run.fit_schedule_curve

    def spy(steps, *args, **kwargs):
        fitted.append(list(steps))
        return real(steps, *args, **kwargs)

    monkeypatch.setattr(run, "fit_schedule_curve", spy)
    steps = np.arange(21, 1521)
    y = schedule_curve(steps, max_steps=3000) + np.random.default_rng(0).normal(0, 0.003, 1500)
    inputs = CurveInputs(points=[(float(s), float(s), float(v)) for s, v in zip(steps, y, strict=True)],
                         max_steps=3000, tokens_per_step=1.0, schedule_for=_planned,
                         warmup_steps=SCHED["warmup_steps"])  # fmt: skip
    full = forecast(inputs, bootstrap=50)
    assert fitted[-1] == [float(s) for s in steps]  # under the cap: every point
    monkeypatch.setattr(run, "FIT_POINTS", 200)
    thinned = forecast(inputs, bootstrap=50)
    kept = fitted[-1]
    assert 100 <= len(kept) <= 200 and kept[0] == 21.0
    assert kept[-run.FIT_LAST :] == [float(s) for s in steps[-run.FIT_LAST :]]
    assert thinned.points == full.points == 1500 and thinned.last_loss == full.last_loss
    assert full.final_band[0] <= thinned.final_loss <= full.final_band[1]
    assert thinned.final_band[0] <= full.final_loss <= thinned.final_band[1]
    seeds = [(s, t, v + k * 0.01) for s, t, v in inputs.points for k in range(3)]
    forecast(CurveInputs(**{**inputs.__dict__, "points": seeds}), bootstrap=5)
    assert len(fitted[-1]) <= 200 and fitted[-1][-3:] == [1520.0] * 3  # whole steps, all seeds


# -- runs resumed with other settings ----------------------------------------------------------
def _write_launches(root: Path, name: str, launches: list[tuple[int, int, dict]],
                    plan: int = 400, branch_at: int = 0, own: bool = True) -> None:  # fmt: skip
    """A run log of several launches, each ``(to step, tokens per step, start fields)``, as
    ``nanolab fit`` writes them: each launch after the first resumes from the step the one
    before it reached; every step trains at the LR of the cosine the first launch planned for
    ``plan`` steps (the checkpoint keeps that plan); a validation every 10 steps on the curve of
    that schedule; GPU-hours 1e-3 per step, counted from the first launch. ``branch_at``: the
    first launch starts a new run from step ``branch_at`` of another run's checkpoint (its
    tokens go on from there, its GPU-hours count from 0); ``own``: the train records say which
    tokens are the run's own (``run_tokens``), as an older log does not."""
    from nanolab.forecast.annealing import multipliers_array, schedule_areas

    run = root / name
    run.mkdir(parents=True)
    planned = _planned(plan)
    s1, s2 = schedule_areas(multipliers_array(planned, 2000), 0.9)
    rng = np.random.default_rng(7)
    step, tokens = branch_at, branch_at * launches[0][1]
    lines: list[dict] = []
    for to_step, per_step, fields in launches:
        trainer = {"max_steps": fields.get("planned_steps", plan)}
        config = {"seed_everything": 1, "trainer": trainer, "run": {"name": name},
                  "model": {"schedule": SCHED, "optimizer": {"lr": 1e-3}}}  # fmt: skip
        lines.append({"event": "start", "time": float(step), "step": step,
                      "resumed_from_step": step or None, "config": config, **fields})  # fmt: skip
        if branch_at and len(lines) == 1:
            lines[0].update(run_dir=f"runs/{name}", resumed_from="runs/parent/last.ckpt")
        while step < to_step:
            step, tokens = step + 1, tokens + per_step
            lines.append({"event": "train", "time": float(step), "step": step, "tokens": tokens,
                          "loss": 3.0, "lr": 1e-3 * planned(step - 1),
                          "gpu_hours": (step - branch_at) * 1e-3,
                          **({"run_tokens": tokens - branch_at * launches[0][1]} if own else {})})  # fmt: skip
            if step % 10 == 0:
                loss = TRUE["L0"] + TRUE["A"] * s1[step] ** -TRUE["alpha"] - TRUE["C"] * s2[step]
                lines.append({"event": "val", "time": float(step), "step": step, "tokens": tokens,
                              "val_loss": float(loss + rng.normal(0, 0.002))})  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_a_resume_with_more_tokens_per_step_forecasts_in_the_tokens_it_trains(tmp_path, capsys):
    """A run of 1000 tokens per step resumed at step 100 with the accumulation doubled: step s
    after it is at 100k + 2000 (s - 100) tokens. The forecast mapped steps to tokens at the
    run's average so far (1500), so ``at max_steps`` said 600k where the run ends at 700k, the
    tokens to a target were as much too few, and the drawn curve missed the run's own points.
    An older log whose start records hold no ``global_batch_tokens`` reads the rate off its
    last two train records.

    Mutations caught: one rate for the whole run; the past steps at the current rate."""
    launches = [(100, 1000, {"global_batch_tokens": 1000}),
                (200, 2000, {"global_batch_tokens": 2000})]  # fmt: skip
    _write_launches(tmp_path, "resumed", launches)
    _write_launches(tmp_path, "older", [(t, p, {}) for t, p, _ in launches])
    truth = float(schedule_curve(np.array([300]))[0])  # reached at step ~300: 500k tokens
    assert main([str(tmp_path), "--json", "--target-loss", str(truth)]) == 0
    data = json.loads(capsys.readouterr().out)["forecasts"]
    for f in data.values():
        assert f["model"] == "schedule" and f["final_tokens"] == 700_000
        assert f["curve"][0][0] == 20_000 and f["curve"][-1][0] == 700_000
        on_the_log = {1000 * s for s in range(101)} | {100_000 + 2000 * s for s in range(301)}
        assert all(x in on_the_log for x, _ in f["curve"]), f["curve"]
        assert f["target_tokens"] in on_the_log  # at a step: the fit puts it near step 300
        assert f["target_tokens"] == pytest.approx(500_000, rel=0.1)


def test_a_resume_with_a_longer_max_steps_is_forecast_on_the_plan_it_keeps(tmp_path, capsys):
    """A run planned for 400 steps, stopped at 200 and resumed with ``trainer.max_steps`` 600:
    the resume keeps the cosine of 400 (its checkpoint holds it; the steps past 400 train at
    the minimum). The forecast checked the logged LRs against a cosine of 600, found them
    different and fell back to the power law "without a known schedule". A branch (started
    from another run's checkpoint) plans its own cosine; a resume of its own keeps that.

    Mutations caught: the plan read from the last launch; a branch's start not planning."""
    from nanolab.forecast.annealing import multipliers_array, schedule_areas

    launches = [(200, 1000, {"planned_steps": 400}), (300, 1000, {"planned_steps": 600})]
    _write_launches(tmp_path, "longer", launches)
    assert main([str(tmp_path), "--json", "--forecast"]) == 0
    f = json.loads(capsys.readouterr().out)["forecasts"]["longer"]
    s1, s2 = schedule_areas(multipliers_array(_planned(400), 601), 0.9)
    truth = TRUE["L0"] + TRUE["A"] * s1[600] ** -TRUE["alpha"] - TRUE["C"] * s2[600]
    assert f["model"] == "schedule" and f["final_tokens"] == 600_000
    assert f["final_loss"] == pytest.approx(truth, abs=0.03)
    from nanolab.report.forecasts import plans_lr_schedule

    branch = {"resumed_from_step": 200, "run_dir": "runs/br",
              "resumed_from": "runs/par/checkpoints/step-00000200.ckpt"}  # fmt: skip
    own = {**branch, "resumed_from_step": 230, "resumed_from": "runs/br/checkpoints/last.ckpt"}
    assert plans_lr_schedule({"resumed_from_step": None}) and plans_lr_schedule(branch)
    assert not plans_lr_schedule(own) and not plans_lr_schedule({"resumed_from_step": 200})
    assert plans_lr_schedule({**own, "branched": True})  # the record says so: no path guessed
    assert not plans_lr_schedule({**branch, "branched": False})


def test_a_branchs_hours_to_a_target_are_a_whole_runs_at_its_rate_and_say_so(tmp_path, capsys):
    """A branch from step 200 (200k tokens) of another run, at 300k tokens now, 1e-6 GPU-h per
    token of its own. Its "to X" figure is the tokens from step 0 where its curve reaches X
    (its parent's 200k with them) at the branch's rate: a whole run to X, not what finishing
    the branch costs ((X - 300k) tokens) nor its own share ((X - 200k)). Nothing said so: a
    reader took the figure for the cost of going on. The heading says what it is now.

    Mutations caught: the figure changed to another count; the heading not saying it."""
    _write_launches(tmp_path, "branch", [(300, 1000, {"planned_steps": 400})], branch_at=200)
    target = float(schedule_curve(np.array([350]))[0])
    assert main([str(tmp_path), "--json", "--target-loss", str(target)]) == 0
    f = json.loads(capsys.readouterr().out)["forecasts"]["branch"]
    whole = f["target_tokens"] * 1e-6
    assert f["target_gpu_hours"] == pytest.approx(whole, rel=1e-9)
    assert 300_000 < f["target_tokens"] < 400_000  # on the branch's curve, parent's included
    assert main([str(tmp_path), "--target-loss", str(target)]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("  branch:")]
    hours = "device-h"  # the log names no accelerator
    assert line.endswith(f", {whole:.3g} {hours}"), line
    for other in (f["target_tokens"] - 200_000, f["target_tokens"] - 300_000):
        assert f"{other * 1e-6:.3g} {hours}" not in line
    heading = next(x for x in out.splitlines() if x.startswith("forecast: "))
    assert heading.endswith(
        f"; to {target}: the tokens from step 0 (a branch's with its parent's) and their {hours} "
        f"and cost at the run's own rate: a whole run to {target}, not what is left"
    ), heading


def test_a_branchs_gpu_hours_are_per_token_of_its_own(tmp_path, capsys):
    """A branch from step 200 of another run: its tokens go on from its parent's 200k, its
    GPU-hours count from 0 (1e-3 per step of 1000 tokens: 1e-6 per token). The forecast divided
    them by all its tokens, the parent's too (3x low here, 1000x for a fine-tune of a long
    pretrain). A branch's older log, which does not say which tokens were its own, gives no
    GPU-hours rather than a wrong number.

    Mutations caught: the hours over the model's tokens; an older branch read as a new run."""
    _write_launches(tmp_path, "branch", [(300, 1000, {"planned_steps": 400})], branch_at=200)
    _write_launches(tmp_path, "older", [(300, 1000, {"planned_steps": 400})], branch_at=200,
                    own=False)  # fmt: skip
    truth = float(schedule_curve(np.array([350]))[0])
    assert main([str(tmp_path), "--json", "--target-loss", str(truth)]) == 0
    data = json.loads(capsys.readouterr().out)["forecasts"]
    f = data["branch"]
    assert f["model"] == "schedule" and f["target_tokens"] > 300_000
    assert f["target_gpu_hours"] == pytest.approx(f["target_tokens"] * 1e-6, rel=1e-9)
    assert data["older"]["target_tokens"] == f["target_tokens"]
    assert data["older"]["target_gpu_hours"] is None
