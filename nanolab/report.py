"""``nanolab report``: the morning summary of every run under one or more run folders.

Each run is read by :func:`nanolab.runs.summarize_run`, whatever state it is in (finished,
running, crashed); curves and "best" figures come from the timeline a resume leaves.

Runs whose configs differ only in the seed and the run name are grouped, with the mean and
standard deviation of their final validation loss: one seed is an anecdote. A group is labelled
by the config values that set it apart from the other groups (``lr=0.001``), not by its names.
"Δ train loss" is the same for every run: the mean training loss of the last
:data:`DELTA_WINDOW` logged steps minus the loss of the first logged step.

``--plot`` draws one colour per group: the mean over its seeds and its 95% interval, against
tokens (or GPU-hours); without ``--run`` it draws the runs trained on the same data as the most
recently updated one (curves of different vocabularies do not share a y axis).
``--compare A B`` prints the config keys where two runs differ beside their results.

``--forecast`` (and ``--target-loss X``) fits each run's validation curve with
:mod:`nanolab.forecast` and says what it will reach at ``trainer.max_steps``, and the tokens,
GPU-hours and cost to reach ``X``; a seed group's points are fitted together.
``--scaling`` (and ``--gpu-hours H``) fits L(N, D) over finished runs of several model sizes
(:mod:`nanolab.scaling_fit`) and gives the compute-optimal size for ``H`` GPU-hours.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import re
import statistics
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from nanolab.downstream.tasks import mean_label
from nanolab.errors import one_line_errors
from nanolab.helpfmt import OneLineParser
from nanolab.messages import say
from nanolab.runlog import RUN_LOG_NAME, refuse_inside_run
from nanolab.runs import (
    DELTA_WINDOW,
    RESULTS_LOG,
    RunsError,
    RunSummary,
    append_result,
    config_of,
    discover_runs,
    duration,
    hours_label,
    indexed_runs,
    last_by_step,
    last_value,
    num,
    read_run,
    result_fields,
    seed_free_fingerprint,
    si,
    summarize_run,
    tail_records,
)
from nanolab.tables import WIDTH, table, table_within


class ReportError(RunsError):
    """Bad input for the report (unknown field or run name, missing folder)."""


SORT_FIELDS = tuple(
    f.name
    for f in fields(RunSummary)
    if f.name
    not in ("group", "run_dir", "skipped_example", "task_scores", "eval_task_scores", "val_points")
)


# -- grouping -------------------------------------------------------------------------------
@dataclass
class SeedGroup:
    """Runs of one configuration that differ only in seed: the spread of the final val loss."""

    label: str
    runs: list[str]
    seeds: list[int | None]
    n: int
    mean_val_loss: float | None
    std_val_loss: float | None
    repeated_seeds: list[int] = field(default_factory=list)  # seeds run twice: not a spread
    mean_core: float | None = None  # mean centered score in training, over the seeds with one
    std_core: float | None = None
    suite: str | None = None  # the suite of those scores (CORE only when "core")
    ci_val_loss: float | None = None  # half-width of the 95% interval (Student t over seeds)
    at_tokens: int | None = None  # the val losses are taken here (the shortest seed's end)
    val_losses: list[float] = field(default_factory=list)  # one per seed, at at_tokens
    #: Runs of the group left out of its statistics, each with why (diverged, no finite
    #: val loss): a seed that failed is a result too, so the report names it.
    left_out: list[str] = field(default_factory=list)


@dataclass
class Comparison:
    """Group ``a`` minus group ``b`` in val loss at equal tokens (nanolab.stats.welch)."""

    a: str
    b: str
    at_tokens: int | None
    difference: float
    half_width: float
    p_value: float
    n_a: int
    n_b: int
    seeds_needed: int | None
    sentence: str


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay values)."""
    if not isinstance(config, dict):
        return {prefix: config} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in config.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _common_configs(summaries: list[RunSummary]) -> dict[str, dict[str, Any]]:
    """Each run's seed-free config, flattened, cut to the keys every run's config has: a key
    only some logs carry was added (or removed) by another nanolab version, with a default the
    older runs also trained with, so it must not split one experiment's seeds."""
    flats = {s.run: flatten(json.loads(s.group)) for s in summaries if s.group is not None}
    common = set.intersection(*(set(f) for f in flats.values())) if flats else set()
    return {run: {k: f[k] for k in sorted(common)} for run, f in flats.items()}


