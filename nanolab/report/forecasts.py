"""``--forecast`` and ``--target-loss``: each run's (and each seed group's) validation curve
fitted over its LR schedule, and the text that says what it will reach."""

from __future__ import annotations

import math
import statistics
from array import array
from pathlib import Path
from typing import Any

from nanolab.report.groups import SeedGroup
from nanolab.report.text import money
from nanolab.runlog import started_from_another_run, written_in_training
from nanolab.runs import (
    EvenSample,
    config_of,
    iter_timeline,
    num,
    own_tokens,
    planned_steps_of,
    si,
)

#: Logged LRs a forecast checks the config's schedule against: an even sample of the log's.
LR_SAMPLE = 50


def _schedule_of(
    config: dict[str, Any], logged: list[tuple[int, float]], max_steps: int
) -> tuple[Any, int]:
    """``(planned steps -> LR multiplier, warmup steps)`` from a run's config and the steps it
    is planned for (:func:`planned_steps_of`), checked against ``logged``, an even sample of
    the (step, LR) its log recorded (``(None, 0)`` when the config has no schedule or the log
    disagrees, e.g. a model class with its own schedule)."""
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
    planned = lr_schedule(cfg, max_steps)
    # Step s trained at the multiplier of s - 1 (counted from 0); records written before this
    # release showed the next step's rate, planned(s), and a run resumed across the upgrade
    # holds both: each sample must be one or the other.
    sample = logged[:: max(1, len(logged) // 50)]
    if all(
        any(
            math.isclose(lr, peak * planned(step - shift), rel_tol=1e-3, abs_tol=1e-12)
            for shift in (1, 0)
        )
        for step, lr in sample
    ):
        return (lambda steps: lr_schedule(cfg, steps)), cfg.warmup_steps
    return None, 0


def plans_lr_schedule(start: dict[str, Any]) -> bool:
    """Whether the launch of this start record planned the run's LR schedule: one that started
    from no checkpoint, or from another run's (a branch plans its own cosine); a resume of the
    run's own checkpoint keeps the plan that checkpoint holds, whatever its
    ``trainer.max_steps`` (the launch says so)."""
    return start.get("resumed_from_step") is None or started_from_another_run(start)


class CurvePoints:
    """A run's validations as a forecast reads them, (step, tokens, val loss), in three packed
    columns: 24 bytes a validation, where a dict of each record's fields took ~340 (the readers
    of every run are held until the forecasts: 50 runs x 10^5 validations were 1.6 GB). A step
    validated again (a resume) counts with its last copy, as the records' dict by step did."""

    def __init__(self) -> None:
        self._steps, self._tokens, self._losses = array("d"), array("d"), array("d")

    def add(self, step: float, tokens: Any, loss: Any) -> None:
        """One validation at step key ``step`` (``inf``: none logged); one without a step,
        a positive token count or a finite loss is kept as not a point (NaN tokens), so that
        it still replaces an earlier copy of its step."""
        t, v = num(tokens), num(loss)
        usable = math.isfinite(step) and t is not None and v is not None and t > 0
        self._steps.append(step)
        self._tokens.append(t if usable and t is not None else math.nan)
        self._losses.append(v if usable and v is not None else math.nan)

    def points(self) -> list[tuple[float, float, float]]:
        """(step, tokens, val loss) of the last copy of each step, by step, usable ones only."""
        last = {step: i for i, step in enumerate(self._steps)}
        return [
            (step, self._tokens[i], self._losses[i])
            for step, i in sorted(last.items())
            if not math.isnan(self._tokens[i])
        ]


class ForecastReader:
    """What a forecast of one run needs from its log, fed record by record: the usable records
    of the timeline a resume leaves (:func:`nanolab.runs.iter_timeline`), so it reads along the
    report's own pass over the log (``summarize_run(..., also=reader.add)``) or on its own
    (:func:`forecast_inputs`). It keeps the validations, the last start and train record, the
    start that planned the LR schedule (:func:`plans_lr_schedule`), and
    an even sample of the logged LRs: a 1M-step log is not held (it took 2 GB). Of the last
    launch, also the train record before its last: the tokens per step it trains with, where
    its start record does not say."""

    def __init__(self) -> None:
        self.val = CurvePoints()
        self.start: dict[str, Any] | None = None
        self.plan: dict[str, Any] | None = None
        self.last: dict[str, Any] | None = None
        self.before_last: dict[str, Any] | None = None  # of the same launch as ``last``
        self.latest: dict[str, tuple[float, float | None]] = dict.fromkeys(
            ("gpu_hours", "cost", "run_tokens"), (-1, None)
        )
        self.first_start: dict[str, Any] | None = None
        self.lrs = EvenSample(LR_SAMPLE)

    def add(self, r: dict[str, Any]) -> None:
        """One usable record (``record_problem`` found nothing) in log order."""
        event = r.get("event")
        if event == "start":
            self.start, self.before_last = r, None
            self.first_start = self.first_start or r
            if self.plan is None or plans_lr_schedule(r):
                self.plan = r
            return
        if event not in ("train", "val"):
            return
        step = r.get("step")
        at = math.inf if step is None else float(step)  # last_by_step's order
        if event == "val":
            if written_in_training(r):  # not a later validate's record of a checkpoint
                self.val.add(at, r.get("tokens"), r.get("val_loss"))
            return
        if num(r.get("tokens")) and step and at >= (self.last or {}).get("at", -1):
            if self.last is not None and at > self.last["at"]:
                self.before_last = self.last
            self.last = {"at": at, "step": step, "tokens": r["tokens"]}
        for f in self.latest:
            if r.get(f) is not None and at >= self.latest[f][0]:
                self.latest[f] = (at, r[f])
        lr = num(r.get("lr"))
        if isinstance(step, int) and step >= 1 and lr is not None:
            self.lrs.add((step, lr))

    def tokens_per_step(self) -> float | None:
        """Tokens per step the run trains with now: its last start record's
        ``global_batch_tokens``, else the step between its last launch's last two train
        records, else (one record) the run's average so far."""
        per_step = num((self.start or {}).get("global_batch_tokens"))
        if per_step:
            return per_step
        last, before = self.last, self.before_last
        if last is None:
            return None
        tokens = num(last["tokens"]) or 0.0
        if before is not None and tokens > (num(before["tokens"]) or 0.0):
            return (tokens - (num(before["tokens"]) or 0.0)) / (last["at"] - before["at"])
        return tokens / int(last["step"])

    def inputs(self, run_dir: Path) -> Any:
        """The :class:`nanolab.forecast.CurveInputs` of what was read (``run_dir``: where the
        config is, when the start record has none)."""
        from nanolab.forecast import CurveInputs

        points = self.val.points()
        start, last, lrs = self.start, self.last, self.lrs
        config = config_of([start] if start else [], run_dir) or {}
        max_steps = planned_steps_of(start, config)
        plan = self.plan if self.plan is not None else start
        plan_config = config_of([plan] if plan else [], run_dir) or {}
        plan_steps = planned_steps_of(plan, plan_config)
        # The hours and cost are the run's own: per token of its own (a branch's without its
        # parent's; None where an older log does not say).
        own = own_tokens(
            num((last or {}).get("tokens")), self.latest["run_tokens"][1], self.first_start
        )
        gpu_h, cost = num(self.latest["gpu_hours"][1]), num(self.latest["cost"][1])
        sample = lrs.items + (
            [lrs.last] if lrs.last is not None and lrs.last not in lrs.items else []
        )
        schedule_for, warmup = (
            _schedule_of(plan_config, sample, plan_steps) if points else (None, 0)
        )
        return CurveInputs(
            points=points,
            max_steps=max_steps if max_steps > 0 else None,
            tokens_per_step=self.tokens_per_step(),
            logged_to=(float(last["step"]), float(last["tokens"])) if last else None,
            schedule_for=schedule_for,
            plan_steps=plan_steps if plan_steps > 0 else None,
            warmup_steps=warmup,
            gpu_hours_per_token=gpu_h / own if gpu_h and own else None,
            cost_per_token=cost / own if cost and own else None,
        )


def forecast_inputs(run_dir: Path) -> Any:
    """What a forecast of one run needs from its log (:class:`nanolab.forecast.CurveInputs`):
    (step, tokens, val loss) points, the steps it is planned for, tokens per step, the LR schedule
    from the config, and GPU-hours and cost per token so far; on the timeline a resume leaves, as
    the report's summary reads it. One pass of its own over the log; ``report`` reads it along
    its summary's pass instead (:class:`ForecastReader`)."""
    reader = ForecastReader()
    for r in iter_timeline(run_dir, ("start", "train", "val")):
        reader.add(r)
    return reader.inputs(run_dir)


def forecasts(
    selected: list[tuple[str, Path]],
    groups: list[SeedGroup],
    target: float | None,
    read: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Forecasts per run and per seed group (the group's points fitted together). ``read``:
    the runs' :class:`~nanolab.forecast.CurveInputs` already read (by name); the other runs'
    logs are read here."""
    from dataclasses import replace

    from nanolab.forecast import forecast

    read = read or {}
    inputs = {name: read[name] if name in read else forecast_inputs(d) for name, d in selected}
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
    if target is not None:
        head += target_heading(target, hours)
    out = ["", head]
    for label, f in [*runs.items(), *((f"group {k}", v) for k, v in groups.items())]:
        if f.fit is None:
            out.append(f"  {label}: no forecast ({f.note})" + _reached_text(f, target))
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


def target_heading(target: float, hours: str) -> str:
    """What the ``to X`` figures of each line are, said once in the heading: the tokens where
    the curve reaches X count from step 0, a branch's with its parent's (its log's tokens go on
    from there), and their hours and cost are at the run's own rate per token it trained. So
    they are a whole run's to X at this run's rate, not the cost of finishing this run (nor a
    branch's own share)."""
    return (
        f"; to {target}: the tokens from step 0 (a branch's with its parent's) and their "
        f"{hours} and cost at the run's own rate: a whole run to {target}, not what is left"
    )


def _target_text(f: Any, target: float | None, hours: str) -> str:
    """``; to X: tokens [range], hours, cost`` for --target-loss (empty without one)."""
    if target is None:
        return ""
    if f.reached is not None:  # seen in the log: no forecast of a point already passed
        return _reached_text(f, target)
    if f.target_tokens is None:
        return f"; to {target}: {f.note}"
    lo, hi = f.target_band
    hi_text = si(hi) if math.isfinite(hi) else "never"
    text = f"; to {target}: {si(f.target_tokens)} tokens [{si(lo)}, {hi_text}]"
    if f.target_gpu_hours is not None:
        text += f", {f.target_gpu_hours:.3g} {hours}"
    if f.target_cost is not None:
        text += f", {money(f.target_cost)}"
    return text


def _reached_text(f: Any, target: float | None) -> str:
    """``; X reached at ~N tokens (step ~S), ...`` when the run's validations already crossed
    the target (:func:`nanolab.forecast.run.observed_crossing`), whether or not a curve could
    be fitted; without a fit, also that it was not reached; else empty."""
    at = f.reached
    if target is None:
        return ""
    if at is None:
        if f.fit is not None or f.last_loss is None:
            return ""  # the forecast's own target text says the rest
        return f"; {target} not reached by its validations (the last: {f.last_loss:.4f})"
    if at.before is None:
        return (f"; {target} reached by {si(at.tokens)} tokens (step {at.step:.0f}): its first "
                "validation is already at or below it")  # fmt: skip
    return (f"; {target} reached at ~{si(at.tokens)} tokens (step ~{at.step:.1f}), interpolated "
            f"between the validations at steps {at.before:.0f} and {at.after:.0f}")  # fmt: skip


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
        text += (
            "; its irreducible loss came out 0 (the points do not show where the curve levels "
            "off: a forecast far past them is a guess)"
        )
    return text
