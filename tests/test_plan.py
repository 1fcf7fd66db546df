import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from flashdraft import results
from flashdraft.config import Config, DrafterConfig, HiddenConfig, TargetConfig, ToyConfig, feature_layers
from flashdraft.config_load import load
from flashdraft.errors import UserError
from flashdraft.estimate import (
    RATES,
    REFERENCE_TARGET,
    Split,
    hidden_disk,
    num_parameters,
    pipeline_seconds,
    token_bytes,
)
from flashdraft.estimate_inputs import (
    ASSUMED_ANSWER_TOKENS,
    ASSUMED_PROMPT_TOKENS,
    read_shapes,
    target_shapes,
    token_stats,
)
from flashdraft.hidden import FP8
from flashdraft.plan import plan, render
from flashdraft.precompute import hidden_shard
from flashdraft.results import lookup
from flashdraft.toy import build_toy_target, task_conversations

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PRODUCTION = REPO / "config" / "production.yaml"
EMBEDDED = REPO / "config" / "config.yaml"
QWEN3_8B = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
}


def plan_cli(*args, cwd=REPO):
    return subprocess.run(
        [sys.executable, "-m", "flashdraft.plan", *map(str, args)], capture_output=True, text=True, cwd=cwd
    )


@pytest.fixture
def qwen3_8b_dir(tmp_path, monkeypatch):
    """production.yaml's target.path (models/Qwen3-8B, relative) holding only a Qwen3-8B config.json."""
    (tmp_path / "models" / "Qwen3-8B").mkdir(parents=True)
    (tmp_path / "models" / "Qwen3-8B" / "config.json").write_text(json.dumps(QWEN3_8B))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def with_keys(tmp_path, base, **overrides):
    cfg = yaml.safe_load(Path(base).read_text())
    for key, value in overrides.items():
        section, name = key.split("__")
        cfg.setdefault(section, {})[name] = value
    path = tmp_path / f"config-{len(list(tmp_path.glob('config-*')))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_every_rate_is_its_benchmarks_figure():
    for name, rate in RATES.items():
        measured = lookup(json.loads((RESULTS / rate.file).read_text()), rate.key)
        assert rate.value == measured and measured > 0, name
    for f in ("eval_decode_qwen3-8b.json", "train_drafter_qwen3-8b.json"):
        shapes = json.loads((RESULTS / f).read_text())["shapes"]["target"]
        assert {k: shapes[k] for k in REFERENCE_TARGET} == REFERENCE_TARGET, f
    assert num_parameters(QWEN3_8B) == pytest.approx(8.19e9, rel=0.01)  # Qwen3-8B's model card: 8.2B


def test_a_re_measured_result_file_is_the_planner_s_new_rate(qwen3_8b_dir, tmp_path, monkeypatch):
    """The planner reads its rates from benchmarks/results/: a file with a doubled figure halves its stage."""
    cfg = load(PRODUCTION)
    before = plan(cfg, qwen3_8b_dir / "results", gpus=8)["stages"]
    copy = tmp_path / "results-copy"
    shutil.copytree(RESULTS, copy)
    rate = RATES[f"precompute_{cfg.hidden.dtype}"]
    data = json.loads((copy / rate.file).read_text())
    section, key = rate.key.split(".")
    data[section][key] *= 2
    (copy / rate.file).write_text(json.dumps(data))
    monkeypatch.setattr(results, "CHECKOUT_RESULTS", copy)
    results.result.cache_clear()
    try:
        after = plan(cfg, qwen3_8b_dir / "results", gpus=8)["stages"]
    finally:
        results.result.cache_clear()
    assert after["precompute"]["hours"] == pytest.approx(before["precompute"]["hours"] / 2)
    assert after["training"]["hours"] == before["training"]["hours"]


def test_a_missing_result_file_or_key_is_named():
    with pytest.raises(UserError, match=r"results/made_up\.json: no such result file"):
        results.figure("made_up.json", "x")
    with pytest.raises(UserError, match=r"results/eval_decode_qwen3-8b\.json: no value at key modes\.nope"):
        results.figure("eval_decode_qwen3-8b.json", "modes.nope")


def test_plan_on_production_on_one_node(qwen3_8b_dir, tmp_path):
    cfg = load(PRODUCTION)
    p = plan(cfg, qwen3_8b_dir / "results", gpus=8)
    tok = p["tokens"]
    assert p["scale"] == 1.0 and tok.samples == cfg.prompts.total
    assert tok.total == cfg.prompts.total * (ASSUMED_PROMPT_TOKENS + ASSUMED_ANSWER_TOKENS)  # assumed
    # 5 fused layers of H=4096: bf16 2 bytes a value, fp8 1 byte + a float32 scale; + int32 id, int8 mask
    width = 5 * 4096
    assert p["hidden_bytes"] == {"bfloat16": tok.total * (2 * width + 5), FP8: tok.total * (width + 4 + 5)}
    assert p["hidden_bytes"][FP8] == pytest.approx(p["hidden_bytes"]["bfloat16"] / 2, rel=1e-3)
    hours = {k: s["hours"] for k, s in p["stages"].items()}
    assert all(h > 0 for h in hours.values()) and p["total_hours"] == pytest.approx(sum(hours.values()))
    assert p["slowest"] == max(hours, key=hours.get)
    # precompute: tokens / (per-GPU rate x 8 GPUs), 40 shards in 5 waves
    rate = RATES[f"precompute_{cfg.hidden.dtype}"].value
    assert hours["precompute"] == pytest.approx(tok.total / (rate * 8) / 3600)

    # half the GPUs: twice the hours (40 and 8 shard jobs in whole waves; training on gpus.drafter)
    def on(gpus, drafter):
        # a global batch both 3 and 6 training processes can share (6 micro-batches of 16384 tokens)
        cfg = load(
            with_keys(
                tmp_path,
                PRODUCTION,
                gpus__drafter=drafter,
                eval__shards=8,
                train__global_batch_tokens=6 * 16384,
            )
        )
        return plan(cfg, "results", gpus=gpus)

    half, full = on(4, 3), on(8, 6)
    for stage in ("regeneration", "precompute", "training", "evaluation"):
        assert half["stages"][stage]["hours"] == pytest.approx(2 * full["stages"][stage]["hours"]), stage
    # a target twice as deep: about twice the parameters, every rate scaled down by the ratio
    deep = dict(QWEN3_8B, num_hidden_layers=72)
    (qwen3_8b_dir / "models" / "Qwen3-8B" / "config.json").write_text(json.dumps(deep))
    bigger = plan(cfg, "results", gpus=8)
    ratio = num_parameters(deep) / num_parameters(QWEN3_8B)
    assert bigger["stages"]["regeneration"]["hours"] == pytest.approx(ratio * hours["regeneration"])


