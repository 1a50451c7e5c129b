"""Training end to end: the CLI, optimizer and schedule, strategies (DDP, FSDP2, DeepSpeed), 8-bit AdamW."""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil

import lightning as L
import pytest
import torch
import yaml
from conftest import QUICKSTART, REPO, nanolab_here, run_nanolab, tiny_overrides, write_config

from nanolab.cli import main
from nanolab.data.datamodule import TokenDataModule
from nanolab.model import GPT, GPTConfig
from nanolab.model.config import ConfigError
from nanolab.runlog import read_records
from nanolab.training.module import GPTLightningModule
from nanolab.training.optim import OptimizerConfig, ScheduleConfig, WarmupCosine, parameter_groups
from nanolab.training.resolve import RunConfigError, gradient_accumulation


def final_state(run_dir) -> dict[str, torch.Tensor]:
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    return ckpt["state_dict"]


def test_fit_then_generate_through_the_cli(tmp_path, char_dataset):
    cfg = write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    # fit through the entry point in this process (a fit's process: test_cli_output), generate
    # in its own
    res = nanolab_here("fit", "--config", str(QUICKSTART), "--config", str(cfg), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    run_dir = tmp_path / "runs" / "tiny"
    assert (run_dir / "config.yaml").is_file()
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 6
    assert ckpt["nanolab"]["gpt"]["n_layer"] == 2
    assert ckpt["nanolab"]["tokenizer"]["name"] == "chars"
    gen = run_nanolab(
        "generate", "--ckpt", str(run_dir / "checkpoints" / "last.ckpt"),
        "--prompt", "HIPPOLYTA:", "--max-new-tokens", "20", cwd=tmp_path,
    )  # fmt: skip
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("HIPPOLYTA:") and len(gen.stdout.strip()) >= 25


def test_print_config_shows_the_merged_config(tmp_path, char_dataset):
    cfg = write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    res = nanolab_here(
        "fit", "--config", str(QUICKSTART), "--config", str(cfg), "--print_config", cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    assert "n_layer: 2" in res.stdout and "block_size: 32" in res.stdout
    assert "global_batch_tokens" in res.stdout


def test_help_lists_every_verb(tmp_path):
    res = run_nanolab("--help", cwd=tmp_path)
    for verb in (
        "fit",
        "validate",
        "test",
        "prepare",
        "generate",
        "estimate",
        "report",
        "queue",
        "bench",
    ):
        assert f"  {verb} " in res.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model.gpt.n_layr", "3"], "n_layr"),
        (["--model.gpt.n_layer", "abc"], "model.gpt.n_layer"),
        (["--model.gpt.n_head", "3"], "divisible by model.gpt.n_head"),
        (["--model.gpt.vocab_size", "10"], "larger than model.gpt.vocab_size"),
        (["--run.global_batch_tokens", "1000"], "run.global_batch_tokens"),
        (["--data.dataset_dir", "nowhere"], "holds no prepared dataset"),
        (["--model.optimizer.lr", "-1"], "model.optimizer.lr"),
    ],
)
def test_bad_configs_fail_in_one_line_and_write_nothing(
    tmp_path, char_dataset, capsys, args, message
):
    # In-process (the subprocess path is covered above): same code, seconds faster.
    cfg = write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    try:
        code = main(["fit", "--config", str(QUICKSTART), "--config", str(cfg), *args])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "runs").exists()


def test_a_dataset_shorter_than_one_block_is_refused(tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("too short")
    overrides = tiny_overrides(tmp_path / "ds", tmp_path / "runs")
    overrides["data"]["source"] = [str(text)]
    cfg = write_config(tmp_path / "tiny.yaml", overrides)
    res = nanolab_here("fit", "--config", str(QUICKSTART), "--config", str(cfg), cwd=tmp_path)
    assert res.returncode == 2
    assert "fewer than one block" in res.stderr


def test_gradient_accumulation_is_derived_from_global_batch_tokens():
    assert gradient_accumulation(None, 16, 1024, 8) == 1
    # Without a global batch in tokens, Lightning's own setting is the accumulation; with one,
    # the derived value wins (it keeps the batch on another device count).
    assert gradient_accumulation(None, 16, 1024, 8, 4) == 4
    assert gradient_accumulation(524288, 16, 1024, 8, 2) == 4
    with pytest.raises(RunConfigError, match=r"trainer\.accumulate_grad_batches"):
        gradient_accumulation(None, 16, 1024, 8, 0)
    assert gradient_accumulation(524288, 16, 1024, 1) == 32
    assert gradient_accumulation(524288, 16, 1024, 8) == 4
    with pytest.raises(RunConfigError, match="multiple"):
        gradient_accumulation(500_000, 16, 1024, 8)


def test_warmup_cosine_schedule():
    f = WarmupCosine(warmup_steps=10, decay_steps=110, min_ratio=0.1)
    assert f(0) < f(5) < f(9) < f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.55)
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(10, 120))


def test_the_schedule_docs_quote_is_what_steps_train_at():
    """docs/configs.md says "linear warm-up" and "cosine to min_lr at max_steps" exactly: step k
    trains at f(k - 1), so step 1 at lr/(W+1) and the last step above the minimum."""
    f = WarmupCosine(warmup_steps=3, decay_steps=12, min_ratio=0.1)
    trained = [round(f(k - 1), 3) for k in range(1, 13)]
    assert trained[:4] == [0.25, 0.5, 0.75, 1.0] and trained[-2:] == [0.205, 0.127]
    doc = (QUICKSTART.parents[1] / "docs" / "configs.md").read_text()
    assert "(12 steps, warm-up 3: 0.25, 0.5, 0.75, 1, ..., 0.205, 0.127 × lr)" in doc
    assert "step 1 trains at lr/(W + 1), not 0" in doc


def test_the_banner_says_what_the_lr_does_past_the_end_of_a_schedule_it_extends() -> None:
    """A run first trained for fewer steps than its warm-up, then extended, keeps warming up
    to the warm-up's end and only then drops to the minimum: the banner said "the extra steps
    run at its minimum" for all of them."""
    from types import SimpleNamespace

    from nanolab.callbacks.banner import ended_schedule_note

    def trainer(fn: WarmupCosine) -> SimpleNamespace:
        scheduler = SimpleNamespace(lr_lambdas=[fn])
        return SimpleNamespace(lr_scheduler_configs=[SimpleNamespace(scheduler=scheduler)])

    short = WarmupCosine(warmup_steps=50, decay_steps=30, min_ratio=0.1)  # first run: 30 steps
    assert [round(short(k - 1), 2) for k in (50, 51)] == [0.98, 0.1]  # step k trains at f(k - 1)
    assert ended_schedule_note(trainer(short), 34, 600, 30) == (
        "the LR schedule ended at step 30, inside its 50-step warm-up: the LR goes on rising to "
        "98% of its peak at step 50, then drops to its minimum (10%) for the last 550 steps"
    )
    assert ended_schedule_note(trainer(short), 30, 40, 30).endswith(
        "the LR goes on rising, to 78% of its peak at step 40"
    )
    done = WarmupCosine(warmup_steps=5, decay_steps=30, min_ratio=0.1)
    assert ended_schedule_note(trainer(done), 30, 40, 30) == (
        "the LR schedule ended at step 30: the extra steps run at its minimum"
    )


@pytest.mark.parametrize(
    "command",
    [
        ["estimate", "--config", str(QUICKSTART), "--vocab-size", "65"],
        ["queue", "add", "--db", "q.db", str(QUICKSTART)],
    ],
    ids=["estimate", "queue-add"],
)
def test_a_decay_that_ends_inside_the_warmup_is_accepted_by_every_command(
    command, tmp_path, monkeypatch, capsys
):
    """decay_steps 3 after a 5-step warm-up was refused by every command, so a run an earlier
    release started with it could no longer be resumed, queued or estimated. It runs again
    (``fit`` warns at launch: tests/test_callbacks_jsonl.py); the ranges are still checked."""
    monkeypatch.chdir(tmp_path)
    schedule = ["model.schedule.warmup_steps=5", "model.schedule.decay_steps=3"]
    if command[0] == "queue":
        overrides = [a for kv in schedule for a in ("--set", kv)]
    else:
        overrides = [f"--{kv}" for kv in schedule]
    assert main([*command, *overrides]) == 0, capsys.readouterr().err
    ScheduleConfig(warmup_steps=5, decay_steps=5)
    ScheduleConfig(warmup_steps=5, decay_steps=1)
    with pytest.raises(ConfigError, match=r"^model.schedule.decay_steps must be >= 1, got 0"):
        ScheduleConfig(warmup_steps=5, decay_steps=0)
    with pytest.raises(ConfigError, match=r"^model.schedule.warmup_steps must be >= 0, got -1"):
        ScheduleConfig(warmup_steps=-1)


