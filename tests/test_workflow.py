"""The real Snakemake DAG: config validation, an end-to-end run, and stage reruns."""

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest
import yaml
from conftest import (
    REPO,
    SMALL,
    cache_misses,
    headless_dom,
    job_counts,
    production_sources,
    snakemake,
    write_config,
)

from flashdraft.io import human_bytes
from flashdraft.shards import shard_of

pytestmark = pytest.mark.slow


# ---- config validation: fails before any job runs, naming the key ----


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({"train.lrr": 1.0}, "lrr"),
        ({"train.epochs": "six"}, "epochs"),
        ({"target": {"path": "no/such/model", "build_toy": False}}, "target.path"),
        ({"gpus.drafter": 64}, "gpus.drafter"),
        ({"regenerate.backend": "server", "regenerate.server_gpus": 64}, "regenerate.server_gpus"),
        ({"drafter.target_layer_ids": [1, 9]}, "drafter.target_layer_ids: [9] out of range"),
        ({"prompts.min_chars": 50, "prompts.max_chars": 10}, "prompts.min_chars (50) > prompts.max_chars"),
        ({"regenerate.max_new_tokens": 10**9}, "1000000000 is greater than the maximum of 1048576"),
        (
            {"regenerate.max_new_tokens": 4096},
            "config key regenerate.max_new_tokens (4096) does not fit the "
            "target's max_position_embeddings (4096); use at most 4095",
        ),
        ({"eval.max_new_tokens": 5000}, "config key eval.max_new_tokens (5000) does not fit"),
        (
            {"hidden.max_length": 4097},
            "config key hidden.max_length (4097) does not fit the target's "
            "max_position_embeddings (4096); use at most 4096",
        ),
        (
            {
                "regenerate.backend": "server",
                "regenerate.server_gpus": 0,
                "regenerate.server_cmd": "vllm serve {model} --port {port}",
            },
            "unknown placeholder(s) ['model']",
        ),
        (
            {"regenerate.backend": "server", "regenerate.server_gpus": 0, "regenerate.server_cmd": " "},
            "regenerate.server_cmd is empty",
        ),
        (
            {"prompts.sources": [{"name": "here", "path": "."}]},
            "config key prompts.sources[here].path: '.' is a directory; point it at a file",
        ),
        (
            {"drafter.init_from": "no/such/drafter"},
            "config key drafter.init_from: no/such/drafter is not a drafter export",
        ),
        ({"train.val_samples": 360}, "config key train.val_samples (360) leaves none of the 360 samples"),
        (
            {"prompts.sources": [{"name": "hub", "path": "HuggingFaceH4/ultrachat_200k"}]},
            "'HuggingFaceH4/ultrachat_200k' does not exist; for a Hugging Face Hub dataset id, set "
            "format: hf",
        ),
    ],
    ids=[
        "unknown-key",
        "wrong-type",
        "missing-model",
        "too-many-gpus",
        "too-many-server-gpus",
        "layer-beyond-target",
        "min-over-max-chars",
        "schema-max-new-tokens",
        "regenerate-over-positions",
        "eval-over-positions",
        "max-length-over-positions",
        "server-cmd-placeholder",
        "server-cmd-empty",
        "source-is-a-directory",
        "init-from-missing",
        "val-split-of-every-prompt",
        "hub-id-without-format",
    ],
)
def test_bad_config_fails_before_any_job(tmp_path, overrides, expected):
    config = write_config(tmp_path / "config.yaml", overrides)
    proc = snakemake(tmp_path, "-n", "--cores", "1", config=config, check=False)
    assert proc.returncode != 0
    assert expected in proc.stdout + proc.stderr
    assert not (tmp_path / "results").exists()


