"""Muon vs AdamW at a fixed token budget, each with a small learning-rate sweep.

Every run is a real ``nanolab fit`` of the same config (the quickstart by default), one process
at a time, the two optimizers alternating so that a change in machine load hits both alike.
Only the optimizer and its learning rate differ: AdamW sweeps ``model.optimizer.lr``; Muon sweeps
``model.optimizer.muon_lr`` (its hidden matrices) with the AdamW part (embeddings, head, norms)
at the config's ``lr``. Each run validates once, at its last step; the table gives that val loss,
the run's tokens/s and its wall time::

    OMP_NUM_THREADS=2 python benches/muon_vs_adamw.py --steps 200 -- --data.micro_batch_size 16
    python benches/muon_vs_adamw.py --steps 600 --adamw-lrs 3e-3 --muon-lrs 0.02   # one pair

Results (one JSON line per run) are appended to ``--out`` as each run ends, so an interrupted
sweep keeps what it measured; the markdown table is printed at the end. Exit 1 if a run fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_one(
    config: Path, root: Path, name: str, steps: int, overrides: list[str], extra: list[str]
) -> dict:
    """One ``nanolab fit``; its final val loss, tokens/s and wall time from metrics.jsonl."""
    cmd = [
        sys.executable, "-m", "nanolab", "fit", "--config", str(config),
        "--run.root", str(root), "--run.name", name, "--run.resume", "never",
        "--trainer.max_steps", str(steps), "--run.eval_every_steps", str(steps),
        "--checkpoint.every_n_steps", str(steps), "--progress.refresh_rate", "0",
        *overrides, *extra,
    ]  # fmt: skip
    start = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if res.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {res.returncode}): {res.stderr[-2000:]}")
    records = [
        json.loads(line) for line in (root / name / "metrics.jsonl").read_text().split("\n") if line
    ]
    vals = [r for r in records if r.get("event") == "val"]
    end = next(r for r in reversed(records) if r.get("event") == "end")
    return {
        "run": name,
        "steps": end["step"],
        "tokens": end["tokens"],
        "val_loss": vals[-1]["val_loss"],
        "tokens_per_s": end["tokens_per_s"],
        "step_s": end["time_breakdown"]["step_s"],
        "wall_s": round(wall, 1),
    }


def optimizer_step_ms(config: Path, repeats: int = 20) -> dict[str, float]:
    """Median wall time of one ``optimizer.step()`` on the config's model (random gradients),
    AdamW and Muon alternating, so both see the same machine load."""
    import statistics

    import torch
    import yaml

    from nanolab.model import GPT, GPTConfig
    from nanolab.training.optim import OptimizerConfig, build_optimizer

    cfg = yaml.safe_load(config.read_text())["model"]
    gpt = GPTConfig(**{**cfg["gpt"], "vocab_size": cfg["gpt"].get("vocab_size") or 65})
    opts = {}
    for name in ("adamw", "muon"):
        model = GPT(gpt)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opts[name] = build_optimizer(model, OptimizerConfig(name=name), torch.device("cpu"))
        opts[name].step()  # states exist from here on
    times: dict[str, list[float]] = {name: [] for name in opts}
    for _ in range(repeats):
        for name, opt in opts.items():
            start = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - start)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def table(rows: list[dict]) -> str:
    lines = [
        "| optimizer | lr (swept) | val loss | tokens/s | train step time (s) | wall (s) |",
        "|---|---|---|---|---|---|",
    ]
    best = {}
    for r in rows:
        if r["optimizer"] not in best or r["val_loss"] < best[r["optimizer"]]:
            best[r["optimizer"]] = r["val_loss"]
    for r in sorted(rows, key=lambda r: (r["optimizer"], r["lr"])):
        mark = " (best)" if r["val_loss"] == best[r["optimizer"]] else ""
        lines.append(
            f"| {r['optimizer']} | {r['swept']} = {r['lr']:g} | {r['val_loss']:.4f}{mark} | "
            f"{r['tokens_per_s']:.0f} | {r['step_s']:.0f} | {r['wall_s']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart.yaml")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps of every run")
    p.add_argument("--adamw-lrs", type=float, nargs="+", default=[1.5e-3, 3e-3, 6e-3])
    p.add_argument("--muon-lrs", type=float, nargs="+", default=[0.01, 0.02, 0.04])
    p.add_argument("--root", type=Path, default=Path("runs") / "muon_vs_adamw")
    p.add_argument(
        "--out", type=Path, default=None, help="JSON lines (default: ROOT/results.jsonl)"
    )
    p.add_argument("--step-only", action="store_true", help="only time one optimizer step")
    p.add_argument("extra", nargs="*", help="after --: more overrides for every run")
    args = p.parse_args(argv)
    step_ms = optimizer_step_ms(args.config)
    print("optimizer step (median of 20, alternating): "
          + ", ".join(f"{k} {v:.1f} ms" for k, v in step_ms.items()), flush=True)  # fmt: skip
    if args.step_only:
        return 0
    root = args.root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    out = args.out or root / "results.jsonl"
    plan = []  # alternate the optimizers; the middle learning rates first
    adamw = sorted(
        args.adamw_lrs, key=lambda x: abs(x - sorted(args.adamw_lrs)[len(args.adamw_lrs) // 2])
    )
    muon = sorted(
        args.muon_lrs, key=lambda x: abs(x - sorted(args.muon_lrs)[len(args.muon_lrs) // 2])
    )
    for i in range(max(len(adamw), len(muon))):
        if i < len(adamw):
            plan.append(
                (
                    "adamw",
                    "lr",
                    adamw[i],
                    ["--model.optimizer.name", "adamw", "--model.optimizer.lr", str(adamw[i])],
                )
            )
        if i < len(muon):
            plan.append(
                (
                    "muon",
                    "muon_lr",
                    muon[i],
                    ["--model.optimizer.name", "muon", "--model.optimizer.muon_lr", str(muon[i])],
                )
            )
    rows = []
    print(
        f"{len(plan)} runs of {args.steps} steps, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}",
        flush=True,
    )
    for opt, swept, lr, overrides in plan:
        name = f"{opt}-{swept}-{lr:g}-{args.steps}"
        try:
            row = run_one(args.config, root, name, args.steps, overrides, args.extra)
        except RuntimeError as err:
            print(f"muon_vs_adamw: {err}", file=sys.stderr)
            return 1
        row.update(
            optimizer=opt,
            swept=swept,
            lr=lr,
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        )
        rows.append(row)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(
            f"{name}: val loss {row['val_loss']:.4f}, {row['tokens_per_s']:.0f} tokens/s, {row['wall_s']:.0f} s",
            flush=True,
        )
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
