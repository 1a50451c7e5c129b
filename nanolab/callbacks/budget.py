"""Cost-aware stopping: hard budgets, a payoff rule and a plateau rule.

Hard budgets (any combination, all counted over every process of the run, from the shared
:class:`RunClock` whose totals travel in checkpoints): GPU-hours (devices x wall hours), money
(GPU-hours x price), wall time, tokens. The check runs after optimizer steps and stops *before* the
next check would pass a limit (reaching it exactly is within it), at the run's own cost per step;
Lightning then runs one final validation (it always validates when asked to stop early), the
checkpoint callback saves, and the ``end`` record says ``budget`` with the spend against the limit
("896 of max_tokens 1024 spent"). The process exits 0.

Payoff rule (``payoff_threshold``, ``payoff_per_gpu_hour``): at each validation, the run's val
curve so far is fitted with the loss forecast that ``nanolab report --forecast`` uses
(:mod:`nanolab.forecast`: the loss over the run's own LR schedule, so the annealing still ahead of
a cosine run is counted), and evaluated at the step where the run will end: ``trainer.max_steps``,
or earlier when a budget runs out first (the tightest of them, at the run's own cost per step).
The improvement still on offer is the forecast loss now minus the forecast at that end, taken at
the optimistic edge of the forecast's 5-95% band, so a noisy or early fit (wide band) does not
stop a run. The run stops with reason ``budget`` when that optimistic improvement is below
``payoff_threshold`` (loss units), or below ``payoff_per_gpu_hour`` times the GPU-hours left
(loss per GPU-hour). The rule waits for ``payoff_min_evals`` validations after warmup, and
fits at most :data:`PAYOFF_POINTS` of them (evenly spread, the newest among them), so a
validation costs the same early and late in a long run. Rank 0 forecasts and decides; the
other ranks receive its numbers and decision.

Plateau rule (``patience``/``min_delta``): stop (reason ``plateau``) after ``patience``
validations without an improvement of at least ``min_delta`` over the best.

At every validation a ``budget`` record gives the decision and every number behind it.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import lightning as L

from nanolab.callbacks.events import emit, set_stop_reason, stop_reason
from nanolab.callbacks.step import StepCallback, scheduled_validation
from nanolab.estimator.run_length import Budget, Spent, token_stop_step
from nanolab.forecast import (
    CurveInputs,
    ForecastError,
    even_points,
    fit_curve,
    fit_loss_curve,
)
from nanolab.training.callback_settings import (
    CHECK_EVERY_N_STEPS,
    check_budget,
    currency_code,
)

#: Most validations the payoff rule fits (evenly spread, the newest always among them): a
#: refit's cost is bounded, however long the run; the schedule fit stays the same below it.
PAYOFF_POINTS = 100


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
        payoff_threshold: Stop when the val-loss improvement the forecast still promises by
            the run's end (optimistic edge of its 5-95% band) is below this (loss units, e.g.
            0.01). ``null``: off.
        payoff_per_gpu_hour: Stop when that improvement per GPU-hour left is below this (loss
            per GPU-hour). ``null``: off.
        payoff_min_evals: Validations after warmup the forecast needs before the payoff rule
            decides (>= 5).
        payoff_bootstrap: Bootstrap refits behind the forecast's band (each validation).
        patience: Stop after this many validations without improvement. ``null``: rule off.
        min_delta: Smallest decrease of the val loss that counts as an improvement.
        monitor: The validation loss the rules read.
        check_every_n_steps: Optimizer steps between budget checks (each check is one small
            collective on multi-device runs; free on one device).
    """

    def __init__(
        self,
        max_gpu_hours: float | None = None,
        max_cost: float | None = None,
        price_per_gpu_hour: float | None = None,
        currency: str = "USD",
        max_wall_hours: float | None = None,
        max_tokens: int | None = None,
        payoff_threshold: float | None = None,
        payoff_per_gpu_hour: float | None = None,
        payoff_min_evals: int = 5,
        payoff_bootstrap: int = 100,
        patience: int | None = None,
        min_delta: float = 0.0,
        monitor: str = "val/loss",
        check_every_n_steps: int = CHECK_EVERY_N_STEPS,
    ) -> None:
        super().__init__()
        check_budget(
            {"max_gpu_hours": max_gpu_hours, "max_cost": max_cost,
             "price_per_gpu_hour": price_per_gpu_hour, "currency": currency,
             "max_wall_hours": max_wall_hours, "max_tokens": max_tokens,
             "payoff_threshold": payoff_threshold, "payoff_per_gpu_hour": payoff_per_gpu_hour,
             "payoff_min_evals": payoff_min_evals, "payoff_bootstrap": payoff_bootstrap,
             "patience": patience, "min_delta": min_delta,
             "check_every_n_steps": check_every_n_steps}
        )  # fmt: skip
        code = currency_code(currency)
        self.max_gpu_hours = max_gpu_hours
        self.max_cost = max_cost
        self.price_per_gpu_hour = price_per_gpu_hour
        self.currency = code
        self.max_wall_hours = max_wall_hours
        self.max_tokens = max_tokens
        self.payoff_threshold = payoff_threshold
        self.payoff_per_gpu_hour = payoff_per_gpu_hour
        self.payoff_min_evals = payoff_min_evals
        self.payoff_bootstrap = payoff_bootstrap
        self.patience = patience
        self.min_delta = min_delta
        self.monitor = monitor
        self.check_every_n_steps = check_every_n_steps

        # State that travels in checkpoints.
        self.history: list[tuple[int, float, float]] = []  # (step, gpu_hours, val_loss)
        self.best: float | None = None
        self.evals_since_best = 0
        # The stop a rule decided (rule, end reason, detail, step, the settings it was decided
        # under) and the spend per step it projected with: a resumed or rerun run whose
        # decision still stands stops before its first step instead of training on past it.
        self.decided: dict[str, Any] | None = None
        self.last_per_step: dict[str, float] = {}
        self.branch = False  # set by fit for a new run from another run's checkpoint
        self._start: tuple[int, float, int] | None = None  # step, process wall s, tokens

    # -- spending ----------------------------------------------------------------------------
    def spent(self) -> dict[str, float | int]:
        assert self.clock is not None
        gpu_hours = self.clock.gpu_hours()
        out: dict[str, float | int] = {
            "gpu_hours": gpu_hours,
            "wall_hours": self.clock.elapsed_s() / 3600.0,
            # The tokens this run trained: a branch's budget counts its own, not its parent's.
            "tokens": self.clock.run_tokens,
        }
        if self.price_per_gpu_hour is not None:
            out["cost"] = gpu_hours * self.price_per_gpu_hour
        return out

    def limits(self) -> dict[str, float | int]:
        names = ("gpu_hours", "cost", "wall_hours", "tokens")
        return {k: v for k in names if (v := getattr(self, f"max_{k}")) is not None}

    def run_budget(self) -> Budget:
        """These limits as the run-length rule reads them
        (:func:`nanolab.estimator.run_length.run_length`): what the banner asks for the end a
        time or cost limit puts on the run."""
        return Budget(
            max_tokens=self.max_tokens,
            max_wall_hours=self.max_wall_hours,
            max_gpu_hours=self.max_gpu_hours,
            max_cost=self.max_cost,
            price_per_gpu_hour=self.price_per_gpu_hour,
            currency=self.currency,
            check_every_n_steps=self.check_every_n_steps,
        )

    def run_spent(self, trainer: L.Trainer) -> Spent:
        """Where the run stands and what it has spent of these limits (over every launch)."""
        if self.clock is None:
            return Spent(step=int(getattr(trainer, "global_step", 0) or 0))
        spent = self.spent()
        return Spent(
            step=int(getattr(trainer, "global_step", 0) or 0),
            tokens=int(spent["tokens"]),
            wall_hours=float(spent["wall_hours"]),
            gpu_hours=float(spent["gpu_hours"]),
        )

    def measured_step_seconds(self) -> float | None:
        """Wall seconds a step took in the run's last process (evaluations and saves
        included: the time a budget counts), as its checkpoint kept it; None before a first
        check measured one."""
        wall_hours = self.last_per_step.get("wall_hours")
        return wall_hours * 3600.0 if wall_hours and wall_hours > 0 else None

    def token_steps(self, trainer: L.Trainer, pl_module: L.LightningModule) -> int | None:
        """The step where ``max_tokens`` stops the run (None: no token budget, or tokens per
        step unknown): the last check before the next would pass the limit (every
        ``check_every_n_steps``), where the run stops if nothing stops it sooner. What
        ``trainer.max_steps: -1`` plans a new run's LR schedule for. Counted from where the
        run stands with what it has spent, so a branch, whose steps start at its parent's and
        whose budget counts only its own tokens, ends that many tokens after its start."""
        from nanolab.callbacks.banner import tokens_per_step

        per_step = tokens_per_step(trainer, pl_module)
        if self.max_tokens is None or per_step is None or per_step[0] <= 0:
            return None
        # A branch before its run log starts it as a new run (its scheduler plans its cosine
        # then) has trained none of its own tokens: the clock still counts its parent's.
        fresh = self.branch and self._start is None
        spent = self.clock.run_tokens if self.clock is not None and not fresh else 0
        step = int(getattr(trainer, "global_step", 0) or 0)  # a planner's stand-in may lack it
        return token_stop_step(
            step, spent, per_step[0], self.check_every_n_steps, int(self.max_tokens)
        )

    def spend_detail(self, name: str, spent: float, limit: float) -> str:
        """What a budget stop says: the spend so far against the limit ("896 of max_tokens 1024
        spent"); the stop comes before the next check would pass the limit, so the spend is
        usually below it, and saying the limit was spent would be false."""
        unit = f" {self.currency}" if name == "cost" else ""
        return f"{_amount(spent)} of max_{name} {_amount(limit)}{unit} spent"

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
        standing = self.standing_stop(trainer)
        if standing is None:
            self.decided = None  # settings changed since: the rules decide again as they go
            return
        reason, detail, fix, record = standing
        if record is not None:
            self._emit(trainer, record)
        set_stop_reason(trainer, reason, detail)
        if trainer.is_global_zero:
            print(
                f"nanolab fit: {trainer.default_root_dir} stopped at step {trainer.global_step} "
                f"({reason}: {detail}); nothing to train. {fix}",
                file=sys.stderr,
                flush=True,
            )

    def settings(self, trainer: L.Trainer) -> dict[str, Any]:
        """What a rule's decision depends on: a resume under other values decides again."""
        return {
            "limits": self.limits(),
            "price_per_gpu_hour": self.price_per_gpu_hour,
            "payoff_threshold": self.payoff_threshold,
            "payoff_per_gpu_hour": self.payoff_per_gpu_hour,
            "patience": self.patience,
            "min_delta": self.min_delta,
            "max_steps": int(trainer.max_steps or -1),
        }

    def standing_stop(
        self, trainer: L.Trainer
    ) -> tuple[str, str, str, dict[str, Any] | None] | None:
        """(end reason, detail, how to go on, the ``budget`` record of a budget's decision)
        when this run, as restored, must not train another step: a stop decided under the
        same settings (a plateau while ``patience`` still says so), or a budget that the next
        step would pass at the saved run's spend per step (or that start-up spent). A new run
        from another's checkpoint (a branch) keeps only the budgets: its rules decide anew."""
        if 0 < (trainer.max_steps or -1) <= trainer.global_step:
            return None  # complete: it ends as completed, whatever a rule says
        spent = self.spent()
        limits = self.limits()
        # The projection to the next check, as the run makes it at a check step; between two
        # checks (a preemption there) an uninterrupted run would not stop until a limit is hit.
        at_check = trainer.global_step % self.check_every_n_steps == 0
        per_step = (self.last_per_step or self._average_step(trainer, spent)) if at_check else {}
        projections = (
            (name, limit, float(spent[name]) + per_step.get(name, 0.0) * self.check_every_n_steps)
            for name, limit in limits.items()
        )
        hit = next((p for p in projections if stops_now(spent[p[0]], p[2], p[1])), None)
        if hit is not None:
            name, limit, projected = hit
            record = {"rule": "budget", "decision": "stop", "budget": f"max_{name}",
                      "limit": limit, "projected_at_next_check": projected}  # fmt: skip
            return ("budget", self.spend_detail(name, spent[name], limit),
                    f"Raise budget.max_{name} (or set it to null) to go on", record)  # fmt: skip
        decided = None if self.branch else self.decided  # a new run from it decides anew
        rule = decided.get("rule") if isinstance(decided, dict) else None
        if (
            rule == "plateau"
            and self.patience is not None
            and self.evals_since_best >= self.patience
        ):  # only a plateau that stopped the run: one that ran to max_steps is extended
            return ("plateau",
                    f"no val improvement >= {self.min_delta} in {self.evals_since_best} evaluations",
                    "Raise budget.patience (or set it to null) to go on", None)  # fmt: skip
        if (
            rule == "payoff"
            and decided is not None
            and decided.get("settings") == self.settings(trainer)
        ):
            return ("budget", str(decided.get("detail")),
                    "Lower budget.payoff_threshold / payoff_per_gpu_hour (or set them to null) "
                    "or raise trainer.max_steps to go on", None)  # fmt: skip
        return None

    @staticmethod
    def _average_step(trainer: L.Trainer, spent: dict[str, Any]) -> dict[str, float]:
        """The run's average spend per step: the projection of a checkpoint saved before the
        spend per step was stored (tokens exact; time including start-ups)."""
        steps = int(trainer.global_step)
        return {k: float(v) / steps for k, v in spent.items()} if steps > 0 else {}

    def _decide(self, trainer: L.Trainer, rule: str, reason: str, detail: str) -> None:
        """Stop the run for ``rule`` and remember the decision in the final checkpoint."""
        self.decided = {"rule": rule, "reason": reason, "detail": detail,
                        "step": int(trainer.global_step), "settings": self.settings(trainer)}  # fmt: skip
        set_stop_reason(trainer, reason, detail)

    def on_step(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        if step % self.check_every_n_steps != 0:
            return
        if stop_reason(trainer)[0] is not None or not self.limits():
            return
        spent, per_step = self.spent(), self._per_step(trainer)
        self.last_per_step = per_step
        # Stop now if the spend by the next check would pass a limit.
        projections = (
            (name, limit, float(spent[name]) + per_step.get(name, 0.0) * self.check_every_n_steps)
            for name, limit in self.limits().items()
        )
        hit = next((p for p in projections if stops_now(spent[p[0]], p[2], p[1])), None)
        stop = hit is not None
        if trainer.world_size > 1:
            stop = bool(trainer.strategy.reduce_boolean_decision(stop, all=False))
        if not stop:
            return
        name, limit, projected = hit if hit is not None else ("another rank's budget", None, None)
        detail = (
            self.spend_detail(name, spent[name], limit) if limit is not None else "budget spent"
        )
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
        self._decide(trainer, "budget", "budget", detail)

    def on_validated(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        assert self.clock is not None
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            return
        if not scheduled_validation(trainer):
            return  # a stop's extra evaluation: an uninterrupted run has none to count
        val = float(value)
        if self.history and self.history[-1][0] == step:
            self.history.pop()  # the same step validated again (e.g. after a resume)
        self.history.append((step, self.clock.gpu_hours(), val))
        if self.best is None or val < self.best - self.min_delta:
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
        payoff = self.agreed_payoff(trainer)
        already = stop_reason(trainer)[0]
        # The run's last step (max_steps) ends it anyway: "completed", never a stop by a rule.
        finished = 0 < (trainer.max_steps or -1) <= trainer.global_step
        rule = "none"
        if already is None and not finished:
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
            detail = (
                payoff_detail(payoff) if payoff["decision"] == "stop" else "payoff (another rank)"
            )
            self._decide(trainer, "payoff", "budget", detail)
            if trainer.is_global_zero:  # the console says why, with the forecast behind it
                print(f"stopping: {detail}", flush=True)
        elif stop and rule == "plateau":
            self._decide(
                trainer,
                "plateau",
                "plateau",
                f"no val improvement >= {self.min_delta} in {self.evals_since_best} evaluations",
            )

    def agreed_payoff(self, trainer: L.Trainer) -> dict[str, Any]:
        """The payoff rule's numbers and decision, computed on rank 0 and sent to every rank:
        one forecast a validation instead of one per rank, and one decision (each rank's own
        spend per step would project its own end step and GPU-hours left)."""
        if trainer.world_size <= 1:
            return self.payoff(trainer)
        mine = self.payoff(trainer) if trainer.is_global_zero else None
        return trainer.strategy.broadcast(mine, src=0)

    def payoff(self, trainer: L.Trainer) -> dict[str, Any]:
        """The payoff rule's forecast, numbers and decision (see the module docstring)."""
        out: dict[str, Any] = {
            "threshold": self.payoff_threshold,
            "per_gpu_hour_threshold": self.payoff_per_gpu_hour,
            "evals": len(self.history),
            "model": None,
            "remaining_gpu_hours": None,
            "limited_by": None,
            "end_step": None,
            "forecast_now": None,
            "forecast_end": None,
            "forecast_end_band": None,
            "gain": None,
            "gain_optimistic": None,
            # The optimistic gain over the GPU-hours left (what payoff_per_gpu_hour compares):
            # named for what it is, not the plain gain per GPU-hour (logs before it: the key
            # ``gain_per_gpu_hour``, the same quantity).
            "gain_optimistic_per_gpu_hour": None,
            "note": None,
            "decision": "continue",
        }
        if self.payoff_threshold is None and self.payoff_per_gpu_hour is None:
            return out
        remaining, which = self.remaining_gpu_hours(trainer)
        out["remaining_gpu_hours"], out["limited_by"] = remaining, which
        gpu_per_step = self._per_step(trainer).get("gpu_hours")
        if remaining is None or not gpu_per_step:
            out["note"] = "no end in sight (no budget, no max_steps) or no cost per step yet"
            return out
        step = int(trainer.global_step)
        if which == "trainer.max_steps":
            end = int(trainer.max_steps)
        else:  # a budget ends the run first: the steps it still pays for
            end = step + math.floor(remaining / gpu_per_step)
            if trainer.max_steps and trainer.max_steps > 0:
                end = min(end, int(trainer.max_steps))
        out["end_step"] = end
        warmup = getattr(
            getattr(trainer.lightning_module, "schedule_config", None), "warmup_steps", 0
        )
        points = [(float(s), float(s), v) for s, _, v in self.history if s >= 1]
        if sum(1 for s, _, _ in points if s >= warmup) < self.payoff_min_evals:
            out["note"] = f"waiting for {self.payoff_min_evals} validations after warmup"
            return out
        try:
            now, end_loss, band, model = self._forecast(trainer, points, warmup, step, end)
        except ForecastError as err:
            out["note"] = f"no forecast: {err}"
            return out
        gain, optimistic = now - end_loss, max(0.0, now - band[0])
        out.update(model=model, forecast_now=now, forecast_end=end_loss, forecast_end_band=band,
                   gain=gain, gain_optimistic=optimistic)  # fmt: skip
        if remaining > 0:
            out["gain_optimistic_per_gpu_hour"] = optimistic / remaining
        if self.payoff_threshold is not None and optimistic < self.payoff_threshold:
            out["decision"] = "stop"
        per_hour = out["gain_optimistic_per_gpu_hour"]
        if self.payoff_per_gpu_hour is not None and (
            per_hour is None or per_hour < self.payoff_per_gpu_hour
        ):
            out["decision"] = "stop"
        return out

    def _forecast(
        self, trainer: L.Trainer, points: list, warmup: int, step: int, end: int
    ) -> tuple[float, float, tuple[float, float], str]:
        """(loss now, loss at ``end``, its 5-95% band, model) from the val history, fitted on
        at most :data:`PAYOFF_POINTS` of its points."""
        schedule = _lr_multiplier(trainer)
        if schedule is not None:
            # The points the schedule fit reads (those after warmup: there are enough), thinned.
            after = even_points([p for p in points if p[0] >= warmup], PAYOFF_POINTS)
            inputs = CurveInputs(points=after, max_steps=max(end, step), tokens_per_step=1.0,
                                 schedule_for=lambda _steps: schedule, warmup_steps=warmup)  # fmt: skip
            fit = fit_curve(inputs, bootstrap=self.payoff_bootstrap)
            return fit.predict(step), fit.predict(end), fit.band(end), "schedule"
        # An optimizer without a LambdaLR: the power law in steps (tokens per step are fixed).
        points = even_points(points, PAYOFF_POINTS)
        law = fit_loss_curve([s for s, _, _ in points], [v for _, _, v in points],
                             bootstrap=self.payoff_bootstrap)  # fmt: skip
        return law.predict(step), law.predict(end), law.band(end), "power law"

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
                "currency": self.priced_currency,
            },
        )

    # -- run log fields ----------------------------------------------------------------------
    @property
    def priced_currency(self) -> str | None:
        """The currency, when there is a price to give it a meaning."""
        return self.currency if self.price_per_gpu_hour is not None else None

    def record_fields(self, trainer: L.Trainer, event: str) -> dict[str, Any]:
        if not self.active or self.clock is None:
            return {}
        if event == "start":
            return {
                "price_per_gpu_hour": self.price_per_gpu_hour,
                "currency": self.priced_currency,
                "budgets": self.limits(),
            }
        cost = {"cost": self.spent().get("cost")}
        return {"train": cost, "end": {**cost, "currency": self.priced_currency}}.get(event, {})

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        spent = self.spent() if self.clock is not None else {}
        return {
            "history": [list(h) for h in self.history],
            "best": self.best,
            "evals_since_best": self.evals_since_best,
            "spent": spent,
            "decided": self.decided,
            "per_step": dict(self.last_per_step),
            "monitor": self.monitor,  # what history holds (an export's card reads val/loss)
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [(int(s), float(g), float(v)) for s, g, v in state_dict.get("history", [])]
        self.best = state_dict.get("best")
        self.evals_since_best = int(state_dict.get("evals_since_best", 0))
        self.decided = state_dict.get("decided")  # checkpoints before it: none
        self.last_per_step = {k: float(v) for k, v in (state_dict.get("per_step") or {}).items()}


def stops_now(spent: float, projected: float, limit: float) -> bool:
    """Whether a budget stops the run at a check: the spend by the next check would pass the
    limit (reaching it exactly is within the budget: ``max_tokens`` 1024 at 128 tokens a step
    trains 8 steps), or there is nothing left of it (a resume between checks projects nothing)."""
    return projected > limit or float(spent) >= limit


def _amount(value: float) -> str:
    """A spend or a limit as a stop reason gives it: whole numbers as such, else 4 digits."""
    number = float(value)
    return str(int(number)) if number.is_integer() else f"{number:.4g}"


def _lr_multiplier(trainer: L.Trainer) -> Any:
    """The run's LR multiplier per step (its ``LambdaLR``'s function), a constant 1 without a
    scheduler, or None when the scheduler is of another kind (then the power law is used)."""
    configs = getattr(trainer, "lr_scheduler_configs", None) or []
    if not configs:
        return lambda _step: 1.0
    lambdas = getattr(configs[0].scheduler, "lr_lambdas", None)
    return lambdas[0] if lambdas else None


def payoff_detail(payoff: dict[str, Any]) -> str:
    """The stop reason of the payoff rule, with the forecast numbers behind it."""
    lo, hi = payoff["forecast_end_band"]
    why = []
    if payoff["threshold"] is not None and payoff["gain_optimistic"] < payoff["threshold"]:
        why.append(f"< threshold {payoff['threshold']:g}")
    if payoff["per_gpu_hour_threshold"] is not None:
        per = payoff["gain_optimistic_per_gpu_hour"]
        per_text = f"{per:.4g}" if per is not None else "none"
        why.append(f"{per_text}/GPU-h vs payoff_per_gpu_hour {payoff['per_gpu_hour_threshold']:g}")
    return (
        f"payoff: forecast val loss {payoff['forecast_now']:.4f} now -> "
        f"{payoff['forecast_end']:.4f} [{lo:.4f}, {hi:.4f}] at step {payoff['end_step']} "
        f"({payoff['limited_by']}, {payoff['remaining_gpu_hours']:.3g} GPU-h left); at best "
        f"{payoff['gain_optimistic']:.4g} better, " + "; ".join(why)
    )
