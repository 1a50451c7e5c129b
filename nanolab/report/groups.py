"""Seed groups and their comparisons: runs of one configuration that differ only in seed,
labelled by what sets them apart, and Welch's test between groups at equal tokens."""

from __future__ import annotations

import json
import os
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanolab.runs import (
    RunsError,
    RunSummary,
    config_of,
    data_identity_of,
    seed_free_fingerprint,
    summarize_run,
    tail_records,
)


class ReportError(RunsError):
    """Bad input for the report (unknown field or run name, missing folder)."""


@dataclass
class SeedGroup:
    """Runs of one configuration that differ only in seed: the spread of the final val loss."""

    label: str
    runs: list[str]
    seeds: list[int | None]
    n: int
    mean_val_loss: float | None
    std_val_loss: float | None
    repeated_seeds: list[int] = field(default_factory=list)  # seeds run twice: counted once
    mean_core: float | None = None  # mean centered score in training, over the seeds with one
    std_core: float | None = None
    suite: str | None = None  # the suite of those scores (CORE only when "core")
    ci_val_loss: float | None = None  # half-width of the 95% interval (Student t over seeds)
    at_tokens: int | None = None  # the val losses are read here (see common_tokens)
    val_losses: list[float] = field(default_factory=list)  # one per seed, at at_tokens
    interpolated: bool = False  # some seed has no validation at at_tokens: read between two
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
    interpolated: bool = False  # some run has no validation at at_tokens: read between two
    #: How the pairs were chosen, for the heading above the sentences ("" for two groups).
    reference: str = ""


@dataclass
class NotCompared:
    """Seed groups trained on other data or another vocabulary than ``others``: a val loss is
    nats per token of its own validation text and vocabulary, so theirs are not one quantity
    and are neither ranked nor tested against each other (bits per byte are shown instead)."""

    groups: list[str]
    data: str
    others: list[str]
    others_data: str
    #: Each group's mean val bpb at its runs' last validation, where its runs logged one.
    val_bpb: dict[str, float]
    sentence: str


@dataclass
class NotTested:
    """A config that would be tested against ``against`` (same data and vocabulary) but has
    fewer than two values to test with: run once, or its other seeds left out, or not
    validated by the tokens both reached. Said in one line rather than dropped: a variant run
    with one seed is the one a reader most needs told that it was not tested."""

    group: str
    against: str
    runs: list[str]
    n: int  # its usable values where it would be read
    sentence: str


#: Config sections every complete run log names; a run without one of them (where another
#: run has it) stands alone in the groups.
CORE_SECTIONS = frozenset({"model", "data", "trainer"})


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay values)."""
    if not isinstance(config, dict):
        return {prefix: config} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in config.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


#: The keys of a config's ``data`` section that say where its data is: a run whose start record
#: logged what the data holds (``data_identity``) is grouped by that instead, so ``data``, its
#: absolute path and a byte-identical copy are one config (older logs: the keys as written).
DATA_LOCATION_KEYS = ("dataset_dir", "datasets", "source")
#: The one key that stands for them in a run's config as the groups compare it.
DATA_KEY = "data.dataset"


def comparable_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with its ``model`` and ``data`` sections in one form, so that the report
    compares what a run trained with rather than how its config was written: a class-path
    section's ``init_args`` read as the section's own keys (``model.gpt.n_layer``, not
    ``model.init_args.gpt.n_layer``), and the class kept as ``class_path``, nanolab's own class
    path standing for the short form. A fork's ``SmoothedGPT`` run and a plain run are then two
    configs told apart by ``model.class_path`` (and by any setting they share, e.g. n_layer),
    not runs whose every model key is unset on one side. ``trainer.precision`` is read as
    Lightning names it (:func:`~nanolab.training.resolve.precision_name`): ``bf16`` and
    ``bf16-mixed`` (``16``/``16-mixed``, ``32``/``32-true``/null) train alike, so the seed
    groups, ``--compare`` and ``--scaling``'s recipes all see one setting."""
    from nanolab.errors import NanolabError  # section() refuses a section of another type
    from nanolab.training.plugins import DEFAULT_DATA, DEFAULT_MODEL
    from nanolab.training.resolve import precision_name, section

    out = dict(config)
    trainer = out.get("trainer")
    if isinstance(trainer, dict) and "precision" in trainer:
        out["trainer"] = {**trainer, "precision": precision_name(trainer["precision"])}
    for key, default in (("model", DEFAULT_MODEL), ("data", DEFAULT_DATA)):
        if not isinstance(out.get(key), (dict, str)):
            continue  # null (a value of its own) or absent: nothing to unwrap
        try:
            class_path, args = section(out, key, default)
        except NanolabError:
            continue
        out[key] = {**args, "class_path": class_path}
    return out


