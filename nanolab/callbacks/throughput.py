"""Throughput, MFU, device memory and utilisation, from the shared :class:`RunClock`.

Rates are measured between two records over *active* time (wall time minus evaluation,
checkpointing and logging pauses; data waits count, they are part of real throughput):

* ``tokens_per_s``/``samples_per_s``: over all ranks, every micro-batch of every accumulation;
* ``step_time_s``: active seconds per optimizer step;
* ``mfu = flops_per_token * tokens_per_s / (peak_flops * world_size)`` with
  ``flops_per_token`` from the model (6N + attention, PaLM convention, embedding lookups free)
  and the dense peak of the matmul dtype the run really uses (bf16/fp16, or TF32/FP32 for
  ``32-true`` as ``run.float32_matmul_precision`` set it) from the one GPU table
  (``nanolab/estimator/gpus.json``, via :mod:`nanolab.callbacks.peak_flops`) or
  ``throughput.peak_flops``; ``null`` (and one warning naming the device and the override) when
  the peak is unknown, never a guess;
* ``mem_allocated_bytes``/``mem_reserved_bytes``: this device's peak since start (CUDA/ROCm;
  ``null`` on CPU); the ``end`` record lists every rank's;
* ``gpu_util``: percent of the last sample period with a kernel running (NVML via ``pynvml``,
  AMD SMI via ``amdsmi``, when importable; else ``null``).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import lightning as L
import torch

from nanolab.callbacks.clock import ClockSnapshot
from nanolab.callbacks.events import CallbackConfigError
from nanolab.callbacks.peak_flops import peak_flops_per_device
from nanolab.callbacks.step import StepCallback

#: The variables that renumber the devices a process sees, per vendor, outermost first.
#: The device-mask variables, in the order the vendor's runtime applies them: each layer picks,
#: by index, from the devices the layer before it left, through its first variable that is set.
#: CUDA: ``CUDA_VISIBLE_DEVICES``. ROCm: ``ROCR_VISIBLE_DEVICES`` first, then the HIP runtime's
#: ``HIP_VISIBLE_DEVICES``, or ``CUDA_VISIBLE_DEVICES`` where that is unset (HIP reads it only
#: then, so the queue runner's equal pair is one mask, not two).
MaskLayers = tuple[tuple[str, ...], ...]
NVIDIA_MASKS: MaskLayers = (("CUDA_VISIBLE_DEVICES",),)
AMD_MASKS: MaskLayers = (("ROCR_VISIBLE_DEVICES",), ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"))


def _bus_id(index: int, domain_digits: int) -> str:
    """The PCI address of visible device ``index`` as the vendor's library spells it (NVML:
    an 8-digit domain, AMD SMI: 4)."""
    props = torch.cuda.get_device_properties(index)
    return (
        f"{props.pci_domain_id:0{domain_digits}x}:{props.pci_bus_id:02x}:"
        f"{props.pci_device_id:02x}.0"
    )


def physical_index(index: int, masks: MaskLayers) -> int:
    """The host's number of visible device ``index``, through the masks that are set, the last
    layer of ``masks`` first (:data:`AMD_MASKS`: a HIP index picks from the ROCr runtime's
    devices). Raises ValueError when that cannot be known for sure (a mask of UUIDs, an index
    past the mask): no figure is better than another GPU's."""
    for layer in reversed(masks):
        given = next((os.environ[m] for m in layer if os.environ.get(m, "").strip()), None)
        if given is None:
            continue
        ids = [v.strip() for v in given.split(",") if v.strip()]
        if index >= len(ids) or not ids[index].isdigit():
            raise ValueError(f"device {index} of mask {given!r}")
        index = int(ids[index])
    return index


