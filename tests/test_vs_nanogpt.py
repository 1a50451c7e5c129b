"""``benches/vs_nanogpt.py``: what it can be checked on without nanoGPT's code.

The bench runs a user's nanoGPT checkout, which the suite does not have (and never copies), so
these tests cover the rest: the dataset nanolab reads from nanoGPT's files, the command lines
each side gets (nanoGPT's configurator insists on the types of its defaults), the timing read
from train.py's printout and from nanolab's run log, and the one-line errors.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import nanolab_here

from nanolab.data.datamodule import TokenDataModule, TokenWindows

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("vs_nanogpt", REPO / "benches" / "vs_nanogpt.py")
vs = importlib.util.module_from_spec(spec)
sys.modules["vs_nanogpt"] = vs
spec.loader.exec_module(vs)


def _nanogpt_folder(folder: Path, vocab: int = 5) -> Path:
    """What nanoGPT's shakespeare_char prepare.py leaves: uint16 ids and a pickled meta."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    rng.integers(0, vocab, 4000).astype(np.uint16).tofile(folder / "train.bin")
    rng.integers(0, vocab, 600).astype(np.uint16).tofile(folder / "val.bin")
    itos = dict(enumerate("\n abc"[:vocab]))
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": vocab, "itos": itos, "stoi": {c: i for i, c in itos.items()}}, f)
    return folder


def test_nanolab_reads_nanogpts_token_files_as_they_are(tmp_path):
    """The meta.json written beside nanoGPT's files passes fit's checks and gives the same
    vocabulary (no end-of-text id added), and the windows are nanoGPT's ids."""
    folder = _nanogpt_folder(tmp_path / "shakespeare_char")
    before = (folder / "train.bin").read_bytes()
    meta = vs.write_nanolab_meta(folder)
    assert (meta["vocab_size"], meta["dtype"], meta["train_tokens"]) == (5, "uint16", 4000)
    assert meta["tokenizer"] == {"name": "chars", "chars": ["\n", " ", "a", "b", "c"], "eot": False}
    assert (folder / "train.bin").read_bytes() == before  # the files themselves are untouched
    dm = TokenDataModule(dataset_dir=str(folder), source=None, block_size=8, micro_batch_size=2)
    assert dm.vocab_size == 5
    x, y = TokenWindows(folder / "train.bin", meta["dtype"], 8)[np.array([0, 100])]
    ids = np.fromfile(folder / "train.bin", dtype=np.uint16)
    assert x[0].tolist() == ids[:8].tolist() and y[1].tolist() == ids[101:109].tolist()


def test_nanogpt_command_values_have_the_types_of_train_pys_defaults(tmp_path):
    """nanoGPT's configurator asserts ``type(literal_eval(value)) == type(default)``: a float
    written as ``0`` or a string left unquoted would stop train.py before it starts."""
    types = {
        "device": str, "compile": bool, "dtype": str, "dataset": str, "out_dir": str,
        "eval_interval": int, "eval_iters": int, "log_interval": int, "max_iters": int,
        "always_save_checkpoint": bool, "batch_size": int, "block_size": int, "n_layer": int,
        "dropout": float, "bias": bool, "learning_rate": float, "min_lr": float,
        "warmup_iters": int, "lr_decay_iters": int, "beta2": float, "weight_decay": float,
        "grad_clip": float, "gradient_accumulation_steps": int, "init_from": str,
    }  # fmt: skip
    for shape in vs.SHAPES.values():
        cmd = vs.nanogpt_command(tmp_path, shape, "out-x")
        settings = {}
        for arg in cmd[2:]:
            if arg.startswith("--"):
                key, value = arg[2:].split("=")  # the configurator splits on '=' too
                settings[key] = ast.literal_eval(value)
        for key, kind in types.items():
            assert type(settings[key]) is kind, (shape.name, key, settings.get(key))
        assert settings["max_iters"] == shape.steps - 1  # iterations 0..max_iters: `steps` steps
        assert settings["device"] == "cpu" and settings["compile"] is False
    char = vs.nanogpt_command(tmp_path, vs.SHAPES["shakespeare_char"], "o")
    assert char[2] == str(tmp_path / "config" / "train_shakespeare_char.py")


