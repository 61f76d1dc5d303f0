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
# On CUDA the recording has no control steps yet: a cond or while_loop there refuses the warmup
# with a reason that names it (the function runs eagerly, logged once), instead of reading the
# predicate during a capture. Issue 48 plans conditional nodes and, where none can serve, the
# tree-branch form (docs/semantics.md, "Data-dependent control flow").

import logging
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


def _device_of(pred: Any, tensors: Any) -> torch.device | None:
    for t in pytree.tree_leaves(tensors):
        if isinstance(t, torch.Tensor):
            return t.device
    return pred.device if isinstance(pred, torch.Tensor) else None


def _refuse_on(kind: str, device: torch.device) -> None:
    why = (
        f"it calls {kind} on {device}, whose predicate would be read on the host during the "
        f"capture; graphtrees records {kind} as a program's control step on the CPU backend "
        "only: CUDA conditional nodes (and the tree-branch form) come later (issue 48)"
    )
    _ext()._refuse_recording(why)
    _log_once(f"graphtrees: {kind} on {device} runs eagerly: {why}")


class _Paused:
    """Ops are neither recorded nor routed into the pool inside (a loop's later iterations)."""

    def __enter__(self):
        _ext()._control_flow_event("pause")

    def __exit__(self, *exc):
        _ext()._control_flow_event("resume")


class _RngKept:
    """The default generator of ``on``'s device is put back on exit when ``keep`` (an untaken
    arm's draws do not count)."""

    def __init__(self, on: torch.Tensor, keep: bool):
        self._on, self._keep = on, keep

    def __enter__(self):
        if self._keep:
            _ext()._control_flow_event("hold_rng", [self._on])

    def __exit__(self, *exc):
        if self._keep:
            _ext()._control_flow_event("restore_rng")


def _tensors(out: Any, kind: str) -> tuple[list, Any]:
    leaves, spec = pytree.tree_flatten(out)
    if not all(isinstance(t, torch.Tensor) for t in leaves):
        raise RuntimeError(
            f"graphtrees: {kind} returns values that are not tensors inside a graphed call; "
            "return tensors"
        )
    return leaves, spec


def _aliases(t: torch.Tensor, operands: Any) -> bool:
    # The StorageImpl, not data_ptr(): an address read would keep the Python replay.
    storage = t.untyped_storage()._cdata
    return any(
        isinstance(o, torch.Tensor) and o.untyped_storage()._cdata == storage
        for o in pytree.tree_leaves(operands)
    )


def _cond_dense(pred, true_fn, false_fn, operands):
    C = _ext()
    if not isinstance(pred, torch.Tensor) or not C._in_tree_call():
        return _original["cond"](pred, true_fn, false_fn, operands)
    device = _device_of(pred, operands)
    if device is None or device.type != "cpu" or pred.device.type != "cpu":
        _refuse_on("torch.cond", device or pred.device)
        return _original["cond"](pred, true_fn, false_fn, operands)
    recorded = C._control_flow_event("begin_cond", [pred])
    taken = C._control_flow_predicate(pred)
    with _RngKept(pred, keep=not taken):
        outs_t, spec = _tensors(true_fn(*operands), "torch.cond's true branch")
    # Results that alias an operand get a buffer of their own, which the false branch can fill.
    homes = [t.clone() if _aliases(t, operands) else t for t in outs_t]
    del outs_t
    C._control_flow_event("next_arm")
    with _RngKept(pred, keep=taken):
        outs_f, _ = _tensors(false_fn(*operands), "torch.cond's false branch")
    C._control_flow_event("end_cond", homes, outs_f)
    if recorded:
        _log_once(
            "graphtrees: torch.cond recorded as a program branch (form 'program-branch'): both "
            "branches recorded, the predicate read by each replay, no Python in the replay"
        )
    if not taken:
        if len(homes) != len(outs_f) or any(
            h.shape != f.shape or h.dtype != f.dtype for h, f in zip(homes, outs_f)
        ):
            C._refuse_recording(
                "the branches of its torch.cond return tensors of different shapes or dtypes, "
                "which one set of results cannot hold"
            )
            return pytree.tree_unflatten(outs_f, spec)
        with _Paused():
            for h, f in zip(homes, outs_f):
                h.copy_(f)
    return pytree.tree_unflatten(homes, spec)


def _while_loop_dense(cond_fn, body_fn, carried_inputs, additional_inputs, *rest, **kwargs):
    C = _ext()
    plain = not rest and not any(kwargs.values())  # no stack_output, no mutated arguments
    tensors = all(isinstance(t, torch.Tensor) for t in carried_inputs)
    if not C._in_tree_call() or not plain or not tensors:
        if C._in_tree_call():
            C._refuse_recording(
                "its torch.while_loop carries values that are not tensors, or stacks its "
                "outputs, which a recording cannot hold"
            )
        return _original["while_loop"](
            cond_fn, body_fn, carried_inputs, additional_inputs, *rest, **kwargs
        )
    device = _device_of(None, (carried_inputs, additional_inputs))
    if device is None or device.type != "cpu":
        _refuse_on("torch.while_loop", device)
        return _original["while_loop"](cond_fn, body_fn, carried_inputs, additional_inputs)
    carried = tuple(t.clone() for t in carried_inputs)  # the loop's own buffers
    recorded = C._control_flow_event("begin_while_loop", list(carried))
    pred = cond_fn(*carried, *additional_inputs)
    if not (isinstance(pred, torch.Tensor) and pred.dim() == 0 and pred.dtype == torch.bool):
        raise RuntimeError(f"cond_fn must return a boolean scalar tensor but got {pred}")
    go_on = C._control_flow_predicate(pred)
    C._control_flow_event("next_arm")
    with _RngKept(pred, keep=not go_on):
        outs = list(body_fn(*carried, *additional_inputs))
    C._control_flow_event("end_while_loop", [pred], outs)
    if recorded:
        _log_once(
            "graphtrees: torch.while_loop recorded as a program loop (form 'program-loop'): "
            "its cond and body recorded once, the predicate read at each iteration of a replay"
        )
    if len(outs) != len(carried):
        raise RuntimeError("body_fn should return the same number of elements as carried_inputs")
    del pred
    if not go_on:
        return carried
    with _Paused():
        while True:
            for c, o in zip(carried, outs):
                if o is not c:
                    c.copy_(o)
            del outs
            pred = cond_fn(*carried, *additional_inputs)
            if not C._control_flow_predicate(pred):
                return carried
            outs = list(body_fn(*carried, *additional_inputs))


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
