"""``nanolab export``: a training checkpoint as a folder other tools read.

``--format hf`` writes a Hugging Face GPT-2 folder (``config.json``, ``model.safetensors``,
``tokenizer.json`` + ``tokenizer_config.json``) that ``transformers``' ``AutoModelForCausalLM``
and ``AutoTokenizer`` load, and so lm-evaluation-harness and vLLM too. ``--format safetensors``
writes the weights under nanolab's own names plus ``nanolab.json`` (architecture and tokenizer),
for any nanolab model, RoPE included.

The folder is written next to its destination and renamed into place when complete: a failed
export leaves nothing behind, and an existing destination is replaced only with ``--force`` and
only when it holds nothing but a previous export's files and nanolab's mark (never a run
directory or a transformers folder, say).
"""

from __future__ import annotations

import errno
import json
import math
import os
import shlex
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from nanolab import messages
from nanolab.data.tokenizers import TokenizerError, TokenizerSpecError, tokenizer_from_spec
from nanolab.errors import NanolabError, one_line_errors, size_limit_met, with_errno_of
from nanolab.helpfmt import OneLineParser
from nanolab.model import GPT, GPTConfig
from nanolab.model.checkpoint import (
    CheckpointError,
    check_part_modules,
    gpt_section,
    invalid_config,
    load_checkpoint,
    stored_tokenizer_error,
    weights_misfit,
)
from nanolab.model.exported import INFO_NAME
from nanolab.model.hf import (
    RECORD_KEY,
    export_refusals,
    generation_config_from_nanolab,
    gpt_shapes,
    hf_config_from_nanolab,
    hf_state_from_nanolab,
)
from nanolab.model.registry import add_import_option, import_modules
from nanolab.processes import exclusive
from nanolab.runlog import refuse_inside_run
from nanolab.training.resume import resolve_checkpoint

#: Files an export writes; ``--force`` replaces a folder holding nothing else.
EXPORT_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "nanolab.json",
        "README.md",
    }
)


class ExportError(NanolabError):
    """An export that cannot be written; the message names the option and the fix."""


def check_destination(out: Path, force: bool) -> None:
    """Refuse to write over anything but a previous export, and that only with ``--force``."""
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir() or out.is_symlink():
        raise ExportError(f"-o {out} exists and is not a folder; choose another -o")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    if not force:
        raise already_exists(out)
    foreign = [name for name in entries if name not in EXPORT_FILES]
    if foreign or ("config.json" not in entries and "nanolab.json" not in entries):
        example = foreign[0] if foreign else entries[0]
        raise ExportError(
            f"-o {out} holds files an export does not write (e.g. {example}); --force replaces "
            "only a previous export folder: choose another -o"
        )
    if not is_previous_export(out):
        raise ExportError(
            f"-o {out} is not a previous nanolab export (no 'nanolab' entry in its config.json, "
            "no model in its nanolab.json): --force replaces only what nanolab export wrote; "
            "choose another -o"
        )


def already_exists(out: Path) -> ExportError:
    """The refusal of an ``-o`` that exists, without ``--force`` (checked before the work and
    again before the move into place)."""
    return ExportError(
        f"-o {out} already exists; pass --force to replace that export, or choose another -o"
    )


