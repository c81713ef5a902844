"""The Pythons instructors have: packages outside the installation's own folders still grade in ``namespaces``.

A box's root file system holds the system's folders, the Python installation and the folders of the grader's
``sys.path`` that torch, NumPy and what they require come from (grader/sandbox/lockdown.py, ``import_folders``).
Two installations here get their packages from elsewhere: a Python whose packages are in its user site-packages
folder (``pip install --user``, PYTHONUSERBASE), and a venv whose packages come through a ``.pth`` file naming a
folder outside it (as conda and editable setups do). Each grades the reference in ``namespaces``, says so at the
start, and its record says the same. (The kit itself comes through PYTHONPATH, which holds the kit's folders: those
are left out of the boxes' view.)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from grader.course.samples import write_modules
from grader.kit import KIT, SUITE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BASE = Path(os.path.realpath(sys.base_prefix)) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
SITE = Path(sysconfig.get_paths()["purelib"])  # where this Python's packages are (the kit's venv)
VERSION = f"python{sys.version_info.major}.{sys.version_info.minor}"


@pytest.fixture(scope="module", autouse=True)
def as_root(unavailable):
    if os.geteuid() != 0 or sys.prefix == sys.base_prefix:
        unavailable("needs root (namespaces) and a venv to take the packages from")


def user_site(tmp_path) -> tuple[Path, dict]:
    """The base Python (which has no torch), with every package of the kit's venv in a user site-packages folder
    (hard links)."""
    base = tmp_path / "userbase"
    folder = base / "lib" / VERSION / "site-packages"
    folder.mkdir(parents=True)
    entries = [str(p) for p in SITE.iterdir() if not p.name.startswith(("__editable__", "_distutils_hack"))
               and p.suffix != ".pth"]
    subprocess.run(["cp", "-al", *entries, str(folder)], check=True)
    return BASE, {"PYTHONUSERBASE": str(base)}


def pth_folder(tmp_path) -> tuple[Path, dict]:
    """A fresh venv with no package of its own (nor the base Python's): a .pth file names the kit's venv's
    site-packages."""
    venv = tmp_path / "venv"
    subprocess.run([str(BASE), "-m", "venv", "--without-pip", str(venv)], check=True)
    (venv / "lib" / VERSION / "site-packages" / "elsewhere.pth").write_text(f"{SITE}\n")
    return venv / "bin" / "python", {"PYTHONNOUSERSITE": "1"}


@pytest.mark.parametrize("make", [user_site, pth_folder], ids=["user-site-packages", "pth-folder"])
def test_packages_outside_the_installation_grade_in_namespaces(tmp_path, make):
    python, env = make(tmp_path)
    env = {**os.environ, **env, "PYTHONPATH": f"{KIT}{os.pathsep}{SUITE}"}
    env.pop("VIRTUAL_ENV", None)
    where = subprocess.run([str(python), "-c", "import sys, torch; print(sys.prefix); print(torch.__file__)"],
                           env=env, capture_output=True, text=True, check=True).stdout.split()
    assert not where[1].startswith(where[0] + "/")  # torch comes from outside the installation
    assert where[1].startswith(str(tmp_path / "userbase") if make is user_site else str(SITE))
    write_modules(tmp_path / "submissions" / "ada", assignment="attention")
    run = subprocess.run([str(python), "-m", "grader.cli", "grade", "attention", "--submissions",
                          str(tmp_path / "submissions"), "--out", str(tmp_path / "grades")],
                         env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "sandbox: namespaces (" in run.stderr, run.stderr
    record = json.loads((tmp_path / "grades" / "ada.json").read_text())
    assert record["confinement"] == {"mode": "namespaces", "missing": []}
    assert record["total"] == record["max_total"]
