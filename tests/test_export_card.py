"""The export's model card describes the launch that trained the exported checkpoint, not the
run's newest launch (a resume with another config, another command)."""

from __future__ import annotations

import json
from pathlib import Path


def test_the_card_names_the_launch_that_trained_the_checkpoint(tmp_path: Path) -> None:
    """A run trained to 600, then resumed to 900 with another learning rate: the card of step
    600 showed the second launch's command and config (the last start record)."""
    from nanolab.export import model_card
    from nanolab.model import GPTConfig

    run = tmp_path / "runs" / "poems"
    (run / "checkpoints").mkdir(parents=True)

    def start(step: int, lr: float, extra: list[str]) -> dict:
        config = {"model": {"init_args": {"optimizer": {"lr": lr}}}}
        argv = ["/venv/bin/nanolab", "fit", "--config", "exp.yaml", *extra]
        return {"event": "start", "time": 1.0 + step, "step": step, "config": config, "argv": argv}

    records = [
        start(0, 0.001, []),
        {"event": "val", "time": 2.0, "step": 600, "tokens": 19200, "val_loss": 1.5},
        start(600, 0.0003, ["--model.optimizer.lr", "3e-4", "--trainer.max_steps", "900"]),
        {"event": "val", "time": 4.0, "step": 900, "tokens": 28800, "val_loss": 1.4},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    ckpt = {"global_step": 600, "nanolab": {"tokenizer": {"name": "chars"}}}
    source = run / "checkpoints" / "step-00000600.ckpt"
    card = model_card(ckpt, GPTConfig(vocab_size=65), source, None)
    assert "| trained with | `nanolab fit --config exp.yaml` |" in card, card
    assert '"lr": 0.001' in card and "3e-4" not in card and "0.0003" not in card
    later = model_card({**ckpt, "global_step": 900}, GPTConfig(vocab_size=65), source, None)
    assert "--model.optimizer.lr 3e-4" in later and '"lr": 0.0003' in later
    # a checkpoint without a step (another program's): the newest launch, as before
    unknown = model_card({"nanolab": {}}, GPTConfig(vocab_size=65), source, None)
    assert "--trainer.max_steps 900" in unknown


def test_the_card_shows_trainings_validation_and_names_a_later_validate_apart(
    tmp_path: Path,
) -> None:
    """A run preempted at step 2044 (its last validation at 2000), then ``nanolab validate``
    appended a val record of step 2044: the card printed that loss as the run's, at the
    checkpoint's step, with "tokens: not logged". Training's figure is the card's, marked with
    the step it was read at (the tokens too); the validate's is on a row of its own."""
    from nanolab.export import model_card
    from nanolab.model import GPTConfig

    run = tmp_path / "runs" / "night"
    (run / "checkpoints").mkdir(parents=True)
    records = [
        {"event": "start", "time": 1.0, "step": 0, "config": {}, "argv": ["nanolab", "fit"]},
        {"event": "val", "time": 2.0, "step": 1000, "tokens": 128000, "val_loss": 2.4967},
        {"event": "val", "time": 3.0, "step": 2000, "tokens": 256000, "val_loss": 2.3905,
         "val_bpb": 3.4488},
        {"event": "end", "time": 4.0, "step": 2044, "reason": "preempted"},
        {"event": "val", "time": 5.0, "step": 2044, "evaluated_by": "nanolab validate",
         "checkpoint": str(run / "checkpoints" / "step-00002044.ckpt"), "val_loss": 2.3754,
         "val_bpb": 3.4270},
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    ckpt = {"global_step": 2044, "nanolab": {"tokenizer": {"name": "chars"}}}
    source = run / "checkpoints" / "last.ckpt"
    card = model_card(ckpt, GPTConfig(vocab_size=65), source, None)
    assert "| val loss | 2.3905 (step 2000) |" in card, card
    assert "| val bits per byte | 3.4488 (step 2000) |" in card
    assert "| tokens | 256,000 (step 2000) |" in card
    assert "| val loss, nanolab validate | 2.3754, 3.4270 bits per byte (appended" in card
    # the card of step 2000 has no validate of its own step: no such row
    earlier = model_card({**ckpt, "global_step": 2000}, GPTConfig(vocab_size=65), source, None)
    assert "| val loss | 2.3905 |" in earlier and "nanolab validate" not in earlier


def test_the_card_reads_the_timeline_that_trained_the_checkpoint(
    tmp_path: Path, char_dataset: Path
) -> None:
    """A run validated every 2 steps to step 6, ``nanolab validate`` of its last checkpoint,
    then resumed from step 4 to 8 validating every 5 steps: the new step-6 checkpoint was trained
    on a timeline that validated at step 5, not 6. The card showed the first timeline's step-6
    validation (later in the log than step 5) as this checkpoint's, and the validate of the
    file the new one replaced."""
    import torch
    from conftest import nanolab_here, tiny_overrides, write_config

    from nanolab.export import model_card
    from nanolab.model import GPTConfig

    cfg = write_config(
        tmp_path / "t.yaml",
        tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=8,
                       checkpoint__every_n_steps=2, checkpoint__keep_last=10),
    )  # fmt: skip
    run = tmp_path / "runs" / "tiny"
    folder = run / "checkpoints"
    first = nanolab_here("fit", "--config", str(cfg), "--run.eval_every_steps", "2",
                         "--trainer.max_steps", "6", cwd=tmp_path)  # fmt: skip
    assert first.returncode == 0, first.stderr[-2000:]
    scored = nanolab_here("validate", "--config", str(cfg), cwd=tmp_path)  # step 6, logged
    assert scored.returncode == 0, scored.stderr[-2000:]
    again = nanolab_here("fit", "--config", str(cfg), "--run.resume", str(folder / "step-00000004.ckpt"),
                         "--run.eval_every_steps", "5", cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    vals = [(r["step"], r.get("evaluated_by")) for r in records if r["event"] == "val"]
    assert vals[:4] == [(2, None), (4, None), (6, None), (6, "nanolab validate")]
    assert vals[4:] == [(5, None), (8, None)]  # the resumed timeline: no validation at 6
    at_5 = next(r for r in records if r["event"] == "val" and r["step"] == 5)

    source = folder / "step-00000006.ckpt"
    ckpt = torch.load(source, map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 6
    card = model_card(ckpt, GPTConfig(vocab_size=65), source, None)
    assert f"| val loss | {at_5['val_loss']:.4f} (step 5) |" in card, card
    assert f"| tokens | {at_5['tokens']:,} (step 5) |" in card
    assert "nanolab validate" not in card  # it scored the first timeline's step-6 file
    assert '"eval_every_steps": 5' in card  # the config of the launch that trained it


def test_a_checkpoint_copied_out_of_its_run_still_has_its_runs_card(
    tmp_path: Path, char_dataset: Path
) -> None:
    """``cp runs/x/checkpoints/step-6.ckpt keep.ckpt; nanolab export --ckpt keep.ckpt`` wrote
    "run: not known (a loose file)" and "not logged" on every row, under an intro saying the
    figures were read from the run's log. The checkpoint records its run folder and id: while
    that folder's log is still the run's, and still the timeline that made the copy, the card
    reads it; once the run trained those steps again, or the folder is gone, the card shows
    what the checkpoint itself stores, each figure said to come from it, and says why."""
    import shutil

    from conftest import nanolab_here, tiny_overrides, write_config

    cfg = write_config(
        tmp_path / "t.yaml",
        tiny_overrides(char_dataset, tmp_path / "runs", checkpoint__every_n_steps=2,
                       checkpoint__keep_last=10, run__eval_every_steps=2),
    )  # fmt: skip
    run = tmp_path / "runs" / "tiny"
    fit = nanolab_here("fit", "--config", str(cfg), cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-2000:]
    keep = tmp_path / "keep.ckpt"
    shutil.copy(run / "checkpoints" / "step-00000006.ckpt", keep)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    at_6 = next(r for r in records if r["event"] == "val" and r["step"] == 6)

    def card(name: str) -> str:
        done = nanolab_here("export", "--ckpt", str(keep), "--format", "safetensors",
                            "-o", str(tmp_path / name), cwd=tmp_path)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        return (tmp_path / name / "README.md").read_text()

    read = card("read")
    assert read.startswith("# tiny\n") and "not known" not in read, read
    assert f"| run | `{run}` (recorded in the checkpoint; this file was copied out of it) |" in read
    assert f"| val loss | {at_6['val_loss']:.4f} |" in read
    assert f"| val bits per byte | {at_6['val_bpb']:.4f} |" in read
    assert f"| tokens | {at_6['tokens']:,} |" in read and "## The run's config" in read

    # resumed from step 4 to 8: step 6 trained again, validated at 5 only (the copy at 6)
    again = nanolab_here("fit", "--config", str(cfg), "--run.resume",
                         str(run / "checkpoints" / "step-00000004.ckpt"),
                         "--run.eval_every_steps", "5", "--trainer.max_steps", "8",
                         cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    own = card("own")
    assert "read from the\ncheckpoint alone" in own, own
    assert "the run trained those steps again after this file was saved" in own
    assert f"| val loss | {at_6['val_loss']:.4f} (stored in the checkpoint) |" in own
    assert f"| tokens | {at_6['tokens']:,} (stored in the checkpoint) |" in own
    assert (
        "| val bits per byte | not stored in the checkpoint (read from the run's log only) |" in own
    )
    assert f"| data | `{char_dataset}` (stored in the checkpoint) |" in own
    assert "## The training setup the checkpoint stores" in own and '"lr": 0.0006' in own

    shutil.move(run, tmp_path / "elsewhere")
    gone = card("gone")
    assert gone.startswith("# tiny\n") and "that folder is gone (moved or deleted)" in gone
    assert f"| val loss | {at_6['val_loss']:.4f} (stored in the checkpoint) |" in gone


def test_a_card_without_the_runs_log_says_why_and_reads_only_val_loss(tmp_path: Path) -> None:
    """A copied checkpoint whose folder now holds another run, one that records no run at all,
    and one whose stored validations rank another metric (``checkpoint.monitor: val/bpb``):
    the card says which, and never shows another metric as the val loss."""
    from nanolab.export import model_card
    from nanolab.model import GPTConfig

    run = tmp_path / "runs" / "poems"
    run.mkdir(parents=True)
    start = {"event": "start", "time": 1.0, "step": 0, "run_id": "new1", "config": {}}
    (run / "metrics.jsonl").write_text(json.dumps(start) + "\n")
    ckpt = {
        "global_step": 40,
        "nanolab": {"tokenizer": {"name": "chars"}, "seed_everything": 7},
        "callbacks": {
            "MetricsLog": {"run_id": "old0", "run_dir": str(run)},
            "RotatingCheckpoint": {"val_by_step": {"30": 1.25}, "monitor": "val/loss"},
            "RunClock": {"tokens": 5120},
        },
    }
    source = tmp_path / "keep.ckpt"
    card = model_card(ckpt, GPTConfig(vocab_size=65), source, None)
    assert f"| run | `{run}` (run old0), recorded in the checkpoint; its metrics.jsonl names run new1 now |" in card, card  # fmt: skip
    assert "| val loss | 1.2500 (step 30) (stored in the checkpoint) |" in card
    assert "| tokens | 5,120 (stored in the checkpoint) |" in card
    assert '"seed_everything": 7' in card

    bpb = {**ckpt, "callbacks": {**ckpt["callbacks"], "RotatingCheckpoint": {
        "val_by_step": {"30": 1.8}, "monitor": "val/bpb"}}}  # fmt: skip
    assert "| val loss | not stored in the checkpoint" in model_card(bpb, GPTConfig(), source, None)

    # copied into another run's checkpoints/: not that run's log either
    into = tmp_path / "runs" / "other" / "checkpoints"
    into.mkdir(parents=True)
    other = {**start, "run_id": "oth9", "argv": ["nanolab", "fit", "--config", "other.yaml"]}
    (into.parent / "metrics.jsonl").write_text(json.dumps(other) + "\n")
    misplaced = model_card(ckpt, GPTConfig(), into / "step-00000040.ckpt", None)
    assert "other.yaml" not in misplaced and "names run new1 now" in misplaced, misplaced

    # in its own run's folder (moved since: the checkpoint records the old place), whose log
    # holds another timeline: the card names the folder it read, not the one recorded
    moved = tmp_path / "moved" / "poems"
    (moved / "checkpoints").mkdir(parents=True)
    ours = {**start, "run_id": "old0"}
    val = {"event": "val", "time": 2.0, "step": 30, "tokens": 5120, "val_loss": 1.5}
    (moved / "metrics.jsonl").write_text(json.dumps(ours) + "\n" + json.dumps(val) + "\n")
    again = model_card(ckpt, GPTConfig(), moved / "checkpoints" / "last.ckpt", None)
    assert f"| run | `{moved}` (run old0); its log's validation up to step 40 is step 30's 1.5000, this checkpoint's is step 30's 1.2500" in again, again  # fmt: skip

    loose = model_card({"global_step": 3, "nanolab": {}}, GPTConfig(), source, None)
    assert loose.startswith("# keep\n")
    assert "| run | not recorded in the checkpoint (a loose file) |" in loose


def test_a_branch_saved_before_its_first_validation_has_its_runs_card(tmp_path: Path) -> None:
    """A branch from its parent's step 6 (``run.resume`` of another run's checkpoint), saved at
    step 8 before it first validated: its checkpoint stores the parent's validations (the cost
    budget's history, the rotation's record carry on), which the branch's log, starting at
    step 6, never held. The card said its own run's log was "not read" and lost the fit
    command and the config; the stored figure is the parent's and says so. A stored
    validation after the log begins that the log lacks still means another timeline."""
    from nanolab.export import model_card
    from nanolab.model import GPTConfig

    run = tmp_path / "runs" / "t3"
    (run / "checkpoints").mkdir(parents=True)
    parent = str(tmp_path / "runs" / "t1" / "checkpoints" / "step-00000006.ckpt")
    argv = ["nanolab", "fit", "--config", "t.yaml", "--run.resume", parent]
    records = [
        {"event": "start", "time": 1.0, "step": 6, "run_id": "br3", "run_dir": str(run),
         "resumed_from_step": 6, "resumed_from": parent, "branched": True,
         "config": {"run": {"eval_every_steps": 5}}, "argv": argv},
        {"event": "checkpoint", "time": 2.0, "step": 8,
         "path": str(run / "checkpoints" / "step-00000008.ckpt")},
        {"event": "val", "time": 3.0, "step": 9, "tokens": 1152, "val_loss": 4.8441},
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    ckpt = {
        "global_step": 8,
        "nanolab": {"tokenizer": {"name": "chars"}},
        "callbacks": {
            "MetricsLog": {"run_id": "br3", "run_dir": str(run)},
            "CostBudget": {"history": [[3, 0.1, 4.8558], [6, 0.2, 4.8514]], "monitor": "val/loss"},
            "RotatingCheckpoint": {"val_by_step": {"3": 4.8558, "6": 4.8514}, "monitor": "val/loss"},
            "RunClock": {"tokens": 1024},
        },
    }  # fmt: skip
    parents = "| val loss | 4.8514 (step 6, the parent run's, before this branch; stored in the checkpoint) |"  # fmt: skip
    for source in (run / "checkpoints" / "step-00000008.ckpt", tmp_path / "keep.ckpt"):
        card = model_card(ckpt, GPTConfig(vocab_size=65), source, None)
        assert "figures below are read from the\ncheckpoint and from the run log" in card, card
        assert f"| trained with | `nanolab fit --config t.yaml --run.resume {parent}` |" in card
        assert "## The run's config" in card and '"eval_every_steps": 5' in card
        assert parents in card and "not read" not in card
        # the tokens the checkpoint stores (the log has none by step 8: it said "not logged");
        # nothing measured bits per byte on this branch by then, and the row says so
        assert "| tokens | 1,024 (stored in the checkpoint) |" in card, card
        assert "| val bits per byte | not logged (no validation in the run's log up to step 8) |" in card  # fmt: skip

    # a validation the checkpoint stores after the branch began, which the log lacks: the
    # log is of another timeline (the run trained those steps again)
    history = [[3, 0.1, 4.8558], [6, 0.2, 4.8514], [7, 0.3, 4.8470]]
    retrained = {**ckpt, "callbacks": {**ckpt["callbacks"], "RotatingCheckpoint": {},
                                       "CostBudget": {"history": history, "monitor": "val/loss"}}}  # fmt: skip
    other = model_card(retrained, GPTConfig(vocab_size=65), run / "checkpoints" / "last.ckpt", None)
    assert "its log holds no validation of step 7, which this checkpoint stores" in other, other
    assert "| val loss | 4.8470 (step 7) (stored in the checkpoint) |" in other

    # the log holds a validation after the branch began that the checkpoint lacks: another
    # timeline's log, and the figure the checkpoint stores is still the parent's
    val_7 = {"event": "val", "time": 2.5, "step": 7, "tokens": 896, "val_loss": 4.8470}
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in (records[0], val_7, records[1]))
    )
    later = model_card(ckpt, GPTConfig(vocab_size=65), run / "checkpoints" / "last.ckpt", None)
    assert "its log's validation up to step 8 is step 7's 4.8470" in later, later
    assert "| val loss | 4.8514 (step 6, the parent run's, before this branch) (stored in the checkpoint) |" in later  # fmt: skip

    # a run trained from scratch whose log lacks the validation its checkpoint stores: not
    # this checkpoint's log (as before), however early the validation
    plain = {**records[0], "step": 0, "branched": False, "resumed_from_step": None}
    (run / "metrics.jsonl").write_text(json.dumps(plain) + "\n" + json.dumps(records[1]) + "\n")
    scratch = model_card(ckpt, GPTConfig(vocab_size=65), run / "checkpoints" / "last.ckpt", None)
    assert "its log holds no validation of step 6, which this checkpoint stores" in scratch
    assert "| val loss | 4.8514 (step 6) (stored in the checkpoint) |" in scratch, scratch