def is_previous_export(out: Path) -> bool:
    """Whether folder ``out`` is what an export wrote, by the mark only an export leaves: the
    ``nanolab`` entry of ``config.json`` (``--format hf``) or the architecture in
    ``nanolab.json`` (``--format safetensors``). File names alone do not tell: transformers'
    ``save_pretrained`` writes ``config.json`` and ``model.safetensors`` too."""
    for name, key in (("config.json", RECORD_KEY), (INFO_NAME, "gpt")):
        try:
            content = json.loads((out / name).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(content, dict) and isinstance(content.get(key), dict):
            return True
    return False


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    plain = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    try:
        save_file(plain, str(path), metadata={"format": "pt"})
    except OSError:
        raise
    except Exception as err:  # safetensors' own error type wraps the file system's
        if "No space left" in str(err) or "Disk quota" in str(err):
            raise OSError(errno.ENOSPC, "No space left on device", str(path)) from None
        if "File too large" in str(err):  # a file-size limit (EFBIG): named as such
            raise OSError(errno.EFBIG, "File too large", str(path)) from None
        raise
    # safetensors creates the file 0600; every other export file follows the umask (0644
    # under the usual 022), and a serving process of another user must read the weights too.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def built_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape of the model a config builds, on the meta device (nothing
    allocated): for parts a project registered, whose tensors :func:`gpt_shapes` cannot know."""
    with torch.device("meta"):
        model = GPT(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def checkpoint_weights(
    ckpt: dict[str, Any], source: Path
) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """The architecture and the model's tensors as the checkpoint stores them (same dtype, no
    copy, no model built), checked against each other."""
    meta = gpt_section(ckpt, source)
    try:
        config = GPTConfig(**{**meta["gpt"], "gradient_checkpointing": False})
    except (TypeError, ValueError) as err:
        raise invalid_config(source, meta, err) from None
    check_part_modules(source, meta)
    state = {
        k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")
    }
    expected = gpt_shapes(config) if not meta.get("part_modules") else built_shapes(config)
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    wrong = [k for k in expected if k in state and tuple(state[k].shape) != expected[k]]
    if missing or extra or wrong:
        what = (
            f"{len(missing)} tensor(s) missing, e.g. {missing[0]}"
            if missing
            else f"unexpected tensor {extra[0]}"
            if extra
            else f"{wrong[0]} is {tuple(state[wrong[0]].shape)}, the config makes it "
            f"{expected[wrong[0]]}"
        )
        raise weights_misfit(source, meta, what)
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(v.isfinite().all())]
    if bad:
        raise CheckpointError(
            f"{source} has non-finite weights (NaN/inf in {len(bad)} tensors, e.g. {bad[0]}): "
            "the run diverged before this save; export an earlier checkpoint from its "
            "checkpoints/ folder"
        )
    return config, state


def write_hf(
    ckpt: dict[str, Any], config: GPTConfig, state: dict[str, torch.Tensor], out: Path
) -> list[str]:
    """A transformers folder in ``out``: ``GPT2LMHeadModel`` for the GPT-2 family,
    ``LlamaForCausalLM`` for RoPE + RMSNorm + SwiGLU without biases; returns notes for the user
    (tokenizer files)."""
    from nanolab.model.llama import (
        llama_config_from_nanolab,
        llama_refusals,
        llama_state_from_nanolab,
    )

    refusals, not_llama = export_refusals(config), llama_refusals(config)
    if refusals and not_llama:
        raise ExportError(
            f"--format hf: the model is neither GPT-2 ({'; '.join(refusals)}) nor Llama "
            f"({'; '.join(not_llama)}); export it with --format safetensors (for nanolab) instead"
        )
    spec = (ckpt.get("nanolab") or {}).get("tokenizer")
    notes: list[str] = []
    tokenizer = None
    if isinstance(spec, dict):
        try:
            tokenizer = tokenizer_from_spec(spec)
        except TokenizerSpecError:
            raise  # a damaged checkpoint, refused (export names the file), not a missing file
        except TokenizerError as err:
            notes.append(f"no tokenizer files: the checkpoint's tokenizer cannot be built ({err})")
    else:
        notes.append("no tokenizer files: the checkpoint stores no tokenizer")
    eot = tokenizer.eot_id if tokenizer is not None else None
    dtype = next(iter(state.values())).dtype
    record = {
        "tokenizer": {k: v for k, v in spec.items() if k != "json"} if spec else None,
        "global_step": ckpt.get("global_step"),
    }
    if refusals:  # Llama-shaped (RoPE, RMSNorm, SwiGLU, no biases)
        hf_config = llama_config_from_nanolab(config, eot, dtype, record)
        tensors = llama_state_from_nanolab(state, config)
    else:
        hf_config = hf_config_from_nanolab(config, eot, dtype, record)
        tensors = hf_state_from_nanolab(state, config)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    generation = generation_config_from_nanolab(config, eot)
    if generation is not None:  # padding ids never sampled, as in nanolab generate
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    _save_safetensors(tensors, out / "model.safetensors")
    if tokenizer is not None:
        from nanolab.model.hf_tokenizer import write_tokenizer_files

        write_tokenizer_files(tokenizer, out, config.block_size)
    return notes


def write_nanolab_safetensors(
    ckpt: dict[str, Any], config: GPTConfig, state: dict[str, torch.Tensor], out: Path
) -> None:
    """nanolab's own tensor names in ``model.safetensors``, architecture and tokenizer in
    ``nanolab.json`` (a tied head is stored once, as ``wte.weight``)."""
    state = dict(state)
    if config.tie_weights:
        state.pop("lm_head.weight")
    _save_safetensors(state, out / "model.safetensors")
    meta = ckpt.get("nanolab") or {}
    info = {
        "gpt": asdict(config),
        "tokenizer": meta.get("tokenizer"),
        "global_step": ckpt.get("global_step"),
        "tied": ["lm_head.weight", "wte.weight"] if config.tie_weights else [],
    }
    (out / "nanolab.json").write_text(json.dumps(info, indent=2) + "\n")


def _command(argv: Any) -> str | None:
    """``nanolab fit ...`` from a start record's ``argv`` (None when it holds no fit command)."""
    if not isinstance(argv, list) or len(argv) < 2 or not all(isinstance(a, str) for a in argv):
        return None
    if argv[1] != "fit":  # a fit started in-process by other code: its argv is not a command
        return None
    return "nanolab " + shlex.join(argv[1:])


