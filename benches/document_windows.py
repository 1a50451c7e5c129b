"""Do document-aligned windows, document masking and a sliding window pay? Measured, not assumed.

A corpus of real documents (default: every top-level function and class of this Python's
standard library, one document each, a few MB) is prepared with a local BPE tokenizer; then the
same small model trains for the same number of steps under four settings, three seeds each:

* ``plain``: windows cut anywhere in the token stream (``data.align: stream``);
* ``aligned``: every window starts at a document (``data.align: document``);
* ``masked``: aligned, and attention stays inside each document (``model.gpt.document_mask``);
* ``window``: masked, with a sliding window of ``--window`` tokens (``attention_window``).

Every final checkpoint is then evaluated on the *same* two validation sets, the fixed stream
windows and the document-aligned rows, so the settings are compared on equal ground (each run's
own validation differs by construction). The seed sets both the model's and the data order's.
The packing statistics (tokens dropped per epoch) are printed for each prepared corpus::

    OMP_NUM_THREADS=2 python benches/document_windows.py --steps 300
    python benches/document_windows.py --packing-only --corpus big.jsonl   # only the statistics

Results go to ``--root``/results.jsonl, one line per run as it ends; the markdown table (mean
and sample standard deviation over seeds) is printed at the end.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "plain": ["--data.align", "stream"],
    "aligned": ["--data.align", "document"],
    "masked": ["--data.align", "document", "--model.gpt.document_mask", "true"],
    "window": ["--data.align", "document", "--model.gpt.document_mask", "true"],
}


def stdlib_documents(out: Path, max_bytes: int) -> Path:
    """A JSON-lines corpus: each top-level function or class of the standard library (tests
    left out) is one document, in sorted file order, until ``max_bytes`` of text."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib"}
    written = 0
    with out.open("w") as f:
        for path in sorted(stdlib.rglob("*.py")):
            if skip & set(path.parts) or written >= max_bytes:
                continue
            try:
                text = path.read_text("utf-8")
                tree = ast.parse(text)
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            lines = text.splitlines(keepends=True)
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
                    doc = "".join(lines[first - 1 : node.end_lineno])
                    if len(doc) > 40:
                        f.write(json.dumps({"text": doc}) + "\n")
                        written += len(doc.encode())
    return out


def packing_table(dataset: Path, blocks: list[int]) -> list[str]:
    """Rows of (corpus, block, documents, rows, dropped share) for each split and block size."""
    import numpy as np

    from nanolab.data.documents import pack_documents, unit_starts

    meta = json.loads((dataset / "meta.json").read_text())
    rows = []
    for split in ("train", "val"):
        tokens = np.memmap(dataset / f"{split}.bin", dtype=meta["dtype"], mode="r")
        start = time.perf_counter()
        starts = unit_starts(tokens, int(meta["eot_id"]))
        scan = time.perf_counter() - start
        for block in blocks:
            start = time.perf_counter()
            p = pack_documents(starts, len(tokens), block + 1)
            rows.append(
                f"| {dataset.name} {split} | {block} | {p.documents:,} | {len(tokens):,} | "
                f"{p.rows:,} | {p.dropped_tokens / p.total_tokens:.1%} | "
                f"{scan:.2f} + {time.perf_counter() - start:.2f} |"
            )
    return rows


