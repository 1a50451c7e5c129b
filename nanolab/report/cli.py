"""``nanolab report``'s command line: which runs, which views, in what order."""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from nanolab.errors import one_line_errors
from nanolab.helpfmt import OneLineParser, given_path, relative_path_without_working_directory
from nanolab.messages import say
from nanolab.report.forecasts import ForecastReader, forecasts, format_forecasts
from nanolab.report.groups import (
    ReportError,
    compare_groups,
    config_groups,
    config_summaries,
    data_key,
    not_compared,
    seed_groups_holding,
    tests,
)
from nanolab.report.plot import (
    PlotReader,
    check_plot_path,
    default_plot_selection,
    plot_runs,
)
from nanolab.report.text import compare_runs, format_table
from nanolab.runlog import RUN_LOG_NAME
from nanolab.runs import (
    RESULTS_LOG,
    RunSummary,
    append_result,
    discover_runs,
    hours_label,
    indexed_runs,
    result_fields,
    summarize_run,
)

#: What ``--sort`` accepts: the summary's fields that hold one comparable value.
SORT_FIELDS = tuple(
    f.name
    for f in fields(RunSummary)
    if f.name
    not in (
        "group",
        "data_identity",
        "run_dir",
        "skipped_example",
        "task_scores",
        "eval_task_scores",
        "val_points",
    )
)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="nanolab report",
        description="Summarise runs from their metrics.jsonl logs (finished, stopped, crashed or "
        "still running).",
    )
    p.add_argument(
        "runs_dirs",
        nargs="*",
        type=given_path,
        metavar="RUNS_DIR",
        help="folders holding run directories, or run directories (default: runs)",
    )
    p.add_argument(
        "--run",
        action="append",
        default=[],
        metavar="NAME",
        help="only these runs (repeatable; shell-style patterns such as 'lr*')",
    )
    p.add_argument(
        "--sort",
        default="run",
        metavar="FIELD",
        help=f"sort by FIELD, '-FIELD' for descending; one of: {', '.join(SORT_FIELDS)}",
    )
    p.add_argument(
        "--json", action="store_true", help="print JSON (runs and seed groups) instead of a table"
    )
    p.add_argument(
        "--plot",
        type=Path,
        metavar="OUT.png",
        help="draw train and val loss: one colour per seed group, the mean over seeds and a "
        "95%% confidence band (without --run: the runs on the newest run's data and vocabulary)",
    )
    p.add_argument(
        "--x", choices=("tokens", "gpu_hours"), default="tokens", help="x axis of --plot"
    )
    p.add_argument("--logx", action="store_true", help="a logarithmic x axis in --plot")
    p.add_argument(
        "--compare",
        nargs=2,
        metavar=("A", "B"),
        help="the config keys where runs A and B differ, beside their results; when they are "
        "seeds of two groups, also whether the groups differ beyond seed noise",
    )
    p.add_argument(
        "--index",
        action="store_true",
        help="add the ended runs that <RUNS_DIR>/results.log lacks (runs that ended before it "
        "was kept, or elsewhere), one JSON line each; nothing in it is rewritten",
    )
    p.add_argument(
        "--baseline",
        metavar="GROUP",
        help="compare every seed group with this one (its label as the table prints it, or "
        "one of its runs): the difference, its 95%% interval and Welch's p-value (default: "
        "every pair of up to 4 groups; more, each with the lowest at the tokens all reached)",
    )
    p.add_argument(
        "--forecast",
        action="store_true",
        help="fit each run's val curve over its LR schedule: the final val loss at max_steps "
        "with a 5-95%% range (dashed in --plot)",
    )
    p.add_argument(
        "--target-loss",
        type=float,
        metavar="LOSS",
        help="with the forecast: tokens, GPU-hours and cost to reach this val loss",
    )
    p.add_argument(
        "--scaling",
        action="store_true",
        help="fit L(N, D) = E + A/N^alpha + B/D^beta over finished runs of >= 3 model sizes "
        "(docs/scaling.md)",
    )
    p.add_argument(
        "--gpu-hours",
        type=float,
        metavar="H",
        help="with --scaling: the compute-optimal model size and tokens for H GPU-hours",
    )
    return p


def _along(*readers: ForecastReader | PlotReader | None) -> Callable[[dict[str, Any]], None] | None:
    """What ``summarize_run`` hands each record of its pass to: the readers given, or None."""
    adds = [r.add for r in readers if r is not None]
    if not adds:
        return None
    if len(adds) == 1:
        return adds[0]

    def add(record: dict[str, Any]) -> None:
        for one in adds:
            one(record)

    return add


def update_index(roots: list[Path], summaries: list[RunSummary]) -> str:
    """Append to each root's results.log the ended runs under it that it lacks."""
    added = []
    for root in roots:
        if (root / RUN_LOG_NAME).is_file():
            continue  # a run directory given as a root: its root is its parent
        path = root / RESULTS_LOG
        have = indexed_runs(path)
        ended = [
            result_fields(s)
            for s in summaries
            if s.status not in ("running", "crashed")
            and Path(s.run_dir).resolve().parent == root.resolve()
        ]
        new = [f for f in ended if (f["run"], f["step"], f["reason"]) not in have]
        for f in new:
            append_result(path, f)
        added.append(f"{path}: {len(new)} run(s) added")
    return "index: " + ("; ".join(added) if added else "no folder of runs given")


