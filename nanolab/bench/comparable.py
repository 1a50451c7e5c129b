"""What the bench's plain loop reproduces of a config, checked before anything runs.

The plain loop (:mod:`nanolab.bench.plain_loop`) trains nanolab's GPT on one prepared dataset's
stream windows, from random weights, every parameter, on one device. A config that asks
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


def check_comparable(resolved: Any) -> None:
    """Refuse, before anything runs, a config whose training the plain loop would not do the
    same way (``resolved``: the resolver's answer for it), naming the setting and the fix."""
    model, data = resolved.model_args, resolved.data_args
    freeze = model.get("freeze") or {}
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
    ]
    for refused, field, problem, fix in refusals:
        if refused:
            raise NotComparable(problem, field=field, fix=fix)
