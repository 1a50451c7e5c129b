"""Training end to end: the CLI, optimizer and schedule, strategies (DDP, FSDP2, DeepSpeed), 8-bit AdamW."""

from __future__ import annotations

import math
import shutil

import lightning as L
import pytest
import torch
from conftest import QUICKSTART, run_nanolab, tiny_overrides, write_config

from nanolab.cli import main
from nanolab.data.datamodule import TokenDataModule
from nanolab.model import GPTConfig
from nanolab.training.cli import RunConfigError, gradient_accumulation
from nanolab.training.module import GPTLightningModule
from nanolab.training.optim import OptimizerConfig, ScheduleConfig, WarmupCosine, parameter_groups


def final_state(run_dir) -> dict[str, torch.Tensor]:
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    return ckpt["state_dict"]


def test_fit_then_generate_through_the_cli(tmp_path, char_dataset):
    cfg = write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    res = run_nanolab("fit", "--config", str(QUICKSTART), "--config", str(cfg), cwd=tmp_path)
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
    res = run_nanolab(
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
    res = run_nanolab("fit", "--config", str(QUICKSTART), "--config", str(cfg), cwd=tmp_path)
    assert res.returncode == 2
    assert "fewer than one block" in res.stderr


def test_gradient_accumulation_is_derived_from_global_batch_tokens():
    assert gradient_accumulation(None, 16, 1024, 8) == 1
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


def test_lr_follows_the_schedule_per_step(char_dataset, tmp_path):
    opt = OptimizerConfig(lr=1e-3)
    _, trainer = _fit_in_process(char_dataset, tmp_path, opt, steps=5)
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    expected = 1e-3 * WarmupCosine(1, 5, 0.1)(5)
    assert lr == pytest.approx(expected)


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
def _strategy_run(tmp_path, char_dataset, name: str, *extra: str, devices: int = 1, **overrides):
    base = tiny_overrides(
        char_dataset, tmp_path / "runs", trainer__max_steps=4, trainer__devices=devices,
        run__name=name, model__gpt__dropout=0.0, **overrides,
    )  # fmt: skip
    cfg = write_config(tmp_path / f"{name}.yaml", base)
    res = run_nanolab(
        "fit", "--config", str(QUICKSTART), "--config", str(cfg), *extra, cwd=tmp_path, timeout=600
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return tmp_path / "runs" / name


def _assert_same_weights(a: dict, b: dict, atol: float = 2e-5) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key].float(), b[key].float(), atol=atol, rtol=1e-4), key


@pytest.fixture(scope="module")
def single_process_reference(tmp_path_factory, char_dataset):
    """One process, micro-batch 4, 2x accumulation: the reference for the 2-process runs."""
    tmp = tmp_path_factory.mktemp("reference")
    run = _strategy_run(tmp, char_dataset, "single", run__global_batch_tokens=4 * 32 * 2)
    return final_state(run)


def test_ddp_two_processes_match_one_process_with_accumulation(
    tmp_path, char_dataset, single_process_reference
):
    run = _strategy_run(
        tmp_path, char_dataset, "ddp", "--config", str(QUICKSTART.parent / "strategy" / "ddp.yaml"),
        "--trainer.devices", "2", run__global_batch_tokens=4 * 32 * 2,
    )  # fmt: skip
    _assert_same_weights(final_state(run), single_process_reference)


def test_fsdp2_two_processes_match_one_process(tmp_path, char_dataset, single_process_reference):
    run = _strategy_run(
        tmp_path, char_dataset, "fsdp", "--config", str(QUICKSTART.parent / "strategy" / "fsdp.yaml"),
        "--trainer.devices", "2", run__global_batch_tokens=4 * 32 * 2,
    )  # fmt: skip
    _assert_same_weights(final_state(run), single_process_reference)


@pytest.mark.slow
def test_deepspeed_zero2_runs_on_cpu_and_matches(tmp_path, char_dataset, single_process_reference):
    pytest.importorskip("deepspeed")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("DeepSpeed's CPU backend JIT-builds a C++ op; no compiler here")
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    run = _strategy_run(
        tmp_path, char_dataset, "ds", "--config", str(QUICKSTART.parent / "strategy" / "deepspeed_stage2.yaml"),
        "--trainer.devices", "2", run__global_batch_tokens=4 * 32 * 2,
    )  # fmt: skip
    ckpt_dir = run / "checkpoints" / "last.ckpt"
    assert ckpt_dir.is_dir()  # DeepSpeed writes its own sharded directory format
    convert_zero_checkpoint_to_fp32_state_dict(str(ckpt_dir), str(tmp_path / "consolidated.ckpt"))
    state = torch.load(tmp_path / "consolidated.ckpt", weights_only=True)["state_dict"]
    reference = {k.removeprefix("model."): v for k, v in single_process_reference.items()}
    state = {k.removeprefix("model."): v for k, v in state.items()}
    # DeepSpeed's state dict names the tied weight once (as the embedding).
    common = reference.keys() & state.keys()
    assert "wte.weight" in common and len(common) >= len(reference) - 1
    _assert_same_weights(
        {k: state[k] for k in common}, {k: reference[k] for k in common}, atol=1e-4
    )


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


def test_bf16_mixed_precision_trains_on_cpu(char_dataset, tmp_path):
    L.seed_everything(0)
    model = GPTLightningModule(gpt=GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32))
    dm = TokenDataModule(dataset_dir=str(char_dataset), micro_batch_size=4, block_size=32)
    trainer = L.Trainer(
        max_steps=3, accelerator="cpu", precision="bf16-mixed", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=tmp_path, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(model, dm)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    x, y = next(iter(dm.train_dataloader()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(x, y)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(loss)
