"""verify=True: a replay's results compared with an eager run (Note [Verified replays] in
csrc/Verifier.h). The C++ wrapper runs the function eagerly and calls :func:`check`."""

import logging
from typing import Any

import torch
from torch.utils import _pytree

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


def check(name: str, warn: bool, replayed: Any, eager: Any, baked: str) -> Any:
    """Returns what the call returns: ``replayed`` if it matches ``eager``; otherwise raises
    ReplayMismatchError, or (``warn``) logs once and returns ``eager``. ``baked``: the first
    recorded op whose non-tensor argument differs in the eager run (CPU backend), or ""."""
    found = _difference(replayed, eager)
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
