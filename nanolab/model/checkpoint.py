"""A training checkpoint as data: find it, load it safely, rebuild its model and tokenizer.

``nanolab generate``, ``nanolab export`` and evaluation all start here. The checkpoint carries
the architecture (``ckpt["nanolab"]["gpt"]``) and the tokenizer as plain data, so nothing else
is needed, and it is read with ``torch.load(weights_only=True)``: a checkpoint is data, never
code. A path may also name a run directory (its newest complete checkpoint is used, by the rule
a resume uses: :func:`nanolab.training.resume.resolve_checkpoint`).

A live run rotates its checkpoints (``checkpoint.keep_last``): a step file can be deleted
between the moment a reader picks it and the moment it reads it. So a reader *holds* the file it
picked (:func:`hold`): one descriptor opened at the pick, and every later read of that name in
this process (its inspection, :func:`load_checkpoint`, Lightning's restore) goes through the
descriptor (:func:`read_path`), which reads the same file whatever happens to its name.
"""

from __future__ import annotations

import os
import pickle
import stat
import struct
import zipfile
from pathlib import Path
from typing import Any

import torch

from nanolab.data.tokenizers import Tokenizer, TokenizerSpecError, spec_problem, tokenizer_from_spec
from nanolab.errors import NanolabError
from nanolab.model.config import GPTConfig
from nanolab.model.gpt import GPT
from nanolab.model.plain_state import refused_global, refused_text


class CheckpointError(NanolabError):
    """A checkpoint that cannot be used (missing, not a torch archive, not nanolab's, or damaged)."""


def sharded_kind(path: str | Path) -> str | None:
    """``"deepspeed"`` or ``"fsdp"`` for a sharded checkpoint folder (DeepSpeed's, or torch's
    distributed checkpoint that FSDP saves), None for anything else (a file, a run directory)."""
    path = Path(path)
    if not path.is_dir():
        return None
    # DeepSpeed's layout: <folder>/<tag>/*_model_states.pt (a run directory holds them deeper)
    if any(path.glob("*/*_model_states.pt")) or any(path.glob("*_model_states.pt")):
        return "deepspeed"
    return "fsdp" if (path / ".metadata").is_file() else None


#: Every class and function the ``.metadata`` index of torch's distributed checkpoint (FSDP2's
#: sharded save) names, read from real saves: torch unpickles that file with no restriction
#: when it loads the folder, so a folder whose index names anything else is refused before
#: torch sees it (a pickle can run any code it names). dtypes are allowed on top, by type.
DCP_METADATA_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    **dict.fromkeys(  # Python 3.13 moved the classes to pathlib._local
        ("pathlib", "pathlib._local"),
        frozenset({"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}),
    ),
    "collections": frozenset({"OrderedDict"}),
}


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles a distributed checkpoint's index, resolving only :data:`DCP_METADATA_GLOBALS`
    (and torch dtypes): anything else raises ``pickle.UnpicklingError`` naming it, before it
    could be called."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _enum_member  # how some Pythons pickle an enum member: by its name
        allowed = name in DCP_METADATA_GLOBALS.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name}")
        return super().find_class(module, name)


def _enum_member(cls: Any, name: Any) -> Any:
    """``getattr(cls, name)`` as an index may hold it, for a member of an enum class the
    unpickler already allowed (``_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT``; Python pickles
    enum members by name in some builds, by value in others): any other use of getattr, which
    could reach any attribute of anything, is refused."""
    import enum

    if isinstance(cls, type) and issubclass(cls, enum.Enum) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"builtins.getattr of {name!r} on {cls!r}")


def sharded_folder_problem(path: Path) -> str | None:
    """Why the sharded checkpoint folder ``path`` cannot be handed to its strategy (None: it
    can), read without running anything it holds: the folder's own pickles are loaded by
    torch and DeepSpeed with no restriction, so this is what keeps a checkpoint data."""
    kind = sharded_kind(path)
    if kind == "fsdp":
        return _dcp_problem(path)
    if kind == "deepspeed":
        return _deepspeed_problem(path)
    return "not a sharded checkpoint folder"


