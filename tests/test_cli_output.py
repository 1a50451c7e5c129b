"""What ``nanolab fit`` prints: a banner, one progress display, nothing else; the short help.

Through the real CLI, with stdout a pipe (as under ``nanolab queue`` or SLURM): plain lines, no
escape codes, none of Lightning's start-up chatter. Extending a finished run keeps its schedule
(the extra steps run at the schedule's minimum) and counts the steps against the new end.
"""

from __future__ import annotations

import os
import re
import sys

import pytest
from conftest import nanolab_here, run_nanolab, tiny_overrides, write_config

from nanolab.runlog import read_records

NOISE = ("litlogger", "LeafSpec", "Total FLOPs", "MFU unknown", "GPU available", "Seed set to",
         "Restoring states", "`Trainer.fit` stopped", "Validation DataLoader")  # fmt: skip


def _tiny(tmp_path, char_dataset):
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__enable_progress_bar=True,
                         progress__refresh_rate=2, progress__plain_every_s=0,
                         model__schedule={"warmup_steps": 2, "min_lr_ratio": 0.1},
                         model__optimizer={"lr": 0.001})  # fmt: skip
    return write_config(tmp_path / "tiny.yaml", cfg)


@pytest.fixture(scope="module")
def printed(tmp_path_factory, char_dataset):
    """What one tiny ``fit`` in a process of its own printed, validating on steps that also
    print (every 2nd): (its folder, the finished process). The tests below only read it."""
    tmp_path = tmp_path_factory.mktemp("printed")
    config = str(_tiny(tmp_path, char_dataset))
    first = run_nanolab("fit", "--config", config, "--run.eval_every_steps", "2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    return tmp_path, first


def test_fit_prints_a_banner_and_plain_lines_and_nothing_else(printed):
    tmp_path, first = printed
    out = first.stdout
    for noise in NOISE:
        assert noise not in out + first.stderr, noise
    assert "\x1b" not in out and "\r" not in out  # no escape codes in a log file
    assert out.startswith(f"nanolab fit: {tmp_path / 'runs' / 'tiny'}\n")
    assert re.search(r"model +\d+(\.\d+)?k parameters: 2 layers x 32 wide", out)
    assert "128 tokens/step = 4 micro-batch x 32 context x 1 accumulation x 1 device" in out
    assert "resume     none: a new run from step 0" in out and "precision 32-true" in out
    assert re.search(r"^step 6/6 \(100%\)  loss \d\.\d{4}  val \d\.\d{4}", out, re.M)
    # One line per step shown: a step that validates prints once, after its validation.
    steps = re.findall(r"^step (\d+)/6", out, re.M)
    assert steps == ["2", "4", "6"], out
    assert re.search(r"^step 2/6 \(33%\)  loss \d\.\d{4}  val \d\.\d{4}", out, re.M)
    assert first.stderr.strip() == ""  # nothing else unless something is wrong


def test_the_line_after_a_validation_between_refreshes_shows_that_steps_loss(
    tmp_path, char_dataset
):
    """With ``run.eval_every_steps`` not a multiple of ``progress.refresh_rate`` the line after a
    validation showed the last refresh's loss and tok/s under the validation's step (here step
    3's line had neither, and step 6's repeated step 4's)."""
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__enable_progress_bar=True,
                         progress__refresh_rate=4, progress__plain_every_s=0,
                         run__eval_every_steps=3, trainer__max_steps=8)  # fmt: skip
    done = nanolab_here(
        "fit", "--config", str(write_config(tmp_path / "t.yaml", cfg)), cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = {int(m[1]): m[0] for m in re.finditer(r"^step (\d+)/8.*$", done.stdout, re.M)}
    assert sorted(lines) == [3, 4, 6, 8], done.stdout
    losses = {r["step"]: r["loss"] for r in read_records(tmp_path / "runs/tiny/metrics.jsonl")
              if r["event"] == "train"}  # fmt: skip
    for step in (3, 6):  # validated between refreshes: that step's own loss, and a rate
        assert f"loss {losses[step]:.4f}  val " in lines[step], (lines[step], losses)
        assert " tok/s" in lines[step], lines[step]


@pytest.mark.slow  # two launches: ~25 s of CPU
def test_extending_a_finished_run_keeps_its_schedule_and_counts_to_the_new_end(
    tmp_path, char_dataset
):
    config = _tiny(tmp_path, char_dataset)
    first = run_nanolab("fit", "--config", str(config), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    # Extend the finished run by 2 steps: resumed at 6, counted to 8, at the schedule's minimum.
    more = run_nanolab("fit", "--config", str(config), "--trainer.max_steps", "8", cwd=tmp_path)
    assert more.returncode == 0, more.stderr[-2000:]
    assert re.search(r"resume +from step 6 \(.*step-00000006\.ckpt\)", more.stdout)
    assert "steps      6 -> 8" in more.stdout and "LR schedule ended at step 6" in more.stdout
    assert re.search(r"^step 8/8 \(100%\)", more.stdout, re.M)
    assert not re.search(r"^step [1-5]/", more.stdout, re.M)
    assert "Restoring states" not in more.stdout + more.stderr
    lr = {r["step"]: r["lr"] for r in read_records(tmp_path / "runs/tiny/metrics.jsonl")
          if r["event"] == "train"}  # fmt: skip
    assert sorted(lr) == list(range(1, 9))
    # Step s trains at the schedule's rate of s - 1: step 7 is the first at the minimum.
    assert lr[7] == lr[8] == pytest.approx(0.001 * 0.1)
    assert lr[6] > lr[7]  # still decaying at the old end


def test_fit_help_leads_with_nanolab_groups_and_common_keys(tmp_path):
    short = nanolab_here("fit", "--help", cwd=tmp_path)  # a process's page: the test below
    assert short.returncode == 0, short.stderr
    lines = short.stdout.splitlines()
    assert len(lines) < 120
    text = short.stdout
    assert lines[0].startswith("usage: nanolab fit --config")
    for key in ("--run.name null", "--run.global_batch_tokens null", "--trainer.max_steps 5000",
                "--model.gpt.n_layer 6", "--model.optimizer.lr 0.0006", "--data.dataset_dir",
                "--checkpoint.*", "--budget.*", "--help-all", "configs/debug/fast_dev_run.yaml"):  # fmt: skip
        assert key in text, key


def test_fit_help_is_remembered_and_printed_the_same_without_lightning(tmp_path):
    """The first ``--help`` of this code builds the page from the classes; the next prints the
    remembered page, byte for byte, before Lightning or torch is imported."""
    env = {"NANOLAB_ESTIMATOR_CACHE": str(tmp_path / "cache"), "PYTHONPROFILEIMPORTTIME": "1"}
    first = run_nanolab("fit", "--help", cwd=tmp_path, env=env)
    second = run_nanolab("fit", "--help", cwd=tmp_path, env=env)
    assert first.returncode == second.returncode == 0, first.stderr[-2000:] + second.stderr[-2000:]
    assert second.stdout == first.stdout and first.stdout.startswith("usage: nanolab fit")
    imported = {line.split("|")[-1].strip() for line in second.stderr.splitlines() if "|" in line}
    assert "lightning" in {line.split("|")[-1].strip() for line in first.stderr.splitlines()}
    assert not {"torch", "lightning", "jsonargparse"} & imported
    other = nanolab_here("validate", "--help", cwd=tmp_path, env=env)  # a page per verb
    assert other.stdout.startswith("usage: nanolab validate") and "--ckpt_path" in other.stdout


@pytest.mark.slow  # builds LightningCLI's whole parser: ~15 s of CPU
def test_fit_help_all_is_lightnings_full_list(tmp_path):
    full = run_nanolab("fit", "--help-all", cwd=tmp_path)
    assert full.returncode == 0 and len(full.stdout.splitlines()) > 500
    assert "--trainer.detect_anomaly" in full.stdout and "args parameter" not in full.stderr


@pytest.mark.parametrize(
    ("verb", "expected"),
    [("prepare", ["bpe: vocabulary size", "(default: 4096)", "(default: 0.1)", "(default: chars)"]),
     ("generate", ["(default: 300)", "0 = greedy", "(default: 0.8)", "(default: 200)",
                   "sampling seed"])],
)  # fmt: skip
def test_prepare_and_generate_help_show_defaults_and_meanings(verb, expected, capsys):
    from nanolab.cli import main

    with pytest.raises(SystemExit) as done:
        main([verb, "--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # unwrap
    for text in expected:
        assert text in out, text
    assert "(default: None)" not in out and "(default: False)" not in out


def test_fit_ends_with_a_short_end_block(printed) -> None:
    """Under its last progress line, fit says how it ended, the val numbers, the wall time and
    goodput, the checkpoint, and what to run next."""
    tmp_path, proc = printed
    tail = proc.stdout.strip().splitlines()[-5:]
    assert tail[0].startswith("nanolab fit: ") and tail[0].endswith("runs/tiny completed at step 6")
    assert tail[1].startswith("  val loss ") and "at step 6 (best " in tail[1]
    assert "of wall time, goodput " in tail[2]
    assert tail[3] == f"  checkpoint {tmp_path / 'runs' / 'tiny' / 'checkpoints' / 'last.ckpt'}"
    assert tail[4].startswith("  next: nanolab generate --ckpt ")


def test_the_end_block_reads_the_runs_own_numbers_and_quotes_its_paths(tmp_path) -> None:
    """A finished run's command run again printed the score of a later `nanolab eval` (another
    example count) as the run's; a run name with a space made the printed next command fail."""
    import json
    from types import SimpleNamespace

    from nanolab.callbacks.checkpoint import RotatingCheckpoint
    from nanolab.model.config import GPTConfig
    from nanolab.run.cli import end_block

    run = tmp_path / "runs" / "my run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step-00000600.ckpt").write_bytes(b"")
    os.link(run / "checkpoints" / "step-00000600.ckpt", run / "checkpoints" / "last.ckpt")
    saver = RotatingCheckpoint()
    saver.dirpath, saver.last_saved_step = run / "checkpoints", 600
    records = [
        {"event": "val", "step": 600, "val_loss": 1.81, "val_bpb": 2.6},
        {"event": "tasks", "step": 600, "tasks/cloze/score": 0.387},
        {"event": "end", "step": 600, "reason": "completed", "best_val_loss": 1.81},
        {"event": "val", "step": 600, "val_loss": 2.5, "evaluated_by": "nanolab validate"},
        {"event": "tasks", "step": 600, "tasks/cloze/score": 0.364, "evaluated_by": "nanolab eval"},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    gpt = SimpleNamespace(gpt_config=GPTConfig(n_layer=1, n_head=2, n_embd=16))  # generate-able
    trainer = SimpleNamespace(default_root_dir=str(run), callbacks=[saver], lightning_module=gpt)
    text = end_block(trainer)
    assert "val loss 1.8100 at step 600" in text and "cloze 0.387" in text, text
    assert f"--ckpt '{run / 'checkpoints' / 'last.ckpt'}'" in text, text


def test_the_verb_list_says_export_writes_both_formats(capsys) -> None:
    """``nanolab --help`` described export as "a Hugging Face GPT-2 folder" only, though
    ``--format safetensors`` writes nanolab's own (any model, RoPE included)."""
    from nanolab.cli import main

    assert main(["--help"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("export")]
    assert "Hugging Face folder" in line and "safetensors" in line and "GPT-2" not in line


def test_the_next_generate_command_imports_the_module_of_the_models_own_parts(
    tmp_path, monkeypatch
) -> None:
    """A run whose model uses a part of a project's own (an attention registered by a module
    no ``nanolab.plugins`` entry point names) ended with a ``nanolab generate`` command that
    failed ("pass --import ..."). The command now carries the ``--import`` generate needs, and
    none where an installed entry point names the module (generate imports it by itself)."""
    import importlib.metadata
    from types import SimpleNamespace

    from nanolab.callbacks.checkpoint import RotatingCheckpoint
    from nanolab.model.config import GPTConfig
    from nanolab.model.gpt import CausalSelfAttention
    from nanolab.model.registry import register_attention
    from nanolab.run.cli import end_block

    @register_attention("test_hint_own_attention")
    class OwnAttention(CausalSelfAttention):
        """A project's attention: the plain one, registered from this module."""

    run = tmp_path / "runs" / "own"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step-00000004.ckpt").write_bytes(b"")
    os.link(run / "checkpoints" / "step-00000004.ckpt", run / "checkpoints" / "last.ckpt")
    saver = RotatingCheckpoint()
    saver.dirpath, saver.last_saved_step = run / "checkpoints", 4
    gpt = GPTConfig(n_layer=1, n_head=2, n_embd=16, attention_variant="test_hint_own_attention")
    trainer = SimpleNamespace(
        default_root_dir=str(run),
        callbacks=[saver],
        lightning_module=SimpleNamespace(gpt_config=gpt),
    )
    last = run / "checkpoints" / "last.ckpt"
    assert f"next: nanolab generate --ckpt {last} --import {__name__} --prompt" in end_block(
        trainer
    )

    plugin = importlib.metadata.EntryPoint("own", __name__, "nanolab.plugins")
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [plugin])
    assert f"next: nanolab generate --ckpt {last} --prompt" in end_block(trainer)

    # An entry point naming a package whose __init__ imports the module that registers the
    # part (`mylab = mylab`, mylab importing mylab.layers): generate's plugin import brings the
    # part in too, so the command needs no --import (it carried `--import ownlab.layers`).
    from nanolab import installed_plugins
    from nanolab.model import registry

    package = tmp_path / "ownlab"
    package.mkdir()
    (package / "__init__.py").write_text("from . import layers  # noqa: F401\n")
    (package / "layers.py").write_text(
        "from nanolab.model.gpt import CausalSelfAttention\n"
        "from nanolab.model.registry import register_attention\n\n\n"
        '@register_attention("test_hint_plugin_attention")\n'
        "class PluginAttention(CausalSelfAttention):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(installed_plugins, "_plugins_loaded", [])  # loaded afresh here
    monkeypatch.setattr(installed_plugins, "_plugin_modules", set())
    plugin = importlib.metadata.EntryPoint("ownlab", "ownlab", "nanolab.plugins")
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [plugin])
    try:
        trainer.lightning_module.gpt_config = GPTConfig(
            n_layer=1, n_head=2, n_embd=16, attention_variant="test_hint_plugin_attention"
        )
        assert registry.part_modules(trainer.lightning_module.gpt_config) == {
            "attention_variant": "ownlab.layers"
        }
        assert f"next: nanolab generate --ckpt {last} --prompt" in end_block(trainer)
    finally:
        for name in ("ownlab", "ownlab.layers"):
            sys.modules.pop(name, None)
