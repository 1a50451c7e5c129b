"""Throughput, MFU and the peak-FLOPs table, goodput, utilisation sampling, the progress bar."""

from __future__ import annotations

import itertools
import sys
import time
import types

import lightning as L
import pytest
import torch
from test_callbacks_runlog import TOKENS_PER_MICRO_BATCH, events, fit

from nanolab.callbacks import (
    CallbackConfigError,
    MetricsLog,
    RotatingCheckpoint,
    StepProgressBar,
    ThroughputMeter,
)
from nanolab.callbacks.peak_flops import lookup_peak, matmul_dtype, peak_flops_per_device
from nanolab.callbacks.throughput import UtilizationSampler


@pytest.mark.parametrize(
    ("name", "precision", "tflops"),
    [
        ("Tesla V100-SXM2-32GB", "16-mixed", 125.0),
        ("Tesla V100-PCIE-16GB", "32-true", 14.0),
        ("NVIDIA A100-SXM4-80GB", "bf16-mixed", 312.0),
        ("NVIDIA A100 80GB PCIe", "bf16-true", 312.0),
        ("NVIDIA H100 80GB HBM3", "bf16-mixed", 989.4),
        ("NVIDIA H100 PCIe", "bf16-mixed", 756.5),
        ("NVIDIA H200", "bf16-mixed", 989.4),
        ("NVIDIA B200", "bf16-mixed", 2250.0),
        ("NVIDIA L4", "16-mixed", 121.0),
        ("NVIDIA L40S", "bf16-mixed", 362.05),
        ("NVIDIA GeForce RTX 3090", "bf16-mixed", 71.0),
        ("NVIDIA GeForce RTX 4070", "bf16-mixed", 58.3),
        ("NVIDIA GeForce RTX 4090", "bf16-mixed", 165.2),
        ("NVIDIA GeForce RTX 5090", "bf16-mixed", 209.5),
        ("AMD Instinct MI250X/MI250", "bf16-mixed", 191.5),
        ("AMD Instinct MI300X", "bf16-mixed", 1307.4),
        ("AMD Instinct MI325X", "16-mixed", 1307.4),
        ("AMD Instinct MI355X", "bf16-mixed", 2516.6),
        ("NVIDIA L40", "bf16-mixed", 181.0),
        ("NVIDIA GB200", "bf16-mixed", 2500.0),
        ("NVIDIA H20", "bf16-mixed", 148.0),
        ("AMD Instinct MI300A", "bf16-mixed", 980.6),
        ("Tesla T4", "16-mixed", 65.0),
    ],
)
def test_peak_table(name, precision, tflops):
    peak, why = peak_flops_per_device(name, precision)
    assert peak == pytest.approx(tflops * 1e12), why


@pytest.mark.parametrize(
    "name",
    ["NVIDIA H100", "NVIDIA GeForce RTX 4080 SUPER", "NVIDIA GeForce RTX 4090 D",
     "NVIDIA GeForce RTX 4070 Ti", "AMD Instinct MI250", "NVIDIA GH200", "Some Future GPU"],
)  # fmt: skip
def test_unknown_or_ambiguous_devices_get_no_number(name):
    peak, why = peak_flops_per_device(name, "bf16-mixed")
    assert peak is None and name in why


def test_a_rocm_build_divides_fp32_mfu_by_tf32_only_with_hipblaslt_allowing_it(monkeypatch):
    """A ``32-true`` run on an MI300X under fit's ``high``: ROCm's torch runs its matmuls in
    FP32 unless ``HIPBLASLT_ALLOW_TF32=1``, and its MFU was divided by the TF32 peak (4x too
    small). Both settings, through the callback's lookup on a stand-in ROCm build."""
    previous = torch.get_float32_matmul_precision()
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    try:
        torch.set_float32_matmul_precision("high")
        monkeypatch.delenv("HIPBLASLT_ALLOW_TF32", raising=False)
        peak, why = peak_flops_per_device("AMD Instinct MI300X", "32-true")
        assert peak == 163.4e12 and "HIPBLASLT_ALLOW_TF32=1" in why, why
        assert matmul_dtype("32-true") == "fp32"
        monkeypatch.setenv("HIPBLASLT_ALLOW_TF32", "1")
        assert peak_flops_per_device("AMD Instinct MI300X", "32-true")[0] == 653.7e12
        assert matmul_dtype("32-true") == "tf32"
    finally:
        torch.set_float32_matmul_precision(previous)