def test_a_source_whose_rows_give_no_prompt_stops_the_run_before_its_prompts_job_deletes_any(tmp_path):
    """A source changed to a file whose first rows fit no shape: the run ends before any job with one line
    naming the source, and the prompts of the run before (kept by Snakemake until their job starts) stay."""
    rows = [{"question": f"What is {i}?", "answer": str(i)} for i in range(30)]
    (tmp_path / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    mine = [{"name": "mine", "path": "mine.jsonl"}]
    config = write_config(tmp_path / "config.yaml", {"prompts.sources": mine})
    old = tmp_path / "results" / "prompts" / "train.parquet"
    old.parent.mkdir(parents=True)
    old.write_bytes(b"the prompts of the run before")
    proc = snakemake(tmp_path, "--cores", "1", config=config, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out
    assert (
        "config key prompts.sources[mine]: none of the first 20 rows of mine.jsonl gives a prompt (most "
        "often: unknown shape); set its shape"
    ) in out
    assert old.read_bytes() == b"the prompts of the run before"
    assert not (tmp_path / "results" / "logs").exists()  # no job started

    (tmp_path / "mine.jsonl").write_text("".join(json.dumps({"prompt": r["question"]}) + "\n" for r in rows))
    proc = snakemake(tmp_path, "-n", "--cores", "1", config=config, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # the fixed source passes the check


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            {"train.fp8": "tensorwise", "gpus.drafter": 0},
            "config key train.fp8 (tensorwise) needs a GPU with FP8 matmuls (compute capability 8.9 "
            "or newer), but "
            "the drafter trains on the CPU; set train.fp8: null",
        ),
        (
            {"train.lrr": 1.0},
            "config key train: Additional properties are not allowed ('lrr' was unexpected)",
        ),
        (
            {"hidden.mode": "stream", "hidden.disk_budget": "1MB"},
            "config key hidden.disk_budget: 1 MB does not hold 2 stream-mode chunks of one "
            "optimizer step (up to "
            "2,080 tokens' worth of hidden states: 2 micro-batch(es) of train.batch_tokens 1024 in "
            "train.buckets "
            "[128, 256], samples of up to hidden.max_length 256 tokens); set hidden.disk_budget >= 2.15 MB "
            "(2150720 bytes)",
        ),
    ],
    ids=["fp8-on-the-cpu", "unknown-key", "stream-budget-below-one-step"],
)
def test_a_config_mistake_is_one_line_before_any_job(tmp_path, overrides, expected):
    """production.yaml's float8 on a CPU run, an unknown key, a stream-mode disk budget too small for one
    step: the line that names it, and no job (neither hours of work before the warmup refuses float8 or
    the data plan the budget, nor a dump of the whole schema)."""
    config = write_config(tmp_path / "config.yaml", overrides)
    proc = snakemake(tmp_path, "-n", "--cores", "1", config=config, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and expected in out.splitlines(), out
    assert "Traceback" not in out and len(out.splitlines()) < 10, out
    assert "Job stats" not in out and not (tmp_path / "results").exists()


def test_every_problem_of_a_first_config_is_reported_in_one_dry_run(tmp_path):
    """A typo, a model not downloaded yet, more GPUs than the node has: one line each, all in one run,
    and no job."""
    config = write_config(
        tmp_path / "config.yaml",
        {"train.lrr": 1.0, "gpus.target": 64, "target": {"path": "models/mine", "build_toy": False}},
    )
    proc = snakemake(tmp_path, "-n", "--cores", "1", config=config, check=False)
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode != 0 and "Traceback" not in lines
    assert {
        "config key train: Additional properties are not allowed ('lrr' was unexpected)",
        "config key target.path: 'models/mine' is not a local Hugging Face model directory (no "
        "config.json); download the model there or set target.build_toy: true",
        "config key gpus.target: asks for 64 GPU(s) but 0 are visible (set gpus.check_visible: false "
        "when jobs run on other nodes)",
    } <= set(lines), lines
    assert not (tmp_path / "results").exists()


def test_a_run_the_disk_cannot_hold_stops_before_any_job(tmp_path):
    """The whole run's planned disk (here made huge by hidden.disk_margin) against the free space: one
    line naming the fix, no job run, nothing written; a dry run, which writes nothing, is not refused."""
    config = write_config(tmp_path / "config.yaml", {"hidden.disk_margin": 1e15})
    proc = snakemake(tmp_path, "--cores", "1", config=config, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out
    [line] = [x for x in out.splitlines() if x.startswith("disk: the run needs about ")]
    assert "are free; free space there" in line and "hidden.mode: stream" not in line  # nothing would fit
    assert not (tmp_path / "results" / "logs").exists()
    assert snakemake(tmp_path, "-n", "--cores", "1", config=config).returncode == 0


def test_an_overlay_given_alone_says_so_and_shows_the_form_that_works(tmp_path):
    overlay = tmp_path / "stream.yaml"
    shutil.copy(REPO / "config" / "stream.yaml", overlay)
    proc = snakemake(tmp_path, "-n", "--cores", "1", config=overlay, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Job stats" not in out
    assert (
        f"--configfile {overlay}: no target or prompts section: an overlay changes a whole config's "
        f"keys; give it after one: snakemake --cores all --configfile config/config.yaml {overlay}"
        in out.splitlines()
    ), out


def test_a_target_written_after_configfile_is_named_before_any_job(tmp_path):
    """`--configfile my.yaml results/eval/summary.json`: Snakemake reads the target as a second config
    (a JSON file it can read); the workflow says so in one line instead of naming the output's keys."""
    config = write_config(tmp_path / "config.yaml", {})
    (tmp_path / "results" / "eval").mkdir(parents=True)
    (tmp_path / "results" / "eval" / "summary.json").write_text('{"dflash": {}}')
    target = tmp_path / "results" / "eval" / "summary.json"
    proc = snakemake(tmp_path, "-n", "--cores", "1", "--configfile", str(config), str(target), check=False)
    out = proc.stdout + proc.stderr
    line = (
        "--configfile results/eval/summary.json: not a config but a target (--configfile takes every "
        "path after it); put targets before --configfile or after --: snakemake --cores all --configfile "
        "<config> -- results/eval/summary.json"
    )  # relative to the working directory
    assert proc.returncode != 0 and line in out.splitlines(), out
    assert "dflash" not in out, out


def test_remote_code_target_fails_before_any_job(tmp_path):
    model = tmp_path / "models" / "mine"
    model.mkdir(parents=True)
    auto_map = {"AutoModelForCausalLM": "modeling_mine.MineForCausalLM"}
    (model / "config.json").write_text(
        json.dumps({"model_type": "mine", "num_hidden_layers": 8, "auto_map": auto_map})
    )
    config = write_config(tmp_path / "config.yaml", {"target": {"path": "models/mine", "build_toy": False}})
    proc = snakemake(tmp_path, "-n", "--cores", "1", config=config, check=False)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "target.path" in out and "needs remote code" in out and "modeling_mine" in out
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize(
    "mode, target, script",
    [
        ("store", "results/hidden/shard-00000.arrow", "hidden_shard.py"),
        ("stream", "results/plan", "data_plan.py"),
    ],
)
def test_the_last_hidden_flag_reaches_the_hidden_stages_only_for_families_that_need_it(
    tmp_path, mode, target, script
):
    commands = {}
    for family in ("dflash", "dspark"):
        config = write_config(
            tmp_path / f"{family}.yaml",
            {"drafter.family": family, "hidden.mode": mode, "hidden.chunk_tokens": 6000},
        )
        proc = snakemake(tmp_path, "-n", "-p", "--cores", "1", target, config=config)
        [commands[family]] = [line for line in proc.stdout.splitlines() if f"/{script} " in line]
    assert "--last-hidden" in commands["dspark"] and "--last-hidden" not in commands["dflash"]
    assert commands["dspark"].replace(f"{script} --last-hidden ", f"{script} ") == commands["dflash"]


def test_shards_without_the_last_hidden_state_are_refused_before_any_job_when_they_would_be_reused(tmp_path):
    """drafter.family dspark and a store made without the last hidden state that Snakemake would not make
    again (its files copied in: no record of their params): the run stops before its first job, naming the
    key and the rerun; a store with the column goes on to the job that reads it."""
    config = write_config(tmp_path / "config.yaml", {"drafter.family": "dspark", "hidden.shards": 1})
    target = "results/hidden/verify.json"
    dry = snakemake(tmp_path, "-n", "--cores", "1", target, config=config).stdout
    outputs = [
        o.strip()
        for line in dry.splitlines()
        if line.strip().startswith("output:")
        for o in line.split(":", 1)[1].split(",")
    ]
    for out in outputs[:-1]:  # everything up to the shard, as if copied in (the verification is to do)
        (tmp_path / out).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / out).mkdir() if out.endswith("target") else (tmp_path / out).write_text("{}")
    manifest = tmp_path / "results" / "hidden" / "shard-00000.json"
    for made, refused in (({}, True), ({"last_hidden": True}, False)):
        manifest.write_text(json.dumps({"format": "flashdraft.hidden/1", **made}))
        for f in (tmp_path / "results").rglob("*"):
            os.utime(f, (1e9, 1e9))  # none newer than what it was made from
        proc = snakemake(tmp_path, "--cores", "1", target, config=config, check=False)
        out = proc.stdout + proc.stderr
        line = (
            "config key drafter.family: dspark trains on the target's last hidden state, but 1 hidden "
            "shard(s) were made without it (results/hidden/shard-00000.arrow); rerun the hidden stage "
            "(snakemake --forcerun hidden_shard)"
        )
        assert (line in out.splitlines()) == refused, out
        assert proc.returncode != 0 and "Traceback" not in out  # with the column: the fake fails to verify
        assert (tmp_path / "results" / "logs" / "hidden_verify.log").exists() != refused  # no job ran


def test_a_rerun_says_before_its_first_job_which_finished_costly_outputs_it_makes_again(tmp_path):
    """Every output up to the hidden shards on disk (as a finished run leaves them), then the prompts made
    newer: before its first job the run names the regeneration and hidden shards it will make again, with
    Snakemake's reasons; nothing is said of a stage whose outputs are not there yet."""
    config = write_config(tmp_path / "config.yaml", {"hidden.shards": 1, "regenerate.shards": 1})
    target = "results/hidden/verify.json"
    dry = snakemake(tmp_path, "-n", "--cores", "1", target, config=config).stdout
    outputs = [
        o.strip()
        for line in dry.splitlines()
        if line.strip().startswith("output:")
        for o in line.split(":", 1)[1].split(",")
    ]
    for out in outputs[:-1]:  # all but the verification, as a finished run's files
        (tmp_path / out).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / out).mkdir() if out.endswith("target") else (tmp_path / out).write_text("{}")
    for f in (tmp_path / "results").rglob("*"):
        os.utime(f, (1e9, 1e9))
    for f in (tmp_path / "results" / "prompts").iterdir():
        os.utime(f, (2e9, 2e9))  # the prompts made again since
    proc = snakemake(tmp_path, "--cores", "1", target, config=config, check=False)
    notes = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("note: this run")]
    assert notes == [
        "note: this run makes 1 finished regenerate output(s) again (updated input files); `snakemake -n` "
        "lists each job's reason before a run",
        "note: this run makes 1 finished hidden_shard output(s) again (input files updated by another job); "
        "`snakemake -n` lists each job's reason before a run",
    ], notes
    assert proc.returncode != 0  # the fake files fail the first job