def test_weight_decay_only_on_matrices():
    module = GPTLightningModule(
        gpt=GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)
    )
    decay, no_decay = parameter_groups(module.model, 0.1)
    assert all(p.dim() >= 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert all(p.dim() < 2 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    n = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    assert n == module.model.num_params()


def _fit_in_process(char_dataset, tmp_path, optimizer: OptimizerConfig, steps: int = 4):
    L.seed_everything(0)
    model = GPTLightningModule(
        gpt=GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32),
        optimizer=optimizer,
        schedule=ScheduleConfig(warmup_steps=1),
    )
    dm = TokenDataModule(dataset_dir=str(char_dataset), micro_batch_size=4, block_size=32)
    trainer = L.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        default_root_dir=tmp_path, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(model, dm)
    return model, trainer


class LrProbe(L.Callback):
    """The learning rate each optimizer step used, read just before the step is taken."""

    def __init__(self) -> None:
        self.lr_by_step: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # global_step counts the steps already taken: this is step `global_step` (0-based).
        self.lr_by_step[trainer.global_step] = optimizer.param_groups[0]["lr"]


def test_lr_follows_the_schedule_per_optimizer_step_and_across_a_resume(char_dataset, tmp_path):
    """The LR of optimizer step k is ``lr * WarmupCosine(k)`` mid-schedule (warmup 2, cosine to
    step 8, floor never reached), with 2 micro-batches per step, and a resumed run goes on
    where the first stopped.

    Mutations caught: stepping the scheduler per micro-batch (an extra
    ``self.lr_schedulers().step()`` in ``training_step``: step k gets f(2k)); not restoring the
    scheduler on resume (``checkpoint["lr_schedulers"] = []`` in ``on_load_checkpoint``: the
    resumed steps restart the warmup).
    """
    schedule = ScheduleConfig(warmup_steps=2, decay_steps=8, min_lr_ratio=0.1)
    f = WarmupCosine(2, 8, 0.1)

    def fit(max_steps: int, ckpt_path=None) -> tuple[LrProbe, L.Trainer]:
        L.seed_everything(0)
        model = GPTLightningModule(
            gpt=GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32),
            optimizer=OptimizerConfig(lr=1e-3),
            schedule=schedule,
        )
        dm = TokenDataModule(dataset_dir=str(char_dataset), micro_batch_size=2, block_size=32)
        probe = LrProbe()
        trainer = L.Trainer(
            max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
            default_root_dir=tmp_path, use_distributed_sampler=False, accumulate_grad_batches=2,
            callbacks=[probe],
        )  # fmt: skip
        trainer.fit(model, dm, ckpt_path=ckpt_path, weights_only=True)
        return probe, trainer

    first, trainer = fit(3)
    assert trainer.fit_loop.epoch_loop.batch_progress.total.processed == 6  # accumulation 2
    trainer.save_checkpoint(tmp_path / "step3.ckpt")
    resumed, _ = fit(6, ckpt_path=tmp_path / "step3.ckpt")
    lrs = {**first.lr_by_step, **resumed.lr_by_step}
    assert sorted(first.lr_by_step) == [0, 1, 2] and sorted(resumed.lr_by_step) == [3, 4, 5]
    expected = {k: 1e-3 * f(k) for k in range(6)}
    assert lrs == pytest.approx(expected, rel=1e-12)
    # Mid-schedule: every step has its own LR, none of them the floor.
    assert len({round(v, 12) for v in lrs.values()}) == 6 and min(lrs.values()) > 1e-3 * 0.1


def test_the_estimators_ground_truth_holds_what_fit_holds(char_dataset, tmp_path):
    """``nanolab.estimator.measure`` counts the optimizer ``fit`` builds: the same groups and the
    same optimizer-state bytes as the optimizer of a real ``fit``.

    Mutation caught: measure.py building its own AdamW while fit's optimizer changes (tried:
    ``amsgrad=True`` in ``nanolab.training.optim.build_optimizer``, one more state per weight).
    """
    from nanolab.estimator.measure import build_optimizer, measure_states, storage_bytes

    module, trainer = _fit_in_process(char_dataset, tmp_path, OptimizerConfig(lr=1e-3), steps=1)
    fit_opt = trainer.optimizers[0]
    states = [v for st in fit_opt.state.values() for v in st.values() if torch.is_tensor(v)]
    measured = measure_states(module.gpt_config, "adamw")
    assert measured.optimizer == storage_bytes(states) > 0
    ours = build_optimizer(GPT(module.gpt_config))
    assert type(ours) is type(fit_opt)
    for mine, theirs in zip(ours.param_groups, fit_opt.param_groups, strict=True):
        assert [p.shape for p in mine["params"]] == [p.shape for p in theirs["params"]]
        assert mine["weight_decay"] == theirs["weight_decay"]


def test_adamw8bit_trains_with_8bit_states(char_dataset, tmp_path):
    pytest.importorskip("bitsandbytes")
    model, trainer = _fit_in_process(
        char_dataset, tmp_path, OptimizerConfig(name="adamw8bit", lr=1e-3)
    )
    opt = trainer.optimizers[0]
    assert type(opt).__name__ == "AdamW8bit"
    dtypes = {v.dtype for s in opt.state.values() for v in s.values() if torch.is_tensor(v)}
    assert torch.uint8 in dtypes  # large tensors keep their moments in 8 bits
    assert all(torch.isfinite(p).all() for p in model.parameters())


# -- strategies: 2 processes on CPU ---------------------------------------------------------
def _strategy_run(
    tmp_path, char_dataset, name: str, *extra: str, devices: int = 1, here: bool = False,
    **overrides,
):  # fmt: skip
    """``nanolab fit`` of the tiny model in its own processes (``here``: this one, 1 device)."""
    overrides = {"trainer__max_steps": 4, "model__gpt__dropout": 0.0, **overrides}
    base = tiny_overrides(
        char_dataset, tmp_path / "runs", trainer__devices=devices, run__name=name, **overrides
    )
    cfg = write_config(tmp_path / f"{name}.yaml", base)
    args = ("fit", "--config", str(QUICKSTART), "--config", str(cfg), *extra)
    if here:
        res = nanolab_here(*args, cwd=tmp_path)
    else:
        res = run_nanolab(*args, cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return tmp_path / "runs" / name


def _assert_same_weights(a: dict, b: dict, atol: float = 2e-5) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key].float(), b[key].float(), atol=atol, rtol=1e-4), key


def _train_records(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in read_records(run_dir / "metrics.jsonl", "train")}


def _replayed_loss(reference_run, step: int, dataset, world: int, rank: int, micro_batch: int):
    """The loss the 1-process run's weights after ``step - 1`` give on micro-batch
    ``micro_batch`` of ``rank`` in a ``world``-rank layout: what that rank logs at ``step``."""
    ckpt = torch.load(
        reference_run / "checkpoints" / f"step-{step - 1:08d}.ckpt", weights_only=True
    )
    model = GPT(GPTConfig(**ckpt["nanolab"]["gpt"]))
    model.load_state_dict({k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()})
    dm = TokenDataModule(dataset_dir=str(dataset), micro_batch_size=4, block_size=32)
    dm.setup("fit")
    x, y = dm.train_tokens[dm.window_plan(world).batch_starts(micro_batch, rank)]
    with torch.no_grad():
        return float(model(x, y)[1])