def test_a_rocm_resume_that_flips_hipblaslt_allow_tf32_gives_no_blended_run_rate(
    tmp_path, char_dataset, monkeypatch
):
    """On ROCm, ``HIPBLASLT_ALLOW_TF32`` decides whether a ``32-true`` launch's matmuls are
    TF32 or FP32 (about 4x apart), and the launch's setup left it out: a resume that flipped it
    reported one run-wide tokens/s over both speeds. Now a ROCm launch records it (setup and
    start record) where it decides, and a flip gives ``totals_of: this launch``; on CUDA, on a
    CPU and at bf16 nothing is added, so setups and logs of older launches still compare equal.

    Mutations caught: the switch left out of ``launch_setup`` (``run``), or recorded on CUDA or
    a CPU (their older checkpoints' setups would no longer match)."""
    from nanolab.callbacks.devices import launch_setup

    def callbacks() -> list[L.Callback]:
        return [MetricsLog(), RotatingCheckpoint(every_n_steps=3), ThroughputMeter(peak_flops=1e11)]

    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        monkeypatch.delenv("HIPBLASLT_ALLOW_TF32", raising=False)
        plain = fit(tmp_path / "plain", char_dataset, callbacks(), max_steps=1)
        assert "hip_allow_tf32" not in launch_setup(plain)  # no ROCm build: as before
        monkeypatch.setattr(torch.version, "hip", "6.4.0")  # a stand-in ROCm build
        bf16 = L.Trainer(accelerator="cpu", precision="bf16-mixed", logger=False)
        assert "hip_allow_tf32" not in launch_setup(bf16)  # bf16: the variable changes nothing
        run = tmp_path / "run"
        fit(run, char_dataset, callbacks(), max_steps=3, eval_every=100)
        monkeypatch.setenv("HIPBLASLT_ALLOW_TF32", "1")
        last = run / "checkpoints" / "last.ckpt"
        fit(run, char_dataset, callbacks(), max_steps=6, eval_every=100, ckpt_path=last)
    finally:
        torch.set_float32_matmul_precision(previous)
    starts = events(run / "metrics.jsonl", "start")
    assert [s["hip_allow_tf32"] for s in starts] == [False, True]
    first, second = events(run / "metrics.jsonl", "end")
    assert first["totals_of"] == "run"
    assert second["totals_of"] == "this launch"
    assert second["tokens_per_s"] == second["launch_tokens_per_s"]


def test_fp32_matmul_precision_picks_tf32_or_fp32():
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert matmul_dtype("32-true") == "fp32"
        assert peak_flops_per_device("NVIDIA A100-SXM4-40GB", "32-true")[0] == 19.5e12
        torch.set_float32_matmul_precision("high")
        assert peak_flops_per_device("NVIDIA A100-SXM4-40GB", "32-true")[0] == 156e12
        # No TF32 units on V100 / MI355X: FP32 matmuls run at the FP32 rate.
        assert peak_flops_per_device("AMD Instinct MI355X", "32-true")[0] == 157.3e12
        assert peak_flops_per_device("NVIDIA L4", "bf16-mixed")[0] == 121e12
        assert lookup_peak("NVIDIA GeForce RTX 3090").bf16 == 71.0
        assert peak_flops_per_device("NVIDIA H100 PCIe", "64-true")[0] is None
        # No bf16 units on V100: bf16 matmuls run (emulated) at about the FP32 rate, as the
        # estimator's time assumes (one rule for both).
        peak, why = peak_flops_per_device("Tesla V100-SXM2-16GB", "bf16-mixed")
        assert peak == 15.7e12 and "no bf16 units" in why
    finally:
        torch.set_float32_matmul_precision(previous)


def test_mfu_counts_accumulation_and_world_size():
    meter = ThroughputMeter(peak_flops=100e12)
    meter.peak_flops, meter.flops_per_token = 100e12, 6_000_000
    # 8 devices x 50 TFLOP/s useful = 40% of 8 x 100 TFLOP/s.
    tokens_per_s = 8 * 50e12 / 6_000_000
    assert meter.mfu(tokens_per_s, world_size=8) == pytest.approx(0.5)
    assert meter.mfu(None, 8) is None


