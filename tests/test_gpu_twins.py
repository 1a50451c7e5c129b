"""CPU twins of branches that behave differently when CUDA is present (docs/architecture.md,
"GPU-only branches"): each runs the code a GPU run takes, on CPU, by forcing the setting or
through a seam that takes a stand-in device object."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nanolab.data.datamodule import TokenDataModule, pins_memory
from nanolab.data.windowed import WindowDataModule
from nanolab.training.module import capture_rng_state, restore_rng_state


class FakeCuda:
    """A stand-in for ``torch.cuda`` with ``count`` visible devices that records what each
    device's generator was given."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.states: dict[int, torch.Tensor] = {}

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count

    def set_rng_state(self, state: torch.Tensor, device: int) -> None:
        if device >= self.count:
            raise IndexError(f"device {device} of {self.count}")
        self.states[device] = state

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [self.states.get(i, torch.full((16,), 100 + i, dtype=torch.uint8)) for i in
                range(self.count)]  # fmt: skip


@pytest.mark.parametrize("visible", [0, 1, 4])
def test_cuda_rng_states_are_saved_for_every_visible_device(visible):
    """A checkpoint keeps one CUDA state per device the run sees, and a resume on as many
    devices puts each back on its own device. Mutation caught: the CUDA states not saved (a
    resumed run's dropout on the GPU would not continue its stream)."""
    saving = FakeCuda(visible)
    state = capture_rng_state(cuda=saving)
    expected = saving.get_rng_state_all()
    assert len(state.get("cuda", [])) == visible
    for got, want in zip(state.get("cuda", []), expected, strict=True):
        assert torch.equal(got, want)
    resuming = FakeCuda(visible)
    restore_rng_state(state, cuda=resuming)
    assert [resuming.states[i].tolist() for i in sorted(resuming.states)] == [
        s.tolist() for s in expected
    ]


@pytest.mark.parametrize(("saved", "visible"), [(8, 1), (2, 2), (2, 4), (1, 0)])
def test_cuda_rng_states_restore_onto_the_devices_now_visible(saved, visible):
    """An 8-GPU checkpoint resumed on 1 GPU (or a queue job given other GPUs): device i takes
    saved state i where both exist, the rest keep their seed. Mutation caught: restoring with
    ``set_rng_state_all`` (IndexError with fewer devices visible)."""
    state = capture_rng_state()
    cuda_states = [torch.full((16,), i, dtype=torch.uint8) for i in range(saved)]
    cuda = FakeCuda(visible)
    restore_rng_state({**state, "cuda": cuda_states}, cuda=cuda)
    assert sorted(cuda.states) == list(range(min(saved, visible)))
    for i, got in cuda.states.items():
        assert torch.equal(got, cuda_states[i])


def _trainer_on(device: str) -> SimpleNamespace:
    """What the data modules read of the trainer they are attached to, on ``device``: a
    stand-in, as a CPU-only host cannot build a Trainer on CUDA."""
    total = SimpleNamespace(processed=0)
    return SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device(device)),
        global_rank=0,
        world_size=1,
        fit_loop=SimpleNamespace(
            epoch_loop=SimpleNamespace(batch_progress=SimpleNamespace(total=total))
        ),
        default_root_dir=None,
    )


class TensorWindows(WindowDataModule):
    """The smallest window data module: both splits are the same 8 windows of 8 ids."""

    def train_split(self):
        return self._windows()

    val_split = train_split

    def _windows(self):
        ids = torch.arange(8 * 9).reshape(8, 9) % 16

        class Source:
            def __len__(self) -> int:
                return len(ids)

            def __getitem__(self, indices):
                rows = ids[torch.from_numpy(indices)]
                return rows[:, :-1], rows[:, 1:]

        return Source()


CASES = [  # (pin_memory setting, the run's device, pinned?)
    (None, "cuda", True), (None, "cpu", False), (False, "cuda", False), (True, "cpu", True),
]  # fmt: skip


def test_pin_memory_follows_the_setting_and_the_run_device():
    """``data.pin_memory`` is obeyed; ``null`` pins only when the run's device is CUDA (not when
    the host merely has one)."""
    assert pins_memory(False, _trainer_on("cuda")) is False
    assert pins_memory(True, _trainer_on("cpu")) is True
    assert pins_memory(None, _trainer_on("cuda")) is True
    assert pins_memory(None, _trainer_on("cpu")) is False
    assert pins_memory(None, None) is False


