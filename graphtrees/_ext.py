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


def _check_cxx_runtime() -> None:
    """ImportError when graphtrees._C carries a private copy of the C++ runtime (libstdc++
    linked in statically) instead of using the process's libstdc++.so.6: its locale code
    crashes at the first number it formats (Note [The process's C++ runtime] in setup.py). Asked
    through ctypes before the module is imported, from a function that formats nothing (Note [A
    private C++ runtime, found without formatting] in csrc/RuntimeCheck.h)."""
    import ctypes
    import importlib.util
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        spec = importlib.util.find_spec(__package__ + "._C")
    except ImportError:  # the _C import below reports it
        return
    if spec is None or not spec.origin:  # never built: the _C import reports it
        return
    import torch  # noqa: F401 - loads the process's C++ runtime first, as any real use does

    try:
        lib = ctypes.CDLL(spec.origin)
        check = lib.graphtrees_private_cxx_runtime
    except (OSError, AttributeError):  # unloadable, or built before the check: _C's import says
        return
    check.restype = ctypes.c_int
    if check() != 1:
        return
    try:
        from ._built_with import LINKER as COMPILER
    except ImportError:
        COMPILER = "an unknown compiler (graphtrees/_built_with.py does not say)"
    raise ImportError(
        f"graphtrees' C++ extension ({spec.origin}) carries its own copy of the C++ standard "
        f"library (libstdc++ linked in statically; built with {COMPILER}) instead of using the "
        "libstdc++.so.6 this process loaded: its locale code would crash at the first number it "
        "formats, so it is not loaded. Rebuild it from the source checkout with `pip install "
        "--no-build-isolation -e .` (graphtrees' setup.py links the process's C++ runtime "
        "whatever compiler is on PATH, and refuses a build that still carries a copy); if the "
        "build is refused, use a compiler that links libstdc++.so.6 dynamically, e.g. "
        "`CXX=/usr/bin/g++ CC=/usr/bin/gcc`."
    )


_check_torch()  # `import graphtrees` under another torch raises, naming both
_check_cxx_runtime()  # and so does a build that carries a private C++ runtime
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
