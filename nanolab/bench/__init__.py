"""Benchmarks: ``nanolab bench`` (nanolab vs a plain PyTorch loop) and the plain loop itself."""

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from nanolab.bench.harness import main as harness_main

    return harness_main(argv)
