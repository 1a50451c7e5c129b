"""{{name}}'s model: nanolab's GPT, plus the variants this project adds.

``configs/experiment.yaml`` selects :class:`Model` by class path (``model.class_path:
{{package}}.model.Model``), so nanolab imports this module before it reads the rest of the
config, in ``fit``, ``estimate`` and ``queue add`` alike. That import is what makes a variant
defined here usable: a class decorated with ``@register_attention("name")`` (or
``register_mlp``, ``register_norm``, ``register_position`` from ``nanolab.model.registry``)
becomes a value of ``model.init_args.gpt.attention_variant`` (``mlp``, ``norm``,
``position_embedding``), and the estimator counts its parameters and FLOPs from the module
itself. README.md ("Change the attention") adds one, step by step.
"""

from __future__ import annotations

from nanolab.training.module import GPTLightningModule


class Model(GPTLightningModule):
    """This project's LightningModule: nanolab's GPT trainer, unchanged so far.

    Change the network through registered variants (above this class), so that every nanolab
    command builds the same model from the config. Override ``training_step`` here to change
    the objective; nanolab's resume, checkpoints and run log keep working for a subclass.
    """
