"""``nanolab report``: the morning summary of every run under one or more run folders.

Each run is read by :func:`nanolab.runs.summarize_run`, whatever state it is in (finished,
running, crashed); curves and "best" figures come from the timeline a resume leaves.

Runs whose configs differ only in the seed and the run name are grouped, with the mean and
standard deviation of their final validation loss: one seed is an anecdote. A group is labelled
by the config values that set it apart from the other groups (``lr=0.001``), not by its names.
"Δ train loss" is the same for every run: the mean training loss of the last
:data:`DELTA_WINDOW` logged steps after the first (all of them when fewer) minus the loss of the
first logged step.

``--plot`` draws one colour per group: the mean over its seeds and its 95% interval, against
tokens (or GPU-hours); without ``--run`` it draws the runs trained on the same data as the most
recently updated one (curves of different vocabularies do not share a y axis).
``--compare A B`` prints the config keys where two runs differ beside their results.

``--forecast`` (and ``--target-loss X``) fits each run's validation curve with
:mod:`nanolab.forecast` and says what it will reach at ``trainer.max_steps``, and the tokens,
GPU-hours and cost to reach ``X``; a seed group's points are fitted together.
``--scaling`` (and ``--gpu-hours H``) fits L(N, D) over finished runs of several model sizes
(:mod:`nanolab.scaling_fit`) and gives the compute-optimal size for ``H`` GPU-hours.

The package, one module a job: :mod:`~nanolab.report.groups` (seed groups and their tests),
:mod:`~nanolab.report.text` (tables), :mod:`~nanolab.report.plot` (``--plot``),
:mod:`~nanolab.report.forecasts` (``--forecast``) and :mod:`~nanolab.report.cli` (the verb).
"""

from nanolab.report.cli import SORT_FIELDS, build_parser, main, update_index
from nanolab.report.forecasts import (
    finished_text,
    forecast_inputs,
    forecasts,
    format_forecasts,
)
from nanolab.report.groups import (
    Comparison,
    NotCompared,
    NotTested,
    ReportError,
    SeedGroup,
    common_tokens,
    compare_groups,
    config_groups,
    config_summaries,
    flatten,
    group_labels,
    not_compared,
    seed_groups,
    values_at,
)
from nanolab.report.plot import (
    BAND_TITLE,
    check_plot_path,
    data_key,
    default_plot_selection,
    plot_runs,
)
from nanolab.report.text import (
    compare_runs,
    downstream_table,
    format_table,
    task_names,
    validated_table,
)
from nanolab.runs import discover_runs, summarize_run

#: Every public name the single-module ``nanolab/report.py`` had, still importable from here.
__all__ = [
    "BAND_TITLE",
    "SORT_FIELDS",
    "Comparison",
    "NotCompared",
    "NotTested",
    "ReportError",
    "SeedGroup",
    "build_parser",
    "check_plot_path",
    "common_tokens",
    "compare_groups",
    "compare_runs",
    "config_groups",
    "config_summaries",
    "data_key",
    "default_plot_selection",
    "discover_runs",
    "downstream_table",
    "finished_text",
    "flatten",
    "forecast_inputs",
    "forecasts",
    "format_forecasts",
    "format_table",
    "group_labels",
    "main",
    "not_compared",
    "plot_runs",
    "seed_groups",
    "summarize_run",
    "task_names",
    "update_index",
    "validated_table",
    "values_at",
]