@pytest.mark.parametrize(("setting", "device", "pinned"), CASES)
def test_the_loaders_a_cuda_run_builds_pin(char_dataset, setting, device, pinned):
    """The DataLoaders of both data modules (nanolab's token data and a fork's windows), built
    here as a run on ``device`` builds them, through the trainer each is attached to. Mutation
    caught: a data module that ignores its setting or the run's device (pins always, never)."""
    token = TokenDataModule(
        dataset_dir=str(char_dataset), micro_batch_size=4, block_size=32, pin_memory=setting
    )
    window = TensorWindows(micro_batch_size=2, block_size=8, val_windows=4, pin_memory=setting)
    for dm in (token, window):
        dm.trainer = _trainer_on(device)
        dm.setup("fit")
        assert dm.train_dataloader().pin_memory is pinned, type(dm).__name__
        assert dm.val_dataloader().pin_memory is pinned, type(dm).__name__


def test_the_cuda_allocator_gets_expandable_segments_unless_configured():
    """The setting every verb makes before touching a GPU: set on CUDA builds, the user's own
    allocator settings kept, ROCm builds left alone."""
    from nanolab.allocator import SETTING, prefer_expandable_segments

    env: dict[str, str] = {}
    assert prefer_expandable_segments(env, hip_version="") and env == {
        "PYTORCH_CUDA_ALLOC_CONF": SETTING
    }
    own = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    assert not prefer_expandable_segments(own, hip_version="") and own == {
        "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"
    }
    rocm: dict[str, str] = {}
    assert not prefer_expandable_segments(rocm, hip_version="6.2") and rocm == {}