def test_unknown_device_warns_once_and_reports_null(tmp_path, char_dataset):
    run = tmp_path / "run"
    with pytest.warns(UserWarning, match=r"MFU unknown.*'cpu'.*throughput\.peak_flops") as caught:
        fit(run, char_dataset, [MetricsLog(), ThroughputMeter()], max_steps=4, eval_every=100)
    assert sum("MFU unknown" in str(w.message) for w in caught) == 1
    assert all(r["mfu"] is None for r in events(run / "metrics.jsonl", "train"))


def test_a_second_run_in_the_same_process_starts_its_own_clock(tmp_path, char_dataset):
    # The first run of a process counts from nanolab's import (its start-up is the run's time);
    # a later one (notebook, test session) must not count the time since that import.
    fit(tmp_path / "first", char_dataset, [MetricsLog()], max_steps=2, eval_every=100)
    time.sleep(2.0)
    began = time.monotonic()
    fit(tmp_path / "second", char_dataset, [MetricsLog()], max_steps=2, eval_every=100)
    took = time.monotonic() - began
    end = events(tmp_path / "second" / "metrics.jsonl", "end")[-1]
    assert 0 < end["elapsed_s"] <= took
    assert 0 < end["goodput"] <= 1


def test_override_gives_mfu_with_accumulation_and_goodput(tmp_path, char_dataset):
    run = tmp_path / "run"
    meter = ThroughputMeter(peak_flops=1e12)
    fit(
        run, char_dataset, [MetricsLog(), RotatingCheckpoint(every_n_steps=3), meter],
        max_steps=6, eval_every=3, accumulate=2,
    )  # fmt: skip
    start = events(run / "metrics.jsonl", "start")[0]
    assert (
        start["peak_flops"] == 1e12 and start["global_batch_tokens"] == 2 * TOKENS_PER_MICRO_BATCH
    )
    train = events(run / "metrics.jsonl", "train")
    assert [r["tokens"] for r in train] == [2 * TOKENS_PER_MICRO_BATCH * s for s in range(1, 7)]
    for r in train:
        assert r["mfu"] == pytest.approx(
            start["flops_per_token"] * r["tokens_per_s"] / 1e12, rel=1e-3
        )
        assert r["samples_per_s"] * 16 == pytest.approx(r["tokens_per_s"], rel=1e-3)
        assert 0 < r["goodput"] <= 1
    end = events(run / "metrics.jsonl", "end")[-1]
    parts = end["time_breakdown"]
    assert parts["eval_s"] > 0 and parts["checkpoint_s"] > 0 and parts["step_s"] > 0
    assert end["goodput"] == pytest.approx(parts["step_s"] / end["elapsed_s"], abs=0.01)
    assert 0 < end["goodput"] < 1 and end["mfu"] > 0


def test_each_run_log_rate_covers_its_own_interval_whatever_the_loggers_cadence(
    tmp_path, char_dataset
):
    # The meter's logger hook measures every step and the run log every fourth step: each
    # run-log record's rate must still cover the four steps since the record before it (what
    # `nanolab report` sums), not the one step since the logger hook's measure.
    from lightning.pytorch.loggers import CSVLogger

    class SlowFirstStep(L.Callback):  # the first step of each interval takes 0.1 s more
        def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
            if trainer.global_step % 4 == 1:
                time.sleep(0.1)

    run = tmp_path / "run"
    fit(
        run, char_dataset, [MetricsLog(every_n_steps=4), ThroughputMeter(), SlowFirstStep()],
        max_steps=12, eval_every=100, logger=CSVLogger(tmp_path / "csv"), log_every_n_steps=1,
    )  # fmt: skip
    train = events(run / "metrics.jsonl", "train")
    assert [r["step"] for r in train] == [4, 8, 12]
    for before, record in itertools.pairwise(train):
        seconds = (record["tokens"] - before["tokens"]) / record["tokens_per_s"]
        assert seconds == pytest.approx(record["time"] - before["time"], rel=0.3)
        assert seconds > 0.1
    # The loggers got the run log's records (train/tokens_per_s), at its steps.
    (logged,) = (tmp_path / "csv").rglob("metrics.csv")
    header, *rows = logged.read_text().splitlines()
    assert "train/tokens_per_s" in header and {r.split(",")[0] for r in rows} == {"4", "8", "12"}


