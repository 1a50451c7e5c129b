"""Where a run's budget stops it: one rule, for the three that ask.

``nanolab fit``'s budget (:class:`nanolab.callbacks.budget.CostBudget`) checks every
``budget.check_every_n_steps`` steps and stops at the first check at which the spend by the
next check would pass a limit; fit plans a ``trainer.max_steps: -1`` run's LR cosine for the
step ``budget.max_tokens`` stops it at. ``nanolab queue`` plans a job's steps with the same
step, and ``nanolab estimate`` prices a config for it (the tightest of ``trainer.max_steps``
and the budget's limits). The rule lives here, below all three (the estimator is layer 5, the
callbacks 7, the queue 9: docs/architecture.md), so they cannot drift apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from nanolab.training.callback_settings import (  # the budget's setting rules, below Lightning
    CHECK_EVERY_N_STEPS,
    cost_problem,
    currency_code,
    currency_problem,
)


def budget_problem(section: Any) -> str | None:
    """The first of fit's refusals of a config's ``budget`` section that change what a run
    costs or where it stops (its currency, a cost limit without a price); None: none. What
    ``nanolab estimate`` refuses a config for, in fit's words."""
    if not isinstance(section, dict):
        return None
    return currency_problem(section.get("currency") or "USD") or cost_problem(
        section.get("max_cost"), section.get("price_per_gpu_hour")
    )


@dataclass(frozen=True)
class Budget:
    """The ``budget`` settings that bound a run's length (and its price); None: not set."""

    max_tokens: int | None = None
    max_wall_hours: float | None = None
    max_gpu_hours: float | None = None
    max_cost: float | None = None
    price_per_gpu_hour: float | None = None
    currency: str = "USD"
    check_every_n_steps: int = CHECK_EVERY_N_STEPS

    @classmethod
    def from_config(cls, section: Any) -> Budget:
        """The budget of a config's ``budget`` section (a dict; anything else: no budget).
        Values fit would refuse are taken as unset here: ``nanolab fit`` says why."""
        if not isinstance(section, dict):
            return cls()

        def number(key: str) -> float | None:
            value = section.get(key)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            return float(value) if ok and math.isfinite(value) and value > 0 else None

        tokens = number("max_tokens")
        every = section.get("check_every_n_steps", CHECK_EVERY_N_STEPS)
        every = every if isinstance(every, int) and not isinstance(every, bool) else 0
        price = section.get("price_per_gpu_hour")
        price_ok = isinstance(price, (int, float)) and not isinstance(price, bool)
        return cls(
            max_tokens=int(tokens) if tokens is not None else None,
            max_wall_hours=number("max_wall_hours"),
            max_gpu_hours=number("max_gpu_hours"),
            max_cost=number("max_cost"),
            price_per_gpu_hour=float(price) if price_ok and 0 <= price < math.inf else None,
            currency=currency_code(section.get("currency") or "USD"),
            check_every_n_steps=every if every >= 1 else CHECK_EVERY_N_STEPS,
        )


