"""How loss scales with model size and data: ``L(N, D) = E + A / N^alpha + B / D^beta``.

Fitted over finished runs of several model sizes (each run one point: its parameters N, the
tokens it trained on D, its final validation loss L), then asked which size and token count a
compute budget should buy. Why each choice:

* **One point per finished run.** A run's intermediate losses are not those of a shorter run: a
  decaying learning rate has not annealed there. So only the final loss of a run that completed
  its schedule is a sample of L(N, D).
* **N = the run's parameters as its ``start`` record logs them** (``num_params``: every unique
  parameter, a tied embedding/head counted once, embeddings included), the count the compute
  estimate ``6 N D`` uses too.
* **Fitted in log space with a Huber loss** (``delta`` = 1e-3) on ``log L`` against
  ``logsumexp(a - alpha log N, b - beta log D, e)``, ``A = e^a, B = e^b, E = e^e``: relative errors,
  outliers down-weighted. ``scipy.optimize.least_squares`` (``loss="huber"``, ``f_scale=delta``)
  from a few starting points, the lowest end kept. The starts come from a profile: for fixed
  exponents the law is linear in (E, A, B), so each (alpha, beta) of a grid gets its best
  E, A, B >= 0 (``scipy.optimize.nnls`` on relative errors) and the best pairs are polished;
  the best end is polished once more with the floor at 0 (from an E > 0 least_squares can stop
  on a floor the runs do not show).
* **Errors**: a bootstrap over runs (refits on runs drawn with replacement, each from the
  full fit's optimum: 5-95% of each parameter and of the optimum) and a leave-one-out check
  (each run predicted by the fit without it).
* **Compute-optimal size** for a budget ``C`` FLOPs (``C = 6 N D``):
  ``N* = G (C/6)^(beta/(alpha+beta))``, ``D* = (C/6) / N*``, ``G = (alpha A / (beta B))^(1/(alpha+beta))``.
  GPU-hours become FLOPs at the runs' own measured rate (``6 N D`` per GPU-hour logged, the
  median over runs): small runs use a GPU less well than large ones, so this is conservative
  for a larger model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from nanolab.errors import NanolabError
from nanolab.tables import table

#: Fewest distinct model sizes (and token counts) the fit is attempted with.
MIN_SIZES = 3
#: Fewest runs: more points than the five parameters.
MIN_RUNS = 6
HUBER_DELTA = 1e-3
#: A fitted floor E below this is reported as 0 (log E ran off to -inf: no floor in the runs).
FLOOR_ZERO = 1e-6
PARAMS = ("E", "A", "alpha", "B", "beta")


class ScalingError(NanolabError):
    """Too few or unusable runs for a scaling fit (the message says what is needed)."""


@dataclass
class ScalingPoint:
    """One finished run: parameters, tokens trained (D: the model's, a branch's parent's
    included), final val loss, device-hours spent and the tokens they were spent on
    (``run_tokens``: a branch's own; None: not known), and the device: ``accelerator`` as its
    start record names it, CPUAccelerator or CUDAAccelerator, None where unknown."""

    run: str
    n: float
    d: float
    loss: float
    gpu_hours: float | None = None
    accelerator: str | None = None
    run_tokens: float | None = None


@dataclass
class ScalingLaw:
    """``L = E + A / N^alpha + B / D^beta`` and how well it was fitted.

    Attributes:
        objective: Sum of Huber losses of ``log L`` at the optimum.
        loo_rmse: Leave-one-out RMSE of the predicted final loss (None until computed).
        band: 5-95% bootstrap range per parameter name (empty until computed).
    """

    E: float
    A: float
    alpha: float
    B: float
    beta: float
    objective: float
    loo_rmse: float | None = None
    loo_max: float | None = None
    loo_left_out: int = 0  # leave-one-out refits that ran off (not in loo_rmse / loo_max)
    band: dict[str, tuple[float, float]] = field(default_factory=dict)

    def predict(self, n: float | np.ndarray, d: float | np.ndarray) -> float | np.ndarray:
        return self.E + self.A / np.power(n, self.alpha) + self.B / np.power(d, self.beta)

    def optimum(self, flops: float) -> tuple[float, float, float]:
        """(N*, D*, L*) minimising L under ``6 N D = flops``."""
        return _optimum(self.E, self.A, self.alpha, self.B, self.beta, flops)

    def to_dict(self) -> dict:
        return asdict(self)


def _optimum(E: float, A: float, alpha: float, B: float, beta: float, flops: float):
    if alpha <= 0 or beta <= 0 or A <= 0 or B <= 0:
        return math.nan, math.nan, math.nan
    try:
        g = (alpha * A / (beta * B)) ** (1.0 / (alpha + beta))
        n = g * (flops / 6.0) ** (beta / (alpha + beta))
        d = flops / 6.0 / n
        return n, d, E + A / n**alpha + B / d**beta
    except (OverflowError, ZeroDivisionError):  # a law at the edge of float range: no optimum
        return math.nan, math.nan, math.nan


#: Exponents tried for (alpha, beta) when choosing starting points (each pair: the best
#: non-negative E, A, B for them), and how many of the best pairs the fit is polished from.
PROFILE_GRID = np.geomspace(0.02, 3.0, 25)
PROFILE_STARTS = 4
#: An exponent above this is a degenerate fit, not a scaling law (measured ones are 0.1-1; the
#: profile's starts go to 3): a loss term that falls as N^-50 is flat over any two sizes.
MAX_EXPONENT = 5.0
#: ``log`` of a coefficient the profile put at 0 (e^-50: the term is gone, yet finite).
LOG_ZERO = -50.0
#: least_squares' ftol, xtol and gtol: tight, so a noiseless law comes back to 1e-12 or better.
TOL = 1e-12


class _LogLaw:
    """Residuals ``logsumexp(a - alpha ln, b - beta ld, e) - ll`` of ``p = [a, b, e, alpha, beta]``
    and their Jacobian, for least_squares (the last point's values kept: it asks for both)."""

    def __init__(self, ln: np.ndarray, ld: np.ndarray, ll: np.ndarray) -> None:
        self.ln, self.ld, self.ll = ln, ld, ll
        self._p: np.ndarray | None = None

    def _at(self, p: np.ndarray) -> None:
        if self._p is not None and np.array_equal(p, self._p):
            return
        a, b, e, alpha, beta = p
        u = np.stack([a - alpha * self.ln, b - beta * self.ld, np.full_like(self.ln, e)])
        top = u.max(axis=0)
        ex = np.exp(u - top)
        total = ex.sum(axis=0)
        self._r = top + np.log(total) - self.ll
        self._w = ex / total  # d logsumexp / d (each term)
        self._p = np.array(p, dtype=float)

    def residuals(self, p: np.ndarray) -> np.ndarray:
        self._at(p)
        return self._r

    def jacobian(self, p: np.ndarray) -> np.ndarray:
        self._at(p)
        w = self._w
        return np.column_stack([w[0], w[1], w[2], -w[0] * self.ln, -w[1] * self.ld])


def _log(v: float) -> float:
    return math.log(v) if v > 0 else LOG_ZERO


def _huber(r: np.ndarray, delta: float) -> float:
    """Sum of Huber losses (what least_squares' ``loss="huber", f_scale=delta`` minimises)."""
    a = np.abs(r)
    return float(np.where(a <= delta, 0.5 * r**2, delta * (a - 0.5 * delta)).sum())


def _polish(law: _LogLaw, p0: np.ndarray, delta: float) -> tuple[np.ndarray, float]:
    """least_squares from ``p0``: the end and its Huber objective."""
    from scipy.optimize import least_squares

    fit = least_squares(law.residuals, p0, jac=law.jacobian, loss="huber", f_scale=delta,
                        method="trf", ftol=TOL, xtol=TOL, gtol=TOL)  # fmt: skip
    return fit.x, _huber(fit.fun, delta)


def _profile_starts(ln: np.ndarray, ld: np.ndarray, ll: np.ndarray, k: int) -> np.ndarray:
    """Starting points ``[a, b, e, alpha, beta]``: for each (alpha, beta) of the grid the law is
    linear in (E, A, B), solved with E, A, B >= 0 on relative errors (scipy.optimize.nnls; a
    relative error is the log residual to first order); the ``k`` pairs that fit best."""
    from scipy.optimize import nnls

    loss = np.exp(ll)
    found = []
    for alpha in PROFILE_GRID:
        x = np.exp(-alpha * ln)
        for beta in PROFILE_GRID:
            cols = np.column_stack([np.ones_like(x), x, np.exp(-beta * ld)]) / loss[:, None]
            (E, A, B), rnorm = nnls(cols, np.ones_like(x))
            found.append((rnorm, alpha, beta, E, A, B))
    found.sort(key=lambda row: row[0])

    return np.array([[_log(A), _log(B), _log(E), alpha, beta]
                     for _, alpha, beta, E, A, B in found[:k]])  # fmt: skip


def _best_fit(
    law: _LogLaw, starts: np.ndarray, delta: float, floor_zero: bool = True
) -> tuple[np.ndarray, float]:
    """The lowest end of least_squares from every start, then (``floor_zero``) from that end
    with the floor at 0 (E = e^-50), kept if no higher: from an E > 0 least_squares can stop
    on a floor the runs do not show (a local optimum, or a slow approach to 0)."""
    best, objective = None, math.inf
    for p0 in starts:
        p, obj = _polish(law, p0, delta)
        if obj < objective:
            best, objective = p, obj
    assert best is not None
    if floor_zero and best[2] > LOG_ZERO:
        p, obj = _polish(law, np.array([*best[:2], LOG_ZERO, *best[3:]]), delta)
        if obj <= objective:
            best, objective = p, obj
    return best, objective


def _law(p: np.ndarray, objective: float) -> ScalingLaw:
    """The law of log-space parameters ``p``; a coefficient past float range is ``inf`` (a fit
    that ran off to a degenerate exponent, see :func:`_ran_off`)."""
    a, b, e, alpha, beta = (float(v) for v in p)
    with np.errstate(over="ignore"):
        E, A, B = (float(np.exp(v)) for v in (e, a, b))
    return ScalingLaw(E, A, alpha, B, beta, objective)


def _ran_off(law: ScalingLaw) -> bool:
    """Whether the fit ran off to a degenerate law: an exponent above :data:`MAX_EXPONENT` or a
    coefficient past float range (A = e^800 with alpha = 50, say), a law that exists only in
    log space, where the runs cannot tell it from a flatter one."""
    finite = all(math.isfinite(v) for v in (law.E, law.A, law.B))
    return not finite or max(law.alpha, law.beta) > MAX_EXPONENT


def fit_scaling_law(
    n: Sequence[float],
    d: Sequence[float],
    loss: Sequence[float],
    *,
    delta: float = HUBER_DELTA,
    starts: np.ndarray | None = None,
) -> ScalingLaw:
    """The best of the Huber fits in log space (see the module); ``starts``: rows
    ``[log A, log B, log E, alpha, beta]`` to start from instead of the profile's."""
    ln, ld = np.log(np.asarray(n, float)), np.log(np.asarray(d, float))
    ll = np.log(np.asarray(loss, float))
    p0 = _profile_starts(ln, ld, ll, PROFILE_STARTS) if starts is None else np.atleast_2d(starts)
    law = _law(*_best_fit(_LogLaw(ln, ld, ll), p0, delta))
    if _ran_off(law):
        raise ScalingError(
            f"the fit ran off to a degenerate law (alpha {law.alpha:.3g}, beta {law.beta:.3g}; "
            f"a scaling exponent is at most {MAX_EXPONENT:g}): these runs do not determine it; "
            "add runs that vary model size and tokens further apart"
        )
    return law


def check_points(points: list[ScalingPoint]) -> None:
    """Refuse a fit the runs cannot determine (raises ScalingError with what is missing)."""
    sizes = sorted({round(p.n) for p in points})
    tokens = sorted({round(p.d) for p in points})
    if len(sizes) < MIN_SIZES:
        raise ScalingError(
            f"{len(sizes)} distinct model size(s) among {len(points)} finished run(s); a scaling "
            f"fit needs runs of at least {MIN_SIZES} sizes (vary model.gpt.n_layer / n_embd)"
        )
    if len(tokens) < MIN_SIZES:
        raise ScalingError(
            f"{len(tokens)} distinct token count(s) among the finished runs; the data term needs "
            f"at least {MIN_SIZES} (vary trainer.max_steps)"
        )
    if len(points) < MIN_RUNS:
        raise ScalingError(
            f"{len(points)} finished run(s); the five-parameter fit needs at least {MIN_RUNS}"
        )


def fit_with_errors(
    points: list[ScalingPoint], *, bootstrap: int = 100, seed: int = 0
) -> tuple[ScalingLaw, np.ndarray]:
    """The fit, its leave-one-out error and a bootstrap over runs.

    Returns the law (``loo_*`` and ``band`` filled in) and the bootstrap parameter rows
    ``(E, A, alpha, B, beta)`` for bands on anything derived from them.
    """
    check_points(points)
    n = np.array([p.n for p in points])
    d = np.array([p.d for p in points])
    y = np.array([p.loss for p in points])
    law = fit_scaling_law(n, d, y)
    # Leave-one-out and bootstrap refits, each from the full fit's optimum: a refit on nearly
    # the same runs ends near it.
    at = np.array([[_log(law.A), _log(law.B), _log(law.E), law.alpha, law.beta]])
    rng = np.random.default_rng(seed)
    loo = [np.delete(np.arange(len(points)), i) for i in range(len(points))]
    boots = []
    while len(boots) < bootstrap:
        pick = rng.integers(0, len(points), len(points))
        if len({round(v) for v in n[pick]}) >= 2 and len({round(v) for v in d[pick]}) >= 2:
            boots.append(pick)
    refits = [
        _law(*_best_fit(_LogLaw(np.log(n[i]), np.log(d[i]), np.log(y[i])), at, HUBER_DELTA, False))
        for i in loo + boots
    ]
    # E, A, alpha, B, beta per refit; a refit that ran off is left out (its row is NaN)
    params = np.array([[np.nan] * 5 if _ran_off(r) else [r.E, r.A, r.alpha, r.B, r.beta]
                       for r in refits])  # fmt: skip
    kept = np.all(np.isfinite(params[: len(points)]), axis=1)
    E, A, al, B, be = params[: len(points)][kept].T
    errs = E + A / n[kept] ** al + B / d[kept] ** be - y[kept]
    law.loo_left_out = int((~kept).sum())
    if len(errs):  # else every leave-one-out refit ran off: no error to give
        law.loo_rmse = float(np.sqrt(np.mean(np.square(errs))))
        law.loo_max = float(np.max(np.abs(errs)))
    samples = params[len(points) :]
    samples = samples[np.all(np.isfinite(samples), axis=1)]
    if len(samples):
        bands = np.percentile(samples, (5.0, 95.0), axis=0).T
        law.band = {k: (float(lo), float(hi)) for k, (lo, hi) in zip(PARAMS, bands, strict=True)}
    return law, samples


def optimum_band(samples: np.ndarray, flops: float) -> dict[str, tuple[float, float]]:
    """5-95% of (N*, D*, L*) over bootstrap parameter rows."""
    opts = np.array([_optimum(*row, flops) for row in samples]).reshape(-1, 3)
    opts = opts[np.all(np.isfinite(opts), axis=1)]
    if not len(opts):
        return {}
    bands = np.percentile(opts, (5.0, 95.0), axis=0).T
    return {
        name: (float(lo), float(hi))
        for name, (lo, hi) in zip(("n", "d", "loss"), bands, strict=True)
    }


def flops_per_gpu_hour(points: list[ScalingPoint]) -> float | None:
    """Median ``6 N D / device-hours`` over runs that logged their hours: the rate this
    hardware delivered on these runs (per CPU-hour where they ran on CPUs). D is the tokens
    those hours trained (``run_tokens``): a branch's hours over its parent's tokens too read a
    sweep of cooldowns as many times faster."""
    rates = [
        6.0 * p.n * p.run_tokens / p.gpu_hours
        for p in points
        if p.gpu_hours and p.gpu_hours > 0 and p.run_tokens
    ]
    return float(np.median(rates)) if rates else None


# -- runs -> points, and the report's text ---------------------------------------------------
def points_from_runs(
    found: list[tuple[str, object]],
) -> tuple[list[ScalingPoint], list[tuple[str, str]]]:
    """One point per run that completed its schedule with a final val loss and a logged
    parameter count; the others as ``(run, why it was left out)``."""
    from nanolab.runs import summarize_run, tail_records

    points, left_out = [], []
    for name, run_dir in found:
        s = summarize_run(name, run_dir)
        if s.status != "completed":
            left_out.append((name, s.status))
            continue
        starts = tail_records(run_dir, "start")
        n = starts[-1].get("num_params") if starts else None
        if not isinstance(n, (int, float)) or isinstance(n, bool) or n <= 0:
            left_out.append((name, "no num_params in its start record"))
            continue
        if not s.final_val_loss or not s.tokens:
            left_out.append((name, "no final val loss or tokens"))
            continue
        own = float(s.run_tokens) if s.run_tokens else None
        points.append(
            ScalingPoint(
                name, float(n), float(s.tokens), s.final_val_loss, s.gpu_hours, s.accelerator, own
            )
        )
    return points, left_out


def _g(v: float) -> str:
    """A parameter for the table: 4 significant digits, and 0 for a floor fitted to nothing."""
    return "0" if 0 <= v < FLOOR_ZERO else f"{v:.4g}"


def _si(v: float) -> str:
    from nanolab.runs import si

    return si(v, billion="B")


def scaling_report(
    points: list[ScalingPoint], gpu_hours: float | None, *, bootstrap: int = 100
) -> tuple[str, dict]:
    """The fit over ``points`` as text and as JSON-ready data (raises ScalingError)."""
    law, samples = fit_with_errors(points, bootstrap=bootstrap)
    sizes = len({round(p.n) for p in points})
    out = [
        "",
        f"scaling: L(N, D) = E + A/N^alpha + B/D^beta over {len(points)} finished runs of "
        f"{sizes} sizes (N: parameters incl. embeddings, D: tokens trained, L: final val loss); "
        f"Huber fit of log L, "
        + (
            f"[5%, 95%] over {len(samples)} bootstrap resamples of the runs"
            if len(samples)
            else "no band: every bootstrap refit ran off to a degenerate law"
        ),
    ]
    rows = []
    for name in PARAMS:
        lo, hi = law.band.get(name, (math.nan, math.nan))
        rows.append([name, f"= {_g(getattr(law, name))}", f"[{_g(lo)}, {_g(hi)}]"])
    out += ["  " + line for line in table(rows, rule=False)]
    if law.E < FLOOR_ZERO:
        out.append("  note: the fit took the floor E to 0: these runs do not pin an irreducible "
                   "loss (too few sizes or tokens in the power-law regime); the optimum is a guess")  # fmt: skip
    left_out = f" ({law.loo_left_out} refits that ran off left out)" if law.loo_left_out else ""
    if law.loo_rmse is None:
        out.append("  leave-one-out error of the final loss: none, every refit without one run "
                   "ran off to a degenerate law (the fit hangs on single runs)")  # fmt: skip
    else:
        out.append(f"  leave-one-out error of the final loss: rmse {law.loo_rmse:.4f}, max "
                   f"{law.loo_max:.4f}{left_out}")  # fmt: skip
    data: dict = {"law": law.to_dict(), "runs": [asdict(p) for p in points]}
    if gpu_hours is not None:
        rate = flops_per_gpu_hour(points)
        if rate is None:
            raise ScalingError(
                "--gpu-hours: none of these runs logged gpu_hours and the tokens they were spent "
                "on (a branch's log from before run_tokens was logged does not say which tokens "
                "were its own), so GPU-hours cannot be turned into FLOPs; leave --gpu-hours out"
            )
        flops = gpu_hours * rate
        n, d, loss = law.optimum(flops)
        band = optimum_band(samples, flops)
        from nanolab.runs import hours_label

        # The hours are the runs' own devices': on CPUs the budget is CPU-hours at a CPU's rate.
        unit = hours_label([p.accelerator for p in points if p.gpu_hours and p.gpu_hours > 0])
        out.append(
            f"  {gpu_hours:g} {unit} = {flops:.3g} FLOPs (6*N*D at {rate:.3g} per {unit}: the "
            "median rate these runs logged; larger models usually run faster per FLOP)"
        )
        if not math.isfinite(n):
            out.append("  no compute-optimal size: a fitted exponent or coefficient is <= 0")
        else:
            bn, bd, bl = (band.get(k, (math.nan, math.nan)) for k in ("n", "d", "loss"))
            out.append(
                f"  compute-optimal: N = {_si(n)} [{_si(bn[0])}, {_si(bn[1])}] parameters, "
                f"D = {_si(d)} [{_si(bd[0])}, {_si(bd[1])}] tokens ({d / n:.3g} tokens per "
                f"parameter), loss {loss:.4f} [{bl[0]:.4f}, {bl[1]:.4f}]"
            )
        data["budget"] = {"gpu_hours": gpu_hours, "hours": unit, "flops_per_gpu_hour": rate,
                          "flops": flops, "n": n, "d": d, "loss": loss, "band": band}  # fmt: skip
    return "\n".join(out), data