def test_utilization_sampler_uses_nvml_when_importable(monkeypatch):
    fake = types.ModuleType("pynvml")
    fake.nvmlInit = lambda: None
    fake.nvmlDeviceGetHandleByPciBusId = lambda bus: (_ for _ in ()).throw(RuntimeError("no bus"))
    fake.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    fake.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=87 if h[1] == 3 else 0)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    sampler = UtilizationSampler(0)  # logical device 0 is physical GPU 3
    assert sampler.backend == "nvml" and sampler.sample() == 87.0


def fake_amdsmi(busy: dict[int, float], by_bdf: dict[str, int] | None) -> types.ModuleType:
    """AMD SMI on a host of ``len(busy)`` GPUs, GPU k ``busy[k]`` percent busy: it lists every
    GPU whatever the process's mask, and finds one by PCI address when ``by_bdf`` is given."""
    fake = types.ModuleType("amdsmi")
    fake.amdsmi_init = lambda: None
    fake.amdsmi_get_processor_handles = lambda: [("gpu", k) for k in sorted(busy)]

    def from_bdf(bdf: str):
        if by_bdf is None or bdf not in by_bdf:
            raise RuntimeError(f"no GPU at {bdf}")
        return ("gpu", by_bdf[bdf])

    fake.amdsmi_get_processor_handle_from_bdf = from_bdf
    fake.amdsmi_get_gpu_activity = lambda h: {"gfx_activity": busy[h[1]]}
    return fake