def _by_config(summaries: list[RunSummary]) -> list[list[RunSummary]]:
    """Runs sharing a seed-free config, in order of first appearance (a run without a config
    is a group of its own)."""
    configs = _common_configs(summaries)
    by_key: dict[str, list[RunSummary]] = {}
    for s in summaries:
        key = json.dumps(configs[s.run], default=str) if s.run in configs else f"run:{s.run}"
        by_key.setdefault(key, []).append(s)
    return list(by_key.values())


def _short_keys(keys: list[str], among: list[str] | None = None) -> dict[str, str]:
    """The last part of each dotted key, or more of it where the last part is ambiguous among
    ``among`` (default ``keys``): ``checkpoint.every_n_steps``, not ``every_n_steps``, where the
    config also has ``log.every_n_steps``."""
    pool = among if among is not None else keys
    out = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            short = ".".join(parts[-n:])
            if sum(k == short or k.endswith("." + short) for k in pool) <= 1:
                break
        out[key] = short
    return out


def _value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def group_labels(
    groups: list[list[RunSummary]], max_keys: int = 4, universe: list[RunSummary] | None = None
) -> list[str]:
    """Each group's label: the config values that set it apart from the other groups of
    ``universe`` (every run found; default: the groups given) (``lr=0.001, n_layer=6``); with
    one group, or too many differences, its run names without the seed suffix. Taking the
    differences over every run found keeps a group's label the same whatever ``--run`` picks."""
    everyone = [g[0] for g in _by_config(universe)] if universe else [g[0] for g in groups]
    common = _common_configs(everyone + [g[0] for g in groups])
    configs = [common.get(g[0].run) for g in groups]
    across = [common.get(r.run) for r in everyone]
    keys = sorted({k for c in across if c for k in c})
    missing = object()
    varying = [
        k
        for k in keys
        if len({_value(c.get(k, missing)) if c else "?" for c in across}) > 1
        and all(c is not None for c in across)
    ]
    short = _short_keys(varying, keys)  # unambiguous among every key of the configs
    labels = []
    for group, config in zip(groups, configs, strict=True):
        if config is None or not varying or len(varying) > max_keys:
            names = [m.run for m in group]
            prefix = os.path.commonprefix(names) if len(names) > 1 else names[0]  # noqa: RUF071
            label = re.sub(r"[-_.=]*(seed|s)[-_=]?\d*$", "", prefix).rstrip("-_.=") or names[0]
        else:
            label = ", ".join(
                f"{short[k]}={_value(config[k])}" if k in config else f"{short[k]} unset"
                for k in varying
            )
        labels.append(label)
    return labels


def seed_groups(
    summaries: list[RunSummary], universe: list[RunSummary] | None = None
) -> list[SeedGroup]:
    """Groups of two or more runs sharing a seed-free config, with mean ± std of final val loss
    (labelled against ``universe``, every run found: see :func:`group_labels`)."""
    groups = _by_config(summaries)
    out = []
    for members, label in zip(groups, group_labels(groups, universe=universe), strict=True):
        if len(members) < 2:
            continue
        left_out = [f"{m.run} ({why})" for m in members if (why := _unusable(m))]
        usable = [m for m in members if not _unusable(m)]
        at_tokens = common_tokens(usable)
        losses = values_at(usable, at_tokens)
        cores = [m.core for m in usable if m.core is not None]
        seeds = [m.seed for m in usable]
        out.append(
            SeedGroup(
                label=label,
                runs=[m.run for m in members],
                seeds=[m.seed for m in members],
                n=len(usable),
                mean_val_loss=statistics.fmean(losses) if losses else None,
                std_val_loss=statistics.stdev(losses) if len(losses) >= 2 else None,
                repeated_seeds=sorted({x for x in seeds if x is not None and seeds.count(x) > 1}),
                mean_core=statistics.fmean(cores) if cores else None,
                std_core=statistics.stdev(cores) if len(cores) >= 2 else None,
                suite=next((m.suite for m in usable if m.core is not None), None),
                ci_val_loss=_ci(losses),
                at_tokens=at_tokens,
                val_losses=losses,
                left_out=left_out,
            )
        )
    return sorted(out, key=lambda g: g.label)


def config_summaries(found: list[tuple[str, Path]]) -> list[RunSummary]:
    """Every found run with only its name and seed-free config: what the group labels are
    taken against, read from the start records alone (not a whole summary per run)."""
    return [
        RunSummary(
            run=n, status="", group=seed_free_fingerprint(config_of(tail_records(d, "start"), d))
        )
        for n, d in found
    ]


def _unusable(run: RunSummary) -> str | None:
    """Why a run cannot stand for its seed in a group's statistics (None: it can)."""
    if run.status == "diverged":
        return "diverged"
    if run.final_val_loss is None:
        return "no finite val loss at its end" if run.val_points else "no val loss"
    return None