def test_fit_runs_with_the_allocator_setting(char_dataset, tmp_path, capsys):
    """``fit`` (a Lightning verb, dispatched apart from the others) sets it before the run, in
    the environment of its process (here: this one's, put back afterwards)."""
    import json
    import os

    from conftest import QUICKSTART, tiny_overrides, write_config

    from nanolab.cli import main

    cfg = write_config(tmp_path / "t.yaml", tiny_overrides(char_dataset, tmp_path / "runs"))
    before = dict(os.environ)
    try:
        for key in [k for k in os.environ if "ALLOC_CONF" in k]:
            del os.environ[key]
        code = main(["fit", "--config", str(QUICKSTART), "--config", str(cfg),
                     "--trainer.max_steps", "1"])  # fmt: skip
        setting = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    finally:
        os.environ.clear()
        os.environ.update(before)
    assert code == 0, capsys.readouterr().err[-2000:]
    assert setting == "expandable_segments:True"
    assert json.loads((tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()[0])


def test_the_hip_version_is_read_without_importing_torch():
    """Every verb asks before it starts; reading torch's version file answers as torch does
    (``queue ls`` and ``fit --help`` stay free of torch's ~2 s import)."""
    import subprocess
    import sys

    code = (
        "import sys; from nanolab.allocator import torch_hip_version; "
        "hip = torch_hip_version(); print('torch' in sys.modules); "
        "import torch; print(hip == torch.version.hip)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]


class CountingAllocator:
    """A stand-in for ``torch.cuda``'s allocator statistics: every peak read is a new, larger
    number, so which reads land in which phase shows in the result."""

    def __init__(self) -> None:
        self.reads: list[int] = []
        self.resets = 0

    def memory_allocated(self) -> int:
        return 7

    def max_memory_allocated(self) -> int:
        self.reads.append(100 + len(self.reads))
        return self.reads[-1]

    def max_memory_reserved(self) -> int:
        return 2 * (100 + len(self.reads))

    def reset_peak_memory_stats(self) -> None:
        self.resets += 1


def test_the_gpu_memory_bench_records_each_phase_of_a_real_lightning_step():
    """bench_memory's GPU path reads the device's peak per phase of Lightning's step (forward,
    backward, before the optimizer, the optimizer step) through ``PhasePeaks``; here the same
    hooks of a real fit on CPU feed it. Mutation caught: a hook not wired (its phase missing),
    the first step counted (it creates the optimizer states), the overall peak lost to the
    per-phase resets."""
    from nanolab.estimator.measure_trainer import PhasePeaks, _fit, phase_peaks_callback
    from nanolab.model.config import GPTConfig

    allocator = CountingAllocator()
    phases = PhasePeaks(allocator)
    gpt = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
    _fit("cpu", [phase_peaks_callback(phases)], gpt, 2, "32-true", "adamw", 2, 3, 0)
    summary = phases.summary()
    assert list(summary) == [*PhasePeaks.ORDER, "at_forward_end"]
    assert summary["at_forward_end"] == 7
    # 3 steps x 2 micro-batches: each batch closes before it starts, forward, backward; each
    # step closes before the optimizer and after it; the end closes once more.
    assert len(allocator.reads) == 3 * 2 * 3 + 3 * 2 + 1
    assert phases.overall_allocated == max(allocator.reads)
    assert phases.overall_reserved == 2 * (100 + len(allocator.reads))
    # The first step's reads (the first 8) count overall but in no phase.
    assert min(summary[p] for p in PhasePeaks.ORDER) > allocator.reads[7]
    assert allocator.resets == len(allocator.reads)


class CudaStandIn(CountingAllocator):
    """The rest of what ``measure_trainer_peak_cuda`` reads of ``torch.cuda``: its syncs and
    ``mem_get_info`` (1,000 of 5,000 bytes free, 600 reserved by the allocator)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0

    def synchronize(self) -> None:
        self.syncs += 1

    def mem_get_info(self) -> tuple[int, int]:
        return 1000, 5000

    def memory_reserved(self) -> int:
        return 600


@pytest.mark.parametrize("fused", [False, True])
def test_the_gpu_memory_measure_runs_its_fit_on_a_cpu_stand_in(monkeypatch, fused):
    """``measure_trainer_peak_cuda`` (bench_memory's GPU path) with ``torch.cuda`` replaced by a
    stand-in and the Trainer on the CPU: the syncs before the reset and before the end's read,
    what is used outside the allocator (total - free - reserved), every phase read, and the
    optimizer it fits is the one asked for (``fused``: the one the estimate predicts for)."""
    from lightning.pytorch.callbacks import Callback

    from nanolab.estimator import measure_trainer as mt
    from nanolab.model.config import GPTConfig

    seen = []

    class OptimizerSeen(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            seen.append(bool(trainer.optimizers[0].defaults["fused"]))  # False: None

    real_fit = mt._fit
    monkeypatch.setattr(
        mt, "_fit", lambda acc, cbs, *a, **k: real_fit(acc, [*cbs, OptimizerSeen()], *a, **k)
    )
    memory = CudaStandIn()
    gpt = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
    got = mt.measure_trainer_peak_cuda(
        gpt, 2, precision="32-true", accumulate=2, fused=fused, memory=memory, accelerator="cpu"
    )
    assert seen == [fused]
    assert memory.syncs == 2 and got.outside_allocator == 5000 - 1000 - 600
    assert list(got.phases) == [*mt.PhasePeaks.ORDER, "at_forward_end"]
    assert got.peak_allocated == max(memory.reads)
    assert got.peak_reserved == 2 * (100 + len(memory.reads))


def _bench_memory():
    """benches/bench_memory.py, imported as the GPU check runs it (a script, not a module)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benches" / "bench_memory.py"
    spec = importlib.util.spec_from_file_location("bench_memory", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_memory"] = module
    spec.loader.exec_module(module)
    return module


def test_the_gpu_memory_bench_measures_the_optimizer_it_predicts(monkeypatch):
    """A config with ``model.optimizer.fused: false`` is predicted for foreach AdamW; the GPU
    measure must fit that optimizer too, not torch's fused default (the error row would compare
    two optimizers). The CPU device path runs the GPU measure's code on a stand-in as well."""
    from nanolab.estimator import measure_trainer as mt
    from nanolab.model.config import GPTConfig

    bm = _bench_memory()
    asked = []

    def spy(gpt, B, **kwargs):
        asked.append((kwargs["fused"], kwargs.get("accelerator", "gpu")))
        return mt.TrainerPeakCuda(1, 2, 3, {})

    monkeypatch.setattr(mt, "measure_trainer_peak_cuda", spy)
    gpt = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
    setup = SimpleNamespace(gpt=gpt, precision="32-true", optimizer="adamw", fused=False)
    assert bm.measure_device_peak("cuda", setup, 2).allocated == 1
    assert asked == [(False, "gpu")]
    monkeypatch.undo()
    monkeypatch.setattr(mt, "measure_trainer_peak_cpu", lambda *a, **k: mt.TrainerPeak(9, 0))
    rehearsed = []
    monkeypatch.setattr(bm, "rehearse_gpu_measure", lambda *a: rehearsed.append(a[2]["fused"]))
    assert bm.measure_device_peak("cpu", setup, 2).allocated == 9
    assert rehearsed == [False]


def test_the_bench_predicts_a_gpu_run_s_peak_at_the_micro_batch_it_ran(
    char_dataset, tmp_path, monkeypatch
):
    """``nanolab bench``'s prediction on a GPU (``predicted_peak_bytes``) and the machine it
    names, through a stand-in ``torch.cuda`` with two 12 GiB devices. Mutation caught: a run
    saved with ``run.micro_batch_size: auto`` predicted at a micro-batch picked again for the
    whole device (4,096 here, not the run's 8), not at the one it trained with."""
    import yaml
    from conftest import tiny_overrides

    from nanolab.bench import harness
    from nanolab.estimator import estimate_from_config

    cfg = tiny_overrides(char_dataset, tmp_path / "runs")
    cfg["trainer"]["accelerator"] = "gpu"
    cfg["run"]["micro_batch_size"] = "auto"  # as saved: the choice, and data's the pick
    cfg["data"]["micro_batch_size"] = 8
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    memory = 12 * 2**30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i=0: SimpleNamespace(total_memory=memory)
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "NVIDIA H100")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.version, "hip", None)

    def peak(**given) -> int:
        est = estimate_from_config(cfg, device_memory=memory, devices=1, **given)
        return int(est.memory.peak_allocated)

    got = harness.predicted_peak_bytes(path)
    assert got == peak(backend="cuda", micro_batch_size=8)
    assert got < peak(backend="cuda")  # auto, picked again for 12 GiB: a larger micro-batch
    assert harness._machine() == "NVIDIA H100 x2"


class CudaOnCpu(str):
    """A device the code under test reads as ``cuda:0`` (``.type``, ``.index``) while a tensor
    made on it lands on the CPU (it is the string ``"cpu"`` to torch): a CPU-only build of
    torch cannot make one on CUDA."""

    type = "cuda"
    index = 0


def test_a_cuda_run_s_meter_names_its_gpu_and_gathers_every_rank_s_peak_memory(monkeypatch):
    """``ThroughputMeter`` on a trainer whose root device is CUDA, with a stand-in
    ``torch.cuda`` and a 2-rank ``all_gather``: the device's name and its peak-FLOPs row, the
    utilisation sampler on its index, and the ``end`` record's per-device peaks gathered in rank
    order. Mutation caught: the table looked up by the device type, the sampler on another
    index, allocated and reserved swapped or a rank's row lost."""
    from nanolab.callbacks import ThroughputMeter
    from nanolab.callbacks import throughput as tp
    from nanolab.callbacks.peak_flops import peak_flops_per_device

    name = "NVIDIA H100 80GB HBM3"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1000)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 1500)
    sampled_on = []
    monkeypatch.setattr(tp, "UtilizationSampler", lambda index: sampled_on.append(index))
    gathered = []

    def all_gather(local: torch.Tensor) -> torch.Tensor:
        gathered.append(local)
        return torch.stack([local, 2 * local])  # rank 1 holds twice rank 0's

    strategy = SimpleNamespace(root_device=CudaOnCpu("cpu"), all_gather=all_gather)
    trainer = SimpleNamespace(
        strategy=strategy, lightning_module=SimpleNamespace(), precision="bf16-mixed",
        is_global_zero=True, datamodule=None,
    )  # fmt: skip
    meter = ThroughputMeter()
    meter.active, meter.clock = True, SimpleNamespace(snapshot=lambda: "start")
    meter._prepare(trainer)
    assert meter.device_name == name and sampled_on == [0]
    assert (meter.peak_flops, meter.peak_source) == peak_flops_per_device(name, "bf16-mixed")
    assert meter.peak_flops is not None
    meter.on_train_end(trainer, trainer.lightning_module)
    assert [t.tolist() for t in gathered] == [[1000, 1500]]
    assert meter._mem_per_device == [
        {"rank": 0, "mem_allocated_bytes": 1000, "mem_reserved_bytes": 1500},
        {"rank": 1, "mem_allocated_bytes": 2000, "mem_reserved_bytes": 3000},
    ]


