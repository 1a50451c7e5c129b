"""Host-device synchronisations per steady optimizer step of a real ``nanolab fit``: at most one.

A sync makes the host wait for the device's whole queued step (``.item()``, ``.tolist()``,
``float()`` of a tensor, ``.cpu()``, ``torch.cuda.synchronize`` ...), so a GPU idles while the
host catches up. They are counted by instrumenting torch (:mod:`nanolab.callbacks.syncs`) in the
fit process, from step 3 on; on a CPU every tensor is host memory, so what is counted is what
would wait on a GPU, where the same code runs with device tensors.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import torch
from conftest import QUICKSTART, nanolab_here, tiny_overrides, write_config

from nanolab.callbacks.readout import StepReadout
from nanolab.callbacks.syncs import ENV, SyncCounter


def tiny_fit(
    tmp_path,
    char_dataset,
    *,
    every: int,
    micro_batches: int = 1,
    refresh: int | None = None,
    env: dict[str, str] | None = None,
    **groups: dict,
) -> subprocess.CompletedProcess:
    """A 12-step fit of a 1-layer quickstart model, every step logged, a validation and a save
    every ``every`` steps, ``micro_batches`` per step; the bar's plain line every ``refresh``
    steps (None: hidden); ``groups``: more config sections (``budget={...}``)."""
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=12)
    cfg["model"]["gpt"]["n_layer"] = 1
    cfg["run"].update(eval_every_steps=every, global_batch_tokens=micro_batches * 4 * 32)
    cfg.update(log={"every_n_steps": 1}, checkpoint={"every_n_steps": every}, **groups)
    if refresh is not None:
        cfg["progress"] = {"refresh_rate": refresh, "plain_every_s": 0}
        cfg["trainer"]["enable_progress_bar"] = True
    res = nanolab_here(
        "fit", "--config", str(QUICKSTART), "--config", str(write_config(tmp_path / "c.yaml", cfg)),
        cwd=tmp_path, env=env or {},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def train_records(tmp_path) -> list[dict]:
    """The ``train`` records of :func:`tiny_fit`'s run log, in file order."""
    records = [json.loads(line) for line in (tmp_path / "runs/tiny/metrics.jsonl").open()]
    return [r for r in records if r["event"] == "train"]


def test_a_fit_takes_one_sync_per_step_and_none_per_micro_batch(tmp_path, char_dataset):
    """The quickstart's callbacks (run log, throughput, progress, budget, divergence, spike,
    preemption, checkpoint, in-loop tasks), every step logged and the progress bar's plain line
    refreshed every step, two micro-batches per step: every steady step costs exactly one sync,
    the step's one read (:mod:`nanolab.callbacks.readout`), and no micro-batch costs any.

    Mutations caught (the tree before this test had all of them: 9 per step, 2 per micro-batch):
    ``self.log("train/loss", loss, prog_bar=True)`` (Lightning ``.item()``s progress-bar values
    whenever it gathers metrics: 5 per step, 2 per micro-batch); the progress bar, the spike
    guard or the divergence stop reading its value itself (one more per step each).
    """
    out = tmp_path / "syncs.json"
    res = tiny_fit(tmp_path, char_dataset, every=6, micro_batches=2, refresh=1, env={ENV: str(out)})
    assert "step 5/12" in res.stdout  # the bar's line of every step was printed
    counts = json.loads(out.read_text())
    steps = counts["steps"]
    assert [s["step"] for s in steps] == list(range(3, 13))
    steady = counts["steady_per_step"]
    assert len(steady) >= 6, steps  # steps 7 and 12 hold an evaluation and a save
    assert steady == [1] * len(steady), counts["steady_sources"]
    assert len(counts["micro_batches"]) >= 6 and set(counts["micro_batches"]) == {0}, counts
    (where,) = counts["steady_sources"]
    assert where.startswith("nanolab/callbacks/readout.py")
    train = train_records(tmp_path)
    assert len(train) == 12 and all(r["loss"] > 0 and r["grad_norm"] > 0 for r in train)


def test_the_counter_counts_what_waits_and_once_per_transfer():
    x = torch.ones(3)
    with SyncCounter().counting() as counter:
        x.sum().item()
        float(x[0])
        bool(x.any())
        x.sum().cpu().tolist()  # one transfer, then a host read
        x.to("cpu")
        x.to(torch.device("cpu"))  # on a CPU run: the training device, not a transfer
        x.to(torch.float64)
        x + 1
    assert counter.count == 5
    assert all(k.startswith("tests/test_syncs.py") for k in counter.sources)
    assert x.item.__name__ == "item" and "wrapper" not in repr(torch.Tensor.item)  # put back