def common_tokens(members: list[RunSummary]) -> int | None:
    """The most tokens every run of ``members`` validated at (runs of different length are
    compared where all of them are, not each at its own end)."""
    ends = [max(t for t, _ in m.val_points) for m in members if m.val_points]
    return min(ends) if ends and len(ends) == len(members) else None


def values_at(members: list[RunSummary], tokens: int | None) -> list[float]:
    """Each run's val loss at its last validation at or before ``tokens`` (the final val loss
    when ``tokens`` is None)."""
    if tokens is None:
        return [m.final_val_loss for m in members if m.final_val_loss is not None]
    before = ([loss for t, loss in m.val_points if t <= tokens] for m in members)
    return [b[-1] for b in before if b]


def _ci(values: list[float]) -> float | None:
    from nanolab.stats import mean_ci

    return mean_ci(values).half_width if len(values) >= 2 else None


def compare_groups(
    summaries: list[RunSummary], groups: list[SeedGroup], baseline: str | None = None
) -> list[Comparison]:
    """Each group against ``baseline`` (a group label), or, without one, the two groups
    against each other, or every group against the one with the lowest mean. Empty with fewer
    than two groups of two usable seeds."""
    usable = [g for g in groups if len(g.val_losses) >= 2]
    if len(usable) < 2:
        return []
    from nanolab.stats import sentence, welch  # scipy.stats: ~0.5 s, only when there is a test

    by_run = {s.run: s for s in summaries}
    if baseline is not None:
        base = next((g for g in usable if g.label == baseline or baseline in g.runs), None)
        if base is None:
            labels = "; ".join(g.label for g in usable)
            raise ReportError(
                f"--baseline {baseline!r} is neither a seed group's label nor one of its runs; "
                f"groups: {labels}"
            )
    else:
        base = min(usable, key=lambda g: statistics.fmean(g.val_losses))
    out = []
    for g in usable:
        if g is base:
            continue
        members_a = [by_run[r] for r in g.runs if r in by_run and not _unusable(by_run[r])]
        members_b = [by_run[r] for r in base.runs if r in by_run and not _unusable(by_run[r])]
        ends = [t for t in (common_tokens(members_a), common_tokens(members_b)) if t is not None]
        at = min(ends) if len(ends) == 2 else None
        a, b = values_at(members_a, at), values_at(members_b, at)
        if len(a) < 2 or len(b) < 2:
            continue
        d = welch(a, b)
        text = sentence(g.label, base.label, d)
        if at is not None and (at != g.at_tokens or at != base.at_tokens):
            text += f" (at {si(at)} tokens, where every run of both got to)"
        out.append(Comparison(g.label, base.label, at, d.difference, d.half_width, d.p_value,
                              d.n_a, d.n_b, d.seeds_needed, text))  # fmt: skip
    return out


# -- formatting -----------------------------------------------------------------------------
def _f(value: float | None, fmt: str = ".4f") -> str:
    return "-" if value is None else format(value, fmt)


def _money(value: float | None) -> str:
    if value is None:
        return "-"
    return f"${value:.2f}" if value >= 1 or value == 0 else f"${value:.2g}"


def _status_text(s: RunSummary) -> str:
    if s.detail and s.status in ("error", "crashed", "diverged"):
        detail = s.detail.strip().splitlines()[-1] if s.detail.strip() else ""
        return f"{s.status}: {detail[:60]}"
    notes = [f"+{s.resumes} resume{'s' if s.resumes > 1 else ''}"] if s.resumes else []
    if s.rollbacks:
        notes.append(f"{s.rollbacks} rollback{'s' if s.rollbacks > 1 else ''}")
    return s.status + (f" ({', '.join(notes)})" if notes else "")


def task_names(summaries: list[RunSummary]) -> list[str]:
    """Every task some run scored, in the order first seen."""
    return list(dict.fromkeys(name for s in summaries for name in s.task_scores))


def _wrap(text: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, break_on_hyphens=False)


