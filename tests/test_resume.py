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