@pytest.mark.parametrize(
    ("masks", "by_bdf", "expected"),
    [
        ({"HIP_VISIBLE_DEVICES": "2"}, {"0000:c3:00.0": 2}, 50.0),  # by PCI address
        ({"HIP_VISIBLE_DEVICES": "2"}, None, 50.0),  # by the mask
        ({"CUDA_VISIBLE_DEVICES": "3,1"}, None, 75.0),  # ROCm honours CUDA's mask too
        ({}, None, 0.0),  # no mask: device 0 is the host's 0
        # the queue runner's pair of masks: HIP reads HIP_VISIBLE_DEVICES, CUDA's only without it
        ({"HIP_VISIBLE_DEVICES": "3", "CUDA_VISIBLE_DEVICES": "3"}, None, 75.0),
        ({"HIP_VISIBLE_DEVICES": "2", "CUDA_VISIBLE_DEVICES": "3"}, None, 50.0),
        # HIP's index picks from the devices ROCR_VISIBLE_DEVICES left: 1 of [2, 3] is 3
        ({"HIP_VISIBLE_DEVICES": "1", "ROCR_VISIBLE_DEVICES": "2,3"}, None, 75.0),
        ({"CUDA_VISIBLE_DEVICES": "0", "ROCR_VISIBLE_DEVICES": "1,2"}, None, 25.0),
        ({"ROCR_VISIBLE_DEVICES": "2"}, None, 50.0),
        ({"HIP_VISIBLE_DEVICES": "2", "ROCR_VISIBLE_DEVICES": "0,1"}, None, None),  # past it
        ({"HIP_VISIBLE_DEVICES": "0", "ROCR_VISIBLE_DEVICES": "GPU-1234"}, None, None),
        ({"HIP_VISIBLE_DEVICES": "GPU-1234"}, None, None),  # a UUID: not guessed
    ],
)
def test_amd_utilization_reads_this_processs_gpu(monkeypatch, masks, by_bdf, expected):
    """AMD SMI numbers every GPU of the host; a job given GPU 2 logged GPU 0's utilisation.
    The sampler finds its GPU by PCI address (as NVML's does), else through the device masks
    as ROCm applies them, else logs nothing rather than another GPU's figure. Mutation caught:
    the queue runner's equal ``CUDA_VISIBLE_DEVICES``/``HIP_VISIBLE_DEVICES`` refused as two
    nested masks (no utilisation for any queued job on ROCm without a PCI match)."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setitem(sys.modules, "amdsmi", fake_amdsmi({0: 0, 1: 25, 2: 50, 3: 75}, by_bdf))
    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0xC3, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in masks.items():
        monkeypatch.setenv(name, value)
    sampler = UtilizationSampler(0)
    assert sampler.sample() == expected
    assert sampler.backend == (None if expected is None else "amdsmi")


def test_nvml_with_a_mask_of_uuids_logs_nothing_rather_than_gpu_0(monkeypatch):
    fake = types.ModuleType("pynvml")
    fake.nvmlInit = lambda: None
    fake.nvmlDeviceGetHandleByPciBusId = lambda bus: (_ for _ in ()).throw(RuntimeError("no bus"))
    fake.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    fake.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=10)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8c6a1f2e")
    assert UtilizationSampler(0).sample() is None


def test_utilization_is_null_without_nvml_or_amdsmi(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    sampler = UtilizationSampler(0)
    assert sampler.backend is None and sampler.sample() is None


def test_peak_override_in_tflops_is_caught():
    with pytest.raises(CallbackConfigError, match=r"looks like TFLOP/s; write 312e12"):
        ThroughputMeter(peak_flops=312)
    with pytest.raises(CallbackConfigError, match=r"throughput\.peak_flops must be > 0"):
        ThroughputMeter(peak_flops=-1.0)


def test_progress_bar_shows_steps_eta_loss_and_tokens(tmp_path, char_dataset, capsys):
    bar = StepProgressBar(refresh_rate=2, mode="bar")  # a bar even though stdout is captured
    fit(tmp_path / "run", char_dataset, [bar], max_steps=6, eval_every=3, enable_progress_bar=True)
    captured = capsys.readouterr()
    err = captured.out + captured.err  # Lightning's tqdm bars write to stdout
    assert "6/6" in err and "loss=" in err and "tok/s=" in err and "val=" in err
    assert "Validation" not in err and "Training" not in err  # one bar, no second one


class _SlowBatches:
    """A wrapper that makes every batch cost ``delay`` seconds to fetch, like a slow disk."""

    def __init__(self, inner, delay: float) -> None:
        self.inner, self.delay = inner, delay

    def __iter__(self):
        import time

        for batch in self.inner:
            time.sleep(self.delay)
            yield batch


def test_time_waiting_for_batches_is_reported_apart_from_steps(tmp_path, char_dataset):
    from nanolab.callbacks import MetricsLog
    from nanolab.data.datamodule import TokenDataModule

    original = TokenDataModule.train_dataloader
    delay, steps = 0.05, 6

    def slow(self):
        return _SlowBatches(original(self), delay)

    TokenDataModule.train_dataloader = slow
    try:
        fit(tmp_path / "run", char_dataset, [MetricsLog()], max_steps=steps, eval_every=100)
    finally:
        TokenDataModule.train_dataloader = original
    end = events(tmp_path / "run" / "metrics.jsonl", "end")[-1]
    parts = end["time_breakdown"]
    # Every fetch after the first happens between steps: at least (steps - 1) x delay of waiting.
    assert parts["data_wait_s"] >= (steps - 1) * delay * 0.9
    # ... and not the steps themselves: the wait is bounded by the fetches (+ loop bookkeeping).
    assert parts["data_wait_s"] <= steps * delay + 0.5
    assert end["goodput"] < 1


class _SlowSteps(L.Callback):
    """Each step 30 ms longer (active time, not a pause): a launch slower than the next."""

    def on_train_batch_end(self, *args: object) -> None:
        time.sleep(0.03)


def _resumed_twice(
    tmp_path, char_dataset, strip_clock: bool = False, later_precision: str | None = None
):
    """A run of 6 slow steps, then resumed to 12 at full speed (in ``later_precision``, when
    given, and then once more to 14 in it): its end records and its train records (one per
    step, each with the active seconds its step took)."""
    run = tmp_path / "run"

    def callbacks(*extra: L.Callback) -> list[L.Callback]:
        meter = ThroughputMeter(peak_flops=1e11)
        return [MetricsLog(), RotatingCheckpoint(every_n_steps=6), meter, *extra]

    fit(run, char_dataset, callbacks(_SlowSteps()), max_steps=6, eval_every=100)
    last = run / "checkpoints" / "last.ckpt"
    if strip_clock:  # as an older nanolab saved it: no run time or split in the clock's state
        state = torch.load(last, weights_only=True)
        for key, value in state["callbacks"].items():
            if "RunClock" in key:
                value.pop("train_active_s"), value.pop("time_breakdown")
        last = run / "checkpoints" / "old.ckpt"
        torch.save(state, last)
    later = {"precision": later_precision} if later_precision else {}
    fit(run, char_dataset, callbacks(), max_steps=12, eval_every=100, ckpt_path=last, **later)
    if later_precision:
        last = run / "checkpoints" / "last.ckpt"
        fit(run, char_dataset, callbacks(), max_steps=14, eval_every=100, ckpt_path=last, **later)
    log = run / "metrics.jsonl"
    return events(log, "end"), events(log, "train")


def test_a_resumed_run_s_end_record_has_the_whole_run_s_rate_and_time_split(tmp_path, char_dataset):
    """After a resume, the ``end`` record's ``tokens_per_s`` was this launch's tokens over its
    own active time, next to ``tokens`` of the whole run, and ``time_breakdown`` this launch's
    split; docs call them whole-run figures. Now both cover every launch (the checkpoint keeps
    the run's active training time and split), and ``totals_of`` says so.

    Mutations caught: the rate over this launch's time only (the slow first launch left out:
    ~2x too high); the split of this launch only."""
    (first, second), train = _resumed_twice(tmp_path, char_dataset)
    active = sum(r["step_time_s"] for r in train)  # every launch's steps
    later = sum(r["step_time_s"] for r in train if r["step"] > 6)
    tokens = train[-1]["tokens"]
    assert first["totals_of"] == second["totals_of"] == "run"
    assert second["tokens"] == tokens == 12 * TOKENS_PER_MICRO_BATCH
    # Each launch's own time from its start of training to its last record is in it too.
    assert second["tokens_per_s"] == pytest.approx(tokens / active, rel=0.2)
    assert second["tokens_per_s"] < 0.8 * (tokens / 2) / later  # not the second launch's
    # ... which is there too, and one launch has one figure.
    launch = second["launch_tokens_per_s"]
    assert launch == pytest.approx(6 * TOKENS_PER_MICRO_BATCH / later, rel=0.3)
    assert launch > second["tokens_per_s"]
    assert first["launch_tokens_per_s"] == first["tokens_per_s"]
    whole, mine = second["time_breakdown"], first["time_breakdown"]
    # The first launch's steps and waits, all before its last save, are in the run's split
    # (what it spent after that save, its final validation, is in other_s: not in the checkpoint)
    assert whole["step_s"] > mine["step_s"]
    assert whole["data_wait_s"] >= mine["data_wait_s"] >= 5 * 0.03  # the sleeps between steps
    assert sum(whole.values()) == pytest.approx(second["elapsed_s"], abs=0.05)


def test_a_run_resumed_from_an_older_checkpoint_says_its_end_totals_are_this_launch_s(
    tmp_path, char_dataset
):
    """A checkpoint of an older nanolab has no run time to add up: the end record keeps this
    launch's rate and split, and says so (``totals_of: this launch``), rather than dividing the
    whole run's tokens by one launch's time."""
    (_, second), train = _resumed_twice(tmp_path, char_dataset, strip_clock=True)
    later = sum(r["step_time_s"] for r in train if r["step"] > 6)
    assert second["totals_of"] == "this launch"
    assert second["tokens_per_s"] == pytest.approx(6 * TOKENS_PER_MICRO_BATCH / later, rel=0.3)
    assert sum(second["time_breakdown"].values()) < second["elapsed_s"]  # this launch's wall


def _two_launches(run, char_dataset, later_peak: float = 1e11, edit_setup=None) -> list[dict]:
    """A run of 3 steps and its resume to 6, the second launch's meter given ``later_peak``
    and its checkpoint's recorded setup passed through ``edit_setup`` first: the end records."""

    def callbacks(peak: float) -> list[L.Callback]:
        return [MetricsLog(), RotatingCheckpoint(every_n_steps=3), ThroughputMeter(peak_flops=peak)]

    fit(run, char_dataset, callbacks(1e11), max_steps=3, eval_every=100)
    last = run / "checkpoints" / "last.ckpt"
    if edit_setup is not None:
        state = torch.load(last, weights_only=True)
        for key, value in state["callbacks"].items():
            if "RunClock" in key:
                edit_setup(value["setup"])
        last = run / "checkpoints" / "edited.ckpt"
        torch.save(state, last)
    fit(run, char_dataset, callbacks(later_peak), max_steps=6, eval_every=100, ckpt_path=last)
    return events(run / "metrics.jsonl", "end")


