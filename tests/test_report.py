import base64
import json
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
from conftest import headless_dom

from flashdraft.report import build_report

REPO = Path(__file__).resolve().parents[1]
B = 4


def write_inputs(root: Path) -> dict:
    """Small real input files in the formats the evaluate, train, prompts stages and Snakemake write."""
    summary = {
        "target_only": {"tokens_per_s": 100.0},
        "dflash": {
            "tau_pooled": 3.21,
            "tau_prompt_mean": 3.14,
            "tau_hist": [1, 2, 3, 14],
            "per_position_acceptance": [0.95, 0.9, 0.7],
            "tokens_per_s": 250.0,
            "speedup": 2.5,
            "lossless_all": True,
            "prompts": 4,
        },
        "ngram": {
            "tau_pooled": 1.37,
            "tau_prompt_mean": 1.36,
            "tau_hist": [12, 3, 1, 0],
            "per_position_acceptance": [0.25, 0.06, 0.0],
            "tokens_per_s": 120.0,
            "speedup": 1.2,
            "lossless_all": False,
            "exact_match_rate": 0.75,
            "mismatches": 1,
            "numerical_ties": 1,
            "divergences": [{"id": "a", "position": 7, "numerical_tie": True, "logit_gap": 0.125}],
            "prompts": 4,
        },
    }
    (root / "eval").mkdir()
    (root / "eval" / "summary.json").write_text(json.dumps(summary))
    per_prompt = [
        ("a", "target_only", 1.0, 30, True),
        ("a", "dflash", 3.5, 30, True),
        ("a", "ngram", 1.25, 30, False),
        ("b", "target_only", 1.0, 12, True),
        ("b", "dflash", 2.75, 12, True),
        ("b", "ngram", 1.5, 12, True),
    ]
    cols = ["id", "drafter", "tau", "new_tokens", "lossless"]
    pd.DataFrame(per_prompt, columns=cols).to_parquet(root / "eval" / "per_prompt.parquet")
    steps = list(range(0, 50, 10))
    metrics = {
        "step": steps,
        "epoch": [0] * 5,
        "loss": [5.0, 3.0, 2.0, 1.5, 1.25],
        "acc": [0.1, 0.3, 0.5, 0.6, 0.65],
    }
    metrics.update({f"acc_pos_{k}": [0.2 / k, 0.4 / k, 0.6 / k, 0.7 / k, 0.8 / k] for k in range(1, B)})
    metrics.update({"sim_tau": [1.1, 1.5, 2.0, 2.4, 2.6], "lr": [1e-4] * 5, "tokens_per_s": [900.0] * 5})
    pd.DataFrame(metrics).to_csv(root / "metrics.csv", index=False)
    stats = {  # the structure prompts.expand writes
        "sources": {
            "sharegpt": {
                "read": 200,
                "kept": 190,
                "rejected": {"empty": 2, "unparseable": 1},
                "duplicates": 7,
                "sampled_train": 60,
                "sampled_eval": 2,
            },
            "alpaca": {
                "read": 200,
                "kept": 197,
                "rejected": {"not a string": 1},
                "duplicates": 2,
                "sampled_train": 36,
                "sampled_eval": 2,
            },
        },
        "totals": {
            "read": 400,
            "kept": 387,
            "duplicates": 9,
            "sampled_train": 96,
            "sampled_eval": 4,
            "rejected": 4,
        },
        "requested_train": 96,
        "requested_eval": 4,
        "pool": 387,
        "note": "pool of 387 unique prompts is smaller than total + eval_count",
    }
    (root / "stats.json").write_text(json.dumps(stats))
    bench = root / "benchmarks"
    (bench / "hidden_shard").mkdir(parents=True)
    header = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"
    for name, s in [("prompts", 1.5), ("train", 421.75), ("hidden_shard/0", 12.0), ("hidden_shard/1", 13.0)]:
        (bench / f"{name}.tsv").write_text(header + f"{s}\t0:00:01\t812.5\t900\t700\t710\t1\t2\t50\t{s}\n")
    return dict(
        eval_dir=root / "eval",
        metrics_csv=root / "metrics.csv",
        prompt_stats=root / "stats.json",
        benchmarks_dir=bench,
    )


def images(doc: str) -> dict[str, str]:
    return {
        m[0]: m[1]
        for m in re.findall(r'<img id="([\w-]+)" alt="[^"]+" src="data:image/png;base64,([^"]+)"', doc)
    }