def _dcp_problem(path: Path) -> str | None:
    """A torch distributed checkpoint as Lightning saves it: the index ``.metadata``, the
    shard files it names (each long enough for what it says is in it) and Lightning's
    ``meta.pt`` (loop, scheduler and callback state), which the restore requires."""
    from torch.distributed.checkpoint.metadata import Metadata

    if not (path / "meta.pt").is_file():
        return "torn: it has no meta.pt, which every complete save writes last"
    try:
        with open(path / ".metadata", "rb") as f:
            index = _IndexUnpickler(f).load()
    except pickle.UnpicklingError as err:
        return (
            f"its .metadata names {err}, which a checkpoint index never holds; refused to load it"
        )
    except Exception as err:  # truncated, not a pickle, a class torch no longer has
        return f"its .metadata is not readable ({type(err).__name__})"
    if not isinstance(index, Metadata) or not isinstance(index.storage_data, dict):
        return "its .metadata is not a distributed checkpoint index"
    for info in index.storage_data.values():
        shard = path / str(getattr(info, "relative_path", ""))
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        try:
            short = shard.parent != path or shard.stat().st_size < end
        except OSError:
            short = True
        if short:
            return f"torn: its shard {shard.name} is missing or shorter than its index says"
    return _torch_file_problem(path / "meta.pt")


def deepspeed_safe_globals() -> list[Any]:
    """The DeepSpeed classes its own checkpoint files pickle besides tensors (read from real
    ZeRO saves: the loss scaler, the ZeRO stage, the fragment map); none runs code when
    rebuilt. Empty without DeepSpeed, which cannot load the folder then anyway."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except Exception:  # not installed, or a version that moved them: refuse, do not guess
        return []
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def _deepspeed_problem(path: Path) -> str | None:
    """A DeepSpeed checkpoint folder: DeepSpeed loads every ``.pt`` in it with
    ``weights_only=False``, so each must load with ``weights_only=True`` first (allowing only
    the DeepSpeed classes its own saves hold: :data:`DEEPSPEED_SAFE_GLOBALS`)."""
    files = sorted(path.rglob("*.pt"))
    if not any(f.name.endswith("_model_states.pt") for f in files):
        return "torn: no *_model_states.pt"
    for file in files:
        problem = _torch_file_problem(file, deepspeed_safe_globals())
        if problem is not None:
            return f"{file.relative_to(path)}: {problem}"
    return None


def _torch_file_problem(file: Path, safe: list[Any] | None = None) -> str | None:
    """Why the ``torch.save`` file ``file`` is not plain data in one piece (None: it is),
    read as :func:`load_checkpoint` reads one, without its tensor bytes."""
    if not zipfile.is_zipfile(file):
        return "truncated or not a torch file"
    try:
        compressed = compressed_problem(file)
        if compressed is not None:
            return compressed
        damaged = damaged_record(file)
        if damaged is not None:
            return f"damaged: its record {damaged} is not where its directory says"
        with torch.serialization.safe_globals(safe or []):
            torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        refused = refused_global(err)
        if refused is not None:
            return refused_text(refused)
        return "it holds pickled Python objects, not only tensors; refused to load it"
    except Exception as err:
        return f"not readable ({type(err).__name__})"
    return None


def sharded_metadata(path: str | Path) -> dict[str, Any] | None:
    """What a sharded checkpoint folder keeps beside its shards, read as plain data without its
    tensor bytes: Lightning's ``meta.pt`` in FSDP's folder, the model-states file DeepSpeed
    writes Lightning's state into (``<tag>/mp_rank_00_model_states.pt``): the step, the loop,
    scheduler and callback states and the ``nanolab`` section, as a one-file checkpoint holds
    them. None: not a sharded folder, or not readable (the load itself says why)."""
    path = Path(path)
    kind = sharded_kind(path)
    if kind == "fsdp":
        files = [path / "meta.pt"]
    elif kind == "deepspeed":
        files = sorted(path.glob("*/*model_states.pt")) + sorted(path.glob("*model_states.pt"))
    else:
        return None
    safe = deepspeed_safe_globals() if kind == "deepspeed" else []
    try:
        with torch.serialization.safe_globals(safe):
            state = torch.load(files[0], map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # torn, gone (rotated), or not plain data: the strategy's load reports it
        return None
    return state if isinstance(state, dict) else None


def sharded_folder_error(path: Path) -> CheckpointError | None:
    """The one line for a sharded checkpoint folder (DeepSpeed's, or FSDP's distributed
    save), which generate, eval and export cannot read: how to make it one file."""
    kind = sharded_kind(path)
    if kind is None:
        return None
    deepspeed = kind == "deepspeed"
    module, function = (
        ("lightning.pytorch.utilities.deepspeed", "convert_zero_checkpoint_to_fp32_state_dict")
        if deepspeed
        else ("torch.distributed.checkpoint.format_utils", "dcp_to_torch_save")
    )
    return CheckpointError(
        f"{path} is a sharded checkpoint folder ({'DeepSpeed' if deepspeed else 'FSDP'}), "
        f'which this command reads only as one file: convert it with python -c "from {module} '
        f"import {function}; {function}('{path}', 'model.ckpt')\" and pass model.ckpt "
        "(docs/scaling.md)"
    )


#: Checkpoint files this process holds open, by the absolute name they were picked under.
_HELD: dict[str, int] = {}


def _descriptor_path(fd: int) -> Path | None:
    """A path that opens what ``fd`` has open, even once its name is deleted (Linux's
    ``/proc/self/fd``, ``/dev/fd`` elsewhere); None where the system has neither."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        if os.path.isdir(folder):
            return Path(folder) / str(fd)
    return None


