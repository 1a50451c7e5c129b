"""One resolver: what ``estimate``, ``bench`` and the estimator API read from a command line is
what ``nanolab fit`` reads from it.

:func:`nanolab.training.resolve.compose` (``--config`` files and dotted overrides, left to right)
is held against the fit parser itself (:func:`nanolab.run.parse.parse_fit_config`, what
``fit --print_config`` prints) for every shipped config, each with every overlay of
``configs/strategy``, ``configs/precision`` and ``configs/debug``, a forked project's class-path
model and data, and more than 20 overrides. Three things must agree: every value the composed
config holds is the value fit holds at that key; :func:`resolve` (devices, micro-batch,
accumulation, run directory) is equal; and the estimator's facts (:func:`setup_from_config`) are
equal, or both sides fail with the same message.
"""

from __future__ import annotations

import math
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from nanolab.estimator.setup import setup_from_config
from nanolab.run.parse import FitParseError, parse_fit_config
from nanolab.training.resolve import (
    RunConfigError,
    compose,
    plain_config,
    resolve,
    split_fit_args,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
OVERLAYS = sorted(p for group in ("strategy", "precision", "debug") for p in (ROOT / "configs" / group).glob("*.yaml"))  # fmt: skip

#: Overrides as a user types them after ``--config``: every group, nested dataclasses, class
#: choices, nulls, lists, floats with exponents, ``=`` and space forms, a list append.
OVERRIDES = [
    ["--model.gpt.n_layer", "3"],
    ["--model.gpt.n_head=2", "--model.gpt.n_embd", "64"],
    ["--model.gpt.block_size", "128"],
    ["--model.gpt.dropout", "0.1"],
    ["--model.gpt.bias", "false"],
    ["--model.gpt.vocab_size", "null"],
    ["--model.gpt.gradient_checkpointing", "true"],
    ["--model.gpt.position_embedding", "rope", "--model.gpt.attention_variant", "qk_norm"],
    ["--model.gpt.norm", "rmsnorm"],
    ["--model.gpt.mlp", "swiglu"],
    ["--model.optimizer.lr", "1e-3"],
    ["--model.optimizer.betas", "[0.9, 0.95]"],
    ["--model.optimizer.name", "muon"],
    ["--model.schedule.warmup_steps", "10"],
    ["--trainer.max_steps", "40"],
    ["--trainer.precision", "bf16-mixed"],
    ["--trainer.devices", "2"],
    ["--trainer.num_nodes", "2", "--trainer.devices", "4"],
    ["--trainer.strategy", "ddp"],
    ["--trainer.accumulate_grad_batches", "2"],
    ["--trainer.gradient_clip_val", "0.5"],
    ["--run.name", "parity", "--run.root", "elsewhere"],
    ["--run.global_batch_tokens", "8192"],
    ["--run.micro_batch_size", "4"],
    ["--run.eval_every_steps", "50"],
    ["--data.micro_batch_size", "8"],
    ["--data.block_size=128", "--model.gpt.block_size=128"],
    ["--trainer.callbacks+=lightning.pytorch.callbacks.LearningRateMonitor"],
    ["--seed_everything", "7"],
]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b
    if {type(a), type(b)} == {int, str}:  # ``trainer.devices: 2``: the parser keeps "2"
        return str(a) == str(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    return a == b


def differences(composed: Any, parsed: Any, where: str = "") -> list[str]:
    """Where ``composed`` holds a value that ``parsed`` does not (``parsed`` may hold more:
    the fit parser fills in every default)."""
    if isinstance(composed, dict):
        if not isinstance(parsed, dict):
            return [f"{where}: {composed!r} vs {parsed!r}"]
        out = []
        for key, value in composed.items():
            if key not in parsed:
                if value is None or value == {}:
                    continue  # a null is the parser's default
                out.append(f"{where}.{key}: missing in fit's config")
                continue
            out += differences(value, parsed[key], f"{where}.{key}")
        return out
    if isinstance(composed, (list, tuple)):
        if not isinstance(parsed, (list, tuple)) or len(composed) != len(parsed):
            return [f"{where}: {composed!r} vs {parsed!r}"]
        return [d for i, (x, y) in enumerate(zip(composed, parsed, strict=True)) for d in differences(x, y, f"{where}[{i}]")]  # fmt: skip
    if isinstance(composed, str) and isinstance(parsed, dict) and parsed.get("class_path"):
        # ``strategy: ddp`` / ``callbacks: [X]``: the parser may expand a class name.
        return [] if parsed["class_path"].rsplit(".", 1)[-1].lower().startswith(composed.lower()) or parsed["class_path"] == composed else [f"{where}: {composed!r} vs {parsed['class_path']!r}"]  # fmt: skip
    if isinstance(composed, dict) is False and isinstance(parsed, dict) and "class_path" in parsed:
        return [f"{where}: {composed!r} vs {parsed!r}"]
    return [] if _same(composed, parsed) else [f"{where}: {composed!r} vs {parsed!r}"]


def _outcome(fn: Any) -> Any:
    try:
        return fn()
    except (RunConfigError, ValueError) as err:
        return f"error: {err}"


def _derived(resolved: Any) -> Any:
    """What :func:`resolve` derives (its ``model_args``/``data_args`` are the config itself, whose
    every composed value is compared above; the parser's copy also holds each default)."""
    if isinstance(resolved, str):
        return resolved
    facts = dict(vars(resolved))
    model_args, data_args = facts.pop("model_args"), facts.pop("data_args")
    facts["vocab_size"] = model_args.get("gpt", {}).get("vocab_size")
    facts["data"] = {k: data_args.get(k) for k in ("block_size", "micro_batch_size")}
    return facts


def check_parity(args: list[str]) -> None:
    composed = compose(args)
    parsed = plain_config(parse_fit_config(args))
    diff = differences(plain_config(composed), parsed)
    assert not diff, f"{' '.join(args)}:\n  " + "\n  ".join(diff)
    for gpus in (0, 4):
        mine = _derived(_outcome(lambda g=gpus: resolve(composed, visible_gpus=g, data_vocab=256)))
        fits = _derived(_outcome(lambda g=gpus: resolve(parsed, visible_gpus=g, data_vocab=256)))
        assert mine == fits, f"{' '.join(args)}: resolve differs"
    mine = _outcome(lambda: setup_from_config(composed, vocab_size=256))
    fits = _outcome(lambda: setup_from_config(parsed, vocab_size=256))
    assert mine == fits, f"{' '.join(args)}: the estimator's facts differ"


def _short(p: Path) -> str:
    return str(p.relative_to(ROOT / "configs"))


# -- the default run: every config alone, every overlay once, every override once ---------------
@pytest.mark.parametrize("config", CONFIGS, ids=_short)
def test_every_shipped_config(config: Path) -> None:
    check_parity(["--config", str(config)])


@pytest.mark.parametrize("overlay", OVERLAYS, ids=_short)
def test_every_overlay_on_the_quickstart(overlay: Path) -> None:
    check_parity(["--config", str(ROOT / "configs/quickstart.yaml"), "--config", str(overlay)])


def test_overrides_one_command_line() -> None:
    """All overrides of :data:`OVERRIDES` that can stand together, in one fit command line."""
    base = ["--config", str(ROOT / "configs/gpt2-124m.yaml")]
    check_parity([*base, *(a for o in OVERRIDES if "muon" not in o for a in o)])


@pytest.mark.parametrize("override", OVERRIDES, ids=lambda o: " ".join(o)[:40])
def test_each_override(override: list[str]) -> None:
    check_parity(["--config", str(ROOT / "configs/quickstart.yaml"), *override])


def test_a_later_config_wins_over_an_earlier_override() -> None:
    quick, fp32 = str(ROOT / "configs/quickstart.yaml"), str(ROOT / "configs/precision/fp32.yaml")
    args = ["--config", quick, "--trainer.precision", "bf16-mixed", "--config", fp32]
    check_parity(args)
    assert compose(args)["trainer"]["precision"] == "32-true"


@pytest.fixture
def fork(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A forked project's model and data classes, importable by class path."""
    package = tmp_path / "myfork"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text(
        textwrap.dedent(
            """
            from nanolab.training.module import GPTLightningModule

            class Model(GPTLightningModule):
                pass
            """
        )
    )
    (package / "data.py").write_text(
        textwrap.dedent(
            """
            from nanolab.data.datamodule import TokenDataModule

            class Data(TokenDataModule):
                pass
            """
        )
    )
    config = tmp_path / "experiment.yaml"
    config.write_text(
        textwrap.dedent(
            """
            model:
              class_path: myfork.model.Model
              init_args:
                gpt: {n_layer: 2, n_head: 2, n_embd: 32, block_size: 64}
            data:
              class_path: myfork.data.Data
              init_args: {block_size: 64, micro_batch_size: 4}
            trainer: {max_steps: 10, accelerator: cpu, devices: 1}
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield config
    for name in [m for m in sys.modules if m.startswith("myfork")]:
        del sys.modules[name]


def test_a_forked_projects_class_path_model_and_data(fork: Path) -> None:
    check_parity(["--config", str(fork)])
    check_parity(["--config", str(fork), "--model.gpt.n_layer", "3", "--data.micro_batch_size=2"])
    composed = compose(["--config", str(fork), "--model.gpt.n_layer", "3"])
    assert composed["model"]["class_path"] == "myfork.model.Model"
    assert composed["model"]["init_args"]["gpt"]["n_layer"] == 3


def test_the_check_can_fail() -> None:
    """A composed value fit does not hold is a difference (the comparison is not vacuous)."""
    parsed = plain_config(parse_fit_config(["--config", str(ROOT / "configs/quickstart.yaml")]))
    wrong = compose(["--config", str(ROOT / "configs/quickstart.yaml"), "--model.gpt.n_layer", "9"])
    assert differences(plain_config(wrong), parsed) == [".model.gpt.n_layer: 9 vs 4"]


def test_a_bad_override_is_the_same_refusal() -> None:
    with pytest.raises(FitParseError):
        parse_fit_config(["--config", str(ROOT / "configs/quickstart.yaml"), "--model.gpt.n_layer"])
    with pytest.raises(RunConfigError, match="needs a value"):
        split_fit_args(["--config", "x.yaml", "--model.gpt.n_layer"])


# -- the whole matrix: every config with every overlay ------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("overlay", OVERLAYS, ids=_short)
@pytest.mark.parametrize("config", CONFIGS, ids=_short)
def test_every_config_with_every_overlay(config: Path, overlay: Path) -> None:
    check_parity(["--config", str(config), "--config", str(overlay), "--model.gpt.n_layer", "2"])
