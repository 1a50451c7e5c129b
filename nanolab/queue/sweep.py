"""``queue add --sweep KEY=V1,V2 --sweep KEY2=...``: the grid of every value, one job per point.

A sweep point is a tuple of ``(key, value)`` pairs, added to the job's ``--set`` overrides; the
job is named after the swept values (``quickstart-lr1e-3-n_layer4-s1``: the last part of each
key, then the value), so ``queue ls`` and ``nanolab report`` say what each run is without
opening its config. Values are split on commas, so a list value (``betas``) cannot be swept.
"""

from __future__ import annotations

import itertools

from nanolab.queue.jobs import RESERVED_KEYS, JobConfigError, name_part, reserved_line

Point = tuple[tuple[str, str], ...]


def parse_sweeps(items: list[str], set_keys: list[str]) -> list[tuple[str, list[str]]]:
    """``["model.optimizer.lr=1e-3,3e-3"]`` -> ``[("model.optimizer.lr", ["1e-3", "3e-3"])]``."""
    sweeps: list[tuple[str, list[str]]] = []
    for item in items:
        key, sep, values_text = item.partition("=")
        key = key.strip().lstrip("-")
        values = [v.strip() for v in values_text.split(",")]
        if not sep or not key or not values_text.strip() or any(not v for v in values):
            raise JobConfigError(
                f"--sweep {item!r}: expected KEY=V1,V2,..., e.g. --sweep model.optimizer.lr=1e-3,3e-3"
            )
        if key in RESERVED_KEYS:
            # --seeds takes the swept seeds as they are (1,2); --name takes one name, not a list.
            seeds = ",".join(values) if key == "seed_everything" else None
            raise JobConfigError(reserved_line(f"--sweep {key}", key, seeds))
        if key in set_keys:
            raise JobConfigError(f"--sweep {key}: also given with --set; give it in one of them")
        if key in (k for k, _ in sweeps):
            raise JobConfigError(f"--sweep {key}: swept twice; list all its values in one --sweep")
        if "[" in values_text or "{" in values_text:
            raise JobConfigError(
                f"--sweep {item!r}: a list or mapping value cannot be swept (values are split "
                "on commas); queue each value with its own --set KEY=[...]"
            )
        read = [_as_read(v) for v in values]  # 1e-3 and 1.0e-3, 1 and 01: one value
        twice = next((v for i, v in enumerate(values) if read[i] in read[:i]), None)
        if twice is not None:
            raise JobConfigError(f"--sweep {item!r}: {twice!r} is a value listed before")
        sweeps.append((key, values))
    return sweeps


def _as_read(text: str) -> object:
    """A value as the fit parser reads it (YAML: ``1.0e-3`` == ``1e-3``), for comparing."""
    from nanolab.training.resolve import override_value

    value = override_value(text)
    return ("bool", value) if isinstance(value, bool) else value  # true is not 1


def grid(sweeps: list[tuple[str, list[str]]]) -> list[Point]:
    """Every combination, the first ``--sweep`` varying slowest; ``[()]`` without sweeps."""
    keys = [k for k, _ in sweeps]
    return [
        tuple(zip(keys, combo, strict=True)) for combo in itertools.product(*(v for _, v in sweeps))
    ]


def point_name(base: str, point: Point) -> str:
    """``quickstart`` + ``(("model.optimizer.lr", "1e-3"),)`` -> ``quickstart-lr1e-3``; a value
    that is a path names its folder with ``_`` for ``/`` (``dataset_dirdata_web``)."""
    return "-".join([base, *(name_part(f"{k.rsplit('.', 1)[-1]}{v}") for k, v in point)])
