"""Training is bit-identical to the reference commit's: the same shards and configs trained by this
checkout's scripts/train.py and by REFERENCE's (unpacked from git), on this machine, give the same
metrics (all but the speed column), the same export choice and the same exported tensors. The gate of a
change that must not change what trains (a refactor); a change meant to change training moves REFERENCE
to its own commit, saying why in the commit message."""

import json
import os
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path

import pandas as pd
import pytest
from conftest import REPO, toy_hidden_shards
from safetensors.torch import load_file

REFERENCE = "8f87f96"  # the last commit before the training wing's redesign
# metrics.csv columns logged since REFERENCE (DeepSpec's tau_probabilistic, training and validation)
NEW_METRICS = {"expected_tau", "val_expected_tau"}
DRAFTER = {"num_layers": 2, "block_size": 8}
CONFIGS = {
    # two micro-batches per step, validation, the export of the best validation step
    "accumulate-validate": {
        "max_steps": 6,
        "lr": 3e-3,
        "max_anchors": 16,
        "batch_tokens": 512,
        "global_batch_tokens": 1024,
        "buckets": [128, 256],
        "compile": False,
        "checkpoint_every": 3,
        "log_every": 1,
        "val_samples": 8,
        "val_every": 3,
        "export": "best",
    },
    # the paper's decay loss, one micro-batch per step, no validation
    "decay": {
        "max_steps": 5,
        "lr": 3e-3,
        "max_anchors": 16,
        "batch_tokens": 512,
        "buckets": [128, 256],
        "compile": False,
        "log_every": 1,
        "val_samples": 0,
        "loss": "decay",
    },
}


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """(this checkout, REFERENCE's src and scripts unpacked)."""
    root = tmp_path_factory.mktemp("reference")
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", REFERENCE, "src", "scripts"], capture_output=True
    )
    if archive.returncode != 0:  # a shallow or exported checkout: no history to compare against
        pytest.skip(f"commit {REFERENCE} is not in this checkout's history")
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(root, filter="data")
    return REPO, root


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("equality")
    return root, toy_hidden_shards(root, DRAFTER)


def train(tree: Path, root: Path, shards: list[str], out: Path, cfg: dict) -> Path:
    cmd = [
        sys.executable,
        str(tree / "scripts" / "train.py"),
        "--cfg",
        json.dumps(cfg),
        "--drafter-cfg",
        json.dumps(DRAFTER),
        "--target",
        str(root / "target"),
        "--checkpoints",
        str(out / "checkpoints"),
        "--metrics",
        str(out / "metrics.csv"),
        "--out",
        str(out / "drafter"),
        *shards,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(tree / "src")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_training_is_bit_identical_to_the_reference_commit(trees, data, tmp_path, name):
    root, shards = data
    new, old = (
        train(tree, root, shards, tmp_path / label, CONFIGS[name])
        for tree, label in zip(trees, ("new", "old"), strict=True)
    )
    speed = ["tokens_per_s"]
    a, b = (pd.read_csv(d / "metrics.csv").drop(columns=speed) for d in (new, old))
    added = [c for c in a.columns if c not in b.columns]  # metrics logged since, beside the same ones
    assert set(added) <= NEW_METRICS, added
    pd.testing.assert_frame_equal(a.drop(columns=added), b, check_exact=True)
    assert len(a) == CONFIGS[name]["max_steps"]
    exported = [json.loads((d / "export.json").read_text()) for d in (new, old)]
    for key in ("run", "commit", "dirty"):  # written by newer trees only (the run keys are compared below)
        exported[0].pop(key, None)
    assert exported[0] == exported[1]
    x, y = (load_file(d / "drafter" / "model.safetensors") for d in (new, old))
    assert x.keys() == y.keys() and all(x[k].equal(y[k]) for k in x)
    # what the two trees wrote is theirs: the run keys agree as well
    assert sorted(p.name for p in (new / "checkpoints").iterdir()) == sorted(
        p.name for p in (old / "checkpoints").iterdir()
    )
