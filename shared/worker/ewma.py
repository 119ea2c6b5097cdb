"""Exponentially weighted moving averages: what a worker's live cost coefficients are made of (calibration.py).

`Ewma` is a mean whose samples' weights decay by (1 - alpha) with every later sample (about the last 1 / alpha
samples count). `EwmaLine` fits y ≈ intercept + slope · x to the recent samples by least squares under the same
weights: a step's seconds against the prompt tokens it computed, a pull's seconds against its bytes. Pure state;
no clock, no threads.
"""

from __future__ import annotations

from typing import NamedTuple

# the xs count as "all one size" while their spread is under this share of their mean: no slope can be told apart
# from an intercept then
_FLAT_SPREAD = 0.01


class Ewma:
    def __init__(self, alpha: float) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.value: float | None = None  # None until the first sample

    def add(self, x: float) -> float:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)
        return self.value


class Line(NamedTuple):
    intercept: float  # y at x = 0 (>= 0)
    slope: float  # y per unit of x (> 0)


class EwmaLine:
    """y ≈ intercept + slope · x over the recent samples (see the module). Both coefficients stay physical: a fit
    with a negative intercept, or a slope that is not positive (noise over a narrow range of x), falls back to the
    line through the origin and the samples' weighted means (slope = mean y / mean x), which is exact at the size
    the samples had; so does a run of samples of one size."""

    def __init__(self, alpha: float) -> None:
        self._x, self._y, self._xx, self._xy = Ewma(alpha), Ewma(alpha), Ewma(alpha), Ewma(alpha)

    def add(self, x: float, y: float) -> None:
        """One sample; x > 0 (a sample at x = 0 says nothing of the slope: give it to an Ewma instead)."""
        if x <= 0:
            raise ValueError(f"a line's sample needs x > 0, got {x}")
        self._x.add(x)
        self._y.add(y)
        self._xx.add(x * x)
        self._xy.add(x * y)

    def fit(self) -> Line | None:
        """The current line; None before the first sample."""
        mx, my, mxx, mxy = self._x.value, self._y.value, self._xx.value, self._xy.value
        if mx is None or my is None or mxx is None or mxy is None:
            return None
        through_origin = Line(0.0, max(my, 0.0) / mx)
        var_x = mxx - mx * mx
        if var_x <= (_FLAT_SPREAD * mx) ** 2:
            return through_origin
        slope = (mxy - mx * my) / var_x
        intercept = my - slope * mx
        if slope <= 0 or intercept < 0:
            return through_origin
        return Line(intercept, slope)
