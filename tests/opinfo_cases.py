"""PyTorch's OpInfo database (torch.testing._internal.common_methods_invocations.op_db) through
graphtrees (issue 28's conformance suite), three ways:

* run(case): each sample recorded by cudagraphify, replayed on a second sample of the same
  structure and compared with eager, bit for bit. On the CPU backend, and on CUDA: on a GPU the
  values are compared; on the CUDA stand-in (kernels never run) what does not depend on them is
  -- that the op records and replays without a capture error or a crash, and the results'
  structure (shapes, dtypes, conjugate and negative bits).
* run_training(case): samples that require grad, through graphtrees.compile (forward and
  backward graphs recorded): outputs and gradients equal eager's.
* run_isolated(cases, ...): either of them in worker processes, so that a crash is counted
  against the case it happened in (and whether eager or graphtrees was running) and the rest
  goes on. The stand-in cannot run every op eagerly (cuFFT, cuDNN, cuSOLVER are not faked).

tests/test_opinfo.py runs CI-sized selections; scripts/opinfo_sweep.py runs all of it and writes
the figures."""

import dataclasses
import json
import math
import os
import queue
import subprocess
import sys
import threading
import warnings
from typing import Any

import torch
from torch.utils import _pytree

import graphtrees

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.complex64, torch.int64, torch.bool)

# Outcomes, one per (op, variant, dtype, sample):
#   program   recorded; its CPU replays ran the recorded op program (no Python), results right
#   python    recorded; CPU replays re-ran the Python function (the program was not proven)
#   graph     recorded as a CUDA graph and replayed (values compared on a GPU only)
#   eager     graphtrees ran the call eagerly (with a logged reason), results right
#   compiler  (training) torch.compile without graphtrees gives the same result, which differs
#             from eager's: not graphtrees' (listed)
#   wrong     a result differed from eager's: a defect
#   error     graphtrees raised where eager did not: a defect
#   crash     the process died while graphtrees ran the case: a defect
#   nondet    eager itself gives different results on the same input (listed with the reason)
#   skipped   the op raises eagerly on this sample (or, on the stand-in, cannot run there), or
#             there is no sample
OUTCOMES = (
    "program",
    "python",
    "graph",
    "eager",
    "compiler",
    "wrong",
    "error",
    "crash",
    "nondet",
    "skipped",
)
DEFECTS = ("wrong", "error", "crash")

# Ops whose eager result is not a function of their inputs: two eager runs may agree by chance
# (the allocator hands back the same uninitialised block), so they are listed, not compared.
NONDETERMINISTIC = {
    name: "returns uninitialised memory"
    for name in (
        "empty",
        "empty_like",
        "empty_strided",
        "empty_permuted",
        "new_empty",
        "new_empty_strided",
        "torch.empty",
    )
}


@dataclasses.dataclass
class Case:
    op: Any
    variant: str  # "functional" or "inplace"
    dtype: torch.dtype
    device: str = "cpu"

    @property
    def op_name(self):
        return self.op.name + (f".{self.op.variant_test_name}" if self.op.variant_test_name else "")

    @property
    def name(self):
        dtype = str(self.dtype).replace("torch.", "")
        where = "" if self.device == "cpu" else f",{self.device}"
        return f"{self.op_name}[{self.variant},{dtype}{where}]"

    def key(self):
        return [self.op.name, self.op.variant_test_name, self.variant, str(self.dtype), self.device]


def op_db():
    from torch.testing._internal.common_methods_invocations import op_db as db

    return db


def cases(dtypes=DTYPES, variants=("functional", "inplace"), device="cpu"):
    for op in op_db():
        supported = op.supported_dtypes(device)
        for dtype in dtypes:
            if dtype not in supported:
                continue
            for variant in variants:
                if variant == "inplace" and op.inplace_variant is None:
                    continue
                yield Case(op, variant, dtype, device)


def training_cases(dtype=torch.float32):
    """The ops that support autograd on the CPU, functional variants."""
    for op in op_db():
        if op.supports_autograd and dtype in op.supported_backward_dtypes("cpu"):
            yield Case(op, "functional", dtype)


def _standin(device):
    if torch.device(device).type != "cuda":
        return False
    from cuda_standin.standin import current

    return current() is not None


def _standin_values(device):
    """On the CUDA stand-in with its value mode: values are compared as on a GPU."""
    if not _standin(device):
        return False
    from cuda_standin.standin import values_enabled

    return values_enabled()


def _unknown(result):
    """Why a result's values are unknown to the CUDA stand-in's value mode, or None."""
    from cuda_standin.standin import values_known

    for t in _pytree.tree_leaves(result):
        if isinstance(t, torch.Tensor) and t.device.type == "cuda" and t.layout == torch.strided:
            known, why = values_known(t)
            if not known:
                return why
    return None


