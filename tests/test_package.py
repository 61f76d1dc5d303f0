"""Packaging, import hygiene and argument validation."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT

import graphtrees


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


def test_info_reports_the_build_and_the_cuda_backend():
    r = subprocess.run([sys.executable, "-m", "graphtrees.info"], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    data = json.loads(r.stdout.strip().splitlines()[-1])
    assert data["built_with_torch"] == torch.__version__.split("+")[0]
    assert isinstance(data["cuda_backend_enabled"], bool)
    if not data["cuda_backend_enabled"]:
        assert data["cuda_backend_disabled_because"]


def test_type_stub_matches_the_extension():
    import ast

    import graphtrees._C as C

    stub = ast.parse(open(os.path.join(ROOT, "graphtrees", "_C.pyi")).read())
    declared = set()
    for node in stub.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            declared.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            declared.add(node.target.id)
    public = {n for n in dir(C) if not n.startswith("__")}
    assert declared == public, (sorted(public - declared), sorted(declared - public))
    assert os.path.exists(os.path.join(ROOT, "graphtrees", "py.typed"))


def test_version_has_one_source():
    import re

    setup = open(os.path.join(ROOT, "setup.py")).read()
    assert "version=VERSION" in setup and not re.search(r'version="\d', setup)
    from graphtrees._version import __version__

    assert graphtrees.__version__ == __version__


def _includes():
    """csrc file -> the project headers it includes."""
    import re

    csrc = os.path.join(ROOT, "csrc")
    graph = {}
    for d, _, files in os.walk(csrc):
        for f in files:
            if f.endswith((".h", ".cpp")):
                path = os.path.relpath(os.path.join(d, f), csrc)
                text = open(os.path.join(d, f)).read()
                graph[path] = re.findall(r'#include "([^"]+)"', text)
    return graph


def test_only_the_factory_names_the_backends():
    for path, headers in _includes().items():
        for h in headers:
            if h in ("CpuBackend.h", "CpuPool.h", "cuda/CudaBackend.h"):
                allowed = {"BackendFactory.cpp", "CpuBackend.cpp", "CpuPool.cpp",
                           "cuda/CudaBackend.cpp"}
                assert path in allowed, f"{path} includes {h}"


def test_no_include_cycles_and_no_oversized_files():
    graph = _includes()
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for dep in graph.get(node, []):
            if state.get(dep) == "open":
                raise AssertionError("include cycle: " + " -> ".join(stack + [node, dep]))
            if dep not in state:
                visit(dep, stack + [node])
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node, [])
    for path in graph:
        lines = sum(1 for _ in open(os.path.join(ROOT, "csrc", path)))
        assert lines <= 700, f"csrc/{path} has {lines} lines"


def test_errors_reach_python_with_their_types():
    C = graphtrees._ext.get_ext()
    with pytest.raises(ValueError, match="unknown failure point"):
        C._inject_failure("nowhere", 1)
    with pytest.raises(TypeError, match="expects a callable"):
        C.GraphedCallable(42)
    with pytest.raises(ValueError, match="max_recorded_shapes must be an int >= 1"):
        graphtrees.compile(torch.nn.Linear(2, 2), max_recorded_shapes=0)
    with pytest.raises(TypeError, match="name must be a str"):
        graphtrees.cudagraphify(lambda x: x, name=3)
