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
  outliers down-weighted. Levenberg-Marquardt (iteratively reweighted for the Huber loss) from a
  grid of starting points, all at once in NumPy, the best end kept; no optimiser dependency.
* **Errors**: a bootstrap over runs (refits on runs drawn with replacement: 5-95% of each
  parameter and of the optimum) and a leave-one-out check (each run predicted by the fit
  without it).
* **Compute-optimal size** for a budget ``C`` FLOPs (``C = 6 N D``):
  ``N* = G (C/6)^(beta/(alpha+beta))``, ``D* = (C/6) / N*``, ``G = (alpha A / (beta B))^(1/(alpha+beta))``.
  GPU-hours become FLOPs at the runs' own measured rate (``6 N D`` per GPU-hour logged, the
  median over runs): small runs use a GPU less well than large ones, so this is conservative
  for a larger model.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from nanolab.errors import NanolabError

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
    """One finished run: parameters, tokens trained, final val loss, GPU-hours spent."""

    run: str
    n: float
    d: float
    loss: float
    gpu_hours: float | None = None


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
    g = (alpha * A / (beta * B)) ** (1.0 / (alpha + beta))
    n = g * (flops / 6.0) ** (beta / (alpha + beta))
    d = flops / 6.0 / n
    return n, d, E + A / n**alpha + B / d**beta


def _objective_parts(p: np.ndarray, ln: np.ndarray, ld: np.ndarray, ll: np.ndarray, delta: float,
                     wt: np.ndarray | float = 1.0):  # fmt: skip
    """Residuals (K, n), Jacobian (K, n, 5) and Huber objective (K,) for parameter rows
    ``p = [a, b, e, alpha, beta]``; the data are (n,) or one row per parameter row (K, n), and
    ``wt`` weighs each point (0 leaves it out)."""
    ln, ld, ll = (np.broadcast_to(v, (len(p), v.shape[-1])) for v in (ln, ld, ll))
    u = np.stack(
        [
            p[:, 0:1] - p[:, 3:4] * ln,
            p[:, 1:2] - p[:, 4:5] * ld,
            np.broadcast_to(p[:, 2:3], ln.shape),
        ],
        axis=2,
    )  # (K, n, 3)
    m = u.max(axis=2, keepdims=True)
    ex = np.exp(u - m)
    tot = ex.sum(axis=2, keepdims=True)
    lse = (m + np.log(tot))[..., 0]
    w = ex / tot
    r = lse - ll
    jac = np.stack([w[..., 0], w[..., 1], w[..., 2], -w[..., 0] * ln, -w[..., 1] * ld], axis=2)
    a = np.abs(r)
    huber = (wt * np.where(a <= delta, 0.5 * r**2, delta * (a - 0.5 * delta))).sum(axis=1)
    return r, jac, huber


def _lm(p0: np.ndarray, ln, ld, ll, delta: float, wt: np.ndarray | float = 1.0,
        iters: int = 300) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Levenberg-Marquardt with Huber IRLS weights, for every starting row at once."""
    p = p0.astype(float).copy()
    mu = np.full(len(p), 1e-3)
    r, jac, obj = _objective_parts(p, ln, ld, ll, delta, wt)
    eye = np.eye(5)[None]
    for _ in range(iters):
        wgt = wt * np.where(np.abs(r) <= delta, 1.0, delta / np.maximum(np.abs(r), 1e-300))
        jw = jac * wgt[..., None]
        h = np.einsum("kni,knj->kij", jw, jac)
        g = np.einsum("kni,kn->ki", jw, r)
        diag = np.einsum("kii->ki", h)
        lhs = h + mu[:, None, None] * (eye * np.maximum(diag, 1e-12)[:, :, None])
        step = np.linalg.solve(lhs + 1e-300 * eye, -g[..., None])[..., 0]
        step = np.where(np.isfinite(step), step, 0.0)
        cand = p + step
        rc, jc, oc = _objective_parts(cand, ln, ld, ll, delta, wt)
        ok = np.isfinite(oc) & (oc < obj)
        p[ok], r[ok], jac[ok], obj[ok] = cand[ok], rc[ok], jc[ok], oc[ok]
        mu = np.clip(np.where(ok, mu / 3.0, mu * 4.0), 1e-12, 1e12)
        if np.all(mu >= 1e6):  # every row has failed to improve ~15 times in a row: converged
            break
    return p, obj


def _starts() -> np.ndarray:
    """A grid of starting points ``[a, b, e, alpha, beta]`` (432 rows)."""
    alphas = betas = (0.2, 0.5, 1.0)
    es = (-1.0, 0.0, 1.0)
    ab = (0.0, 5.0, 10.0, 20.0)
    return np.array(list(itertools.product(ab, ab, es, alphas, betas)), dtype=float)


def _near(law: ScalingLaw) -> np.ndarray:
    """Starts for refits on nearly the same runs: the full fit's optimum and four moves away."""
    at = np.array([math.log(law.A), math.log(law.B), math.log(law.E), law.alpha, law.beta])
    moves = np.array([[0, 0, 0, 0, 0], [2, 0, 0, 0.15, 0], [0, 2, 0, 0, 0.15],
                      [-2, -2, 0, -0.1, -0.1], [0, 0, -0.7, 0, 0]])  # fmt: skip
    return at[None, :] + moves


