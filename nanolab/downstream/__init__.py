"""Downstream evaluation: in-context tasks (multiple choice, schema, language modeling) scored
on a model the way the literature scores them, from local files only (docs/evaluate.md).

``tasks`` reads task files and suites, ``scoring`` scores them batched, ``cloze`` builds the
bundled Shakespeare cloze, ``cli`` is ``nanolab eval``; the callback that runs a suite inside
``fit`` is ``nanolab.callbacks.downstream.DownstreamEval``.
"""