def test_a_failed_job_says_its_error_once_with_its_log_and_the_rerun(tmp_path):
    """A job that fails (the prompts stage: prompts.min_chars above every toy prompt) is its error line
    once on the console, with its log; the run ends with the command that reruns it. Neither the job's
    command line nor a traceback is printed; Snakemake's whole account is in the run's complete log."""
    config = write_config(
        tmp_path / "config.yaml", {"toy.steps": 0, "toy.num_docs": 200, "prompts.min_chars": 1999}
    )
    proc = snakemake(tmp_path, "--cores", "2", config=config, check=False)
    out = proc.stdout + proc.stderr
    lines = out.splitlines()
    said = "rule prompts failed: "
    [error] = [x.removeprefix(said) for x in lines if x.startswith(said)]
    # the reasons in the line itself (rejects.parquet goes with the failed job's other outputs)
    assert error.startswith("prompts: error: no usable prompt in any source (rejected: "), out
    assert "too short (under prompts.min_chars 1999)" in error and out.count(error) == 1, out
    assert proc.returncode != 0 and "  log: results/logs/prompts.log" in lines, out
    assert error in (tmp_path / "results" / "logs" / "prompts.log").read_text()
    [complete] = list((tmp_path / ".snakemake" / "log").glob("*.snakemake.log"))
    assert lines[-2] == (
        "flashdraft: the run stopped; 1 job failed (above: its error and log); Snakemake's "
        f"account, with each job's command line: .snakemake/log/{complete.name}"
    ), out
    rerun = shlex.split(lines[-1].removeprefix("rerun once fixed: "))
    assert lines[-1].startswith("rerun once fixed: snakemake ") and rerun[-2:] == ["--cores", "all"], out
    assert rerun[rerun.index("--configfile") + 1] == str(config), out
    assert "Traceback (most recent call last)" not in out and "Error in rule" not in out, out
    assert "--out-dir results/prompts" not in out and "WorkflowError" not in out, out  # no command line
    assert "--out-dir results/prompts" in complete.read_text()


