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
import runpy
import sys
from typing import Any

import torch

_logger = logging.getLogger("graphtrees")

# The kinds of eager reasons, as csrc/CallStats.cpp's reasonKindName() names them (Note [Reason
# kinds]: each reason's kind is given where the reason is made, not guessed from its words), and
# "eager piece" for the pieces of a split graph that run eagerly (graphtrees/_piecewise.py).
REASON_KINDS = (
    "host sync",
    "unsupported op",
    "thrashing shapes",
    "memory budget",
    "re-recorded too often",
    "autograd",
    "arguments",
    "device",
    "record function off",
    "another thread",
    "capture elsewhere",
    "graphtrees failure",
    "eager piece",
    "other",
)


def _ext():
    from ._ext import get_ext

    return get_ext()


def _devices() -> list[str]:
    devices = ["cpu"]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return devices


# dynamo's graph-break counts when reset_report() was last called (they are dynamo's, not ours).
_graph_breaks_at_reset: dict[str, int] = {}


def _dynamo_graph_breaks() -> dict[str, int]:
    # Only when the program imported dynamo: a report never imports it (seconds, at exit).
    if "torch._dynamo" not in sys.modules:
        return {}
    try:
        from torch._dynamo.utils import counters
    except Exception:  # noqa: BLE001 - dynamo missing or broken: no graph breaks to report
        return {}
    return {str(k): int(v) for k, v in counters.get("graph_break", {}).items()}


def _graph_breaks() -> dict[str, int]:
    """dynamo's graph breaks since reset_report()."""
    out = {}
    for reason, n in _dynamo_graph_breaks().items():
        n -= _graph_breaks_at_reset.get(reason, 0)
        if n > 0:
            out[reason] = n
    return out


def _entry(name: str, callable_id: int | None) -> dict[str, Any]:
    return {
        "name": name,
        "id": callable_id,
        "replays": 0,
        "recordings": 0,
        "warmups": 0,
        "eager": 0,
        "eager_reasons": [],
        "nodes": [],
    }


def collect() -> dict[str, Any]:
    """The report as a JSON-serialisable dict: ``functions`` (one entry per wrapped callable --
    per ``cudagraphify()`` call or AOT graph graphtrees wraps -- and per eager piece of a split
    graph: ``name``, ``id`` -- the callable's id, which tree_info()'s nodes are filed by, ``None``
    for an eager piece --, ``label`` -- the name, with `` (id N)`` when another entry has the same
    name --, ``calls``, ``replays``, ``recordings``, ``warmups``, ``eager``,
    ``recorded_fraction`` -- replays over calls --, ``eager_reasons``: ``[{"reason", "kind",
    "count"}]`` most frequent first (``kind``: one of :data:`REASON_KINDS`), ``nodes``:
    ``[{"device", "id", "function", "pool_bytes", "replays", "kind"}]``, ``pool_bytes``),
    ``compiled`` (graph name -> ``pieces`` as :func:`graphtrees.split_info` gives them, with
    ``recorded_pieces`` and ``eager_pieces``), ``graph_breaks`` (dynamo's reason -> count since
    :func:`reset_report`), ``devices`` (device -> pool reserved bytes and recordings) and
    ``summary`` (the totals; ``eager_pieces``: the eager pieces that ran). A call that raised is
    not counted (Note [Call statistics] in csrc/CallStats.h)."""
    from ._api import tree_info
    from ._dynamo_backend import split_info
    from ._piecewise import eager_piece_runs

    functions: dict[Any, dict[str, Any]] = {}  # keyed by callable id
    by_signature: dict[int, int] = {}  # a signature's function id -> its callable's id
    for s in _ext()._call_stats():
        f = functions.setdefault(s["callable_id"], _entry(s["name"], s["callable_id"]))
        for k in ("replays", "recordings", "warmups", "eager"):
            f[k] += s[k]
        f["eager_reasons"] += s["eager_reasons"]
        for sig in s["signatures"]:
            by_signature[sig] = s["callable_id"]
    for i, piece in enumerate(eager_piece_runs()):
        f = functions.setdefault(("piece", i), _entry(piece["name"], None))
        f["eager"] = piece["runs"]
        if piece["runs"]:
            f["eager_reasons"] = [
                {"reason": piece["reason"], "kind": "eager piece", "count": piece["runs"]}
            ]
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
            key = by_signature.get(n["function_id"], ("node", n["function_id"]))
            f = functions.setdefault(key, _entry(n["function"], None))
            f["nodes"].append(
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
        f["calls"] = f["replays"] + f["recordings"] + f["warmups"] + f["eager"]
        if f["calls"] == 0 and not f["nodes"]:
            continue
        f["recorded_fraction"] = round(f["replays"] / f["calls"], 4) if f["calls"] else 0.0
        f["eager_reasons"] = sorted(
            f["eager_reasons"], key=lambda e: (-e["count"], e["reason"], e["kind"])
        )
        f["pool_bytes"] = sum(n["pool_bytes"] for n in f["nodes"])
        out.append(f)
    names: dict[str, int] = {}
    for f in out:
        names[f["name"]] = names.get(f["name"], 0) + 1
    for f in out:
        same = names[f["name"]] > 1 and f["id"] is not None
        f["label"] = f"{f['name']} (id {f['id']})" if same else f["name"]
    out.sort(key=lambda f: (-f["calls"], f["name"], f["id"] if f["id"] is not None else -1))
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
        "eager_pieces": sum(1 for p in eager_piece_runs() if p["runs"]),
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
            f"{f['label']}: {f['calls']} calls: {f['replays']} replayed "
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
    """Zeroes the call counts :func:`report` shows (and forgets freed callables), the runs of
    eager pieces, and counts dynamo's graph breaks from here on."""
    from ._piecewise import reset_eager_piece_runs

    global _graph_breaks_at_reset
    _ext()._reset_call_stats()
    reset_eager_piece_runs()
    _graph_breaks_at_reset = _dynamo_graph_breaks()


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


USAGE = "usage: python -m graphtrees.report [--json] [--] script.py [args...]"


def main(argv: list[str] | None = None) -> int:
    """``python -m graphtrees.report``: runs the script in this process, then prints the report --
    also when the script raised or called sys.exit() (the traceback or the exit message follows
    the report on stderr, and the script's exit status is the command's). Options end at ``--`` or
    at the script: what follows is the script's own arguments (its own ``--json`` included)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = False
    while argv and argv[0].startswith("-"):
        opt = argv.pop(0)
        if opt == "--":
            break
        if opt == "--json":
            as_json = True
        else:
            print(f"graphtrees.report: unknown option {opt!r}\n{USAGE}", file=sys.stderr)
            return 2
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    script = argv[0]
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code: int = 0
    after = None  # what the script said on its way out: printed after the report
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            code, after = 1, str(e.code)  # sys.exit("message"): the message, status 1
    except BaseException:  # noqa: BLE001 - the script's error: reported after the report
        import traceback

        code, after = 1, traceback.format_exc()
    finally:
        print(report("json") if as_json else report(), flush=True)
    if after is not None:
        print(after.rstrip("\n"), file=sys.stderr, flush=True)
    return code