def _assert_same_trajectory(run, reference_run, dataset, grad_norm: bool = True) -> None:
    """Step by step, the 2-process run did what the 1-process run with 2x accumulation did.

    * ``grad_norm`` (all ranks, before clipping) equals the reference's: gradients are averaged
      over ranks, not summed (AdamW's update is blind to a constant gradient scale, so the final
      weights alone cannot tell);
    * ``loss`` equals the reference's: both log the mean over the step's micro-batches of all
      ranks, one global batch either way (rank 0's last micro-batch differed: 3.41 vs 3.69);
      and it is that mean: the reference's weights of the step before give it on the step's
      windows, so every intermediate step followed the same trajectory.
    """
    ours, ref = _train_records(run), _train_records(reference_run)
    assert sorted(ours) == sorted(ref) == [1, 2, 3, 4]
    for step in ref:
        if grad_norm:
            assert ours[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-4), step
        assert ours[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5), step
        if step == 1:
            continue  # no checkpoint of the initial weights to replay from
        both = [_replayed_loss(reference_run, step, dataset, 1, 0, 2 * step - m) for m in (2, 1)]
        assert ref[step]["loss"] == pytest.approx(sum(both) / 2, rel=1e-5), step


@pytest.fixture(scope="module")
def single_process_reference(tmp_path_factory, char_dataset):
    """One process, micro-batch 4, 2x accumulation: the reference for the 2-process runs
    (a checkpoint every step, to replay each step's loss from), trained in this process."""
    tmp = tmp_path_factory.mktemp("reference")
    return _strategy_run(
        tmp, char_dataset, "single", here=True, run__global_batch_tokens=4 * 32 * 2,
        checkpoint__every_n_steps=1, checkpoint__keep_last=10,
    )  # fmt: skip


def test_ddp_two_processes_match_one_process_with_accumulation(
    tmp_path, char_dataset, single_process_reference
):
    """Mutation caught: ``training_step`` returning ``loss * self.trainer.world_size`` (gradients
    summed over ranks): grad_norm doubles while the final weights stay within tolerance."""
    run = _strategy_run(
        tmp_path, char_dataset, "ddp", "--config", str(QUICKSTART.parent / "strategy" / "ddp.yaml"),
        "--trainer.devices", "2", run__global_batch_tokens=4 * 32 * 2,
    )  # fmt: skip
    _assert_same_trajectory(run, single_process_reference, char_dataset)
    _assert_same_weights(final_state(run), final_state(single_process_reference))


@pytest.mark.slow  # 30-100 s on 2 cores; `pytest -m slow`
def test_fsdp2_two_processes_match_one_process(tmp_path, char_dataset, single_process_reference):
    """Mutation caught: as for DDP (gradients summed over the sharding group)."""
    run = _strategy_run(
        tmp_path, char_dataset, "fsdp", "--config", str(QUICKSTART.parent / "strategy" / "fsdp.yaml"),
        "--trainer.devices", "2", run__global_batch_tokens=4 * 32 * 2,
    )  # fmt: skip
    _assert_same_trajectory(run, single_process_reference, char_dataset)
    _assert_same_weights(final_state(run), final_state(single_process_reference))


@pytest.mark.slow
@pytest.mark.parametrize("config", ["deepspeed_stage2", "deepspeed_stage3_offload"])
def test_deepspeed_runs_on_cpu_and_matches(
    tmp_path, char_dataset, single_process_reference, config
):
    """ZeRO-2, and ZeRO-3 with the optimizer offloaded to CPU (DeepSpeed's CPU Adam, JIT-built
    at first use and cached in ~/.cache/torch_extensions), train what the 1-process run trains.

    Mutations caught: as for DDP (``loss * world_size``: DeepSpeed's own global norm, which the
    run log reports, doubles); the offload config building torch's AdamW (DeepSpeed refuses it).
    """
    pytest.importorskip("deepspeed")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("DeepSpeed's CPU backend JIT-builds C++ ops; no compiler here")
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    run = _strategy_run(
        tmp_path, char_dataset, "ds", "--config", str(QUICKSTART.parent / "strategy" / f"{config}.yaml"),
        "--trainer.devices", "2", run__global_batch_tokens=4 * 32 * 2,
    )  # fmt: skip
    _assert_same_trajectory(run, single_process_reference, char_dataset)
    ckpt_dir = run / "checkpoints" / "last.ckpt"
    assert ckpt_dir.is_dir()  # DeepSpeed writes its own sharded directory format
    convert_zero_checkpoint_to_fp32_state_dict(str(ckpt_dir), str(tmp_path / "consolidated.ckpt"))
    state = torch.load(tmp_path / "consolidated.ckpt", weights_only=True)["state_dict"]
    reference = {
        k.removeprefix("model."): v for k, v in final_state(single_process_reference).items()
    }
    state = {k.removeprefix("model."): v for k, v in state.items()}
    # DeepSpeed's state dict names the tied weight once (as the embedding).
    common = reference.keys() & state.keys()
    assert "wte.weight" in common and len(common) >= len(reference) - 1
    _assert_same_weights(
        {k: state[k] for k in common}, {k: reference[k] for k in common}, atol=1e-4
    )


@pytest.mark.slow
def test_deepspeed_with_accumulation_divides_the_loss_once(tmp_path, char_dataset):
    """2 processes x 2 accumulated micro-batches under ZeRO-2 against 1 process x 4: the same
    gradient norm at every step and the same weights. Lightning divides each micro-batch's loss
    by the accumulation and DeepSpeed's backward divided it again: every gradient was half the
    true one (norms 0.27 against 1.08 at accumulation 4), so the clip, the guards and the
    update were off; at accumulation 1 (the test above) the two agree either way."""
    pytest.importorskip("deepspeed")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("DeepSpeed's CPU backend JIT-builds C++ ops; no compiler here")
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    reference = _strategy_run(
        tmp_path, char_dataset, "single", here=True, run__global_batch_tokens=4 * 32 * 4,
        trainer__gradient_clip_val=None,
    )  # fmt: skip
    run = _strategy_run(
        tmp_path, char_dataset, "ds", "--config",
        str(QUICKSTART.parent / "strategy" / "deepspeed_stage2.yaml"), "--trainer.devices", "2",
        run__global_batch_tokens=4 * 32 * 4, trainer__gradient_clip_val=None,
    )  # fmt: skip
    ours, ref = _train_records(run), _train_records(reference)
    assert sorted(ours) == sorted(ref) == [1, 2, 3, 4]
    for step in ref:
        assert ours[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-3), step
    convert_zero_checkpoint_to_fp32_state_dict(
        str(run / "checkpoints" / "last.ckpt"), str(tmp_path / "consolidated.ckpt")
    )
    state = torch.load(tmp_path / "consolidated.ckpt", weights_only=True)["state_dict"]
    state = {k.removeprefix("model."): v for k, v in state.items()}
    expected = {k.removeprefix("model."): v for k, v in final_state(reference).items()}
    common = expected.keys() & state.keys()
    assert "wte.weight" in common and len(common) >= len(expected) - 1
    _assert_same_weights({k: state[k] for k in common}, {k: expected[k] for k in common}, atol=1e-4)
    # validate under DeepSpeed on a CPU: its inference set-up passed a CUDA index (None here)
    res = run_nanolab("validate", "--config", str(run / "config.yaml"), cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "val" in res.stdout, res.stdout[-2000:]
    # ...and without DeepSpeed its folder is one line (a traceback from Lightning's loader)
    for verb in ("validate", "test"):
        res = run_nanolab(verb, "--config", str(run / "config.yaml"), "--trainer.strategy", "auto",
                          "--trainer.devices", "1", cwd=tmp_path)  # fmt: skip
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-3000:]
        assert "is a DeepSpeed checkpoint folder, which only DeepSpeed reads" in res.stderr


def _deepspeed_here_or_skip() -> None:
    pytest.importorskip("deepspeed")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("DeepSpeed's CPU backend JIT-builds C++ ops; no compiler here")


