"""The rules of the run callbacks' settings, without Lightning.

``nanolab fit`` checks them when it builds its callbacks; ``queue add`` checks the same rules
for each job it queues, and must not import Lightning (seconds a launch) to do so. So the
rules of a group a recipe commonly sets live here, below the callbacks, and the callback's
constructor calls them: one rule, one message, wherever it is checked. A group without rules
here is checked by building its callback (:data:`SETTING_RULES` says which are here).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from nanolab.errors import NanolabError
from nanolab.notify import NotifyConfigError, check_targets


class CallbackConfigError(NanolabError):
    """A callback setting that cannot work; the message names the YAML key and the fix."""


def check_checkpoint(settings: Mapping[str, Any]) -> None:
    """``checkpoint.*``: where checkpoints live, how often and how many are kept."""
    dirpath = settings.get("dirpath")
    if dirpath is not None:  # another folder: resume would not find its checkpoints
        raise CallbackConfigError(
            f"checkpoint.dirpath {dirpath}: checkpoints live in <run_dir>/checkpoints, where "
            "a resume finds them (elsewhere a restart begins at step 0 and rotates them "
            "away); drop the setting, and to keep them on another disk set run.root there "
            "or make <run_dir>/checkpoints a link to a folder on it"
        )
    every_n_steps = settings.get("every_n_steps")
    if every_n_steps is not None and every_n_steps < 1:
        raise CallbackConfigError(
            f"checkpoint.every_n_steps must be >= 1 or null (no step-based saves), got {every_n_steps}"
        )
    every_n_minutes = settings.get("every_n_minutes")
    if every_n_minutes is not None and not every_n_minutes > 0:
        raise CallbackConfigError(
            f"checkpoint.every_n_minutes must be > 0 or null (no time-based saves), got {every_n_minutes}"
        )
    for name in ("keep_last", "keep_best"):
        value = settings.get(name, 0)
        if value < 0:
            raise CallbackConfigError(f"checkpoint.{name} must be >= 0, got {value}")
    max_disk_gb = settings.get("max_disk_gb")
    if max_disk_gb is not None and not max_disk_gb > 0:
        raise CallbackConfigError(
            f"checkpoint.max_disk_gb must be > 0 or null (no cap), got {max_disk_gb}"
        )


def check_downstream(settings: Mapping[str, Any]) -> None:
    """``downstream.*``: how often the in-loop tasks are scored, on how many examples and rows
    (whether the suite itself exists is read where it is loaded)."""
    every_n_evals = settings.get("every_n_evals", 1)
    if every_n_evals < 1:
        raise CallbackConfigError(f"downstream.every_n_evals must be >= 1, got {every_n_evals}")
    for name in ("limit", "rows"):
        value = settings.get(name)
        if value is not None and value < 1:
            raise CallbackConfigError(f"downstream.{name} must be >= 1 or null, got {value}")


#: ISO 4217 codes accepted for ``budget.currency`` (the common ones; case-insensitive).
CURRENCIES = frozenset(
    (
        *("USD", "EUR", "GBP", "JPY", "CNY", "CHF", "CAD", "AUD", "NZD", "SEK", "NOK", "DKK"),
        *("PLN", "CZK", "HUF", "INR", "KRW", "SGD", "HKD", "TWD", "BRL", "MXN", "ZAR", "ILS"),
        *("AED", "SAR", "TRY", "THB", "IDR", "MYR", "PHP", "VND", "RUB", "UAH", "CLP", "COP"),
        "ARS",
    )
)
#: The fewest validations the payoff rule may wait for: the loss forecast's fewest points
#: (:data:`nanolab.forecast.MIN_POINTS`, a layer above; a test holds the two equal).
PAYOFF_MIN_EVALS = 5
#: ``budget.check_every_n_steps`` when a config does not set it (CostBudget's default).
CHECK_EVERY_N_STEPS = 1


def currency_code(currency: Any) -> str:
    """``budget.currency`` as fit writes it: trimmed and upper-cased (``eur`` -> ``EUR``)."""
    return str(currency).strip().upper()


def currency_problem(currency: Any) -> str | None:
    """Why fit refuses ``budget.currency`` (None: it is a known ISO 4217 code). One rule for
    the budget callback and ``nanolab estimate``, so both refuse and print the same code."""
    if currency_code(currency) in CURRENCIES:
        return None
    return (
        f"budget.currency {currency!r} is not a known ISO 4217 code; use e.g. USD, EUR, GBP, "
        "JPY, CNY, CHF"
    )


def cost_problem(max_cost: Any, price_per_gpu_hour: Any) -> str | None:
    """Why fit refuses a ``budget.max_cost`` (None: it has a price to turn GPU-hours into
    money, or there is no cost limit)."""
    if max_cost is None or price_per_gpu_hour:
        return None
    return "budget.max_cost needs budget.price_per_gpu_hour (> 0) to turn GPU-hours into money"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_budget(settings: Mapping[str, Any]) -> None:
    """``budget.*``: the limits (each > 0 or null), the price and its currency, the payoff and
    plateau rules' settings and how often the budget is checked."""
    for name in ("max_gpu_hours", "max_cost", "max_wall_hours", "max_tokens",
                 "payoff_threshold", "payoff_per_gpu_hour"):  # fmt: skip
        value = settings.get(name)
        if value is None:
            continue
        if not _is_number(value) or not math.isfinite(value):
            raise CallbackConfigError(f"budget.{name} must be a number or null, got {value!r}")
        if value <= 0:
            raise CallbackConfigError(
                f"budget.{name} must be > 0 (or null for no limit), got {value}"
            )
    price = settings.get("price_per_gpu_hour")
    if price is not None and (not _is_number(price) or not math.isfinite(price) or price < 0):
        raise CallbackConfigError(f"budget.price_per_gpu_hour must be a number >= 0, got {price!r}")
    problem = currency_problem(settings.get("currency", "USD")) or cost_problem(
        settings.get("max_cost"), price
    )
    if problem is not None:
        raise CallbackConfigError(problem)
    payoff_min_evals = settings.get("payoff_min_evals", PAYOFF_MIN_EVALS)
    if payoff_min_evals < PAYOFF_MIN_EVALS:
        raise CallbackConfigError(
            f"budget.payoff_min_evals must be >= {PAYOFF_MIN_EVALS} (the forecast's fewest "
            f"points), got {payoff_min_evals}"
        )
    payoff_bootstrap = settings.get("payoff_bootstrap", 100)
    if payoff_bootstrap < 10:
        raise CallbackConfigError(
            f"budget.payoff_bootstrap must be >= 10 (the band's refits), got {payoff_bootstrap}"
        )
    patience = settings.get("patience")
    if patience is not None and patience < 1:
        raise CallbackConfigError(f"budget.patience must be >= 1 or null, got {patience}")
    min_delta = settings.get("min_delta", 0.0)
    if min_delta < 0:
        raise CallbackConfigError(f"budget.min_delta must be >= 0, got {min_delta}")
    check_every_n_steps = settings.get("check_every_n_steps", CHECK_EVERY_N_STEPS)
    if check_every_n_steps < 1:
        raise CallbackConfigError(
            f"budget.check_every_n_steps must be >= 1, got {check_every_n_steps}"
        )


