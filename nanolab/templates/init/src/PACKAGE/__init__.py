"""{{name}}: a language-model project on nanolab (README.md says where to change what).

The configs name this package's classes by path (``{{package}}.model.Model``,
``{{package}}.data.Data``, ``{{package}}.callbacks.SampleText``), so ``pip install -e .`` once
and every ``nanolab`` command finds them, from any folder, without ``PYTHONPATH``.
"""
