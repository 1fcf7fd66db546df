import json
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from flashdraft import plan as P
from flashdraft.config import Config, DrafterConfig, HiddenConfig, TargetConfig, ToyConfig
from flashdraft.errors import UserError
from flashdraft.hidden import FP8
from flashdraft.precompute import precompute_shard
from flashdraft.toy import build_toy_target, task_conversations

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PRODUCTION = REPO / "config" / "production.yaml"
EMBEDDED = REPO / "config" / "config.yaml"
QWEN3_8B = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False}


def lookup(data, dotted):
    for part in dotted.split("."):
        data = data[part]
    return data


def plan_cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "flashdraft.plan", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd)


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
    for name, rate in P.RATES.items():
        measured = lookup(json.loads((RESULTS / rate.file).read_text()), rate.key)
        assert rate.value == pytest.approx(measured, rel=1e-3), name
    for f in ("eval_decode_qwen3-8b.json", "train_drafter_qwen3-8b.json"):
        shapes = json.loads((RESULTS / f).read_text())["shapes"]["target"]
        assert {k: shapes[k] for k in P.REFERENCE_TARGET} == P.REFERENCE_TARGET, f
    assert P.num_parameters(QWEN3_8B) == pytest.approx(8.19e9, rel=0.01)  # Qwen3-8B's model card: 8.2B


def test_plan_on_production_on_one_node(qwen3_8b_dir, tmp_path):
    cfg = P.load(PRODUCTION)
    p = P.plan(cfg, qwen3_8b_dir / "results", gpus=8)
    tok = p["tokens"]
    assert p["scale"] == 1.0 and tok.samples == cfg.prompts.total
    assert tok.total == cfg.prompts.total * (P.ASSUMED_PROMPT_TOKENS + P.ASSUMED_ANSWER_TOKENS)  # assumed
    # 5 fused layers of H=4096: bf16 2 bytes a value, fp8 1 byte + a float32 scale; + int32 id, int8 mask
    width = 5 * 4096
    assert p["hidden_bytes"] == {"bfloat16": tok.total * (2 * width + 5), FP8: tok.total * (width + 4 + 5)}
    assert p["hidden_bytes"][FP8] == pytest.approx(p["hidden_bytes"]["bfloat16"] / 2, rel=1e-3)
    hours = {k: s["hours"] for k, s in p["stages"].items()}
    assert all(h > 0 for h in hours.values()) and p["total_hours"] == pytest.approx(sum(hours.values()))
    assert p["slowest"] == max(hours, key=hours.get)
    # precompute: tokens / (per-GPU rate x 8 GPUs), 40 shards in 5 waves
    rate = P.RATES[f"precompute_{cfg.hidden.dtype}"].value
    assert hours["precompute"] == pytest.approx(tok.total / (rate * 8) / 3600)

    # half the GPUs: twice the hours (40 and 8 shard jobs in whole waves; training on gpus.drafter)
    def on(gpus, drafter):
        # a global batch both 3 and 6 training processes can share (6 micro-batches of 16384 tokens)
        cfg = P.load(with_keys(tmp_path, PRODUCTION, gpus__drafter=drafter, eval__shards=8,
                               train__global_batch_tokens=6 * 16384))
        return P.plan(cfg, "results", gpus=gpus)

    half, full = on(4, 3), on(8, 6)
    for stage in ("regeneration", "precompute", "training", "evaluation"):
        assert half["stages"][stage]["hours"] == pytest.approx(2 * full["stages"][stage]["hours"]), stage
    # a target twice as deep: about twice the parameters, every rate scaled down by the ratio
    deep = dict(QWEN3_8B, num_hidden_layers=72)
    (qwen3_8b_dir / "models" / "Qwen3-8B" / "config.json").write_text(json.dumps(deep))
    bigger = P.plan(cfg, "results", gpus=8)
    ratio = P.num_parameters(deep) / P.num_parameters(QWEN3_8B)
    assert bigger["stages"]["regeneration"]["hours"] == pytest.approx(ratio * hours["regeneration"])


