"""A ``trainer.*`` setting Lightning's Trainer refuses is one line naming the key, exit 2.

``Trainer(...)`` checks the accelerator, the strategy and the clipping algorithm itself; through
``nanolab fit`` its refusal was a traceback and exit code 1. The accelerator row is the CPU twin
of a GPU recipe started where torch sees no GPU (``configs/gpt2-124m.yaml`` says ``gpu``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import QUICKSTART, tiny_overrides, write_config

from nanolab.cli import main

#: These rows are about a machine without a GPU (this project's CI); where torch sees one they
#: do not apply.
NO_GPU = pytest.mark.skipif(
    torch.cuda.is_available() or torch.backends.mps.is_available(), reason="a GPU is visible"
)


@pytest.mark.parametrize(
    ("override", "key", "says"),
    [
        (
            ["--trainer.gradient_clip_algorithm", "bogus"],
            "trainer.gradient_clip_algorithm",
            "bogus",
        ),
        (["--trainer.strategy", "bogus"], "trainer.strategy", "bogus"),
        pytest.param(
            ["--trainer.strategy", "fsdp"],
            "trainer.strategy",
            "configs/strategy/fsdp.yaml",
            marks=NO_GPU,
        ),
        pytest.param(
            ["--trainer.accelerator", "gpu"],
            "trainer.accelerator",
            "--trainer.accelerator cpu",
            marks=NO_GPU,
        ),
        (["--trainer.accelerator", "tpu"], "trainer.accelerator", "torch_xla"),
        (["--trainer.precision", "transformer-engine"], "trainer.precision", "transformer_engine"),
    ],
    ids=["clip-algorithm", "strategy", "fsdp1-on-cpu", "gpu-without-one", "tpu", "te-precision"],
)
def test_a_setting_the_trainer_refuses_is_one_line_and_writes_nothing(
    tmp_path: Path, char_dataset: Path, capsys, override: list[str], key: str, says: str
) -> None:
    runs = tmp_path / "runs"
    cfg = tiny_overrides(char_dataset, runs, trainer__max_steps=2)
    config = write_config(tmp_path / "tiny.yaml", cfg)
    capsys.readouterr()
    code = main(["fit", "--config", str(QUICKSTART), "--config", str(config), *override])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"nanolab fit: error: {key}: "), lines[0]
    assert says in lines[0]
    assert not runs.exists()  # no run directory, no log


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"accelerator": "cpu", "devices": 0}, "trainer.devices"),
        ({"devices": "x"}, "trainer.devices"),
        ({"plugins": "bogus"}, "trainer.plugins"),
        ({"val_check_interval": -1}, "trainer.val_check_interval"),
        ({"num_nodes": 0}, "trainer.num_nodes"),
        ({"max_time": "x"}, "trainer.max_time"),
        ({"profiler": "bogus"}, "trainer.profiler"),
        ({"strategy": "fsdp", "accelerator": "cpu"}, "trainer.strategy"),
        ({"precision": "bogus"}, "trainer.precision"),
        ({"accelerator": "bogus"}, "trainer.accelerator"),
    ],
)
def test_the_refusal_names_the_key_lightnings_message_is_about(kwargs: dict, key: str) -> None:
    """Lightning's own messages, from a real ``Trainer``: the key is the argument the message
    names first, or an alias it uses (``plugin``, ``Timer(duration``). Mutation caught: a
    fixed keyword order (``devices=0`` on a CPU labelled trainer.accelerator)."""
    from lightning.pytorch import Trainer

    from nanolab.run.trainer_errors import REFUSALS, trainer_refusal

    with pytest.raises(REFUSALS) as caught:
        Trainer(**kwargs, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    line = str(trainer_refusal(caught.value, kwargs))
    assert line.startswith(f"{key}: ") and "\n" not in line, line


@NO_GPU
def test_the_gpu_recipe_without_a_gpu_is_refused_before_its_data_is_read(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """``nanolab fit --config configs/gpt2-124m.yaml`` where torch sees no GPU and the recipe's
    ``data/owt`` does not exist: the missing GPU is what is said (the first thing to fix), not
    the missing dataset, and nothing is written."""
    monkeypatch.chdir(tmp_path)
    recipe = Path(__file__).resolve().parents[1] / "configs" / "gpt2-124m.yaml"
    capsys.readouterr()
    code = main(["fit", "--config", str(recipe)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("nanolab fit: error: trainer.accelerator: 'gpu' needs a CUDA or ROCm GPU")
    assert list(tmp_path.iterdir()) == []


LAUNCH_VARS = (
    "MASTER_ADDR", "NODE_RANK", "GROUP_RANK", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS",
    "SLURM_JOB_NAME", "LSB_JOBID", "OMPI_COMM_WORLD_SIZE", "KUBERNETES_PORT",
)  # fmt: skip


def test_several_machines_without_a_multinode_launch_is_refused_before_anything_runs(
    tmp_path: Path, char_dataset: Path, capsys, monkeypatch
) -> None:
    """``trainer.num_nodes: 2`` on one machine, started plainly: rank 0 used to wait in the
    rendezvous for machines that never came, deaf to Ctrl-C and SIGTERM (a queue job then
    hung until SIGKILL). Refused in one line; torchrun, SLURM or a hand-made launch
    (MASTER_ADDR/NODE_RANK) are what a multi-node run is started by, and those are let through.

    Mutation caught: the launcher check dropped (the fit blocks: the test times out)."""
    from nanolab.run.trainer_errors import lone_multinode, multinode_launcher

    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    runs = tmp_path / "runs"
    config = write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, runs))
    capsys.readouterr()
    code = main(["fit", "--config", str(QUICKSTART), "--config", str(config),
                 "--trainer.num_nodes", "2"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("nanolab fit: error: trainer.num_nodes: 2 machines, but no multi-node")
    assert not runs.exists()

    assert multinode_launcher({}) is None
    launches = {
        "torchrun": {"TORCHELASTIC_RUN_ID": "j", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                     "GROUP_RANK": "0", "MASTER_ADDR": "n0", "MASTER_PORT": "1"},
        "hand-made": {"MASTER_ADDR": "node0", "NODE_RANK": "1"},
        "slurm": {"SLURM_NTASKS": "16", "SLURM_JOB_NAME": "train"},
    }  # fmt: skip
    for env in launches.values():
        assert multinode_launcher(env) is not None, env
        assert lone_multinode({"num_nodes": 2}, env) is None
    assert lone_multinode({"num_nodes": 1}, {}) is None


def test_a_callback_that_needs_a_logger_on_a_run_without_one_is_one_line(
    tmp_path: Path, char_dataset: Path, capsys
) -> None:
    """``--trainer.callbacks+=LearningRateMonitor`` without a logger: Lightning refused it at
    the first step, a traceback (exit 1) after the run directory was claimed and the banner
    printed. Said before anything is written; with ``--logger csv`` the same run trains."""
    runs = tmp_path / "runs"
    config = write_config(tmp_path / "tiny.yaml", tiny_overrides(char_dataset, runs))
    argv = ["fit", "--config", str(QUICKSTART), "--config", str(config), "--trainer.max_steps",
            "2", "--trainer.callbacks+=lightning.pytorch.callbacks.LearningRateMonitor"]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "trainer.callbacks[0] (LearningRateMonitor) writes through a logger" in err
    assert not runs.exists()
    assert main([*argv, "--logger", "csv"]) == 0
