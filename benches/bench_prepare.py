"""``nanolab prepare`` on a big corpus: tokens/s and peak RSS at 1 and N workers, side by side with
a bare loop that calls the same tokenizer's ``encode_batch`` over the same text and writes nothing.

The corpus is built here, never committed: the public-domain texts in ``../shared/data`` (or any
``--text`` files) repeated up to each ``--sizes`` entry, as plain text (one file per ~64 MB) and,
with ``--format jsonl``, as JSON lines of ~4 KB documents. Peak RSS is sampled from /proc over
the whole process tree (the main process plus its workers) every 20 ms, so it is the memory the
machine really had to find.

    python benches/bench_prepare.py --sizes 100M,1G --workers 1,2 --tokenizer bpe
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
FILE_BYTES = 64 << 20


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def base_text(paths: list[Path]) -> str:
    parts = []
    for p in paths:
        raw = p.read_bytes()
        parts.append((gzip.decompress(raw) if p.suffix == ".gz" else raw).decode("utf-8"))
    return "\n".join(parts)


def build_corpus(folder: Path, text: str, size: int, fmt: str) -> int:
    """Repeat ``text`` into ``folder`` until ``size`` bytes; returns the bytes written."""
    folder.mkdir(parents=True, exist_ok=True)
    data = text.encode("utf-8")
    written, index = 0, 0
    while written < size:
        target = min(FILE_BYTES, size - written)
        path = folder / f"part-{index:05d}.{'txt' if fmt == 'txt' else 'jsonl'}"
        with open(path, "wb") as f:
            n = 0
            while n < target:
                if fmt == "txt":
                    piece = data[: target - n]
                    f.write(piece)
                    n += len(piece)
                else:
                    for start in range(0, len(text), 4096):
                        line = json.dumps({"text": text[start : start + 4096]}) + "\n"
                        f.write(line.encode())
                        n += len(line)
                        if n >= target:
                            break
        written += n
        index += 1
    return written


class TreeRSS:
    """Peak of the summed RSS of a process and all its descendants, sampled from /proc."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(entry))
        out, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo.extend(children.get(pid, []))
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            for pid in self._tree():
                try:
                    with open(f"/proc/{pid}/status") as f:
                        for line in f:
                            if line.startswith("VmRSS:"):
                                total += int(line.split()[1]) * 1024
                except OSError:
                    pass
            self.peak = max(self.peak, total)
            time.sleep(0.02)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_measured(cmd: list[str], env: dict[str, str]) -> tuple[float, int, str]:
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = TreeRSS(proc.pid)
    out, err = proc.communicate()
    peak = sampler.stop()
    secs = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err}")
    return secs, peak, out


BARE = r"""
import json, sys, time
from pathlib import Path
from nanolab.data.tokenizers import tokenizer_from_spec
spec = json.loads(Path(sys.argv[1]).read_text())
tok = tokenizer_from_spec(spec)
tokens = 0
for path in sys.argv[2:]:
    fmt_jsonl = path.endswith(".jsonl")
    with open(path, encoding="utf-8") as f:
        while True:
            lines = f.readlines(1 << 20)
            if not lines:
                break
            if fmt_jsonl:
                texts = [json.loads(l)["text"] for l in lines]
            else:
                blob = "".join(lines)
                texts = [blob[i : i + 16384] for i in range(0, len(blob), 16384)]
            tokens += sum(len(a) for a in tok.encode_batch(texts))
print(tokens)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100M", help="corpus sizes, e.g. 100M,1G")
    parser.add_argument("--workers", default="1,2", help="worker counts to compare")
    parser.add_argument("--tokenizer", default="bpe", help="bytes, chars, bpe or a tokenizer.json")
    parser.add_argument("--format", default="txt", choices=["txt", "jsonl"])
    parser.add_argument("--text", nargs="*", type=Path, default=None, help="source texts")
    parser.add_argument("--keep", type=Path, default=None, help="build the corpus here, keep it")
    args = parser.parse_args()

    texts = args.text or sorted(SHARED.glob("*.txt.gz"))
    if not texts:
        raise SystemExit("no source texts: pass --text FILES (../shared/data is not here)")
    text = base_text(texts)
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    nanolab = [sys.executable, "-m", "nanolab", "prepare"]
    rows = []
    try:
        for size_text in args.sizes.split(","):
            corpus = root / f"corpus-{size_text}-{args.format}"
            nbytes = build_corpus(corpus, text, parse_size(size_text), args.format)
            files = sorted(str(p) for p in corpus.iterdir())
            # The tokenizer once (bpe trains on the default bounded sample), then reused so
            # every measured run encodes with the same one.
            tok_dir = root / f"tok-{size_text}"
            subprocess.run(
                [*nanolab, files[0], "-o", str(tok_dir), "--tokenizer", args.tokenizer, "-q"],
                env=env,
                check=True,
                capture_output=True,
            )
            meta = json.loads((tok_dir / "meta.json").read_text())
            spec = meta["tokenizer"]
            tokenizer_arg = args.tokenizer
            if spec["name"] in ("bpe", "hf"):
                tokenizer_arg = str(tok_dir / "tokenizer.json")
                spec = {**spec, "json": (tok_dir / "tokenizer.json").read_text()}
            spec_path = root / "spec.json"
            spec_path.write_text(json.dumps(spec))
            for round_ in range(2):  # alternate: bare, w1, w2, ... twice, to see the spread
                secs, peak, out = run_measured(
                    [sys.executable, "-c", BARE, str(spec_path), *files], env
                )
                tokens = int(out.strip())
                rows.append((size_text, "bare encode_batch", round_, secs, peak, tokens, nbytes))
                for w in args.workers.split(","):
                    out_dir = root / f"ds-{size_text}-{w}"
                    secs, peak, _ = run_measured(
                        [
                            *nanolab,
                            *files,
                            "-o",
                            str(out_dir),
                            "--tokenizer",
                            tokenizer_arg,
                            "--workers",
                            w,
                            "--force",
                            "-q",
                        ],
                        env,
                    )
                    m = json.loads((out_dir / "meta.json").read_text())
                    tokens = m["train_tokens"] + m["val_tokens"]
                    rows.append(
                        (size_text, f"prepare --workers {w}", round_, secs, peak, tokens, nbytes)
                    )
                    shutil.rmtree(out_dir)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)

    print(f"\ntokenizer {args.tokenizer}, format {args.format}, {os.cpu_count()} cores")
    print(
        f"{'corpus':>7} {'what':<22} {'round':>5} {'secs':>8} {'MB/s':>7} {'Mtok/s':>7} {'peak RSS MB':>11}"
    )
    for size_text, what, round_, secs, peak, tokens, nbytes in rows:
        print(
            f"{size_text:>7} {what:<22} {round_:>5} {secs:8.1f} {nbytes / secs / 1e6:7.1f} "
            f"{tokens / secs / 1e6:7.2f} {peak / 1e6:11.0f}"
        )
    print("\nratio prepare --workers 1 / bare (tokens/s), per round:")
    for size_text in args.sizes.split(","):
        for round_ in range(2):
            bare = [
                r for r in rows if r[0] == size_text and r[2] == round_ and r[1].startswith("bare")
            ]
            one = [r for r in rows if r[0] == size_text and r[2] == round_ and r[1].endswith(" 1")]
            if bare and one:
                print(f"  {size_text} round {round_}: {bare[0][3] / one[0][3]:.3f}")


if __name__ == "__main__":
    main()
