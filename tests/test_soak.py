"""A short soak (scripts/soak.py runs the long one): calls that switch branches, record, evict and
reset from four threads; RSS, pool bytes and live outputs must not grow, results must be right."""

import importlib.util
import os

from helpers import ROOT


def _soak_module():
    spec = importlib.util.spec_from_file_location("soak", os.path.join(ROOT, "scripts", "soak.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_short_soak_grows_nothing():
    soak = _soak_module()
    rows, errors = soak.soak(calls=24_000, threads=4, samples=8)
    assert errors == []
    assert len(rows) == 8 and rows[-1][0] >= 20_000
    assert soak.grew(rows) == []