class Bf16Cuda:
    """A stand-in for ``torch.cuda`` on a host whose GPU 0 is ``name`` of compute capability
    ``capability`` (and GPU 1.. the ``more`` cards, name and capability each): bf16 in hardware
    from 8.0 (Ampere), emulated below it (what ``is_bf16_supported()`` says by default, of the
    current GPU 0). ``emulation_flag``: whether its ``is_bf16_supported`` takes
    ``including_emulation`` (an older torch's does not, and reports hardware only)."""

    def __init__(
        self,
        name: str,
        capability: tuple[int, int],
        emulation_flag: bool = True,
        more: tuple[tuple[str, tuple[int, int]], ...] = (),
    ):
        self.cards = [(name, capability), *more]
        self.emulation_flag = emulation_flag

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return len(self.cards)

    def is_bf16_supported(self, **kwargs: bool) -> bool:
        if kwargs and not self.emulation_flag:
            raise TypeError("is_bf16_supported() got an unexpected keyword argument")
        emulated = kwargs.get("including_emulation", self.emulation_flag)
        return self.cards[0][1] >= (8, 0) or bool(emulated)

    def get_device_capability(self, device: int = 0) -> tuple[int, int]:
        return self.cards[device][1]

    def get_device_name(self, device: int = 0) -> str:
        return self.cards[device][0]


