"""Piecewise recording: a forward or backward graph split around the ops that cannot be recorded.
(Note [Piecewise graphs] below says how.)
"""

import dataclasses
import operator
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ._graph_checks import is_host_scalar, op_name, underlying_op

# Note [Piecewise graphs]
# A graph that AOTAutograd hands the backend (a forward, a backward or an inference graph, after
# functionalization) may hold ops that no recording can reproduce (``node_reasons`` in
# _graph_checks.py: host reads, data-dependent shapes, ops tagged cudagraph_unsafe, CPU ops and
# device copies in a CUDA graph, mutation of an eager input, the user's ``splitting_ops``). Rather
# than run the whole graph eagerly, graphtrees cuts it at those ops:
#
# * ``plan`` walks the graph's ops in order. A multi-output op keeps its ``getitem``s (they move
#   up next to it: they depend on nothing else). Host scalars (sym_size, SymInt arithmetic) belong
#   to no piece: each piece that reads one computes it again from its own inputs, so a piece takes
#   plain sizes and unbacked symbols as inputs, never expressions of them (Inductor binds only
#   plain symbols); an _assert_scalar goes with the piece it falls in. They count as no op, and
#   so do views, which launch no kernel.
#   Consecutive recordable ops form a recorded piece; consecutive unrecordable ones an eager
#   piece. A recorded piece of fewer than ``min_piece_ops`` (default 3) ops joins the eager pieces
#   around it: a replay has a fixed cost (about 6 us of bookkeeping on CPU,
#   benchmarks/results/cpu-2026-12-01.md, plus the graph launch on CUDA), about what two or three
#   eager ops cost (about 3.6 us for a 1-op call, same file), and on CUDA it copies in the
#   inputs that no earlier piece produced. benchmarks/bench_piecewise.py sweeps min_piece_ops;
#   on CPU six 2-op pieces replayed and run eagerly differ by less than the timings' noise.
# * ``build`` turns each piece into an FX GraphModule of its own (its inputs: the values earlier
#   pieces or the graph's inputs define; its outputs, always a tuple: the values later pieces or
#   the graph's result use) and a top-level GraphModule that calls the pieces in order. FX's code
#   drops each value after its last use, so pieces' outputs die as early as they did in the graph.
# * Each recorded piece is its own graphtrees function (one GraphedCallable, named
#   ``graph0.forward[1/3]``). The pieces run one after another on one path, so each piece is a
#   child of the one before; an input that an earlier piece produced is a live output of the path,
#   hence a managed input, used in place (Note [Matching a child]); the graph's static inputs and
#   views of them stay static. In training the backward is split the same way, and its pieces
#   continue the path under the forward's. A split graph counts once in Note [Pending backward]:
#   its first recorded forward piece and its last recorded backward piece.
# * Eager pieces run their ops through the dispatcher between the replays, as PyTorch's graph
#   partitions run the ops outside their cudagraph partitions.
#
# Splitting happens before the inner compiler: with inner="inductor" each recorded piece is
# compiled by Inductor on its own (``compile_fx_inner`` with the piece's example inputs), and eager
# pieces run their aten ops. Three things of the whole graph's compile must not leak into a
# piece's: every output of a piece keeps its traced strides (the pieces after it were traced with
# them), AOTAutograd's donated buffers are off (their indices are the whole backward's, and a
# later piece may read a buffer Inductor would overwrite), and AOTAutograd is told the traced
# strides of the graph's outputs instead of one piece's.
#
# Inductor's own ``graph_partition`` (with ``set_customized_partition_wrappers``) could partition
# instead, but its scheduler cuts wherever a node is not on a GPU, so on the CPU backend every op
# would be an eager partition and CPU tests could not predict a GPU; it cuts only for Inductor's
# own reasons (not at mutations of eager inputs; custom_should_partition_ops only for fallback
# kernels), after fusion; and aot_eager needs a split of its own anyway.
#
# Note [Tree branches]
# A torch.cond that no recording can hold as a control step or conditional nodes -- on CUDA a
# branch that draws random numbers (torch refuses them in a conditional body) or a driver without
# conditional nodes, or any cond when the user asks for it with ``cond_form="tree-branch"``
# (_graph_checks.tree_branch_reason) -- takes the tree-branch form: the graph is split around
# the cond like around any op that cannot be recorded, so the part before it is a recorded piece
# (a tree node) and the cond runs in an eager piece, where torch's own cond reads the predicate
# on the host (the one sync a user sees; the split is logged once). Its two branches are not run
# eagerly: each is compiled and made a graphtrees function of its own (``graph0.forward[2/3].
# cond1.true`` and ``.false``, _dynamo_backend._graph_branches), so the branch a call takes is
# recorded the first time it runs and replayed after, as a child of the piece before -- the two
# branches are siblings, g1 -> g2 / g1 -> g3, whose memory the pool shares through the parent's
# checkpoint: it holds the larger branch's, not both. The piece after the cond is a child of
# whichever branch ran. In training the backward's cond is split the same way, under the
# forward's branch. Only a graph can be split: a function that graphtrees records whole
# (cudagraphify) takes the form by handing its calls to the function traced by torch.compile
# (Note [A wrapper's cond split into tree branches] in csrc/ThreadState.h).
#
# A graph that no cut can help (FSDP2's unsharded parameters, a mutation that no op of the graph
# can be blamed for, or no piece left with ``min_piece_ops`` ops) still runs eagerly whole, with
# its reason logged; only that raises under ``strict=True``.


