"""In-context evaluation tasks read from local files: three kinds, three file layouts, suites.

A task is a JSON-lines file of examples of one *kind*:

* ``multiple_choice`` (HellaSwag, ARC, PIQA, OpenBookQA style): one context, several
  continuations, one of them right;
* ``schema`` (Winograd style): several contexts, one continuation, one context right;
* ``language_modeling`` (LAMBADA style): one context, one continuation the model must produce
  exactly (greedily).

Three layouts of a line are read (``format``; detected from the first line when not given):

* ``nanolab``: ``{"context": str, "choices": [str, ...], "label": int}`` (multiple choice),
  ``{"contexts": [str, ...], "continuation": str, "label": int}`` (schema),
  ``{"context": str, "continuation": str}`` (language modeling);
* ``dclm``: the DCLM / nanochat evaluation bundle's ``eval_data/*.jsonl``:
  ``{"query", "choices", "gold"}``, ``{"context_options", "continuation", "gold"}``,
  ``{"context", "continuation"}``;
* ``hellaswag``: HellaSwag's own ``hellaswag_{train,val}.jsonl`` (``activity_label``,
  ``ctx_a``, ``ctx_b``, ``endings``, ``label``), its context built as lm-evaluation-harness does.

A *suite* is a YAML list of tasks (``file``, ``kind``, ``shots``, ``baseline``, ...), or the
folder of a DCLM evaluation bundle (``core.yaml``, ``eval_meta_data.csv``, ``eval_data/``), which
is CORE. Nothing is ever downloaded. Every problem with a file is one line naming the file and
line number (:class:`TaskFileError`).
"""

from __future__ import annotations

import csv
import json
import random
import re
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from nanolab.errors import NanolabError
from nanolab.home import expand_user

Kind = Literal["multiple_choice", "schema", "language_modeling"]
KINDS: tuple[str, ...] = ("multiple_choice", "schema", "language_modeling")
FORMATS: tuple[str, ...] = ("nanolab", "dclm", "hellaswag")
#: What a multiple-choice task's ``centered`` score uses: ``acc`` (summed log-likelihood),
#: ``acc_norm`` (per character of the continuation, lm-evaluation-harness's normalization),
#: ``acc_token`` (mean per token, the DCLM/nanochat CORE rule) or ``acc_pmi`` (log-likelihood
#: gained from the context: with the context minus without it, lm-evaluation-harness's
#: ``acc_mutual_info``; one more short pass per option).
METRICS: tuple[str, ...] = ("acc", "acc_norm", "acc_token", "acc_pmi")
#: Where ``builtin:<name>`` suites (``<name>.yaml``) and their task files ship with nanolab.
BUILTIN_DIR = Path(__file__).parent / "data"
#: CORE's order of examples: shuffled once with this seed (before ``limit`` and few-shot draws).
SHUFFLE_SEED = 1337