V100 = ("Tesla V100-SXM2-16GB", (7, 0))


@pytest.mark.parametrize("emulation_flag", [True, False])
def test_bf16_on_a_cuda_gpu_without_it_is_refused_before_the_run(emulation_flag):
    """A V100 or T4 has no bf16 (torch emulates it, many times slower): ``bf16-mixed`` there is
    refused in one line naming the card and what runs on it; on an Ampere card, on the CPU, or
    under fp16 nothing is said. Mutation caught: asking ``is_bf16_supported()`` with its
    default, which counts emulation and so says yes on every CUDA GPU."""
    from nanolab.run.trainer_errors import bf16_unsupported

    old = Bf16Cuda(*V100, emulation_flag=emulation_flag)
    for precision in ("bf16-mixed", "bf16-true", "bf16"):
        for accelerator in (None, "auto", "gpu", "cuda"):
            args = {"precision": precision, "accelerator": accelerator}
            refusal = bf16_unsupported(args, cuda=old)
            assert refusal is not None, args
            named = "bf16-mixed" if precision == "bf16" else precision
            assert str(refusal) == (
                f"trainer.precision: {named} needs a GPU with bf16 (Ampere or newer, compute "
                "capability 8.0), and Tesla V100-SXM2-16GB (GPU 0, compute capability 7.0) has "
                "none; "
                "use --trainer.precision 16-mixed (fp16 with loss scaling) or 32-true on this GPU"
            )
    assert bf16_unsupported({"precision": "bf16-mixed", "accelerator": "cpu"}, cuda=old) is None
    assert bf16_unsupported({"precision": "16-mixed", "accelerator": "gpu"}, cuda=old) is None
    assert bf16_unsupported({"precision": None}, cuda=old) is None
    a100 = Bf16Cuda("NVIDIA A100-SXM4-80GB", (8, 0), emulation_flag=emulation_flag)
    assert bf16_unsupported({"precision": "bf16-mixed", "accelerator": "gpu"}, cuda=a100) is None


