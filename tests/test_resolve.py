"""The one config resolver: what fit, queue add and estimate derive from a config, and that they
derive the same thing (device count, micro-batch, accumulation, vocabulary, run directory)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from conftest import QUICKSTART

from nanolab.estimator.setup import EstimateError, load_config, setup_from_config
from nanolab.training.plugins import DEFAULT_DATA, DEFAULT_MODEL
from nanolab.training.resolve import (
    RunConfigError,
    count_devices,
    plain_config,
    resolve,
    sections,
)


def quickstart(**overrides: dict) -> dict:
    cfg = yaml.safe_load(QUICKSTART.read_text())
    for group, values in overrides.items():
        cfg[group] = {**(cfg.get(group) or {}), **values}
    return cfg


@pytest.mark.parametrize(
    ("devices", "accelerator", "visible", "expected"),
    [
        ("auto", "auto", 4, (4, False)),  # fit on a 4-GPU machine
        ("auto", "gpu", 1, (1, False)),  # a queued job: the one GPU it is given
        ("auto", "auto", None, (1, True)),  # the estimator: cannot see the machine
        (-1, "gpu", 8, (8, False)),
        ("auto", "cpu", 8, (1, False)),  # a CPU run is one process, whatever GPUs exist
        ([0, 3], "gpu", 8, (2, False)),
        ("0,1", "gpu", 8, (2, False)),
        ("2", "gpu", 8, (2, False)),
        (4, "gpu", None, (4, False)),
    ],
)
def test_one_device_counter(devices, accelerator, visible, expected) -> None:
    assert count_devices(devices, accelerator, visible) == expected


def test_resolve_derives_what_fit_fills_in() -> None:
    cfg = quickstart(
        run={"global_batch_tokens": 32 * 128 * 2 * 3, "name": "r1", "root": "somewhere"},
        trainer={"devices": "auto", "accelerator": "gpu"},
    )
    r = resolve(cfg, visible_gpus=2, data_vocab=65)
    assert (r.devices_per_node, r.num_nodes, r.world_size) == (2, 1, 2)
    assert r.micro_batch_size == 32 and r.block_size == 128 and r.accumulate == 3
    assert r.tokens_per_step == 32 * 128 * 2 * 3
    assert r.val_check_interval == 100 * 3  # eval_every_steps in micro-batches
    assert r.vocab_size == 65 and r.model_args["gpt"]["vocab_size"] == 65
    assert r.data_args["block_size"] == 128  # the data's windows follow the model's context
    assert r.run_dir == Path("somewhere") / "r1"
    assert (r.model_class, r.data_class) == (DEFAULT_MODEL, DEFAULT_DATA)


def test_run_micro_batch_wins_and_auto_waits_for_the_caller() -> None:
    cfg = quickstart(run={"micro_batch_size": 8, "global_batch_tokens": 8 * 128 * 4})
    r = resolve(cfg, visible_gpus=1)
    assert r.micro_batch_size == 8 and r.accumulate == 4 and r.data_args["micro_batch_size"] == 8
    auto = quickstart(run={"micro_batch_size": "auto", "global_batch_tokens": 4096})
    r = resolve(auto, visible_gpus=1)
    assert r.micro_batch_size is None and r.accumulate is None and r.tokens_per_step is None
    planned = resolve(auto, visible_gpus=1, micro_batch_size=16)
    assert planned.micro_batch_size == 16 and planned.accumulate == 2


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("50", "run.eval_every_steps: '50' is not a whole number; give the optimizer steps"),
        (None, "run.eval_every_steps: null is not a whole number"),
        (True, "run.eval_every_steps: True is not a whole number"),
        (
            100.0,
            "run.eval_every_steps: 100.0 is read as a float and this setting takes a whole "
            "number; write it whole: 100",
        ),
        (2.5, "run.eval_every_steps: 2.5 is not a whole number"),
        (0, "run.eval_every_steps must be >= 1 (optimizer steps between validations), got 0"),
    ],
)
def test_eval_every_is_refused_for_what_is_wrong_with_it(value: object, message: str) -> None:
    """A value of another type was "must be >= 1, got '50'": a range it is not out of."""
    with pytest.raises(RunConfigError) as err:
        resolve(quickstart(run={"eval_every_steps": value}), visible_gpus=1)
    assert str(err.value).startswith(message)
    assert ">= 1" not in str(err.value) or value == 0


def test_the_global_batch_refusal_names_the_micro_batch_setting_it_came_from() -> None:
    """It named data.micro_batch_size (32) beside run.micro_batch_size's 64."""
    for run, given, name in (
        ({"micro_batch_size": 64}, None, "run.micro_batch_size x"),
        ({}, None, "data.micro_batch_size x"),
        ({}, 16, "--micro-batch x"),
    ):
        cfg = quickstart(run={**run, "global_batch_tokens": 4000})
        with pytest.raises(RunConfigError, match=re.escape(name)):
            resolve(cfg, visible_gpus=1, micro_batch_size=given, micro_batch_from="--micro-batch")


