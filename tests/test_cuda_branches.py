"""Every place nanolab's code branches on the device has a CPU twin, or is listed as having none.

The rule (docs/architecture.md, "GPU-only branches"): no code runs for the first time on a GPU.
This test parses every module of ``nanolab/`` and ``benches/`` and finds each way of asking
about the device (:class:`DeviceBranches`): a comparison, ``in`` test or ``case`` against
``"cuda"``, ``"cpu"``, ``"hip"``, ``"mps"``, ``"gpu"``, ``"xpu"``, ``"xla"`` or an accelerator
class's name (either side, or in a tuple), such a string named anywhere else (a constant, a
dispatch table's key, a default) but where it only places something on a device
(``torch.device("cuda")``, ``.to("cpu")``, ``map_location="cpu"``), ``.device.index``,
``torch._C._cuda*``, ``.startswith("cuda")``, ``.is_cuda``, anything reached through ``torch.cuda``,
``torch.backends.cuda``, ``torch.backends.cudnn``, ``torch.backends.mps``, ``torch.mps``,
``torch.xpu``, ``torch.accelerator``, ``torch.get_device_module``, ``torch.get_default_device``,
``torch.set_default_device``, ``torch.version.hip`` or ``torch.version.cuda`` (imported under
any name, or through ``getattr`` or ``import_module``), a device's type handed to a call that
does not only place something (``getattr(torch, x.device.type)``,
``Trainer(accelerator=device.type)``: the callee branches where no device name shows),
Lightning's ``accelerators.cuda``/``mps`` modules, code in a string that does (a child's
``python -c``), Lightning's accelerator classes (``isinstance(acc, CPUAccelerator)``),
``.is_cpu``/``.is_mps``, ``.get_device()``, a ``*_VISIBLE_DEVICES`` mask or an
``nvidia-smi``/``rocm-smi``/``amd-smi`` command in a string, ``"nccl"`` compared as a backend, and
the GPU query libraries (``pynvml``, ``amdsmi``). A file with such a hit must be in :data:`TWINS` (a test that runs the same code on
a CPU, by forcing the setting or through a seam), :data:`NO_CPU_TWIN` (with why) or
:data:`SETTING_NOT_DEVICE` (the string compared is a setting or a named target, not the device
this process runs on). A stale entry fails too, and every named twin must exist. A twinned
file's part that no CPU can run is named, with why, in :data:`NO_CPU_TWIN_PART`.

A listed file is not a licence for more: :data:`BRANCHES` pins how many hits each function of
each file has, so a new device branch anywhere, in a listed file too, is a failing diff to
review (twin it, then update the count the failure prints).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("nanolab", "benches")
#: Device names, and the GPU-only collective backend (``dist.get_backend() == "nccl"``).
DEVICE_NAMES = frozenset({"cuda", "cpu", "hip", "mps", "gpu", "xpu", "xla", "nccl"})
DEVICE_MODULES = (
    "torch.cuda",
    "torch.backends.cuda",
    "torch.accelerator",
    "torch.get_device_module",
    # The default device: ``torch.get_default_device()`` answers "cuda" where a caller set it,
    # and ``torch.set_default_device`` moves every tensor made after it (a factory's ``device``
    # left out) onto the one it names.
    "torch.get_default_device",
    "torch.set_default_device",
    "torch.version.hip",
    "torch.version.cuda",
    "torch.backends.mps",
    "torch.backends.cudnn",
    "torch.mps",
    "torch.xpu",
    "lightning.fabric.accelerators.cuda",
    "lightning.fabric.accelerators.mps",
    "lightning.pytorch.accelerators.cuda",
    "lightning.pytorch.accelerators.mps",
)
#: Libraries that ask the GPU's driver directly (utilisation, bus ids, memory).
GPU_LIBRARIES = frozenset({"pynvml", "amdsmi", "pyrsmi", "nvidia_smi"})
#: Lightning's accelerators: ``isinstance(acc, CPUAccelerator)`` asks the device as surely as
#: ``CUDAAccelerator`` does.
DEVICE_CLASSES = frozenset(
    {"CUDAAccelerator", "CPUAccelerator", "MPSAccelerator", "XLAAccelerator"}
)
#: A tensor's or device's own answer to "where am I" (``x.is_cuda``, ``x.is_cpu``).
DEVICE_ATTRIBUTES = frozenset({"is_cuda", "is_cpu", "is_mps"})
#: torch's private bindings of a device's runtime (``torch._C._cuda_getDeviceCount()``).
PRIVATE_DEVICE_BINDING = re.compile(r"^torch\._C\._(cuda|mps|xpu|hip)")
#: Calls that place something on the device a string names (``torch.device("cuda")``,
#: ``x.to("cpu")``, ``torch.autocast("cpu")``): their first argument uses a device, it does not
#: ask which one this is; likewise the keywords that name where a tensor goes.
PLACING_CALLS = frozenset({"device", "to", "autocast", "GradScaler"})
PLACING_KEYWORDS = frozenset({"device", "device_type", "map_location"})
#: Text that asks the GPU in a string: a device mask (``CUDA_VISIBLE_DEVICES``,
#: ``HIP_VISIBLE_DEVICES``, ...) or a vendor's query tool run as a command.
DEVICE_TEXT = re.compile(r"\b[A-Z]+_VISIBLE_DEVICES\b|\b(nvidia|rocm|amd)-smi\b")


def _is_device_string(value: object) -> bool:
    """A device's name (``"cuda"``, ``"cuda:1"``, ``"xpu"``, ...) or an accelerator class's
    (``"CUDAAccelerator"``: ``type(acc).__name__ == "CUDAAccelerator"`` asks as surely)."""
    return isinstance(value, str) and (
        value.split(":")[0] in DEVICE_NAMES or value in DEVICE_CLASSES
    )


def _names_a_device(node: ast.AST) -> bool:
    """A string constant naming a device (:func:`_is_device_string`), or a tuple, list or set
    holding one."""
    if isinstance(node, ast.Constant):
        return _is_device_string(node.value)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_device(e) for e in node.elts)
    return False


def _matches_a_device(pattern: ast.pattern) -> bool:
    """A ``case`` pattern that names a device (``case "cuda":``, ``case "cuda" | "hip":``)."""
    if isinstance(pattern, ast.MatchValue):
        return _names_a_device(pattern.value)
    if isinstance(pattern, ast.MatchOr):
        return any(_matches_a_device(p) for p in pattern.patterns)
    if isinstance(pattern, ast.MatchAs) and pattern.pattern is not None:
        return _matches_a_device(pattern.pattern)
    return False


def _is_device_module(dotted: str | None) -> bool:
    """Whether a dotted name is one of :data:`DEVICE_MODULES` or inside one."""
    if dotted is None:
        return False
    if PRIVATE_DEVICE_BINDING.match(dotted):
        return True
    return any(dotted == module or dotted.startswith(module + ".") for module in DEVICE_MODULES)


#: What code in a string (a child's ``python -c``) asks the device through.
CODE_IN_TEXT = (
    *(f"{module}." for module in DEVICE_MODULES),
    "torch.version.hip",
    "torch.version.cuda",
    "torch.get_default_device(",
    "torch.set_default_device(",
)


class DeviceBranches(ast.NodeVisitor):
    """The lines of one module that ask which device the code runs on, as
    ``(line, what, scope)``: ``scope`` is the enclosing function or class, dotted
    (``Class.method``), or ``<module>``."""

    def __init__(self) -> None:
        self.aliases: dict[str, str] = {}  # a name bound by an import -> what it names
        self.scope: list[str] = []
        self.hits: list[tuple[int, str, str]] = []
        #: Device-name strings already counted (in a comparison, a case, a ``startswith``) or
        #: only placing something on a device (:data:`PLACING_CALLS`): not a hit of their own.
        self.accounted: set[int] = set()

    def _account(self, *nodes: ast.AST) -> None:
        """Mark the device-name strings in ``nodes`` (and their tuples) as accounted for."""
        for node in nodes:
            for inner in ast.walk(node):
                if isinstance(inner, ast.Constant) and _is_device_string(inner.value):
                    self.accounted.add(id(inner))

    def _hit(self, node: ast.AST, what: str) -> None:
        scope = ".".join(self.scope) or "<module>"
        self.hits.append((getattr(node, "lineno", 0), what, scope))

    def _scoped(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return  # a docstring: prose about the device, not code that asks it
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            root = alias.name.split(".")[0]
            self.aliases[alias.asname or root] = alias.name if alias.asname else root
            if _is_device_module(alias.name) or root in GPU_LIBRARIES:
                self._hit(node, f"import {alias.name}")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        for alias in node.names:
            full = f"{module}.{alias.name}"
            self.aliases[alias.asname or alias.name] = full
            library = module.split(".")[0] in GPU_LIBRARIES
            if _is_device_module(full) or library or alias.name in DEVICE_CLASSES:
                self._hit(node, f"from {module} import {alias.name}")

    def _dotted(self, node: ast.AST) -> str | None:
        """``a.b.c`` with ``a`` read through the imports (``tc.x`` -> ``torch.cuda.x``)."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        return ".".join([self.aliases.get(node.id, node.id), *reversed(parts)])

    def visit_Attribute(self, node: ast.Attribute) -> None:
        dotted = self._dotted(node)
        if node.attr in DEVICE_ATTRIBUTES:
            self._hit(node, f".{node.attr}")
        elif node.attr == "index" and _last_name(node.value).endswith("device"):
            self._hit(node, ".device.index")  # a CUDA device's number, None on a CPU
        elif node.attr in DEVICE_CLASSES:
            self._hit(node, node.attr)
        elif _is_device_module(dotted):
            self._hit(node, str(dotted))
            return  # the chain's inner attributes are the same use
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        named = self.aliases.get(node.id)
        if node.id in DEVICE_CLASSES or (named != node.id and _is_device_module(named)):
            self._hit(node, named or node.id)

    def visit_Compare(self, node: ast.Compare) -> None:
        sides = (node.left, *node.comparators)
        if any(_names_a_device(side) for side in sides):
            self._hit(node, "a comparison with a device name")
            self._account(*(side for side in sides if _names_a_device(side)))
        self.generic_visit(node)

    def visit_match_case(self, node: ast.match_case) -> None:
        if _matches_a_device(node.pattern):
            self._hit(node.pattern, "a case of a device name")
            self._account(node.pattern)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        prefix = isinstance(func, ast.Attribute) and func.attr in ("startswith", "endswith")
        if prefix and node.args and _names_a_device(node.args[0]):
            self._hit(node, f".{func.attr}(a device name)")
            self._account(node.args[0])
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if called in PLACING_CALLS and node.args and isinstance(node.args[0], ast.Constant):
            self._account(node.args[0])  # torch.device("cuda"): uses a device, asks nothing
        for keyword in node.keywords:
            if keyword.arg in PLACING_KEYWORDS and isinstance(keyword.value, ast.Constant):
                self._account(keyword.value)  # map_location="cpu"
        for position, argument in enumerate(node.args):
            places = called in PLACING_CALLS and position == 0
            if _is_device_type(argument) and not places:
                self._hit(argument, ".device.type passed along")  # getattr(torch, d.type)
        for keyword in node.keywords:
            if _is_device_type(keyword.value) and keyword.arg not in PLACING_KEYWORDS:
                self._hit(keyword.value, f".device.type passed along as {keyword.arg}")
        if isinstance(func, ast.Attribute) and func.attr == "get_device" and not node.args:
            self._hit(node, ".get_device()")  # a tensor's CUDA index, -1 on a CPU
        imports = (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)) in (
            "import_module", "__import__",
        )  # fmt: skip
        module = (
            node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
        )
        if imports and isinstance(module, str) and _is_device_module(module):
            self._hit(node, f"import_module({module!r})")  # importlib.import_module("torch.cuda")
        looks_up = isinstance(func, ast.Name) and func.id in ("getattr", "hasattr")
        if looks_up and len(node.args) >= 2:
            owner, name = self._dotted(node.args[0]), node.args[1]
            attribute = name.value if isinstance(name, ast.Constant) else None
            if owner and isinstance(attribute, str) and _is_device_module(f"{owner}.{attribute}"):
                self._hit(node, f"{func.id}({owner}, {attribute!r})")
                self._account(name)  # getattr(torch.version, "hip"): one use, counted once
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if not isinstance(node.value, str):
            return
        if _is_device_string(node.value) and id(node) not in self.accounted:
            # Named anywhere else, the string is a branch waiting for its comparison: a
            # constant (CUDA = "cuda", then == CUDA), a dispatch table's key
            # ({"cuda": a, "cpu": b}[x.device.type]), a default, an argument compared inside.
            self._hit(node, f"{node.value!r} named")
        elif any(code in node.value for code in CODE_IN_TEXT):
            self._hit(node, "device code in a string")
        elif match := DEVICE_TEXT.search(node.value):
            self._hit(node, f"{match[0]} in a string")


