"""How much of a program ran recorded: :func:`report`, and ``python -m graphtrees.report``
(graphtrees/report.py, which calls :func:`main`).

    python -m graphtrees.report [--json] -- script.py [args...]

runs ``script.py`` (as ``python script.py args...`` would, in this process) and prints the report
when it ends. With ``GRAPHTREES_REPORT=1`` in the environment any program logs a one-line summary
at exit on the ``graphtrees`` logger (and prints it to stderr when logging is not configured).

For each wrapped function and compiled graph (one per ``cudagraphify()`` call or AOT graph that
graphtrees wraps): its calls that replayed, recorded, warmed up and ran eagerly, the eager runs'
reasons grouped and counted (Note [Call statistics] in csrc/CallStats.h), and its recordings
with the pool bytes each wrote; for compiled models, the graphs graphtrees split into pieces
(:func:`graphtrees.split_info`) and dynamo's graph breaks. Counts are process-wide (every thread,
every device) since the start or :func:`reset_report`; nodes are the calling thread's trees.
"""

import atexit
import json
import logging
import os
import re
import runpy
import sys
from typing import Any

import torch

_logger = logging.getLogger("graphtrees")

# The kind of an eager run's reason, by what its text says (the reasons are written in
# csrc/ and graphtrees/; tests/test_observability.py runs one of each).
_REASON_KINDS = [
    (
        "host sync",
        re.compile(
            r"on the host|host read|\.item\(\)|synchronis|host sync|while .*capturing", re.I
        ),
    ),
    ("thrashing shapes", re.compile(r"max_recorded_shapes|above the largest bucket", re.I)),
    ("memory budget", re.compile(r"memory budget|out of memory", re.I)),
    ("re-recorded too often", re.compile(r"rerecord_limit", re.I)),
    ("unsupported op", re.compile(r"cannot be recorded|unsupported|cannot record", re.I)),
    ("autograd", re.compile(r"autograd|requires_grad|grad mode", re.I)),
    ("arguments", re.compile(r"argument", re.I)),
]


def reason_kind(reason: str) -> str:
    """The kind of an eager run's reason: "host sync", "unsupported op", "thrashing shapes",
    "memory budget", "re-recorded too often", "autograd", "arguments" or "other"."""
    for kind, pattern in _REASON_KINDS:
        if pattern.search(reason):
            return kind
    return "other"


def _ext():
    from ._ext import get_ext

    return get_ext()


def _devices() -> list[str]:
    devices = ["cpu"]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return devices


def _graph_breaks() -> dict[str, int]:
    try:
        from torch._dynamo.utils import counters
    except Exception:  # noqa: BLE001 - dynamo missing or broken: no graph breaks to report
        return {}
    return {str(k): int(v) for k, v in counters.get("graph_break", {}).items()}


def collect() -> dict[str, Any]:
    """The report as a JSON-serialisable dict: ``functions`` (one entry per name: ``name``,
    ``calls``, ``replays``, ``recordings``, ``warmups``, ``eager``, ``recorded_fraction`` --
    replays over calls --, ``eager_reasons``: ``[{"reason", "kind", "count"}]`` most frequent
    first, ``nodes``: ``[{"device", "id", "function", "pool_bytes", "replays", "kind"}]``,
    ``pool_bytes``), ``compiled`` (graph name -> ``pieces`` as :func:`graphtrees.split_info`
    gives them, with ``recorded_pieces`` and ``eager_pieces``), ``graph_breaks`` (dynamo's
    reason -> count), ``devices`` (device -> pool reserved bytes and recordings) and ``summary``
    (the totals)."""
    from ._api import tree_info
    from ._dynamo_backend import split_info

    functions: dict[str, dict[str, Any]] = {}
    for s in _ext()._call_stats():
        f = functions.setdefault(
            s["name"],
            {"name": s["name"], "replays": 0, "recordings": 0, "warmups": 0, "eager": 0},
        )
        for k in ("replays", "recordings", "warmups", "eager"):
            f[k] += s[k]
        reasons = f.setdefault("_reasons", {})
        for reason, n in s["eager_reasons"].items():
            reasons[reason] = reasons.get(reason, 0) + n
    devices = {}
    for device in _devices():
        info = tree_info(device)
        if not info["nodes"] and info["backend"] is None:
            continue
        devices[device] = {
            "backend": info["backend"],
            "pool_reserved_bytes": info["pool"]["reserved_bytes"],
            "recordings": len(info["nodes"]),
        }
        for n in info["nodes"]:
            base = n["function"].split("#")[0]
            f = functions.setdefault(
                base, {"name": base, "replays": 0, "recordings": 0, "warmups": 0, "eager": 0}
            )
            f.setdefault("nodes", []).append(
                {
                    "device": device,
                    "id": n["id"],
                    "function": n["function"],
                    "pool_bytes": n["pool_bytes"],
                    "replays": n["replays"],
                    "kind": n.get("kind", "graph"),
                }
            )
    out = []
    for f in functions.values():
        reasons = f.pop("_reasons", {})
        f["calls"] = f["replays"] + f["recordings"] + f["warmups"] + f["eager"]
        if f["calls"] == 0 and not f.get("nodes"):
            continue
        f["recorded_fraction"] = round(f["replays"] / f["calls"], 4) if f["calls"] else 0.0
        f["eager_reasons"] = [
            {"reason": r, "kind": reason_kind(r), "count": n}
            for r, n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))
        ]
        f.setdefault("nodes", [])
        f["pool_bytes"] = sum(n["pool_bytes"] for n in f["nodes"])
        out.append(f)
    out.sort(key=lambda f: (-f["calls"], f["name"]))
    compiled = {}
    for graph, pieces in split_info().items():
        compiled[graph] = {
            "pieces": pieces,
            "recorded_pieces": sum(1 for p in pieces if p["recorded"]),
            "eager_pieces": sum(1 for p in pieces if not p["recorded"]),
        }
    calls = sum(f["calls"] for f in out)
    replays = sum(f["replays"] for f in out)
    breaks = _graph_breaks()
    summary = {
        "functions": len(out),
        "calls": calls,
        "replays": replays,
        "recordings": sum(f["recordings"] for f in out),
        "warmups": sum(f["warmups"] for f in out),
        "eager": sum(f["eager"] for f in out),
        "recorded_fraction": round(replays / calls, 4) if calls else 0.0,
        "pool_bytes": sum(f["pool_bytes"] for f in out),
        "graph_breaks": sum(breaks.values()),
        "eager_pieces": sum(c["eager_pieces"] for c in compiled.values()),
    }
    return {
        "functions": out,
        "compiled": compiled,
        "graph_breaks": breaks,
        "devices": devices,
        "summary": summary,
    }