def test_bf16_is_checked_on_the_gpus_the_run_uses_not_gpu_0():
    """A V100 at 0 and an A100 at 1: ``devices: [1]`` (or ``"1,"``) was refused naming the
    V100, and with an A100 at 0 and a T4 at 1, ``devices: [1]`` ran on the T4 unrefused."""
    from nanolab.run.trainer_errors import bf16_unsupported

    a100 = ("NVIDIA A100-SXM4-40GB", (8, 0))
    v100_a100 = Bf16Cuda(*V100, more=(a100,))
    t4 = ("Tesla T4", (7, 5))
    a100_t4 = Bf16Cuda(*a100, more=(t4,))

    def refusal(cuda: Bf16Cuda, devices: object) -> str | None:
        args = {"precision": "bf16-mixed", "accelerator": "gpu", "devices": devices}
        found = bf16_unsupported(args, cuda=cuda)
        return None if found is None else str(found)

    for devices in ([1], "1,", (1,), "1, "):
        assert refusal(v100_a100, devices) is None, devices
    for devices in ([0], "0,", 1, "1", "auto", -1, "-1", None, [0, 1], "0,1", 2):
        said = refusal(v100_a100, devices)
        assert said is not None and "Tesla V100-SXM2-16GB (GPU 0," in said, devices
        assert said.endswith("or --trainer.devices '[1]' (the GPUs here with bf16)"), said
    for devices in ([1], "1,", [0, 1], "auto", 2):
        said = refusal(a100_t4, devices)
        assert said is not None and "Tesla T4 (GPU 1, compute capability 7.5)" in said, devices
    for devices in ([0], 1, "0,"):
        assert refusal(a100_t4, devices) is None, devices
    # a GPU the host lacks, or a malformed list: Lightning's own refusal names it
    for devices in ([5], 3, "7,", "x"):
        assert refusal(v100_a100, devices) is None, devices


def test_the_bf16_check_reads_trainer_devices_without_lightnings_private_helpers():
    """``gpus_used`` parsed ``trainer.devices`` with two private helpers of Lightning's device
    parser: an upgrade that renames them would break every bf16 run's start. It reads the
    Trainer's documented forms itself now, as those helpers read them (compared here while
    they exist)."""
    import ast
    import inspect

    from nanolab.run import trainer_errors
    from nanolab.run.trainer_errors import gpus_used

    tree = ast.parse(inspect.getsource(trainer_errors))
    private = [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning")
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert private == []
    four = Bf16Cuda(*V100, more=(V100, V100, V100))
    forms = [None, "auto", -1, "-1", 1, 2, 4, 5, 0, "0", "2", " 3 ", "1,", "0,2", "1, ", ",1",
             [1], [0, 3], (2,), [], [1, 1], [4], [True], True, "x", "[1]", 1.0, "1,x"]  # fmt: skip
    for devices in forms:
        assert gpus_used(devices, four) == _as_lightning_reads(devices, 4), devices


def _as_lightning_reads(devices: object, count: int) -> list[int]:
    """What Lightning's own (private) parsing makes of ``devices`` on ``count`` GPUs, in
    ``gpus_used``'s terms ([] for what the Trainer refuses)."""
    parser = pytest.importorskip("lightning.fabric.utilities.device_parser")
    normalize = getattr(parser, "_normalize_parse_gpu_string_input", None)
    to_list = getattr(parser, "_normalize_parse_gpu_input_to_list", None)
    if normalize is None or to_list is None:
        pytest.skip("Lightning's private device parsing moved: nothing to compare with")
    if devices is None or str(devices).strip() in ("auto", "-1"):
        return list(range(count))
    try:
        parser._check_data_type(devices)
        ids = to_list(normalize(devices), include_cuda=True, include_mps=False)
    except (TypeError, ValueError, AssertionError):
        return []
    ids = list(ids or ())
    if len(set(ids)) != len(ids) or not all(type(i) is int and 0 <= i < count for i in ids):
        return []
    return ids


def test_fit_under_bf16_on_a_gpu_without_it_writes_nothing(
    tmp_path, char_dataset, monkeypatch, capsys
):
    """The refusal through ``nanolab fit`` on a stand-in V100: one line, exit 2, before the
    data is read and with no run directory."""
    from conftest import QUICKSTART, tiny_overrides, write_config

    from nanolab.cli import main

    stand_in = Bf16Cuda(*V100)
    for name in (
        "is_available", "device_count", "is_bf16_supported", "get_device_capability",
        "get_device_name",
    ):  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, getattr(stand_in, name))
    runs = tmp_path / "runs"
    config = write_config(tmp_path / "t.yaml", tiny_overrides(char_dataset, runs))
    argv = ["fit", "--config", str(QUICKSTART), "--config", str(config),
            "--trainer.accelerator", "gpu", "--trainer.precision", "bf16-mixed"]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "nanolab fit: error: trainer.precision: bf16-mixed needs a GPU with bf16"
    ), err
    assert not runs.exists()


