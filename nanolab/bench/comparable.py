"""What the bench's plain loop reproduces of a config, checked before anything runs.

The plain loop (:mod:`nanolab.bench.plain_loop`) trains nanolab's GPT on one prepared dataset's
stream windows, from random weights, every parameter, on one device without a strategy, no
callbacks of the user's, and saves by steps, synchronously. A config that asks
``nanolab fit`` for anything else would make the bench time two different jobs and call the
ratio nanolab's overhead; it is refused in one line naming the setting and the way to bench it.
Kept free of torch so the refusal comes before any heavy import.
"""

from __future__ import annotations

from typing import Any

from nanolab.errors import NanolabError

#: The classes whose training the plain loop reproduces (``model_class``/``data_class``).
FOLLOWED_CLASSES = {
    "model": "nanolab.training.module.GPTLightningModule",
    "data": "nanolab.data.datamodule.TokenDataModule",
}


class NotComparable(NanolabError):
    """A setting the plain loop does not reproduce: the bench would time different work."""


#: ``trainer.strategy`` values that train one device the way the plain loop does.
ONE_DEVICE_STRATEGIES = {None, "auto", "single_device", "SingleDeviceStrategy"}


def _strategy_name(strategy: Any) -> Any:
    if isinstance(strategy, dict):  # {class_path: ..., init_args: ...}
        return str(strategy.get("class_path", "")).rsplit(".", 1)[-1]
    return strategy if strategy is None else str(strategy)


def check_comparable(config: dict[str, Any], resolved: Any) -> None:
    """Refuse, before anything runs, a config whose training, evaluation or saving the plain
    loop would not do the same way (``config``: composed; ``resolved``: the resolver's answer
    for it), naming the setting and the fix."""
    model, data = resolved.model_args, resolved.data_args
    trainer, saves = config.get("trainer") or {}, config.get("checkpoint") or {}
    freeze = model.get("freeze") or {}
    strategy = _strategy_name(trainer.get("strategy"))
    refusals = [
        (
            resolved.model_class != FOLLOWED_CLASSES["model"],
            "model.class_path",
            f"the plain loop trains nanolab's GPT, not {resolved.model_class}",
            "bench nanolab's model; time your own module with nanolab fit's goodput",
        ),
        (
            resolved.data_class != FOLLOWED_CLASSES["data"],
            "data.class_path",
            f"the plain loop reads nanolab's token windows, not {resolved.data_class}",
            "bench nanolab's TokenDataModule on the same prepared folder",
        ),
        (
            bool(data.get("datasets")),
            "data.datasets",
            "the plain loop reads one dataset, not a mixture",
            "bench one of them: --set=--data.datasets=null --set=--data.dataset_dir=<folder>",
        ),
        (
            data.get("align", "stream") != "stream",
            "data.align",
            "the plain loop reads stream windows, not document-aligned ones",
            "bench with --set=--data.align=stream (the step costs the same)",
        ),
        (
            model.get("init_from") is not None,
            "model.init_from",
            "the plain loop starts from random weights",
            "bench the same architecture from scratch: set model.gpt to it and "
            "--set=--model.init_from=null (the step costs the same)",
        ),
        (
            bool(freeze.get("embeddings")) or bool(freeze.get("blocks")),
            "model.freeze",
            "the plain loop trains every parameter",
            "bench without freezing (--set=--model.freeze.blocks=0 "
            "--set=--model.freeze.embeddings=false)",
        ),
        (
            resolved.world_size > 1,
            "trainer.devices",
            f"the plain loop trains on one device, nanolab here on {resolved.world_size}",
            "bench with --set=--trainer.devices=1 --set=--trainer.num_nodes=1",
        ),
        (
            strategy not in ONE_DEVICE_STRATEGIES,
            "trainer.strategy",
            f"the plain loop steps a plain optimizer on one device, not under {strategy}",
            "bench without the strategy overlay (one device trains the same model)",
        ),
        (
            bool(trainer.get("fast_dev_run")) or trainer.get("profiler") is not None,
            "trainer.fast_dev_run" if trainer.get("fast_dev_run") else "trainer.profiler",
            "the plain loop has no debug mode or profiler",
            "bench without the debug config",
        ),
        (
            bool(trainer.get("callbacks")),
            "trainer.callbacks",
            "the plain loop runs none of your callbacks (their work would count as nanolab's)",
            "bench without them (--set=--trainer.callbacks=[])",
        ),
        (
            saves.get("every_n_minutes") is not None,
            "checkpoint.every_n_minutes",
            "the plain loop saves by steps, not by wall time",
            "bench with --set=--checkpoint.every_n_minutes=null",
        ),
        (
            bool(saves.get("save_on_best")),
            "checkpoint.save_on_best",
            "the plain loop saves by steps, not on a new best validation loss",
            "bench with --set=--checkpoint.save_on_best=false",
        ),
        (
            bool(saves.get("async_save")),
            "checkpoint.async_save",
            "the plain loop saves synchronously",
            "bench with --set=--checkpoint.async_save=false",
        ),
    ]
    for refused, field, problem, fix in refusals:
        if refused:
            raise NotComparable(problem, field=field, fix=fix)
