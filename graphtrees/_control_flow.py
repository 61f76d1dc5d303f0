"""torch.cond and torch.while_loop inside graphtrees' warmups, recordings and Python replays."""

# Note [Control flow in a recording]
# torch.cond(pred, true_fn, false_fn, operands) run eagerly compiles a wrapper with dynamo and calls
# the cond higher-order op, whose dense kernel (the CompositeExplicitAutograd one, reached below
# autograd, from eager code, from an aot_eager graph, from a backward) reads ``pred`` on the host:
# the host read refused every recording. torch.while_loop reads its predicate at every iteration.
# graphtrees replaces those two kernels at import (``install()``) with the functions below; outside
# a graphed call they call torch's own. Inside one (a warmup, a recording, a CPU Python replay) the
# predicate is never read by an op, and every arm runs:
#
# * **cond**: the true branch, then the false branch, on the same operands; the branch that is not
#   taken runs with the device's default generator put back afterwards (its draws do not count) and
#   its results are dropped. The cond's results are the true branch's, cloned where they alias an
#   operand; when the predicate is false, the false branch's results are copied into them (as a CUDA
#   IF/ELSE node's else-branch is copied into the if-branch's outputs, so that later work sees one
#   address). Both branches are warmed up; their allocations come from the pool; the pool holds the
#   true branch's results whichever branch ran.
# * **while_loop**: the carried values are cloned (the loop's own buffers), the cond function runs
#   once, the body once (dropped, and its draws undone, when the predicate is false: a body is
#   warmed up even when a call runs it zero times), the body's results are copied into the carried
#   buffers; the further iterations run with the recording paused and outside the pool, so that a
#   recording's allocations do not depend on the trip count.
#
# The same sequence runs in a warmup, a recording and a CPU Python replay, so that a Python replay
# allocates exactly as the recording did. On the CPU backend, the recording's program recorder turns
# each of them into one control step (Note [Control steps of a program] in csrc/cpu/OpProgram.h)
# that a program replay runs from C++: it reads the predicate, runs the taken arm (a loop: as many
# times as the predicate says) and no Python runs. The predicate is read in place
# (``_control_flow_predicate``), which the host-read watch does not see: the read is the control
# step's own, as a conditional node's kernel reads it on the device.
#
# On CUDA a warmup runs the same sequence (every arm warmed up, its allocations from the pool, the
# predicate read on the host, which a warmup may do), and a recording captures each cond as CUDA
# conditional nodes and each while_loop as a WHILE node (``_cond_nodes``, ``_while_node``; Note
# [Conditional nodes on CUDA] in csrc/cuda/ConditionalNodes.cpp): the predicate is read on the
# device at every replay, with no host sync. Which path runs is decided by the backend of the call
# in flight (``_tree_call_device``), never by its tensors' devices. Where a conditional node
# cannot serve -- a driver without them (the reason says so), a predicate, operand or result not on
# the CUDA device, an arm that draws random numbers or reads the host (seen in the warmup) -- the
# warmup is refused with the reason (the function runs eagerly, logged once). Under torch.compile
# such a cond (random numbers, no conditional nodes) never reaches this kernel inside a recording:
# the graph is split at it and its branches recorded as tree nodes of their own (Note [Tree
# branches] in _piecewise.py); a function recorded whole whose warmup refuses such a cond asks
# for that form (``_refuse(..., split=True)``), and its later calls take it (Note [A wrapper's
# cond split into tree branches] in csrc/ThreadState.h).
#
# Running every arm is right only where no arm can be seen to differ from eager; otherwise the
# recording is refused and the call returns what the taken arm returned (review of issue 48):
# an in-place op in an arm's graph (torch's kernel runs instead; a write no graph shows is caught
# by the version counters: refused when the taken arm made it, an error when the untaken one
# did), results that differ between the arms in structure, shape, dtype or strides, are not
# tensors or are expanded, and an untaken arm that raises. Results sharing memory with an operand
# or with one another get homes of their own (ProgramRecorder::endCond checks both). Inside an
# untaken arm a while_loop runs its cond and body once at most: its values are dropped anyway.

