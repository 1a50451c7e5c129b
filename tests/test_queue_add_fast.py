"""``queue add`` reads each job's config without Lightning: the fit parser's remembered schema
(:mod:`nanolab.run.schema`) gives what the parser would, and whatever it cannot say goes to the
parser, so every refusal is the one it was.

Three things are held here: the schema's reading equals the parser's for every shipped config,
overlay and a list of overrides chosen for the parser's quirks (or the schema asks the parser);
a sweep queued from a warm cache imports neither Lightning nor torch, and a cold cache is filled
by the first job so the rest are read without the parser; and each refusal of ``queue add`` is
the same one line, exit 2, whether the schema or the parser words it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, tiny_overrides, write_config

from nanolab.queue.cli import main
from nanolab.queue.db import QueueDB
from nanolab.run import keys, parse, schema
from nanolab.training.resolve import plain_config

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
OVERLAYS = sorted(p for group in ("strategy", "precision", "debug") for p in (REPO / "configs" / group).glob("*.yaml"))  # fmt: skip
QUICK = str(REPO / "configs" / "quickstart.yaml")

#: Overrides as ``queue add`` passes them (``--key=value``), picked for what the parser does
#: to a value: ``"2"`` kept as text for ``trainer.devices`` on the command line, ``1`` -> ``1.0``
#: for a float, ``123`` kept as text for a name, YAML's ``yes``, a Literal of ints and strings,
#: tuples, lists, dicts of anything, unions with Lightning classes in them.
OVERRIDES = [
    ["--model.gpt.n_layer=3", "--model.gpt.n_head=2", "--model.gpt.n_embd=64"],
    ["--model.optimizer.lr=1e-3"], ["--model.optimizer.lr=1"], ["--model.gpt.dropout=0"],
    ["--model.optimizer.betas=[0.9, 0.95]"], ["--model.optimizer.name=muon"],
    ["--model.gpt.bias=yes"], ["--model.gpt.position_embedding=rope"],
    ["--trainer.devices=2"], ["--trainer.devices=[0, 1]"], ["--trainer.devices=auto"],
    ["--trainer.devices=[a]"],
    ["--trainer.precision=32"], ["--trainer.precision=bf16-mixed"], ["--trainer.precision=16"],
    ["--trainer.max_steps=40"], ["--trainer.gradient_clip_val=1"],
    ["--trainer.accelerator=gpu", "--trainer.strategy=ddp"], ["--trainer.num_nodes=2"],
    ["--trainer.strategy=DDPStrategy"], ["--trainer.profiler=simple"],
    ["--trainer.max_time=00:01:00:00"], ["--trainer.val_check_interval=0.5"],
    ["--trainer.logger=false"], ["--trainer.callbacks=null"], ["--trainer.deterministic=warn"],
    ["--run.name=123"], ["--run.fresh=true"], ["--run.micro_batch_size=auto"],
    ["--run.micro_batch_size=4"], ["--run.global_batch_tokens=8192"],
    ["--data.source=[a.txt, b.txt]"], ["--data.datasets=[{path: a, weight: 2}]"],
    ["--data.micro_batch_size=8"], ["--seed_everything=7"], ["--seed_everything=true"],
    ["--downstream.suite=null"], ["--logger=csv"], ["--preemption.signals=[SIGTERM]"],
    ["--model.gpt.vocab_size=null"], ["--trainer.callbacks+=lightning.pytorch.callbacks.LearningRateMonitor"],
]  # fmt: skip

#: Values the parser refuses: the schema must never take one.
REFUSED = [
    ["--trainer.max_steps=two"], ["--trainer.max_steps=3.0"], ["--trainer.max_steps=true"],
    ["--model.gpt.n_layer=two"], ["--model.gpt.bias=1"], ["--model.optimizer.lr=abc"],
    ["--trainer.precision=foo"], ["--run.float32_matmul_precision=low"],
    ["--model.optimizer.betas=[1, 2, 3]"], ["--log.fresh=true"],
    ["--progress.mode=fancy"], ["--data.source=3"], ["--model.gpt.attention=flash"],
]  # fmt: skip


@pytest.fixture(scope="module")
def remembered() -> tuple[schema.Schema, frozenset[str]]:
    """The schema and keys as a first parse of this code remembers them."""
    parse.verb_keys("fit")
    found, known = schema.load("fit"), keys.known_keys("fit")
    assert found is not None and known is not None
    return found, known


def outcomes(args: list[str], remembered) -> tuple[Any, Any]:
    """(the schema's reading, the parser's): a config, ``"ask"``, or ``"refused: <line>"``."""
    found, known = remembered
    try:
        fast: Any = found.read(args, known)
    except schema.AskTheParser:
        fast = "ask"
    except schema.FitParseError as err:
        fast = f"refused: {err}"
    try:
        real: Any = plain_config(parse.parse_fit_config(args))
        real["config"] = keys.config_file_paths(args)
    except schema.FitParseError as err:
        real = f"refused: {err}"
    return fast, real


def same(fast: Any, real: Any, args: list[str]) -> None:
    if fast != "ask":
        assert fast == real, (
            f"{' '.join(args)}:\n  schema: {str(fast)[:400]}\n  parser: {str(real)[:400]}"
        )
        if isinstance(fast, dict):  # the types too: 1.0 is not 1, ("a",) is not ["a"]
            assert json.dumps(fast, sort_keys=True) == json.dumps(real, sort_keys=True)


# -- the schema reads as the parser does ---------------------------------------------------------
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_is_read_without_the_parser(config: Path, remembered) -> None:
    fast, real = outcomes(["--config", str(config)], remembered)
    assert isinstance(fast, dict), fast  # plain settings only: no reason to ask
    same(fast, real, ["--config", str(config)])


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_overlay_on_the_quickstart(overlay: Path, remembered) -> None:
    args = ["--config", QUICK, "--config", str(overlay)]
    same(*outcomes(args, remembered), args)


@pytest.mark.parametrize("override", OVERRIDES, ids=lambda o: " ".join(o)[:40])
def test_each_override(override: list[str], remembered) -> None:
    args = ["--config", QUICK, *override, "--run.name=x"]
    same(*outcomes(args, remembered), args)


def test_plain_settings_are_not_asked_of_the_parser(remembered) -> None:
    """What a sweep sets is read by the schema itself; a class of one's own, a Lightning class
    tried first for a value, an append, a link's target, ``ckpt_path`` go to the parser."""
    found, known = remembered
    plain = [o for o in OVERRIDES if not any(k in " ".join(o) for k in ("logger=", "profiler=", "+="))]  # fmt: skip
    for override in plain:
        found.read(["--config", QUICK, *override], known)  # no AskTheParser
    for override in (["--trainer.logger=false"], ["--trainer.profiler=simple"],
                     ["--trainer.callbacks+=a.B"], ["--model=my.Model"], ["--log.fresh=true"],
                     ["--ckpt_path=x.ckpt"], ["--model.gpt.vocab_siz=null"]):  # fmt: skip
        with pytest.raises(schema.AskTheParser):
            found.read(["--config", QUICK, *override], known)


