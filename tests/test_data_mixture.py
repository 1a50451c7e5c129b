"""Mixtures (``data.datasets``): windows drawn by weight, a pure function of (seed, micro-batch,
rank), so exact resume and the DDP = gradient accumulation identity hold as for one dataset."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import QUICKSTART, run_nanolab
from test_data_checks import TEXT, fit_config, fit_in_process, write_dataset

from nanolab.data.datamodule import TokenDataModule
from nanolab.data.windows import DataTooSmallError, MixturePlan, ResumableBatchSampler
from nanolab.runlog import read_records
from nanolab.training.resume import find_resume_checkpoint

CODE = "def step(model, batch):\n    loss = model(batch).mean()\n    return loss.backward()\n"


def two_datasets(tmp_path: Path, code_weight: float = 0.25) -> list[dict]:
    """Prose and code, both byte-tokenized (one tokenizer, as a mixture needs)."""
    write_dataset(tmp_path / "prose", TEXT * 60, TEXT * 10)
    write_dataset(tmp_path / "code", CODE * 40, CODE * 8)
    return [
        {"path": str(tmp_path / "prose"), "weight": 1 - code_weight},
        {"path": str(tmp_path / "code"), "weight": code_weight},
    ]


def mixture(weights=(0.8, 0.2), sizes=(5000, 3000), world=1, B=4, seed=3) -> MixturePlan:
    return MixturePlan(list(sizes), list(weights), 16, B, world, seed)


# -- the order --------------------------------------------------------------------------------
@pytest.mark.parametrize("weights", [(0.8, 0.2), (0.5, 0.3, 0.2), (1, 1, 1, 7)])
def test_weights_hold_over_every_stretch_of_the_stream(weights):
    plan = mixture(weights, sizes=(4000,) * len(weights))
    shares = np.array(weights) / sum(weights)
    counts = np.zeros(len(weights))
    for slot in range(3000):
        d, k = plan.slot_source(slot)
        assert k == counts[d]  # the k-th slot of dataset d is window k of its own stream
        counts[d] += 1
        # Stratified, not dice: after n slots each dataset is within a slot or two of its share.
        assert np.all(np.abs(counts - shares * (slot + 1)) < len(weights))


def test_every_step_of_32_windows_gets_6_or_7_at_weight_0_2():
    # docs/data.md: "6 or 7 code windows at weight 0.2, never 2 or 12", on one device or two.
    for world, B in ((1, 32), (2, 16)):
        plan = mixture(world=world, B=B)
        for step in range(200):
            rows = np.concatenate([plan.batch_starts(step, r) for r in range(world)])
            assert int((rows[:, 0] == 1).sum()) in (6, 7)


def test_each_dataset_visits_every_window_once_per_epoch():
    plan = mixture(sizes=(800, 500))
    seen: dict[int, list[int]] = {0: [], 1: []}
    for g in range(40):
        for d, start in plan.batch_starts(g, 0):
            seen[int(d)].append(int(start))
    for d, starts in seen.items():
        per_epoch = plan.plans[d].num_windows
        first_epoch = starts[:per_epoch]
        assert len(starts) > per_epoch  # the test crosses an epoch of both datasets
        assert len(set(first_epoch)) == len(first_epoch)  # without replacement
        assert max(starts) + 16 + 1 <= (800, 500)[d]


def test_the_order_is_a_pure_function_of_seed_micro_batch_and_rank():
    a, b = mixture(), mixture()
    for g in (0, 7, 300):
        for r in (0, 1):
            assert np.array_equal(a.batch_starts(g, r), b.batch_starts(g, r))
    other = mixture(seed=4)
    assert not np.array_equal(a.batch_starts(0, 0), other.batch_starts(0, 0))
    # A resumed sampler continues exactly where the uninterrupted one was.
    full = [x for _, x in zip(range(120), ResumableBatchSampler(mixture(), 0, 0), strict=False)]
    tail = [x for _, x in zip(range(70), ResumableBatchSampler(mixture(), 0, 50), strict=False)]
    assert all(np.array_equal(x, y) for x, y in zip(full[50:], tail, strict=True))


def test_one_step_of_two_ranks_is_two_accumulated_micro_batches():
    single, double = mixture(world=1), mixture(world=2)
    for step in range(20):
        accumulated = np.concatenate([single.batch_starts(2 * step + i, 0) for i in range(2)])
        ranks = np.concatenate([double.batch_starts(step, r) for r in range(2)])
        assert sorted(map(tuple, accumulated)) == sorted(map(tuple, ranks))
        assert not set(map(tuple, double.batch_starts(step, 0))) & set(
            map(tuple, double.batch_starts(step, 1))
        )


def _order_as_it_always_was(weights) -> list[tuple[int, int]]:
    """The split of the slots before weights were normalised first: each weight as a fraction
    (denominator up to 10^6), then normalised. A running job resumes in this order."""
    from fractions import Fraction

    fractions = [Fraction(w).limit_denominator(1_000_000) for w in weights]
    shares = [f / sum(fractions) for f in fractions]
    split, left = [], Fraction(1)
    for share in shares[:-1]:
        q = share / left
        split.append((q.numerator, q.denominator))
        left -= share
    return split


@pytest.mark.parametrize(
    "weights",
    [(0.7, 0.3), (1, 2), (3, 1), (0.8, 0.1, 0.1), (0.5, 0.3, 0.2), (1, 1, 1, 7),
     (0.123457, 0.876544), (1 / 3, 2 / 3), (2.5e-3, 7.5e-3)],
)  # fmt: skip
def test_ordinary_weights_keep_the_order_they_always_had(weights):
    plan = mixture(weights, sizes=(4000,) * len(weights))
    assert plan._split == _order_as_it_always_was(weights)


@pytest.mark.parametrize(
    ("weights", "same_as"),
    [((6.0e-7, 1.2e-6), (1, 2)), ((1e-9, 3e-9), (1, 3)), ((1e308, 1e308), (1, 1))],
)
def test_weights_train_their_ratio_whatever_their_scale(weights, same_as):
    """Tiny weights were each rounded to a fraction of denominator 10^6 before normalising
    (6e-7 and 1.2e-6 trained 45.5/54.5, not 1/3, 2/3); the ratio is what trains now."""
    plan, ratio = mixture(weights), mixture(same_as)
    assert plan.shares == ratio.shares
    assert [plan.slot_source(s) for s in range(500)] == [ratio.slot_source(s) for s in range(500)]


def test_the_validation_average_of_huge_weights_is_the_ratio(tmp_path):
    """Weights whose sum overflows (1e308 twice) weigh validation as 1:1 (it divided by zero)."""
    datasets = [dict(d, weight=1e308) for d in two_datasets(tmp_path)]
    dm = TokenDataModule(datasets=datasets, micro_batch_size=4, block_size=16, val_windows=4)
    dm.setup("validate")
    dm.val_dataloader()
    assert [s.loss_weight for s in dm.eval_scales] == [1.0, 1.0]
    assert all(math.isfinite(s.overall_bpb) for s in dm.eval_scales)


def test_a_dataset_too_small_for_one_window_is_named():
    with pytest.raises(DataTooSmallError, match=r"dataset b: .*fewer than one block"):
        MixturePlan([5000, 10], [1, 1], 16, 4, 1, 0, names=["a", "b"])


def test_batches_hold_the_windows_the_plan_names(tmp_path):
    datasets = two_datasets(tmp_path)
    dm = TokenDataModule(datasets=datasets, micro_batch_size=8, block_size=16, val_windows=4)
    dm.setup("fit")
    loader = dm.train_dataloader()
    plan = dm.train_sampler.plan
    bins = [np.fromfile(Path(d["path"]) / "train.bin", dtype=np.uint16) for d in datasets]
    from_code = 0
    for g, (x, y) in zip(range(25), loader, strict=False):
        rows = plan.batch_starts(g, 0)
        for (d, start), xi, yi in zip(rows, x.numpy(), y.numpy(), strict=True):
            assert np.array_equal(xi, bins[d][start : start + 16])
            assert np.array_equal(yi, bins[d][start + 1 : start + 17])
        from_code += int((rows[:, 0] == 1).sum())
    assert from_code == 25 * 8 // 4  # weight 0.25, exactly
    # Validation batches come one dataset at a time, labelled with it.
    labels = [batch[2] for batch in dm.val_dataloader()]
    assert labels == [0, 1]


# -- configuration errors: one line, exit 2 ---------------------------------------------------
def _mixture_error(tmp_path, capsys, data: dict) -> str:
    code, err = fit_in_process(capsys, fit_config(tmp_path, data))
    errors = [line for line in err if line.startswith("nanolab")]
    assert code == 2 and len(errors) == 1, err
    assert not (tmp_path / "runs").exists()
    return errors[0]


def test_datasets_with_different_tokenizers_are_refused(tmp_path, capsys):
    datasets = two_datasets(tmp_path)
    write_dataset(tmp_path / "code", CODE * 40, CODE * 8, tokenizer="chars")
    line = _mixture_error(tmp_path, capsys, {"datasets": datasets})
    assert "different tokenizers (bytes, vocab 256 vs chars, vocab" in line
    assert "same --tokenizer" in line


def test_chars_datasets_of_different_texts_are_refused(tmp_path, capsys):
    write_dataset(tmp_path / "a", TEXT * 60, TEXT * 10, tokenizer="chars")
    write_dataset(tmp_path / "b", CODE * 40, CODE * 8, tokenizer="chars")
    datasets = [{"path": str(tmp_path / "a")}, {"path": str(tmp_path / "b")}]
    line = _mixture_error(tmp_path, capsys, {"datasets": datasets})
    assert "different tokenizers" in line


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"source": ["bundled:shakespeare"]}, "set data.source to null"),
        ({"datasets": [{"path": "x", "wieght": 1}]}, "unknown key(s) wieght"),
        (
            {"datasets": [{"path": "x", "weight": 0}]},
            "data.datasets[0].weight must be a number > 0",
        ),
        ({"datasets": [{"path": "x", "weight": float("nan")}]}, "weight must be a number > 0"),
        ({"datasets": []}, "data.datasets must list prepared folders"),
        ({"datasets": [{"path": "a/web"}, {"path": "b/web"}]}, "two datasets are named 'web'"),
        ({"datasets": [{"path": "missing"}]}, "data.datasets[0].path missing holds no prepared"),
        (
            {"datasets": [{"path": "x", "weight": 1e-320}, {"path": "y", "weight": 1}]},
            "data.datasets[0].weight 1e-320 is a share of 1e-320 of the weights' total, below",
        ),
        (
            {"datasets": [{"path": "x", "weight": 1e300}, {"path": "y", "weight": 1e-300}]},
            "data.datasets[1].weight 1e-300 is a share of 0 of the weights' total, below 1e-06",
        ),
    ],
)
def test_bad_mixture_settings(tmp_path, capsys, change, message):
    data = {"datasets": two_datasets(tmp_path), **change}
    assert message in _mixture_error(tmp_path, capsys, data)


# -- training on a mixture --------------------------------------------------------------------
def test_a_mixture_trains_and_logs_each_dataset(tmp_path, capsys):
    datasets = two_datasets(tmp_path)
    datasets[1]["name"] = "py"
    code, err = fit_in_process(capsys, fit_config(tmp_path, {"datasets": datasets}))
    assert code == 0, err[-20:]
    val = read_records(tmp_path / "runs" / "tiny" / "metrics.jsonl", "val")
    assert [r["step"] for r in val] == [2, 4]
    for r in val:
        prose, py = r["val/prose/loss"], r["val/py/loss"]
        # The overall figures are mixture-weighted (0.75 / 0.25), not an average of windows.
        assert r["val_loss"] == pytest.approx(0.75 * prose + 0.25 * py, rel=1e-5)
        # Byte tokenizer, no end-of-text: one token per byte, so bpb = nats / ln 2 everywhere.
        assert r["val/prose/bpb"] == pytest.approx(prose / math.log(2), rel=1e-6)
        assert r["val/py/bpb"] == pytest.approx(py / math.log(2), rel=1e-6)
        assert r["val_bpb"] == pytest.approx(r["val_loss"] / math.log(2), rel=1e-6)
    ckpt = torch.load(
        tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt", weights_only=True, mmap=True
    )
    fp = ckpt["TokenDataModule"]["data_fingerprint"]["datasets"]
    assert [(d["name"], d["weight"]) for d in fp] == [("prose", 0.75), ("py", 0.25)]
    assert ckpt["nanolab"]["tokenizer"]["name"] == "bytes"  # generate needs only the checkpoint


def test_served_counts_each_datasets_windows_as_the_stream_gives_them():
    plan = mixture((0.5, 0.3, 0.2), sizes=(4000, 3000, 2000))
    counts = [0, 0, 0]
    for slot in range(700):
        assert plan.served(slot) == counts
        counts[plan.slot_source(slot)[0]] += 1


def test_a_mixture_says_which_dataset_repeats_though_its_epoch_is_below_one(tmp_path, capsys):
    """A small dataset at a large share goes round its windows more than once while the
    ``epoch`` (windows served over every dataset's windows together) is still below 1: the
    banner said nothing of it. It now names the dataset repeated most and its own passes, and
    the end record gives each dataset's (``dataset_passes``), as the stream serves them."""
    datasets = two_datasets(tmp_path, code_weight=0.75)
    steps, micro = 40, 4
    config = fit_config(
        tmp_path,
        {"datasets": datasets},
        trainer={"max_steps": steps},
        run={"eval_every_steps": 20},
        checkpoint={"every_n_steps": 20},
    )
    code, err = fit_in_process(capsys, config)
    assert code == 0, err[-20:]
    log = tmp_path / "runs" / "tiny" / "metrics.jsonl"
    plan = MixturePlan(
        [json.loads((Path(d["path"]) / "meta.json").read_text())["train_tokens"] for d in datasets],
        [d["weight"] for d in datasets], 32, micro, 1, 0,
    )  # fmt: skip
    served = [0, 0]
    for slot in range(steps * micro):  # the stream itself, slot by slot
        served[plan.slot_source(slot)[0]] += 1
    own = [served[i] / plan.plans[i].num_windows for i in range(2)]
    assert own[1] > 1 and read_records(log, "train")[-1]["epoch"] < 1  # the case at hand
    end = read_records(log, "end")[-1]
    assert end["dataset_passes"] == {
        d["path"]: pytest.approx(p, abs=1e-4) for d, p in zip(datasets, own, strict=True)
    }
    said = f"the data repeats: {own[1]:.3g} passes over {datasets[1]['path']}'s"
    assert said in fit_in_process.stdout, fit_in_process.stdout


# -- exact resume on a mixture (the single-dataset version: test_resume_exact.py) ------------
STEPS, ACCUMULATE = 10, 2


def _exact_config(tmp_path: Path) -> Path:
    cfg = {
        "seed_everything": 1234,
        "run": {"root": str(tmp_path / "runs"), "global_batch_tokens": 4 * 32 * ACCUMULATE,
                "eval_every_steps": 4},
        "trainer": {"accelerator": "cpu", "devices": 1, "precision": "32-true",
                    "max_steps": STEPS, "enable_progress_bar": False,
                    "enable_model_summary": False},
        "checkpoint": {"every_n_steps": 1, "keep_last": 3},
        "model": {"gpt": {"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32,
                          "dropout": 0.2},
                  "optimizer": {"lr": 3.0e-3}, "schedule": {"warmup_steps": 3}},
        "data": {"source": None, "datasets": two_datasets(tmp_path, 0.3),
                 "micro_batch_size": 4, "val_windows": 4},
    }  # fmt: skip
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _launch(cfg: Path, name: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    cmd = [sys.executable, "-m", "nanolab", "fit", "--config", str(cfg), "--run.name", name]
    log = open(cfg.parent / f"{name}.log", "a")  # noqa: SIM115 (the child keeps it open)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cfg.parent)


def _final(run_dir: Path) -> dict:
    choice = find_resume_checkpoint(run_dir)
    assert choice.chosen is not None and choice.chosen.step == STEPS, choice
    return torch.load(choice.chosen.path, map_location="cpu", weights_only=True)


@pytest.mark.slow  # 30-100 s on 2 cores; `pytest -m slow`
def test_kill_and_resume_a_mixture_run_is_bit_identical(tmp_path):
    import time

    cfg = _exact_config(tmp_path)
    runs = tmp_path / "runs"
    reference = _launch(cfg, "reference")
    proc = _launch(cfg, "killed")
    deadline = time.monotonic() + 240
    while not list((runs / "killed" / "checkpoints").glob("step-0000000[3-9].ckpt")):
        assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    resumed = _launch(cfg, "killed")
    assert resumed.wait(timeout=300) == 0, (tmp_path / "killed.log").read_text()[-2000:]
    assert reference.wait(timeout=300) == 0, (tmp_path / "reference.log").read_text()[-2000:]

    a, b = _final(runs / "reference"), _final(runs / "killed")
    for key, tensor in a["state_dict"].items():
        assert torch.equal(tensor, b["state_dict"][key]), key
    for i, state in a["optimizer_states"][0]["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(
                b["optimizer_states"][0]["state"][i][key]))  # fmt: skip
    log_a, log_b = (read_records(runs / n / "metrics.jsonl") for n in ("reference", "killed"))
    starts = [r for r in log_b if r["event"] == "start"]
    assert len(starts) == 2 and starts[1]["resumed_from_step"] >= 3
    train_a = {r["step"]: r["loss"] for r in log_a if r["event"] == "train"}
    train_b = {r["step"]: r["loss"] for r in log_b if r["event"] == "train"}
    assert train_a == train_b and sorted(train_a) == list(range(1, STEPS + 1))
    val_a = {r["step"]: (r["val/prose/loss"], r["val/code/loss"]) for r in log_a
             if r["event"] == "val"}  # fmt: skip
    val_b = {r["step"]: (r["val/prose/loss"], r["val/code/loss"]) for r in log_b
             if r["event"] == "val"}  # fmt: skip
    assert val_a == val_b and sorted(val_a) == [4, 8, STEPS]  # the last step is validated too


# -- DDP = accumulation on a mixture (the single-dataset version: test_training.py) ----------
@pytest.mark.slow
def test_ddp_two_processes_match_one_process_with_accumulation_on_a_mixture(tmp_path):
    datasets = two_datasets(tmp_path, 0.4)
    states = {}
    for name, extra in (
        ("single", []),
        ("ddp", ["--config", str(QUICKSTART.parent / "strategy" / "ddp.yaml"),
                 "--trainer.devices", "2"]),
    ):  # fmt: skip
        cfg = fit_config(
            tmp_path,
            {"datasets": datasets},
            trainer={"max_steps": 3, "accelerator": "cpu", "devices": 1},
            run={"name": name, "global_batch_tokens": 4 * 32 * 2, "eval_every_steps": 3},
            checkpoint={"every_n_steps": 3},
            model={"gpt": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32,
                           "dropout": 0.0}},
        )  # fmt: skip
        res = run_nanolab("fit", "--config", str(QUICKSTART), "--config", str(cfg), *extra,
                          cwd=tmp_path, timeout=600)  # fmt: skip
        assert res.returncode == 0, res.stderr[-3000:]
        run = tmp_path / "runs" / name
        states[name] = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
        states[name + "_val"] = read_records(run / "metrics.jsonl", "val")[-1]
    a, b = states["single"]["state_dict"], states["ddp"]["state_dict"]
    for key in a:
        assert torch.allclose(a[key], b[key], atol=2e-5, rtol=1e-4), key
    # Validation splits its windows over the ranks and gathers them back: the same figures.
    for key in ("val_loss", "val_bpb", "val/prose/loss", "val/code/loss"):
        assert states["ddp_val"][key] == pytest.approx(states["single_val"][key], rel=1e-5), key
    assert json.loads(json.dumps(states["ddp"]["TokenDataModule"])) == json.loads(
        json.dumps(states["single"]["TokenDataModule"])
    )


