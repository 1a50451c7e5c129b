"""Start-up cost of nanolab's commands: wall and CPU seconds per launch, and fit's first step.

    python benches/startup.py                         # every command, 3 rounds
    python benches/startup.py --rounds 5 --only estimate --only fit

Light commands (``--help``, ``estimate``, ``report``, ``queue ls``) are timed launch to exit;
``fit`` is timed launch to its first ``train`` record (the end of the first optimizer step) on the
quickstart config, compile off, in a scratch folder. ``estimate`` runs with the estimator's cache
of model facts warmed by an untimed launch (every estimate after a model's first);
``estimate, cold cache`` with an empty cache each round (a model's first estimate). Commands alternate round by round, so a busy
machine disturbs all of them alike. Besides wall time the bench reports the CPU time the process
used (``os.wait4``): on a shared machine it is the steadier number, since wall time there is
mostly waiting for a core. The load average before and after is printed with the table.
``python -X importtime -m nanolab <verb>`` shows where an import-bound launch spends its time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"


def light_commands(work: Path) -> dict[str, list[str]]:
    """The commands that should start in well under a second (argv after ``python -m nanolab``)."""
    estimate = ["estimate", "--config", str(QUICKSTART), "--vocab-size", "65", "--device", "gpu"]
    return {
        "--help": ["--help"],
        "estimate": estimate,
        "estimate, cold cache": list(estimate),
        "estimate --help": ["estimate", "--help"],
        "report": ["report", str(work / "runs")],
        "queue ls": ["queue", "ls", "--db", str(work / "queue.db")],
    }


def fit_command(work: Path, tag: str) -> list[str]:
    return [
        "fit", "--config", str(QUICKSTART), "--run.root", str(work / "runs"), "--run.name", tag,
        "--run.resume", "never", "--trainer.max_steps", "1", "--trainer.enable_progress_bar",
        "false", "--model.compile", "false", "--data.dataset_dir", str(work / "data"),
        "--checkpoint.every_n_steps", "1000", "--run.eval_every_steps", "1000",
    ]  # fmt: skip


def run_once(argv: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """(wall s, CPU s, exit code) of ``python -m nanolab argv``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanolab", *argv],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"startup: `nanolab {' '.join(argv)}` exited {code}: {err[-300:]!r}")
    return wall, usage.ru_utime + usage.ru_stime, code


def first_step_s(work: Path, tag: str, launched: float) -> float:
    """Launch to the first ``train`` record of run ``tag``."""
    from nanolab.runlog import read_records

    records = read_records(work / "runs" / tag / "metrics.jsonl")
    return next(r["time"] for r in records if r["event"] == "train") - launched


def spread(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benches/startup.py", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", action="append", help="a command name (repeatable)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory(prefix="nanolab-startup-") as tmp:
        work = Path(tmp)
        (work / "runs").mkdir()
        names = [*light_commands(work), "fit (to first step)"]
        if args.only:
            unknown = [n for n in args.only if not any(n == m or m.startswith(n) for m in names)]
            if unknown:
                parser.error(f"--only {unknown[0]!r}: use one of {', '.join(names)}")
            names = [m for m in names if any(m == n or m.startswith(n) for n in args.only)]
        env["NANOLAB_ESTIMATOR_CACHE"] = str(work / "estimator-cache")
        if any(n.startswith("fit") for n in names):  # prepare the data once, untimed
            run_once(fit_command(work, "warm"), env)
        if "estimate" in names:  # the model's facts, read once, untimed
            run_once(light_commands(work)["estimate"], env)
        times: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in names}
        load_before = os.getloadavg()[0]
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                if name.startswith("fit"):
                    tag = f"r{r}"
                    launched = time.time()
                    _, cpu, _ = run_once(fit_command(work, tag), env)
                    times[name]["wall"].append(first_step_s(work, tag, launched))
                    times[name]["cpu"].append(cpu)  # the whole 1-step run, teardown included
                else:
                    cold = {"NANOLAB_ESTIMATOR_CACHE": str(work / f"empty-cache-{r}")}
                    here = {**env, **cold} if name.endswith("cold cache") else env
                    wall, cpu, _ = run_once(light_commands(work)[name], here)
                    times[name]["wall"].append(wall)
                    times[name]["cpu"].append(cpu)
        load_after = os.getloadavg()[0]
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load": [round(load_before, 1), round(load_after, 1)],
        "cores": os.cpu_count(),
        "commands": {n: {k: spread(v) for k, v in t.items()} for n, t in times.items()},
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"{result['date']}, {result['cores']} cores, load {result['load'][0]} -> "
        f"{result['load'][1]}, {args.rounds} rounds (median [min-max] seconds)"
    )
    for name, t in result["commands"].items():
        w, c = t["wall"], t["cpu"]
        print(
            f"  {name:<24} wall {w['median']:6.2f} [{w['min']:.2f}-{w['max']:.2f}]   "
            f"CPU {c['median']:6.2f} [{c['min']:.2f}-{c['max']:.2f}]"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
