"""Commands that should answer at once, timed in one or more source trees side by side.

    python benches/latency.py                              # this tree, 5 rounds
    python benches/latency.py --tree /tmp/before --tree . --rounds 5

Each tree runs as ``PYTHONPATH=TREE python -m nanolab ...`` from a scratch folder, with its own
estimator cache (where the parser's keys and the ``fit --help`` page are remembered), warmed by
one untimed launch of every command: the timings are of the second launch on, as a user sees
them once any ``fit`` has run. Trees and commands alternate round by round, so a busy machine
disturbs all of them alike. Wall and CPU seconds (``os.wait4``), median [min-max], and the load
average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ["--sweep", "model.optimizer.lr=1e-3,3e-3", "--sweep", "model.gpt.n_layer=2,4",
         "--set", "trainer.max_steps=40"]  # fmt: skip


def commands(config: Path, work: Path) -> dict[str, tuple[list[str], int]]:
    """name -> (argv after ``python -m nanolab``, expected exit code); ``{db}``: a fresh file."""
    return {
        "fit --help": (["fit", "--help"], 0),
        "unknown key": (["fit", "--config", str(config), "--model.gpt.n_layers", "2"], 2),
        "queue add, 4 jobs": (["queue", "add", str(config), "--db", "{db}", *SWEEP], 0),
        "queue add, 12 jobs": (
            ["queue", "add", str(config), "--db", "{db}", *SWEEP, "--seeds", "1,2,3"], 0
        ),
        "queue ls": (["queue", "ls", "--db", str(work / "ls.db")], 0),
    }  # fmt: skip


def run_once(
    tree: Path, argv: list[str], code: int, work: Path, cache: Path
) -> tuple[float, float]:
    db = Path(tempfile.mkdtemp(dir=work)) / "q.db"
    argv = [a.replace("{db}", str(db)) for a in argv]
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1",
           "NANOLAB_ESTIMATOR_CACHE": str(cache)}  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "nanolab", *argv], cwd=db.parent, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != code:
        raise SystemExit(f"latency: {tree}: `nanolab {' '.join(argv)}`: {err[-400:]!r}")
    return wall, usage.ru_utime + usage.ru_stime


class BadTree(Exception):
    """A ``--tree`` whose timings would not be of its own code: the one line that says so."""


def check_tree(tree: Path) -> None:
    """``tree`` holds a nanolab to time: else ``PYTHONPATH=TREE`` falls through to whichever
    nanolab is installed, and its timings would be printed under this tree's name."""
    if not (tree / "nanolab" / "__init__.py").is_file():
        raise BadTree(
            f"--tree {tree}: no nanolab/__init__.py there; give the root of a nanolab source "
            "tree (a clone or a worktree of this repository)"
        )


def check_imported_from(tree: Path, cache: Path, work: Path) -> None:
    """The nanolab that ``PYTHONPATH=TREE`` imports lies under ``tree`` (checked with the warm-up:
    something earlier on the path, a ``.pth`` file or a ``sitecustomize``, could shadow it).
    Asked from ``work``, where the timed commands run: ``python -c`` puts its folder first."""
    env = {**os.environ, "PYTHONPATH": str(tree), "NANOLAB_ESTIMATOR_CACHE": str(cache)}
    probe = "import nanolab; print(nanolab.__file__)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=work, env=env,
                         capture_output=True, text=True)  # fmt: skip
    found = Path(os.path.abspath(out.stdout.strip() or "."))  # as the path names it
    if out.returncode != 0 or not found.is_relative_to(tree):
        where = found if out.returncode == 0 else f"nowhere ({out.stderr.strip()[-200:]!r})"
        raise BadTree(
            f"--tree {tree}: `import nanolab` with PYTHONPATH={tree} imports {where}, not this "
            "tree's nanolab; time it where nothing on the path comes before PYTHONPATH"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", type=Path, help="source tree (repeatable)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", action="append", help="a command's name (repeatable)")
    args = parser.parse_args(argv)
    trees = [t.resolve() for t in args.tree or [ROOT]]
    try:
        for tree in trees:
            check_tree(tree)
        _time(trees, args.rounds, args.only)
    except BadTree as err:
        print(f"latency: error: {err}", file=sys.stderr)
        return 2
    return 0


def _time(trees: list[Path], rounds: int, only: list[str] | None) -> None:
    """Each command of :func:`commands` timed ``rounds`` times in each tree, printed."""
    with tempfile.TemporaryDirectory(prefix="nanolab-latency-") as scratch:
        work = Path(scratch)
        wanted = {k: v for k, v in commands(ROOT / "configs" / "quickstart.yaml", work).items()
                  if not only or k in only}  # fmt: skip
        caches = {t: work / f"cache{i}" for i, t in enumerate(trees)}
        for tree in trees:  # warm: the keys and the help page remembered, the db created
            check_imported_from(tree, caches[tree], work)
            for argv, code in wanted.values():
                run_once(tree, argv, code, work, caches[tree])
        times: dict[tuple[str, Path], list[tuple[float, float]]] = {}
        load = os.getloadavg()[0]
        for r in range(rounds):
            for name, (argv, code) in wanted.items():
                for tree in trees if r % 2 == 0 else trees[::-1]:
                    times.setdefault((name, tree), []).append(
                        run_once(tree, argv, code, work, caches[tree])
                    )
        print(f"load {load:.2f} -> {os.getloadavg()[0]:.2f}, {rounds} rounds, "
              f"{time.strftime('%Y-%m-%d %H:%M')}")  # fmt: skip
        for (name, tree), runs in times.items():
            walls, cpus = [w for w, _ in runs], [c for _, c in runs]
            print(f"{name:<20} {tree!s:<28} wall {statistics.median(walls):6.2f} "
                  f"[{min(walls):.2f}-{max(walls):.2f}]  CPU {statistics.median(cpus):6.2f} "
                  f"[{min(cpus):.2f}-{max(cpus):.2f}]")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
