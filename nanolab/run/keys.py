"""The settings ``nanolab fit`` knows, so an unknown key gets "did you mean" and is refused fast.

The fit parser (LightningCLI) only exists after Lightning is imported, seconds into a launch. Its
keys are the same at every launch of the same code, so the first parse remembers them on disk
(beside the estimator's cache, keyed by nanolab's files and the versions of Lightning,
jsonargparse, torch and Python), and the next launch checks the command line and its ``--config``
files against them before importing anything heavy: a typo is one line in well under a second.

A key is unknown when it is neither a setting, nor a group of settings, nor inside a setting
that takes free-form values (``trainer.callbacks``, ``trainer.strategy``, ...). Keys under
``model``/``data`` are not checked when the config chooses another class for them (its keys are
that class's). An argparse-style abbreviation (``--trainer.max_step`` for ``max_steps``) is
unknown too: a silently completed typo is the same typo.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from nanolab.errors import RunConfigError

#: Groups whose keys depend on a class the config may choose.
CLASS_GROUPS = ("model", "data")


def _cache_file(verb: str, kind: str = "keys", dists: tuple[str, ...] = ()) -> Path | None:
    """Where ``verb``'s remembered ``kind`` (``keys``, ``help``) lives for this code; ``dists``:
    more packages whose version the answer depends on."""
    from nanolab.estimator.facts_cache import cache_dir

    folder = cache_dir()
    return None if folder is None else folder / f"{verb}-{kind}-{_fingerprint(dists)}.json"


def _fingerprint(dists: tuple[str, ...] = ()) -> str:
    """Changes whenever the keys could: nanolab's files, and the parser's packages."""
    from importlib.metadata import PackageNotFoundError, version

    digest = hashlib.sha256()
    package = Path(__file__).resolve().parents[1]
    for root, dirs, files in os.walk(package):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                st = os.stat(os.path.join(root, name))
                digest.update(f"{root}/{name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    for dist in ("lightning", "jsonargparse", "torch", *dists):
        try:
            digest.update(f"{dist}={version(dist)}\n".encode())
        except PackageNotFoundError:
            digest.update(f"{dist}=none\n".encode())
    digest.update(f"python={sys.version_info[:3]}".encode())
    return digest.hexdigest()[:16]


def known_keys(verb: str) -> frozenset[str] | None:
    """The keys remembered for ``verb`` by an earlier parse of this code, or None."""
    path = _cache_file(verb)
    try:
        return frozenset(json.loads(path.read_text())) if path is not None else None
    except (OSError, ValueError):
        return None


def remember_keys(verb: str, keys: Iterable[str]) -> frozenset[str]:
    """Write ``keys`` for the next launch (atomically; a cache that cannot be written is
    skipped: it only makes the next refusal slower)."""
    known = frozenset(keys)
    write_remembered(_cache_file(verb), sorted(known))
    return known


def write_remembered(path: Path | None, value: Any) -> None:
    """``value`` as JSON at ``path``, atomically (a cache that cannot be written is skipped:
    it only makes the next launch slower)."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(value, f)
        os.replace(tmp, path)
    except OSError:
        pass


def parser_keys(config: Any) -> list[str]:
    """The dotted keys of a parsed fit config (a jsonargparse Namespace), as a user writes them
    (``model.gpt.n_layer``: the ``init_args`` level left out)."""
    return [_plain_key(key) for key in config.keys()]  # noqa: SIM118 (dotted, nested keys)


def _plain_key(key: str) -> str:
    parts = key.split(".")
    if len(parts) >= 2 and parts[0] in CLASS_GROUPS and parts[1] == "init_args":
        parts = [parts[0], *parts[2:]]
    return ".".join(parts)


def given_keys(argv: list[str]) -> Iterator[tuple[str, str]]:
    """``(key, where)`` for every dotted ``--key`` of the command line and every key of its
    ``--config`` files (files that cannot be read are left to the parser)."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            yield from _file_keys(argv[i + 1])
        elif arg.startswith("--config="):
            yield from _file_keys(arg.split("=", 1)[1])
        elif arg.startswith("--") and "." in arg.split("=", 1)[0]:
            key = arg[2:].split("=", 1)[0].rstrip("+")  # --trainer.callbacks+=X appends
            yield key, f"--{key}"


def _file_keys(raw: str) -> Iterator[tuple[str, str]]:
    from nanolab.training.resolve import load_yaml

    path = Path(raw)
    if not path.is_file():
        return
    try:
        data = load_yaml(path.read_text(encoding="utf-8"), f"config file {path}")
    except RunConfigError:
        raise
    except Exception:  # not YAML, not text: the parser names the problem its own way
        return
    if isinstance(data, Mapping):
        for key in _flatten(data):
            yield key, f"config file {path}"


def _flatten(data: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from _flatten(value, path + ".")
        else:
            yield path


def chosen_classes(argv: list[str]) -> set[str]:
    """The class groups whose class the command line or its files choose (not checked)."""
    chosen = set()
    for key, _ in given_keys(argv):
        group, _, rest = key.partition(".")
        if group in CLASS_GROUPS and rest == "class_path":
            chosen.add(group)
    for arg in argv:
        for group in CLASS_GROUPS:
            if arg == f"--{group}" or arg.startswith(f"--{group}="):
                chosen.add(group)
    return chosen


def check_keys(argv: list[str], known: frozenset[str]) -> None:
    """Refuse the first key of ``argv`` (and its ``--config`` files) that ``known`` lacks,
    naming where it is and the nearest known key."""
    skip = chosen_classes(argv)
    for raw, where in given_keys(argv):
        key = _plain_key(raw)
        group = key.split(".", 1)[0]
        if group in skip or key.endswith(".help") or _known(key, known):
            continue
        near = suggestion(key, known)
        dash = "--" if where.startswith("--") else ""
        hint = f"did you mean {dash}{near}?" if near else "`nanolab fit --help` lists them"
        place = "" if dash else f"{where}: "
        raise RunConfigError(f"{place}unknown setting {dash}{key}; {hint}")


def _known(key: str, known: frozenset[str]) -> bool:
    """A setting, a group of settings, or inside a setting that takes free-form values."""
    if key in known:
        return True
    parts = key.split(".")
    if any(".".join(parts[:n]) in known for n in range(1, len(parts))):
        return True  # below a setting: a class's init_args, a dict value
    return any(k.startswith(key + ".") for k in known)


def suggestion(key: str, known: frozenset[str]) -> str | None:
    """The nearest known key: a sibling in the same group first (a looser match: the group is
    right), then any key."""
    parent, _, leaf = key.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == parent}
    near = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.4)
    if near:
        return siblings[near[0]]
    near = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return near[0] if near else None


def preflight(verb: str, argv: list[str]) -> None:
    """Before Lightning is imported: every ``--config`` file read (an alias bomb refused) and,
    when the keys are remembered, an unknown key refused with its nearest known key."""
    for _ in given_keys(argv):  # reads (and checks) every --config file
        pass
    known = known_keys(verb)
    if known is not None:
        check_keys(argv, known)