def _select(found: list[tuple[str, Path]], patterns: list[str]) -> list[tuple[str, Path]]:
    if not patterns:
        return found
    names = [n for n, _ in found]
    unknown = [p for p in patterns if not fnmatch.filter(names, p)]
    if unknown:
        have = ", ".join(names[:12]) + (" ..." if len(names) > 12 else "")
        raise ReportError(
            f"--run: no run named {', '.join(map(repr, unknown))}; runs found: {have}"
        )
    return [(n, d) for n, d in found if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def _sort(summaries: list[RunSummary], spec: str) -> list[RunSummary]:
    desc = spec.startswith("-")
    key = spec.lstrip("-")
    if key not in SORT_FIELDS:
        raise ReportError(f"--sort: unknown field {key!r}; choose one of {', '.join(SORT_FIELDS)}")
    present = [s for s in summaries if getattr(s, key) is not None]
    absent = [s for s in summaries if getattr(s, key) is None]  # always last
    return sorted(present, key=lambda s: getattr(s, key), reverse=desc) + absent


def _scaling(
    args: argparse.Namespace, selected: list[tuple[str, Path]], summaries: list[Any]
) -> tuple[Any, Any]:
    """``--scaling`` / ``--gpu-hours``: the fit's text and data (None, None when not asked).

    One law is fitted to runs of one dataset and vocabulary only (a loss over 65 characters and
    one over 50k tokens are different quantities): without ``--run``, the newest run's, as
    ``--plot`` picks; a ``--run`` selection that spans several is refused. Of those, the runs
    of one recipe, each config and seed once (:mod:`nanolab.report.scaling`). The runs left
    out, and why, are listed under the fit, one line per reason."""
    if not args.scaling and args.gpu_hours is None:
        return None, None
    if args.gpu_hours is not None and not (math.isfinite(args.gpu_hours) and args.gpu_hours > 0):
        raise ReportError(f"--gpu-hours {args.gpu_hours}: give a positive number, e.g. 100")
    from nanolab.report.plot import default_plot_selection
    from nanolab.report.scaling import left_out_lines, runs_of, select
    from nanolab.scaling_fit import ScalingError, points_from_runs, scaling_report

    if args.run:
        kinds = {data_key(s) for s in summaries}
        if len(kinds) > 1:
            raise ReportError(
                f"--scaling: the runs --run selects were trained on {len(kinds)} different "
                "datasets or vocabularies, whose losses one law cannot fit; select the runs of "
                "one dataset"
            )
        kept = {s.run for s in summaries}
    else:
        kept = {s.run for s in default_plot_selection(summaries)[0]}
    other_data = [(name, "other data or vocabulary") for name, _ in selected if name not in kept]
    points, left_out = points_from_runs(runs_of(selected, kept))
    with_points = {p.run for p in points}
    chosen = select([s for s in summaries if s.run in with_points])
    points = [p for p in points if p.run in set(chosen.runs)]
    skipped = left_out + chosen.left_out + other_data
    try:
        text, data = scaling_report(points, args.gpu_hours)
    except ScalingError as err:
        others = sum(why.startswith("another recipe") for _, why in chosen.left_out)
        apart = (
            f" ({others} run(s) of other recipes left out, differing in "
            f"{', '.join(chosen.other_recipes)}: a law is fitted to one recipe's sweep)"
            if others and chosen.other_recipes
            else ""
        )
        raise ReportError(f"--scaling: {err}{apart}") from None
    data = {**data, "recipe": chosen.recipe}
    if skipped:
        text += "".join(f"\n  {line}" for line in left_out_lines(skipped))
        data["left_out"] = [f"{name} ({why})" for name, why in skipped]
    return text, data


def _compare_pair(everyone: list[RunSummary], pair: list[Any]) -> str:
    """``--compare``'s line on the two seed groups its runs belong to: their difference, or
    what kept them from being compared (a group with fewer than two usable seeds, or the two
    trained on other data or vocabularies)."""
    short = [g for g in pair if len(g.val_losses) < 2]
    other_data = not_compared(everyone, pair)
    if other_data:
        return f"\nseed groups: {other_data[0].sentence}"
    if not short:
        found = compare_groups(everyone, pair, baseline=pair[1].label)
        if found:
            return "\n".join(f"\nseed groups: {c.sentence}" for c in found)
        return ("\nseed groups: not compared: fewer than two seeds of each validated by the "
                "tokens both groups reached")  # fmt: skip
    why = "; ".join(
        f"{g.label} has {len(g.val_losses)} usable seed(s)"
        + (f" (left out: {', '.join(g.left_out)})" if g.left_out else "")
        for g in short
    )
    return f"\nseed groups: not compared: {why}; a comparison needs two in each group"


def no_runs_line(roots: list[Path], why: str) -> str:
    """The line of a report that found no runs: the folders it looked in, absolute (run from
    another folder, the default ``runs`` is that folder's), and how to point it elsewhere."""
    folders = ", ".join(str(r.absolute()) for r in roots)
    return (
        f"no runs under {folders} ({why}); runs appear there once `nanolab fit` has started: "
        "run it from the folder you ran `nanolab fit` in, or name the folder: nanolab report "
        "PROJECT/runs"
    )


@one_line_errors("nanolab report")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    given = [*(args.runs_dirs or [Path("runs")]), *([args.plot] if args.plot is not None else [])]
    if (gone := relative_path_without_working_directory(given)) is not None:
        raise ReportError(gone)
    if args.plot is not None:
        check_plot_path(args.plot)
    elif args.logx or args.x != "tokens":
        raise ReportError("--x and --logx shape the plot only; add --plot FILE.png")
    if args.compare and args.json:
        raise ReportError(
            "--json: --compare prints text only; drop --json (report --json without --compare "
            "has the runs, seed groups and comparisons)"
        )
    roots = args.runs_dirs or [Path("runs")]
    if not args.runs_dirs and not roots[0].exists():
        raise ReportError(no_runs_line(roots, "the folder does not exist"))
    found = discover_runs(roots)
    if not found:  # bad input, as nanolab status says of the same folder
        raise ReportError(no_runs_line(roots, f"no {RUN_LOG_NAME} found"))
    if args.compare:
        # Only the two runs and their seed groups are read whole (the other runs' configs
        # place them in groups): a long run beside them does not slow the comparison.
        now = time.time()
        known: dict[str, RunSummary] = {}
        print(compare_runs(found, *args.compare, known=known, now=now))
        pair = seed_groups_holding(found, args.compare, known, now)
        if len(pair) == 2:
            print(_compare_pair(list(known.values()), pair))
        return 0
    selected = _select(found, args.run)
    now = time.time()
    want_forecast = args.forecast or args.target_loss is not None
    if args.target_loss is not None and not 0 < args.target_loss < math.inf:
        raise ReportError(f"--target-loss {args.target_loss}: give a loss > 0, e.g. 1.5")
    # The forecast and the plot read each log along the summary's pass: one read of a long
    # log, not two or three.
    readers = {n: ForecastReader() for n, _ in selected} if want_forecast else {}
    plot_read = {n: PlotReader(args.x) for n, _ in selected} if args.plot is not None else {}
    summaries = _sort(
        [summarize_run(n, d, now, _along(readers.get(n), plot_read.get(n))) for n, d in selected],
        args.sort,
    )
    if args.index:
        say("nanolab report", update_index(roots, summaries))
    universe = config_summaries(found) if args.run else summaries
    configs = config_groups(summaries, universe)
    groups = [g for g in configs if len(g.runs) >= 2]
    lone = [g for g in configs if len(g.runs) == 1]  # named where they would be tested
    comparisons, untested = tests(summaries, groups, args.baseline, lone)
    apart = not_compared(summaries, groups)
    read = {n: readers[n].inputs(d) for n, d in selected} if readers else {}
    run_fc, group_fc = (
        forecasts(selected, groups, args.target_loss, read) if want_forecast else ({}, {})
    )
    scaling_text, scaling_data = _scaling(args, selected, summaries)
    not_drawn: list[str] = []
    if args.plot is not None:
        dirs = dict(selected)
        plotted, left_out = (summaries, 0) if args.run else default_plot_selection(summaries)
        plot_runs([(s, dirs[s.run]) for s in plotted], args.plot, args.x, run_fc, logx=args.logx,
                  universe=universe, left_out=not_drawn, read=plot_read)  # fmt: skip
    if args.json:
        payload = {
            "runs": [
                {
                    k: v
                    for k, v in asdict(s).items()
                    if k not in ("group", "data_identity", "val_points")
                }
                for s in summaries
            ],
            "seed_groups": [asdict(g) for g in groups],
            "comparisons": [asdict(c) for c in comparisons],
            "not_compared": [asdict(c) for c in apart],
            "not_tested": [asdict(c) for c in untested],
        }
        if want_forecast:
            payload["forecasts"] = {k: asdict(v) for k, v in run_fc.items()}
            payload["group_forecasts"] = {k: asdict(v) for k, v in group_fc.items()}
        if scaling_data is not None:
            payload["scaling"] = scaling_data
        print(json.dumps(payload, indent=2, default=str))
    else:
        print(format_table(summaries, groups, comparisons, apart, untested))
        if want_forecast:
            ordered = {s.run: run_fc[s.run] for s in summaries}
            hours = hours_label([s.accelerator for s in summaries])
            print(format_forecasts(ordered, group_fc, args.target_loss, hours))
        if scaling_text is not None:
            print(scaling_text)
    if args.plot is not None:
        note = ""
        if left_out:
            note = (f" ({len(plotted)} runs on the newest run's data; {left_out} on other data "
                    "left out: --run NAME to choose)")  # fmt: skip
        if not_drawn:
            note += f" (not drawn: {', '.join(not_drawn)})"
        print(f"plot: {args.plot}{note}", file=sys.stderr if args.json else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