@pytest.mark.slow  # DeepSpeed's start-up in its own process (its CPU op cached after the first)
def test_a_diverged_deepspeed_run_stops_and_keeps_its_last_good_checkpoint(tmp_path, char_dataset):
    """DeepSpeed skips a step whose gradients are not finite (``OVERFLOW! Skipping step``) in
    fp32 too: the loss stays finite and ``.grad`` is empty, so the run trained nothing from step
    4 on, ran to ``max_steps``, exited 0 as ``completed``, and its step-4..12 saves rotated the
    good step-2 checkpoint away. One process reproduces it. It now stops as DDP's does
    (``diverged`` at step 4, exit 3), saves nothing at the stop, and names the branch from the
    step-2 folder (a sharded checkpoint is a folder: it said "it saved no checkpoint"). The
    save due at step 4, the first skipped step, waits for a finite step as every save inside
    non-finite steps does: ``last.ckpt`` pointed at it, a state whose next step diverges.

    Mutations caught: the engine's skips not read; the stop's state saved; step 4 saved."""
    _deepspeed_here_or_skip()
    cfg = tiny_overrides(
        char_dataset, tmp_path / "runs", run__name="ds", run__eval_every_steps=1000,
        trainer__max_steps=12, model__optimizer__lr=3000.0,
        model__schedule__warmup_steps=30, checkpoint__every_n_steps=2,
    )  # fmt: skip
    args = ("fit", "--config", str(write_config(tmp_path / "ds.yaml", cfg)), "--config",
            str(QUICKSTART.parent / "strategy" / "deepspeed_stage2.yaml"), "--trainer.devices", "1")  # fmt: skip
    res = run_nanolab(*args, cwd=tmp_path, timeout=600)
    assert res.returncode == 3, res.stderr[-3000:]
    run = tmp_path / "runs" / "ds"
    end = [r for r in read_records(run / "metrics.jsonl") if r["event"] == "end"][-1]
    assert end["reason"] == "diverged" and end["diverged_step"] == 4, end
    assert end["step"] == 6
    step2 = run / "checkpoints" / "step-00000002.ckpt"
    assert step2.is_dir()
    assert not (run / "checkpoints" / "step-00000006.ckpt").exists()  # the stop saved nothing
    assert not (run / "checkpoints" / "step-00000004.ckpt").exists()  # held, then diverged
    assert os.path.samefile(run / "checkpoints" / "last.ckpt", step2)
    assert "from step 2, its newest checkpoint that a finite step followed" in res.stderr
    assert f"--run.resume {step2} --model.optimizer.lr 300" in res.stderr


@pytest.mark.parametrize(
    ("validates", "deferred"),
    [(True, False), (False, False), (True, True), (False, True)],
    ids=["validated", "no-validation", "validated-late-values", "no-validation-late-values"],
)
def test_a_run_that_diverges_at_its_last_step_saves_no_checkpoint_of_it(
    tmp_path, char_dataset, validates, deferred
):
    """At lr 3000 step 4 is the first with a non-finite gradient norm (its weights stay
    finite). With ``max_steps`` 4 the run ends on it: diverged at the end, exit 3, but
    step 4 was saved (every 2 steps) and ``last.ckpt`` pointed at it, the state a resume takes;
    a stop mid-run saves none of the state that followed the divergence. Judged before the
    last step's save now (after its validation, or in its step without one), with the last
    step's flags taken there where a GPU's arrive a step late (forced here).

    Mutations caught: the end judged after the last save; its state saved at the stop; the
    last step's flags left to arrive after it (with and without the validation)."""
    cfg = tiny_overrides(
        char_dataset, tmp_path / "runs", run__name="end", run__eval_every_steps=1000,
        trainer__max_steps=4, model__optimizer__lr=3000.0,
        model__schedule__warmup_steps=30, checkpoint__every_n_steps=2,
    )  # fmt: skip
    if not validates:
        cfg["trainer"]["limit_val_batches"] = 0
    env = {"NANOLAB_READOUT_DEFER": "1"} if deferred else None
    config = str(write_config(tmp_path / "end.yaml", cfg))
    res = nanolab_here("fit", "--config", config, cwd=tmp_path, env=env)
    assert res.returncode == 3, res.stderr[-3000:]
    run = tmp_path / "runs" / "end"
    end = [r for r in read_records(run / "metrics.jsonl") if r["event"] == "end"][-1]
    assert (end["reason"], end["diverged_step"], end["step"]) == ("diverged", 4, 4), end
    assert "at the end of the run: the last optimizer step (4)" in end["detail"]
    folder = run / "checkpoints"
    assert not (folder / "step-00000004.ckpt").exists()
    assert os.path.samefile(folder / "last.ckpt", folder / "step-00000002.ckpt")  # a link


#: Probe: the gradients of the listed steps times 1e30 (an infinite norm, finite weights).
HUGE_GRADIENTS = ("--trainer.callbacks+=cli_probes.HugeGradientsAt", "--trainer.callbacks.steps")


def _saving_every_step(
    char_dataset,
    tmp_path,
    name: str,
    max_steps: int,
    max_disk_gb: float | None = None,
    every_n_steps: int = 1,
) -> str:
    """A tiny run's config saving every step (or ``every_n_steps``), keeping 2, no validation,
    no spike guard (its own rollback file would be kept beside them), the gradient norm
    clipped at 1.0: an infinite norm zeroes the step, so its weights stay finite."""
    cfg = tiny_overrides(
        char_dataset, tmp_path / "runs", run__name=name, run__eval_every_steps=1000,
        trainer__max_steps=max_steps, checkpoint__every_n_steps=every_n_steps,
        checkpoint__keep_last=2, checkpoint__max_disk_gb=max_disk_gb, spike__enabled=False,
        trainer__gradient_clip_val=1.0,
    )  # fmt: skip
    cfg["trainer"]["limit_val_batches"] = 0
    return str(write_config(tmp_path / f"{name}.yaml", cfg))


@pytest.mark.parametrize(
    ("bad", "code"), [([4, 5], 0), ([4, 5, 6], 3)], ids=["recovers", "diverges"]
)
def test_a_scheduled_save_inside_non_finite_steps_waits_for_a_finite_step(
    tmp_path, char_dataset, bad, code
):
    """Steps 4.. have an infinite gradient norm (their weights stay finite: the clip zeroes
    the step). Saving every step, keeping 2, the run saved steps 4 and 5, states it may yet
    diverge from (``last.ckpt`` pointed there), and rotated away step 2, the checkpoint a
    branch from before them starts from. Those saves wait now, said once: taken at step 6,
    the first finite step, or never when the run stops as diverged (patience 3).

    Mutations caught: a held save written; one never taken after the steps; step 2 deleted."""
    config = _saving_every_step(char_dataset, tmp_path, "hold", 8)
    res = nanolab_here("fit", "--config", config, *HUGE_GRADIENTS, str(bad), cwd=tmp_path)
    assert res.returncode == code, res.stderr[-3000:]
    run = tmp_path / "runs" / "hold"
    saved = [r["step"] for r in read_records(run / "metrics.jsonl", "checkpoint")]
    assert saved == ([1, 2, 3, 6, 7, 8] if code == 0 else [1, 2, 3])
    held = "not saving step-00000004.ckpt yet: the loss or gradient norm has not been finite "
    assert res.stderr.count("not saving step-") == 1 and f"{held}since step 4" in res.stderr
    if code == 3:
        folder = run / "checkpoints"
        assert sorted(p.name for p in folder.glob("step-*")) == [
            "step-00000002.ckpt", "step-00000003.ckpt"]  # fmt: skip
        assert os.path.samefile(folder / "last.ckpt", folder / "step-00000003.ckpt")
        assert f"--run.resume {folder / 'step-00000002.ckpt'} " in res.stderr


