"""Data preparation, tokenizers and the resumable window order."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from nanolab.data.datamodule import TokenDataModule
from nanolab.data.prepare import PrepareError
from nanolab.data.tokenizers import load_tokenizer
from nanolab.data.windows import (
    DataTooSmallError,
    IndexPlan,
    MixturePlan,
    ResumableBatchSampler,
    WindowPlan,
    epoch_seed,
    rank_share,
    validation_starts,
)

SAMPLE = (
    "ROMEO:\nBut soft, what light through yonder window breaks?\nJuliet — ünïcödé ✓ 日本\n" * 20
)


# -- window order ----------------------------------------------------------------------------
def plan(world=1, n=10_000, T=16, B=4, seed=7) -> WindowPlan:
    return WindowPlan(num_tokens=n, block_size=T, micro_batch_size=B, world_size=world, seed=seed)


def test_an_epoch_is_whole_micro_batches_so_layouts_part_where_one_crosses_it():
    """docs/resume.md said an epoch is a whole number of *global* batches; it is a whole number
    of micro-batches per device (accumulation not counted). 101 windows: micro-batch 2 x
    accumulation 4 has a 100-window epoch (ending inside step 13), 8 x 1 a 96-window one, so the
    same 8-window steps agree for 12 steps and part at the 13th."""
    a, b = plan(n=1633, B=2, seed=3), plan(n=1633, B=8, seed=3)
    assert a.num_windows == 101 and (a.batches_per_epoch, b.batches_per_epoch) == (50, 12)

    def step(p: WindowPlan, accumulate: int, s: int) -> list[int]:
        starts = [p.batch_starts(s * accumulate + i, 0) for i in range(accumulate)]
        return sorted(np.concatenate(starts).tolist())

    assert [step(a, 4, s) == step(b, 1, s) for s in range(13)] == [True] * 12 + [False]
    doc = (Path(__file__).resolve().parents[1] / "docs" / "resume.md").read_text()
    assert "epoch length is a whole number of micro-batches per device" in doc


def test_window_order_is_a_pure_function_of_seed_epoch_position_rank():
    a, b = plan(), plan()
    for g in (0, 5, 200):
        assert np.array_equal(a.batch_starts(g, 0), b.batch_starts(g, 0))
    assert not np.array_equal(plan(seed=8).batch_starts(0, 0), a.batch_starts(0, 0))


def test_each_epoch_visits_every_window_once_across_ranks():
    p = plan(world=2)
    per_epoch = p.batches_per_epoch
    for epoch in range(2):
        starts = np.concatenate(
            [p.batch_starts(epoch * per_epoch + i, r) for i in range(per_epoch) for r in range(2)]
        )
        assert len(np.unique(starts)) == len(starts)  # without replacement
        offset, _ = p.epoch_layout(epoch)
        assert np.all((starts - offset) % p.block_size == 0)
        assert starts.max() + p.block_size + 1 <= p.num_tokens
        assert len(starts) == per_epoch * 2 * p.micro_batch_size
    # Ranks never share a window within a step.
    assert not set(p.batch_starts(3, 0)) & set(p.batch_starts(3, 1))
    # A new epoch is a new order.
    assert not np.array_equal(p.batch_starts(0, 0), p.batch_starts(per_epoch, 0))


def test_a_resumed_sampler_continues_the_uninterrupted_stream():
    p = plan()
    full = ResumableBatchSampler(p, rank=0, start=0)
    stream = [b for _, b in zip(range(400), iter(full), strict=False)]  # crosses epoch borders
    resumed = ResumableBatchSampler(p, rank=0, start=137)
    tail = [b for _, b in zip(range(400 - 137), iter(resumed), strict=False)]
    assert all(np.array_equal(x, y) for x, y in zip(stream[137:], tail, strict=True))


def test_an_epoch_order_takes_four_bytes_a_window_and_is_the_order_runs_always_had():
    """The order is held as int32 (half of int64's memory), and is the very permutation that
    earlier versions held as int64: a run resumed from their checkpoints keeps its order."""
    for num_windows, seed in ((1, 3), (1000, 7), (300_001, 11)):
        p = IndexPlan(num_windows=num_windows, micro_batch_size=1, world_size=1, seed=seed)
        order = p.fresh_layout(2)[1]
        assert order.dtype == np.int32 and order.nbytes == 4 * num_windows
        g = torch.Generator().manual_seed(epoch_seed(seed, 2))
        assert np.array_equal(order, torch.randperm(num_windows, generator=g).numpy())
    w = plan(seed=5)
    offset, order = w.epoch_layout(1)
    g = torch.Generator().manual_seed(epoch_seed(5, 1))
    assert offset == int(torch.randint(0, w.max_offset + 1, (1,), generator=g))
    assert order.dtype == np.int32
    assert np.array_equal(order, torch.randperm(w.num_windows, generator=g).numpy())


def test_batches_are_the_rank_shares_of_the_whole_order_in_every_layout():
    """A rank keeps only its share of an epoch's order; each micro-batch is still exactly
    rank_share of the whole order, so a resume (or an earlier version) trains the same windows."""
    for world, B in ((1, 4), (2, 4), (3, 2)):
        w = plan(world=world, B=B, seed=5)
        i = IndexPlan(num_windows=333, micro_batch_size=B, world_size=world, seed=5)
        for p in (w, i):
            for epoch in (0, 1, 3):
                offset, order, stride = p.fresh_layout(epoch)
                for rank in range(world):
                    for position in (0, 1, p.batches_per_epoch - 1):
                        want = offset + rank_share(order, position, B, world, rank) * stride
                        got = p.batch_starts(epoch * p.batches_per_epoch + position, rank)
                        assert got.dtype == np.int64 and np.array_equal(got, want)


def test_a_process_holds_one_epoch_share_not_every_order_it_trained(monkeypatch):
    """Orders of past epochs were cached (4 x 191 MiB at 50M windows): only the share of the
    epoch in use is held now, 1 / world_size of an order, and no whole order at all on 2 ranks."""
    import gc
    import weakref

    from nanolab.data import windows

    made: list[weakref.ref] = []
    real = windows.window_permutation

    def tracked(count: int, generator: torch.Generator) -> np.ndarray:
        order = real(count, generator)
        made.append(weakref.ref(order))
        return order

    monkeypatch.setattr(windows, "window_permutation", tracked)
    for world in (1, 2):
        made.clear()
        p = plan(world=world, n=200_000, seed=1234 + world)
        for epoch in range(4):
            p.batch_starts(epoch * p.batches_per_epoch + 1, world - 1)
        gc.collect()
        alive = [ref for ref in made if ref() is not None]
        assert len(made) == 4 and len(alive) == (1 if world == 1 else 0)


def test_token_offsets_past_two_billion_do_not_wrap_in_the_int32_order():
    """A split of 3B tokens: window numbers fit int32, their token offsets do not."""
    big = WindowPlan(num_tokens=3_000_000_000, block_size=1024, micro_batch_size=64,
                     world_size=1, seed=1)  # fmt: skip
    offset, order = big.epoch_layout(0)
    starts = big.batch_starts(0, 0)
    assert starts.dtype == np.int64 and starts.max() > 2**31
    assert np.array_equal(starts, offset + order[:64].astype(np.int64) * 1024)
    mixed = MixturePlan([3_000_000_000, 3_000_000_000], [0.5, 0.5], 1024, 64, 1, seed=1)
    rows = mixed.batch_starts(0, 0)
    assert rows[:, 1].min() >= 0 and rows[:, 1].max() > 2**31


def test_one_step_of_n_ranks_sees_the_windows_of_n_accumulated_micro_batches():
    # What makes a 2-GPU run equal to a 1-GPU run with 2x gradient accumulation.
    single, double = plan(world=1), plan(world=2)
    for step in range(3):
        accumulated = np.concatenate([single.batch_starts(2 * step + i, 0) for i in range(2)])
        ranks = np.concatenate([double.batch_starts(step, r) for r in range(2)])
        assert set(accumulated) == set(ranks)


def test_too_little_data_fails_with_a_fix():
    with pytest.raises(DataTooSmallError, match="block_size"):
        plan(n=10, T=16)
    with pytest.raises(DataTooSmallError, match="micro_batch_size"):
        plan(n=100, T=16, B=8)
    with pytest.raises(DataTooSmallError, match="val_fraction"):
        validation_starts(10, 16, 4)


def test_validation_windows_are_fixed_and_in_range():
    a = validation_starts(5000, 64, 20)
    assert np.array_equal(a, validation_starts(5000, 64, 20))
    assert a.min() == 0 and a.max() == 5000 - 65 and len(np.unique(a)) == 20


def test_datamodule_batches_are_shifted_targets(char_dataset):
    dm = TokenDataModule(dataset_dir=str(char_dataset), micro_batch_size=3, block_size=24)
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (3, 24)
    assert np.array_equal(x[:, 1:].numpy(), y[:, :-1].numpy())
    tok = load_tokenizer(char_dataset)
    assert len(tok.decode(x[0].tolist())) == 24
    vx, _ = next(iter(dm.val_dataloader()))
    assert vx.shape[1] == 24


class _Counted(torch.utils.data.Dataset):
    """A fork's own windows: the module's, counting the rows read."""

    def __init__(self, windows) -> None:
        self.windows, self.read = windows, 0

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i):
        self.read += 1
        return self.windows[i]

    def __getattr__(self, name: str):  # the rest of the window protocol (validation_keys)
        if name == "windows":
            raise AttributeError(name)
        return getattr(self.windows, name)


@pytest.mark.parametrize("names", [("train_tokens", "val_tokens"), ("train_parts", "val_parts")])
def test_a_fork_that_assigns_its_windows_in_setup_trains_on_them(char_dataset, names):
    """Forks of earlier versions set ``self.train_tokens = ...`` in ``setup``: that must work
    (it raised AttributeError once the names became properties) and be what the loaders read."""
    train_name, val_name = names

    class Fork(TokenDataModule):
        def setup(self, stage: str) -> None:
            super().setup(stage)
            for name in (train_name, val_name):
                windows = getattr(self, name)
                if name.endswith("parts"):
                    setattr(self, name, [_Counted(w) for w in windows])
                else:
                    setattr(self, name, _Counted(windows))

    dm = Fork(dataset_dir=str(char_dataset), micro_batch_size=3, block_size=24)
    dm.setup("fit")
    assert isinstance(dm.train_tokens, _Counted) and dm.train_parts == [dm.train_tokens]
    assert isinstance(dm.val_tokens, _Counted) and dm.val_parts == [dm.val_tokens]
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (3, 24) and dm.train_tokens.read > 0
    next(iter(dm.val_dataloader()))
    assert dm.val_tokens.read > 0


def test_datamodule_refuses_missing_data(tmp_path):
    dm = TokenDataModule(dataset_dir=str(tmp_path / "nothing"))
    with pytest.raises(PrepareError, match="nanolab prepare"):
        dm.setup("fit")


def test_a_home_relative_folder_is_the_folder_prepare_writes(tmp_path, monkeypatch):
    # `prepare` and data.source expand `~`; the DataModule must read that same folder, not a
    # literal `./~/ds` (which it then called missing), for one folder and for a mixture.
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "text.txt"
    src.write_text(SAMPLE * 50)
    dm = TokenDataModule(dataset_dir="~/ds", source=[str(src)], tokenizer="chars", block_size=8)
    dm.setup("fit")
    assert dm.dataset_dir == tmp_path / "ds"
    assert (tmp_path / "ds" / "meta.json").is_file() and not (tmp_path / "~").exists()
    mixed = TokenDataModule(datasets=[{"path": "~/ds"}], block_size=8, micro_batch_size=2)
    mixed.setup("fit")
    assert [part.path for part in mixed.parts] == [tmp_path / "ds"]


def test_concurrent_prepares_of_one_dataset_agree(tmp_path):
    # What every rank of a torchrun/srun launch does with data.source set: three real
    # `nanolab prepare` processes at once (the CLI imports no torch, so this is quick).
    import subprocess
    import sys

    src = tmp_path / "text.txt"
    src.write_text(SAMPLE * 50)
    out = tmp_path / "ds"
    cmd = [sys.executable, "-m", "nanolab", "prepare", str(src), "-o", str(out), "--json"]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err for _, err in results]
    hashes = {json.loads(stdout)["source_hash"] for stdout, _ in results}
    assert len(hashes) == 1
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_worker_processes_serve_the_same_batches(char_dataset):
    def first_batches(workers: int) -> list:
        dm = TokenDataModule(
            dataset_dir=str(char_dataset), micro_batch_size=4, block_size=16, num_workers=workers
        )
        dm.setup("fit")
        it = iter(dm.train_dataloader())
        return [next(it)[0] for _ in range(5)]

    for a, b in zip(first_batches(0), first_batches(2), strict=True):
        assert np.array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("workers", [0, 2])
def test_loaders_leave_the_training_rng_alone(char_dataset, workers):
    """Starting a loader (a validation, or the first one after a resume, whose persistent
    workers start then) draws the workers' base seed: from the loader's own generator, never
    from the global torch RNG that dropout trains with. Mutation caught: a DataLoader without a
    ``generator`` (a resumed run with workers parted from the uninterrupted one at its first
    evaluation)."""
    dm = TokenDataModule(
        dataset_dir=str(char_dataset), micro_batch_size=4, block_size=16, num_workers=workers
    )
    dm.setup("fit")
    torch.manual_seed(7)
    before = torch.get_rng_state()
    for loader in (dm.train_dataloader(), dm.val_dataloader(), dm.val_dataloader()):
        next(iter(loader))
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize(("windows", "batch"), [(3, 4), (9, 4), (8, 1), (320, 16)])
def test_a_device_count_that_scores_fewer_validation_windows_says_so(
    char_dataset, capsys, windows, batch
):
    """Each device scores as many windows (Lightning averages the window count over ranks as
    an integer), so 3 windows on 2 devices scored [0, 3579] of [0, 3579, 7158] without a
    word; the launch now names the windows left out and the val_windows that keeps them. A
    multiple of the devices scores one device's windows exactly."""
    from types import SimpleNamespace

    dm = TokenDataModule(
        dataset_dir=str(char_dataset), micro_batch_size=batch, block_size=64, val_windows=windows
    )
    dm.setup("fit")
    one = sorted(np.concatenate(dm.val_dataloader().sampler).tolist())
    assert one == dm.val_parts[0].validation_keys(windows).tolist()
    for world in (2, 3, 4):
        if windows < world:
            continue  # test_fewer_validation_windows_than_devices_give_each_device_one
        capsys.readouterr()
        dm.check_fits(world)
        said = capsys.readouterr().err
        kept = windows // world * world
        if kept == windows:
            assert said == ""
        else:
            assert f"{world} devices score {kept} of the {windows} validation windows" in said
            assert (
                f"set data.val_windows to a multiple of {world} ({kept} or {kept + world})" in said
            )
        ranks = []
        for rank in range(world):
            dm.trainer = SimpleNamespace(global_rank=rank, world_size=world)
            ranks.append(list(dm.val_dataloader().sampler))
        dm.trainer = None
        assert len({len(r) for r in ranks}) == 1 and all(len(b) <= batch for r in ranks for b in r)
        scored = sorted(np.concatenate([b for r in ranks for b in r]).tolist())
        assert len(scored) == kept and set(scored) <= set(one)


def test_more_validation_windows_than_the_split_holds_says_so_once(char_dataset, capsys):
    """data.val_windows above what the validation split holds scored the whole split without a
    word (fewer windows than the config says). The launch says it in one line, with how many
    the split holds and what was asked; asking for exactly that many says nothing."""
    dm = TokenDataModule(dataset_dir=str(char_dataset), micro_batch_size=4, block_size=64,
                         val_windows=10**7)  # fmt: skip
    dm.setup("fit")
    held = sum(len(b) for b in dm.val_dataloader().sampler)  # what an evaluation scores
    capsys.readouterr()
    dm.check_fits(1)
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        f"nanolab: warning: {char_dataset}: data.val_windows 10000000 asks for more validation "
        f"windows than its validation split holds ({held}): each evaluation scores all {held}; "
        f"set data.val_windows {held} to say what is scored, or give the split more text"
    )
    exact = TokenDataModule(dataset_dir=str(char_dataset), micro_batch_size=4, block_size=64,
                            val_windows=held)  # fmt: skip
    exact.check_fits(1)
    assert capsys.readouterr().err == ""


