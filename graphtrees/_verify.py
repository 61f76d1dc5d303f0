"""verify=True: a replay's results compared with an eager run (Note [Verified replays] in
csrc/Verifier.h). The C++ wrapper runs the function eagerly and calls :func:`check`."""

import logging
from typing import Any

import torch
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode

_log = logging.getLogger("graphtrees")
_warned: set[tuple[str, str]] = set()


class ReplayMismatchError(RuntimeError):
    """A verified replay (``verify=True``) returned something an eager run of the same function,
    on the same inputs and from the same RNG state, does not: the recording baked in a value
    (a Python attribute, a global, a number, a branch) that has changed since."""


def _difference(replayed: Any, eager: Any) -> tuple[str, str] | None:
    """(output path, what differs) for the first output that differs, or None."""
    got, got_spec = _pytree.tree_flatten_with_path(replayed)
    want, want_spec = _pytree.tree_flatten_with_path(eager)
    if got_spec != want_spec:
        return "its result", f"has another structure ({want_spec} eagerly)"
    for (path, a), (_, b) in zip(got, want):
        where = f"output {_pytree.keystr(path)}" if path else "its result"
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype:
                eager_kind = f"{b.dtype}{list(b.shape)}"
                return where, f"is {a.dtype}{list(a.shape)} where the eager run gives {eager_kind}"
            try:
                torch.testing.assert_close(a, b, equal_nan=True, check_device=False)
            except AssertionError:
                if a.dtype.is_floating_point or a.dtype.is_complex:
                    wide = torch.complex128 if a.dtype.is_complex else torch.float64
                    diff = (a.detach().cpu().to(wide) - b.detach().cpu().to(wide)).abs()
                    diff = diff.nan_to_num(nan=float("inf")).max().item()
                    return where, f"differs from the eager run's by up to {diff:g}"
                wrong = (a.detach().cpu() != b.detach().cpu()).sum().item()
                return where, f"differs from the eager run's in {wrong} of {a.numel()} elements"
        elif isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor) or a != b:
            return where, f"is {a!r} where the eager run gives {b!r}"
    return None


class _StateWrites(TorchDispatchMode):
    """Notes the tensors ops write in place that are neither the call's arguments nor made by
    an earlier op of the same run: state the function keeps elsewhere (Note [Verified replays])."""

    def __init__(self, arguments: list[torch.Tensor]) -> None:
        super().__init__()
        self._arguments = {_storage_key(t) for t in arguments}
        self._made: set[int] = set()
        self.written: dict[int, torch.Tensor] = {}
        # torch.cond and torch.while_loop reach the mode as themselves: run as they are (a
        # recording refuses arms that write in place; review of issue 48).
        self.supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.cond's and torch.while_loop's wrappers compile the op: dynamo leaves the mode be.
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        schema = func._schema
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
            for t in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    key = _storage_key(t)
                    if key not in self._arguments and key not in self._made:
                        base = t if t._base is None else t._base  # the whole state tensor
                        self.written.setdefault(id(base), base)
        seen = {
            _storage_key(t)
            for t in _pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **kwargs)
        for t in _pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and _storage_key(t) not in seen:
                self._made.add(_storage_key(t))
        return out


def _storage_key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr() or id(t.untyped_storage())
    except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass)
        return id(t)


def run_noting_state_writes(fn, args, kwargs, arguments):
    """``(fn(*args, **kwargs), tensors)``: the call's result and the tensors it wrote that are not
    ``arguments`` and were not made by the call (a buffer, a cache held in a closure)."""
    mode = _StateWrites(arguments)
    with mode:
        out = fn(*args, **kwargs)
    state = [t for t in mode.written.values() if t.numel() > 0]
    if state:
        _log.debug(
            "verify: %d tensors written outside the arguments (%s) are restored around each eager "
            "check",
            len(state),
            ", ".join(f"{t.dtype}{list(t.shape)}" for t in state[:4]),
        )
    return out, state


def check(
    name: str,
    warn: bool,
    replayed: Any,
    eager: Any,
    baked: str,
    replayed_state: list[torch.Tensor] = (),
    eager_state: list[torch.Tensor] = (),
) -> Any:
    """Returns what the call returns: ``replayed`` if it matches ``eager``; otherwise raises
    ReplayMismatchError, or (``warn``) logs once and returns ``eager``. ``baked``: the first
    recorded op whose non-tensor argument differs in the eager run (CPU backend), or "".
    ``replayed_state`` and ``eager_state``: what the replay and the eager run wrote into the
    tensors the function writes outside its arguments, compared as well."""
    found = _difference(replayed, eager)
    if found is None and replayed_state:
        found = _difference(list(replayed_state), list(eager_state))
        if found is not None:
            where = found[0].replace("output ", "")
            found = (
                f"a tensor it writes outside its arguments (state {where}: a buffer, a "
                "cache or a closure tensor)",
                found[1],
            )
    if found is None:
        return replayed
    where, what = found
    message = f"graphtrees: the replay of '{name}' does not match an eager run: {where} {what}"
    if baked:
        message += f"; {baked}"
    message += (
        ". The recording replays what it saw when it was recorded; pass the changing value as a"
        " tensor argument, or keep it out of the graphed function (docs/semantics.md, 'What a"
        " replay bakes')."
    )
    if not warn:
        raise ReplayMismatchError(message)
    if (name, where) not in _warned:
        _warned.add((name, where))
        _log.warning("%s The eager result is returned (verify='warn').", message)
    return eager
