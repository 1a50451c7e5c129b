"""The loss as a function of the learning-rate schedule, so a decaying LR is forecast, not missed.

    L(s) = L0 + A * S1(s) ** -alpha - C * S2(s)

after ``s`` optimizer steps, with the schedule's LR multipliers ``m_i`` (LR / peak LR):

* ``S1(s) = sum_{i<s} m_i``: the forward area, i.e. steps at the peak LR the run has had. With a
  constant LR it is the step count, and the model is the power law in tokens.
* ``S2(s) = sum_{i<s} mom_i``, ``mom_i = decay * mom_{i-1} + max(m_{i-1} - m_i, 0)``: the annealing
  area. Lowering the LR lowers the loss (less gradient noise) with a lag; ``decay`` (0.999 by
  default) is how long that lag is remembered. LR increases (warmup) are not annealing.

Fitted on the part of the curve seen so far, evaluated on the *whole planned schedule*: a cosine
run's late drop is in S2 before it happens, which a power law in tokens cannot know. For a fixed
``alpha`` the model is linear in ``(L0, A, C)``, solved exactly with all three ``>= 0``
(``scipy.optimize.nnls``) for every ``alpha`` of a log grid, then of two finer grids around the
best; no joint Newton fit that can diverge on a short curve.

The band is a residual bootstrap: refits on the fitted curve plus resampled residuals. Early in a
run ``C`` is weakly determined (little annealing seen yet); the bootstrap then spreads it and the
band at ``max_steps`` widens, which is the honest answer. ``benches/forecast_check.py`` measures
the error and the band's coverage on finished runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, fields, is_dataclass

import numpy as np

from nanolab.forecast.powerlaw import MIN_POINTS, ForecastError, require_points

#: Memory of the annealing momentum per step (0.999: ~1000 steps).
DECAY = 0.999
#: Exponents searched for ``S1``.
ALPHA_RANGE = (0.01, 3.0)

Multipliers = Sequence[float] | np.ndarray | Callable[[int], float]


#: Longest schedule evaluated step by step; longer ones are sampled at this many steps, each
#: sample held over its stretch (smooth schedules lose nothing that matters to the areas).
MAX_EVALUATED = 200_000


def multipliers_array(schedule: Multipliers, steps: int) -> np.ndarray:
    """The first ``steps`` LR multipliers of a schedule (a callable step -> multiplier, as the
    run's ``LambdaLR`` uses, or a sequence, held at its last value past its end). A callable
    with a ``multipliers(steps)`` method (nanolab's own cosine) gives them all at once, every
    step exact; any other is called per step, sampled past :data:`MAX_EVALUATED` steps."""
    at_once = getattr(schedule, "multipliers", None)
    if callable(schedule) and callable(at_once):
        return np.asarray(at_once(steps), dtype=float)[:steps]
    if callable(schedule):
        if steps > MAX_EVALUATED:
            stride = math.ceil(steps / MAX_EVALUATED)
            coarse = [float(schedule(i)) for i in range(0, steps, stride)]
            return np.repeat(np.array(coarse, dtype=float), stride)[:steps]
        return np.array([float(schedule(i)) for i in range(steps)], dtype=float)
    arr = np.asarray(schedule, dtype=float)
    if len(arr) >= steps:
        return arr[:steps].copy()
    if len(arr) == 0:
        raise ForecastError("an empty LR schedule")
    return np.concatenate([arr, np.full(steps - len(arr), arr[-1])])


def _schedule_key(schedule: Multipliers) -> Hashable | None:
    """What defines a callable schedule, for :class:`AreasCache`: a dataclass's type and fields
    (nanolab's cosine: equal settings, equal schedule), else the callable itself when hashable
    (a function: the same object), else None (not cached). A sequence is not cached."""
    if not callable(schedule):
        return None
    if is_dataclass(schedule) and not isinstance(schedule, type):
        key: Hashable = (type(schedule), tuple(getattr(schedule, f.name) for f in fields(schedule)))
    else:
        key = schedule
    try:
        hash(key)
    except TypeError:
        return None
    return key


class AreasCache:
    """The planned schedule's multipliers checked and its areas, computed once per schedule.

    The payoff rule refits the forecast at every validation under the same schedule; computing
    ``S1``/``S2`` for every decay over the whole plan each time cost up to a second on a long
    run. Areas after ``s`` steps depend only on the steps before, so a plan's areas are the
    first ``total + 1`` entries of a longer plan's, when every step was evaluated (not sampled):
    a budget that moves the end step at each validation slices one computation. The newest
    ``entries`` schedules are kept (each holds its schedule, so an identity key stays its own).
    """

    def __init__(self, entries: int = 2) -> None:
        self.entries = entries
        # key -> (schedule, steps computed, every step evaluated, {decay: (S1, S2)})
        self._held: dict[Hashable, tuple[Multipliers, int, bool, dict]] = {}

    def areas(
        self, schedule: Multipliers, total: int, decays: Sequence[float]
    ) -> dict[float, tuple[np.ndarray, np.ndarray]]:
        """``decay -> (S1, S2)`` of ``schedule`` over ``total`` steps (index = steps done).

        Raises:
            ForecastError: the schedule has negative or non-finite multipliers.
        """
        wanted = tuple(float(d) for d in decays)
        key = _schedule_key(schedule)
        key = None if key is None else (key, wanted)
        held = self._held.get(key) if key is not None else None
        if held is not None and (held[1] == total or (held[2] and held[1] >= total)):
            self._held[key] = self._held.pop(key)  # the newest again
            return {d: (s1[: total + 1], s2[: total + 1]) for d, (s1, s2) in held[3].items()}
        mult = multipliers_array(schedule, total)
        if not np.all(np.isfinite(mult)) or np.any(mult < 0):
            raise ForecastError("the LR schedule has negative or non-finite multipliers")
        areas = {d: schedule_areas(mult, d) for d in wanted}
        if key is not None:
            sampled = not callable(getattr(schedule, "multipliers", None)) and total > MAX_EVALUATED
            self._held.pop(key, None)
            self._held[key] = (schedule, total, not sampled, areas)
            while len(self._held) > self.entries:
                self._held.pop(next(iter(self._held)))
        return areas


#: The areas of the schedules forecast last (the payoff rule's, a report's).
AREAS = AreasCache()


def schedule_areas(multipliers: np.ndarray, decay: float = DECAY) -> tuple[np.ndarray, np.ndarray]:
    """``(S1, S2)`` after ``s = 0 .. len(multipliers)`` steps (index ``s``); O(steps).

    The momentum recurrence is run as chunked cumulative sums (exact up to rounding): within a
    chunk, ``mom_j = decay^j * (mom_0 + sum_{k<=j} delta_k decay^-k)``, the chunk short enough
    that ``decay^-k`` stays far from overflow.
    """
    m = np.asarray(multipliers, dtype=float)
    s1 = np.concatenate([[0.0], np.cumsum(m)])
    delta = np.zeros_like(m)
    if len(m) > 1:
        delta[1:] = np.maximum(m[:-1] - m[1:], 0.0)
    mom = np.empty_like(m)
    if decay <= 0.0:
        mom[:] = delta
    else:
        chunk = max(1, int(60.0 / -math.log(decay))) if decay < 1.0 else len(m) or 1
        carry = 0.0
        for a in range(0, len(m), chunk):
            d = delta[a : a + chunk]
            j = np.arange(len(d), dtype=float)
            w = decay**j
            mom[a : a + chunk] = w * (carry + np.cumsum(d / w))
            carry = float(mom[a + len(d) - 1]) * decay if len(d) else carry
    s2 = np.concatenate([[0.0], np.cumsum(mom)])
    return s1, s2


def law(L0, A, alpha, C, s1, s2):
    """``L0 + A * s1 ** -alpha - C * s2``: the model, on numbers or arrays."""
    return L0 + A * s1**-alpha - C * s2


def _solve_batch(
    x: np.ndarray, s2: np.ndarray, y: np.ndarray, alphas: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares ``(L0, A, C) >= 0`` of ``y ~ L0 + A x^-alpha - C s2`` for each alpha
    (``scipy.optimize.nnls``; C stays 0 when no annealing has been seen). Returns (coefs [k, 3],
    sse [k])."""
    from scipy.optimize import nnls

    annealed = bool(np.any(s2 > 0))
    cols = np.empty((len(y), 3 if annealed else 2))
    cols[:, 0] = 1.0
    if annealed:
        cols[:, 2] = -s2
    coefs = np.zeros((len(alphas), 3))
    sses = np.empty(len(alphas))
    for i, alpha in enumerate(alphas):
        cols[:, 1] = x**-alpha
        coef, norm = nnls(cols, y)
        coefs[i, : len(coef)] = coef
        sses[i] = norm * norm
    return coefs, sses


def _fit(x: np.ndarray, s2: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float, float]:
    """((L0, A, C), alpha, sse) minimising the squared error; ``x`` = S1 (> 0)."""
    grid = np.geomspace(*ALPHA_RANGE, 60)
    coefs, sses = _solve_batch(x, s2, y, grid)
    i = int(np.argmin(sses))
    lo, hi = math.log(grid[max(i - 1, 0)]), math.log(grid[min(i + 1, len(grid) - 1)])
    # Refine: two rounds of a finer grid between the neighbours. A grid, not minimize_scalar:
    # the profile has kinks where a coefficient reaches 0, and a bounded Brent search took as
    # long and moved the printed forecasts in their 4th decimal.
    for _ in range(2):
        fine = np.exp(np.linspace(lo, hi, 17))
        c, s = _solve_batch(x, s2, y, fine)
        j = int(np.argmin(s))
        if s[j] <= sses[i]:
            coefs, sses, grid, i = c, s, fine, j
        step = (hi - lo) / 16
        lo, hi = math.log(grid[i]) - step, math.log(grid[i]) + step
    return coefs[i], float(grid[i]), float(sses[i])


@dataclass
class ScheduleFit:
    """A fitted ``L(s) = L0 + A S1(s)^-alpha - C S2(s)`` and its bootstrap refits.

    Attributes:
        L0, A, alpha, C: The parameters (S1, S2 in steps at the peak LR).
        decay: The annealing momentum's memory chosen (the best fit of :data:`DECAYS`).
        rmse: Root-mean-square residual; n: points fitted; last_step: the last point's step.
        samples: Bootstrap refits, one ``(L0, A, alpha, C, decay)`` row each.
        backtests: ``(miss, span)`` of fits on all but the last point, the last third and the
            last half of the points: the largest miss on the held-out points, and the forward area it
            was extrapolated over. The band widens by the largest miss scaled to the forecast's
            own span (the model's misfit, which resampling the residuals does not see). Empty:
            too few points to hold any out.
        no_annealing: ``(L0, A, alpha)`` of the same fit with ``C = 0``. While less than
            :data:`ANNEALING_SEEN` of the planned annealing area has been seen, the size of
            the annealing gain is extrapolated from a small start: the forecast then counts
            none (:meth:`params`) and the band spans both fits (:meth:`band`).
        offset: Mean residual of the last two points: forecasts from the last point on start
            where the curve is, not where the fit's misfit there puts it (a finished run's
            forecast at its end is then its last loss, not the fit's).
        areas: ``decay -> (S1, S2)`` over the planned schedule, index = steps done.
    """

    L0: float
    A: float
    alpha: float
    C: float
    decay: float
    rmse: float
    n: int
    last_step: int
    samples: np.ndarray
    backtests: list[tuple[float, float]]
    no_annealing: tuple[float, float, float] | None
    offset: float
    areas: dict[float, tuple[np.ndarray, np.ndarray]] = field(repr=False)

    @property
    def degenerate(self) -> bool:
        """``alpha`` at the edge of its range: the points do not pin the curve's shape."""
        return not ALPHA_RANGE[0] * 1.05 < self.alpha < ALPHA_RANGE[1] * 0.95

    def _at(self, step: float, decay: float) -> tuple[float, float]:
        s1, s2 = self.areas[decay]
        s = int(min(max(round(step), 1), len(s1) - 1))
        return float(s1[s]), float(s2[s])

    def s2_at(self, step: float) -> float:
        """The annealing area after ``step`` steps (at the fitted decay)."""
        return self._at(step, self.decay)[1]

    def _shift(self, step: float) -> float:
        return self.offset if step >= self.last_step else 0.0

    @property
    def annealing_known(self) -> bool:
        """Whether enough of the LR decay has been seen to size its gain (see ``no_annealing``)."""
        return self.no_annealing is None or self.annealing_seen() >= ANNEALING_SEEN

    def params(self, step: float) -> tuple[float, float, float, float]:
        """``(L0, A, alpha, C)`` a forecast at ``step`` uses: the fit, except ahead of the last
        point while the annealing's size is unknown, where the fit without it is used (the best
        fit's annealing is then a guess: on the quickstart's first 30% its final loss ranged from
        1.45 to -2.96 with the annealing memory; the band still reaches down to it)."""
        if step > self.last_step and not self.annealing_known:
            assert self.no_annealing is not None
            return (*self.no_annealing, 0.0)
        return self.L0, self.A, self.alpha, self.C

    def predict(self, step: float) -> float:
        """The loss after ``step`` optimizer steps of the planned schedule (from the last point
        on, shifted by ``offset``)."""
        return float(law(*self.params(step), *self._at(step, self.decay))) + self._shift(step)

    def sample_predictions(self, step: float) -> np.ndarray:
        out = np.full(len(self.samples), self._shift(step))
        for decay in np.unique(self.samples[:, 4]):
            rows = self.samples[:, 4] == decay
            s1, s2 = self._at(step, float(decay))
            out[rows] += law(*self.samples[rows, :4].T, s1, s2)
        return out

    def model_error(self, step: float) -> float:
        """The band's widening at ``step`` for the model's misfit (see ``backtests``)."""
        if step <= self.last_step:
            return 0.0
        return self.error_ahead(self._at(step, self.decay)[0])

    def error_ahead(self, s1: float) -> float:
        """The backtests' largest miss scaled to a forecast at forward area ``s1`` (of this
        plan, or of a longer run of the same recipe) from the last point's."""
        if not self.backtests:
            return 0.0
        ahead = max(0.0, s1 - self._at(self.last_step, self.decay)[0])
        return max(miss * (ahead / span) ** GROWTH for miss, span in self.backtests)

    def band(self, step: float, q: tuple[float, float] = (5.0, 95.0)) -> tuple[float, float]:
        """The ``q`` percentiles of the bootstrap fits' predictions after ``step`` steps,
        widened on both sides by :meth:`model_error` (never below 0: a cross-entropy)."""
        lo, hi = np.percentile(self.sample_predictions(step), q)
        extra = self.model_error(step)
        lo, hi = float(lo) - extra, float(hi) + extra
        if not self.annealing_known:
            areas = self._at(step, self.decay)
            for params in ((*self.no_annealing, 0.0), (self.L0, self.A, self.alpha, self.C)):
                value = law(*params, *areas) + self._shift(step)
                lo, hi = min(lo, value), max(hi, value)
        return max(0.0, lo), hi

    def annealing_seen(self) -> float:
        """Share of the planned annealing area (S2 at the end of the plan) seen so far
        (1 when the plan has none)."""
        s2 = self.areas[self.decay][1]
        return float(s2[self.last_step] / s2[-1]) if s2[-1] > 0 else 1.0

    def to_dict(self) -> dict[str, float | int | bool | str | None]:
        return {"model": "schedule", "L0": self.L0, "A": self.A, "alpha": self.alpha,
                "C": self.C, "decay": self.decay, "rmse": self.rmse, "n": self.n,
                "last_step": self.last_step, "backtests": self.backtests,
                "annealing_seen": self.annealing_seen(), "offset": self.offset,
                "degenerate": self.degenerate}  # fmt: skip


#: How a backtest's miss grows with the forward area extrapolated over (linearly: a missed
#: slope). The shortest holdout (one point) has the largest ratio, so it usually decides.
GROWTH = 1.0
#: Below this share of the planned annealing area seen, the band includes the no-annealing fit.
ANNEALING_SEEN = 0.25
#: Annealing memories tried; the one that fits best is kept (per bootstrap refit too).
DECAYS = (0.0, 0.9, 0.99, 0.999)


def _fit_decays(
    idx: np.ndarray, y: np.ndarray, areas: dict[float, tuple[np.ndarray, np.ndarray]]
) -> tuple[np.ndarray, float, float, float]:
    """((L0, A, C), alpha, decay, sse) of the best fit over the decays."""
    best = None
    for decay, (s1, s2) in areas.items():
        coef, alpha, sse = _fit(s1[idx], s2[idx], y)
        if best is None or sse < best[3] - 1e-15:
            best = (coef, alpha, decay, sse)
    assert best is not None
    return best


def fit_schedule_curve(
    steps: Sequence[float],
    losses: Sequence[float],
    schedule: Multipliers,
    total_steps: int,
    *,
    decays: Sequence[float] = DECAYS,
    bootstrap: int = 200,
    seed: int = 0,
) -> ScheduleFit:
    """Fit ``L(s)`` to (step, loss) points under ``schedule`` planned for ``total_steps``.

    Args:
        steps, losses: The curve so far (steps after which each loss was measured).
        schedule: LR multipliers per step (a callable or a sequence), for at least the steps
            fitted; it is evaluated up to ``total_steps`` for the forecast.
        total_steps: Steps the run is planned for (``trainer.max_steps``); the areas are
            computed that far.
        decays: Annealing memories to choose from (one value: fixed).

    Raises:
        ForecastError: usable points at fewer than :data:`MIN_POINTS` steps, or a schedule
            that never moved the weights (S1 = 0 at a point).
    """
    pts = sorted(
        (float(s), float(v))
        for s, v in zip(steps, losses, strict=True)
        if s is not None and v is not None and math.isfinite(s) and math.isfinite(v) and s >= 1
    )
    require_points([round(s) for s, _ in pts], "steps")
    last = round(pts[-1][0])
    total = max(int(total_steps), last)
    areas = AREAS.areas(schedule, total, decays)
    idx = np.array([round(s) for s, _ in pts])
    y = np.array([v for _, v in pts])
    if np.any(next(iter(areas.values()))[0][idx] <= 0):
        raise ForecastError("the LR schedule is zero at the start: no forward area to fit on")
    coef, alpha, decay, sse = _fit_decays(idx, y, areas)
    s1, s2 = areas[decay]
    fitted = law(coef[0], coef[1], alpha, coef[2], s1[idx], s2[idx])
    resid = y - fitted
    rng = np.random.default_rng(seed)
    samples = np.empty((bootstrap, 5))
    for k in range(bootstrap):
        yb = fitted + rng.choice(resid, size=len(resid), replace=True)
        cb, ab, db, _ = _fit_decays(idx, yb, areas)
        samples[k] = (cb[0], cb[1], ab, cb[2], db)
    no_annealing = None
    if coef[2] > 0:
        c0, a0, _ = _fit(s1[idx], np.zeros(len(idx)), y)
        no_annealing = (float(c0[0]), float(c0[1]), a0)
    return ScheduleFit(
        float(coef[0]), float(coef[1]), alpha, float(coef[2]), decay,
        math.sqrt(sse / len(y)), len(y), last, samples, _backtest(idx, y, areas), no_annealing,
        float(np.mean(resid[-2:])), areas,
    )  # fmt: skip


def _backtest(
    idx: np.ndarray, y: np.ndarray, areas: dict[float, tuple[np.ndarray, np.ndarray]]
) -> list[tuple[float, float]]:
    """Fit on the points but the last one, but the last third, and but the last half (at least
    :data:`MIN_POINTS` steps kept), and predict the held-out ones: per holdout, the largest miss and
    the forward area from the last kept point to the last held-out one. Empty when no point can
    be held out."""
    n, out = len(y), []
    for held in sorted({1, max(1, n // 3), max(1, n // 2)}):
        keep = n - held
        if len(set(idx[:keep].tolist())) < MIN_POINTS:  # a group's seeds share their steps
            continue
        coef, alpha, decay, _ = _fit_decays(idx[:keep], y[:keep], areas)
        s1, s2 = areas[decay]
        pred = law(coef[0], coef[1], alpha, coef[2], s1[idx[keep:]], s2[idx[keep:]])
        span = float(s1[idx[-1]] - s1[idx[keep - 1]])
        if span > 0:
            out.append((float(np.max(np.abs(pred - y[keep:]))), span))
    return out
