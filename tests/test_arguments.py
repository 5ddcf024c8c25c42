"""lnmonitor.core.monitor.arguments: every public constructor argument of the three callbacks, fuzzed
with nonsense, is refused at construction with a MisconfigurationException that names it."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor, Settings, StructureProbe
from lnmonitor.core.findings.reader import KINDS
from lnmonitor.core.invariance.results import CASES


def _int(v, low=None):
    if isinstance(v, bool):
        return False
    try:
        n = operator.index(v)
    except TypeError:
        return False
    return low is None or n >= low


def _pos_int_or_none(v):
    return v is None or _int(v, 1)


def _name_or_none(v):
    return v is None or (isinstance(v, str) and v != "")


def _strings(v, allowed=None, distinct=False):
    """A non-empty string or a non-empty collection (not a mapping/bytes) of non-empty
    strings, each in ``allowed`` when given."""
    if isinstance(v, str):
        items = [v]
    elif isinstance(v, Iterable) and not isinstance(v, (bytes, bytearray, Mapping)):
        items = list(v)
    else:
        return False
    ok = bool(items) and all(isinstance(i, str) and i and (allowed is None or i in allowed)
                             for i in items)
    return ok and (not distinct or len(set(items)) == len(items))


def _scales(v):
    if isinstance(v, (str, bytes, bytearray, Mapping)) or not isinstance(v, Iterable):
        return False
    items = list(v)
    if not all(isinstance(a, (int, float, np.floating, np.integer)) and not isinstance(a, bool)
               for a in items):
        return False
    try:
        floats = [float(a) for a in items]
    except OverflowError:
        return False
    return all(math.isfinite(a) and a > 0 for a in floats) and len(set(floats)) == len(floats)


def _rtol(v):
    return v is None or (isinstance(v, (int, float, np.floating, np.integer))
                         and not isinstance(v, bool) and 0.0 < v < 1.0)


def _findings(v):
    """None or a bool, or {kind: a finite number > 0, or None}."""
    if v is None or isinstance(v, bool):
        return True
    return isinstance(v, dict) and all(k in KINDS for k in v) and all(
        t is None or (isinstance(t, (int, float, np.floating, np.integer)) and not isinstance(t, bool)
                      and math.isfinite(t) and t > 0) for t in v.values())


VALID = {
    (LayerNormMonitor, "every_n_steps"): _pos_int_or_none,
    (LayerNormMonitor, "include"): lambda v: v is None or _strings(v),
    (LayerNormMonitor, "exclude"): lambda v: v is None or _strings(v),
    (LayerNormMonitor, "final_norm"): _name_or_none,
    (LayerNormMonitor, "histograms"): lambda v: isinstance(v, bool),
    (LayerNormMonitor, "keep_history"): lambda v: v is None or isinstance(v, bool),
    (LayerNormMonitor, "image_every_n_steps"): lambda v: _int(v, 1),
    (LayerNormMonitor, "ladder"): lambda v: v is None or _strings(v),
    (LayerNormMonitor, "images"): lambda v: isinstance(v, bool),
    (LayerNormMonitor, "summary"): lambda v: isinstance(v, bool),
    (LayerNormMonitor, "row_mask"): lambda v: v is None or v is False or callable(v),
    (LayerNormMonitor, "findings"): _findings,
    (LayerNormMonitor, "on_finding"): lambda v: v is None or callable(v),
    (LayerNormMonitor, "invariance_every_n_steps"): _pos_int_or_none,
    (LayerNormMonitor, "probe_size"): _pos_int_or_none,
    (LayerNormMonitor, "cases"): lambda v: _strings(v, CASES, distinct=True),
    (LayerNormMonitor, "scales"): _scales,
    (LayerNormMonitor, "settings"): lambda v: v is None or isinstance(v, Settings),
    # None alone would leave it nothing to run on (on_validation is False by default)
    (FinalNormInvarianceMonitor, "invariance_every_n_steps"): lambda v: _int(v, 1),
    (FinalNormInvarianceMonitor, "settings"): lambda v: v is None or isinstance(v, Settings),
    (FinalNormInvarianceMonitor, "on_validation"): lambda v: isinstance(v, bool),
    (FinalNormInvarianceMonitor, "sweep_every_n_steps"): _pos_int_or_none,
    (FinalNormInvarianceMonitor, "probe_batch"): lambda v: True,  # anything loss_fn accepts
    (FinalNormInvarianceMonitor, "probe_size"): _pos_int_or_none,
    (FinalNormInvarianceMonitor, "loss_fn"): lambda v: v is None or callable(v),
    (FinalNormInvarianceMonitor, "final_norm"): _name_or_none,
    (FinalNormInvarianceMonitor, "cases"): lambda v: _strings(v, CASES, distinct=True),
    (FinalNormInvarianceMonitor, "scales"): _scales,
    (FinalNormInvarianceMonitor, "keep_history"): lambda v: v is None or isinstance(v, bool),
    (FinalNormInvarianceMonitor, "summary"): lambda v: isinstance(v, bool),
    (StructureProbe, "every_n_validations"): lambda v: _int(v, 1),
    (StructureProbe, "position"): _int,
    (StructureProbe, "blocks"): _name_or_none,
    (StructureProbe, "branch"): lambda v: v is None or callable(v) or (
        not isinstance(v, str) and _strings(v)),
    (StructureProbe, "rtol"): _rtol,
    (StructureProbe, "norm_jacobians"): lambda v: isinstance(v, bool),
}


_atoms = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 5), st.integers(-(10**400), 10**400),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(0.0, 2.0),
    st.text(max_size=6), st.sampled_from(["", "*", "model.lnf", *CASES, "ln1", "attn"]),
    st.binary(max_size=3), st.complex_numbers(max_magnitude=3),
    st.builds(np.int64, st.integers(-3, 5)), st.builds(np.float32, st.floats(-2, 2, width=32)),
    st.just(object()), st.just(print), st.just(Ellipsis), st.just(torch.ones(2)),
)


NONSENSE = st.one_of(
    _atoms,
    st.lists(_atoms, max_size=3), st.tuples(_atoms, _atoms), st.sets(st.integers(-2, 2), max_size=2),
    st.lists(st.sampled_from([*CASES, "ln1", "attn", ""]), max_size=4),
    st.frozensets(st.sampled_from(CASES), max_size=3),
    st.dictionaries(st.text(max_size=3), _atoms, max_size=2),
    st.dictionaries(st.sampled_from(sorted(KINDS)), _atoms, max_size=2),
    st.lists(st.floats(1e-3, 1e3), max_size=4),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arg=st.sampled_from(sorted(VALID, key=lambda k: (k[0].__name__, k[1]))), value=NONSENSE)
def test_every_public_argument_fails_clearly_at_construction(arg, value):
    """Any value of any public constructor argument either constructs (exactly when it is
    valid) or raises MisconfigurationException at construction -- never another exception."""
    cls, name = arg
    valid = VALID[arg](value)
    try:
        cls(**{name: value})
    except MisconfigurationException as err:
        assert not valid, f"{cls.__name__}({name}={value!r}) was refused: {err}"
        assert name in str(err) or cls.__name__ in str(err)
    else:
        assert valid, f"{cls.__name__}({name}={value!r}) was accepted"


def test_argument_combinations_and_generators():
    with pytest.raises(MisconfigurationException, match="would never run"):
        FinalNormInvarianceMonitor(invariance_every_n_steps=None, on_validation=False)
    probe = StructureProbe(branch=(n for n in ("ln1", "attn")))  # a one-shot iterable
    assert probe.branch == ("ln1", "attn")
    mon = LayerNormMonitor(include=(p for p in ["*.ln1"]), every_n_steps=np.int64(3))
    assert mon.settings.include == ("*.ln1",) and mon.settings.every_n_steps == 3
    assert type(mon.settings.every_n_steps) is int


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(every_n_steps=0), dict(every_n_steps=-2), dict(every_n_steps=True),
        dict(every_n_steps=2.5), dict(include=[]), dict(exclude=[""]), dict(final_norm=""),
        dict(histograms="yes"), dict(keep_history=1),
    ],
)
def test_layernorm_monitor_bad_arguments(kwargs):
    with pytest.raises(MisconfigurationException):
        LayerNormMonitor(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(every_n_steps=0), dict(every_n_steps=None, on_validation=False),
        dict(cases=[]), dict(cases=["shift_7"]), dict(cases=["axis_5", "axis_5"]),
        dict(scales=[0.0]), dict(scales=[float("inf")]), dict(scales="abc"),
        dict(probe_size=0), dict(loss_fn=3), dict(on_validation=None), dict(sweep_every_n_steps=0),
    ],
)
def test_invariance_monitor_bad_arguments(kwargs):
    with pytest.raises(MisconfigurationException):
        FinalNormInvarianceMonitor(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"every_n_validations": 0}, "positive integer"),
        ({"every_n_validations": 1.5}, "positive integer"),
        ({"position": "last"}, "integer sequence position"),
        ({"blocks": 3}, "qualified name"),
        ({"branch": "ln1"}, "sequence of child names"),
        ({"rtol": 0.0}, r"float in \(0, 1\)"),
        ({"rtol": 2}, r"float in \(0, 1\)"),
        ({"norm_jacobians": "yes"}, "True or False"),
    ],
)
def test_probe_rejects_bad_arguments_early(kwargs, message):
    with pytest.raises(MisconfigurationException, match=message):
        StructureProbe(**kwargs)


def test_the_fuzz_covers_every_public_argument():
    """Every named argument and every setting a callback reads (``**fields`` builds its Settings)."""
    import dataclasses
    import inspect

    from lnmonitor.lightning.invariance_monitor import READS

    every_setting = [f.name for f in dataclasses.fields(Settings)]
    reading = ((LayerNormMonitor, every_setting), (FinalNormInvarianceMonitor, READS), (StructureProbe, []))
    for cls, reads in reading:
        params = inspect.signature(cls).parameters.values()
        names = [p.name for p in params if p.kind is not p.VAR_KEYWORD] + list(reads)
        assert [n for n in names if (cls, n) not in VALID] == [], cls.__name__


def test_every_monitor_takes_one_settings_object_with_one_name_a_setting():
    """One dataclass, a docstring per field, checked when built; every monitor accepts it as
    ``settings=`` or builds it from keyword arguments of the same names, and reads back the
    same object; the same nonsense gets the same refusal; a name a monitor does not read, and
    a settings object beside keyword settings, are refused with what to pass."""
    import ast
    import dataclasses
    import inspect

    from lnmonitor import LoopMonitor
    from lnmonitor.core.monitor.arguments import ArgumentError

    pytest.importorskip("transformers")
    from lnmonitor.integrations.transformers import LNMonitorCallback

    given = dict(every_n_steps=4, include=["*.ln*"], exclude="*.ln2", final_norm="lnf", ladder=None,
                 images=False, image_every_n_steps=7, summary=False, keep_history=True,
                 invariance_every_n_steps=None, findings={"loss_blowup": None})
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    expected = Settings(**given)
    built = [LayerNormMonitor(**given), LNMonitorCallback(**given)]
    handed = [LayerNormMonitor(settings=expected), LNMonitorCallback(settings=expected),
              LoopMonitor(model, settings=Settings(**{**given, "include": None, "exclude": None,
                                                      "final_norm": None}))]
    assert all(m.settings == expected for m in built) and handed[0].settings is expected
    assert handed[2].settings.image_every_n_steps == 7 and expected.include == ("*.ln*",)
    inv = FinalNormInvarianceMonitor(settings=Settings(invariance_every_n_steps=3, probe_size=8))
    assert (inv.invariance_every_n_steps, inv.probe_size) == (3, 8)

    # a docstring under every field (attribute docstrings, read from the source)
    tree = ast.parse(inspect.getsource(Settings))
    body = tree.body[0].body
    documented = {node.target.id for node, after in zip(body, body[1:], strict=False)
                  if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)}
    assert documented == {f.name for f in dataclasses.fields(Settings)}

    with pytest.raises(MisconfigurationException, match="image_every_n_steps"):
        LayerNormMonitor(image_every_n_steps=0)
    for monitor in (lambda: LNMonitorCallback(image_every_n_steps=0),
                    lambda: LoopMonitor(model, image_every_n_steps=0)):
        with pytest.raises(ArgumentError, match="image_every_n_steps"):
            monitor()
    with pytest.raises(MisconfigurationException,
                       match="no setting 'every_n_steps'.*invariance_every_n_steps"):
        FinalNormInvarianceMonitor(every_n_steps=500)  # the ladder's cadence: the probe's has its own name
    with pytest.raises(ArgumentError, match="no setting 'evry_n_steps'; did you mean 'every_n_steps'"):
        LoopMonitor(model, evry_n_steps=5)
    with pytest.raises(ArgumentError, match="not both"):
        LNMonitorCallback(settings=expected, every_n_steps=3)
