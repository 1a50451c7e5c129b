"""How well does the loss forecast extrapolate? Checked offline on finished runs.

For every finished run under the given folders, the validation curve is cut at 30% and 50% of
the run's tokens; ``nanolab.forecast`` is fitted on the part before the cut and asked for the
final validation loss; the error against the run's actual final val loss is printed with
whether the actual value fell inside the forecast's 5-95% band::

    python benches/forecast_check.py runs/                 # every finished run under runs/
    python benches/forecast_check.py runs/ --cuts 0.3 0.5 0.7

Runs need enough evaluations for the cut to keep at least 5 points (e.g. ``run.eval_every_steps``
at a thirtieth of ``trainer.max_steps``). Exit 1 when no run could be checked.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from nanolab.forecast import ForecastError, fit_loss_curve  # noqa: E402
from nanolab.report import discover_runs, forecast_inputs, summarize_run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs_dirs", nargs="+", type=Path)
    p.add_argument("--cuts", nargs="+", type=float, default=[0.3, 0.5])
    args = p.parse_args(argv)
    rows, errors = [], {c: [] for c in args.cuts}
    inside = dict.fromkeys(args.cuts, 0)
    for name, run_dir in discover_runs(args.runs_dirs):
        if summarize_run(name, run_dir).status != "completed":
            continue
        points = forecast_inputs(run_dir)["points"]
        if len(points) < 2:
            continue
        final_tokens, actual = points[-1]
        for cut in args.cuts:
            seen = [pt for pt in points if pt[0] <= cut * final_tokens]
            try:
                fit = fit_loss_curve([t for t, _ in seen], [v for _, v in seen])
            except ForecastError as err:
                rows.append(f"{name:<16} {cut:>4.0%}  {len(seen):>3}  no forecast: {err}")
                continue
            pred = fit.predict(final_tokens)
            lo, hi = fit.band(final_tokens)
            hit = lo <= actual <= hi
            errors[cut].append(pred - actual)
            inside[cut] += hit
            rows.append(f"{name:<16} {cut:>4.0%}  {len(seen):>3}  {pred:8.4f} [{lo:.4f}, {hi:.4f}]"
                        f"  {actual:8.4f}  {pred - actual:+8.4f}  {'yes' if hit else 'no'}"
                        + ("  (degenerate: no saturation seen)" if fit.degenerate else ""))  # fmt: skip
    if not rows:
        print("forecast_check: no finished run with a validation curve found", file=sys.stderr)
        return 1
    print(f"{'run':<16} {'cut':>4}  {'pts':>3}  {'forecast [5%, 95%]':<27}  {'actual':>8}  "
          f"{'error':>8}  in band")  # fmt: skip
    print("\n".join(rows))
    for cut, errs in errors.items():
        if errs:
            mae = statistics.fmean(abs(e) for e in errs)
            print(f"fitted on the first {cut:.0%}: mean |error| {mae:.4f}, max "
                  f"{max(abs(e) for e in errs):.4f}, mean error {statistics.fmean(errs):+.4f}, "
                  f"in band {inside[cut]}/{len(errs)} (n={len(errs)})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
