"""Every place nanolab's code branches on the device has a CPU twin, or is listed as having none.

The rule (docs/architecture.md, "GPU-only branches"): no code runs for the first time on a GPU.
This test parses every module of ``nanolab/`` and ``benches/`` and finds each way of asking
about the device (:class:`DeviceBranches`): a comparison or ``in`` test against ``"cuda"``,
``"cpu"``, ``"hip"`` or ``"mps"`` (either side, or in a tuple), ``.startswith("cuda")``,
``.is_cuda``, anything reached through ``torch.cuda``, ``torch.backends.cuda``,
``torch.accelerator``, ``torch.get_device_module`` or ``torch.version.hip``, and ``torch.cuda``
imported under any name. A file with such a hit must be in :data:`TWINS` (a test that runs the
same code on a CPU, by forcing the setting or through a seam), :data:`NO_CPU_TWIN` (with why) or
:data:`SETTING_NOT_DEVICE` (the string compared is a setting or a named target, not the device
this process runs on). A stale entry fails too, and every named twin must exist. A twinned
file's part that no CPU can run is named, with why, in :data:`NO_CPU_TWIN_PART`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("nanolab", "benches")
DEVICE_NAMES = frozenset({"cuda", "cpu", "hip", "mps"})
DEVICE_MODULES = (
    "torch.cuda",
    "torch.backends.cuda",
    "torch.accelerator",
    "torch.get_device_module",
    "torch.version.hip",
)


def _names_a_device(node: ast.AST) -> bool:
    """A string constant ``"cuda"``/``"cpu"``/``"hip"``/``"mps"`` (or ``"cuda:1"``), or a
    tuple, list or set holding one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split(":")[0] in DEVICE_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_device(e) for e in node.elts)
    return False


class DeviceBranches(ast.NodeVisitor):
    """The lines of one module that ask which device the code runs on, as ``(line, what)``."""

    def __init__(self) -> None:
        self.torch = {"torch"}  # names torch is imported as
        self.modules: set[str] = set()  # names a device module is imported as
        self.hits: list[tuple[int, str]] = []

    def _hit(self, node: ast.AST, what: str) -> None:
        self.hits.append((getattr(node, "lineno", 0), what))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == "torch" and alias.asname:
                self.torch.add(alias.asname)
            if alias.name.startswith(DEVICE_MODULES):
                self._hit(node, f"import {alias.name}")
                if alias.asname:
                    self.modules.add(alias.asname)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            full = f"{node.module}.{alias.name}"
            if full.startswith(DEVICE_MODULES) or str(node.module).startswith(DEVICE_MODULES):
                self._hit(node, f"from {node.module} import {alias.name}")
                self.modules.add(alias.asname or alias.name)

    def _dotted(self, node: ast.AST) -> str | None:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        root = "torch" if node.id in self.torch else node.id
        return ".".join([root, *reversed(parts)])

    def visit_Attribute(self, node: ast.Attribute) -> None:
        dotted = self._dotted(node)
        if node.attr == "is_cuda":
            self._hit(node, ".is_cuda")
        elif dotted and (dotted.startswith(DEVICE_MODULES) or dotted.split(".")[0] in self.modules):
            self._hit(node, dotted)
            return  # the chain's inner attributes are the same use
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in self.modules:
            self._hit(node, node.id)

    def visit_Compare(self, node: ast.Compare) -> None:
        if any(_names_a_device(side) for side in (node.left, *node.comparators)):
            self._hit(node, "a comparison with a device name")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        prefix = isinstance(func, ast.Attribute) and func.attr in ("startswith", "endswith")
        if prefix and node.args and _names_a_device(node.args[0]):
            self._hit(node, f".{func.attr}(a device name)")
        self.generic_visit(node)


def device_branches(source: str) -> list[tuple[int, str]]:
    """Where ``source`` asks about the device: ``(line, what)`` per use."""
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
    ),
    "nanolab/training/resolve.py": ("tests/test_resolve.py::test_one_device_counter",),
    "nanolab/run/autobatch.py": (
        "tests/test_autobatch.py::test_auto_picks_the_largest_fitting_divisor_of_the_global_batch",
    ),
    "nanolab/bench/harness.py": (
        "tests/test_gpu_twins.py::test_the_bench_predicts_a_gpu_run_s_peak_at_the_micro_batch_it_ran",
        "tests/test_gpu_check.py::test_the_dry_run_takes_every_check_s_code_path_on_this_cpu",
    ),
    "nanolab/callbacks/readout.py": (
        "tests/test_syncs.py::test_the_readout_defers_a_copy_nobody_waits_for",
        "tests/test_syncs.py::test_a_run_log_written_a_step_late_holds_the_same_records_in_the_same_order",
    ),
    "nanolab/callbacks/throughput.py": (
        "tests/test_gpu_twins.py::test_a_cuda_run_s_meter_names_its_gpu_and_gathers_every_rank_s_peak_memory",
    ),
    "nanolab/callbacks/syncs.py": (
        "tests/test_syncs.py::test_the_counter_counts_what_waits_and_once_per_transfer",
    ),
    "nanolab/bench/plain_loop.py": (
        "tests/test_gpu_check.py::test_the_dry_run_takes_every_check_s_code_path_on_this_cpu",
    ),
    "nanolab/run/trainer_errors.py": (
        "tests/test_trainer_refusals.py::test_a_setting_the_trainer_refuses_is_one_line_and_writes_nothing",
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
    ),
    "benches/bench_memory.py": (
        "tests/test_gpu_twins.py::test_the_gpu_memory_bench_measures_the_optimizer_it_predicts",
        "tests/test_gpu_check.py::test_the_dry_run_takes_every_check_s_code_path_on_this_cpu",
    ),
    "benches/gpu_pack.py": (
        "tests/test_gpu_check.py::test_the_dry_run_takes_every_check_s_code_path_on_this_cpu",
    ),
}

