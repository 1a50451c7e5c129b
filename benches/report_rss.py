"""Peak memory of ``nanolab report`` against the length of a run's log.

Writes one run whose ``metrics.jsonl`` holds ``--records`` train records shaped like a real
run's (a validation every 250 steps, a resume from step 1/3 of the way back), then the report
is measured from the shell::

    python benches/report_rss.py /tmp/rss --records 300000      # ~125 MB of log
    /usr/bin/time -v nanolab report /tmp/rss 2>&1 | grep 'Maximum resident'

The report reads the log as a stream, so its peak should not grow with ``--records``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def train_record(step: int, t0: float) -> dict:
    """One train record with the fields (and about the size) the JSONL callback writes."""
    loss = 2.0 + 8.0 / math.sqrt(step)
    return {
        "event": "train", "time": t0 + step * 0.1, "step": step, "epoch": 0,
        "tokens": step * 8192, "loss": loss, "lr": 6e-4, "grad_norm": 0.75 + 1 / step,
        "tokens_per_s": 81920.5, "mfu": 0.4123, "step_time_s": 0.1, "data_wait_s": 0.001,
        "peak_mem_gb": 12.25, "elapsed_s": round(step * 0.1, 3), "gpu_hours": step * 0.1 / 3600,
        "goodput": 0.9876, "cost": step * 0.1 / 3600 * 2.5,
    }  # fmt: skip


def write_log(run: Path, records: int) -> int:
    """The log of one resumed run; returns its size in bytes."""
    run.mkdir(parents=True, exist_ok=True)
    config = {"model": {"optimizer": {"lr": 6e-4}}, "trainer": {"max_steps": records},
              "seed_everything": 1}  # fmt: skip
    t0, resume_at = 1.7e9, records // 3
    with open(run / "metrics.jsonl", "w") as f:

        def put(record: dict) -> None:
            f.write(json.dumps(record) + "\n")

        put({"event": "start", "time": t0, "step": 0, "seed": 1, "config": config})
        for step in range(1, records + 1):
            put(train_record(step, t0))
            if step % 250 == 0:
                put({"event": "val", "time": t0 + step * 0.1, "step": step,
                     "tokens": step * 8192, "val_loss": 2.1 + 8.0 / math.sqrt(step)})  # fmt: skip
            if step == resume_at + 500:  # killed here, resumed from the checkpoint at resume_at
                put({"event": "start", "time": t0 + step * 0.1, "step": resume_at, "seed": 1,
                     "config": config, "resumed_from_step": resume_at})  # fmt: skip
                for again in range(resume_at + 1, step + 1):
                    put(train_record(again, t0))
        put({"event": "end", "time": t0 + records * 0.1, "step": records, "reason": "completed",
             "tokens": records * 8192})  # fmt: skip
    return (run / "metrics.jsonl").stat().st_size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="folder of runs to write (one run, 'long')")
    p.add_argument("--records", type=int, default=300_000, help="train records (steps)")
    args = p.parse_args()
    size = write_log(args.out / "long", args.records)
    print(f"{args.out / 'long' / 'metrics.jsonl'}: {size / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