import logging
import operator
import threading
from typing import Any

import torch
import torch.utils._pytree as pytree

_logger = logging.getLogger("graphtrees")
_logged: set = set()
_original: dict[str, Any] = {}


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        _logger.info(message)


def _ext():
    from ._ext import get_ext

    return get_ext()


def _refuse(why: str, split: bool = False) -> None:
    """Refuses the warmup or recording under way for `why`. `split`: the cond's tree-branch form
    would serve it, which a function recorded whole then takes from its next call (Note [A
    wrapper's cond split into tree branches] in csrc/ThreadState.h)."""
    C = _ext()
    C._refuse_recording(why)
    if split:
        C._request_tree_branches(why)
    _log_once(f"graphtrees: a graphed function runs eagerly: {why}")


def _backend_refusal(kind: str, backend: str, pred: Any, tensors: Any) -> str | None:
    # By the recording's backend, never by the tensors' devices (review of issue 48, W4): a CPU
    # counter inside a CUDA recording must not take the CPU path, whose loop would be baked.
    if backend == "cuda":
        why = _ext()._cuda_conditional_unavailable()
        if why:
            return (
                f"it calls {kind} in a CUDA recording, which graphtrees records as CUDA "
                f"conditional nodes, and {why}"
            )
        if pred is not None and not _device_predicate(pred):
            return f"its {kind} has a predicate {_predicate_refusal(pred)}"
        if any(
            isinstance(t, torch.Tensor) and t.device.type != "cuda"
            for t in pytree.tree_leaves(tensors)
        ):
            return (
                f"its {kind} takes tensors that are not on the CUDA device (a CPU operand or "
                "loop counter: work on it would run once, when the function is recorded, and be "
                "baked into the recording)"
            )
        return None
    if backend != "cpu":
        return (
            f"it calls {kind} in a {backend} recording: graphtrees records {kind} on the CPU "
            "(program steps) and CUDA (conditional nodes) backends"
        )
    leaves = [pred, *pytree.tree_leaves(tensors)]
    if any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in leaves):
        return f"its {kind} takes tensors that are not on the CPU in a CPU recording"
    return None


def _device_predicate(pred: Any) -> bool:
    return (
        isinstance(pred, torch.Tensor)
        and pred.device.type == "cuda"
        and pred.dim() == 0
        and pred.dtype == torch.bool
    )


def _predicate_refusal(pred: Any) -> str:
    """Why `pred` cannot set a CUDA conditional node's handle (review of issue 48)."""
    if not isinstance(pred, torch.Tensor) or pred.device.type != "cuda":
        where = pred.device.type if isinstance(pred, torch.Tensor) else type(pred).__name__
        return (
            f"on the {where}, not on the CUDA device (its value would be read once, when the "
            "function is recorded, and baked into the recording)"
        )
    return (
        f"of dtype {pred.dtype} and shape {list(pred.shape)}, where a CUDA conditional node "
        "needs a boolean scalar tensor (write the predicate as one, e.g. `(x.sum() > 0)` rather "
        "than `x.sum(0, keepdim=True) > 0` or `(...).long()`)"
    )


def _capturing(backend: str) -> bool:
    """Whether a CUDA recording is capturing now (not a warmup): its control flow becomes
    conditional nodes."""
    return backend == "cuda" and torch.cuda.is_current_stream_capturing()


class _Draws:
    """Whether the arm run inside drew random numbers from the CUDA device's default generator
    or took a generator of its own (a user's torch.Generator), which a conditional node cannot
    hold (torch refuses RNG in a conditional body)."""

    def __init__(self, on: Any, backend: str):
        self._gen = None
        if backend == "cuda" and isinstance(on, torch.Tensor) and on.device.type == "cuda":
            self._gen = torch.cuda.default_generators[on.device.index or 0]
        self.drew = False

    def __enter__(self):
        if self._gen is not None:
            self._offset = self._gen.get_offset()
            _ext()._control_flow_event("watch_generators")
        return self

    def __exit__(self, *exc):
        if self._gen is not None:
            taken = _ext()._control_flow_event("generators_taken")
            self.drew = taken or self._gen.get_offset() != self._offset


