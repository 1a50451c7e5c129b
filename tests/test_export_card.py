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