@pytest.mark.parametrize("name", ["shakespeare_char", "quickstart"])
def test_nanolab_command_is_a_valid_fit_config(tmp_path, name):
    """``nanolab fit`` accepts every override the bench passes; the resolved model is the
    shape's, with the quickstart recipe's GELU and padding unless --nanolab-set changes them."""
    shape = vs.SHAPES[name]
    cmd = vs.nanolab_command(shape, tmp_path / "data", tmp_path / "runs", "t", [])
    assert cmd[1:4] == ["-m", "nanolab", "fit"]
    extra = ["--model.gpt.activation", "gelu_tanh"]
    res = nanolab_here(*cmd[3:], *extra, "--print_config", cwd=tmp_path)  # the config only
    assert res.returncode == 0, res.stderr[-2000:]
    cfg = yaml.safe_load(res.stdout)
    model, data = (cfg[k].get("init_args", cfg[k]) for k in ("model", "data"))  # class-path form
    gpt = model["gpt"]
    arch = (gpt["n_layer"], gpt["n_head"], gpt["n_embd"], gpt["block_size"], gpt["dropout"])
    assert arch == (shape.n_layer, shape.n_head, shape.n_embd, shape.block_size, shape.dropout)
    assert (gpt["activation"], gpt["vocab_multiple"]) == ("gelu_tanh", 1)
    assert data["val_windows"] == 2 * shape.eval_iters * shape.batch_size
    assert data["micro_batch_size"] == shape.batch_size
    assert model["schedule"]["decay_steps"] == shape.lr_decay_iters  # None: the last step
    assert model["schedule"]["min_lr_ratio"] == pytest.approx(0.1)
    assert vs.nanolab_model_options(extra) == {"activation": "gelu_tanh", "vocab_multiple": 1}


def _train_py_output(steps: int, eval_interval: int, dts: list[float]) -> str:
    """Lines in the format of train.py's prints (its f-strings), with a few unrelated ones."""
    lines = ["tokens per iteration will be: 4,096", "number of parameters: 0.80M"]
    for i in range(steps):
        if i % eval_interval == 0:
            lines.append(f"step {i}: train loss {4.2 - i / 100:.4f}, val loss {4.3 - i / 100:.4f}")
            if i:
                lines.append("saving checkpoint to out")
        lines.append(f"iter {i}: loss {4.0:.4f}, time {dts[i] * 1000:.2f}ms, mfu {-100.0:.2f}%")
    return "\n".join(lines)


def test_nanogpt_step_times_and_evaluations_are_read_from_its_printout():
    dts = [5.0, 0.30, 0.31, 0.29, 2.0, 0.32, 0.28, 0.30]
    step_s, dirty, val = vs.parse_nanogpt_log(_train_py_output(8, 4, dts), 4)
    assert step_s == pytest.approx(dts) and dirty == [0, 4] and val == pytest.approx(4.26)
    # Steady: steps after warmup 1 that hold no evaluation.
    assert vs.steady_step_s(step_s, dirty, warmup=1) == pytest.approx(0.30)
    broken = _train_py_output(8, 4, dts).replace("iter 3:", "iter 33:")
    with pytest.raises(vs.BenchError, match="misses some `iter N:` lines"):
        vs.parse_nanogpt_log(broken, 4)


def test_nanolab_step_times_leave_out_steps_holding_an_evaluation():
    recs = [{"event": "start", "time": 100.0}]
    t = 100.0
    for step in range(1, 7):
        t += 0.5 if step != 4 else 3.0
        recs.append({"event": "train", "time": t, "step": step})
        if step == 3:
            recs += [{"event": "val", "time": t + 1, "val/loss": 2.5}, {"event": "checkpoint"}]
    step_s, dirty, val = vs.nanolab_steps(recs)
    assert step_s == pytest.approx([0.5, 0.5, 0.5, 3.0, 0.5, 0.5]) and dirty == [3]
    assert val == 2.5 and vs.steady_step_s(step_s, dirty, warmup=1) == pytest.approx(0.5)
    with pytest.raises(vs.BenchError, match="no clean step"):
        vs.steady_step_s(step_s, dirty, warmup=10)