#: What the spike guard may do about a spike (``spike.action``).
SPIKE_ACTIONS = ("rollback", "stop", "warn")


def check_spike(settings: Mapping[str, Any]) -> None:
    """``spike.*``: what the guard does, how big a spike is and how long it must last, and the
    learning rate after a rollback."""
    action = settings.get("action", "rollback")
    if action not in SPIKE_ACTIONS:
        raise CallbackConfigError(
            f"spike.action must be one of {', '.join(SPIKE_ACTIONS)}, got {action!r}"
        )
    for name, default, low in (("window", 50, 1), ("patience", 5, 1), ("max_rollbacks", 3, 0),
                               ("lr_scale_steps", 0, 0)):  # fmt: skip
        value = settings.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise CallbackConfigError(f"spike.{name} must be an integer >= {low}, got {value!r}")
    factor = settings.get("factor", 2.0)
    if not isinstance(factor, int | float) or not factor > 1 or math.isinf(factor):
        raise CallbackConfigError(f"spike.factor must be a number > 1, got {factor!r}")
    min_increase = settings.get("min_increase", 0.5)
    if not isinstance(min_increase, int | float) or not min_increase >= 0:
        raise CallbackConfigError(
            f"spike.min_increase must be a number >= 0 (nats), got {min_increase!r}"
        )
    lr_scale = settings.get("lr_scale", 1.0)
    if not _is_number(lr_scale) or not 0 < lr_scale <= 1:
        raise CallbackConfigError(
            f"spike.lr_scale must be a number in (0, 1] (1: the schedule as it is), got "
            f"{lr_scale!r}"
        )


#: What a notification command can fill in (``{run}``, ``{reason}``, ...).
NOTIFY_FIELDS = ("run", "reason", "detail", "step", "val_loss", "best_val_loss", "wall",
                 "wall_s", "tokens", "run_dir", "time")  # fmt: skip


def check_notify(settings: Mapping[str, Any]) -> None:
    """``notify.*``: every target a command naming only known fields, or an apprise URL that
    apprise can use."""
    try:
        check_targets(list(settings.get("targets") or []), NOTIFY_FIELDS, "notify.targets")
    except NotifyConfigError as err:
        raise CallbackConfigError(str(err)) from None


#: The groups whose rules are checked here, by group name.
SETTING_RULES: dict[str, Callable[[Mapping[str, Any]], None]] = {
    "checkpoint": check_checkpoint,
    "downstream": check_downstream,
    "budget": check_budget,
    "spike": check_spike,
    "notify": check_notify,
}
