"""What graphtrees shows of itself: profiler ranges (Note [Call ranges]), the tree as a picture
(tree_to_svg) and the coverage report (graphtrees.report, Note [Call statistics])."""

import gc
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import graphtrees
from graphtrees import cudagraphify, mark_step_begin
from graphtrees._ext import get_ext

from helpers import assert_close, assert_replays_ran_programs, info

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANGES = ("replay", "record", "warmup", "restore", "eager")


def _profile(fn, record_shapes=True):
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=record_shapes
    ) as prof:
        fn()
    return prof


def _ranges(prof):
    """graphtrees' ranges in the trace, in order: (kind, function, node, reason, event)."""
    out = []
    for e in prof.events():
        if e.name.startswith("graphtrees::"):
            kw = e.kwinputs or {}
            out.append(
                (e.name.split("::")[1], kw.get("function"), kw.get("node"), kw.get("reason"), e)
            )
    out.sort(key=lambda r: r[4].time_range.start)
    return out


def _seed_story(device):
    """g1 -> g2, then g1 -> g3 (a branch switch: the pool is restored to g1's checkpoint)."""
    g1 = cudagraphify(lambda x: x * 2 + 1, name="g1")
    g2 = cudagraphify(lambda h: h.sin(), name="g2")
    g3 = cudagraphify(lambda h: h.cos() * 3, name="g3")
    x = torch.randn(16, device=device)
    outs = []

    def run():
        for head in (g2, g2, g2, g3, g3, g3):
            mark_step_begin()
            outs.append(head(g1(x)))

    return x, run, outs


def test_every_call_is_one_range_named_for_what_happened(device):
    x, run, outs = _seed_story(device)
    prof = _profile(run)
    assert_close(outs[-1], (x * 2 + 1).cos() * 3)
    r = _ranges(prof)
    calls = [(k, f) for k, f, *_ in r if k != "restore"]
    assert calls == [
        ("warmup", "g1"), ("warmup", "g2"),
        ("record", "g1"), ("record", "g2"),
        ("replay", "g1"), ("replay", "g2"),
        ("replay", "g1"), ("warmup", "g3"),
        ("replay", "g1"), ("record", "g3"),
        ("replay", "g1"), ("replay", "g3"),
    ], calls  # fmt: skip
    nodes = {n["function"]: n["id"] for n in info(device)["nodes"]}
    for kind, function, node, _, _ in r:
        if kind in ("record", "replay"):
            assert node == nodes[function], (kind, function, node, nodes)
        elif kind == "warmup":
            assert node == -1
    # The branch switch restored the pool to g1's checkpoint, inside g3's warmup and recording.
    restores = [x for x in r if x[0] == "restore"]
    assert restores and all(f == "g1" and n == nodes["g1"] for _, f, n, _, _ in restores)
    for _, _, _, _, e in restores:
        (outer,) = [
            o for k, f, _, _, o in r
            if f == "g3" and k in ("warmup", "record") and o.time_range.start <= e.time_range.start
            and e.time_range.end <= o.time_range.end
        ]  # fmt: skip


def test_the_replay_range_encloses_the_input_copies_and_the_replayed_ops():
    f = cudagraphify(lambda x: torch.relu(x * 2) + 1, name="f")
    x = torch.randn(32)
    for _ in range(3):
        mark_step_begin()
        f(x)
    mark_step_begin()
    prof = _profile(lambda: f(x))
    ((kind, function, node, _, rng),) = _ranges(prof)
    assert (kind, function, node) == ("replay", "f", info("cpu")["nodes"][0]["id"])
    inside = [
        e.name
        for e in prof.events()
        if e is not rng and e.thread == rng.thread
        and rng.time_range.start <= e.time_range.start <= e.time_range.end <= rng.time_range.end
    ]  # fmt: skip
    assert "aten::copy_" in inside and "aten::relu" in inside, inside
    assert_replays_ran_programs("cpu")