class MemoryCuda:
    """A stand-in for ``torch.cuda`` on a host with one GPU of each of ``memory`` bytes, GPU 0
    current (as it is in every process before the Trainer starts)."""

    def __init__(self, *memory: int) -> None:
        self.memory = memory

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return len(self.memory)

    def current_device(self) -> int:
        return 0

    def get_device_properties(self, device: int) -> SimpleNamespace:
        return SimpleNamespace(total_memory=self.memory[device], name=f"GPU {device}")


def _namespace(value: object) -> object:
    """A plain config as the parsed ``fit`` config holds it (nested jsonargparse Namespaces)."""
    from jsonargparse import Namespace

    if isinstance(value, dict):
        return Namespace(**{key: _namespace(item) for key, item in value.items()})
    return value


@pytest.mark.parametrize(
    ("devices", "gpus", "micro", "planned_on"),
    [
        ([1], 1, 8, 12),
        ("1,", 1, 8, 12),
        ([0, 1], 2, 8, 12),
        ("auto", 2, 8, 12),
        ([0], 1, 64, 80),
        (1, 1, 64, 80),
    ],
)
def test_auto_micro_batch_is_planned_on_the_smallest_gpu_the_run_uses(
    monkeypatch, caplog, devices, gpus, micro, planned_on
):
    """An 80 GiB GPU 0 and a 12 GiB GPU 1: gpt2-124m on ``devices: [1]`` was planned on GPU 0,
    micro-batch 64 (46.8 GiB predicted, an OOM on the 12 GiB card; 8 fits), and a fixed
    micro-batch too large for GPU 1 was not warned of. Every GPU the run uses is read now and
    the smallest decides; through ``fit``'s own planning with a stand-in ``torch.cuda``. Where
    the run's ``gpus`` differ, the warning said "this device's 12.0 GiB" of a run on both: it
    names the smallest of the run's GPUs now."""
    import warnings

    import yaml
    from conftest import REPO

    from nanolab.run.autobatch import gpu_memories
    from nanolab.run.compose import plan_micro_batch
    from nanolab.training.resolve import DEFAULT_DATA, resolve

    stand_in = MemoryCuda(80 * 2**30, 12 * 2**30)
    for name in ("is_available", "device_count", "current_device", "get_device_properties"):
        monkeypatch.setattr(torch.cuda, name, getattr(stand_in, name))

    def planned(micro_batch_size: object) -> tuple[int, str]:
        cfg = yaml.safe_load((REPO / "configs" / "gpt2-124m.yaml").read_text())
        cfg["trainer"]["devices"] = devices
        cfg["run"]["micro_batch_size"] = micro_batch_size
        cfg["data"] = {"class_path": DEFAULT_DATA, "init_args": cfg["data"]}
        parsed = _namespace(cfg)
        caplog.clear()
        with warnings.catch_warnings(record=True) as warned, caplog.at_level("INFO"):
            warnings.simplefilter("always")
            got = plan_micro_batch(parsed, resolve(parsed, visible_gpus=2))
        return got, caplog.text + "".join(str(w.message) for w in warned)

    got, said = planned("auto")
    assert got == micro, said
    assert f"run.micro_batch_size auto: {micro} (predicted peak " in said
    assert f" of {planned_on}.0 GiB)" in said
    got, said = planned(16)  # about 14 GiB: too large for the 12 GiB card only
    assert got == 16
    if planned_on == 12:  # the run's GPUs differ: the smallest's memory, said as such
        memory = (
            "this device's 12.0 GiB" if gpus == 1 else "the smallest of the run's GPUs (12.0 GiB)"
        )
        assert f"exceeds {memory} at micro_batch_size 16; expect an OOM" in said
    else:
        assert "exceeds" not in said
    # A GPU this host lacks: planned on every GPU here (the Trainer then refuses the value).
    assert gpu_memories([5], stand_in) == gpu_memories("x", stand_in) == [80 * 2**30, 12 * 2**30]
