"""The whole OpInfo sweep (issue 28): every op of PyTorch's op_db through graphtrees, with the
cases and outcomes of tests/opinfo_cases.py. Three passes:

    python scripts/opinfo_sweep.py [--samples 1] [--verify]   cudagraphify on the CPU backend:
        every dtype of opinfo_cases.DTYPES the op supports on CPU, functional and in-place
    python scripts/opinfo_sweep.py --training                 samples that require grad through
        graphtrees.compile(inner="aot_eager"): outputs and gradients against eager (float32)
    python scripts/opinfo_sweep.py --device cuda              cudagraphify on CUDA, each case in
        a worker process; on the CUDA stand-in (tests/cuda_standin/standin.py run ...) values
        are compared in its value mode (the default: ATen's CPU kernels compute them on the
        host, so tolerances apply; values it does not know are listed as not compared), and
        only structure with CUDA_STANDIN_VALUES=0 (each op must then record and replay without a
        capture error or a crash)

Writes benchmarks/results/opinfo-DATE[-verify|-training|-cuda|-standin[-values]].md and .json: cases,
outcomes per dtype, every defect (wrong, error, crash: all must be 0) and every case that was not
compared (nondet, compiler, skipped) with the reason.
"""

import argparse
import collections
import datetime
import json
import pathlib
import platform
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from opinfo_cases import (  # noqa: E402
    DEFECTS,
    OUTCOMES,
    _standin,
    _standin_values,
    cases,
    run,
    run_isolated,
    training_cases,
)

LISTED = ("wrong", "error", "crash", "compiler", "nondet", "skipped")


def _results(a):
    """(case, counts, notes) for each case of the pass `a` asks for."""
    if a.training:  # in worker processes: a crash is counted against its case
        yield from run_isolated(list(training_cases()), mode="training", samples=a.samples)
    elif a.device != "cpu":
        yield from run_isolated(list(cases(device=a.device)), samples=a.samples, verify=a.verify)
    else:
        for case in cases():
            yield (case, *run(case, samples=a.samples, verify=a.verify))


def _title(a, standin):
    if a.training:
        return "OpInfo sweep, training through graphtrees.compile (CPU backend, inner='aot_eager')"
    if a.device != "cpu":
        where = torch.cuda.get_device_name()
        if standin:
            where = "the CUDA stand-in: " + (
                "its value mode computed each op on the host, not a GPU"
                if _standin_values(a.device)
                else "kernels not executed"
            )
        return f"OpInfo sweep through cudagraphify on {a.device} ({where})"
    return f"OpInfo sweep through cudagraphify (CPU backend{', verify=True' if a.verify else ''})"


def _method(a, standin):
    if a.training:
        return (
            "Each sample (requires_grad): four calls through graphtrees.compile (warmup, "
            "recording, two replays on a second sample's values); the outputs and the gradients "
            "of a loss (the results times fixed random weights, summed) compared with eager "
            "within torch.testing's default tolerances. `compiler`: plain torch.compile("
            "backend='aot_eager') gives the same result, so the difference is not graphtrees'."
        )
    compared = "compared with eager bit for bit"
    if standin and _standin_values(a.device):
        compared = (
            "compared with eager bit for bit, values included (the stand-in's value mode "
            "computes each op on the host; results it could not compute are `skipped` with the "
            "reason); each case in a worker process, a crash counted against the case"
        )
    elif standin:
        compared = (
            "the results' structure, shapes, dtypes and conjugate/negative bits compared with "
            "eager (no values: the stand-in's value mode was off); each case in a worker "
            "process, a crash counted against the case"
        )
    return (
        "Each sample: warmup and recording on the first sample, two replays on a second "
        f"sample's values, {compared} (`tests/opinfo_cases.py`)."
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--verify", action="store_true")
    p.add_argument("--training", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--limit", type=int, default=0, help="only the first N cases (a quick look)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = p.parse_args()
    standin = _standin(a.device)
    t0 = time.time()
    totals = collections.Counter()
    by_dtype = collections.defaultdict(collections.Counter)
    notes = collections.defaultdict(list)
    n = 0
    for case, counts, case_notes in _results(a):
        n += 1
        totals.update(counts)
        by_dtype[f"{str(case.dtype).replace('torch.', '')} {case.variant}"].update(counts)
        for outcome, detail in case_notes:
            notes[outcome].append(f"{case.name}: {detail}")
        if n % 250 == 0:
            print(
                f"[opinfo_sweep] {n} cases, {time.time() - t0:.0f} s", file=sys.stderr, flush=True
            )
        if a.limit and n >= a.limit:
            break
    seconds = time.time() - t0
    date = datetime.date.today().isoformat()
    suffix = "-verify" if a.verify else "-training" if a.training else ""
    if a.device != "cpu":
        suffix += (
            ("-standin-values" if _standin_values(a.device) else "-standin")
            if standin
            else f"-{a.device}"
        )
    shown = [o for o in OUTCOMES if totals[o] or o in DEFECTS]
    result = {
        "date": date,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": a.device,
        "cuda_standin": standin,
        "samples_per_case": a.samples,
        "verify": a.verify,
        "training": a.training,
        "cases": n,
        "seconds": round(seconds, 1),
        "totals": {k: totals[k] for k in OUTCOMES},
        "by_dtype": {k: {o: v[o] for o in OUTCOMES} for k, v in sorted(by_dtype.items())},
        "notes": {k: sorted(set(v)) for k, v in notes.items()},
    }
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"opinfo-{date}{suffix}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"# {_title(a, standin)}",
        "",
        f"{date}, torch {torch.__version__}, Python {platform.python_version()}; {n} (op, "
        f"variant, dtype) cases, up to {a.samples} samples each, {seconds:.0f} s. "
        + _method(a, standin),
        "",
        "| dtype, variant | " + " | ".join(shown) + " |",
        "|---|" + "---|" * len(shown),
    ]
    for k, v in sorted(by_dtype.items()):
        lines.append(f"| {k} | " + " | ".join(str(v[o]) for o in shown) + " |")
    lines.append("| **all** | " + " | ".join(f"**{totals[o]}**" for o in shown) + " |")
    for outcome in LISTED:
        if notes.get(outcome):
            lines += ["", f"## {outcome}", ""] + [f"* {x}" for x in sorted(set(notes[outcome]))]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[: 8 + len(by_dtype)]))
    return 1 if any(totals[o] for o in DEFECTS) else 0


if __name__ == "__main__":
    sys.exit(main())
