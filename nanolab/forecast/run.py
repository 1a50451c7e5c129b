"""One run's forecast: where its validation loss ends at ``trainer.max_steps``, and what a target
loss would take. Used by ``nanolab report --forecast`` and by the budget's payoff rule, so both
answer "is this run still worth its GPU-hours" with the same model.

The LR schedule decides the model. When the run's schedule is known (its config), the loss is
fitted as a function of the schedule (:mod:`nanolab.forecast.annealing`: forward area and
annealing area), on the validation points after warmup, and evaluated on the whole planned
schedule. Without it, the power law in tokens (:mod:`nanolab.forecast.powerlaw`) is the fallback.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from nanolab.forecast.annealing import (
    MIN_POINTS,
    ScheduleFit,
    fit_schedule_curve,
    law,
    multipliers_array,
    schedule_areas,
)
from nanolab.forecast.powerlaw import ForecastError, fit_loss_curve

#: Planned lengths tried when a target is beyond the run's own plan: up to this many times it.
TARGET_HORIZON = 20.0

Schedule = Callable[[int], float]


@dataclass
class CurveInputs:
    """What a forecast of one validation curve needs.

    Attributes:
        points: ``(step, tokens, val loss)`` so far.
        max_steps: Steps the run is planned for (None / <= 0: unbounded or unknown).
        tokens_per_step: Tokens one optimizer step trains on now (the last launch's: a resume
            may have changed accumulation, micro-batch or devices).
        schedule_for: Planned steps -> the LR multiplier per step of a run of that length (the
            run's own schedule at ``plan_steps``). None: unknown, the power law in tokens is used.
        plan_steps: The steps the run's LR schedule was planned for, when not ``max_steps``: a
            resume keeps the plan its checkpoint holds, so a run resumed with a longer
            ``trainer.max_steps`` trains the steps past the plan at the schedule's minimum.
        warmup_steps: Points before the end of warmup are left out of a schedule fit (the loss
            there is the start-up transient, not the law).
        gpu_hours_per_token, cost_per_token: The run's rate so far, for a target's cost.
        logged_to: ``(step, tokens)`` of the run's newest train record. With it, a step up to
            there is mapped to tokens through what the log says (the points' and its own), and
            a later one counts on from it at ``tokens_per_step``
            (:func:`tokens_by_step`); without it, every step is ``tokens_per_step`` tokens.
    """

    points: list[tuple[float, float, float]]
    max_steps: int | None = None
    tokens_per_step: float | None = None
    schedule_for: Callable[[int], Schedule] | None = None
    plan_steps: int | None = None
    warmup_steps: int = 0
    gpu_hours_per_token: float | None = None
    cost_per_token: float | None = None
    logged_to: tuple[float, float] | None = None


StepsToTokens = Callable[[np.ndarray], np.ndarray]


def tokens_by_step(inputs: CurveInputs) -> StepsToTokens | None:
    """Steps -> the tokens trained by then, for a forecast's tokens (None: tokens per step
    unknown). One rate for the whole run (its tokens over its steps) was 25% low after a resume
    that doubled the accumulation: the steps logged so far map through their own tokens (the
    points' and ``logged_to``, interpolated between them; before the first, in proportion to
    it), and the steps after the newest count on from it at the current ``tokens_per_step``."""
    per_step = inputs.tokens_per_step
    if not per_step:
        return None
    if inputs.logged_to is None:
        return lambda steps: np.asarray(steps, dtype=float) * per_step
    logged: dict[float, list[float]] = {}
    for step, tokens, _ in inputs.points:  # a seed group's seeds at one step: their mean
        logged.setdefault(float(step), []).append(float(tokens))
    anchors = {s: sum(t) / len(t) for s, t in logged.items() if s > 0}
    last_step, last_tokens = (float(v) for v in inputs.logged_to)
    if last_step > 0:
        anchors[last_step] = last_tokens
    if not anchors:
        return lambda steps: np.asarray(steps, dtype=float) * per_step
    xs = np.array(sorted(anchors))
    ys = np.array([anchors[x] for x in xs])

    def tokens(steps: np.ndarray) -> np.ndarray:
        s = np.asarray(steps, dtype=float)
        after = ys[-1] + (s - xs[-1]) * per_step  # inf (a band never reached) stays inf
        before = s * (ys[0] / xs[0])
        return np.where(s > xs[-1], after, np.where(s < xs[0], before, np.interp(s, xs, ys)))

    return tokens


@dataclass
class Crossing:
    """Where a validation curve first reached a target loss, read off its own points.

    Attributes:
        step, tokens: Where the straight line between the validations either side meets the
            target (interpolated); at the first validation itself when that one is already at
            or below it (it was reached there or sooner).
        before: The step of the last validation above the target (None: the first validation
            was already at or below it).
        after: The step of the first validation at or below it.
    """

    step: float
    tokens: float
    before: float | None
    after: float


@dataclass
class RunForecast:
    """What a run's validation curve says about its end and about a target loss.

    Attributes:
        points: Validation points fitted.
        model: ``schedule`` (loss vs the LR schedule) or ``power law`` (loss vs tokens).
        fit: The fitted parameters, None when no fit was possible.
        final_tokens: Tokens at ``trainer.max_steps``; ``final_loss``/``final_band``: the
            forecast there (the fit and its 5-95% range).
        target / target_tokens / target_band: tokens to reach ``--target-loss`` (None: not
            reachable within :data:`TARGET_HORIZON` x the planned run, or below the fitted
            floor), and the GPU-hours and cost of getting there at the run's own rate so far.
        curve: ``(tokens, loss)`` of the fitted curve from the first point to ``max_steps``.
        note: Why something is missing.
        finished: The last validation point is at ``max_steps``: nothing is left to forecast
            (the report says "finished" and how well the curve was fitted, not a forecast).
        last_loss: The val loss of the last point.
        reached: Where the validations already crossed ``target`` (:func:`observed_crossing`),
            with or without a fit; None: not crossed, or no target.
    """

    points: int
    model: str | None = None
    fit: dict | None = None
    final_tokens: float | None = None
    final_loss: float | None = None
    final_band: tuple[float, float] | None = None
    target: float | None = None
    target_tokens: float | None = None
    target_band: tuple[float, float] | None = None
    target_gpu_hours: float | None = None
    target_cost: float | None = None
    curve: list[tuple[float, float]] = field(default_factory=list)
    note: str | None = None
    finished: bool = False
    last_loss: float | None = None
    reached: Crossing | None = None


def observed_crossing(points: list[tuple[float, float, float]], target: float) -> Crossing | None:
    """Where ``points`` (``(step, tokens, val loss)``, a seed group's several per step: their
    mean counts) first reach ``target``, interpolated linearly in loss between the validations
    either side; None when no validation is at or below it. A report asked for a target says
    so from the log itself, however few points it holds (a fit needs :data:`MIN_POINTS`)."""
    by_step: dict[float, list[tuple[float, float]]] = {}
    for step, tokens, loss in points:
        by_step.setdefault(step, []).append((tokens, loss))
    previous: tuple[float, float, float] | None = None
    for step in sorted(by_step):
        pairs = by_step[step]
        tokens = sum(t for t, _ in pairs) / len(pairs)
        loss = sum(v for _, v in pairs) / len(pairs)
        if loss <= target:
            if previous is None:
                return Crossing(step=step, tokens=tokens, before=None, after=step)
            s0, t0, v0 = previous
            share = (v0 - target) / (v0 - loss)  # v0 > target >= loss: in (0, 1]
            return Crossing(
                step=s0 + share * (step - s0),
                tokens=t0 + share * (tokens - t0),
                before=s0,
                after=step,
            )
        previous = (step, tokens, loss)
    return None


def even_points(points: list, limit: int) -> list:
    """At most ``limit`` (>= 2) of ``points`` (in step order), spread evenly: every
    ``stride``-th from the first, the stride the smallest power of two that fits, and the last.
    A refit's cost grows with its points (a 100k-step run validated every 50 steps has 2,000);
    the points kept stay the same from one validation to the next until the stride doubles,
    so successive forecasts do not jump, and the newest is always one of them."""
    if len(points) <= limit:
        return list(points)
    stride = 1
    while -(-(len(points) - 1) // stride) + 1 > limit:
        stride *= 2
    return [*points[:-1:stride], points[-1]]


#: Most validation points a forecast fits: each of its 200 bootstrap refits reads every point,
#: so a run validated every 10 steps (41,666 points at 416K steps) took 32 s and 95 MB, and four
#: times the points 183 s. Evenly spread, they give the same curve (tests/test_forecast.py).
FIT_POINTS = 2000
#: The newest validation steps a thinned fit always keeps whole: they set the fit's offset.
FIT_LAST = 8


def fit_sample(points: list, limit: int = FIT_POINTS, last: int = FIT_LAST) -> list:
    """At most about ``limit`` of ``points`` (``(step, ...)``, in step order) for a fit: all of
    them when they are that few, else every point at an even sample of the earlier steps
    (:func:`even_points`) and at the ``last`` newest steps. By steps, so a seed group keeps all
    its seeds' points at each step kept."""
    steps = sorted({p[0] for p in points})
    if len(points) <= limit or len(steps) <= last + 2:
        return list(points)
    per_step = len(points) / len(steps)  # a seed group: one point per seed at each step
    budget = max(last + 2, int(limit / per_step))
    if len(steps) <= budget:
        return list(points)
    kept = {*even_points(steps[:-last], budget - last), *steps[-last:]}
    return [p for p in points if p[0] in kept]


def fit_curve(inputs: CurveInputs, bootstrap: int = 200) -> ScheduleFit:
    """The schedule fit of ``inputs`` (raises ForecastError when it cannot be made)."""
    if inputs.schedule_for is None or not inputs.max_steps or inputs.max_steps <= 0:
        raise ForecastError("no LR schedule or planned steps to forecast with")
    pts = [(s, v) for s, _, v in inputs.points]
    after = [(s, v) for s, v in pts if s >= inputs.warmup_steps]
    use = after if len({s for s, _ in after}) >= MIN_POINTS else pts  # steps, not seeds' copies
    return fit_schedule_curve(
        [s for s, _ in use],
        [v for _, v in use],
        inputs.schedule_for(inputs.plan_steps or inputs.max_steps),
        inputs.max_steps,
        bootstrap=bootstrap,
    )


def forecast(inputs: CurveInputs, target: float | None = None, bootstrap: int = 200) -> RunForecast:
    """Fit ``inputs`` and forecast the end of the run and a target (see the module)."""
    out = RunForecast(points=len(inputs.points), target=target)
    if target is not None:
        out.reached = observed_crossing(inputs.points, target)
    if inputs.points:
        # The last validation's loss; a seed group has one point per seed there: their mean.
        last_step = max(s for s, _, _ in inputs.points)
        at_last = [v for s, _, v in inputs.points if s == last_step]
        out.last_loss = sum(at_last) / len(at_last)
        out.finished = bool(
            inputs.max_steps and inputs.max_steps > 0 and last_step >= inputs.max_steps
        )
    to_tokens = tokens_by_step(inputs)
    if to_tokens is not None and inputs.max_steps and inputs.max_steps > 0:
        out.final_tokens = float(to_tokens(inputs.max_steps))
    inputs = replace(inputs, points=fit_sample(inputs.points, FIT_POINTS))
    try:
        if inputs.schedule_for is not None and to_tokens and out.final_tokens and inputs.points:
            _schedule_forecast(out, inputs, target, bootstrap, to_tokens)
        else:
            _power_law_forecast(out, inputs, target, bootstrap)
    except ForecastError as err:
        out.note = str(err)
    return out


def _cost(out: RunForecast, inputs: CurveInputs) -> None:
    if out.target_tokens is None:
        return
    if inputs.gpu_hours_per_token:
        out.target_gpu_hours = out.target_tokens * inputs.gpu_hours_per_token
    if inputs.cost_per_token:
        out.target_cost = out.target_tokens * inputs.cost_per_token


def _power_law_forecast(
    out: RunForecast, inputs: CurveInputs, target: float | None, bootstrap: int
) -> None:
    fit = fit_loss_curve(
        [t for _, t, _ in inputs.points], [v for _, _, v in inputs.points], bootstrap=bootstrap
    )
    out.model, out.fit = "power law", {"model": "power law", **fit.to_dict()}
    if out.final_tokens:
        out.final_loss = fit.predict(out.final_tokens)
        out.final_band = fit.band(out.final_tokens)
        xs = np.linspace(min(t for _, t, _ in inputs.points), out.final_tokens, 60)
        out.curve = [(float(x), fit.predict(float(x))) for x in xs]
    if target is not None:
        need = fit.tokens_to(target)
        if math.isinf(need):
            out.note = f"the fitted floor E={fit.E:.4f} is above {target}: not reachable"
        else:
            out.target_tokens = need
            out.target_band = fit.tokens_to_band(target)
            _cost(out, inputs)


def _schedule_forecast(
    out: RunForecast,
    inputs: CurveInputs,
    target: float | None,
    bootstrap: int,
    to_tokens: StepsToTokens,
) -> None:
    fit = fit_curve(inputs, bootstrap)
    assert inputs.max_steps and inputs.schedule_for
    out.model, out.fit = "schedule", fit.to_dict()
    out.final_loss = fit.predict(inputs.max_steps)
    out.final_band = fit.band(inputs.max_steps)
    first = max(int(min(s for s, _, _ in inputs.points)), inputs.warmup_steps)  # fitted from
    steps = np.unique(np.linspace(max(first, 1), inputs.max_steps, 60).round().astype(int))
    out.curve = [
        (float(t), fit.predict(int(s))) for s, t in zip(steps, to_tokens(steps), strict=True)
    ]
    if target is None:
        return
    need, band = steps_to_target(fit, target, inputs.schedule_for, inputs.max_steps)
    if need is None:
        out.note = (f"{target} is not reached by a run of this recipe up to "
                    f"{TARGET_HORIZON:g}x its planned steps")  # fmt: skip
        return
    out.target_tokens = float(to_tokens(need))
    out.target_band = (float(to_tokens(band[0])), float(to_tokens(band[1])))
    _cost(out, inputs)


def steps_to_target(
    fit: ScheduleFit, target: float, schedule_for: Callable[[int], Schedule], max_steps: int
) -> tuple[float | None, tuple[float, float]]:
    """Steps to reach ``target``: within the planned run, the first step the fitted curve is at
    or below it; beyond, the planned length of a run of the same recipe (its schedule stretched
    to that length) that ends there. Band: the same over the bootstrap refits, widened by the
    fit's curve shifted down and up by its backtest miss scaled to each length (inf: never).
    """
    steps = np.arange(1, max_steps + 1)
    decays = sorted({fit.decay, *(float(d) for d in fit.samples[:, 4])})
    best = np.array([[*fit.params(max_steps + 1), fit.decay]])
    # Rows: the fit, the fit minus / plus its backtest miss, then the bootstrap refits.
    rows = np.concatenate([best, best, best, fit.samples])
    sign = np.zeros(len(rows))
    sign[1], sign[2] = -1.0, 1.0

    def curves(pick: np.ndarray, s1: np.ndarray, s2: np.ndarray) -> np.ndarray:
        r = rows[pick]
        loss = law(r[:, 0:1], r[:, 1:2], r[:, 2:3], r[:, 3:4], s1[None, :], s2)
        miss = np.array([fit.error_ahead(float(v)) for v in s1]) if sign[pick].any() else 0.0
        return loss + fit.offset + sign[pick][:, None] * miss

    reached = np.full(len(rows), np.inf)
    for decay in decays:
        pick = rows[:, 4] == decay
        s1, s2 = fit.areas[decay]
        hit = curves(pick, s1[steps], s2[steps]) <= target
        reached[pick] = np.where(hit.any(axis=1), steps[np.argmax(hit, axis=1)], np.inf)
    todo = ~np.isfinite(reached)
    if todo.any():
        lengths = np.unique(np.geomspace(max_steps * 1.1, max_steps * TARGET_HORIZON, 24).round())
        ends = np.full((len(rows), len(lengths)), np.inf)
        for j, length in enumerate(lengths.astype(int)):
            mult = multipliers_array(schedule_for(length), length)
            for decay in decays:
                pick = rows[:, 4] == decay
                s1, s2 = schedule_areas(mult, decay)
                ends[pick, j] = curves(pick, s1[-1:], s2[-1:])[:, 0]
        hit = ends <= target
        for i in np.flatnonzero(todo & hit.any(axis=1)):
            j = int(np.argmax(hit[i]))
            if j == 0:
                reached[i] = lengths[0]
                continue
            # log-linear interpolation between the last length above and the first below.
            a, b = ends[i, j - 1], ends[i, j]
            t = (a - target) / (a - b) if a != b else 1.0
            reached[i] = math.exp(math.log(lengths[j - 1]) * (1 - t) + math.log(lengths[j]) * t)
    spread = reached[3:] if len(rows) > 3 else reached[:1]
    # "nearest": a spread holding inf (never reached) must not interpolate inf - inf = nan.
    lo, hi = np.percentile(spread, (5.0, 95.0), method="nearest")
    lo, hi = min(float(lo), float(reached[1])), max(float(hi), float(reached[2]))
    need = float(reached[0]) if math.isfinite(reached[0]) else None
    return need, (lo, hi)