def test_a_held_save_is_taken_once_then_the_schedule_goes_on(tmp_path, char_dataset):
    """Saving every 3 steps, no validation: step 3's gradient norm is infinite, so its save
    waits for step 4, the first finite step. The run then saved at every step until its end
    (4, 5, 6, 7, 8, 9: the owed save was never marked as taken); it saves step 4 once, then
    goes on every 3 steps.

    Mutations caught: the held save owed at every later step; never taken."""
    config = _saving_every_step(char_dataset, tmp_path, "once", 9, every_n_steps=3)
    res = nanolab_here("fit", "--config", config, *HUGE_GRADIENTS, "[3]", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "runs" / "once"
    saved = [r["step"] for r in read_records(run / "metrics.jsonl", "checkpoint")]
    assert saved == [4, 6, 9]
    assert res.stderr.count("not saving step-00000003.ckpt yet") == 1


@pytest.mark.parametrize("max_disk_gb", [None, 0.001], ids=["keep_last", "max_disk_gb"])
def test_a_preemption_inside_non_finite_steps_saves_and_keeps_the_branch_checkpoint(
    tmp_path, char_dataset, max_disk_gb
):
    """SIGTERM in step 5, inside steps 4-6 whose gradient norm is infinite (patience 3),
    keeping 2. The preemption keeps its progress: step 5 is saved (finite weights, the open
    run of bad steps inside), and a resume stops where the run never stopped would (diverged
    at step 6, from step 4). Its rotation kept steps 3 and 5 and deleted step 2, the
    checkpoint the branch from before the bad steps starts from; it keeps it now, as the
    resume's start does, and the exit line names it. A disk cap of two of these checkpoints
    (0.4 MB each) deletes step 3 then, not the branch's step 2, the oldest.

    Mutations caught: the branch checkpoint rotated away by the save or by the resume's start;
    the preemption's save held back."""
    config = _saving_every_step(char_dataset, tmp_path, "pre", 10, max_disk_gb)
    signal = ("--trainer.callbacks+=cli_probes.SignalAt", "--trainer.callbacks.step", "4")
    first = nanolab_here("fit", "--config", config, *HUGE_GRADIENTS, "[4, 5, 6]", *signal,
                         cwd=tmp_path)  # fmt: skip
    assert first.returncode == 75, first.stderr[-3000:]
    folder = tmp_path / "runs" / "pre" / "checkpoints"
    kept = ["step-00000002.ckpt", "step-00000003.ckpt", "step-00000005.ckpt"]
    if max_disk_gb is not None:
        kept.remove("step-00000003.ckpt")
    assert sorted(p.name for p in folder.glob("step-*")) == kept
    assert (
        "step-00000005.ckpt holds a state after non-finite steps (from step 4): a resume goes on "
        "from it and stops as diverged if the next step is not finite either" in first.stderr
    )
    assert (
        "step-00000002.ckpt, the newest checkpoint a finite step followed, is kept" in first.stderr
    )
    second = nanolab_here("fit", "--config", config, *HUGE_GRADIENTS, "[4, 5, 6]", cwd=tmp_path)
    assert second.returncode == 3, second.stderr[-3000:]
    end = read_records(tmp_path / "runs" / "pre" / "metrics.jsonl", "end")[-1]
    assert (end["reason"], end["diverged_step"], end["step"]) == ("diverged", 4, 6), end
    assert sorted(p.name for p in folder.glob("step-*")) == kept
    assert f"--run.resume {folder / 'step-00000002.ckpt'} " in second.stderr


def test_a_budget_stop_on_a_non_finite_step_says_only_what_its_save_holds(tmp_path, char_dataset):
    """``budget.max_tokens`` stops the run at step 6 (128 tokens a step), whose gradient norm
    is infinite (patience 3), saving every 2 steps. Two lines contradicted each other: "not
    saving step-00000006.ckpt yet ... the save waits for a finite step", then the stop's save
    of that very step, which "stops as diverged where this run would" on a resume (this run
    stopped on its budget). The stop's save follows at once, so no waiting line, and the resume
    stops as diverged only if its next 2 steps are not finite either.

    Mutations caught: the waiting line said; the resume's stop stated as certain."""
    cfg = tiny_overrides(
        char_dataset, tmp_path / "runs", run__name="bud", run__eval_every_steps=1000,
        trainer__max_steps=20, checkpoint__every_n_steps=2, checkpoint__keep_last=2,
        spike__enabled=False, budget__max_tokens=768, trainer__gradient_clip_val=1.0,
    )  # fmt: skip
    cfg["trainer"]["limit_val_batches"] = 0
    config = str(write_config(tmp_path / "bud.yaml", cfg))
    res = nanolab_here("fit", "--config", config, *HUGE_GRADIENTS, "[6]", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "runs" / "bud"
    end = read_records(run / "metrics.jsonl", "end")[-1]
    assert (end["reason"], end["step"]) == ("budget", 6), end
    assert [r["step"] for r in read_records(run / "metrics.jsonl", "checkpoint")] == [2, 4, 6]
    assert "not saving" not in res.stderr and "where this run would" not in res.stderr
    assert (
        "step-00000006.ckpt holds a state after non-finite steps (from step 6): a resume goes on "
        "from it and stops as diverged if the next 2 steps are not finite either" in res.stderr
    )


def test_a_resume_with_the_divergence_stop_off_holds_no_save(tmp_path, char_dataset):
    """SIGTERM in step 5, inside steps 4-5 whose gradient norm is infinite: step 5 is saved
    with that open run of bad steps inside. Resumed with ``divergence.enabled false``, the stop
    restored it, never watched a step to close it, and every later save was held ("not
    saving ... waits for a finite step", then the end's save "holds a state after non-finite
    steps"); an inactive stop drops it, and the resume saves every step.

    Mutations caught: a restored run of bad steps kept by the stop that is off; reported."""
    config = _saving_every_step(char_dataset, tmp_path, "off", 8)
    signal = ("--trainer.callbacks+=cli_probes.SignalAt", "--trainer.callbacks.step", "4")
    first = nanolab_here("fit", "--config", config, *HUGE_GRADIENTS, "[4, 5]", *signal,
                         cwd=tmp_path)  # fmt: skip
    assert first.returncode == 75, first.stderr[-3000:]
    second = nanolab_here("fit", "--config", config, "--divergence.enabled", "false",
                          cwd=tmp_path)  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    assert "non-finite" not in second.stderr and "not saving" not in second.stderr
    saved = [r["step"] for r in read_records(tmp_path / "runs" / "off" / "metrics.jsonl",
                                             "checkpoint")]  # fmt: skip
    assert saved == [1, 2, 3, 5, 6, 7, 8]


@pytest.mark.parametrize("every", [1, 1000], ids=["branch-from-step-1", "no-checkpoint"])
def test_a_diverged_run_s_next_line_is_its_branch_not_generate(tmp_path, char_dataset, every):
    """Steps 3-5 have an infinite gradient norm: the run stops as diverged at step 5. Its end
    block said ``next: nanolab generate --ckpt .../last.ckpt``, a sample from the state the
    run just called diverged (or said nothing when no checkpoint was saved); it names the
    branch of the exit line now: from step 1, the newest checkpoint a finite step followed,
    or a new run from step 0.

    Mutations caught: generate suggested; no next line without a checkpoint."""
    config = _saving_every_step(char_dataset, tmp_path, "nx", 8)
    every_n = ("--checkpoint.every_n_steps", str(every))
    res = nanolab_here("fit", "--config", config, *every_n, *HUGE_GRADIENTS, "[3, 4, 5]",
                       cwd=tmp_path)  # fmt: skip
    assert res.returncode == 3, res.stderr[-3000:]
    assert "generate" not in res.stdout
    (line,) = [x for x in res.stdout.splitlines() if x.startswith("  next: ")]
    run = tmp_path / "runs" / "nx"
    branch = line.removeprefix("  next: ").split("   |   ")[0]
    assert branch in res.stderr  # the exit line's command
    assert branch.startswith(f"nanolab fit --config {run / 'config.yaml'} --run.name nx-lr")
    if every == 1:
        assert f"--run.resume {run / 'checkpoints' / 'step-00000001.ckpt'} " in branch
    else:
        assert "--run.resume" not in branch
    assert line.endswith(f"nanolab report {tmp_path / 'runs'}")


@pytest.mark.slow  # DeepSpeed's start-up in its own process (its CPU op cached after the first)
@pytest.mark.parametrize("max_steps", [4, 5])
def test_a_deepspeed_run_that_diverges_at_its_end_saves_no_checkpoint_of_it(
    tmp_path, char_dataset, max_steps
):
    """DeepSpeed skips the non-finite steps from step 4, so the weights stay finite and the
    checkpoint's check of them lets them pass: a run ending on those steps saved step 4 (its
    last step, every 2 steps) or step 5 (the end's save), ``last.ckpt`` pointing at it. DDP's
    NaN weights at step 5 were refused; both now judge the end before the last save. Step 4's
    save, inside the skipped steps, waits for a finite step (none comes): step 2 is the newest.

    Mutations caught: the end judged after the last save; its state saved at the stop."""
    _deepspeed_here_or_skip()
    cfg = tiny_overrides(
        char_dataset, tmp_path / "runs", run__name="ds", run__eval_every_steps=1000,
        trainer__max_steps=max_steps, model__optimizer__lr=3000.0,
        model__schedule__warmup_steps=30, checkpoint__every_n_steps=2,
    )  # fmt: skip
    args = ("fit", "--config", str(write_config(tmp_path / "ds.yaml", cfg)), "--config",
            str(QUICKSTART.parent / "strategy" / "deepspeed_stage2.yaml"), "--trainer.devices", "1")  # fmt: skip
    res = run_nanolab(*args, cwd=tmp_path, timeout=600)
    assert res.returncode == 3, res.stderr[-3000:]
    run = tmp_path / "runs" / "ds"
    end = [r for r in read_records(run / "metrics.jsonl") if r["event"] == "end"][-1]
    assert (end["reason"], end["diverged_step"], end["step"]) == ("diverged", 4, max_steps), end
    assert "at the end of the run" in end["detail"]
    folder = run / "checkpoints"
    assert not (folder / f"step-{max_steps:08d}.ckpt").exists()
    assert os.path.samefile(folder / "last.ckpt", folder / "step-00000002.ckpt")
    assert "branch a new run with a lower one (or a higher model.schedule.warmup_steps) from " \
        "step 2" in res.stderr  # fmt: skip


#: A model whose training loss is times 1e9 (finite in fp32): its fp16 gradients overflow at
#: any loss scale, so every step is skipped; the working directory of ``python -m`` imports it.
OVERFLOWING_GPT = """
from nanolab.training.module import GPTLightningModule


class OverflowingGPT(GPTLightningModule):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * 1e9
"""


@pytest.mark.slow  # DeepSpeed's start-up in its own process (its CPU op cached after the first)
def test_a_deepspeed_fp16_scale_at_its_lowest_stops_as_collapsed_not_in_a_traceback(
    tmp_path, char_dataset
):
    """DeepSpeed's ZeRO loss scaler raises ``Exception: Current loss scale already at minimum``
    (deepspeed/runtime/fp16/loss_scaler.py, from the engine's step) at an overflow at its
    ``min_loss_scale``. From ``initial_scale_power`` 1 (scale 2, hysteresis 2) that is the third
    overflow, before the divergence stop's 3 skipped steps: the run ended in that traceback,
    exit 1, reason ``error``. It now stops as a collapsed fp16 scale, exit 3, one line.

    DeepSpeed refuses fp16 on this CPU (its oneDNN has no fp16 kernels); a probe lets it, and
    everything else is DeepSpeed's own fp16 path. Mutations caught: DeepSpeed left to raise."""
    _deepspeed_here_or_skip()
    (tmp_path / "overflowing.py").write_text(OVERFLOWING_GPT)
    cfg = tiny_overrides(
        char_dataset, tmp_path / "runs", run__name="fp16", run__eval_every_steps=1000,
        trainer__max_steps=8, trainer__precision="16-mixed", checkpoint__every_n_steps=2,
    )  # fmt: skip
    cfg["model"] = {"class_path": "overflowing.OverflowingGPT", "init_args": cfg["model"]}
    tests = os.pathsep.join(p for p in (str(REPO / "tests"), os.environ.get("PYTHONPATH")) if p)
    args = ("fit", "--config", str(write_config(tmp_path / "fp16.yaml", cfg)), "--config",
            str(QUICKSTART.parent / "strategy" / "deepspeed_stage2.yaml"), "--trainer.devices", "1",
            "--trainer.strategy.init_args.initial_scale_power", "1",
            "--trainer.callbacks+=cli_probes.DeepSpeedFp16OnThisCpu")  # fmt: skip
    res = run_nanolab(*args, cwd=tmp_path, timeout=600, env={"PYTHONPATH": tests})  # cli_probes
    assert res.returncode == 3, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "already at minimum" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    collapse = "fp16 loss scale collapsed: 3 consecutive optimizer steps skipped (scale 1)"
    assert last.startswith(f"nanolab fit: diverged: {collapse}; stopped at step 3"), last
    run = tmp_path / "runs" / "fp16"
    end = [r for r in read_records(run / "metrics.jsonl") if r["event"] == "end"][-1]
    assert (end["reason"], end["detail"]) == ("diverged", collapse)
    assert (end["diverged_step"], end["skipped_steps"], end["loss_scale"]) == (1, 3, 1.0)


def test_val_loss_drops_on_the_bundled_corpus(tmp_path, char_dataset):
    L.seed_everything(0)
    model = GPTLightningModule(
        gpt=GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32),
        optimizer=OptimizerConfig(lr=3e-3),
        schedule=ScheduleConfig(warmup_steps=5),
    )
    dm = TokenDataModule(
        dataset_dir=str(char_dataset), micro_batch_size=8, block_size=32, val_windows=32
    )
    trainer = L.Trainer(
        max_steps=60, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        use_distributed_sampler=False,
    )  # fmt: skip
    before = trainer.validate(model, dm, verbose=False)[0]["val/loss"]
    trainer.fit(model, dm)
    after = trainer.validate(model, dm, verbose=False)[0]["val/loss"]
    # At initialisation every id of the padded vocabulary (70 -> 128 rows) is about equally likely.
    assert before == pytest.approx(math.log(model.gpt_config.padded_vocab_size), abs=0.1)
    assert after < before - 0.8


@pytest.mark.slow
def test_compiled_model_trains_like_the_eager_one(char_dataset, tmp_path):
    # One cold torch.compile (inductor, ~30-60 s on CPU): the flag works and changes no numbers.
    def fit(compile_: bool) -> dict[str, torch.Tensor]:
        L.seed_everything(0)
        model = GPTLightningModule(
            gpt=GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32),
            schedule=ScheduleConfig(warmup_steps=1),
            compile=compile_,
        )
        dm = TokenDataModule(dataset_dir=str(char_dataset), micro_batch_size=4, block_size=32)
        trainer = L.Trainer(
            max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
            default_root_dir=tmp_path, use_distributed_sampler=False,
        )  # fmt: skip
        trainer.fit(model, dm)
        assert model.model is not None
        if compile_:
            assert model.model._compiled_call_impl is not None  # compiled in place
        return {k: v.detach().clone() for k, v in model.model.state_dict().items()}

    eager, compiled = fit(False), fit(True)
    assert eager.keys() == compiled.keys()  # in-place compile: checkpoint keys unchanged
    for key in eager:
        assert torch.allclose(eager[key], compiled[key], atol=1e-4), key