def _samples(case, seed, limit, requires_grad=False):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = []
        for s in case.op.sample_inputs(case.device, case.dtype, requires_grad=requires_grad):
            out.append(s)
            if len(out) == limit:
                break
    return out


def _structure(sample):
    leaves, spec = _pytree.tree_flatten((sample.input, sample.args, sample.kwargs))

    def of(x):
        if not isinstance(x, torch.Tensor):
            return repr(x)
        strides = x.stride() if x.layout == torch.strided else str(x.layout)
        return (tuple(x.shape), x.dtype, strides, x.requires_grad)

    return spec, [of(x) for x in leaves]


def _equal(a, b, values=True, exact=True, devices=True):
    """Same structure, shapes, dtypes, conjugate and negative bits, devices (unless `devices` is
    False), and (with `values`) the same values: bit for bit, or (exact=False) within
    torch.testing's default tolerances."""
    la, sa = _pytree.tree_flatten(a)
    lb, sb = _pytree.tree_flatten(b)
    if sa != sb:
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype or x.is_conj() != y.is_conj():
                return False
            if x.is_neg() != y.is_neg() or (devices and x.device != y.device):
                return False
            if not values:
                continue
            tolerance = {"atol": 0, "rtol": 0} if exact else {}
            if x.device.type == "cuda" and x.layout == torch.strided:  # host copies: no kernels
                x, y = x.cpu(), y.cpu()
            try:
                torch.testing.assert_close(x, y, equal_nan=True, **tolerance)
            except AssertionError:
                return False
        elif not values and isinstance(x, (int, float, complex, bool)):
            continue  # a value read from the device (the stand-in has none)
        elif isinstance(x, float) and isinstance(y, float):
            if not (x == y or (math.isnan(x) and math.isnan(y))):
                return False
        elif x != y:
            return False
    return True


def _clone(sample):
    def copy(x):
        if not isinstance(x, torch.Tensor):
            return x
        return x.detach().clone().requires_grad_(x.requires_grad)

    return _pytree.tree_map(copy, (sample.input, sample.args, sample.kwargs))


def _variant(case):
    return case.op.op if case.variant == "functional" else case.op.inplace_variant


def _outcome_of_tree(case, g):
    """program / python / graph when the graphed calls replayed, else eager with its reasons."""
    t = graphtrees.tree_info(case.device)
    if t["num_replays"] == 0:
        signatures = g.signatures() if hasattr(g, "signatures") else []
        return "eager", "; ".join(filter(None, (s["eager_reason"] for s in signatures)))
    if torch.device(case.device).type == "cuda":
        return "graph", ""
    modes = {n["cpu_replay"] for n in t["nodes"]}
    return ("program" if modes == {"program"} else "python"), ""


def _each_pair(case, samples, requires_grad, runner, phase):
    counts = dict.fromkeys(OUTCOMES, 0)
    notes = []
    try:
        first = _samples(case, 0, samples, requires_grad)
        second = _samples(case, 1, samples, requires_grad)
    except Exception as e:  # noqa: BLE001 - the database's own sample generator failed
        counts["skipped"] += 1
        return counts, [("skipped", f"no samples: {type(e).__name__}")]
    for a, b in zip(first, second):
        if _structure(a) != _structure(b):
            b = a  # replay on the same values: still a replay of the recording
        outcome, detail = runner(case, a, b, phase)
        counts[outcome] += 1
        if outcome not in ("program", "python", "graph", "eager"):
            notes.append((outcome, detail))
    return counts, notes


def _no_phase(_what):
    pass


