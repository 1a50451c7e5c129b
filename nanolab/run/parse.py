"""The command line of ``nanolab fit / validate / test``: LightningCLI parses, nothing more.

On top of Lightning's own config groups (``trainer``, ``model``, ``data``, ``seed_everything``)
the parser adds ``run`` (where the run lives, the global batch in tokens, evaluation cadence,
resume policy), the run's callbacks (``log``, ``checkpoint``, ``budget``, ``throughput``,
``progress``, ``divergence``, ``preemption``) and ``--logger``. Parsing stops before anything is
built: :func:`nanolab.run.compose.launch` resolves the derived values and assembles the run in
one function. ``--print_config`` shows the config as given.

Why LightningCLI still parses (measured, docs/architecture.md): its parse costs 0.28-0.46 s of a
launch whose imports cost 3.9-4.8 s, and it gives every Trainer/model/data setting its typed
``--key value`` flag, ``--config`` merging, class choices and ``--print_config`` for free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from nanolab.estimator.gpus import MatmulPrecision
from nanolab.messages import warn
from nanolab.processes import global_rank_from_env
from nanolab.run import keys, schema
from nanolab.run.class_choice import dropped_line, settle_chosen_classes
from nanolab.run.group_value import group_value_problem
from nanolab.run.schema import (  # noqa: F401  (NULL_WORDS: public here too)
    NULL_WORDS,
    FitParseError,
    nulls_as_class_settings,
)
from nanolab.training.plugins import (
    DEFAULT_DATA,
    DEFAULT_MODEL,
    PluginImportError,
    check_importable,
    class_paths_in_argv,
    class_paths_in_config,
)
from nanolab.training.resolve import (
    FIT_SEED,
    RunConfigError,
    trainer_defaults,
)


@dataclass
class RunConfig:
    """Where a run lives and how its steps are counted.

    Args:
        name: Run name: its directory is ``<root>/<name>``. ``null`` = ``<config stem>-<time>``.
            Give a fixed name to make a run resumable under the same directory. A plain folder
            name: no ``/``, not empty, ``.`` or ``..`` (the run must stay inside ``root``).
        root: Folder holding run directories.
        global_batch_tokens: Tokens per optimizer step over all devices. Gradient accumulation
            is derived: ``global_batch_tokens / (micro_batch_size * block_size * world_size)``,
            which must be a whole number. ``null`` = no accumulation.
        eval_every_steps: Optimizer steps between validations.
        resume: ``auto`` continues from the run directory's newest complete checkpoint when
            there is one; ``never`` starts fresh; a path resumes from that checkpoint.
        fresh: Start a new run even though the run directory holds another one: its log,
            checkpoints and config are moved to ``<run_dir>/previous/`` (never deleted). Without
            it, a directory that holds a different run is refused.
        micro_batch_size: ``null`` = ``data.micro_batch_size``; an integer overrides it;
            ``auto`` = the largest micro-batch the memory estimator predicts fits on the
            smallest GPU in ``trainer.devices`` and divides the global batch (no
            trial-and-error OOM runs; on CPU the data's value).
        float32_matmul_precision: ``torch.set_float32_matmul_precision`` for GPU runs:
            ``high`` (default) lets ``32-true`` matmuls use TF32 tensor cores (8x the FP32 rate
            on an A100, 10 mantissa bits per product, FP32 accumulation; on ROCm only with
            ``HIPBLASLT_ALLOW_TF32=1`` set); ``highest`` keeps full FP32. 16-bit precisions
            do not use it. CPU runs are left as they are. The estimator, the MFU denominator
            and ``nanolab estimate`` follow this setting.
    """

    name: str | None = None
    root: str = "runs"
    global_batch_tokens: int | None = None
    eval_every_steps: int = 250
    resume: str = "auto"
    fresh: bool = False
    micro_batch_size: int | Literal["auto"] | None = None
    float32_matmul_precision: MatmulPrecision = "high"


#: Settings the parser sets from another, ``(source, target)``: ``--run.fresh`` also moves the
#: log aside. A target is in the config but no option of its own (the parser refuses it).
LINKS = (("run.fresh", "log.fresh"),)


def run_callbacks() -> dict[str, type]:
    """The run's callbacks by config group (``--log.*``, ``--checkpoint.*``, ...), in the order
    the Trainer gets them, after ``trainer.callbacks``.

    In-context task accuracies (off until ``downstream.suite`` is set), the run log, checkpoint
    rotation, budgets, throughput/MFU and the step progress bar; on by
    default, the divergence stop (K non-finite steps in a row, or a collapsed fp16 loss scale),
    the spike guard (a finite loss spike: roll back past it) and the preemption handler (SIGTERM/SIGINT/SIGUSR1: finish the step, checkpoint, exit 75).
    Their step hooks run in ``callbacks/step.STEP_ORDER`` wherever they are registered, so the
    checkpoint a preemption saves includes the step's record.
    """
    from nanolab.callbacks import (
        CostBudget,
        MetricsLog,
        RotatingCheckpoint,
        StepProgressBar,
        ThroughputMeter,
    )
    from nanolab.callbacks.divergence import DivergenceStop
    from nanolab.callbacks.downstream import DownstreamEval
    from nanolab.callbacks.notify import Notifier
    from nanolab.callbacks.preemption import PreemptionHandler
    from nanolab.callbacks.spike import SpikeGuard

    return {
        "downstream": DownstreamEval,  # first: its final record lands before the log closes
        "log": MetricsLog,
        "checkpoint": RotatingCheckpoint,
        "budget": CostBudget,
        "throughput": ThroughputMeter,
        "progress": StepProgressBar,
        "divergence": DivergenceStop,
        "spike": SpikeGuard,
        "preemption": PreemptionHandler,
        "notify": Notifier,  # last: the end record is written when it reads it
    }


def config_groups() -> tuple[str, ...]:
    """The groups of a config file that ``group: null`` would empty (refused by name)."""
    return ("run", "trainer", "model", "data", *run_callbacks())


def check_config_files(argv: list[str]) -> None:
    """Refuse an override giving a group null (``--model.optimizer null``), read every
    ``--config`` file first (:func:`nanolab.run.keys.read_config_files`: an empty or malformed
    one is named in the error), and import the model, data and callback classes
    they and the command line name, so a plug-in that does not import is one line naming its
    module (the parser would say it "does not validate against any of the Union subtypes")."""
    from nanolab.training.resolve import check_override_group, override_value

    for i, arg in enumerate(argv):  # --model.optimizer null: refused as a null group in a file
        name, eq, text = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if ("." in name or name == "model") and (eq or i + 1 < len(argv)):
            check_override_group(name, override_value(text if eq else argv[i + 1]))
    plugins = class_paths_in_argv(argv)
    for data in keys.read_config_files(argv, config_groups()):
        plugins += class_paths_in_config(data)
    try:
        check_importable(plugins)
    except PluginImportError as err:
        raise RunConfigError(str(err)) from None


class OneLineErrorParser(LightningArgumentParser):
    """Reports a bad config as one :class:`RunConfigError` (the key and what is wrong) for the
    CLI's one error handler, not a usage screen and ``SystemExit``."""

    def parse_args(self, args: Any = None, namespace: Any = None, **kwargs: Any) -> Any:
        """The verb's parse, then its chosen model and data classes settled: each keeps its own
        defaults and the settings given (:mod:`nanolab.run.class_choice`), before the defaults
        are merged, ``--print_config`` prints and the config is checked."""
        cfg = super().parse_args(args, namespace, **kwargs)
        verb = getattr(self, "subcommand", None)  # set on a verb's parser, not on the top one
        if verb in LightningCLI.subcommands():
            dropped = settle_chosen_classes(cfg, list(self.args))  # the verb's arguments
            line = dropped_line(dropped, cfg)
            if line is not None and global_rank_from_env() == 0:
                warn(f"nanolab {verb}", line)
        return cfg

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error:
            super().error(message, ex)
        message = subclass_problem(str(message)) or str(message)
        lines = [line.strip() for line in message.splitlines() if line.strip()]
        text = " ".join(lines)
        raise RunConfigError(
            logger_problem(text)
            or whole_number_problem(text)
            or union_problem(text)
            or type_problem(text)
            or config_file_problem(text)
            or class_path_problem(text)
            or " ".join(lines[:3])
        )


def whole_number_problem(text: str) -> str | None:
    """A whole-number setting given a whole float (``--budget.max_tokens 1e9``, ``max_tokens:
    1e9`` in a file: both read as floats) as :func:`nanolab.errors.written_whole` says it,
    for a plain ``int`` setting and one that may also be null alike."""
    import re

    from nanolab.errors import written_whole

    keys = re.findall(r'Parser key "([^"]+)"', text)
    if not keys or "Expected a <class 'int'>" not in text:
        return None
    key = ".".join(k for k in keys if k != "init_args")  # a class's setting: model.gpt.n_layer
    for shown in re.findall(r"(?:Got value|Given value): (\S+?)(?:;|$| )", text):
        try:
            value = float(shown)
        except ValueError:
            continue
        if math.isfinite(value) and (line := written_whole(key, value, shown)) is not None:
            return line
    return None


def type_problem(text: str) -> str | None:
    """jsonargparse's ``Parser key "K": Expected a <class 'int'>. Got value: V`` as the key,
    the value and what it must be; ``trainer.max_steps`` with the message its YAML form gets
    (``--trainer.max_steps null`` and ``max_steps: null`` in a file say the same)."""
    import re

    m = re.fullmatch(r'Parser key "([^"]+)": (Expected a .+?)\. Got value: (.*)', text)
    if m is None:
        return None
    key, expected, value = m.group(1), _expected_type(m.group(2)), m.group(3)
    if key == "trainer.max_steps":
        from nanolab.training.resolve import check_max_steps

        try:
            check_max_steps(None if value == "None" else value)
        except RunConfigError as err:
            return str(err)
    if key.startswith("model.optimizer.") and _spells_non_finite(value):
        # YAML reads nan/inf as text (it spells them .nan/.inf): the setting's own rule says it
        from nanolab.training.optim import OptimizerConfig

        try:
            OptimizerConfig(**{key.rsplit(".", 1)[1]: float(value)})
        except (ValueError, TypeError) as err:
            return str(err)
    shown = "null" if value == "None" else repr(value)
    wanted = expected or m.group(2).removeprefix("Expected ")  # "a tuple with 2 elements"
    return f"{key}: {shown} is not valid; expected {wanted}"


def _spells_non_finite(value: str) -> bool:
    """``nan``, ``inf``, ``-Infinity``, ...: a float Python reads and YAML does not."""
    try:
        return not math.isfinite(float(value))
    except ValueError:
        return False


def class_path_problem(text: str) -> str | None:
    """A class chosen by ``class_path`` given wrong, said once with the fix: a name its module
    does not have (with the nearest names it has), or an ``init_args`` key its ``__init__`` does
    not take (the parser said each twice, or without saying where to look)."""
    import difflib
    import importlib
    import re

    m = re.fullmatch(r"module '([\w.]+)' has no attribute '(\w+)' - Problem with given .*", text)
    if m:
        module, name = m.group(1), m.group(2)
        try:
            names = [n for n in dir(importlib.import_module(module)) if not n.startswith("_")]
        except Exception:  # the import error was reported before this; say what is known
            names = []
        near = difflib.get_close_matches(name, names, n=2)
        hint = f"; did you mean {' or '.join(f'{module}.{n}' for n in near)}?" if near else ""
        return f"class_path {module}.{name}: module {module!r} has no {name!r}{hint}"
    m = re.match(r"Option '([^']+)' is not accepted", text)
    if m:
        return (
            f"{m.group(1)!r} is not a setting of the class it is given to (the arguments of its "
            "__init__ and its base classes'); check its spelling, under init_args for a class "
            "chosen by class_path (nanolab fit --help-all lists nanolab's own)"
        )
    return None


def config_file_problem(text: str) -> str | None:
    """The two ways a config file is given wrong, with the fix: a path without ``--config``
    before it (``nanolab fit configs/x.yaml``), and a ``--config`` path that does not exist."""
    import os
    import re

    loose = re.fullmatch(r"unrecognized arguments: (.+)", text)
    if loose:
        words = loose.group(1).split()
        if all(w.endswith((".yaml", ".yml")) for w in words):  # only file names, no option
            fix = " ".join(f"--config {w}" for w in words)
            return f"unrecognized arguments: {loose.group(1)}; a config file goes after --config: {fix}"
    missing = re.fullmatch(r'Parser key "config": File does not exist: (.+)', text)
    if missing:
        path = missing.group(1).strip("'\"")
        return f"--config: {path} does not exist (relative paths start from {os.getcwd()})"
    return None


#: What a setting must be, for keys whose parser type ("int, float or null") says too little.
VALUE_RULES = {
    "trainer.gradient_clip_val": "must be a finite number >= 0 (e.g. 1.0), or null: no clipping",
}


def union_problem(text: str) -> str | None:
    """jsonargparse's "Does not validate against any of the Union subtypes" report (one line)
    as what is wrong: the key, the value and what it must be, without the subtype listing."""
    import re

    m = re.search(
        r'Parser key "([^"]+)": Does not validate against any of the Union subtypes '
        r"Subtypes: \[(.*?)\] Errors: (.*?)(?: Given value type: .*? Given value: (.*))?$",
        text,
    )
    if m is None:
        return None
    key, subtypes, errors, value = m.group(1), m.group(2), m.group(3), m.group(4)
    if key == "seed_everything":  # the rule fit, estimate and a config file's null all meet
        from nanolab.training.resolve import check_seed

        try:
            check_seed(None if value in (None, "None") else value)
        except RunConfigError as err:
            return str(err)
    given = f"{value!r}" if value is not None else "the value given"
    if key in VALUE_RULES:
        return f"{key}: {given} is not valid; it {VALUE_RULES[key]}"
    items = [e.strip() for e in re.split(r"(?:^| )- ", errors) if e.strip()]
    items = [e for e in items if e != "Expected a <class 'NoneType'>"]
    expected = [_expected_type(e) for e in items]
    if items and all(expected):
        null = " (or null)" if "NoneType" in subtypes else ""  # only where null is a choice
        return f"{key}: {given} is not valid; expected {' or '.join(map(str, expected))}{null}"
    return f"{key}: {'; '.join(items)}" if items else None


def logger_problem(text: str) -> str | None:
    """A bare name given to ``trainer.logger`` (``--trainer.logger csv``), which takes a
    Lightning logger class: the parser's report lists the Union's subtypes and says "Expected a
    path". nanolab's short names (``csv``, ``tensorboard``, ...) belong to ``--logger``: said
    with the option to write instead."""
    import re

    from nanolab.callbacks.loggers import LOGGER_CHOICES

    m = re.match(r'Parser key "trainer\.logger":.* Given value: ([A-Za-z_][\w-]*)$', text)
    if m is None:
        return None
    given = m.group(1)
    short = given.lower().removesuffix("logger")
    use = (
        f"write --logger {short} (logger: {short} in a config file)"
        if short in LOGGER_CHOICES
        else f"write --logger NAME with one of nanolab's loggers ({', '.join(LOGGER_CHOICES)})"
    )
    return (
        f"trainer.logger: {given!r} is not a Lightning logger class; {use}, see docs/loggers.md; "
        "trainer.logger itself takes a class path (lightning.pytorch.loggers.CSVLogger) or false"
    )


def _expected_type(error: str) -> str | None:
    """``"Expected a <class 'int'>"`` -> ``"int"``; ``"Expected a typing.Literal['auto']"`` ->
    ``"'auto'"``; any other error (it says more than a type) -> None."""
    import re

    m = re.fullmatch(r"Expected a (.+)", error)
    if m is None:
        return None
    cls = re.fullmatch(r"<class '([\w.]+)'>", m.group(1))
    if cls:
        return cls.group(1).rsplit(".", 1)[-1]
    literal = re.fullmatch(r"typing\.Literal\[(.*)\]", m.group(1))
    return " or ".join(literal.group(1).split(", ")) if literal else None


def unwrap_union_error(err: BaseException) -> BaseException:
    """The exception a class raised, from under jsonargparse's Union report (its cause)."""
    while (
        isinstance(err, ValueError)
        and "Does not validate against any of the Union subtypes" in str(err)
        and isinstance(err.__cause__, Exception)
    ):
        err = err.__cause__
    return err


def subclass_problem(message: str) -> str | None:
    """The setting at fault inside a ``model``/``data``/``trainer.callbacks`` class choice,
    with its full key.

    The parser reports a bad ``model.gpt.n_layer`` as "Parser key "model": Does not validate
    against any of the Union subtypes ... Problem with given class_path X: Parser key
    "gpt.n_layer": Expected a <class 'int'>": this keeps the inner problem, keyed from the top
    (``model.gpt.n_layer``; a callback's as ``trainer.callbacks[1] (X).init_args.every``, the
    list's ``[-1]`` for a ``--trainer.callbacks.every`` flag, which sets the last one given).
    A required argument left out says where to give it.
    """
    import re

    head = re.match(r'Parser key "([\w.]+)":', message)
    if head is None:
        return None
    group = head.group(1)
    block = re.search(r"^( *)- Problem with given class_path '([\w.]+)':$", message, re.M)
    if block is None:
        return callback_shape_problem(message) if group == "trainer.callbacks" else None
    indent, class_path = len(block.group(1)), block.group(2)
    inner = []
    for line in message[block.end() :].splitlines()[1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break  # the parser's next alternative, or its "Given value" lines
        inner.append(line.strip())
    text = " ".join(inner).strip()
    if group == "trainer.callbacks":
        named = re.search(r"(?:Parser key \"|Option ')(\w+)", text)
        index = callback_index(message, class_path, named.group(1) if named else None)
        key = f"trainer.callbacks[{index}] ({class_path}).init_args"
        settings, where = key, "the callback's init_args"
        flag = f"--trainer.callbacks.{{}} VALUE after --trainer.callbacks+={class_path}"
    else:
        key, settings = group, f"{group}.init_args"
        where, flag = settings, f"--{group}.{{}} VALUE"
    required = re.fullmatch(r"the following arguments are required: (.+)", text)
    if required:
        names = [name.strip() for name in required.group(1).split(",")]
        return (
            f"{', '.join(f'{settings}.{name}' for name in names)}: required by {class_path} and "
            f"not given; set it under {where} in the config, or give "
            + ", ".join(flag.format(name) for name in names)
        )
    option = re.fullmatch(r"Option '(\w+)' is not accepted", text)
    if option and group == "trainer.callbacks":
        return f"{key}.{option.group(1)}: {_not_a_setting(class_path, option.group(1))}"
    text = re.sub(r'Parser key "([^"]+)"', lambda m: f'Parser key "{key}.{m.group(1)}"', text)
    if key == group:
        text = re.sub(r"--(?!config)([\w.]+)=", lambda m: f"--{group}.{m.group(1)}=", text)
        text = re.sub(r"Group '([\w.]+)'", lambda m: f"Group '{group}.{m.group(1)}'", text)
    return text or None


def callback_index(message: str, class_path: str, key: str | None = None) -> str:
    """Where in ``trainer.callbacks`` the parser's report about ``class_path`` points: its
    position in the list the report gives (of two of that class, the first that has ``key``),
    or ``-1`` for a ``--trainer.callbacks.KEY`` flag, which sets the last callback given."""
    import re

    given = message[message.rfind("Given value:") :]
    paths = re.findall(r"class_path(?:=|': )'([\w.]+)'", given)  # each item's, in order
    items = re.split(r"(?=class_path(?:=|': )')", given)[1:]  # the text of each item
    mine = [i for i, path in enumerate(paths) if path == class_path]
    named = [i for i in mine if key and re.search(rf"\b{re.escape(key)}\b", items[i])]
    return str((named or mine)[0]) if mine else "-1"


def callback_shape_problem(message: str) -> str | None:
    """A ``trainer.callbacks`` item whose settings sit beside ``class_path`` instead of under
    ``init_args`` (an indentation slip in YAML): the parser says only "Not a valid subclass of
    Callback", with the item."""
    import ast
    import re

    m = re.search(r"Not a valid subclass of \w+\. Got value: (\{.*\})$", message, re.M)
    try:
        item = ast.literal_eval(m.group(1)) if m else None
    except (ValueError, SyntaxError):
        return None
    if not isinstance(item, dict) or not isinstance(item.get("class_path"), str):
        return None
    beside = [str(k) for k in item if k not in ("class_path", "init_args")]
    if not beside:
        return None
    path = item["class_path"]
    empty = " (its init_args: is empty)" if item.get("init_args") is None else ""
    return (
        f"trainer.callbacks[{callback_index(message, path)}] ({path}): {', '.join(beside)} "
        f"{'is' if len(beside) == 1 else 'are'} beside class_path, not under init_args{empty}; "
        "indent the settings under init_args"
    )


def _not_a_setting(class_path: str, name: str) -> str:
    """``NAME`` given to a class whose ``__init__`` does not take it: the nearest it takes."""
    import difflib
    import inspect

    from nanolab.training.plugins import PluginImportError, load_class

    try:
        params = inspect.signature(load_class(class_path, "trainer.callbacks")).parameters
    except (PluginImportError, TypeError, ValueError):
        params = {}
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    taken = [name for name, p in params.items() if p.kind in named]
    near = difflib.get_close_matches(name, taken, n=1, cutoff=0.6)
    hint = f"; did you mean {near[0]}?" if near else f"; it takes {', '.join(taken) or 'none'}"
    return f"not a setting of {class_path}{hint}"


class Parsed(Exception):
    """Ends LightningCLI's run once the command line is parsed; carries the parsed CLI."""

    def __init__(self, cli: NanolabCLI) -> None:
        super().__init__("parsed")
        self.cli = cli


class NanolabCLI(LightningCLI):
    """LightningCLI as nanolab's parser: ``run`` settings, the run's callbacks, ``--logger``.

    It stops right after parsing, before it would seed and build anything:
    :func:`nanolab.run.compose.launch` does both, in one function. ``verb_parser`` is the parser of the
    subcommand being run, the one whose dump is the run's ``config.yaml``.

    Args:
        verb: The subcommand being run (``fit``, ``validate``, ``test``): only its parser is
            built. LightningCLI builds one per subcommand, four in all, and a run uses one
            (the other three cost 0.15 s of CPU at every launch; docs/performance.md).
    """

    def __init__(self, *args: Any, verb: str | None = None, **kwargs: Any) -> None:
        self._verb = verb
        super().__init__(*args, **kwargs)

    def subcommands(self) -> dict[str, set[str]]:  # type: ignore[override]
        every = LightningCLI.subcommands()
        verb = getattr(self, "_verb", None)
        return {verb: every[verb]} if verb in every else every

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        self.verb_parser = parser
        parser.add_class_arguments(RunConfig, "run", fail_untyped=True)
        # Model and data are choices (--model pkg.mod.Class); nanolab's own by default. The
        # data's block_size follows the model's gpt.block_size (set by the resolver).
        parser.set_defaults(
            {"model": {"class_path": DEFAULT_MODEL}, "data": {"class_path": DEFAULT_DATA}}
        )
        for group, callback in run_callbacks().items():
            parser.add_lightning_class_args(callback, group)
        for source, target in LINKS:
            parser.link_arguments(source, target)
        # A tracker fed from the run log, its files inside the run directory (docs/loggers.md).
        parser.add_argument(
            "--logger",
            type=Literal["tensorboard", "csv", "wandb", "mlflow"] | None,
            default=None,
            help="Experiment logger writing into the run directory, at metrics.jsonl's steps.",
        )

    def _set_seed(self) -> None:
        """Parsing leaves the RNG alone: ``launch`` seeds, where a reader sees it."""

    def before_instantiate_classes(self) -> None:
        raise Parsed(self)

    def _parse_ckpt_path(self) -> None:
        """Check a ``--ckpt_path`` file the safe way before LightningCLI opens it (it reads the
        checkpoint's hyperparameters right after parsing): a bad file is one error line."""
        sub = self.config.get("subcommand")
        given = self.config[sub].get("ckpt_path") if sub else None
        if given is not None and Path(str(given)).is_file():
            from nanolab.training.resume import ResumeError, resume_candidate

            try:
                resume_candidate(str(given), ".", None, "--ckpt_path", training=sub == "fit")
            except ResumeError as err:
                raise RunConfigError(str(err)) from None
        super()._parse_ckpt_path()


def parse_command(argv: list[str], *, from_command_line: bool = False) -> NanolabCLI:
    """``VERB ARGS`` parsed by the run's parser: the CLI holding ``config`` and the parsers.

    Every ``--config`` file is read first (:func:`check_config_files`); a value the parser
    refuses ends in one error line and exit 2 (:class:`OneLineErrorParser`). With
    ``from_command_line`` LightningCLI reads ``sys.argv`` itself (it warns when given both).
    """
    check_config_files(argv)
    verb = argv[0] if argv else None
    known = keys.known_keys(verb) if verb in ("fit", "validate", "test") else None
    if known is not None:
        keys.check_keys(argv[1:], known)
    try:
        cli = _parse(argv, from_command_line)
    except RunConfigError as err:
        if verb in ("fit", "validate", "test"):
            known = known if known is not None else verb_keys(verb)
            keys.check_keys(argv[1:], known)  # an unknown key: "did you mean"
            options = known - {target for _, target in LINKS}  # a link's target is no option
            hint = keys.undotted_hint(argv[1:], options) if "unrecognized" in str(err) else None
            if hint:
                raise RunConfigError(hint) from None
            settings = getattr(schema.load(verb), "settings", None)  # the settings' types
            hint = group_value_problem(argv[1:], options, str(err), settings)
            if hint:
                raise RunConfigError(hint) from None
            chosen = chosen_class_keys(verb, argv[1:])
            if chosen is not None:  # the same check for the keys of a class the config names
                keys.check_keys(argv[1:], chosen, skip_chosen=False)
            line = keys.unknown_option_line(argv[1:], known, verb) if hint is None else None
            if line is not None and "unrecognized arguments" in str(err):
                raise RunConfigError(line) from None
        raise
    if verb in ("fit", "validate", "test") and known is None:
        keys.check_keys(argv[1:], verb_keys(verb))  # and remembered for the next launch
    return cli


def _parse(argv: list[str], from_command_line: bool) -> NanolabCLI:
    try:
        NanolabCLI(  # model and data: any LightningModule / LightningDataModule class path
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=None if from_command_line else argv,
            trainer_defaults=trainer_defaults(),
            seed_everything_default=FIT_SEED,
            auto_configure_optimizers=False,
            parser_class=OneLineErrorParser,
            parser_kwargs=whole_options(argv[0] if argv else None),
            verb=argv[0] if argv else None,
        )
    except Parsed as done:
        return done.cli
    raise RunConfigError("the command line could not be parsed")  # pragma: no cover


def verb_keys(verb: str) -> frozenset[str]:
    """Every key of ``verb``'s parser with nanolab's own classes (a parse of the defaults,
    ~0.3 s), remembered for the next launch's check before Lightning is imported."""
    import warnings

    with warnings.catch_warnings():  # LightningCLI warns that sys.argv is not what it parses
        warnings.simplefilter("ignore")
        cli = _parse([verb], from_command_line=False)
    _remember_schema(verb, cli)
    return keys.remember_keys(verb, keys.parser_keys(cli.config[verb]))


def chosen_class_keys(verb: str, args: list[str]) -> frozenset[str] | None:
    """Every key of ``verb``'s parser with the model and data classes ``args`` name (a parse of
    those classes' defaults, ~0.3 s, on the error path only), or None when they name none or
    their defaults do not parse alone (the parser's own error stands then).

    The keys nanolab remembers are those of its own classes, so the check before the parse
    passes over the groups of a class the config names; the parser then refuses a mistyped
    key in words of its own (``Group 'model.gpt' does not accept option 'n_layers'``, or an
    unrecognized ``--model.gpt.n_layers=2`` the user never typed) that name no file and no fix.
    """
    chosen: dict[str, str] = {}
    for data in keys.read_config_files(args, config_groups()):  # files, then flags: last wins
        chosen.update(class_paths_in_config(data))
    chosen.update(class_paths_in_argv(args))
    flags = [f"--{group}={path}" for group, path in chosen.items() if group in keys.CLASS_GROUPS]
    if not flags:
        return None
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cli = _parse([verb, *flags], from_command_line=False)
    except RunConfigError:
        return None
    return frozenset(keys.parser_keys(cli.config[verb]))


def remember_schema(verb: str) -> None:
    """Remember ``verb``'s settings, types and defaults (:mod:`nanolab.run.schema`) from a parse
    of the defaults (~0.3 s), for the next launch's reading of a config without Lightning."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = _parse([verb], from_command_line=False)
    _remember_schema(verb, cli)


def _remember_schema(verb: str, cli: NanolabCLI) -> None:
    from nanolab.training.resolve import plain_config

    try:
        found = schema.schema_of(cli.verb_parser, plain_config(cli.config[verb]), config_groups())
    except Exception:  # a parser the schema cannot describe: every config goes to the parser
        return
    schema.remember(verb, found)


def parse_fit_config(args: list[str]) -> Any:
    """The merged config ``nanolab fit ARGS`` would run, read by the fit parser itself.

    Nothing is built and this process's RNG is not touched. ``queue add`` checks jobs with it
    and the resolver's parity test holds :func:`nanolab.training.resolve.compose` against it.
    Raises :class:`FitParseError` with the parser's error line.
    """
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return parse_command(nulls_as_class_settings(["fit", *args])).config["fit"]
    except RunConfigError as error:
        raise FitParseError(str(error)) from None


def whole_options(verb: str | None) -> dict[str, Any]:
    """The parsers' keyword arguments: options are matched whole, never by a prefix.

    argparse completes a prefix of one option (``--seed 3`` set ``seed_everything``, an
    abbreviation the user may not know they made) and refuses a prefix of several as
    "ambiguous" (``--mode`` could be ``--model``), naming neither the setting meant nor the fix.
    Matched whole, both are unknown options, which get "did you mean" with every setting of
    that name (:func:`nanolab.run.keys.undotted_hint`)."""
    kwargs: dict[str, Any] = {"allow_abbrev": False}
    return {**kwargs, verb: dict(kwargs)} if verb in LightningCLI.subcommands() else kwargs
