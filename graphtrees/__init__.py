"""graphtrees: CUDA Graph Trees for any PyTorch callable.

Wrap a callable with :func:`cudagraphify`; graphtrees warms it up, records it as a graph and
replays it, keeping the recordings of all wrapped callables on a device in one tree whose nodes
share one memory pool. See docs/semantics.md for how checkpointing keeps live outputs safe.
"""

from ._api import (
    GraphvizNotFoundError,
    check_pool_invariants,
    cudagraphify,
    mark_step_begin,
    memory_budget,
    reset,
    set_memory_budget,
    tree_info,
    tree_to_dot,
    tree_to_svg,
)
from ._dynamo_backend import SkipError, compile, make_backend, split_info
from ._ext import has_ext
from ._policy import install, install_from_environment, installed, uninstall
from ._report import install_from_environment as _report_from_environment
from ._report import report, reset_report
from ._verify import ReplayMismatchError
from ._version import __version__

__all__ = [
    "GraphvizNotFoundError",
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
    "report",
    "reset",
    "reset_report",
    "set_memory_budget",
    "split_info",
    "tree_info",
    "tree_to_dot",
    "tree_to_svg",
    "uninstall",
    "__version__",
]

install_from_environment()  # GRAPHTREES_INSTALL=1: graphtrees behind mode='reduce-overhead'
_report_from_environment()  # GRAPHTREES_REPORT=1: a one-line summary at exit
