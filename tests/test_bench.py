"""`nanolab bench` runs both sides on the same config and reports what it measured."""

from __future__ import annotations

import json

import pytest
from conftest import (
    QUICKSTART,
    REPO,
    nanolab_here,
    run_nanolab,
    tiny_overrides,
    write_config,
)


@pytest.mark.slow
def test_bench_compares_nanolab_with_the_plain_loop(tmp_path, char_dataset):
    """Both sides train the same thing: the plain loop reads its loss at every step (its one
    sync per step, as nanolab's), nanolab logged the same loss, in every round; then their
    speeds are compared.

    Mutation caught: the plain loop seeded differently (``torch.manual_seed(seed + 1)``): the
    speeds still compare fine, the losses differ from step 1 on.
    """
    cfg = write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, tmp_path / "unused"))
    res = run_nanolab(
        "bench", "--config", str(QUICKSTART), "--config", str(cfg),
        "--steps", "16", "--warmup", "4", "--rounds", "2", "--json", "--floor", cwd=tmp_path,
        timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert out["rounds"] == 2 and len(out["rounds_detail"]) == 2
    for side in ("nanolab_tokens_per_s", "plain_tokens_per_s"):
        assert 0 < out[side]["min"] <= out[side]["median"] <= out[side]["max"]
    ratio = out["nanolab_tokens_per_s"]["median"] / out["plain_tokens_per_s"]["median"]
    assert out["ratio"]["min"] <= ratio * 1.5 and 0.05 < out["ratio"]["median"] < 20
    assert 0 < out["goodput"]["median"] <= 1
    assert out["nanolab_startup_s"]["min"] > 0 and out["import_s"] > 0
    # Each side trained the whole run, and the same model on the same batches.
    for detail in out["rounds_detail"]:
        nano, plain = detail["nanolab"], detail["plain"]
        assert nano["steps"] == 16 and plain["steps"] == 16
        assert sorted(plain["losses"], key=int) == [str(s) for s in range(1, 17)]
        for step, loss in plain["losses"].items():
            assert nano["losses"][step] == pytest.approx(loss, rel=1e-4, abs=1e-5), step
    assert out["loss_gap"]["steps_compared"] == 32 and out["loss_gap"]["max"] < 1e-4
    # ... and both validated it the same way at the same steps (3, 6, 9, 12, 15 and the last,
    # 16), so the whole window and the end-to-end ratio (process start to exit) compare the
    # same work.
    assert out["val_loss_gap"]["steps_compared"] == 12 and out["val_loss_gap"]["max"] < 1e-5
    for side in ("plain", "nanolab"):  # each round's wall holds its own start-up, so the least
        # wall exceeds the least start-up (a slow start-up of one round may exceed another's wall)
        assert out[f"{side}_wall_s"]["min"] > out[f"{side}_startup_s"]["min"]
    assert 0.05 < out["end_to_end_ratio"]["median"] < 20 and out["window_ratio"]["min"] > 0
    # the same work timed on both sides: 5 validations and the save at the end (no tasks here)
    assert set(out["extra_s"]) == {"eval_s", "tasks_s", "checkpoint_s"}
    assert out["extra_s"]["tasks_s"]["min"] == out["extra_s"]["tasks_s"]["max"] == 0
    assert set(out["startup_extra_s"]) == {"median", "min", "max"}
    for side in ("plain", "nanolab"):  # at least the start-up is outside the steps
        assert out[f"{side}_outside_steps_s"]["min"] > 0.5 * out[f"{side}_startup_s"]["min"]
    assert out["lightning_loss_gap"]["steps_compared"] == 32
    # The run-to-run spread of each side, and a verdict on whether the ratio can be read.
    assert set(out["spread"]) == {"nanolab", "plain loop", "ratio", "bare Lightning"}
    assert all(v is not None and v >= 0 for v in out["spread"].values())
    assert out["noisy"] == bool(out["warnings"]) and len(out["load_avg"]) == 2
    # nanolab's fixed cost per step, and its syncs counted in an extra, untimed run
    assert set(out["overhead_ms_per_step"]) == {"median", "min", "max"}
    assert out["syncs"]["per_step"]["max"] == 1 and out["syncs"]["per_micro_batch_max"] == 0
    # --floor: the overhead split at Lightning's bare loop, which trained the same losses
    assert set(out["lightning_ms_per_step"]) == {"median", "min", "max"}
    assert set(out["nanolab_beyond_lightning_ms_per_step"]) == {"median", "min", "max"}
    for detail in out["rounds_detail"]:
        bare, plain = detail["lightning"]["losses"], detail["plain"]["losses"]
        assert bare.keys() == plain.keys()
        assert all(bare[k] == pytest.approx(v, rel=1e-4, abs=1e-5) for k, v in plain.items())


def test_bench_refuses_a_window_without_steady_state(tmp_path):
    res = run_nanolab(
        "bench", "--config", str(QUICKSTART), "--steps", "5", "--warmup", "5", cwd=tmp_path
    )
    assert res.returncode == 2 and "--steps must exceed --warmup" in res.stderr


def test_bench_refuses_no_import_timing(tmp_path):
    res = nanolab_here("bench", "--config", str(QUICKSTART), "--import-repeats", "0", cwd=tmp_path)
    assert res.returncode == 2 and "--import-repeats must be >= 1" in res.stderr


def _result(nano: list[float], plain: list[float], load: float = 0.1) -> dict:
    from nanolab.bench.harness import _stats, noise_warnings, spread

    ratios = [n / p for n, p in zip(nano, plain, strict=True)]
    res = {"rounds": len(nano), "nanolab_tokens_per_s": _stats(nano),
           "plain_tokens_per_s": _stats(plain), "ratio": _stats(ratios), "load_avg": [load]}  # fmt: skip
    res["spread"] = {"nanolab": spread(res["nanolab_tokens_per_s"]),
                     "plain loop": spread(res["plain_tokens_per_s"]), "ratio": spread(res["ratio"])}  # fmt: skip
    return {**res, "warnings": noise_warnings(res)}


def test_bench_says_when_the_machine_is_too_noisy_for_the_ratio():
    """The newcomer's case: 0.35 and 0.71 from two rounds on a loaded machine."""
    from nanolab.bench.harness import format_table

    noisy = _result([3500, 7100], [10000, 10000], load=14.0)
    (spread_warning, load_warning) = noisy["warnings"]
    assert "too noisy for the ratio to mean anything" in spread_warning
    assert "from 0.35 to 0.71 over the rounds (68% of its median" in spread_warning
    assert "nanolab 68%, plain loop 0%" in spread_warning
    assert "load average 14.0" in load_warning
    steady = _result([9800, 10000, 9900], [10100, 10050, 10200])
    assert steady["warnings"] == [] and steady["spread"]["nanolab"] < 0.03
    assert "one round" in _result([9800], [10000])["warnings"][0]
    table = format_table({**steady, "machine": "m", "date": "d", "steps": 9, "warmup": 2,
                          **{k: steady["ratio"] for k in ("nanolab_window_tokens_per_s",
                             "plain_window_tokens_per_s", "nanolab_startup_s", "plain_startup_s",
                             "goodput")}})  # fmt: skip
    assert "run-to-run spread (max-min)/median" in table and "it can be read" in table
    # both sides drifting together (alternated rounds): a steady ratio can still be read
    drift = _result([10000, 13000, 11500], [10100, 13050, 11600])
    assert drift["spread"]["nanolab"] > 0.2 and drift["warnings"] == []


def test_bench_resolves_the_config_before_running_anything(capsys):
    """The benchmarked config goes through fit's resolver first, its --set overrides included:
    a global batch that cannot divide is one line and exit 2, before any run starts."""
    from nanolab.bench.harness import main, resolve_benchmarked

    resolved = resolve_benchmarked(
        [str(QUICKSTART)], ["--run.global_batch_tokens", "8192", "--data.micro_batch_size", "16"], 7
    )
    assert (resolved.micro_batch_size, resolved.accumulate, resolved.max_steps) == (16, 4, 7)
    code = main(["--config", str(QUICKSTART), "--set=--run.global_batch_tokens=1000"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "run.global_batch_tokens (1000)" in err[0]


@pytest.fixture
def resolved_tiny(tmp_path, char_dataset) -> dict:
    """A tiny run's resolved ``config.yaml`` (2 micro-batches of 4 x 32 tokens per step)."""
    import yaml

    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=1)
    cfg["run"]["global_batch_tokens"] = 2 * 4 * 32
    # no warm-up and a high rate: 8 steps move the loss, so what each side does shows in it
    cfg["model"].update(optimizer={"lr": 0.01}, schedule={"warmup_steps": 0})
    out = nanolab_here("fit", "--config", str(write_config(tmp_path / "t.yaml", cfg)), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    return yaml.safe_load((tmp_path / "runs" / "tiny" / "config.yaml").read_text())


BARE_CASES = {
    "clip binding": {"trainer": {"gradient_clip_val": 0.01}},
    "clip by value": {"trainer": {"gradient_clip_val": 0.001, "gradient_clip_algorithm": "value"}},
    "bf16 + fused AdamW": {"trainer": {"precision": "bf16-mixed"}, "model": {"optimizer": {"fused": True}}},
    "short spelling bf16": {"trainer": {"precision": "bf16"}},
    "16-mixed on a CPU": {"trainer": {"precision": "16-mixed"}},
    "bf16-true": {"trainer": {"precision": "bf16-true"}},
    "dropout": {"model": {"gpt": {"dropout": 0.1}}},
}  # fmt: skip


def _with(config: dict, change: dict) -> dict:
    import copy

    out = copy.deepcopy(config)
    for group, values in change.items():
        node = out[group]
        for key, value in values.items():
            if isinstance(value, dict):
                node[key].update(value)
            else:
                node[key] = value
    return out


@pytest.mark.parametrize("case", list(BARE_CASES))
def test_a_bare_lightning_trainer_trains_the_plain_loops_setup_step_for_step(resolved_tiny, case):
    """``nanolab bench --floor``'s third side: the plain loop's model, optimizer, schedule,
    clipping and batches under a bare Lightning Trainer. It must train the same thing, or
    "Lightning's own loop per step" would compare different work: the same loss at every step
    (2 micro-batches a step) for each precision spelling, clipping, fused AdamW and dropout.

    Mutations caught: the bare side without the LR schedule, stepping every micro-batch, or its
    DataLoader seeded from the global RNG (dropout masks differ from step 1); the plain loop
    clipping by norm when the config says value, or reading ``bf16`` as fp32."""
    import torch

    from nanolab.bench.plain_loop import train, train_lightning

    config = _with(resolved_tiny, BARE_CASES[case])
    plain = train(config, 8, torch.device("cpu"))
    bare = train_lightning(config, 8, torch.device("cpu"))
    assert [s for s, _ in bare["losses"]] == [s for s, _ in plain["losses"]] == list(range(1, 9))
    for (step, expected), (_, got) in zip(plain["losses"], bare["losses"], strict=True):
        assert got == pytest.approx(expected, rel=1e-6), step  # the same ops: equal in practice
    assert len(bare["step_ends"]) == 8 and bare["step_ends"] == sorted(bare["step_ends"])
    assert bare["tokens_per_step"] == plain["tokens_per_step"] == 256
    if case.startswith("clip"):  # the clip changes what is trained here, so it was compared
        unclipped = train(_with(config, {"trainer": {"gradient_clip_val": None}}), 8,
                          torch.device("cpu"))  # fmt: skip
        assert unclipped["losses"][-1][1] != pytest.approx(plain["losses"][-1][1], rel=1e-4)


class CudaOnCpu(str):
    """A device the plain loop reads as ``cuda`` (``.type``) while torch, given it, makes
    tensors on the CPU (it is the string ``"cpu"``): a CPU-only torch has no CUDA device."""

    type = "cuda"
    index = 0


def test_the_plain_loop_on_a_cuda_device_pins_its_batches_and_waits_for_its_last_step(
    resolved_tiny, monkeypatch
):
    """The plain loop's GPU branches, as a GPU bench runs them (``--device`` defaults to cuda
    there), on a device it reads as ``cuda``: every micro-batch's inputs and targets
    page-locked before the copy, and one ``torch.cuda.synchronize`` after the last step's work
    was queued, so its end time counts that work. torch's ``pin_memory`` and
    ``torch.cuda.synchronize`` are stand-ins (a CPU-only torch has neither); the losses are a
    CPU run's. Mutation caught: the batches not pinned on cuda, pinned on a CPU, or the
    synchronize left out or made before the last step."""
    import torch

    from nanolab.bench.plain_loop import train

    pinned: list[int] = []
    synced: list[int] = []  # how many tensors had been pinned when each synchronize came
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned.append(t.numel()) or t)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(len(pinned)))
    on_cpu = train(resolved_tiny, 3, torch.device("cpu"))
    assert pinned == synced == []  # a CPU run neither pins nor waits on a GPU
    on_cuda = train(resolved_tiny, 3, CudaOnCpu("cpu"))
    micro_batches = 3 * 2  # 3 steps of 2 micro-batches: an input and a target each
    assert len(pinned) == 2 * micro_batches and set(pinned) == {4 * 32}
    assert synced == [2 * micro_batches]  # once, after the last step's batches
    assert on_cuda["losses"] == on_cpu["losses"]


@pytest.mark.parametrize("fused", [False, True])
def test_the_bare_sides_fp16_path_with_a_fused_optimizer_clips_unscaled_gradients(
    resolved_tiny, fused
):
    """The GPU's fp16 path on a CPU: a real ``GradScaler("cpu")`` in Lightning's fp16 plugin
    (Lightning alone would train bf16 here), a binding clip, fused AdamW (what CUDA picks) or
    not. A fused optimizer unscales inside its step, so the bare side must unscale right
    after the backward, as ``GPTLightningModule`` does, or it clips scaled gradients.

    Mutation caught: the bare side's ``optimizer_step`` override removed (fused: the losses
    part from step 2 on)."""
    import torch
    from lightning.pytorch.plugins.precision import MixedPrecision

    from nanolab.bench.plain_loop import train, train_lightning

    config = _with(resolved_tiny, {"trainer": {"gradient_clip_val": 0.01},
                                   "model": {"optimizer": {"fused": fused}}})  # fmt: skip
    cpu = torch.device("cpu")
    plain = train(config, 8, cpu, precision="16-mixed")
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    bare = train_lightning(config, 8, cpu, precision_plugin=plugin)
    assert plugin.scaler is not None and plugin.scaler.get_scale() > 1  # it really scaled
    for (step, expected), (_, got) in zip(plain["losses"], bare["losses"], strict=True):
        # fp16 rounds in a different order in the two loops: ~3e-6 apart; the bug: ~1e-2
        assert got == pytest.approx(expected, rel=2e-5), step


REFUSED = {
    "data.align": ["--set=--data.align=document"],
    "data.datasets": ['--set=--data.datasets=[{"dir": "data/a", "weight": 1}]'],
    "model.init_from": ["--set=--model.init_from=models/gpt2"],
    "model.freeze": ["--set=--model.freeze.embeddings=true"],
    "trainer.devices": ["--set=--trainer.devices=2"],
    "model.class_path": ["--set=--model=smoothed_lm.SmoothedGPT"],
    "trainer.strategy": ["--set=--trainer.strategy=ddp"],
    "trainer.fast_dev_run": ["--set=--trainer.fast_dev_run=3"],
    "trainer.profiler": ["--config", str(QUICKSTART.parent / "debug" / "profile.yaml")],
    "trainer.callbacks": ["--config", str(QUICKSTART.parent / "debug" / "overfit.yaml")],
    "checkpoint.every_n_minutes": ["--set=--checkpoint.every_n_minutes=30"],
    "checkpoint.save_on_best": ["--set=--checkpoint.save_on_best=true"],
    "checkpoint.async_save": ["--set=--checkpoint.async_save=true"],
}


@pytest.mark.parametrize("field", list(REFUSED))
def test_bench_refuses_what_the_plain_loop_would_not_train_the_same_way(
    field, tmp_path, monkeypatch, capsys
):
    """A mixture, document-aligned windows, pretrained or frozen weights, several devices, a
    strategy, a debug mode, the user's callbacks, saves by time, on a new best or in the
    background, or a fork's own module: the plain loop would time other work, so the ratio
    would not be nanolab's overhead. One line naming the setting and the fix, exit 2, before
    any run."""
    from nanolab.bench.harness import main

    (tmp_path / "smoothed_lm.py").write_text(
        "from nanolab.training.module import GPTLightningModule\n\n\n"
        "class SmoothedGPT(GPTLightningModule):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    code = main(["--config", str(QUICKSTART), *REFUSED[field]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"nanolab bench: error: {field}: the plain loop "), err[0]
    assert "--set=" in err[0] or "bench" in err[0].split(";", 1)[1]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "configs",
    [
        ["quickstart.yaml"],
        ["gpt2-124m.yaml"],
        ["gpt2-124m.yaml", "gpt2-350m.yaml"],
        ["gpt2-124m.yaml", "gpt2-774m.yaml"],
        *([["gpt2-124m.yaml", f"precision/{p}.yaml"] for p in ("bf16", "fp16", "fp32")]),
    ],
)
def test_bench_takes_every_shipped_recipe_on_one_device(configs):
    """No false refusal: the recipes a user benches (alone, composed, with each precision)."""
    from nanolab.bench.harness import resolve_benchmarked

    paths = [str(QUICKSTART.parent / c) for c in configs]
    overrides = ["--data.source", "null", "--trainer.devices", "1"]
    assert resolve_benchmarked(paths, overrides, 10).world_size == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set=--run.name=foo"], "--set --run.name: the bench sets it"),
        (["--set=--trainer.max_steps=10"], "use --steps"),
        (["--warmup", "-1"], "--warmup must be >= 0"),
        (["--steps", "5", "--warmup", "5"], "--steps must exceed --warmup + 1"),
        (["--set=--nonsense.key=3"], "unknown setting --nonsense.key"),
        (["--set=--model.gpt.n_layer=abc"], "model.gpt.n_layer"),
        (["--set=--model.gpt.n_head=3"], "n_head"),
        (["--set=--model.gpt.n_layer"], "give one fit setting and its value"),
        (["--set=model.gpt.n_layer=2"], "give one fit setting and its value"),
    ],
)
def test_bench_options_that_cannot_work_are_one_line(args, message, capsys) -> None:
    """A --set of what the bench sets itself ended in a StopIteration traceback (run.name) or
    a run measured on other steps (exit 1); a negative warm-up was taken. A --set fit refuses
    (unknown key, wrong type, a head count that does not divide the width, no value) passed
    the up-front check, so the first side's run failed and printed its error three times,
    exit 1."""
    from nanolab.bench import main

    assert main(["--config", str(QUICKSTART), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_bench_set_takes_both_spellings() -> None:
    """``--set '--key value'``, the form the help showed, was split on ``=`` only and refused
    as an unknown setting ``--model.gpt.n_layer 2``."""
    from nanolab.bench.harness import resolve_benchmarked, set_pair

    assert set_pair("--model.gpt.n_layer 2") == ("--model.gpt.n_layer", "2")
    assert set_pair("--model.gpt.n_layer=2") == ("--model.gpt.n_layer", "2")
    assert set_pair('--data.datasets=[{"dir": "a=b"}]')[1] == '[{"dir": "a=b"}]'
    assert set_pair("--data.dataset_dir data/a=b") == ("--data.dataset_dir", "data/a=b")
    assert set_pair("--run.eval_every_steps=5 0")[1] == "5 0"
    resolved = resolve_benchmarked(
        [str(QUICKSTART)], [*set_pair("--model.gpt.n_layer 2"), "--data.source", "null"], 10
    )
    assert resolved.world_size == 1


def test_the_predicted_peak_is_the_cpu_rules_where_no_gpu_is_visible():
    """A CPU run has the estimator's prediction too (its CPU rules), so the bench and the GPU
    check's dry run carry a figure instead of None. Mutation caught: returning None without
    CUDA, as the bench did, leaves the dry run's memory checks with no prediction."""
    import torch
    import yaml

    from nanolab.bench.harness import predicted_peak_bytes
    from nanolab.estimator import estimate_from_config

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the GPU's rules apply")
    path = REPO / "tests" / "fixtures" / "estimator_gpt2_124m.yaml"
    expected = estimate_from_config(yaml.safe_load(path.read_text()), device="cpu", devices=1)
    assert predicted_peak_bytes(path) == expected.memory.peak_allocated > 0


@pytest.mark.slow  # a bench and its fit to start (~45 s on 2 loaded cores) and stop (~10 s)
def test_a_bench_stopped_by_sigterm_stops_its_side_and_removes_its_runs(tmp_path, char_dataset):
    """SIGTERM to the bench alone (``kill PID``, a scheduler's stop) while its nanolab side
    trained: the bench died at once (exit 143, no line) and its child ``fit`` went on as an
    orphan, training and saving into the bench's temporary folder, which was never removed.
    Now the side is stopped and waited for, the folder removed, and the bench says so in one
    line, exit 143."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from nanolab.processes import pid_alive, read_lock_holder

    temp = tmp_path / "tmp"
    temp.mkdir()
    cfg = tiny_overrides(char_dataset, tmp_path / "unused", run__eval_every_steps=1000)
    config = write_config(tmp_path / "tiny.yaml", cfg)
    env = {**os.environ, "TMPDIR": str(temp), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    bench = subprocess.Popen(
        [sys.executable, "-m", "nanolab", "bench", "--config", str(config), "--steps", "100000",
         "--warmup", "4", "--rounds", "1", "--no-import-time", "--no-count-syncs"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        child, deadline = None, time.monotonic() + 240
        while child is None and bench.poll() is None and time.monotonic() < deadline:
            for lock in temp.glob("nanolab-bench-*/runs/bench-0/.nanolab.lock"):
                log = lock.parent / "metrics.jsonl"
                if log.exists() and '"event": "train"' in log.read_text().replace('":"', '": "'):
                    child = (read_lock_holder(lock) or {}).get("pid")
            time.sleep(0.2)
        assert child and pid_alive(child), "the nanolab side never started training"
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.communicate()
    lines = [line for line in err.splitlines() if line.startswith("nanolab bench")]
    assert bench.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err[-3000:]
    assert lines[-1].startswith("nanolab bench: terminated; "), err[-3000:]
    alive = pid_alive(child)
    if alive:
        os.kill(child, signal.SIGKILL)
    assert not alive, "the bench's nanolab side was left running"
    assert list(temp.glob("nanolab-bench-*")) == []  # its temporary runs went with it