def test_the_run_wide_rate_is_one_setup_s_strategy_compile_micro_batch_and_peak_included(
    tmp_path, char_dataset
):
    """The setup two launches must share for one run-wide tokens/s and MFU left out the
    strategy, ``model.compile``, the micro-batch size and a ``throughput.peak_flops`` override,
    so a resume that changed one of them reported ``totals_of: run`` over a blend. Now each is
    in it; a setup an older nanolab recorded (without them) is unknown: per launch only.

    Mutations caught: any of the four left out of ``launch_setup`` (the override changed, or a
    field stripped from the recorded setup, still ``run``)."""
    from nanolab.callbacks.devices import launch_setup

    trainer = fit(tmp_path / "one", char_dataset, [ThroughputMeter(peak_flops=3e11)], max_steps=1)
    setup = launch_setup(trainer)
    assert setup["strategy"] == "SingleDeviceStrategy"
    assert (setup["compile"], setup["compile_mode"]) == (False, None)
    assert setup["micro_batch_size"] == trainer.datamodule.micro_batch_size
    assert setup["peak_flops"] == 3e11

    first, second = _two_launches(tmp_path / "same", char_dataset)
    assert first["totals_of"] == second["totals_of"] == "run"  # nothing changed: one rate

    first, second = _two_launches(tmp_path / "peak", char_dataset, later_peak=2e11)
    assert second["totals_of"] == "this launch"
    assert second["tokens_per_s"] == second["launch_tokens_per_s"]

    for key in ("strategy", "compile", "micro_batch_size", "peak_flops"):
        ends = _two_launches(tmp_path / key, char_dataset, edit_setup=lambda s, k=key: s.pop(k))
        assert ends[1]["totals_of"] == "this launch", key

    def another(key: str, value: object):
        return lambda recorded: recorded.update({key: value})

    for key, value in (("strategy", "DDPStrategy"), ("compile", True), ("micro_batch_size", 2)):
        ends = _two_launches(
            tmp_path / f"{key}-changed", char_dataset, edit_setup=another(key, value)
        )
        assert ends[1]["totals_of"] == "this launch", key