def test_fewer_validation_windows_than_devices_give_each_device_one(char_dataset, capsys):
    """val_windows 1 on 2 devices left rank 1 without a batch: "DataLoader within local rank
    has zero length" and the other rank's gloo connection closed, two tracebacks. (A window
    data module repeated the window instead, and a fix that refused it took that run away.)
    Each device now scores one window, the set repeated: one window on 2 or 4 devices is one
    device's mean; 2 windows on 3 devices weigh one twice, and the launch says so."""
    from types import SimpleNamespace

    from nanolab.data.windows import evaluation_batches, validation_cut

    for count, world, even in ((1, 2, True), (1, 4, True), (2, 4, True), (2, 3, False)):
        keys = np.arange(10, 10 + count)
        ranks = [evaluation_batches(keys, r, world, 4) for r in range(world)]
        assert all(len(b) == 1 and len(b[0]) == 1 for b in ranks)
        scored = np.concatenate([b[0] for b in ranks])
        counts = np.bincount(scored - 10)
        assert (len(set(counts.tolist())) == 1) == even and set(scored.tolist()) == set(keys)
        said = validation_cut(count, world, "x")
        assert (said is None) == even and (even or "unevenly" in said)
    with pytest.raises(DataTooSmallError, match="holds no window"):
        evaluation_batches(np.arange(0), 0, 2, 4)

    dm = TokenDataModule(
        dataset_dir=str(char_dataset), micro_batch_size=4, block_size=64, val_windows=1
    )
    dm.setup("fit")
    capsys.readouterr()
    dm.check_fits(2)
    assert capsys.readouterr().err == ""
    ranks = []
    for rank in range(2):
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=2)
        ranks.append([b.tolist() for b in dm.val_dataloader().sampler])
    dm.trainer = None
    assert ranks[0] == ranks[1] == [dm.val_parts[0].validation_keys(1).tolist()]