def run_config(s: RunSummary) -> dict[str, Any]:
    """A run's seed-free config as the report compares it (:func:`comparable_config`)."""
    return comparable_config(json.loads(s.group or "{}"))


def _flat_config(s: RunSummary) -> dict[str, Any]:
    """A run's seed-free config, flattened, as the seed groups compare it: the data's location
    keys (:data:`DATA_LOCATION_KEYS`) replaced by one key, :data:`DATA_KEY`, whose value is
    what the data holds (the start record's ``data_identity``), or for an older log without it
    the location keys as configured (nulls dropped: a key a newer release added splits
    nothing). The rule of :func:`data_of`, which keeps groups on other data from being
    compared: one dataset named two ways is one group, not two that it then compares."""
    flat = flatten(run_config(s))
    if not any(k.startswith("data.") for k in flat):
        return flat  # no data section (or a null one): nothing to stand for
    where: dict[str, Any] = {}
    for key in list(flat):
        section, _, leaf = key.rpartition(".")
        if section == "data" and leaf in DATA_LOCATION_KEYS:
            value = flat.pop(key)
            if value is not None:
                where[leaf] = value
    flat[DATA_KEY] = (
        f"content {s.data_identity}"
        if s.data_identity is not None
        else json.dumps(where, sort_keys=True, default=str)
    )
    return flat


def _common_configs(summaries: list[RunSummary]) -> dict[str, dict[str, Any]]:
    """Each run's seed-free config, flattened, cut to the keys that can tell runs apart: every
    key all the runs' configs have (null is a value there: ``attention_window`` null and 8 are
    two configs), and a key only some logs carry where those logs disagree on it. A key only
    some logs carry, all with one value, was added (or removed) by another nanolab version with
    a default the older runs also trained with, so it must not split one experiment's seeds;
    where the logs that carry it differ, a run without it is a config of its own (``unset``)."""
    flats = {s.run: _flat_config(s) for s in summaries if s.group is not None}
    # A run whose log holds part of its config (a section others have is missing: an older
    # debug run logged only its model) cannot be compared: it stands alone, instead of cutting
    # every run's config down to that part and grouping unrelated runs as seeds.
    sections = {run: {key.split(".", 1)[0] for key in f} for run, f in flats.items()}
    wanted = CORE_SECTIONS & set().union(*sections.values())
    flats = {run: f for run, f in flats.items() if wanted <= sections[run]}
    keys: set[str] = set().union(*flats.values())  # once: per run it was quadratic
    flats = {run: {k: _value_in(f, k) for k in keys} for run, f in flats.items()}
    kept = set()
    for key in keys:
        values = {value_text(f[key]) for f in flats.values() if f[key] is not _ABSENT}
        if len(values) > 1 or all(f[key] is not _ABSENT for f in flats.values()):
            kept.add(key)
    return {run: {k: f[k] for k in sorted(kept) if f[k] is not _ABSENT} for run, f in flats.items()}


#: A key a run's config does not have (neither it nor a null section above it).
_ABSENT: Any = object()


def _value_in(flat: dict[str, Any], key: str) -> Any:
    """``flat[key]``; null inside a section set to null (``trainer.logger: null`` has a null
    ``trainer.logger.class_path``); :data:`_ABSENT` when the config does not have it."""
    if key in flat:
        return flat[key]
    parts = key.split(".")
    for n in range(len(parts) - 1, 0, -1):
        above = ".".join(parts[:n])
        if above in flat:
            return None if flat[above] is None else _ABSENT
    return _ABSENT


def data_of(s: RunSummary) -> tuple[Any, Any] | None:
    """What a run's loss is measured on: what its data holds (the start record's
    ``data_identity``: one folder named relative or absolute, or a byte-identical copy, is the
    same data), else, for an older log, its dataset as configured (``data.dataset_dir``, or
    the list ``data.datasets``); and its vocabulary size (None when its config is unknown)."""
    where = _data_where(s)
    if where is None:
        return None
    vocab = ((run_config(s).get("model") or {}).get("gpt") or {}).get("vocab_size")
    return s.data_identity or where[0], vocab


def _data_where(s: RunSummary) -> tuple[Any] | None:
    """The run's dataset as its config names it (in a one-tuple: it may be None), or None
    when its config is unknown."""
    if s.group is None:
        return None
    data = run_config(s).get("data") or {}
    return (data.get("datasets") or data.get("dataset_dir"),)


def data_key(s: RunSummary) -> str | None:
    """:func:`data_of` as one comparable text: runs with equal keys have losses on one scale
    (the one rule of ``--plot``, ``--scaling`` and the seed-group statistics)."""
    of = data_of(s)
    return None if of is None else json.dumps(list(of), sort_keys=True, default=str)


