"""From ``nanolab fit`` YAML files to the handful of facts the estimator needs.

The YAML is read directly (``yaml.safe_load``, several files deep-merged in order, later keys win)
rather than through LightningCLI: the estimate then takes a fraction of a second, needs no
prepared dataset and cannot be broken by a data or logger setting it does not use.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from nanolab.data.tokenizers import KNOWN_VOCAB, is_tokenizer_file, prepared_vocab
from nanolab.errors import RunConfigError
from nanolab.estimator.gpus import FLOAT32_MATMUL_PRECISIONS, PRECISIONS
from nanolab.estimator.run_length import Budget, budget_problem
from nanolab.helpfmt import suggestion
from nanolab.home import expand_user
from nanolab.model.config import ConfigError, GPTConfig
from nanolab.training.parallelism import (  # noqa: F401  (Strategy, parse_strategy: public here too)
    DEEPSPEED_REDUCE_BUCKET,
    Strategy,
    StrategyKind,
    int_setting,
    parse_strategy,
)
from nanolab.training.resolve import (  # noqa: F401  (deep_merge, load_config: public here too)
    deep_merge,
    load_config,
    trainer_accumulation,
)

#: Optimizers whose state and step memory the estimator models (nanolab/estimator/states.py).
MODELLED_OPTIMIZERS = ("adamw", "adamw8bit", "muon")


#: The estimator's config errors are the resolver's: one kind for a setting that cannot work.
EstimateError = RunConfigError


@dataclass(frozen=True)
class Setup:
    """Everything the estimate depends on, already validated.

    Attributes:
        gpt: The architecture.
        micro_batch_size: Sequences per device per forward/backward (``None``: "auto").
        devices: Devices per node; ``num_nodes``: nodes.
        precision: One of ``32-true``, ``bf16-mixed``, ``16-mixed``, ``bf16-true``, ``16-true``.
        strategy: See :class:`Strategy`.
        optimizer: ``adamw``, ``adamw8bit`` or ``muon`` (:data:`MODELLED_OPTIMIZERS`).
        fused: torch AdamW's fused kernel (no step temporaries); ``None`` = on for GPUs.
        global_batch_tokens: Tokens per optimizer step over all devices (``None``:
            ``accumulate_grad_batches`` micro-batches per device per step).
        accumulate_grad_batches: ``trainer.accumulate_grad_batches`` as the resolver reads it:
            micro-batches per optimizer step where no ``global_batch_tokens`` derives them
            (``nanolab fit`` obeys it then, whatever the micro-batch).
        max_steps: Optimizer steps of the run (for the token budget), if known.
        budget: The config's ``budget`` limits and price: where they stop the run, what an
            hour costs (:mod:`nanolab.estimator.run_length`).
        compile: ``torch.compile`` is on (on a GPU its loss keeps no log-softmax:
            ``Numerics.compiled_loss``; docs/estimator.md).
        float32_matmul_precision: ``run.float32_matmul_precision`` (``highest``: FP32 GEMMs;
            ``high``/``medium``: TF32 where the GPU has it); only ``32-true`` matmuls care.
        devices_guessed: ``trainer.devices`` was ``auto`` (or absent) and no override was
            given, so one device per node was assumed.
        data_micro_batch_size: ``data.micro_batch_size``, what an ``auto`` micro-batch trains
            at where fit has no GPU memory to plan against (a CPU run).
        model_note: A model class of a project's own estimated as nanolab's GPT of ``gpt``
            though not exactly it (a few parameters more, or not buildable to count): the
            line that says so with the estimate (:mod:`nanolab.estimator.own_class`).
    """

    gpt: GPTConfig
    micro_batch_size: int | None = None
    devices: int = 1
    num_nodes: int = 1
    precision: str = "bf16-mixed"
    strategy: Strategy = field(default_factory=Strategy)
    optimizer: str = "adamw"
    fused: bool | None = None
    global_batch_tokens: int | None = None
    accumulate_grad_batches: int = 1
    max_steps: int | None = None
    budget: Budget = field(default_factory=Budget)
    compile: bool = False
    devices_guessed: bool = False  # trainer.devices was "auto" and nothing overrode it
    float32_matmul_precision: str = "high"
    data_micro_batch_size: int | None = None
    model_note: str = ""  # a model class of one's own estimated as its GPT: how it differs

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    def with_micro_batch(self, micro_batch_size: int) -> Setup:
        return replace(self, micro_batch_size=micro_batch_size)


# -- interpretation ---------------------------------------------------------------------------
def on_one_device(setup: Setup, micro_batch: int, accumulate: int) -> Setup:
    """``setup`` trained eager on one device at ``micro_batch`` with ``accumulate`` micro-batches
    a step: what ``benches/bench_memory.py`` measures on a GPU, and the GPU figures the tests
    hold the rules to were measured as."""
    return replace(
        setup,
        devices=1,
        num_nodes=1,
        strategy=Strategy("single"),
        micro_batch_size=micro_batch,
        global_batch_tokens=micro_batch * setup.gpt.block_size * accumulate,
        compile=False,
    )


def _section(cfg: Mapping[str, Any], name: str) -> dict[str, Any]:
    value = cfg.get(name) or {}
    if not isinstance(value, Mapping):
        raise EstimateError(f"'{name}' must be a mapping, got {type(value).__name__}")
    return dict(value)


def resolve_vocab(gpt: dict[str, Any], data: Mapping[str, Any]) -> int:
    """``model.gpt.vocab_size``, or the prepared data's, or the named tokenizer's."""
    if gpt.get("vocab_size") is not None:
        return int_setting(gpt["vocab_size"], "model.gpt.vocab_size", minimum=2)
    if (vocab := prepared_vocab(data)) is not None:
        return vocab
    tokenizer = str(data.get("tokenizer", ""))
    if tokenizer in KNOWN_VOCAB:  # the named tokenizers' vocabularies, end-of-text included
        return KNOWN_VOCAB[tokenizer]
    if tokenizer == "bpe":
        return int_setting(data.get("bpe_vocab_size", 4096), "data.bpe_vocab_size", minimum=2)
    if (
        is_tokenizer_file(tokenizer)
        and (file := expand_user(tokenizer, field="data.tokenizer")).is_file()
    ):
        from tokenizers import Tokenizer as RustTokenizer

        return int(RustTokenizer.from_file(str(file)).get_vocab_size(with_added_tokens=True))
    raise EstimateError(
        "model.gpt.vocab_size is null and the data is not prepared yet; "
        "pass --vocab-size N (or prepare the data first)"
    )


def _plugin_classes(model_class: str, data_class: str) -> bool:
    """Import the config's own model/data classes: their modules may register the attention,
    MLP or norm variants the config names (the estimate must describe the model the run
    builds); one line when they do not import. Returns whether the model takes ``gpt``."""
    from nanolab.training.plugins import DEFAULT_DATA, DEFAULT_MODEL, PluginImportError, load_class

    try:
        if data_class != DEFAULT_DATA:
            load_class(data_class, "data")
        if model_class == DEFAULT_MODEL:
            return True
        cls = load_class(model_class, "model")
    except PluginImportError as err:
        raise EstimateError(str(err)) from None
    import inspect

    from nanolab.training.module import GPTLightningModule

    return issubclass(cls, GPTLightningModule) or "gpt" in inspect.signature(cls).parameters


def unknown_gpt_keys(unknown: list[str], known: set[str]) -> str:
    """One line for misspelt ``model.gpt`` keys, as ``fit`` words it: each key, and the nearest
    known one where there is one."""
    full = frozenset(f"model.gpt.{k}" for k in known)
    parts = []
    for key in unknown:
        near = suggestion(f"model.gpt.{key}", full)
        parts.append(f"model.gpt.{key}" + (f" (did you mean {near}?)" if near else ""))
    return f"unknown setting {', '.join(parts)}; the model.gpt settings are in docs/configs.md"


def timed_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg`` as a time estimate reads it: an optimizer of a project's own (registered, not
    one whose state memory is modelled: docs/optimizers.md) is read as ``adamw``. A step's time
    is the model's FLOPs, which the optimizer does not change; its memory is another matter,
    which the memory estimate still refuses in words. Anything else is left as it is."""
    from nanolab.training.optim import registered_optimizer
    from nanolab.training.resolve import sections

    try:
        model_class, model = sections(cfg)[:2]
    except Exception:  # not a config the estimator reads: it says why itself
        return dict(cfg)
    opt = model.get("optimizer")
    name = opt.get("name") if isinstance(opt, Mapping) else None
    if not isinstance(name, str) or name in MODELLED_OPTIMIZERS or not registered_optimizer(name):
        return dict(cfg)
    args = {**model, "optimizer": {**opt, "name": "adamw"}}
    return {**cfg, "model": {"class_path": model_class, "init_args": args}}