def _trained_by(run_dir: Path, step: Any) -> dict[str, Any]:
    """The start record of the launch that trained step ``step`` of the run: the newest one
    that started before it (a launch that starts at a step trains the ones after it), read
    from the end of the log. A later launch (resumed with another config, another command)
    did not make this checkpoint; a step not known: the newest launch."""
    import contextlib

    from nanolab.runlog import RUN_LOG_NAME, iter_backwards
    from nanolab.runs import record_problem

    def began_before(record: dict[str, Any]) -> bool:
        began = record.get("step")
        began = began if isinstance(began, int) and not isinstance(began, bool) else 0
        return not isinstance(step, int) or began < step or began == step == 0

    starts = iter_backwards(
        run_dir / RUN_LOG_NAME,
        "start",
        where=lambda r: record_problem(r) is None and began_before(r),
        split_cr=True,
    )
    with contextlib.closing(starts):
        return next(starts, None) or {}


def _callback_state(ckpt: dict[str, Any], name: str) -> dict[str, Any]:
    """The state callback ``name`` saved in the checkpoint (Lightning keys it by the class's
    name, with a suffix when the callback has a state key); empty when it saved none."""
    callbacks = ckpt.get("callbacks")
    if isinstance(callbacks, dict):
        for key, state in callbacks.items():
            if str(key).split("{")[0] == name and isinstance(state, dict):
                return state
    return {}


#: The metric the run log writes as ``val_loss``: the one stored validations must be of.
VAL_LOSS_METRIC = "val/loss"


def _stored_vals(ckpt: dict[str, Any]) -> dict[int, float]:
    """Training's validation losses by step as the checkpoint stores them (the checkpoint
    rotation's record and the cost budget's history): those of the timeline that made it. A
    state that does not say it holds ``val/loss`` (``monitor`` set to another metric, or a
    checkpoint from before states named theirs) is not read."""
    budget = _callback_state(ckpt, "CostBudget")
    rotation = _callback_state(ckpt, "RotatingCheckpoint")
    vals: dict[int, float] = {}
    if budget.get("monitor") == VAL_LOSS_METRIC:
        for entry in budget.get("history") or ():
            if isinstance(entry, (list, tuple)) and len(entry) == 3:
                vals[int(entry[0])] = float(entry[2])
    if rotation.get("monitor") == VAL_LOSS_METRIC:
        for at, value in (rotation.get("val_by_step") or {}).items():
            vals[int(at)] = float(value)
    return vals


def _stored_val(ckpt: dict[str, Any], step: Any) -> tuple[int, float] | None:
    """(step, loss) of the newest validation the checkpoint stores at or before ``step``."""
    known = isinstance(step, int) and not isinstance(step, bool)
    vals = {s: v for s, v in _stored_vals(ckpt).items() if not known or s <= step}
    return (at := max(vals), vals[at]) if vals else None


