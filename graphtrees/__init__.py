"""graphtrees: CUDA Graph Trees for any PyTorch callable.

Wrap a callable with :func:`cudagraphify`; graphtrees warms it up, records it as a graph and
replays it, keeping the recordings of all wrapped callables on a device in one tree whose nodes
share one memory pool. See docs/semantics.md for how checkpointing keeps live outputs safe.
"""

from ._api import (
    check_pool_invariants,
    cudagraphify,
    mark_step_begin,
    memory_budget,
    reset,
    set_memory_budget,
    tree_info,
    tree_to_dot,
)
from ._dynamo_backend import SkipError, compile, make_backend, split_info
from ._ext import has_ext
from ._policy import install, install_from_environment, installed, uninstall
from ._verify import ReplayMismatchError
from ._version import __version__

__all__ = [
    "ReplayMismatchError",
    "SkipError",
    "check_pool_invariants",
    "compile",
    "cudagraphify",
    "has_ext",
    "install",
    "installed",
    "make_backend",
    "mark_step_begin",
    "memory_budget",
    "reset",
    "set_memory_budget",
    "split_info",
    "tree_info",
    "tree_to_dot",
    "uninstall",
    "__version__",
]

install_from_environment()  # GRAPHTREES_INSTALL=1: graphtrees behind mode='reduce-overhead'
