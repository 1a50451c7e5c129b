"""The deferred step readout on several ranks: every rank takes a step's values at the same step.

On a GPU the step callbacks' device scalars (the divergence stop's all-reduced flags, the spike
guard's all-reduced loss) reach the host a step late (:mod:`nanolab.callbacks.readout`). Each rank
has its own host and device, and how far a host runs ahead of its device differs from rank to
rank; were a step's values taken when its copy happened to be done, one rank would act on them (stop,
roll back) a step before another, and the other would wait in the next all-reduce alone until
the collective's timeout. Here a real 2-process DDP fit on a CPU plays that: its ranks' stand-in
devices run 1 and 3 steps behind their hosts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_overrides, write_config

from nanolab.callbacks.divergence import EXIT_DIVERGED
from nanolab.callbacks.readout import DEFER_ENV
from nanolab.runlog import read_records

#: ``nanolab fit`` with each rank's stand-in device ``1 + 2 * LOCAL_RANK`` steps behind its host
#: (one environment variable cannot say that per rank; Lightning starts rank 1 with this same
#: script), each rank's exit status written to ``rank<N>.exit``.
WRAPPER = """
import os, sys
from pathlib import Path
import nanolab.callbacks.clock as clock
rank = int(os.environ.get("LOCAL_RANK", "0"))
clock.lag_from_env = lambda: 1 + 2 * rank
from nanolab.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
Path(f"rank{rank}.exit").write_text(str(code))
sys.exit(code)
"""


@pytest.mark.slow  # two DDP processes on a CPU (~40-70 s); the arrival rule's unit test is in test_syncs.py
def test_a_ddp_run_whose_ranks_devices_lag_differently_stops_diverged_on_every_rank(
    tmp_path: Path, char_dataset: Path
) -> None:
    """lr 1e30: the loss is NaN from step 2 on every rank. With the flags taken at the step
    their copy happened to be done, rank 0 stopped at step 3 and rank 1 (3 steps behind)
    trained on into an all-reduce rank 0 never joined: a hang until the timeout, no ``end``
    record. Now both take step k's flags at step k + 1: both stop at step 3 and exit 3."""
    cfg = tiny_overrides(
        char_dataset, tmp_path / "runs", trainer__max_steps=12, run__name="ranks",
        run__eval_every_steps=100, checkpoint__every_n_steps=100,
    )  # fmt: skip
    cfg["trainer"].update(precision="32-true", accelerator="cpu")
    cfg["model"]["optimizer"] = {"lr": 1e30}
    cfg["divergence"] = {"patience": 1}
    config = write_config(tmp_path / "ranks.yaml", cfg)
    ddp = Path(__file__).resolve().parents[1] / "configs" / "strategy" / "ddp.yaml"
    (tmp_path / "wrap.py").write_text(WRAPPER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", DEFER_ENV: "1"}
    proc = subprocess.Popen(
        [sys.executable, "wrap.py", "fit", "--config", str(config), "--config", str(ddp),
         "--trainer.devices", "2", "--run.global_batch_tokens", "256"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the run hung (a rank left alone in a collective):\n{output[-3000:]}")
    assert proc.returncode == EXIT_DIVERGED, output[-3000:]
    exits = {p.name: p.read_text() for p in tmp_path.glob("rank*.exit")}
    assert exits == {"rank0.exit": str(EXIT_DIVERGED), "rank1.exit": str(EXIT_DIVERGED)}, output
    (end,) = read_records(tmp_path / "runs" / "ranks" / "metrics.jsonl", "end")
    assert end["reason"] == "diverged" and end["diverged_step"] == 2, end
    assert end["step"] == 3, end  # step 2's flags, taken at step 3 on both ranks