def test_plan_command_prints_the_table_and_the_goal(qwen3_8b_dir):
    proc = plan_cli("--configfile", PRODUCTION, "--gpus", 8, cwd=qwen3_8b_dir)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for stage in ("regeneration", "precompute", "training", "evaluation", "total"):
        assert re.search(rf"^\| {stage} \|.*\| [\d.]+ \|[^|]*\|$", out, re.M), stage
    # the memory column: each GPU stage's peak on the card planned for, as a share of it
    for stage in ("precompute", "training", "evaluation"):
        assert re.search(rf"^\| {stage} \|.*\| [\d.]+ GiB \(0\.\d\d\) \|$", out, re.M), stage
    assert re.search(r"^\| regeneration \|.* \| fits \(slots sized from the free memory\) \|$", out, re.M)
    assert "ASSUMED" in out and f"{RATES['regenerate'].file}: tokens_per_s_per_gpu" in out
    assert re.search(r"36\.05 TB in bfloat16 \(40,965 bytes/token\), 18\.03 TB in float8_e4m3", out)
    goal = r"^goal \(whole DAG <= 36 h\): (met|NOT met), [\d.]+ h; .*: \w+ \([\d.]+ h\)$"
    assert re.search(goal, out, re.M)


def test_plan_prints_each_stage_s_peak_for_the_card_it_plans_for(qwen3_8b_dir):
    """No GPU here: an 80 GB H100's memory, said so; --gpu-memory another card's. A card too small for
    training without its bound names train.batch_anchors' largest value that fits, and that value fits."""
    from dataclasses import replace

    from flashdraft import memory

    proc = plan_cli("--configfile", PRODUCTION, cwd=qwen3_8b_dir)
    assert proc.returncode == 0, proc.stderr
    assert "on a card of 79.6 GiB (an 80 GB H100's 81,559 MiB: no GPU visible here" in proc.stdout
    assert "does NOT fit" not in proc.stdout  # production.yaml fits the card it is written for
    unbounded = qwen3_8b_dir / "unbounded.yaml"
    unbounded.write_text("train:\n  batch_anchors: 0\n")
    proc = plan_cli("--configfile", PRODUCTION, unbounded, "--gpu-memory", 40, cwd=qwen3_8b_dir)
    assert proc.returncode == 0, proc.stderr
    assert "on a card of 40.0 GiB (--gpu-memory)" in proc.stdout
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("  does NOT fit: stage train:")]
    fits = int(re.search(r"set train\.batch_anchors to (\d+) or less \(now unbounded\)$", line).group(1))
    cfg = load([str(PRODUCTION), str(unbounded)], target=QWEN3_8B)
    gib40 = 40 * memory.GIB
    bounded = replace(cfg, train=replace(cfg.train, batch_anchors=fits))
    assert memory.train_peak(bounded, QWEN3_8B, 3, gib40).bytes <= memory.budget(gib40)
    assert memory.problems(bounded, QWEN3_8B, 3, gib40, "test") == []
    assert plan_cli("--configfile", PRODUCTION, "--gpu-memory", 0, cwd=qwen3_8b_dir).returncode == 1


