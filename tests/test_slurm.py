"""SLURM: the profile's sbatch resources per rule (dry run), a two-node torchrun launch, and the embedded
default DAG through the SLURM profile, on a SLURM cluster started on this machine from Debian's packages
(tests/slurm_cluster.py; skipped where they are missing or we are not root)."""

import json
import re
import sys
import time
from types import SimpleNamespace

import pandas as pd
import pytest
from conftest import REPO, SMALL, job_counts, production_sources, snakemake, toy_hidden_shards, write_config
from slurm_cluster import PARTITION, Cluster, missing

from flashdraft.launch import on_every_node, torchrun

pytestmark = pytest.mark.slow

PROFILE = REPO / "workflow" / "profiles" / "slurm"
# Snakemake with the SLURM executor plugin polling sacct every 2 s. The plugin waits 10 s longer after each
# status check that finds no job finished (2, 12, 22, ... s after a job ends or starts): on this cluster a
# 20 s job was seen done after 36 s, each of the DAG's ten levels waiting so. The jobs, their sbatch
# lines and where they ran are the plugin's own; only how soon their ends are seen differs.
FAST_POLL = (
    "-c",
    "import sys; from snakemake_executor_plugin_slurm import Executor; "
    "Executor.next_seconds_between_status_checks = property(lambda self: 2, lambda self, s: None); "
    "from snakemake.cli import main; sys.argv[0] = 'snakemake'; main()",
)


def job_resources(output: str) -> dict[str, list[dict]]:
    """{rule: [resources of each job]} from a dry run's job blocks."""
    jobs, rule = {}, None
    for line in output.splitlines():
        if m := re.match(r"(?:local)?rule (\w+):", line):
            rule = m[1]
            jobs.setdefault(rule, [])
        elif rule and (m := re.match(r"\s+resources: (.*)", line)):
            res = dict(kv.split("=", 1) for kv in m[1].split(", "))
            jobs[rule].append({k: int(v) if v.isdigit() else v for k, v in res.items()})
    return jobs


class _Resources(dict):
    __getattr__ = dict.__getitem__


def sbatch_line(rule_resources: dict, threads: int = 1) -> str:
    """The sbatch call the SLURM executor plugin builds for a job with these resources."""
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    res = {k: v for k, v in rule_resources.items() if v != "<TBD>"}
    job = SimpleNamespace(resources=_Resources(res), threads=threads)
    params = dict(run_uuid="uuid", slurm_logfile="log", comment_str="c", account="", partition="", workdir="")
    return get_submit_command(job, params) + set_gres_string(job)


def production(tmp_path, **gpus):
    """config/production.yaml on a stand-in model dir (a config.json: nothing loads the weights)."""
    model = tmp_path / "models" / "Qwen3-8B"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 36}))
    production_sources(tmp_path)
    cfg = {"gpus": {"target": 5, "drafter": 3, "check_visible": False, **gpus}}
    return write_config(tmp_path / "prod.yaml", cfg, base=REPO / "config" / "production.yaml")


# ---- dry runs: what each rule asks SLURM for ----


def test_production_dry_run_sbatch_resources(tmp_path):
    pytest.importorskip("snakemake_executor_plugin_slurm")
    proc = snakemake(
        tmp_path, "-n", "--profile", str(PROFILE), "--workflow-profile", "none", config=production(tmp_path)
    )
    jobs = job_resources(proc.stdout)
    assert job_counts(proc.stdout)["hidden_shard"] == len(jobs["hidden_shard"]) == 40
    assert job_counts(proc.stdout)["regenerate"] == len(jobs["regenerate"]) == 40
    for res in jobs["hidden_shard"]:  # independent jobs, one GPU each, wherever SLURM puts them
        assert (res["gpu"], res["runtime"], res["mem_mb"], res["cpus_per_task"]) == (1, 360, 64000, 8)
    (train,) = jobs["train"]
    assert (train["gpu"], train["runtime"], train["mem_mb"], train["cpus_per_task"]) == (3, 4320, 256000, 32)
    assert "nodes" not in train and "mpi" not in train
    assert "gpu" not in jobs["prompts"][0] and jobs["prompts"][0]["runtime"] == 120
    for rule in ("regenerate", "warmup", "evaluate"):
        assert jobs[rule][0]["gpu"] == 1, rule

    shard = sbatch_line(jobs["hidden_shard"][0])
    assert "--gpus=1" in shard and "-t 360" in shard and "--mem 64000" in shard
    assert "--cpus-per-task=8" in shard
    line = sbatch_line(train, threads=3)
    assert "--gpus=3" in line and "-t 4320" in line and "--mem 256000" in line and "--nodes" not in line
    assert "nproc_per_node 3 --virtual-local-rank" in proc.stdout and "srun" not in proc.stdout