class UtilizationSampler:
    """Device utilisation in percent from NVML or AMD SMI; ``sample()`` is ``None`` when neither works."""

    def __init__(self, device_index: int) -> None:
        self.backend: str | None = None  # "nvml" or "amdsmi" once one works
        self._read: Any = None
        for name in ("nvml", "amdsmi"):
            with contextlib.suppress(Exception):
                self._read = getattr(self, f"_{name}")(device_index)
                self.backend = name
                break

    @staticmethod
    def _nvml(index: int) -> Any:
        import pynvml

        pynvml.nvmlInit()
        try:  # the PCI bus id survives CUDA_VISIBLE_DEVICES renumbering
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(_bus_id(index, 8).encode())
        except Exception:
            handle = pynvml.nvmlDeviceGetHandleByIndex(physical_index(index, NVIDIA_MASKS))
        return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)

    @staticmethod
    def _amdsmi(index: int) -> Any:
        import amdsmi

        amdsmi.amdsmi_init()
        try:  # AMD SMI lists every GPU of the host, whatever HIP_VISIBLE_DEVICES hides
            handle = amdsmi.amdsmi_get_processor_handle_from_bdf(_bus_id(index, 4))
        except Exception:
            handle = amdsmi.amdsmi_get_processor_handles()[physical_index(index, AMD_MASKS)]
        return lambda: float(amdsmi.amdsmi_get_gpu_activity(handle)["gfx_activity"])

    def sample(self) -> float | None:
        if self._read is None:
            return None
        try:
            return self._read()
        except Exception:
            return None


#: The fields this meter adds to ``train`` records, in the order the run log writes them: the
#: one list of them. The run log gives every ``train`` record these keys (null without a
#: meter: :data:`~nanolab.callbacks.jsonl.TRAIN_FIELDS`), and ``log_to_loggers`` governs them
#: all (:data:`LOGGED_FIELDS`), so a field added here reaches both.
METER_FIELDS: tuple[str, ...] = (
    "step_time_s",
    "tokens_per_s",
    "samples_per_s",
    "mfu",
    "mem_allocated_bytes",
    "mem_reserved_bytes",
    "gpu_util",
)

#: The fields ``log_to_loggers: false`` keeps out of the trackers: all of :data:`METER_FIELDS`.
LOGGED_FIELDS = frozenset(METER_FIELDS)


