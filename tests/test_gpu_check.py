"""``benches/gpu_check.sh``: the parts that run without a GPU (its checks need one).

Without a GPU the script must stop at once with one error line and exit code 2, and leave a
summary saying so; with one, it selects checks, gives each its time, and writes one JSON summary
and a table. The selection, the time split, the summary and the table are tested here on results
built in the test; the crash path runs for real (a GPU check on this CPU-only torch crashes).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import redirect_stdout
from functools import partial
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benches" / "gpu_check.sh"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benches" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gc = _load("gpu_check")


def _sh(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, **env}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=full, capture_output=True, text=True, timeout=120
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_stops_at_once_with_one_line_and_a_summary(tmp_path):
    proc = _sh(tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA/ROCm GPU visible" in lines[0], proc.stderr
    summary = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert summary["status"] == "no_gpu" and summary["checks"] == []
    assert "sees no GPU" in summary["note"] and summary["torch"] == torch.__version__
    table = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "status no_gpu" in table and "note: torch" in table
    assert not list((tmp_path / "out").glob(".*.tmp"))  # written atomically


@pytest.mark.parametrize(("value", "says"), [("abc", "whole seconds"), ("30", "too short")])
def test_a_bad_time_limit_is_one_line(tmp_path, value, says):
    proc = _sh(tmp_path, GPU_CHECK_TIMEOUT=value)
    assert proc.returncode == 2 and says in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()  # refused before anything ran


def test_selection_keeps_the_order_and_names_unknown_checks():
    assert [c.name for c in gc.select("pack,flash", None)] == ["flash", "pack"]
    every = [c.name for c in gc.CHECKS]
    assert [c.name for c in gc.select(None, "pack")] == [n for n in every if n != "pack"]
    assert [c.name for c in gc.select(None, None)] == every
    with pytest.raises(ValueError, match=r"--only: unknown check nope; one of flash, "):
        gc.select("flash,nope", None)


def test_list_prints_each_check_with_its_cap(capsys):
    assert gc.main(["--list", "--only", "flash,memory_eager"]) == 0
    out = capsys.readouterr().out.splitlines()
    caps = gc.BY_NAME["flash"].cap_s, gc.BY_NAME["memory_eager"].cap_s
    assert out[0].split()[:3] == ["flash", str(caps[0]), "s"]
    assert out[1].split()[:3] == ["memory_eager", str(caps[1]), "s"]
    assert out[2].startswith("total cap") and f"{sum(caps)} s" in out[2]


def test_the_dry_run_has_its_own_caps(capsys):
    """The dry run gives each check 3 times its H200 cap (and 3 times the deadline): a loaded
    2-core CPU took 50 s over memory_eager's tiny sizes, which its 70 s H200 cap read as a
    timeout once the load rose. A hang still ends at a cap. Mutation caught: the dry run on
    the H200's caps."""
    eager = gc.BY_NAME["memory_eager"]
    assert gc.time_for(eager, 1000, gc.DRY) == 3 * eager.cap_s == 210
    assert gc.time_for(eager, 1000) == eager.cap_s  # a GPU run keeps the H200's
    assert gc.main(["--list", "--dry-run", "--only", "memory_eager"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["memory_eager", "210", "s"]
    assert out[1].endswith("(--deadline 2070 s)")


@pytest.mark.parametrize(
    ("argv", "says"),
    [(["--only", "nope"], "unknown check nope"), (["--deadline", "0"], "--deadline must be")],
)
def test_bad_arguments_are_one_line(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        gc.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and says in err[0]


def test_each_check_gets_its_cap_or_what_is_left(tmp_path):
    flash = gc.BY_NAME["flash"]
    assert gc.time_for(flash, 1000) == flash.cap_s and gc.time_for(flash, 12.5) == 12.5
    assert gc.time_for(flash, -3) == 0
    result = gc.run_check(flash, tmp_path, None, tmp_path, limit_s=2)
    assert (result.status, result.note) == ("not_run", "no time left before the deadline")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the check would pass on a GPU")
def test_a_check_that_crashes_is_recorded_with_its_log(tmp_path):
    """The flash check on a CPU-only torch dies inside torch (no result file): recorded as a
    failure with the log's last line, and the driver goes on."""
    logs = tmp_path / "logs"
    logs.mkdir()
    result = gc.run_check(gc.BY_NAME["flash"], tmp_path, None, logs, limit_s=120)
    assert result.status == "fail" and result.note.startswith("crashed (exit 1)")
    assert Path(result.log).read_text().strip(), "the child's traceback is kept"


def _results():
    bench = {
        "nanolab_tokens_per_s": 412345.6, "plain_tokens_per_s": 415000.0,
        "ratio_nanolab_over_plain": 0.9936, "mfu": 0.412, "peak_measured_gib": 21.5,
        "peak_predicted_gib": 22.1,
    }  # fmt: skip
    return [
        gc.Result("flash", "ok", 3.2, {"fwd_bwd_ms": 1.234, "max_out_diff": 0.0039}),
        gc.Result("bench_124m", "ok", 150.0, bench, log="/x/bench_124m.log"),
        gc.Result("memory_eager", "fail", 40.0, {"rows": [{}] * 4, "worst_error": 0.153}, "x"),
        gc.Result("async_checkpoint", "timeout", 100.0, note="stopped after 100 s"),
        gc.Result("pack", "skipped", 0.1, note="benches/gpu_pack.py is not in this tree"),
        gc.Result("micro_batch_auto", "not_run", note="no time left before the deadline"),
    ]


def test_summary_json_and_table(tmp_path):
    meta = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.9.1", "nanolab_commit": "abc1234"}
    res = gc.summary(meta, _results(), started=0.0)
    assert res["status"] == "fail"  # a failure and a timeout
    assert res["counts"] == {
        "ok": 2, "fail": 1, "timeout": 1, "stopped": 0, "skipped": 1, "not_run": 1,
    }  # fmt: skip
    assert [c["name"] for c in res["checks"]][:2] == ["flash", "bench_124m"]
    assert set(res["checks"][0]) == {"name", "status", "seconds", "metrics", "note", "log"}
    gc.write_summary(tmp_path, res)
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == res
    table = (tmp_path / "gpu_check.md").read_text().splitlines()
    assert table[0].startswith("nanolab GPU check: NVIDIA H100 80GB HBM3, torch 2.9.1")
    rows = [line for line in table if line.startswith("| ") and "---" not in line][1:]
    assert [r.split(" | ")[0:2] for r in rows] == [
        ["| flash", "ok"], ["| bench_124m", "ok"], ["| memory_eager", "fail"],
        ["| async_checkpoint", "timeout"], ["| pack", "skipped"], ["| micro_batch_auto", "not_run"],
    ]  # fmt: skip
    assert "412,346 tok/s (plain 415,000)" in rows[1] and "MFU 0.412" in rows[1]
    assert "peak 21.50 vs 22.10 GiB" in rows[1]
    assert "worst error 15.3%" in rows[2] and rows[3].endswith("stopped after 100 s |")
    assert not list(tmp_path.glob(".*.tmp"))
    ok = gc.summary(meta, [r for r in _results() if r.status in ("ok", "skipped")], 0.0)
    assert ok["status"] == "ok"


def test_the_flex_check_s_gradient_difference_is_zero_for_one_kernel_and_not_for_another():
    """``max_grad_rel_diff``, which the GPU's flex check runs on FlexAttention's backward (a CPU
    has none), on kernels a CPU has: SDPA against the boolean causal mask (the same gradient:
    0) and against the mask without its window (0.17 of the largest gradient in fp32, 0.38 in
    bf16, the figures :data:`FLEX_GRAD_LIMIT` cites). Its table cell too: a figure on a GPU,
    "-" where none was measured (the dry run)."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    for dtype, missed_window in ((torch.float32, 0.17), (torch.bfloat16, 0.38)):
        q, k, v = (
            torch.randn(2, 2, 128, 16, generator=g).to(dtype).requires_grad_() for _ in range(3)
        )
        causal = torch.ones(128, 128, dtype=torch.bool).tril()
        window = causal & ~torch.ones(128, 128, dtype=torch.bool).tril(-64)
        attend = partial(F.scaled_dot_product_attention, q, k, v)
        by_kernel = partial(attend, is_causal=True)
        by_mask, windowed = partial(attend, attn_mask=causal), partial(attend, attn_mask=window)
        assert gc.max_grad_rel_diff(by_kernel, by_mask, q) < 1e-5
        wrong = gc.max_grad_rel_diff(by_kernel, windowed, q)
        assert wrong == pytest.approx(missed_window, abs=0.01) and wrong > gc.FLEX_GRAD_LIMIT
    assert "gradient 2.0e-03 relative" in gc._headline("flex_mask", {"max_grad_rel_diff": 2e-3})
    assert "gradient -" in gc._headline("flex_mask", {"max_out_diff": 1e-3})


@pytest.mark.parametrize(
    ("results", "says"),
    [
        ({"backward": True, "max_out_diff": 1e-3, "max_grad_rel_diff": 4e-3}, None),
        ({"backward": False, "max_out_diff": 1e-3}, None),  # the dry run: no backward on a CPU
        ({"backward": True, "max_out_diff": 1e-3, "max_grad_rel_diff": 0.17}, "in gradient"),
        ({"backward": True, "max_out_diff": 1e-3}, "no gradient difference recorded"),
        ({"backward": True, "max_out_diff": 0.05, "max_grad_rel_diff": 0.0}, "in output"),
    ],
)
def test_the_flex_check_holds_its_gradient_to_a_bound(results, says):
    """Mutation caught: a gradient difference past :data:`FLEX_GRAD_LIMIT` (a mask that missed
    its window: 0.17) was recorded and passed."""
    if says is None:
        gc.judge_flex_mask(results)
        return
    with pytest.raises(gc.CheckFailed, match=says) as err:
        gc.judge_flex_mask(results)
    assert err.value.args[1] is results  # the figures go with the failure


def test_the_flash_check_fails_when_flash_s_gradient_is_off(monkeypatch, tmp_path):
    """``check_flash`` as the dry run runs it (this CPU's flash kernel against the math one, bf16,
    tiny shape): a backward that agrees passes (0.003 of the largest gradient here, about one
    bf16 rounding), and one whose gradient for ``q`` is 5% off fails, its figures in the
    failure. Mutation caught: ``max_grad_diff`` recorded without a bound (any gradient passed;
    an absolute one is ~1e-8 at 124M's shape)."""
    import torch.nn.functional as F

    monkeypatch.setattr(gc, "SCALE", gc.DRY)
    good = gc.check_flash(tmp_path, None)
    assert 0 <= good["max_grad_rel_diff"] < gc.FLASH_GRAD_LIMIT == 0.02
    assert good["max_out_diff"] <= gc.FLASH_OUT_LIMIT
    assert "gradient 3.0e-03 relative" in gc._headline("flash", {**good, "max_grad_rel_diff": 3e-3})
    sdpa = F.scaled_dot_product_attention

    def flash_off_by_5_percent(q, *args, **kwargs):
        if not torch.backends.cuda.math_sdp_enabled():  # inside sdpa_kernel(FLASH_ATTENTION)
            q = q.view_as(q)
            q.register_hook(lambda grad: grad * 1.05)
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", flash_off_by_5_percent)
    with pytest.raises(gc.CheckFailed, match=r"differ by 0.0\d+ in gradient.*limit 0.02") as err:
        gc.check_flash(tmp_path, None)
    assert err.value.args[1]["max_out_diff"] == good["max_out_diff"]  # the output is unchanged
    with pytest.raises(gc.CheckFailed, match="no gradient difference recorded"):
        gc.judge_flash({"max_out_diff": 1e-3})
    with pytest.raises(gc.CheckFailed, match="in output"):
        gc.judge_flash({"max_out_diff": 0.05, "max_grad_rel_diff": 0.0})


def _bench(**changed):
    """``bench_124m``'s metrics as a GPU run gives them (the H200's gap), with ``changed``."""
    return {
        "mfu": 0.391, "loss_gap_max": 0.011, "loss_gap_steps": 60, "loss_gap_limit": 0.05,
        "peak_measured_gib": 21.5, "peak_predicted_gib": 21.6, "peak_error": 0.005, **changed,
    }  # fmt: skip


def test_the_bench_check_fails_when_its_two_sides_did_not_train_the_same_model(monkeypatch):
    """Both sides of ``bench_124m`` train from the same seed on the same windows: a loss gap past
    the device's bound, or no step compared, fails the check, and a GPU run without MFU fails
    (the dry run's reads "n/a on CPU"). Mutation caught: the plain side's learning rate x100
    (a gap of 0.059 after the dry run's 3 steps, 0.0 unmutated) and ``mfu: None`` passed."""
    assert gc.loss_gap_limit() == gc.LOSS_GAP_LIMIT["cuda"] == 0.05
    gc.judge_bench(_bench())
    with pytest.raises(
        gc.CheckFailed, match=r"differs from the plain loop's by 0.059 .*limit 0.05"
    ):
        gc.judge_bench(_bench(loss_gap_max=0.059))
    with pytest.raises(gc.CheckFailed, match="no step's loss was compared"):
        gc.judge_bench(_bench(loss_gap_max=None, loss_gap_steps=0))
    with pytest.raises(gc.CheckFailed, match="no MFU") as err:
        gc.judge_bench(_bench(mfu=None))
    assert err.value.args[1]["loss_gap_max"] == 0.011
    monkeypatch.setattr(gc, "SCALE", gc.DRY)
    dry = _bench(mfu=gc.NA_ON_CPU, loss_gap_max=0.0, loss_gap_limit=gc.loss_gap_limit(),
                 peak_measured_gib=gc.NA_ON_CPU, peak_error=gc.NA_ON_CPU)  # fmt: skip
    gc.judge_bench(dry)
    with pytest.raises(gc.CheckFailed, match=r"by 0.059 at the same step \(limit 0.0001 on cpu\)"):
        gc.judge_bench({**dry, "loss_gap_max": 0.059})
    cell = gc._headline("bench_124m", {**dry, "loss_gap_max": 0.059})
    assert "MFU n/a on CPU, loss gap 5.9e-02 (limit 0.0001)" in cell


def test_the_flex_fit_check_s_losses_are_judged_and_shown():
    """``flex_fit`` fails on a null (non-finite) loss in the run log, and its table cell gives
    its losses, the resumed run's difference and the step time, "-" for a figure a failure
    came before. Mutation caught: a null loss read as finite (the branch's difference from it
    crashed the check without its figures)."""
    assert gc._all_finite([4.2, 3, 0.0]) and not gc._all_finite([4.2, None])
    assert not gc._all_finite([float("nan")]) and not gc._all_finite([float("inf")])
    cell = gc._headline(
        "flex_fit",
        {"first_loss": 10.9, "last_loss": 9.87654, "val_loss": 9.9, "resumed_at": 3,
         "resume_loss_max_diff": 2.5e-4, "step_ms_median": 80.04, "peak_allocated_gib": 12.345},
    )  # fmt: skip
    assert cell == (
        "loss 10.900 -> 9.877, val 9.900, resumed at 3: loss diff 2.5e-04, 80.0 ms/step, "
        "peak 12.35 GiB"
    )
    assert "loss diff -" in gc._headline("flex_fit", {"first_loss": 10.9, "resumed_at": 3})


def test_memory_table_is_read_back_from_bench_memorys_own_printout():
    bm = _load("bench_memory")
    rows = [
        bm.Row("gpt2-124m", 16, "peak allocated", 20 * 2**30, 19 * 2**30),
        bm.Row("gpt2-350m", 8, "saved activations", 12_345 * 2**20, 12_000 * 2**20),
    ]
    text = io.StringIO()
    with redirect_stdout(text):
        bm.print_table(rows, "GPU: test")
    parsed = gc.parse_memory_table(text.getvalue())
    assert [(p["config"], p["micro_batch"], p["quantity"]) for p in parsed] == [
        ("gpt2-124m", 16, "peak allocated"),
        ("gpt2-350m", 8, "saved activations"),
    ]
    assert parsed[0]["predicted_mib"] == 20 * 1024 and parsed[0]["measured_mib"] == 19 * 1024
    assert parsed[0]["error"] == pytest.approx(20 / 19 - 1, abs=1e-4)
    assert parsed[1]["error"] == pytest.approx(12_345 / 12_000 - 1, abs=1e-4)


def test_the_phase_peaks_bench_memory_prints_are_read_back():
    """memory_eager keeps bench_memory's "where the peak is" lines as figures. Mutation caught:
    a change to either side's format loses the phases from gpu_check.json."""
    bm = _load("bench_memory")
    text = io.StringIO()
    with redirect_stdout(text):
        bm.print_phases(
            [("gpt2-124m", 16, {"forward": 12 * 2**30, "backward": 15 * 2**30}),
             ("gpt2-350m", 8, {"optimizer_step": 3 * 2**20, "at_forward_end": 2**20})]
        )  # fmt: skip
    assert gc.parse_phase_peaks(text.getvalue()) == {
        "gpt2-124m B16": {"forward": 12 * 1024.0, "backward": 15 * 1024.0},
        "gpt2-350m B8": {"optimizer_step": 3.0, "at_forward_end": 1.0},
    }


#: The dry run's costliest checks (process start-ups: two bench sides, three packed jobs, two
#: flex fits), whose machinery has default tests of its own (tests/test_bench.py,
#: tests/test_queue_pack.py, tests/test_flex_fit.py): the default run takes the rest of the
#: checks; ``-m slow`` takes these.
COSTLY = ("bench_124m", "pack", "flex_fit")


@pytest.mark.parametrize(
    "part", ["default", pytest.param("costly", marks=pytest.mark.slow)], ids=["rest", "costly"]
)
def test_the_dry_run_takes_every_check_s_code_path_on_this_cpu(tmp_path, part):
    """``--dry-run``: every check of a GPU session, on this CPU at tiny sizes, with CUDA's
    fused AdamW forced (``torch.compile`` is not: eager, as docs/gpu-check.md says): the
    shipped recipes (124M, 350M composed on it) go through ``fit``, ``nanolab bench``,
    ``bench_memory.py``'s device path (calibration and phase peaks included) and
    ``gpu_pack.py``. Mutation caught:
    any check that crashes before it reaches a GPU (bench_memory's uncomposed 350M overlay, the
    bench's JSON read, flex's backward on CPU) fails here instead of in a lent GPU session.
    ``--out`` and ``--work`` are given relative to where it starts, not to the project's root,
    where the checks run their commands (a pack that worked read as crashed, exit 0)."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benches" / "gpu_check.py"), "--dry-run", "--out", "out",
         "--work", "work", "--deadline", "1200",
         "--only" if part == "costly" else "--skip", ",".join(COSTLY)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=1500,
        cwd=tmp_path,
    )  # fmt: skip
    summary = json.loads((out / "gpu_check.json").read_text())
    statuses = {c["name"]: (c["status"], c["note"]) for c in summary["checks"]}
    every = {c.name for c in gc.CHECKS}
    assert set(statuses) == (set(COSTLY) if part == "costly" else every - set(COSTLY))
    not_ok = {name: got for name, got in statuses.items() if got[0] != "ok"}
    # nanoGPT's train.py is never shipped: without a checkout its side-by-side is skipped.
    if part == "default":
        skipped = ("skipped", "no nanoGPT checkout given (--nanogpt PATH)")
        assert not_ok.pop("vs_nanogpt") == skipped
    assert not not_ok
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert summary["dry_run"] is True and "CPU dry run" in (out / "gpu_check.md").read_text()
    metrics = {c["name"]: c["metrics"] for c in summary["checks"]}
    # Each memory figure is there or says why not: the CPU's rules predict; a CPU has no
    # allocator peak to measure (on a GPU its absence fails the check).
    for name in {"bench_124m", "memory_compiled_350m", "micro_batch_auto"} & set(metrics):
        assert metrics[name]["peak_predicted_gib"] > 0, name
        assert metrics[name]["peak_measured_gib"] == gc.NA_ON_CPU, name
    if part == "costly":
        bench = metrics["bench_124m"]
        assert bench["nanolab_tokens_per_s"] > 0 and bench["plain_tokens_per_s"] > 0
        # Both sides trained the same model: fp32 on a CPU gives the same losses to the bit.
        assert bench["loss_gap_steps"] > 0 and bench["loss_gap_max"] <= bench["loss_gap_limit"]
        assert bench["mfu"] == gc.NA_ON_CPU
        # The GPU's packed jobs are the 124M recipe's: the dry run packs it too, shrunk.
        packed = metrics["pack"]["args"]
        assert Path(packed["config"]).name == "gpt2-124m.yaml" and packed["block_size"] == "64"
        assert all(not r["failed"] and r["tokens"] > 0 for r in metrics["pack"]["results"])
        # The flex fit trained, validated and resumed; a CPU resumes it to the bit.
        flex = metrics["flex_fit"]
        assert flex["resume_loss_max_diff"] == 0.0 and flex["resumed_at"] == 1
        assert all(flex[k] > 0 for k in ("first_loss", "last_loss", "val_loss"))
        assert flex["peak_allocated_gib"] == gc.NA_ON_CPU
        return
    eager = metrics["memory_eager"]
    assert set(eager["phases_mib"]) == {"gpt2-124m B4", "gpt2-350m B4"}
    assert all(p["optimizer_step"] > 0 for p in eager["phases_mib"].values())
    auto = metrics["micro_batch_auto"]
    assert auto["auto_line"] == (
        f"run.micro_batch_size auto: {auto['micro_batch']}, data.micro_batch_size "
        "(no GPU memory to plan against)"
    )


def test_on_a_gpu_the_timings_wait_for_the_device_and_the_machine_names_its_gpu(monkeypatch):
    """The GPU side of ``timed_ms`` and ``machine()`` with a stand-in ``torch.cuda``: a GPU run's
    timing synchronizes after the warm-up and after the timed calls (the kernels it queued are
    what is timed), the dry run's does not; the summary's machine names the GPU, how many
    there are and its memory. Mutation caught: the synchronize taken off the GPU path (kernel
    launches timed instead of kernels), the GPU fields read on a CPU or left out."""
    from types import SimpleNamespace

    synced, calls = [], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(len(calls)))
    monkeypatch.setattr(gc, "SCALE", gc.GPU)
    assert gc.timed_ms(lambda: calls.append(1), repeats=3) >= 0
    assert synced == [1, 4]  # after the warm-up call, then after the 3 timed ones
    monkeypatch.setattr(gc, "SCALE", gc.DRY)
    synced.clear()
    gc.timed_ms(lambda: calls.append(1), repeats=3)
    assert synced == []

    assert "gpu" not in gc.machine()  # this CPU
    props = SimpleNamespace(name="NVIDIA H200", total_memory=143 * gc.GiB)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    info = gc.machine()
    assert (info["gpu"], info["gpu_count"], info["gpu_gib"]) == ("NVIDIA H200", 8, 143.0)
    assert gc.format_table({**gc.summary(info, [], 0.0), "dry_run": False}).startswith(
        "nanolab GPU check: NVIDIA H200, torch "
    )


def test_a_failed_child_is_summed_up_by_its_exception_line():
    """The summary names the error (a CUDA OOM's first line), not the tail of PyTorch's advice."""
    log = (
        "Traceback (most recent call last):\n  File 'x.py', line 1\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 26.67 GiB. GPU 0 has a "
        "total capacity of 139.80 GiB\nIf reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\n"
    )
    assert gc.last_line(log).startswith("torch.OutOfMemoryError: CUDA out of memory. Tried")
    assert gc.last_line("start\nnanolab fit: error: bad value\n") == "nanolab fit: error: bad value"
    assert gc.last_line("one\ntwo\n") == "two" and gc.last_line("") == "(no output)"
    assert gc._headline("bench_124m", {}) == ""  # stopped at its cap: nothing measured


def test_a_memory_check_without_its_figure_fails(monkeypatch):
    """``bench_124m``, ``memory_compiled_350m`` and ``micro_batch_auto`` judge their figures
    alike: on a GPU no measured peak (a broken memory reader), no prediction, or a prediction
    beyond the tolerance fails; the dry run has no allocator peak and says so in the field.
    Mutation caught: the checks returned ``peak - GiB`` as ok."""
    GiB = gc.GiB
    with pytest.raises(gc.CheckFailed, match="no measured peak"):
        gc.judge_peak(gc.peak_metrics(None, 10 * GiB))
    with pytest.raises(gc.CheckFailed, match="no predicted peak"):
        gc.judge_peak(gc.peak_metrics(10 * GiB, None))
    with pytest.raises(gc.CheckFailed, match=r"predicted \+10.0% off the measured one") as err:
        gc.judge_peak(gc.peak_metrics(10 * GiB, 11 * GiB))
    assert err.value.args[1]["peak_measured_gib"] == 10  # the figures go with the failure
    fine = gc.peak_metrics(100 * GiB, 101 * GiB)
    gc.judge_peak(fine)
    assert fine["peak_error"] == pytest.approx(0.01)
    monkeypatch.setattr(gc, "SCALE", gc.DRY)
    dry = gc.peak_metrics(None, 2**20)
    gc.judge_peak(dry)
    assert dry["peak_measured_gib"] == dry["peak_error"] == gc.NA_ON_CPU == "n/a on CPU"
    with pytest.raises(gc.CheckFailed, match="no predicted peak"):
        gc.judge_peak(gc.peak_metrics(None, None))
    assert "peak n/a on CPU GiB" in gc._headline("memory_compiled_350m", dry)


@pytest.mark.parametrize(
    ("line", "size", "planned"),
    [
        ("run.micro_batch_size auto: 139 (predicted peak 124.3 of 139.8 GiB, ...)", "139", "139.8"),
        ("run.micro_batch_size auto: 16, data.micro_batch_size (no GPU memory to plan against)",
         "16", None),
    ],
)  # fmt: skip
def test_the_auto_line_is_read_on_a_gpu_and_on_a_cpu(line, size, planned):
    """The dry run reads fit's CPU line through the same pattern the GPU's goes through."""
    m = gc._AUTO_LINE.search(f"INFO {line}\n")
    assert m is not None and m[1] == size and m[3] == planned


def _processes_naming(text: str) -> dict[int, str]:
    """This machine's processes whose command line contains ``text``: id -> command line."""
    found = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it exited meanwhile
            continue
        if text in args:
            found[int(cmdline.parent.name)] = args
    return found


def _children(pid: int) -> list[tuple[int, str]]:
    """The processes whose parent is ``pid``: their ids and command lines."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            args = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):  # it exited meanwhile
            continue
        if parent == pid:
            found.append((int(stat.parent.name), args))
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the processes from /proc")
def test_the_cap_stops_the_pack_check_s_queue_jobs_too(tmp_path, monkeypatch, char_dataset):
    """``pack`` as the dry run runs it (gpu_pack.py's tiny jobs through ``nanolab queue run``
    on this CPU), its cap reached while a job runs: the queue runner starts each job in a
    session of its own, and none may outlive the cap. The job is stopped first, standing for
    one stuck where no Python handler runs (a GPU kernel, a compile, a checkpoint's write):
    the parent-death SIGTERM the runner's death sends asks a job to checkpoint and exit,
    which on a CPU it does in ~0.1 s, and such a job does not. Mutation caught: only the
    check's own process group killed (the runner died, its job ran on, the GPU held into
    the next check)."""
    from nanolab.processes import pid_alive

    stuck: list[int] = []

    class CapWhileAJobRuns(subprocess.Popen):
        def wait(self, timeout=None):
            if timeout is None:  # the reaping wait after the kill
                return super().wait()
            give_up = time.monotonic() + 300
            while time.monotonic() < give_up and self.poll() is None:
                with contextlib.suppress(ProcessLookupError):  # one exited meanwhile
                    # The queue's jobs: the check's descendants in sessions of their own.
                    jobs = [p for p in gc.descendants(self.pid) if os.getsid(p) != self.pid]
                    if jobs:
                        os.kill(jobs[0], signal.SIGSTOP)
                        stuck.append(jobs[0])
                        raise subprocess.TimeoutExpired(self.args, timeout)  # the cap, now
                time.sleep(0.05)
            return super().wait()

    monkeypatch.setattr(subprocess, "Popen", CapWhileAJobRuns)
    logs = tmp_path / "logs"
    logs.mkdir()
    try:
        result = gc.run_check(
            gc.BY_NAME["pack"], tmp_path, str(char_dataset), logs, limit_s=300, dry_run=True
        )
        survivors = [job for job in stuck if pid_alive(job)]
    finally:
        for job in stuck:  # this test's own job only
            with contextlib.suppress(ProcessLookupError):
                os.kill(job, signal.SIGKILL)
    assert stuck and result.status == "timeout", (result, (logs / "pack.log").read_text()[-2000:])
    assert not survivors, "a queue job outlived the check's cap"


#: A driver whose Popen is sent a real signal after it has started the check and before it
#: returns (``argv[1]``: the signal's name, or "none"): prints the check's pid, then what
#: run_check ended in.
_SIGNAL_IN_POPEN = """
import os, signal, subprocess, sys
from pathlib import Path
sys.path.insert(0, sys.argv[3])
import gpu_check as gc

real, sent = subprocess.Popen, sys.argv[1]

def popen_then_signal(*args, **kwargs):
    proc = real(*args, **kwargs)  # forked and exec'd: the check runs, its pid not yet stored
    print(proc.pid, flush=True)
    if sent != "none":
        os.kill(os.getpid(), signal.Signals[sent])
    return proc

gc.subprocess.Popen = popen_then_signal
gc.stop_on_signals()
work = Path(sys.argv[2])
try:
    result = gc.run_check(gc.BY_NAME["flash"], work, None, work, limit_s=120, dry_run=True)
    print("ended", result.status, flush=True)
except gc.Stopped as stop:
    print("stopped", stop.name, stop.result.status if stop.result else None, flush=True)
"""


def _blocked_signals(pid: int) -> int | None:
    """The signal mask ``pid`` runs with (``SigBlk`` of /proc), None once it has exited."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return int(
        next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16
    )


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the processes from /proc")
@pytest.mark.parametrize("sent", ["SIGINT", "SIGTERM", "none"])
def test_a_stop_that_comes_while_popen_starts_the_check_still_kills_it(tmp_path, sent):
    """A real SIGINT or SIGTERM to the driver after Popen has started the check (its own
    session: the terminal's Ctrl-C does not reach it) but before Popen returns its pid: the
    check is killed and recorded ``stopped``. And a check started with no stop runs with
    SIGINT and SIGTERM open again (the driver holds them while it starts one), so what it
    starts is not deaf to a stop. Mutation caught: Stopped raised inside Popen, the check
    left running on with no one to end it (flash ran its 7 s and more, orphaned)."""
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", _SIGNAL_IN_POPEN, sent, str(work), str(REPO / "benches")],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    check = None
    try:
        assert proc.stdout is not None
        check = int(proc.stdout.readline())
        if sent == "none":  # the mask the check runs with, once it has opened it
            stops = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))
            deadline = time.monotonic() + 60
            while (mask := _blocked_signals(check)) is not None and mask & stops:
                assert time.monotonic() < deadline, "the check runs with SIGINT/SIGTERM held"
                time.sleep(0.05)
            assert mask is not None, "the check ran to its end with SIGINT/SIGTERM held"
        out = proc.stdout.read()  # to its end (the driver's run_check ends within 120 s)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        survived = check is not None and _blocked_signals(check) is not None
        if survived:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(check, signal.SIGKILL)
    assert proc.returncode == 0, out
    if sent == "none":
        assert out.splitlines()[-1:] == ["ended ok"], out
        return
    assert out.splitlines()[-1:] == [f"stopped {sent} stopped"], out
    assert not survived, "the check outlived the driver's stop"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the processes from /proc")
@pytest.mark.parametrize("how", ["ctrl-c", "time limit"])
def test_a_ctrl_c_or_the_time_limit_stops_the_check_in_flight_and_writes_what_finished(
    tmp_path, how
):
    """A Ctrl-C (SIGINT to the script's process group, as a terminal sends it) or ``timeout``'s
    SIGTERM while a check's ``nanolab fit`` runs: the check, its fit and its scratch folder are
    gone, the summary says ``stopped`` (the check after it ``not_run``), the exit code is 128 +
    the signal. Mutation caught: ``timeout`` without ``--foreground`` (a Ctrl-C never reached
    the driver) and a driver without a handler (its check and fit ran on as orphans, ``--work``
    was left behind and no summary said what had run)."""
    scratch = tmp_path / "tmp"  # the driver's default --work is made here
    scratch.mkdir()
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
           "TMPDIR": str(scratch), "OMP_NUM_THREADS": "1"}  # fmt: skip
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), "--dry-run", "--only", "micro_batch_auto,flex_fit"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )  # fmt: skip
    log = tmp_path / "out" / "logs" / "micro_batch_auto.log"
    try:
        deadline = time.monotonic() + 90
        while not (log.is_file() and " fit " in log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "the fit never started"
            time.sleep(0.2)
        assert _processes_naming(str(scratch)), "the check's fit runs"
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:  # the limit, now: timeout's own alarm, on which it sends the driver SIGTERM
            (timeout,) = [pid for pid, args in _children(proc.pid) if args.startswith("timeout ")]
            os.kill(timeout, signal.SIGALRM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        orphans = _processes_naming(str(scratch))
        for pid in orphans:  # this test's only: each names its scratch folder
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    signum = signal.SIGINT if how == "ctrl-c" else signal.SIGTERM
    assert proc.returncode == (128 + signum if how == "ctrl-c" else 124), err
    assert not orphans, "a check or its fit outlived the driver"
    assert list(scratch.iterdir()) == [], "the driver's scratch folder was left behind"
    summary = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert summary["status"] == "fail" and f"stopped by {signum.name}" in summary["note"]
    statuses = [(c["name"], c["status"]) for c in summary["checks"]]
    assert statuses == [("micro_batch_auto", "stopped"), ("flex_fit", "not_run")]
    assert summary["checks"][0]["note"].startswith(f"stopped by {signum.name} after ")
    if how == "time limit":
        assert "what finished is in" in err and str(tmp_path / "out" / "gpu_check.json") in err