def _is_device_type(node: ast.AST) -> bool:
    """``x.device.type`` or ``root_device.type``: a device's name read at run time, which code
    handed it can branch on with no device name in sight."""
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "type"
        and _last_name(node.value).endswith("device")
    )


def _last_name(node: ast.AST) -> str:
    """The last identifier of ``a.b.device`` or ``device`` ('' for anything else)."""
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def device_branches(source: str) -> list[tuple[int, str, str]]:
    """Where ``source`` asks about the device: ``(line, what, scope)`` per use."""
    scan = DeviceBranches()
    scan.visit(ast.parse(source))
    return scan.hits


#: file -> the tests that run its CUDA branch's code on a CPU.
TWINS: dict[str, tuple[str, ...]] = {
    "nanolab/training/optim.py": (
        "tests/test_fused_amp.py::test_fused_adamw_trains_like_the_unfused_one",
    ),
    "nanolab/training/module.py": (
        "tests/test_gpu_twins.py::test_cuda_rng_states_restore_onto_the_devices_now_visible",
        "tests/test_gpu_twins.py::test_cuda_rng_states_are_saved_for_every_visible_device",
    ),
    "nanolab/model/gpt.py": (
        "tests/test_documents.py::test_flex_sdpa_and_math_give_the_same_losses_and_gradients",
        "tests/test_flex_fit.py::test_the_compiled_flex_path_a_gpu_takes_trains_and_resumes_through_fit",
        # GPT.forward: whether autocast is on for the logits' device type, asked on a CPU alike
        "tests/test_model.py::test_a_model_cast_to_16_bits_computes_its_loss_in_fp32",
    ),
    "nanolab/training/resolve.py": ("tests/test_resolve.py::test_one_device_counter",),
    "nanolab/run/autobatch.py": (
        "tests/test_autobatch.py::test_auto_picks_the_largest_fitting_divisor_of_the_global_batch",
        # gpu_memories: the GPUs of trainer.devices, read through a stand-in torch.cuda
        "tests/test_gpu_twins.py::test_auto_micro_batch_is_planned_on_the_smallest_gpu_the_run_uses",
    ),
    "nanolab/bench/harness.py": (
        "tests/test_gpu_twins.py::test_the_bench_predicts_a_gpu_run_s_peak_at_the_micro_batch_it_ran",
        "tests/test_gpu_check.py::test_the_dry_run_takes_every_check_s_code_path_on_this_cpu",
    ),
    "nanolab/callbacks/peak_flops.py": (
        # rocm_build: a ROCm build's 32-true TF32 only with HIPBLASLT_ALLOW_TF32=1 (matmul_dtype),
        # which its launch setup and start record keep (tf32_switch)
        "tests/test_callbacks_throughput.py::test_a_rocm_build_divides_fp32_mfu_by_tf32_only_with_hipblaslt_allowing_it",
        "tests/test_callbacks_throughput.py::test_a_rocm_resume_that_flips_hipblaslt_allow_tf32_gives_no_blended_run_rate",
    ),
    "nanolab/callbacks/readout.py": (
        "tests/test_syncs.py::test_the_readout_defers_a_copy_nobody_waits_for",
        "tests/test_syncs.py::test_a_run_log_written_a_step_late_holds_the_same_records_in_the_same_order",
    ),
    "nanolab/callbacks/throughput.py": (
        "tests/test_gpu_twins.py::test_a_cuda_run_s_meter_names_its_gpu_and_gathers_every_rank_s_peak_memory",
        "tests/test_callbacks_throughput.py::test_amd_utilization_reads_this_processs_gpu",
    ),
    "nanolab/callbacks/syncs.py": (
        "tests/test_syncs.py::test_the_counter_counts_what_waits_and_once_per_transfer",
    ),
    "nanolab/bench/plain_loop.py": (
        "tests/test_bench.py::test_the_plain_loop_on_a_cuda_device_pins_its_batches_and_waits_for_its_last_step",
        "tests/test_gpu_check.py::test_the_dry_run_takes_every_check_s_code_path_on_this_cpu",
    ),
    "nanolab/run/trainer_errors.py": (
        "tests/test_trainer_refusals.py::test_a_setting_the_trainer_refuses_is_one_line_and_writes_nothing",
        "tests/test_gpu_twins.py::test_bf16_on_a_cuda_gpu_without_it_is_refused_before_the_run",
        "tests/test_gpu_twins.py::test_fit_under_bf16_on_a_gpu_without_it_writes_nothing",
    ),
    "nanolab/estimator/measure_trainer.py": (
        "tests/test_gpu_twins.py::test_the_gpu_memory_measure_runs_its_fit_on_a_cpu_stand_in",
        "tests/test_gpu_check.py::test_the_dry_run_takes_every_check_s_code_path_on_this_cpu",
    ),
    "nanolab/data/datamodule.py": (
        "tests/test_gpu_twins.py::test_the_loaders_a_cuda_run_builds_pin",
    ),
    "nanolab/training/masked_targets.py": (  # a y already on a device is not read: a meta one
        "tests/test_masked_loss.py::test_masks_a_data_module_did_not_declare_are_found_on_the_host_and_said_once",
    ),
    "benches/gpu_check.py": (
        "tests/test_gpu_check.py::test_the_dry_run_takes_every_check_s_code_path_on_this_cpu",
        "tests/test_gpu_check.py::test_on_a_gpu_the_timings_wait_for_the_device_and_the_machine_names_its_gpu",
        "tests/test_gpu_check.py::test_the_flex_check_s_gradient_difference_is_zero_for_one_kernel_and_not_for_another",
    ),
    "benches/bench_memory.py": (
        "tests/test_gpu_twins.py::test_the_gpu_memory_bench_measures_the_optimizer_it_predicts",
        "tests/test_gpu_check.py::test_the_dry_run_takes_every_check_s_code_path_on_this_cpu",
    ),
    "benches/gpu_pack.py": (
        "tests/test_gpu_check.py::test_the_dry_run_takes_every_check_s_code_path_on_this_cpu",
    ),
    "nanolab/queue/runner.py": (  # --pack --gpus: the backend and each GPU's memory, read
        "tests/test_queue_pack.py::test_a_packed_gpu_runner_reads_each_gpu_s_memory_in_a_child_that_sees_only_it",
        "tests/test_queue_pack.py::test_a_gpu_that_does_not_answer_refuses_the_run_in_one_line_and_leaves_no_runner_row",
        # --gpus --until: the name of the GPU a job added without a time is timed for
        "tests/test_queue_pack.py::test_until_times_a_job_queue_add_could_not_for_the_gpu_the_runner_gives_it",
        # --gpus: each job's masks
        "tests/test_queue_runner_cli.py::test_gpus_give_each_job_its_ids_and_until_defers_what_would_end_late",
    ),
    "nanolab/allocator.py": (  # expandable segments, not on a ROCm build (torch's version file)
        "tests/test_gpu_twins.py::test_the_cuda_allocator_gets_expandable_segments_unless_configured",
        "tests/test_gpu_twins.py::test_the_hip_version_is_read_without_importing_torch",
    ),
    "nanolab/training/strategies.py": (  # DeepSpeed on a CPU accelerator
        "tests/test_training.py::test_deepspeed_runs_on_cpu_and_matches",
        "tests/test_training.py::test_deepspeed_with_accumulation_divides_the_loss_once",
    ),
}

