"""Which way a per-layer curve (a work profile, a width schedule) points along depth: front-loaded or back-loaded.

The direction is read from where the curve's excess over its minimum sits, its centre along relative depth
t = l / (L - 1):

    centre = sum_l t_l (v_l - min v) / sum_l (v_l - min v)      (0: all in the first layer, 1: all in the last)

The excess, not the curve itself, so a constant offset (raw work in the states' units) cannot pull every curve to
the middle; and a curve reflected about its midrange, v -> max v + min v - v (the anti control), has the excess
max v - v; the two excesses add up to the flat curve max v - min v, whose centre is 1/2, so their centres lie on
either side of it: reflection always flips the direction.
"""

from __future__ import annotations

import numpy as np

BALANCED = 0.05
"""A centre within this distance of mid-depth (1/2) is called balanced: a flat, symmetric or mid-peaked curve."""


def depth_centre(values) -> float:
    """Centre of the curve's excess over its minimum along relative depth, in [0, 1]; 1/2 for a flat curve."""
    v = np.asarray(values, dtype=np.float64)
    excess = v - v.min()
    if v.size < 2 or not excess.sum() > 0:
        return 0.5
    return float(np.linspace(0.0, 1.0, v.size) @ excess / excess.sum())


def direction(values) -> str:
    """`front-loaded` (most of the excess in the first half of the layers), `back-loaded`, or `balanced`."""
    centre = depth_centre(values)
    if abs(centre - 0.5) < BALANCED:
        return "balanced"
    return "front-loaded" if centre < 0.5 else "back-loaded"
