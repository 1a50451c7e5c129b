"""The progress display's time per step: that of the recent past, not the whole launch's average.

The launch's average (elapsed time over steps done) lags every change of pace: a throttled GPU,
a phase that validates more often, a neighbour on a shared CPU. It also carries the first steps'
one-time cost (``torch.compile``, kernel set-up, the first validation's data loading) to the end
of the run. :class:`RecentStepTime` keeps the (time, step) of each refresh over the last
:data:`RECENT_S` seconds and divides the time between its oldest and newest by the steps
between them: a change of pace shows within that window, and a validation inside it counts at
its share. Its first sample is the first refresh, so the steps before it (the compile) never
count.
"""

from __future__ import annotations

from collections import deque

#: Seconds of refreshes the time per step is taken over: long enough to hold a few
#: validations' worth of steps on most runs, short enough that a slowdown shows within minutes.
RECENT_S = 300.0

#: Refreshes kept at most (a refresh every step of a tiny model: the window is then shorter).
MAX_SAMPLES = 1000


class RecentStepTime:
    """Seconds per optimizer step over the last ``window_s`` seconds of refreshes.

    Times are whatever clock the caller reads (``time.monotonic`` in the progress bar), passed in
    so a test can give its own."""

    def __init__(self, window_s: float = RECENT_S, max_samples: int = MAX_SAMPLES) -> None:
        if window_s <= 0 or max_samples < 2:
            raise ValueError(
                f"window_s must be > 0 and max_samples >= 2, got {window_s}, {max_samples}"
            )
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque(maxlen=max_samples)

    def add(self, now: float, step: int) -> None:
        """A refresh at ``now`` after optimizer step ``step``. Older samples are dropped while
        the next-oldest one still spans the window, so the span covers at least ``window_s``
        once the run is that old."""
        if self._samples and step <= self._samples[-1][1]:
            return  # the same step again (its line after a validation): nothing new
        self._samples.append((now, step))
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    def seconds_per_step(self) -> float | None:
        """The mean step time over the window; None before two refreshes."""
        if len(self._samples) < 2:
            return None
        (t0, s0), (t1, s1) = self._samples[0], self._samples[-1]
        return (t1 - t0) / (s1 - s0)

    def eta_s(self, step: int, total: int) -> float | None:
        """Seconds until ``total`` from ``step`` at the recent pace; None before two refreshes."""
        per_step = self.seconds_per_step()
        return None if per_step is None else per_step * max(total - step, 0)

    def steps_per_second(self) -> float | None:
        """The recent pace as a rate (the bar's ``it/s``); None before two refreshes or when no
        time passed between them."""
        per_step = self.seconds_per_step()
        return 1.0 / per_step if per_step else None