def test_step_cpu_time_is_read_off_the_process_samples_at_each_step_end():
    """CPU seconds between step ends, interpolated in the 20 ms samples of the process's CPU
    time; the steady median leaves out warm-up, evaluation steps and unknown (NaN) steps."""
    samples = [(10.0 + i * 0.1, 0.05 * i) for i in range(41)]  # half a core busy for 4 s
    ends = [10.45, 11.0, 12.0, 12.5, 13.95]
    cpu = vs.step_cpu_s(samples, ends)
    assert math.isnan(cpu[0]) and cpu[1:] == pytest.approx([0.275, 0.5, 0.25, 0.725])
    assert vs.cpu_at(samples, 5.0) == 0.0 and vs.cpu_at(samples, 99.0) == pytest.approx(2.0)
    assert vs.steady_cpu_s(cpu, dirty=[3], warmup=1) == pytest.approx(0.5)
    assert math.isnan(vs.steady_cpu_s([float("nan")] * 3, dirty=[], warmup=0))


def test_a_child_process_is_timed_by_wall_and_cpu_with_its_lines_stamped(tmp_path):
    """``timed`` samples a real child's CPU time while it runs; 3 busy steps of 0.15 s CPU."""
    code = (
        "import time\n"
        "for i in range(3):\n"
        "    t = time.process_time()\n"
        "    while time.process_time() - t < 0.15: pass\n"
        "    print('iter', i, flush=True)\n"
        "raise SystemExit(3)"
    )
    run = vs.timed([sys.executable, "-c", code], tmp_path, dict(os.environ), tmp_path / "l.log")
    assert run.returncode == 3 and run.cpu_s >= 0.45 and run.wall_s >= run.cpu_s * 0.5
    assert (tmp_path / "l.log").read_text().count("iter") == 3
    if Path("/proc/self/stat").exists():
        ends = [t for t, line in run.lines if line.startswith("iter")]
        steps = vs.step_cpu_s(run.samples, ends)[1:]
        assert steps == pytest.approx([0.15, 0.15], abs=0.1)


def test_summary_ratios_are_per_round_with_their_spread():
    shape = vs.SHAPES["quickstart"]

    def side(step: float, wall: float, cpu: float) -> vs.SideRun:
        steps = [step] * 20
        return vs.SideRun(steps, [0], wall, cpu, 5.0, 1.5)

    rounds = [
        {"nanogpt": side(0.40, 100, 90), "nanolab": side(0.38, 95, 85)},
        {"nanogpt": side(0.44, 110, 99), "nanolab": side(0.40, 100, 90)},
    ]
    res = vs.summarize(shape, rounds)
    assert [r["steady_ratio"] for r in res["rounds"]] == pytest.approx([0.40 / 0.38, 1.1])
    assert res["steady_ratio"]["min"] == pytest.approx(0.40 / 0.38)
    assert res["steady_ratio"]["max"] == pytest.approx(1.1)
    assert res["wall_ratio"]["median"] == pytest.approx((100 / 95 + 1.1) / 2)
    assert res["cpu_ratio"]["max"] == pytest.approx(99 / 90)
    assert res["nanolab_tokens_per_s"] == pytest.approx(32 * 128 * (1 / 0.38 + 1 / 0.40) / 2)
    json.dumps(res)  # plain data


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--nanogpt", "/no/such/dir"], "is not a nanoGPT checkout (missing train.py"),
        (["--nanogpt", ".", "--rounds", "0"], "--rounds must be >= 1"),
        (["--nanogpt", ".", "--steps", "5"], "leave no steady steps"),
        (["--nanogpt", ".", "--steps", "4", "--warmup", "3"], "--warmup 3 leave no steady"),
        (["--nanogpt", ".", "--warmup", "-1"], "--warmup must be >= 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, says, capsys):
    try:
        code = vs.main(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and says in err[0], err