def downstream_table(summaries: list[RunSummary]) -> list[str]:
    """One row per run and source of downstream scores: the newest ``tasks`` record written in
    training and the newest ``nanolab eval`` appended, each with its step and suite; the mean
    column is CORE only when every row's suite is CORE."""
    scored = [
        (s.run, source, step, suite, core, scores)
        for s in summaries
        for source, step, suite, core, scores in (
            ("training", s.tasks_step, s.suite, s.core, s.task_scores),
            ("nanolab eval", s.eval_step, s.eval_suite, s.eval_core, s.eval_task_scores),
        )
        if core is not None or scores
    ]
    if not scored:
        return []
    suites = {row[3] for row in scored}
    mean = "CORE" if suites == {"core"} else "mean centered"
    tasks = list(dict.fromkeys(t for row in scored for t in row[5]))
    headers = ["run", "from", "step", "suite", mean, *tasks]
    rows = [
        [run, source, "-" if step is None else str(step), suite or "?", _f(core, "+.3f"),
         *(_f(scores.get(t), ".3f") for t in tasks)]
        for run, source, step, suite, core, scores in scored
    ]  # fmt: skip
    out = ["", *table_within(rows, headers, {2, *range(4, len(headers))})]
    return out + _wrap(
        f"{mean}: the mean centered accuracy of the suite's tasks"
        + (" (CORE only for the CORE suite)" if mean != "CORE" else "")
        + "; a task's column: the accuracy its centered value uses; from: the tasks record "
        "written in training (--downstream.suite) or appended by nanolab eval"
    )


def validated_table(summaries: list[RunSummary]) -> list[str]:
    """The val loss ``nanolab validate`` appended to a run after training, one row per run that
    has one: apart from the runs table, whose best and final val loss are training's."""
    rows = [
        [s.run, "-" if s.evaluated_val_step is None else str(s.evaluated_val_step),
         _f(s.evaluated_val_loss), _f(s.evaluated_val_bpb)]
        for s in summaries
        if s.evaluated_val_loss is not None
    ]  # fmt: skip
    if not rows:
        return []
    out = ["", *table(rows, ["run", "step", "val loss (nanolab validate)", "val bpb"], {1, 2, 3})]
    return out + _wrap(
        "appended by nanolab validate after training; the runs table's best and final val loss "
        "are training's validations, the ones --ckpt_path best chooses from"
    )


def _mean_spread(mean: float | None, std: float | None, fmt: str = ".4f") -> str:
    if mean is None:
        return "-"
    return f"{mean:{fmt}} ± {std:{fmt}}" if std is not None else f"{mean:{fmt}}"


def format_table(
    summaries: list[RunSummary],
    groups: list[SeedGroup],
    comparisons: list[Comparison] | None = None,
) -> str:
    """The report: runs (cut into tables of at most 100 columns), then the downstream scores,
    seed groups, their differences and notes."""
    hours = hours_label([s.accelerator for s in summaries])
    headers = [
        "run", "status", "steps", "tokens", "train loss", "best val (step)", "val bpb",
        "Δ train loss", "tokens/s", "MFU", hours, "cost", "wall",
    ]  # fmt: skip
    rows = []
    for s in summaries:
        best = "-" if s.best_val_loss is None else f"{s.best_val_loss:.4f} ({s.best_val_step})"
        improvement = "-"
        if s.improvement is not None:
            pct = f" ({-s.improvement / s.start_loss:+.0%})" if s.start_loss else ""
            improvement = f"{-s.improvement:+.4f}{pct}"
        rows.append(
            [
                s.run,
                _status_text(s),
                "-" if s.steps is None else str(s.steps),
                si(s.tokens),
                _f(s.train_loss),
                best,
                _f(s.best_val_bpb),
                improvement,
                si(s.tokens_per_s),
                "-" if s.mfu is None else f"{s.mfu:.1%}",
                _f(s.gpu_hours, ".3f"),
                _money(s.cost),
                duration(s.wall_s),
            ]
        )
    out = table_within(rows, headers, {2, 3, 4, 6, 8, 9, 10, 11, 12})
    out += _wrap(
        f"Δ train loss: mean training loss of the last {DELTA_WINDOW} logged steps minus the "
        f"first logged step's (the same for every run). {hours}: devices x wall hours"
    )
    out += downstream_table(summaries)
    out += validated_table(summaries)
    if groups:
        out += [
            "",
            *_wrap(
                "seed groups (same config, different seed): val loss at the shortest seed's "
                "last validation, mean ± 95% confidence interval (Student t over the seeds)"
            ),
        ]
        for g in groups:
            spread = _mean_spread(g.mean_val_loss, g.ci_val_loss)
            if g.mean_core is not None:
                spread += f", {mean_label(g.suite)} {_mean_spread(g.mean_core, g.std_core, '+.3f')}"
            seeds = ",".join(str(x) for x in g.seeds)
            out.append(f"  {g.label}: {spread}  (n={g.n}, seeds {seeds}: {', '.join(g.runs)})")
            if g.left_out:
                out.append(
                    f"    note: left out of the statistics: {', '.join(g.left_out)}; the "
                    f"figures are over the other {g.n} run(s)"
                )
            if g.repeated_seeds:
                twice = ", ".join(map(str, g.repeated_seeds))
                out.append(
                    f"    note: seed {twice} ran more than once in this group: those runs "
                    "repeat each other, their spread is not a seed-to-seed spread"
                )
    if comparisons:
        out += ["", "differences (Welch's t-test over seeds, val loss at equal tokens):"]
        out += [f"  {c.sentence}" for c in comparisons]
    skipped = [s for s in summaries if s.skipped_records]
    if skipped:
        out.append("")
        for s in skipped:
            out.append(
                f"note: {s.run}: skipped {s.skipped_records} record(s) of the wrong shape in "
                f"{Path(s.run_dir) / RUN_LOG_NAME} (first: {s.skipped_example}); the rest is shown"
            )
    return "\n".join(out)