def hold(path: str | Path) -> Path:
    """Open the checkpoint file ``path`` and keep it open (idempotent), so that a rotation
    deleting its name no longer matters to this process; returns the path reads should use
    (:func:`read_path`). Raises ``FileNotFoundError`` when the name is already gone. Only a
    regular file is held: a folder (a sharded checkpoint) would still lose its files one by
    one, and anything else is refused by its reader."""
    key = os.path.abspath(path)
    if key in _HELD:
        return read_path(path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a pipe must not block
    if not stat.S_ISREG(os.fstat(fd).st_mode) or _descriptor_path(fd) is None:
        os.close(fd)
        return Path(path)
    _HELD[key] = fd
    return read_path(path)


def read_path(path: str | Path) -> Path:
    """Where to read ``path`` from: its held descriptor's path, or the name itself."""
    fd = _HELD.get(os.path.abspath(path))
    return (_descriptor_path(fd) or Path(path)) if fd is not None else Path(path)


def is_held(path: str | Path) -> bool:
    return os.path.abspath(path) in _HELD


def release(path: str | Path) -> None:
    """Close the descriptor :func:`hold` opened for ``path`` (nothing when it holds none)."""
    fd = _HELD.pop(os.path.abspath(path), None)
    if fd is not None:
        os.close(fd)


def damaged_record(path: str | Path) -> str | None:
    """The first record of the torch zip archive ``path`` whose local header is not where the
    archive's directory says, or whose data would run past the end of the file (``None`` when
    every record is in place).

    ``torch.load(mmap=True)`` maps each tensor at the offset the directory gives without
    reading the header there, so a file whose header was overwritten (a bad sector, a torn copy)
    loads shifted bytes as weights: finite, wrong and silent. Checking every header costs one
    small read per tensor, not a read of the data."""
    size = Path(path).stat().st_size
    with zipfile.ZipFile(path) as archive, open(path, "rb") as f:
        for info in archive.infolist():
            f.seek(info.header_offset)
            head = f.read(30)
            if len(head) < 30 or head[:4] != b"PK\x03\x04":
                return info.filename
            name_len, extra_len = struct.unpack("<HH", head[26:30])
            if f.read(name_len).decode("utf-8", "replace") != info.orig_filename:
                return info.filename
            end = info.header_offset + 30 + name_len + extra_len + info.compress_size
            if end > size:
                return info.filename
    return None


def compressed_record(path: str | Path) -> str | None:
    """The first record of the zip archive ``path`` that is compressed (``None``: every record
    is stored as is), read from the archive's directory alone.

    ``torch.save`` stores every record uncompressed (a tensor is memory-mapped straight from the
    file), so a compressed one means the file was made by something else: a zip tool, or a
    file built to be inflated (8 bytes of directory can announce gigabytes; reading every
    record against its CRC-32 (:func:`corrupt_record`) would inflate them all)."""
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
                return info.filename
    return None


def compressed_problem(path: str | Path) -> str | None:
    """Why ``path`` is not a file ``torch.save`` wrote, in words (None: no record of it is
    compressed): :func:`compressed_record`."""
    name = compressed_record(path)
    if name is None:
        return None
    return (
        f"not a checkpoint written by torch.save (its record {name} is compressed; torch.save "
        "stores every record as is)"
    )


def corrupt_record(path: str | Path) -> str | None:
    """The first record of the torch zip archive ``path`` whose bytes fail the CRC-32 its
    directory stores (``None`` when all pass, or when the archive cannot be read: the other
    checks say why).

    A bad sector or a flipped bit inside a tensor leaves every header in place
    (:func:`damaged_record` passes) and loads as finite, wrong weights: the run then diverges
    with advice about the learning rate. Reading every byte once is the only way to know; it
    streams in 1 MiB reads (constant memory), at the disk's read speed (docs/resume.md).

    A compressed record is never read (never inflated): its size is the archive's word, not
    the file's, and no ``torch.save`` file has one; :func:`compressed_record` refuses it."""
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile):
        return None
    with archive:
        for info in archive.infolist():
            if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
                continue
            try:
                with archive.open(info) as record:
                    while record.read(1 << 20):
                        pass
            except (OSError, EOFError, zipfile.BadZipFile):  # a bad CRC, or the disk's EIO
                return info.filename
    return None


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint ``path`` names, read safely (a held file through its descriptor:
    :func:`hold`); messages name ``path``."""
    path = Path(path)
    sharded = sharded_folder_error(path)
    if sharded is not None:
        raise sharded
    source = read_path(path)
    if not source.is_file():
        what = "is not a regular file (a device, a pipe?)" if path.exists() else "does not exist"
        raise CheckpointError(f"checkpoint {path} {what}; pass a .ckpt file or a run dir")
    if not zipfile.is_zipfile(source):  # what torch.save writes; anything else is not ours
        raise CheckpointError(
            f"{path} is not a checkpoint (not a torch zip archive: empty, truncated or another "
            "kind of file); pass a .ckpt written by nanolab fit"
        )
    try:
        compressed = compressed_problem(source)
        damaged = None if compressed else damaged_record(source) or corrupt_record(source)
    except (OSError, zipfile.BadZipFile) as err:
        compressed, damaged = None, str(err) or type(err).__name__
    if compressed is not None:
        raise CheckpointError(f"{path} is {compressed}; pass a .ckpt written by nanolab fit")
    if damaged is not None:
        raise CheckpointError(
            f"{path} is damaged (its record {damaged} is not where the archive's directory "
            "says, or its bytes fail their CRC-32: a bad disk or a torn copy); pass another "
            "checkpoint, e.g. an earlier "
            "step-*.ckpt of the run"
        )
    try:
        ckpt = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        refused = refused_global(err)
        if refused is not None:
            raise CheckpointError(f"{path} cannot be read: {refused_text(refused)}") from None
        raise CheckpointError(
            f"{path} holds Python objects besides tensors, which weights_only loading refuses "
            "(a checkpoint is data, never code); pass a .ckpt written by nanolab fit"
        ) from None
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise CheckpointError(
            f"{path} is not a readable checkpoint ({type(err).__name__}: {first[:200]})"
        ) from None
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise CheckpointError(f"{path} holds no state_dict; pass a checkpoint saved by nanolab fit")
    check_stored_tokenizer(ckpt, path)
    return ckpt


#: The key of the checkpoint's record of the model and data classes that trained it, in its
#: ``nanolab`` section (written by :mod:`nanolab.training.class_settings`).
CLASSES_KEY = "classes"
#: nanolab's own model class: the one a checkpoint without a record was trained by.
PLAIN_MODEL = "nanolab.training.module.GPTLightningModule"


def trained_by_another_class(meta: Any) -> str | None:
    """The model class that trained a checkpoint, when its ``nanolab`` section records one
    other than nanolab's own (which may build another network than nanolab's GPT of its
    ``gpt``); None otherwise, a checkpoint of an earlier nanolab included."""
    record = meta.get(CLASSES_KEY) if isinstance(meta, dict) else None
    model = record.get("model") if isinstance(record, dict) else None
    path = model.get("class_path") if isinstance(model, dict) else None
    return path if isinstance(path, str) and path != PLAIN_MODEL else None


def weights_misfit(source: Any, meta: Any, what: str) -> CheckpointError:
    """The error for weights that nanolab's GPT of the checkpoint's config cannot hold: where a
    class of a project's own trained them, that class's network is what they fit, and the
    line names it (a mismatch in nanolab's own checkpoint is a damaged or edited file)."""
    trained_by = trained_by_another_class(meta)
    if trained_by is None:
        return CheckpointError(f"{source}: the weights do not fit its model config ({what})")
    return CheckpointError(
        f"{source} was trained by {trained_by}, whose network is not nanolab's GPT of its model "
        f"config ({what}): generate, eval and export rebuild nanolab's GPT from the checkpoint "
        f"alone and cannot hold these weights; load its state_dict into {trained_by} in Python"
    )


def gpt_section(ckpt: dict[str, Any], source: str | Path) -> dict[str, Any]:
    """The checkpoint's ``nanolab`` section, holding the GPT's config (``gpt``) that generate
    and export rebuild the model from. A checkpoint without it was saved by ``nanolab fit`` of a
    model class of a fork's own (a plain LightningModule: no ``model.gpt``): the tools that read
    a checkpoint alone build nanolab's GPT only, and say so, not that fit did not write it."""
    meta = ckpt.get("nanolab")
    if not isinstance(meta, dict) or not isinstance(meta.get("gpt"), dict):
        raise CheckpointError(
            f"{source} was trained by a model class without model.gpt (it holds no nanolab GPT "
            "config): nanolab generate, eval and export build nanolab's GPT only; use your "
            "model class's own code on it (nanolab validate and test run it)"
        )
    return meta


def model_from_checkpoint(ckpt: dict[str, Any], source: str | Path = "the checkpoint") -> GPT:
    """Rebuild the GPT from ``ckpt["nanolab"]["gpt"]`` and load its weights (``source`` names
    the file in error messages)."""
    meta = gpt_section(ckpt, source)
    state = model_weights(ckpt)
    non_finite = non_finite_error(state, source)
    if non_finite is not None:
        raise non_finite
    model = None
    try:
        config = GPTConfig(**{**meta["gpt"], "gradient_checkpointing": False})
        try:
            with torch.device("meta"):  # the shapes first, allocating nothing: a config of
                skeleton = GPT(config)  # n_embd 131072 over small weights is refused, not built
        except (TypeError, ValueError):
            raise
        except Exception:  # a fork's part that cannot be built on meta (.item() in __init__)
            skeleton = model = GPT(config)
    except (TypeError, ValueError) as err:
        raise invalid_config(source, meta, err) from None
    check_part_modules(source, meta)
    mismatch = state_mismatch(skeleton.state_dict(), state)
    if mismatch:
        raise weights_misfit(source, meta, mismatch)
    model = model or GPT(config)
    model.load_state_dict(state)
    return model.eval()


def model_weights(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The GPT's weights in a checkpoint's ``state_dict``, named as the GPT names them (the
    LightningModule keeps it as ``model``: its keys start with ``model.``)."""
    prefix = "model."
    return {k[len(prefix) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}


def non_finite_error(state: dict[str, Any], source: str | Path) -> CheckpointError | None:
    """The one line for weights holding NaN or inf (None when every tensor is finite):
    generate, eval, validate and test refuse such a checkpoint in these words before running
    the model (its loss would be NaN, printed as "-" with exit 0). One pass over the weights
    as loaded (memory-mapped: each page is read once), never a load of its own."""
    bad = [
        k
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(v.isfinite().all())
    ]
    if not bad:
        return None
    return CheckpointError(
        f"{source} has non-finite weights (NaN/inf in {len(bad)} of {len(state)} "
        f"tensors, e.g. {bad[0]}): the run diverged before this save; pass an earlier "
        "checkpoint from its checkpoints/ folder"
    )


def check_part_modules(source: str | Path, meta: dict[str, Any]) -> None:
    """Refuse a checkpoint whose own parts are registered here by another module than the one
    that registered them when it was saved: two projects using one name (an installed
    project's entry point, say) would build the model with the other's maths, silently."""
    from nanolab.model.registry import REGISTRIES

    modules = meta.get("part_modules")
    gpt = meta.get("gpt") or {}
    if not isinstance(modules, dict):
        return
    for field, saved in modules.items():
        registry = REGISTRIES.get(field)
        name = gpt.get(field)
        here = registry.module_of(name) if registry is not None else None
        if here is not None and here != saved:
            raise CheckpointError(
                f"{source}: its {field} {name!r} was registered by {saved} when it was saved, "
                f"and here by {here} (two projects use the name): run where only {saved} "
                f"registers it (--import {saved}, and uninstall the other project's package)"
            )


def invalid_config(source: str | Path, meta: dict[str, Any], err: Exception) -> CheckpointError:
    """The one line for a checkpoint whose model config does not build here. A part that a
    project registered is unknown until its module is imported: the checkpoint names that
    module (``part_modules``), and the line says to pass it with ``--import``; nanolab never
    imports a module because a checkpoint names it."""
    modules = meta.get("part_modules")
    missing = []
    if isinstance(modules, dict):
        from nanolab.model.registry import REGISTRIES

        for field, module in modules.items():
            registry = REGISTRIES.get(field)
            name = (meta.get("gpt") or {}).get(field)
            if registry is not None and isinstance(module, str) and name not in registry:
                missing.append(module)
    if missing:
        imports = " ".join(f"--import {m}" for m in dict.fromkeys(missing))
        return CheckpointError(
            f"{source}: its model uses parts of your own that {', '.join(dict.fromkeys(missing))} "
            f"registered when it was saved; pass {imports} (importable from here: PYTHONPATH, "
            "or pip install -e your project)"
        )
    return CheckpointError(f"{source}: its model config is not valid ({err})")


def state_mismatch(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor]) -> str:
    """The first difference between two state dicts, in words ("" when they match)."""
    missing = [k for k in expected if k not in found]
    if missing:
        return f"{len(missing)} tensor(s) missing, e.g. {missing[0]}"
    extra = [k for k in found if k not in expected]
    if extra:
        return f"{len(extra)} unexpected tensor(s), e.g. {extra[0]}"
    for key, tensor in expected.items():
        if tuple(found[key].shape) != tuple(tensor.shape):
            return f"{key} is {tuple(found[key].shape)}, the config makes it {tuple(tensor.shape)}"
    return ""


def tokenizer_from_checkpoint(
    ckpt: dict[str, Any], source: str | Path = "the checkpoint"
) -> Tokenizer:
    """The checkpoint's tokenizer; one that has ids the model has no row for is refused (an
    edited or mixed-up checkpoint: sampling would index past the embedding, or print nothing
    for ids the tokenizer cannot decode), and so is one whose stored fields are not what
    nanolab writes (:func:`stored_tokenizer_error`). ``source`` names the file in messages."""
    spec = (ckpt.get("nanolab") or {}).get("tokenizer")
    if spec is None:
        raise CheckpointError(
            "the checkpoint stores no tokenizer: its run's DataModule had no `dataset_dir` (a "
            "folder `nanolab prepare` made, which holds the tokenizer); give yours one "
            "(docs/forking.md) and train again"
        )
    try:
        tokenizer = tokenizer_from_spec(spec)
    except TokenizerSpecError as err:
        raise stored_tokenizer_error(source, err) from None
    rows = ((ckpt.get("nanolab") or {}).get("gpt") or {}).get("vocab_size")
    if isinstance(rows, int) and tokenizer.vocab_size > rows:
        raise CheckpointError(
            f"the checkpoint's tokenizer has {tokenizer.vocab_size:,} tokens, more than its "
            f"model's vocabulary ({rows:,}): the two do not belong together; pass a checkpoint "
            "written by nanolab fit as it wrote it"
        )
    return tokenizer


def stored_tokenizer_error(source: str | Path, problem: object) -> CheckpointError:
    """The one line for a checkpoint whose stored tokenizer spec is malformed (``problem``: a
    :class:`TokenizerSpecError` or :func:`spec_problem`'s words): an edited or damaged file,
    whose ids no command could turn back into text."""
    text = str(problem).removeprefix("the tokenizer spec ")
    return CheckpointError(
        f"{source}: its stored tokenizer is not valid (nanolab.tokenizer: {text}); pass a "
        "checkpoint written by nanolab fit as it wrote it, e.g. another step-*.ckpt of its run"
    )


def check_stored_tokenizer(ckpt: dict[str, Any], source: str | Path) -> None:
    """Refuse a checkpoint whose stored tokenizer spec is malformed (one that stores none is
    fine: its weights are still what a command reads); the fields only, nothing is built."""
    meta = ckpt.get("nanolab")
    spec = meta.get("tokenizer") if isinstance(meta, dict) else None
    problem = None if spec is None else spec_problem(spec)
    if problem is not None:
        raise stored_tokenizer_error(source, problem)