def stop_step(step: int, fits: int, every: int) -> int:
    """The step a budget that pays for ``fits`` more whole steps stops a run standing at
    ``step`` at, checked every ``every`` steps: the first check at which the spend by the
    next check would pass the limit, or ``step`` itself when a restored run at a check has
    less than a check's steps left (it stops before its first step)."""
    if step > 0 and step % every == 0 and fits < every:
        return step
    first_check = step // every * every + every
    return max(first_check, -(-(step + fits - every + 1) // every) * every)


def token_stop_step(step: int, spent: int, per_step: int, every: int, limit: int) -> int:
    """The step where a token budget of ``limit`` stops a run standing at ``step`` with
    ``spent`` tokens of it trained, at ``per_step`` tokens a step, checked every ``every``
    steps (:func:`stop_step`), or ``step`` itself when nothing of it is left. From step 0 with
    nothing spent that is ``max(every, limit // per_step // every * every)``."""
    if spent >= limit:
        return step
    return stop_step(step, (limit - spent) // per_step, every)


def budget_steps(budget: Budget, tokens_per_step: int) -> int | None:
    """The step ``budget.max_tokens`` stops a new run at (None: no token budget), what fit
    plans a ``trainer.max_steps: -1`` run's LR cosine for."""
    if budget.max_tokens is None or tokens_per_step <= 0:
        return None
    return token_stop_step(0, 0, tokens_per_step, budget.check_every_n_steps, budget.max_tokens)


@dataclass(frozen=True)
class RunLength:
    """How many steps a new run trains and the setting that ends it there."""

    steps: int
    source: str


@dataclass(frozen=True)
class Spent:
    """Where a run stands and what it has spent of its budget, over every launch (a new run:
    nothing). The figures fit's budget counts: its run log's ``step``, ``tokens`` (the run's
    own), ``elapsed_s`` (start-ups included) and ``gpu_hours``."""

    step: int = 0
    tokens: int = 0
    wall_hours: float = 0.0
    gpu_hours: float = 0.0


#: The settings :func:`hour_limits` turns into wall hours: a run they end has no step count
#: until its step time is known (estimated, or measured once it trains).
HOUR_LIMITS = ("budget.max_wall_hours", "budget.max_gpu_hours", "budget.max_cost")


def run_length(
    max_steps: int | None,
    budget: Budget,
    tokens_per_step: int,
    step_seconds: float,
    world_size: int,
    spent: Spent = Spent(),
) -> RunLength | None:
    """The step a run ends at: the first of ``trainer.max_steps`` and the steps each of
    ``budget``'s limits stops it at, None when nothing bounds it. ``spent``: where the run
    stands and what it has spent (a new run by default), so a run under way is asked the same
    rule with its measured progress. The hour and cost limits are turned into steps at
    ``step_seconds`` a step (no start-up, evaluation or checkpoint time: the run may stop
    sooner); a cost limit needs ``price_per_gpu_hour``, as fit's does."""
    every = budget.check_every_n_steps
    options: list[tuple[int, str]] = []
    if max_steps is not None and max_steps > 0:
        options.append((max_steps, "trainer.max_steps"))
    if budget.max_tokens is not None and tokens_per_step > 0:
        tokens = token_stop_step(
            spent.step, spent.tokens, tokens_per_step, every, budget.max_tokens
        )
        options.append((tokens, "budget.max_tokens"))
    if step_seconds > 0:
        for wall_hours, name in hour_limits(budget, world_size, spent):
            fits = int(max(0.0, wall_hours) * 3600 // step_seconds)
            options.append((stop_step(spent.step, fits, every), name))
    if not options:
        return None
    steps, source = min(options, key=lambda option: option[0])  # the first named on a tie
    return RunLength(steps, source)


def hour_limits(budget: Budget, world_size: int, spent: Spent = Spent()) -> list[tuple[float, str]]:
    """(wall hours left, setting) of each of ``budget``'s limits on time and money, after
    ``spent``: the wall hours, the GPU-hours over ``world_size`` devices, and the cost at its
    price (a cost without a price is no limit here: fit refuses it, :func:`cost_problem`).
    Empty: none is set."""
    hours: list[tuple[float | None, str]] = [
        (_less(budget.max_wall_hours, spent.wall_hours), "budget.max_wall_hours"),
        (_per_device(_less(budget.max_gpu_hours, spent.gpu_hours), world_size),
         "budget.max_gpu_hours"),
    ]  # fmt: skip
    if budget.max_cost is not None and budget.price_per_gpu_hour:
        gpu_hours = budget.max_cost / budget.price_per_gpu_hour - spent.gpu_hours
        hours.append((_per_device(gpu_hours, world_size), "budget.max_cost"))
    return [(wall_hours, name) for wall_hours, name in hours if wall_hours is not None]


def _less(limit: float | None, spent: float) -> float | None:
    """What is left of ``limit`` after ``spent`` (None: no limit)."""
    return None if limit is None else limit - spent


def _per_device(gpu_hours: float | None, world_size: int) -> float | None:
    """Wall hours that ``gpu_hours`` buy on ``world_size`` devices."""
    return None if gpu_hours is None else gpu_hours / max(1, world_size)