def data_text(s: RunSummary) -> str:
    """:func:`data_of` for a reader: ``data/shk_bpe, vocab 300`` (where, as configured)."""
    of = data_of(s)
    if of is None:
        return "data unknown"
    vocab = of[1]
    return f"{where_text(s)}, vocab {vocab if vocab is not None else 'unknown'}"


def where_text(s: RunSummary) -> str:
    """A run's dataset as its config names it: ``data/shk_bpe``, a mixture's folders joined
    with ``+``, ``data unknown``."""
    at = _data_where(s)
    where = None if at is None else at[0]
    if isinstance(where, list):  # a mixture: its folders
        where = "+".join(str(d.get("path", d)) if isinstance(d, dict) else str(d) for d in where)
    return str(where) if where else "data unknown"


def by_config(summaries: list[RunSummary]) -> list[list[RunSummary]]:
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


def value_text(value: Any) -> str:
    """A config value as one line of a table or a label: lists, dicts and a string with a line
    break or another unprintable character (a data template) as JSON, so ``\n`` shows as
    such rather than breaking the row in two (and dropping the table's blank rows)."""
    if isinstance(value, (list, dict)) or (isinstance(value, str) and not value.isprintable()):
        return json.dumps(value)
    return str(value)


def group_labels(
    groups: list[list[RunSummary]], max_keys: int = 4, universe: list[RunSummary] | None = None
) -> list[str]:
    """Each group's label: the config values that set it apart from the other groups of
    ``universe`` (every run found; default: the groups given) (``lr=0.001, n_layer=6``); with
    one group, or too many differences, its run names without the seed suffix. Taking the
    differences over every run found keeps a group's label the same whatever ``--run`` picks."""
    everyone = [g[0] for g in by_config(universe)] if universe else [g[0] for g in groups]
    common = _common_configs(everyone + [g[0] for g in groups])
    configs = [common.get(g[0].run) for g in groups]
    across = [common.get(r.run) for r in everyone]
    keys = sorted({k for c in across if c for k in c})
    missing = object()
    varying = [
        k
        for k in keys
        if len({value_text(c.get(k, missing)) if c else "?" for c in across}) > 1
        and all(c is not None for c in across)
    ]
    plain = [k for k in keys if k not in CLASS_KEYS]  # a class is labelled by its section
    short = _short_keys([k for k in varying if k in plain], plain)  # unambiguous among them
    short.update({k: CLASS_KEYS[k] for k in varying if k in CLASS_KEYS})
    classes = {k: _class_names({c.get(k) for c in across if c}) for k in CLASS_KEYS}
    labels = []
    for group, config in zip(groups, configs, strict=True):
        if config is None or not varying or len(varying) > max_keys:
            label = name_label([m.run for m in group])
        else:
            label = ", ".join(
                f"{short[k]}={classes[k].get(config[k], config[k])}"
                if k in config and k in CLASS_KEYS
                else f"{short[k]}={_label_value(k, config[k], group[0], groups)}"
                if k in config
                else f"{short[k]} unset"
                for k in varying
            )
        labels.append(label)
    return labels


#: The keys that name a section's class (:func:`comparable_config`), labelled by the section:
#: ``model=SmoothedGPT``.
CLASS_KEYS = {"model.class_path": "model", "data.class_path": "data"}


def _class_names(paths: set[Any]) -> dict[Any, str]:
    """Each class path by its class's own name (``SmoothedGPT``), or whole where another path
    of ``paths`` ends in the same name."""
    names = [str(p).rpartition(".")[2] for p in paths]
    return {p: n if names.count(n) == 1 else str(p) for p, n in zip(paths, names, strict=True)}


def _label_value(key: str, value: Any, run: RunSummary, groups: list[list[RunSummary]]) -> str:
    """A config value as a group's label shows it: the data (:data:`DATA_KEY`) by the folder
    its first run names (``dataset=data/shk``), with a short hash of what it holds where
    another group names the same folder for other content (data prepared again in place)."""
    if key != DATA_KEY:
        return value_text(value)
    where = where_text(run)
    if run.data_identity is not None and any(
        where_text(g[0]) == where and g[0].data_identity != run.data_identity for g in groups
    ):
        return f"{where} (content {run.data_identity[:8]})"
    return where


#: A seed suffix as the queue and sweeps write it: ``-s3``, ``_seed7``, ``.seed=2``.
_SEED_SUFFIX = r"[-_.](?:seed[-_=]?|s)"
_SEPARATORS = "-_./="


