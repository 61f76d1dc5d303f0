"""Packaging, import hygiene and argument validation."""

import json
import os
import subprocess
import sys

import pytest
import torch

import graphtrees

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


@pytest.mark.no_ext_ok
def test_import_does_not_initialise_cuda():
    r = _run("import graphtrees, torch; assert not torch.cuda.is_initialized(); print('ok')")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


@pytest.mark.no_ext_ok
def test_missing_extension_gives_actionable_error():
    code = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "graphtrees._C":
            raise ImportError("simulated missing extension")
sys.meta_path.insert(0, Block())
import graphtrees
assert not graphtrees.has_ext()
try:
    graphtrees.cudagraphify(lambda x: x)
except ImportError as e:
    print(e)
"""
    r = _run(code)
    assert r.returncode == 0, r.stderr
    assert "graphtrees._C" in r.stdout and "pip install --no-build-isolation -e ." in r.stdout


def test_info_command():
    r = subprocess.run([sys.executable, "-m", "graphtrees.info"], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout.strip().splitlines()[-1])
    assert data["extension_loaded"] is True
    assert "cpu" in data["backends"] and data["torch"] == torch.__version__


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(static_argnums=(-1,)), ValueError, "non-negative"),
        (dict(static_argnums=("a",)), ValueError, "non-negative"),
        (dict(warmup_iters=0), ValueError, "warmup_iters"),
        (dict(rerecord_limit=-1), ValueError, "rerecord_limit"),
    ],
)
def test_argument_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        graphtrees.cudagraphify(lambda x: x, **kwargs)


def test_not_callable():
    with pytest.raises(TypeError, match="expects a callable"):
        graphtrees.cudagraphify(42)


def test_repr_and_module_attribute():
    m = torch.nn.Linear(2, 2)
    g = graphtrees.cudagraphify(m)
    assert "Linear" in repr(g) and g.module is m


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_BIND_NOW is a glibc loader switch")
def test_every_symbol_of_the_extension_resolves_against_this_torch():
    # Lazy binding would only report a symbol missing from this torch (the CUDA backend's calls
    # included) when it is first called, possibly on a GPU machine; resolve them all at import.
    env = dict(os.environ, LD_BIND_NOW="1")
    r = subprocess.run([sys.executable, "-c", "import torch, graphtrees._C; print('ok')"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