def _bytes(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def summary_line(r: dict[str, Any] | None = None) -> str:
    """One line: how many calls replayed, recorded, warmed up and ran eagerly."""
    s = (collect() if r is None else r)["summary"]
    return (
        f"graphtrees: {s['calls']} calls of {s['functions']} functions: {s['replays']} replayed "
        f"({100 * s['recorded_fraction']:.1f}%), {s['recordings']} recorded, {s['warmups']} "
        f"warmed up, {s['eager']} eager; pool {_bytes(s['pool_bytes'])}; "
        f"{s['graph_breaks']} graph breaks, {s['eager_pieces']} eager pieces"
    )


def _text(r: dict[str, Any]) -> str:
    lines = [summary_line(r), ""]
    for f in r["functions"]:
        lines.append(
            f"{f['name']}: {f['calls']} calls: {f['replays']} replayed "
            f"({100 * f['recorded_fraction']:.1f}%), {f['recordings']} recorded, "
            f"{f['warmups']} warmed up, {f['eager']} eager; pool {_bytes(f['pool_bytes'])}"
        )
        for e in f["eager_reasons"]:
            lines.append(f"    eager x{e['count']} [{e['kind']}]: {e['reason']}")
        for n in f["nodes"]:
            kind = "" if n["kind"] == "graph" else f" ({n['kind']})"
            lines.append(
                f"    node {n['id']} on {n['device']}{kind}: '{n['function']}', "
                f"{n['replays']} replays, {_bytes(n['pool_bytes'])}"
            )
    for graph, c in r["compiled"].items():
        lines.append(
            f"compiled graph {graph}: {len(c['pieces'])} pieces, {c['recorded_pieces']} "
            f"recorded, {c['eager_pieces']} eager"
        )
        for p in c["pieces"]:
            state = "recorded" if p["recorded"] else "eager: " + "; ".join(p["why_eager"])
            lines.append(f"    {p['piece']} ({p['ops']} ops) {state}")
    if r["graph_breaks"]:
        lines.append(f"graph breaks (torch._dynamo): {sum(r['graph_breaks'].values())}")
        for reason, n in sorted(r["graph_breaks"].items(), key=lambda kv: -kv[1]):
            lines.append(f"    x{n}: {reason.strip().splitlines()[0]}")
    return "\n".join(lines)


def report(format: str = "text") -> str | dict[str, Any]:
    """What graphtrees did with every call so far: ``format="text"`` (default) a report for
    people, ``"json"`` the same as a JSON string, ``"dict"`` as a dict (:func:`collect`)."""
    if format not in ("text", "json", "dict"):
        raise ValueError(
            f"graphtrees.report: format must be 'text', 'json' or 'dict', not {format!r}"
        )
    r = collect()
    if format == "dict":
        return r
    if format == "json":
        return json.dumps(r, indent=1)
    return _text(r)


def reset_report() -> None:
    """Zeroes the call counts :func:`report` shows (and forgets freed callables)."""
    _ext()._reset_call_stats()


def _log_at_exit() -> None:
    try:
        line = summary_line()
    except Exception as e:  # noqa: BLE001 - at exit: say why, never raise
        line = f"graphtrees: no report ({e})"
    if _logger.hasHandlers():
        _logger.warning("%s", line)
    else:
        print(line, file=sys.stderr)


_registered = False


def install_from_environment() -> None:
    """``GRAPHTREES_REPORT=1``: log the one-line summary at exit."""
    global _registered
    if os.environ.get("GRAPHTREES_REPORT", "") not in ("", "0") and not _registered:
        _registered = True
        atexit.register(_log_at_exit)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv[: argv.index("--")] if "--" in argv else "--json" in argv
    if "--" in argv:
        argv = argv[argv.index("--") + 1 :]
    else:
        argv = [a for a in argv if a != "--json"]
    if not argv:
        print("usage: python -m graphtrees.report [--json] -- script.py [args...]", file=sys.stderr)
        return 2
    script = argv[0]
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    print(report("json") if as_json else report(), flush=True)
    return code