def _outermost(ranges):
    def inside(e, o):
        return o is not e and o.time_range.start <= e.time_range.start <= e.time_range.end <= (
            o.time_range.end
        )

    return [r for r in ranges if not any(inside(r[4], o[4]) for o in ranges)]


def test_eager_runs_carry_their_reason(device):
    def reads_host(x):
        return x * float(x.sum())  # a host read: never recordable

    f = cudagraphify(reads_host, name="reads_host")
    g = cudagraphify(lambda x: x + 1, name="g")
    x = torch.randn(8, device=device)
    w = torch.randn(8, device=device, requires_grad=True)

    def run():
        for _ in range(4):
            mark_step_begin()
            f(x)
        g(w)  # autograd needed: decided before the tree is asked

    prof = _profile(run)
    r = _ranges(prof)
    assert [(k, fn) for k, fn, *_ in _outermost(r)] == [
        ("warmup", "reads_host"),
        ("record", "reads_host"),  # refused: eager (CPU: the recording's run is the result)
        ("eager", "reads_host"),
        ("eager", "reads_host"),
        ("eager", "g"),
    ]
    reason = f.signatures()[0]["eager_reason"]
    assert reason and all(
        why == reason for k, fn, _, why, _ in r if fn == "reads_host" and k == "eager"
    )
    if device == "cpu":  # the CPU emulation names the line that read the host
        assert "host" in reason and "test_observability.py:" in reason, reason
    (why_g,) = [why for k, fn, _, why, _ in r if fn == "g"]
    assert "grad" in why_g, why_g


def test_the_chrome_trace_shows_the_ranges(device, tmp_path):
    x, run, _ = _seed_story(device)
    prof = _profile(run)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["name"] for e in events if e.get("name", "").startswith("graphtrees::")}
    assert names == {f"graphtrees::{k}" for k in ("replay", "record", "warmup", "restore")}
    replays = [e for e in events if e.get("name") == "graphtrees::replay"]
    assert all(e["ph"] == "X" and e["dur"] >= 0 and e["cat"] == "user_annotation" for e in replays)


def test_without_a_profiler_no_range_begins(device):
    f = cudagraphify(lambda x: x * 3, name="quiet")
    x = torch.randn(8, device=device)
    before = get_ext()._call_ranges_begun()
    for _ in range(5):
        mark_step_begin()
        f(x)
    assert get_ext()._call_ranges_begun() == before
    prof = _profile(lambda: f(x), record_shapes=False)  # no inputs asked for: names only
    ((kind, function, node, _, _),) = _ranges(prof)
    assert kind == "replay" and function is None and node is None
    assert get_ext()._call_ranges_begun() == before + 1


def test_ranges_are_not_recorded_as_ops_nor_trip_the_recording_checks():
    # Recorded entirely under the profiler: the CPU emulation's observers (the op program, host
    # reads, input mutations, placeholder views) see the ops and never the ranges.
    def f(x, y):
        y.add_(1)  # a mutation of a copied input, written back
        return (x.view(-1) * 2).sum(0, keepdim=True) + y[:1]

    g = cudagraphify(f, name="checked")
    x, y = torch.randn(4, 4), torch.zeros(4)
    with torch.profiler.profile(record_shapes=True) as prof:
        for _ in range(4):
            mark_step_begin()
            out = g(x, y)
        with torch.profiler.record_function("user range"):  # the user's own, inside a call too
            mark_step_begin()
            out = g(x, y)
    assert_close(out, (x.view(-1) * 2).sum(0, keepdim=True) + 5)
    assert_close(y, torch.full((4,), 5.0))
    t = info("cpu")
    assert t["num_fallbacks"] == 0 and t["num_nodes"] == 1, t
    assert_replays_ran_programs("cpu")
    kinds = [k for k, *_ in _ranges(prof)]
    assert kinds == ["warmup", "record", "replay", "replay", "replay"], kinds


def _cuda_include():
    """The CUDA headers' folder, found as setup.py finds it, if it has NVTX 3."""
    import glob

    from torch.utils.cpp_extension import CUDA_HOME

    homes = [os.environ.get("CUDA_HOME"), CUDA_HOME, "/usr/local/cuda"]
    for home in homes + sorted(glob.glob("/usr/local/cuda-*"), reverse=True):
        if home and os.path.exists(os.path.join(home, "include", "nvtx3", "nvToolsExt.h")):
            return os.path.join(home, "include")
    return None


