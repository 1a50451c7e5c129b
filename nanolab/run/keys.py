"""The settings ``nanolab fit`` knows, so an unknown key gets "did you mean" and is refused fast.

The fit parser (LightningCLI) only exists after Lightning is imported, seconds into a launch. Its
keys are the same at every launch of the same code, so the first parse remembers them on disk
(beside the estimator's cache, keyed by nanolab's files and the versions of Lightning,
jsonargparse, torch and Python), and the next launch checks the command line and its ``--config``
files against them before importing anything heavy: a typo is one line in well under a second.

A key is unknown when it is neither a setting, nor a group of settings, nor inside a setting
that takes free-form values (``trainer.callbacks``, ``trainer.strategy``, ...). Keys under
``model``/``data`` are not checked here when the config chooses another class for them (its keys
are that class's): when the parser refuses such a config, the keys of the classes it names are
checked the same way (:func:`nanolab.run.parse.chosen_class_keys`). An argparse-style abbreviation (``--trainer.max_step`` for ``max_steps``) is
unknown too: a silently completed typo is the same typo.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from nanolab.atomic import write_whole
from nanolab.errors import RunConfigError
from nanolab.helpfmt import either, near_options, suggestion

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
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parents[1]
    for root, dirs, files in os.walk(package):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                st = os.stat(os.path.join(root, name))
                digest.update(f"{root}/{name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    for dist in ("lightning", "jsonargparse", "torch", *dists):
        digest.update(f"{dist}={_version(dist)}\n".encode())
    digest.update(f"python={sys.version_info[:3]}".encode())
    return digest.hexdigest()[:16]


@functools.cache
def _version(dist: str) -> str:
    """A package's version, looked up once per process (each look-up lists site-packages)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "none"


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
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, json.dumps(value), durable=False)


def parser_keys(config: Any) -> list[str]:
    """The dotted keys of a parsed fit config (a jsonargparse Namespace), as a user writes them
    (``model.gpt.n_layer``: the ``init_args`` level left out)."""
    return [_plain_key(key) for key in config.keys()]  # noqa: SIM118 (dotted, nested keys)


def _plain_key(key: str) -> str:
    from nanolab.training.resolve import setting_key

    return setting_key(key)


def given_keys(argv: list[str]) -> Iterator[tuple[str, str]]:
    """``(key, where)`` for every dotted ``--key`` of the command line and every key of its
    ``--config`` files (files that cannot be read are left to the parser)."""
    for _, key, where in _given_at(argv):
        yield key, where


