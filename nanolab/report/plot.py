"""``--plot``: train and val loss per seed group (mean and 95% band), against tokens or
GPU-hours, with the forecast dashed."""

from __future__ import annotations

import math
import os
import statistics
import tempfile
from collections import deque
from pathlib import Path
from typing import Any

from nanolab.downstream.tasks import mean_label
from nanolab.report.groups import ReportError, by_config, data_key, group_labels
from nanolab.report.text import task_names
from nanolab.runlog import refuse_inside_run, written_in_training
from nanolab.runs import (
    RunSummary,
    hours_label,
    iter_timeline,
    last_by_step,
    num,
    si,
)


def default_plot_selection(summaries: list[RunSummary]) -> tuple[list[RunSummary], int]:
    """The runs on the same data and vocabulary as the most recently updated run, and how many
    others were left out: a loss in bits of a 50k-token vocabulary and one of 65 characters
    cannot share an axis."""
    if not summaries:
        return [], 0
    newest = max(summaries, key=lambda s: s.updated or 0.0)
    key = data_key(newest)
    kept = [s for s in summaries if data_key(s) == key]
    return kept, len(summaries) - len(kept)


def _curve(records: list[dict[str, Any]], key: str, ykey: str, xs: dict[Any, float | None],
           smooth: int = 1) -> dict[int, tuple[float, float]]:  # fmt: skip
    """step -> (x, y), y a trailing mean over ``smooth`` points (a running sum: one pass, however
    wide the window; a 400k-step log's window is 10k points)."""
    out: dict[int, tuple[float, float]] = {}
    window: deque[float] = deque()
    total = 0.0
    for r in records:
        step, x, y = r.get("step"), num(r.get(key)), num(r.get(ykey))
        if x is None:
            x = xs.get(step)
        if not isinstance(step, int) or x is None or y is None:
            continue
        window.append(y)
        total += y
        if len(window) > max(1, smooth):
            total -= window.popleft()
        out[step] = (x, total / len(window))
    return out


#: Train points a plotted curve keeps of a long log: its trailing mean, evenly thinned (a
#: 1M-step log draws as well from 2,000 points, and a dict per record took a GB).
TRAIN_POINTS = 2000


def _plot_records(
    run_dir: Path, task_keys: list[str]
) -> tuple[list[int], bool, list[dict[str, Any]]]:
    """A run's train records counted (how many, the highest step), whether one has a finite
    loss, and its val and tasks records with only the fields a plot reads; streamed."""
    keep = ("event", "step", "tokens", "gpu_hours", "val_loss", "evaluated_by", *task_keys)
    count, finite, records = [0, 0], False, []
    for r in iter_timeline(run_dir):
        if r.get("event") == "train":
            count[0] += 1
            count[1] = max(count[1], r["step"] if isinstance(r.get("step"), int) else 0)
            finite = finite or num(r.get("loss")) is not None
        else:
            records.append({k: r[k] for k in keep if k in r})
    return count, finite, records


