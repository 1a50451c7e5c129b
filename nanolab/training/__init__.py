"""Training: the LightningModule, optimizers and LR schedule, strategies (and ``trainer.strategy``
read as data), the config resolver, resume and evaluation helpers. The command line that
assembles a run from them is :mod:`nanolab.run`."""
