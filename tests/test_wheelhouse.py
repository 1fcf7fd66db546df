"""`make wheelhouse`: the pip commands it runs for a target platform (make -n: nothing is downloaded)."""

import shutil
import subprocess

import pytest
from conftest import REPO


def test_wheelhouse_downloads_for_the_given_platform(tmp_path):
    if shutil.which("make") is None:
        pytest.skip("no make")
    args = [
        "PLATFORM=manylinux_2_28_x86_64 manylinux2014_x86_64",
        "PYVER=3.11",
        "TORCH_INDEX=https://download.pytorch.org/whl/cu128",
    ]
    out = subprocess.run(
        ["make", "-n", "-C", str(REPO), "wheelhouse", f"VENV={tmp_path / 'venv'}", *args],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = " ".join(out.split())
    assert "-m pip wheel" in out and "--no-deps -w wheelhouse connection_pool==0.0.3 ." in out
    assert (
        "--platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --python-version 3.11 "
        "--only-binary=:all: --extra-index-url https://download.pytorch.org/whl/cu128"
    ) in line
    assert "-d wheelhouse --find-links wheelhouse" in out and "-r envs/requirements.txt" in out
    assert "connection_pool==0.0.3 . -r envs/requirements-nodeps.txt" in line  # pure Python, no deps
    assert not (tmp_path / "venv").exists()
