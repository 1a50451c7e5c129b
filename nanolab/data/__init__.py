"""Data: tokenizers (``tokenizers``), ``nanolab prepare`` (``prepare``), the resumable window
order (``windows``) and the LightningDataModule (``datamodule``).

Nothing is imported here so that ``nanolab prepare`` starts without importing Lightning.
"""