def _rng_refusal(kind: str) -> str:
    return (
        f"an arm of its {kind} draws random numbers, which a CUDA conditional node cannot "
        "hold (torch refuses random numbers in a conditional body)"
    )


class _Body:
    """One conditional node's body in the capture under way (Note [Conditional nodes on
    CUDA]): ``step`` begins it, the block's work is captured into it, its exit ends it. When the
    block raised, its error is the one that propagates (ending a body whose capture it
    invalidated fails too; the capture is rejected either way)."""

    def __init__(self, step: str, pred: torch.Tensor):
        self._step, self._pred = step, pred

    def __enter__(self):
        _ext()._cuda_conditional_step(self._step, self._pred)

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            _ext()._cuda_conditional_step("end")
            return
        try:
            _ext()._cuda_conditional_step("end")
        except Exception:  # noqa: BLE001 - the block's own error propagates
            pass


def _run_arm(C: Any, backend: str, fn: Any, args: Any) -> tuple[Any, str]:
    """fn(*args) in a warmup, and on CUDA the first host read it made ('' if none): a
    conditional node cannot hold one (the capture of its body would fail)."""
    if backend != "cuda":
        return fn(*args), ""
    return C._run_watching_host_reads(fn, tuple(args))


def _host_read_refusal(kind: str, read: str) -> str:
    return (
        f"an arm of its {kind} reads a tensor's value on the host, {read}, which a CUDA "
        "conditional node cannot hold"
    )


def _cond_nodes(pred, true_fn, false_fn, operands):
    """A torch.cond captured as two IF nodes: the true branch's results stay in their buffers
    (clones where they alias an operand or each other); the false branch's are copied into them."""
    not_pred = torch.logical_not(pred)  # in the outer graph, before either node
    kept = _watched(operands, (true_fn, false_fn))
    with _Body("cond", pred):
        outs_t = true_fn(*operands)
        why = _results_refusal(outs_t, outs_t)
        if why is not None:
            raise RuntimeError(f"graphtrees: {why}")
        leaves_t, spec = pytree.tree_flatten(outs_t)
        homes = [
            t.clone() if _needs_home(t, k, leaves_t, true_fn, kept) else t
            for k, t in enumerate(leaves_t)
        ]
        del outs_t, leaves_t
    with _Body("else", not_pred):
        outs_f = false_fn(*operands)
        why = _results_refusal(pytree.tree_unflatten(homes, spec), outs_f)
        if why is not None:
            raise RuntimeError(f"graphtrees: {why}")
        for h, f in zip(homes, pytree.tree_leaves(outs_f)):
            h.copy_(f)
        del outs_f
    _log_once(
        "graphtrees: torch.cond recorded as CUDA conditional nodes (form 'conditional-node'): "
        "the predicate is read on the device at each replay, no host sync"
    )
    return pytree.tree_unflatten(homes, spec)


def _unshared(outs: list, carried: Any) -> list:
    """A loop body's results, each copied into its carried buffer in turn: a result that shares
    memory with a carried value but is not that buffer itself (carried values swapped, a view of
    one) is cloned first, so that no copy reads a buffer an earlier copy wrote."""
    return [o.clone() if o is not c and _aliases(o, carried) else o for o, c in zip(outs, carried)]