#: file -> why no CPU test runs its CUDA-only lines (device queries and readers with no CPU
#: equivalent); the code around them runs on a CPU in the suite.
NO_CPU_TWIN: dict[str, str] = {
    "nanolab/callbacks/clock.py": "torch.cuda.synchronize before reading the step clock",
    "nanolab/callbacks/jsonl.py": "torch.cuda.get_device_name for the start record",
    "nanolab/downstream/harness.py": "the default device when none is given",
    "nanolab/estimator/runtime.py": "the device name for the GPU table lookup",
    "nanolab/eval_tasks.py": "the default --device",
    "nanolab/generate.py": "the default --device",
    "nanolab/model/device.py": "the usable devices named in --device's error",
    "nanolab/queue/cli.py": "torch.cuda.device_count for --gpus",
    "nanolab/queue/launch.py": "set_per_process_memory_fraction of a packed job",
    "nanolab/run/compose.py": "whether an accelerator: auto run lands on a GPU",
}

#: twinned file -> the part of its GPU-only code no CPU test can run, why, and what runs it.
NO_CPU_TWIN_PART: dict[str, str] = {
    "nanolab/model/gpt.py": (
        "FlexAttention's backward (training with attention: flex): torch has none on a CPU "
        "('FlexAttention does not support backward on CPU'), so a CPU run that needs gradients "
        "attends through the dense mask; benches/gpu_check.py's flex_mask runs it on a GPU and "
        "records its gradient's difference from the boolean mask's (max_grad_diff), and its "
        "flex_fit trains through it in fit, compiled, and resumes"
    ),
}

#: file -> what it compares: a setting or a named target ("gpu"/"cpu" to estimate for, a job's
#: accelerator, DeepSpeed's offload device), the same on a CPU host as on a GPU one.
SETTING_NOT_DEVICE: dict[str, str] = {
    "nanolab/estimator/cli.py": "the estimate's backend, named in its report",
    "nanolab/estimator/compute.py": "the estimate's backend",
    "nanolab/estimator/estimate.py": "--device gpu/cpu and the estimate's backend",
    "nanolab/estimator/gpus.py": "the estimated device's vendor",
    "nanolab/estimator/history.py": "the devices a past run's log records",
    "nanolab/estimator/memory.py": "the estimate's backend",
    "nanolab/estimator/numerics.py": "the estimate's backend",
    "nanolab/queue/packing.py": "the label of the device a job is packed on",
    "nanolab/queue/predict.py": "a job's trainer.accelerator setting",
    "nanolab/training/strategies.py": "DeepSpeed's offload_optimizer.device setting",
}


def _files_with_device_branches() -> dict[str, list[tuple[int, str]]]:
    found = {}
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            if hits := device_branches(path.read_text()):
                found[str(path.relative_to(REPO))] = hits
    return found


def test_every_cuda_branch_is_twinned_or_listed():
    """Mutation caught: a new device branch, written any of the ways :data:`SNIPPETS` shows, in
    a file no list names (it shows up here with its lines); a listed file that no longer
    branches (a stale entry)."""
    found = _files_with_device_branches()
    lists = (set(TWINS), set(NO_CPU_TWIN), set(SETTING_NOT_DEVICE))
    listed = set().union(*lists)
    assert sum(map(len, lists)) == len(listed), "a file in two lists"
    unlisted = {f"{f}:{line} {what}" for f in set(found) - listed for line, what in found[f]}
    assert not unlisted, "device branches without a CPU twin: add a test to TWINS"
    assert listed - set(found) == set(), "listed files that no longer branch on the device"


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
    "if x.is_cuda: pass",
    "import torch as t\nt.cuda.synchronize()",
    "def f(cuda=torch.cuda): pass",
]


@pytest.mark.parametrize("snippet", SNIPPETS)
def test_the_scan_sees_each_way_of_writing_a_device_branch(snippet):
    assert device_branches(snippet), snippet


def test_the_scan_leaves_code_that_only_uses_a_device():
    """Moving a tensor or naming a device is not a branch; nor is a name that merely contains
    "cuda", nor a message saying it."""
    plain = 'x = x.to(device)\nd = torch.device("cuda")\ncuda_ok = 1\nprint("no cuda here")'
    assert device_branches(plain) == []


def test_every_named_twin_exists():
    for twins in TWINS.values():
        for twin in twins:
            file, name = twin.split("::")
            assert re.search(rf"^def {name}\(", (REPO / file).read_text(), re.M), twin