@dataclasses.dataclass(frozen=True)
class SplittingOps:
    """The ops a user keeps out of recordings (``splitting_ops``), by their registered names
    ("aten::nonzero", "mylib::attention", with or without an overload: "aten::add.Tensor"; a dot
    in place of "::" works too); a custom op that writes into an argument (vLLM's attention
    writing its output) is matched through the auto_functionalized that wraps it. An entry also
    matches its backward op ("aten::gelu" matches
    aten::gelu_backward), and the aten ops that a Python function of that name lowered to
    ("aten::scaled_dot_product_attention" matches the attention kernel that
    F.scaled_dot_product_attention dispatched to, forward and backward)."""

    names: tuple[str, ...] = ()

    @classmethod
    def parse(cls, entries: Any) -> "SplittingOps":
        if entries is None:
            return cls()
        if isinstance(entries, str) or not isinstance(entries, Iterable):
            raise TypeError(
                "graphtrees: splitting_ops must be a list of op names such as "
                f"['aten::nonzero', 'mylib::attention'], got {entries!r}"
            )
        names = []
        for entry in entries:
            if not isinstance(entry, str) or not entry.strip():
                raise TypeError(f"graphtrees: splitting_ops entries are op names, got {entry!r}")
            name = entry.strip().replace("::", ".")
            parts = name.split(".")
            if len(parts) not in (2, 3) or not all(parts):
                raise ValueError(
                    f"graphtrees: splitting_ops entry {entry!r} is not an op name; write "
                    "'namespace::op' or 'namespace::op.overload', e.g. 'aten::nonzero'"
                )
            try:
                packet = getattr(getattr(torch.ops, parts[0]), parts[1])
                if len(parts) == 3:
                    getattr(packet, parts[2])
            except (AttributeError, RuntimeError):
                raise ValueError(
                    f"graphtrees: splitting_ops entry {entry!r} names no registered op (define "
                    "a custom op before compiling with it)"
                ) from None
            names.append(name)
        return cls(tuple(dict.fromkeys(names)))

    def match(self, node: torch.fx.Node) -> str | None:
        """The entry that keeps `node` out of recordings, or None."""
        if not self.names or node.op != "call_function":
            return None
        packet, overload = op_name(node), str(underlying_op(node))
        sources = set()
        for key in ("source_fn_stack", "fwd_source_fn_stack"):
            stack = node.meta.get(key) or ()
            if stack:
                fn = stack[-1][1]
                sources.add(fn if isinstance(fn, str) else getattr(fn, "__name__", ""))
        for name in self.names:
            if (
                name in (packet, overload)
                or packet == name + "_backward"
                or name.split(".")[1] in sources
            ):
                return name.replace(".", "::", 1)
        return None


@dataclasses.dataclass
class Piece:
    """Consecutive ops of a graph that run as one recording, or eagerly."""

    nodes: list[torch.fx.Node]
    # Why it runs eagerly: (the unrecordable op, or None for the piece as a whole, reason).
    # Empty: recorded.
    blame: list[tuple[torch.fx.Node | None, str]]
    ops: int = 0
    inputs: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    outputs: list[torch.fx.Node] = dataclasses.field(default_factory=list)

    @property
    def recorded(self) -> bool:
        return not self.blame

    @property
    def why_eager(self) -> list[str]:
        return _grouped(self.blame)


def _floating(node: torch.fx.Node) -> bool:
    """A host scalar that something reads: no piece owns it; each piece (and the top-level code)
    that reads it computes it again from its own inputs, so that pieces take plain sizes and
    unbacked symbols as inputs, never expressions of them (which Inductor could not bind)."""
    return bool(node.users) and is_host_scalar(node)


def _is_view(node: torch.fx.Node) -> bool:
    """A view launches no kernel: a piece of views only would capture an empty graph (torch
    warns "The CUDA Graph is empty"), so views count as no op (review 4, #17)."""
    return bool(getattr(underlying_op(node), "is_view", False))