def test_plan_on_the_embedded_default_reads_the_stages_already_run(tmp_path):
    cfg = load(EMBEDDED)
    p = plan(cfg, tmp_path / "results")  # nothing has run: the assumptions, and the CPU has no rate
    width = 2 * cfg.toy.hidden_size  # drafter.num_layers 2
    per_sample = min(ASSUMED_PROMPT_TOKENS + cfg.regenerate.max_new_tokens, cfg.hidden.max_length)
    tokens = cfg.prompts.total * per_sample
    assert p["tokens"].total == tokens
    assert p["hidden_bytes"] == {"bfloat16": tokens * (2 * width + 5), FP8: tokens * (width + 9)}
    assert all(s["hours"] is None for s in p["stages"].values()) and p["total_hours"] is None

    # what the prompts, regenerate and hidden stages leave behind replaces the assumptions
    r = tmp_path / "results"
    (r / "prompts").mkdir(parents=True)
    stats = {"totals": {"sampled_train": 300, "sampled_eval": 9}}
    (r / "prompts" / "stats.json").write_text(json.dumps(stats))
    (r / "regenerated" / "train").mkdir(parents=True)
    for i, lengths in enumerate([[10, 20], [30]]):
        path = r / "regenerated" / "train" / f"shard-{i:05d}.parquet"
        pd.DataFrame({"response_tokens": lengths}).to_parquet(path)
    p = plan(cfg, r, gpus=2)
    assert (p["tokens"].samples, p["tokens"].answer_tokens, p["tokens"].eval_prompts) == (300, 20.0, 9)
    assert p["tokens"].total == 300 * min(ASSUMED_PROMPT_TOKENS + 20, cfg.hidden.max_length)
    assert p["stages"]["precompute"]["hours"] > 0
    assert p["stages"]["training"]["hours"] is None  # gpus.drafter 0: on the CPU
    (r / "hidden").mkdir()
    for i in range(cfg.hidden.shards):
        (r / "hidden" / f"shard-{i:05d}.json").write_text(json.dumps({"tokens": 1000 + i}))
    assert plan(cfg, r)["tokens"].total == 2001

    proc = plan_cli("--configfile", EMBEDDED, "--results", tmp_path / "none")
    assert proc.returncode == 0, proc.stderr
    assert "| precompute |" in proc.stdout and "runs on the CPU" in proc.stdout


@pytest.mark.parametrize(
    "text, expected",
    [
        ("eval:\n  shards: -1\n", "config key eval.shards: -1 is less than the minimum of 0"),
        ("hidden:\n  dtipe: bfloat16\n", "config key hidden: Additional properties are not allowed ('dtipe'"),
        ("target:\n  path: nowhere\n  build_toy: false\n", "config key target.path: cannot read nowhere/"),
        ("gpus: [1\n", "cannot read the config"),
    ],
)
def test_bad_config_is_one_line(tmp_path, text, expected):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    proc = plan_cli("--configfile", EMBEDDED, bad, cwd=tmp_path)  # a bad overlay on the embedded default
    assert proc.returncode == 1 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("plan: error: ") and expected in line, line


def test_every_problem_of_a_config_is_its_own_line_at_once(tmp_path):
    """The schema's mistake and a check's on the rest of the config, in one run, one line each, as the
    workflow gathers them before any job."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("hidden:\n  dtipe: bfloat16\ntarget:\n  path: nowhere\n  build_toy: false\n")
    proc = plan_cli("--configfile", EMBEDDED, bad, cwd=tmp_path)
    assert proc.returncode == 1 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("plan: error: ") for line in lines), lines
    assert "config key hidden: Additional properties are not allowed ('dtipe'" in lines[0]
    assert "config key target.path: cannot read nowhere/" in lines[1]


def test_a_config_without_a_target_is_one_line_not_the_toy(tmp_path):
    """A config file is read on its own: one that names no target is refused, not run on the toy's."""
    partial = tmp_path / "mine.yaml"
    partial.write_text("train:\n  lr: 0.001\n")
    proc = plan_cli("--configfile", partial, cwd=REPO)
    assert proc.returncode == 1 and "config key (top level): 'target' is a required property" in proc.stderr


@pytest.mark.parametrize("family", ["dflash", "dspark"])
@pytest.mark.parametrize("dtype", ["bfloat16", FP8])
def test_precompute_preflight_refuses_with_the_plans_estimate(tmp_path, dtype, family):
    target = tmp_path / "target"
    build_toy_target(ToyConfig(steps=0, num_docs=200), str(target))
    convs = task_conversations(6, seed=1)
    pd.DataFrame({"id": [f"s{i}" for i in range(6)], "messages": convs}).to_parquet(tmp_path / "data.parquet")
    hidden = HiddenConfig(dtype=dtype, max_length=96, disk_margin=1e12)
    drafter = DrafterConfig(num_layers=2, family=family)
    with pytest.raises(UserError, match="not enough disk space") as e:
        out = tmp_path / "h" / "shard-00000.arrow"
        section = TargetConfig(path=str(target), dtype="float32")
        hidden_shard(
            section, tmp_path / "data.parquet", 0, 1, out, hidden, drafter, last_hidden=family == "dspark"
        )
    need, tokens = map(int, re.search(r"\((\d+) bytes: (\d+) tokens x", str(e.value)).groups())
    cfg = Config(target=TargetConfig(path=str(target)), hidden=hidden, drafter=drafter)
    assert need == int(hidden_disk(cfg, target_shapes(cfg), tokens)[dtype] * (1 + hidden.disk_margin))
    assert not out.exists()


