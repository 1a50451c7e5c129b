"""``fit``, ``estimate`` and ``queue add`` read a config with one resolver, so they give the
same verdict on it, naming the same field: a misspelt key anywhere (not only under
``model.gpt``), a quoted number the fit parser types, a whole float, an empty file, a tuple of
the wrong length, and the micro-batch setting a global batch does not divide.

``estimate`` once read the YAML on its own: it priced ``trainer: {precison: 32-true}`` as
bf16-mixed (exit 0) where fit refused the key, and refused ``eval_every_steps: "50"``, which fit
trains, saying "must be >= 1"."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import nanolab_here, tiny_overrides, write_config

#: (what is given, the error line all three verbs end with; None: all three accept it)
CASES = {
    "misspelt trainer key in a file": (
        {"trainer": {"precison": "32-true"}},
        "unknown setting trainer.precison; did you mean trainer.precision?",
    ),
    "misspelt trainer key on the command line": (
        ["--trainer.max_stepz", "3"],
        "unknown setting --trainer.max_stepz; did you mean --trainer.max_steps?",
    ),
    "misspelt data key": (
        ["--data.micro_batch", "4"],
        "unknown setting --data.micro_batch; did you mean --data.micro_batch_size?",
    ),
    "misspelt group": (
        {"chekpoint": {"every_n_steps": 5}},
        "unknown setting chekpoint.every_n_steps; did you mean checkpoint.every_n_steps?",
    ),
    "misspelt model group": (
        {"model": {"schedul": {"warmup_steps": 5}}},
        "unknown setting model.schedul.warmup_steps; did you mean model.schedule.warmup_steps?",
    ),
    "empty file": (None, "is empty; give it settings"),
    "whole float in a file": (
        {"budget": {"max_tokens": 1e6}},
        "budget.max_tokens: 1000000.0 is read as a float and this setting takes a whole "
        "number; write it whole: 1000000",
    ),
    "whole float on the command line": (
        ["--run.eval_every_steps", "100.0"],
        "run.eval_every_steps: 100.0 is read as a float and this setting takes a whole "
        "number; write it whole: 100",
    ),
    "tuple of one": (
        ["--model.optimizer.betas", "[0.9]"],
        "model.optimizer.betas: '[0.9]' is not valid; expected a tuple with 2 elements",
    ),
    "global batch vs run.micro_batch_size": (
        ["--run.micro_batch_size", "8", "--run.global_batch_tokens", "128"],
        "run.global_batch_tokens (128) must be a positive multiple of run.micro_batch_size x "
        "model.gpt.block_size x devices = 8 x 32 x 1 = 256; e.g. 256",
    ),
    "global batch vs data.micro_batch_size": (
        ["--run.global_batch_tokens", "100"],
        "run.global_batch_tokens (100) must be a positive multiple of data.micro_batch_size x "
        "model.gpt.block_size x devices = 4 x 32 x 1 = 128; e.g. 128",
    ),
    "quoted numbers fit types": (
        {
            "run": {"eval_every_steps": "50"},
            "trainer": {"max_steps": "2", "gradient_clip_val": "1.0"},
            "model": {"optimizer": {"lr": "1e-3"}, "gpt": {"block_size": "32"}},
        },
        None,
    ),
}


def _error(proc, verb: str) -> str | None:
    """The verb's one error line without its ``nanolab VERB: error:`` prefix; None for exit 0."""
    if proc.returncode == 0:
        return None
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, (verb, proc.stderr)
    prefix = f"nanolab {verb}: error: "
    assert lines[0].startswith(prefix), lines[0]
    return lines[0].removeprefix(prefix)


@pytest.mark.parametrize("case", list(CASES))
def test_fit_estimate_and_queue_add_give_the_same_verdict(
    case: str, char_dataset: Path, tmp_path: Path
) -> None:
    given, expected = CASES[case]
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=2)
    cfg["trainer"]["accelerator"] = "cpu"
    cfg["trainer"]["precision"] = "32-true"
    base = str(write_config(tmp_path / "base.yaml", cfg))
    files, flags = [base], []
    if isinstance(given, list):
        flags = given
    else:
        extra = tmp_path / "extra.yaml"
        extra.write_text("") if given is None else write_config(extra, given)
        files.append(str(extra))
    configs = [a for f in files for a in ("--config", f)]
    fit = _error(nanolab_here("fit", *configs, *flags, cwd=tmp_path), "fit")
    estimate = _error(
        nanolab_here("estimate", *configs, *flags, "--trace", "never", cwd=tmp_path), "estimate"
    )
    queue = _error(
        nanolab_here("queue", "add", "--db", str(tmp_path / "q.db"), *files, *flags, cwd=tmp_path),
        "queue add",
    )
    if expected is None:
        assert fit is estimate is queue is None, (fit, estimate, queue)
        return
    assert fit is not None and expected in fit, fit
    assert estimate == fit  # fit's own line, word for word
    assert queue is not None and queue.endswith(fit), queue  # after the job's files or --set
    assert "Expected" not in fit