def test_report_has_plots_tables_and_numbers(tmp_path):
    inputs = write_inputs(tmp_path)
    out = tmp_path / "report.html"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "report.py"),
            "--out",
            str(out),
            "--eval-dir",
            str(inputs["eval_dir"]),
            "--metrics",
            str(inputs["metrics_csv"]),
            "--prompt-stats",
            str(inputs["prompt_stats"]),
            "--benchmarks-dir",
            str(inputs["benchmarks_dir"]),
            "--plots-dir",
            str(tmp_path / "plots"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    doc = out.read_text()
    imgs = images(doc)
    assert set(imgs) == {"acceptance", "tau-hist", "train-loss", "train-acc", "stage-time"}
    for name, data in imgs.items():
        assert base64.b64decode(data).startswith(b"\x89PNG")
        assert (tmp_path / "plots" / f"{name}.png").read_bytes() == base64.b64decode(data)
    assert "http" not in doc  # self-contained: nothing loaded from elsewhere
    # headline numbers: tau, speedup, losslessness per drafter
    row = "<td>dflash</td><td>3.21</td><td>3.14</td><td>4</td><td>250.00</td><td>2.50</td><td>yes</td>"
    assert row in doc
    assert "<td>ngram</td><td>1.37</td><td>1.36</td>" in doc and "<td>NO</td>" in doc
    # losslessness in numbers: exact-match rate, differing outputs (numerical ties), where they diverged
    assert "<td>NO</td><td>0.75</td><td>1 (1)</td>" in doc
    assert "<td>ngram</td><td>a</td><td>7</td><td>0.125</td><td>yes</td>" in doc
    # tau per prompt, one column per drafter; a prompt is lossless only if every drafter was
    assert "<td>a</td><td>30</td><td>3.50</td><td>1.25</td><td>NO</td>" in doc
    assert "<td>b</td><td>12</td><td>2.75</td><td>1.50</td><td>yes</td>" in doc
    # prompt stats per source: reject total, then one column per reason (0 where a source has none)
    assert "<th>rejected: unparseable</th>" in doc
    assert "<td>sharegpt</td><td>200</td><td>190</td><td>3</td><td>2</td><td>1</td><td>7</td>" in doc
    assert "<td>alpaca</td><td>200</td><td>197</td><td>1</td><td>0</td><td>0</td><td>2</td>" in doc
    assert "<td>total</td><td>400</td><td>387</td><td>4</td>" in doc
    assert "<td>requested_train</td><td>96</td>" in doc and "smaller than total + eval_count" in doc
    # stage wall times, nested benchmark names kept, and their total
    assert "<td>hidden_shard/1</td><td>13.00</td>" in doc and "<td>train</td><td>421.75</td>" in doc
    assert "<td>total</td><td>448.25</td>" in doc
    # last training row
    assert "<td>40</td><td>0</td><td>1.25</td><td>0.65</td><td>2.60</td>" in doc


def test_report_notes_missing_inputs(tmp_path):
    inputs = write_inputs(tmp_path)
    (tmp_path / "metrics.csv").unlink()
    doc = build_report(
        tmp_path / "r.html",
        inputs["eval_dir"],
        tmp_path / "metrics.csv",
        tmp_path / "nope.json",
        tmp_path / "no_benchmarks",
    )
    assert set(images(doc)) == {"acceptance", "tau-hist"}
    assert (
        "no training metrics at" in doc and "no prompt statistics at" in doc and "no benchmark files" in doc
    )
    assert (tmp_path / "r.html").read_text() == doc


def test_report_renders_in_headless_chromium(tmp_path):
    inputs = write_inputs(tmp_path)
    out = tmp_path / "report.html"
    build_report(out, **inputs)
    # After the page loads, record each image's decoded width: 0 means the browser could not draw it.
    mark_widths = "for (const i of document.images) i.setAttribute('data-w', i.naturalWidth)"
    dom = headless_dom(out, tmp_path, mark_widths)
    widths = dict(re.findall(r'<img id="([\w-]+)" alt="[^"]+" src="[^"]+" data-w="(\d+)"', dom))
    assert set(widths) == {"acceptance", "tau-hist", "train-loss", "train-acc", "stage-time"}
    assert all(int(w) > 100 for w in widths.values()), widths
    assert "DFlash drafter report" in dom