# -- plotting -------------------------------------------------------------------------------
def data_key(s: RunSummary) -> str | None:
    """What a run's loss is measured on: its dataset and vocabulary (None when unknown)."""
    if s.group is None:
        return None
    config = json.loads(s.group)
    data = config.get("data") or {}
    vocab = ((config.get("model") or {}).get("gpt") or {}).get("vocab_size")
    where = data.get("datasets") or data.get("dataset_dir")
    return json.dumps([where, vocab], sort_keys=True, default=str)


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
    """step -> (x, y), y a trailing mean over ``smooth`` points."""
    out: dict[int, tuple[float, float]] = {}
    window: list[float] = []
    for r in records:
        step, x, y = r.get("step"), num(r.get(key)), num(r.get(ykey))
        if x is None:
            x = xs.get(step)
        if not isinstance(step, int) or x is None or y is None:
            continue
        window = [*window[-(smooth - 1) :], y] if smooth > 1 else [y]
        out[step] = (x, statistics.fmean(window))
    return out


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
) -> list[dict[str, Any]]:
    """Train and val loss against tokens or GPU-hours, written atomically to ``out``: one colour
    per seed group, its mean over seeds as a line and its 95% interval as a band; with
    ``forecasts`` (tokens axis), each run's fitted curve dashed to max_steps, with its band.
    Returns what was drawn per group (label, colour, runs, the val band) for the caller."""
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
    groups = _by_config([s for s, _ in runs])
    labels = group_labels(groups, universe=universe)
    missing: list[str] = []
    drawn: list[dict[str, Any]] = []
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (members, label) in enumerate(zip(groups, labels, strict=True)):
        color = colors[i % len(colors)]
        trains, vals = [], []
        task_curves: list[list[dict[int, tuple[float, float]]]] = [[] for _ in task_keys]
        for s in members:
            records = read_run(dirs[s.run])[0]
            train = last_by_step([r for r in records if r.get("event") == "train"])
            val = last_by_step([r for r in records if r.get("event") == "val"])
            xs = {r.get("step"): num(r.get(key)) for r in train}  # val records may lack GPU-h
            t = _curve(train, key, "loss", xs, smooth=max(1, len(train) // 40))
            v = _curve(val, key, "val_loss", xs)
            if (train and not t) or (val and not v):
                missing.append(s.run)
                continue
            if t:
                trains.append(t)
            if v:
                vals.append(v)
            # The scores written in training (a later `nanolab eval` record is not a curve point).
            scored = last_by_step(
                [r for r in records if r.get("event") == "tasks" and not r.get("evaluated_by")]
            )
            for curves, task_key in zip(task_curves, task_keys, strict=True):
                curve = _curve(scored, key, task_key, xs)
                if curve:
                    curves.append(curve)
        n = len(members)
        name = f"{label} (n={n})" if n > 1 else label
        drawn.append({"label": label, "color": color, "runs": [m.run for m in members],
                      "val_band": _band(vals)})  # fmt: skip
        panes = [(ax_train, trains, None), (ax_val, vals, "o")]
        panes += [(ax, curves, "s") for ax, curves in zip(task_axes, task_curves, strict=True)]
        for ax, curves, marker in panes:
            band = _band(curves)
            if not band:
                continue
            bx, mean, lo, hi = zip(*band, strict=True)
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
    core_title = mean_label(suites.pop()) if len(suites) == 1 else "suite mean"
    titles = [(ax_train, smooth), (ax_val, "val loss")]
    titles += [
        (ax, f"{core_title} (mean centered accuracy)" if name == "core" else f"{name} (score)")
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
    tmp = out.with_name(f".{out.stem}.tmp{out.suffix}")
    try:
        fig.savefig(tmp, dpi=120, format=out.suffix.lstrip(".") or "png")
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        if tmp.exists():
            tmp.unlink()
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


# -- command line ---------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="nanolab report",
        description="Summarise runs from their metrics.jsonl logs (finished, stopped, crashed or "
        "still running).",
    )
    p.add_argument(
        "runs_dirs",
        nargs="*",
        type=Path,
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
        "one of its runs): the difference, its 95%% interval and Welch's p-value",
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


# -- forecasts ------------------------------------------------------------------------------
def _schedule_of(config: dict[str, Any], train: list[dict[str, Any]]) -> tuple[Any, int]:
    """``(planned steps -> LR multiplier, warmup steps)`` from a run's config, checked against the
    LRs its log recorded (``(None, 0)`` when the config has no schedule or the log disagrees,
    e.g. a model class with its own schedule)."""
    from nanolab.training.optim import ScheduleConfig, lr_schedule

    model = config.get("model") or {}
    if isinstance(model.get("init_args"), dict):
        model = model["init_args"]
    sched, peak = model.get("schedule"), num((model.get("optimizer") or {}).get("lr"))
    if not isinstance(sched, dict) or not peak:
        return None, 0
    try:
        cfg = ScheduleConfig(**sched)
    except (TypeError, ValueError):
        return None, 0
    max_steps = int(num((config.get("trainer") or {}).get("max_steps")) or -1)
    planned = lr_schedule(cfg, max_steps)
    logged = [(r["step"], num(r.get("lr"))) for r in train if isinstance(r.get("step"), int)]
    logged = [(s, lr) for s, lr in logged if lr is not None and s >= 1]
    # A train record is written after the scheduler stepped: it shows the LR of the next step.
    for step, lr in logged[:: max(1, len(logged) // 50)]:
        if not math.isclose(lr, peak * planned(step), rel_tol=1e-3, abs_tol=1e-12):
            return None, 0
    return (lambda steps: lr_schedule(cfg, steps)), cfg.warmup_steps


def forecast_inputs(run_dir: Path) -> Any:
    """What a forecast of one run needs from its log (:class:`nanolab.forecast.CurveInputs`):
    (step, tokens, val loss) points, ``trainer.max_steps``, tokens per step, the LR schedule
    from the config, and GPU-hours and cost per token so far."""
    from nanolab.forecast import CurveInputs

    records = read_run(run_dir)[0]
    val = last_by_step([r for r in records if r.get("event") == "val"])
    train = last_by_step([r for r in records if r.get("event") == "train"])
    points = [
        (float(s), t, v)
        for s, t, v in ((r.get("step"), num(r.get("tokens")), num(r.get("val_loss"))) for r in val)
        if isinstance(s, int) and t is not None and v is not None and t > 0
    ]
    config = config_of(records, run_dir) or {}
    max_steps = num((config.get("trainer") or {}).get("max_steps"))
    last = next((r for r in reversed(train) if num(r.get("tokens")) and r.get("step")), None)
    per_step = num(last["tokens"]) / int(last["step"]) if last else None
    tokens = num((last or {}).get("tokens"))
    gpu_h, cost = num(last_value(train, "gpu_hours")), num(last_value(train, "cost"))
    schedule_for, warmup = _schedule_of(config, train) if points else (None, 0)
    return CurveInputs(
        points=points,
        max_steps=int(max_steps) if max_steps and max_steps > 0 else None,
        tokens_per_step=per_step,
        schedule_for=schedule_for,
        warmup_steps=warmup,
        gpu_hours_per_token=gpu_h / tokens if gpu_h and tokens else None,
        cost_per_token=cost / tokens if cost and tokens else None,
    )


def forecasts(
    selected: list[tuple[str, Path]], groups: list[SeedGroup], target: float | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Forecasts per run and per seed group (the group's points fitted together)."""
    from dataclasses import replace

    from nanolab.forecast import forecast

    inputs = {name: forecast_inputs(d) for name, d in selected}
    runs = {name: forecast(i, target) for name, i in inputs.items()}
    by_group = {}
    for g in groups:
        members = [inputs[r] for r in g.runs if r in inputs]
        if not members:
            continue
        rate = [m.gpu_hours_per_token for m in members if m.gpu_hours_per_token]
        price = [m.cost_per_token for m in members if m.cost_per_token]
        # One recipe, several seeds: the first member's plan, everyone's points.
        by_group[g.label] = forecast(
            replace(
                members[0],
                points=sorted(p for m in members for p in m.points),
                gpu_hours_per_token=statistics.fmean(rate) if rate else None,
                cost_per_token=statistics.fmean(price) if price else None,
            ),
            target,
        )
    return runs, by_group


def format_forecasts(
    runs: dict[str, Any], groups: dict[str, Any], target: float | None, hours: str = "GPU-h"
) -> str:
    head = ("forecast: the val curve fitted as L = L0 + A*S1^-alpha - C*S2 over the run's LR "
            "schedule (S1: LR area, S2: annealing area; without a known schedule L = E + "
            "A*D^-alpha in tokens); [5%, 95%] of a residual bootstrap, widened by the fit's "
            "own backtest miss")  # fmt: skip
    out = ["", head]
    for label, f in [*runs.items(), *((f"group {k}", v) for k, v in groups.items())]:
        if f.fit is None:
            out.append(f"  {label}: no forecast ({f.note})")
            continue
        if f.finished:
            out.append(f"  {label}: {finished_text(f)}" + _target_text(f, target, hours))
            continue
        text = f"  {label}: {f.points} val points, "
        if f.model == "schedule":
            text += (f"L0={f.fit['L0']:.3f} alpha={f.fit['alpha']:.3f} C={f.fit['C']:.3g} "
                     f"decay={f.fit['decay']:g}")  # fmt: skip
        else:
            text += f"power law E={f.fit['E']:.3f} alpha={f.fit['alpha']:.3f}"
        if f.fit.get("degenerate"):
            text += " (the points do not pin the curve's shape: unreliable)"
        elif f.fit.get("annealing_seen", 1.0) < 0.25:
            text += " (under a quarter of the LR decay seen: its gain is not counted, the range reaches the fit with it)"
        if f.final_loss is not None:
            lo, hi = f.final_band
            text += (f"; at max_steps ({si(f.final_tokens)} tokens): {f.final_loss:.4f} "
                     f"[{lo:.4f}, {hi:.4f}]")  # fmt: skip
        out.append(text + _target_text(f, target, hours))
    return "\n".join(out)


def _target_text(f: Any, target: float | None, hours: str) -> str:
    """``; to X: tokens [range], hours, cost`` for --target-loss (empty without one)."""
    if target is None:
        return ""
    if f.target_tokens is None:
        return f"; to {target}: {f.note}"
    lo, hi = f.target_band
    hi_text = si(hi) if math.isfinite(hi) else "never"
    text = f"; to {target}: {si(f.target_tokens)} tokens [{si(lo)}, {hi_text}]"
    if f.target_gpu_hours is not None:
        text += f", {f.target_gpu_hours:.3g} {hours}"
    if f.target_cost is not None:
        text += f", {_money(f.target_cost)}"
    return text


def finished_text(f: Any) -> str:
    """A run whose last validation is at max_steps: its final val loss and how well the curve
    was fitted (rmse, the worst backtest miss), not a forecast of a point already reached; a
    floor fitted at its bound of 0 is named as such, not shown as a loss the run tends to."""
    fit = f.fit
    text = f"finished ({f.points} val points), final val loss {f.last_loss:.4f}; the fit's "
    text += f"rmse {fit['rmse']:.3g} over {fit['n']} points"
    misses = [m for m, _ in fit.get("backtests") or []]
    if misses:
        text += f", worst backtest miss {max(misses):.3g}"
    floor = fit.get("L0", fit.get("E"))
    if floor is not None and floor <= 1e-6:
        text += "; its floor is at the bound 0 (not pinned by the points)"
    return text


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


def compare_runs(found: list[tuple[str, Path]], a: str, b: str) -> str:
    """The config keys where runs ``a`` and ``b`` differ (seed and name included), then their
    results side by side."""
    dirs = dict(found)
    for name in (a, b):
        if name not in dirs:
            have = ", ".join(list(dirs)[:12]) + (" ..." if len(dirs) > 12 else "")
            raise ReportError(f"--compare: no run named {name!r}; runs found: {have}")
    now = time.time()
    sa, sb = summarize_run(a, dirs[a], now), summarize_run(b, dirs[b], now)
    configs = []
    for name in (a, b):
        config = config_of(tail_records(dirs[name], "start"), dirs[name])
        if config is None:
            raise ReportError(
                f"--compare: run {name} has no config (no start record, no config.yaml)"
            )
        plain = flatten(json.loads(json.dumps(config, default=str)))
        plain.pop("trainer.default_root_dir", None)  # follows run.root/run.name
        configs.append(plain)
    missing = "(unset)"
    keys = sorted(k for k in set(configs[0]) | set(configs[1])
                  if _value(configs[0].get(k, missing)) != _value(configs[1].get(k, missing)))  # fmt: skip
    rows = [("config", a, b)]
    rows += [
        (k, _value(configs[0].get(k, missing)), _value(configs[1].get(k, missing))) for k in keys
    ]
    if not keys:
        rows.append(("(no difference)", "", ""))
    rows += [("", "", ""), ("result", "", "")]

    for label, fn in (
        ("status", _status_text), ("steps", lambda s: "-" if s.steps is None else str(s.steps)),
        ("tokens", lambda s: si(s.tokens)), ("final val loss", lambda s: _f(s.final_val_loss)),
        ("best val loss", lambda s: "-" if s.best_val_loss is None
         else f"{s.best_val_loss:.4f} (step {s.best_val_step})"),
        ("train loss", lambda s: _f(s.train_loss)),
        ("Δ train loss", lambda s: "-" if s.improvement is None else f"{-s.improvement:+.4f}"),
        ("tokens/s", lambda s: si(s.tokens_per_s)),
        (hours_label([sa.accelerator, sb.accelerator]), lambda s: _f(s.gpu_hours, ".3f")),
        ("wall", lambda s: duration(s.wall_s)),
    ):  # fmt: skip
        rows.append((label, fn(sa), fn(sb)))
    return "\n".join(table(rows, rule=False))


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


def _scaling(args: argparse.Namespace, selected: list[tuple[str, Path]]) -> tuple[Any, Any]:
    """``--scaling`` / ``--gpu-hours``: the fit's text and data (None, None when not asked)."""
    if not args.scaling and args.gpu_hours is None:
        return None, None
    if args.gpu_hours is not None and not (math.isfinite(args.gpu_hours) and args.gpu_hours > 0):
        raise ReportError(f"--gpu-hours {args.gpu_hours}: give a positive number, e.g. 100")
    from nanolab.scaling_fit import ScalingError, points_from_runs, scaling_report

    points, _ = points_from_runs(selected)
    try:
        return scaling_report(points, args.gpu_hours)
    except ScalingError as err:
        raise ReportError(f"--scaling: {err}") from None


@one_line_errors("nanolab report")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.plot is not None:
        check_plot_path(args.plot)
    roots = args.runs_dirs or [Path("runs")]
    found = discover_runs(roots)
    if not found:
        where = ", ".join(str(r) for r in roots)
        print(
            f"nanolab report: error: no runs under {where} (no {RUN_LOG_NAME} found); "
            "runs appear there once `nanolab fit` has started",
            file=sys.stderr,
        )
        return 2  # bad input, as nanolab status says of the same folder
    if args.compare:
        print(compare_runs(found, *args.compare))
        everyone = [summarize_run(n, d) for n, d in found]
        pair = [g for g in seed_groups(everyone) if set(args.compare) & ({g.label} | set(g.runs))]
        if len(pair) == 2:
            for c in compare_groups(everyone, pair, baseline=pair[1].label):
                print(f"\nseed groups: {c.sentence}")
        return 0
    selected = _select(found, args.run)
    now = time.time()
    summaries = _sort([summarize_run(n, d, now) for n, d in selected], args.sort)
    if args.index:
        say("nanolab report", update_index(roots, summaries))
    universe = config_summaries(found) if args.run else summaries
    groups = seed_groups(summaries, universe)
    comparisons = compare_groups(summaries, groups, args.baseline)
    want_forecast = args.forecast or args.target_loss is not None
    if args.target_loss is not None and not 0 < args.target_loss < math.inf:
        raise ReportError(f"--target-loss {args.target_loss}: give a loss > 0, e.g. 1.5")
    run_fc, group_fc = forecasts(selected, groups, args.target_loss) if want_forecast else ({}, {})
    scaling_text, scaling_data = _scaling(args, selected)
    if args.plot is not None:
        dirs = dict(selected)
        plotted, left_out = (summaries, 0) if args.run else default_plot_selection(summaries)
        plot_runs([(s, dirs[s.run]) for s in plotted], args.plot, args.x, run_fc, logx=args.logx,
                  universe=universe)  # fmt: skip
    if args.json:
        payload = {
            "runs": [
                {k: v for k, v in asdict(s).items() if k not in ("group", "val_points")}
                for s in summaries
            ],
            "seed_groups": [asdict(g) for g in groups],
            "comparisons": [asdict(c) for c in comparisons],
        }
        if want_forecast:
            payload["forecasts"] = {k: asdict(v) for k, v in run_fc.items()}
            payload["group_forecasts"] = {k: asdict(v) for k, v in group_fc.items()}
        if scaling_data is not None:
            payload["scaling"] = scaling_data
        print(json.dumps(payload, indent=2, default=str))
    else:
        print(format_table(summaries, groups, comparisons))
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
        print(f"plot: {args.plot}{note}", file=sys.stderr if args.json else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
