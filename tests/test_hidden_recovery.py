"""A corrupt hidden shard on the real DAG: the verify moves it aside and names the rerun, which rebuilds
exactly that shard."""

import hashlib
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml
from conftest import job_counts, shared_pycache, snakemake, write_config

from flashdraft.hidden_verify import verify_shard

pytestmark = pytest.mark.slow

# the embedded default, as small as the stages up to the verify allow
TINY = {
    "toy.num_docs": 200,
    "toy.steps": 0,
    "toy.source_rows": 12,
    "prompts.total": 16,
    "prompts.eval_count": 2,
    "regenerate.max_new_tokens": 4,
    "hidden.max_length": 64,
}
VERIFY = "results/hidden/verify.json"


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_corrupt_shard_is_moved_aside_and_the_rerun_rebuilds_only_it(tmp_path):
    # two config files, the second an overlay: the printed rerun command must keep both
    base = {k: v for k, v in TINY.items() if k != "hidden.max_length"}
    config = write_config(tmp_path / "config.yaml", base)
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(yaml.safe_dump({"hidden": {"max_length": TINY["hidden.max_length"]}}))
    configs = ("--configfile", str(config), str(overlay))
    snakemake(tmp_path, *configs, "--cores", "2", VERIFY)
    hidden = tmp_path / "results" / "hidden"
    good, bad = hidden / "shard-00000.arrow", hidden / "shard-00001.arrow"
    kept = {p: (_digest(p), p.stat().st_mtime_ns) for p in (good, good.with_suffix(".json"))}

    data = bytearray(bad.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(255 - b for b in data[middle : middle + 8])  # same size, other bytes
    bad.write_bytes(data)

    # the rerun verifies again (an input changed) and fails, naming what moved where and the command
    failed = snakemake(tmp_path, *configs, "--cores", "2", VERIFY, check=False)
    assert failed.returncode != 0
    log = (tmp_path / "results" / "logs" / "hidden_verify.log").read_text()
    assert "checksum (sha256_tree)" in log
    [moved] = (hidden / "bad").glob("shard-00001.*.arrow")
    assert f"moved results/hidden/shard-00001.arrow -> results/hidden/bad/{moved.name}" in log
    assert f"moved results/hidden/shard-00001.json -> results/hidden/bad/{moved.stem}.json" in log
    assert moved.read_bytes() == bytes(data) and not bad.exists()  # kept for inspection
    rerun = re.search(r"Rerun to rebuild exactly these shards: (.+)", log).group(1)
    assert rerun.startswith("snakemake ") and f"--configfile {config} {overlay}" in rerun

    # that command, run where the workflow ran (with this interpreter's Snakemake, up to the verify)
    cmd = [sys.executable, "-m", *shlex.split(rerun), VERIFY]
    env = dict(shared_pycache(os.environ), PYTHONUNBUFFERED="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.pop("FLASHDRAFT_RERUN", None)
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=1800, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert job_counts(done.stdout + "\n" + done.stderr) == {"hidden_shard": 1, "hidden_verify": 1}
    [job] = [b for b in (done.stdout + done.stderr).split("\n\n") if "rule hidden_shard:" in b]
    assert "output: results/hidden/shard-00001.arrow" in job, job  # the bad shard's job, not the good one's
    assert {p: (_digest(p), p.stat().st_mtime_ns) for p in kept} == kept  # the good shard untouched
    assert verify_shard(bad)["ok"]