def test_a_model_type_of_transformers_in_a_package_of_another_name_is_not_remote_code(tmp_path):
    """gemma3_text's classes live in transformers' gemma3 package: it ships, though an auto_map is there."""
    model = tmp_path / "models" / "gemma"
    model.mkdir(parents=True)
    auto_map = {"AutoModelForCausalLM": "modeling_gemma.Gemma3ForCausalLM"}
    (model / "config.json").write_text(
        json.dumps({"model_type": "gemma3_text", "num_hidden_layers": 8, "auto_map": auto_map})
    )
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "Hi"}) + "\n")
    overrides = {
        "target": {"path": "models/gemma", "build_toy": False},
        "prompts.sources": [{"name": "p", "path": "prompts.jsonl"}],
    }
    config = write_config(tmp_path / "config.yaml", overrides)
    proc = snakemake(tmp_path, "-n", "--cores", "1", config=config, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "needs remote code" not in proc.stdout + proc.stderr


def test_more_hidden_shards_than_prompts_warns(tmp_path):
    config = write_config(tmp_path / "config.yaml", {"hidden.shards": 8, "prompts.total": 4})
    proc = snakemake(tmp_path, "-n", "--cores", "1", config=config)
    assert "warning: config key hidden.shards: 8 shards for at most 4 training prompts" in proc.stderr
    assert not (tmp_path / "results").exists()


def test_production_dry_run_shards_and_gpus(tmp_path):
    # Dry run only: a config.json stands in for the 16 GB of Qwen3-8B weights nothing here loads.
    model = tmp_path / "models" / "Qwen3-8B"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 36}))
    production_sources(tmp_path)
    config = write_config(
        tmp_path / "prod.yaml", {"gpus.check_visible": False}, base=REPO / "config" / "production.yaml"
    )
    shutil.copytree(REPO / "config", tmp_path / "config")  # as in a clone: the embedded default is there
    proc = snakemake(tmp_path, "-n", "-p", "--cores", "8", "--resources", "gpu=8", config=config)
    counts = job_counts(proc.stdout)
    assert counts["hidden_shard"] == 40 and counts["regenerate"] == 40
    assert counts["train"] == 1 and "toy_target" not in counts
    assert counts["evaluate"] == 8 and counts["evaluate_merge"] == 1  # eval.shards: 8, every GPU of the node
    assert "nproc_per_node 3 --virtual-local-rank" in proc.stdout
    assert "--gpus 3" in proc.stdout and "--gpus 1" in proc.stdout
    # the prompts stage measures the prompts against the target it reads (tokenizer, positions)
    assert re.search(r"scripts/prompts\.py .*--target models/Qwen3-8B", proc.stdout)
    # production.yaml is not read on top of the toy's config/config.yaml: the keys it leaves out are the
    # documented defaults (a validation at each checkpoint), not the toy's (every 10 steps, logs every 5)
    [train] = [shlex.split(line) for line in proc.stdout.splitlines() if "scripts/train.py" in line]
    cfg = json.loads(train[train.index("--cfg") + 1])
    assert (cfg["val_every"], cfg["log_every"]) == (0, 10)


def test_a_config_that_does_not_fit_the_gpu_stops_before_any_job(tmp_path):
    """production.yaml without its bound on a micro-batch's anchors, for nodes of 40 GiB GPUs
    (gpus.memory_gib): the training stage's line names the key and the largest value that fits, and no job
    runs; with the bound the value named, the same dry run plans every job."""
    from flashdraft.shapes import QWEN3_8B

    model = tmp_path / "models" / "Qwen3-8B"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", **QWEN3_8B}))
    production_sources(tmp_path)
    shutil.copytree(REPO / "config", tmp_path / "config")
    keys = {"gpus.check_visible": False, "gpus.memory_gib": 40, "train.batch_anchors": 0}
    config = write_config(tmp_path / "prod.yaml", keys, base=REPO / "config" / "production.yaml")
    proc = snakemake(tmp_path, "-n", "--cores", "8", "--resources", "gpu=8", config=config, check=False)
    out = proc.stdout + proc.stderr
    [line] = [x for x in out.splitlines() if x.startswith("stage train: ")]
    assert re.search(
        r"^stage train: predicted peak [\d.]+ GiB of GPU memory, more than the [\d.]+ GiB a 40 "
        r"GiB card \(gpus\.memory_gib\) gives it; set train\.batch_anchors to (\d+) or less "
        r"\(now unbounded\)$",
        line,
    ), line
    assert proc.returncode != 0 and "Traceback" not in out and "Job stats" not in out
    fits = int(re.search(r"batch_anchors to (\d+)", line).group(1))
    config = write_config(
        tmp_path / "prod.yaml",
        {**keys, "train.batch_anchors": fits},
        base=REPO / "config" / "production.yaml",
    )
    proc = snakemake(tmp_path, "-n", "--cores", "8", "--resources", "gpu=8", config=config)
    assert job_counts(proc.stdout)["train"] == 1


def test_server_backend_leases_the_server_gpus(tmp_path):
    overrides = {"regenerate.backend": "server", "regenerate.server_gpus": 2, "gpus.check_visible": False}
    config = write_config(tmp_path / "config.yaml", overrides)
    proc = snakemake(
        tmp_path, "-n", "-p", "--cores", "1", "results/regenerated/train/shard-00000.parquet", config=config
    )
    assert re.search(r"flashdraft\.gpu --gpus 2 .*scripts/regenerate\.py", proc.stdout)


# ---- the end-to-end run ----