def test_a_dspark_token_holds_the_target_s_last_hidden_state_too():
    """Qwen3-8B's shapes (K=5 fused layers of H=4096) in bf16: a DFlash token is 40,960 bytes of hidden
    states, a DSpark token one more H-wide column, 49,152 (DESIGN.md 3a); each + its int32 id and int8
    mask. In fp8: a byte a value, and a float32 scale per column. Every estimate counts so."""
    from dataclasses import replace

    from flashdraft.io import bytes_per_token

    dflash = load(PRODUCTION, target=QWEN3_8B)
    dspark = replace(dflash, drafter=replace(dflash.drafter, family="dspark"))
    k, h = len(feature_layers(QWEN3_8B["num_hidden_layers"], dflash.drafter)), QWEN3_8B["hidden_size"]
    assert (k, h) == (5, 4096)
    bf16 = "bfloat16"
    assert bytes_per_token(bf16, k, h) == token_bytes(dflash, QWEN3_8B, bf16) == 40_960 + 5
    assert bytes_per_token(bf16, k, h, True) == token_bytes(dspark, QWEN3_8B, bf16) == 49_152 + 5
    assert token_bytes(dflash, QWEN3_8B, FP8) == 20_480 + 4 + 5
    assert token_bytes(dspark, QWEN3_8B, FP8) == 20_480 + 4 + 4096 + 4 + 5
    plans = {
        c.drafter.family: plan(c, "no-results", gpus=8, budget=2 * 10**12, target=QWEN3_8B)
        for c in (dflash, dspark)
    }
    p, tokens = plans["dspark"], plans["dspark"]["tokens"].total
    assert p["hidden_bytes"] == {"bfloat16": tokens * (49_152 + 5), FP8: tokens * (20_480 + 4096 + 13)}
    assert dspark.hidden.dtype == FP8 and p["modes"]["store"].peak_disk == p["hidden_bytes"][FP8]
    cap = {f: plans[f]["modes"]["stream"].chunks.cap for f in plans}  # a disk budget holds fewer tokens
    assert cap["dspark"] == 2 * 10**12 // (2 * (20_480 + 4096 + 13)) < cap["dflash"]
    assert "x 20,480 values + the target's last hidden state" in render(p, "production.yaml")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2TB", 2 * 10**12),
        ("500GB", 500 * 10**9),
        ("1.5TiB", 3 * 2**39),
        ("2e12", 2 * 10**12),
        (" 64 kib ", 65536),
        ("4096", 4096),
        ("1.1TB", 1_100_000_000_000),
        (7, 7),
    ],
)
def test_parse_bytes_reads_sizes_as_the_schema_does(text, expected):
    from flashdraft.io import parse_bytes

    assert parse_bytes(text) == expected
    assert HiddenConfig(disk_budget=text).disk_budget == expected
    if isinstance(text, str):
        schema = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
        assert re.search(schema["properties"]["hidden"]["properties"]["disk_budget"]["pattern"], text)


@pytest.mark.parametrize("bad", ["2 TBs", "-1", "TB", "", "1e", "5K", -3, 1.5, True])
def test_a_bad_size_is_an_error_naming_the_key(bad):
    from flashdraft.io import parse_bytes

    with pytest.raises(ValueError, match="config key hidden.disk_budget"):
        HiddenConfig(disk_budget=bad)
    with pytest.raises(ValueError, match="--disk-budget"):
        parse_bytes(bad, "--disk-budget")
    if isinstance(bad, str):
        schema = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
        assert not re.search(schema["properties"]["hidden"]["properties"]["disk_budget"]["pattern"], bad)


def test_stream_chunk_tokens_from_the_budget_or_the_key():
    from flashdraft.config import stream_chunk_tokens
    from flashdraft.hidden import storage_dtype
    from flashdraft.io import STORAGE_DTYPES, bytes_per_token

    for dtype in STORAGE_DTYPES:  # the torch-free arithmetic is torch's itemsize
        scale = 4 if dtype == FP8 else 0
        assert bytes_per_token(dtype, 2, 5) == 10 * storage_dtype(dtype).itemsize + scale + 5
    per_token = bytes_per_token(FP8, 5, 4096)
    budget = HiddenConfig(dtype=FP8, disk_budget="2TB")
    assert stream_chunk_tokens(budget, per_token) == 2 * 10**12 // (2 * per_token)
    keyed = HiddenConfig(dtype=FP8, disk_budget="2TB", chunk_tokens=1000)
    assert stream_chunk_tokens(keyed, per_token) == 1000
    with pytest.raises(UserError, match="config key hidden.disk_budget"):
        stream_chunk_tokens(HiddenConfig(mode="stream"), per_token)


def test_pipeline_waits_for_the_slower_side_and_the_ring():
    assert pipeline_seconds([2, 2, 2], [1, 1, 1]) == 2 + 2 + 2 + 1  # precompute-bound: + the drain
    assert pipeline_seconds([1, 1, 1], [3, 3, 3]) == 1 + 3 + 3 + 3  # training-bound: the fill +
    # chunk 2's shards wait for chunk 0's training (two chunks on disk): 11 + 5, then its training
    assert pipeline_seconds([1, 1, 5], [10, 1, 1]) == 17


