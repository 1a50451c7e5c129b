"""The loss forecaster (``nanolab.forecast``) on curves with a known answer, and ``nanolab report
--forecast --target-loss`` over run logs written the way ``nanolab fit`` writes them.

Each test names, in its docstring, the mutation of nanolab it was seen to catch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from nanolab.forecast import ForecastError, fit_loss_curve
from nanolab.report import main

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
    assert "forecast: L = E + A*D^-alpha" in table and "at max_steps (400k tokens)" in table
    assert "1.0: the fitted floor" in table and "not reachable" in table
    assert "group exp" in table


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
