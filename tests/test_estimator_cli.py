"""``nanolab estimate``: config reading, strategies, recommendations, compute, bad input, bench."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import nanolab_here, tiny_overrides, write_config

from nanolab.estimator import estimate_from_config, largest_fitting_micro_batch
from nanolab.estimator.cli import build_parser, main
from nanolab.estimator.compute import estimate_compute
from nanolab.estimator.gpus import (
    GPUS,
    AmbiguousGPUError,
    GiB,
    MemoryStringError,
    UnknownGPUError,
    get_gpu,
    gpu_for_device,
    parse_memory,
)
from nanolab.estimator.memory import CPU_FRAGMENTATION, estimate_memory
from nanolab.estimator.recommend import fits
from nanolab.estimator.setup import (
    EstimateError,
    Setup,
    Strategy,
    deep_merge,
    load_config,
    parse_strategy,
    setup_from_config,
)
from nanolab.model.config import GPTConfig
from nanolab.training.resolve import trainer_defaults

ROOT = Path(__file__).resolve().parents[1]
GPT2 = ROOT / "tests" / "fixtures" / "estimator_gpt2_124m.yaml"


def _write(tmp_path: Path, name: str, data: dict) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


# -- units and the GPU table ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("12GiB", 12 * GiB),
        ("12 GB", 12 * 10**9),
        ("11.5gib", int(11.5 * GiB)),
        ("24576MiB", 24 * GiB),
        ("1073741824", GiB),
        (" 2 tib ", 2 * 1024**4),
    ],
)
def test_parse_memory(text: str, expected: int) -> None:
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["12 gigs", "GiB", "-3GB", "0", "1e9", "", "12"])
def test_parse_memory_rejects(text: str) -> None:
    with pytest.raises(MemoryStringError):
        parse_memory(text)


def test_a_small_size_without_a_unit_asks_for_one() -> None:
    """``--gpu-mem 12`` read as 12 bytes and said DOES NOT FIT, exit 0."""
    with pytest.raises(MemoryStringError, match="did you mean 12GiB"):
        parse_memory("12")


def test_gpu_table() -> None:
    """One table: every GPU the estimator and the MFU callback know, each number with a source."""
    wanted = [
        "rtx4070",
        "rtx3090",
        "rtx4080",
        "rtx4090",
        "rtx5090",
        "rtx6000ada",
        "a100-40gb",
        "a100-80gb",
        "a10",
        "a10g",
        "a40",
        "h100",
        "h100-pcie",
        "h100-nvl",
        "h800",
        "h20",
        "h200",
        "h200-nvl",
        "gh200",
        "b200",
        "b300",
        "gb200",
        "l4",
        "l40",
        "l40s",
        "t4",
        "v100-sxm2-16gb",
        "v100-sxm2-32gb",
        "v100-pcie-16gb",
        "v100-pcie-32gb",
        "v100s",
        "mi210",
        "mi250x",
        "mi300a",
        "mi300x",
        "mi325x",
        "mi355x",
    ]
    assert set(wanted) <= set(GPUS)
    for g in GPUS.values():
        assert g.memory_source and g.tflops_source and g.mfu_source and g.price_source, g.name
        assert g.patterns and g.vendor in ("nvidia", "amd") and 0 < g.default_mfu < 1
        assert g.peak("fp32") > 0 and (g.peak("bf16") or g.peak("fp16"))
    assert GPUS["rtx4070"].memory_bytes == 12282 * 1024**2  # what torch reports of 12 GB
    assert GPUS["a100-40gb"].memory_bytes < 40 * GiB  # reported, not the marketing figure
    assert GPUS["mi300x"].memory_bytes == 196592 * 1024**2
    assert get_gpu("RTX 4070") is GPUS["rtx4070"] and get_gpu("4090") is GPUS["rtx4090"]
    with pytest.raises(AmbiguousGPUError, match=r"a100-40gb \(39.4 GiB\), a100-80gb"):
        get_gpu("a100")
    with pytest.raises(UnknownGPUError, match="closest: h100, h20"):
        get_gpu("h10")


@pytest.mark.parametrize(
    ("driver_name", "entry"),
    [
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100 80GB PCIe", "a100-80gb"),
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("NVIDIA H200 NVL", "h200-nvl"),
        ("NVIDIA GH200 480GB", "gh200"),
        ("NVIDIA GB200", "gb200"),
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA L40", "l40"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA RTX 6000 Ada Generation", "rtx6000ada"),
        ("Tesla T4", "t4"),
        ("Tesla V100-SXM2-16GB", "v100-sxm2-16gb"),
        ("AMD Instinct MI250X/MI250", "mi250x"),
        ("AMD Instinct MI300A", "mi300a"),
        ("AMD Instinct MI300X VF", "mi300x"),
        ("NVIDIA H100", None),  # PCIe, SXM or NVL: not guessed
        ("NVIDIA GeForce RTX 4090 D", None),
        ("NVIDIA GeForce RTX 4070 Ti", None),
    ],
)
def test_driver_names_map_to_one_entry(driver_name: str, entry: str | None) -> None:
    g = gpu_for_device(driver_name)
    assert (g.name if g else None) == entry
    if entry is not None:  # --gpu takes the name nvidia-smi / rocm-smi prints, too
        assert get_gpu(driver_name) is GPUS[entry]


def test_gpus_module_imports_alone() -> None:
    code = (
        "import sys, nanolab.estimator.gpus as g; g.get_gpu('h100'); "
        "assert 'torch' not in sys.modules and 'lightning' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# -- config reading ---------------------------------------------------------------------------
def test_configs_merge_in_order(tmp_path: Path) -> None:
    a = _write(
        tmp_path,
        "a.yaml",
        {"model": {"gpt": {"n_layer": 2, "n_embd": 64}}, "trainer": {"precision": "32-true"}},
    )
    b = _write(
        tmp_path,
        "b.yaml",
        {"model": {"gpt": {"n_layer": 4}}, "trainer": {"strategy": "deepspeed_stage_3"}},
    )
    cfg = load_config([a, b])
    assert cfg["model"]["gpt"] == {"n_layer": 4, "n_embd": 64}
    # On top of what fit sets before any file (max_steps 5000, ...), as fit reads them.
    assert cfg["trainer"] == {
        **trainer_defaults(),
        "precision": "32-true",
        "strategy": "deepspeed_stage_3",
    }
    assert deep_merge({"x": {"y": 1}}, {"x": 2}) == {"x": 2}


@pytest.mark.parametrize(
    ("raw", "world", "expected"),
    [
        ("auto", 1, Strategy("single")),
        ("auto", 4, Strategy("ddp")),
        ("ddp", 2, Strategy("ddp")),
        (
            {
                "class_path": "lightning.pytorch.strategies.DDPStrategy",
                "init_args": {"gradient_as_bucket_view": True},
            },
            2,
            Strategy("ddp", gradient_as_bucket_view=True),
        ),
        ("deepspeed_stage_2", 2, Strategy("deepspeed", zero_stage=2)),
        (
            "deepspeed_stage_2_offload",
            1,
            Strategy("deepspeed", zero_stage=2, offload_optimizer=True),
        ),
        (
            "deepspeed_stage_3_offload",
            2,
            Strategy("deepspeed", zero_stage=3, offload_optimizer=True, offload_params=True),
        ),
        (
            {
                "class_path": "nanolab.training.strategies.DeepSpeedStrategy",
                "init_args": {"stage": 3, "offload_optimizer": True},
            },
            2,
            Strategy("deepspeed", zero_stage=3, offload_optimizer=True),
        ),
        ({"class_path": "nanolab.training.strategies.FSDP2Strategy"}, 2, Strategy("fsdp2")),
        (
            {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy"},
            2,
            Strategy("fsdp2"),
        ),
        ("fsdp", 2, Strategy("fsdp1")),
    ],
)
def test_parse_strategy(raw: object, world: int, expected: Strategy) -> None:
    assert parse_strategy(raw, world) == expected


def test_shipped_configs_are_read() -> None:
    """Every recipe and strategy snippet in configs/ is understood."""
    # gpt2-124m.yaml is the base; the other sizes are overlays given after it.
    base = ROOT / "configs" / "gpt2-124m.yaml"
    overlays = sorted(p for p in (ROOT / "configs").glob("gpt2-*.yaml") if p != base)
    snippets = sorted((ROOT / "configs" / "strategy").glob("*.yaml"))
    assert overlays, "the size overlays are missing"
    for recipe in [[base], *([base, overlay] for overlay in overlays)]:
        setup = setup_from_config(load_config(recipe))
        assert setup.gpt.vocab_size == 50257 and setup.precision == "bf16-mixed"
        for snippet in snippets:
            s = setup_from_config(load_config([*recipe, snippet]), devices=2, num_nodes=1)
            assert s.world_size == 2 and s.strategy.kind != "single"


def test_vocab_from_tokenizer_or_argument(tmp_path: Path) -> None:
    base = {"model": {"gpt": {"vocab_size": None, "n_layer": 2}}}
    assert setup_from_config({**base, "data": {"tokenizer": "gpt2"}}).gpt.vocab_size == 50257
    assert setup_from_config(base, vocab_size=1000).gpt.vocab_size == 1000
    meta = tmp_path / "ds"
    meta.mkdir()
    (meta / "meta.json").write_text(json.dumps({"vocab_size": 65}))
    got = setup_from_config({**base, "data": {"dataset_dir": str(meta), "tokenizer": "chars"}})
    assert got.gpt.vocab_size == 65
    with pytest.raises(EstimateError, match="--vocab-size"):
        setup_from_config({**base, "data": {"tokenizer": "chars", "dataset_dir": "nowhere"}})


# -- memory and recommendations ---------------------------------------------------------------
def _gpt2(**over: object) -> Setup:
    return setup_from_config(load_config([GPT2]), **over)


def test_peak_lines_add_up_for_every_strategy() -> None:
    base = _gpt2()
    strategies = [
        Strategy("single"),
        Strategy("ddp"),
        Strategy("ddp", gradient_as_bucket_view=True),
        Strategy("fsdp1"),
        Strategy("fsdp1", fsdp_wrapped_blocks=True),
        Strategy("fsdp2"),
        Strategy("deepspeed", zero_stage=1),
        Strategy("deepspeed", zero_stage=2),
        Strategy("deepspeed", zero_stage=3),
        Strategy("deepspeed", zero_stage=3, offload_optimizer=True, offload_params=True),
    ]
    for strategy in strategies:
        for precision in ("32-true", "bf16-mixed", "bf16-true"):
            for devices in (1, 4):
                s = Setup(
                    **{
                        **base.__dict__,
                        "strategy": strategy,
                        "precision": precision,
                        "devices": devices,
                        "global_batch_tokens": None,
                    }
                )
                est = estimate_memory(s, 4)
                assert sum(ln.bytes for ln in est.lines if ln.in_peak) == est.peak_allocated
                assert est.total > est.peak_allocated > 0


def test_sharding_lowers_model_states() -> None:
    base = _gpt2(devices=8)

    def states(strategy: Strategy) -> int:
        s = Setup(**{**base.__dict__, "strategy": strategy})
        st = estimate_memory(s, 1).states
        return st.params + st.grads + st.optimizer + st.master

    ddp, z1, z2, z3 = (
        states(Strategy("ddp")),
        states(Strategy("deepspeed", zero_stage=1)),
        states(Strategy("deepspeed", zero_stage=2)),
        states(Strategy("deepspeed", zero_stage=3)),
    )
    assert ddp > z1 > z2 > z3
    assert states(Strategy("fsdp2")) * 8 == pytest.approx(ddp, rel=1e-6)


def test_ddp_buckets_line() -> None:
    base = _gpt2(devices=2)
    est = estimate_memory(Setup(**{**base.__dict__, "strategy": Strategy("ddp")}), 2)
    assert est.line("buckets").bytes == est.line("grads").bytes
    view = Strategy("ddp", gradient_as_bucket_view=True)
    assert (
        estimate_memory(Setup(**{**base.__dict__, "strategy": view}), 2).line("buckets").bytes == 0
    )


def test_largest_micro_batch_is_the_boundary() -> None:
    setup = _gpt2()
    mem = GPUS["rtx4090"].memory_bytes
    b = largest_fitting_micro_batch(setup, gpu="rtx4090", divide_global_batch=False)
    assert b > 0
    assert fits(setup, b, mem) and not fits(setup, b + 1, mem)
    d = largest_fitting_micro_batch(setup, gpu="rtx4090")
    per_device = setup.global_batch_tokens // setup.gpt.block_size
    assert d <= b and per_device % d == 0
    assert largest_fitting_micro_batch(setup, device_memory="1GiB") == 0


def test_estimate_recommends_switches_when_it_does_not_fit() -> None:
    est = estimate_from_config(str(GPT2), gpu="rtx4070", micro_batch_size=32)
    assert not est.fits
    names = {sw.name: sw.largest_micro_batch for sw in est.switches}
    assert names["gradient checkpointing"] > est.largest_micro_batch
    assert names["8-bit AdamW"] >= est.largest_micro_batch
    assert est.recommended_micro_batch * est.recommended_accumulation == 512
    fitting = estimate_from_config(str(GPT2), gpu="h100")
    assert fitting.fits and fitting.switches == []


def test_auto_micro_batch(tmp_path: Path) -> None:
    cfg = load_config([GPT2])
    cfg["data"]["micro_batch_size"] = "auto"
    est = estimate_from_config(cfg, gpu="a100-80gb")
    assert est.micro_batch_source == "auto"
    assert est.micro_batch == est.recommended_micro_batch and est.fits


def test_compute_figures() -> None:
    setup = _gpt2()
    est = estimate_from_config(setup, gpu="h100", micro_batch_size=16, mfu=0.5)
    c = est.compute
    assert c.tokens_per_step == 524288 and est.memory.accumulate == 32
    assert c.flops_per_step == c.flops_per_token * 524288
    assert c.step_seconds == pytest.approx(c.flops_per_step / (989.4e12 * 0.5))
    assert c.token_budget == 19073 * 524288 and c.chinchilla_tokens == 20 * c.params
    assert c.cost_usd == pytest.approx(c.gpu_hours * GPUS["h100"].usd_per_hour)
    ckpt = Setup(
        **{
            **setup.__dict__,
            "gpt": GPTConfig(**{**setup.gpt.to_dict(), "gradient_checkpointing": True}),
        }
    )
    slow = estimate_compute(ckpt, GPUS["h100"], 16, 32, mfu=0.5)
    assert slow.effective_mfu < 0.5 and slow.step_seconds > c.step_seconds
    custom = estimate_compute(setup, GPUS["h100"], 16, 32, tokens=10**9, usd_per_gpu_hour=1.0)
    assert custom.token_budget == 10**9 and custom.cost_usd == pytest.approx(custom.gpu_hours)


# -- the command ------------------------------------------------------------------------------
def test_cli_table(capsys: pytest.CaptureFixture) -> None:
    assert main(["--config", str(GPT2), "--gpu", "rtx4070"]) == 0
    out = capsys.readouterr().out
    for text in (
        "activations saved for backward",
        "saved by the loss",
        "framework overhead",
        "fragmentation",
        "DOES NOT FIT",
        "largest micro-batch that fits",
        "gradient checkpointing",
        "step time",
        "Chinchilla",
    ):
        assert text in out
    # The recipe's 16 does not fit 12 GB; the recommendation comes with the option to paste.
    assert "micro-batch 8 x gradient accumulation 64" in out
    assert "to train so: --run.micro_batch_size 8, or --run.micro_batch_size auto" in out


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        (["--run.micro_batch_size", "16"], "to train so: --run.micro_batch_size 8, or"),
        (["--micro-batch", "8"], "to train so: --run.micro_batch_size 8, or"),
        (["--devices", "4"], "to train so: --run.micro_batch_size 8 --trainer.devices 4, or"),
        (["--run.micro_batch_size", "auto"], None),
    ],
    ids=["run-micro-batch-wins", "given-equal", "devices", "auto-already"],
)
def test_the_recommendation_says_the_option_that_trains_so(capsys, extra, line) -> None:
    """``run.micro_batch_size`` wins over ``data.micro_batch_size`` (so the line names it), a
    ``--micro-batch`` equal to the advice still needs the config changed, several devices are
    part of the advice, and a config already on ``auto`` needs no line. Mutation caught:
    advising ``--data.micro_batch_size`` (ignored under a numeric run.micro_batch_size)."""
    assert main(["--config", str(GPT2), "--gpu", "rtx4070", "--trace", "never", *extra]) == 0
    out = capsys.readouterr().out
    found = [ln.strip() for ln in out.splitlines() if "to train so:" in ln]
    if line is None:
        assert found == [], found
    else:
        assert len(found) == 1 and found[0].startswith(line), found


def test_cli_json(capsys: pytest.CaptureFixture) -> None:
    assert main(["--config", str(GPT2), "--gpu-mem", "80GiB", "--devices", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is True and data["device"]["memory_bytes"] == 80 * GiB
    assert data["setup"]["devices"] == 2 and data["gradient_accumulation"] == 16
    keys = {ln["key"] for ln in data["memory"]["lines"]}
    assert {"params", "grads", "optimizer", "activations", "logits", "buckets"} <= keys


def test_cli_lists_gpus(capsys: pytest.CaptureFixture) -> None:
    assert main(["--list-gpus"]) == 0
    assert "mi300x" in capsys.readouterr().out
    assert main(["--list-gpus", "--json"]) == 0
    table = {g["name"]: g for g in json.loads(capsys.readouterr().out)}
    assert table["a100-40gb"]["memory_source"] and table["h100"]["mfu_source"]


def test_a_decimal_gpu_mem_a_card_is_sold_as_gets_a_note(capsys) -> None:
    """``--gpu-mem 12GB`` is 12e9 bytes, 11.18 GiB, where a card sold as "12 GB" has 11.99:
    said once, naming the card and the spelling that holds its memory; a GiB size, or a GB
    size no listed card is sold as, gets none."""
    base = ["--config", str(ROOT / "configs" / "quickstart.yaml"), "--vocab-size", "71",
            "--trace", "never", "--json"]  # fmt: skip
    assert main([*base, "--gpu-mem", "12GB"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "nanolab estimate: note: --gpu-mem 12GB is 11.18 GiB (GB: powers of 1000); a card sold "
        "as 12 GB has more (rtx4070 11.99 GiB): give --gpu NAME (its own figure) or --gpu-mem "
        "12GiB"
    ]
    for quiet in ("12GiB", "11GB", "12000MB"):
        assert main([*base, "--gpu-mem", quiet]) == 0
        assert capsys.readouterr().err == "", quiet
    from nanolab.estimator.gpus import decimal_size_note

    # Some cards sold as 24 GB hold less than 24 GiB (an L4: 22.49): no GiB size is offered.
    assert decimal_size_note("24GB").endswith(
        "l4 22.49 GiB, 1 more): give --gpu NAME (its own figure)"
    )
    help_text = build_parser().format_help()
    assert "while 12GB is 12e9 bytes (11.18 GiB)" in " ".join(help_text.split())


def test_a_config_that_trains_on_a_cpu_is_estimated_on_a_cpu(capsys) -> None:
    """The quickstart sets ``trainer.accelerator: cpu``: without ``--device`` it is estimated
    on this machine's CPU (it was an H100, 0.0 min, with no word), and the first line says why;
    ``--device gpu`` or a GPU's memory asks about a GPU."""
    base = ["--config", str(ROOT / "configs" / "quickstart.yaml"), "--vocab-size", "71",
            "--trace", "never"]  # fmt: skip
    assert main(base) == 0
    (
        first,
        *_,
    ) = capsys.readouterr().out.splitlines()
    assert first == (
        "device    CPU, as the config's trainer.accelerator: cpu says (--device gpu estimates a GPU)"
    )
    assert main([*base, "--json"]) == 0
    device = json.loads(capsys.readouterr().out)["device"]
    assert (device["backend"], device["chosen_by"]) == ("cpu", "trainer.accelerator")
    for asked, chosen_by in (
        (["--device", "gpu"], "--device"),
        (["--gpu-mem", "12GiB"], "default"),
    ):
        assert main([*base, *asked, "--json"]) == 0
        device = json.loads(capsys.readouterr().out)["device"]
        assert (device["backend"], device["chosen_by"]) == ("cuda", chosen_by), asked
    assert main([*base, "--device", "gpu"]) == 0
    assert capsys.readouterr().out.startswith("model ")  # asked for: nothing to explain


