"""Packed vs back to back: aggregate tokens/s of N jobs sharing one device through the queue.

The same N seeds of one config go through ``nanolab queue run`` twice, into two queues in a
work folder: once one job at a time, once with ``--pack`` (the jobs share the device as their
predicted memory allows). Reported per mode: wall time of the whole queue (start-ups
included), tokens trained, aggregate tokens/s over that wall time, aggregate tokens/s over the
training spans only (first ``train`` record to last), and the peak memory each job recorded.
``--mps`` adds a third pass with NVIDIA's Multi-Process Service daemon running (when
``nvidia-cuda-mps-control`` exists), which lets the packed processes' kernels run
concurrently instead of time-sliced.

    python benches/gpu_pack.py                        # GPU 0: 3 x GPT-2 124M, 200 steps each
    python benches/gpu_pack.py --mps --steps 300      # + a packed pass under MPS
    python benches/gpu_pack.py --device cpu           # the same comparison on this CPU
    python benches/gpu_pack.py --device cpu --config configs/gpt2-124m.yaml --block-size 64 \
      --set trainer.accelerator=cpu --set model.gpt.n_layer=1 ...   # the GPU's recipe, shrunk

GPU mode needs a visible CUDA/ROCm device; without one it says so and exits 2 (``--device
cpu`` is the CPU comparison). The data is a BPE corpus of GPT-2's vocabulary size made from the
bundled text unless ``--data`` points at a prepared one (speed does not depend on the text).
``model.compile`` is off unless ``--compile`` (then a 2-step warm-up job fills the queue's
compile cache first, so neither mode pays the compile in its numbers); ``--set KEY=VALUE``
adds an override to every job (``--set downstream.suite=null``: the CPU default, the
quickstart, scores its cloze at the end of each job, which the GPU's 124M does not). Writes
``<work>/gpu_pack.json``; exit 1 when a job fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def nanolab(*args: str, cwd: Path, env: dict[str, str] | None = None) -> None:
    """Run a nanolab command, echoing it; stop the bench on failure."""
    cmd = [sys.executable, "-m", "nanolab", *args]
    print("$ nanolab " + " ".join(args), flush=True)
    res = subprocess.run(cmd, cwd=cwd, env=env)
    if res.returncode != 0:
        sys.exit(f"gpu_pack: `nanolab {args[0]} {args[1] if len(args) > 1 else ''}` failed "
                 f"(exit {res.returncode})")  # fmt: skip


def read_log(path: Path) -> list[dict]:
    records = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return records


def run_queue(
    name: str, args: argparse.Namespace, work: Path, sets: list[str], run_flags: list[str],
    env: dict[str, str],
) -> dict:  # fmt: skip
    """Queue ``args.jobs`` seeds into ``<work>/<name>.db`` and run them; the numbers."""
    db = work / f"{name}.db"
    for f in work.glob(f"{name}.db*"):
        f.unlink()
    runs = work / f"runs-{name}"
    shutil.rmtree(runs, ignore_errors=True)
    seeds = ",".join(str(s) for s in range(1, args.jobs + 1))
    nanolab("queue", "add", str(args.config), "--db", str(db), "--name", name, "--seeds", seeds,
            "--set", f"run.root={runs}", *sets, cwd=work, env=env)  # fmt: skip
    start = time.time()
    nanolab("queue", "run", "--db", str(db), *run_flags, cwd=work, env=env)
    wall = time.time() - start
    jobs, tokens, first, last, peaks, failed = [], 0, [], [], [], []
    for run in sorted(p for p in runs.iterdir() if p.is_dir()):  # the queue's files sit beside
        recs = read_log(run / "metrics.jsonl")
        train = [r for r in recs if r.get("event") == "train"]
        end = [r for r in recs if r.get("event") == "end"]
        if not end or end[-1].get("reason") != "completed":
            why = end[-1].get("reason") if end else "no end record"
            print(f"gpu_pack: job {run.name} did not complete ({why}); its log: "
                  f"{run / 'queue.log'}", file=sys.stderr, flush=True)  # fmt: skip
            failed.append(run.name)
            continue
        tokens += int(end[-1].get("tokens") or 0)
        first.append(train[0]["time"])
        last.append(train[-1]["time"])
        peak = max((r.get("mem_reserved_bytes") or 0 for r in train), default=0)
        peaks.append(peak)
        jobs.append({"run": run.name, "tokens": end[-1].get("tokens"),
                     "tokens_per_s": end[-1].get("tokens_per_s"), "peak_reserved_bytes": peak})  # fmt: skip
    if name.startswith("sequential"):
        span = sum(b - a for a, b in zip(first, last, strict=True))
    else:
        span = (max(last) - min(first)) if first else 0.0
    return {
        "mode": name, "jobs": jobs, "failed": failed, "wall_s": round(wall, 2), "tokens": tokens,
        "tokens_per_s_wall": round(tokens / wall, 1) if wall else None,
        "tokens_per_s_training": round(tokens / span, 1) if span else None,
    }  # fmt: skip


def prepare_data(args: argparse.Namespace, work: Path, env: dict[str, str]) -> Path:
    if args.data:
        return Path(args.data).resolve()
    if args.device == "cpu":
        out = work / "data-chars"
        if not (out / "meta.json").is_file():
            nanolab("prepare", "bundled:shakespeare", "--tokenizer", "chars", "-o", str(out),
                    cwd=work, env=env)  # fmt: skip
        return out
    out = ROOT / "data" / "bench_bpe50k"  # shared with benches/gpu_124m.sh
    if not (out / "meta.json").is_file():
        nanolab("prepare", "bundled:shakespeare", "--tokenizer", "bpe", "--bpe-vocab-size",
                "50257", "-o", str(out), cwd=work, env=env)  # fmt: skip
    return out


def start_mps(work: Path, env: dict[str, str]) -> dict[str, str] | None:
    """Start an MPS control daemon private to this bench; the env its clients need (None: no
    MPS here)."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        print("MPS: nvidia-cuda-mps-control not found; the MPS pass is skipped", flush=True)
        return None
    pipe, logs = work / "mps-pipe", work / "mps-log"
    pipe.mkdir(exist_ok=True)
    logs.mkdir(exist_ok=True)
    mps_env = dict(env, CUDA_MPS_PIPE_DIRECTORY=str(pipe), CUDA_MPS_LOG_DIRECTORY=str(logs))
    res = subprocess.run([control, "-d"], env=mps_env)
    if res.returncode != 0:
        print(f"MPS: the daemon did not start (exit {res.returncode}); skipped", flush=True)
        return None
    return mps_env


