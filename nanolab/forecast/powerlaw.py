"""A saturating power law in tokens fitted to a validation curve (the forecast of a run whose LR
schedule is unknown; :mod:`nanolab.forecast.annealing` is used when it is known).

    L(D) = E + A * (D / D0) ** -alpha        D: tokens trained, D0: the first point's tokens

``E`` is the loss the run would approach with endless data at this model size, ``A`` and
``alpha`` how fast it gets there. Fitted by least squares: for a fixed ``alpha`` the model is
linear in ``(E, A)``, so ``alpha`` is searched on a log grid, then refined between the best grid
point's neighbours by ``scipy.optimize.minimize_scalar`` (bounded), and ``(E, A)`` solved exactly
(with ``A, E >= 0``) at each, which never diverges the way a joint Newton fit can on a short,
noisy curve.

The uncertainty is a residual bootstrap: the fitted curve plus resampled residuals, refitted
``bootstrap`` times; predictions are reported as the median and the 5-95% range of those fits.
It describes the noise of the points, not a wrong model: a learning-rate schedule that decays
late (cosine) bends the curve down where a power law does not, so the band can be too narrow
at long range. ``benches/forecast_check.py`` measures the real error on finished runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nanolab.errors import NanolabError

#: Fewest points a fit is attempted with (three parameters, and some left to judge them).
MIN_POINTS = 5
#: Range of exponents searched (token exponents of LM losses are ~0.05-0.5).
ALPHA_RANGE = (0.005, 3.0)
#: How closely log(alpha) is refined between the grid's neighbours of the best grid point.
XATOL = 1e-8


class ForecastError(NanolabError):
    """A curve that cannot be fitted (too few points, non-finite values, no tokens)."""


@dataclass
class CurveFit:
    """A fitted ``L(D) = E + A (D/D0)^-alpha`` with bootstrap parameter samples.

    Attributes:
        E, A, alpha, d0: The parameters (``d0`` in tokens).
        rmse: Root-mean-square residual of the fit.
        n: Points fitted.
        samples: Bootstrap refits, one ``(E, A, alpha)`` row each.

    ``degenerate``: ``alpha`` ended at the edge of its search range or the floor ``E`` at
    zero, i.e. the points show no saturation yet (a straight descent, or a plateau before a
    second drop): the curve's form is not a power law there and the forecast is not to be
    trusted.
    """

    E: float
    A: float
    alpha: float
    d0: float
    rmse: float
    n: int
    samples: np.ndarray

    @property
    def degenerate(self) -> bool:
        inside = ALPHA_RANGE[0] * 1.05 < self.alpha < ALPHA_RANGE[1] * 0.95
        return not inside or self.E <= 0.0

    def predict(self, tokens: float) -> float:
        return float(self.E + self.A * (tokens / self.d0) ** -self.alpha)

    def band(self, tokens: float, q: tuple[float, float] = (5.0, 95.0)) -> tuple[float, float]:
        """The ``q`` percentiles of the bootstrap fits' predictions at ``tokens``."""
        e, a, al = self.samples.T
        lo, hi = np.percentile(e + a * (tokens / self.d0) ** -al, q)
        return float(lo), float(hi)

    def tokens_to(self, target: float) -> float:
        """Tokens at which the fitted curve reaches ``target`` (inf: never, it is <= E)."""
        return _tokens_to(self.E, self.A, self.alpha, self.d0, target)

    def tokens_to_band(
        self, target: float, q: tuple[float, float] = (5.0, 95.0)
    ) -> tuple[float, float]:
        values = [_tokens_to(e, a, al, self.d0, target) for e, a, al in self.samples]
        lo, hi = np.percentile(np.array(values), q, method="nearest")  # inf: never; no inf - inf
        return float(lo), float(hi)

    def to_dict(self) -> dict[str, float | int]:
        return {"E": self.E, "A": self.A, "alpha": self.alpha, "d0": self.d0,
                "rmse": self.rmse, "n": self.n, "degenerate": self.degenerate}  # fmt: skip


def _tokens_to(E: float, A: float, alpha: float, d0: float, target: float) -> float:
    if target <= E or A <= 0 or alpha <= 0:
        return math.inf
    return float(d0 * (A / (target - E)) ** (1.0 / alpha))


