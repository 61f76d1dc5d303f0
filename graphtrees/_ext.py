"""Loads the compiled extension lazily and reports a missing or broken build actionably."""

_C = None
_import_error = None


def _check_torch() -> None:
    """ImportError when the running torch is not the one the extension was compiled against
    (graphtrees/_built_with.py, written by setup.py): its C++ ABI would not match (undefined
    symbols at best, a crash at worst)."""
    try:
        from ._built_with import TORCH
    except ImportError:  # a source tree that was never built: the _C import reports it
        return
    import torch

    if torch.__version__ != TORCH:
        raise ImportError(
            f"graphtrees was built against torch {TORCH}, running torch {torch.__version__}: "
            "its C++ extension only loads with the torch it was compiled against. Install "
            f"torch {TORCH}, or rebuild graphtrees for this torch (`pip install "
            "--no-build-isolation .` from the source checkout, or a wheel built with it)."
        )


_check_torch()  # `import graphtrees` under another torch raises, naming both
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