#: file -> why no CPU test runs its CUDA-only lines (device queries and readers with no CPU
#: equivalent); the code around them runs on a CPU in the suite.
NO_CPU_TWIN: dict[str, str] = {
    "nanolab/callbacks/clock.py": "torch.cuda.synchronize before reading the step clock",
    "nanolab/callbacks/devices.py": (
        "torch.cuda.get_device_name for the start record and the launch's setup"
    ),
    "nanolab/downstream/harness.py": "the default device when none is given",
    "nanolab/estimator/runtime.py": "the device name for the GPU table lookup",
    "nanolab/eval_tasks.py": "the default --device",
    "nanolab/generate.py": "the default --device",
    "nanolab/model/device.py": "the usable devices (CUDA, Apple's mps) named in --device's error",
    "nanolab/queue/cli.py": "torch.cuda.device_count for --gpus; a ROCm build's nested masks",
    "nanolab/queue/launch.py": "set_per_process_memory_fraction of a packed job",
    "nanolab/run/compose.py": "whether an accelerator: auto run lands on a GPU",
}

#: twinned file -> the part of its GPU-only code no CPU test can run, why, and what runs it.
NO_CPU_TWIN_PART: dict[str, str] = {
    "nanolab/model/gpt.py": (
        "FlexAttention's backward (training with attention: flex): torch has none on a CPU "
        "('FlexAttention does not support backward on CPU'), so a CPU run that needs gradients "
        "attends through the dense mask; benches/gpu_check.py's flex_mask runs it on a GPU and "
        "holds its gradient to the boolean mask's (max_grad_rel_diff, at most 0.02), and its "
        "flex_fit trains through it in fit, compiled, and resumes"
    ),
    "nanolab/bench/plain_loop.py": (
        "train_lightning on a CUDA device (nanolab bench --floor on a GPU): Lightning's CUDA "
        "accelerator (the Trainer's accelerator is the device's type), which a CPU-only torch "
        "cannot build, and the synchronize after its last "
        "step; the same bare-Trainer loop runs on a CPU in tests/test_bench.py, and train's "
        "own pinning and synchronize on a device it reads as cuda"
    ),
    "benches/gpu_check.py": (
        "check_flex_mask's backward through FlexAttention, which torch has not on a CPU: the "
        "gradient comparison it feeds (max_grad_rel_diff) runs on CPU kernels and its bound "
        "is judged in tests/test_gpu_check.py; check_flash's flash kernel, likewise GPU-only"
    ),
    "nanolab/training/strategies.py": (
        "DeepSpeedStrategy's GPU side: on any accelerator but the CPU's, setup_environment, "
        "_setup_model_and_optimizer, _initialize_deepspeed_inference and setup_distributed "
        "hand over to Lightning's own DeepSpeed strategy unchanged (super()); nanolab's code "
        "there is the CPU side, which the twins run"
    ),
}