@pytest.mark.needs_cuda
def test_nvtx_ranges_reach_an_injected_tool(tmp_path):
    # tests/nvtx_tool.c is an NVTX tool as Nsight Systems injects one (NVTX_INJECTION64_PATH): it
    # logs the ranges pushed. A process of its own: NVTX reads the variable once.
    inc = _cuda_include()
    assert inc is not None, "the CUDA headers the extension was built with have nvtx3"
    tool = tmp_path / "nvtx_tool.so"
    src = os.path.join(ROOT, "tests", "nvtx_tool.c")
    subprocess.run(["cc", "-shared", "-fPIC", "-I", inc, src, "-o", str(tool)], check=True)
    log = tmp_path / "nvtx.log"
    script = (
        "import torch, graphtrees\n"
        "f = graphtrees.cudagraphify(lambda x: x * 2, name='doubled')\n"
        "x = torch.ones(4, device='cuda')\n"
        "for _ in range(3):\n"
        "    graphtrees.mark_step_begin()\n"
        "    f(x)\n"
        "g = graphtrees.cudagraphify(lambda x: x + 1, name='needs_grad')\n"
        "g(torch.ones(4, device='cuda', requires_grad=True))\n"  # eager, decided before the tree
        "torch.cuda.synchronize()\n"
    )
    env = dict(os.environ, NVTX_INJECTION64_PATH=str(tool), GRAPHTREES_NVTX_LOG=str(log))
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in log.read_text().splitlines() if "graphtrees::" in ln or ln == "pop"]
    assert lines == [
        "push graphtrees::warmup doubled",
        "pop",
        "push graphtrees::record doubled #0",
        "pop",
        "push graphtrees::replay doubled #0",
        "pop",
        "push graphtrees::eager needs_grad: it needs autograd: grad mode is on and an input "
        "requires grad. Call it under torch.no_grad() or torch.inference_mode() to graph it",
        "pop",
    ], lines


# ---- the picture -----------------------------------------------------------------------------

needs_dot = pytest.mark.skipif(
    shutil.which("dot") is None,
    reason="Graphviz's dot is not installed (scripts/run_tests.sh installs it: apt-get install "
    "graphviz)",
)


@needs_dot
def test_tree_to_svg_draws_every_node(device, tmp_path):
    x, run, _ = _seed_story(device)
    run()
    piece = cudagraphify(lambda h: h - 1, name="graph0.forward[2/3]")  # named as a split's piece
    for _ in range(3):
        mark_step_begin()
        kept = piece(x)  # alive: its node is drawn with a live output
    path = tmp_path / "tree.svg"
    svg = graphtrees.tree_to_svg(device, path=str(path))
    assert path.read_text() == svg and svg.lstrip().startswith("<?xml") and "<svg" in svg
    t = info(device)
    titles = re.findall(r"<title>(n\d+)</title>", svg)
    assert sorted(titles) == sorted(f"n{n['id']}" for n in t["nodes"])
    for n in t["nodes"]:
        assert f"#{n['id']} {n['function']}" in svg
        assert f"replays: {n['replays']}" in svg
    kinds = {n["function"]: n["kind"] for n in t["nodes"]}
    assert kinds == {"g1": "graph", "g2": "graph", "g3": "graph", "graph0.forward[2/3]": "piece"}
    assert "(piece)" in svg and "stroke-dasharray" in svg  # the piece is dashed
    assert svg.count('stroke="#c00000"') >= 1  # the current path
    assert "live outputs: 1" in svg and 'fill="#c6efce"' in svg
    del kept