def name_label(names: list[str]) -> str:
    """A group's label from its run names: one name less its seed suffix (``qs60-s1`` ->
    ``qs60``; ``qs600``, ``records`` and ``class`` stay whole), several names their common
    part, cut at a separator (``cpu_check-20261205-1215`` of two timestamped names is not a
    name of its own) and less a seed suffix that only the seeds follow, else the names."""
    if len(names) == 1:
        return re.sub(_SEED_SUFFIX + r"\d+$", "", names[0]) or names[0]
    prefix = os.path.commonprefix(names)  # noqa: RUF071
    rests = [n[len(prefix) :] for n in names]
    seed = re.search(_SEED_SUFFIX + "$", prefix)
    if seed and all(r.isdigit() for r in rests):
        return prefix[: seed.start()] or names[0]
    if not all(r[:1] in _SEPARATORS for r in rests):  # "" (a name that is the prefix) counts
        prefix = re.sub(rf"[^{re.escape(_SEPARATORS)}]*$", "", prefix)
    whole = prefix.rstrip(_SEPARATORS)
    return whole or ", ".join(names[:3]) + (f" (+{len(names) - 3})" if len(names) > 3 else "")


def seed_groups(
    summaries: list[RunSummary], universe: list[RunSummary] | None = None
) -> list[SeedGroup]:
    """Groups of two or more runs sharing a seed-free config, with mean ± std of final val loss
    (labelled against ``universe``, every run found: see :func:`group_labels`)."""
    return [g for g in config_groups(summaries, universe) if len(g.runs) >= 2]


def config_groups(
    summaries: list[RunSummary], universe: list[RunSummary] | None = None
) -> list[SeedGroup]:
    """Every seed-free config of ``summaries`` as a :class:`SeedGroup`, those run once too
    (:func:`not_tested` names them where they would be tested), sorted by label."""
    groups = by_config(summaries)
    labels = group_labels(groups, universe=universe)
    return sorted(
        (seed_group(g, label) for g, label in zip(groups, labels, strict=True)),
        key=lambda g: g.label,
    )


def seed_groups_holding(
    found: list[tuple[str, Path]],
    names: list[str],
    known: dict[str, RunSummary],
    now: float | None = None,
) -> list[SeedGroup]:
    """The seed groups of ``found`` that hold one of ``names`` (a run or a group's label), as
    :func:`seed_groups` of every run's summary makes them, with only their own runs summarised
    (``known``: the summaries already made, by run; those made here are added). The groups and
    labels come from each run's config alone (:func:`config_summaries`): a long run beside
    them costs a read of its last ``start`` record, not of its whole log."""
    dirs = dict(found)
    groups = by_config(config_summaries(found))
    out = []
    for members, label in zip(groups, group_labels(groups), strict=True):
        if len(members) < 2 or not set(names) & ({label} | {m.run for m in members}):
            continue
        for m in members:
            if m.run not in known:
                known[m.run] = summarize_run(m.run, dirs[m.run], now)
        out.append(seed_group([known[m.run] for m in members], label))
    return sorted(out, key=lambda g: g.label)


def seed_group(members: list[RunSummary], label: str) -> SeedGroup:
    """One group's statistics from the summaries of its runs."""
    left_out = [f"{m.run} ({why})" for m in members if (why := _unusable(m))]
    usable = [m for m in members if not _unusable(m)]
    again = repeats(usable)
    left_out += [f"{m.run} (seed {m.seed} again, as {again[m.run]}: counted once)"
                 for m in usable if m.run in again]  # fmt: skip
    repeated = sorted({m.seed for m in usable if m.run in again and m.seed is not None})
    usable = [m for m in usable if m.run not in again]
    at_tokens = common_tokens(usable)
    between = interpolated(usable, at_tokens)
    # A seed whose first validation came after at_tokens has no value there: left out and
    # named, so that n counts the values the mean is over.
    at = [(m, _value_at(m, at_tokens)) for m in usable]
    left_out += [f"{m.run} (no validation by {at_tokens:,} tokens)"
                 for m, v in at if v is None]  # fmt: skip
    usable = [m for m, v in at if v is not None]
    losses = [v for _, v in at if v is not None]
    cores = [m.core for m in usable if m.core is not None]
    return SeedGroup(
        label=label,
        runs=[m.run for m in members],
        seeds=[m.seed for m in members],
        n=len(usable),
        mean_val_loss=statistics.fmean(losses) if losses else None,
        std_val_loss=statistics.stdev(losses) if len(losses) >= 2 else None,
        repeated_seeds=repeated,
        mean_core=statistics.fmean(cores) if cores else None,
        std_core=statistics.stdev(cores) if len(cores) >= 2 else None,
        suite=next((m.suite for m in usable if m.core is not None), None),
        ci_val_loss=_ci(losses),
        at_tokens=at_tokens,
        val_losses=losses,
        interpolated=between,
        left_out=left_out,
    )