class PrecisionProbe(L.Callback):
    """What ran inside ``fit``: the dtype of the logits the model's own forward produced (and of
    the first block's MLP activations), the weights' dtype, and each micro-batch's loss."""

    def __init__(self) -> None:
        self.activation_dtypes: set[torch.dtype] = set()
        self.weight_dtypes: set[torch.dtype] = set()
        self.losses: list[float] = []
        self._hooks: list = []

    def on_train_start(self, trainer, pl_module) -> None:
        def seen(module, inputs, output) -> None:
            self.activation_dtypes.add(output.dtype)

        gpt = pl_module.model
        self._hooks = [gpt.lm_head.register_forward_hook(seen)]
        self._hooks.append(gpt.blocks[0].mlp.c_fc.register_forward_hook(seen))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.weight_dtypes |= {p.dtype for group in optimizer.param_groups for p in group["params"]}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module) -> None:
        for hook in self._hooks:
            hook.remove()


def _fit_with_precision(char_dataset, tmp_path, precision: str, accelerator: str = "cpu"):
    L.seed_everything(0)
    model = GPTLightningModule(gpt=GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32))
    dm = TokenDataModule(dataset_dir=str(char_dataset), micro_batch_size=4, block_size=32)
    probe = PrecisionProbe()
    trainer = L.Trainer(
        max_steps=3, accelerator=accelerator, devices=1, precision=precision, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=tmp_path, use_distributed_sampler=False,
        callbacks=[probe],
    )  # fmt: skip
    trainer.fit(model, dm)
    return probe, trainer


