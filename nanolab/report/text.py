"""The report's text: the summary table, the downstream-task and validation tables, and
``--compare``'s two runs side by side."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

from nanolab.downstream.tasks import mean_label
from nanolab.report.groups import (
    Comparison,
    NotCompared,
    NotTested,
    ReportError,
    SeedGroup,
    comparable_config,
    flatten,
    value_text,
)
from nanolab.runlog import RUN_LOG_NAME
from nanolab.runs import (
    DELTA_WINDOW,
    RunSummary,
    config_of,
    duration,
    hours_label,
    si,
    summarize_run,
    tail_records,
)
from nanolab.tables import WIDTH, table, table_within


def _f(value: float | None, fmt: str = ".4f") -> str:
    return "-" if value is None else format(value, fmt)


def money(value: float | None) -> str:
    if value is None:
        return "-"
    return f"${value:.2f}" if value >= 1 or value == 0 else f"${value:.2g}"


def _status_text(s: RunSummary) -> str:
    """The status, its detail for a run that failed, and its resumes and rollbacks: a run that
    diverged or crashed after a resume says so too (its ``--json`` has the same counts)."""
    notes = [f"+{s.resumes} resume{'s' if s.resumes > 1 else ''}"] if s.resumes else []
    if s.rollbacks:
        notes.append(f"{s.rollbacks} rollback{'s' if s.rollbacks > 1 else ''}")
    status = s.status
    if s.detail and s.status in ("error", "crashed", "diverged"):
        detail = s.detail.strip().splitlines()[-1] if s.detail.strip() else ""
        status = f"{s.status}: {detail[:60]}"
    return status + (f" ({', '.join(notes)})" if notes else "")


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
    mean = "CORE" if suites == {"core"} else "centered"
    tasks = list(dict.fromkeys(t for row in scored for t in row[5]))
    headers = ["run", "from", "step", "suite", mean, *tasks]
    rows = [
        [run, source, "-" if step is None else str(step), suite or "?", _f(core, "+.3f"),
         *(_f(scores.get(t), ".3f") for t in tasks)]
        for run, source, step, suite, core, scores in scored
    ]  # fmt: skip
    out = ["", *table_within(rows, headers, {2, *range(4, len(headers))})]
    return out + _wrap(
        f"{mean}: the mean over the suite's tasks of (accuracy - chance) / (1 - chance), 0 at "
        "chance"
        + (" (called CORE for the CORE suite only)" if mean != "CORE" else "")
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


#: The "not tested" lines printed, at most (a folder of one-off runs beside a seed group
#: would otherwise print one per run); ``--json`` has every one.
NOT_TESTED_SHOWN = 8


def _mean_spread(mean: float | None, std: float | None, fmt: str = ".4f") -> str:
    if mean is None:
        return "-"
    spread = fmt.lstrip("+")  # a signed mean (+0.041), an unsigned spread (± 0.009)
    return f"{mean:{fmt}} ± {std:{spread}}" if std is not None else f"{mean:{fmt}}"


def format_table(
    summaries: list[RunSummary],
    groups: list[SeedGroup],
    comparisons: list[Comparison] | None = None,
    not_compared: list[NotCompared] | None = None,
    not_tested: list[NotTested] | None = None,
) -> str:
    """The report: runs (cut into tables of at most 100 columns), then the downstream scores,
    seed groups, their differences (and the configs too few runs kept from a test) and notes."""
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
                money(s.cost),
                duration(s.wall_s),
            ]
        )
    out = table_within(rows, headers, {2, 3, 4, 6, 8, 9, 10, 11, 12})
    out += _wrap(
        f"Δ train loss: mean training loss of the last {DELTA_WINDOW} logged steps after the "
        f"first (all of them when fewer) minus the first logged step's (the same for every "
        f"run). {hours}: devices x wall hours"
    )
    out += downstream_table(summaries)
    out += validated_table(summaries)
    if groups:
        out += [
            "",
            *_wrap(
                "seed groups (same config, different seed): val loss at the most tokens where "
                "every seed validated, mean ± 95% confidence interval (Student t over the seeds)"
            ),
        ]
        for g in groups:
            spread = _mean_spread(g.mean_val_loss, g.ci_val_loss)
            if g.at_tokens is not None:
                spread += f" at {g.at_tokens:,} tokens"
                spread += " (interpolated: the seeds share no validation)" if g.interpolated else ""
            if g.mean_core is not None:
                spread += f", {mean_label(g.suite)} {_mean_spread(g.mean_core, g.std_core, '+.3f')}"
            seeds = ",".join(str(x) for x in dict.fromkeys(g.seeds))  # a repeat counts once
            out.append(f"  {g.label}: {spread}  (n={g.n}, seeds {seeds}: {', '.join(g.runs)})")
            if g.left_out:
                out.append(
                    f"    note: left out of the statistics: {', '.join(g.left_out)}; the "
                    f"figures are over the other {g.n} run(s)"
                )
    if comparisons or not_compared or not_tested:
        out += ["", "differences (Welch's t-test over seeds, val loss at equal tokens):"]
        reference = ""
        for c in comparisons or []:
            if c.reference and c.reference != reference:  # groups on several datasets: each
                out.append(f"  ({c.reference})")
            reference = c.reference
            out.append(f"  {c.sentence}")
        out += [f"  {c.sentence}" for c in not_compared or []]
        untested = not_tested or []
        out += [f"  {c.sentence}" for c in untested[:NOT_TESTED_SHOWN]]
        if len(untested) > NOT_TESTED_SHOWN:
            out.append(f"  ... and {len(untested) - NOT_TESTED_SHOWN} more configs not tested "
                       "(--json: not_tested)")  # fmt: skip
    skipped = [s for s in summaries if s.skipped_records]
    if skipped:
        out.append("")
        for s in skipped:
            out.append(
                f"note: {s.run}: skipped {s.skipped_records} record(s) of the wrong shape in "
                f"{Path(s.run_dir) / RUN_LOG_NAME} (first: {s.skipped_example}); the rest is shown"
            )
    return "\n".join(out)


def compare_runs(
    found: list[tuple[str, Path]],
    a: str,
    b: str,
    known: dict[str, RunSummary] | None = None,
    now: float | None = None,
) -> str:
    """The config keys where runs ``a`` and ``b`` differ (seed and name included), then their
    results side by side. ``known``: summaries already made, by run (the two made here are
    added, for the seed groups that follow)."""
    dirs = dict(found)
    for name in (a, b):
        if name not in dirs:
            have = ", ".join(list(dirs)[:12]) + (" ..." if len(dirs) > 12 else "")
            raise ReportError(f"--compare: no run named {name!r}; runs found: {have}")
    now = time.time() if now is None else now
    known = {} if known is None else known
    for name in (a, b):
        if name not in known:
            known[name] = summarize_run(name, dirs[name], now)
    sa, sb = known[a], known[b]
    configs = []
    for name in (a, b):
        config = config_of(tail_records(dirs[name], "start"), dirs[name])
        if config is None:
            raise ReportError(
                f"--compare: run {name} has no config (no start record, no config.yaml)"
            )
        plain = flatten(comparable_config(json.loads(json.dumps(config, default=str))))
        plain.pop("trainer.default_root_dir", None)  # follows run.root/run.name
        configs.append(plain)
    missing = "(unset)"
    keys = sorted(k for k in set(configs[0]) | set(configs[1])
                  if value_text(configs[0].get(k, missing)) != value_text(configs[1].get(k, missing)))  # fmt: skip
    rows = [("config", a, b)]
    rows += [
        (k, value_text(configs[0].get(k, missing)), value_text(configs[1].get(k, missing)))
        for k in keys
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