def setup_from_config(
    cfg: Mapping[str, Any],
    *,
    devices: int | None = None,
    num_nodes: int | None = None,
    micro_batch_size: int | None = None,
    vocab_size: int | None = None,
) -> Setup:
    """Interpret a merged ``nanolab fit`` config; keyword arguments override it.

    Device counts, micro-batch and global batch come from the one resolver
    (:func:`nanolab.training.resolve.resolve`) that ``fit`` and ``queue add`` use, with
    ``trainer.devices: auto`` read as one device (flagged as a guess) since the estimate is
    for a machine it cannot see.
    """
    from nanolab.training.resolve import (
        check_model_settings,
        resolve,
        sections,
        with_own_defaults,
    )

    model_class, model, data_class, data = sections(cfg)
    takes_gpt = _plugin_classes(model_class, data_class)
    model = with_own_defaults(model_class, model, "model")  # a class's own, as fit reads it
    data = with_own_defaults(data_class, data, "data")
    check_model_settings({k: v for k, v in model.items() if k != "gpt"})  # gpt: checked below
    trainer = _section(cfg, "trainer")
    if "gpt" in model and not isinstance(model["gpt"], Mapping):
        raise EstimateError(f"'model.gpt' must be a mapping, got {type(model['gpt']).__name__}")
    if not takes_gpt:
        raise EstimateError(
            f"model {model_class} cannot be estimated: the estimator describes nanolab's GPT "
            "(its parameters, memory and time from model.gpt), and this class neither "
            "subclasses GPTLightningModule nor takes a `gpt: GPTConfig` argument; fit trains "
            "it all the same (docs/estimate.md, 'A model class of your own')"
        )
    gpt_raw = dict(model.get("gpt") or {})
    if model.get("init_from"):  # a Hugging Face GPT-2 folder: its architecture (docs/hf.md)
        from nanolab.model.hf import resolve_architecture

        try:
            gpt_raw = resolve_architecture(gpt_raw, model["init_from"])
        except ConfigError as err:
            raise EstimateError(str(err)) from None
    if vocab_size is not None:
        gpt_raw["vocab_size"] = vocab_size
    gpt_raw["vocab_size"] = resolve_vocab(gpt_raw, data)
    if gpt_raw.get("document_mask") and gpt_raw.get("eot_id") is None:
        # Which id ends a document changes no size or FLOP count: any id stands in for the
        # data's (fit reads the real one).
        gpt_raw["eot_id"] = gpt_raw["vocab_size"] - 1
    known = set(GPTConfig.__dataclass_fields__)
    unknown = sorted(set(gpt_raw) - known)
    if unknown:
        raise EstimateError(unknown_gpt_keys(unknown, known))
    try:
        gpt = GPTConfig(**gpt_raw)
    except (ConfigError, TypeError) as err:
        raise EstimateError(str(err)) from None
    from nanolab.training.plugins import DEFAULT_MODEL

    model_note = ""
    if model_class != DEFAULT_MODEL:  # a class of one's own may build another network
        from nanolab.estimator.own_class import OtherNetworkError, own_class_verdict

        verdict = own_class_verdict(model_class, model, gpt)
        if verdict.refusal is not None:
            raise OtherNetworkError(verdict.refusal)
        model_note = verdict.note

    if devices is not None:
        devices = int_setting(devices, "devices")
    resolved = resolve(
        {**cfg, "model": {**model, "gpt": gpt.to_dict()}, "data": data},
        visible_gpus=None,
        data_vocab=prepared_vocab(data),
        devices=devices,
        num_nodes=num_nodes,
        micro_batch_size=micro_batch_size,
        micro_batch_from="--micro-batch",  # the estimate's own option (the config's: named)
    )

    given = trainer.get("precision")
    raw_precision = "32-true" if given is None else str(given)  # None: Lightning's default
    if raw_precision not in PRECISIONS:
        raise EstimateError(
            f"trainer.precision {raw_precision!r} is not modelled; use one of "
            f"{sorted(set(PRECISIONS.values()))}"
        )
    precision = PRECISIONS[raw_precision]

    world = resolved.world_size
    strategy = parse_strategy(trainer.get("strategy", "auto"), world)
    if strategy.kind == "single" and world > 1:
        strategy = Strategy("ddp")

    opt = _section(model, "optimizer") if "optimizer" in model else {}
    opt_name = str(opt.get("name", "adamw"))
    if opt_name not in MODELLED_OPTIMIZERS:
        from nanolab.training.optim import optimizer_spec

        optimizer_spec(opt_name)  # not registered: the one-line error listing the names
        raise EstimateError(
            f"model.optimizer.name {opt_name!r}: its state memory is not modelled (the estimate "
            f"covers {', '.join(MODELLED_OPTIMIZERS)}); the optimizer does not change the "
            "time: --model.optimizer.name adamw estimates the same FLOPs and time, with memory "
            f"for AdamW's state (two fp32 values a parameter) instead of {opt_name}'s"
        )

    run = _section(cfg, "run")
    matmul = str(run.get("float32_matmul_precision", "high"))
    if matmul not in FLOAT32_MATMUL_PRECISIONS:
        raise EstimateError(
            f"run.float32_matmul_precision must be one of {list(FLOAT32_MATMUL_PRECISIONS)}, "
            f"got {matmul!r}"
        )
    if (problem := budget_problem(cfg.get("budget"))) is not None:
        raise EstimateError(problem)  # fit's own refusal: the run this would price never starts
    max_steps = resolved.max_steps
    # Without a global batch, fit trains the trainer's own accumulation (the resolver's value;
    # it has none yet while the micro-batch is auto, and the count does not depend on it).
    accumulate = resolved.accumulate
    if accumulate is None or resolved.global_batch_tokens is not None:
        accumulate = trainer_accumulation(trainer.get("accumulate_grad_batches"))

    setup = Setup(
        gpt=gpt,
        micro_batch_size=resolved.micro_batch_size,
        devices=resolved.devices_per_node,
        num_nodes=resolved.num_nodes,
        precision=precision,
        strategy=strategy,
        optimizer=opt_name,
        fused=opt.get("fused"),
        global_batch_tokens=resolved.global_batch_tokens,
        accumulate_grad_batches=accumulate,
        max_steps=None if max_steps in (None, -1) else max_steps,
        budget=Budget.from_config(cfg.get("budget")),
        compile=bool(model.get("compile", False)),
        devices_guessed=resolved.devices_guessed,
        float32_matmul_precision=matmul,
        data_micro_batch_size=_positive_int_or_none(data.get("micro_batch_size")),
        model_note=model_note,
    )
    check_setup(setup)
    return setup


def _positive_int_or_none(value: Any) -> int | None:
    """``value`` as a micro-batch when it is a positive whole number (else the data refuses it)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def check_setup(setup: Setup) -> None:
    """Reject combinations that cannot run, with the reason."""
    s = setup.strategy
    if s.kind == "deepspeed" and setup.optimizer == "adamw8bit" and s.offload_optimizer:
        raise EstimateError("DeepSpeed optimizer offload runs its own CPU Adam; use name: adamw")
    from nanolab.training.optim import strategy_refusal

    why = strategy_refusal(setup.optimizer, s.kind, s.describe())
    if why:
        raise EstimateError(why)
    if setup.global_batch_tokens is None:
        return
    per_seq = setup.gpt.block_size * setup.world_size
    units = {"": per_seq}
    if setup.micro_batch_size is not None:
        units["micro_batch_size x "] = setup.micro_batch_size * per_seq
    for what, unit in units.items():
        if setup.global_batch_tokens % unit != 0:
            raise EstimateError(
                f"run.global_batch_tokens ({setup.global_batch_tokens}) is not a multiple of "
                f"{what}block_size x devices = {unit}"
            )