FSDP2 = "nanolab.training.strategies.FSDP2Strategy"
DEEPSPEED = "nanolab.training.strategies.DeepSpeedStrategy"


@pytest.mark.parametrize(
    ("overrides", "data_vocab", "message"),
    [
        ({"run": {"global_batch_tokens": 1000}}, None, "run.global_batch_tokens (1000) must be"),
        ({"model": {"gpt": {"vocab_size": 10, "block_size": 128}}}, 65, "larger than model.gpt"),
        ({"run": {"eval_every_steps": 0}}, None, "run.eval_every_steps must be >= 1"),
        ({"run": {"name": "../x"}}, None, "run.name '../x'"),
        ({"trainer": {"max_steps": 0}}, None, "trainer.max_steps must be a positive"),
        ({"trainer": {"devices": "two"}}, None, "trainer.devices must be an integer"),
        ({"run": {"micro_batch_size": 0}}, None, "run.micro_batch_size must be >= 1"),
        # The data's windows follow the model's context: another value is refused, not replaced.
        ({"data": {"block_size": 64}}, None, "data.block_size (64) differs from model.gpt"),
        (
            {
                "trainer": {
                    "precision": "16-mixed",
                    "strategy": {"class_path": "nanolab.training.strategies.FSDP2Strategy"},
                }
            },
            None,
            "trainer.precision 16-mixed cannot run under FSDP2 (it has no fp16 loss scaler); use "
            "bf16-mixed, or trainer.strategy ddp or deepspeed",
        ),
        (
            {"trainer": {"precision": "64-true", "strategy": {"class_path": FSDP2}}},
            None,
            "64-true cannot run under FSDP2 (it runs 32-bit, bf16 or 16-bit weights only)",
        ),
        (
            {"trainer": {"gradient_clip_algorithm": "value", "strategy": "deepspeed_stage_2"}},
            None,
            "trainer.gradient_clip_algorithm value: DeepSpeed clips by the global norm only",
        ),
        (
            {
                "model": {"optimizer": {"name": "adamw8bit"}},
                "trainer": {
                    "strategy": {
                        "class_path": DEEPSPEED,
                        "init_args": {"stage": 3, "offload_optimizer": True},
                    }
                },
            },
            None,
            "model.optimizer.name 'adamw8bit' cannot run with DeepSpeed's optimizer offload",
        ),
        (
            {"model": {"optimizer": {"name": "muon"}}, "trainer": {"strategy": "fsdp"}},
            None,
            "model.optimizer.name 'muon' needs whole weight matrices on every device, but "
            "trainer.strategy (fsdp1) shards them",
        ),
        (
            {
                "model": {"optimizer": {"name": "muon"}},
                "trainer": {"strategy": "deepspeed_stage_2"},
            },
            None,
            "trainer.strategy (deepspeed) shards them",
        ),
    ],
)
def test_settings_that_cannot_work_name_their_key(overrides, data_vocab, message) -> None:
    with pytest.raises(RunConfigError, match=re.escape(message)):
        resolve(quickstart(**overrides), visible_gpus=1, data_vocab=data_vocab)


