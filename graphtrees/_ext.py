"""Loads the compiled extension lazily and reports a missing or broken build actionably."""

_C = None
_import_error = None

try:
    from . import _C  # noqa: F811
except ImportError as e:  # pragma: no cover - exercised by a subprocess test
    _import_error = e


def has_ext() -> bool:
    return _C is not None


def get_ext():
    """Returns graphtrees._C or raises an ImportError that says how to fix the build."""
    if _C is None:
        import torch

        raise ImportError(
            "graphtrees' C++ extension (graphtrees._C) is not available: "
            f"{_import_error}. It must be compiled against the installed torch "
            f"({torch.__version__}, CUDA {torch.version.cuda}). Rebuild it from the source "
            "checkout with `pip install --no-build-isolation -e .` (after installing or "
            "upgrading torch)."
        )
    return _C


if _C is not None:
    from . import _hooks

    _hooks.install(_C)