@pytest.mark.parametrize("override", REFUSED, ids=lambda o: " ".join(o)[:40])
def test_a_value_the_parser_refuses_is_never_taken(override: list[str], remembered) -> None:
    fast, real = outcomes(["--config", QUICK, *override], remembered)
    assert isinstance(real, str) and real.startswith("refused: "), real
    assert fast == "ask" or fast == real, fast


def test_the_schema_holds_every_key_the_parser_knows(remembered) -> None:
    found, known = remembered
    free = {"config", "model.class_path", "data.class_path"}  # not settings of a value
    free |= {target for _, target in found.links}  # set through its link's source
    assert known - free <= set(found.settings), sorted(known - free - set(found.settings))
    assert found.links == [("run.fresh", "log.fresh")]
    assert found.groups == parse.config_groups()


# -- queue add: no Lightning, a cold cache filled once -------------------------------------------
ADD = """
import sys, time
from nanolab.cli import main
start = time.perf_counter()
code = main(sys.argv[1:])
print("RESULT", code, time.perf_counter() - start, "lightning" in sys.modules, "torch" in sys.modules)
"""


def test_a_sweep_is_queued_without_importing_lightning_or_torch(
    tmp_path: Path, char_dataset
) -> None:
    cfg = tiny_overrides(char_dataset, tmp_path / "runs", trainer__max_steps=8)
    del cfg["run"]["name"]
    cfg["trainer"]["accelerator"] = "cpu"
    config = write_config(tmp_path / "base.yaml", cfg)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NANOLAB_ESTIMATOR_CACHE": str(tmp_path / "cache")}
    results = []
    for n in range(3):  # the first launch fills the cache: the parser's schema and the CPU's
        # rates; the second the model's facts (the first imported the model with the parser)
        argv = ["queue", "add", str(config), "--db", str(tmp_path / f"q{n}.db"), "--seeds", "1,2,3",
                "--sweep", "model.optimizer.lr=1e-3,3e-3", "--sweep", "model.gpt.n_layer=1,2"]  # fmt: skip
        out = subprocess.run([sys.executable, "-c", ADD, *argv], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert out.returncode == 0, out.stderr
        results.append(out.stdout.splitlines()[-1].split())
        assert len(QueueDB(tmp_path / f"q{n}.db").jobs()) == 12
    assert results[0][-2] == "True"  # the cold launch asked the parser
    assert results[1][-2] == "False"  # no Lightning from the second launch on
    _, code, seconds, lightning, torch = results[2]
    assert (code, lightning, torch) == ("0", "False", "False"), results[2]
    assert float(seconds) < 10.0  # ~0.5 s on a quiet 2-core machine; generous for a busy one
    first, second = (QueueDB(tmp_path / f"q{n}.db").jobs() for n in (0, 2))
    for a, b in zip(first, second, strict=True):  # the same jobs either way
        assert (a.name, a.args, a.config_key, a.max_steps, a.mem_peak, a.estimate_s) == (b.name, b.args, b.config_key, b.max_steps, b.mem_peak, b.estimate_s)  # fmt: skip
    # The quickstart sets checkpoint and downstream settings: their rules are checked without
    # building the callbacks (which imported Lightning: 6-7 s CPU a launch)
    argv = ["queue", "add", QUICK, "--db", str(tmp_path / "quick.db"), "--set", "trainer.max_steps=40",
            "--sweep", "model.optimizer.lr=1e-3,3e-3", "--sweep", "model.gpt.n_layer=2,4"]  # fmt: skip
    out = subprocess.run([sys.executable, "-c", ADD, *argv], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1].split()[-2] == "False", out.stdout  # no Lightning
    assert len(QueueDB(tmp_path / "quick.db").jobs()) == 4
    # Budget, spike and notify settings too: their rules live below the callbacks as well
    argv = ["queue", "add", QUICK, "--db", str(tmp_path / "groups.db"), "--set", "trainer.max_steps=40",
            "--budget.max_tokens", "100000", "--set", "budget.patience=3", "--spike.factor", "3",
            "--set", 'notify.targets=["echo {run} {reason}"]']  # fmt: skip
    out = subprocess.run([sys.executable, "-c", ADD, *argv], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1].split()[-2] == "False", out.stdout  # no Lightning
    assert len(QueueDB(tmp_path / "groups.db").jobs()) == 1


def _spy_on_the_parser(monkeypatch) -> list:
    """The argument lists fit's full parser is called with from here on (it still parses)."""
    calls: list = []
    real = parse.parse_fit_config
    monkeypatch.setattr(parse, "parse_fit_config", lambda args: calls.append(args) or real(args))
    return calls


def _tiny_config(path: Path, dataset: Path, runs: Path) -> Path:
    """A tiny fit config of 8 steps without a run name (a queued job is named by the queue)."""
    cfg = tiny_overrides(dataset, runs, trainer__max_steps=8)
    del cfg["run"]["name"]
    return write_config(path, cfg)


def test_a_cold_cache_asks_the_parser_once_and_remembers(
    tmp_path, char_dataset, capsys, monkeypatch
):
    monkeypatch.setenv("NANOLAB_ESTIMATOR_CACHE", str(tmp_path / "cold"))
    monkeypatch.chdir(tmp_path)
    calls = _spy_on_the_parser(monkeypatch)
    config = _tiny_config(tmp_path / "base.yaml", char_dataset, tmp_path / "runs")
    sweep = ["--sweep", "model.optimizer.lr=1e-3,3e-3", "--sweep", "model.gpt.n_layer=1,2"]
    assert main(["add", str(config), "--db", str(tmp_path / "a.db"), *sweep]) == 0
    assert len(calls) == 1  # the first point; its parse remembered the schema for the others
    assert main(["add", str(config), "--db", str(tmp_path / "b.db"), *sweep]) == 0
    assert len(calls) == 1
    first, second = QueueDB(tmp_path / "a.db").jobs(), QueueDB(tmp_path / "b.db").jobs()
    assert [j.config_key for j in first] == [j.config_key for j in second]
    capsys.readouterr()


# -- every refusal, one line, exit 2 -------------------------------------------------------------
def _files(tmp_path: Path) -> dict[str, Path]:
    files = {"empty": "", "null-group": "checkpoint: null\n", "yaml": "trainer: {max_steps: [\n",
             "typo": "model:\n  gpt:\n    n_layers: 3\n", "list": "- 1\n"}  # fmt: skip
    out = {}
    for name, text in files.items():
        out[name] = tmp_path / f"{name}.yaml"
        out[name].write_text(text)
    return out


REFUSALS = [  # (extra argv, message, worded by the parser)
    # a --set key fit does not know is the command line's: no config file is blamed
    (["--set", "trainer.max_stepz=3"], "error: unknown setting --trainer.max_stepz; did you mean --trainer.max_steps?", False),
    (["--set", "bogus=8"], "error: unknown setting --set bogus=8; fit has no setting bogus (its settings take their group, e.g. --set trainer.max_steps=600; `nanolab fit --help` lists them)", True),
    (["--set", "bogus=8", "--set", "lr=3"], "error: unknown setting --set bogus=8; fit has no setting bogus", True),
    (["--model.gpt.n_layers", "3"], "unknown setting --model.gpt.n_layers; did you mean --model.gpt.n_layer?", False),
    (["{typo}"], "typo.yaml: unknown setting model.gpt.n_layers; did you mean model.gpt.n_layer?", False),
    (["{empty}"], "empty.yaml is empty; give it settings", False),
    (["{null-group}"], "`checkpoint: null` gives the checkpoint group no settings", False),
    (["{yaml}"], "yaml.yaml: YAML error", False),
    (["{list}"], "list.yaml must be a mapping of settings", False),
    (["--set", "model.gpt.n_head=3"], "model.gpt.n_embd (32) must be divisible by model.gpt.n_head (3)", False),
    (["--set", "run.global_batch_tokens=100"], "run.global_batch_tokens (100) must be a positive multiple", False),
    (["--set", "trainer.max_steps=-1"], "trainer.max_steps is -1 and no budget.max_tokens, max_wall_hours, max_gpu_hours or max_cost bounds the run; a queued job needs an end", False),
    (["--set", "data.source=[nowhere.txt]"], "data.source: nowhere.txt does not exist", False),
    (["--set", "data.dataset_dir=missing", "--set", "data.source=null"], "holds no prepared dataset", False),
    (["--set", "data.dataset_dir=missing", "--set", "data.sourc=null"], "'sourc' is not a setting of the class it is given to", True),
    (["--set", "data.dataset_dir="], "data.dataset_dir is empty", False),
    (["--set", "model.optimizer.lr=.nan"], "model.optimizer.lr", False),
    (["--set", "data.val_windows=-5"], "data.val_windows must be >= 1, got -5", False),
    (["--set", "budget.max_tokens=-5"], "budget.max_tokens must be > 0 (or null for no limit), got -5", False),
    (["--set", "budget.max_cost=10"], "budget.max_cost needs budget.price_per_gpu_hour (> 0)", False),
    (["--set", "spike.factor=0.5"], "spike.factor must be a number > 1, got 0.5", False),
    (["--set", "spike.action=skip"], "spike.action must be one of rollback, stop, warn, got 'skip'", False),
    (["--set", 'notify.targets=["echo {nope}"]'], "notify.targets[0] names {nope}, which is not a field", False),
    (["--set", "data.val_windows=0"], "data.val_windows must be >= 1, got 0", False),
    (["--set", "data.num_workers=-1"], "data.num_workers must be >= 0, got -1", False),
    (["--set", "model.gpt.block_size=1000000000"], "fewer than one block (block_size 1000000000 + 1)", False),
    (["--set", "data.micro_batch_size=100000"], "fewer than micro_batch_size x world_size = 100000", False),
    (["--set", "model.gpt.n_layer=two"], "model.gpt.n_layer: 'two' is not valid; expected int", True),
    (["--set", "trainer.precision=foo"], "trainer.precision: 'foo' is not valid; expected int or", True),
    (["--sweep", "trainer.max_steps=5,x"], "trainer.max_steps must be a positive number of optimizer steps (or -1: no limit, stop on a budget), got 'x'", True),
    (["--sweep", "model.optimizer.lr"], "expected KEY=V1,V2", False),
    # a key without its group, in queue add's own words: the queue sets seed_everything itself
    (["--set", "seed=3"], "unknown setting --set seed=3; did you mean --set data.seed=3 or --seeds 3? (settings", True),
    (["--set", "name=x"], "did you mean --name x or --set model.optimizer.name=x?", True),
    (["--set", "resume=x"], "unknown setting --set resume=x; run.resume is set by the queue: the queue always", True),
    # an option of fit without its group, given as queue add's own: fit's rule, in fit's form
    (["--micro_batch_size", "8"], "unknown setting --micro_batch_size 8; did you mean --run.micro_batch_size 8 or --data.micro_batch_size 8? (settings take their group)", False),
    (["--max_steps=5"], "unknown setting --max_steps 5; did you mean --trainer.max_steps 5? (settings", False),
    (["--lr", "1e-3"], "did you mean --model.optimizer.lr 1e-3?", False),
    # options are matched whole, as fit matches its own: --seed is not --seeds
    (["--seed", "3"], "unknown setting --seed 3; did you mean --data.seed 3 or --seeds 3? (settings", False),
    (["--seed=3", "--name", "x"], "unknown setting --seed 3; did you mean --data.seed 3 or --seeds 3?", False),
    (["--resume", "x"], "unknown setting --resume x; run.resume is set by the queue: the queue always", False),
    (["--bogus", "3"], "unknown option --bogus; `nanolab queue add --help` lists its options, and fit's settings take their group", False),
    # a near miss of an option of its own, or of fit's that it takes: the nearest named
    (["--contineu"], "unknown option --contineu; did you mean --continue?", False),
    # a misspelling of its own option before a setting near it (--seedz: --seeds, not data.seed)
    (["--seedz", "3"], "unknown option --seedz; did you mean --seeds?", False),
    (["--ckpt_pth", "x"], "unknown option --ckpt_pth; did you mean --ckpt_path?", False),
    # fit's --config (or a near miss of it): the queue takes its configs as arguments
    (["--config", "x.yaml"], "--config: `queue add` takes its configs as arguments, composed in order: `nanolab queue add A.yaml [B.yaml ...]`", False),
    (["--confg", "x.yaml"], "--confg: `queue add` takes its configs as arguments", False),
    (["--gpus", "0"], "--gpus is an option of `nanolab queue run`, not of `queue add`; give it there", False),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "message", "by_parser"), REFUSALS, ids=lambda v: str(v)[:40])