def test_plan_command_prints_the_table_and_the_goal(qwen3_8b_dir):
    proc = plan_cli("--configfile", PRODUCTION, "--gpus", 8, cwd=qwen3_8b_dir)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for stage in ("regeneration", "precompute", "training", "evaluation", "total"):
        assert re.search(rf"^\| {stage} \|.*\| [\d.]+ \|$", out, re.M), stage
    assert "ASSUMED" in out and "regenerate_qwen3-8b.json: tokens_per_s_per_gpu" in out
    assert re.search(r"36\.05 TB in bfloat16 \(40,965 bytes/token\), 18\.03 TB in float8_e4m3", out)
    goal = r"^goal \(whole DAG <= 36 h\): (met|NOT met), [\d.]+ h; .*: \w+ \([\d.]+ h\)$"
    assert re.search(goal, out, re.M)


def test_plan_on_the_embedded_default_reads_the_stages_already_run(tmp_path):
    cfg = P.load(EMBEDDED)
    p = P.plan(cfg, tmp_path / "results")  # nothing has run: the assumptions, and the CPU has no rate
    width = 2 * cfg.toy.hidden_size  # drafter.num_layers 2
    per_sample = min(P.ASSUMED_PROMPT_TOKENS + cfg.regenerate.max_new_tokens, cfg.hidden.max_length)
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
    p = P.plan(cfg, r, gpus=2)
    assert (p["tokens"].samples, p["tokens"].answer_tokens, p["tokens"].eval_prompts) == (300, 20.0, 9)
    assert p["tokens"].total == 300 * min(P.ASSUMED_PROMPT_TOKENS + 20, cfg.hidden.max_length)
    assert p["stages"]["precompute"]["hours"] > 0
    assert p["stages"]["training"]["hours"] is None  # gpus.drafter 0: on the CPU
    (r / "hidden").mkdir()
    for i in range(cfg.hidden.shards):
        (r / "hidden" / f"shard-{i:05d}.json").write_text(json.dumps({"tokens": 1000 + i}))
    assert P.plan(cfg, r)["tokens"].total == 2001

    proc = plan_cli("--configfile", EMBEDDED, "--results", tmp_path / "none")
    assert proc.returncode == 0, proc.stderr
    assert "| precompute |" in proc.stdout and "runs on the CPU" in proc.stdout


@pytest.mark.parametrize("text, expected", [
    ("eval:\n  shards: -1\n", "config key eval.shards: -1 is less than the minimum of 0"),
    ("hidden:\n  dtipe: bfloat16\n", "config key hidden: Additional properties are not allowed ('dtipe'"),
    ("target:\n  path: nowhere\n  build_toy: false\n", "config key target.path: cannot read nowhere/"),
    ("gpus: [1\n", "cannot read the config"),
])
def test_bad_config_is_one_line(tmp_path, text, expected):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    proc = plan_cli("--configfile", bad, cwd=tmp_path)
    assert proc.returncode == 1 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("plan: error: ") and expected in line, line


@pytest.mark.parametrize("dtype", ["bfloat16", FP8])
def test_precompute_preflight_refuses_with_the_plans_estimate(tmp_path, dtype):
    target = tmp_path / "target"
    build_toy_target(ToyConfig(steps=0, num_docs=200), str(target))
    convs = task_conversations(6, seed=1)
    pd.DataFrame({"id": [f"s{i}" for i in range(6)], "messages": convs}).to_parquet(tmp_path / "data.parquet")
    hidden, drafter = HiddenConfig(dtype=dtype, max_length=96, disk_margin=1e12), DrafterConfig(num_layers=2)
    with pytest.raises(UserError, match="not enough disk space") as e:
        out = tmp_path / "h" / "shard-00000.arrow"
        precompute_shard(target, "float32", tmp_path / "data.parquet", 0, 1, out, hidden, drafter)
    need, tokens = map(int, re.search(r"\((\d+) bytes: (\d+) tokens x", str(e.value)).groups())
    cfg = Config(target=TargetConfig(path=str(target)), hidden=hidden, drafter=drafter)
    width = P.hidden_width(cfg, P.target_shapes(cfg))
    assert need == int(P.hidden_disk(tokens, width)[dtype] * (1 + hidden.disk_margin))
    assert not out.exists()