def config_summaries(found: list[tuple[str, Path]]) -> list[RunSummary]:
    """Every found run with only its name and seed-free config: what the group labels are
    taken against, read from the start records alone (not a whole summary per run)."""
    return [
        RunSummary(
            run=n,
            status="",
            group=seed_free_fingerprint(config_of(start, d), keep_nulls=True),
            data_identity=data_identity_of(start[-1] if start else None, d),
        )
        for n, d in found
        for start in (tail_records(d, "start"),)
    ]


def repeats(members: list[RunSummary]) -> dict[str, str]:
    """Each run of ``members`` (runs of one config) whose seed another one already has, and
    that run: the same config and seed again is the same sample of the loss, not a second
    seed, and counted twice it made a spread of zero that a test and a power estimate read as
    certainty. The run that stands for a seed is :func:`_stands_first` of its runs: a copy
    that crashed early must not stand for the seed a later launch trained to the end."""
    kept: dict[int, str] = {}
    out = {}
    for m in sorted(members, key=_stands_first):
        if m.seed is None:
            continue
        if m.seed in kept:
            out[m.run] = kept[m.seed]
        else:
            kept[m.seed] = m.run
    return out


def _stands_first(run: RunSummary) -> tuple[int, int, int, float]:
    """Sort key: of the runs of one seed, the one that stands for it comes first. A completed
    run, then one that ended for another reason (a budget), then one that crashed or still
    runs; within that the most tokens, then the most validations; the earliest to finish
    breaks a tie (a plain rerun of a finished run keeps the first)."""
    ended = 0 if run.status == "completed" else 2 if run.status in ("crashed", "running") else 1
    return (ended, -(run.tokens or 0), -len(run.val_points), run.updated or 0.0)


def _unusable(run: RunSummary) -> str | None:
    """Why a run cannot stand for its seed in a group's statistics (None: it can)."""
    if run.status == "diverged":
        return "diverged"
    if run.final_val_loss is None:
        return "no finite val loss at its end" if run.val_points else "no val loss"
    return None


def common_tokens(members: list[RunSummary]) -> int | None:
    """The tokens ``members`` are read at side by side: the most tokens every one of them
    validated at, so that each value is a validation at that very count (a run read at its last
    validation before another run's end would be a run read earlier, under the other's count).
    Where no count is shared (runs off each other's evaluation grid), the most tokens every run
    reached, its last validation or beyond, where :func:`values_at` interpolates. None when a
    run has no validation with a token count (the final val losses are read then)."""
    if not members or not all(m.val_points for m in members):
        return None
    shared = set.intersection(*({t for t, _ in m.val_points} for m in members))
    return max(shared) if shared else min(max(t for t, _ in m.val_points) for m in members)


def interpolated(members: list[RunSummary], tokens: int | None) -> bool:
    """Whether some run of ``members`` has no validation at ``tokens`` itself: its value
    there is interpolated (the report says so beside the count)."""
    return tokens is not None and any(all(t != tokens for t, _ in m.val_points) for m in members)


def values_at(members: list[RunSummary], tokens: int | None) -> list[float]:
    """Each run's val loss at ``tokens``: its validation there, else the straight line between
    its validations either side (a run without one on each side has no value and is left
    out); the final val loss when ``tokens`` is None."""
    return [v for v in (_value_at(m, tokens) for m in members) if v is not None]


def _value_at(member: RunSummary, tokens: int | None) -> float | None:
    """:func:`values_at` of one run (None: it has no validation at or on both sides of
    ``tokens``)."""
    if tokens is None:
        return member.final_val_loss
    points = dict(member.val_points)  # a count validated twice (a resume): its last value
    if tokens in points:
        return points[tokens]
    t0 = max((t for t in points if t < tokens), default=None)
    t1 = min((t for t in points if t > tokens), default=None)
    if t0 is None or t1 is None:
        return None
    return points[t0] + (points[t1] - points[t0]) * (tokens - t0) / (t1 - t0)


def _ci(values: list[float]) -> float | None:
    """The 95% interval's half-width of ``values``' mean; None under two values. Those return
    before nanolab.stats is imported: it imports scipy (~1 s), which the report of one run
    (a group of one) does not need."""
    if len(values) < 2:
        return None
    from nanolab.stats import mean_ci

    return mean_ci(values).half_width


#: Up to this many seed groups, every pair is tested; more are each tested against one
#: reference (a handful of sentences, not one per pair of a sweep's dozens of groups).
ALL_PAIRS_UP_TO = 4


