"""``data.datasets``, a mixture of prepared folders by weight, read from its settings.

Apart from the DataModule (which imports Lightning) so that ``queue add`` reads a job's
mixture by the same rule without that import.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from nanolab.data.prepare import PrepareError
from nanolab.data.windows import MIN_SHARE, mixture_shares
from nanolab.home import expand_user

DATASET_KEYS = ("path", "weight", "name")


def parse_datasets(specs: Any) -> list[tuple[str, Path, float]] | None:
    """``data.datasets`` as (name, path, weight) triples, or one clear error line."""
    if specs is None:
        return None
    if not isinstance(specs, (list, tuple)) or not specs:
        raise PrepareError(
            "data.datasets must list prepared folders with weights, e.g. "
            "[{path: data/web, weight: 0.8}, {path: data/code, weight: 0.2}]; or null"
        )
    out: list[tuple[str, Path, float]] = []
    for i, spec in enumerate(specs):
        field = f"data.datasets[{i}]"
        if hasattr(spec, "as_dict"):  # a jsonargparse Namespace
            spec = spec.as_dict()
        if not isinstance(spec, dict):
            raise PrepareError(f"{field} must be a mapping like {{path: data/web, weight: 0.8}}")
        unknown = sorted(set(spec) - set(DATASET_KEYS))
        if unknown:
            raise PrepareError(
                f"{field} has unknown key(s) {', '.join(unknown)}; use {', '.join(DATASET_KEYS)}"
            )
        path = spec.get("path")
        if not isinstance(path, str) or not path:
            raise PrepareError(f"{field}.path must name a prepared dataset folder")
        weight = spec.get("weight", 1.0)
        if (
            not isinstance(weight, (int, float))
            or isinstance(weight, bool)
            or not math.isfinite(weight)
            or weight <= 0
        ):
            raise PrepareError(f"{field}.weight must be a number > 0, got {weight!r}")
        name = spec.get("name") or Path(path).name or f"dataset{i}"
        if not isinstance(name, str) or "/" in name:
            raise PrepareError(f"{field}.name must be a text without '/', got {name!r}")
        # `~` as `nanolab prepare -o` expands it: the folder prepare wrote is the one read.
        out.append((name, expand_user(path, field=f"{field}.path"), float(weight)))
    for i, share in enumerate(mixture_shares([w for _, _, w in out])):
        if share < MIN_SHARE:
            raise PrepareError(
                f"data.datasets[{i}].weight {out[i][2]!r} is a share of {share:.2g} of the "
                f"weights' total, below {MIN_SHARE:g}: the mixture cannot give it so few "
                f"windows; raise its weight (weights are ratios: their scale does not matter) "
                "or leave it out"
            )
    names = [n for n, _, _ in out]
    if dup := next((n for n in names if names.count(n) > 1), None):
        raise PrepareError(
            f"data.datasets: two datasets are named {dup!r}; give each a distinct name "
            "(name: ...), which labels its validation metrics"
        )
    paths = [p.resolve() for _, p, _ in out]
    if len(set(paths)) != len(paths):
        raise PrepareError("data.datasets lists the same folder twice; list it once")
    return out
