"""A split's document packing is made by the first launch only, kept in the dataset's
``packing/`` folder, and read by later launches and ranks (``data.align: document``)."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from test_documents import EOT, random_documents, write_documents

from nanolab.data import packing_cache
from nanolab.data.datamodule import DocumentWindows
from nanolab.data.documents import pack_documents, read_rows, unit_starts


@pytest.fixture(autouse=True)
def _new_process(monkeypatch):
    """Each launch in a test is a new process: nothing kept in memory from the one before."""
    monkeypatch.setattr(packing_cache, "_PACKINGS", {})


def _launch(folder: Path, block_size: int = 31) -> DocumentWindows:
    """The training windows a new launch reads (this process's packings forgotten)."""
    packing_cache._PACKINGS.clear()
    windows = DocumentWindows(folder / "train.bin", "uint16", block_size, EOT)
    _ = windows.packing
    return windows


def _count_packings(monkeypatch) -> list[int]:
    made: list[int] = []
    real = packing_cache.pack_documents

    def counting(*args):
        made.append(1)
        return real(*args)

    monkeypatch.setattr(packing_cache, "pack_documents", counting)
    return made


def _all_rows(windows: DocumentWindows) -> np.ndarray:
    return windows.read(np.arange(len(windows)))


def _packed_now(folder: Path, row_len: int) -> np.ndarray:
    """Every row as the packing rule makes it from the file, with no saved packing."""
    tokens = np.fromfile(folder / "train.bin", dtype=np.uint16)
    packing = pack_documents(unit_starts(tokens, EOT), len(tokens), row_len)
    return read_rows(packing, tokens, np.arange(packing.rows))


def test_a_later_launch_reads_the_saved_packing_and_the_same_windows(tmp_path, monkeypatch):
    folder = write_documents(tmp_path / "d", random_documents(300, 1), ["x y"])
    made = _count_packings(monkeypatch)
    first = _launch(folder)
    assert made == [1] and first.cache_note is None
    entries = [p.name for p in (folder / "packing").iterdir()]
    assert len(entries) == 1 and entries[0].startswith("train-") and "row32" in entries[0]
    later = _launch(folder)
    assert made == [1]  # no scan, no packing: the saved one, memory-mapped
    assert isinstance(later.packing.piece_start, np.memmap)
    assert later.fresh  # a new process says the summary line once
    assert np.array_equal(_all_rows(later), _all_rows(first))
    assert np.array_equal(_all_rows(later), _packed_now(folder, 32))
    _launch(folder, block_size=15)  # another block size is another packing, kept beside it
    assert made == [1, 1] and len(list((folder / "packing").iterdir())) == 2


def test_a_replaced_split_is_packed_again_and_its_old_packings_go(tmp_path, monkeypatch):
    folder = write_documents(tmp_path / "d", random_documents(300, 2), ["x y"])
    made = _count_packings(monkeypatch)
    _launch(folder)
    before = next((folder / "packing").iterdir()).name
    write_documents(tmp_path / "d", random_documents(250, 3), ["x y"])  # prepared again
    again = _launch(folder)
    assert made == [1, 1]
    assert np.array_equal(_all_rows(again), _packed_now(folder, 32))
    assert [p.name for p in (folder / "packing").iterdir()] != [before]
    assert len(list((folder / "packing").iterdir())) == 1


def test_a_split_edited_in_place_with_its_size_and_time_kept_is_packed_again(tmp_path):
    """The entry's name hashes a sample of the file's bytes, not only its size and time."""
    folder = write_documents(tmp_path / "d", random_documents(300, 4), ["x y"])
    _launch(folder)
    path = folder / "train.bin"
    stat = path.stat()
    tokens = np.memmap(path, dtype=np.uint16, mode="r+")
    tokens[5:9] = EOT  # four more (one-token) documents, in place
    tokens.flush()
    del tokens
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert np.array_equal(_all_rows(_launch(folder)), _packed_now(folder, 32))


def test_a_damaged_entry_is_made_again(tmp_path, monkeypatch):
    folder = write_documents(tmp_path / "d", random_documents(300, 5), ["x y"])
    _launch(folder)
    entry = next((folder / "packing").iterdir())
    (entry / "row_ptr.npy").write_bytes((entry / "row_ptr.npy").read_bytes()[:100])
    made = _count_packings(monkeypatch)
    assert np.array_equal(_all_rows(_launch(folder)), _packed_now(folder, 32))
    assert made == [1]
    assert _launch(folder) and made == [1]  # and saved whole again


def test_a_dataset_folder_that_cannot_be_written_still_trains_with_one_note(tmp_path, monkeypatch):
    folder = write_documents(tmp_path / "d", random_documents(300, 6), ["x y"])
    real_mkdir = Path.mkdir

    def read_only(self, *args, **kwargs):
        if self.name == packing_cache.CACHE_FOLDER:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    windows = _launch(folder)
    assert np.array_equal(_all_rows(windows), _packed_now(folder, 32))
    assert windows.cache_note == (
        f"the document packing of {folder / 'train.bin'} cannot be kept in "
        f"{folder / 'packing'} (Read-only file system): it is made again at every launch; make "
        "the dataset folder writable to keep it"
    )
    assert not (folder / "packing").exists()


def test_ranks_starting_together_pack_once_and_read_the_same(tmp_path, monkeypatch):
    """Two ranks race for the entry: one packs and saves under the lock, the other waits and
    reads the saved one."""
    folder = write_documents(tmp_path / "d", random_documents(300, 7), ["x y"])
    tokens = np.fromfile(folder / "train.bin", dtype=np.uint16)
    identity = (0, 1, 2, 3)
    made: list[int] = []

    def slow_pack():
        made.append(1)
        time.sleep(0.3)
        return pack_documents(unit_starts(tokens, EOT), len(tokens), 32)

    got: list[object] = []

    def rank() -> None:
        cache = packing_cache.PackingCache(folder / "train.bin", tokens, identity, 32, EOT)
        got.append(cache.get(slow_pack))

    ranks = [threading.Thread(target=rank) for _ in range(2)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join()
    assert made == [1]
    (a, note_a), (b, note_b) = got
    assert note_a is None and note_b is None
    rows = np.arange(a.rows)
    assert np.array_equal(read_rows(a, tokens, rows), read_rows(b, tokens, rows))
    assert [p.name for p in (folder / "packing").iterdir()] == [
        f"train-{packing_cache.content_key(tokens, identity)}-row32-eot{EOT}"
    ]