def test_tree_to_svg_says_how_to_install_graphviz(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot there
    with pytest.raises(graphtrees.GraphvizNotFoundError) as e:
        graphtrees.tree_to_svg("cpu")
    for how in ("apt-get install graphviz", "conda install graphviz", "brew install graphviz"):
        assert how in str(e.value)
    assert "tree_to_dot" in str(e.value)


# ---- the report ------------------------------------------------------------------------------


def test_report_counts_calls_reasons_and_pool_bytes(device):
    graphtrees.reset_report()
    x, run, _ = _seed_story(device)
    run()
    reads_host = cudagraphify(lambda x: x * float(x.sum()), name="reads_host")
    few = cudagraphify(lambda x: x + 1, name="few", buckets=[4])
    for _ in range(3):
        mark_step_begin()
        reads_host(x)
        few(x)  # 16 > the largest bucket: eager
    r = graphtrees.report(format="dict")
    by = {f["name"]: f for f in r["functions"]}
    assert (by["g1"]["calls"], by["g1"]["warmups"], by["g1"]["recordings"]) == (6, 1, 1)
    assert by["g1"]["replays"] == 4 and by["g1"]["recorded_fraction"] == round(4 / 6, 4)
    assert [(n["function"], n["pool_bytes"] > 0) for n in by["g1"]["nodes"]] == [("g1", True)]
    assert by["g1"]["pool_bytes"] == sum(n["pool_bytes"] for n in info(device)["nodes"][:1])
    assert by["reads_host"]["eager"] == 2 and by["reads_host"]["warmups"] == 1
    ((host,),) = [[e for e in by["reads_host"]["eager_reasons"]]]
    assert host["count"] == 2 and host["kind"] == "host sync", host
    ((bucket,),) = [by["few"]["eager_reasons"]]
    assert bucket["count"] == 3 and bucket["kind"] == "thrashing shapes", bucket
    s = r["summary"]
    assert s["calls"] == sum(f["calls"] for f in r["functions"]) == 12 + 3 + 3
    assert json.loads(graphtrees.report(format="json"))["summary"] == s
    text = graphtrees.report()
    assert text.splitlines()[0].startswith(f"graphtrees: {s['calls']} calls of")
    assert "g1: 6 calls: 4 replayed (66.7%), 1 recorded, 1 warmed up, 0 eager" in text
    assert "eager x3 [thrashing shapes]: its batch size" in text
    with pytest.raises(ValueError, match="format"):
        graphtrees.report(format="xml")
    graphtrees.reset_report()
    assert graphtrees.report(format="dict")["summary"]["calls"] == 0


def test_report_of_a_compiled_model_shows_its_pieces_and_graph_breaks():
    @torch.library.custom_op(
        "graphtrees_obs::host_op", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,)
    )
    def host_op(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @host_op.register_fake
    def _(x):
        return torch.empty_like(x)

    def model(x):
        h = torch.tanh(x) * 2 + 1
        h = torch.sigmoid(host_op(h)) * 3 - h  # an op no recording can repeat: a split
        torch._dynamo.graph_break()  # a deliberate graph break
        return torch.cos(h) * 2 + h

    torch._dynamo.reset()
    graphtrees.reset_report()
    compiled = graphtrees.compile(model, inner="aot_eager", min_piece_ops=1)
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(4):
            mark_step_begin()
            assert_close(compiled(x), model(x))
    r = graphtrees.report(format="dict")
    assert r["summary"]["graph_breaks"] >= 1 and r["graph_breaks"]
    ((graph, split),) = r["compiled"].items()
    assert split["recorded_pieces"] == 2 and split["eager_pieces"] == 1, split
    names = {f["name"] for f in r["functions"]}
    assert {p["piece"] for p in split["pieces"]} <= names
    graphed = [f for f in r["functions"] if f["id"] is not None]
    assert all(f["replays"] == 2 for f in graphed), r["functions"]
    # The eager piece's runs are eager calls (review of issue 49, #4).
    (eager,) = [f for f in r["functions"] if f["id"] is None and f["name"].startswith(graph)]
    assert eager["calls"] == eager["eager"] == 4 and eager["nodes"] == [], eager
    assert [e["kind"] for e in eager["eager_reasons"]] == ["eager piece"]
    s = r["summary"]
    assert s["eager"] >= 4 and s["eager_pieces"] == 1 and s["recorded_fraction"] < 0.5, s
    text = graphtrees.report()
    assert f"compiled graph {graph}: 3 pieces, 2 recorded, 1 eager" in text
    assert "graph breaks (torch._dynamo)" in text
    # reset_report() starts dynamo's graph breaks and the eager pieces' runs from zero (#15).
    graphtrees.reset_report()
    s = graphtrees.report(format="dict")["summary"]
    assert (s["calls"], s["graph_breaks"], s["eager_pieces"]) == (0, 0, 0), s
    with torch.no_grad():
        mark_step_begin()
        compiled(x)
    s = graphtrees.report(format="dict")["summary"]
    assert s["eager_pieces"] == 1 and s["eager"] >= 1 and s["graph_breaks"] == 0, s
    torch._dynamo.reset()


def test_report_command_and_the_summary_at_exit(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        "import sys, torch, graphtrees\n"
        "f = graphtrees.cudagraphify(lambda x: x * 2, name='doubled')\n"
        "for _ in range(int(sys.argv[1])):\n"
        "    graphtrees.mark_step_begin()\n"
        "    f(torch.ones(3))\n"
    )
    env = dict(os.environ, GRAPHTREES_REPORT="1", PYTHONPATH=ROOT)
    r = subprocess.run(
        [sys.executable, "-m", "graphtrees.report", "--json", "--", str(script), "5"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    (f,) = report["functions"]
    assert (f["name"], f["calls"], f["replays"]) == ("doubled", 5, 3)
    assert "graphtrees: 5 calls of 1 functions: 3 replayed (60.0%)" in r.stderr


# ---- review of issue 49 ----------------------------------------------------------------------


def test_report_stays_callable_after_importing_its_module():
    import importlib

    module = importlib.import_module("graphtrees.report")  # what `import graphtrees.report` does
    assert callable(module) and module.main is graphtrees._report.main
    assert graphtrees.report().startswith("graphtrees: ")  # the package attribute may be either
    assert graphtrees.report(format="dict")["summary"] == module(format="dict")["summary"]


def test_report_files_nodes_and_counts_by_callable_not_name():
    graphtrees.reset_report()
    a = cudagraphify(lambda x: x + 1, name="same")  # always replays
    b = cudagraphify(lambda x: x * x.sum().item(), name="same")  # never records: a host read
    c = cudagraphify(lambda x: x * 2, name="layer#3")  # a '#' of the user's own
    x = torch.randn(4)
    for _ in range(5):
        mark_step_begin()
        a(x), b(x), c(x)
    fs = graphtrees.report(format="dict")["functions"]
    lambdas = sorted((f for f in fs if f["name"] == "same"), key=lambda f: f["id"])
    assert [(f["replays"], f["eager"], len(f["nodes"])) for f in lambdas] == [(3, 0, 1), (0, 4, 0)]
    assert [f["label"] for f in lambdas] == [f"same (id {f['id']})" for f in lambdas]
    (layer,) = [f for f in fs if f["name"] == "layer#3"]
    assert layer["label"] == "layer#3" and layer["calls"] == 5
    assert [n["function"] for n in layer["nodes"]] == ["layer#3"] and layer["pool_bytes"] > 0
    assert len(fs) == 3, fs
    assert f"same (id {lambdas[0]['id']}): 5 calls" in graphtrees.report()


def test_a_pieces_second_signature_is_a_piece():
    p = cudagraphify(lambda h: h - 1, name="graph0.forward[2/3]")
    for n in (8, 16):
        for _ in range(3):
            mark_step_begin()
            p(torch.randn(n))
    kinds = {n["function"]: n["kind"] for n in info("cpu")["nodes"]}
    assert kinds == {"graph0.forward[2/3]": "piece", "graph0.forward[2/3]#1": "piece"}, kinds
    assert 'style="rounded,dashed"' in graphtrees.tree_to_dot("cpu").split("#1 graph0")[0][-300:]


def test_a_call_that_raises_is_counted_nowhere_and_closes_its_ranges():
    def bad(x):
        raise ValueError("user error")

    graphtrees.reset_report()
    before = cudagraphify(bad, name="raises_before_the_tree")  # autograd: fallback()
    in_tree = cudagraphify(bad, name="raises_in_the_tree")
    w, x = torch.randn(4, requires_grad=True), torch.randn(4)

    def run():
        for _ in range(3):
            for fn, arg in ((before, w), (in_tree, x)):
                with pytest.raises(ValueError):
                    fn(arg)

    prof = _profile(run)
    assert graphtrees.report(format="dict")["summary"]["calls"] == 0
    r = _ranges(prof)
    assert {fn for _, fn, *_ in r} == {"raises_before_the_tree", "raises_in_the_tree"}
    assert all(e.time_range.end >= e.time_range.start for *_, e in r)


def test_host_reads_name_the_users_line_not_graphtrees_nor_a_torch_named_folder(tmp_path):
    user = tmp_path / "torch" / "mymodel.py"  # the user's code in a folder named torch
    user.parent.mkdir()
    user.write_text("def body(x):\n    return x + len(x.tolist())\n")
    import importlib.util

    spec = importlib.util.spec_from_file_location("mymodel_r49", user)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    f = cudagraphify(mod.body, name="tolist_in_user_code")
    g = cudagraphify(lambda x: x + len(x.tolist()), name="tolist_here")
    for _ in range(3):
        mark_step_begin()
        f(torch.randn(4)), g(torch.randn(4))
    why_f = f.signatures()[0]["eager_reason"]
    why_g = g.signatures()[0]["eager_reason"]
    assert f"at {user}:2" in why_f, why_f
    assert "test_observability.py:" in why_g and "_hooks.py" not in why_g, why_g


def test_reason_kinds_come_from_where_the_reason_is_made():
    graphtrees.reset_report()
    x = torch.randn(8)
    autograd = cudagraphify(lambda x: x + 1, name="autograd")
    buckets = cudagraphify(lambda x: x + 1, name="buckets", buckets=[2])
    host = cudagraphify(lambda x: x + len(x.tolist()), name="host")
    blind = cudagraphify(lambda x: x * 2, name="blind")
    for _ in range(3):
        mark_step_begin()
        autograd(torch.randn(8, requires_grad=True)), buckets(x), host(x)
    torch._C._autograd._enable_record_function(False)
    try:
        blind(x)
    finally:
        torch._C._autograd._enable_record_function(True)
    kinds = {
        f["name"]: sorted({e["kind"] for e in f["eager_reasons"]})
        for f in graphtrees.report(format="dict")["functions"]
        if f["eager_reasons"]
    }
    assert kinds == {
        "autograd": ["autograd"],
        "buckets": ["thrashing shapes"],
        "host": ["host sync"],
        "blind": ["record function off"],
    }, kinds
    # The tree's sources that a CPU test cannot reach, by the text they begin with.
    kind = get_ext()._tree_reason_kind
    assert (
        kind(
            "it was called on another thread while a call on its tree ran user code (a nested "
            "graphed call, as a backward that autograd runs on its device thread ...)"
        )
        == "another thread"
    )
    assert (
        kind(
            "it was called while another thread's capture (or budgeted warmup) on cuda:0 ran user "
            "code (a thread it starts and joins, say) and held the device (waited 5 ms)"
        )
        == "capture elsewhere"
    )
    assert kind("it ran out of memory while recording it (CUDA out of memory)") == "memory budget"
    assert kind("it was re-recorded 2 times (rerecord_limit=2), last because x") == (
        "re-recorded too often"
    )
    assert kind("its replay failed: x") == "graphtrees failure"
    assert set(graphtrees._report.REASON_KINDS) >= {k for ks in kinds.values() for k in ks}


def test_tree_to_svg_in_an_ascii_locale_and_no_dynamo_import_at_exit(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "dot").write_text("#!/bin/sh\ncat\n")  # echoes the DOT: enough to see the bytes
    (fake / "dot").chmod(0o755)
    script = (
        "import sys, torch, graphtrees\n"
        "from graphtrees import _report\n"
        "f = graphtrees.cudagraphify(lambda x: x + 1, name='\\u6a21\\u578b')\n"
        "for _ in range(3):\n"
        "    graphtrees.mark_step_begin(); f(torch.randn(4))\n"
        "assert '\\u6a21\\u578b' in graphtrees.tree_to_svg('cpu')\n"
        "_report.summary_line()\n"
        "print('dynamo imported:', 'torch._dynamo' in sys.modules)\n"
    )
    env = dict(os.environ, LC_ALL="C", PYTHONUTF8="0", PYTHONCOERCECLOCALE="0")
    env["PATH"] = str(fake) + os.pathsep + env["PATH"]
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONIOENCODING"] = "utf-8"
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       encoding="utf-8", timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "dynamo imported: False" in r.stdout


def test_tree_to_svg_gives_up_on_a_dot_that_hangs(monkeypatch, tmp_path):
    (tmp_path / "dot").write_text("#!/bin/sh\nexec sleep 30\n")
    (tmp_path / "dot").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path) + os.pathsep + os.environ["PATH"])
    monkeypatch.setattr(graphtrees._api, "SVG_TIMEOUT_S", 0.5)
    with pytest.raises(RuntimeError, match="did not finish in 0.5 s"):
        graphtrees.tree_to_svg("cpu")


def test_call_statistics_of_freed_uncalled_callables_are_dropped():
    ext = get_ext()
    graphtrees.reset_report()
    before = len(ext._call_stats())
    for _ in range(3000):  # made per request, never called: not kept
        cudagraphify(lambda x: x + 1, name="per_request")
    # Bounded by about twice what is alive or counted (the sweep runs when the list doubled; a
    # callable in a reference cycle lives until the collector runs), not by what was made.
    assert len(ext._call_stats()) <= 2 * before + 200, (before, len(ext._call_stats()))
    kept = cudagraphify(lambda x: x + 1, name="kept_and_called")
    kept(torch.randn(2))
    for _ in range(300):
        cudagraphify(lambda x: x + 1, name="per_request")
    del kept
    for _ in range(300):
        cudagraphify(lambda x: x + 1, name="per_request")
    names = [s["name"] for s in ext._call_stats()]
    assert "kept_and_called" in names  # freed, but it counted a call: kept until reset_report()
    graphtrees.reset()  # the tree's warmup state holds the callable too
    gc.collect()
    graphtrees.reset_report()
    assert "kept_and_called" not in [s["name"] for s in ext._call_stats()]


def test_dot_labels_show_ampersands_literally():
    f = cudagraphify(lambda x: x + 1, name="a&amp;b")
    for _ in range(3):
        mark_step_begin()
        f(torch.randn(2))
    assert "a&amp;amp;b" in graphtrees.tree_to_dot("cpu")


def test_report_command_reports_a_failing_script_and_keeps_its_exit(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        "import sys, torch, graphtrees\n"
        "f = graphtrees.cudagraphify(lambda x: x * 2, name='doubled')\n"
        "f(torch.ones(3))\n"
        "print('argv', sys.argv[1:])\n"
        "if sys.argv[-1] == 'raise': raise ValueError('the script failed')\n"
        "sys.exit('a message of the script')\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT)
    # Options end at the script: its own --json is its own.
    for args, argv, err in (
        ([str(script), "--json", "raise"], "['--json', 'raise']", "ValueError: the script failed"),
        (["--", str(script), "exit"], "['exit']", "a message of the script"),
    ):
        r = subprocess.run([sys.executable, "-m", "graphtrees.report", *args], capture_output=True,
                           text=True, env=env, cwd=tmp_path, timeout=120)  # fmt: skip
        assert r.returncode == 1, r.stderr
        assert f"argv {argv}" in r.stdout, r.stdout
        assert "doubled: 1 calls" in r.stdout, r.stdout  # the text report, after the failure
        assert r.stderr.rstrip().endswith(err), r.stderr[-2000:]