def compare_groups(
    summaries: list[RunSummary], groups: list[SeedGroup], baseline: str | None = None
) -> list[Comparison]:
    """:func:`tests`' comparisons (without the configs it could not test)."""
    return tests(summaries, groups, baseline)[0]


def tests(
    summaries: list[RunSummary],
    groups: list[SeedGroup],
    baseline: str | None = None,
    lone: list[SeedGroup] | None = None,
) -> tuple[list[Comparison], list[NotTested]]:
    """Each group against ``baseline`` (a group label or one of its runs); without one, every
    pair of up to :data:`ALL_PAIRS_UP_TO` groups, or each group against the one lowest at the
    tokens every group reached. Groups are ranked at that shared count, not at each one's own
    (a group that trained longer is lower at its end without being better). Only groups on
    one dataset and vocabulary (:func:`same_data`) are ranked and tested against each other:
    a val loss over 300 BPE tokens and one over 71 characters are not one quantity
    (:func:`not_compared` says so of the others). No comparison with fewer than two groups of
    two usable seeds on one dataset.

    Second, :class:`NotTested` lines: each config of ``groups`` or ``lone`` (configs run once)
    with fewer than two usable values, against the group it would be tested with (the
    baseline, else the lowest of its data), and each pair whose runs share too few validations
    to be tested; none on data no testable group trained on."""
    usable = [g for g in groups if len(g.val_losses) >= 2]
    if len(usable) < 2:
        if baseline is not None:  # asked for, and nothing to compare: said, not ignored
            raise ReportError(
                f"--baseline {baseline!r}: these runs hold {len(usable)} seed group(s) with two "
                "usable seeds; a comparison needs two (queue add --seeds 1,2,3 for each config)"
            )
        by_run = {s.run: s for s in summaries}
        return [], _too_few(by_run, usable, [*groups, *(lone or [])], None)
    by_run = {s.run: s for s in summaries}
    families = same_data(by_run, usable)
    if baseline is not None:
        base = next((g for g in usable if g.label == baseline or baseline in g.runs), None)
        if base is None:
            labels = "; ".join(g.label for g in usable)
            few = next((g for g in [*groups, *(lone or [])]
                        if g.label == baseline or baseline in g.runs), None)  # fmt: skip
            if few is not None:
                raise ReportError(_too_few_for_a_baseline(baseline, few, labels))
            raise ReportError(
                f"--baseline {baseline!r} is neither a seed group's label nor one of its runs; "
                f"groups: {labels}"
            )
        (family,) = [f for f in families if base in f]
        if len(family) < 2:
            raise ReportError(
                f"--baseline {baseline!r}: no other seed group was trained on its data and "
                f"vocabulary ({_group_data(by_run, base)}), and a val loss on other data or "
                "vocabulary is not the same quantity; name a group of the same data"
            )
        families = [family]
    out: list[Comparison] = []
    untested: list[NotTested] = []
    for family in families:
        if len(family) < 2:
            continue
        # Several datasets or vocabularies among the groups: each heading names its own.
        on = f"the groups on {_group_data(by_run, family[0])}" if len(families) > 1 else ""
        out += _compare_family(by_run, family, baseline, on, untested)
    testable = [g for f in families for g in f]
    return out, _too_few(by_run, testable, [*groups, *(lone or [])], baseline) + untested


def _too_few(
    by_run: dict[str, RunSummary],
    testable: list[SeedGroup],
    candidates: list[SeedGroup],
    baseline: str | None,
) -> list[NotTested]:
    """A :class:`NotTested` line for each of ``candidates`` with fewer than two usable values
    on the data and vocabulary of a ``testable`` group (two or more values): against the
    baseline where it is on that data, else against the lowest group there (the ranking of
    the tested groups is theirs alone: one value does not move it)."""
    out = []
    for family in same_data(by_run, testable):
        key = _family_key(by_run, family[0])
        base = next((g for g in family if baseline is not None
                     and (g.label == baseline or baseline in g.runs)), None)  # fmt: skip
        reference = base or _ranked(by_run, family)[0]
        for g in candidates:
            if len(g.val_losses) < 2 and _family_key(by_run, g) == key:
                out.append(_not_tested(g, reference))
    return out


def _family_key(by_run: dict[str, RunSummary], group: SeedGroup) -> str | None:
    """:func:`data_key` of a group (its first run found stands for all)."""
    first = _first(by_run, group)
    return None if first is None else data_key(first)


def _ranked(by_run: dict[str, RunSummary], family: list[SeedGroup]) -> list[SeedGroup]:
    """``family`` lowest first at the tokens every run of it validated at (or at the end)."""
    everyone = [m for g in family for m in _members(by_run, g)]
    shared = common_tokens(everyone)
    return sorted(family, key=lambda g: _mean_or_inf(values_at(_members(by_run, g), shared)))


