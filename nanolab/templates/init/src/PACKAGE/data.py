"""{{name}}'s data: which text the model trains on, and how it becomes token windows.

``configs/experiment.yaml`` selects :class:`Data` by class path (``data.class_path:
{{package}}.data.Data``). It is nanolab's ``TokenDataModule``: the text in ``source`` is
tokenized once into ``dataset_dir`` (``train.bin``, ``val.bin``, ``meta.json``) and served as
windows of ``block_size`` tokens, in an order that an interrupted run resumes exactly. A dataset
in another shape (records, conversations, several fields) is a class of its own here; README.md
("Add a dataset") writes one.
"""

from __future__ import annotations

from nanolab.data.datamodule import TokenDataModule


class Data(TokenDataModule):
    """This project's text, as nanolab prepares and serves any text (``data.init_args.*``)."""
