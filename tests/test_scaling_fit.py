"""The scaling-law fit (``nanolab.scaling_fit``) and ``nanolab report --scaling --gpu-hours`` on runs
with a known answer, written the way ``nanolab fit`` logs them.

Each test names, in its docstring, the mutation of nanolab it was seen to catch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from nanolab.report import main
from nanolab.scaling_fit import (
    FLOOR_ZERO,
    ScalingError,
    ScalingLaw,
    ScalingPoint,
    fit_scaling_law,
    fit_with_errors,
)

# A Chinchilla-like law in this test's units.
TRUE = {"E": 1.69, "A": 406.4, "alpha": 0.34, "B": 410.7, "beta": 0.28}
SIZES = (1e6, 3e6, 1e7, 3e7)
TOKENS = (1e7, 1e8, 1e9)
RATE = 1e15  # 6ND FLOPs per GPU-hour the synthetic hardware delivers


def law_loss(n: float, d: float) -> float:
    return TRUE["E"] + TRUE["A"] / n ** TRUE["alpha"] + TRUE["B"] / d ** TRUE["beta"]


def test_noiseless_law_is_recovered_and_the_optimum_is_the_constrained_minimum() -> None:
    """From 12 exact points the five parameters come back to 1e-6, and the closed-form optimum
    under ``6 N D = C`` is the minimum of L along that constraint (checked on a dense grid).

    Mutations caught: the exponents of N* swapped (beta/(alpha+beta) vs alpha/(alpha+beta));
    the residual in linear instead of log space with a 1e-3 Huber delta (E off by 5%).
    """
    n, d = (a.ravel() for a in np.meshgrid(SIZES, TOKENS))
    law = fit_scaling_law(n, d, [law_loss(a, b) for a, b in zip(n, d, strict=True)])
    for name, value in TRUE.items():
        assert getattr(law, name) == pytest.approx(value, rel=1e-6), name
    flops = 1e20
    n_opt, d_opt, l_opt = law.optimum(flops)
    assert 6 * n_opt * d_opt == pytest.approx(flops)
    grid = np.geomspace(n_opt / 10, n_opt * 10, 20001)
    losses = law.predict(grid, flops / 6 / grid)
    assert grid[int(np.argmin(losses))] == pytest.approx(n_opt, rel=1e-3)
    assert l_opt == pytest.approx(float(losses.min()), abs=1e-9)


# The previous fit (a hand-written Levenberg-Marquardt from a grid of 432 starts, NumPy only), on
# the 12 points of ``_noisy(noise, seed)``, computed before scipy.optimize replaced it.
PREVIOUS = {
    (0.003, 1): {"E": 1.670273358, "A": 420.7545253, "alpha": 0.3425973201, "B": 380.7003912,
                 "beta": 0.2749392504, "objective": 7.131963431e-06},
    (0.01, 2): {"E": 1.083452351, "A": 261.4801086, "alpha": 0.3040587081, "B": 227.8613337,
                "beta": 0.2390071929, "objective": 5.736309027e-05},
    (0.02, 3): {"E": 1.949962213, "A": 1662.011146, "alpha": 0.4497589367, "B": 307.2230884,
                "beta": 0.2596831624, "objective": 0.0002130985561},
}  # fmt: skip
#: Its leave-one-out error and bootstrap ranges (fit_with_errors) on the (0.003, 1) points.
PREVIOUS_ERRORS = {
    "loo": (0.01618588329, 0.03873317728),
    "band": {"E": (1.598558648, 1.815417663), "A": (373.9302056, 584.8095393),
             "alpha": (0.3326606633, 0.3688458489), "B": (332.7931932, 413.7740294),
             "beta": (0.2661086106, 0.2806581629)},
}  # fmt: skip


def _noisy(noise: float, seed: int) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """The 4 x 3 sweep of the known law, each loss times exp(N(0, noise))."""
    rng = np.random.default_rng(seed)
    n, d = (a.ravel() for a in np.meshgrid(SIZES, TOKENS, indexing="ij"))
    return (
        n,
        d,
        [law_loss(a, b) * math.exp(rng.normal(0, noise)) for a, b in zip(n, d, strict=True)],
    )


@pytest.mark.parametrize(("noise", "seed"), list(PREVIOUS))
def test_the_fit_is_the_previous_fit_on_the_same_points(noise: float, seed: int) -> None:
    """On noisy sweeps of the known law (0.3%, 1% and 2% noise) scipy's fit ends where the
    previous hand-written Levenberg-Marquardt did: every parameter and the Huber objective to
    1e-6 relative (seen: 1e-7 at most).

    Mutations caught: ``f_scale`` left at 1 (a plain least-squares fit); the profile's relative
    weights dropped (starts in other basins: E off at all three noise levels).
    """
    law = fit_scaling_law(*_noisy(noise, seed))
    for name, value in PREVIOUS[(noise, seed)].items():
        assert getattr(law, name) == pytest.approx(value, rel=1e-6), name


def test_the_fit_recovers_the_law_from_noisy_points_within_the_stated_tolerance() -> None:
    """Over 20 draws of 0.3% noise on the 12 points, the fitted exponents stay within 10% of the
    true ones, E within 20%, A and B within 40% (the worst seen: alpha 9.0%, beta 6.1%, E 16%,
    A 38%, B 27%; a coefficient trades off against its exponent), and the errors of the 0.3% sweep are the previous
    fit's: leave-one-out rmse and max and every bootstrap range to 1e-6 relative.

    Mutations caught: the leave-one-out refit keeping the run it leaves out (a smaller rmse).
    """
    tolerance = {"E": 0.20, "A": 0.40, "alpha": 0.10, "B": 0.40, "beta": 0.10}
    for seed in range(20):
        law = fit_scaling_law(*_noisy(0.003, seed))
        for name, rel in tolerance.items():
            assert getattr(law, name) == pytest.approx(TRUE[name], rel=rel), (seed, name)
    n, d, y = _noisy(0.003, 1)
    points = [ScalingPoint(f"r{i}", *row) for i, row in enumerate(zip(n, d, y, strict=True))]
    law, samples = fit_with_errors(points)
    assert len(samples) == 100
    assert (law.loo_rmse, law.loo_max) == pytest.approx(PREVIOUS_ERRORS["loo"], rel=1e-6)
    for name, band in PREVIOUS_ERRORS["band"].items():
        assert law.band[name] == pytest.approx(band, rel=1e-6), name


def test_a_fit_that_runs_off_past_float_range_is_a_scaling_error_not_an_overflow() -> None:
    """An optimum at a degenerate exponent (beta = 50 with B = e^800: a law in log space only)
    used to end `report --scaling` in an OverflowError traceback; it is a ScalingError, which
    the report prints as one line, saying what the runs lack."""
    n = np.array([1e6, 1e6, 4e6, 4e6, 16e6, 16e6])
    d = np.array([1e8, 4e8, 1e8, 4e8, 1e8, 4e8])
    y = [law_loss(a, b) for a, b in zip(n, d, strict=True)]
    with pytest.raises(ScalingError, match=r"ran off to a degenerate law .*add runs"):
        fit_scaling_law(n, d, y, starts=np.array([[800.0, 800.0, 800.0, 50.0, 50.0]]))
    # finite coefficients (A = 3e303) but an exponent of 65: as degenerate, and its optimum
    # overflowed in report --scaling --gpu-hours
    with pytest.raises(ScalingError, match=r"alpha 6\d.*at most 5"):
        fit_scaling_law(n, d, y, starts=np.array([[700.0, 700.0, 0.5, 50.0, 50.0]]))
    assert all(math.isnan(v) for v in ScalingLaw(1.6, 3.3e303, 65.0, 1e304, 50.0, 0).optimum(1e18))


def test_a_fit_started_above_a_missing_floor_ends_at_the_floor_zero() -> None:
    """Runs of a law without a floor (E = 0, 0.3% noise), the fit started from E = 1.65: it
    ends where the profile's starts end, E below 1e-6 with the same objective, not at the
    local optimum E = 0.012 that least_squares stops on from there.

    Mutations caught: the last polish with the floor at 0 left out (E = 0.0117, objective 5%
    higher).
    """
    n, d, _ = _noisy(0.0, 0)
    rng = np.random.default_rng(1)
    y = [
        (law_loss(a, b) - TRUE["E"]) * math.exp(rng.normal(0, 0.003))
        for a, b in zip(n, d, strict=True)
    ]
    law = fit_scaling_law(n, d, y, starts=np.array([[4.0, 6.0, 0.5, 0.5, 0.5]]))
    best = fit_scaling_law(n, d, y)
    assert law.E < FLOOR_ZERO and best.E < FLOOR_ZERO
    assert law.objective == pytest.approx(best.objective, rel=1e-6)
    for name in ("A", "alpha", "B", "beta"):
        assert getattr(law, name) == pytest.approx(getattr(best, name), rel=1e-5), name


def _write_run(
    root: Path, name: str, n: float, d: float, loss: float, *, done: bool = True, data=None,
    seed: int = 1, optimizer: str = "adamw", precision: str = "bf16-mixed",
    accelerator: str = "CUDAAccelerator", branch: bool | None = None,
):  # fmt: skip
    """A finished run's log: start (num_params), train records with tokens and GPU-hours, a
    final val loss, and the end record. ``branch``: a run started at step 50 from another
    run's checkpoint, its GPU-hours counted from there (True: its records say which tokens are
    its own, ``run_tokens``; False: an older log that does not)."""
    run = root / name
    run.mkdir(parents=True)
    steps = 100
    per_step = d / steps
    config = {"seed_everything": seed, "run": {"name": name},
              "trainer": {"max_steps": steps, "precision": precision},
              "model": {"gpt": {"n_embd": int(n) % 997}, "optimizer": {"name": optimizer}}}  # fmt: skip
    if data is not None:
        config["data"] = {"dataset_dir": data}
    lines = [{"event": "start", "time": 0.0, "step": 0, "num_params": int(n), "config": config,
              "accelerator": accelerator}]  # fmt: skip
    inherited = 0
    if branch is not None:
        inherited = int(per_step * 50)
        lines[0].update(step=50, resumed_from_step=50, run_dir=f"runs/{name}",
                        resumed_from="runs/parent/checkpoints/step-00000050.ckpt")  # fmt: skip
    for step in (50, 100)[1 if branch is not None else 0 :]:
        tokens = int(per_step * step)
        own = {"run_tokens": tokens - inherited} if branch else {}
        lines.append({"event": "train", "time": float(step), "step": step, "tokens": tokens,
                      "loss": loss + 0.1, "gpu_hours": 6 * n * (tokens - inherited) / RATE,
                      **own})  # fmt: skip
    lines.append({"event": "val", "time": 100.0, "step": 100, "tokens": int(d), "val_loss": loss})
    if done:
        own = {"run_tokens": int(d) - inherited} if branch else {}
        lines.append({"event": "end", "time": 101.0, "step": 100, "reason": "completed",
                      "tokens": int(d), "gpu_hours": 6 * n * (d - inherited) / RATE, **own})  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def _sweep(
    root: Path, sizes=SIZES, noise: float = 0.003, seed: int = 1, branch: bool | None = None
) -> None:
    rng = np.random.default_rng(seed)
    for n in sizes:
        for d in TOKENS:
            loss = law_loss(n, d) * math.exp(rng.normal(0, noise))
            _write_run(root, f"n{n:.0e}-d{d:.0e}", n, d, loss, branch=branch)


def test_report_scaling_recovers_the_law_and_the_optimum(tmp_path: Path, capsys) -> None:
    """Twelve finished runs (4 sizes x 3 token counts, 0.3% noise on the loss) plus one still
    running: ``report --scaling --gpu-hours 1e5 --json`` fits the law from the 12, each true
    parameter lies inside its 5-95% bootstrap range, the leave-one-out error is about the noise,
    the GPU-hours become FLOPs at the runs' logged rate, and the true compute-optimal N and D
    lie inside their ranges and within 25% of the fitted ones. The table says the same.

    Mutations caught: the running run counted (13 points); D from the last val record's step
    instead of the run's tokens; GPU-hours turned into FLOPs with 2ND instead of 6ND (rate off 3x).
    """
    _sweep(tmp_path)
    _write_run(tmp_path, "live", 5e6, 5e8, 2.0, done=False)
    assert main([str(tmp_path), "--scaling", "--gpu-hours", "1e5", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["scaling"]
    law = data["law"]
    assert len(data["runs"]) == 12
    for name, value in TRUE.items():
        lo, hi = law["band"][name]
        assert lo <= value <= hi, (name, value, lo, hi)
    assert 0.001 < law["loo_rmse"] < 0.05
    budget = data["budget"]
    assert budget["flops_per_gpu_hour"] == pytest.approx(RATE, rel=1e-6)
    flops = 1e5 * RATE
    truth = ScalingLaw(**TRUE, objective=0.0).optimum(flops)
    for key, true in zip(("n", "d"), truth[:2], strict=True):
        lo, hi = budget["band"][key]
        assert lo <= true <= hi, (key, true, lo, hi)
        assert budget[key] == pytest.approx(true, rel=0.25)
    assert main([str(tmp_path), "--scaling", "--gpu-hours", "1e5"]) == 0
    out = capsys.readouterr().out
    assert "over 12 finished runs of 4 sizes" in out and "compute-optimal: N = " in out
    assert "leave-one-out error" in out and "alpha  = 0.3" in out


def test_a_sweep_of_branches_turns_gpu_hours_into_flops_over_their_own_tokens(tmp_path, capsys):
    """Each run a branch from step 50 of another (a cooldown sweep): D is the model's tokens, its
    parent's included, but its GPU-hours are its own, spent on half of them. The rate was
    6 N D over those hours: twice the truth here, and 1000x for a fine-tune of a long pretrain.
    A branch's older log, which does not say which tokens were its own, gives no rate: with no
    run that does, --gpu-hours is one error line.

    Mutations caught: the rate over D; an older branch's hours taken over all its tokens."""
    from nanolab.scaling_fit import points_from_runs

    _sweep(tmp_path / "new", branch=True)
    assert main([str(tmp_path / "new"), "--scaling", "--gpu-hours", "1e5", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["scaling"]
    assert data["budget"]["flops_per_gpu_hour"] == pytest.approx(RATE, rel=1e-6)
    run = next(r for r in data["runs"] if r["run"] == "n1e+06-d1e+08")
    assert run["d"] == 1e8 and run["run_tokens"] == 5e7
    _sweep(tmp_path / "old", branch=False)
    points, _ = points_from_runs([("b", tmp_path / "old" / "n1e+06-d1e+08")])
    assert points[0].d == 1e8 and points[0].run_tokens is None
    assert main([str(tmp_path / "old"), "--scaling", "--gpu-hours", "1e5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "which tokens were its own" in err, err


def test_scaling_fits_the_runs_of_one_dataset_and_says_what_it_left_out(tmp_path, capsys):
    """A runs folder that also holds runs on other data (another tokenizer's losses are another
    quantity): the fit takes the newest run's dataset only, as --plot does, and lists the runs
    it left out and why; a --run selection across datasets is one error line.

    Mutations caught: every completed run fitted whatever its data (14 points), left out
    silently."""
    for i, (n, d, loss) in enumerate([(3e6, 1e8, 5.5), (3e7, 1e9, 5.1)]):
        _write_run(tmp_path, f"bpe{i}", n, d, loss, data="data/bpe")
    _sweep(tmp_path)
    _write_run(tmp_path, "live", 5e6, 5e8, 2.0, done=False)
    for i in range(2):  # the bpe runs are the oldest: the newest run's data is the sweep's
        log = tmp_path / f"bpe{i}" / "metrics.jsonl"
        records = [json.loads(line) for line in log.read_text().splitlines()]
        log.write_text("".join(json.dumps({**r, "time": r["time"] - 1e3}) + "\n" for r in records))
    assert main([str(tmp_path), "--scaling", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["scaling"]
    assert len(data["runs"]) == 12
    assert sorted(data["left_out"]) == [
        "bpe0 (other data or vocabulary)", "bpe1 (other data or vocabulary)", "live (crashed)",
    ]  # fmt: skip
    assert main([str(tmp_path), "--scaling"]) == 0
    out = capsys.readouterr().out
    assert "\n  left out 1 run (crashed): live\n" in out
    assert "\n  left out 2 runs (other data or vocabulary): bpe0, bpe1\n" in out
    assert main([str(tmp_path), "--scaling", "--run", "bpe0", "--run", "n1e+06-d1e+08"]) == 2
    err = capsys.readouterr().err
    assert "error: --scaling: the runs --run selects were trained on 2 different" in err


def test_scaling_fits_one_recipe_and_counts_a_repeated_seed_once(tmp_path, capsys):
    """Beside the AdamW sweep: a fork's Lion runs, an fp32 debug run and a repeat of one run
    with its seed. One law was fitted through all of them (17 points, the repeat twice); it is
    fitted to the sweep's 12, and each reason for leaving runs out is one line with its count.

    Mutations caught: other optimizers or precisions fitted; the repeat counted twice; the
    reasons listed run by run."""
    _sweep(tmp_path)
    for i, n in enumerate((2e6, 2e7, 2e8)):
        _write_run(tmp_path, f"lion{i}", n, 1e9, 3.0, optimizer="lion")
    _write_run(tmp_path, "debug", 1e6, 1e8, 9.0, precision="32-true")
    _write_run(tmp_path, "again", 1e6, 1e8, 8.0)  # n1e+06-d1e+08 repeated, seed 1, later:
    log = tmp_path / "again" / "metrics.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    log.write_text("".join(json.dumps({**r, "time": r["time"] + 1e3}) + "\n" for r in records))
    assert main([str(tmp_path), "--scaling", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["scaling"]
    assert sorted(p["run"] for p in data["runs"]) == sorted(
        f"n{n:.0e}-d{d:.0e}" for n in SIZES for d in TOKENS
    )
    assert data["recipe"] == {
        "model.class_path": "nanolab.training.module.GPTLightningModule",
        "model.optimizer.name": "adamw",
        "trainer.precision": "bf16-mixed",
    }
    assert main([str(tmp_path), "--scaling"]) == 0
    out = capsys.readouterr().out
    lines = out[out.index("leave-one-out") :].splitlines()[1:]
    assert lines == [
        "  left out 1 run (same config and seed as n1e+06-d1e+08: counted once): again",
        "  left out 1 run (another recipe: trainer.precision 32-true, fitted bf16-mixed): debug",
        "  left out 3 runs (another recipe: model.optimizer.name lion, fitted adamw): lion0, "
        "lion1, lion2",
    ]


def test_a_precision_spelled_short_is_the_same_recipe(tmp_path, capsys):
    """``trainer.precision: bf16`` is Lightning's ``bf16-mixed`` (``32`` is ``32-true``, ``16``
    is ``16-mixed``): a sweep whose smallest size was launched with the short spelling lost
    those runs from the fit as "another recipe".

    Mutations caught: the precision compared as written."""
    for i, n in enumerate(SIZES):
        for d in TOKENS:
            precision = "bf16" if i == 0 else "bf16-mixed"
            _write_run(tmp_path, f"n{n:.0e}-d{d:.0e}", n, d, law_loss(n, d), precision=precision)
    _write_run(tmp_path, "fp32", 2e6, 1e8, 9.0, precision="32")
    _write_run(tmp_path, "fp16", 2e6, 1e9, 9.0, precision="16")
    assert main([str(tmp_path), "--scaling", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["scaling"]
    assert len(data["runs"]) == len(SIZES) * len(TOKENS)
    assert data["recipe"]["trainer.precision"] == "bf16-mixed"
    assert main([str(tmp_path), "--scaling"]) == 0
    out = capsys.readouterr().out
    assert "(another recipe: trainer.precision 16-mixed, fitted bf16-mixed): fp16" in out, out
    assert "(another recipe: trainer.precision 32-true, fitted bf16-mixed): fp32" in out, out


def test_scaling_refuses_runs_of_two_recipes_too_few_each_naming_what_differs(tmp_path, capsys):
    """Two recipes, neither with runs of three sizes: one line that says which keys set the
    left-out runs apart (not a fit through both)."""
    for n in SIZES[:2]:
        for d in TOKENS:
            _write_run(tmp_path, f"a{n:.0e}-{d:.0e}", n, d, law_loss(n, d))
            _write_run(tmp_path, f"b{n * 3:.0e}-{d:.0e}", n * 3, d, 5.0, optimizer="lion")
    assert main([str(tmp_path), "--scaling"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "nanolab report: error: --scaling: 2 distinct model size(s) among 6 finished run(s); a "
        "scaling fit needs runs of at least 3 sizes (vary model.gpt.n_layer / n_embd) (6 run(s) "
        "of other recipes left out, differing in model.optimizer.name: a law is fitted to one "
        "recipe's sweep)"
    )


def test_the_budget_of_cpu_runs_is_said_in_cpu_hours(tmp_path, capsys):
    """Runs that trained on CPUs logged CPU-hours: ``--gpu-hours 100`` is 100 CPU-hours at
    their rate, and the line says so (it said GPU-h)."""
    rng = np.random.default_rng(1)
    for n in SIZES:
        for d in TOKENS:
            loss = law_loss(n, d) * math.exp(rng.normal(0, 0.003))
            _write_run(tmp_path, f"n{n:.0e}-d{d:.0e}", n, d, loss, accelerator="CPUAccelerator")
    assert main([str(tmp_path), "--scaling", "--gpu-hours", "100"]) == 0
    out = capsys.readouterr().out
    assert "  100 CPU-h = 1e+17 FLOPs (6*N*D at 1e+15 per CPU-h: the median rate" in out
    assert "GPU-h" not in out


@pytest.mark.parametrize(
    ("sizes", "args", "message"),
    [
        ((1e6, 1e7), ["--scaling"], "2 distinct model size(s) among 6 finished run(s)"),
        (SIZES, ["--scaling", "--gpu-hours", "-3"], "--gpu-hours -3.0: give a positive number"),
        (SIZES, ["--gpu-hours", "nan"], "--gpu-hours nan: give a positive number"),
    ],
)
def test_too_few_sizes_and_bad_budgets_are_one_line(tmp_path, capsys, sizes, args, message):
    """Runs of only two sizes cannot pin alpha: one ``error:`` line, exit 2, no traceback; a
    non-positive or NaN ``--gpu-hours`` the same.

    Mutations caught: a fit attempted on two sizes (a confident answer with alpha undetermined);
    --gpu-hours nan passed through to a NaN model size.
    """
    _sweep(tmp_path, sizes=sizes)
    assert main([str(tmp_path), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "error:" in err and message in err, err


def test_the_docs_scaling_command_prints_the_pages_fit(tmp_path, capsys, monkeypatch) -> None:
    """docs/scaling.md's ``nanolab report runs/ --scaling --gpu-hours 100``, as written, on the
    synthetic sweep the page describes: the fit's lines the page shows are what it prints.

    Mutations caught: the page's output going stale after a change to the fit or its text.
    """
    import re
    import shlex

    page = (Path(__file__).resolve().parents[1] / "docs" / "scaling.md").read_text()
    section = page[page.index("## Scaling laws") :]
    (command,) = [c for c in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]
    shown = re.search(r"```text\n(.*?)```", section, flags=re.S).group(1).strip().splitlines()
    monkeypatch.chdir(tmp_path)
    _sweep(tmp_path / "runs")
    argv = shlex.split(command.strip())
    assert argv[:2] == ["nanolab", "report"]
    assert main(argv[2:]) == 0
    out = capsys.readouterr().out
    printed = out[out.index("scaling: ") :].strip().splitlines()
    assert printed == shown


def test_a_floor_the_runs_do_not_show_is_reported_as_zero_with_a_note(tmp_path, capsys) -> None:
    """Runs from a law without a floor (E = 0, no noise): the fit still finds alpha and beta,
    prints E as 0 (log E ran off towards -inf, e.g. 1e-25) and says the runs do not pin it.

    Mutations caught: E printed as a meaningless 3.241e-25; the note missing.
    """
    for n in SIZES:
        for d in TOKENS:
            loss = TRUE["A"] / n ** TRUE["alpha"] + TRUE["B"] / d ** TRUE["beta"]
            _write_run(tmp_path, f"n{n:.0e}-d{d:.0e}", n, d, loss)
    assert main([str(tmp_path), "--scaling"]) == 0
    out = capsys.readouterr().out
    assert "  E      = 0      [0, 0]" in out and "alpha  = 0.34   " in out
    assert "note: the fit took the floor E to 0" in out
