"""The estimator on a CPU says what fit will do there: the memory fit checks before it builds the
model, the micro-batch an ``auto`` run trains at, the time of a 16-bit run, and when the FLOPs
model stops predicting a step's time at all."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _tiny(**run: object) -> dict:
    return {
        "trainer": {"accelerator": "cpu", "precision": "32-true", "max_steps": 10},
        "model": {"gpt": {"vocab_size": 500, "block_size": 64, "n_layer": 2, "n_head": 2,
                          "n_embd": 64}},
        "data": {"micro_batch_size": 4},
        "run": dict(run),
    }  # fmt: skip


def test_estimate_and_fits_refusal_give_one_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """``estimate --device cpu`` compared its total with the physical RAM and no heap margin,
    fit's check with the RAM available and the GPU's 12% margin: the estimate said a
    micro-batch fit in 23.58 of 23.59 GiB and fit refused it as needing 26.4 of 21.3 GiB. Both
    now hold one total (the process and the C heap's slack included) against the RAM free now
    (plus, inside fit, what its own process already holds)."""
    from nanolab import processes
    from nanolab.estimator.estimate import estimate_from_config
    from nanolab.estimator.memory import CONTEXT_BYTES, CPU_FRAGMENTATION
    from nanolab.run import autobatch

    cfg = _tiny()
    free = 3 << 30
    monkeypatch.setattr(processes, "host_memory_available", lambda: free)
    est = estimate_from_config(cfg, device="cpu", history=False)
    peak = est.memory.peak_allocated
    assert est.device_memory == free and est.fits
    assert est.memory.total == peak + CONTEXT_BYTES["cpu"] + int(CPU_FRAGMENTATION * peak)

    held = 200 << 20  # this process's own resident memory counts towards the need
    monkeypatch.setattr(autobatch, "resident_bytes", lambda: held)
    monkeypatch.setattr(autobatch, "host_memory_available", lambda: est.memory.total - held)
    autobatch.check_fits_on_host(cfg)  # exactly enough: runs
    monkeypatch.setattr(autobatch, "host_memory_available", lambda: est.memory.total - held - 1)
    with pytest.raises(autobatch.HostMemoryError) as refused:
        autobatch.check_fits_on_host(cfg)
    assert f"about {est.memory.total / 2**30:.1f} GiB" in str(refused.value)

    monkeypatch.setattr(processes, "host_memory_available", lambda: est.memory.total - 1)
    assert not estimate_from_config(cfg, device="cpu", history=False).fits


def test_several_cpu_processes_share_one_machine_in_estimate_and_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two DDP processes on one CPU: estimate held one process's total against the whole
    machine ("fits"), while fit refused twice a single-device figure (DDP's gradient buckets
    left out), pointing at an estimate that said the run fits. Both now hold each process (as
    the strategy has it) to its share of the machine: estimate shows RAM / 2 each and
    the per-process total, fit refuses when twice that total exceeds the RAM."""
    from nanolab import processes
    from nanolab.estimator.estimate import estimate_from_config
    from nanolab.run import autobatch

    cfg = _tiny()
    cfg["trainer"] |= {"devices": 2, "strategy": "ddp"}
    free = 8 << 30
    monkeypatch.setattr(processes, "host_memory_available", lambda: free)
    two = estimate_from_config(cfg, device="cpu", devices=2, history=False)
    one = estimate_from_config(cfg, device="cpu", devices=1, history=False)
    assert two.device_memory == free // 2 and one.device_memory == free
    assert two.memory.total >= one.memory.total  # DDP's buckets, where it keeps any
    monkeypatch.setattr(autobatch, "resident_bytes", lambda: 0)
    monkeypatch.setattr(autobatch, "host_memory_available", lambda: 2 * two.memory.total)
    autobatch.check_fits_on_host(cfg, processes=2)  # exactly enough
    monkeypatch.setattr(autobatch, "host_memory_available", lambda: 2 * two.memory.total - 1)
    with pytest.raises(autobatch.HostMemoryError, match="x2 processes"):
        autobatch.check_fits_on_host(cfg, processes=2)


def test_auto_micro_batch_on_a_cpu_is_the_datas() -> None:
    """fit trains ``run.micro_batch_size: auto`` at ``data.micro_batch_size`` on a CPU (no GPU
    memory to plan against), but the estimate and fit's banner planned the largest micro-batch
    that fit the RAM: 4096 sequences and ~24 s for 3 steps that took 5 s."""
    from nanolab.estimator.estimate import estimate_from_config
    from nanolab.estimator.runtime import run_seconds

    est = estimate_from_config(_tiny(micro_batch_size="auto"), device="cpu", history=False)
    assert est.micro_batch == 4 and est.micro_batch_source.startswith("auto: data.")
    assert est.largest_micro_batch > 4  # the RAM would take more; fit does not plan on a CPU
    auto = run_seconds(_tiny(micro_batch_size="auto"), devices=1, tokens_per_step=256,
                       max_steps=3)  # fmt: skip
    given = run_seconds(_tiny(), devices=1, tokens_per_step=256, max_steps=3)
    assert auto[0] == pytest.approx(given[0])


def test_a_sixteen_bit_cpu_run_is_timed_at_the_fp32_rate() -> None:
    """A bf16 run on a CPU was timed at 55% of the bf16 peak of one 512 x 512 matmul (3x the
    fp32 rate with AMX): predicted 6x faster than fp32 where it trained slower. 16-mixed, which
    Lightning trains as bf16-mixed on a CPU, was computed as fp32 matmuls."""
    from nanolab.estimator.compute import estimate_compute
    from nanolab.estimator.cpu import CPU_EFFICIENCY, _device
    from nanolab.estimator.estimate import setup_for
    from nanolab.estimator.gpus import matmul_rate

    cpu = _device(1, 0.2, 1.0)  # fp32 0.2 TFLOP/s, bf16 1.0 (a CPU with AMX)
    times = {}
    for precision in ("32-true", "bf16-mixed", "bf16-true", "16-mixed"):
        cfg = _tiny()
        cfg["trainer"]["precision"] = precision
        c = estimate_compute(setup_for(cfg), cpu, 4, 1)
        times[precision] = c.step_seconds
        if precision != "32-true":
            assert c.matmul_dtype == "bf16" and c.mfu == pytest.approx(CPU_EFFICIENCY * 0.2)
    assert len({round(t, 12) for t in times.values()}) == 1, times
    assert matmul_rate(cpu, "16-mixed")[1] == "bf16"  # the MFU callback divides by the same
    no_bf16 = _device(1, 0.2, None)
    assert matmul_rate(no_bf16, "16-mixed")[1] == "fp32"


def test_a_step_too_small_for_the_flops_model_is_flagged() -> None:
    """A tiny model was estimated at 5.7 M tokens/s (0.000 s a step) where it trained at 15 k:
    the FLOPs model has no fixed cost per step. Now a step holds the host's fixed work (on a
    GPU as its floor: milliseconds, not microseconds), and where that dominates the estimate
    says its time is a lower bound."""
    from nanolab.estimator.cpu import host_floor_seconds
    from nanolab.estimator.estimate import estimate_from_config

    tiny = estimate_from_config(_tiny(), gpu="h100", history=False)
    assert tiny.compute.step_seconds >= host_floor_seconds(2, 1) >= 1e-3
    assert any("fixed host work" in w and "lower bound" in w for w in tiny.warnings)
    big = estimate_from_config(str(CONFIGS / "gpt2-124m.yaml"), gpu="h100", history=False)
    assert not any("fixed host work" in w for w in big.warnings)
    assert big.compute.step_seconds > big.compute.floor_seconds  # the FLOPs set its time


@pytest.mark.slow
def test_the_cpu_estimate_covers_a_real_fits_resident_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The total of ``estimate --device cpu`` against the peak resident memory of a real
    quickstart fit at micro-batch 128 (measured 1.26-1.28 GB against 1.34 GB estimated): it must
    cover the process and not overstate it by more than a third."""
    from nanolab.estimator.estimate import estimate_from_config

    rss_file = tmp_path / "rss"
    args = ["--config", str(CONFIGS / "quickstart.yaml"), "--data.micro_batch_size", "128",
            "--trainer.max_steps", "3", "--downstream.suite", "null",
            "--run.eval_every_steps", "1000", "--checkpoint.every_n_steps", "1000",
            "--run.root", str(tmp_path / "runs"), "--run.name", "rss"]  # fmt: skip
    code = (
        "import atexit, resource, sys\n"
        "path = sys.argv[1]\n"
        "atexit.register(lambda: open(path, 'w').write(\n"
        "    str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)))\n"
        "sys.argv = ['nanolab', 'fit', *sys.argv[2:]]\n"
        "from nanolab.cli import main\n"
        "main()\n"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(rss_file), *args],
        check=True,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
    )
    rss = int(rss_file.read_text())
    monkeypatch.chdir(tmp_path)  # the data fit prepared there gives the vocabulary
    cfg_args = [str(CONFIGS / "quickstart.yaml")]
    est = estimate_from_config(cfg_args, device="cpu", micro_batch_size=128, history=False)
    print(f"peak RSS {rss / 1e9:.3f} GB, estimated {est.memory.total / 1e9:.3f} GB")
    assert 0.75 * est.memory.total <= rss <= est.memory.total, (rss, est.memory.total)
