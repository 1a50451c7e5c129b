"""How well does the loss forecast extrapolate? Checked offline on finished runs.

For every finished run under the given folders, the validation curve is cut at 30% and 50% of
the run's steps; both forecasters are fitted on the part before the cut and asked for the final
validation loss: ``schedule`` (the loss over the run's LR schedule, what ``nanolab report
--forecast`` and the budget's payoff rule use) and ``power law`` (L = E + A*D^-alpha in tokens,
the fallback when the schedule is unknown). Printed per run and cut: each forecast's error
against the run's actual final val loss and whether the actual value fell inside its 5-95%
band; then the mean and max error and the band coverage per forecaster and cut::

    python benches/forecast_check.py runs/                 # every finished run under runs/
    python benches/forecast_check.py runs/ --cuts 0.3 0.5 0.7
    python benches/forecast_check.py runs/ --payoff 0.05   # + where budget.payoff_threshold 0.05
                                                          #   would have stopped each run

``--payoff`` replays the budget's payoff rule on each finished run's log: at each validation,
the forecast of the curve so far, and the first step where the optimistic gain still on offer
(forecast now minus the band's low edge at max_steps) falls below the threshold, with the loss
given up by stopping there (the run's final val loss minus its val loss at that step).

Runs need enough evaluations for the cut to keep at least 5 points after warmup (e.g.
``run.eval_every_steps`` at a twentieth of ``trainer.max_steps``). Exit 1 when no run could be
checked.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from nanolab.forecast import forecast  # noqa: E402
from nanolab.report import discover_runs, forecast_inputs, summarize_run  # noqa: E402

MODELS = ("schedule", "power law")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs_dirs", nargs="+", type=Path)
    p.add_argument("--cuts", nargs="+", type=float, default=[0.3, 0.5])
    p.add_argument("--bootstrap", type=int, default=200)
    p.add_argument("--payoff", type=float, metavar="THRESHOLD", help="replay the payoff rule")
    args = p.parse_args(argv)
    rows: list[str] = []
    errors = {(m, c): [] for m in MODELS for c in args.cuts}
    inside = dict.fromkeys(errors, 0)
    for name, run_dir in discover_runs(args.runs_dirs):
        if summarize_run(name, run_dir).status != "completed":
            continue
        full = forecast_inputs(run_dir)
        if len(full.points) < 2 or not full.max_steps:
            continue
        final_step, _, actual = full.points[-1]
        for cut in args.cuts:
            seen = [pt for pt in full.points if pt[0] <= cut * final_step]
            cells = []
            for model in MODELS:
                part = replace(full, points=seen)
                if model == "power law":
                    part = replace(part, schedule_for=None)
                elif part.schedule_for is None:
                    cells.append(f"{'(no schedule in config)':<38}")
                    continue
                f = forecast(part, bootstrap=args.bootstrap)
                if f.final_loss is None:
                    cells.append(f"{'no forecast: ' + str(f.note):<38}"[:38])
                    continue
                lo, hi = f.final_band
                hit = lo <= actual <= hi
                errors[(model, cut)].append(f.final_loss - actual)
                inside[(model, cut)] += hit
                flag = "*" if f.fit and f.fit.get("degenerate") else " "
                cells.append(f"{f.final_loss:7.4f} [{lo:7.4f},{hi:7.4f}] {f.final_loss - actual:+7.4f}"
                             f" {'in ' if hit else 'out'}{flag}")  # fmt: skip
            rows.append(
                f"{name:<14} {cut:>4.0%} {len(seen):>4}  {actual:7.4f}  " + "  ".join(cells)
            )
    if not rows:
        print("forecast_check: no finished run with a validation curve found", file=sys.stderr)
        return 1
    cell = "forecast [5%,   95%]      error band"
    print(f"{'run':<14} {'cut':>4} {'pts':>4}  {'actual':>7}  {'schedule: ' + cell:<38}  "
          f"{'power law: ' + cell}")  # fmt: skip
    print("\n".join(rows))
    print("(* = degenerate fit: the points do not pin the curve's shape)")
    if args.payoff is not None:
        for name, run_dir in discover_runs(args.runs_dirs):
            if summarize_run(name, run_dir).status == "completed":
                print(replay_payoff(name, forecast_inputs(run_dir), args.payoff, args.bootstrap))
    for (model, cut), errs in errors.items():
        if errs:
            mae = statistics.fmean(abs(e) for e in errs)
            print(f"{model:<9} fitted on the first {cut:.0%}: mean |error| {mae:.4f}, max "
                  f"{max(abs(e) for e in errs):.4f}, mean error {statistics.fmean(errs):+.4f}, "
                  f"in band {inside[(model, cut)]}/{len(errs)}")  # fmt: skip
    return 0


def replay_payoff(name: str, full, threshold: float, bootstrap: int) -> str:
    """Where ``budget.payoff_threshold`` would have stopped a finished run (see the module)."""
    from nanolab.callbacks.budget import PAYOFF_POINTS
    from nanolab.forecast import MIN_POINTS, ForecastError, even_points, fit_curve

    end, final = full.max_steps, full.points[-1][2]
    for k in range(1, len(full.points) + 1):
        step, _, val = full.points[k - 1]
        after = [p for p in full.points[:k] if p[0] >= full.warmup_steps]
        if len(after) < MIN_POINTS:
            continue
        part = replace(full, points=even_points(after, PAYOFF_POINTS))  # as the rule fits
        try:
            fit = fit_curve(part, bootstrap=bootstrap)
        except ForecastError:
            continue
        lo, hi = fit.band(end)
        gain = max(0.0, fit.predict(step) - lo)
        if gain < threshold:
            return (f"payoff {threshold:g}: {name} stops at step {step:.0f} of {end} (val {val:.4f};"
                    f" forecast at {end}: {fit.predict(end):.4f} [{lo:.4f}, {hi:.4f}], at best "
                    f"{gain:.4f} better); its final val {final:.4f}: {val - final:.4f} given up")  # fmt: skip
    return f"payoff {threshold:g}: {name} runs to the end (final val {final:.4f})"


if __name__ == "__main__":
    sys.exit(main())