def _while_node(cond_fn, body_fn, carried_inputs, additional_inputs):
    """A torch.while_loop captured as one WHILE node: the body's results are copied into the
    carried buffers and the cond function sets the node's value for the next iteration."""
    carried = tuple(t.clone() for t in carried_inputs)  # the loop's own buffers
    pred = cond_fn(*carried, *additional_inputs)
    if not _device_predicate(pred):
        raise RuntimeError(
            f"graphtrees: cond_fn must return a boolean scalar CUDA tensor in a CUDA recording, "
            f"got {pred!r}"
        )
    with _Body("while_loop", pred):
        outs = list(body_fn(*carried, *additional_inputs))
        if len(outs) != len(carried):
            raise RuntimeError(
                "body_fn should return the same number of elements as carried_inputs"
            )
        outs = _unshared(outs, carried)
        for c, o in zip(carried, outs):
            if o is not c:
                c.copy_(o)
        del outs
        _ext()._cuda_conditional_step("set", cond_fn(*carried, *additional_inputs))
    _log_once(
        "graphtrees: torch.while_loop recorded as a CUDA WHILE node (form 'conditional-node'): "
        "the predicate is read on the device at each iteration of a replay, no host sync"
    )
    return carried


_INPLACE_FUNCTIONS = frozenset(
    getattr(operator, n)
    for n in (
        "iadd isub imul itruediv ifloordiv imod ipow iand ior ixor ilshift irshift imatmul "
        "setitem delitem"
    ).split()
)


def _mutation_in(fn: Any) -> str | None:
    """An op of a branch's graph that may write a tensor in place (conservatively: any in-place
    op, of an intermediate too), or None. Only graphs can be read; a plain callable's writes are
    caught after the fact by the version counters."""
    if not isinstance(fn, torch.fx.GraphModule):
        return None
    for gm in fn.modules():
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        for n in gm.graph.nodes:
            if n.op == "call_method":
                name = n.target
                if (name.endswith("_") and not name.startswith("_")) or name == "__setitem__":
                    if name != "requires_grad_":
                        return f"Tensor.{name}"
            elif n.op == "call_function":
                t = n.target
                name = getattr(t, "__name__", str(t))
                if t in _INPLACE_FUNCTIONS:
                    return f"operator.{name}"
                if isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable:
                    return str(t)
                if isinstance(t, torch._ops.OpOverloadPacket):
                    if any(t.op(o)._schema.is_mutable for o in t.overloads()):
                        return str(t)
                if name.endswith("_") and not name.startswith("_"):
                    return name
                if n.kwargs.get("out") is not None or n.kwargs.get("inplace") is True:
                    return name
    return None


def _mutation_refusal(kind: str, fns: Any) -> str | None:
    for fn in fns:
        op = _mutation_in(fn)
        if op is not None:
            return (
                f"its {kind} writes a tensor in place ({op}) in a branch or loop body: both arms "
                "run while a function is recorded, so an arm a call does not take would write it"
            )
    return None


def _watched(operands: Any, fns: Any) -> list:
    """The tensors an arm could write: the operands (dynamo lifts the tensors a branch closes
    over into them) and the branches' own buffers and parameters."""
    out = [t for t in pytree.tree_leaves(operands) if isinstance(t, torch.Tensor)]
    for fn in fns:
        if isinstance(fn, torch.nn.Module):
            out.extend(fn.buffers())
            out.extend(fn.parameters())
    return out


def _versions(tensors: list) -> list:
    return [t._version for t in tensors]


class _Paused:
    """Ops are neither recorded nor routed into the pool inside (a loop's later iterations)."""

    def __enter__(self):
        _ext()._control_flow_event("pause")

    def __exit__(self, *exc):
        _ext()._control_flow_event("resume")


_untaken = threading.local()


class _RngKept:
    """The default generator of ``on``'s device is put back on exit when ``keep`` (an untaken
    arm's draws do not count); inside an untaken arm, a while_loop runs its cond and body once
    at most (review of issue 48, C2: its values are dropped, and it might never end)."""

    def __init__(self, on: torch.Tensor, keep: bool):
        self._on, self._keep = on, keep

    def __enter__(self):
        if self._keep:
            _ext()._control_flow_event("hold_rng", [self._on])
            _untaken.depth = getattr(_untaken, "depth", 0) + 1

    def __exit__(self, *exc):
        if self._keep:
            _untaken.depth -= 1
            _ext()._control_flow_event("restore_rng")


