"""Loads the compiled extension lazily and reports a missing or broken build actionably."""

import logging

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


_logger = logging.getLogger("graphtrees")


def _emit(level: int, message: str) -> None:
    if _logger.isEnabledFor(level):
        _logger.log(level, message)


def _collect_garbage() -> None:
    import gc

    gc.collect()


def _on_module_change(*args):
    _C._bump_module_epoch()
    return None


def _install() -> None:
    import atexit

    import torch.nn.modules.module as module

    _C._set_log_sink(_emit)
    _C._set_collect_garbage_hook(_collect_garbage)
    module.register_module_parameter_registration_hook(_on_module_change)
    module.register_module_buffer_registration_hook(_on_module_change)
    module.register_module_module_registration_hook(_on_module_change)

    def _shutdown():
        _C.reset()
        _C._set_log_sink(None)
        _C._set_collect_garbage_hook(None)

    atexit.register(_shutdown)


if _C is not None:
    _install()
