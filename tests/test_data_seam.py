"""The data seam: a forked dataset of pre-tokenized windows with a loss mask trains like nanolab's.

The fork's module is written here as a fork would write it (a :class:`WindowDataModule` subclass
with a two-method :class:`WindowSource`), selected by class path on the real ``fit`` command
line. Checked: the masked positions carry no loss (the module's loss equals cross-entropy over
the unmasked targets only), validation logs bits per byte from the source's bytes per token,
the order of windows is a pure function of (seed, micro-batch, rank) with 2 ranks seeing what 2
accumulated micro-batches see, a changed dataset is refused on resume, and (slow) a run stopped
by SIGTERM and resumed ends with the very weights of a run never stopped.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import QUICKSTART, run_nanolab, tiny_overrides, write_config

from nanolab.cli import main
from nanolab.data.checks import DataChangedError
from nanolab.data.windowed import IndexPlan, WindowDataModule
from nanolab.runlog import read_records

BLOCK, PROMPT = 32, 8

FORK = '''
"""A fork's dataset: fixed windows of ids in .npy files; the first ``prompt`` targets of every
window carry no loss (y = -1), as an instruction-tuning set masks its prompts."""

import numpy as np
import torch

from nanolab.data.windowed import WindowDataModule


class Windows:
    def __init__(self, path, prompt, bytes_per_token):
        self.ids = np.load(path, mmap_mode="r")  # (windows, block_size + 1)
        self.prompt = prompt
        self.bytes_per_token = bytes_per_token

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, indices):
        chunk = torch.from_numpy(np.asarray(self.ids[np.sort(indices)], dtype=np.int64))
        order = np.argsort(np.argsort(indices))  # the rows in the order asked for
        chunk = chunk[torch.from_numpy(order)]
        x, y = chunk[:, :-1], chunk[:, 1:].clone()
        y[:, : self.prompt] = -1
        return x, y


class PackedWindows(WindowDataModule):
    vocab_size = 71
    masked_targets = True  # y = -1 on the prompt: each step averages over the targets it holds

    def __init__(self, folder: str, prompt: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.folder, self.prompt = folder, prompt

    def train_split(self):
        return Windows(f"{self.folder}/train.npy", self.prompt, None)

    def val_split(self):
        return Windows(f"{self.folder}/val.npy", self.prompt, 1.0)  # chars: one byte a token
'''


def _windows(char_dataset: Path, out: Path) -> Path:
    """Pre-tokenized windows of BLOCK + 1 ids cut from the prepared character corpus."""
    meta = json.loads((char_dataset / "meta.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        ids = np.fromfile(char_dataset / f"{split}.bin", dtype=meta["dtype"]).astype(np.int64)
        n = len(ids) // (BLOCK + 1)
        windows = ids[: n * (BLOCK + 1)].reshape(n, BLOCK + 1)
        np.save(out / f"{split}.npy", windows[:2000] if split == "train" else windows[:64])
    return out


@pytest.fixture
def fork(tmp_path: Path, char_dataset: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    package = tmp_path / "forkdata"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "data.py").write_text(textwrap.dedent(FORK))
    monkeypatch.syspath_prepend(str(tmp_path))
    tests = str(Path(__file__).resolve().parent)  # cli_probes, for the stopped run
    path = os.pathsep.join(p for p in (str(tmp_path), tests, os.environ.get("PYTHONPATH")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
    folder = _windows(char_dataset, tmp_path / "windows")
    cfg = tiny_overrides(char_dataset, tmp_path / "runs")
    cfg["data"] = {
        "class_path": "forkdata.data.PackedWindows",
        "init_args": {"folder": str(folder), "prompt": PROMPT, "micro_batch_size": 4},
    }
    cfg["trainer"].update({"accelerator": "cpu", "devices": 1, "precision": "32-true"})
    yield {"config": write_config(tmp_path / "fork.yaml", cfg), "folder": folder, "cfg": cfg}
    for name in [m for m in sys.modules if m.startswith("forkdata")]:
        del sys.modules[name]


def _fit(config: Path, *args: str) -> int:
    try:
        return main(["fit", "--config", str(QUICKSTART), "--config", str(config), *args])
    except SystemExit as exit_:
        return int(exit_.code or 0)


def test_a_masked_window_dataset_trains_and_logs_bits_per_byte(fork: dict, tmp_path: Path, capsys):
    assert _fit(fork["config"]) == 0
    assert "masked_targets" not in capsys.readouterr().err  # declared: no warning
    records = read_records(tmp_path / "runs" / "tiny" / "metrics.jsonl")
    vals = [r for r in records if r.get("event") == "val"]
    assert vals and all(np.isfinite(r["val_loss"]) for r in vals)
    # One byte a token: bits per byte = nats per token / ln 2.
    assert vals[-1]["val_bpb"] == pytest.approx(vals[-1]["val_loss"] / np.log(2), rel=1e-5)
    assert records[-1]["event"] == "end" and records[-1]["reason"] == "completed"


def test_declared_masks_under_deepspeed_are_refused_before_the_run(
    fork: dict, tmp_path: Path, capsys
):
    """DeepSpeed steps its own gradients: the step's average over targets cannot reach them,
    so a fit of a data module declaring masked targets is one line, exit 2, no run written."""
    code = _fit(fork["config"], "--trainer.strategy", "deepspeed_stage_2")
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    lines = [line for line in err.splitlines() if "masked_targets" in line]
    assert len(lines) == 1 and "ddp or fsdp" in lines[0], err[-2000:]
    assert "Traceback" not in err
    assert not (tmp_path / "runs" / "tiny" / "metrics.jsonl").exists()


def test_masks_a_fork_does_not_declare_are_one_warning_line(
    fork: dict, monkeypatch: pytest.MonkeyPatch, capsys
):
    """nanolab's own data never masks (the attribute a fork inherits is False); a fork that
    masks without saying so trains on, told once, in one line, what to set."""
    from forkdata.data import PackedWindows

    from nanolab.data.datamodule import TokenDataModule

    assert TokenDataModule.masked_targets is False and WindowDataModule.masked_targets is False
    monkeypatch.setattr(PackedWindows, "masked_targets", False)
    assert _fit(fork["config"], "--trainer.max_steps", "3") == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "masked_targets" in line]
    assert lines == [
        "nanolab fit: warning: forkdata.data.PackedWindows's training batches hold masked "
        "targets (y = -1) it does not declare; set masked_targets = True on "
        "forkdata.data.PackedWindows, so each optimizer step averages its loss and gradient "
        "over its targets (micro-batch 8 = 4 x accumulation 2) and a micro-batch whose targets "
        "are all -1 adds 0 instead of NaN"
    ]


def test_masked_targets_carry_no_loss(fork: dict):
    from forkdata.data import PackedWindows

    from nanolab.model import GPT, GPTConfig

    data = PackedWindows(str(fork["folder"]), prompt=PROMPT, micro_batch_size=4, block_size=BLOCK)
    data.setup("fit")
    x, y = data.train_source[np.array([3, 1, 2])]
    assert (y[:, :PROMPT] == -1).all() and (y[:, PROMPT:] >= 0).all()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=71, block_size=BLOCK, n_layer=1, n_head=2, n_embd=16))
    with torch.no_grad():  # far from uniform predictions, so each target's loss differs
        for p in model.parameters():
            p.mul_(30)
    logits, loss = model(x, y)
    v = logits.size(-1)  # the padded vocabulary
    unmasked = F.cross_entropy(logits[:, PROMPT:].reshape(-1, v), y[:, PROMPT:].reshape(-1))
    assert float(loss) == pytest.approx(float(unmasked), rel=1e-6)
    everything = F.cross_entropy(
        logits.reshape(-1, v), torch.cat([x[:, 1 : PROMPT + 1], y[:, PROMPT:]], 1).reshape(-1)
    )
    assert abs(float(loss) - float(everything)) > 0.05  # the mask mattered


def test_the_order_is_a_function_of_seed_step_and_rank():
    one = IndexPlan(num_windows=101, micro_batch_size=4, world_size=1, seed=7)
    two = IndexPlan(num_windows=101, micro_batch_size=4, world_size=2, seed=7)
    for step in range(12):  # 2 ranks at step k = micro-batches 2k and 2k+1 of one device
        ranks = np.concatenate([two.batch_starts(step, 0), two.batch_starts(step, 1)])
        accumulated = np.concatenate(
            [one.batch_starts(2 * step, 0), one.batch_starts(2 * step + 1, 0)]
        )
        assert sorted(ranks) == sorted(accumulated)
    again = IndexPlan(num_windows=101, micro_batch_size=4, world_size=1, seed=7)
    assert np.array_equal(one.batch_starts(30, 0), again.batch_starts(30, 0))
    other = IndexPlan(num_windows=101, micro_batch_size=4, world_size=1, seed=8)
    assert not np.array_equal(one.batch_starts(0, 0), other.batch_starts(0, 0))
    epoch = np.concatenate([one.batch_starts(g, 0) for g in range(one.batches_per_epoch)])
    assert len(set(epoch.tolist())) == len(epoch)  # every window at most once an epoch


def test_a_changed_dataset_is_refused_on_resume(fork: dict):
    from forkdata.data import PackedWindows

    data = PackedWindows(str(fork["folder"]), micro_batch_size=4, block_size=BLOCK)
    saved = data.state_dict()
    data.load_state_dict(saved)  # the same data: fine
    with pytest.raises(DataChangedError, match="now holds 2000 windows"):
        data.load_state_dict({**saved, "train_windows": 1999})


def test_a_window_of_the_wrong_length_is_one_line(fork: dict, capsys):
    code = _fit(fork["config"], "--model.gpt.block_size", "16")
    assert code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert len(err) == 1 and "windows of 32 tokens but block_size is 16" in err[0], err


def test_more_validation_windows_than_the_split_holds_says_so_once(fork: dict, capsys):
    """The fork's val split holds 64 windows: asking for 100 scored those 64 without a word."""
    from forkdata.data import PackedWindows

    capsys.readouterr()
    PackedWindows(str(fork["folder"]), micro_batch_size=4, val_windows=100).check_fits(1)
    assert capsys.readouterr().err.splitlines() == [
        "nanolab: warning: PackedWindows: data.val_windows 100 asks for more validation windows "
        "than its validation split holds (64): each evaluation scores all 64; set "
        "data.val_windows 64 to say what is scored, or give the split more text"
    ]
    PackedWindows(str(fork["folder"]), micro_batch_size=4, val_windows=64).check_fits(1)
    assert capsys.readouterr().err == ""


