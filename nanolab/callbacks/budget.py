"""Cost-aware stopping: hard budgets, a payoff rule and a plateau rule.

Hard budgets (any combination, all counted over every process of the run, from the shared
:class:`RunClock` whose totals travel in checkpoints): GPU-hours (devices x wall hours), money
(GPU-hours x price), wall time, tokens. The check runs after optimizer steps and stops *before* the
next check would overrun, using the run's own cost per step; Lightning then runs one final
validation (it always validates when asked to stop early), the checkpoint callback saves, and the
``end`` record says ``budget``. The process exits 0.

Payoff rule (``payoff_threshold``): at each validation, fit a line to the last ``payoff_window``
(GPU-hours, val loss) points; its slope is the loss the run currently buys per GPU-hour. Times the
GPU-hours the run may still spend (the tightest of the budgets and of ``trainer.max_steps``), that
is the improvement still on offer. Below ``payoff_threshold`` (in loss units) the run stops with
reason ``budget``. A straight line over-estimates what a flattening loss curve will deliver, so the
rule errs towards continuing.

Plateau rule (``patience``/``min_delta``): stop (reason ``plateau``) after ``patience``
validations without an improvement of at least ``min_delta`` over the best.

At every validation a ``budget`` record gives the decision and every number behind it.
"""

from __future__ import annotations

import math
import time
from typing import Any

import lightning as L

from nanolab.callbacks.events import CallbackConfigError, emit, set_stop_reason, stop_reason
from nanolab.callbacks.step import StepCallback

#: ISO 4217 codes accepted for ``budget.currency`` (the common ones; case-insensitive).
CURRENCIES = frozenset(
    (
        *("USD", "EUR", "GBP", "JPY", "CNY", "CHF", "CAD", "AUD", "NZD", "SEK", "NOK", "DKK"),
        *("PLN", "CZK", "HUF", "INR", "KRW", "SGD", "HKD", "TWD", "BRL", "MXN", "ZAR", "ILS"),
        *("AED", "SAR", "TRY", "THB", "IDR", "MYR", "PHP", "VND", "RUB", "UAH", "CLP", "COP"),
        "ARS",
    )
)


