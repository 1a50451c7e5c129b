"""The CUDA caching allocator's settings nanolab asks for, before anything allocates.

With the default allocator a training step's large, changing blocks (logits of a big
vocabulary, a grown micro-batch) leave reserved-but-unallocated memory behind: on an H200,
GPT-2 124M at micro-batch 16 reserved 22% more than it allocated, and ``run.micro_batch_size:
auto`` at 139 ran out of memory with 26 GiB "reserved but unallocated" (docs/gpu-check.md). Expandable segments grow one mapping instead of caching fixed blocks, which is
what the estimator's fragmentation margin assumes. A user's own ``PYTORCH_CUDA_ALLOC_CONF``
(or ``PYTORCH_ALLOC_CONF``) is kept as it is; ROCm builds are left alone.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

SETTING = "expandable_segments:True"


def prefer_expandable_segments(
    environ: MutableMapping[str, str] = os.environ, hip_version: str | None = None
) -> bool:
    """Set ``PYTORCH_CUDA_ALLOC_CONF`` to expandable segments unless the user configured the
    allocator or this is a ROCm build; whether it was set. Call before the first CUDA
    allocation (the allocator reads its settings once); child processes inherit it."""
    if hip_version is None:
        hip_version = torch_hip_version()
    if hip_version or "PYTORCH_CUDA_ALLOC_CONF" in environ or "PYTORCH_ALLOC_CONF" in environ:
        return False
    environ["PYTORCH_CUDA_ALLOC_CONF"] = SETTING
    return True


def torch_hip_version() -> str | None:
    """``torch.version.hip``, read from torch's ``version.py`` without importing torch: every verb
    asks, and importing torch costs ~2 s that ``queue ls`` or ``fit --help`` have no use for."""
    return torch_build("hip")


def torch_build(field: str) -> str | None:
    """``torch.version.<field>`` (``hip``, ``cuda``): the GPU toolkit torch was built with, None
    for a build without it, read from torch's ``version.py`` without importing torch."""
    if "torch" in sys.modules:
        return getattr(sys.modules["torch"].version, field, None)
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
        folders = list(spec.submodule_search_locations or []) if spec else []
        with open(os.path.join(folders[0], "version.py"), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in tree.body:  # `hip: Optional[str] = None` or `hip = '6.2...'`
            if isinstance(node, ast.AnnAssign):
                target, value = node.target, node.value
            elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
            else:
                continue
            if isinstance(target, ast.Name) and target.id == field and value is not None:
                found = ast.literal_eval(value)
                if found is None or isinstance(found, str):
                    return found
    except (OSError, IndexError, ValueError, SyntaxError, ImportError):
        pass
    import torch  # a torch laid out otherwise: ask it

    return getattr(torch.version, field, None)