def test_the_readout_defers_a_copy_nobody_waits_for():
    """The GPU path (``defer``), on a CPU: values nobody needs now arrive a step later, one read
    for everything put; a value needed now brings the earlier ones with it."""
    readout = StepReadout(defer=True)
    readout.begin(1)
    readout.put("a", torch.tensor(1.0))
    readout.put("b", torch.tensor([float("nan")]))
    readout.put("n", 3)
    readout.transfer()
    assert readout.values is None and readout.completed == []
    readout.begin(2)
    readout.put("a", torch.tensor(2.0))
    readout.transfer()
    assert readout.values is None
    ((step, values),) = readout.completed
    assert step == 1 and values["a"] == 1.0 and values["n"] == 3.0 and values["b"] != values["b"]
    readout.begin(3)
    readout.put("a", torch.tensor(3.0), now=True)
    readout.transfer()
    assert readout.values == {"a": 3.0}
    assert [s for s, _ in readout.completed] == [2, 3]
    readout.begin(4)
    readout.put("a", torch.tensor(4.0))
    readout.transfer()
    assert readout.drain() == [(4, {"a": 4.0})]


@pytest.mark.parametrize("defer", [None, False])
def test_the_readout_reads_at_once_off_the_gpu(defer):
    readout = StepReadout(defer=defer)
    readout.begin(7)
    readout.put("a", torch.tensor(0.5))
    readout.put("skip", torch.ones(2))  # not a scalar: not read
    readout.transfer()
    assert readout.values == {"a": 0.5} and readout.completed == [(7, {"a": 0.5})]