def test_multi_node_dry_run_asks_for_nodes_and_launches_srun(tmp_path):
    pytest.importorskip("snakemake_executor_plugin_slurm")
    config = production(tmp_path, drafter_nodes=2)
    # 6 processes: a global batch they can share (production's 3 micro-batches serve 1 or 3)
    write_config(config, {"train.global_batch_tokens": 6 * 16384}, base=config)
    proc = snakemake(
        tmp_path, "-n", "--profile", str(PROFILE), "--workflow-profile", "none", "train", config=config
    )
    (train,) = job_resources(proc.stdout)["train"]
    assert (train["nodes"], train["tasks"], train["gres"], train["mpi"]) == (2, 2, "gpu:3", "srun")
    assert "gpu" not in train
    line = sbatch_line(train, threads=3)
    assert "--nodes=2" in line and "--ntasks=2" in line and "--gres=gpu:3" in line
    assert "--ntasks-per-gpu" not in line and "--gpus=" not in line and "-t 4320" in line
    cmd = next(c for c in proc.stdout.splitlines() if "scripts/train.py" in c)
    assert cmd.startswith("Shell command: srun --nodes 2 --ntasks 2 --ntasks-per-node 1")
    assert "--nnodes 2 --nproc_per_node 3 --virtual-local-rank --rdzv-backend c10d" in cmd
    assert '--rdzv-endpoint "$(hostname)":29400 --rdzv-id "$SLURM_JOB_ID"' in cmd


# ---- a real SLURM on this machine ----


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = missing()
    if why:
        pytest.skip(why)
    c = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        c.start()
    except Exception:
        c.stop()
        raise
    yield c
    c.stop()


def sacct(cluster, *args, timeout: float = 60) -> list[list[str]]:
    """sacct rows (parsable), once slurmdbd has taken every listed job's end (State is the last field)."""
    end = time.monotonic() + timeout
    while True:
        out = cluster.run("sacct", "-a", "-n", "-P", "-S", "2000-01-01", *args).stdout
        rows = [line.split("|") for line in out.splitlines() if line]
        settled = rows and not any(r[-1].startswith(("PENDING", "RUNNING", "COMPLETING")) for r in rows)
        if settled or time.monotonic() > end:
            return rows
        time.sleep(0.5)