def _members(by_run: dict[str, RunSummary], g: SeedGroup) -> list[RunSummary]:
    """A group's runs that stand for a seed (found, not :func:`_unusable`, and not a
    :func:`repeats` of another)."""
    usable = [by_run[r] for r in g.runs if r in by_run and not _unusable(by_run[r])]
    again = repeats(usable)
    return [m for m in usable if m.run not in again]


def _has_and_seeds_to_add(group: SeedGroup) -> tuple[str, str]:
    """What a config of too few values has (``1 run (b-s1)``, ``1 usable seed of 2 (left
    out: ...)``) and the seeds to add for three (``2,3``)."""
    n, runs = len(group.val_losses), len(group.runs)
    has = (f"1 run ({group.runs[0]})" if n == runs == 1
           else f"{n} usable seed{'s' if n != 1 else ''} of {runs}")  # fmt: skip
    if group.left_out:
        has += f" (left out: {', '.join(group.left_out)})"
    used = {x for x in group.seeds if x is not None}
    more = [x for x in range(1, len(used) + 4) if x not in used][: 3 - n]
    return has, ",".join(map(str, more))


def _not_tested(group: SeedGroup, against: SeedGroup) -> NotTested:
    """``A vs B: not tested, A has 1 run; add seeds ...`` for a config of too few values."""
    has, seeds = _has_and_seeds_to_add(group)
    text = (f"{group.label} vs {against.label}: not tested, {group.label} has {has}; a test "
            f"needs two seeds of each: add seeds (queue add its config --seeds {seeds})")  # fmt: skip
    return NotTested(group.label, against.label, group.runs, len(group.val_losses), text)


def _too_few_for_a_baseline(baseline: str, group: SeedGroup, labels: str) -> str:
    """Why ``--baseline`` names no group it can test against: it is ``group`` (or one of its
    runs), a config run once or with fewer than two usable seeds; the seeds to add, as the
    "not tested" line says them, and the groups it could name instead."""
    has, seeds = _has_and_seeds_to_add(group)
    what = f"names {group.label}" if baseline == group.label else f"is a run of {group.label}"
    once = len(group.val_losses) == len(group.runs) == 1
    what += ", a config run once" if once else f", which has {has}"
    return (
        f"--baseline {baseline!r} {what}; a baseline needs two seeds of its config: add "
        f"seeds (queue add its config --seeds {seeds}), or name a seed group: {labels}"
    )


def _compare_family(
    by_run: dict[str, RunSummary],
    family: list[SeedGroup],
    baseline: str | None,
    on: str,
    untested: list[NotTested],
) -> list[Comparison]:
    """:func:`compare_groups` over groups of one dataset and vocabulary; ``on`` names them in
    the heading when other groups are on other data. A pair whose runs share too few
    validations to be tested is added to ``untested``, with why."""
    from nanolab.stats import sentence, welch  # scipy.stats: ~0.5 s, only when there is a test

    def members(g: SeedGroup) -> list[RunSummary]:
        return _members(by_run, g)

    if baseline is not None:
        base = next(g for g in family if g.label == baseline or baseline in g.runs)
        pairs = [(g, base) for g in family if g is not base]
        reference = f"each group against {base.label} (--baseline)" if len(pairs) > 1 else ""
    else:
        shared = common_tokens([m for g in family for m in members(g)])
        ranked = _ranked(by_run, family)
        where = "at their end" if shared is None else f"at {shared:,} tokens, the most all reached"
        if len(ranked) <= ALL_PAIRS_UP_TO:
            pairs = [(a, b) for i, b in enumerate(ranked) for a in ranked[i + 1 :]]
            reference = "" if len(ranked) == 2 else (
                f"every pair of the {len(ranked)} groups; --baseline GROUP tests each against one"
            )  # fmt: skip
        else:
            pairs = [(g, ranked[0]) for g in ranked[1:]]
            reference = (
                f"each group against {ranked[0].label}, the lowest val loss {where}; "
                "--baseline GROUP picks another"
            )
    if on:
        reference = f"{on}: {reference}" if reference else on
    out = []
    for g, base in pairs:
        members_a, members_b = members(g), members(base)
        at = common_tokens(members_a + members_b)
        a, b = values_at(members_a, at), values_at(members_b, at)
        if len(a) < 2 or len(b) < 2:
            short, n = (g, len(a)) if len(a) < 2 else (base, len(b))
            untested.append(NotTested(g.label, base.label, short.runs, n, (
                f"{g.label} vs {base.label}: not tested, {short.label} has {n} run(s) with a "
                f"validation at or either side of {at:,} tokens, the most both reached; "
                "validate both on one grid (run.eval_every_steps) to test them"
            )))  # fmt: skip
            continue
        d = welch(a, b)
        text = sentence(g.label, base.label, d)
        between = interpolated(members_a + members_b, at)
        if between:
            text += (f" (at {at:,} tokens, interpolated: no count has a validation of every run "
                     "of both)")  # fmt: skip
        elif at is not None and (at != g.at_tokens or at != base.at_tokens):
            text += f" (at {at:,} tokens, the most where every run of both validated)"
        out.append(Comparison(g.label, base.label, at, d.difference, d.half_width, d.p_value,
                              d.n_a, d.n_b, d.seeds_needed, text, between, reference))  # fmt: skip
    return out