def test_each_refusal_is_the_one_line_it_was(tmp_path, char_dataset, capsys, monkeypatch, remembered,
                                             extra, message, by_parser) -> None:  # fmt: skip
    """Refused in one line and exit 2, nothing queued; the schema answers what it can (an
    unknown key, a file that cannot be read, the resolver's checks) without the parser."""
    monkeypatch.chdir(tmp_path)
    calls = _spy_on_the_parser(monkeypatch)
    config = _tiny_config(tmp_path / "tiny.yaml", char_dataset, tmp_path / "runs")
    files = {k: str(v) for k, v in _files(tmp_path).items()}
    argv = [a.format(**files) if a.startswith("{") else a for a in extra]
    db = tmp_path / "q.db"
    code = main(["add", str(config), *argv, "--db", str(db)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("nanolab queue add: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1
    assert QueueDB(db).jobs() == []
    assert bool(calls) == by_parser, calls


# -- the CPU's rates, remembered for a day --------------------------------------------------------
def test_the_cpu_rates_a_probe_measured_stand_for_a_day(tmp_path: Path, monkeypatch) -> None:
    """``queue add``'s CPU estimate divides by rates a probe on this machine measured within a
    day (no torch import); a day later, another machine or a rate not measured yet: probed."""
    from nanolab.estimator import cpu

    monkeypatch.setenv("NANOLAB_ESTIMATOR_CACHE", str(tmp_path))
    probes: list[str] = []
    rates = {"float32": 0.05, "bfloat16": 0.02}
    monkeypatch.setattr(cpu, "_rate", lambda dtype, threads: probes.append(dtype) or rates[dtype])
    first = cpu.remembered_cpu_device(bf16=False)
    assert probes == ["float32"] and first.tflops["fp32"] == 0.05
    assert cpu.remembered_cpu_device(bf16=False).tflops == first.tflops and len(probes) == 1
    assert cpu.remembered_cpu_device(bf16=True).tflops["bf16"] == 0.02  # not measured yet
    assert probes == ["float32", "float32", "bfloat16"]
    assert cpu.remembered_cpu_device(bf16=True).tflops["bf16"] == 0.02 and len(probes) == 3
    (stored,) = tmp_path.glob("cpu-rates-*.json")
    data = json.loads(stored.read_text())
    stored.write_text(json.dumps({**data, "time": data["time"] - cpu.REMEMBERED_RATES_S - 1}))
    cpu.remembered_cpu_device(bf16=False)  # a day old: probed again
    assert len(probes) == 4
    monkeypatch.setattr(cpu, "_machine", lambda: ["another machine"])
    cpu.remembered_cpu_device(bf16=False)
    assert len(probes) == 5


def test_the_best_rate_any_probe_saw_is_what_is_remembered(tmp_path: Path, monkeypatch) -> None:
    """Load only ever slows a probe (14 GFLOP/s at load 3-4 on the 2-core machine, 170-200
    idle): a later probe in a process that has torch anyway (a fit's banner) raises the
    remembered rate, a slower one does not lower it, and ``queue add`` reads the best without
    probing; a fit's banner or ``estimate --device cpu`` on a busy machine divides by that best
    too. Mutations caught: the first, busy probe's rate kept for a day (queue estimates 10x
    long until tomorrow); a later, slower probe replacing a faster one; a busy probe's own rate
    used by the estimate that took it (step times 10x apart between two calls)."""
    import torch

    from nanolab.estimator import cpu

    monkeypatch.setenv("NANOLAB_ESTIMATOR_CACHE", str(tmp_path))
    seen = iter([0.014, 0.18, 0.05])
    monkeypatch.setattr(cpu, "_rate", lambda dtype, threads: next(seen))
    assert cpu.remembered_cpu_device(bf16=False).tflops["fp32"] == 0.014  # the first probe
    threads = torch.get_num_threads()
    assert cpu.cpu_device(threads, bf16=False).tflops["fp32"] == 0.18  # a fit's own probe
    assert cpu.remembered_cpu_device(bf16=False).tflops["fp32"] == 0.18  # raised, no probe
    assert cpu.cpu_device(threads, bf16=False).tflops["fp32"] == 0.18  # a busy probe: the best
    assert cpu.remembered_cpu_device(bf16=False).tflops["fp32"] == 0.18  # not lowered


def test_a_best_cpu_rate_expires_a_day_after_it_was_measured(tmp_path: Path, monkeypatch) -> None:
    """A slower probe keeps the best rate but not its own time: the best stands until a day
    after the probe that measured it, then this machine's rate as now measured is believed (a
    CPU quota lowered since). Mutation caught: every write restamping the best (it never
    expires while something probes daily)."""
    import torch

    from nanolab.estimator import cpu

    monkeypatch.setenv("NANOLAB_ESTIMATOR_CACHE", str(tmp_path))
    seen = iter([0.5, 0.05, 0.05])
    monkeypatch.setattr(cpu, "_rate", lambda dtype, threads: next(seen))
    threads = torch.get_num_threads()

    def age_by(hours: float) -> None:
        (stored,) = tmp_path.glob("cpu-rates-*.json")
        data = json.loads(stored.read_text())
        stored.write_text(json.dumps({**data, "time": data["time"] - hours * 3600}))

    assert cpu.cpu_device(threads, bf16=False).tflops["fp32"] == 0.5
    age_by(23)
    assert cpu.cpu_device(threads, bf16=False).tflops["fp32"] == 0.5  # 23 h old: still the best
    age_by(2)  # the best probe is 25 h old now, the slower one 2 h
    assert cpu.cpu_device(threads, bf16=False).tflops["fp32"] == 0.05


def test_a_best_bf16_rate_expires_on_its_own_probes_time(tmp_path: Path, monkeypatch) -> None:
    """A newer, faster fp32 probe does not renew an old bf16 best: each rate expires a day
    after the probe that measured it. Mutation caught: one timestamp for both rates."""
    import torch

    from nanolab.estimator import cpu

    monkeypatch.setenv("NANOLAB_ESTIMATOR_CACHE", str(tmp_path))
    rates = iter([0.1, 0.5, 0.2, 0.05, 0.3, 0.05])  # (fp32, bf16) per call
    monkeypatch.setattr(cpu, "_rate", lambda dtype, threads: next(rates))
    threads = torch.get_num_threads()

    def age_by(hours: float) -> None:
        (stored,) = tmp_path.glob("cpu-rates-*.json")
        data = json.loads(stored.read_text())
        data["time"] -= hours * 3600
        data["bf16_time"] -= hours * 3600
        stored.write_text(json.dumps(data))

    assert cpu.cpu_device(threads).tflops["bf16"] == 0.5
    age_by(23)
    second = cpu.cpu_device(threads)  # fp32 0.2 beats 0.1 (stamped now); bf16 0.05 < 0.5 kept
    assert second.tflops["fp32"] == 0.2 and second.tflops["bf16"] == 0.5
    age_by(2)  # the bf16 best is 25 h old now; the fp32 best 2 h
    third = cpu.cpu_device(threads)
    assert third.tflops["fp32"] == 0.3 and third.tflops["bf16"] == 0.05