def run(case, samples=1, verify=False, phase=_no_phase):
    """{outcome: count} for the case's first `samples` samples, and [(outcome, detail)] for those
    that are not recorded or eager. `phase("eager" | "graphtrees")` is told what runs next.
    Under torch.no_grad(), as cudagraphify is used for inference."""

    def runner(case, a, b, phase):
        return _run_pair(case, _variant(case), a, b, verify, phase)

    with torch.no_grad():
        return _each_pair(case, samples, False, runner, phase)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _run_pair(case, fn, a, b, verify, phase):
    if case.op.name in NONDETERMINISTIC:
        return "nondet", NONDETERMINISTIC[case.op.name]
    values = not _standin(case.device) or _standin_values(case.device)
    # Eager on copies: whether it runs, and whether it is deterministic.
    phase("eager")
    try:
        inp, args, kwargs = _clone(b)
        want = fn(inp, *args, **kwargs)
        inp2, args2, kwargs2 = _clone(b)
        again = fn(inp2, *args2, **kwargs2)
        _sync(case.device)
    except Exception as e:  # noqa: BLE001 - the op refuses the sample eagerly: no comparison
        return "skipped", f"eager raises {type(e).__name__}"
    if case.variant == "inplace":
        want, again = (want, inp), (again, inp2)
    if values and _standin(case.device):
        why = _unknown(want)
        if why:
            return "skipped", f"the stand-in's value mode: {why}"
    if not _equal(want, again, values):
        return "nondet", "eager differs between two runs on the same input"
    # On the stand-in, an op that reads device values on the host (nonzero, unique, item) sizes
    # its results from memory no kernel wrote: what eager gives depends on what that memory
    # held before, in graphtrees' runs as in eager's.
    unsized = not values and _reads_device_values(fn, b)
    # The copies each call takes, made first: on the stand-in a sparse sample's indices come
    # from kernels that never ran, and cloning it can raise in torch, not in graphtrees.
    try:
        calls = [_clone(a), _clone(a), _clone(b), _clone(b)]
    except Exception as e:  # noqa: BLE001
        return "skipped", f"copying the sample raises {type(e).__name__}"
    phase("graphtrees")
    graphtrees.reset()
    g = graphtrees.cudagraphify(
        lambda inp, args, kwargs: fn(inp, *args, **kwargs),
        name=case.name,
        verify=True if verify else None,
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for inp, args, kwargs in calls[:2]:  # warmup, recording
                g(inp, args, kwargs)
            for inp, args, kwargs in calls[2:]:  # replays on the second sample's values
                got = g(inp, args, kwargs)
                if case.variant == "inplace":
                    got = (got, inp)
                _sync(case.device)
                if not _equal(got, want, values):
                    if unsized and _nothing_replayed(case):
                        return "nondet", _UNSIZED
                    if case.op.name in CAPTURE_DEVICES and _equal(got, want, values, devices=False):
                        return "nondet", CAPTURE_DEVICES[case.op.name]
                    return "wrong", "a replay differs from eager"
    except graphtrees.ReplayMismatchError as e:
        return "wrong", f"verify: {str(e)[:200]}"
    except Exception as e:  # noqa: BLE001 - graphtrees raised where eager did not: a defect
        if unsized and _nothing_replayed(case):
            return "nondet", _UNSIZED
        return "error", f"{type(e).__name__}: {str(e)[:200]}"
    return _outcome_of_tree(case, g)


# Ops whose results torch itself puts on another device while a CUDA graph is captured: any
# replay of a capture returns them there (PyTorch's own trees as well). Not compared by device.
CAPTURE_DEVICES = {
    "torch.ops.aten._efficient_attention_forward": (
        "torch 2.11 returns its philox seed and offset on the GPU while a CUDA graph is captured "
        "and on the CPU eagerly (torch's capture behaviour; torch 2.14 returns them on the CPU)"
    ),
}

_UNSIZED = (
    "the stand-in: it reads device values on the host, which no kernel wrote, and nothing was "
    "replayed (every call ran it as eager does)"
)


def _nothing_replayed(case):
    return graphtrees.tree_info(case.device)["num_replays"] == 0


def _reads_device_values(fn, sample):
    """Whether one eager run synchronises with the host (torch's sync debug mode raises)."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        inp, args, kwargs = _clone(sample)
        fn(inp, *args, **kwargs)
        return False
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode(previous)


# Training: the op through graphtrees.compile, its results reduced to a loss with fixed random
# weights, gradients of every input that requires grad; the same on eager. Call 1 warms up,
# call 2 records (the backward graph at its first backward), calls 3 and 4 replay on the
# second sample's values.


def _loss_and_grads(fn, sample, weights_seed=0):
    inp, args, kwargs = _clone(sample)
    out = fn(inp, args, kwargs)
    leaves = [x for x in _pytree.tree_leaves((inp, args, kwargs)) if isinstance(x, torch.Tensor)]
    wanted = [x for x in leaves if x.requires_grad]
    outs = [o for o in _pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
    gen = torch.Generator().manual_seed(weights_seed)
    loss = None
    for o in outs:
        if not o.requires_grad or not (o.is_floating_point() or o.is_complex()):
            continue
        real = torch.view_as_real(o.resolve_conj()) if o.is_complex() else o
        weight = torch.rand(real.shape, generator=gen, dtype=real.dtype)
        term = (real * weight).sum()
        loss = term if loss is None else loss + term
    values = [o.detach().clone() for o in outs]
    if loss is None or not wanted:
        return values, None
    grads = torch.autograd.grad(loss, wanted, allow_unused=True)
    return values, [None if g is None else g.detach().clone() for g in grads]


def run_training(case, samples=1, phase=_no_phase):
    """run(), for samples that require grad, through graphtrees.compile(inner="aot_eager")."""
    return _each_pair(case, samples, True, _run_training_pair, phase)


def _run_training_pair(case, a, b, phase):
    if case.op.name in NONDETERMINISTIC:
        return "nondet", NONDETERMINISTIC[case.op.name]
    op = case.op.op

    def fn(inp, args, kwargs):
        return op(inp, *args, **kwargs)

    phase("eager")
    try:
        want_a = _loss_and_grads(fn, a)
        want_b = _loss_and_grads(fn, b)
        again_b = _loss_and_grads(fn, b)
    except Exception as e:  # noqa: BLE001 - eager refuses the sample
        return "skipped", f"eager raises {type(e).__name__}"
    if want_b[1] is None:
        return "skipped", "no result requires grad"
    if not _equal(want_b, again_b):
        return "nondet", "eager differs between two runs on the same input"
    phase("graphtrees")
    torch._dynamo.reset()
    graphtrees.reset()
    compiled = graphtrees.compile(fn, inner="aot_eager", dynamic=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = [_loss_and_grads(compiled, s) for s in (a, a, b, b)]
    except Exception as e:  # noqa: BLE001
        why = f"{type(e).__name__}: {str(e)[:200]}"
        return ("compiler" if _compile_fails(fn, a) else "error"), why
    outcome, reasons = _outcome_of_tree(case, compiled)
    for result, want in zip(got, (want_a, want_a, want_b, want_b)):
        if not _equal(result, want, exact=False):
            plain = _plain_compile(fn, b if want is want_b else a)
            if plain is not None and _equal(result, plain):
                return "compiler", "torch.compile(backend='aot_eager') differs from eager alike"
            return "wrong", "a result or gradient differs from eager"
    torch._dynamo.reset()
    return outcome, reasons


def _plain_compile(fn, sample):
    torch._dynamo.reset()
    try:
        return _loss_and_grads(torch.compile(fn, backend="aot_eager", dynamic=False), sample)
    except Exception:  # noqa: BLE001
        return None
    finally:
        torch._dynamo.reset()


def _compile_fails(fn, sample):
    return _plain_compile(fn, sample) is None


# Worker processes (run_isolated).


def _find_case(key, ops):
    name, variant_test_name, variant, dtype, device = key
    return Case(ops[(name, variant_test_name)], variant, getattr(torch, dtype[6:]), device)


def _worker(mode, samples, verify):
    ops = {(op.name, op.variant_test_name): op for op in op_db()}
    out = sys.stdout

    def phase(what):
        out.write(f"PHASE {what}\n")
        out.flush()

    for line in sys.stdin:
        case = _find_case(json.loads(line), ops)
        if mode == "training":
            counts, notes = run_training(case, samples, phase)
        else:
            counts, notes = run(case, samples, verify, phase)
        out.write("RESULT " + json.dumps([counts, notes]) + "\n")
        out.flush()
    return 0


def _forward_lines(stream, lines):
    for line in stream:
        lines.put(line)
    lines.put(None)


def run_isolated(case_list, mode="replay", samples=1, verify=False, timeout=300):
    """Yields (case, counts, notes) for each case, run in worker processes (mode "replay": run(),
    "training": run_training()). A worker that dies or hangs counts its case as a crash if
    graphtrees was running, as skipped if eager was (the op cannot run there), and a new worker
    goes on with the next case."""
    pending = list(case_list)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    # On the CUDA stand-in, memory no kernel wrote reads as zeros rather than the NaN poison:
    # the sizes of data-dependent results (nonzero, unique, masked_select) are read from such
    # memory, and a poisoned count is an impossible size in one run and not in another.
    env.setdefault("CUDA_STANDIN_POISON", "0x00")
    while pending:
        proc = subprocess.Popen(
            [
                sys.executable,
                os.path.join(here, "opinfo_cases.py"),
                mode,
                str(samples),
                str(int(verify)),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        lines = queue.Queue()
        threading.Thread(target=_forward_lines, args=(proc.stdout, lines), daemon=True).start()
        for case in list(pending):
            proc.stdin.write(json.dumps(case.key()) + "\n")
            proc.stdin.flush()
            phase, result = "eager", None
            while result is None:
                try:
                    line = lines.get(timeout=timeout)
                except queue.Empty:
                    proc.kill()
                    line = None
                if line is None:
                    break
                if line.startswith("PHASE "):
                    phase = line.split()[1]
                elif line.startswith("RESULT "):
                    result = json.loads(line[7:])
            pending.pop(0)
            if result is not None:
                yield case, result[0], [tuple(n) for n in result[1]]
                continue
            proc.wait()
            counts = dict.fromkeys(OUTCOMES, 0)
            how = f"the process ended with {proc.returncode}" if proc.returncode else "hung"
            if phase == "eager":
                counts["skipped"] = 1
                yield case, counts, [("skipped", f"eager {how} (the op cannot run here)")]
            else:
                counts["crash"] = 1
                yield case, counts, [("crash", f"{how} while graphtrees ran it")]
            break  # a new worker for the rest
        else:
            proc.stdin.close()
            proc.wait()


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1], int(sys.argv[2]), bool(int(sys.argv[3]))))