def test_two_nodes_one_rendezvous_train_on_the_cpu(cluster, tmp_path):
    """The multi-node launch as the train rule runs it: srun starts one task per node (two slurmd on
    this machine), each a torchrun with 2 processes, all 4 joining one c10d rendezvous."""
    drafter = {"num_layers": 2, "block_size": 8}
    cfg = {
        "max_steps": 4,
        "lr": 3e-3,
        "max_anchors": 16,
        "batch_tokens": 512,
        "buckets": [128, 256],
        "compile": False,
        "checkpoint_every": 2,
        "log_every": 1,
        "val_samples": 0,
    }
    shards = toy_hidden_shards(tmp_path, drafter)
    py = sys.executable
    lease = f"{py} -m flashdraft.gpu --gpus 0 --lock-dir {tmp_path / 'locks'} --"
    launch = on_every_node(
        f"{lease} {torchrun(py, REPO / 'scripts' / 'train.py', 2, nodes=2, port=29431)}", nodes=2
    )
    out = tmp_path / "out"
    args = (
        f"--cfg '{json.dumps(cfg)}' --drafter-cfg '{json.dumps(drafter)}' --target {tmp_path / 'target'}"
        f" --checkpoints {out / 'checkpoints'} --metrics {out / 'metrics.csv'} --out {out / 'drafter'}"
    )
    (tmp_path / "job.sh").write_text(
        f"#!/bin/bash\nexport OMP_NUM_THREADS=1\n{launch} {args}"
        f" {' '.join(shards)} > {tmp_path / 'train.log'} 2>&1\n"
    )
    proc = cluster.run(
        "sbatch",
        "--parsable",
        "--wait",
        "-N",
        "2",
        "-n",
        "2",
        "-c",
        "2",
        "-p",
        PARTITION,
        "-J",
        "two-nodes",
        "-o",
        str(tmp_path / "slurm.out"),
        str(tmp_path / "job.sh"),
        check=False,
        timeout=600,
    )
    log = (tmp_path / "train.log").read_text() if (tmp_path / "train.log").exists() else ""
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{log[-6000:]}\n{cluster.logs()}"
    job = proc.stdout.strip().split(";")[0]

    assert "4 process(es) on cpu" in log, log[-3000:]
    metrics = pd.read_csv(out / "metrics.csv")
    assert metrics.step.max() == 4 and metrics.loss.notna().all()
    assert (out / "drafter" / "model.safetensors").exists()
    rows = {r[0]: r[1:] for r in sacct(cluster, "-j", job, "-o", "JobID,NNodes,NTasks,NodeList,State")}
    step = rows[f"{job}.0"]  # the srun step: one task on each node
    assert step[0] == "2" and step[1] == "2" and step[-1] == "COMPLETED", rows
    assert rows[job][-1] == "COMPLETED"


def test_default_dag_through_the_slurm_profile(cluster, tmp_path):
    """The embedded default (smaller, as in the other DAG tests) to the end, every job an sbatch job, the
    training on both nodes: the plugin runs the train rule's own srun + torchrun line. What is asserted
    here is the jobs and where they ran, so the toy target is left untrained and the drafter trains two
    eager steps (the workflow tests check what training and the warm compile cache give)."""
    cheap = {
        "toy.num_docs": 200,
        "toy.steps": 0,
        "toy.source_rows": 20,
        "train.max_steps": 2,
        "train.compile": False,
        "gpus.drafter_nodes": 2,
    }
    config = write_config(tmp_path / "config.yaml", {**SMALL, **cheap})
    proc = snakemake(
        tmp_path,
        "--profile",
        str(PROFILE),
        "--workflow-profile",
        "none",
        "--latency-wait",
        "5",
        "--slurm-init-seconds-before-status-checks",
        "2",
        config=config,
        check=False,
        env={k: cluster.env[k] for k in ("SLURM_CONF", "PATH")},
        entry=FAST_POLL,
    )
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}\n{cluster.logs()}"
    r = tmp_path / "results"
    assert (r / "report.html").exists() and (r / "drafter" / "model.safetensors").exists()
    summary = json.loads((r / "eval" / "summary.json").read_text())
    assert summary["dflash"]["lossless_all"]
    assert "2 process(es) on cpu" in (r / "logs" / "train.log").read_text()

    rows = sacct(cluster, "-X", "-o", "JobID,Comment,State,NNodes")
    rules, nodes = {}, {}
    for _, comment, state, n in rows:
        if m := re.match(r"rule_([a-z_]+?)(?:_wildcards_.*)?$", comment):
            rules.setdefault(m[1], []).append(state)
            nodes[m[1]] = int(n)
    expected = {
        "toy_target": 1,
        "toy_sources": 1,
        "prompts": 1,
        "regenerate": 2,
        "hidden_shard": 2,
        "hidden_verify": 1,
        "warmup": 1,
        "train": 1,
        "evaluate": 1,
        "evaluate_merge": 1,
        "report": 1,
    }
    assert {k: len(v) for k, v in rules.items()} == expected, rows
    assert all(s == "COMPLETED" for states in rules.values() for s in states), rows
    assert nodes["train"] == 2 and nodes["hidden_shard"] == 1, rows