def fit_scaling_law(
    n: Sequence[float],
    d: Sequence[float],
    loss: Sequence[float],
    *,
    delta: float = HUBER_DELTA,
    starts: np.ndarray | None = None,
) -> ScalingLaw:
    """The best of the Huber fits in log space from every starting point (see the module)."""
    ln, ld = np.log(np.asarray(n, float)), np.log(np.asarray(d, float))
    ll = np.log(np.asarray(loss, float))
    p0 = _starts() if starts is None else starts
    p, obj = _lm(p0, ln, ld, ll, delta)
    obj = np.where(np.isfinite(obj), obj, np.inf)
    best = p[int(np.argmin(obj))]
    a, b, e, alpha, beta = (float(v) for v in best)
    return ScalingLaw(math.exp(e), math.exp(a), alpha, math.exp(b), beta, float(obj.min()))


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
    local = _near(law)
    # Leave-one-out and bootstrap refits, all in one batched fit from the local starts: each
    # refit is a row of indices into the runs (a bootstrap draw) or of weights (0: left out).
    rng = np.random.default_rng(seed)
    loo = [np.arange(len(points))] * len(points)
    boots = []
    while len(boots) < bootstrap:
        pick = rng.integers(0, len(points), len(points))
        if len({round(v) for v in n[pick]}) >= 2 and len({round(v) for v in d[pick]}) >= 2:
            boots.append(pick)
    index = np.array(loo + boots)
    weights = np.ones(index.shape)
    weights[np.arange(len(points)), np.arange(len(points))] = 0.0
    k = len(local)
    rows = np.repeat(index, k, axis=0)
    p, obj = _lm(np.tile(local, (len(index), 1)), np.log(n)[rows], np.log(d)[rows],
                 np.log(y)[rows], HUBER_DELTA, np.repeat(weights, k, axis=0), iters=100)  # fmt: skip
    obj = np.where(np.isfinite(obj), obj, np.inf).reshape(len(index), k)
    best = p.reshape(len(index), k, 5)[np.arange(len(index)), obj.argmin(axis=1)]
    params = np.column_stack(
        [np.exp(best[:, 2]), np.exp(best[:, 0]), best[:, 3], np.exp(best[:, 1]), best[:, 4]]
    )  # E, A, alpha, B, beta
    E, A, al, B, be = params[: len(points)].T
    errs = E + A / n**al + B / d**be - y
    law.loo_rmse = float(np.sqrt(np.mean(np.square(errs))))
    law.loo_max = float(np.max(np.abs(errs)))
    samples = params[len(points) :]
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
    """Median ``6 N D / GPU-hours`` over runs that logged GPU-hours: the rate this hardware
    delivered on these runs."""
    rates = [6.0 * p.n * p.d / p.gpu_hours for p in points if p.gpu_hours and p.gpu_hours > 0]
    return float(np.median(rates)) if rates else None


# -- runs -> points, and the report's text ---------------------------------------------------
def points_from_runs(found: list[tuple[str, object]]) -> tuple[list[ScalingPoint], list[str]]:
    """One point per run that completed its schedule with a final val loss and a logged
    parameter count; the others are named with why they were left out."""
    from nanolab.runs import summarize_run, tail_records

    points, left_out = [], []
    for name, run_dir in found:
        s = summarize_run(name, run_dir)
        if s.status != "completed":
            left_out.append(f"{name} ({s.status})")
            continue
        starts = tail_records(run_dir, "start")
        n = starts[-1].get("num_params") if starts else None
        if not isinstance(n, (int, float)) or isinstance(n, bool) or n <= 0:
            left_out.append(f"{name} (no num_params in its start record)")
            continue
        if not s.final_val_loss or not s.tokens:
            left_out.append(f"{name} (no final val loss or tokens)")
            continue
        points.append(ScalingPoint(name, float(n), float(s.tokens), s.final_val_loss, s.gpu_hours))
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
        f"Huber fit of log L, [5%, 95%] over {len(samples)} bootstrap resamples of the runs",
    ]
    for name in PARAMS:
        value = getattr(law, name)
        lo, hi = law.band.get(name, (math.nan, math.nan))
        out.append(f"  {name:<5} = {_g(value):<10} [{_g(lo)}, {_g(hi)}]")
    if law.E < FLOOR_ZERO:
        out.append("  note: the fit took the floor E to 0: these runs do not pin an irreducible "
                   "loss (too few sizes or tokens in the power-law regime); the optimum is a guess")  # fmt: skip
    out.append(f"  leave-one-out error of the final loss: rmse {law.loo_rmse:.4f}, max "
               f"{law.loo_max:.4f}")  # fmt: skip
    data: dict = {"law": law.to_dict(), "runs": [asdict(p) for p in points]}
    if gpu_hours is not None:
        rate = flops_per_gpu_hour(points)
        if rate is None:
            raise ScalingError(
                "--gpu-hours: none of these runs logged gpu_hours, so GPU-hours cannot be turned "
                "into FLOPs; leave --gpu-hours out"
            )
        flops = gpu_hours * rate
        n, d, loss = law.optimum(flops)
        band = optimum_band(samples, flops)
        out.append(
            f"  {gpu_hours:g} GPU-h = {flops:.3g} FLOPs (6*N*D at {rate:.3g} per GPU-h: the median "
            "rate these runs logged; larger models usually run faster per FLOP)"
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
        data["budget"] = {"gpu_hours": gpu_hours, "flops_per_gpu_hour": rate, "flops": flops,
                          "n": n, "d": d, "loss": loss, "band": band}  # fmt: skip
    return "\n".join(out), data
