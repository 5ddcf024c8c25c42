"""lnmonitor.core.invariance.sweep: every point of the scale sweep says why it is in the fit or not."""

import pytest

from lnmonitor.core.invariance import sweep
from lnmonitor.core.invariance.results import SweepPoint
from lnmonitor.core.invariance.sweep import fit_sweep, fitted


@pytest.mark.parametrize("eps_over_var, in_fit, rounding, fitted, reason", [
    (1e-3, True, False, True, "fitted"),
    (1e-3, False, False, True, "sign"),
    (1e-3, True, False, False, "too_few"),
    (1e-3, False, False, False, "too_few"),
    (100.0, False, False, True, "outside"),
    (1e-7, False, False, True, "outside"),
    (1e-7, False, True, True, "rounding"),
])
def test_every_point_has_its_reason(eps_over_var, in_fit, rounding, fitted, reason):
    assert sweep.sweep_reason(eps_over_var, in_fit, rounding, fitted) == reason


def test_points_left_out_for_a_sign_change_are_not_called_outside_the_window():
    # five window points: a positive one, a negative one, then three positive ones; the fit takes
    # the longest run of one sign, and the first is left out for the sign change, not the window
    points = [SweepPoint(a, d, r, True, False) for a, d, r in
              ((1.0, 1e-4, 1e-4), (0.1, -2e-3, 1e-2), (0.01, 1e-2, 1e-1), (0.003, 3e-2, 1.0),
               (0.001, 9e-2, 5.0))]
    points.append(SweepPoint(1e-4, 2.0, 500.0, False, False))  # beyond the window
    slope, _, note = fit_sweep(points)
    assert slope == slope and "changes sign" in note  # fitted on the three positive ones
    reasons = [sweep.sweep_reason(p.eps_over_var, p.in_fit, p.rounding, True) for p in fitted(points)]
    assert reasons == ["sign", "sign", "fitted", "fitted", "fitted", "outside"]
