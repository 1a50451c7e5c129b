"""``nanolab fit --help``: nanolab's groups and the keys most runs touch, on one screen or two.

LightningCLI's own help lists every argument of every class (~900 lines, mostly the Trainer's);
it stays one flag away (``--help-all``). Defaults here are read from the classes themselves and
descriptions from their docstrings' ``Args:`` sections, so this page cannot drift from the code;
only the Trainer's few keys carry a description written here (its docstrings run to pages).

Reading those classes imports Lightning and torch (seconds); the page is the same at every
launch of the same code, so it is remembered like the parser's keys (:mod:`nanolab.run.keys`:
keyed by nanolab's files and the versions of Lightning, jsonargparse, torch, docstring_parser
and Python) and the next ``--help`` prints it before anything heavy is imported.
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
from typing import Any

#: Trainer keys worth a line, with a short description (defaults come from Lightning / nanolab).
TRAINER_KEYS = {
    "max_steps": "optimizer steps to train (-1: until a budget or a signal stops the run)",
    "accelerator": "cpu, gpu, cuda, mps or auto",
    "devices": "devices per node (auto = every visible GPU); accumulation is re-derived",
    "num_nodes": "machines (configs/strategy/multinode.yaml)",
    "precision": "32-true, bf16-mixed, 16-mixed, bf16-true (configs/precision/)",
    "strategy": "auto, ddp, fsdp, deepspeed_stage_2, ... (configs/strategy/)",
    "gradient_clip_val": "clip the global gradient norm (null: off)",
}

#: (group, object documenting it, keys shown); ``None`` keys = every documented key.
GROUPS: list[tuple[str, str, list[str] | None]] = [
    ("run", "nanolab.run.parse:RunConfig", None),
    ("model.gpt", "nanolab.model.config:GPTConfig",
     ["n_layer", "n_head", "n_embd", "block_size", "vocab_size", "dropout", "activation"]),
    ("model.optimizer", "nanolab.training.optim:OptimizerConfig", ["name", "lr", "weight_decay", "betas"]),
    ("model.schedule", "nanolab.training.optim:ScheduleConfig", None),
    ("data", "nanolab.data.datamodule:TokenDataModule",
     ["dataset_dir", "source", "tokenizer", "micro_batch_size", "val_windows", "num_workers"]),
    ("progress", "nanolab.callbacks.progress:StepProgressBar", ["refresh_rate", "mode", "plain_every_s"]),
]  # fmt: skip

LOGGER_HELP = "tensorboard, csv, wandb or mlflow, written into the run directory (docs/loggers.md)"

#: Callback groups: one line each (their keys: --help-all or docs/callbacks.md).
CALLBACK_GROUPS = {
    "downstream": "in-context task accuracy: suite (builtin:shakespeare, a YAML, a DCLM bundle), every_n_evals, limit",
    "log": "metrics.jsonl, the run log (every_n_steps)",
    "checkpoint": "rotation, keep_last/keep_best, every_n_steps/minutes, async_save",
    "budget": "max_gpu_hours, max_cost + price_per_gpu_hour, max_tokens, patience, payoff",
    "throughput": "tokens/s, MFU (peak_flops for devices not in the table)",
    "divergence": "stop after `patience` non-finite steps or fp16 loss-scale collapse (exit 3)",
    "preemption": "SIGTERM/SIGUSR1: checkpoint at the step boundary, exit 75",
}


def _load(spec: str) -> Any:
    import importlib

    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def docstring_args(obj: Any) -> dict[str, str]:
    """``name -> first sentence`` of each entry in the object's ``Args:`` section, read by the
    docstring parser jsonargparse itself uses for ``--help-all``."""
    import docstring_parser

    params = docstring_parser.parse(inspect.getdoc(obj) or "").params
    return {p.arg_name: _first_sentence(" ".join((p.description or "").split())) for p in params}


def _first_sentence(text: str, limit: int = 110) -> str:
    """Up to the first full stop outside parentheses, at most ``limit`` characters."""
    text = text.replace("``", "")
    depth, end = 0, len(text)
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "." and depth == 0 and (i + 1 == len(text) or text[i + 1] == " "):
            end = i
            break
    sentence = text[:end]
    if len(sentence) > limit:
        sentence = sentence[: sentence.rfind(" ", 0, limit)] + " ..."
    return sentence


def defaults(obj: Any) -> dict[str, Any]:
    """Field defaults of a dataclass, or parameter defaults of a class's ``__init__``."""
    if dataclasses.is_dataclass(obj):
        return {
            f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            for f in dataclasses.fields(obj)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        }
    params = inspect.signature(obj.__init__).parameters
    return {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}