def _train_curve(
    run_dir: Path, key: str, count: list[int], steps: set[Any]
) -> tuple[dict[int, tuple[float, float]], dict[Any, float | None]]:
    """The train loss as :func:`_curve` draws it (a trailing mean over 1/40 of the records),
    streamed, kept at the first step of each of at most ``TRAIN_POINTS`` spans of steps and the
    last; and the x of ``steps`` (val records may lack GPU-hours). A span is a power of two
    steps long, so seeds of different lengths keep the same steps and share a band."""
    smooth = max(1, count[0] // 40)
    span = 1 << max(0, math.ceil(math.log2(max(1, count[1]) / TRAIN_POINTS)))
    window: deque[float] = deque()
    total, last_step, bucket = 0.0, -1, -1
    out: dict[int, tuple[float, float]] = {}
    xs: dict[Any, float | None] = {}
    point = None
    for r in iter_timeline(run_dir, ("train",)):
        step = r.get("step")
        if not isinstance(step, int) or step <= last_step:
            continue
        last_step = step
        x, y = num(r.get(key)), num(r.get("loss"))
        if step in steps:
            xs[step] = x
        if x is None or y is None:
            continue
        window.append(y)
        total += y
        if len(window) > smooth:
            total -= window.popleft()
        point = (step, (x, total / len(window)))
        if step // span != bucket:
            bucket = step // span
            out[step] = point[1]
    if point is not None:
        out[point[0]] = point[1]
    return out, xs


def _nothing_to_draw(count: list[int], finite: bool, val: list[dict[str, Any]]) -> str | None:
    """Why a run's curves cannot be drawn: records of a kind, none with a finite loss (a run
    that diverged before its first validation logs a val loss of null)."""
    if count[0] and not finite:
        return "no finite train loss"
    if val and not any(num(r.get("val_loss")) is not None for r in val):
        return "no finite val loss"
    return None


#: What the --plot band is, in the figure's title and the docs (docs/report.md): one statement.
BAND_TITLE = (
    "mean over seeds, band = 95% confidence interval of the mean (Student t over the seeds)"
)


def _band(curves: list[dict[int, tuple[float, float]]]) -> list[tuple[float, float, float, float]]:
    """(x, mean, low, high) at every step that every curve of the group has: the 95%
    confidence interval of the mean over seeds (Student t; low = high = mean for one seed)."""
    from scipy import stats

    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    t = float(stats.t.ppf(0.975, len(curves) - 1)) if len(curves) >= 2 else 0.0
    out = []
    for step in steps:
        ys = [c[step][1] for c in curves]
        mean = statistics.fmean(ys)
        x = statistics.fmean(c[step][0] for c in curves)
        half = t * statistics.stdev(ys) / math.sqrt(len(ys)) if len(ys) >= 2 else 0.0
        out.append((x, mean, mean - half, mean + half))
    return out


def _tokens_axis(value: float, _pos: Any = None) -> str:
    return si(value, "g", billion="B")


def plot_runs(
    runs: list[tuple[RunSummary, Path]],
    out: Path,
    x: str,
    forecasts: dict | None = None,
    logx: bool = False,
    universe: list[RunSummary] | None = None,
    left_out: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Train and val loss against tokens or GPU-hours, written atomically to ``out``: one colour
    per seed group, its mean over seeds as a line and its 95% interval as a band; with
    ``forecasts`` (tokens axis), each run's fitted curve dashed to max_steps, with its band.
    Returns what was drawn per group (label, colour, runs, the val band) for the caller; a run
    with no finite loss to draw (diverged before its first validation) is left out of its
    group's curves and named, with why, in ``left_out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    key = {"tokens": "tokens", "gpu_hours": "gpu_hours"}[x]
    summaries = [s for s, _ in runs]
    # A panel per task metric after the two loss panels: CORE, then each task's score.
    task_keys = (["tasks/core"] if any(s.core is not None for s in summaries) else []) + [
        f"tasks/{t}/score" for t in task_names(summaries)
    ]
    panels = 2 + len(task_keys)
    ncols = min(3, panels) if task_keys else 2
    nrows = -(-panels // ncols)
    fig, grid = plt.subplots(
        nrows, ncols, figsize=(6 * ncols, 4.8 * nrows), sharex=True, squeeze=False
    )
    axes = list(grid.flat)
    ax_train, ax_val, task_axes = axes[0], axes[1], axes[2 : 2 + len(task_keys)]
    for ax in axes[panels:]:
        ax.set_visible(False)
    dirs = {s.run: d for s, d in runs}
    groups = by_config([s for s, _ in runs])
    labels = group_labels(groups, universe=universe)
    missing: list[str] = []
    drawn: list[dict[str, Any]] = []
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    if len(groups) > len(colors):  # past the default 10, two groups would share a colour
        colors = [plt.get_cmap("tab20")(i % 20) for i in range(len(groups))]
        if len(groups) > 20:
            colors = [plt.get_cmap("turbo")(i / (len(groups) - 1)) for i in range(len(groups))]
    for i, (members, label) in enumerate(zip(groups, labels, strict=True)):
        color = colors[i % len(colors)]
        trains, vals = [], []
        task_curves: list[list[dict[int, tuple[float, float]]]] = [[] for _ in task_keys]
        n = len(members)
        for s in members:
            count, finite, records = _plot_records(dirs[s.run], task_keys)
            # The curve written in training: a later validate/test/eval record is no point of it.
            ours = [r for r in records if written_in_training(r)]
            val = last_by_step([r for r in ours if r.get("event") == "val"])
            why = _nothing_to_draw(count, finite, val)
            if why:
                n -= 1
                if left_out is not None:
                    left_out.append(f"{s.run} ({why})")
                continue
            scored = last_by_step([r for r in ours if r.get("event") == "tasks"])
            steps = {r.get("step") for r in (*val, *scored)}
            t, xs = _train_curve(dirs[s.run], key, count, steps) if count[0] else ({}, {})
            v = _curve(val, key, "val_loss", xs)
            if (count[0] and not t) or (val and not v):
                missing.append(s.run)
                continue
            if t:
                trains.append(t)
            if v:
                vals.append(v)
            for curves, task_key in zip(task_curves, task_keys, strict=True):
                curve = _curve(scored, key, task_key, xs)
                if curve:
                    curves.append(curve)
        name = f"{label} (n={n})" if n > 1 else label
        drawn.append({"label": label, "color": color, "runs": [m.run for m in members],
                      "val_band": _band(vals)})  # fmt: skip
        # A loss is never negative: with two seeds the t interval can reach below 0, and the
        # band is drawn from 0 there (task scores are centred, so theirs can be negative).
        panes = [(ax_train, trains, None, 0.0), (ax_val, vals, "o", 0.0)]
        panes += [(ax, c, "s", None) for ax, c in zip(task_axes, task_curves, strict=True)]
        for ax, curves, marker, floor in panes:
            band = _band(curves)
            if not band:
                continue
            bx, mean, lo, hi = zip(*band, strict=True)
            if floor is not None:
                lo = tuple(max(floor, v) for v in lo)
            ax.plot(bx, mean, color=color, lw=1.4, marker=marker, ms=3,
                    label=name if ax is ax_train or not trains else None)  # fmt: skip
            if len(curves) > 1:
                ax.fill_between(bx, lo, hi, color=color, alpha=0.3, lw=0)
        for s in members:
            f = (forecasts or {}).get(s.run)
            if f is not None and f.fit is not None and f.final_tokens and x == "tokens" and vals:
                first = min(c[min(c)][0] for c in vals)
                _plot_forecast(ax_val, f, first, color)
    if missing:
        plt.close(fig)
        raise ReportError(
            f"--x {x}: run(s) {', '.join(missing)} log no {key}; use --x tokens"
            if x != "tokens"
            else f"run(s) {', '.join(missing)} log no token counts"
        )
    unit = hours_label([s.accelerator for s in summaries]).removesuffix("-h") + "-hours"
    xlabel = "tokens" if x == "tokens" else unit
    smooth = "train loss (trailing mean)"
    suites = {s.suite for s in summaries if s.core is not None}
    core_title = mean_label(suites.pop()) if len(suites) == 1 else "suites centered"
    titles = [(ax_train, smooth), (ax_val, "val loss")]
    titles += [
        (ax, f"{core_title} (0 = chance)" if name == "core" else f"{name} (score)")
        for ax, name in zip(task_axes, (k.split("/")[1] for k in task_keys), strict=True)
    ]
    for ax, title in titles:
        ax.set_title(title)
        ax.tick_params(labelbottom=True)  # every panel keeps its x labels (rows share the axis)
        ax.set_xlabel(xlabel + (" (log)" if logx else ""))
        ax.grid(alpha=0.3)
        if logx:
            ax.set_xscale("log")
        if x == "tokens":
            ax.xaxis.set_major_formatter(FuncFormatter(_tokens_axis))
    ax_train.set_ylabel("loss")
    if any(len(g) > 1 for g in groups):
        fig.suptitle(BAND_TITLE, fontsize=9)
    handles, names = ax_train.get_legend_handles_labels()
    if not handles:
        handles, names = ax_val.get_legend_handles_labels()
    if handles:
        fig.legend(handles, names, loc="lower center", ncol=min(3, len(names)), fontsize=8)
    rows = (len(names) + 2) // 3 if handles else 0
    fig.tight_layout(rect=(0, min(0.3, 0.05 * rows + 0.02) if handles else 0, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    # A name of this call's own: two reports drawing to one file (two shells, a cron job) must
    # not write into, publish or delete each other's half-drawn image.
    fd, name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.stem}.", suffix=f".tmp{out.suffix}")
    os.close(fd)
    tmp = Path(name)
    try:
        fig.savefig(tmp, dpi=120, format=out.suffix.lstrip(".") or "png")
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except OSError as err:
        if err.filename is not None:
            raise
        # The image writer's own errors name no file: the line names the one asked for.
        raise OSError(err.errno, err.strerror or str(err), str(out)) from None
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return drawn


def check_plot_path(out: Path) -> None:
    """``--plot``: an image file name matplotlib can write, outside every run directory,
    checked before anything is read (a bad name would otherwise fail after the table)."""
    from matplotlib.backend_bases import FigureCanvasBase

    if not str(out).strip() or str(out) == "." or out.is_dir():
        raise ReportError(f"--plot {str(out)!r} is not a file name; give one such as loss.png")
    kinds = FigureCanvasBase.get_supported_filetypes()
    if out.suffix.lstrip(".").lower() not in kinds:
        raise ReportError(
            f"--plot {out}: matplotlib cannot write {out.suffix or 'a file without a suffix'}; "
            f"end the name in one of {', '.join('.' + k for k in sorted(kinds))}"
        )
    refuse_inside_run(out, "--plot", ReportError)


def _plot_forecast(ax: Any, f: Any, start: float, color: Any) -> None:
    """The fitted curve from the first val point to max_steps (dashed) and its 5-95% band."""
    xs = [t for t, _ in f.curve if t >= start]
    ys = [v for t, v in f.curve if t >= start]
    ax.plot(xs, ys, ls="--", lw=1.0, color=color)
    lo, hi = f.final_band
    ax.errorbar([f.final_tokens], [f.final_loss], yerr=[[f.final_loss - lo], [hi - f.final_loss]],
                fmt="none", capsize=4, color=color)  # fmt: skip
