"""A run assembled: the ``fit``/``validate``/``test`` command line, built on every layer below.

``cli`` (LightningCLI with nanolab's run settings, checks and error lines), ``autobatch``
(``run.micro_batch_size: auto`` from the estimator), ``short_help`` (``fit --help``) and
``quiet`` (Lightning's start-up chatter). Nothing below this package imports it
(docs/architecture.md).
"""