def _stored_datasets(ckpt: dict[str, Any]) -> list[str]:
    """The prepared data folders in the data fingerprint the checkpoint's DataModule stored
    (whatever the class's name)."""
    for value in ckpt.values():
        if isinstance(value, dict) and isinstance(value.get("data_fingerprint"), dict):
            parts = value["data_fingerprint"].get("datasets") or []
            return [str(d["path"]) for d in parts if isinstance(d, dict) and d.get("path")]
    return []


def _why_no_log(run_dir: str | None, run_id: str | None) -> str:
    """Why the run folder the checkpoint records cannot be read for the card (its log is gone,
    or names another run now)."""
    if run_dir is None:
        return "the checkpoint records no run folder"
    from nanolab.runlog import RUN_LOG_NAME, owner_of_log

    log = Path(run_dir) / RUN_LOG_NAME
    if not Path(run_dir).is_dir():
        return "that folder is gone (moved or deleted)"
    if not log.is_file():
        return f"that folder has no {RUN_LOG_NAME}"
    owner = owner_of_log(log)
    return f"its {RUN_LOG_NAME} names {'no run' if owner is None else f'run {owner}'} now"


def _log_of(source: Path, ckpt: dict[str, Any]) -> tuple[Path | None, str | None]:
    """(the run folder whose log the card reads, None when it reads none; how it was found:
    None for the folder the file sits in). A file in ``<run>/checkpoints/`` is that run's
    unless the folder's log names another run than the checkpoint records; one copied out of
    it is read against the folder it records, while that folder's log still names its run."""
    from nanolab.runlog import RUN_LOG_NAME, owner_of_log
    from nanolab.training.resume import run_of_checkpoint

    run_id, run_dir = run_of_checkpoint(ckpt)
    if source.parent.name == "checkpoints":
        held = source.parent.parent
        log = held / RUN_LOG_NAME
        if log.is_file() and (run_id is None or owner_of_log(log) in (None, run_id)):
            return held, None
    if run_id is None or run_dir is None or owner_of_log(Path(run_dir) / RUN_LOG_NAME) != run_id:
        return None, None
    if Path(run_dir).resolve() in source.resolve().parents:  # Lightning's hpc_ckpt_*, say
        return Path(run_dir), None
    return Path(run_dir), "recorded"


def _run_facts(run_dir: Path, step: Any) -> dict[str, Any]:
    """What run ``run_dir`` logged of its checkpoint of ``step``: the start record (config, argv)
    of the launch that trained it; training's own validation at the checkpoint's step (the
    last one before it, failing that); and the newest ``nanolab validate`` of this very step.

    The launch is the one that logged the newest save of the checkpoint's step
    (:func:`nanolab.runs.launch_that_saved`), and training's validation is read on the
    timeline that launch trained (:func:`nanolab.runs.iter_timeline`): a run resumed from an
    older checkpoint trains the later steps again, and the first timeline's validations
    (later in the log than the steps they scored) are not this checkpoint's. A ``validate``
    counts when it came after that save: one before it scored the file this one replaced.

    The two validations are kept apart by the one rule every reader of the curve uses
    (:func:`nanolab.runlog.written_in_training`): a ``validate`` appended later scored the
    checkpoint afterwards, without the tokens a training point has, and taken for training's
    figure it made the card print its loss as the run's and "tokens: not logged"."""
    from nanolab.runlog import RUN_LOG_NAME, event_marks, iter_numbered, written_in_training
    from nanolab.runs import iter_timeline, launch_that_saved, record_problem

    known = isinstance(step, int) and not isinstance(step, bool)
    launch = launch_that_saved(run_dir, step) if known else None
    trained = None  # the newest copy of the highest step (a resume redoes the later steps)
    for r in iter_timeline(run_dir, ("val",), launch):
        at = r.get("step")
        if not isinstance(at, int) or not written_in_training(r) or (known and at > step):
            continue
        if trained is None or at >= trained["step"]:
            trained = r
    validated = None
    after = launch.saved_line if launch is not None else -1
    for number, r in iter_numbered(run_dir / RUN_LOG_NAME, containing=event_marks("val")):
        of_step = known and r.get("event") == "val" and r.get("step") == step
        if of_step and number > after and record_problem(r) is None:
            validated = r if not written_in_training(r) else validated
    return {
        "run_dir": run_dir,
        "start": launch.start if launch is not None else _trained_by(run_dir, step),
        "val": trained,
        "validated": validated,
        "begins": _log_begins(run_dir),
    }