def linear_slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys over xs (``None`` when the xs do not spread)."""
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if var <= 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var


def _positive(name: str, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise CallbackConfigError(f"budget.{name} must be a number or null, got {value!r}")
    if value <= 0:
        raise CallbackConfigError(f"budget.{name} must be > 0 (or null for no limit), got {value}")


class CostBudget(StepCallback):
    """Stops the run when a budget is spent or when further training no longer pays.

    Its step hooks run after the run log's and before the checkpoint's: its ``budget`` record
    follows the step's ``train`` / ``val`` record, and a stop is decided before the save.

    Args:
        max_gpu_hours: Budget in GPU-hours (devices x wall hours, over every resume).
        max_cost: Budget in ``currency``; needs ``price_per_gpu_hour``.
        price_per_gpu_hour: What one device-hour costs (>= 0); also puts ``cost`` in the log.
        currency: ISO 4217 code of the price (USD, EUR, GBP, ...).
        max_wall_hours: Budget in wall-clock hours of the run (over every resume).
        max_tokens: Budget in training tokens (all ranks).
        payoff_threshold: Stop when the val-loss improvement the remaining budget can buy, at
            the recent rate, is below this (loss units, e.g. 0.01). ``null``: rule off.
        payoff_window: Validations the improvement rate is fitted over (>= 2).
        patience: Stop after this many validations without improvement. ``null``: rule off.
        min_delta: Smallest decrease of the val loss that counts as an improvement.
        monitor: The validation loss the rules read.
        check_every_n_steps: Optimizer steps between budget checks (each check is one small
            collective on multi-device runs; free on one device).
    """

    step_order = 40

    def __init__(
        self,
        max_gpu_hours: float | None = None,
        max_cost: float | None = None,
        price_per_gpu_hour: float | None = None,
        currency: str = "USD",
        max_wall_hours: float | None = None,
        max_tokens: int | None = None,
        payoff_threshold: float | None = None,
        payoff_window: int = 4,
        patience: int | None = None,
        min_delta: float = 0.0,
        monitor: str = "val/loss",
        check_every_n_steps: int = 1,
    ) -> None:
        super().__init__()
        for name, value in (
            ("max_gpu_hours", max_gpu_hours),
            ("max_cost", max_cost),
            ("max_wall_hours", max_wall_hours),
            ("max_tokens", max_tokens),
            ("payoff_threshold", payoff_threshold),
        ):
            _positive(name, value)
        if price_per_gpu_hour is not None and (
            not isinstance(price_per_gpu_hour, (int, float))
            or isinstance(price_per_gpu_hour, bool)
            or not math.isfinite(price_per_gpu_hour)
            or price_per_gpu_hour < 0
        ):
            raise CallbackConfigError(
                f"budget.price_per_gpu_hour must be a number >= 0, got {price_per_gpu_hour!r}"
            )
        code = str(currency).strip().upper()
        if code not in CURRENCIES:
            raise CallbackConfigError(
                f"budget.currency {currency!r} is not a known ISO 4217 code; use e.g. USD, EUR, "
                "GBP, JPY, CNY, CHF"
            )
        if max_cost is not None and not price_per_gpu_hour:
            raise CallbackConfigError(
                "budget.max_cost needs budget.price_per_gpu_hour (> 0) to turn GPU-hours into money"
            )
        if payoff_window < 2:
            raise CallbackConfigError(f"budget.payoff_window must be >= 2, got {payoff_window}")
        if patience is not None and patience < 1:
            raise CallbackConfigError(f"budget.patience must be >= 1 or null, got {patience}")
        if min_delta < 0:
            raise CallbackConfigError(f"budget.min_delta must be >= 0, got {min_delta}")
        if check_every_n_steps < 1:
            raise CallbackConfigError(
                f"budget.check_every_n_steps must be >= 1, got {check_every_n_steps}"
            )
        self.max_gpu_hours = max_gpu_hours
        self.max_cost = max_cost
        self.price_per_gpu_hour = price_per_gpu_hour
        self.currency = code
        self.max_wall_hours = max_wall_hours
        self.max_tokens = max_tokens
        self.payoff_threshold = payoff_threshold
        self.payoff_window = payoff_window
        self.patience = patience
        self.min_delta = min_delta
        self.monitor = monitor
        self.check_every_n_steps = check_every_n_steps

        # State that travels in checkpoints.
        self.history: list[tuple[int, float, float]] = []  # (step, gpu_hours, val_loss)
        self.best: float | None = None
        self.evals_since_best = 0
        self._start: tuple[int, float, int] | None = None  # step, process wall s, tokens

    # -- spending ----------------------------------------------------------------------------
    def spent(self) -> dict[str, float | int]:
        assert self.clock is not None
        gpu_hours = self.clock.gpu_hours()
        out: dict[str, float | int] = {
            "gpu_hours": gpu_hours,
            "wall_hours": self.clock.elapsed_s() / 3600.0,
            "tokens": self.clock.tokens,
        }
        if self.price_per_gpu_hour is not None:
            out["cost"] = gpu_hours * self.price_per_gpu_hour
        return out

    def limits(self) -> dict[str, float | int]:
        limits = {
            "gpu_hours": self.max_gpu_hours,
            "cost": self.max_cost,
            "wall_hours": self.max_wall_hours,
            "tokens": self.max_tokens,
        }
        return {k: v for k, v in limits.items() if v is not None}

    def _per_step(self, trainer: L.Trainer) -> dict[str, float]:
        """This process's average spend per optimizer step (for projections)."""
        clock = self.clock
        if self._start is None or clock is None:
            return {}
        step0, wall0, tok0 = self._start
        steps = trainer.global_step - step0
        if steps <= 0:
            return {}
        # This process's own wall time: independent of totals restored from earlier processes.
        wall_h = (clock.process_elapsed_s() - wall0) / 3600.0 / steps
        gpu = wall_h * clock.world_size
        out = {
            "gpu_hours": gpu,
            "wall_hours": wall_h,
            "tokens": (clock.tokens - tok0) / steps,
        }
        if self.price_per_gpu_hour is not None:
            out["cost"] = gpu * self.price_per_gpu_hour
        return out

    def remaining_gpu_hours(self, trainer: L.Trainer) -> tuple[float | None, str | None]:
        """GPU-hours the run may still spend, and which limit sets it (``None``: unbounded)."""
        spent, per_step = self.spent(), self._per_step(trainer)
        world = max(1, int(trainer.world_size))
        options: list[tuple[float, str]] = []
        if self.max_gpu_hours is not None:
            options.append((self.max_gpu_hours - float(spent["gpu_hours"]), "max_gpu_hours"))
        if self.max_cost is not None and self.price_per_gpu_hour:
            left = (self.max_cost - float(spent["cost"])) / self.price_per_gpu_hour
            options.append((left, "max_cost"))
        if self.max_wall_hours is not None:
            left = (self.max_wall_hours - float(spent["wall_hours"])) * world
            options.append((left, "max_wall_hours"))
        gpu_per_step = per_step.get("gpu_hours")
        if self.max_tokens is not None and gpu_per_step and per_step.get("tokens"):
            steps_left = (self.max_tokens - float(spent["tokens"])) / per_step["tokens"]
            options.append((steps_left * gpu_per_step, "max_tokens"))
        if trainer.max_steps and trainer.max_steps > 0 and gpu_per_step:
            steps_left = trainer.max_steps - trainer.global_step
            options.append((steps_left * gpu_per_step, "trainer.max_steps"))
        if not options:
            return None, None
        left, which = min(options)
        return max(0.0, left), which

    # -- lifecycle ---------------------------------------------------------------------------
    def on_run_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        assert self.clock is not None
        self._start = (trainer.global_step, self.clock.process_elapsed_s(), self.clock.tokens)

    def on_step(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        if step % self.check_every_n_steps != 0:
            return
        if stop_reason(trainer)[0] is not None or not self.limits():
            return
        spent, per_step = self.spent(), self._per_step(trainer)
        hit = None
        for name, limit in self.limits().items():
            # Stop now if the spend by the next check would pass the limit.
            projected = float(spent[name]) + per_step.get(name, 0.0) * self.check_every_n_steps
            if projected >= limit:
                hit = (name, limit, projected)
                break
        stop = hit is not None
        if trainer.world_size > 1:
            stop = bool(trainer.strategy.reduce_boolean_decision(stop, all=False))
        if not stop:
            return
        name, limit, projected = hit if hit is not None else ("another rank's budget", None, None)
        unit = self.currency if name == "cost" else name.split("_")[-1]
        detail = f"max_{name} {limit} {unit} spent" if limit is not None else "budget spent"
        self._emit(
            trainer,
            {
                "rule": "budget",
                "decision": "stop",
                "budget": f"max_{name}",
                "limit": limit,
                "projected_at_next_check": projected,
            },
        )
        set_stop_reason(trainer, "budget", detail)

    def on_validated(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        assert self.clock is not None
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            return
        val = float(value)
        if self.history and self.history[-1][0] == step:
            self.history.pop()  # the same step validated again (e.g. after a resume)
        self.history.append((step, self.clock.gpu_hours(), val))
        improved = self.best is None or val < self.best - self.min_delta
        if improved:
            self.best, self.evals_since_best = val, 0
        else:
            self.evals_since_best += 1

        plateau = {
            "patience": self.patience,
            "min_delta": self.min_delta,
            "evals_since_best": self.evals_since_best,
            "decision": "continue",
        }
        if self.patience is not None and self.evals_since_best >= self.patience:
            plateau["decision"] = "stop"
        payoff = self.payoff(trainer)
        already = stop_reason(trainer)[0]
        rule = "none"
        if already is None:
            if payoff["decision"] == "stop":
                rule = "payoff"
            elif plateau["decision"] == "stop":
                rule = "plateau"
        stop = rule != "none"
        if trainer.world_size > 1:
            agreed = bool(trainer.strategy.reduce_boolean_decision(stop, all=False))
            if agreed and not stop:
                rule = "plateau" if self.patience is not None else "payoff"
            stop = agreed
        self._emit(
            trainer,
            {
                "rule": rule,
                "decision": "stop" if stop else ("stopping" if already else "continue"),
                "val_loss": val,
                "best_val_loss": self.best,
                "payoff": payoff,
                "plateau": plateau,
            },
        )
        if stop and rule == "payoff":
            set_stop_reason(
                trainer,
                "budget",
                f"payoff: projected gain {payoff['projected_gain']:.4g} < threshold "
                f"{self.payoff_threshold}",
            )
        elif stop and rule == "plateau":
            set_stop_reason(
                trainer,
                "plateau",
                f"no val improvement >= {self.min_delta} in {self.evals_since_best} evaluations",
            )

    def payoff(self, trainer: L.Trainer) -> dict[str, Any]:
        """The payoff rule's numbers and decision from the recent validation history."""
        window = self.history[-self.payoff_window :]
        out: dict[str, Any] = {
            "threshold": self.payoff_threshold,
            "window": len(window),
            "improvement_per_gpu_hour": None,
            "remaining_gpu_hours": None,
            "limited_by": None,
            "projected_gain": None,
            "decision": "continue",
        }
        remaining, which = self.remaining_gpu_hours(trainer)
        out["remaining_gpu_hours"], out["limited_by"] = remaining, which
        if len(window) < self.payoff_window:
            return out
        slope = linear_slope([g for _, g, _ in window], [v for _, _, v in window])
        if slope is None:
            return out
        rate = max(0.0, -slope)
        out["improvement_per_gpu_hour"] = rate
        if remaining is None:
            return out
        out["projected_gain"] = rate * remaining
        if self.payoff_threshold is not None and out["projected_gain"] < self.payoff_threshold:
            out["decision"] = "stop"
        return out

    def _emit(self, trainer: L.Trainer, fields: dict[str, Any]) -> None:
        emit(
            trainer,
            {
                "event": "budget",
                "time": time.time(),
                "step": int(trainer.global_step),
                **fields,
                "spent": self.spent(),
                "limits": self.limits(),
                "currency": self.currency if self.price_per_gpu_hour is not None else None,
            },
        )

    # -- run log fields ----------------------------------------------------------------------
    def record_fields(self, trainer: L.Trainer, event: str) -> dict[str, Any]:
        if not self.active or self.clock is None:
            return {}
        if event == "start":
            return {
                "price_per_gpu_hour": self.price_per_gpu_hour,
                "currency": self.currency if self.price_per_gpu_hour is not None else None,
                "budgets": self.limits(),
            }
        if event in ("train", "end"):
            cost = None
            if self.price_per_gpu_hour is not None:
                cost = self.clock.gpu_hours() * self.price_per_gpu_hour
            fields: dict[str, Any] = {"cost": cost}
            if event == "end":
                fields["currency"] = self.currency if cost is not None else None
            return fields
        return {}

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        spent = self.spent() if self.clock is not None else {}
        return {
            "history": [list(h) for h in self.history],
            "best": self.best,
            "evals_since_best": self.evals_since_best,
            "spent": spent,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [(int(s), float(g), float(v)) for s, g, v in state_dict.get("history", [])]
        self.best = state_dict.get("best")
        self.evals_since_best = int(state_dict.get("evals_since_best", 0))