def test_class_path_and_short_form_read_the_same() -> None:
    short = quickstart()
    long = {
        **short,
        "model": {"class_path": DEFAULT_MODEL, "init_args": short["model"]},
        "data": {"class_path": DEFAULT_DATA, "init_args": short["data"]},
    }
    assert sections(long) == sections(short)
    assert resolve(long, visible_gpus=1) == resolve(short, visible_gpus=1)
    # nanolab's own classes are written back in the short form (config.yaml as before) ...
    assert plain_config(long)["model"] == short["model"]
    # ... and a class of one's own keeps its class path.
    mine = {**short, "model": {"class_path": "mylab.models.MyGPT", "init_args": short["model"]}}
    assert plain_config(mine)["model"] == mine["model"]
    assert sections({"model": "mylab.models.MyGPT"})[:2] == ("mylab.models.MyGPT", {})


def test_estimator_and_resolver_agree(tmp_path: Path) -> None:
    """The estimator reads devices, micro-batch and global batch through the resolver:
    ``devices: "0,1"`` is two devices for both (the queue once read it as one)."""
    cfg = quickstart(
        trainer={"devices": "0,1", "accelerator": "gpu", "precision": "bf16-mixed"},
        run={"micro_batch_size": 16, "global_batch_tokens": 16 * 128 * 2 * 2},
        model={"gpt": {**quickstart()["model"]["gpt"], "vocab_size": 65}},
    )
    setup = setup_from_config(cfg)
    r = resolve(cfg, visible_gpus=None)
    assert (setup.devices, setup.world_size, setup.micro_batch_size) == (2, 2, 16)
    assert (r.world_size, r.micro_batch_size, r.accumulate) == (2, 16, 2)
    assert setup.global_batch_tokens == r.tokens_per_step
    auto = {**cfg, "trainer": {**cfg["trainer"], "devices": "auto"}}
    assert (
        setup_from_config(auto).devices_guessed and resolve(auto, visible_gpus=None).world_size == 1
    )
    bad = {**cfg, "run": {**cfg["run"], "global_batch_tokens": 1000}}
    with pytest.raises(EstimateError, match=r"run\.global_batch_tokens"):
        setup_from_config(bad)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert setup_from_config(load_config([path])) == setup


def test_later_files_merge_as_the_fit_parser_merges_them(tmp_path: Path, capsys) -> None:
    """``model``/``data`` are class choices when files are merged: a class path keeps the
    settings given so far, plain settings go to the class chosen so far. The estimator's merge
    (merge_configs) reads two files as ``nanolab fit --print_config`` does."""
    from nanolab.cli import main
    from nanolab.training.resolve import merge_configs

    mine = {"class_path": "mylab.models.MyGPT", "init_args": {"label_smoothing": 0.1}}
    merged = merge_configs(quickstart(), {"model": mine})
    assert merged["model"]["class_path"] == "mylab.models.MyGPT"
    assert merged["model"]["init_args"]["gpt"] == quickstart()["model"]["gpt"]
    assert merged["model"]["init_args"]["label_smoothing"] == 0.1
    again = merge_configs(merged, {"model": {"gpt": {"n_layer": 8}}})
    assert again["model"]["class_path"] == "mylab.models.MyGPT"
    assert again["model"]["init_args"]["gpt"]["n_layer"] == 8

    # Against the real parser: the default class named by path after the recipe, then a
    # plain setting; every merged setting is what fit prints.
    files = [QUICKSTART, tmp_path / "a.yaml", tmp_path / "b.yaml"]
    files[1].write_text(yaml.safe_dump({"model": DEFAULT_MODEL, "data": {"seed": 7}}))
    files[2].write_text(yaml.safe_dump({"model": {"gpt": {"n_layer": 3}}}))
    merged = load_config(files)
    args = [a for f in files for a in ("--config", str(f))]
    try:
        code = main(["fit", *args, "--print_config"])
    except SystemExit as stop:
        code = stop.code
    assert code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    model_cls, model, data_cls, data = sections(printed)
    want_model_cls, want_model, want_data_cls, want_data = sections(merged)
    assert (model_cls, data_cls) == (want_model_cls, want_data_cls)
    for got, want in ((model, want_model), (data, want_data)):
        for name, value in want.items():
            if isinstance(value, dict):
                assert {k: got[name][k] for k in value} == value, name
            else:
                assert got[name] == value, name
    assert sections(merged)[1]["gpt"]["n_layer"] == 3 and sections(merged)[3]["seed"] == 7