def test_cli_estimates_a_cpu_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``--device cpu``: CPU kernels, so the JSON peak is what a CPU run allocates
    (tests/test_estimator_lightning.py checks it against a real Trainer); the total adds the
    process itself and the C heap's slack (tests/test_estimator_cpu_rules.py); the time comes
    from this machine's measured matmul rate."""
    cfg = {
        "trainer": {"precision": "bf16-mixed", "max_steps": 10},
        "model": {"gpt": {"vocab_size": 500, "block_size": 64, "n_layer": 2, "n_head": 2,
                          "n_embd": 64, "dropout": 0.1}},
        "data": {"micro_batch_size": 4},
        "run": {"global_batch_tokens": 512},
    }  # fmt: skip
    path = _write(tmp_path, "cpu.yaml", cfg)
    assert main(["--config", path, "--device", "cpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    setup = setup_from_config(cfg)
    expected = estimate_memory(setup, 4, backend="cpu", fragmentation=CPU_FRAGMENTATION)
    assert data["memory"]["peak_allocated_bytes"] == expected.peak_allocated
    assert data["memory"]["total_bytes"] == expected.total > expected.peak_allocated
    assert data["device"]["backend"] == "cpu" and data["gradient_accumulation"] == 2
    assert data["compute"]["tokens_per_second"] > 0 and data["compute"]["matmul_dtype"] == "bf16"
    assert main(["--config", path, "--device", "cpu", "--gpu", "h100"]) == 2
    capsys.readouterr()
    assert main(["--config", path, "--device", "cpu"]) == 0  # 10 tiny steps: minutes, cents
    text = capsys.readouterr().out
    wall = next(line for line in text.splitlines() if "wall-clock" in line)
    assert " min on 1 device(s)" in wall and " 0.0 h" not in wall
    assert re.search(r"CPU-h x \$0\.00 = \$0\.\d{3}$", text, re.M)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu", "gtx1080"], "unknown GPU 'gtx1080'; closest:"),
        (["--gpu", "a100"], "ambiguous: a100-40gb"),
        (["--gpu-mem", "12 gigs"], "cannot read a memory size"),
        (["--devices", "0"], "--devices must be >= 1"),
        (["--mfu", "1.5"], "--mfu"),
        (
            ["--model.gpt.n_layr", "3"],
            "unknown setting --model.gpt.n_layr; did you mean --model.gpt.n_layer?",
        ),  # fit's own line
        ([], None),
    ],
)
def test_cli_bad_input(args: list[str], message: str | None, capsys) -> None:
    argv = ["--config", str(GPT2), *args] if args else []
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("nanolab estimate: error:")
    if message:
        assert message in err


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"model": {"gpt": {"n_embd": 100, "n_head": 12}}}, "divisible"),
        ({"run": {"global_batch_tokens": 1000}}, "global_batch_tokens"),
        ({"trainer": {"precision": "64-true"}}, "precision"),
        ({"trainer": {"strategy": "horovod"}}, "unknown trainer.strategy"),
        ({"model": {"gpt": {"n_layers": 3}}}, "unknown setting model.gpt."),
        (
            {
                "trainer": {
                    "strategy": {  # as the shipped overlays name it (a short name is ambiguous
                        "class_path": "nanolab.training.strategies.DeepSpeedStrategy",  # once
                        "init_args": {"stage": 4},  # nanolab's own is imported in this process)
                    }
                }
            },
            "stage",
        ),
    ],
)
def test_cli_impossible_configs(tmp_path: Path, override: dict, message: str, capsys) -> None:
    bad = _write(tmp_path, "bad.yaml", override)
    assert main(["--config", str(GPT2), "--config", bad]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--model.optimizer.lrr", "0.1"],
            "unknown setting --model.optimizer.lrr; did you mean --model.optimizer.lr?",
        ),
        (
            ["--model.schedule.warmupsteps", "3"],
            "unknown setting --model.schedule.warmupsteps; did you mean "
            "--model.schedule.warmup_steps?",
        ),
        (
            ["--model.schedule.warmup_steps", "ten"],
            "model.schedule.warmup_steps: 'ten' is not valid; expected int",
        ),
        (
            ["--model.optimizer", "adamw"],
            "--model.optimizer is a group of settings, not a value; did you mean "
            "--model.optimizer.name adamw?",
        ),
    ],
    ids=["unknown-optimizer-key", "unknown-schedule-key", "wrong-type", "not-a-mapping"],
)
def test_model_settings_fit_refuses_are_one_line_here(
    tmp_path: Path, args: list[str], message: str, capsys
) -> None:
    # The raw YAML reached the dataclasses: a TypeError or ValueError traceback, exit 1. Now
    # the config is read by fit's own reader: fit's line, word for word.
    assert main(["--config", str(GPT2), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err == f"nanolab estimate: error: {message}"
    if args[0] == "--model.optimizer.lrr":  # the same key written in a config file
        bad = _write(tmp_path, "bad.yaml", {"model": {"optimizer": {"lrr": 0.1}}})
        assert main(["--config", str(GPT2), "--config", bad]) == 2
        in_file = f"config file {bad}: {message.replace('--', '')}"  # as a file's key
        assert capsys.readouterr().err.strip() == f"nanolab estimate: error: {in_file}"


def test_cli_missing_file(capsys: pytest.CaptureFixture) -> None:
    assert main(["--config", "nope.yaml"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_bench_cpu_mode(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    sys.path.insert(0, str(ROOT / "benches"))
    try:
        import bench_memory
    finally:
        sys.path.pop(0)
    assert bench_memory.main(["--cpu", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "predicted" in out and "error" in out
    # The docs' table: one row of it, through `nanolab estimate --device cpu --json`.
    assert bench_memory.main(["--trainer", "--cases", "14", "--keep-configs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "14 fp32 step-bound" in out and "worst error" in out
    assert (tmp_path / "case14.yaml").is_file()


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--gpu", "h100", "--model.compile", "false"], True),
        (["--gpu", "h100", "--model.compile", "false", "--mfu", "0.2"], False),
        (["--gpu", "h100"], False),  # the recipe compiles
        (["--model.compile", "false", "--device", "cpu"], False),  # a CPU's rate is measured
    ],
    ids=["eager", "eager-own-mfu", "compiled", "cpu"],
)
def test_an_eager_gpu_estimate_says_its_time_is_optimistic(capsys, extra, said) -> None:
    """The GPU families' measured MFU come from compiled or hand-fused runs (nanoGPT, llm.c);
    an eager run is typically 1.3-2x slower, and the estimate says so unless told an MFU."""
    assert main(["--config", str(GPT2), "--trace", "never", *extra]) == 0
    out = capsys.readouterr().out
    assert ("eager steps are typically 1.3-2x slower" in out) is said


@pytest.mark.parametrize(
    "batch",
    [["--trainer.accumulate_grad_batches", "3"], ["--run.global_batch_tokens", "384"]],
    ids=["accumulate_grad_batches", "global_batch_tokens"],
)
def test_estimate_trains_the_batch_fit_trains(tmp_path: Path, char_dataset, batch) -> None:
    """The estimate's tokens/step and gradient buffer are those of the run fit's banner
    describes, whether the accumulation comes from Lightning's own setting or from a global
    batch in tokens."""
    cfg = write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    args = ["--config", str(cfg), "--trainer.max_steps", "1", *batch]
    fit = nanolab_here("fit", *args, cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-2000:]
    assert "384 tokens/step = 4 micro-batch x 32 context x 3 accumulation x 1 device" in fit.stdout
    est = nanolab_here("estimate", *args, "--device", "cpu", "--trace", "never", cwd=tmp_path)
    assert est.returncode == 0, est.stderr
    assert "micro-batch 4 (config) x accumulation 3 x 1 device(s) = 384 tokens/step" in est.stdout
    assert re.search(r"gradients \(fp32\) +[\d.]+ +kept across micro-batches", est.stdout)


def test_lightning_accumulation_estimates_as_the_global_batch_it_makes(capsys) -> None:
    """gpt2-124m at 64 x 1024 tokens a device: 4 accumulated micro-batches of 16 are the run
    ``run.global_batch_tokens 65536`` describes (the same memory, step time and cost)."""
    forms = {
        "accumulate": ["--run.global_batch_tokens", "null", "--trainer.accumulate_grad_batches", "4"],
        "tokens": ["--run.global_batch_tokens", "65536"],
    }  # fmt: skip
    seen = {}
    for name, extra in forms.items():
        base = ["--config", str(ROOT / "configs" / "gpt2-124m.yaml"), "--gpu", "h100"]
        assert main([*base, *extra, "--json"]) == 0
        seen[name] = data = json.loads(capsys.readouterr().out)
        assert data["gradient_accumulation"] == 4
    a, t = seen["accumulate"], seen["tokens"]
    assert a["memory"] == t["memory"] and a["compute"] == t["compute"]


def test_estimate_reads_the_command_line_as_fit_does(tmp_path: Path, capsys) -> None:
    """The default model named by its class name, and a number with a leading zero (a decimal
    on fit's command line, octal for plain YAML), mean what fit makes of them."""
    given = ["--model", "GPTLightningModule", "--model.gpt.n_layer", "010"]
    args = ["--config", str(ROOT / "configs" / "quickstart.yaml"), *given]
    fit = nanolab_here("fit", *args, "--print_config", cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr
    assert yaml.safe_load(fit.stdout)["model"]["init_args"]["gpt"]["n_layer"] == 10
    assert main([*args, "--vocab-size", "71", "--device", "cpu", "--trace", "never"]) == 0
    assert "10 layers x 128 wide" in capsys.readouterr().out


def test_the_estimate_trains_as_long_as_the_budget_lets_the_run_and_prices_it_so(
    capsys: pytest.CaptureFixture,
) -> None:
    """``nanolab estimate`` ignored ``budget``: a ``trainer.max_steps: -1`` run stopped by
    ``budget.max_tokens`` 1e9 at step 1,900 (checks every 100 steps) was priced for
    Chinchilla's 20 tokens per parameter (4,749 steps) at the table's $2.50/GPU-h where the
    config says 2.0. It now takes the steps fit's budget stops the run at (the callback's own
    rule, as the queue plans them), the tightest limit, and the config's price."""
    from types import SimpleNamespace

    from nanolab.callbacks.budget import CostBudget

    cfg = load_config([GPT2])
    cfg["trainer"]["max_steps"] = -1
    budget = {"max_tokens": 10**9, "price_per_gpu_hour": 2.0, "check_every_n_steps": 100}
    cfg["budget"] = budget
    est = estimate_from_config(cfg, gpu="h100", micro_batch_size=16, mfu=0.5)
    c = est.compute
    trainer = SimpleNamespace(
        datamodule=SimpleNamespace(micro_batch_size=16),
        accumulate_grad_batches=32,
        world_size=1,
    )
    module = SimpleNamespace(gpt_config=SimpleNamespace(block_size=1024))
    fits = CostBudget(**budget).token_steps(trainer, module)
    assert c.tokens_per_step == 524288 and c.steps == fits == 1900
    assert c.token_budget_source == "budget.max_tokens"
    assert c.usd_per_gpu_hour == 2.0 and c.cost_usd == pytest.approx(2.0 * c.gpu_hours)

    fits = int(900 // c.step_seconds)  # whole steps in 15 minutes, at the estimated step time
    cfg["budget"] = {**budget, "max_wall_hours": 0.25}
    walled = estimate_from_config(cfg, gpu="h100", micro_batch_size=16, mfu=0.5).compute
    assert fits < 1900 and walled.steps == -(-(fits - 99) // 100) * 100  # its last check
    assert walled.token_budget_source == "budget.max_wall_hours"

    from nanolab.estimator.compute import UNBOUNDED_NOTE

    assert UNBOUNDED_NOTE not in est.warnings
    cfg["budget"] = {}
    open_ended = estimate_from_config(cfg, gpu="h100", micro_batch_size=16, mfu=0.5)
    assert open_ended.compute.token_budget == 20 * open_ended.compute.params
    assert UNBOUNDED_NOTE in open_ended.warnings
    assert open_ended.compute.usd_per_gpu_hour == GPUS["h100"].usd_per_hour

    argv = ["--config", str(GPT2), "--gpu", "h100", "--trainer.max_steps", "-1",
            "--budget.max_tokens", "1000000000", "--budget.price_per_gpu_hour", "2.0",
            "--budget.currency", "EUR"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "token budget (budget.max_tokens)    1.000 B tokens = 1,907 steps" in out, out
    assert "x 2.00 EUR = " in out and "(budget.price_per_gpu_hour)" in out, out


@pytest.mark.parametrize(
    ("sets", "said"),
    [
        (["--trainer.max_steps", "-1", "--budget.max_cost", "100"],
         "budget.max_cost needs budget.price_per_gpu_hour (> 0) to turn GPU-hours into money"),
        (["--budget.currency", "EURO"], "budget.currency 'EURO' is not a known ISO 4217 code"),
    ],
)  # fmt: skip
def test_the_estimate_refuses_a_budget_fit_refuses_in_fits_words(
    sets: list[str], said: str, capsys: pytest.CaptureFixture
) -> None:
    """A cost limit without a price was priced as a Chinchilla-length run ("no ... max_cost
    bounds the run"), and a currency fit refuses was printed: fit refuses both configs, so
    the estimate says fit's line (one line, exit 2)."""
    assert main(["--config", str(GPT2), "--gpu", "h100", *sets]) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1, err


def test_the_estimate_writes_the_currency_as_fit_does(capsys: pytest.CaptureFixture) -> None:
    """``budget.currency eur`` was printed ``eur``; fit upper-cases it (EUR)."""
    argv = ["--config", str(GPT2), "--gpu", "h100", "--budget.currency", " eur",
            "--budget.price_per_gpu_hour", "2.0"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "x 2.00 EUR = " in out and "eur" not in out, out


def test_estimate_says_which_rate_it_assumed_for_fp32_on_rocm(tmp_path, monkeypatch, capsys):
    """``nanolab estimate --gpu mi300x`` for a ``32-true`` run named the TF32 peak (ROCm's torch
    uses TF32 only with ``HIPBLASLT_ALLOW_TF32=1``) and said nothing of why: it now follows
    the variable in its own environment and says so in the compute section."""
    cfg = {
        "trainer": {"precision": "32-true", "max_steps": 10},
        "model": {"gpt": {"vocab_size": 500, "block_size": 64, "n_layer": 2, "n_head": 2,
                          "n_embd": 64}},
        "data": {"micro_batch_size": 4},
    }  # fmt: skip
    path = _write(tmp_path, "fp32.yaml", cfg)
    said = {}
    for value in (None, "1"):
        if value is None:
            monkeypatch.delenv("HIPBLASLT_ALLOW_TF32", raising=False)
        else:
            monkeypatch.setenv("HIPBLASLT_ALLOW_TF32", value)
        assert main(["--config", path, "--gpu", "mi300x", "--trace", "never"]) == 0
        said[value] = capsys.readouterr().out
    assert "compute   fp32 matmuls, dense peak 163.4 TFLOP/s" in said[None]
    assert (
        "  32-bit matmuls as FP32: ROCm's torch uses TF32 only with HIPBLASLT_ALLOW_TF32=1 set, "
        "and it is not set here\n"
    ) in said[None]
    assert "compute   tf32 matmuls, dense peak 653.7 TFLOP/s" in said["1"]
    assert "  32-bit matmuls as TF32: HIPBLASLT_ALLOW_TF32=1 is set here" in said["1"]
    assert main(["--config", path, "--gpu", "a100-80gb", "--trace", "never"]) == 0
    assert "32-bit matmuls as" not in capsys.readouterr().out
