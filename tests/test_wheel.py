"""The installable wheel: `pip wheel --no-build-isolation --no-deps .` builds one (reusing the
persistent build folder, so only the link runs again), it installs into a fresh virtual
environment that holds the same torch, and examples/seed_tree.py and `python -m graphtrees.info`
run from it; its metadata pins the torch it was built against, and under another torch
`import graphtrees` raises naming both.

The fresh environment gets torch from this one's site-packages through a path file (the torch
install is 2 GB): a plain path entry, so that this environment's editable graphtrees (enabled by
a .pth file of its own, which Python does not run from an added path) is not seen there.
"""

import email
import os
import subprocess
import sys
import sysconfig
import zipfile

import pytest
import torch

from helpers import ROOT

pytestmark = pytest.mark.no_ext_ok


def run(cmd, **kwargs):
    out = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert out.returncode == 0, f"{cmd} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def fresh_venv(path):
    """A new virtual environment without pip; add_torch() gives it a torch."""
    run([sys.executable, "-m", "venv", "--without-pip", str(path)])
    python = path / "bin" / "python"
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    return python, site.strip()


def add_torch(site, torch_site):
    with open(os.path.join(site, "torch-from-elsewhere.pth"), "w") as f:
        f.write(torch_site + "\n")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", out, "."],
        cwd=ROOT,
        env=dict(os.environ, PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1"),
    )
    (path,) = out.glob("graphtrees-*.whl")
    return path


def test_the_wheel_holds_the_extension_and_pins_its_torch(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        metadata = email.message_from_bytes(z.read(meta))
        built_with = z.read("graphtrees/_built_with.py").decode()
        entry_points = z.read(entry_points).decode()
    assert any(n.startswith("graphtrees/_C.") and n.endswith(".so") for n in names)
    assert "graphtrees/_C.pyi" in names and "graphtrees/py.typed" in names
    base = torch.__version__.split("+")[0]
    requires = [r for r in metadata.get_all("Requires-Dist") if "extra ==" not in r]
    assert requires == [f"torch=={base}"]
    assert f"TORCH = {torch.__version__!r}" in built_with
    assert "graphtrees = graphtrees._dynamo_backend:graphtrees_backend" in entry_points


def test_the_wheel_installs_and_runs_in_a_fresh_environment(wheel, tmp_path):
    python, site = fresh_venv(tmp_path / "venv")
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", str(wheel)])
    add_torch(site, sysconfig.get_paths()["purelib"])
    elsewhere = tmp_path / "elsewhere"  # not the checkout: its graphtrees/ would be imported
    elsewhere.mkdir()
    where = run([str(python), "-c", "import graphtrees; print(graphtrees.__file__)"], cwd=elsewhere)
    assert where.startswith(site), where
    info = run([str(python), "-m", "graphtrees.info"], cwd=elsewhere)
    assert "extension_loaded" in info and "True" in info.split("extension_loaded")[1].split()[0]
    out = run(
        [str(python), os.path.join(ROOT, "examples", "seed_tree.py")],
        cwd=elsewhere,
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_PRELOAD")},
    )
    assert out.strip(), "examples/seed_tree.py printed nothing"
    # torch.compile(backend="graphtrees") finds the backend through the wheel's entry point.
    code = (
        "import torch\n"
        "f = torch.compile(lambda x: x * 2 + 1, backend='graphtrees')\n"
        "x = torch.ones(4)\n"
        "for _ in range(3): y = f(x)\n"
        "import graphtrees; print(graphtrees.tree_info('cpu')['num_replays'], y.tolist())\n"
    )
    assert run([str(python), "-c", code], cwd=elsewhere).split()[0] == "1"


OTHER_TORCH = os.environ.get("GRAPHTREES_OTHER_TORCH_SITE")


@pytest.mark.skipif(
    not OTHER_TORCH,
    reason="GRAPHTREES_OTHER_TORCH_SITE (the site-packages of another torch) is not set: "
    "scripts/run_tests.sh sets it for its torch 2.11 stage",
)
def test_the_wheel_refuses_another_torch_naming_both(wheel, tmp_path):
    python, site = fresh_venv(tmp_path / "venv")
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", str(wheel)])
    add_torch(site, OTHER_TORCH)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    other = run([str(python), "-c", "import torch; print(torch.__version__)"], cwd=elsewhere)
    assert other.strip() != torch.__version__
    out = subprocess.run(
        [str(python), "-c", "import graphtrees"], cwd=elsewhere, capture_output=True, text=True
    )
    assert out.returncode != 0
    assert (
        f"graphtrees was built against torch {torch.__version__}, running torch {other.strip()}"
        in out.stderr
    ), out.stderr