def _in_untaken_arm() -> bool:
    return getattr(_untaken, "depth", 0) > 0


def _needs_home(t: torch.Tensor, k: int, leaves: list, fn: Any, kept: Any) -> bool:
    """Whether the true branch's k-th result needs a buffer of its own, into which the false
    branch's result is copied: it shares memory with an operand, a buffer or parameter of the
    branch (`kept`) or an earlier result (W1). A branch that is not a graph may return a tensor it
    closes over, which no check sees: all its results get buffers (review of issue 48)."""
    if not isinstance(fn, torch.fx.GraphModule):
        return True
    return _aliases(t, (kept, leaves[:k]))


def _aliases(t: torch.Tensor, others: Any) -> bool:
    # The StorageImpl, not data_ptr(): an address read would keep the Python replay.
    storage = t.untyped_storage()._cdata
    return any(
        isinstance(o, torch.Tensor) and o.untyped_storage()._cdata == storage
        for o in pytree.tree_leaves(others)
    )


def _layout(t: torch.Tensor) -> list:
    return [st for n, st in zip(t.shape, t.stride()) if n > 1]  # a size-1 dim's stride: no matter


def _results_refusal(outs_t: Any, outs_f: Any) -> str | None:
    """Why one set of buffers cannot hold both branches' results (W2, C3), or None."""
    leaves_t, spec_t = pytree.tree_flatten(outs_t)
    leaves_f, spec_f = pytree.tree_flatten(outs_f)
    for leaves in (leaves_t, leaves_f):
        if not all(isinstance(t, torch.Tensor) for t in leaves):
            return (
                "its torch.cond returns values that are not tensors, which a recording cannot hold"
            )
        if any(st == 0 and n > 1 for t in leaves for n, st in zip(t.shape, t.stride())):
            return (
                "its torch.cond returns an expanded tensor (a stride of 0), whose elements "
                "share memory: the other branch's results cannot be copied into it"
            )
    if spec_t != spec_f or any(
        a.shape != b.shape or a.dtype != b.dtype or _layout(a) != _layout(b)
        for a, b in zip(leaves_t, leaves_f)
    ):
        return (
            "the branches of its torch.cond return tensors of different structures, shapes, "
            "dtypes or strides, which one set of results cannot hold"
        )
    return None