#: file -> what it compares: a setting or a named target ("gpu"/"cpu" to estimate for, a job's
#: accelerator, DeepSpeed's offload device), the same on a CPU host as on a GPU one.
SETTING_NOT_DEVICE: dict[str, str] = {
    "nanolab/estimator/cli.py": (
        "the estimate's backend, named in its report, and the config's trainer.accelerator "
        "that picks it when --device is not given"
    ),
    "nanolab/estimator/compute.py": "the estimate's backend",
    "nanolab/estimator/estimate.py": "--device gpu/cpu and the estimate's backend",
    "nanolab/estimator/gpus.py": "the estimated device's vendor",
    "nanolab/estimator/history.py": "the devices a past run's log records",
    "nanolab/estimator/memory.py": "the estimate's backend, and its table of context bytes by backend",
    "nanolab/estimator/numerics.py": "the estimate's backend",
    "nanolab/queue/packing.py": "the label of the device a job is packed on",
    "nanolab/queue/predict.py": (
        "a job's trainer.accelerator setting, and the memory backend and context bytes it picks"
    ),
    "nanolab/estimator/cpu.py": "this machine's CPU described as the estimate's device",
    "nanolab/estimator/measure.py": "the device a saved-memory measurement is told to run on",
    "nanolab/estimator/recommend.py": "the estimate's backend",
    "nanolab/estimator/states.py": "the plan's CPU offload, as the estimate's note names it",
    "nanolab/estimator/trace.py": "the estimate's backend its CPU trace is held to",
    "nanolab/runs.py": (
        "the accelerator classes a past run's start records name (the hours column's label), "
        "not the device this process runs on"
    ),
    "benches/startup.py": "the CPU-seconds column of each command's timings; --device gpu",
    "benches/vs_nanogpt.py": "nanoGPT's train.py told device=cpu: the comparison is a CPU one",
    "benches/vs_nanogpt_model.py": (
        "the CPU-seconds column of its step timings, and nanoGPT's optimizer built for the "
        "CPU the comparison runs on"
    ),
}


