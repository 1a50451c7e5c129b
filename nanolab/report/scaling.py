"""Which runs ``report --scaling`` fits: one recipe's runs, each configuration and seed once.

A scaling law is the loss of one recipe as its model size N and its tokens D change. Runs of
another model class or variant, optimizer, schedule shape or precision lie on curves of their
own, and one law drawn through all of them is wrong without a sign of it. So the runs are
grouped by recipe (their config without what a sweep varies: the size, the run's length, the
hyperparameters tuned for each size, and settings of speed alone), the largest group is fitted,
and the others are named under the fit, one line per reason. A run repeated with the same
config and seed is one sample of the loss, not two: it counts once.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanolab.report.groups import _common_configs, repeats, value_text
from nanolab.runs import RunSummary

#: The model's size: what a scaling sweep varies (with the run's length).
SIZE_KEYS = frozenset({"model.gpt.n_layer", "model.gpt.n_head", "model.gpt.n_embd"})
#: Model settings that change speed, memory or the vocabulary's padding, not the loss curve
#: (the vocabulary itself is the data's: runs on other data are left out before).
NOT_THE_CURVE = frozenset({
    "model.compile", "model.compile_mode", "model.gpt.attention",
    "model.gpt.gradient_checkpointing", "model.gpt.vocab_size", "model.gpt.vocab_multiple",
})  # fmt: skip
#: The one optimizer setting of the recipe: its name. Its learning rate, decay and betas are
#: tuned for each size in a sweep.
OPTIMIZER_NAME = "model.optimizer.name"
PRECISION = "trainer.precision"


def is_recipe_key(key: str) -> bool:
    """Whether a flattened config key is part of the recipe a scaling law belongs to: the
    model's class and variant (every model setting but its size and those of speed alone),
    the optimizer's name, the schedule's shape (not its lengths in steps: those follow the
    run's length) and the precision."""
    if key == PRECISION:
        return True
    if not key.startswith("model.") or key in SIZE_KEYS or key in NOT_THE_CURVE:
        return False
    if key.startswith("model.optimizer."):
        return key == OPTIMIZER_NAME
    if key.startswith("model.schedule."):
        return not key.endswith("_steps")
    return True


@dataclass
class Selection:
    """The runs one law is fitted to and the others, each with why it was left out.

    Attributes:
        runs: the fitted runs' names, in the order given.
        left_out: ``(run, reason)`` of every run not fitted.
        recipe: the fitted runs' recipe: config keys (flattened) and values.
        other_recipes: the config keys in which the runs of other recipes differ.
    """

    runs: list[str]
    left_out: list[tuple[str, str]] = field(default_factory=list)
    recipe: dict[str, Any] = field(default_factory=dict)
    other_recipes: list[str] = field(default_factory=list)


def select(summaries: list[RunSummary]) -> Selection:
    """The largest group of ``summaries`` (runs on one dataset that each give a point) sharing
    a recipe, ties going to the group of the most recently updated run; in it, a run whose
    config, seed and tokens another one has is left out (:func:`repeats` says which counts:
    a completed run before one that ended otherwise, the first to finish among equals)."""
    if not summaries:
        return Selection([])
    configs = _common_configs(summaries)
    recipes: dict[str, list[RunSummary]] = {}
    for s in summaries:
        recipes.setdefault(_recipe_text(configs.get(s.run)), []).append(s)
    newest = max(summaries, key=lambda s: s.updated or 0.0)
    chosen = max(recipes, key=lambda k: (_samples(recipes[k]), newest in recipes[k]))
    fitted = recipes[chosen]
    picked = _recipe(configs.get(fitted[0].run))
    left_out: list[tuple[str, str]] = []
    differing: set[str] = set()
    for key, members in recipes.items():
        if key == chosen:
            continue
        theirs = _recipe(configs.get(members[0].run))
        why, names = _other_recipe(theirs, picked)
        differing.update(names)
        left_out += [(s.run, why) for s in members]
    samples: dict[tuple[Any, Any], list[RunSummary]] = {}
    for s in fitted:  # one config run to one length: the seeds of one sample of L(N, D)
        samples.setdefault((s.group, s.tokens), []).append(s)
    again = {run: first for members in samples.values() for run, first in repeats(members).items()}
    left_out += [(s.run, f"same config and seed as {again[s.run]}: counted once")
                 for s in fitted if s.run in again]  # fmt: skip
    runs = [s.run for s in fitted if s.run not in again]
    order = {s.run: i for i, s in enumerate(summaries)}
    return Selection(
        runs=runs,
        left_out=sorted(left_out, key=lambda item: order[item[0]]),
        recipe=picked or {},
        other_recipes=sorted(differing),
    )


def _samples(members: list[RunSummary]) -> int:
    """How many samples of the loss ``members`` are: a config run to one length with one
    seed is one, however often it ran."""
    return len({(s.group, s.tokens, s.seed if s.seed is not None else s.run) for s in members})


def _recipe(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """The recipe keys of a run's comparable config (None: its config is unknown)."""
    if config is None:
        return None
    # The precision is already named as Lightning names it (``bf16`` is ``bf16-mixed``):
    # groups.comparable_config reads it so for every view of the report.
    return {k: v for k, v in config.items() if is_recipe_key(k)}


def _recipe_text(config: dict[str, Any] | None) -> str:
    """:func:`_recipe` as one comparable text."""
    recipe = _recipe(config)
    return "unknown" if recipe is None else json.dumps(recipe, sort_keys=True, default=str)


#: The differing keys one reason names before it says how many more there are.
SHOWN_KEYS = 3


def _other_recipe(
    theirs: dict[str, Any] | None, fitted: dict[str, Any] | None
) -> tuple[str, list[str]]:
    """Why runs of recipe ``theirs`` are not fitted with ``fitted``: the config keys that
    differ, each with both values; and those keys."""
    if theirs is None or fitted is None:
        return "its config is not in its log: its recipe is unknown", []
    missing = "unset"
    names = sorted(
        k for k in {*theirs, *fitted} if theirs.get(k, missing) != fitted.get(k, missing)
    )
    said = [f"{k} {_value(theirs, k)}, fitted {_value(fitted, k)}" for k in names[:SHOWN_KEYS]]
    more = f" and {len(names) - SHOWN_KEYS} more" if len(names) > SHOWN_KEYS else ""
    return f"another recipe: {'; '.join(said)}{more}", names


def _value(recipe: dict[str, Any], key: str) -> str:
    return value_text(recipe[key]) if key in recipe else "unset"


def left_out_lines(left_out: Iterable[tuple[str, str]], shown: int = 8) -> list[str]:
    """One line per reason, with how many runs it left out and (up to ``shown`` of) their
    names: ``left out 3 runs (other data or vocabulary): a, b, c``."""
    by_reason: dict[str, list[str]] = {}
    for run, reason in left_out:
        by_reason.setdefault(reason, []).append(run)
    lines = []
    for reason, runs in by_reason.items():
        names = ", ".join(runs[:shown]) + (
            f" and {len(runs) - shown} more" if len(runs) > shown else ""
        )
        count = f"{len(runs)} run" + ("s" if len(runs) != 1 else "")
        lines.append(f"left out {count} ({reason}): {names}")
    return lines


def runs_of(selected: list[tuple[str, Path]], names: Iterable[str]) -> list[tuple[str, Path]]:
    """The ``(name, folder)`` of ``selected`` whose names are ``names``, in their order."""
    wanted = set(names)
    return [(n, d) for n, d in selected if n in wanted]