def test_training_on_the_sources_answers(tmp_path):
    """regenerate.enabled: false trains on the sources' own answers. The pool (3 x 20 toy rows) is smaller
    than prompts.total, which would otherwise be filled with answerless augmented prompts."""
    cheap = {
        "toy.num_docs": 200,
        "toy.steps": 0,
        "toy.source_rows": 20,
        "regenerate.enabled": False,
        "hidden.shards": 1,
        "train.max_steps": 2,
        "train.compile": False,
    }
    # in a run directory of its own (results: the only key changed): the toy and its sources included
    own = {"results": "runs/sources"}
    config = write_config(tmp_path / "config.yaml", {**SMALL, **cheap, **own})
    snakemake(tmp_path, "--cores", "2", "runs/sources/eval/summary.json", config=config)
    assert not (tmp_path / "results").exists()
    r = tmp_path / "runs" / "sources"
    assert (r / "logs" / "train.log").exists() and list((r / "checkpoints").glob("*/step-*"))
    # the run directory (a hash) says what it trained with; the export names it
    [run] = (r / "checkpoints").iterdir()
    recorded = json.loads((run / "run.json").read_text())
    assert (
        recorded["train"]["max_steps"] == 2
        and recorded["drafter"]["block_size"] == SMALL.get("drafter.block_size", 8)
        and recorded["data"]["shards"]
    )
    assert json.loads((r / "train" / "export.json").read_text())["run"] == run.name
    stats = json.loads((r / "prompts" / "stats.json").read_text())
    assert stats["need_answers"] and stats["totals"]["augmented"] == 0
    train = pd.read_parquet(r / "prompts" / "train.parquet")
    assert len(train) == stats["totals"]["sampled_train"] < SMALL["prompts.total"]
    assert pd.read_parquet(r / "regenerated" / "errors" / "shard-00000.parquet").empty
    assert (r / "drafter" / "config.json").exists()
    assert json.loads((r / "eval" / "summary.json").read_text())["target_only"]["tokens_per_s"]


def test_a_source_rewritten_under_its_old_mtime_reruns_the_prompts(tmp_path):
    """cp -p, rsync -t and tar x keep a file's mtime: the prompts still rerun on the new content."""

    def source(word):
        return "".join(json.dumps({"prompt": f"Question {i} about {word}?"}) + "\n" for i in range(40))

    src = tmp_path / "mine.jsonl"
    src.write_text(source("cats"))
    mine = [{"name": "mine", "path": "mine.jsonl"}]
    cheap = {"toy.num_docs": 200, "toy.steps": 0}  # the prompts read the toy target's tokenizer
    config = write_config(tmp_path / "config.yaml", {"prompts.sources": mine, "prompts.total": 20, **cheap})
    stats = "results/prompts/stats.json"
    snakemake(tmp_path, "--cores", "1", stats, config=config)

    def to_do():
        return job_counts(snakemake(tmp_path, "-n", "--cores", "1", stats, config=config).stdout)

    assert to_do() == {}
    before = src.stat()
    (tmp_path / "new.jsonl").write_text(source("dogs"))  # the same size, other prompts
    shutil.copy2(tmp_path / "new.jsonl", src)
    os.utime(src, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert src.stat().st_size == before.st_size and src.stat().st_mtime_ns == before.st_mtime_ns
    assert to_do() == {"prompts": 1}


def test_a_job_run_again_keeps_its_previous_log(small_run):
    """A job that runs again (killed, failed, or forced) starts a new log: the previous attempt's is kept
    beside it, which Snakemake would otherwise delete as the job starts."""
    work, config, _ = small_run
    log = work / "results" / "logs" / "report.log"
    first = log.read_text()
    assert first
    proc = snakemake(work, "--cores", "1", "--forcerun", "report", "results/report.html", config=config)
    assert (work / "results" / "logs" / "report.log.previous").read_text() == first
    assert log.exists() and "the previous attempt's log is" in proc.stderr


def test_paths_with_spaces_quotes_and_shell_syntax_stay_plain_text(tmp_path):
    """Every job of the DAG, from a checkout whose path holds a space and a quote, with a run directory
    (`results:`), a target path and a GPU lock dir holding `$(...)`: all run, and nothing in those strings
    is executed."""
    root = tmp_path / "it's a checkout"
    shutil.copytree(
        REPO,
        root,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", ".whl", "wheelhouse", "results", ".snakemake", "__pycache__", ".gl"
        ),
    )
    work = root / "work"
    work.mkdir()
    results = "runs/r $(touch PWNED) ü"
    cheap = {
        "toy.num_docs": 200,
        "toy.steps": 0,
        "toy.source_rows": 20,
        "hidden.shards": 1,
        "train.max_steps": 2,
        "train.compile": False,
        "results": results,
        "target.path": "{results}/toy/$(touch PWNED)target",
        "gpus.lock_dir": str(tmp_path / "locks $(touch PWNED)"),
    }
    config = write_config(work / "config.yaml", {**SMALL, **cheap})
    snakemake(
        work,
        "--cores",
        "2",
        config=config,
        snakefile=root / "workflow" / "Snakefile",
        env={"PYTHONPATH": str(root / "src")},
    )
    assert (work / results / "report.html").exists()
    assert (work / results / "toy" / "$(touch PWNED)target" / "config.json").exists()
    assert not [p for p in tmp_path.rglob("PWNED*")], "a path was run as a command"


def test_a_finished_run_ends_with_its_result(small_run):
    """Its last lines: each drafter's tau, speedup and losslessness (the evaluation's summary), the report's
    path and the commands that serve the drafter."""
    work, _, proc = small_run
    lines = proc.stdout.splitlines()
    start = lines.index("flashdraft: the drafter is trained and evaluated")
    end = lines[start:]
    summary = json.loads((work / "results" / "eval" / "summary.json").read_text())
    tau = summary["dflash"]["tau_pooled"]
    assert any(
        re.fullmatch(rf"  dflash: tau {tau:.2f} pooled, .* speedup [\d.]+x  lossless (True|False)", x)
        for x in end
    ), end
    assert f"  report: {(work / 'results' / 'report.html').resolve()}" in end
    assert [x.split(":")[0] for x in end[-2:]] == ["  serve it with vLLM", "  serve it with SGLang"]