def test_both_modes_and_the_recommendation_on_production():
    cfg = load(PRODUCTION, target=QWEN3_8B)  # production's target.path does not exist here
    p = plan(cfg, "no-results", gpus=8, budget=2 * 10**12, target=QWEN3_8B)
    store, stream, tok = p["modes"]["store"], p["modes"]["stream"], p["tokens"]
    per_token = 5 * 4096 + 9  # fp8
    assert store.peak_disk == p["hidden_bytes"][FP8] == tok.total * per_token
    assert store.wall_hours == pytest.approx(p["total_hours"])
    assert store.split == Split(cfg.gpus.target, cfg.gpus.drafter)

    c = stream.chunks
    assert c.cap == 2 * 10**12 // (2 * per_token)
    assert c.step_tokens == cfg.train.global_batch_tokens
    assert max(c.sizes) == c.cap // c.step_tokens * c.step_tokens
    assert sum(c.sizes) == cfg.train.epochs * tok.total and c.per_epoch == -(-tok.total // max(c.sizes))
    assert stream.peak_disk == 2 * max(c.sizes) * per_token <= 2 * 10**12
    rate = RATES[f"precompute_{FP8}"].value
    assert stream.hours["precompute"] == pytest.approx(sum(c.sizes) / (cfg.gpus.target * rate) / 3600)
    busy = stream.hours["training"] + stream.hours["start-up and checkpoints"]
    pre = stream.hours["precompute"]
    assert max(busy, pre) < stream.hours["pipeline"] < busy + pre
    assert stream.wall_hours == pytest.approx(
        stream.hours["regeneration"] + stream.hours["pipeline"] + stream.hours["evaluation"]
    )
    # the first chunk job: the measured launch, its last save (waited for) and the saves within it (copies)
    within = c.sizes[0] / c.step_tokens / cfg.train.checkpoint_every
    launch = RATES["train_launch_fp8" if cfg.train.fp8 else "train_launch"].value
    assert c.startup_s == pytest.approx(launch + p["last_save_s"] + within * p["save_s"])
    assert p["last_save_s"] > p["save_s"] > 0

    rec = p["recommendation"]
    splits = {(m.mode, m.split.target + m.split.drafter) for m in rec.candidates}
    assert splits == {("store", 16), ("stream", 8)}
    fits = [m for m in rec.candidates if m.peak_disk <= 2 * 10**12]
    assert "store" not in {m.mode for m in fits} and rec.best.wall_hours == min(m.wall_hours for m in fits)
    assert rec.floor_hours == pytest.approx(rec.best.gpu_hours / 8) and rec.floor_hours < rec.best.wall_hours
    # with disk for store mode, every stage on all 8 GPUs one after another beats the pipeline
    roomy = plan(cfg, "no-results", gpus=8, budget=20 * 10**12, target=QWEN3_8B)["recommendation"]
    assert roomy.best.mode == "store" and roomy.best.split == Split(8, 8)


def test_fp8_training_is_planned_at_its_measured_factor_and_start(tmp_path):
    bf16 = tmp_path / "bf16.yaml"
    bf16.write_text("train: {fp8: null, compile_loss: false, compile_scope: model}\n")
    base = load([PRODUCTION, bf16], target=QWEN3_8B)
    fp8 = load(PRODUCTION, target=QWEN3_8B)  # production.yaml trains in float8
    overlay = load([PRODUCTION, bf16, PRODUCTION.parent / "fp8.yaml"], target=QWEN3_8B)
    assert (fp8.train.fp8, fp8.train.compile_loss) == ("tensorwise", True) and base.train.fp8 is None
    assert overlay.train == fp8.train  # config/fp8.yaml sets what production.yaml does
    plans = [plan(c, "no-results", gpus=8, budget=2 * 10**12, target=QWEN3_8B) for c in (base, fp8)]
    (bf16_store, bf16_stream), (fp8_store, fp8_stream) = (
        (p["modes"]["store"], p["modes"]["stream"]) for p in plans
    )
    factor = RATES["train_fp8_speedup"].value
    assert factor > 1
    assert plans[1]["stages"]["training"]["hours"] == pytest.approx(
        plans[0]["stages"]["training"]["hours"] / factor
    )
    assert fp8_stream.hours["training"] == pytest.approx(bf16_stream.hours["training"] / factor)
    assert fp8_stream.chunks.sizes == bf16_stream.chunks.sizes  # the same chunks, trained faster
    # the first chunk job starts fresh, every later one from a checkpoint: float8's measured starts
    c, p = fp8_stream.chunks, plans[1]
    launches = [
        RATES["train_launch_resumed_fp8" if i else "train_launch_fp8"].value for i in range(len(c.sizes))
    ]
    saves = [n / c.step_tokens / fp8.train.checkpoint_every * p["save_s"] + p["last_save_s"] for n in c.sizes]
    assert fp8_stream.hours["start-up and checkpoints"] == pytest.approx((sum(launches) + sum(saves)) / 3600)
    assert RATES["train_launch_resumed_fp8"].value != RATES["train_launch_resumed"].value
    assert fp8_store.wall_hours < bf16_store.wall_hours


def test_plan_command_writes_both_modes_and_refuses_a_budget_nothing_fits(tmp_path):
    out = tmp_path / "plan.json"
    proc = plan_cli(
        "--configfile", PRODUCTION, "--gpus", 8, "--target-config", "qwen3-8b", "--json", out, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    s = json.loads(out.read_text())
    assert set(s) == {"store", "stream", "recommended", "floor_hours", "floor_fraction"}
    assert set(s["store"]) == set(s["stream"]) == {"wall_hours", "peak_disk_tb"}
    assert set(s["recommended"]) == {"mode", "gpus", "wall_hours", "peak_disk_tb"}
    assert set(s["recommended"]["gpus"]) == {"target", "drafter"}
    assert 0 < s["floor_fraction"] <= 1 and s["recommended"]["peak_disk_tb"] <= 2
    recommended = r"^recommended: hidden\.mode \w+, gpus\.target \d, gpus\.drafter \d: "
    assert re.search(recommended, proc.stdout, re.M)
    assert "| pipeline: precompute and training at once |" in proc.stdout

    proc = plan_cli(
        "--configfile",
        PRODUCTION,
        "--gpus",
        8,
        "--target-config",
        "qwen3-8b",
        "--disk-budget",
        "1GB",
        cwd=tmp_path,
    )
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert "config key hidden.disk_budget: 1 GB (--disk-budget) fits no plan on 8 GPUs" in line, line
    assert "one optimizer step" in line
    bad = with_keys(tmp_path, PRODUCTION, hidden__disk_budget="2 TBs")
    proc = plan_cli("--configfile", bad, "--target-config", "qwen3-8b", cwd=tmp_path)
    assert proc.returncode == 1 and "config key hidden.disk_budget" in proc.stderr


def test_results_of_another_target_are_ignored(tmp_path):
    cfg = load(EMBEDDED)
    r = tmp_path / "results"
    (r / "prompts").mkdir(parents=True)
    stats = {"totals": {"sampled_train": 300, "sampled_eval": 9}, "requested_train": cfg.prompts.total}
    (r / "prompts" / "stats.json").write_text(json.dumps(stats))
    (r / "hidden").mkdir()
    for i in range(cfg.hidden.shards):
        manifest = {"tokens": 1000 + i, "target": cfg.target.path}
        (r / "hidden" / f"shard-{i:05d}.json").write_text(json.dumps(manifest))
    tok = token_stats(cfg, r)
    assert (tok.samples, tok.total) == (300, 2001) and not any("IGNORED" in n for n in tok.notes)

    (r / "hidden" / "shard-00000.json").write_text(json.dumps({"tokens": 5, "target": "models/Other"}))
    tok = token_stats(cfg, r)
    assert tok.samples == cfg.prompts.total and tok.total != 2001
    assert any(n.startswith("IGNORED") and "models/Other" in n for n in tok.notes)

    (r / "hidden" / "shard-00000.json").unlink()  # the target matches again; the prompts asked for differ
    (r / "prompts" / "stats.json").write_text(json.dumps({**stats, "requested_train": 5}))
    tok = token_stats(cfg, r)
    assert tok.samples == cfg.prompts.total and any("prompts.total 5" in n for n in tok.notes)


@pytest.mark.parametrize(
    "shapes, expected",
    [
        ([], "holds list, not a config.json object"),
        (None, "holds NoneType, not a config.json object"),
        ({"hidden_size": "abc"}, "hidden_size is 'abc'"),
        ({"hidden_size": 0}, "hidden_size is 0"),
        ({"hidden_size": 64, "num_hidden_layers": 0}, "num_hidden_layers is 0"),
    ],
)
def test_a_target_config_without_usable_shapes_is_one_line(tmp_path, shapes, expected):
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps(shapes))
    proc = plan_cli("--configfile", EMBEDDED, "--target-config", path)
    assert proc.returncode == 1 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line == f"plan: error: --target-config {path}: {expected}" or line.startswith(
        f"plan: error: --target-config {path}: {expected};"
    ), line


def test_plan_json_into_a_missing_folder_is_one_line_before_the_plan(tmp_path):
    missing = tmp_path / "no"
    proc = plan_cli("--configfile", EMBEDDED, "--json", missing / "plan.json")
    assert proc.returncode == 1 and proc.stdout == ""  # refused before the plan was printed
    (line,) = proc.stderr.strip().splitlines()
    assert line == f"plan: error: --json {missing / 'plan.json'}: no folder {missing}; create it first"


def test_target_config_preset_is_qwen3_8b():
    import runpy

    from flashdraft.shapes import QWEN3_8B as PRESET

    shapes = read_shapes("qwen3-8b")
    assert {k: shapes[k] for k in REFERENCE_TARGET} == REFERENCE_TARGET and shapes == PRESET
    assert runpy.run_path(str(REPO / "benchmarks" / "shapes.py"))["QWEN3_8B"] is PRESET  # the benchmarks' too
    with pytest.raises(UserError, match="no such file, nor a preset"):
        read_shapes("nope")


def test_production_yaml_leaves_out_only_what_takes_the_documented_default():
    """config/production.yaml is read on its own, not on top of the toy's config/config.yaml: every key it
    leaves out is the dataclasses' default (train.val_every 0: a validation at each checkpoint, where the toy
    validates every 10 steps)."""
    import dataclasses

    import yaml

    from flashdraft.config import Config

    written = yaml.safe_load(PRODUCTION.read_text())
    loaded, default = load(PRODUCTION, target=QWEN3_8B), Config()
    for section in dataclasses.fields(Config):
        got, want = getattr(loaded, section.name), getattr(default, section.name)
        if not dataclasses.is_dataclass(got):  # a top-level key (results)
            assert section.name in written or got == want, section.name
            continue
        for f in dataclasses.fields(got):
            if f.name not in (written.get(section.name) or {}):
                assert getattr(got, f.name) == getattr(want, f.name), f"{section.name}.{f.name}"
    assert loaded.train.val_every == 0 and loaded.train.log_every == default.train.log_every


@pytest.fixture(scope="module")
def family_plans(tmp_path_factory):
    """production.yaml planned as it is (dflash) and with drafter.family dspark."""
    dspark = tmp_path_factory.mktemp("family") / "dspark.yaml"
    dspark.write_text("drafter: {family: dspark}\n")
    return [
        plan(load(files, target=QWEN3_8B), "no-results", gpus=8, budget=2 * 10**12, target=QWEN3_8B)
        for files in ([PRODUCTION], [PRODUCTION, dspark])
    ]


def test_a_dspark_drafter_is_planned_at_its_measured_training_factor(family_plans):
    """drafter.family dspark trains at the factor measured against dflash on the same data (and stores the
    target's last hidden state too): the training hours are the dflash plan's over that factor."""
    plans = family_plans
    factor = RATES["train_dspark_factor"].value
    assert 0 < factor < 1
    assert plans[1]["stages"]["training"]["hours"] == pytest.approx(
        plans[0]["stages"]["training"]["hours"] / factor
    )


def test_a_dspark_drafter_s_evaluation_is_planned_at_its_measured_decoding_factor(family_plans):
    """Evaluation's two drafter decoders of a dspark run decode at the factor measured against dflash at
    equal acceptance; target-only and the n-gram decoder keep their rates."""
    plans = family_plans
    factor = RATES["eval_dspark_factor"].value
    assert 0 < factor < 1
    ev = [p["stages"]["evaluation"] for p in plans]
    assert "eval_dspark_factor" in ev[1]["rates"] and "eval_dspark_factor" not in ev[0]["rates"]
    only, spec = (ev[0]["rates"][k] for k in ("eval_target_only", "eval_speculative"))
    per_token = [1 / only + 3 / spec, 1 / only + 2 / (spec * factor) + 1 / spec]
    assert ev[1]["hours"] / ev[0]["hours"] == pytest.approx(per_token[1] / per_token[0])


def test_a_target_much_smaller_than_the_benchmarks_is_planned_with_its_hours_as_a_lower_bound():
    """Rates scaled by parameter count would have a 0.6B target decode 13.7x faster than Qwen3-8B: the plan
    says those hours are a lower bound; at the benchmarks' own shape it says nothing of the kind."""
    small = QWEN3_8B | {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "head_dim": 128,
        "tie_word_embeddings": True,
    }
    texts = {}
    for name, shapes in (("small", small), ("8b", QWEN3_8B)):
        p = plan(load([PRODUCTION], target=shapes), "no-results", gpus=8, budget=2 * 10**12, target=shapes)
        texts[name] = (p["scale"], render(p, "production.yaml"))
    assert texts["small"][0] > 10 and "ASSUMED: a target this much smaller" in texts["small"][1]
    assert texts["8b"][0] == pytest.approx(1) and "ASSUMED: a target this much smaller" not in texts["8b"][1]


def test_the_committed_production_plan_is_the_planner_s_output(tmp_path):
    """benchmarks/results/plan_production.json (whose figures docs/planning.md quotes) is what the planner
    gives today from the committed rates: rerun the command in docs/planning.md after a benchmark."""
    out = tmp_path / "plan.json"
    proc = plan_cli(
        "--configfile",
        PRODUCTION,
        "--target-config",
        "qwen3-8b",
        "--gpus",
        8,
        "--results",
        tmp_path / "none",
        "--json",
        out,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text()) == json.loads((RESULTS / "plan_production.json").read_text())
    assert (
        "--target-config qwen3-8b --gpus 8 --json benchmarks/results/plan_production.json"
        in (REPO / "docs" / "planning.md").read_text()
    )


# The planner's cost stays bounded: an absurd GPU count is refused in one line before any work, the
# recommendation tries a bounded set of splits, and stream mode's chunks are counted, not listed.


def bounded_plan_cli(*args, cwd, timeout=90):
    """The planner's command in a child of its own child: its exit status, output and peak memory (the
    planner's ru_maxrss, KiB); a planner still running after `timeout` s is killed and fails the test."""
    wrapper = (
        "import json, resource, subprocess, sys\n"
        f"p = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout={timeout})\n"
        "print(json.dumps({'rc': p.returncode, 'stdout': p.stdout, 'stderr': p.stderr,\n"
        "                  'maxrss_kib': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", wrapper, sys.executable, "-m", "flashdraft.plan", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout + 30,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]  # the wrapper's: the planner answered in time
    return json.loads(proc.stdout)


def test_an_absurd_gpu_count_is_one_line_naming_the_limit(tmp_path):
    out = bounded_plan_cli(
        "--configfile", PRODUCTION, "--target-config", "qwen3-8b", "--gpus", 10**9, cwd=tmp_path
    )
    from flashdraft.estimate import MAX_GPUS

    assert out["rc"] == 1 and not out["stdout"]
    (line,) = out["stderr"].strip().splitlines()
    assert "--gpus 1000000000" in line and f"{MAX_GPUS:,}" in line, line
    many = with_keys(tmp_path, PRODUCTION, gpus__target=10**9)  # the default --gpus: gpus.target
    out = bounded_plan_cli("--configfile", many, "--target-config", "qwen3-8b", cwd=tmp_path)
    assert out["rc"] == 1
    (line,) = out["stderr"].strip().splitlines()
    assert "gpus.target" in line and f"{MAX_GPUS:,}" in line, line
    # at the limit: a plan, its recommendation from a bounded set of splits
    out = bounded_plan_cli(
        "--configfile", PRODUCTION, "--target-config", "qwen3-8b", "--gpus", MAX_GPUS, cwd=tmp_path
    )
    assert out["rc"] == 0, out["stderr"]
    assert re.search(
        r"^recommended: hidden\.mode \w+, gpus\.target \d+, gpus\.drafter \d+: ", out["stdout"], re.M
    )
    assert len(re.findall(r"^\| stream \| \d+ \| \d+ \|", out["stdout"], re.M)) < 1000


def test_a_trillion_prompts_are_planned_in_bounded_memory(tmp_path):
    big = tmp_path / "trillion.yaml"
    big.write_text("prompts:\n  total: 1000000000000\n")
    out = bounded_plan_cli(
        "--configfile", PRODUCTION, big, "--target-config", "qwen3-8b", "--gpus", 8, cwd=tmp_path
    )
    assert out["rc"] == 0, out["stderr"]
    assert "training samples 1,000,000,000,000: prompts.total" in out["stdout"]
    assert re.search(r"^recommended: hidden\.mode stream, ", out["stdout"], re.M)
    assert out["maxrss_kib"] < 2**20, out["maxrss_kib"]  # under 1 GiB


def _old_chunk_sizes(total, train, full):
    """Every chunk's tokens, listed one by one (the planner's chunking before it counted them)."""
    epoch = [full] * (total // full) + ([total % full] if total % full else [])
    sizes, left = [], train
    while left > 0 and epoch:
        for size in epoch:
            sizes.append(int(min(size, left)))
            left -= sizes[-1]
            if left <= 0:
                break
    return sizes


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # production: 6 epochs of whole chunks and a remainder
        {"train__max_steps": 1000},  # cut mid-epoch
        {"train__max_steps": 50000, "train__epochs": 3},
        {"hidden__chunk_tokens": 49152 * 7, "train__epochs": 2},  # thousands of chunks: past the exact loop
        {"hidden__chunk_tokens": 49152 * 11, "train__max_steps": 40000},
        {"train__global_batch_tokens": 0, "hidden__chunk_tokens": 16384 * 60, "eval__shards": 0},
    ],
)
def test_stream_chunks_in_closed_form_are_the_chunk_by_chunk_plan(tmp_path, monkeypatch, overrides):
    from flashdraft import estimate
    from flashdraft.estimate import Run, chunk_sizes, stream_mode

    cfg = load(with_keys(tmp_path, PRODUCTION, **overrides), target=QWEN3_8B)
    run = Run(cfg, token_stats(cfg, tmp_path / "none"), QWEN3_8B, 1.0, 8)
    split = Split(5, 3)
    cap, _, sizes = chunk_sizes(run, split, 2 * 10**12)
    step = run.step_tokens(split)
    listed = _old_chunk_sizes(run.tok.total, run.train_tokens(split), max(cap // step, 1) * step)
    assert len(sizes) == len(listed) and list(sizes) == listed and sizes == tuple(listed)
    assert (sum(sizes), max(sizes), sizes[0], sizes[-1]) == (sum(listed), max(listed), listed[0], listed[-1])
    plans = {}
    for name, exact in (("listed", 10**9), ("closed", 0)):
        monkeypatch.setattr(estimate, "EXACT_CHUNKS", exact)
        plans[name] = stream_mode(run, split, 2 * 10**12)
    a, b = plans["listed"], plans["closed"]
    assert a.hours == pytest.approx(b.hours, rel=1e-9)
    assert a.wall_hours == pytest.approx(b.wall_hours, rel=1e-9)
    assert (a.peak_disk, a.gpu_hours, a.chunks.per_epoch) == (b.peak_disk, b.gpu_hours, b.chunks.per_epoch)
    assert (a.chunks.precompute_s, a.chunks.train_s, a.chunks.startup_s) == pytest.approx(
        (b.chunks.precompute_s, b.chunks.train_s, b.chunks.startup_s)
    )


def test_the_pipeline_of_runs_of_equal_chunks_is_the_chunk_by_chunk_pipeline():
    import random

    from flashdraft.estimate import pipeline_seconds_runs

    rng = random.Random(0)
    for _ in range(300):
        segments = []
        for _ in range(rng.randint(1, 4)):
            pattern = tuple(
                (rng.uniform(0, 10), rng.uniform(0, 10), rng.randint(1, 40)) for _ in range(rng.randint(1, 3))
            )
            segments.append((pattern, rng.randint(1, 6)))
        pre, train = [], []
        for pattern, times in segments:
            for p, t, n in pattern * times:
                pre += [p] * n
                train += [t] * n
        assert pipeline_seconds_runs(segments) == pytest.approx(pipeline_seconds(pre, train), rel=1e-12)
    assert pipeline_seconds_runs([]) == pipeline_seconds([], []) == 0.0


@pytest.mark.parametrize(
    "overrides", [{}, {"hidden__dtype": "bfloat16"}, {"train__global_batch_tokens": 0, "eval__shards": 0}]
)
def test_the_recommendation_is_the_exhaustive_search_s(tmp_path, overrides):
    """Every split up to a few hundred GPUs, as before; past that, a grid refined around its best split
    (a bounded number of plans whatever the count): the same answer as trying every split."""
    from flashdraft.estimate import EXHAUSTIVE_GPUS, Run, recommend

    cfg = load(with_keys(tmp_path, PRODUCTION, **overrides), target=QWEN3_8B)
    tok = token_stats(cfg, tmp_path / "none")
    for n in (1, 2, 3, 5, 8, 13, 32, 64, EXHAUSTIVE_GPUS + 1, 700, 2500):
        run = Run(cfg, tok, QWEN3_8B, 1.0, n)
        for budget in (2 * 10**12, 20 * 10**12):
            answers = {}
            for name, targets in (("bounded", None), ("every", range(1, n))):
                try:
                    r = recommend(run, budget, "test", targets=targets)
                except UserError as e:  # one GPU and too little disk for store mode: nothing fits
                    answers[name] = str(e), None
                else:
                    answers[name] = (r.best.mode, r.best.split, r.best.wall_hours), r
            assert answers["bounded"][0] == answers["every"][0], (n, budget)
            bounded, every = answers["bounded"][1], answers["every"][1]
            if bounded is None:
                continue
            if n <= 64:  # every split, as listed before
                assert [(m.mode, m.split) for m in bounded.candidates] == [
                    (m.mode, m.split) for m in every.candidates
                ]
                assert bounded.refused == every.refused
            else:
                assert len(bounded.candidates) + len(bounded.refused) < 600