def _solve(x: np.ndarray, y: np.ndarray, alpha: float) -> tuple[float, float, float]:
    """(E, A, sum of squared residuals) for a fixed ``alpha``, with ``A >= 0`` and ``E >= 0``
    (a cross-entropy cannot go below zero)."""
    f = x[None, :] ** -alpha
    (E,), (A,) = _linear(f, y)
    return float(E), float(A), float(((E + A * f[0] - y) ** 2).sum())


def _linear(f: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares ``(E, A)`` of ``y ~ E + A f`` for each row of ``f``, with ``A, E >= 0``.

    With two unknowns the non-negative solution is a closed form (the unconstrained one, else
    A = 0 or E = 0), so every alpha of the grid is solved in one NumPy pass; scipy.optimize.nnls
    solves one problem per call and made ``fit_loss_curve`` 2.5x slower with the same result.
    """
    fm = f.mean(axis=1, keepdims=True)
    fc = f - fm
    A = np.maximum((fc * (y - y.mean())).sum(axis=1) / np.maximum((fc**2).sum(axis=1), 1e-300), 0)
    E = y.mean() - A * fm[:, 0]
    neg = E < 0  # the floor at zero: then y ~ A f through the origin
    if neg.any():
        A[neg] = np.maximum(
            (f[neg] * y).sum(axis=1) / np.maximum((f[neg] ** 2).sum(axis=1), 1e-300), 0
        )
        E[neg] = 0.0
    return E, A


def _fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float, float]:
    """(E, A, alpha, sse) minimising the squared error; ``x`` is tokens / d0."""
    grid = np.geomspace(*ALPHA_RANGE, 80)
    f = x[None, :] ** -grid[:, None]  # one row per alpha
    E, A = _linear(f, y)
    sses = ((E[:, None] + A[:, None] * f - y[None, :]) ** 2).sum(axis=1)
    i = int(np.argmin(sses))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    # Refined on log(alpha) between the grid neighbours (Brent's method, bounded).
    from scipy.optimize import minimize_scalar

    best = minimize_scalar(
        lambda log_alpha: _solve(x, y, math.exp(log_alpha))[2],
        bounds=(math.log(lo), math.log(hi)),
        method="bounded",
        options={"xatol": XATOL},
    )
    alpha = math.exp(best.x)
    E, A, sse = _solve(x, y, alpha)
    return E, A, alpha, sse


def require_points(xs: Sequence[float], unit: str) -> None:
    """Raise :class:`ForecastError` unless the points lie at :data:`MIN_POINTS` distinct ``xs``
    (steps or tokens): a seed group pools its seeds' points, which share their steps, and two
    repeats of 3 validations are 3 places on the curve, not 6 (their fit came out exact)."""
    distinct = len(set(xs))
    if distinct < MIN_POINTS:
        at = f" at {distinct} distinct {unit}" if distinct != len(xs) else ""
        raise ForecastError(
            f"{len(xs)} usable validation point(s){at}; a forecast needs at least {MIN_POINTS}"
            + (f" {unit}" if at else "")
        )


def fit_loss_curve(
    tokens: Sequence[float],
    losses: Sequence[float],
    *,
    bootstrap: int = 200,
    seed: int = 0,
) -> CurveFit:
    """Fit ``L(D) = E + A (D/D0)^-alpha`` to (tokens, loss) points; see the module docstring.

    Raises:
        ForecastError: usable points (finite, tokens > 0) at fewer than :data:`MIN_POINTS`
            token counts.
    """
    pts = sorted(
        (float(d), float(v))
        for d, v in zip(tokens, losses, strict=True)
        if d is not None and v is not None and math.isfinite(d) and math.isfinite(v) and d > 0
    )
    require_points([x for x, _ in pts], "token counts")
    d, y = (np.array(column) for column in zip(*pts, strict=True))
    d0 = float(d[0])
    x = d / d0
    E, A, alpha, sse = _fit(x, y)
    fitted = E + A * x**-alpha
    resid = y - fitted
    rng = np.random.default_rng(seed)
    samples = np.empty((bootstrap, 3))
    for k in range(bootstrap):
        yb = fitted + rng.choice(resid, size=len(resid), replace=True)
        eb, ab, alb, _ = _fit(x, yb)
        samples[k] = (eb, ab, alb)
    return CurveFit(E, A, alpha, d0, math.sqrt(sse / len(y)), len(y), samples)
