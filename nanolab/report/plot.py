"""``--plot``: train and val loss per seed group (mean and 95% band), against tokens or
GPU-hours, with the forecast dashed."""

from __future__ import annotations

import math
import os
import statistics
import tempfile
from array import array
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

#: What a :class:`PlotReader` keeps of a train series, at most: the first point of each of
#: this many spans of steps and the running loss sum every this many-th point. Above twice
#: TRAIN_POINTS, so the spans stay within the drawn ones (both powers of two).
KEPT = 4096

#: Running loss sums a :class:`PlotReader` keeps, at most (128 kB): a trailing mean's window
#: starts exactly where it should for a series up to this many points, within 1/1,000 of the
#: window beyond (every 2nd, 4th, ... sum kept: the window is 1/40 of the records).
SUMS_KEPT = 16384


class PlotReader:
    """What ``--plot`` draws of one run, fed its usable timeline records one by one, in log
    order (what :func:`nanolab.runs.iter_timeline` yields): along the summary's own pass
    (``summarize_run(..., also=reader.add)``), so a long log is read once, not three times.

    Its val and tasks records are kept (few, the fields a plot reads); the train series only
    as the first point of each span of steps (a power of two, doubled to keep at most
    :data:`KEPT`) and its running loss sum every so many points (at most :data:`SUMS_KEPT`).
    The curve is the trailing mean over 1/40 of the train records, as before; its window starts
    within half a kept interval of that. Memory stays flat in the log's length."""

    def __init__(self, x: str) -> None:
        self.key = {"tokens": "tokens", "gpu_hours": "gpu_hours"}[x]
        self.count = [0, 0]  # train records, their highest step
        self.finite = False  # whether one has a finite loss
        self.records: list[dict[str, Any]] = []  # val and tasks, the fields a plot reads
        self.xs: dict[Any, float | None] = {}  # x of the steps of those (from train records)
        self._pending: set[int] = set()  # their steps not trained yet in the log
        self._recent: deque[tuple[int, float | None]] = deque(maxlen=64)
        self._last_step = -1
        self._points = 0  # train points with an x and a loss: the ones averaged
        self._total = 0.0  # their loss, summed
        self._every = 1  # the running sum is kept every this many points
        self._sums = array("d", [0.0])  # the running sum after 0, every, 2*every, ... points
        self._grain = 1  # steps per span of the first points kept
        self._firsts: tuple[array, ...] = tuple(array(t) for t in "qqdqd")  # span, step, x, n, sum
        self._last: tuple[int, float, int, float] | None = None

    def add(self, r: dict[str, Any]) -> None:
        """One usable record of the timeline, in log order."""
        event = r.get("event")
        if event == "train":
            self._train(r)
        elif event in ("val", "tasks"):
            self.records.append({k: v for k, v in r.items() if _plotted_field(k)})
            step = r.get("step")
            if isinstance(step, int):
                x = next((x for s, x in reversed(self._recent) if s == step), _NONE)
                if x is _NONE:
                    self._pending.add(step)
                else:
                    self.xs[step] = x

    def _train(self, r: dict[str, Any]) -> None:
        self.count[0] += 1
        step = r.get("step")
        self.count[1] = max(self.count[1], step if isinstance(step, int) else 0)
        self.finite = self.finite or num(r.get("loss")) is not None
        if not isinstance(step, int) or step <= self._last_step:
            return
        self._last_step = step
        x, y = num(r.get(self.key)), num(r.get("loss"))
        self._recent.append((step, x))
        if step in self._pending:
            self._pending.discard(step)
            self.xs[step] = x
        if x is None or y is None:
            return
        self._points += 1
        self._total += y
        if self._points % self._every == 0:
            self._sums.append(self._total)
            if len(self._sums) > SUMS_KEPT:
                self._sums, self._every = self._sums[::2], self._every * 2
        spans = self._firsts[0]
        if not spans or step // self._grain != spans[-1]:
            for column, value in zip(self._firsts, (step // self._grain, step, x, self._points,
                                                    self._total), strict=True):  # fmt: skip
                column.append(value)
            if len(spans) > KEPT:
                self._coarsen()
        self._last = (step, x, self._points, self._total)

    def _coarsen(self) -> None:
        """Twice as many steps per span: each keeps the first point of its two halves."""
        self._grain *= 2
        old = self._firsts
        self._firsts = tuple(array(t) for t in "qqdqd")
        for row in zip(*old, strict=True):
            span = row[1] // self._grain
            if not self._firsts[0] or self._firsts[0][-1] != span:
                for column, value in zip(self._firsts, (span, *row[1:]), strict=True):
                    column.append(value)

    def _mean(self, n: int, total: float, smooth: int) -> float:
        """The mean loss of the ``smooth`` points up to the ``n``-th (running sum ``total``)."""
        start = max(0, n - smooth)
        k = min(round(start / self._every), len(self._sums) - 1, (n - 1) // self._every)
        return (total - self._sums[k]) / (n - k * self._every)

    def train_curve(self) -> dict[int, tuple[float, float]]:
        """step -> (x, trailing mean of the loss) at the first step of each of at most
        ``TRAIN_POINTS`` spans of steps and the last. A span is a power of two steps long, so
        seeds of different lengths keep the same steps and share a band."""
        smooth = max(1, self.count[0] // 40)
        span = 1 << max(0, math.ceil(math.log2(max(1, self.count[1]) / TRAIN_POINTS)))
        out: dict[int, tuple[float, float]] = {}
        bucket = -1
        for _, step, x, n, total in zip(*self._firsts, strict=True):
            if step // span != bucket:
                bucket = step // span
                out[step] = (x, self._mean(n, total, smooth))
        if self._last is not None:
            step, x, n, total = self._last
            out[step] = (x, self._mean(n, total, smooth))
        return out


_NONE = object()  # no train record of that step seen yet


def _plotted_field(key: str) -> bool:
    """A field of a val or tasks record that a plot reads (a task's score, the CORE mean)."""
    return key in ("event", "step", "tokens", "gpu_hours", "val_loss", "evaluated_by") or (
        key.startswith("tasks/") and (key == "tasks/core" or key.endswith("/score"))
    )


def read_for_plot(run_dir: Path, x: str) -> PlotReader:
    """A run's :class:`PlotReader`, read on its own (a caller without the summary's pass)."""
    reader = PlotReader(x)
    for r in iter_timeline(run_dir):
        reader.add(r)
    return reader


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
    read: dict[str, PlotReader] | None = None,
) -> list[dict[str, Any]]:
    """Train and val loss against tokens or GPU-hours, written atomically to ``out``: one colour
    per seed group, its mean over seeds as a line and its 95% interval as a band; with
    ``forecasts`` (tokens axis), each run's fitted curve dashed to max_steps, with its band.
    Returns what was drawn per group (label, colour, runs, the val band) for the caller; a run
    with no finite loss to draw (diverged before its first validation) is left out of its
    group's curves and named, with why, in ``left_out``. ``read``: run name -> its
    :class:`PlotReader`, filled along the summary's pass (a run without one is read here)."""
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
            reader = (read or {}).get(s.run)
            if reader is None or reader.key != key:
                reader = read_for_plot(dirs[s.run], x)
            count, finite, records = reader.count, reader.finite, reader.records
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
            t, xs = (reader.train_curve(), reader.xs) if count[0] else ({}, {})
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
