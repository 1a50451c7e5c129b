"""CPU fits keep freed heap memory: a large freed tensor is not page-faulted in again."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")

PROBE = textwrap.dedent(
    """
    import os, resource, sys
    import torch
    from nanolab.training.cpu_memory import keep_freed_memory

    def faults_per_alloc():
        r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(4):
            t = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)  # 64 MiB, touched
            del t
        return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / 4

    before = faults_per_alloc()
    applied = keep_freed_memory()
    faults_per_alloc()  # the heap grows to hold the tensor once first
    print(applied, before, min(faults_per_alloc() for _ in range(3)))
    """
)


def _probe(env_value: str | None) -> tuple[bool, float, float]:
    import os

    env = dict(os.environ)
    if env_value is not None:
        env["NANOLAB_KEEP_FREED_MEMORY"] = env_value
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    applied, before, after = out.stdout.split()
    return applied == "True", float(before), float(after)


def test_freed_memory_stays_in_the_process_after_keep_freed_memory():
    applied, before, after = _probe(None)
    if not applied:
        pytest.skip("no glibc mallopt here")
    # 64 MiB is 16384 pages, above glibc's adaptive mmap threshold (at most 32 MiB): by default
    # each one is mapped fresh, zero-filled page by page, and unmapped when freed. The kernel
    # may serve a fresh mapping with transparent huge pages (a few dozen faults), more often on
    # an idle machine than a loaded one: then there is nothing to compare. The bar is relative,
    # so it holds whatever else the machine is doing.
    if before < 1000:
        pytest.skip(f"the kernel mapped the tensors with huge pages ({before:.0f} faults each)")
    assert after < before / 10, (before, after)


def test_the_environment_turns_it_off():
    applied, before, after = _probe("0")
    assert not applied and after > 8000, (before, after)
