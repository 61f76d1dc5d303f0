"""The whole OpInfo sweep (issue 28): every op of PyTorch's op_db, every dtype of
tests/opinfo_cases.DTYPES the op supports on CPU, functional and in-place variants, its first
`--samples` samples, through cudagraphify on the CPU backend (and with --verify, verify=True).
Writes benchmarks/results/opinfo-DATE.md and .json: samples, ran as programs, Python replays,
eager fallbacks, wrong and errors (both must be 0), and every non-deterministic op once.

    python scripts/opinfo_sweep.py [--samples 3] [--verify] [--limit N]
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

from opinfo_cases import OUTCOMES, cases, run  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--verify", action="store_true")
    p.add_argument("--limit", type=int, default=0, help="only the first N cases (a quick look)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = p.parse_args()
    t0 = time.time()
    totals = collections.Counter()
    by_dtype = collections.defaultdict(collections.Counter)
    notes = collections.defaultdict(list)
    n = 0
    with torch.no_grad():
        for case in cases():
            if a.limit and n >= a.limit:
                break
            n += 1
            counts, case_notes = run(case, samples=a.samples, verify=a.verify)
            totals.update(counts)
            by_dtype[f"{str(case.dtype).replace('torch.', '')} {case.variant}"].update(counts)
            for outcome, detail in case_notes:
                notes[outcome].append(f"{case.name}: {detail}")
    seconds = time.time() - t0
    date = datetime.date.today().isoformat()
    result = {
        "date": date,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "samples_per_case": a.samples,
        "verify": a.verify,
        "cases": n,
        "seconds": round(seconds, 1),
        "totals": {k: totals[k] for k in OUTCOMES},
        "by_dtype": {k: {o: v[o] for o in OUTCOMES} for k, v in sorted(by_dtype.items())},
        "notes": {k: sorted(set(v)) for k, v in notes.items()},
    }
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"opinfo-{date}" + ("-verify" if a.verify else "")
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"# OpInfo sweep through cudagraphify (CPU backend{', verify=True' if a.verify else ''})",
        "",
        f"{date}, torch {torch.__version__}, Python {platform.python_version()}; "
        f"{n} (op, variant, dtype) cases, up to {a.samples} samples each, {seconds:.0f} s. "
        "Each sample: warmup and recording on the first sample, two replays on a second "
        "sample's values, compared with eager bit for bit (`tests/opinfo_cases.py`).",
        "",
        "| dtype, variant | " + " | ".join(OUTCOMES) + " |",
        "|---|" + "---|" * len(OUTCOMES),
    ]
    for k, v in sorted(by_dtype.items()):
        lines.append(f"| {k} | " + " | ".join(str(v[o]) for o in OUTCOMES) + " |")
    lines.append("| **all** | " + " | ".join(f"**{totals[o]}**" for o in OUTCOMES) + " |")
    for outcome in ("wrong", "error", "nondet"):
        if notes.get(outcome):
            lines += ["", f"## {outcome}", ""] + [f"* {x}" for x in sorted(set(notes[outcome]))]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[: 12 + len(by_dtype)]))
    return 1 if totals["wrong"] or totals["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