def _cond_dense(pred, true_fn, false_fn, operands):
    C = _ext()
    backend = C._tree_call_device() if C._in_tree_call() else ""
    if not isinstance(pred, torch.Tensor) or not backend:
        return _original["cond"](pred, true_fn, false_fn, operands)
    why = _backend_refusal("torch.cond", backend, pred, operands) or _mutation_refusal(
        "torch.cond", (true_fn, false_fn)
    )
    if why is not None:
        # A driver without conditional nodes: the tree-branch form serves any cond.
        _refuse(why, split=backend == "cuda" and bool(C._cuda_conditional_unavailable()))
        return _original["cond"](pred, true_fn, false_fn, operands)
    if _capturing(backend):
        return _cond_nodes(pred, true_fn, false_fn, operands)
    watched = _watched(operands, (true_fn, false_fn))
    before = _versions(watched)
    recorded = C._control_flow_event("begin_cond", [pred])
    taken = C._control_flow_predicate(pred)
    results, failed = [None, None], [None, None]
    homes = None
    wrote = [False, False]
    drew = False
    host_read = ""
    for arm, fn in enumerate((true_fn, false_fn)):
        if arm == 1:
            C._control_flow_event("next_arm")
            wrote[0] = before != _versions(watched)
            before = _versions(watched)
        untaken = taken != (arm == 0)
        try:
            with _RngKept(pred, keep=untaken), _Draws(pred, backend) as draws:
                results[arm], read = _run_arm(C, backend, fn, operands)
            drew = drew or draws.drew
            host_read = host_read or read
        except Exception as e:
            if not untaken:
                raise
            # The untaken branch on values no call gives it (C2). Its message only: the
            # traceback holds the recording's tensors.
            failed[arm] = f"{type(e).__name__} ({(str(e).splitlines() or [''])[0][:120]})"
            continue
        if arm == 0 and _results_refusal(results[0], results[0]) is None:
            # The results get buffers of their own where they are not the branch's own (W1):
            # the false branch's results are copied into them.
            leaves, spec = pytree.tree_flatten(results[0])
            homes = [
                t.clone() if _needs_home(t, k, leaves, true_fn, watched) else t
                for k, t in enumerate(leaves)
            ]
    wrote[1] = before != _versions(watched)
    if wrote[int(taken)]:  # arm 0 is the true branch: the untaken one is arm int(taken)
        raise RuntimeError(
            "graphtrees: the branch of a torch.cond that this call does not take wrote a tensor "
            "it did not make (an operand, a buffer, a tensor it closes over) while the function "
            "was graphed, which graphtrees did not see coming; write it outside the torch.cond"
        )
    why, split = None, False
    if wrote[0] or wrote[1]:
        why = (
            "a branch of its torch.cond wrote a tensor it did not make (an operand, a buffer, "
            "a tensor it closes over)"
        )
    elif drew:  # each branch, a tree node of its own, may draw them: the tree-branch form serves
        why, split = _rng_refusal("torch.cond"), True
    elif host_read:
        why = _host_read_refusal("torch.cond", host_read)
    elif backend == "cuda" and any(
        isinstance(t, torch.Tensor) and t.device.type != "cuda"
        for r in results
        for t in pytree.tree_leaves(r)
    ):
        why = (
            "a branch of its torch.cond returns a tensor that is not on the CUDA device, which "
            "a conditional node cannot make"
        )
    elif failed[0] is not None or failed[1] is not None:
        why = (
            f"the branch of its torch.cond that this call does not take raised "
            f"{failed[0] or failed[1]} on this call's values: a recording runs both branches"
        )
    else:
        why = _results_refusal(results[0], results[1])
    taken_out = results[0] if taken else results[1]
    if why is not None:
        C._control_flow_event("end_cond", [], [])
        if not C._refuse_recording(why):
            raise RuntimeError(
                f"graphtrees: {why}, in a replay of a recording that did not see it; "
                "call graphtrees.reset() and run the function eagerly"
            )
        if split:
            C._request_tree_branches(why)
        _log_once(f"graphtrees: a graphed function runs eagerly: {why}")
        return taken_out
    leaves_f, _ = pytree.tree_flatten(results[1])
    _, spec = pytree.tree_flatten(results[0])
    C._control_flow_event("end_cond", homes, leaves_f)
    if recorded:
        _log_once(
            "graphtrees: torch.cond recorded as a program branch (form 'program-branch'): both "
            "branches recorded; the program replays with no Python once its proof passes"
        )
    if not taken:
        with _Paused():
            for h, f in zip(homes, leaves_f):
                h.copy_(f)
    return pytree.tree_unflatten(homes, spec)


