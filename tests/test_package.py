"""Packaging, import hygiene and argument validation."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import graphtrees

from helpers import ROOT


def _run(code):
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


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
    r = subprocess.run(
        [sys.executable, "-m", "graphtrees.info"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].split() == ["graphtrees", graphtrees.__version__]  # a table, printed once
    assert not any(line.startswith("{") for line in lines)
    assert sum(line.startswith("torch ") for line in lines) == 1
    assert ["extension_loaded", "True"] in [line.split() for line in lines]
    assert ["torch", torch.__version__] in [line.split() for line in lines]


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


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="LD_BIND_NOW is a glibc loader switch"
)
def test_every_symbol_of_the_extension_resolves_against_this_torch():
    # Lazy binding would only report a symbol missing from this torch (the CUDA backend's calls
    # included) when it is first called, possibly on a GPU machine; resolve them all at import.
    env = dict(os.environ, LD_BIND_NOW="1")
    r = subprocess.run(
        [sys.executable, "-c", "import torch, graphtrees._C; print('ok')"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_info_reports_the_build_and_the_cuda_backend():
    r = subprocess.run(
        [sys.executable, "-m", "graphtrees.info", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
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
            if h in ("cpu/CpuBackend.h", "cpu/CpuPool.h", "cuda/CudaBackend.h"):
                allowed = {
                    "BackendFactory.cpp",
                    "cpu/CpuBackend.cpp",
                    "cpu/CpuPool.cpp",
                    "cpu/ProgramRecorder.cpp",
                    "cpu/RoutingAllocator.cpp",
                    "cuda/CudaBackend.cpp",
                }
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
        assert lines <= 600, f"csrc/{path} has {lines} lines"


def test_no_room_reaches_back_to_a_room_that_includes_it():
    # A room is a header and its source (TreeNode.h and TreeNode.cpp). WriteBack.cpp including
    # TreeNode.h, whose header includes WriteBack.h, was a loop no file-level check sees (design
    # review 6, S2): a room's source may include only rooms below it.
    rooms = {}
    for path, headers in _includes().items():
        room = os.path.splitext(path)[0]
        deps = rooms.setdefault(room, set())
        deps.update(os.path.splitext(h)[0] for h in headers if os.path.splitext(h)[0] != room)
    state = {}

    def visit(room, stack):
        state[room] = "open"
        for dep in sorted(rooms.get(room, ())):
            if state.get(dep) == "open":
                raise AssertionError(
                    "rooms include each other: " + " -> ".join(stack + [room, dep])
                )
            if dep not in state:
                visit(dep, stack + [room])
        state[room] = "done"

    for room in sorted(rooms):
        if room not in state:
            visit(room, [])


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


def _note_references():
    """(file, name, file it points at or None) for every `Note [name]` reference, and the files
    that define each Note (a line that is the Note's title)."""
    defined, refs = {}, []
    paths = [
        p
        for d in ("csrc", "graphtrees", "tests", "scripts", "benchmarks", "docs")
        for p in pathlib.Path(ROOT, d).rglob("*")
        if p.suffix in (".h", ".cpp", ".py", ".md", ".sh") and p.name != "test_package.py"
    ] + [
        pathlib.Path(ROOT, n)
        for n in ("README.md", "CONTRIBUTING.md", "setup.py")
        if os.path.exists(os.path.join(ROOT, n))
    ]
    for p in paths:
        text = p.read_text(errors="ignore")
        for m in re.finditer(r"^\s*(?://|#)\s*Note \[([^\]]+)\]\s*$", text, re.M):
            defined.setdefault(m.group(1), set()).add(p.name)
        sep = r"(?:\s|//|#)+"
        for m in re.finditer(
            r"Note" + sep + r"\[([^\]]+)\](?:" + sep + r"in" + sep + r"`?([\w/]+\.\w+)`?)?", text
        ):
            name = " ".join(re.sub(r"//|#", " ", m.group(1)).split())
            if name != "...":
                refs.append((p.relative_to(ROOT), name, m.group(2)))
    return defined, refs


def test_every_note_reference_names_a_note_that_exists_where_it_says():
    defined, refs = _note_references()
    assert len(refs) > 50
    for path, name, where in refs:
        assert name in defined, f"{path}: Note [{name}] is defined nowhere"
        if where is not None:
            assert os.path.basename(where) in defined[name], (
                f"{path}: Note [{name}] is not in {where} but in {sorted(defined[name])}"
            )


def test_counters_come_from_one_table_and_are_documented():
    C = graphtrees._ext.get_ext()
    counters = C.tree_counters
    assert {"num_replays", "num_recordings", "num_checkpoints", "bytes_released"} <= set(counters)
    info = graphtrees.tree_info("cpu")
    for name, doc in counters.items():
        assert info[name] == 0 and doc
        assert f"``{name}``: {doc}" in graphtrees.tree_info.__doc__


def test_docs_counter_table_is_the_cpp_table():
    text = open(os.path.join(ROOT, "docs", "api.md")).read()
    rows = re.findall(r"^\| `(\w+)` \| (.+) \|$", text, re.M)
    assert dict(rows) == graphtrees._ext.get_ext().tree_counters


def _github_anchor(title):
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces -> -."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


@pytest.mark.no_ext_ok
def test_relative_links_in_readme_and_docs_resolve():
    # README is a door to docs/: every relative link in it, in docs/ and in CONTRIBUTING.md names
    # a file or folder that exists and, with #anchor, a heading that file has.
    pages = [pathlib.Path(ROOT, n) for n in ("README.md", "CONTRIBUTING.md")]
    pages += sorted(pathlib.Path(ROOT, "docs").glob("*.md"))
    checked = 0
    for page in pages:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # code blocks
        text = re.sub(r"`[^`\n]*`", "", text)  # inline code
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: link {target}"
            assert dest.exists(), f"{where}: {path} does not exist"
            if anchor:
                seen, anchors = {}, set()
                body = re.sub(r"^```.*?^```", "", dest.read_text(), flags=re.M | re.S)
                for title in re.findall(r"^#{1,6} (.+)$", body, re.M):
                    a = _github_anchor(title)
                    anchors.add(a if a not in seen else f"{a}-{seen[a]}")
                    seen[a] = seen.get(a, 0) + 1
                assert anchor in anchors, f"{where}: no heading #{anchor} in {path or page.name}"
            checked += 1
    assert checked > 40


def test_failure_points_come_from_one_table():
    C = graphtrees._ext.get_ext()
    assert set(C.failure_points) == {
        "restore", "backend_restore", "partial_restore", "checkpoint", "capture_end",
        "end_allocate", "release_pool", "pool_alloc",
    }  # fmt: skip
    with pytest.raises(ValueError, match=", ".join(C.failure_points)):
        C._inject_failure("nowhere", 1)
    for point in C.failure_points:
        C._inject_failure(point, 1)
        assert C._pending_failures(point) == 1
        C._inject_failure(point, 0)


def test_graph_options_are_listed_once():
    import inspect

    C = graphtrees._ext.get_ext()
    params = inspect.signature(graphtrees.cudagraphify).parameters
    assert set(C.graph_option_names) <= set(params)
    g = graphtrees.cudagraphify(lambda x: x, warmup_iters=3, buckets=[8, 2, 8], on_overwrite="copy")
    assert g.options["warmup_iters"] == 3 and g.options["buckets"] == (2, 8)
    assert g.options["on_overwrite"] == "copy" and set(g.options) == set(C.graph_option_names)
    backend = graphtrees._dynamo_backend
    assert set(backend._GRAPH_OPTIONS) <= set(C.graph_option_names)
    assert set(backend._GRAPH_OPTIONS) <= set(backend._BACKEND_OPTIONS)


@pytest.mark.no_ext_ok
def test_the_hooks_module_lists_every_torch_function_import_replaces():
    code = """
import torch, torch.compiler, torch.cuda, torch.nn.modules.module as m
before = {"is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
          "cudagraph_mark_step_begin": torch.compiler.cudagraph_mark_step_begin,
          "tolist": torch.Tensor.tolist}
hooks = (len(m._global_parameter_registration_hooks), len(m._global_buffer_registration_hooks),
         len(m._global_module_registration_hooks))
import graphtrees, graphtrees._hooks as h
after = {"is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
         "cudagraph_mark_step_begin": torch.compiler.cudagraph_mark_step_begin,
         "tolist": torch.Tensor.tolist}
changed = sorted(k for k in before if before[k] is not after[k])
added = [len(m._global_parameter_registration_hooks) - hooks[0],
         len(m._global_buffer_registration_hooks) - hooks[1],
         len(m._global_module_registration_hooks) - hooks[2]]
print(changed, added)
for name in changed:
    assert name in h.__doc__, name
"""
    r = _run(code)
    assert r.returncode == 0, r.stderr
    assert "'tolist'" not in r.stdout  # only wrapped while a graph is being recorded


def _tool(name):
    import shutil

    search = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
    path = shutil.which(name, path=search)
    assert path, f"{name} is installed by scripts/run_tests.sh (pip install {name})"
    return path


def test_the_cpp_is_clang_formatted():
    sources = sorted(
        str(p)
        for d in ("csrc", "tests/cuda_standin")
        for p in pathlib.Path(ROOT, d).rglob("*")
        if p.suffix in (".h", ".cpp")
    )
    r = subprocess.run([_tool("clang-format"), "--dry-run", "--Werror", *sources],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]


def test_the_python_passes_ruff():
    r = subprocess.run([_tool("ruff"), "check", "--no-cache", "."], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:]
    r = subprocess.run([_tool("ruff"), "format", "--check", "--no-cache", "."],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:]


def test_info_names_the_folder_that_shadows_the_package(tmp_path):
    # Run from the folder holding a clone named "graphtrees": Python imports the clone's root as
    # a namespace package; the command must say so rather than fail on a missing __version__.
    (tmp_path / "graphtrees").symlink_to(ROOT, target_is_directory=True)
    r = subprocess.run(
        [sys.executable, "-m", "graphtrees.info"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert r.returncode == 1
    assert "instead of the installed package" in r.stderr
    assert str(tmp_path / "graphtrees") in r.stderr
    assert "__version__" not in r.stderr


def _two(x, y):
    return x + y


@pytest.mark.parametrize(
    "args, kwargs",
    [((1,), {}), ((1, 2, 3), {}), ((1, 2), {"z": 1})],
    ids=["too-few", "too-many", "unknown-keyword"],
)
def test_a_wrong_call_raises_the_functions_own_type_error(args, kwargs):
    g = graphtrees.cudagraphify(_two)
    args = tuple(torch.ones(2) * a for a in args)
    with pytest.raises(TypeError) as eager:
        _two(*args, **kwargs)
    with pytest.raises(TypeError) as graphed:
        g(*args, **kwargs)
    assert str(graphed.value) == str(eager.value)
    assert torch.equal(g(torch.ones(2), torch.ones(2)), torch.full((2,), 2.0))


def test_failed_calls_do_not_count_as_signatures(caplog):
    g = graphtrees.cudagraphify(_two)
    with caplog.at_level("WARNING", logger="graphtrees"):
        for n in range(12):
            with pytest.raises(TypeError):
                g(torch.ones(n + 1))
        for n in range(8):
            g(torch.ones(n + 1), torch.ones(n + 1))
    assert "distinct signatures" not in caplog.text
    with caplog.at_level("WARNING", logger="graphtrees"):
        g(torch.ones(20), torch.ones(20))
    assert "more than 8 distinct signatures" in caplog.text


def test_a_wrapped_module_behaves_like_the_module():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    model.config = {"hidden": 4}
    g = graphtrees.cudagraphify(model)
    assert g.config is model.config and g.training
    assert g.eval() is g and not model.training and not g.training
    assert g.train() is g and model.training
    assert g.requires_grad_(False) is g
    assert [p for p in g.parameters()] == list(model.parameters())
    assert g.state_dict().keys() == model.state_dict().keys()
    assert g[0] is model[0] and len(g) == 3 and list(g) == list(model)
    x = torch.randn(3, 4)
    with torch.no_grad():
        expect = model(x)
        for _ in range(3):
            assert torch.equal(g(x), expect)
    assert graphtrees.tree_info()["num_replays"] >= 1
    with pytest.raises(AttributeError, match="no_such_thing"):
        _ = g.no_such_thing
    f = graphtrees.cudagraphify(_two)
    assert bool(f)
    with pytest.raises(AttributeError):
        _ = f.parameters
    with pytest.raises(TypeError, match="wraps a function"):
        len(f)


def test_a_wrapper_of_a_wrapper_is_named_after_what_it_wraps():
    inner = graphtrees.cudagraphify(torch.nn.Linear(2, 2))
    outer = graphtrees.cudagraphify(inner)
    assert repr(outer) == "<graphtrees.GraphedCallable 'Linear'>"
    fn = graphtrees.cudagraphify(graphtrees.cudagraphify(_two))
    assert repr(fn) == "<graphtrees.GraphedCallable '_two'>"


def test_contributing_lists_every_room_module_and_note():
    # CONTRIBUTING's layout and Note index are how a newcomer finds a room (design review 6 found
    # 7 rooms, 5 modules and 18 Notes missing, and rooms listed that were gone).
    import re

    text = open(os.path.join(ROOT, "CONTRIBUTING.md")).read()
    layout = text[text.index("## Layout") : text.index("## Build")]
    index = text[text.index("## Notes in the code") :]
    rooms = {os.path.splitext(path)[0] for path in _includes()}
    for room in sorted(rooms):
        assert re.search(r"(?<![\w/])" + re.escape(room) + r"(?![\w])", layout), (
            f"csrc/{room} is not in CONTRIBUTING's layout"
        )
    listed = re.findall(r"^  ((?:cpu/|cuda/)?[A-Z]\w+)(?:\.h)?(?:,| )", layout, re.M)
    for room in listed:
        assert room in rooms or room == "bindings", f"CONTRIBUTING lists csrc/{room}, which is gone"
    for module in os.listdir(os.path.join(ROOT, "graphtrees")):
        if module.endswith((".py", ".pyi")):
            assert module in layout, f"graphtrees/{module} is not in CONTRIBUTING's layout"
    for base in ("csrc", "graphtrees", os.path.join("tests", "cuda_standin")):
        for d, _, files in os.walk(os.path.join(ROOT, base)):
            for f in files:
                if not f.endswith((".h", ".cpp", ".py")):
                    continue
                path = os.path.relpath(os.path.join(d, f), ROOT)
                for note in re.findall(
                    r"^\s*(?://|#) Note \[([^\]]+)\]\s*$", open(path).read(), re.M
                ):
                    row = next((r for r in index.splitlines() if f"`{path}`" in r), "")
                    assert row and note in [n.strip() for n in row.split("|")[1].split(";")], (
                        f"Note [{note}] ({path}) is not in CONTRIBUTING's Note index"
                    )