#: file -> {scope: hits}: how many device branches each function (class, ``<module>``) of each
#: file has, as :func:`device_branches` counts them. A new one, in a listed file too, fails the
#: test with the entry to write here once it is twinned or listed with why.
BRANCHES: dict[str, dict[str, int]] = {
    "benches/bench_memory.py": {
        "cli_peak": 1,
        "device_memory": 2,
        "fit_config": 1,
        "main": 2,
        "measure_device_peak": 1,
        "rehearse_gpu_measure": 1,
        "run_cpu": 2,
        "run_gpu": 9,
        "run_zero_grad": 1,
    },
    "benches/gpu_check.py": {
        "<module>": 5,
        "check_flex_mask": 1,
        "check_pack": 1,
        "format_table": 1,
        "gpu_visible": 5,
        "machine": 7,
        "synchronize": 2,
    },
    "benches/gpu_pack.py": {"main": 6, "prepare_data": 1},
    "benches/startup.py": {"light_commands": 1, "main": 4},
    "benches/vs_nanogpt.py": {"nanogpt_command": 1},
    "benches/vs_nanogpt_model.py": {"main": 2, "optimizers": 1, "summary": 2, "time_steps": 2},
    "nanolab/allocator.py": {"torch_hip_version": 1},
    "nanolab/bench/harness.py": {"_machine": 3, "predicted_peak_bytes": 2},
    "nanolab/bench/plain_loop.py": {
        "build": 1,
        "main": 3,
        "train": 2,
        "train_lightning": 3,
        "trained_precision": 1,
    },
    "nanolab/callbacks/clock.py": {"RunClock.sync_device": 2},
    "nanolab/callbacks/devices.py": {"device_names": 3},
    "nanolab/callbacks/peak_flops.py": {"rocm_build": 1},
    "nanolab/callbacks/readout.py": {"StepReadout.transfer": 3},
    "nanolab/callbacks/syncs.py": {
        "SyncCounter._wrap_transfer.transfer": 1,
        "SyncCounter.install": 5,
        "_is_cpu": 2,
        "sync_count_callback.SyncCount.setup": 1,
    },
    "nanolab/callbacks/throughput.py": {
        "<module>": 4,
        "ThroughputMeter._memory": 3,
        "ThroughputMeter._prepare": 3,
        "ThroughputMeter.on_train_end": 1,
        "UtilizationSampler._amdsmi": 1,
        "UtilizationSampler._nvml": 1,
        "_bus_id": 1,
    },
    "nanolab/data/datamodule.py": {"pins_memory": 1},
    "nanolab/downstream/harness.py": {"NanolabLM.__init__": 6},
    "nanolab/estimator/cli.py": {
        "_peak_meter": 2,
        "build_parser": 2,
        "default_device": 3,
        "format_estimate": 2,
        "main": 2,
    },
    "nanolab/estimator/compute.py": {"estimate_compute": 1},
    "nanolab/estimator/cpu.py": {"_device": 3},
    "nanolab/estimator/estimate.py": {
        "Estimate.to_dict": 1,
        "_compile_note": 1,
        "_device": 7,
        "_follow_the_model": 3,
        "estimate_from_config": 8,
        "largest_fitting_micro_batch": 1,
    },
    "nanolab/estimator/gpus.py": {"matmul_rate": 1},
    "nanolab/estimator/history.py": {"ran_on": 1},
    "nanolab/estimator/measure.py": {"measure_saved": 1},
    "nanolab/estimator/measure_trainer.py": {
        "measure_trainer_peak_cpu": 1,
        "measure_trainer_peak_cuda": 2,
    },
    "nanolab/estimator/memory.py": {"<module>": 4, "estimate_memory": 2},
    "nanolab/estimator/numerics.py": {"<module>": 2, "numerics_for": 3},
    "nanolab/estimator/recommend.py": {
        "evaluate_switches": 1,
        "fits": 1,
        "largest_micro_batch": 1,
        "micro_batch_for_global": 1,
    },
    "nanolab/estimator/runtime.py": {"_gpu_name": 4, "run_seconds": 5},
    "nanolab/estimator/states.py": {"model_states": 2},
    "nanolab/estimator/trace.py": {"model_matches_rules.compare": 1},
    "nanolab/eval_tasks.py": {"main": 3},
    "nanolab/generate.py": {"main": 3},
    "nanolab/model/device.py": {"check_device": 5},
    "nanolab/model/gpt.py": {
        "CausalSelfAttention.attend_masked": 1,
        "GPT.forward": 1,
        "compiles_flex": 1,
    },
    "nanolab/queue/cli.py": {"check_gpus_visible": 4, "parse_gpus": 1, "visible_mask": 6},
    "nanolab/queue/launch.py": {"apply_memory_cap": 3},
    "nanolab/queue/packing.py": {"describe_start": 1},
    "nanolab/queue/predict.py": {"_memory_backend": 4, "process_overhead": 1},
    "nanolab/queue/runner.py": {
        "<module>": 2,
        "Runner._setup_pack": 3,
        "Runner._spawn": 3,
        "Runner.label": 1,
    },
    "nanolab/run/autobatch.py": {
        "check_fits_on_host": 1,
        "device_backend": 2,
        "gpu_memories": 1,
    },
    "nanolab/run/compose.py": {
        "apply_float32_matmul_precision": 2,
        "plan_micro_batch": 1,
        "runs_on_cpu": 3,
    },
    "nanolab/run/trainer_errors.py": {
        "bf16_unsupported": 2,
        "gpu_visible": 2,
        "missing_gpu": 3,
        "torch_build": 2,
    },
    "nanolab/runs.py": {"hours_label": 2},
    "nanolab/training/masked_targets.py": {"holds_masked_targets": 1},
    "nanolab/training/module.py": {
        "GPTLightningModule.on_fit_start": 1,
        "capture_rng_state": 2,
        "restore_rng_state": 2,
    },
    "nanolab/training/optim.py": {"build_adamw": 1, "build_muon": 1},
    "nanolab/training/resolve.py": {
        "_offloads_optimizer": 1,
        "count_devices": 2,
        "visible_gpus": 2,
    },
    "nanolab/training/strategies.py": {
        "<module>": 1,
        "DeepSpeedStrategy._initialize_deepspeed_inference": 1,
        "DeepSpeedStrategy._setup_model_and_optimizer": 1,
        "DeepSpeedStrategy.setup_distributed": 1,
        "DeepSpeedStrategy.setup_environment": 2,
        "offloads_optimizer": 1,
    },
}