@pytest.fixture(scope="module")
def fp32_losses(char_dataset, tmp_path_factory) -> list[float]:
    probe, _ = _fit_with_precision(char_dataset, tmp_path_factory.mktemp("fp32"), "32-true")
    assert probe.activation_dtypes == {torch.float32} and probe.weight_dtypes == {torch.float32}
    return probe.losses


# (precision, dtype of activations inside forward, dtype of the weights the optimizer steps)
CPU_PRECISIONS = [
    ("bf16-mixed", torch.bfloat16, torch.float32),  # autocast, fp32 master weights
    ("bf16-true", torch.bfloat16, torch.bfloat16),  # the whole model in bf16
]


@pytest.mark.parametrize(("precision", "activations", "weights"), CPU_PRECISIONS)
def test_reduced_precision_is_what_runs_inside_fit(
    char_dataset, tmp_path, fp32_losses, precision, activations, weights
):
    """Lightning's precision plugin is what ran during ``fit``: activations in the model's own
    forward have the reduced dtype, the optimizer steps weights of the expected dtype, and the
    losses follow the fp32 run closely without being bit-equal to it.

    Mutation caught: a copy of the test whose Trainer gets ``precision="32-true"`` (activations
    and weights fp32, losses bit-equal to fp32). 16-mixed is GPU-only (Lightning turns it into
    bf16-mixed on CPU): see the CUDA test below.
    """
    probe, trainer = _fit_with_precision(char_dataset, tmp_path, precision)
    assert trainer.precision == precision
    assert probe.activation_dtypes == {activations}
    assert probe.weight_dtypes == {weights}
    assert len(probe.losses) == len(fp32_losses) == 3
    assert probe.losses != fp32_losses  # reduced precision changed the numbers...
    assert probe.losses == pytest.approx(fp32_losses, abs=0.05)  # ...but not the training


@pytest.mark.skipif(not torch.cuda.is_available(), reason="16-mixed (fp16 AMP) needs a GPU")
def test_fp16_mixed_precision_on_a_gpu(char_dataset, tmp_path, fp32_losses):
    """fp16 autocast with fp32 master weights and a gradient scaler, on a real GPU."""
    probe, trainer = _fit_with_precision(char_dataset, tmp_path, "16-mixed", accelerator="gpu")
    assert trainer.precision == "16-mixed"
    assert trainer.precision_plugin.scaler is not None
    assert probe.activation_dtypes == {torch.float16}
    assert probe.weight_dtypes == {torch.float32}
    assert probe.losses != fp32_losses
    assert probe.losses == pytest.approx(fp32_losses, abs=0.05)