class ThroughputMeter(StepCallback):
    """Adds tokens/s, samples/s, step time, MFU, memory and utilisation to the run log.

    Args:
        peak_flops: Dense peak FLOP/s of *one* device at the run's precision, overriding the
            table (e.g. ``989.4e12`` for an H100 SXM in bf16). ``null`` = look the device up.
        gpu_utilization: Sample utilisation through NVML / AMD SMI when available.
        log_to_loggers: Let the numbers reach the ``--logger`` trackers (TensorBoard, W&B,
            CSV) with the rest of the run log's ``train`` records, as ``train/tokens_per_s``,
            ``train/mfu``, ... at the records' steps (:func:`~nanolab.callbacks.loggers.
            forward_record`, the one path to a logger); false keeps them out of the trackers
            (they stay in ``metrics.jsonl``).
    """

    def __init__(
        self,
        peak_flops: float | None = None,
        gpu_utilization: bool = True,
        log_to_loggers: bool = True,
    ) -> None:
        super().__init__()
        if peak_flops is not None and peak_flops <= 0:
            raise CallbackConfigError(
                f"throughput.peak_flops must be > 0 (FLOP/s per device) or null, got {peak_flops}"
            )
        if peak_flops is not None and peak_flops < 1e9:
            raise CallbackConfigError(
                f"throughput.peak_flops is in FLOP/s per device, got {peak_flops}: that looks like "
                f"TFLOP/s; write {peak_flops}e12"
            )
        self.peak_flops_override = peak_flops
        self.gpu_utilization = gpu_utilization
        self.log_to_loggers = log_to_loggers
        self.peak_flops: float | None = None
        self.peak_source: str = ""
        self.device_name: str = ""
        self.flops_per_token: int | None = None
        self._first: ClockSnapshot | None = None
        #: Per reader (the run log's records, a fork's own): the snapshot of its previous measure.
        self._last: dict[str, ClockSnapshot] = {}
        #: Per reader: (step, fields) of its measure at that step.
        self._cache: dict[str, tuple[int, dict[str, Any]]] = {}
        #: The step's memory and utilisation, sampled once however many readers ask.
        self._sampled: tuple[int, dict[str, Any]] | None = None
        self._sampler: UtilizationSampler | None = None
        self._mem_per_device: list[dict[str, int]] | None = None
        self._warned = False

    # -- setup -------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.active:
            self._first = None

    def on_run_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._prepare(trainer)

    def _prepare(self, trainer: L.Trainer) -> None:
        """Look up the peak and the model's FLOPs once per fit (whichever callback asks first)."""
        if not self.active or self._first is not None:
            return
        assert self.clock is not None
        pl_module = trainer.lightning_module
        device = trainer.strategy.root_device
        cuda = device.type == "cuda"
        self.device_name = torch.cuda.get_device_name(device) if cuda else device.type
        precision = str(trainer.precision)
        if self.peak_flops_override is not None:
            self.peak_flops, self.peak_source = self.peak_flops_override, "throughput.peak_flops"
        elif cuda:
            self.peak_flops, self.peak_source = peak_flops_per_device(self.device_name, precision)
        else:
            self.peak_flops, self.peak_source = None, f"no peak-FLOPs table for {device.type}"
        if self.peak_flops is None and trainer.is_global_zero and not self._warned:
            self._warned = True
            warnings.warn(
                f"MFU unknown ({self.peak_source}; device {self.device_name!r}, precision "
                f"{precision}): records carry mfu null. Set throughput.peak_flops to the "
                "device's dense peak FLOP/s to report it.",
                stacklevel=2,
            )
        self.flops_per_token = model_flops_per_token(pl_module, trainer)
        if cuda and self.gpu_utilization and trainer.is_global_zero:
            self._sampler = UtilizationSampler(device.index or 0)
        self._first = self.clock.snapshot()
        self._last, self._cache, self._sampled = {}, {}, None

    # -- numbers -----------------------------------------------------------------------------
    def measure(self, trainer: L.Trainer, reader: str = "record") -> dict[str, Any]:
        """Rates since ``reader``'s previous measure, so each record's rate covers exactly the
        interval since the reader's record before it, whatever the other readers' cadence
        (``nanolab report`` sums those intervals); cached per reader and step. Memory and
        utilisation are sampled once a step for every reader."""
        step = int(trainer.global_step)
        cached = self._cache.get(reader)
        if cached is not None and cached[0] == step:
            return cached[1]
        assert self.clock is not None and self._first is not None
        now = self.clock.snapshot()
        fields = self._rates(self._last.get(reader, self._first), now, trainer)
        if self._sampled is None or self._sampled[0] != step:
            sampled = self._memory(trainer)
            sampled["gpu_util"] = self._sampler.sample() if self._sampler is not None else None
            self._sampled = (step, sampled)
        fields.update(self._sampled[1])
        self._last[reader] = now
        self._cache[reader] = (step, fields)
        return fields

    def _rates(self, a: ClockSnapshot, b: ClockSnapshot, trainer: L.Trainer) -> dict[str, Any]:
        active = b.active_s - a.active_s
        steps = b.global_step - a.global_step
        tokens = b.tokens - a.tokens
        samples = b.samples - a.samples
        tps = tokens / active if active > 0 and tokens > 0 else None
        return {
            "step_time_s": round(active / steps, 6) if steps > 0 and active > 0 else None,
            "tokens_per_s": round(tps, 2) if tps is not None else None,
            "samples_per_s": round(samples / active, 3) if active > 0 and samples > 0 else None,
            "mfu": self.mfu(tps, int(trainer.world_size)),
        }

    def run_tokens_per_s(self) -> float | None:
        """The whole run's tokens/s: the tokens it trained (all ranks, every launch; a branch's
        inherited ones left out) over its active training time (every launch's, from the
        checkpoint: :meth:`RunClock.train_active_s`). None when the checkpoint it resumed from
        did not keep that time, when the launches trained on different setups, or nothing was
        trained."""
        assert self.clock is not None
        active, tokens = self.clock.train_active_s(), self.clock.run_tokens
        if active is None or active <= 0 or tokens <= 0:
            return None
        return round(tokens / active, 2)

    def launch_tokens_per_s(self) -> float | None:
        """This launch's own tokens/s: the tokens it trained (all ranks) over its active
        training time (:meth:`RunClock.launch_train_active_s`), measured as the run's rate is,
        so a run of one launch has one figure. None when nothing was trained."""
        assert self.clock is not None and self._first is not None
        active, tokens = self.clock.launch_train_active_s(), self.clock.tokens - self._first.tokens
        if active <= 0 or tokens <= 0:
            return None
        return round(tokens / active, 2)

    def mfu(self, tokens_per_s: float | None, world_size: int) -> float | None:
        """Model FLOPs utilisation over all devices; ``None`` if the peak or the rate is unknown."""
        if tokens_per_s is None or not self.peak_flops or not self.flops_per_token:
            return None
        return float(f"{self.flops_per_token * tokens_per_s / (self.peak_flops * world_size):.6g}")

    @staticmethod
    def _memory(trainer: L.Trainer) -> dict[str, int | None]:
        device = trainer.strategy.root_device
        if device.type != "cuda":
            return {"mem_allocated_bytes": None, "mem_reserved_bytes": None}
        return {
            "mem_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
            "mem_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
        }

    def record_fields(self, trainer: L.Trainer, event: str) -> dict[str, Any]:
        if not self.active:
            return {}
        self._prepare(trainer)
        if event == "start":
            return {
                "flops_per_token": self.flops_per_token,
                "peak_flops": self.peak_flops,
                "peak_flops_source": self.peak_source,
            }
        if event == "train":
            return self.measure(trainer)
        if event == "end" and self._first is not None and self.clock is not None:
            launch = self.launch_tokens_per_s()
            run = self.run_tokens_per_s()  # None: totals_of "this launch" (RunClock.end_totals)
            return {
                "tokens_per_s": run if run is not None else launch,
                # This launch's own rate, on the setup its start record names: what estimate
                # and queue calibrate from; its MFU is over this launch's own peak.
                "launch_tokens_per_s": launch,
                "mfu": self.mfu(launch, int(trainer.world_size)),
                **self._memory(trainer),
                "mem_per_device": self._mem_per_device,
            }
        return {}

    @property
    def withheld_from_loggers(self) -> frozenset[str]:
        """The record fields the loggers do not get (``log_to_loggers: false``): the run log
        forwards its records to them (:func:`~nanolab.callbacks.loggers.forward_record`)."""
        return frozenset() if self.log_to_loggers else LOGGED_FIELDS

    # -- hooks -------------------------------------------------------------------------------
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Collect every rank's peak memory for the ``end`` record (a collective: all ranks)."""
        if not self.active or trainer.strategy.root_device.type != "cuda":
            return
        mem = self._memory(trainer)
        local = torch.tensor(
            [mem["mem_allocated_bytes"] or 0, mem["mem_reserved_bytes"] or 0],
            device=trainer.strategy.root_device,
        )
        gathered = trainer.strategy.all_gather(local).reshape(-1, 2).tolist()
        self._mem_per_device = [
            {"rank": r, "mem_allocated_bytes": int(a), "mem_reserved_bytes": int(b)}
            for r, (a, b) in enumerate(gathered)
        ]


def model_flops_per_token(pl_module: L.LightningModule, trainer: L.Trainer) -> int | None:
    """Training FLOPs per token from the model's own formula, at the data's sequence length."""
    model = getattr(pl_module, "model", None)
    formula = getattr(model, "flops_per_token", None)
    if not callable(formula):
        return None
    seq_len = getattr(trainer.datamodule, "block_size", None)
    try:
        return int(formula(seq_len) if isinstance(seq_len, int) else formula())
    except Exception:
        return None