def _files_with_device_branches() -> dict[str, list[tuple[int, str, str]]]:
    found = {}
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            if hits := device_branches(path.read_text()):
                found[str(path.relative_to(REPO))] = hits
    return found


def unpinned(
    found: dict[str, list[tuple[int, str, str]]], pinned: dict[str, dict[str, int]]
) -> list[str]:
    """Each file whose hits per scope differ from ``pinned``: its new ``BRANCHES`` entry, and
    the hits of each scope that changed (to review: twin them, or say why not)."""
    diffs = []
    for file in sorted(set(found) | set(pinned)):
        hits = found.get(file, [])
        counts: dict[str, int] = {}
        for _, _, scope in hits:
            counts[scope] = counts.get(scope, 0) + 1
        was = pinned.get(file, {})
        if counts != was:
            changed = sorted(k for k in set(counts) | set(was) if counts.get(k) != was.get(k))
            lines = [f"{line} {what} ({scope})" for line, what, scope in hits if scope in changed]
            diffs.append(f"{file!r}: {dict(sorted(counts.items()))!r}  # {'; '.join(lines)}")
    return diffs


def test_every_cuda_branch_is_twinned_or_listed():
    """Mutation caught: a new device branch, written any of the ways :data:`SNIPPETS` shows, in
    a file no list names (it shows up here with its lines), or in a listed one (a changed
    :data:`BRANCHES` count); a listed file that no longer branches (a stale entry)."""
    found = _files_with_device_branches()
    lists = (set(TWINS), set(NO_CPU_TWIN), set(SETTING_NOT_DEVICE))
    listed = set().union(*lists)
    assert sum(map(len, lists)) == len(listed), "a file in two lists"
    unlisted = {f"{f}:{line} {what}" for f in set(found) - listed for line, what, _ in found[f]}
    assert not unlisted, "device branches without a CPU twin: add a test to TWINS"
    assert listed - set(found) == set(), "listed files that no longer branch on the device"
    diffs = unpinned(found, BRANCHES)
    assert not diffs, "device branches changed: review each, then set BRANCHES:\n" + "\n".join(
        diffs
    )


