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
