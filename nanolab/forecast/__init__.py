"""Loss forecasts: where a run's validation loss is heading, and what a target would take.

* :mod:`nanolab.forecast.annealing`: the loss as a function of the LR schedule (used whenever
  the schedule is known).
* :mod:`nanolab.forecast.powerlaw`: a power law in tokens (the fallback).
* :mod:`nanolab.forecast.run`: one run's forecast for ``nanolab report --forecast`` and the
  budget's payoff rule.
"""

from nanolab.forecast.annealing import ScheduleFit, fit_schedule_curve, schedule_areas
from nanolab.forecast.powerlaw import MIN_POINTS, CurveFit, ForecastError, fit_loss_curve
from nanolab.forecast.run import CurveInputs, RunForecast, even_points, fit_curve, forecast

__all__ = [
    "MIN_POINTS",
    "CurveFit",
    "CurveInputs",
    "ForecastError",
    "RunForecast",
    "ScheduleFit",
    "even_points",
    "fit_curve",
    "fit_loss_curve",
    "fit_schedule_curve",
    "forecast",
    "schedule_areas",
]