def _units(gm: torch.fx.GraphModule) -> list[list[torch.fx.Node]]:
    """The graph's ops in order, each with the getitems of its result (Note [Piecewise graphs])."""
    units: list[list[torch.fx.Node]] = []
    unit_of: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method", "call_module") or _floating(n):
            continue
        if n.target is operator.getitem and n.args and n.args[0] in unit_of:
            unit = unit_of[n.args[0]]
            unit.append(n)
        else:
            unit = [n]
            units.append(unit)
        unit_of[n] = unit
    return units


def plan(
    gm: torch.fx.GraphModule, reasons: dict[torch.fx.Node, str], min_piece_ops: int
) -> list[Piece]:
    """The pieces of `gm`, given why each unrecordable op is (Note [Piecewise graphs])."""
    pieces: list[Piece] = []
    for unit in _units(gm):
        head = unit[0]
        why = [(head, reasons[head])] if head in reasons else []
        counts = 0 if is_host_scalar(head) or _is_view(head) else 1
        if pieces and bool(pieces[-1].blame) == bool(why):
            pieces[-1].nodes.extend(unit)
            pieces[-1].blame.extend(why)
            pieces[-1].ops += counts
        elif pieces and not why and counts == 0:
            pieces[-1].nodes.extend(unit)  # an _assert_scalar joins the piece it falls in
        else:
            pieces.append(Piece(list(unit), why, counts))
    merged: list[Piece] = []
    for p in pieces:
        if p.recorded and p.ops < min_piece_ops:
            p.blame.append((None, f"{_ops(p.ops)}, fewer than min_piece_ops={min_piece_ops}"))
        if merged and not merged[-1].recorded and not p.recorded:
            merged[-1].nodes.extend(p.nodes)
            merged[-1].blame.extend(p.blame)
            merged[-1].ops += p.ops
        else:
            merged.append(p)
    _link(merged)
    return merged


def _ops(n: int) -> str:
    return f"{n} op{'' if n == 1 else 's'}"


def label(index: int, total: int) -> str:
    """How piece `index` (from 0) of `total` is named after its graph: "[1/3]"."""
    return f"[{index + 1}/{total}]"


def _grouped(entries: list[tuple[torch.fx.Node | None, str]]) -> list[str]:
    """Reasons of an eager piece, one per reason and source line, naming all the ops it holds
    ("aten.scalar_tensor x2, aten.where (splitting_ops entry ...) at file:line")."""
    from collections import Counter

    groups: dict[str, list[str]] = {}
    for node, text in entries:
        op = op_name(node) if node is not None else None
        if op is None or op not in text:
            groups.setdefault(text, [])
            continue
        groups.setdefault(text.replace(op, "\0", 1), []).append(op)
    out = []
    for template, ops in groups.items():
        names = ", ".join(f"{o} x{c}" if c > 1 else o for o, c in Counter(ops).items())
        out.append(template.replace("\0", names, 1) if ops else template)
    return out


def _sources(node: torch.fx.Node) -> list[torch.fx.Node]:
    """What `node` reads, seen through floating host scalars (which are computed again)."""
    found: list[torch.fx.Node] = []
    for a in node.all_input_nodes:
        found.extend(_sources(a) if _floating(a) else [a])
    return found