@dataclass(frozen=True)
class LogBegins:
    """Where a run log's timeline begins (:func:`_log_begins`)."""

    step: int  # the step its first launch began from (0: trained from scratch)
    branched: bool  # that launch began this run from another run's checkpoint


def _log_begins(run_dir: Path) -> LogBegins:
    """Where run ``run_dir``'s log begins: its first usable start record's step (a branch's
    ``resumed_from_step``, the parent's step it was started from). A branch's checkpoints
    store the validations its parent scored up to there (the cost budget's history and the
    checkpoint rotation's record carry on), which the branch's own log never held: they are
    not evidence that the log is another checkpoint's. Read as a stream: the first start
    record is near the top however long the log."""
    import contextlib

    from nanolab.runlog import RUN_LOG_NAME, iter_records, started_from_another_run
    from nanolab.runs import record_problem

    starts = iter_records(run_dir / RUN_LOG_NAME, "start")
    with contextlib.closing(starts):
        first = next((r for r in starts if record_problem(r) is None), None)
    if first is None:
        return LogBegins(0, False)
    branched = started_from_another_run(first)
    at = first.get("resumed_from_step") if branched else first.get("step")
    return LogBegins(at if isinstance(at, int) and not isinstance(at, bool) else 0, branched)


def _before_log_text(at: int, begins: LogBegins | None) -> str:
    """Whose a stored validation of step ``at`` is when the run's log begins after it: the
    parent run's, for a branch (its own log never scored it)."""
    if begins is None or at > begins.step:
        return ""
    return ", the parent run's, before this branch" if begins.branched else ", before this log"


def _validated_text(record: dict[str, Any]) -> str:
    """A ``nanolab validate`` record of the checkpoint's step as the card shows it, apart from
    training's validation: its loss and bits per byte (``4.8492, 6.9960 bits per byte``)."""
    loss, bpb = record.get("val_loss"), record.get("val_bpb")
    text = "not logged" if not isinstance(loss, (int, float)) else f"{loss:.4f}"
    if isinstance(bpb, (int, float)):
        text += f", {bpb:.4f} bits per byte"
    return text + " (appended after training; the rows above are training's validation)"


def model_card(ckpt: dict[str, Any], config: GPTConfig, source: Path, command: str | None) -> str:
    """The export's README.md: what the weights are (architecture, data, tokenizer), how far they
    were trained (steps, tokens, val loss and bits per byte from the run's log) and the
    commands that trained and exported them, so a folder found later explains itself.

    The run's log is the one of the folder the file sits in (``<run>/checkpoints/``) or, for a
    file copied out of it, of the run folder the checkpoint records. Without a log that is this
    checkpoint's (gone, another run's now, or of a timeline the run trained again after this
    save), the card says so and shows what the checkpoint itself stores."""
    step = ckpt.get("global_step")
    run_dir, found = _log_of(source, ckpt)
    facts = _run_facts(run_dir, step) if run_dir is not None else {}
    begins = facts.get("begins")
    why_not = _not_its_log(ckpt, facts.get("val"), step, begins) if facts else None
    if not facts or why_not is not None:
        read = (run_dir, why_not) if run_dir is not None and why_not is not None else None
        return _card_from_checkpoint(ckpt, config, source, command, read, begins)
    start, val = facts.get("start") or {}, facts.get("val")
    run_config = start.get("config") if isinstance(start.get("config"), dict) else {}
    data = (run_config.get("data") or {}).get("init_args") or run_config.get("data") or {}

    def shown(value: Any, fmt: str = "") -> str:
        return "not logged" if value is None else format(value, fmt)

    # Read at an earlier step than the checkpoint's (no validation at its own): said on
    # each row read there, the tokens too.
    at = f" (step {val['step']})" if val and val.get("step") != step else ""
    validated = facts.get("validated")
    copied = " (recorded in the checkpoint; this file was copied out of it)"
    rows = [
        ("checkpoint", f"`{source}`"),
        ("run", f"`{run_dir}`" + (copied if found else "")),
        ("steps", shown(step)),
        ("tokens", _stored_tokens_text(ckpt) if not val
                   else shown(val.get("tokens"), ",") + at),
        ("val loss", _inherited_text(ckpt, step, begins) if not val
                     else shown(val.get("val_loss"), ".4f") + at),
        ("val bits per byte", f"not logged (no validation in the run's log up to step {step})"
                              if not val else shown(val.get("val_bpb"), ".4f") + at),
        *([("val loss, nanolab validate", _validated_text(validated))] if validated else []),
        ("data", ", ".join(f"{k}: `{json.dumps(data[k])}`"
                           for k in ("dataset_dir", "source", "datasets") if data.get(k)) or "not logged"),
        _tokenizer_row(ckpt, config),
        ("trained with", f"`{c}`" if (c := _command(start.get("argv"))) else "not logged"),
        _exported_row(command),
    ]  # fmt: skip
    intro = (
        "A GPT language model trained with nanolab. The figures below are read from the",
        "checkpoint and from the run log (`metrics.jsonl`) of the run that wrote it.",
    )
    section = ("The run's config", run_config) if run_config else None
    return _card_text(run_dir.name, intro, rows, config, section)