def _given_at(argv: list[str]) -> Iterator[tuple[int, str, str]]:
    """:func:`given_keys` with the position in ``argv`` of the option or file giving each."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            yield from ((i, key, where) for key, where in _file_keys(argv[i + 1]))
        elif arg.startswith("--config="):
            yield from ((i, key, where) for key, where in _file_keys(arg.split("=", 1)[1]))
        elif arg.startswith("--") and "." in arg.split("=", 1)[0]:
            key = arg[2:].split("=", 1)[0].rstrip("+")  # --trainer.callbacks+=X appends
            yield i, key, f"--{key}"


def given_since_choice(argv: list[str]) -> list[tuple[str, str]]:
    """:func:`given_keys` without the ``model``/``data`` keys given before the option or file
    that last chooses that group's class (``--config quickstart.yaml --model mylab.X``: the
    file's ``model.gpt``): the parser leaves out those the chosen class does not take, with a
    warning (:mod:`nanolab.run.class_choice`), so they are no typo of its settings."""
    given = list(_given_at(argv))
    last: dict[str, int] = {}
    for i, key, _ in given:
        group, _, rest = key.partition(".")
        if group in CLASS_GROUPS and rest in ("", "class_path"):  # ``model: mylab.X`` too
            last[group] = i
    for i, arg in enumerate(argv):
        flag, sep, value = arg.partition("=")
        value = value if sep else (argv[i + 1] if i + 1 < len(argv) else "")
        group = flag[2:] if flag.startswith("--") else ""
        if group in CLASS_GROUPS and not _settings_only(value):
            last[group] = i
    return [(key, where) for i, key, where in given if i >= last.get(key.split(".", 1)[0], -1)]


def _settings_only(value: str) -> bool:
    """``--model VALUE`` that gives settings and keeps the class (a mapping without
    ``class_path``, as ``--model '{"init_args": {...}}'``), not a class choice."""
    import yaml

    try:
        node = yaml.safe_load(value)
    except yaml.YAMLError:
        return False
    return isinstance(node, Mapping) and "class_path" not in node


def _file_keys(raw: str) -> Iterator[tuple[str, str]]:
    path = Path(raw)
    if not _readable_file(raw):
        return
    try:
        text = read_config_text(raw)
    except Exception:  # not text: the parser names the problem its own way
        return
    for key in _keys_in(text, str(path)):
        yield key, f"config file {path}"


def _file_settings(raw: str) -> dict[str, Any]:
    """A readable ``--config`` file's settings by dotted key, with their values (none for one
    the parser will name a problem of)."""
    from nanolab.training.resolve import config_settings, load_yaml

    if not _readable_file(raw):
        return {}
    try:
        data = load_yaml(read_config_text(raw), f"config file {raw}")
    except RunConfigError:
        raise
    except Exception:  # not text, or not YAML: the parser names the problem its own way
        return {}
    return config_settings(data) if isinstance(data, Mapping) else {}


def _readable_file(raw: str) -> bool:
    """Whether ``--config raw`` is a file to read here: a regular file or the shell's
    ``<(...)`` pipe. A folder, a named FIFO or a device is refused in one line (the parser would
    say "Path is not a file", or block on the FIFO until something writes to it); a missing
    path is left to the parser, which names it; an empty one is named empty (not the folder
    ``.`` that ``Path('')`` reads as)."""
    from nanolab.training.resolve import EMPTY_CONFIG, config_path_problem

    problem = config_path_problem(raw)
    if problem == EMPTY_CONFIG:
        raise RunConfigError(f"--config {problem}")
    if problem is not None and problem != "does not exist":
        raise RunConfigError(f"--config {raw} {problem}")
    return problem is None


#: The text of each ``<(...)`` pipe of this command line, read once (see :func:`read_config_text`).
_PIPED: dict[str, str] = {}


def read_config_text(raw: str) -> str:
    """A ``--config`` file's text. The shell's ``<(...)`` pipe holds its text for one read,
    and the parser reads it after the checks here: the text read is put back into a new pipe
    on the same descriptor (``/dev/fd/N`` still names it), so each reader sees the same text."""
    from nanolab.training.resolve import shell_pipe

    if not shell_pipe(raw):
        return Path(raw).read_text(encoding="utf-8")
    if raw not in _PIPED:
        import threading

        data = Path(raw).read_bytes()
        fd = int(raw.rsplit("/", 1)[1])
        read_end, write_end = os.pipe()
        os.dup2(read_end, fd)
        os.close(read_end)

        def refill() -> None:  # a thread: a pipe buffers 64 KiB, a config may be longer
            with os.fdopen(write_end, "wb") as out:
                out.write(data)

        threading.Thread(target=refill, daemon=True).start()
        _PIPED[raw] = data.decode("utf-8")
    return _PIPED[raw]


@functools.lru_cache(maxsize=32)
def _keys_in(text: str, path: str) -> tuple[str, ...]:
    """The dotted keys of a config file's ``text`` (remembered: ``queue add`` reads one file
    for every job of a sweep)."""
    from nanolab.training.resolve import load_yaml

    try:
        data = load_yaml(text, f"config file {path}")
    except RunConfigError:
        raise
    except Exception:  # not YAML: the parser names the problem its own way
        return ()
    return tuple(_flatten(data)) if isinstance(data, Mapping) else ()


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


def check_keys(argv: list[str], known: frozenset[str], skip_chosen: bool = True) -> None:
    """Refuse the first key of ``argv`` (and its ``--config`` files) that ``known`` lacks,
    naming where it is and the nearest known key, both as the user writes them (with
    ``init_args`` when the key has it). ``skip_chosen``: pass over the keys of a group whose
    class ``argv`` chooses (``known`` holds nanolab's classes' keys, not that class's); without
    it (``known`` holds the chosen classes' keys), pass over the keys given for the class
    chosen before (:func:`given_since_choice`)."""
    skip = chosen_classes(argv) if skip_chosen else set()
    for raw, where in given_keys(argv) if skip_chosen else given_since_choice(argv):
        key = _plain_key(raw)
        group = key.split(".", 1)[0]
        if group in skip or key.endswith(".help") or _known(key, known):
            continue
        near = suggestion(key, known)
        if near is not None and key != raw:  # written with init_args: suggest it that way
            near_group, _, rest = near.partition(".")
            near = f"{near_group}.init_args.{rest}" if near_group == group and rest else near
        dash = "--" if where.startswith("--") else ""
        hint = f"did you mean {dash}{near}?" if near else "`nanolab fit --help` lists them"
        place = "" if dash else f"{where}: "
        raise RunConfigError(f"{place}unknown setting {dash}{raw}; {hint}")


def undotted_hint(
    argv: list[str], known: frozenset[str], form: Callable[[str, str], str | None] | None = None
) -> str | None:
    """For an option without its group (``--max_steps 50``, which the parser only calls an
    unrecognized argument): every setting of that name (``--run.micro_batch_size or
    --data.micro_batch_size``), or None.

    An option the parser has, a top-level one (``--ckpt_path``) or a whole group (``--model
    mylab.models.X``, which chooses the class), is passed over: its name only looks like a
    setting's (``model`` is close to ``progress.mode``), and the unrecognized argument is
    another one.

    ``form(key, value)``: how the caller's user gives a setting where it is not fit's
    ``--key`` (``queue add``: ``--set data.seed=3``, and ``--seeds 3`` for the seed the queue
    sets itself), or None to leave a setting they cannot give out of the hint."""
    for arg in argv:
        name, _, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if not name or "." in name or _is_option(name, known):
            continue
        meant = settings_named(name, known)
        if form is None:
            given, hints = f"option --{name}", [f"--{k}" for k in meant]
        else:
            given = f"setting {form(name, value)}"
            hints = [h for h in (form(k, value) for k in meant) if h is not None]
        if hints:
            return f"unknown {given}; did you mean {either(hints)}? (settings take their group)"
    return None


#: Options of the run's parser besides its settings (LightningCLI's own).
PARSER_OPTIONS = ("config", "print_config", "help")


def unknown_option_line(argv: list[str], known: frozenset[str], verb: str) -> str | None:
    """For the first option of ``argv`` that is no option of ``nanolab VERB``'s parser and
    takes no group (``--ckpt_pth``, ``--bogus``: the parser only says "unrecognized
    arguments"): one line naming the nearest of its options (:func:`near_options`), else
    where they are listed and how settings are given. None: every option is the parser's (a
    stray value: the parser's own line names it). ``known``: the verb's settings."""
    options = {k.split(".", 1)[0] for k in known} | set(CLASS_GROUPS) | set(PARSER_OPTIONS)
    for arg in argv:
        name = arg[2:].partition("=")[0] if arg.startswith("--") else ""
        if not name or "." in name or name in options or _is_option(name, known):
            continue
        near = near_options(name, options)
        if near:
            return f"unknown option --{name}; did you mean {either(f'--{n}' for n in near)}?"
        return (
            f"unknown option --{name}; `nanolab {verb} --help` lists its options, and its "
            "settings take their group (--trainer.precision 32-true, --data.micro_batch_size 8)"
        )
    return None


def settings_named(name: str, known: frozenset[str]) -> list[str]:
    """The settings ``--name`` may mean: every one whose last part is ``name`` in any group
    (else whose last part is nearest it), then a top-level option that ``name`` begins
    (``--seed``: ``data.seed`` or ``seed_everything``), shortest first."""
    leaves = {k.rpartition(".")[2] for k in known if "." in k}
    near = [name] if name in leaves else difflib.get_close_matches(name, sorted(leaves), 1, 0.8)
    found = [k for k in known if "." in k and k.rpartition(".")[2] in near]
    found += [k for k in known if "." not in k and k.startswith(name)]
    return sorted(found, key=lambda k: (len(k), k))


def _is_option(name: str, known: frozenset[str]) -> bool:
    """``--name`` is an option of the parser itself: a top-level setting or a group."""
    return name in known or name in CLASS_GROUPS or any(k.startswith(name + ".") for k in known)


def _known(key: str, known: frozenset[str]) -> bool:
    """A setting, a group of settings, or inside a setting that takes free-form values."""
    if key in known:
        return True
    parts = key.split(".")
    if any(".".join(parts[:n]) in known for n in range(1, len(parts))):
        return True  # below a setting: a class's init_args, a dict value
    return any(k.startswith(key + ".") for k in known)


def config_file_paths(argv: list[str]) -> list[str]:
    """The ``--config`` files of ``argv``, in order (``--config X`` and ``--config=X``)."""
    paths = []
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            paths.append(argv[i + 1])
        elif arg.startswith("--config="):
            paths.append(arg.split("=", 1)[1])
    return paths


def read_config_files(argv: list[str], groups: Iterable[str]) -> list[dict[str, Any]]:
    """Every ``--config`` file of ``argv`` read first, so an empty or malformed one is named in
    the error (the parser itself reports them as "Unexpected config" or ``<unicode string>``):
    each file's settings, in order. ``groups``: the config groups a file may not set to null.
    A path that is not a file is left to the parser (it reports it, or takes it as YAML)."""
    import yaml

    found = []
    for raw in config_file_paths(argv):
        path = Path(raw)
        if not _readable_file(raw):
            continue
        try:
            text = read_config_text(raw)
        except (OSError, UnicodeDecodeError) as err:
            raise RunConfigError(f"config file {path}: cannot be read ({err})") from None
        try:
            data = copy.deepcopy(_settings_in(text, str(path)))
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise RunConfigError(
                f"config file {path}: YAML error{where}: {problem}; fix the file's syntax"
            ) from None
        if data is None:
            raise RunConfigError(
                f"config file {path} is empty; give it settings (e.g. `trainer: {{max_steps: "
                f"100}}`) or leave out --config {raw}"
            )
        if not isinstance(data, dict):
            raise RunConfigError(
                f"config file {path} must be a mapping of settings (e.g. `trainer: ...`), "
                f"got a {type(data).__name__}"
            )
        from nanolab.training.resolve import check_group_shapes  # a null group too

        check_group_shapes(data, groups, f"config file {path}")
        found.append(data)
    return found


@functools.lru_cache(maxsize=32)
def _settings_in(text: str, path: str) -> Any:
    """A config file's ``text`` read (an alias bomb refused first); remembered like
    :func:`_keys_in`. Callers copy the result before changing it."""
    from nanolab.training.resolve import load_yaml

    return load_yaml(text, f"config file {path}")


def preflight(verb: str, argv: list[str], prog: str | None = None) -> None:
    """Before Lightning is imported: every ``--config`` file read (an alias bomb refused) and,
    when the keys are remembered, an unknown key refused with its nearest known key; then a
    warning line for each flag a later ``--config`` file overrides
    (:func:`nanolab.training.resolve.overridden_flags`). ``prog``: the command the warnings
    name, where another verb reads ``verb``'s command line (``estimate`` reads fit's)."""
    from nanolab.messages import warn

    for _ in given_keys(argv):  # reads (and checks) every --config file
        pass
    known = known_keys(verb)
    if known is not None:
        check_keys(argv, known)
    from nanolab.training.resolve import config_path_problem, overridden_flags

    def keys_in(path: str) -> dict[str, Any]:  # a file the parser will name a problem of: none
        return _file_settings(path) if config_path_problem(path) is None else {}

    for line in overridden_flags(argv, keys_in):
        warn(prog or f"nanolab {verb}", line)