def _shown(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


def _entry(key: str, default: Any, text: str, width: int = 100) -> list[str]:
    head = f"  --{key} {_shown(default)}"
    body = textwrap.wrap(text, width - 38) or [""]
    if len(head) < 38:
        first = f"{head:<38}{body[0]}"
        return [first, *(" " * 38 + line for line in body[1:])]
    return [head, *("        " + line for line in body)]


def short_help(verb: str) -> str:
    """The one-page help of ``nanolab fit`` (``validate``/``test`` take the same config)."""
    from nanolab.training.resolve import FIT_SEED, trainer_defaults

    lines = [
        f"usage: nanolab {verb} --config CONFIG.yaml [--config MORE.yaml ...] [--GROUP.KEY VALUE ...]",
        "",
        "Configs compose left to right, then --key value overrides (later wins); "
        "--print_config shows the merged result.",
        "Shown: the common keys with their defaults (configs/*.yaml change many of them). "
        "Every key: --help-all.",
    ]
    if verb in ("validate", "test"):
        lines.append(
            "--ckpt_path last|best|PATH|none: which checkpoint to evaluate (default: the run's "
            "newest; docs/evaluate.md)."
        )
    lines += ["", "trainer (Lightning's Trainer; the rest of its keys: --help-all)"]
    trainer = {**defaults(_load("lightning:Trainer")), **trainer_defaults()}
    for key, text in TRAINER_KEYS.items():
        lines += _entry(f"trainer.{key}", trainer.get(key), text)
    for group, spec, keys in GROUPS:
        try:
            obj = _load(spec)
        except (ImportError, AttributeError):
            continue  # a fork that removed the class: its group is simply not listed
        docs, values = docstring_args(obj), defaults(obj)
        lines += ["", group]
        for key in keys or list(docs):
            if key in docs:
                lines += _entry(f"{group}.{key}", values.get(key), docs[key])
    lines += ["", "callbacks (on by default; keys: --help-all, docs/callbacks.md)"]
    for group, text in CALLBACK_GROUPS.items():
        lines.append(f"{'  --' + group + '.*':<38}{text}")
    lines += [
        "",
        "other",
        *_entry("seed_everything", FIT_SEED, "seed of model init and dropout"),
        *_entry("logger", None, LOGGER_HELP),
        *_entry("model.compile", False, "torch.compile the model (minutes of start-up; GPUs)"),
        "",
        "debug presets (compose after a base config): configs/debug/fast_dev_run.yaml, "
        "overfit.yaml, profile.yaml; configs/debug/cpu_check.yaml alone checks a GPU recipe here",
        "docs: docs/configs.md (groups), docs/callbacks.md, docs/resume.md, docs/scaling.md",
    ]
    return "\n".join(lines)


#: Packages the page depends on beyond those the parser's keys do.
HELP_DISTS = ("docstring_parser",)


def remembered_page(verb: str) -> str | None:
    """The page an earlier ``--help`` of this code wrote, or None."""
    import json

    from nanolab.run.keys import _cache_file

    path = _cache_file(verb, "help", HELP_DISTS)
    try:
        page = json.loads(path.read_text(encoding="utf-8")) if path is not None else None
    except (OSError, ValueError):
        return None
    return page if isinstance(page, str) else None


def page(verb: str) -> str:
    """:func:`short_help`, remembered for the next launch."""
    from nanolab.run.keys import _cache_file, write_remembered

    text = short_help(verb)
    write_remembered(_cache_file(verb, "help", HELP_DISTS), text)
    return text


def wants_short_help(argv: list[str]) -> bool:
    """``-h``/``--help`` without ``--help-all``: the short page."""
    return any(a in ("-h", "--help") for a in argv[1:]) and "--help-all" not in argv


def full_help_argv(argv: list[str]) -> list[str]:
    """``--help-all`` becomes LightningCLI's own ``--help`` (in ``sys.argv`` too when ``argv``
    came from it: LightningCLI warns when the two differ)."""
    import sys

    new = [("--help" if a == "--help-all" else a) for a in argv]
    if new != argv and argv == sys.argv[1:]:
        sys.argv[1:] = new
    return new