def test_a_resume_in_another_precision_gives_no_blended_run_rate(tmp_path, char_dataset):
    """A resume may change the precision (fit warns and goes on), the devices or the GPU: a
    run-wide tokens/s over such launches was one figure for none of them, and its MFU divided
    it by the last launch's peak. Now the end record says ``totals_of: this launch`` when the
    launches' setups differ, for every later launch too (the mixed time stays in the run's
    total), its rate and MFU are this launch's, and ``launch_tokens_per_s`` is always there.

    Mutations caught: the setup left out of the checkpoint or not compared (``run``, a 32-bit
    and a 64-bit launch blended); a mixed run forgotten by the next launch of one precision;
    MFU from the blended rate."""
    ends, train = _resumed_twice(tmp_path, char_dataset, later_precision="64-true")
    first, second, third = ends
    assert first["totals_of"] == "run"
    assert second["totals_of"] == third["totals_of"] == "this launch"
    later = sum(r["step_time_s"] for r in train if 6 < r["step"] <= 12)
    assert second["tokens_per_s"] == second["launch_tokens_per_s"]
    assert second["tokens_per_s"] == pytest.approx(6 * TOKENS_PER_MICRO_BATCH / later, rel=0.3)
    assert third["tokens_per_s"] == third["launch_tokens_per_s"]
    start = events(tmp_path / "run" / "metrics.jsonl", "start")[-1]
    mfu = start["flops_per_token"] * second["launch_tokens_per_s"] / 1e11
    assert second["mfu"] == pytest.approx(mfu, rel=1e-4)
