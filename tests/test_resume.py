"""SLURM requeue detection by the preemption handler."""

from __future__ import annotations


def test_slurm_auto_requeue_is_seen_on_a_single_device(monkeypatch):
    # Single-device strategies carry no cluster_environment; Lightning's accelerator connector
    # does, and that is where its own SIGUSR1 requeue handler looks.
    import signal

    import lightning as L
    from lightning.fabric.plugins.environments import SLURMEnvironment

    from nanolab.callbacks.preemption import slurm_requeue_signal

    for key, value in {"SLURM_NTASKS": "1", "SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "train",
                       "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        plugins=[SLURMEnvironment(auto_requeue=True, requeue_signal=signal.SIGUSR1)],
    )  # fmt: skip
    assert slurm_requeue_signal(trainer) == signal.SIGUSR1
    for key in ("SLURM_NTASKS", "SLURM_JOB_ID", "SLURM_JOB_NAME"):
        monkeypatch.delenv(key)
    outside_slurm = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False
    )
    assert slurm_requeue_signal(outside_slurm) is None


def test_auto_names_under_slurm_follow_the_command_and_survive_a_requeue(monkeypatch):
    """Two experiments in one SLURM job (``--model.optimizer.lr 1e-3``, then ``3e-3``) were
    both named ``<stem>-slurm<job>``: the second found the first complete, kept its lr with a
    warning and trained nothing. The command line is part of the name; the same command (a
    requeue, every srun task) gets the same one."""
    import sys

    from nanolab.run.compose import default_run_name

    monkeypatch.setenv("SLURM_JOB_ID", "777")

    def name_for(*argv: str) -> str:
        monkeypatch.delenv("NANOLAB_RUN_NAME", raising=False)
        monkeypatch.setattr(sys, "argv", ["nanolab", "fit", *argv])
        return default_run_name("tiny")

    first = name_for("--config", "tiny.yaml", "--model.optimizer.lr", "1e-3")
    assert first.startswith("tiny-slurm777-") and len(first) == len("tiny-slurm777-") + 6
    assert name_for("--config", "tiny.yaml", "--model.optimizer.lr", "1e-3") == first
    assert name_for("--config", "tiny.yaml", "--model.optimizer.lr", "3e-3") != first
    # the job's `test` of that config after its `fit` (a checkpoint named or not) is that run
    monkeypatch.delenv("NANOLAB_RUN_NAME", raising=False)
    monkeypatch.setattr(sys, "argv", ["nanolab", "test", "--config", "tiny.yaml",
                                      "--model.optimizer.lr", "1e-3", "--ckpt_path", "best"])  # fmt: skip
    assert default_run_name("tiny") == first