def _readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes that read `node`, seen through floating host scalars."""
    found: list[torch.fx.Node] = []
    for u in node.users:
        found.extend(_readers(u) if _floating(u) else [u])
    return found


def _link(pieces: list[Piece]) -> None:
    """Each piece's inputs (values it reads that it does not define; get_attr constants and
    floating host scalars are copied into each piece instead) and outputs (values it defines
    that later code reads)."""
    piece_of = {n: i for i, p in enumerate(pieces) for n in p.nodes}
    for i, p in enumerate(pieces):
        inputs: dict[torch.fx.Node, None] = {}
        outputs: dict[torch.fx.Node, None] = {}
        for n in p.nodes:
            for a in _sources(n):
                if piece_of.get(a) != i and a.op != "get_attr":
                    inputs[a] = None
            if any(piece_of.get(u) != i for u in _readers(n)):
                outputs[n] = None
        p.inputs, p.outputs = list(inputs), list(outputs)


def _copier(graph: torch.fx.Graph, env: dict[torch.fx.Node, torch.fx.Node]):
    """arg(node): `node` in `graph`: from env, or a get_attr or floating host scalar copied in."""

    def arg(a: torch.fx.Node) -> torch.fx.Node:
        if a not in env:
            if a.op == "get_attr":
                env[a] = graph.get_attr(a.target)
            else:
                assert _floating(a), f"graphtrees: {a} is read before it is defined"
                env[a] = graph.node_copy(a, arg)
            env[a].meta = dict(a.meta)
        return env[a]

    return arg


def _piece_module(gm: torch.fx.GraphModule, piece: Piece) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for a in piece.inputs:
        env[a] = graph.placeholder(a.name)
        # An unbacked size an earlier piece bound (nonzero's length, item()'s value) arrives
        # here as an input: nothing in this piece binds it.
        env[a].meta = {k: v for k, v in a.meta.items() if k != "unbacked_bindings"}
    arg = _copier(graph, env)
    for n in piece.nodes:
        env[n] = graph.node_copy(n, arg)
    graph.output(tuple(env[o] for o in piece.outputs))
    return torch.fx.GraphModule(gm, graph)


def build(
    gm: torch.fx.GraphModule,
    pieces: list[Piece],
    make_piece: Callable[[int, Piece, torch.fx.GraphModule], Callable[..., Any]],
) -> torch.fx.GraphModule:
    """A GraphModule that runs `gm` as `pieces`: make_piece(index, piece, module) gives the
    callable that runs piece `index` (its module returns a tuple of piece.outputs)."""
    top = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = top.placeholder(n.name)
            env[n].meta = dict(n.meta)
    arg = _copier(top, env)
    for i, p in enumerate(pieces):
        run = make_piece(i, p, _piece_module(gm, p))
        kind = "recorded" if p.recorded else "eager"
        call = top.create_node(
            "call_function", run, tuple(env[a] for a in p.inputs), name=f"{kind}_piece_{i + 1}"
        )
        for k, o in enumerate(p.outputs):
            env[o] = top.call_function(operator.getitem, (call, k))
    out = gm.graph.output_node()
    top.output(torch.fx.map_arg(out.args[0], arg))
    return torch.fx.GraphModule(gm, top)


def describe(name: str, pieces: Sequence[Piece]) -> str:
    """One line per piece: what a split made of graph `name`, and why."""
    total = len(pieces)
    lines = [f"graphtrees: split '{name}' into {total} pieces around ops it cannot record:"]
    for i, p in enumerate(pieces):
        if p.recorded:
            lines.append(f"  {label(i, total)} recorded, {_ops(p.ops)}")
        else:
            why = p.why_eager
            more = f"; and {len(why) - 3} more" if len(why) > 3 else ""
            lines.append(f"  {label(i, total)} eager, {_ops(p.ops)}: {'; '.join(why[:3])}{more}")
    return "\n".join(lines)


def summary(name: str, pieces: Sequence[Piece]) -> list[dict]:
    """What graphtrees.split_info() shows of one split graph."""
    return [
        {
            "piece": name + label(i, len(pieces)),
            "recorded": p.recorded,
            "ops": p.ops,
            "why_eager": p.why_eager,
        }
        for i, p in enumerate(pieces)
    ]


# Note [Eager piece runs]
# graphtrees.report() counts the runs of each eager piece of a split graph beside the graphed
# calls of its recorded pieces (Note [Call statistics] in csrc/CallStats.h): a split that left
# half the model eager says so in the recorded fraction. counted() wraps the piece's function with
# one counter (a Python attribute increment, next to the eager ops' own cost), counted once the
# run returned, as a graphed call is. Entries are kept, like CallStats, until reset_report() --
# which zeroes them and drops those whose piece is gone (a graph that torch._dynamo.reset()
# freed) -- and a new entry drops the gone ones that counted nothing when the list has doubled.
class _EagerPieceRuns:
    __slots__ = ("name", "reason", "runs", "piece")

    def __init__(self, name: str, reason: str):
        self.name, self.reason, self.runs, self.piece = name, reason, 0, None


_eager_pieces: list[_EagerPieceRuns] = []
_swept_at = [64]


def _gone(e: _EagerPieceRuns) -> bool:
    return e.piece is None or e.piece() is None


def counted(fn: Callable[..., Any], name: str, why_eager: Sequence[str]) -> Callable[..., Any]:
    """`fn`, an eager piece named `name`, counting its runs (Note [Eager piece runs])."""
    entry = _EagerPieceRuns(name, "; ".join(why_eager) or "an eager piece of a split graph")

    def piece(*args):
        out = fn(*args)
        entry.runs += 1
        return out

    entry.piece = weakref.ref(piece)
    if len(_eager_pieces) >= _swept_at[0]:
        _eager_pieces[:] = [e for e in _eager_pieces if e.runs or not _gone(e)]
        _swept_at[0] = max(64, 2 * len(_eager_pieces))
    _eager_pieces.append(entry)
    return piece


def eager_piece_runs() -> list[dict]:
    """Every eager piece's ``name``, ``reason`` and ``runs`` since reset_eager_piece_runs()."""
    return [{"name": e.name, "reason": e.reason, "runs": e.runs} for e in list(_eager_pieces)]


def reset_eager_piece_runs() -> None:
    _eager_pieces[:] = [e for e in _eager_pieces if not _gone(e)]
    for e in _eager_pieces:
        e.runs = 0
