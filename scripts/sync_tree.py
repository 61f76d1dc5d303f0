"""Copies this checkout (git's tracked and untracked, not ignored, files; without git, every
file but build outputs and virtual environments) into DEST, which keeps its build/ folder.
A file is written only where its content changed, with a new modification time, and a file
that left the checkout is removed: so the build folder recompiles exactly what changed. (A
copy that kept the checkout's times could leave an object compiled from an older copy looking
newer than an edited source, and the build would skip it.)

    python scripts/sync_tree.py DEST
"""

import os
import pathlib
import shutil
import subprocess
import sys

SKIP = {".git", ".venv", ".venv-torch211", "build", "dist", "__pycache__"}


def checkout_files(root):
    try:
        out = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"],
            cwd=root,
            capture_output=True,
            check=True,
        ).stdout.decode()
        return [f for f in out.split("\0") if f and (root / f).is_file()]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for d, dirs, names in os.walk(root):
            dirs[:] = [x for x in dirs if x not in SKIP and not x.endswith(".egg-info")]
            rel = pathlib.Path(d).relative_to(root)
            files += [str(rel / n) for n in names if not n.endswith(".so")]
        return files


def main():
    root = pathlib.Path(__file__).resolve().parent.parent
    dest = pathlib.Path(sys.argv[1]).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    wanted = set(checkout_files(root))
    changed = 0
    for rel in sorted(wanted):
        src, dst = root / rel, dest / rel
        if dst.is_file() and dst.read_bytes() == src.read_bytes():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        shutil.copymode(src, dst)
        changed += 1
    removed = 0
    for d, dirs, names in os.walk(dest):
        rel_dir = pathlib.Path(d).relative_to(dest)
        if rel_dir == pathlib.Path("."):
            dirs[:] = [x for x in dirs if x != "build"]
        dirs[:] = [x for x in dirs if x not in ("__pycache__",) and not x.endswith(".egg-info")]
        for n in names:
            rel = str(rel_dir / n) if rel_dir != pathlib.Path(".") else n
            if rel not in wanted and not n.endswith(".so") and n != "_built_with.py":
                (dest / rel).unlink()
                removed += 1
    print(f"[sync_tree] {dest}: {changed} files written, {removed} removed")


if __name__ == "__main__":
    main()