def test_a_new_branch_in_a_twinned_file_is_a_failing_diff():
    """A branch appended to a function of a twinned file (training/module.py) changes its pin,
    where comparing whole files would let it through."""
    file = "nanolab/training/module.py"
    source = (REPO / file).read_text()
    added = (
        "\n\ndef free_memory():\n    if torch.cuda.is_available():\n"
        "        return torch.cuda.mem_get_info()\n"
    )
    assert unpinned({file: device_branches(source)}, {file: BRANCHES[file]}) == []
    diffs = unpinned({file: device_branches(source + added)}, {file: BRANCHES[file]})
    assert len(diffs) == 1 and "'free_memory': 2" in diffs[0], diffs
    assert "torch.cuda.is_available (free_memory)" in diffs[0], diffs


def test_a_part_without_a_twin_is_of_a_twinned_file():
    """A file whose only device code has no twin belongs in NO_CPU_TWIN instead."""
    assert set(NO_CPU_TWIN_PART) <= set(TWINS)


#: Ways of writing a device branch the scan must see (each is one hit or more).
SNIPPETS = [
    "import torch.cuda as tc\nn = tc.device_count()",
    "from torch import cuda\nok = cuda.is_available()",
    "from torch.cuda import is_available",
    'if "cuda" in str(d): pass',
    'if device.type != "cpu": pass',
    'if "cuda" == x.device.type: pass',
    'if getattr(d, "type", None) == "cuda": pass',
    'if str(d).startswith("cuda"): pass',
    'if x.device.type in ("cuda", "mps"): pass',
    'if x.device.type not in ["hip"]: pass',
    "n = torch.accelerator.device_count()",
    "torch.backends.cuda.matmul.allow_tf32 = True",
    "m = torch.get_device_module(d)",
    "if torch.version.hip: pass",
    "if torch.version.cuda is None: pass",
    "ok = torch.backends.mps.is_available()",
    "torch.backends.cudnn.benchmark = True",
    "torch.mps.synchronize()",
    "n = torch.xpu.device_count()",
    "from torch.backends import mps\nok = mps.is_built()",
    'subprocess.run([sys.executable, "-c", "import torch; print(torch.version.cuda)"])',
    "if x.is_cuda: pass",
    "import torch as t\nt.cuda.synchronize()",
    "def f(cuda=torch.cuda): pass",
    'if getattr(torch.version, "hip", None): pass',
    'cuda = getattr(torch, "cuda")',
    'n = hasattr(torch.backends, "cuda")',
    'subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"])',
    'if trainer.accelerator == "gpu": pass',
    "if isinstance(acc, CUDAAccelerator): pass",
    "from lightning.pytorch.accelerators import CUDAAccelerator",
    "from torch import version\nif version.hip: pass",
    'match device.type:\n    case "cuda": pass',
    'match kind:\n    case "cpu" | "mps": pass',
    "import pynvml",
    "import amdsmi as smi",
    "from pynvml import nvmlInit",
    "from lightning.pytorch.accelerators import CPUAccelerator\nok = isinstance(a, CPUAccelerator)",
    "if isinstance(acc, MPSAccelerator): pass",
    "if isinstance(acc, XLAAccelerator): pass",
    "if not x.is_cpu: pass",
    "if d.is_mps: pass",
    "if x.get_device() >= 0: pass",
    "from lightning.fabric.accelerators.cuda import num_cuda_devices",
    "from lightning.pytorch.accelerators.cuda import CUDAAccelerator as A",
    'm = importlib.import_module("torch.cuda")',
    'm = __import__("torch.backends.mps")',
    'if "CUDA_VISIBLE_DEVICES" in os.environ: pass',
    'mask = os.environ.get("ROCR_VISIBLE_DEVICES")',
    'subprocess.run(["nvidia-smi", "--query-gpu=memory.used"])',
    'subprocess.run("rocm-smi --showmeminfo vram", shell=True)',
    'subprocess.run(["amd-smi", "list"])',
    'if dist.get_backend() == "nccl": pass',
    'CUDA = "cuda"\nif x.device.type == CUDA: pass',
    'y = {"cuda": a, "cpu": b}[x.device.type]()',
    'if x.device.type == "xpu": pass',
    'if x.device.type in ("xla",): pass',
    'if type(t.accelerator).__name__ == "CUDAAccelerator": pass',
    'def f(x, name="cuda"):\n    return x.device.type == name',
    'on = is_on(x, "cuda")',
    "if x.device.index is not None: pass",
    "i = trainer.strategy.root_device.index",
    "n = torch._C._cuda_getDeviceCount()",
    "from torch._C import _cuda_getDeviceCount",
    'n = getattr(torch._C, "_cuda_getDeviceCount")()',
    "if torch.get_default_device().type == d: pass",
    "from torch import get_default_device\nd = get_default_device()",
    "torch.set_default_device(device)",
    'subprocess.run([sys.executable, "-c", "import torch; print(torch.get_default_device())"])',
    "m = getattr(torch, x.device.type)",
    "trainer = L.Trainer(accelerator=device.type, devices=1)",
    "backend = pick_backend(trainer.strategy.root_device.type)",
]