def test_rerunning_a_finished_run_says_it_is_complete(tmp_path, char_dataset):
    """The same command after the run ended: exit 0, one line saying the run is complete and
    how to extend it, and nothing else: no banner, no summary, no record appended to the log
    (`nanolab report` would count the re-run as a resume), no file of the run rewritten."""
    cfg = write_config(tmp_path / "c.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    first = nanolab_here("fit", "--config", str(QUICKSTART), "--config", str(cfg), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    log = tmp_path / "runs" / "tiny" / "metrics.jsonl"
    before = log.read_bytes()
    again = run_nanolab("fit", "--config", str(QUICKSTART), "--config", str(cfg), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    said = [ln for ln in (again.stdout + again.stderr).splitlines() if ln.strip()]
    assert len(said) == 1, said  # the line only: no banner, no closing summary
    assert "is already complete at step 6 (trainer.max_steps 6); nothing to train" in said[0]
    # More steps would train at the LR's minimum (the cosine ended at step 6 and a resume
    # keeps the plan): said, with the branch whose cosine is planned for the longer run.
    assert "its LR cosine ended at step 6 (a resume keeps the plan), so the extra steps train " \
           "at the schedule's minimum" in said[0]  # fmt: skip
    branch = said[0].split("planned for its own end: ", 1)[1]
    assert shlex.split(branch)[-4:] == [
        "--run.resume", str(log.parent / "checkpoints" / "step-00000006.ckpt"), "--trainer.max_steps", "12"
    ]  # fmt: skip
    assert log.read_bytes() == before
    # Other settings on the complete run train nothing, so they do not replace the config it
    # trained with (a fork's example once rewrote runs/quickstart/config.yaml this way).
    config = (tmp_path / "runs" / "tiny" / "config.yaml").read_text()
    changed = nanolab_here("fit", "--config", str(QUICKSTART), "--config", str(cfg),
                           "--model.gpt.dropout", "0.3", "--seed_everything", "7", cwd=tmp_path)  # fmt: skip
    assert changed.returncode == 0 and "nothing to train" in changed.stderr, changed.stderr[-2000:]
    assert (tmp_path / "runs" / "tiny" / "config.yaml").read_text() == config


def test_a_run_stopped_short_of_a_longer_launch_is_not_called_complete(tmp_path, char_dataset):
    """A run extended to max_steps 800 and preempted at 611, launched again with its config's
    600, was "already complete at step 611 (trainer.max_steps 600)". The line names both
    numbers and the option that finishes it (here: launched for 10, stopped at 6)."""
    cfg = write_config(tmp_path / "c.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    first = nanolab_here("fit", "--config", str(QUICKSTART), "--config", str(cfg), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    log = tmp_path / "runs" / "tiny" / "metrics.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    (start,) = [r for r in records if r["event"] == "start"]
    start["config"]["trainer"]["max_steps"] = 10  # the launch asked for 10 and stopped at 6
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    again = nanolab_here("fit", "--config", str(QUICKSTART), "--config", str(cfg), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    said = " ".join(again.stderr.split())
    assert "stopped at step 6 of the 10 its last launch asked for; this launch's " in said, said
    assert "trainer.max_steps is 6, so there is nothing to train. Continue it with " in said
    assert "--trainer.max_steps 10" in said and "already complete" not in said


@pytest.mark.slow
@pytest.mark.parametrize(
    ("first", "then", "strategy"), [(2, 1, "ddp"), (1, 2, "ddp"), (2, 1, "fsdp")]
)
def test_resume_on_another_device_count_continues_the_same_run(
    tmp_path, char_dataset, single_process_reference, first, then, strategy
):
    """A run saved on ``first`` processes (DDP, or FSDP2 with its consolidated checkpoint) and
    resumed on ``then`` keeps its global batch (``run.global_batch_tokens``: accumulation is
    derived again) and its data order, so it ends where the 1-process run with 2x accumulation
    ends (to the DDP tolerance)."""
    ddp = ["--config", str(QUICKSTART.parent / "strategy" / f"{strategy}.yaml")]
    common = dict(run__global_batch_tokens=4 * 32 * 2, checkpoint__every_n_steps=1)
    run = _strategy_run(
        tmp_path, char_dataset, "moved", *(ddp if first > 1 else []), "--trainer.devices",
        str(first), "--trainer.max_steps", "2", devices=first, **common,
    )  # fmt: skip
    _strategy_run(
        tmp_path, char_dataset, "moved", *(ddp if then > 1 else []), "--trainer.devices",
        str(then), devices=then, **common,
    )  # fmt: skip
    starts = list(read_records(run / "metrics.jsonl", "start"))
    assert [s["world_size"] for s in starts] == [first, then]
    assert starts[-1]["resumed_from_step"] == 2
    ours, ref = _train_records(run), _train_records(single_process_reference)
    for step in (3, 4):
        assert ours[step]["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-4), step
    _assert_same_weights(final_state(run), final_state(single_process_reference))


@pytest.mark.slow  # three 2-process launches: 80-110 s on 2 cores
def test_a_ddp_run_with_dropout_resumes_bit_exactly(tmp_path, char_dataset):
    """Each rank draws its own dropout masks. The checkpoint kept rank 0's RNG streams only and
    every rank restored them, so rank 1 went on with rank 0's draws: a resumed run trained other
    weights than the run never stopped. Now each rank continues its own streams."""
    ddp = ["--config", str(QUICKSTART.parent / "strategy" / "ddp.yaml"), "--trainer.devices", "2"]
    common = dict(
        devices=2, model__gpt__dropout=0.1, trainer__max_steps=6, model__schedule__decay_steps=200,
        run__global_batch_tokens=4 * 32 * 2,
    )  # fmt: skip
    whole = _strategy_run(tmp_path, char_dataset, "whole", *ddp, **common)
    split = _strategy_run(
        tmp_path, char_dataset, "split", *ddp, "--trainer.max_steps", "3", **common
    )
    _strategy_run(tmp_path, char_dataset, "split", *ddp, **common)
    assert [s["resumed_from_step"] for s in read_records(split / "metrics.jsonl", "start")] == [
        None,
        3,
    ]
    a, b = final_state(whole), final_state(split)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_plain_checkpoint_under_fsdp2_on_two_devices_is_refused_first(tmp_path, char_dataset):
    """A run saved on one device without FSDP2 keeps its optimizer state by parameter index,
    which FSDP2 on 2 devices cannot shard: one line, exit 2, and the run's files unchanged."""
    common = dict(run__global_batch_tokens=4 * 32 * 2, checkpoint__every_n_steps=1)
    run = _strategy_run(tmp_path, char_dataset, "plain", "--trainer.max_steps", "2", **common)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    cfg = tiny_overrides(
        char_dataset, tmp_path / "runs", trainer__max_steps=4, trainer__devices=2,
        run__name="plain", model__gpt__dropout=0.0, **common,
    )  # fmt: skip
    path = write_config(tmp_path / "plain-fsdp.yaml", cfg)
    fsdp = str(QUICKSTART.parent / "strategy" / "fsdp.yaml")
    res = run_nanolab("fit", "--config", str(QUICKSTART), "--config", str(path), "--config",
                      fsdp, "--trainer.devices", "2", cwd=tmp_path, timeout=600)  # fmt: skip
    assert res.returncode == 2, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "FSDP2 on 2 devices cannot shard that state" in errors[0]
    assert "Traceback" not in res.stderr
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_accumulate_grad_batches_is_obeyed_without_a_global_batch(tmp_path, char_dataset):
    """`trainer.accumulate_grad_batches` was replaced by 1 when `run.global_batch_tokens` was
    null: the run trained a quarter of the batch it was asked for, and said nothing."""
    overrides = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=2)
    overrides["trainer"]["accumulate_grad_batches"] = 4
    overrides["run"]["global_batch_tokens"] = None
    cfg = write_config(tmp_path / "tiny.yaml", overrides)
    res = nanolab_here("fit", "--config", str(QUICKSTART), "--config", str(cfg), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    run_dir = tmp_path / "runs" / "tiny"
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["trainer"]["accumulate_grad_batches"] == 4
    assert "x 4 accumulation" in res.stdout + res.stderr
    steps = [r for r in read_records(run_dir / "metrics.jsonl") if r.get("event") == "train"]
    assert [r["tokens"] for r in steps] == [4 * 32 * 4, 2 * 4 * 32 * 4]


def test_a_replaced_accumulation_or_validation_interval_is_said(tmp_path, char_dataset):
    """With run.global_batch_tokens set, nanolab derives the accumulation and the validation
    interval; a trainer value given for either was replaced without a word."""
    overrides = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=1)
    overrides["run"]["global_batch_tokens"] = 2 * 4 * 32
    overrides["trainer"].update(accumulate_grad_batches=4, val_check_interval=1)
    cfg = write_config(tmp_path / "tiny.yaml", overrides)
    res = nanolab_here("fit", "--config", str(QUICKSTART), "--config", str(cfg), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout + res.stderr
    assert (
        "trainer.accumulate_grad_batches 4 is replaced by 2, derived from run.global_batch_tokens"
        in out
    )
    assert "trainer.val_check_interval 1 is replaced by 6 micro-batches" in out
    # without a global batch the interval is derived all the same: said all the same
    overrides["run"]["global_batch_tokens"] = None
    overrides["run"]["name"] = "no-global-batch"
    overrides["trainer"].pop("accumulate_grad_batches")
    cfg = write_config(tmp_path / "tiny2.yaml", overrides)
    res = nanolab_here("fit", "--config", str(QUICKSTART), "--config", str(cfg), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "trainer.val_check_interval 1 is replaced by 3 micro-batches" in res.stdout + res.stderr


def test_a_run_without_max_steps_plans_its_cosine_for_the_token_budget(tmp_path, char_dataset):
    """``trainer.max_steps -1`` with ``budget.max_tokens``: the cosine ends where the budget
    stops the run (8 steps of 128 tokens), as a run of ``max_steps 8`` would; it was planned
    for 10,000 steps, so the LR never left its peak. Lightning's "`max_epochs` was not set"
    line is gone: nanolab sets no epoch limit itself."""
    cfg = tiny_overrides(
        char_dataset, tmp_path / "runs", trainer__max_steps=-1, budget__max_tokens=1024,
        model__schedule={"warmup_steps": 2},
    )  # fmt: skip
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = str(write_config(tmp_path / "c.yaml", cfg))
        res = nanolab_here("fit", "--config", config, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not [w for w in caught if "max_epochs" in str(w.message)]
    assert "the LR cosine ends at step 8 (budget.max_tokens)" in res.stdout
    train = list(read_records(tmp_path / "runs" / "tiny" / "metrics.jsonl", "train"))
    assert [r["step"] for r in train] == list(range(1, 9))
    peak, f = train[2]["lr"], WarmupCosine(2, 8, 0.1)  # step 3 trains at the peak
    assert [r["lr"] for r in train] == pytest.approx([peak * f(k - 1) for k in range(1, 9)])
    assert train[-1]["lr"] < 0.2 * peak
    # The budget raised on a resume: the checkpoint keeps the plan, and the banner says the
    # steps past it train at the minimum (it said nothing), as for a larger trainer.max_steps.
    res = nanolab_here("fit", "--config", config, "--budget.max_tokens", "2048", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (
        "the LR schedule ended at step 8: the extra steps run at its minimum; a resume keeps the "
        "plan: for a new cosine, train a new run (run.fresh: true, or another run.name)"
    ) in res.stdout
    train = list(read_records(tmp_path / "runs" / "tiny" / "metrics.jsonl", "train"))[8:]
    assert [r["lr"] for r in train] == pytest.approx([0.1 * peak] * 8)
    # Each launch's start record says where it trains to: what report --forecast plans with.
    starts = read_records(tmp_path / "runs" / "tiny" / "metrics.jsonl", "start")
    assert [r["planned_steps"] for r in starts] == [8, 16]


def test_a_run_nothing_bounds_in_steps_says_its_cosine_has_no_end() -> None:
    from types import SimpleNamespace

    from nanolab.callbacks.budget import CostBudget
    from nanolab.training.optim import unplanned_schedule_note

    note = unplanned_schedule_note(ScheduleConfig(), -1)
    assert note is not None and note.startswith("trainer.max_steps is -1")
    assert "model.schedule.decay_steps" in note and "10,000 steps" in note
    assert unplanned_schedule_note(ScheduleConfig(decay_steps=500), -1) is None
    assert unplanned_schedule_note(ScheduleConfig(min_lr_ratio=1.0), -1) is None  # constant
    assert unplanned_schedule_note(ScheduleConfig(), 8) is None
    # The steps a token budget trains: the last check before the next would pass the limit.
    trainer = SimpleNamespace(
        datamodule=SimpleNamespace(micro_batch_size=4), accumulate_grad_batches=1, world_size=1
    )
    module = SimpleNamespace(gpt_config=SimpleNamespace(block_size=32))  # 128 tokens a step
    assert CostBudget(max_tokens=1024).token_steps(trainer, module) == 8
    assert CostBudget(max_tokens=1000).token_steps(trainer, module) == 7
    assert CostBudget(max_tokens=1024, check_every_n_steps=3).token_steps(trainer, module) == 6
    assert CostBudget(max_wall_hours=1.0).token_steps(trainer, module) is None
