"""`python -m graphtrees.info`: versions, backends compiled in, devices seen."""

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
    if torch.cuda.is_available():
        info["devices"] += [
            f"cuda:{i} ({torch.cuda.get_device_name(i)})" for i in range(torch.cuda.device_count())
        ]
    return info


def main():
    info = collect()
    width = max(len(k) for k in info)
    for k, v in info.items():
        print(f"{k:<{width}}  {v}")
    print(json.dumps(info))


if __name__ == "__main__":
    main()
