"""A split's document packing is made once and kept in its dataset (``data.align: document``).

Packing a split (:mod:`nanolab.data.documents`) scans every token for document boundaries and
runs a loop per document: on a split of 1M documents about 1 s of CPU and 35 MB of memory (and
the split's mapped pages), on tens of millions of documents a minute or more, before step 1. It depends only on the split's tokens, the row length and
the end-of-text id, so the first launch saves it as ``.npy`` arrays in the dataset's
``packing/`` folder, and every later launch, resume and rank memory-maps them instead.

* An entry's name holds what it was made from: the split, a hash of the token file's identity
  (inode, size, modification time) and of a fixed sample of its bytes, the row length and the
  end-of-text id. A split prepared again or copied over has another name, so a stale entry is
  never read; a new entry removes the split's entries for other contents.
* An entry is written to a temporary folder and renamed into place whole, under a lock file:
  the ranks of one launch take turns, the first packs and saves, the others read its entry.
* A dataset folder that cannot be written (read-only, full) still trains: the packing is made
  in memory, as before, and one note says each launch packs it again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nanolab.atomic import fsync_dir
from nanolab.data.checks import SAMPLE_BLOCK_BYTES, SAMPLE_BLOCKS, FileIdentity, file_identity
from nanolab.data.documents import Packing, pack_documents, unit_starts
from nanolab.processes import exclusive

#: The folder of a dataset that keeps its splits' packings (``nanolab prepare --force``
#: replaces it with the rest of the dataset).
CACHE_FOLDER = "packing"
#: Changed when the packing rule or an entry's layout changes: older entries are not read.
LAYOUT = 1
#: Each entry's arrays and their dtypes (:class:`~nanolab.data.documents.Packing`'s fields).
ARRAYS = {"piece_start": np.int64, "piece_len": np.int32, "row_ptr": np.int64}
INFO = "packing.json"


@dataclass(frozen=True)
class PackingFound:
    """A split's packing and how this process came by it.

    ``fresh`` is False when another instance in this process already had it (its summary was
    said); ``note`` is a line worth saying when it could not be kept for later launches.
    """

    packing: Packing
    fresh: bool
    note: str | None = None


#: Packings this process holds, by (file, size, mtime, row length, end-of-text id): the
#: DataModule that ``fit`` builds to read the vocabulary and the one it trains with share one.
_PACKINGS: dict[tuple[object, ...], Packing] = {}


def packing_of(
    path: Path,
    tokens: np.ndarray,
    row_len: int,
    eot_id: int,
    identity: FileIdentity | None = None,
) -> PackingFound:
    """The packing of the split in ``path`` (its mapped ``tokens``, from the file whose
    identity is ``identity``; None: ``path``'s now) into rows of ``row_len``: this process's,
    else the dataset's saved one, else made now and saved."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, row_len, eot_id)
    packing = _PACKINGS.get(key)
    if packing is not None:
        return PackingFound(packing, fresh=False)
    cache = PackingCache(path, tokens, identity or file_identity(stat), row_len, eot_id)
    packing, note = cache.get(
        lambda: pack_documents(unit_starts(tokens, eot_id), len(tokens), row_len)
    )
    while len(_PACKINGS) >= 8:  # a launch has two splits per dataset
        del _PACKINGS[next(iter(_PACKINGS))]
    _PACKINGS[key] = packing
    return PackingFound(packing, fresh=True, note=note)


def content_key(tokens: np.ndarray, identity: FileIdentity) -> str:
    """A short hash of the token file's identity (less its device, which another machine
    mounting the same file sees differently) and of :data:`SAMPLE_BLOCKS` blocks of its bytes,
    read from ``tokens`` (the mapped file itself, never a file put at its path since)."""
    _, inode, size, mtime_ns = identity
    raw = np.asarray(tokens).reshape(-1).view(np.uint8)  # a view of the map: nothing copied
    digest = hashlib.sha256(json.dumps([LAYOUT, inode, size, mtime_ns]).encode())
    if len(raw) <= SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES:
        digest.update(raw.tobytes())
    else:
        span = len(raw) - SAMPLE_BLOCK_BYTES
        for i in range(SAMPLE_BLOCKS):
            at = span * i // (SAMPLE_BLOCKS - 1)
            digest.update(raw[at : at + SAMPLE_BLOCK_BYTES].tobytes())
    return digest.hexdigest()[:16]


class PackingCache:
    """The saved packing of one split's contents at one row length and end-of-text id."""

    def __init__(
        self, path: Path, tokens: np.ndarray, identity: FileIdentity, row_len: int, eot_id: int
    ) -> None:
        self.path = path
        self.total_tokens = len(tokens)
        self.row_len = row_len
        self.folder = path.parent / CACHE_FOLDER
        self.prefix = f"{path.stem}-{content_key(tokens, identity)}-"
        self.entry = self.folder / f"{self.prefix}row{row_len}-eot{eot_id}"

    def get(self, make: Callable[[], Packing]) -> tuple[Packing, str | None]:
        """The saved packing, else ``make()``'s, saved for later launches when the folder can
        be written (else with the note that says so)."""
        if (found := self.load()) is not None:
            return found, None
        with contextlib.ExitStack() as held:
            try:
                self.folder.mkdir(exist_ok=True)
                held.enter_context(exclusive(self.folder / f".{self.entry.name}.lock"))
            except OSError as err:
                return make(), self.unkept(err)
            if (found := self.load()) is not None:  # saved while this process waited
                return found, None
            packing = make()
            try:
                self.save(packing)
            except OSError as err:
                return packing, self.unkept(err)
            self.remove_other_contents()
            return self.load() or packing, None

    def load(self) -> Packing | None:
        """The entry's packing, its arrays memory-mapped (None: no entry, or not a whole one)."""
        try:
            info = json.loads((self.entry / INFO).read_text())
            arrays = {
                name: np.load(self.entry / f"{name}.npy", mmap_mode="r", allow_pickle=False)
                for name in ARRAYS
            }
            packing = Packing(
                row_len=self.row_len,
                documents=int(info["documents"]),
                total_tokens=int(info["total_tokens"]),
                **arrays,
            )
        except (OSError, ValueError, TypeError, KeyError):
            return None
        whole = (
            info.get("layout") == LAYOUT
            and info.get("row_len") == self.row_len
            and packing.total_tokens == self.total_tokens
            and all(arrays[name].dtype == dtype and arrays[name].ndim == 1
                    for name, dtype in ARRAYS.items())
            and len(packing.row_ptr) >= 1
            and packing.row_ptr[0] == 0
            and packing.row_ptr[-1] == len(packing.piece_start) == len(packing.piece_len)
        )  # fmt: skip
        return packing if whole else None

    def save(self, packing: Packing) -> None:
        """Write the entry whole or not at all: a temporary folder, renamed into place."""
        tmp = self.folder / f".{self.entry.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)  # a killed writer's, of the same PID
        tmp.mkdir()
        try:
            info = {"layout": LAYOUT, "row_len": packing.row_len,
                    "documents": packing.documents, "total_tokens": packing.total_tokens}  # fmt: skip
            for name, dtype in ARRAYS.items():
                _write_durably(tmp / f"{name}.npy", np.asarray(getattr(packing, name), dtype))
            _write_durably(tmp / INFO, json.dumps(info))
            if self.entry.exists():  # not a whole entry (load refused it), under this lock
                shutil.rmtree(self.entry)
            os.rename(tmp, self.entry)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        fsync_dir(self.folder)

    def remove_other_contents(self) -> None:
        """Remove this split's entries for other contents (an earlier version of the file), and
        this entry's temporary folders a killed writer left (this process holds its lock)."""
        split = self.path.stem + "-"
        for old in self.folder.iterdir():
            if (old.name.startswith(split) and not old.name.startswith(self.prefix)) or (
                old.name.startswith(f".{self.entry.name}.tmp-")
            ):
                shutil.rmtree(old, ignore_errors=True)

    def unkept(self, err: OSError) -> str:
        """The note for a packing that could not be saved (``err`` says why)."""
        reason = err.strerror or type(err).__name__
        return (
            f"the document packing of {self.path} cannot be kept in {self.folder} ({reason}): "
            "it is made again at every launch; make the dataset folder writable to keep it"
        )


def _write_durably(path: Path, content: np.ndarray | str) -> None:
    with open(path, "wb") as f:
        if isinstance(content, str):
            f.write(content.encode())
        else:
            np.save(f, content, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
