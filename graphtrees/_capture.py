"""``wrapped.capture()``: records every bucket of a graphed callable ahead of time, with progress
shown. The batch is padded or cut by the same C++ rule that pads calls (Note [Buckets])."""

import torch

from ._ext import get_ext


class _Progress:
    """On a terminal: tqdm when installed, else one updating line; elsewhere: log lines."""

    def __init__(self, total, enabled):
        import logging
        import sys

        self._bar = None
        self._tty = False
        self._log = logging.getLogger("graphtrees")
        self._enabled = enabled
        if not enabled:
            return
        # A bar or an updating line only on a terminal: in a log file or CI, one log line per
        # bucket (a bar there writes a line per refresh).
        self._tty = sys.stderr.isatty()
        if not self._tty:
            return
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc="graphtrees capture", unit="bucket")
        except ImportError:
            pass

    def update(self, text):
        import sys

        if not self._enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(text)
            self._bar.update(1)
        elif self._tty:
            sys.stderr.write("\rgraphtrees capture: " + text + " " * 8)
            sys.stderr.flush()
        else:
            self._log.info("capture: %s", text)

    def close(self):
        import sys

        if self._bar is not None:
            self._bar.close()
        elif self._tty:
            sys.stderr.write("\n")


def capture(wrapped, *args, progress=True, **kwargs):
    """Records every bucket of ``wrapped`` ahead of time, largest first (so that the smaller ones
    reuse its memory), from example arguments of any batch size. Python's garbage collector is
    frozen meanwhile (``gc.freeze()``), unless the application froze objects already: those stay
    frozen after it. Returns one dict per bucket: size, seconds, pool_bytes_after and status
    ("recorded", or "eager" with a reason)."""
    import gc
    import time

    options = wrapped.options
    buckets = sorted(options["buckets"] or (), reverse=True)
    if not buckets:
        raise ValueError("capture() needs graphtrees.cudagraphify(..., buckets=[...])")
    device = None
    for leaf in torch.utils._pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            device = leaf.device
            break
    if device is None:
        raise ValueError("capture(): the example arguments contain no tensor")
    reports = []
    bar = _Progress(len(buckets), progress)
    gc.collect()
    # gc.unfreeze() thaws every frozen object: objects the application froze (a server's gc.freeze()
    # before fork) would be thawed with ours. So it freezes only when nothing was frozen before.
    freezing = gc.get_freeze_count() == 0
    if freezing:
        gc.freeze()
    started = time.perf_counter()
    try:
        for size in buckets:
            t0 = time.perf_counter()
            ex_args, ex_kwargs = wrapped._resize_example(size, *args, **kwargs)
            before = get_ext().tree_info(str(device))
            for _ in range(options["warmup_iters"] + 1):
                get_ext().mark_step_begin()
                wrapped(*ex_args, **ex_kwargs)
            after = get_ext().tree_info(str(device))
            report = dict(
                size=size,
                seconds=round(time.perf_counter() - t0, 4),
                pool_bytes_after=after["pool"]["reserved_bytes"],
            )
            if (
                after["num_recordings"] > before["num_recordings"]
                or after["num_replays"] > before["num_replays"]
            ):
                report["status"] = "recorded"
            else:
                reasons = [s["eager_reason"] for s in wrapped.signatures() if s["eager_reason"]]
                report["status"] = "eager"
                report["reason"] = reasons[-1] if reasons else "it ran eagerly"
            reports.append(report)
            bar.update(
                f"bucket {size}: {report['status']}, "
                f"{time.perf_counter() - started:.1f} s, "
                f"pool {report['pool_bytes_after'] / 2**20:.1f} MiB"
            )
    finally:
        if freezing:
            gc.unfreeze()
        bar.close()
    return reports
