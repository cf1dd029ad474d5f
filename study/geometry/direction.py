"""Which way a per-layer curve (a work profile, a width schedule) points along depth, from the centre of its excess
over its minimum along relative depth t = l / (L - 1):

    centre = sum_l t_l (v_l - min v) / sum_l (v_l - min v)      (0: all in the first layer, 1: all in the last)

The excess ignores a constant offset, and a curve reflected about its midrange (the anti control) has the excess
max v - v, which sums with the original's to a flat curve: reflection always flips the direction.
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