@pytest.mark.parametrize("snippet", SNIPPETS)
def test_the_scan_sees_each_way_of_writing_a_device_branch(snippet):
    assert device_branches(snippet), snippet


def test_the_scan_leaves_code_that_only_uses_a_device():
    """Moving a tensor or naming the device it goes to (``torch.device("cuda")``,
    ``.to("cpu")``, ``map_location="cpu"``) is not a branch; nor is a name that merely contains
    "cuda", nor a message saying it, nor a list's ``.index``, nor torch's private bindings
    that are not a device's, nor a logger named after Lightning's CUDA module."""
    plain = (
        'x = x.to(device)\nd = torch.device("cuda")\ncuda_ok = 1\nprint("no cuda here")\n'
        'x = x.to("cpu")\ns = torch.load(p, map_location="cpu")\nwith torch.autocast("cpu"): pass\n'
        'g = torch.Generator(device="cpu")\ni = names.index(n)\nx = torch._C._get_tracing_state()\n'
        'def f():\n    """Reads torch.cuda.max_memory_allocated()."""\n'
        "import torch.nn as nn\nimport os.path\nfrom torch import nn as cuda_layers\n"
        'NOISY = ("lightning.pytorch.accelerators.cuda",)\nprint("set CUDA_VISIBLES")\n'
        "with torch.autocast(x.device.type): pass\ny = torch.zeros(2, device=x.device.type)\n"
        'print(f"on {x.device.type}")\ns = torch.amp.GradScaler(d.type)\nt = z.type(torch.int64)'
    )
    assert device_branches(plain) == []


def test_the_scan_names_the_function_each_branch_is_in():
    source = (
        "import torch\nclass A:\n    def f(self):\n        return torch.cuda.is_available()\n"
        "def g():\n    def inner():\n        return x.is_cuda\nOK = torch.cuda.is_available()"
    )
    scopes = [scope for _, _, scope in device_branches(source)]
    assert scopes == ["A.f", "g.inner", "<module>"]


def test_every_named_twin_exists():
    for twins in TWINS.values():
        for twin in twins:
            file, name = twin.split("::")
            assert re.search(rf"^def {name}\(", (REPO / file).read_text(), re.M), twin


def _table_paths() -> set[str]:
    """The files and folders docs/architecture.md's "GPU-only branches" table names in its
    first column, as paths from the repository's root (a folder ends in ``/``)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## GPU-only branches", 1)[1].split("\n## ", 1)[0]
    paths = set()
    for row in re.findall(r"^\|([^|\n]*)\|", section, re.M):
        for name in re.findall(r"`([\w/.]+)`", row):
            if name.endswith((".py", "/")):
                paths.add(name if name.startswith("benches/") else f"nanolab/{name}")
    return paths


def test_the_architecture_table_names_the_twinned_files():
    """One list: each file of :data:`TWINS` is a row of the docs' table (itself or its folder),
    and each file or folder the table names is real and listed here."""
    named = _table_paths()
    assert named, "the table was not found"
    listed = set(TWINS) | set(NO_CPU_TWIN) | set(SETTING_NOT_DEVICE)

    def covers(path: str, file: str) -> bool:
        return file == path or (path.endswith("/") and file.startswith(path))

    missing = {f for f in TWINS if not any(covers(p, f) for p in named)}
    assert not missing, "twinned files the table does not name"
    stale = {p for p in named if not any(covers(p, f) for f in listed)}
    assert not stale, "the table names files no list here has"
