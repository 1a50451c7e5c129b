#!/usr/bin/env bash
# GPT-2 124M on one GPU in under 10 minutes: bf16, torch.compile, flash attention.
# Prints tokens/s, MFU and peak memory (nanolab vs the plain loop) and the estimator's predicted
# peak beside the measured one. Needs a prepared GPT-2-vocabulary dataset; without one it makes a
# BPE dataset (vocab 50257) from the bundled corpus, which is enough for speed and memory.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-data/bench_bpe}
MB=${MB:-16}
[ -f "$DATA/meta.json" ] || nanolab prepare bundled:shakespeare --tokenizer bpe --bpe-vocab-size 50257 -o "$DATA"
nanolab estimate --config configs/gpt2-124m.yaml --set data.micro_batch_size=$MB --json > /tmp/nanolab_estimate.json || true
nanolab bench --config configs/gpt2-124m.yaml --steps 120 --warmup 30 --rounds 2 \
  --set=--data.dataset_dir="$DATA" --set=--data.micro_batch_size=$MB \
  --set=--run.global_batch_tokens=$((MB * 1024 * 4)) --set=--run.eval_every_steps=100
python - <<'PY'
import json, glob
from nanolab.runlog import read_records
est = json.load(open("/tmp/nanolab_estimate.json")) if open("/tmp/nanolab_estimate.json").read().strip() else {}
print("estimator predicted peak (bytes):", est.get("total_bytes") or est.get("memory", {}).get("total_bytes"))
for path in sorted(glob.glob("runs/bench-*/metrics.jsonl")):
    train = [r for r in read_records(path) if r["event"] == "train"]
    if train:
        print(path, "peak allocated:", max(r.get("mem_allocated_bytes") or 0 for r in train),
              "MFU:", train[-1].get("mfu"))
PY