def _stored_tokens_text(ckpt: dict[str, Any]) -> str:
    """The tokens row of a card whose log has no validation up to the checkpoint's step (a
    branch saved before its first validation): the tokens the checkpoint's clock stores at
    its step (a branch's count on from its parent's, as its log's do), else "not logged"."""
    tokens = _callback_state(ckpt, "RunClock").get("tokens")
    ok = isinstance(tokens, int) and not isinstance(tokens, bool)
    return f"{tokens:,} (stored in the checkpoint)" if ok else "not logged"


def _inherited_text(ckpt: dict[str, Any], step: Any, begins: LogBegins | None) -> str:
    """The val loss row of a card whose log has no validation up to the checkpoint's step:
    the one the checkpoint stores from before the log begins (a branch saved before its first
    validation: its parent's, said so), else "not logged"."""
    stored = _stored_val(ckpt, step)
    if stored is None or not (whose := _before_log_text(stored[0], begins)):
        return "not logged"
    return f"{stored[1]:.4f} (step {stored[0]}{whose}; stored in the checkpoint)"


def _not_its_log(
    ckpt: dict[str, Any], val: dict[str, Any] | None, step: Any, begins: LogBegins | None = None
) -> str | None:
    """Why the run log's validation is not this checkpoint's, or None: the newest validation
    the checkpoint stores up to its step is not the log's (the run was resumed from an earlier
    step after this file was saved, and trained those steps again). A checkpoint that stores
    none is taken at the log's word, and so is one whose newest stored validation is from at
    or before the step the log ``begins`` at: a branch's checkpoint saved before the branch
    first validated stores its parent's, which the branch's log never held."""
    stored = _stored_val(ckpt, step)
    if stored is None:
        return None
    at, loss = stored
    logged = (val or {}).get("val_loss")
    if not val or not isinstance(logged, (int, float)):
        if begins is not None and at <= begins.step:
            return None
        return f"its log holds no validation of step {at}, which this checkpoint stores"
    if val.get("step") == at and math.isclose(loss, logged, rel_tol=1e-6):
        return None
    return (
        f"its log's validation up to step {step} is step {val.get('step')}'s {logged:.4f}, this "
        f"checkpoint's is step {at}'s {loss:.4f}: the run trained those steps again after this "
        "file was saved"
    )