def stop_mps(mps_env: dict[str, str]) -> None:
    control = shutil.which("nvidia-cuda-mps-control")
    if control:
        subprocess.run([control], input=b"quit\n", env=mps_env)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--gpu", default="0", help="device id to pack onto (default 0)")
    p.add_argument("--jobs", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="per job (default: 200 GPU, 60 CPU)")
    p.add_argument("--micro-batch", type=int, default=None, help="default: 16 GPU, 16 CPU")
    p.add_argument("--config", default=None, help="default: gpt2-124m (GPU), quickstart (CPU)")
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="the jobs' context, set on the config (default: the config's own, taken as 1024 "
        "on a GPU, 128 on a CPU); a step is one micro-batch of it",
    )
    p.add_argument("--data", default=None, help="a prepared dataset folder")
    p.add_argument("--compile", action="store_true", help="keep model.compile as configured")
    p.add_argument("--mps", action="store_true", help="add a packed pass under NVIDIA MPS")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU mode: OMP_NUM_THREADS of every job in both modes (default 1), so the "
        "comparison is of packing, not of thread counts",
    )
    p.add_argument("--work", default=str(ROOT / "runs" / "bench_gpu_pack"))
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more `queue add --set` for every job, after the bench's own (repeatable; "
        "e.g. downstream.suite=null)",
    )
    args = p.parse_args(argv)

    gpu = args.device == "gpu"
    if gpu:
        import torch

        if not torch.cuda.is_available():
            built = "a CPU-only torch" if not torch.backends.cuda.is_built() else "no device found"
            print(f"gpu_pack: no GPU visible ({built}); this benchmark needs one. Run it on a GPU "
                  "machine, or `python benches/gpu_pack.py --device cpu` for the CPU comparison",
                  file=sys.stderr)  # fmt: skip
            return 2
    args.steps = args.steps or (200 if gpu else 60)
    args.micro_batch = args.micro_batch or 16
    args.config = Path(
        args.config or ROOT / "configs" / ("gpt2-124m.yaml" if gpu else "quickstart.yaml")
    ).resolve()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not gpu:
        env["OMP_NUM_THREADS"] = str(args.threads)
    data = prepare_data(args, work, env)
    block = args.block_size or (1024 if gpu else 128)
    sets = [
        *([f"model.gpt.block_size={block}"] if args.block_size else []),
        f"trainer.max_steps={args.steps}",
        f"data.dataset_dir={data}",
        "data.source=null",
        f"data.micro_batch_size={args.micro_batch}",
        f"run.global_batch_tokens={args.micro_batch * block}",
        f"run.eval_every_steps={args.steps}",
        f"checkpoint.every_n_steps={args.steps}",
    ]
    if not args.compile:
        sets.append("model.compile=false")
    sets += args.set
    sets = [x for s in sets for x in ("--set", s)]
    device_flags = ["--gpus", args.gpu] if gpu else []
    if args.compile:  # fill the queue's compile cache once, so neither mode pays for it
        warm = [*sets, "--set", "trainer.max_steps=2"]
        run_queue("warmup", argparse.Namespace(**{**vars(args), "jobs": 1}), work, warm,
                  device_flags, env)  # fmt: skip
    results = [run_queue("sequential", args, work, sets, device_flags, env)]
    results.append(run_queue("packed", args, work, sets, [*device_flags, "--pack"], env))
    if args.mps and gpu:
        mps_env = start_mps(work, env)
        if mps_env is not None:
            try:
                results.append(
                    run_queue("packed-mps", args, work, sets, [*device_flags, "--pack"], mps_env)
                )
            finally:
                stop_mps(mps_env)

    where = (
        f"GPU {args.gpu}"
        if gpu
        else f"CPU ({os.cpu_count()} cores, {args.threads} thread(s) per job)"
    )
    print(f"\n{args.jobs} x {args.config.name}, {args.steps} steps, micro-batch "
          f"{args.micro_batch}, on {where}")  # fmt: skip
    print(f"{'mode':<12} {'wall s':>8} {'tokens':>10} {'tok/s wall':>11} {'tok/s train':>12}  "
          "peak reserved per job")  # fmt: skip
    for r in results:
        peaks = ", ".join(f"{j['peak_reserved_bytes'] / 1024**3:.1f}G" for j in r["jobs"]) or "-"
        print(f"{r['mode']:<12} {r['wall_s']:>8.1f} {r['tokens']:>10,} "
              f"{r['tokens_per_s_wall'] or 0:>11,.0f} {r['tokens_per_s_training'] or 0:>12,.0f}  "
              f"{peaks if gpu else '(CPU: not recorded)'}")  # fmt: skip
    seq, packed = results[0], results[1]
    if seq["tokens_per_s_wall"] and packed["tokens_per_s_wall"]:
        print(f"packed / sequential: {packed['tokens_per_s_wall'] / seq['tokens_per_s_wall']:.2f}x "
              "aggregate tokens/s over the whole queue")  # fmt: skip
    out = work / "gpu_pack.json"
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                               "results": results}, indent=2))  # fmt: skip
    print(f"wrote {out}")
    return 1 if any(r["failed"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
