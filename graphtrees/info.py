"""`python -m graphtrees.info`: versions (the torch the extension was built against too), backends
compiled in, whether the CUDA backend is enabled (and why not), devices seen."""

import json
import platform


def collect():
    import torch

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