def test_every_stage_artifact(small_run):
    work, config, _ = small_run
    cfg = yaml.safe_load(config.read_text())
    r = work / "results"

    assert (r / "toy" / "target" / "config.json").exists()
    # no job's log opens with torchao's import-time noise (kernels this machine cannot load, deprecations)
    logs = {p: p.read_text(errors="replace") for p in (r / "logs").rglob("*.log")}
    assert len(logs) > 10 and not [p for p, t in logs.items() if "Failed to load" in t or "_pytree.py" in t]
    train = pd.read_parquet(r / "prompts" / "train.parquet")
    evals = pd.read_parquet(r / "prompts" / "eval.parquet")
    assert {"id", "source", "messages", "prompt"} <= set(train.columns)
    assert len(evals) == cfg["prompts"]["eval_count"]
    assert 0 < len(train) <= cfg["prompts"]["total"]
    assert not set(train.id) & set(evals.id)
    assert json.loads((r / "prompts" / "stats.json").read_text())

    regen = pd.read_parquet(r / "regenerated" / "train")  # one file per regeneration shard
    assert sorted(regen.id) == sorted(train.id)
    for i in range(cfg["hidden"]["shards"]):  # each regeneration shard holds exactly its own rows
        part = pd.read_parquet(r / "regenerated" / "train" / f"shard-{i:05d}.parquet")
        assert len(part) > 0 and all(shard_of(x, cfg["hidden"]["shards"]) == i for x in part.id)
    assert all(m[-1]["role"] == "assistant" for m in regen.messages)

    rows, feats = 0, None
    for i in range(cfg["hidden"]["shards"]):
        manifest = json.loads((r / "hidden" / f"shard-{i:05d}.json").read_text())
        with pa.memory_map(str(r / "hidden" / f"shard-{i:05d}.arrow")) as src:
            table = pa.ipc.open_file(src).read_all()
        assert table.num_rows == manifest["rows"]
        assert manifest["target_layer_ids"] == [1, 3]
        H = manifest["hidden_size"]
        for row in table.slice(0, 3).to_pylist():
            T = row["num_tokens"]
            assert len(row["input_ids"]) == len(row["loss_mask"]) == T <= cfg["hidden"]["max_length"]
            assert len(row["hidden"]) == T * manifest["num_features"] * H * 2  # bf16
        rows += manifest["rows"]
        feats = manifest["num_features"] * H
    assert rows > 0.9 * len(regen) and feats == 2 * 128
    verify = json.loads((r / "hidden" / "verify.json").read_text())
    assert verify["ok"] and len(verify["shards"]) == cfg["hidden"]["shards"]

    meta = json.loads((r / "compile_cache" / "meta.json").read_text())
    assert meta["compile"] and (r / "compile_cache" / "artifacts.bin").stat().st_size > 0
    train_log = (r / "logs" / "train.log").read_text()
    first = re.search(r"first step .*caches (\{.*\})", train_log)
    counters = ast.literal_eval(first[1]) if first else {}
    assert counters.get("fxgraph_cache_hit", 0) > 0 and cache_misses(counters) == 0, (
        f"training did not start from the warm cache: {counters}"
    )

    dcfg = json.loads((r / "drafter" / "config.json").read_text())
    assert dcfg["architectures"] == ["DFlashDraftModel"]
    assert dcfg["dflash_config"]["target_layer_ids"] == [1, 3]
    from safetensors import safe_open

    with safe_open(str(r / "drafter" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "fc.weight" in keys and not any("embed" in k or "lm_head" in k for k in keys)

    metrics = pd.read_csv(r / "train" / "metrics.csv")
    assert len(metrics) > 0 and metrics.loss.notna().all()

    summary = json.loads((r / "eval" / "summary.json").read_text())
    per_prompt = pd.read_parquet(r / "eval" / "per_prompt.parquet")
    assert len(per_prompt) > 0
    assert 1.0 <= summary["dflash"]["tau_pooled"] <= cfg["drafter"]["block_size"]
    assert summary["dflash"]["lossless_all"] and summary["dflash_untrained"]["lossless_all"]
    # Even this short run buys acceptance over the untrained drafter (1.6 vs 1.0 when written).
    assert summary["dflash"]["tau_pooled"] > 1.2 * summary["dflash_untrained"]["tau_pooled"]

    html = (r / "report.html").read_text()
    assert html.count("<img") == 5
    assert "<h2>Throughput</h2>" in html and "hidden_shard/00001" in html and "regenerate/00001" in html
    assert " answers</td>" in html
    assert sorted(p.name for p in (r / "report_plots").glob("*.png")) == [
        "acceptance.png",
        "stage-time.png",
        "tau-hist.png",
        "train-acc.png",
        "train-loss.png",
    ]

    for stage in (
        "toy_target",
        "prompts",
        "regenerate/00000",
        "warmup",
        "train",
        "evaluate/00000",
        "evaluate_merge",
        "report",
    ):
        assert (r / "benchmarks" / f"{stage}.tsv").exists(), stage
        assert (r / "logs" / f"{stage}.log").exists(), stage


# ---- reruns: dry-run job lists on the finished run ----


def test_jobs_keep_their_bytecode_where_the_environment_forbids_writing_it(small_run):
    """PYTHONDONTWRITEBYTECODE was set for the run: each stage still left its modules' bytecode in the
    workflow's cache, so the next job (a stream-mode chunk) imports without compiling them again."""
    work = small_run[0]
    cached = {
        p.name.split(".")[0]
        for p in (work / ".snakemake" / "pycache").rglob("*.pyc")
        if p.parent.name == "flashdraft"
    }
    assert {"train", "hidden", "regenerate", "evaluate", "report"} <= cached


def test_each_long_job_puts_its_status_on_the_console(small_run):
    """The run's console (Snakemake's stderr) shows each long job's status line, its last at least, while
    its log keeps the whole bar."""
    lines = [line for line in small_run[2].stderr.splitlines() if line.startswith("[")]
    for job in ("regenerate 00000", "hidden_shard 00001", "train", "evaluate 00000"):
        assert any(line.startswith(f"[{job}] ") and "(100%)" in line for line in lines), (job, lines)
    assert any(line.startswith("[train] train: ") and "loss=" in line and "tau=" in line for line in lines)


def test_complete_run_has_nothing_to_do(small_run):
    work, config, _ = small_run
    proc = snakemake(work, "-n", "--cores", "2", config=config)
    assert job_counts(proc.stdout) == {}


@pytest.mark.slow
def test_a_moved_checkout_run_through_another_path_to_python_has_nothing_to_do(small_run, tmp_path):
    """Job parameters hold no machine paths: the checkout copied elsewhere, its interpreter reached through
    another path (a link to the environment), sees the finished run as finished."""
    work, config, _ = small_run
    moved = tmp_path / "moved checkout"
    for part in ("workflow", "scripts", "src", "config"):
        shutil.copytree(REPO / part, moved / part, ignore=shutil.ignore_patterns("__pycache__"))
    env_dir = Path(sys.executable).parent.parent
    (tmp_path / "env").symlink_to(env_dir)
    python = tmp_path / "env" / Path(sys.executable).relative_to(env_dir)
    proc = subprocess.run(
        [
            str(python),
            "-m",
            "snakemake",
            "-s",
            str(moved / "workflow" / "Snakefile"),
            "-d",
            str(work),
            "-n",
            "--cores",
            "2",
            "--configfile",
            str(config),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert job_counts(proc.stdout) == {}, proc.stdout[-4000:]


def test_forcerun_train_reruns_train_onward_only(small_run):
    work, config, _ = small_run
    proc = snakemake(work, "-n", "--cores", "2", "--forcerun", "train", config=config)
    assert set(job_counts(proc.stdout)) == {"train", "evaluate", "evaluate_merge", "report", "all"}


def test_one_shard_builds_only_what_it_needs(tmp_path):
    config = write_config(tmp_path / "config.yaml", {})
    proc = snakemake(tmp_path, "-n", "--cores", "2", "results/hidden/shard-00001.arrow", config=config)
    assert job_counts(proc.stdout) == {
        "toy_target": 1,
        "toy_sources": 1,
        "prompts": 1,
        "regenerate": 1,
        "hidden_shard": 1,
    }


def test_a_hidden_shard_waits_only_for_its_regeneration_shards(tmp_path):
    # 4 hidden shards over 2 regeneration shards: hidden shard 3's rows all lie in regeneration shard 1
    config = write_config(tmp_path / "config.yaml", {"hidden.shards": 4, "regenerate.shards": 2})
    proc = snakemake(tmp_path, "-n", "-p", "--cores", "2", "results/hidden/shard-00003.arrow", config=config)
    assert job_counts(proc.stdout) == {
        "toy_target": 1,
        "toy_sources": 1,
        "prompts": 1,
        "regenerate": 1,
        "hidden_shard": 1,
    }
    assert "--shard 00001 --num-shards 2" in proc.stdout


def test_evaluation_runs_as_eval_shards_jobs_then_one_merge(tmp_path):
    config = write_config(tmp_path / "config.yaml", {"eval.shards": 3})
    proc = snakemake(tmp_path, "-n", "-p", "--cores", "2", "results/eval/summary.json", config=config)
    counts = job_counts(proc.stdout)
    assert counts["evaluate"] == 3 and counts["evaluate_merge"] == 1
    assert all(f"--shard {i:05d} --num-shards 3" in proc.stdout for i in range(3))


def test_a_rerun_regeneration_shard_reruns_only_its_own_downstream(small_run):
    work, config, _ = small_run
    shard = "results/regenerated/train/shard-00001.parquet"
    proc = snakemake(work, "-n", "-p", "--cores", "2", "--forcerun", shard, config=config)
    counts = job_counts(proc.stdout)
    assert counts["regenerate"] == 1 and counts["hidden_shard"] == 1 and "prompts" not in counts
    # shard 0 of the regeneration and hidden shards stays (the one evaluation job is --shard 00000 of 1)
    assert "--shard 00001 --num-shards 2" in proc.stdout and "--shard 00000 --num-shards 2" not in proc.stdout


@pytest.mark.parametrize(
    "deleted, rerun",
    [
        ("hidden/shard-00001.arrow", {"hidden_shard": 1}),
        ("regenerated/train/shard-00000.parquet", {"regenerate": 1, "hidden_shard": 1}),
    ],
    ids=["hidden", "regenerated"],
)
def test_a_plain_rerun_makes_a_deleted_shard_again_with_what_depends_on_it(
    small_run, tmp_path, deleted, rerun
):
    """Snakemake makes a missing file again only for a job that runs: rule all asks for every shard, so the
    plain rerun makes a deleted one again, and the stages after it, not the others; one line says so."""
    work = tmp_path / "run"
    shutil.copytree(small_run[0], work, symlinks=True, ignore=shutil.ignore_patterns("pycache"))
    (work / "results" / deleted).unlink()
    proc = snakemake(work, "-n", "--cores", "2", config=small_run[1])
    after = {
        "hidden_verify": 1,
        "warmup": 1,
        "train": 1,
        "evaluate": 1,
        "evaluate_merge": 1,
        "report": 1,
        "all": 1,
    }
    assert job_counts(proc.stdout) == {**rerun, **after}
    assert (
        f"note: results/{deleted}: deleted since the run that used it; the plain run makes it again, "
        "with what depends on it (snakemake "
    ) in proc.stderr


def test_a_stream_run_names_the_store_run_s_shards_it_leaves_on_disk(small_run, tmp_path):
    work, config, _ = small_run
    stream = write_config(
        tmp_path / "stream.yaml", {"hidden.mode": "stream", "hidden.disk_budget": "10MB"}, base=config
    )
    proc = snakemake(work, "-n", "--cores", "2", config=stream)
    size = sum(p.stat().st_size for p in (work / "results" / "hidden").glob("shard-*"))
    assert (
        f"note: results/hidden holds 2 store-mode hidden shard(s) ({human_bytes(size)}) that this "
        "stream-mode run does not read; to free the space: rm results/hidden/shard-*"
    ) in proc.stderr
    assert (work / "results" / "hidden" / "shard-00000.arrow").exists()


def test_changed_train_param_reruns_train_onward_only(small_run, tmp_path):
    work, config, _ = small_run
    changed = tmp_path / "changed.yaml"
    cfg = yaml.safe_load(config.read_text())
    cfg["train"]["lr"] = cfg["train"]["lr"] * 0.5
    changed.write_text(yaml.safe_dump(cfg))
    proc = snakemake(work, "-n", "--cores", "2", config=changed)
    assert set(job_counts(proc.stdout)) == {"train", "evaluate", "evaluate_merge", "report", "all"}


def test_a_family_that_needs_the_last_hidden_state_remakes_the_hidden_shards(small_run, tmp_path):
    """The small run's (DFlash) shards hold no last hidden state: drafter.family dspark makes them again by
    itself (the flag is one of the hidden stage's params); the DFlash run's own params are unchanged."""
    work, config, _ = small_run
    changed = tmp_path / "dspark.yaml"
    cfg = yaml.safe_load(config.read_text())
    cfg.setdefault("drafter", {})["family"] = "dspark"
    changed.write_text(yaml.safe_dump(cfg))
    proc = snakemake(work, "-n", "--cores", "2", config=changed)
    assert job_counts(proc.stdout)["hidden_shard"] == cfg.get("hidden", {}).get("shards", 2)
    assert "params" in proc.stdout.lower() and "hidden_shard" in proc.stdout


def test_snakemake_report_renders_with_plots(small_run, tmp_path):
    work, config, _ = small_run
    out = tmp_path / "snakemake-report.html"
    snakemake(work, "--report", str(out), config=config)
    dom = headless_dom(out, tmp_path)
    for name in ("acceptance.png", "tau-hist.png", "train-loss.png", "report.html"):
        assert name in dom, name
    # the workflow's description (its template rendered with the run's config), as the report embeds it
    desc = json.loads(re.search(r"var workflow_desc = (\".*?\");\n", out.read_text()).group(1))
    target = yaml.safe_load(config.read_text())["target"]["path"].replace("{results}", "results")
    assert (
        'A <tt class="docutils literal">dflash</tt> drafter trained for the target at '
        f'<tt class="docutils literal">{target}</tt>'
    ) in desc
    assert "config[" not in desc and "{{" not in desc


DSPARK = {
    "drafter.family": "dspark",
    "drafter.block_size": 7,
    "drafter.dspark": {"markov_rank": 64},
    "train.gamma": 4.0,
}


@pytest.mark.slow
def test_a_dspark_drafter_runs_the_whole_dag_on_the_answers_already_there(small_run, tmp_path):
    """drafter.family dspark on a finished DFlash run: the hidden states again (now holding the target's
    last hidden state), then the warmup, training, a DSpark export and a lossless evaluation; the prompts
    and the regenerated answers are kept."""
    from flashdraft.drafter_io import load_drafter
    from flashdraft.hidden import HiddenStore

    work = tmp_path / "dspark"
    shutil.copytree(small_run[0], work, symlinks=True)
    # ten steps: what is asserted is the family's path through every stage, not how well it drafts
    config = write_config(work / "dspark.yaml", {**SMALL, **DSPARK, "train.max_steps": 10})
    planned = set(job_counts(snakemake(work, "-n", "--cores", "2", config=config).stdout))
    assert {"hidden_shard", "warmup", "train", "evaluate", "report"} <= planned
    assert not {"prompts", "regenerate"} & planned
    snakemake(work, "--cores", "2", config=config)
    results = work / "results"
    shards = sorted((results / "hidden").glob("shard-*.arrow"))
    sample = HiddenStore(shards)[0]
    assert sample["last_hidden"].shape == (len(sample["input_ids"]), sample["hidden"].shape[1] // 2)
    export = json.loads((results / "drafter" / "config.json").read_text())
    assert export["architectures"] == ["Qwen3DSparkModel"] and export["block_size"] == 7
    assert export["markov_rank"] == 64 and export["enable_confidence_head"] is True
    drafter, spec = load_drafter(results / "drafter")
    assert spec.family == "dspark" and drafter.markov_head.markov_w1.weight.shape[1] == 64
    metrics = pd.read_csv(results / "train" / "metrics.csv")
    assert {"l1", "confidence", "expected_tau", "acc_pos_7"} <= set(metrics.columns)
    assert metrics[["loss", "l1", "expected_tau"]].notna().all().all()
    summary = json.loads((results / "eval" / "summary.json").read_text())
    assert summary["dspark"]["lossless_all"] is True
    assert len(summary["dspark"]["tau_hist"]) == 8  # 1..B+1 tokens per verify step: B drafts and the bonus
