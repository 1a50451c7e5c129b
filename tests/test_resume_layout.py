"""Resuming on another number of devices: the restored counters, the line that says so, and
what cannot move (a DeepSpeed folder). The end-to-end runs (DDP 2 -> 1 and 1 -> 2 continue the
run exactly) are ``test_training.py::test_resume_on_another_device_count_continues_the_same_run``."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanolab.data.skips import read_ledger
from nanolab.errors import RunConfigError
from nanolab.training.resume import (
    ResumeError,
    check_deepspeed_world_size,
    describe_layout_change,
    realign_progress,
)


def checkpoint(step: int, processed: int) -> dict:
    counts = {
        "ready": processed,
        "started": processed,
        "processed": processed,
        "completed": processed,
    }
    progress = {"total": dict(counts), "current": dict(counts), "is_last_batch": False}
    return {"global_step": step, "loops": {"fit_loop": {"epoch_loop.batch_progress": progress}}}


def test_counters_follow_this_launchs_accumulation() -> None:
    saved_on_two = checkpoint(step=3, processed=3)  # 2 devices, accumulation 1
    assert realign_progress(saved_on_two, accumulate=2)
    progress = saved_on_two["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    assert progress["total"]["processed"] == progress["current"]["ready"] == 6
    same = checkpoint(step=3, processed=6)
    assert not realign_progress(same, accumulate=2)  # the same layout: untouched


def test_the_layout_line() -> None:
    two = {"world_size": 2, "accumulate": 1, "micro_batch_size": 4}
    one = {"world_size": 1, "accumulate": 2, "micro_batch_size": 4}
    assert "the same global batch, and the same data order" in describe_layout_change(two, one)
    smaller = {"world_size": 1, "accumulate": 1, "micro_batch_size": 4}
    assert "global batch changes (8 -> 4 windows per step)" in describe_layout_change(two, smaller)
    assert describe_layout_change(two, dict(two)) is None
    assert describe_layout_change(None, two) is None  # an older checkpoint says nothing


def test_a_deepspeed_folder_on_another_rank_count_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "step-00000010.ckpt" / "checkpoint"
    folder.mkdir(parents=True)
    for rank in (0, 1):
        (folder / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
    check_deepspeed_world_size(folder.parent, 2)
    with pytest.raises(ResumeError, match="saved on 2 data-parallel ranks and this launch has 1"):
        check_deepspeed_world_size(folder.parent, 1)
    check_deepspeed_world_size(tmp_path / "plain.ckpt", 1)  # a file reshards: nothing to say


def test_a_checkpoint_the_strategy_cannot_read_is_refused(tmp_path: Path) -> None:
    """Resuming across strategy families ended in a traceback on every rank, after
    config.yaml was rewritten: now one line before anything is written."""
    from nanolab.training.resume import check_checkpoint_format

    deepspeed = tmp_path / "step-00000010.ckpt" / "checkpoint"
    deepspeed.mkdir(parents=True)
    (deepspeed / "mp_rank_00_model_states.pt").write_bytes(b"")
    dcp = tmp_path / "step-00000012.ckpt"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"")
    plain = tmp_path / "step-00000014.ckpt"
    plain.write_bytes(b"")
    check_checkpoint_format(deepspeed.parent, "deepspeed")
    check_checkpoint_format(dcp, "fsdp2")
    for kind in ("single", "ddp", "fsdp2"):
        check_checkpoint_format(plain, kind)
        with pytest.raises(ResumeError, match="is a DeepSpeed checkpoint folder"):
            check_checkpoint_format(deepspeed.parent, kind)
    with pytest.raises(ResumeError, match="only FSDP reads"):
        check_checkpoint_format(dcp, "ddp")
    with pytest.raises(ResumeError, match="one-file checkpoint, which DeepSpeed cannot resume"):
        check_checkpoint_format(plain, "deepspeed")


def test_a_one_device_run_resumed_under_deepspeed_is_refused_before_any_write(
    tmp_path: Path, char_dataset: Path
) -> None:
    from conftest import QUICKSTART, nanolab_here, tiny_overrides, write_config

    pytest.importorskip("deepspeed")
    cfg = write_config(tmp_path / "t.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    base = ["fit", "--config", str(QUICKSTART), "--config", str(cfg)]
    assert nanolab_here(*base, "--trainer.max_steps", "2", cwd=tmp_path).returncode == 0
    run = tmp_path / "runs" / "tiny"
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    strategy = str(QUICKSTART.parent / "strategy" / "deepspeed_stage2.yaml")
    res = nanolab_here(*base, "--config", strategy, "--trainer.max_steps", "4", cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "one-file checkpoint, which DeepSpeed cannot resume" in res.stderr
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_a_resume_the_checkpoint_restore_refuses_leaves_the_run_as_it_was(
    tmp_path: Path, char_dataset: Path
) -> None:
    """Another optimizer is refused from the checkpoint's record before anything is written
    (the rule ``queue add`` asks too), and again when Lightning restores the checkpoint: the
    run's ``config.yaml`` (and every other file) is still the one it trained with, not the
    refused launch's.

    Mutation caught: the early refusal gone and ``RunConfigWriter`` writing at ``setup`` again
    (config.yaml then names muon)."""
    from conftest import QUICKSTART, nanolab_here, tiny_overrides, write_config

    cfg = write_config(tmp_path / "t.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    base = ["fit", "--config", str(QUICKSTART), "--config", str(cfg)]
    assert nanolab_here(*base, "--trainer.max_steps", "2", cwd=tmp_path).returncode == 0
    run = tmp_path / "runs" / "tiny"
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    res = nanolab_here(*base, "--model.optimizer.name", "muon", cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "checkpoint was trained with 'adamw'" in res.stderr
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_a_changed_learning_rate_on_resume_is_said_and_the_checkpoints_kept(
    tmp_path: Path, char_dataset: Path
) -> None:
    """The optimizer and schedule state come back with the checkpoint, so a new
    ``model.optimizer.lr`` cannot take effect: the resume says so in one line, trains with the
    checkpoint's rate, and its own checkpoints record the rate it trained with."""
    import torch
    from conftest import QUICKSTART, nanolab_here, tiny_overrides, write_config

    from nanolab.runlog import read_records

    cfg = write_config(tmp_path / "t.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    base = ["fit", "--config", str(QUICKSTART), "--config", str(cfg)]
    assert nanolab_here(*base, "--trainer.max_steps", "4", cwd=tmp_path).returncode == 0
    proc = nanolab_here(*base, "--model.optimizer.lr", "0.05", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    warned = [line for line in proc.stderr.splitlines() if "resuming keeps" in line]
    assert len(warned) == 1 and "model.optimizer.lr 0.003 (not 0.05)" in warned[0]
    lrs = {
        r["step"]: r["lr"]
        for r in read_records(tmp_path / "runs" / "tiny" / "metrics.jsonl", "train")
    }
    assert max(lrs.values()) <= 0.003 + 1e-12
    last = torch.load(tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["nanolab"]["optimizer"]["lr"] == 0.003
    # The run's files name what it trained with, so report groups it with its seeds.
    import yaml

    saved = yaml.safe_load((tmp_path / "runs" / "tiny" / "config.yaml").read_text())
    assert saved["model"]["optimizer"]["lr"] == 0.003
    starts = list(read_records(tmp_path / "runs" / "tiny" / "metrics.jsonl", "start"))
    assert starts[-1]["config"]["model"]["optimizer"]["lr"] == 0.003


def test_a_changed_seed_on_resume_is_said_and_the_run_goes_on_in_its_own_order(
    tmp_path: Path, char_dataset: Path
) -> None:
    """``--data.seed`` and ``--seed_everything`` changed on a resume: the rest of the epoch was
    drawn from another window order (windows twice, others never) with no word, and the run's
    files took the new seed (report grouped it with that seed's runs). The resume keeps the
    checkpoint's seeds, says so, and trains the steps an uninterrupted run trains."""
    import yaml
    from conftest import nanolab_here, tiny_overrides, write_config

    from nanolab.runlog import read_records

    cfg = write_config(tmp_path / "t.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    fit = ["fit", "--config", str(cfg), "--trainer.max_steps", "8"]
    straight = nanolab_here(*fit, "--run.name", "straight", cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr[-2000:]
    first = nanolab_here(*fit[:-1], "4", "--run.name", "split", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    again = nanolab_here(*fit, "--run.name", "split", "--data.seed", "7", "--seed_everything", "99",
                         cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    warned = [line for line in again.stderr.splitlines() if "resuming keeps" in line]
    assert len(warned) == 1 and "data.seed 1337 (not 7)" in warned[0], again.stderr[-2000:]
    assert "seed_everything" in warned[0] and "(not 99)" in warned[0]

    def losses(name: str) -> dict[int, float]:
        log = tmp_path / "runs" / name / "metrics.jsonl"
        return {r["step"]: r["loss"] for r in read_records(log, "train") if r["step"] > 4}

    assert losses("split") == losses("straight")
    run = tmp_path / "runs" / "split"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    before = read_records(run / "metrics.jsonl", "start")[0]["config"]
    data = saved["data"].get("init_args", saved["data"])
    assert data["seed"] == 1337
    assert saved["seed_everything"] == before["seed_everything"] != 99


def test_seed_everything_true_draws_a_seed_and_the_ranks_share_rank_0s(monkeypatch) -> None:
    """``seed_everything: true`` is documented as a random seed, but Lightning's
    ``seed_everything(None)`` seeds 0: every "random" run was the same run. A rank started by
    rank 0 takes rank 0's seed from the environment it inherited."""
    from nanolab.run.compose import chosen_seed

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("PL_GLOBAL_SEED", "5")  # a stale value in rank 0's shell: not taken
    draws = {chosen_seed(True) for _ in range(8)}
    assert len(draws) > 1 and all(0 <= d < 2**32 for d in draws)
    assert chosen_seed(1337) == 1337
    with pytest.raises(RunConfigError, match="null is not a seed"):
        chosen_seed(None)  # Lightning would seed 0: every such run the same
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert chosen_seed(True) == 5


def test_the_run_keeps_its_seed_through_every_resume_and_a_branch_picks_its_own(
    tmp_path: Path, char_dataset: Path
) -> None:
    """A resume's checkpoints recorded the launch's seed (``PL_GLOBAL_SEED`` of the new command)
    rather than the run's, so the next resume relabelled the run with it. A new run from
    another run's checkpoint (a branch) keeps the seeds it is given: branches of one parent on
    other data orders."""
    import torch
    import yaml
    from conftest import nanolab_here, tiny_overrides, write_config

    cfg = write_config(tmp_path / "t.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    run = tmp_path / "runs" / "tiny"

    def fit(steps: int, *extra: str) -> str:
        done = nanolab_here("fit", "--config", str(cfg), "--trainer.max_steps", str(steps), *extra,
                            cwd=tmp_path)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stderr

    fit(4, "--seed_everything", "42")
    assert "seed_everything 42 (not 7)" in fit(6, "--seed_everything", "7")
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["nanolab"]
    assert saved["seed_everything"] == 42
    assert "seed_everything" not in fit(8, "--seed_everything", "42")  # the run's own: no word
    assert yaml.safe_load((run / "config.yaml").read_text())["seed_everything"] == 42

    branch = nanolab_here("fit", "--config", str(cfg), "--run.name", "branch", "--run.resume",
                          str(run / "checkpoints" / "last.ckpt"), "--trainer.max_steps", "10",
                          "--seed_everything", "5", "--data.seed", "5", cwd=tmp_path)  # fmt: skip
    assert branch.returncode == 0, branch.stderr[-2000:]
    assert "resuming keeps" not in branch.stderr
    mine = yaml.safe_load((tmp_path / "runs" / "branch" / "config.yaml").read_text())
    assert mine["seed_everything"] == 5
    assert mine["data"].get("init_args", mine["data"])["seed"] == 5


# -- where the data order goes on (nanolab.data.order) ------------------------------------------
def test_a_position_is_carried_to_the_same_window_of_another_layout() -> None:
    """Position g of micro-batch 4 is window 4g of the epoch's order; micro-batch 8 must go on
    there (position g/2), not at position g (window 8g: a resume that changed the micro-batch
    skipped or repeated 4g windows)."""
    from nanolab.data.order import carry
    from nanolab.data.windows import WindowPlan

    def plan(micro: int, world: int = 1) -> WindowPlan:
        return WindowPlan(num_tokens=3265, block_size=32, micro_batch_size=micro,
                          world_size=world, seed=3)  # fmt: skip

    assert plan(4).num_windows == 101 and plan(8).batches_per_epoch == 12
    assert carry(plan(8), 6, 4).position == 3 and carry(plan(8), 6, 4).skipped == 0
    assert carry(plan(4), 6, 8).position == 12
    assert carry(plan(4, world=2), 6, 8).position == 6  # the same unit: the same position
    within = carry(plan(8), 7, 4)  # window 28: inside micro-batch 3 of 8
    assert (within.position, within.skipped, within.window, within.epoch) == (4, 4, 28, 0)
    later = carry(plan(8), 25 + 3, 4)  # epoch 1 (25 positions of 4 per epoch), window 12
    assert (later.position, later.skipped, later.epoch) == (12 + 2, 4, 1)
    end = carry(plan(8), 24, 4)  # window 96 of 101: no whole micro-batch of 8 left
    assert (end.position, end.skipped, end.next_epoch) == (12, 5, True)
    for g in range(60):  # every carried position starts at or after the saved window
        c = carry(plan(8), g, 4)
        starts = plan(8).batch_starts(c.position, 0)
        assert c.skipped >= 0 and len(starts) == 8


def test_a_mixture_position_is_carried_by_slots() -> None:
    from nanolab.data.order import carry
    from nanolab.data.windows import MixturePlan

    mix = MixturePlan([5000, 7000], [0.3, 0.7], 16, 6, 1, 1)
    assert carry(mix, 10, 4).position == 7 and carry(mix, 10, 4).skipped == 2  # 40 -> 42
    assert carry(mix, 9, 4).position == 6 and carry(mix, 9, 4).skipped == 0


def test_a_checkpoint_without_the_record_resumes_as_it_always_did() -> None:
    """A checkpoint of an earlier nanolab has no ``order`` record: on the same layout the
    order goes on exactly as before (steps x accumulation, with the ledger's jumps), at every
    micro-batch from the resume on; on another one, from its saved layout."""
    from nanolab.data.order import SavedOrder, resume_jumps, saved_order
    from nanolab.data.skips import data_position, jumps
    from nanolab.data.windows import WindowPlan

    plan = WindowPlan(num_tokens=20_000, block_size=16, micro_batch_size=2, world_size=1, seed=3)
    layout = {"world_size": 1, "accumulate": 2, "micro_batch_size": 2}
    ledgers = [
        [],
        [{"skip_at": 40, "skip_offset": 8, "restored": 20}],
        [
            {"skip_at": 40, "skip_offset": 8, "restored": 20},
            {"skip_at": 30, "skip_offset": 25, "restored": 15},
        ],
    ]
    for ledger in ledgers:
        for step in (0, 10, 15, 20, 25, 30):
            saved = saved_order({"global_step": step, "nanolab": {"layout": layout}})
            assert saved == SavedOrder(step, None, 2, 2)
            start = step * 2
            carried, _ = resume_jumps(saved, plan, start, 2, ledger)
            for k in range(start, start + 40):
                assert data_position(k, carried) == data_position(k, jumps(ledger)), (ledger, k)
    moved = saved_order({"global_step": 6, "nanolab": {"layout": layout}})
    wider = WindowPlan(num_tokens=20_000, block_size=16, micro_batch_size=4, world_size=1, seed=3)
    carried, _ = resume_jumps(moved, wider, 6, 1, [])  # 12 micro-batches of 2 = 6 of 4
    assert data_position(6, carried) == 6


def test_a_rollback_is_carried_into_the_resuming_layout() -> None:
    """A spike rolled a micro-batch-2 run back to step 10 (window 20) after it had reached
    position 30 (unit 2: window 60). Resumed from step 10 on micro-batch 4, it goes on at
    window 60 (position 15); resumed from its step-5 checkpoint (window 10: micro-batch 4 goes
    on at window 12), it trains to window 20 and jumps there, not at step 10 (window 40)."""
    from nanolab.data.order import SavedOrder, resume_jumps
    from nanolab.data.skips import data_position
    from nanolab.data.windows import WindowPlan

    plan = WindowPlan(num_tokens=20_000, block_size=16, micro_batch_size=4, world_size=1, seed=3)
    ledger = [{"skip_at": 10, "skip_offset": 20, "restored": 10, "unit": 2}]
    carried, where = resume_jumps(SavedOrder(10, 10, 2, None), plan, 10, 1, ledger)
    assert data_position(10, carried) == 15 and where is not None and where.skipped == 0
    carried, where = resume_jumps(SavedOrder(5, 5, 2, None), plan, 5, 1, ledger)
    assert where is not None and where.skipped == 2
    assert [data_position(k, carried) for k in (5, 6, 7, 8)] == [3, 4, 15, 16]
    older = [{"skip_at": 4, "skip_offset": 6, "restored": 4, "unit": 4}]  # before the checkpoint
    carried, _ = resume_jumps(SavedOrder(10, 20, 4, None), plan, 10, 1, older)
    assert data_position(10, carried) == 20  # its own record already went past it


@pytest.mark.parametrize("micro, accumulate", [(8, 1), (4, 2), (2, 1)])
def test_a_rollback_after_the_checkpoint_jumps_at_the_window_it_restored(
    micro: int, accumulate: int
) -> None:
    """The reviewer's run: micro-batch 4 rolled back to step 8 (window 32) after reaching
    window 44 (ledger: skip_at 8, skip_offset 3, unit 4). Resumed from step 6 (window 24) with
    another global batch, it trains windows 24-31 and then goes on at the first micro-batch at
    or after window 44: never the windows 32-43 the rollback skipped (a jump at step 8 of the
    new layout trained 32-39 again on micro-batch 8, or skipped healthy 24-31 on micro-batch
    2), and every healthy window before them once."""
    from nanolab.data.order import SavedOrder, resume_jumps
    from nanolab.data.skips import data_position
    from nanolab.data.windows import WindowPlan

    plan = WindowPlan(
        num_tokens=20_000, block_size=16, micro_batch_size=micro, world_size=1, seed=3
    )
    entry = {"skip_at": 8, "skip_offset": 3, "restored": 8, "unit": 4}
    for written in ({"skipped_micro_batches": 3}, {"restored_position": 8, "restored_unit": 4}, {}):
        ledger = [{**entry, **written}]
        start = 6 * accumulate
        carried, _ = resume_jumps(SavedOrder(6, 6, 4, 1), plan, start, accumulate, ledger)
        starts = [data_position(k, carried) * micro for k in range(start, start + 40 // micro)]
        trained = [w for s in starts for w in range(s, s + micro)]
        first_after = -(-44 // micro) * micro
        assert trained[: 8 + 16] == [*range(24, 32), *range(first_after, first_after + 16)]


def test_a_rollback_restored_inside_a_micro_batch_jumps_at_the_next_whole_one() -> None:
    """A rollback whose restored checkpoint stood at window 20 (recorded exactly: position 5 of
    4-window micro-batches) and had reached window 48: resumed on micro-batch 8 from window 8,
    the launch jumps at its first micro-batch at or after window 20 (window 24)."""
    from nanolab.data.order import SavedOrder, resume_jumps
    from nanolab.data.skips import data_position
    from nanolab.data.windows import WindowPlan

    plan = WindowPlan(num_tokens=20_000, block_size=16, micro_batch_size=8, world_size=1, seed=3)
    ledger = [
        {"skip_at": 6, "skip_offset": 0, "restored": 5, "unit": 8, "skipped_micro_batches": 1}
        | {"restored_position": 5, "restored_unit": 4}
    ]
    carried, _ = resume_jumps(SavedOrder(2, 2, 4, None), plan, 2, 1, ledger)
    assert [data_position(k, carried) * 8 for k in (2, 3, 4, 5)] == [8, 16, 48, 56]


def _windows(path: Path) -> list[int]:
    """The windows a run trained on, in order (``cli_probes.WindowsSeen``'s file)."""
    import json

    return [w for line in path.read_text().splitlines() for w in json.loads(line)["windows"]]


def _fit_seen(tmp_path: Path, dataset: Path, name: str, *args: str) -> tuple[list[int], str]:
    """``nanolab fit`` of run ``name`` with the window probe: (windows it has trained on so
    far, this launch's stderr)."""
    from conftest import QUICKSTART, nanolab_here, tiny_overrides, write_config

    seen = tmp_path / f"{name}.windows"
    probe = [{"class_path": "cli_probes.WindowsSeen", "init_args": {"path": str(seen)}}]
    cfg = tiny_overrides(dataset, tmp_path / "runs", trainer__callbacks=probe)
    path = write_config(tmp_path / f"{name}.yaml", cfg)
    res = nanolab_here(
        "fit", "--config", str(QUICKSTART), "--config", str(path), "--run.name", name, *args,
        cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    return _windows(seen), res.stderr


def _strip_order_record(run_dir: Path) -> None:
    """Make the run's checkpoints those of a nanolab that did not record the data order."""
    import torch

    for path in (run_dir / "checkpoints").glob("*.ckpt"):
        if path.is_symlink():
            continue
        ckpt = torch.load(path, weights_only=True)
        ckpt["nanolab"].pop("order", None)
        torch.save(ckpt, path)


@pytest.mark.parametrize("record", ["recorded", "older checkpoint"])
def test_a_resume_on_another_micro_batch_trains_every_window_once(
    tmp_path: Path, char_dataset: Path, record: str
) -> None:
    """The reviewer's repro: 6 steps of micro-batch 4, resumed with micro-batch 8 to step 8,
    trained windows 48-63 of the epoch's order after 0-23 (24 never trained); 8 -> 4 trained
    24 windows twice. Now both train the windows an uninterrupted micro-batch-4 run trains, in
    its order, and a checkpoint of an earlier nanolab (no record) too, from its saved layout."""
    straight, _ = _fit_seen(tmp_path, char_dataset, "straight", "--trainer.max_steps", "16")
    for first, then, steps, seen in ((4, 8, 8, 40), (8, 4, 10, 64)):
        name = f"mb{first}to{then}"
        _fit_seen(tmp_path, char_dataset, name, "--data.micro_batch_size", str(first))
        if record != "recorded":
            _strip_order_record(tmp_path / "runs" / name)
        windows, err = _fit_seen(
            tmp_path, char_dataset, name, "--data.micro_batch_size", str(then),
            "--trainer.max_steps", str(steps),
        )  # fmt: skip
        assert windows == straight[:seen], name
        assert "skipping" not in err and "goes on at the first window" in err


def test_a_resume_inside_a_micro_batch_of_the_new_layout_says_what_it_skips(
    tmp_path: Path, char_dataset: Path
) -> None:
    """7 steps of micro-batch 4 stop at window 28, inside micro-batch 8's 4th: the resume goes
    on at window 32 and says, in one line, that it skips 4 windows."""
    straight, _ = _fit_seen(tmp_path, char_dataset, "straight", "--trainer.max_steps", "12")
    _fit_seen(tmp_path, char_dataset, "odd", "--trainer.max_steps", "7")
    windows, err = _fit_seen(
        tmp_path, char_dataset, "odd", "--trainer.max_steps", "9", "--data.micro_batch_size", "8"
    )
    assert windows == straight[:28] + straight[32:48]
    lines = [line for line in err.splitlines() if "skipping" in line]
    assert len(lines) == 1 and lines[0].startswith("nanolab fit: warning: the checkpoint stopped")
    assert "28 windows into epoch 0's window order" in lines[0]
    assert "skipping 4 windows" in lines[0]


#: The spike guard of the rollback runs: quick to roll back, with no warm-up to hide the spike.
SPIKE = (
    "--spike.window", "3", "--spike.patience", "2", "--spike.factor", "1.2",
    "--model.schedule.warmup_steps", "0", "--checkpoint.keep_last", "20",
)  # fmt: skip


def _rolled_back_across_a_layout_change(
    tmp_path: Path, dataset: Path
) -> tuple[Path, list[int], str]:
    """Run ``rb``: 8 steps of micro-batch 4 (windows 0-31), its step-8 checkpoint gone, resumed
    from last.ckpt on micro-batch 8 with poisoned windows 32-55, so that the spike rolls back to
    step 6 (window 24), saved by the earlier launch, and goes on at window 56. (run directory,
    the windows trained, the second launch's stderr)."""
    poison = (
        "--trainer.callbacks+=cli_probes.PoisonedWindows", "--trainer.callbacks.first=32",
        "--trainer.callbacks.last=55", "--trainer.callbacks.lr_factor=3000",
    )  # fmt: skip
    run = tmp_path / "runs" / "rb"
    _fit_seen(
        tmp_path, dataset, "rb", "--trainer.max_steps", "8", "--checkpoint.every_n_steps", "2",
        *SPIKE,
    )  # fmt: skip
    (run / "checkpoints" / "step-00000008.ckpt").unlink()
    order, err = _fit_seen(
        tmp_path, dataset, "rb", "--trainer.max_steps", "14", "--data.micro_batch_size",
        "8", "--checkpoint.every_n_steps", "100", *SPIKE, *poison,
    )  # fmt: skip
    return run, order, err


def test_a_rollback_across_a_layout_change_says_what_it_skipped_and_older_resumes_keep_it(
    tmp_path: Path, char_dataset: Path
) -> None:
    """The reviewer's run (:func:`_rolled_back_across_a_layout_change`): the spike rolled back
    to step 6 (window 24), saved by the earlier launch. It skipped 4 micro-batches of 8 (windows
    24-55; it said 1, counting this launch's micro-batches from step 6), and a later resume
    from step 4 on micro-batch 8 trains 16-23 and then goes on at window 56, as the healed run
    did (at step 6 of the new layout it trained the skipped 24-31 again)."""
    run, order, err = _rolled_back_across_a_layout_change(tmp_path, char_dataset)
    (entry,) = read_ledger(run)
    assert entry["restored"] == 6 and entry["skipped_micro_batches"] == 4, entry
    assert "rolled back to step 6, skipping 4 micro-batches" in err
    assert len(order) == 32 + 24 + 64  # every window of the order up to 120, once
    windows, err = _fit_seen(
        tmp_path, char_dataset, "rb", "--run.resume", str(run / "checkpoints" / "step-00000004.ckpt"),
        "--trainer.max_steps", "8", "--data.micro_batch_size", "8", *SPIKE,
    )  # fmt: skip
    assert windows[len(order) :] == order[16:24] + order[56:80]
    assert "skipping" not in err  # window 56 starts a micro-batch of 8: nothing to say


def test_a_rollback_carried_inside_a_micro_batch_says_what_it_skips(
    tmp_path: Path, char_dataset: Path
) -> None:
    """Resumed from step 4 (window 16) on micro-batch 16, the rollback's jump to window 56 lands
    inside this launch's 4th micro-batch (48-63): the order goes on at window 64, and the
    launch says so in the words of the resume point's own skip. Before, it skipped windows
    56-63 without a line."""
    run, order, _ = _rolled_back_across_a_layout_change(tmp_path, char_dataset)
    windows, err = _fit_seen(
        tmp_path, char_dataset, "rb", "--run.resume", str(run / "checkpoints" / "step-00000004.ckpt"),
        "--trainer.max_steps", "6", "--data.micro_batch_size", "16", *SPIKE,
    )  # fmt: skip
    assert windows[len(order) :] == order[16:32] + order[64:80]
    lines = [line for line in err.splitlines() if "skipping" in line]
    assert lines == [
        "nanolab fit: warning: the rollback to step 6 went on 56 windows into epoch 0's window "
        "order, inside a micro-batch of this launch (micro-batch 16 x 1 device(s) = 16 windows): "
        "training goes on at the next whole one, skipping 8 windows (a micro-batch x devices "
        "that divides 56 skips none)"
    ]
