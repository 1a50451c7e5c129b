"""FLOPs per token against ``torch.utils.flop_counter``, and the rate each precision gets.

The counter sees every matmul of a real forward + backward (``attention: math``: the CPU flash
kernel has no FLOP formula in the counter). ``flops_per_token`` counts the matrices in 6N, not
biases and norm gains (element-wise work), and must not count an embedding *lookup*: an untied
model does exactly the matmul work of a tied one. So the two agree exactly.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from nanolab.estimator.compute import estimate_compute, matmul_rate
from nanolab.estimator.gpus import get_gpu
from nanolab.estimator.setup import Setup
from nanolab.estimator.shapes import flops_per_token
from nanolab.model.config import GPTConfig
from nanolab.model.gpt import GPT


def _counted_per_token(cfg: GPTConfig, batch: int = 2) -> float:
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size))
    with FlopCounterMode(display=False) as counter:
        model(idx, idx)[1].backward()
    return counter.get_total_flops() / (batch * cfg.block_size)


SHAPES = [
    GPTConfig(vocab_size=4000, block_size=64, n_layer=2, n_head=4, n_embd=128, attention="math"),
    GPTConfig(
        vocab_size=8000,
        block_size=128,
        n_layer=2,
        n_head=2,
        n_embd=64,
        position_embedding="rope",
        bias=False,
        attention="math",
    ),
    GPTConfig(
        vocab_size=100, block_size=32, n_layer=2, n_head=4, n_embd=64, mlp="swiglu",
        attention="math",
    ),
    GPTConfig(
        vocab_size=100, block_size=32, n_layer=2, n_head=4, n_embd=64, mlp="swiglu", bias=False,
        position_embedding="rope", norm="rmsnorm", attention_variant="qk_norm", attention="math",
    ),
]  # fmt: skip


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize(
    "cfg", SHAPES, ids=["learned-bias", "rope-nobias", "swiglu-bias", "swiglu-rope-rms-qknorm"]
)
def test_flops_per_token_matches_the_flop_counter(cfg: GPTConfig, tied: bool) -> None:
    """Exactly: 6N counted biases and norm gains (1,792 parameters of the 2-layer 64-wide model
    with biases: 698,880 FLOPs a token where the counter measures 688,128), hidden by a 1%
    tolerance."""
    torch.set_num_threads(1)
    cfg = replace(cfg, tie_weights=tied)
    counted = _counted_per_token(cfg)
    model = GPT(cfg)
    assert model.flops_per_token() == flops_per_token(cfg)
    assert flops_per_token(cfg) == counted


def test_an_untied_embedding_lookup_costs_no_flops() -> None:
    torch.set_num_threads(1)
    tied = SHAPES[0]
    untied = replace(tied, tie_weights=False)
    assert _counted_per_token(untied) == _counted_per_token(tied)
    assert flops_per_token(untied) == flops_per_token(tied)


def _setup(precision: str, matmul: str = "high") -> Setup:
    gpt = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    return Setup(gpt=gpt, precision=precision, float32_matmul_precision=matmul)


def test_fp32_runs_at_the_rate_their_matmul_precision_gets() -> None:
    a100 = get_gpu("a100-80gb")
    assert matmul_rate(_setup("32-true", "highest"), a100) == (19.5, "fp32")
    assert matmul_rate(_setup("32-true", "high"), a100) == (156.0, "tf32")
    assert matmul_rate(_setup("bf16-mixed"), a100) == (312.0, "bf16")
    assert matmul_rate(_setup("16-mixed"), get_gpu("v100-sxm2-32gb")) == (125.0, "fp16")
    # No TF32 units: "high" falls back to the fp32 rate.
    assert matmul_rate(_setup("32-true", "high"), get_gpu("mi250x")) == (47.9, "fp32")
    slow = estimate_compute(_setup("32-true", "highest"), a100, 8, 1)
    fast = estimate_compute(_setup("32-true", "high"), a100, 8, 1)
    assert slow.step_seconds == pytest.approx(fast.step_seconds * 156.0 / 19.5)


@pytest.mark.parametrize("allowed", [None, "0", "true", "1"])
def test_fp32_on_an_amd_gpu_is_tf32_only_with_rocms_variable(
    monkeypatch: pytest.MonkeyPatch, allowed: str | None
) -> None:
    """ROCm's torch computes ``32-true`` matmuls as TF32 only with ``HIPBLASLT_ALLOW_TF32=1``
    set (``float32_matmul_precision: high`` alone leaves them IEEE FP32): an MI300X run at
    fit's default was timed, and its MFU divided, at the 654 TFLOP/s TF32 peak, 4x its FP32
    rate. The estimate now takes TF32 only with the variable at 1 (as torch reads it) and says
    which it assumed; an NVIDIA GPU in the same environment keeps TF32."""
    from nanolab.estimator.gpus import HIP_TF32_VARIABLE, matmul_dtype

    if allowed is None:
        monkeypatch.delenv(HIP_TF32_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(HIP_TF32_VARIABLE, allowed)
    tf32 = allowed == "1"
    mi300x = get_gpu("mi300x")
    want = (653.7, "tf32") if tf32 else (163.4, "fp32")
    assert matmul_rate(_setup("32-true", "high"), mi300x) == want
    assert matmul_rate(_setup("32-true", "highest"), mi300x) == (163.4, "fp32")
    assert matmul_rate(_setup("bf16-mixed"), mi300x) == (1307.4, "bf16")
    assert matmul_rate(_setup("32-true", "high"), get_gpu("a100-80gb")) == (156.0, "tf32")
    assert matmul_dtype("32-true", "high", amd=True) == ("tf32" if tf32 else "fp32")
    assert matmul_dtype("32-true", "high") == "tf32"
    note = estimate_compute(_setup("32-true", "high"), mi300x, 8, 1).matmul_dtype_note
    assert note is not None and note.startswith("TF32: " if tf32 else "FP32: ")
    assert f"{HIP_TF32_VARIABLE}=1" in note
    for quiet in ((_setup("32-true", "high"), get_gpu("a100-80gb")),
                  (_setup("bf16-mixed"), mi300x), (_setup("32-true", "highest"), mi300x),
                  (_setup("32-true", "high"), get_gpu("mi250x"))):  # fmt: skip
        assert estimate_compute(*quiet, 8, 1).matmul_dtype_note is None


def test_default_mfu_comes_from_the_gpu_family() -> None:
    h100, mi300x, rtx4090 = get_gpu("h100-sxm"), get_gpu("mi300x"), get_gpu("rtx4090")
    assert mi300x.default_mfu < h100.default_mfu < rtx4090.default_mfu
    for g in (h100, mi300x, rtx4090):
        assert g.mfu_source
        est = estimate_compute(_setup("bf16-mixed"), g, 8, 1)
        assert est.mfu == g.default_mfu and est.mfu_source == g.mfu_source


def test_measured_tokens_per_second_of_a_finished_queue_run_wins(tmp_path) -> None:
    """A finished queue job of the same step on the same GPU replaces the MFU assumption."""
    import json
    import sqlite3

    import yaml

    from nanolab.estimator import estimate_from_config

    cfg = {
        "trainer": {"precision": "bf16-mixed", "max_steps": 100, "devices": 1},
        "model": {"gpt": {"vocab_size": 50257, "block_size": 1024, "n_layer": 12,
                          "n_head": 12, "n_embd": 768}},
        "data": {"micro_batch_size": 8},
        "run": {"global_batch_tokens": 8 * 1024 * 4},
    }  # fmt: skip
    db = tmp_path / "queue.db"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE jobs (run_dir TEXT, cwd TEXT, status TEXT)")
    for i, (device, rate, status) in enumerate(
        [
            ("NVIDIA H100 80GB HBM3", 300_000.0, "done"),
            ("NVIDIA H100 80GB HBM3", 320_000.0, "done"),
            ("NVIDIA H100 80GB HBM3", 1.0, "failed"),  # not finished: ignored
            ("NVIDIA A100-SXM4-80GB", 150_000.0, "done"),  # another GPU: ignored
        ]
    ):
        run = tmp_path / f"run{i}"
        run.mkdir()
        (run / "config.yaml").write_text(yaml.safe_dump(cfg))
        records = [
            {"event": "start", "step": 0, "devices": [device]},
            {"event": "end", "step": 100, "reason": "completed", "tokens_per_s": rate},
        ]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        conn.execute("INSERT INTO jobs VALUES (?, ?, ?)", (str(run), str(tmp_path), status))
    conn.commit()
    conn.close()
    est = estimate_from_config(cfg, gpu="h100", queue_db=str(db))
    assert est.compute.tokens_per_second == pytest.approx(310_000.0)
    assert "2 finished queue run(s)" in est.compute.tokens_per_second_source
    assert est.compute.mfu_source == "implied by the measured tokens/s"
    other = dict(cfg, data={"micro_batch_size": 4})  # another step: no history
    assumed = estimate_from_config(other, gpu="h100", queue_db=str(db))
    assert assumed.compute.mfu == get_gpu("h100").default_mfu


def test_history_calibrates_from_each_run_s_last_launch_not_a_blend(tmp_path) -> None:
    """The config and devices a past run is matched on are its last launch's, so its rate must
    be too: ``launch_tokens_per_s``, not the end record's ``tokens_per_s``, which a resumed run
    gives over every launch (another precision's or GPU's included). An older record's
    ``tokens_per_s`` counts where it was one launch's: no ``totals_of``, ``this launch``, or a
    ``run`` figure of a launch that resumed nothing.

    Mutations caught: the run-wide figure read (the median would be 200,000); an older
    resumed run's whole-run figure counted."""
    import json
    import sqlite3

    import yaml

    from nanolab.estimator import estimate_from_config

    cfg = {
        "trainer": {"precision": "bf16-mixed", "max_steps": 100, "devices": 1},
        "model": {"gpt": {"vocab_size": 50257, "block_size": 1024, "n_layer": 12,
                          "n_head": 12, "n_embd": 768}},
        "data": {"micro_batch_size": 8},
        "run": {"global_batch_tokens": 8 * 1024 * 4},
    }  # fmt: skip
    blended = {"totals_of": "run", "tokens_per_s": 100_000.0}
    runs = [  # (resumed, end fields): the rate each should give
        (True, {**blended, "launch_tokens_per_s": 300_000.0}),  # today's record: 300,000
        (True, {"totals_of": "this launch", "tokens_per_s": 310_000.0}),  # older: its own
        (False, {"tokens_per_s": 320_000.0}),  # before totals_of: one launch's
        (False, blended),  # a run figure of a launch that resumed nothing: 100,000 is its own
        (True, blended),  # a resumed run's run figure without the launch's: not counted
    ]
    db = tmp_path / "queue.db"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE jobs (run_dir TEXT, cwd TEXT, status TEXT)")
    for i, (resumed, end) in enumerate(runs):
        run = tmp_path / f"run{i}"
        run.mkdir()
        (run / "config.yaml").write_text(yaml.safe_dump(cfg))
        start = {"event": "start", "step": 0, "devices": ["NVIDIA H100 80GB HBM3"]}
        start["resumed_from"] = "last.ckpt" if resumed else None
        records = [start, {"event": "end", "step": 100, "reason": "completed", **end}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        conn.execute("INSERT INTO jobs VALUES (?, ?, ?)", (str(run), str(tmp_path), "done"))
    conn.commit()
    conn.close()
    est = estimate_from_config(cfg, gpu="h100", queue_db=str(db))
    assert "4 finished queue run(s)" in est.compute.tokens_per_second_source
    assert est.compute.tokens_per_second == pytest.approx(305_000.0)


def test_history_on_an_amd_gpu_at_32_true_counts_runs_of_this_hipblaslt_allow_tf32(
    tmp_path, monkeypatch
) -> None:
    """On ROCm ``HIPBLASLT_ALLOW_TF32`` makes a ``32-true`` step TF32 or FP32 (about 4x apart),
    and measured tokens/s were matched on the config's matmul precision only: an FP32 run's
    rate calibrated a TF32 estimate. Now a past AMD run counts when its start record kept the
    variable as this process has it (an older record without it says nothing); CUDA runs,
    whose start records never carry it, count as before.

    Mutations caught: the variable not compared (the median of all three AMD runs); a record
    without it counted; CUDA runs asked for it (none would count)."""
    import json
    import sqlite3

    import yaml

    from nanolab.estimator import estimate_from_config

    cfg = {
        "trainer": {"precision": "32-true", "max_steps": 100, "devices": 1},
        "model": {"gpt": {"vocab_size": 50257, "block_size": 1024, "n_layer": 12,
                          "n_head": 12, "n_embd": 768}},
        "data": {"micro_batch_size": 8},
        "run": {"global_batch_tokens": 8 * 1024 * 4},
    }  # fmt: skip
    runs = [  # (device, the start record's hip_allow_tf32 (None: not recorded), tokens/s)
        ("AMD Instinct MI300X", True, 400_000.0),
        ("AMD Instinct MI300X", False, 100_000.0),
        ("AMD Instinct MI300X", None, 50_000.0),
        ("NVIDIA H100 80GB HBM3", None, 250_000.0),
    ]
    db = tmp_path / "queue.db"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE jobs (run_dir TEXT, cwd TEXT, status TEXT)")
    for i, (device, allowed, rate) in enumerate(runs):
        run = tmp_path / f"run{i}"
        run.mkdir()
        (run / "config.yaml").write_text(yaml.safe_dump(cfg))
        start = {"event": "start", "step": 0, "devices": [device]}
        if allowed is not None:
            start["hip_allow_tf32"] = allowed
        end = {"event": "end", "step": 100, "reason": "completed", "tokens_per_s": rate}
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (start, end)))
        conn.execute("INSERT INTO jobs VALUES (?, ?, ?)", (str(run), str(tmp_path), "done"))
    conn.commit()
    conn.close()
    monkeypatch.delenv("HIPBLASLT_ALLOW_TF32", raising=False)
    fp32 = estimate_from_config(cfg, gpu="mi300x", queue_db=str(db)).compute
    assert fp32.tokens_per_second == pytest.approx(100_000.0)
    assert "1 finished queue run(s)" in fp32.tokens_per_second_source
    monkeypatch.setenv("HIPBLASLT_ALLOW_TF32", "1")
    tf32 = estimate_from_config(cfg, gpu="mi300x", queue_db=str(db)).compute
    assert tf32.tokens_per_second == pytest.approx(400_000.0)
    cuda = estimate_from_config(cfg, gpu="h100", queue_db=str(db)).compute
    assert cuda.tokens_per_second == pytest.approx(250_000.0)


def test_fit_sets_the_float32_matmul_precision_only_on_gpu_runs() -> None:
    from nanolab.run.compose import apply_float32_matmul_precision
    from nanolab.run.parse import RunConfig

    assert RunConfig().float32_matmul_precision == "high"
    before = torch.get_float32_matmul_precision()
    apply_float32_matmul_precision("medium", {"accelerator": "cpu"})
    assert torch.get_float32_matmul_precision() == before
