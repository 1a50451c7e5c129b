"""``model.init_from`` a ``nanolab export --format safetensors`` folder: what stays the run's.

A window and document masking change no weights, so the new run chooses them; one trained in
and left out (or set otherwise) changes what every token attends to, and is said in one note.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from jsonargparse import Namespace

from nanolab.cli import main
from nanolab.model import GPT, GPTConfig
from nanolab.model.hf import apply_init_from

pytest.importorskip("safetensors")

WINDOWED = GPTConfig(vocab_size=70, vocab_multiple=1, n_layer=1, n_head=2, n_embd=32,
                     block_size=16, attention_window=8)  # fmt: skip


def export_of(tmp_path: Path, config: GPTConfig) -> Path:
    """``nanolab export --format safetensors`` of a random model of ``config``."""
    ckpt = {
        "state_dict": {f"model.{k}": v for k, v in GPT(config).state_dict().items()},
        "nanolab": {"gpt": asdict(config), "tokenizer": None},
    }
    torch.save(ckpt, tmp_path / "w.ckpt")
    out = tmp_path / "export"
    assert main(["export", "--ckpt", str(tmp_path / "w.ckpt"), "--format", "safetensors",
                 "-o", str(out)]) == 0  # fmt: skip
    return out


def started_from(out: Path, **gpt: object) -> Namespace:
    """The parsed ``model`` section of a fit with ``model.init_from out``, after the import."""
    settings = asdict(GPTConfig(**{"block_size": 16, **gpt}))  # type: ignore[arg-type]
    model = Namespace(gpt=Namespace(**settings), init_from=str(out))
    apply_init_from(model)
    return model


def test_a_window_the_run_leaves_out_is_said_once(tmp_path, capsys, monkeypatch) -> None:
    out = export_of(tmp_path, WINDOWED)
    capsys.readouterr()
    model = started_from(out)
    notes = [line for line in capsys.readouterr().err.splitlines() if "init_from" in line]
    assert model.gpt.n_embd == 32 and model.gpt.attention_window is None  # the run's choice
    assert len(notes) == 1, notes
    assert notes[0].startswith("nanolab: note: model.init_from ")
    assert "trained with attention_window 8, this run has attention_window null" in notes[0]
    assert notes[0].endswith("set --model.gpt.attention_window 8 to keep what it was trained with")

    started_from(out, document_mask=True, eot_id=0, attention_window=4)
    both = capsys.readouterr().err
    assert "attention_window 8 and document_mask false" in both
    assert "--model.gpt.attention_window 8 --model.gpt.document_mask false" in both

    started_from(out, attention_window=8)  # kept: nothing to say
    monkeypatch.setenv("RANK", "1")
    started_from(out)  # said by rank 0 only
    assert "init_from" not in capsys.readouterr().err