def fit(name: str, root: Path, dataset: Path, seed: int, steps: int, extra: list[str]) -> dict:
    cmd = [
        sys.executable, "-m", "nanolab", "fit", "--config", str(ROOT / "configs" / "quickstart.yaml"),
        "--data.dataset_dir", str(dataset), "--data.source", "null",
        "--run.root", str(root), "--run.name", name, "--run.resume", "never",
        "--seed_everything", str(seed), "--data.seed", str(seed),
        "--trainer.max_steps", str(steps), "--run.eval_every_steps", str(steps),
        "--checkpoint.every_n_steps", str(steps), "--progress.refresh_rate", "0",
        "--downstream.suite", "null", "--model.schedule.warmup_steps", str(max(1, steps // 12)),
        *extra,
    ]  # fmt: skip
    start = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {res.returncode}): {res.stderr[-2000:]}")
    return {"wall_s": round(time.perf_counter() - start, 1)}


def evaluate(ckpt: Path, dataset: Path, windows: int) -> dict[str, float]:
    """Mean validation loss and bits per byte of a checkpoint on the stream windows and on the
    document-aligned rows of ``dataset`` (the same windows for every run)."""
    import torch

    from nanolab.data.datamodule import TokenDataModule
    from nanolab.model.checkpoint import load_checkpoint, model_from_checkpoint

    model = model_from_checkpoint(load_checkpoint(ckpt)).eval()
    gpt = model.config
    out = {}
    for align in ("stream", "document"):
        data = TokenDataModule(
            dataset_dir=str(dataset), source=None, block_size=gpt.block_size,
            micro_batch_size=16, val_windows=windows, align=align,
        )  # fmt: skip
        data.setup("validate")
        val = data.val_parts[0]
        keys = val.validation_keys(windows)
        losses = []
        with torch.no_grad():
            for i in range(0, len(keys), 16):
                x, y = val[keys[i : i + 16]]
                _, loss = model(x, y)
                losses.append((float(loss), len(x)))
        mean = sum(v * n for v, n in losses) / sum(n for _, n in losses)
        bytes_per_token = data.parts[0].val_bytes_per_token
        out[f"{align}_loss"] = mean
        out[f"{align}_bpb"] = mean / (bytes_per_token * math.log(2))
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| setting | val loss, stream windows | bpb, stream | val loss, aligned rows | "
        "bpb, aligned | wall (s) |",
        "|---|---|---|---|---|---|",
    ]
    for variant in VARIANTS:
        mine = [r for r in rows if r["variant"] == variant]
        if not mine:
            continue

        def cell(key: str, mine: list[dict] = mine) -> str:
            values = [r[key] for r in mine]
            sd = statistics.stdev(values) if len(values) > 1 else 0.0
            return f"{statistics.mean(values):.4f} ± {sd:.4f}"

        wall = statistics.mean(r["wall_s"] for r in mine)
        lines.append(
            f"| {variant} (n={len(mine)}) | {cell('stream_loss')} | {cell('stream_bpb')} | "
            f"{cell('document_loss')} | {cell('document_bpb')} | {wall:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=Path("runs") / "document_windows")
    p.add_argument("--corpus", type=Path, default=None, help="a .jsonl corpus (default: stdlib)")
    p.add_argument("--corpus-mb", type=float, default=8.0, help="size of the stdlib corpus")
    p.add_argument("--vocab", type=int, default=2048, help="BPE vocabulary")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--block", type=int, default=256, help="model.gpt.block_size")
    p.add_argument("--window", type=int, default=64, help="attention_window of 'window'")
    p.add_argument("--val-windows", type=int, default=128)
    p.add_argument("--packing-only", action="store_true", help="only the packing statistics")
    args = p.parse_args(argv)

    root = args.root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    corpus = args.corpus or stdlib_documents(root / "corpus.jsonl", int(args.corpus_mb * 1e6))
    dataset = root / f"data_{corpus.stem}"
    if not (dataset / "meta.json").exists():
        subprocess.run(
            [sys.executable, "-m", "nanolab", "prepare", str(corpus), "--tokenizer", "bpe",
             "--bpe-vocab-size", str(args.vocab), "-o", str(dataset)],
            check=True,
        )  # fmt: skip
    print("| corpus, split | block | documents | tokens | rows | dropped | scan + pack (s) |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(packing_table(dataset, sorted({128, args.block, 1024}))), flush=True)
    if args.packing_only:
        return 0

    VARIANTS["window"] = VARIANTS["masked"] + ["--model.gpt.attention_window", str(args.window)]
    common = ["--model.gpt.block_size", str(args.block), "--data.micro_batch_size", "16",
              "--data.val_windows", str(args.val_windows)]  # fmt: skip
    out = root / "results.jsonl"
    rows = []
    for seed in args.seeds:  # the settings alternate, so machine load hits all alike
        for variant, extra in VARIANTS.items():
            name = f"{variant}-seed{seed}"
            row = {"variant": variant, "seed": seed, "steps": args.steps}
            row.update(fit(name, root / "runs", dataset, seed, args.steps, common + extra))
            ckpt = root / "runs" / name / "checkpoints" / "last.ckpt"
            row.update(evaluate(ckpt, dataset, args.val_windows))
            rows.append(row)
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