def _card_from_checkpoint(
    ckpt: dict[str, Any],
    config: GPTConfig,
    source: Path,
    command: str | None,
    not_its_log: tuple[Path, str] | None = None,
    begins: LogBegins | None = None,
) -> str:
    """The card of a checkpoint whose run log cannot be read: none found (why, found out
    here), or ``not_its_log`` (the run folder whose log was read, why it is not this
    checkpoint's). Its figures are what the checkpoint stores (steps, tokens, training's
    validation loss, the data folders, the optimizer and schedule), each said to come from it;
    what only the log has (bits per byte, the fit command, the whole config) is said to be
    there. ``begins``: where the log read begins, so a validation from before it (a branch's
    parent's) is said to be so."""
    from nanolab.training.resume import run_of_checkpoint

    step = ckpt.get("global_step")
    run_id, run_dir = run_of_checkpoint(ckpt)
    said = ", recorded in the checkpoint" if run_dir is not None else ""
    if not_its_log is not None:  # the folder read, maybe not the one recorded (a moved run)
        run_dir, why, said = str(not_its_log[0]), not_its_log[1], ""
    else:
        if run_dir is None and source.parent.name == "checkpoints":  # saved before runs said it
            run_dir = str(source.parent.parent)
        why = _why_no_log(run_dir, run_id)
    in_ckpt, only_log = (
        "(stored in the checkpoint)",
        "not stored in the checkpoint (read from the run's log only)",
    )
    run = (
        f"`{run_dir}`{f' (run {run_id})' if run_id else ''}{said}; {why}"
        if run_dir is not None
        else "not recorded in the checkpoint (a loose file)"
    )
    tokens = _callback_state(ckpt, "RunClock").get("tokens")
    val = _stored_val(ckpt, step)
    whose = _before_log_text(val[0], begins) if val and not_its_log is not None else ""
    at = f" (step {val[0]}{whose})" if val and (val[0] != step or whose) else ""
    datasets = _stored_datasets(ckpt)
    rows = [
        ("checkpoint", f"`{source}`"),
        ("run", run),
        ("steps", "not stored" if step is None else str(step)),
        ("tokens", f"{tokens:,} {in_ckpt}" if isinstance(tokens, int) else only_log),
        ("val loss", f"{val[1]:.4f}{at} {in_ckpt}" if val else only_log),
        ("val bits per byte", only_log),
        ("data", ", ".join(f"`{d}`" for d in datasets) + f" {in_ckpt}" if datasets else only_log),
        _tokenizer_row(ckpt, config),
        ("trained with", only_log),
        _exported_row(command),
    ]
    intro = (
        "A GPT language model trained with nanolab. The figures below are read from the",
        "checkpoint alone: the run log (`metrics.jsonl`) of the run that wrote it is not read",
        "(the run row says why).",
    )
    meta = ckpt.get("nanolab") or {}
    stored = {k: meta[k] for k in SETUP_STORED if meta.get(k) is not None}
    section = ("The training setup the checkpoint stores", stored) if stored else None
    return _card_text(Path(run_dir).name if run_dir else source.stem, intro, rows, config, section)


#: What of the run's config a checkpoint stores (``ckpt["nanolab"]``), shown on a card made
#: without the run's log.
SETUP_STORED = ("optimizer", "schedule", "freeze", "seed_everything", "precision", "layout")


def _tokenizer_row(ckpt: dict[str, Any], config: GPTConfig) -> tuple[str, str]:
    tokenizer = (ckpt.get("nanolab") or {}).get("tokenizer") or {}
    return "tokenizer", f"{tokenizer.get('name', 'not stored')}, vocabulary {config.vocab_size}"


def _exported_row(command: str | None) -> tuple[str, str]:
    return "exported with", f"`{command}`" if command else "nanolab export"


def _card_text(
    title: str,
    intro: Sequence[str],
    rows: Sequence[tuple[str, str]],
    config: GPTConfig,
    section: tuple[str, dict[str, Any]] | None,
) -> str:
    """The card's Markdown: title, intro, the table of ``rows``, the architecture and
    ``section`` (a heading and the config it shows)."""
    lines = [
        f"# {title}",
        "",
        *intro,
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in rows),
        "",
        "## Architecture (nanolab's GPTConfig)",
        "",
        "```json",
        json.dumps(asdict(config), indent=2),
        "```",
    ]
    if section is not None:
        heading, content = section
        lines += ["", f"## {heading}", "", "```json",
                  json.dumps(content, indent=2, default=str), "```"]  # fmt: skip
    return "\n".join(lines) + "\n"