def test_the_base_class_names_what_a_subclass_must_give():
    with pytest.raises(NotImplementedError, match="train_split"):
        WindowDataModule().train_split()


@pytest.mark.slow
def test_a_stopped_and_resumed_window_run_ends_with_the_same_weights(fork: dict, tmp_path: Path):
    cfg = fork["cfg"]
    cfg["trainer"]["max_steps"] = 8
    cfg["checkpoint"] = {"every_n_steps": 2}
    straight = write_config(tmp_path / "straight.yaml", {**cfg, "run": {**cfg["run"], "name": "straight"}})  # fmt: skip
    stopped = write_config(tmp_path / "stopped.yaml", {**cfg, "run": {**cfg["run"], "name": "stopped"}})  # fmt: skip
    args = ["--config", str(QUICKSTART)]
    done = run_nanolab("fit", *args, "--config", str(straight), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    signal = ["--trainer.callbacks+=cli_probes.SignalAt", "--trainer.callbacks.step", "5"]
    first = run_nanolab("fit", *args, "--config", str(stopped), *signal, cwd=tmp_path)
    assert first.returncode == 75, first.stderr[-2000:]
    second = run_nanolab("fit", *args, "--config", str(stopped), cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    start = read_records(tmp_path / "runs" / "stopped" / "metrics.jsonl", "start")[-1]
    assert 0 < start["resumed_from_step"] < 8  # stopped mid-run, resumed from its checkpoint

    def weights(run: str) -> dict:
        path = tmp_path / "runs" / run / "checkpoints" / "last.ckpt"
        return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]

    a, b = weights("straight"), weights("stopped")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