def _while_loop_dense(cond_fn, body_fn, carried_inputs, additional_inputs, *rest, **kwargs):
    C = _ext()
    backend = C._tree_call_device() if C._in_tree_call() else ""
    if not backend:  # outside a warmup, a recording or a Python replay
        return _original["while_loop"](
            cond_fn, body_fn, carried_inputs, additional_inputs, *rest, **kwargs
        )
    plain = not rest and not any(kwargs.values())  # no stack_output, no mutated arguments
    tensors = all(isinstance(t, torch.Tensor) for t in carried_inputs)
    why = None
    if not plain or not tensors:
        why = (
            "its torch.while_loop carries values that are not tensors, stacks its outputs or "
            "writes its arguments in place, which a recording cannot hold"
        )
    why = (
        why
        or _backend_refusal("torch.while_loop", backend, None, (carried_inputs, additional_inputs))
        or _mutation_refusal("torch.while_loop", (cond_fn, body_fn))
    )
    if why is not None:
        _refuse(why)
        return _original["while_loop"](
            cond_fn, body_fn, carried_inputs, additional_inputs, *rest, **kwargs
        )
    if _capturing(backend):
        return _while_node(cond_fn, body_fn, carried_inputs, additional_inputs)
    watched = _watched((carried_inputs, additional_inputs), (cond_fn, body_fn))
    before = _versions(watched)
    carried = tuple(t.clone() for t in carried_inputs)  # the loop's own buffers
    recorded = C._control_flow_event("begin_while_loop", list(carried))
    with _Draws(carried[0] if carried else None, backend) as cond_draws:
        pred, cond_read = _run_arm(C, backend, cond_fn, (*carried, *additional_inputs))
    if not (isinstance(pred, torch.Tensor) and pred.dim() == 0 and pred.dtype == torch.bool):
        raise RuntimeError(f"cond_fn must return a boolean scalar tensor but got {pred}")
    if backend == "cuda" and not _device_predicate(pred):
        _refuse(_backend_refusal("torch.while_loop", backend, pred, ()) or "")
        return _original["while_loop"](
            cond_fn, body_fn, carried_inputs, additional_inputs, *rest, **kwargs
        )
    go_on = C._control_flow_predicate(pred)
    C._control_flow_event("next_arm")
    with _RngKept(pred, keep=not go_on), _Draws(pred, backend) as draws:
        outs, body_read = _run_arm(C, backend, body_fn, (*carried, *additional_inputs))
        outs = list(outs)
        if len(outs) == len(carried):
            outs = _unshared(outs, carried)
    C._control_flow_event("end_while_loop", [pred], outs)
    why = None
    if draws.drew or cond_draws.drew:
        why = _rng_refusal("torch.while_loop")
    elif cond_read or body_read:
        why = _host_read_refusal("torch.while_loop", cond_read or body_read)
    if why is not None:
        if not C._refuse_recording(why):
            raise RuntimeError(f"graphtrees: {why}; run the function eagerly")
        _log_once(f"graphtrees: a graphed function runs eagerly: {why}")
    if before != _versions(watched):
        why = (
            "its torch.while_loop wrote a tensor it did not make (an operand, a buffer, a "
            "tensor it closes over)"
        )
        if not C._refuse_recording(why) or not go_on:
            raise RuntimeError(f"graphtrees: {why}; run the function eagerly")
        _log_once(f"graphtrees: a graphed function runs eagerly: {why}")
    if recorded:
        _log_once(
            "graphtrees: torch.while_loop recorded as a program loop (form 'program-loop'): "
            "its cond and body recorded once, the predicate read at each iteration of a replay"
        )
    if len(outs) != len(carried):
        raise RuntimeError("body_fn should return the same number of elements as carried_inputs")
    del pred
    if not go_on or _in_untaken_arm():
        return carried  # in an untaken arm: dropped, whatever the trip count
    with _Paused():
        while True:
            for c, o in zip(carried, outs):
                if o is not c:
                    c.copy_(o)
            del outs
            pred = cond_fn(*carried, *additional_inputs)
            if not C._control_flow_predicate(pred):
                return carried
            outs = _unshared(list(body_fn(*carried, *additional_inputs)), carried)


def install() -> None:
    """Replaces the dense kernels of torch.cond and torch.while_loop (idempotent)."""
    if _original:
        return
    from torch._C import DispatchKey
    from torch._higher_order_ops.cond import cond_op
    from torch._higher_order_ops.while_loop import while_loop_op

    key = DispatchKey.CompositeExplicitAutograd
    for name, op, ours in (("cond", cond_op, _cond_dense), ("while_loop", while_loop_op, None)):
        _original[name] = op.py_kernels[key]
        op.py_kernels[key] = ours or _while_loop_dense
        op._dispatch_cache.clear()