def export(
    ckpt_path: str | Path,
    fmt: str,
    out: str | Path,
    force: bool = False,
    command: str | None = None,
) -> list[str]:
    """Write the export of ``ckpt_path`` to ``out`` (atomically), with a README.md model card;
    returns notes for the user."""
    out = Path(out)
    recover_interrupted(out)
    check_destination(out, force)
    path = resolve_checkpoint(ckpt_path)
    ckpt = load_checkpoint(path)
    config, state = checkpoint_weights(ckpt, path)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.export-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    notes: list[str] = []
    try:
        if fmt == "hf":
            try:
                notes = write_hf(ckpt, config, state, staging)
            except TokenizerSpecError as err:
                raise stored_tokenizer_error(path, err) from None
        else:
            write_nanolab_safetensors(ckpt, config, state, staging)
        (staging / "README.md").write_text(model_card(ckpt, config, path, command))
        # -o may have appeared since the check (another export to it, a folder of the user's):
        # checked again, and moved, under one lock that every export to -o takes.
        with exclusive(out.parent / f".{out.name}.export-lock"):
            check_destination(out, force)
            old = None
            if out.exists():  # an empty folder, or a previous export with --force
                old = out.parent / f".{out.name}.replaced-{os.getpid()}"
                out.rename(old)
            try:
                staging.rename(out)
            except OSError as err:
                if old is not None:
                    old.rename(out)  # the previous export stays as it was
                elif err.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    raise already_exists(out) from None  # made since the check, not an export's
                raise
            if old is not None:
                shutil.rmtree(old)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return notes


def recover_interrupted(out: Path) -> None:
    """What a killed export left beside ``out``: its staging copy (``.<name>.export-PID``, a
    full-size hidden folder no later export would remove) goes; a previous export it had moved
    aside (``.<name>.replaced-PID``) and not yet replaced comes back as ``out``, or goes once
    ``out`` is the newer export. Leftovers of a live process are left to it."""
    import glob
    import re

    from nanolab.processes import pid_alive

    def dead(kind: str) -> list[Path]:
        """``.<name>.<kind>-PID`` exactly (not another output's), its process gone: this one's
        own pid too (in a container every export may be pid 1, and this one has not begun)."""
        exact = re.compile(rf"\.{re.escape(out.name)}\.{kind}-(\d+)")
        found = []
        for p in out.parent.glob(f".{glob.escape(out.name)}.{kind}-*"):
            m = exact.fullmatch(p.name)
            if m and (int(m.group(1)) == os.getpid() or not pid_alive(int(m.group(1)))):
                found.append(p)
        return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)

    for staging in dead("export"):
        shutil.rmtree(staging, ignore_errors=True)
    replaced = dead("replaced")
    if replaced and not out.exists():
        os.replace(replaced.pop(0), out)
    for stale in replaced:
        shutil.rmtree(stale, ignore_errors=True)


@one_line_errors("nanolab export")
def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(
        prog="nanolab export",
        description="Write a checkpoint as a Hugging Face GPT-2 folder or as safetensors.",
    )
    parser.add_argument(
        "--ckpt", required=True, help="checkpoint file (runs/x/checkpoints/last.ckpt) or run dir"
    )
    parser.add_argument(
        "--format",
        choices=("hf", "safetensors"),
        default="hf",
        help="hf: transformers GPT-2 folder with tokenizer files; safetensors: weights + "
        "nanolab.json (any nanolab model)",
    )
    parser.add_argument("-o", "--out", required=True, help="folder to write (must not exist)")
    parser.add_argument("--force", action="store_true", help="replace a previous export in -o")
    add_import_option(parser)
    args = parser.parse_args(argv)
    refuse_inside_run(args.out, "-o", ExportError)
    import_modules(args.imports)
    start = time.perf_counter()
    try:
        given = list(sys.argv[2:] if argv is None else argv)
        notes = export(
            args.ckpt, args.format, args.out, args.force, "nanolab export " + shlex.join(given)
        )
    except OSError as err:
        if err.errno == errno.EFBIG:  # a size limit: free space would not help
            limit, fix = size_limit_met("-o")
            refused = ExportError(
                f"cannot write -o {args.out} ({err.strerror or err}: {limit}); {fix}; "
                "nothing was written there"
            )
            raise with_errno_of(refused, err) from None
        refused = ExportError(
            f"cannot write -o {args.out} ({err.strerror or err}); "
            "choose a folder this user can write, with free space"
        )
        raise with_errno_of(refused, err) from None
    for note in notes:
        messages.note("nanolab export", note)
    print(f"wrote {args.out} ({args.format}) in {time.perf_counter() - start:.1f}s")
    return 0
