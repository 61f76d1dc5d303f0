"""Reads the ThreadSanitizer logs of the TSan stage (scripts/run_tests.sh) and says how many
reports are graphtrees' own: a report is graphtrees' when one of its access or lock stacks (not the
stacks that say where a thread was created or a block allocated) holds a frame of graphtrees' code:
a file under csrc/, or graphtrees' instrumented _C (torch's own _C has no source locations). Those
are printed whole and fail the stage (exit 1); the others are counted and summarised, and so are
the suppressions matched (scripts/tsan.supp).

    python scripts/tsan_reports.py REPORTS_DIR
"""

import collections
import pathlib
import re
import sys

FRAME = re.compile(r"^\s+#\d+ (?P<func>.*?) (?P<file>\S+) \((?P<module>[^+)]+)\+0x[0-9a-f]+\)$")
NOT_ACCESS = re.compile(r"created by|created at|allocated by|Location is")


def is_graphtrees(line):
    m = FRAME.match(line)
    if not m:
        return False
    if "/csrc/" in m["file"]:
        return True
    return m["module"].startswith("_C.") and m["file"] != "<null>"


def reports(text):
    """The reports in one log: (kind, text, graphtrees' own)."""
    for block in text.split("==================\n")[1:]:
        if "WARNING: ThreadSanitizer:" not in block:
            continue
        kind = re.search(r"WARNING: ThreadSanitizer: (.*?)(?: \(pid=\d+\))?$", block, re.M)[1]
        own, counting = False, False
        for line in block.splitlines():
            if line.startswith("  ") and not line.startswith("    "):  # a stack's title
                counting = not NOT_ACCESS.search(line)
            elif counting and is_graphtrees(line):
                own = True
        yield kind, block, own


def main(folder):
    own, others, used = [], collections.Counter(), collections.Counter()
    for path in sorted(pathlib.Path(folder).iterdir()):
        text = path.read_text(errors="replace")
        for kind, block, mine in reports(text):
            if mine:
                own.append((path.name, block))
            else:
                top = re.search(r"^SUMMARY: ThreadSanitizer: (.*)$", block, re.M)
                others[top[1] if top else kind] += 1
        for matched in text.split("ThreadSanitizer: Matched ")[1:]:  # print_suppressions=1
            for m in re.finditer(r"^(\d+) (\w+:\S+)$", matched, re.M):
                used[m[2]] += int(m[1])
    print(
        f"[tsan] graphtrees' own reports: {len(own)}; third-party reports: {sum(others.values())}"
    )
    for what, n in others.most_common():
        print(f"[tsan]   third-party, {n}x: {what}")
    for what, n in used.most_common():
        print(f"[tsan]   suppressed, {n}x: {what} (scripts/tsan.supp says why)")
    for name, block in own:
        print(f"[tsan] graphtrees' own report in {name}:\n{block}")
    return 1 if own else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