def test_a_run_log_written_a_step_late_holds_the_same_records_in_the_same_order(
    tmp_path, char_dataset
):
    """The GPU path, on a CPU (``NANOLAB_READOUT_DEFER=1``): the run log no longer makes the
    host wait for the device at every record; a train record's loss and gradient norm arrive
    with the next step's transfer and the record is written then. The file must be the one the
    blocking path writes: every step's train record with the same loss and gradient norm, each
    before the validation and checkpoint records of its step, the end record last; and the
    steady steps cost no sync at all. Mutations caught: the pending record dropped at a
    validation or at the end (a missing step), written after the next record (out of order),
    a value read by the drain lost to the divergence stop or spike guard (their counts differ).
    """
    from nanolab.callbacks.readout import DEFER_ENV

    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=12)
    cfg["model"]["gpt"]["n_layer"] = 1
    cfg["run"].update(eval_every_steps=5, global_batch_tokens=2 * 4 * 32)
    cfg.update(log={"every_n_steps": 1}, checkpoint={"every_n_steps": 5})
    config = str(write_config(tmp_path / "c.yaml", cfg))
    logs, counts = {}, {}
    for defer in ("0", "1"):
        out = tmp_path / f"syncs{defer}.json"
        res = nanolab_here(
            "fit", "--config", str(QUICKSTART), "--config", config, "--run.name", f"d{defer}",
            cwd=tmp_path, env={ENV: str(out), DEFER_ENV: defer},
        )  # fmt: skip
        assert res.returncode == 0, res.stderr[-3000:]
        logs[defer] = [
            json.loads(line) for line in (tmp_path / f"runs/d{defer}/metrics.jsonl").open()
        ]
        counts[defer] = json.loads(out.read_text())

    def shape(records):
        return [(r["event"], r.get("step")) for r in records if r["event"] != "start"]

    assert shape(logs["1"]) == shape(logs["0"])
    events = shape(logs["1"])
    assert events[-1][0] == "end"
    for event, step in events:
        if event in ("val", "checkpoint"):
            assert events.index(("train", step)) < events.index((event, step))
    train = {d: [r for r in logs[d] if r["event"] == "train"] for d in logs}
    assert [r["step"] for r in train["1"]] == list(range(1, 13))
    for a, b in zip(train["0"], train["1"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)
    assert set(counts["0"]["steady_per_step"]) == {1}
    assert set(counts["1"]["steady_per_step"]) == {0}, counts["1"]["steady_sources"]


@pytest.mark.parametrize("lag", [1, 3])
def test_the_progress_bar_refreshes_without_waiting_for_the_device(tmp_path, char_dataset, lag):
    """The GPU path on a CPU (``NANOLAB_READOUT_DEFER``), each step's copy finished ``lag``
    transfers later (a device 1 or 3 steps behind the host), the bar's plain line every fourth
    step: a device that keeps up is never waited for but at the last step; one 3 steps behind
    is waited for once a step, for the copy of the step before (the host runs at most one step
    ahead). Each line shows the loss of the step before (the last line its own step's, read
    then). Mutations caught: the bar asking for its loss now (a sync every refresh), the bar
    reading only the values it put itself (the line of step 8 shows step 4's loss), a copy left
    in flight past the next step (with lag 3 the line of step 8 shows step 5's)."""
    from nanolab.callbacks.readout import DEFER_ENV

    out = tmp_path / "syncs.json"
    res = tiny_fit(
        tmp_path, char_dataset, every=100, refresh=4, env={ENV: str(out), DEFER_ENV: str(lag)}
    )
    counts = json.loads(out.read_text())
    syncs = {s["step"]: s["syncs"] for s in counts["steps"]}
    steady = 0 if lag == 1 else 1
    assert syncs == {**dict.fromkeys(range(3, 12), steady), 12: 1}, counts["steady_sources"]
    assert all(k.startswith("nanolab/callbacks/readout.py") for k in counts["steady_sources"])
    train = train_records(tmp_path)
    assert [r["step"] for r in train] == list(range(1, 13))  # all written, in order
    loss = {r["step"]: r["loss"] for r in train}
    shown = {
        int(m[1]): float(m[2])
        for m in re.finditer(r"^step (\d+)/12 \(\d+%\)\s+loss ([\d.]+)", res.stdout, re.M)
    }
    assert sorted(shown) == [4, 8, 12], res.stdout[-2000:]
    for step, value in shown.items():
        arrived = step if step == 12 else step - 1
        assert value == pytest.approx(loss[arrived], abs=1e-4), (step, value)


@pytest.mark.parametrize("lag", [1, 3])
def test_a_steps_values_arrive_at_the_next_step_however_far_behind_the_device_runs(lag):
    """The arrival rule: step k's deferred values arrive at step k + 1's transfer, whatever
    that step puts (tensors, host numbers only, nothing), on a device 1 or 3 steps behind the
    host; the host waits (a counted sync) only for a copy not finished by then. A step that
    puts no device tensor is read at its own transfer (nothing to copy). So every rank of a
    multi-GPU run takes the all-reduced flags at the same step, however far each one's host ran
    ahead. Mutation caught: a copy that is not finished yet left in flight for a later step (it
    arrived at step k + lag: the ranks of a diverged DDP run stopped at different steps, and the
    one that stopped first left the other waiting in an all-reduce until the timeout)."""
    readout = StepReadout(defer=True, lag=lag)
    arrivals: dict[int, list[int]] = {}
    puts = {1: torch.tensor(1.0), 2: 2, 3: None, 4: torch.tensor(4.0), 5: torch.tensor(5.0)}
    with SyncCounter().counting() as counter:
        for step, value in puts.items():
            readout.begin(step)
            if value is not None:
                readout.put("a", value)
            readout.transfer()
            arrivals[step] = [s for s, _ in readout.completed]
    assert arrivals == {1: [], 2: [1, 2], 3: [3], 4: [], 5: [4]}
    assert dict(readout.completed)[4] == {"a": 4.0}
    # Only the copies of steps 1 and 4 can be unfinished at the next step.
    waits = 0 if lag == 1 else 2
    assert readout.waits == counter.count == waits, counter.sources
    assert readout.drain() == [(5, {"a": 5.0})]


@pytest.mark.slow  # a row of a kind the default run covers (the suite's time)
def test_a_run_stopped_early_ends_its_bar_on_its_last_steps_loss(tmp_path, char_dataset):
    """A token budget stops the run before step 12 (and after the step-8 refresh), on a device
    3 steps behind: nothing was read at once, so the last steps' losses are still in flight at
    the end; the bar's last line drains them and shows the last step's. Mutation caught: the
    last line showing the newest loss that had arrived at the last refresh (step 5's)."""
    from nanolab.callbacks.readout import DEFER_ENV

    budget = {"max_tokens": 10 * 4 * 32, "check_every_n_steps": 1}
    res = tiny_fit(
        tmp_path, char_dataset, every=100, refresh=4, env={DEFER_ENV: "3"}, budget=budget
    )
    loss = {r["step"]: r["loss"] for r in train_records(tmp_path)}
    end = max(loss)
    assert 8 < end < 12, sorted(loss)  # stopped by the budget, after the step-8 refresh
    last = re.findall(rf"^step {end}/12 \(\d+%\)\s+loss ([\d.]+)", res.stdout, re.M)
    assert last and float(last[-1]) == pytest.approx(loss[end], abs=1e-4), res.stdout[-1500:]