def test_the_queue_accepts_a_mixture_and_refuses_a_missing_folder(tmp_path, capsys, monkeypatch):
    from nanolab.queue.cli import main as queue_main
    from nanolab.queue.db import QueueDB

    monkeypatch.chdir(tmp_path)
    datasets = two_datasets(tmp_path)
    cfg = fit_config(tmp_path, {"datasets": datasets, "dataset_dir": "not/used"})
    db = tmp_path / "q.db"
    assert queue_main(["add", str(cfg), "--db", str(db), "--name", "mix"]) == 0
    assert [j.name for j in QueueDB(db).jobs()] == ["mix"]
    capsys.readouterr()
    missing = [datasets[0], {"path": str(tmp_path / "gone"), "weight": 1}]
    cfg = fit_config(tmp_path, {"datasets": missing})
    assert queue_main(["add", str(cfg), "--db", str(db), "--name", "mix2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.datasets[1].path" in err[0] and "holds no prepared" in err[0]


def test_the_estimator_reads_the_vocabulary_of_the_mixture(tmp_path):
    from nanolab.estimator.setup import resolve_vocab

    datasets = two_datasets(tmp_path)  # bytes: 256 ids
    write_dataset(tmp_path / "other", tokenizer="chars")  # what data.dataset_dir still names
    data = {"dataset_dir": str(tmp_path / "other"), "datasets": datasets}
    assert resolve_vocab({"vocab_size": None}, data) == 256
    assert resolve_vocab({"vocab_size": None}, {"dataset_dir": str(tmp_path / "other")}) < 256
