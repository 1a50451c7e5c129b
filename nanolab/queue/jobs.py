"""From ``queue add CONFIG --set k=v --seeds 1,2`` to validated jobs, refused now, not at 3 a.m.

A config is read as the real ``nanolab fit`` parser reads it (the same LightningCLI class,
defaults and linked arguments: from the parser's remembered schema where it can say, else by the
parser itself; :mod:`nanolab.run.read`), in this process: unknown keys, wrong types and
unreadable YAML fail here. Then the checks ``nanolab fit`` would only make when it starts are made too: the model, optimizer
and schedule settings (their dataclasses validate themselves), the global batch against the
micro-batch (gradient accumulation must come out whole), a finite ``trainer.max_steps`` (or -1 with a budget limit: tokens, hours, GPU-hours or cost; the
training stream is endless, so a job without an end never ends), and that the data exists (a
prepared ``data.dataset_dir`` or readable ``data.source`` paths). The data is not prepared here:
tokenizing a large corpus is the job's work.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import hashlib
import re
import time
import unicodedata
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import groupby, pairwise
from pathlib import Path
from typing import Any

from nanolab.errors import NanolabError
from nanolab.estimator.run_length import (
    Budget,
    budget_problem,
    hour_limits,
    run_length,
)
from nanolab.home import expand_user
from nanolab.queue.db import Job, NewJob

#: Keys the queue sets itself on every job.
RESERVED_KEYS = {
    "run.name": "use --name (the queue derives each job's run name from it)",
    "run.resume": "the queue always resumes a job from its own run directory (run.resume auto)",
    "seed_everything": "use --seeds 42,43,44",
    "config": "pass the YAML file as CONFIG",
}

#: How ``queue add`` gives a key the queue sets itself, in a hint (``{value}``: the value given).
QUEUE_FORMS = {"seed_everything": "--seeds {value}", "run.name": "--name {value}"}


def reserved_line(given: str, key: str, value: str | None = None) -> str:
    """The refusal of fit's setting ``key`` that the queue sets itself, naming it as the user
    gave it (``given``: ``--seed_everything 3``, ``--set seed_everything=3``, ``--sweep
    seed_everything``), never as another option they did not write. ``value``: the value
    given, shown in the option that takes it (``use --seeds 3``; a sweep's seeds ``1,2``)."""
    form = QUEUE_FORMS.get(key)
    fix = f"use {form.format(value=value)}" if form and value else RESERVED_KEYS[key]
    if key == "seed_everything" and value and not _seeds_valid(value):
        from nanolab.training.resolve import MAX_SEED  # --seeds 1.5 would fail in turn

        fix = f"use --seeds with integers from 0 to {MAX_SEED} (not {value}), e.g. --seeds 42,43,44"
    return f"{given}: set by the queue; {fix}"


def _seeds_valid(text: str) -> bool:
    """Whether ``--seeds TEXT`` would be taken (:func:`parse_seeds`)."""
    try:
        parse_seeds(text)
    except JobConfigError:
        return False
    return True


def queue_form(key: str, value: str) -> str | None:
    """How ``queue add`` gives fit's setting ``key`` (None: it cannot, the queue sets it)."""
    if key in RESERVED_KEYS:
        form = QUEUE_FORMS.get(key)
        return None if form is None else form.format(value=value or "N")
    return f"--set {key}={value}"


#: What a derived run name keeps besides letters, marks and digits of any script.
_NAME_PUNCTUATION = frozenset("._=+-")


def _kept_in_name(char: str) -> bool:
    """Letters, combining marks (a Devanagari vowel sign, a decomposed accent) and digits of any
    script, as fit's ``run.name`` takes them (``lr-実験``), and ``._=+-``: a folder name that
    needs no quoting in a shell."""
    return char in _NAME_PUNCTUATION or unicodedata.category(char)[0] in "LMN"


def name_part(text: str) -> str:
    """``text`` as part of a derived run name: each run of other characters (``/`` of a path,
    spaces, brackets, control characters) becomes ``_``."""
    return "".join("".join(chars) if kept else "_" for kept, chars in groupby(text, _kept_in_name))


class JobConfigError(NanolabError):
    """A queued job whose config cannot run; the message names the config, the key and the fix."""


@dataclass
class ParsedConfig:
    """What the queue needs to know about a config after parsing it."""

    config: dict[str, Any]  # the merged ``fit`` config as plain data
    run_root: str
    #: The steps the job trains (:func:`planned_steps`; 0 while only an hour or cost limit
    #: ends it: the estimate plans those at the job's step time, :meth:`steps_at`).
    max_steps: int
    devices: int
    tokens_per_step: int
    step_bound: int | None = None  # ``trainer.max_steps`` when > 0
    budget: Budget = field(default_factory=Budget)
    world_size: int = 1

    def steps_at(self, step_s: float) -> int:
        """The steps the job trains at ``step_s`` seconds a step: the tightest of
        ``trainer.max_steps`` and every budget limit, its hours and cost included."""
        return (
            planned_steps(
                self.step_bound, self.budget, self.tokens_per_step, self.world_size, step_s
            )
            or self.max_steps
        )


def parse_sets(sets: list[str]) -> list[tuple[str, str]]:
    """``["model.optimizer.lr=1e-3"]`` -> ``[("model.optimizer.lr", "1e-3")]``."""
    out = []
    for item in sets:
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-")
        if not sep or not key:
            raise JobConfigError(
                f"--set {item!r}: expected KEY=VALUE, e.g. --set model.optimizer.lr=1e-3"
            )
        if key in RESERVED_KEYS:
            raise JobConfigError(reserved_line(f"--set {key}={value}", key, value))
        out.append((key, value))
    return out


def parse_seeds(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise JobConfigError(
            f"--seeds {text!r}: expected integers, e.g. --seeds 42,43,44"
        ) from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise JobConfigError(f"--seeds {text!r}: give distinct integers, e.g. --seeds 42,43,44")
    from nanolab.training.resolve import MAX_SEED

    bad = [s for s in seeds if not 0 <= s <= MAX_SEED]
    if bad:
        raise JobConfigError(
            f"--seeds {text!r}: {bad[0]} is out of range; seeds go from 0 to {MAX_SEED}"
        )
    return seeds


def job_names(
    config: Path, name: str | None, sets: list[tuple[str, str]], seeds: list[int] | None
) -> list[str]:
    """Run names: ``--name`` or ``<config stem>[-<key><value>...]``, plus ``-s<seed>`` per seed.

    A ``--name`` is kept as given: it is the run's ``run.name``, refused by fit's own rule
    (:func:`~nanolab.training.resolve.run_name_problem`) and never rewritten (a rewritten
    name would not be the one asked for, and two names could become one). A derived name has
    each run of other characters (``/`` of a path, spaces) made ``_``."""
    from nanolab.training.resolve import shown_name

    if name is not None:
        base = name
        given = f"--name {shown_name(name)}"
    else:
        parts = [config.stem] + [f"{k.rsplit('.', 1)[-1]}{v}" for k, v in sets]
        base = name_part("-".join(parts)).strip("_") or "job"
        given = f"the job name {shown_name(base)} (from {config.name}; give --name)"
    names = [f"{base}-s{s}" for s in seeds] if seeds else [base]
    for run_name in names:
        _check_job_name(run_name, base, given)
    return names


def _check_job_name(run_name: str, base: str, given: str) -> None:
    """Refuse a job's run name (``base`` and its seed's suffix) fit would refuse, or one the
    queue would misread; ``given``: where the name came from, as the message says it."""
    from nanolab.training.resolve import override_value, run_name_problem, shown_name

    if run_name != base:  # the seed's suffix made it too long, or a comment ('#x-s1')
        given += f" (run name {shown_name(run_name)})"
    problem = run_name_problem(run_name)
    if problem is not None:
        raise JobConfigError(f"{given}: {problem}")
    # The runner passes --run.name=<name>, read as YAML: '~', 'Null', ' null', '#x' (a comment)
    # are all null, no name, and fit trains in a timestamped folder; 'true' or '1e3' stay text.
    if override_value(run_name) is None:
        raise JobConfigError(
            f"{given}: a run name the command line reads as null (no name, so a timestamped "
            "run directory the queue does not follow); give another --name"
        )


def fit_args(sets: list[tuple[str, str]], seed: int | None) -> list[str]:
    """Extra ``nanolab fit`` arguments for one job (the config and run name are added at launch)."""
    return [f"--{k}={v}" for k, v in sets] + ([] if seed is None else [f"--seed_everything={seed}"])


def parse_config(
    config: Path,
    args: list[str],
    run_name: str,
    cwd: Path,
    *,
    seed_of: ParsedConfig | None = None,
    seed: int | None = None,
    swept: frozenset[str] = frozenset(),
) -> ParsedConfig:
    """Read ``nanolab fit --config CONFIG ARGS`` as the fit parser does and check it can run.

    The config is read by :func:`nanolab.run.read.fit_config`: with the parser's remembered
    types and defaults (no Lightning, ~10 ms), or by the parser itself where they cannot say
    (a value they refuse, a class of one's own; seconds). ``seed_of``: the reading of this
    job's command line with another ``--seed_everything`` and run name (a sibling seed): its
    config is taken with ``seed`` and ``run_name`` set, the one thing read differently, and
    checked again, so a config is read once per experiment, not once per seed. ``swept``: the
    keys of ``args`` a ``--sweep`` gave (an error names that, not a ``--set``)."""
    from nanolab.run.read import FitParseError, fit_config

    # The error names every config file of the job: the key at fault may be in any of them.
    files = [str(config), *(b for a, b in pairwise(args) if a == "--config")]
    where = " + ".join(files)
    if seed_of is not None:
        cfg = copy.deepcopy(seed_of.config)
        cfg["seed_everything"] = seed
        cfg["run"]["name"] = run_name
    else:
        try:
            cfg = fit_config(["--config", str(config), *args, f"--run.name={run_name}"])
        except FitParseError as e:  # named once: a config file's own error already names it
            text = str(e)
            loose = "unknown option" in text or "unrecognized arguments" in text
            hint = set_hint(args) if loose else None
            if hint is not None:  # a --set key without its group: no file is at fault
                raise JobConfigError(hint) from None
            # A --set key fit does not know is the command line's, not a config file's.
            given = text.startswith("unknown setting --") or str(config) in text
            raise JobConfigError(
                text if given else f"{at_fault(text, args, where, swept)}: {text}"
            ) from None
    try:
        return _check(cfg, cwd)
    except (ValueError, TypeError) as e:  # RunConfigError, ConfigError: the key and the fix
        raise JobConfigError(f"{at_fault(str(e), args, where, swept)}: {e}") from None


def at_fault(text: str, args: list[str], files: str, swept: frozenset[str] = frozenset()) -> str:
    """Where the setting an error ``text`` is about was given: each ``--set KEY=VALUE`` of the
    job's fit arguments (``args``: ``--KEY=VALUE``) whose key the text names, as ``queue add``
    takes it (``--sweep KEY, value V`` for a key in ``swept``); the config ``files`` when it
    names none of them. A value typed on the command line
    is not the file's (which may say 2 where the user typed x); nor is a value the text quotes
    that is not the one typed (a file's ``n_layer: x`` refused before ``--set n_layer=3`` is
    applied)."""
    quoted = re.findall(r"'([^']*)'", text)
    named = []
    for arg in args:
        key, sep, value = arg[2:].partition("=")
        if not (arg.startswith("--") and sep and key) or key == "seed_everything":
            continue  # --seeds is checked before fit reads it
        mentioned = re.search(rf"(?<![\w.]){re.escape(key)}(?!\w|\.\w)", text)
        if (mentioned and (not quoted or _typed_in(value, quoted))) or _names_value(text, value):
            named.append(
                f"--sweep {key}, value {value}" if key in swept else f"--set {key}={value}"
            )
    return " ".join(named) if named else files


def _typed_in(value: str, quoted: list[str]) -> bool:
    """Whether an error quotes the typed ``value``, as typed or as the parser writes it back
    (``[1e-3,2e-3]`` is ``'[0.001, 0.002]'``): the two compared as the YAML values they are."""
    if value in quoted:
        return True
    from nanolab.training.resolve import override_value

    try:
        typed = override_value(value)
        return any(override_value(q) == typed for q in quoted)
    except ValueError:  # text the YAML reader refuses (a key given twice): not the value
        return False


def _names_value(text: str, value: str) -> bool:
    """Whether an error ``text`` that names no setting quotes the typed ``value`` itself (a
    suite ``builtin:nosuch``, a path): a word of its own, not a number or a short word that
    any line may hold."""
    if len(value) < 4 or re.fullmatch(r"[-+.\deE]+|true|false|null|none", value, re.I):
        return False
    return re.search(rf"(?<![\w.]){re.escape(value)}(?!\w)", text) is not None


#: What ``trainer.devices: auto`` is for a queued job: the one device the runner gives it
#: (through CUDA_VISIBLE_DEVICES), unless the config asks for N.
QUEUE_VISIBLE_GPUS = 1


def _check(parsed: Any, cwd: Path) -> ParsedConfig:
    """The checks ``nanolab fit`` makes at start-up, through the same resolver, plus a finite
    ``trainer.max_steps`` and data that exists (it is not prepared here)."""
    from nanolab.training.resolve import check_model_settings, plain_config, resolve, sections

    cfg = plain_config(parsed)
    check_model_settings(sections(cfg)[1])
    nodes = (cfg.get("trainer") or {}).get("num_nodes")  # 0: the resolver refuses it
    if isinstance(nodes, int) and nodes > 1:  # first: the batch checks count its nodes too
        raise JobConfigError(
            f"trainer.num_nodes is {nodes}; the queue runs each job on this machine: set 1 "
            "(a multi-node run starts with torchrun or srun, docs/scaling.md)"
        )
    vocab = _prepared_vocab(sections(cfg)[3], cwd, sections(cfg)[2])
    resolved = resolve(cfg, visible_gpus=QUEUE_VISIBLE_GPUS, data_vocab=vocab)
    if (problem := budget_problem(cfg.get("budget"))) is not None:
        raise JobConfigError(problem)  # fit's own line: a cost without a price is no end
    budget = Budget.from_config(cfg.get("budget"))
    step_bound = resolved.max_steps if resolved.max_steps and resolved.max_steps > 0 else None
    if step_bound is None and budget.max_tokens is None and not hour_limits(budget, 1):
        raise JobConfigError(
            f"trainer.max_steps is {resolved.max_steps!r} and no budget.max_tokens, "
            "max_wall_hours, max_gpu_hours or max_cost bounds the run; a queued job needs an end "
            "(the training stream never ends on its own): set trainer.max_steps, or a budget "
            "limit (fit then stops the run where it is spent)"
        )
    _check_data(resolved.data_args, cwd, sections(cfg)[2])
    _check_resume(cfg)
    _check_callbacks(cfg)
    _check_suite(cfg, cwd)
    micro = resolved.micro_batch_size
    if micro is None:  # run.micro_batch_size auto: the data's value until the job plans it
        micro = int(resolved.data_args.get("micro_batch_size") or 1)
        resolved = resolve(
            cfg, visible_gpus=QUEUE_VISIBLE_GPUS, data_vocab=vocab, micro_batch_size=micro
        )
    _check_data_sizes(resolved, micro, cwd, sections(cfg)[2])
    tokens_per_step = int(resolved.tokens_per_step or 0)
    return ParsedConfig(
        config=cfg,
        run_root=str((cfg.get("run") or {}).get("root") or "runs"),
        max_steps=planned_steps(step_bound, budget, tokens_per_step, resolved.world_size, 0.0),
        devices=resolved.devices_per_node,
        tokens_per_step=tokens_per_step,
        step_bound=step_bound,
        budget=budget,
        world_size=resolved.world_size,
    )


def planned_steps(
    step_bound: int | None, budget: Budget, tokens_per_step: int, world_size: int, step_s: float
) -> int:
    """The steps a job trains: the first of ``trainer.max_steps`` (``step_bound``) and where
    its budget stops it, by the rule fit's budget and ``nanolab estimate`` use
    (:func:`nanolab.estimator.run_length.run_length`); its hour and cost limits count only at a
    known ``step_s`` (seconds a step). 0: no step count is known (only such a limit ends it)."""
    length = run_length(step_bound, budget, tokens_per_step, step_s, world_size)
    return length.steps if length is not None else 0


def _check_callbacks(cfg: dict[str, Any]) -> None:
    """The rules of the run's callback settings, as ``nanolab fit`` checks them at start-up (a
    budget of -5 tokens, a cost cap without a price, a notify field that does not exist, a
    spike factor below 1), so a job is refused here with the line fit would print, not when it
    starts at night.

    A group left at the parser's defaults is not checked: every fit starts from those. A group
    whose rules live below the callbacks (:data:`SETTING_RULES`: the checkpoint, in-loop task,
    budget, spike and notify settings a recipe sets) is checked by them; any other is checked
    by building its callback, which imports Lightning (seconds: a sweep is queued without it)."""
    from nanolab.run import schema
    from nanolab.training.callback_settings import SETTING_RULES
    from nanolab.training.resolve import SETTING_GROUPS

    remembered = schema.load("fit")
    if remembered is not None:
        groups = [g for g in remembered.groups if g not in SETTING_GROUPS]
        changed = [g for g in groups if cfg.get(g) != remembered.defaults.get(g)]
        for group in changed:
            settings = cfg.get(group)
            if group in SETTING_RULES and isinstance(settings, dict):
                SETTING_RULES[group](settings)
        if all(g in SETTING_RULES for g in changed):
            return
    from nanolab.run.parse import run_callbacks

    for group, callback in run_callbacks().items():
        settings = cfg.get(group)
        if isinstance(settings, dict) and (
            remembered is None or settings != remembered.defaults.get(group)
        ):
            callback(**settings)


def _check_suite(cfg: dict[str, Any], cwd: Path) -> None:
    """The in-loop task suite read as fit reads it when the run starts (its constructor only
    keeps the name): a suite file that does not exist or does not parse is refused at add."""
    section = cfg.get("downstream")
    spec = section.get("suite") if isinstance(section, dict) else None
    if not spec:
        return
    from nanolab.downstream.tasks import TaskFileError, load_suite

    text = str(spec)
    if not text.startswith("builtin:") and not expand_user(text).is_absolute():
        text = str(_under(cwd, text))  # the job runs where it was added
    try:
        load_suite(text, section.get("limit"))
    except TaskFileError as err:
        raise JobConfigError(str(err)) from None  # the line fit prints at start-up


def _check_resume(cfg: dict[str, Any]) -> None:
    """The queue resumes every job from its own run directory after a preemption or a runner
    restart; settings that would make a restart begin again are refused here, not found out at
    the second attempt."""
    run = cfg.get("run") or {}
    if run.get("fresh"):
        raise JobConfigError(
            "run.fresh: true: each restart of a queued job (a preemption, the runner stopped) "
            "would move the run aside and train it again from step 0; drop it, and give a new "
            "--name for a new run"
        )
    if str(run.get("resume") or "auto") == "never":
        raise JobConfigError(
            "run.resume: never: a queued job resumes from its own checkpoints after a "
            "preemption (a restart from step 0 would be refused in a folder that holds them); "
            "drop it, and give a new --name for a new run"
        )


def start_checkpoint(cfg: dict[str, Any], cwd: Path) -> list[str]:
    """``--ckpt_path=PATH`` for a job whose config starts it from a checkpoint
    (``run.resume: PATH``): the runner sets ``run.resume auto`` on every attempt, so the path
    goes on as ``--ckpt_path``, the first attempt starts from it and later ones continue the run
    it started (``nanolab fit``'s rule for a fine-tune's own command)."""
    resume = str((cfg.get("run") or {}).get("resume") or "auto")
    if resume in ("auto", "never"):
        return []
    path = _under(cwd, resume)
    run_dir = _under(cwd, str((cfg.get("run") or {}).get("root") or "runs")) / str(
        cfg["run"]["name"]
    )
    if path.resolve().is_relative_to(run_dir.resolve()):
        raise JobConfigError(
            f"run.resume {resume}: a checkpoint of the job's own run; every restart would go "
            "back to it (and set aside what the job trained since). Go back once with `nanolab "
            "fit --run.resume PATH` (the later checkpoints are kept aside), then queue the run"
        )
    given = cfg.get("ckpt_path")
    if given is not None and _under(cwd, str(given)) != path:
        raise JobConfigError(
            f"ckpt_path {given} and run.resume {resume} name different checkpoints; give one"
        )
    return [f"--ckpt_path={path}"]


def _check_data(data: dict[str, Any], cwd: Path, data_class: str | None = None) -> None:
    """The data a job will train on exists: a prepared folder, a mixture of them, or sources
    to prepare from (nanolab's data keys; a DataModule of one's own without them is trusted).
    Sources go into a folder fit can prepare them into: one that holds a dataset prepared
    otherwise is refused here in fit's words (fit never overwrites one), not at night."""
    from nanolab.data.sources import BUNDLED, BUNDLED_PREFIX

    sources = data.get("source")
    if data.get("datasets"):  # a mixture of prepared folders (docs/data.md)
        for i, spec in enumerate(data["datasets"]):
            path = spec.get("path") if isinstance(spec, dict) else None
            if not isinstance(path, str) or not (_under(cwd, path) / "meta.json").is_file():
                raise JobConfigError(
                    f"data.datasets[{i}].path {path} holds no prepared dataset; run "
                    "`nanolab prepare` for it first"
                )
    elif not sources:
        if "dataset_dir" not in data:
            return
        dataset_dir = _under(cwd, data["dataset_dir"])
        if not (dataset_dir / "meta.json").is_file():
            raise JobConfigError(
                f"data.dataset_dir {dataset_dir} holds no prepared dataset and data.source is "
                "empty; run `nanolab prepare` first or set data.source"
            )
    else:
        for spec in sources:
            if spec.startswith(BUNDLED_PREFIX):
                if spec[len(BUNDLED_PREFIX) :] not in BUNDLED:
                    raise JobConfigError(
                        f"data.source: unknown bundled corpus {spec!r}; available: "
                        + ", ".join(BUNDLED_PREFIX + k for k in BUNDLED)
                    )
            elif glob.has_magic(spec):  # fit reads a glob's matches: one must be there
                if not glob.glob(str(_under(cwd, spec)), recursive=True):
                    raise JobConfigError(f"data.source: {spec} matches no file")
            elif not _under(cwd, spec).exists():
                raise JobConfigError(f"data.source: {spec} does not exist")
        if _source_is_setting(data_class):  # a name fit cannot prepare with: no stale folder
            _check_tokenizer(str(data.get("tokenizer") or "chars"), cwd)
        _check_prepared_folder(data, cwd, data_class)


def _check_tokenizer(name: str, cwd: Path) -> None:
    """``data.tokenizer`` one fit can prepare ``data.source`` with, in fit's words (a
    ``tokenizer.json`` path relative to the job's folder)."""
    from nanolab.data.tokenizers import check_tokenizer_name, is_tokenizer_file

    check_tokenizer_name(str(_under(cwd, name)) if is_tokenizer_file(name) else name)


def _check_prepared_folder(data: dict[str, Any], cwd: Path, data_class: str | None) -> None:
    """Refuse ``data.source`` whose ``data.dataset_dir`` holds a dataset prepared from other
    files or settings, as fit does at start (told from file sizes and times, nothing read).
    Only where the data class prepares ``data.source`` as configured: one that sets its own
    source (a records renderer) is trusted, fit checks it at start."""
    if not data.get("dataset_dir") or not _source_is_setting(data_class):
        return
    folder = _under(cwd, str(data["dataset_dir"]))
    if not (folder / "meta.json").is_file() or _holds_prepared(data, cwd) is not False:
        return
    from nanolab.data.stale import other_sources, prepare_command, stale_dataset_message

    source = [str(s) for s in data["source"]]
    prepare = prepare_command(source, data["dataset_dir"], *_prepare_settings(data))
    theirs = other_sources(folder, source, cwd)
    raise JobConfigError(
        stale_dataset_message(data["dataset_dir"], source, prepare, "fit", True, theirs=theirs)
    )


def _prepare_settings(data: dict[str, Any]) -> tuple[str, int, float]:
    """(tokenizer, bpe_vocab_size, val_fraction) fit prepares ``data.source`` with (the
    DataModule's defaults where unset; its module is not imported: queue add starts fast)."""
    return (
        str(data.get("tokenizer") or "chars"),
        int(data.get("bpe_vocab_size") or 4096),
        float(data.get("val_fraction") or 0.1),
    )


def _holds_prepared(data: dict[str, Any], cwd: Path) -> bool | None:
    """Whether ``data.dataset_dir`` already holds what fit would prepare there from
    ``data.source`` (:func:`nanolab.data.prepare.holds_prepared`: the same files and settings,
    told from sizes and times); None: it cannot be told now. One rule for ``queue add`` and
    ``--continue``, the rule fit applies."""
    from nanolab.data.prepare import holds_prepared
    from nanolab.data.sources import BUNDLED_PREFIX

    folder = _under(cwd, str(data.get("dataset_dir", "")))
    specs = [
        s if s.startswith(BUNDLED_PREFIX) else str(_under(cwd, s)) for s in data.get("source") or ()
    ]
    return holds_prepared(specs, folder, *_prepare_settings(data))


def _prepared_vocab(data: dict[str, Any], cwd: Path, data_class: str | None) -> int | None:
    """The vocabulary fit will read from the job's prepared data (its ``meta.json``), so a
    ``model.gpt.vocab_size`` below it is refused now; None where fit will prepare the data
    from ``data.source`` first, or the data class is one of its own (fit asks it)."""
    from nanolab.data.tokenizers import prepared_vocab

    if not _source_is_setting(data_class):
        return None
    if data.get("source") and not data.get("datasets") and _holds_prepared(data, cwd) is not True:
        return None
    return prepared_vocab(data, cwd)


def _source_is_setting(data_class: str | None) -> bool:
    """The data class prepares ``data.source`` as configured: nanolab's own, or a subclass
    that defines no ``__init__`` and no ``source`` of its own (a starter project's ``Data``).
    A class that may set its own source, or one that does not import here, is not judged."""
    from nanolab.training.plugins import DEFAULT_DATA, PluginImportError, load_class

    if data_class in (None, DEFAULT_DATA):
        return True
    from nanolab.data.datamodule import TokenDataModule

    try:
        cls = load_class(data_class, "data")
    except PluginImportError:
        return False
    if not (isinstance(cls, type) and issubclass(cls, TokenDataModule)):
        return False
    own = cls.__mro__[: cls.__mro__.index(TokenDataModule)]
    return not any("__init__" in c.__dict__ or "source" in c.__dict__ for c in own)


def _check_data_sizes(resolved: Any, micro: int, cwd: Path, data_class: str | None) -> None:
    """fit's start-up rules on the data's sizes (:mod:`nanolab.data.sizes`, the functions fit
    calls): the window settings and ``data.align`` in range, and a single prepared folder cut
    as a stream that fills one window and one micro-batch per device, ``data.source`` or not
    when the folder already holds what fit would prepare. A mixture, document alignment and
    data fit has yet to prepare need the tokens themselves: fit checks those at start."""
    import json

    from nanolab.data.sizes import (
        check_align,
        check_stream_fits,
        check_validation_fits,
        check_window_sizes,
    )

    data = resolved.data_args
    sizes = [micro, resolved.block_size, data.get("val_windows", 1), data.get("num_workers", 0)]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in sizes):
        return  # a DataModule of one's own with other meanings: its own start-up checks them
    check_window_sizes(*sizes)
    if not _source_is_setting(data_class):
        return  # a class with an __init__ of its own: its settings may mean other things
    check_align(data.get("align", "stream"))
    if data.get("datasets") or data.get("align", "stream") != "stream":
        return
    if data.get("source") and _holds_prepared(data, cwd) is not True:
        return  # fit prepares it first: its size is not known yet
    meta_path = _under(cwd, str(data.get("dataset_dir", ""))) / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
        tokens, val_tokens = meta["train_tokens"], meta.get("val_tokens")
    except (OSError, ValueError, KeyError, TypeError):
        return  # no readable meta.json: _check_data has said what it can, fit says the rest
    if isinstance(tokens, int):
        check_stream_fits(tokens, resolved.block_size, micro, resolved.world_size)
    if isinstance(val_tokens, int):  # fit's next check: a validation window of the split
        check_validation_fits(val_tokens, resolved.block_size)


def _under(cwd: Path, path: str) -> Path:
    p = expand_user(path)
    return p if p.is_absolute() else cwd / p


def config_key(config: dict[str, Any]) -> str:
    """Fingerprint of the config without seed and run name: jobs with equal keys are seeds of
    one experiment (their past durations predict each other's)."""
    from nanolab.runs import seed_free_fingerprint

    blob = seed_free_fingerprint(config) or ""
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


#: A ``--set`` value with one of these suffixes names a settings file (``--set data=d.yaml``,
#: fit's ``--data d.yaml``), which the job reads again at each start.
YAML_SUFFIXES = (".yaml", ".yml")


def config_files(config: str | Path, args: list[str], cwd: Path | None = None) -> list[Path]:
    """The YAML files a job reads: its config, every ``--config`` in its arguments, then every
    ``--KEY=FILE.yaml`` (a group's settings from a file; relative to ``cwd``, where the job
    runs). Chosen by the arguments alone, not by which files exist, so ``queue add`` and the
    job's start list the same files in the same order (one that is gone is named so)."""
    files = [Path(config)]
    files += [Path(args[i + 1]) for i, a in enumerate(args[:-1]) if a == "--config"]
    for arg in args:
        _, sep, value = arg.partition("=")
        if arg.startswith("--") and sep and value.strip().lower().endswith(YAML_SUFFIXES):
            files.append(_under(cwd, value.strip()) if cwd else expand_user(value.strip()))
    return files


def config_digest(files: list[Path]) -> str:
    """What ``queue add`` checked, to compare with what the job would read when it starts (an
    edited file is refused, not run unchecked): ``v2:`` and one digest of each file's bytes,
    so the refusal can name the file that changed."""
    return "v2:" + ",".join(_file_digest(path) for path in files)


def _file_digest(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except IsADirectoryError:
        return "folder"
    except OSError:
        return "missing"


#: How the refusal names a config file that is no longer what ``queue add`` read.
_NOW = {"missing": "gone", "folder": "now a folder"}


def _legacy_digest(files: list[Path]) -> str:
    """The one digest over names and bytes that jobs added by earlier versions carry."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path).encode() + b"\0")
        try:
            digest.update(path.read_bytes())
        except OSError:
            digest.update(b"<missing>")
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def changed_config(
    config: str | Path, args: list[str], sha: str | None, cwd: Path | None = None
) -> str | None:
    """The job's config files that are not as ``queue add`` read them, named (None: all are,
    or the job was added before digests were kept). ``cwd``: where the job runs, which its
    relative ``--KEY=FILE.yaml`` paths are under."""
    files = config_files(config, args, cwd)
    if sha is None:
        return None
    if not sha.startswith("v2:"):  # an older job: one digest, so every file is named
        files = files[: 1 + args.count("--config")]  # it covered no --KEY=FILE.yaml
        return None if _legacy_digest(files) == sha else ", ".join(str(f) for f in files)
    then = sha[3:].split(",")
    changed = [
        f"{path} ({_NOW.get(now, 'edited')})"
        for path, was, now in zip(files, then, (_file_digest(f) for f in files), strict=False)
        if was != now
    ]
    return ", ".join(changed) or None


def build_jobs(
    config: Path,
    sets: list[str],
    seeds: str | None,
    name: str | None,
    cwd: Path,
    estimate=None,
    memory=None,
    backfill: bool = False,
    extra_configs: tuple[Path, ...] = (),
    continue_runs: bool = False,
    notes: list[str] | None = None,
    swept: frozenset[str] = frozenset(),
) -> list[NewJob]:
    """Validated jobs for one ``queue add`` (one per seed); nothing is written here.

    ``extra_configs`` compose after ``config`` as ``nanolab fit --config a --config b`` does.

    ``estimate(parsed) -> (seconds, how)`` and ``memory(parsed) -> (peak bytes, how)`` are the
    duration and memory predictions (:mod:`nanolab.queue.predict`); ``backfill`` marks the jobs
    low priority (they run on idle devices only and are preempted for other jobs).

    A job whose run directory already holds a run continues it (the queue resumes with
    ``run.resume auto``): that is refused for a run the queue did not start unless
    ``continue_runs``, and for a model that cannot resume it; otherwise one line saying so is
    appended to ``notes``. ``swept``: the keys of ``sets`` a ``--sweep`` gave."""
    from nanolab.training.resolve import config_path_problem, shell_pipe

    for path in (config, *extra_configs):
        if (problem := config_path_problem(path)) is not None:
            raise JobConfigError(f"config {path} {problem}")
        if shell_pipe(path):  # gone when the job starts: each attempt reads the file again
            raise JobConfigError(
                f"config {path} is a pipe the shell made (<(...)), read once; a queued job "
                "reads its config again at each start: give a YAML file"
            )
    config = config.resolve()
    more = [a for extra in extra_configs for a in ("--config", str(extra.resolve()))]
    pairs = parse_sets(sets)
    seed_list = parse_seeds(seeds)
    names = job_names(config, name, pairs, seed_list)
    jobs = []
    first: ParsedConfig | None = None
    for i, job_name in enumerate(names):
        seed = seed_list[i] if seed_list else None
        args = [*more, *fit_args(pairs, seed)]
        parsed = parse_config(config, args, job_name, cwd, seed_of=first, seed=seed, swept=swept)
        if first is None:  # the seeds of one experiment: one parse, one estimate of each kind
            first = parsed
            seconds, source = estimate(parsed) if estimate else (None, None)
            peak, mem_source = memory(parsed) if memory else (None, None)
        args += start_checkpoint(parsed.config, cwd)
        run_dir = _under(cwd, parsed.run_root) / job_name
        note = existing_run(run_dir, job_name, parsed.config, continue_runs, cwd)
        if note is not None and notes is not None:
            notes.append(note)
        jobs.append(
            NewJob(
                name=job_name,
                config=str(config),
                args=args,
                seed=seed,
                cwd=str(cwd),
                run_dir=str(run_dir),
                config_key=config_key(parsed.config),
                devices=parsed.devices,
                max_steps=parsed.max_steps or None,  # None: only hours or cost end it
                estimate_s=seconds,
                estimate_source=source,
                backfill=backfill,
                mem_peak=peak,
                mem_source=mem_source,
                config_sha=config_digest(config_files(config, args, cwd)),
            )
        )
    return jobs


def existing_run(
    run_dir: Path, name: str, config: dict[str, Any], continue_runs: bool, cwd: Path
) -> str | None:
    """What a job named ``name`` would do to a run already in ``run_dir``, said now.

    None when the directory holds no run. A run that ``nanolab fit`` (or anything but the queue)
    started is the user's: the job would resume it, train on and rotate its final checkpoint
    away, so that needs ``--continue``. A model, optimizer or data (``cwd``: where the job runs,
    which its data paths are under) the run's checkpoint cannot resume on is refused here
    instead of failing at 3 a.m. Otherwise: one line naming the step it resumes at.
    """
    from nanolab.model.config import with_defaults
    from nanolab.runlog import RUN_LOG_NAME, read_records
    from nanolab.runs import foreign_config
    from nanolab.training.resolve import sections
    from nanolab.training.resume import ResumeError, check_same_model, find_resume_checkpoint

    log = run_dir / RUN_LOG_NAME
    choice = find_resume_checkpoint(run_dir) if (run_dir / "checkpoints").is_dir() else None
    chosen = choice.chosen if choice is not None else None
    if chosen is None and not (log.is_file() and log.stat().st_size > 0):
        refusal = foreign_config(run_dir)
        if refusal is not None:
            raise JobConfigError(f"--name {name}: {refusal}")
        return None
    starts = read_records(log, "start")
    by_queue = bool(starts) and starts[0].get("queue_job") is not None
    where = _resume_point(chosen)
    if not by_queue and not continue_runs:
        who = "nanolab fit" if starts else "no queue job"
        raise JobConfigError(
            f"--name {name}: {_would_continue(run_dir, who, where)}. Pass --continue to do "
            "that, or choose another --name"
        )
    if chosen is not None:
        model = sections(config)[1]
        gpt = model.get("gpt")
        try:
            check_same_model(chosen, with_defaults(gpt) if isinstance(gpt, dict) else None,
                             f"--name {name}", "set model.gpt to match it, or choose another "
                             "--name")  # fmt: skip
        except ResumeError as err:
            raise JobConfigError(f"{err} (the job would continue the run in {run_dir})") from None
        data_problem, unchecked = _data_problem(chosen, config, cwd)
        problem = (
            _optimizer_state_problem(chosen, model)
            or data_problem
            or _start_checkpoint_problem(config, cwd)
        )
        if problem is not None:
            raise JobConfigError(
                f"--name {name}: {problem} (the job would continue the run in {run_dir}; "
                "another --name starts a new one)"
            )
        if unchecked is not None:
            return f"job {name} continues the existing run {run_dir} from {where}; {unchecked}"
    return f"job {name} continues the existing run {run_dir} from {where}"


def _optimizer_state_problem(chosen: Any, model: dict[str, Any]) -> str | None:
    """Why the run's checkpoint ``chosen`` cannot continue under the job's ``model.optimizer``
    and ``model.freeze`` (``model``: the job's model settings), by fit's own rule
    (:func:`nanolab.training.resume.optimizer_state_problem`); None: it can. A setting the
    job's model class does not have is not compared (fit compares what its module holds)."""
    from nanolab.training.resume import optimizer_state_problem

    optimizer, freeze = model.get("optimizer"), model.get("freeze")
    name = optimizer.get("name") if isinstance(optimizer, dict) else None
    now = freeze if isinstance(freeze, dict) else None
    return optimizer_state_problem(chosen.nanolab, name, now, chosen.path)


def _data_problem(chosen: Any, config: dict[str, Any], cwd: Path) -> tuple[str | None, str | None]:
    """(why the run's checkpoint ``chosen`` cannot continue on the job's data, what of it
    cannot be checked now), by the rules fit's DataModule applies when it restores the
    checkpoint (:func:`nanolab.data.checks.resume_data_problem`: the data changed, another
    ``data.align``); None, None: it can. Data fit prepares from ``data.source`` is compared
    where ``data.dataset_dir`` already holds what fit would prepare (the same files and
    settings: fit reuses it as it is); otherwise it exists only once the job starts, which is
    said. A DataModule of one's own keeps its own rules, which fit applies at start."""
    from nanolab.data.checks import resume_data_problem
    from nanolab.training.plugins import DEFAULT_DATA
    from nanolab.training.resolve import sections

    _, _, data_class, data_args = sections(config)
    if data_class != DEFAULT_DATA:
        return None, None
    unchecked = None
    source = data_args.get("source")
    if source and not data_args.get("allow_changed") and not data_args.get("datasets"):
        folder = _under(cwd, str(data_args.get("dataset_dir", "")))
        if _holds_prepared(
            data_args, cwd
        ):  # fit reuses the folder as it is: compare it as prepared data
            data_args = {**data_args, "source": None}
        else:
            unchecked = (
                f"its data is not compared with the checkpoint's now: fit prepares {folder} "
                "from data.source when the job starts (it holds other data, or none yet), and "
                "compares it then"
            )
    key = data_class.rpartition(".")[2]  # Lightning keeps its state under the class's name
    return resume_data_problem(chosen.path, key, data_args, cwd), unchecked


def _start_checkpoint_problem(config: dict[str, Any], cwd: Path) -> str | None:
    """Why a fine-tune's ``run.resume: PATH`` cannot be read as fit would read it (missing,
    or not a checkpoint nanolab opens with ``weights_only``), told without reading its
    tensors; None: it can, or the job names no such path."""
    from nanolab.training.resume import inspect_checkpoint

    resume = str((config.get("run") or {}).get("resume") or "auto")
    if resume in ("auto", "never"):
        return None
    path = _under(cwd, resume)
    if not path.exists():
        return f"run.resume: checkpoint {resume} does not exist; pass an existing .ckpt"
    cand = inspect_checkpoint(path)
    if not cand.ok:
        return (
            f"run.resume: {resume} cannot be resumed from ({cand.error}); pass another checkpoint"
        )
    return None


def _resume_point(chosen: Any) -> str:
    """Where a job would continue a run: its newest complete checkpoint, or step 0."""
    return f"step {chosen.step} ({chosen.path.name})" if chosen else "step 0 (no checkpoint)"


def _would_continue(run_dir: Path, who: str, where: str) -> str:
    """The part of the refusal ``queue add`` and a job's start share: whose run it is."""
    return (
        f"{run_dir} is an existing run started by {who}; this job would continue it from "
        f"{where} and rotate its checkpoints"
    )


def foreign_run_at_start(job: Job) -> str | None:
    """Why ``job`` must not start: its run directory holds a run it did not start and that
    ``queue add`` did not see (None: it may start).

    ``queue add`` refuses to continue a run the queue did not start unless ``--continue``
    (:func:`existing_run`), but a run can appear in the folder after the add: a ``nanolab fit
    --run.name`` by hand, another queue's job. The job would resume it with ``run.resume
    auto``, train past it, rotate its checkpoints and report it under its own name. So, at
    each start (``queue retry`` included), the run's first ``start`` record says whose it is:
    this job's own (an earlier attempt: preempted, retried) resumes; one that began before
    the job was added is the one ``add`` checked (and refused without ``--continue``);
    anything else is refused with the add's line, before anything is written there.
    """
    from nanolab.runlog import RUN_LOG_NAME, iter_records
    from nanolab.training.resume import find_resume_checkpoint

    run_dir = job.run_path
    with contextlib.closing(iter_records(run_dir / RUN_LOG_NAME, "start")) as starts:
        first = next(starts, None)  # the first only: a long log is not read to its end
    if first is not None:
        began, by_job = first.get("time"), first.get("queue_job")
        if not isinstance(began, (int, float)):
            began = None
    else:  # checkpoints without a run log (copied in?): as new as the newest of them
        stamps = [_mtime(p) for p in _checkpoint_files(run_dir)]
        if not stamps:
            return None  # no run yet (a queue.log of an attempt that died at start-up is none)
        began, by_job = max(stamps), None
    if began is not None and began < job.created:
        return None  # there at `queue add`, which checked it
    if by_job == str(job.id) and began is not None and began >= (job.started or job.created):
        return None  # this job's own earlier attempt
    # Refused: only now is a checkpoint read (seconds), to say where the job would go on from.
    choice = find_resume_checkpoint(run_dir) if (run_dir / "checkpoints").is_dir() else None
    chosen = choice.chosen if choice is not None else None
    if first is None and chosen is None:
        return None  # torn files only, no run: as `queue add` sees it
    if first is None:
        who = "no queue job"
    else:
        who = "nanolab fit" if by_job is None else f"queue job {by_job} (not this job)"
    return (
        f"{_would_continue(run_dir, who + ' after this job was added', _resume_point(chosen))}"
        f"; `nanolab queue rm {job.id}` and add it again with --continue to do that, or with "
        "another --name"
    )


def _checkpoint_files(run_dir: Path) -> list[Path]:
    try:
        return [p for p in (run_dir / "checkpoints").iterdir() if p.suffix == ".ckpt"]
    except OSError:
        return []


def _mtime(path: Path) -> float:
    """When ``path`` was last written; one that vanished meanwhile counts as written now."""
    try:
        return path.stat().st_mtime
    except OSError:
        return time.time()


def set_hint(args: list[str]) -> str | None:
    """For a ``--set`` key without its group (``--set seed=3``): the settings it may mean as
    ``queue add`` takes them (``--set data.seed=3 or --seeds 3``: the queue sets
    ``seed_everything`` itself), or, for one that means none (``--set bogus=8``), that it is no
    setting and how settings are given; the first such key of ``args`` is named, or None."""
    for arg in args:
        line = setting_hint([arg], queue_form) or unknown_set_line([arg])
        if line is not None:
            return line
    return None


def unknown_set_line(args: list[str]) -> str | None:
    """The line for a ``--set`` key without a group that is none of fit's settings and is near
    none of them (``args``: the job's fit arguments, ``--key=value``): the parser only says
    "unrecognized arguments", which named neither the ``--set`` given nor the fix, and a config
    file was not at fault. None when every such key is fit's, or fit's settings cannot be read."""
    from nanolab.run.keys import _is_option

    known = fit_settings()
    if not known:
        return None
    for arg in args:
        name, _, value = arg[2:].partition("=")
        if not arg.startswith("--") or not name or "." in name or name == "config":
            continue
        if not _is_option(name, known):
            return (
                f"unknown setting {queue_form(name, value)}; fit has no setting {name} (its "
                "settings take their group, e.g. --set trainer.max_steps=600; `nanolab fit "
                "--help` lists them)"
            )
    return None


def option_form(key: str, value: str) -> str | None:
    """How ``queue add`` gives fit's setting ``key`` in fit's own form (``--data.seed 3``:
    queue add takes it as it is), or None where the queue sets it and has no option for it."""
    if key in RESERVED_KEYS:
        return queue_form(key, value)
    return f"--{key} {value}" if value else f"--{key}"


def setting_hint(
    args: list[str], form: Callable[[str, str], str | None] = queue_form
) -> str | None:
    """For a setting given without its group (``args``: ``--name=value``, each as the user
    wrote it in ``form``): the settings it may mean, written in ``form``, by fit's own rule
    (:func:`nanolab.run.keys.undotted_hint`), or None."""
    from nanolab.run.keys import _is_option, settings_named, undotted_hint

    known = fit_settings()
    hint = undotted_hint(args, known, form)
    if hint is not None:
        return hint
    for arg in args:  # every setting it may mean is one the queue sets: say so
        name, _, value = arg[2:].partition("=")
        given = arg.startswith("--") and "." not in name and not _is_option(name, known)
        meant = settings_named(name, known) if given else []
        if meant and all(k in RESERVED_KEYS for k in meant):
            return (f"unknown setting {form(name, value)}; {meant[0]} is set by the queue: "
                    f"{RESERVED_KEYS[meant[0]]}")  # fmt: skip
    return None


def names_a_setting(name: str) -> bool:
    """Whether ``name`` (an option's name without its dashes) is spelt as a setting of fit's is:
    the last part of one (``seed``: ``data.seed``) or the beginning of a top-level one
    (``seed_everything``). Such a name is taken for that setting without its group; any other
    is a misspelling, nearest an option of the verb's own where there is one."""
    from nanolab.run.keys import _is_option

    known = fit_settings()
    leaves = {k.rpartition(".")[2] for k in known if "." in k}
    return (
        name in leaves
        or _is_option(name, known)
        or any("." not in k and k.startswith(name) for k in known)
    )


def unknown_option_line(
    unknown: list[str], elsewhere: dict[str, str], own: Iterable[str] = ()
) -> str | None:
    """The one error line for the options ``queue add`` does not have (``unknown``: what its
    parser left over, values included): fit's setting without its group (``--micro_batch_size
    8``) names every setting it may mean in the form ``queue add`` takes; an option of another
    verb (``elsewhere``: option -> verb) names that verb; one near an option of its own
    (``own``: ``--contineu``) or of fit's that it takes names those (fit's rule,
    :func:`nanolab.helpfmt.near_options`); anything else says where the options are listed
    and how fit's settings are given. None when no option is left over (a stray value:
    argparse's own line names it)."""
    from nanolab.helpfmt import either, near_options
    from nanolab.training.resolve import UNDOTTED_FIT_OPTIONS

    options: list[str] = []  # each option as --name=value, the form undotted_hint reads
    for i, token in enumerate(unknown):
        if not token.startswith("-"):
            continue
        value = (
            unknown[i + 1] if i + 1 < len(unknown) and not unknown[i + 1].startswith("-") else None
        )
        options.append(token if value is None or "=" in token else f"{token}={value}")
    if not options:
        return None
    first = options[0].split("=", 1)[0]
    mine = near_options(first.removeprefix("--"), [o.removeprefix("--") for o in own])
    if mine and first not in elsewhere and not names_a_setting(first.removeprefix("--")):
        # A misspelling of the verb's own option (--seedz: --seeds) is meant before a setting
        # its spelling is near (data.seed): the verb's own options are what its user types.
        return f"unknown option {first}; did you mean {either(f'--{n}' for n in mine)}?"
    hint = setting_hint(options, option_form)
    if hint is not None:
        return hint
    name = options[0].split("=", 1)[0]
    if name in elsewhere:
        verb = elsewhere[name]
        return (f"{name} is an option of `nanolab queue {verb}`, not of `queue add`; give it "
                f"there: `nanolab queue {verb} {name} ...`")  # fmt: skip
    taken = [o.removeprefix("--") for o in own] + list(UNDOTTED_FIT_OPTIONS)
    near = near_options(name.removeprefix("--"), taken)
    if name == "--config" or near[:1] == ["config"]:  # fit's --config: the queue's are arguments
        return (
            f"{name}: `queue add` takes its configs as arguments, composed in order: "
            "`nanolab queue add A.yaml [B.yaml ...]`"
        )
    if near:
        return f"unknown option {name}; did you mean {either(f'--{n}' for n in near)}?"
    return (
        f"unknown option {name}; `nanolab queue add --help` lists its options, and fit's "
        "settings take their group (--trainer.max_steps 600 or --set trainer.max_steps=600)"
    )


def fit_settings() -> frozenset[str]:
    """fit's setting keys: remembered by an earlier parse of this code, else read from its
    parser (once per runner; empty when it cannot be read: options then run as stored)."""
    from nanolab.run import keys

    known = keys.known_keys("fit")
    if known is not None:
        return known
    try:
        from nanolab.run.parse import verb_keys

        return verb_keys("fit")
    except Exception:  # the job's fit names what it cannot parse, in its own log
        return frozenset()


#: Options of fit's parser besides its settings: a prefix that begins one of them as well was
#: ambiguous to the parser that took abbreviations, so it is not completed here either.
_PARSER_OPTIONS = ("config", "print_config", "help")


def complete_abbreviations(args: list[str], known: frozenset[str]) -> tuple[list[str], list[str]]:
    """``args`` with each option that is a prefix of exactly one of fit's settings written
    whole (``--seed=7`` -> ``--seed_everything=7``), and a note per completion.

    Until fit matched options whole, its parser completed such prefixes, and ``queue add``
    stored them as given: a pending or preempted job of an upgraded queue runs as it was
    queued. A new ``queue add`` checks options whole. ``known``: fit's settings (dotted keys);
    an option that is one, a group or inside one, or that begins several, is left as it is
    (fit then names it as it names any unknown option)."""
    done: list[str] = []
    notes: list[str] = []
    for arg in args:
        name, eq, value = arg[2:].partition("=")
        if not arg.startswith("--") or not name or _is_setting(name, known):
            done.append(arg)
            continue
        begun = [k for k in (*known, *_PARSER_OPTIONS) if k.startswith(name)]
        if len(begun) != 1 or begun[0] not in known:
            done.append(arg)
            continue
        done.append(f"--{begun[0]}{eq}{value}")
        notes.append(f"--{name} as --{begun[0]}")
    return done, notes


def _is_setting(name: str, known: frozenset[str]) -> bool:
    """``name`` is a parser option, a setting, a group of settings, or inside a setting."""
    from nanolab.run.keys import _known

    return name in _PARSER_OPTIONS or _known(name, known)