class TaskFileError(NanolabError):
    """A task or suite file that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Example:
    """One example, kind-independent: contexts × continuations, and the right index.

    Multiple choice has one context and several continuations; schema several contexts and
    one continuation; language modeling one of each (``label`` 0).
    """

    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    label: int
    line: int  # 1-based line of the task file, for messages

    @property
    def options(self) -> int:
        return max(len(self.contexts), len(self.continuations))

    def right(self) -> tuple[str, str]:
        """The right (context, continuation) pair: what a few-shot prompt shows."""
        if len(self.contexts) > 1:
            return self.contexts[self.label], self.continuations[0]
        return self.contexts[0], self.continuations[self.label]


@dataclass
class Task:
    """A task file read and checked, with how it is prompted and scored."""

    name: str
    kind: Kind
    examples: list[Example]
    path: Path
    shots: int = 0
    baseline: float | None = None  # random-guess accuracy as a fraction; None = 1/options
    delimiter: str = " "  # between a context and its continuation (belongs to the continuation)
    metric: str = "acc_norm"

    def random_baseline(self) -> float:
        if self.baseline is not None:
            return self.baseline
        if self.kind == "language_modeling":
            return 0.0
        return sum(1.0 / e.options for e in self.examples) / max(1, len(self.examples))


@dataclass
class Suite:
    """Tasks evaluated together; ``core`` is their mean centered accuracy."""

    name: str
    tasks: list[Task] = field(default_factory=list)


def mean_label(suite: str | None) -> str:
    """What a suite's mean centered accuracy is called where it is shown: ``CORE`` only for the
    CORE suite (a DCLM bundle; one Shakespeare cloze is not CORE), otherwise ``<suite>
    centered``. Not "mean": beside a task's accuracy of 0.280, "mean +0.040" reads as a
    contradiction; the centered value is (accuracy - chance) / (1 - chance), 0 at chance."""
    if not suite:
        return "centered"
    return "CORE" if suite == "core" else f"{suite} centered"


def suite_name_of(record: dict[str, Any]) -> str | None:
    """The suite a ``tasks`` record scored: its ``suite_name``, or, in logs written before it
    was recorded, the name :func:`nanolab.downstream.tasks.load_suite` gives its ``suite``
    (``builtin:<name>``, a YAML file's stem, ``core`` for a DCLM bundle folder)."""
    name = record.get("suite_name")
    if isinstance(name, str) and name:
        return name
    spec = record.get("suite")
    if not isinstance(spec, str) or not spec:
        return None
    if spec.startswith("builtin:"):
        return spec.removeprefix("builtin:")
    path = Path(spec)
    return path.stem if path.suffix in (".yaml", ".yml") else "core"


# -- one line of a task file ----------------------------------------------------------------
def _fail(path: Path, line: int, problem: str) -> TaskFileError:
    return TaskFileError(f"task file {path} line {line}: {problem}")


def _text(row: dict[str, Any], key: str, path: Path, line: int) -> str:
    value = row.get(key)
    if not isinstance(value, str):
        what = "missing" if key not in row else f"a {type(value).__name__}, not a string"
        raise _fail(path, line, f"field {key!r} is {what}")
    return value


def _texts(row: dict[str, Any], key: str, path: Path, line: int, least: int = 2) -> list[str]:
    value = row.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        what = "missing" if key not in row else "not a list of strings"
        raise _fail(path, line, f"field {key!r} is {what}")
    if len(value) < least:
        raise _fail(path, line, f"field {key!r} has {len(value)} entries; it needs {least} or more")
    empty = [i for i, v in enumerate(value) if not v.strip()] if key == "choices" else []
    if empty:  # scored as the bare delimiter: cheap for any model, an accuracy for nothing
        raise _fail(path, line, f"field {key!r} entry {empty[0]} is empty; every option needs text")
    return value


def _label(row: dict[str, Any], key: str, options: int, path: Path, line: int) -> int:
    value = row.get(key)
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        value = int(value)  # HellaSwag's files hold the label as an int; some copies as "3"
    if not isinstance(value, int) or isinstance(value, bool):
        what = "missing" if key not in row else f"{value!r}, not an integer"
        raise _fail(path, line, f"field {key!r} is {what}")
    if not 0 <= value < options:
        raise _fail(path, line, f"field {key!r} is {value}, out of range for {options} options")
    return value


def hellaswag_text(text: str) -> str:
    """HellaSwag's WikiHow markup removed as lm-evaluation-harness does (`` [title]``, ``[...]``)."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def parse_example(row: dict[str, Any], kind: str, fmt: str, path: Path, line: int) -> Example:
    """One line of a task file as an :class:`Example`; a :class:`TaskFileError` naming the
    field when it does not fit ``kind`` in layout ``fmt``."""
    if fmt == "hellaswag":
        if kind != "multiple_choice":
            raise _fail(path, line, "the hellaswag layout is multiple choice; set kind accordingly")
        endings = _texts(row, "endings", path, line)
        context = hellaswag_text(
            f"{_text(row, 'activity_label', path, line)}: {_text(row, 'ctx_a', path, line)} "
            f"{_text(row, 'ctx_b', path, line).capitalize()}"
        )
        label = _label(row, "label", len(endings), path, line)
        return Example((context,), tuple(hellaswag_text(e) for e in endings), label, line)
    dclm = fmt == "dclm"
    if kind == "multiple_choice":
        choices = _texts(row, "choices", path, line)
        context = _text(row, "query" if dclm else "context", path, line)
        label = _label(row, "gold" if dclm else "label", len(choices), path, line)
        return Example((context,), tuple(choices), label, line)
    if kind == "schema":
        contexts = _texts(row, "context_options" if dclm else "contexts", path, line)
        label = _label(row, "gold" if dclm else "label", len(contexts), path, line)
        return Example(tuple(contexts), (_text(row, "continuation", path, line),), label, line)
    context = _text(row, "context", path, line)
    continuation = _text(row, "continuation", path, line)
    if not continuation.strip():
        raise _fail(
            path, line, "field 'continuation' is empty; a language-modeling target needs text"
        )
    return Example((context,), (continuation,), 0, line)


def detect_format(row: dict[str, Any]) -> str:
    """The layout a line is in, from its keys."""
    if "endings" in row and "ctx_a" in row:
        return "hellaswag"
    if "query" in row or "context_options" in row or "gold" in row:
        return "dclm"
    return "nanolab"


def refuse_non_file(path: Path, what: str, fix: str) -> None:
    """Refuse ``path`` when it exists but is not a regular file: reading a FIFO waits for a
    writer forever, a device never ends. A missing file is left to the read, which says so."""
    from nanolab.data.sources import not_a_file

    if path.exists() and not path.is_file():
        raise TaskFileError(f"{what} {path} is {not_a_file(path)}, not a file; {fix}")


def _check_kind_and_format(path: Path, kind: str, fmt: str | None) -> None:
    if kind not in KINDS:
        raise TaskFileError(
            f"task file {path}: kind {kind!r} (as its suite gives it) is not one of "
            f"{', '.join(KINDS)}"
        )
    if fmt is not None and fmt not in FORMATS:
        raise TaskFileError(f"task file {path}: format {fmt!r} is not one of {', '.join(FORMATS)}")
    refuse_non_file(path, "task file", "give a JSON-lines file")


def _open_task_file(path: Path, mode: str) -> IO[Any]:
    try:
        return path.open(mode, encoding=None if "b" in mode else "utf-8")
    except OSError as err:
        raise TaskFileError(
            f"task file {path} cannot be read ({err.strerror or err}); give an existing "
            "JSON-lines file"
        ) from None


def _row(raw: str, path: Path, number: int) -> dict[str, Any]:
    """One non-blank line of a task file as a JSON object, or the line's error."""
    try:
        row = json.loads(raw)
    except json.JSONDecodeError as err:
        raise _fail(path, number, f"not JSON ({err.msg} at column {err.colno})") from None
    except RecursionError:
        raise _fail(path, number, "JSON nested too deeply to read") from None
    if not isinstance(row, dict):
        raise _fail(path, number, f"a JSON {type(row).__name__}, not an object")
    return row


def read_task_file(path: Path, kind: str, fmt: str | None = None) -> tuple[list[Example], str]:
    """Every example of a JSON-lines task file (blank lines skipped), and its layout."""
    _check_kind_and_format(path, kind, fmt)
    examples: list[Example] = []
    with _open_task_file(path, "r") as handle:
        try:
            for number, raw in enumerate(handle, start=1):
                if not raw.strip():
                    continue
                row = _row(raw, path, number)
                fmt = fmt or detect_format(row)
                examples.append(parse_example(row, kind, fmt, path, number))
        except UnicodeDecodeError:
            raise TaskFileError(f"task file {path} is not UTF-8 text") from None
    if not examples:
        raise TaskFileError(f"task file {path} is empty; it needs one JSON object per line")
    return examples, fmt or "nanolab"


def core_order(count: int) -> list[int]:
    """CORE's order of ``count`` examples (the DCLM/nanochat rule): positions shuffled once with
    :data:`SHUFFLE_SEED`. The permutation depends on ``count`` alone, so it can be drawn before
    any example is parsed."""
    order = list(range(count))
    random.Random(SHUFFLE_SEED).shuffle(order)
    return order


def _blank(raw: bytes) -> bool:
    """Whether a line is blank as text-mode reading sees it (``str.strip`` empty)."""
    stripped = raw.strip()
    if not stripped:
        return True
    if stripped[0] < 0x80 and not 0x1C <= stripped[0] <= 0x1F:
        return False  # an ASCII character that is not whitespace: the common case, undecoded
    try:
        return not stripped.decode("utf-8").strip()
    except UnicodeDecodeError:
        return False  # not blank; an error if it is ever read


def _line_starts(handle: IO[bytes]) -> tuple[array[int], array[int]]:
    """Where each non-blank line of a task file starts (byte offset) and its number, counted
    as text-mode reading counts them (universal newlines: ``\\n``, ``\\r\\n`` or a lone
    ``\\r`` ends a line), from one pass that keeps no line: 16 bytes a line."""
    offsets, numbers = array("q"), array("q")
    offset = number = 0
    for raw in handle:
        pieces = [raw] if b"\r" not in raw else raw.split(b"\r")
        if len(pieces) > 1 and pieces[-1] in (b"", b"\n"):
            pieces.pop()  # the line's own \r\n (or a final \r): no line after it
        start = offset
        for piece in pieces:
            number += 1
            if not _blank(piece):
                offsets.append(start)
                numbers.append(number)
            start += len(piece) + 1
        offset += len(raw)
    return offsets, numbers


def _line_at(handle: IO[bytes], offset: int, path: Path) -> str:
    """The text-mode line that starts at ``offset``: up to its first line break, ending in
    ``\\n`` as universal newlines translate it."""
    handle.seek(offset)
    raw = handle.readline()
    cut = raw.find(b"\r")
    if cut >= 0:
        raw = raw[:cut] + b"\n"
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TaskFileError(f"task file {path} is not UTF-8 text") from None


def read_task_examples(
    path: Path, kind: str, fmt: str | None = None, limit: int | None = None
) -> tuple[list[Example], str]:
    """A task file's examples in CORE's order (:func:`core_order`), the first ``limit`` of
    them when given, and its layout.

    With a limit only the chosen lines (and the first, for the layout when ``fmt`` is not
    given) are read and parsed, after one pass that notes where each line starts: 50 examples
    of a file of 500k lines take what 50 take, not what 500k do. A line the limit leaves out is
    never read, so a malformed one there is not reported.
    """
    if limit is None:
        examples, fmt = read_task_file(path, kind, fmt)
        return [examples[i] for i in core_order(len(examples))], fmt
    _check_kind_and_format(path, kind, fmt)
    with _open_task_file(path, "rb") as handle:
        offsets, numbers = _line_starts(handle)
        if not offsets:
            raise TaskFileError(f"task file {path} is empty; it needs one JSON object per line")
        if fmt is None:  # from the first row, as a full read detects it
            fmt = detect_format(_row(_line_at(handle, offsets[0], path), path, numbers[0]))
        chosen = core_order(len(offsets))[:limit]
        parsed: dict[int, Example] = {}
        for i in sorted(chosen):  # in file order: the first bad line is the one a full read names
            row = _row(_line_at(handle, offsets[i], path), path, numbers[i])
            parsed[i] = parse_example(row, kind, fmt, path, numbers[i])
    return [parsed[i] for i in chosen], fmt


# -- suites ----------------------------------------------------------------------------------
def task_path(file: str, base: Path) -> Path:
    """A task file's path: absolute, or relative to the suite file's folder."""
    path = expand_user(file)
    return path if path.is_absolute() else base / path


def make_task(entry: dict[str, Any], base: Path, where: str) -> Task:
    """A suite entry (``file``, ``kind``, and optionally ``name``, ``format``, ``shots``,
    ``baseline``, ``delimiter``, ``metric``, ``limit``) read into a :class:`Task`."""
    known = {"name", "file", "kind", "format", "shots", "baseline", "delimiter", "metric", "limit"}
    unknown = sorted(set(entry) - known)
    if unknown:
        raise TaskFileError(
            f"{where}: unknown key {unknown[0]!r}; the keys are {', '.join(sorted(known))}"
        )
    if not isinstance(entry.get("file"), str) or not isinstance(entry.get("kind"), str):
        raise TaskFileError(f"{where}: give file (a JSON-lines path) and kind ({', '.join(KINDS)})")
    shots, limit, baseline = entry.get("shots", 0), entry.get("limit"), entry.get("baseline")
    if not isinstance(shots, int) or isinstance(shots, bool) or shots < 0:
        raise TaskFileError(f"{where}: shots must be an integer >= 0, got {shots!r}")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise TaskFileError(f"{where}: limit must be an integer >= 1 or null, got {limit!r}")
    if baseline is not None and (
        isinstance(baseline, bool)
        or not isinstance(baseline, (int, float))
        or not 0 <= baseline < 1
    ):
        raise TaskFileError(f"{where}: baseline must be a fraction in [0, 1), got {baseline!r}")
    metric = entry.get("metric")
    if metric is not None and metric not in METRICS:
        raise TaskFileError(f"{where}: metric must be one of {', '.join(METRICS)}, got {metric!r}")
    delimiter = entry.get("delimiter", " ")
    if not isinstance(delimiter, str):
        raise TaskFileError(
            f'{where}: delimiter must be a string ("" for none, " " by default), got {delimiter!r}'
        )
    path = task_path(entry["file"], base)
    name = str(entry.get("name") or path.stem)
    if "/" in name or not name.strip():
        raise TaskFileError(f"{where}: task name {name!r} must be non-empty and without '/'")
    # CORE's order, then the first `limit`; few-shot examples are drawn from what is left.
    examples, fmt = read_task_examples(path, entry["kind"], entry.get("format"), limit)
    if shots and len(examples) <= shots:
        cut = (
            f" (limit {limit} leaves {len(examples)}; give a limit above {shots})" if limit else ""
        )
        raise TaskFileError(
            f"{where}: {shots} shots need more than {shots} examples; {path} has "
            f"{len(examples)}{cut}"
        )
    return Task(
        name=name,
        kind=entry["kind"],
        examples=examples,
        path=path,
        shots=shots,
        baseline=None if baseline is None else float(baseline),
        delimiter=delimiter,
        metric=metric or ("acc_token" if fmt == "dclm" else "acc_norm"),
    )


def load_suite(spec: str | Path, limit: int | None = None) -> Suite:
    """A suite from a YAML list of tasks, a DCLM bundle folder, or ``builtin:<name>``.

    ``limit`` caps every task's examples (the first ``limit`` after CORE's shuffle).
    """
    text = str(spec)
    if not text:  # Path("") is the current folder: read as a bundle folder that is not one
        raise TaskFileError(
            "the suite is empty (''); give a YAML list of tasks, a DCLM bundle folder or "
            "builtin:<task>"
        )
    if text.startswith("builtin:"):  # a suite shipped with nanolab: data/<name>.yaml
        name = text.removeprefix("builtin:")
        path = BUILTIN_DIR / f"{name}.yaml"
        if not path.is_file():
            names = sorted(p.stem for p in BUILTIN_DIR.glob("*.yaml"))
            raise TaskFileError(f"{text}: no such built-in suite; built in: {', '.join(names)}")
        text = str(path)
    path = expand_user(text)
    if path.is_dir():
        return load_dclm_bundle(path, limit)
    import yaml

    refuse_non_file(
        path, "suite", "give a YAML list of tasks, a DCLM bundle folder or builtin:<task>"
    )
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise TaskFileError(
            f"suite {path} cannot be read ({err.strerror or err}); give a YAML list of tasks, "
            "a DCLM bundle folder or builtin:<task>"
        ) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise TaskFileError(f"suite {path}{where}: not valid YAML") from None
    if isinstance(data, dict) and isinstance(data.get("tasks"), list):
        data = data["tasks"]
    if not isinstance(data, list) or not data:
        raise TaskFileError(f"suite {path}: give a YAML list of tasks (file, kind, shots, ...)")
    return _suite(path.stem, data, path.parent, str(path), limit)


def _suite(name: str, entries: list[Any], base: Path, where: str, limit: int | None) -> Suite:
    tasks = []
    for i, entry in enumerate(entries, start=1):
        if not isinstance(entry, dict):
            raise TaskFileError(f"suite {where} task {i}: a mapping (file, kind, ...) is needed")
        if limit is not None:
            entry = {**entry, "limit": min(limit, entry.get("limit") or limit)}
        tasks.append(make_task(entry, base, f"suite {where} task {i}"))
    names = [t.name for t in tasks]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise TaskFileError(f"suite {where}: two tasks are named {dup!r}; give each its own name")
    return Suite(name, tasks)


def load_dclm_bundle(folder: Path, limit: int | None = None) -> Suite:
    """The DCLM / nanochat evaluation bundle (``core.yaml``, ``eval_meta_data.csv``,
    ``eval_data/``) as the CORE suite: each task's shots, delimiter and random baseline."""
    import yaml

    config, meta = folder / "core.yaml", folder / "eval_meta_data.csv"
    for needed in (config, meta, folder / "eval_data"):
        if not needed.exists():
            raise TaskFileError(
                f"{folder} is not a DCLM evaluation bundle: {needed.name} is missing (it holds "
                "core.yaml, eval_meta_data.csv and eval_data/)"
            )
    for needed in (config, meta):
        refuse_non_file(needed, "DCLM bundle file", "the bundle holds it as a regular file")
    try:
        tasks = (yaml.safe_load(config.read_text(encoding="utf-8")) or {}).get("icl_tasks")
        with meta.open(encoding="utf-8", newline="") as handle:
            baselines = {
                row["Eval Task"]: float(row["Random baseline"]) for row in csv.DictReader(handle)
            }
    except (yaml.YAMLError, KeyError, ValueError, AttributeError) as err:
        raise TaskFileError(
            f"{folder}: core.yaml or eval_meta_data.csv is not readable ({err})"
        ) from None
    if not isinstance(tasks, list) or not tasks:
        raise TaskFileError(f"{config}: icl_tasks is missing or empty")
    entries = []
    for i, task in enumerate(tasks, start=1):
        if not isinstance(task, dict):
            raise TaskFileError(f"{config} task {i}: a mapping (label, dataset_uri, ...) is needed")
        label = str(task.get("label", ""))
        if label not in baselines:
            raise TaskFileError(f"{config} task {i} ({label}): no random baseline in {meta.name}")
        shots = task.get("num_fewshot", [0])
        shots = shots[0] if isinstance(shots, list) and shots else shots
        if not isinstance(shots, int) or isinstance(shots, bool) or shots < 0:
            raise TaskFileError(
                f"{config} task {i} ({label}): num_fewshot must be [N] with N >= 0, got "
                f"{task.get('num_fewshot')!r}"
            )
        if not isinstance(task.get("dataset_uri"), str):
            raise TaskFileError(
                f"{config} task {i} ({label}): dataset_uri (a file under eval_data/) is missing"
            )
        kind = {"multiple_choice": "multiple_choice", "schema": "schema"}.get(
            str(task.get("icl_task_type")), "language_modeling"
        )
        entries.append(
            {
                "name": label,
                "file": f"eval_data/{task.get('dataset_uri')}",  # relative to the bundle
                "kind": kind,
                "format": "dclm",
                "shots": shots,
                "baseline": baselines[label] / 100.0,
                "delimiter": task.get("continuation_delimiter", " "),
            }
        )
    return _suite("core", entries, folder, str(config), limit)
