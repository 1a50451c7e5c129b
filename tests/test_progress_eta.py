"""The progress display's ETA follows the recent pace: a slowdown shows within the window, and the
first steps' compile time never counts (fake clock, no training)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nanolab.callbacks import progress
from nanolab.callbacks.eta import RecentStepTime
from nanolab.callbacks.progress import StepProgressBar


def test_the_pace_is_the_windows_not_the_launchs() -> None:
    recent = RecentStepTime(window_s=100.0)
    assert recent.seconds_per_step() is None and recent.eta_s(0, 10) is None
    recent.add(60.0, 10)  # the first refresh, after a minute of compile: the window starts here
    assert recent.seconds_per_step() is None
    for step in range(20, 510, 10):
        recent.add(60.0 + (step - 10) * 0.2, step)  # 0.2 s per step
    assert recent.seconds_per_step() == pytest.approx(0.2)
    start = 60.0 + 490 * 0.2
    for step in range(510, 810, 10):
        recent.add(start + (step - 500) * 1.0, step)  # throttled: 1 s per step
    assert recent.seconds_per_step() == pytest.approx(1.0)  # the last 100 s are all slow
    assert recent.eta_s(800, 1000) == pytest.approx(200.0)
    assert recent.steps_per_second() == pytest.approx(1.0)
    recent.add(10_000.0, 800)  # the same step again (its line after a validation): ignored
    assert recent.seconds_per_step() == pytest.approx(1.0)


def test_samples_are_bounded() -> None:
    recent = RecentStepTime(window_s=1e9, max_samples=5)
    for step in range(1, 100):
        recent.add(float(step), step)
    assert len(recent._samples) == 5 and recent.seconds_per_step() == pytest.approx(1.0)


def test_the_plain_lines_eta_follows_a_slowdown_and_leaves_the_compile_out(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """1,000 steps: a minute of compile before step 10, 0.2 s per step to step 500, then 1 s
    per step. The launch's average said ETA 50m38s at step 20 and 1m54s at step 800; the last
    five minutes' pace says 3m16s and 3m20s."""
    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(progress, "validation_follows", lambda trainer: False)
    bar = StepProgressBar(refresh_rate=10, mode="plain", plain_every_s=0, banner=False)
    bar.clock = SimpleNamespace(readout=SimpleNamespace(completed=[]))
    trainer = SimpleNamespace(max_steps=1000, is_global_zero=True)
    bar._started = (0.0, 0)

    def step_at(t: float, step: int) -> str:
        now[0] = t
        bar.on_step(trainer, None, step)
        return capsys.readouterr().out.strip()

    assert step_at(60.0, 10).endswith(", ETA 1h39m")  # one refresh: the launch's pace so far
    assert step_at(62.0, 20).endswith("1m02s, ETA 3m16s")  # 0.2 s/step, the compile left out
    for step in range(30, 510, 10):
        step_at(60.0 + (step - 10) * 0.2, step)
    start = 60.0 + 490 * 0.2
    for step in range(510, 800, 10):
        step_at(start + (step - 500) * 1.0, step)
    assert step_at(start + 300.0, 800).endswith("7m38s, ETA 3m20s")  # 1 s/step for 200 steps


def test_the_bars_rate_and_eta_are_the_recent_pace() -> None:
    recent = RecentStepTime()
    bar = progress.RecentPaceTqdm(total=1000, initial=0, disable=True)
    bar.recent = recent
    assert bar.format_dict["rate"] is None  # no refresh yet: tqdm's own (none before an update)
    recent.add(60.0, 10)
    recent.add(62.0, 20)
    assert bar.format_dict["rate"] == pytest.approx(5.0)  # 0.2 s per step
