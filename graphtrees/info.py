"""`python -m graphtrees.info`: versions (the torch the extension was built against too), backends
compiled in, whether the CUDA backend is enabled (and why not), devices seen."""

import json
import platform


def _shadowed_by() -> str | None:
    """The folder that hides the installed package, when ``graphtrees`` was imported as a
    namespace package: run from the folder that holds a clone named ``graphtrees``, Python finds
    the clone (no ``__init__.py`` at its root) before the installed package."""
    import sys

    pkg = sys.modules.get(__package__ or "graphtrees")
    if pkg is None or getattr(pkg, "__file__", None) is not None:
        return None
    return ", ".join(getattr(pkg, "__path__", [])) or "an unknown folder"


def collect():
    import torch

    shadow = _shadowed_by()
    if shadow is not None:
        raise SystemExit(
            f"graphtrees: 'import graphtrees' found the folder {shadow} (a directory named "
            "graphtrees without an __init__.py, such as the clone itself) instead of the "
            "installed package. Run from another folder, or from inside the clone."
        )
    from . import __version__
    from ._ext import _import_error, has_ext

    info = {
        "graphtrees": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "extension_loaded": has_ext(),
        "extension_error": None if has_ext() else str(_import_error),
        "backends": [],
        "devices": ["cpu"],
    }
    if has_ext():
        from ._ext import _C

        info["backends"] = list(_C.backends)
        info["built_with_torch"] = getattr(_C, "built_with_torch", None)
        reason = _C._cuda_backend_disabled_reason()
        info["cuda_backend_enabled"] = reason == ""
        if reason:
            info["cuda_backend_disabled_because"] = reason
    if torch.cuda.is_available():
        info["devices"] += [
            f"cuda:{i} ({torch.cuda.get_device_name(i)})" for i in range(torch.cuda.device_count())
        ]
    return info


def main(argv=None):
    """A table for people; ``--json`` prints the same as one JSON object, for programs."""
    import sys

    info = collect()
    if "--json" in (sys.argv[1:] if argv is None else argv):
        print(json.dumps(info))
        return
    width = max(len(k) for k in info)
    for k, v in info.items():
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