def test_fit_plans_auto_micro_batch_through_the_resolver(
    tmp_path: Path, char_dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run.micro_batch_size: auto`` on a device with memory (a GPU's, stood in for here): the
    planned micro-batch and the accumulation re-derived from it are what the run uses and saves.
    8 sequences per step and room for all of them: micro-batch 8 (not the data's 4), accumulation 1.
    """
    from conftest import tiny_overrides, write_config

    import nanolab.run.compose as fit_cli
    from nanolab.cli import main

    monkeypatch.setattr(fit_cli, "gpu_memories", lambda devices: [8 * 2**30])
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=2)
    cfg["trainer"]["accelerator"] = "auto"  # this machine's CPU; the planner sees "a device"
    cfg["run"].update(micro_batch_size="auto", global_batch_tokens=8 * 32)
    path = write_config(tmp_path / "auto.yaml", cfg)
    assert main(["fit", "--config", str(QUICKSTART), "--config", str(path)]) == 0
    saved = yaml.safe_load((tmp_path / "runs" / "tiny" / "config.yaml").read_text())
    assert saved["data"]["micro_batch_size"] == 8
    assert saved["trainer"]["accumulate_grad_batches"] == 1
    assert saved["trainer"]["val_check_interval"] == cfg["run"]["eval_every_steps"]


def test_data_block_size_left_out_or_equal_follows_the_model() -> None:
    assert resolve(quickstart(), visible_gpus=1).data_args["block_size"] == 128
    same = quickstart(data={"block_size": 128})
    assert resolve(same, visible_gpus=1).data_args["block_size"] == 128


def test_muon_under_ddp_is_accepted() -> None:
    cfg = quickstart(model={"optimizer": {"name": "muon"}}, trainer={"strategy": "ddp"})
    assert resolve(cfg, visible_gpus=1).model_class


def test_a_key_given_twice_is_refused_and_merge_keys_still_work() -> None:
    """PyYAML keeps the last of two equal keys, so a second `trainer:` block silently dropped
    the first; the refusal must leave YAML's `<<: *anchor` merges (whose keys a mapping may
    override) as they were."""
    from nanolab.training.resolve import load_yaml

    text = "base: &b\n  lr: 1\n  wd: 2\none:\n  <<: *b\n  lr: 3\ntwo: {<<: *b}\n"
    assert load_yaml(text) == {
        "base": {"lr": 1, "wd": 2}, "one": {"lr": 3, "wd": 2}, "two": {"lr": 1, "wd": 2},
    }  # fmt: skip
    with pytest.raises(
        RunConfigError, match=r"`trainer` is given twice in one mapping \(lines 1 and 3\)"
    ):
        load_yaml(
            "trainer: {max_steps: 7}\nmodel: {}\ntrainer: {gradient_clip_val: 0.5}\n", "f.yaml"
        )
    with pytest.raises(RunConfigError, match="`max_steps` is given twice"):
        load_yaml("trainer:\n  max_steps: 5\n  max_steps: 10\n")