def same_data(by_run: dict[str, RunSummary], groups: list[SeedGroup]) -> list[list[SeedGroup]]:
    """``groups`` split by the data and vocabulary their runs trained on (:func:`data_key`), in
    order of first appearance: only groups of one family have val losses on one scale."""
    families: dict[str | None, list[SeedGroup]] = {}
    for g in groups:
        first = next((by_run[r] for r in g.runs if r in by_run), None)
        families.setdefault(None if first is None else data_key(first), []).append(g)
    return list(families.values())


def _first(by_run: dict[str, RunSummary], group: SeedGroup) -> RunSummary | None:
    """A group's first run found (its runs share one config: it stands for all of them)."""
    return next((by_run[r] for r in group.runs if r in by_run), None)


def _group_data(by_run: dict[str, RunSummary], group: SeedGroup) -> str:
    """:func:`data_text` of a group."""
    first = _first(by_run, group)
    return "data unknown" if first is None else data_text(first)


def _what_differs(a: RunSummary | None, b: RunSummary | None) -> str:
    """``other data``, ``another vocabulary`` or both: where two groups' losses part."""
    of_a, of_b = (None if s is None else data_of(s) for s in (a, b))
    if of_a is None or of_b is None:
        return "data not known to be the same"
    same = [json.dumps(x, sort_keys=True, default=str) == json.dumps(y, sort_keys=True, default=str)
            for x, y in zip(of_a, of_b, strict=True)]  # fmt: skip
    parts = [w for w, equal in zip(("other data", "another vocabulary"), same, strict=True)
             if not equal]  # fmt: skip
    return " and ".join(parts)


def _mean_final_bpb(by_run: dict[str, RunSummary], group: SeedGroup) -> float | None:
    """The mean val bpb of a group's usable runs at their last validation (None: none has
    one, e.g. a dataset prepared without byte counts)."""
    bpbs = [
        bpb
        for r in group.runs
        if r in by_run and not _unusable(by_run[r])
        if (bpb := by_run[r].final_val_bpb) is not None
    ]
    return statistics.fmean(bpbs) if bpbs else None


def not_compared(summaries: list[RunSummary], groups: list[SeedGroup]) -> list[NotCompared]:
    """One entry per two families of seed groups on different data or vocabularies (which
    :func:`compare_groups` neither ranks nor tests against each other): what each trained on
    and, where both have them, their bits per byte side by side. Empty when all the groups
    with two usable seeds share one dataset and vocabulary."""
    by_run = {s.run: s for s in summaries}
    families = same_data(by_run, [g for g in groups if len(g.val_losses) >= 2])
    out = []
    for i, family in enumerate(families):
        for others in families[i + 1 :]:
            bpb = {g.label: v for g in family + others
                   if (v := _mean_final_bpb(by_run, g)) is not None}  # fmt: skip
            data, others_data = _group_data(by_run, family[0]), _group_data(by_run, others[0])
            why = _what_differs(_first(by_run, family[0]), _first(by_run, others[0]))
            text = (
                f"{'; '.join(g.label for g in family)} ({data}) and "
                f"{'; '.join(g.label for g in others)} ({others_data}): not compared, {why} "
                "(a val loss is per token of its own text and vocabulary)"
            )
            sides = [[f"{g.label} {bpb[g.label]:.4f}" for g in f if g.label in bpb]
                     for f in (family, others)]  # fmt: skip
            if all(sides):
                text += (f"; mean val bpb at the runs' last validation: {'; '.join(sides[0])} "
                         f"vs {'; '.join(sides[1])}")  # fmt: skip
            out.append(NotCompared([g.label for g in family], data, [g.label for g in others],
                                   others_data, bpb, text))  # fmt: skip
    return out


def _mean_or_inf(values: list[float]) -> float:
    """The mean of ``values``; infinity for none (a group without a value ranks last)."""
    return statistics.fmean(values) if values else float("inf")
