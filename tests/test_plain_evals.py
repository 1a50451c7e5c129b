"""The bench's plain loop validates, scores tasks and saves at the steps ``nanolab fit`` does, so
the end-to-end ratio compares the same work (nanolab/bench/plain_evals.py)."""

from __future__ import annotations

import json

import pytest
from conftest import nanolab_here, tiny_overrides, write_config


@pytest.fixture
def fitted(tmp_path, char_dataset):
    """A 7-step tiny fit that validates every 2 steps (10 windows: batches of 4, 4 and 2), scores
    the cloze after every 2nd validation and on the final model, and saves every 3 steps (and
    at the end)."""
    import yaml

    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=7)
    cfg["run"]["eval_every_steps"] = 2
    cfg["data"]["val_windows"] = 10  # batches of 4, 4 and 2: Lightning weighs them by size
    cfg["downstream"] = {"suite": "builtin:shakespeare", "every_n_evals": 2, "limit": 12}
    cfg["checkpoint"] = {"every_n_steps": 3, "keep_last": 2}
    out = nanolab_here("fit", "--config", str(write_config(tmp_path / "t.yaml", cfg)), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    run = tmp_path / "runs" / "tiny"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return yaml.safe_load((run / "config.yaml").read_text()), records, run


def test_the_plain_loop_validates_scores_and_saves_where_fit_does(fitted, tmp_path):
    """Same steps, same numbers: the validation loss at steps 2, 4, 6 and 7 (the last step is
    always validated) and the cloze scores at
    steps 4 (the 2nd validation) and 7 (the final model) equal ``fit``'s, the saves fall on
    steps 3, 6 and 7, the newest 2 kept and step 3 too (the spike guard's file ageing into the
    one it rolls back to), ``last.ckpt`` the newest, and the steps
    followed by that work are named so the bench leaves their intervals out of the steady rate.

    Mutations caught: validating on other windows or averaging the batches unweighted (the losses differ), scoring tasks after
    every validation (steps 2, 4, 6, 7), no final save (step 7 missing), rotation keeping
    them all."""
    import torch

    from nanolab.bench.plain_loop import train

    config, records, run = fitted
    saves = tmp_path / "plain-checkpoints"
    plain = train(config, 7, torch.device("cpu"), checkpoint_dir=saves)

    fit_val = {r["step"]: r["val/loss"] for r in records if r["event"] == "val"}
    assert [s for s, _ in plain["val_losses"]] == sorted(fit_val) == [2, 4, 6, 7]
    for step, loss in plain["val_losses"]:
        assert loss == pytest.approx(fit_val[step], rel=1e-6, abs=1e-6), step

    fit_tasks = {r["step"]: r for r in records if r["event"] == "tasks"}
    assert [s for s, _ in plain["task_scores"]] == sorted(fit_tasks) == [4, 7]
    for step, scores in plain["task_scores"]:
        compared = [k for k in scores if k.startswith("tasks/") and k != "tasks/seconds"]
        assert any(k.endswith("/acc") for k in compared)
        assert scores["tasks/shakespeare-cloze/n"] == 12
        assert {k: scores[k] for k in compared} == {k: fit_tasks[step][k] for k in compared}

    fit_saves = sorted(p.name for p in (run / "checkpoints").glob("step-*.ckpt"))
    assert sorted(p.name for p in saves.glob("step-*.ckpt")) == fit_saves
    assert fit_saves == ["step-00000003.ckpt", "step-00000006.ckpt", "step-00000007.ckpt"]
    newest = saves / "step-00000007.ckpt"
    assert (saves / "last.ckpt").stat().st_ino == newest.stat().st_ino
    state = torch.load(newest, weights_only=True)
    assert state["step"] == 7 and set(state) == {"model", "optimizer", "scheduler", "step"}
    assert not list(saves.glob("*.tmp"))

    assert plain["busy_steps"] == [2, 3, 4, 6, 7]  # 7: its validation, after the timed steps
    # each kind of work timed under the end record's names, for the bench's comparison
    assert set(plain["time_breakdown"]) == {"eval_s", "tasks_s", "checkpoint_s"}
    assert all(seconds > 0 for seconds in plain["time_breakdown"].values())


def test_the_cadence_is_read_from_the_resolved_config(fitted):
    from nanolab.bench.plain_evals import Cadence

    config, _, _ = fitted
    cadence = Cadence.of(config)
    assert (cadence.eval_every, cadence.val_windows, cadence.save_every) == (2, 10, 3)
    assert (cadence.suite, cadence.tasks_every_n_evals, cadence.tasks_limit) == (
        "builtin:shakespeare", 2, 12,
    )  # fmt: skip
    assert cadence.keep_last == 2 and cadence.save_at_end and cadence.save_last
    quiet = {"downstream": {"suite": None}, "checkpoint": {"every_n_steps": None}}
    off = Cadence.of({**config, **quiet})
    assert off.suite is None and off.save_every is None


def test_limit_val_batches_is_followed_as_lightning_reads_it(fitted, tmp_path):
    """An int caps the validation batches, a fraction rounds down, 0 turns validation off (the
    tasks then score the final model only, as ``fit`` does)."""
    import torch

    from nanolab.bench.plain_evals import limited
    from nanolab.bench.plain_loop import train

    assert [limited(4, x) for x in (None, 2, 9, 0.5, 0.3, 1.0, 0, 0.0)] == [4, 2, 4, 2, 1, 4, 0, 0]
    config, _, _ = fitted
    off = {**config, "trainer": {**config["trainer"], "limit_val_batches": 0}}
    plain = train(off, 7, torch.device("cpu"), checkpoint_dir=tmp_path / "saves")
    assert plain["val_losses"] == [] and [s for s, _ in plain["task_scores"]] == [7]
    assert plain["busy_steps"] == [3, 6]
    no_link = {**config, "checkpoint": {**config["checkpoint"], "save_last": False}}
    unlinked = train(no_link, 3, torch.device("cpu"), checkpoint_dir=tmp_path / "unlinked")
    assert unlinked["busy_steps"] == [2, 3] and not (tmp_path / "unlinked" / "last.ckpt").exists()
    half = {**config, "trainer": {**config["trainer"], "limit_val_batches": 2}}
    first_two = train(half, 2, torch.device("cpu"), checkpoint_dir=tmp_path / "half")
    every = train(config, 2, torch.device("cpu"), checkpoint_dir=tmp_path / "all")
    assert first_two["val_losses"][0][1] != pytest.approx(every["val_losses"][0][1], rel=1e-6)
