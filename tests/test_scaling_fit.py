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
from nanolab.scaling_fit import ScalingLaw, fit_scaling_law

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


def _write_run(root: Path, name: str, n: float, d: float, loss: float, *, done: bool = True):
    """A finished run's log: start (num_params), train records with tokens and GPU-hours, a
    final val loss, and the end record."""
    run = root / name
    run.mkdir(parents=True)
    steps = 100
    per_step = d / steps
    config = {"seed_everything": 1, "trainer": {"max_steps": steps}, "run": {"name": name},
              "model": {"gpt": {"n_embd": int(n) % 997}}}  # fmt: skip
    lines = [{"event": "start", "time": 0.0, "step": 0, "num_params": int(n), "config": config}]
    for step in (50, 100):
        tokens = int(per_step * step)
        lines.append({"event": "train", "time": float(step), "step": step, "tokens": tokens,
                      "loss": loss + 0.1, "gpu_hours": 6 * n * tokens / RATE})  # fmt: skip
    lines.append({"event": "val", "time": 100.0, "step": 100, "tokens": int(d), "val_loss": loss})
    if done:
        lines.append({"event": "end", "time": 101.0, "step": 100, "reason": "completed",
                      "tokens": int(d), "gpu_hours": 6 * n * d / RATE})  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def _sweep(root: Path, sizes=SIZES, noise: float = 0.003, seed: int = 1) -> None:
    rng = np.random.default_rng(seed)
    for n in sizes:
        for d in TOKENS:
            loss = law_loss(n, d) * math.exp(rng.normal(0, noise))
            _write_run(root, f"n{n:.0e}-d{d:.0e}", n, d, loss)


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
    assert "leave-one-out error" in out and "alpha = 0.3" in out


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
    assert "  E     = 0          [0, 0]" in out and "alpha = 0.34 " in out
    assert "note: the fit took the floor E to 0" in out
