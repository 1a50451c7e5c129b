"""Every place nanolab's code branches on CUDA has a CPU twin, or is listed as having none.

The rule (docs/architecture.md, "GPU-only branches"): no code runs for the first time on a GPU.
This test reads the code of ``nanolab/`` (strings and comments left out) for the ways it asks
about CUDA and fails on a file that does but is not in :data:`TWINS` (a test that runs the same
code on a CPU, by forcing the setting or through a seam) or :data:`NO_CPU_TWIN` (with why). A
stale entry fails too, and every named twin must exist.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CUDA_CODE = re.compile(
    r"torch\.cuda\b|\.type\s*==\s*[\"']cuda[\"']|\.is_cuda\b|torch\.version\.hip"
)

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
    ),
    "nanolab/training/resolve.py": ("tests/test_resolve.py::test_one_device_counter",),
    "nanolab/run/autobatch.py": (
        "tests/test_autobatch.py::test_auto_picks_the_largest_fitting_divisor_of_the_global_batch",
    ),
    "nanolab/bench/harness.py": (
        "tests/test_gpu_check.py::test_the_dry_run_takes_every_check_s_code_path_on_this_cpu",
    ),
    "nanolab/callbacks/readout.py": (
        "tests/test_syncs.py::test_the_readout_defers_a_copy_nobody_waits_for",
        "tests/test_syncs.py::test_a_run_log_written_a_step_late_holds_the_same_records_in_the_same_order",
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
        "tests/test_gpu_check.py::test_the_dry_run_takes_every_check_s_code_path_on_this_cpu",
    ),
}

#: file -> why no CPU test runs its CUDA-only lines (device queries and readers with no CPU
#: equivalent); the code around them runs on a CPU in the suite.
NO_CPU_TWIN: dict[str, str] = {
    "nanolab/callbacks/clock.py": "torch.cuda.synchronize before reading the step clock",
    "nanolab/callbacks/jsonl.py": "torch.cuda.get_device_name for the start record",
    "nanolab/callbacks/throughput.py": "max_memory_allocated/reserved and the device's name",
    "nanolab/downstream/harness.py": "the default device when none is given",
    "nanolab/estimator/runtime.py": "the device name for the GPU table lookup",
    "nanolab/eval_tasks.py": "the default --device",
    "nanolab/generate.py": "the default --device",
    "nanolab/model/device.py": "the usable devices named in --device's error",
    "nanolab/queue/cli.py": "torch.cuda.device_count for --gpus",
    "nanolab/queue/launch.py": "set_per_process_memory_fraction of a packed job",
    "nanolab/run/compose.py": "whether an accelerator: auto run lands on a GPU",
}


def _code_only(path: Path) -> str:
    """The file's code with its comments and its strings (docstrings, messages) left out; a
    short literal such as ``"cuda"`` is code and stays."""
    kept = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        long_string = tok.type == tokenize.STRING and len(tok.string) > 8
        if tok.type != tokenize.COMMENT and not long_string:
            kept.append(tok.string)
    return " ".join(kept).replace(" . ", ".").replace(" .", ".").replace(". ", ".")


def _files_with_cuda_branches() -> set[str]:
    found = set()
    for path in sorted((REPO / "nanolab").rglob("*.py")):
        if CUDA_CODE.search(_code_only(path)):
            found.add(str(path.relative_to(REPO)))
    return found


def test_every_cuda_branch_is_twinned_or_listed():
    """Mutation caught: a new ``if x.device.type == "cuda":`` in any module (the file shows up
    here, unlisted); a listed file that no longer branches (a stale entry)."""
    found = _files_with_cuda_branches()
    listed = set(TWINS) | set(NO_CPU_TWIN)
    assert not set(TWINS) & set(NO_CPU_TWIN)
    assert found - listed == set(), "CUDA branches without a CPU twin: add a test to TWINS"
    assert listed - found == set(), "listed files that no longer branch on CUDA"


def test_every_named_twin_exists():
    for twins in TWINS.values():
        for twin in twins:
            file, name = twin.split("::")
            assert re.search(rf"^def {name}\(", (REPO / file).read_text(), re.M), twin
