import base64
import html
import json
import re
import shlex
import subprocess
import sys
from functools import partial
from pathlib import Path

import pandas as pd
from conftest import headless_dom

from flashdraft.evaluate import NO_MISMATCH, decoded_row, read_rows, write_outputs, write_rows
from flashdraft.report import build_report, serve_commands
from flashdraft.speculative import Decoded

REPO = Path(__file__).resolve().parents[1]
B = 4


def decoded(steps: list[tuple[int, int]], seconds: float, changed_at: int | None = None) -> Decoded:
    """A speculative decode as `speculative_decode` returns it: per verify step (tokens emitted, draft
    positions verified), the accepted drafts being all emitted tokens but the bonus. Its new tokens are the
    prefill's first and then the emitted ones: 0, 1, 2, ..., but for a different token at `changed_at`."""
    emitted = [e for e, _ in steps]
    tokens = list(range(1 + sum(emitted)))
    if changed_at is not None:
        tokens[changed_at] = -1
    return Decoded(tokens, emitted, [e - 1 for e in emitted], [v for _, v in steps], seconds)


def target_only(new_tokens: int, seconds: float) -> Decoded:
    """A target-only decode as `target_decode` returns it: one step per token after the first."""
    steps = new_tokens - 1
    return Decoded(list(range(new_tokens)), [1] * steps, [0] * steps, [0] * steps, seconds)


def eval_rows() -> list[dict]:
    """The evaluate stage's per-prompt rows (`evaluate.decoded_row`, as `evaluate.evaluate` builds them) for
    two greedy prompts: target-only, a lossless DFlash drafter, and an n-gram drafter whose output on prompt a
    leaves target-only's at new token 7, where the target's two choices are a numerical tie."""
    tie_at_7 = (7, 0.125, True)  # what evaluate.first_mismatch returns: position, logit gap, numerical tie
    rows = []
    for index, (pid, new_tokens, target_s, dflash, dflash_s, ngram, ngram_s, mismatch) in enumerate(
        [
            # a: 35 tokens after the first; DFlash in 10 steps (tau 3.5), n-gram in 28 (tau 1.25)
            (
                "a",
                36,
                0.35,
                [(4, 3)] * 5 + [(3, 3)] * 5,
                0.14,
                [(2, 3)] * 7 + [(1, 3)] * 7 + [(1, 0)] * 14,
                0.3,
                tie_at_7,
            ),
            # b: 11 tokens after the first; DFlash in 4 steps (tau 2.75), n-gram in 10 (tau 1.1)
            ("b", 12, 0.11, [(4, 3), (3, 3), (2, 3), (2, 3)], 0.044, [(2, 3)] + [(1, 0)] * 9, 0.1, None),
        ]
    ):
        rows.append(decoded_row(pid, "target_only", target_only(new_tokens, target_s), 20, True, index=index))
        rows.append(decoded_row(pid, "dflash", decoded(dflash, dflash_s), 20, True, index=index))
        ng = decoded(ngram, ngram_s, mismatch[0] if mismatch else None)
        rows.append(decoded_row(pid, "ngram", ng, 20, mismatch is None, mismatch or NO_MISMATCH, index=index))
    return rows


def write_inputs(root: Path) -> dict:
    """Small real input files in the formats the evaluate, train, prompts stages and Snakemake write."""
    # the evaluate stage writes a shard of rows per job; evaluate_merge joins them into per_prompt.parquet
    # and summary.json
    eval_dir, rows = root / "eval", eval_rows()
    shards = [eval_dir / "shards" / f"shard-{i:05d}.parquet" for i in range(2)]
    for i, shard in enumerate(shards):
        write_rows([r for r in rows if r["prompt_index"] == i], shard)
    write_outputs(read_rows(shards), B, eval_dir)
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
    (root / "export.json").write_text(
        json.dumps(
            {  # what training writes beside its metrics
                "export": "last",
                "last_step": 40,
                "best_step": None,
                "best_val_sim_tau": None,
                "step": 40,
                "why": "train.export: last",
                "run": "abc123",
                "commit": "1a2b3c4",
                "dirty": False,
            }
        )
    )
    drafter = root / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], "block_size": B}))
    return dict(
        eval_dir=eval_dir,
        metrics_csv=root / "metrics.csv",
        prompt_stats=root / "stats.json",
        benchmarks_dir=bench,
        drafter_dir=drafter,
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
            "--target",
            str(tmp_path / "my target"),
            "--drafter",
            str(inputs["drafter_dir"]),
            "--checkpoints",
            str(tmp_path / "checkpoints"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    doc = out.read_text()
    # what, where, next: the export, its run, and the commands that serve it (paths quoted for a shell)
    drafter, target = inputs["drafter_dir"].resolve(), (tmp_path / "my target").resolve()
    assert f"<td>drafter (the export)</td><td>{drafter}</td>" in doc
    run = tmp_path.resolve() / "checkpoints" / "abc123"
    assert f"<td>checkpoints and run.json (its config)</td><td>{run}</td>" in doc
    assert "<td>exported step</td><td>40 of 40 (last)</td>" in doc
    assert "<td>trained by commit</td><td>1a2b3c4</td>" in doc
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": B - 1}
    vllm = shlex.join(["vllm", "serve", str(target), "--speculative-config", json.dumps(spec)])
    assert html.escape(vllm) in doc
    assert html.escape(f"--speculative-algorithm DFLASH --speculative-draft-model-path {drafter}") in doc
    imgs = images(doc)
    assert set(imgs) == {"acceptance", "tau-hist", "train-loss", "train-acc", "stage-time"}
    for name, data in imgs.items():
        assert base64.b64decode(data).startswith(b"\x89PNG")
        assert (tmp_path / "plots" / f"{name}.png").read_bytes() == base64.b64decode(data)
    assert "http" not in doc  # self-contained: nothing loaded from elsewhere
    # headline numbers: tau, speedup, losslessness per drafter
    row = "<td>dflash</td><td>3.29</td><td>3.12</td><td>2</td><td>250.00</td><td>2.50</td><td>yes</td>"
    assert row in doc
    assert "<td>ngram</td><td>1.21</td><td>1.18</td>" in doc and "<td>NO</td>" in doc
    # losslessness in numbers: exact-match rate, differing outputs (numerical ties), where they diverged
    assert "<td>NO</td><td>0.5</td><td>1 (1)</td>" in doc
    assert "<td>ngram</td><td>a</td><td>7</td><td>0.125</td><td>yes</td>" in doc
    # tau per prompt, one column per drafter; a prompt is lossless only if every drafter was
    assert "<td>a</td><td>36</td><td>3.50</td><td>1.25</td><td>NO</td>" in doc
    assert "<td>b</td><td>12</td><td>2.75</td><td>1.10</td><td>yes</td>" in doc
    # prompt stats per source: reject total, then one column per reason (0 where a source has none)
    assert "<th>rejected: unparseable</th>" in doc
    assert "<td>sharegpt</td><td>200</td><td>190</td><td>3</td><td>2</td><td>1</td><td>7</td>" in doc
    assert "<td>alpaca</td><td>200</td><td>197</td><td>1</td><td>0</td><td>0</td><td>2</td>" in doc
    # the total row's rejects by reason are the sources' sums (the totals hold only their sum)
    total = [400, 387, 4, 2, 1, 9, 96, 4, 1]
    assert "<td>total</td>" + "".join(f"<td>{x}</td>" for x in total) in doc
    assert "<td>requested_train</td><td>96</td>" in doc and "smaller than total + eval_count" in doc
    # stage wall times, nested benchmark names kept, and their total
    assert "<td>hidden_shard/1</td><td>13.00</td>" in doc and "<td>train</td><td>421.75</td>" in doc
    assert "<td>total</td><td>448.25</td>" in doc
    # last training row
    assert "<td>40</td><td>0</td><td>1.25</td><td>0.65</td><td>2.60</td>" in doc


def test_report_shows_tau_at_every_temperature_and_the_expected_tau(tmp_path):
    """eval.temperatures [0, 1]: the headline table is T=0's, a table gives tau at each temperature, the
    per-prompt table a column per drafter and temperature (losslessness from the greedy rows alone); the
    validation table has expected_tau beside sim_tau."""
    inputs = write_inputs(tmp_path)
    rows = eval_rows()
    for index, (pid, new, dflash, ngram) in enumerate(
        [
            ("a", 36, [(2, 3)] * 10 + [(1, 3)] * 15, [(1, 0)] * 35),  # tau 1.4 and 1.0
            ("b", 12, [(2, 3)] * 5 + [(1, 3)], [(1, 0)] * 11),  # tau 11/6 and 1.0
        ]
    ):
        row = partial(decoded_row, pid, num_prompt_tokens=20, lossless=None, index=index, temperature=1.0)
        rows += [
            row("target_only", target_only(new, 0.01 * new)),
            row("dflash", decoded(dflash, 0.1)),
            row("ngram", decoded(ngram, 0.2)),
        ]
    summary = write_outputs(sorted(rows, key=lambda r: r["prompt_index"]), B, inputs["eval_dir"])
    assert summary["dflash"]["temperature"] == 0.0 and list(summary["dflash"]["by_temperature"]) == ["0", "1"]
    assert summary["dflash"]["tau_pooled"] == summary["dflash"]["by_temperature"]["0"]["tau_pooled"]
    assert summary["dflash"]["by_temperature"]["1"]["tau_pooled"] == 46 / 31
    metrics = pd.read_csv(inputs["metrics_csv"])
    metrics["expected_tau"] = [1.05, 1.3, 1.6, 1.9, 2.0]
    metrics["val_loss"], metrics["val_acc"] = [None, None, 2.5, None, 1.5], [None, None, 0.4, None, 0.5]
    metrics["val_sim_tau"] = [None, None, 1.8, None, 2.3]
    metrics["val_expected_tau"] = [None, None, 1.5, None, 1.75]
    metrics.to_csv(inputs["metrics_csv"], index=False)
    doc = build_report(tmp_path / "r.html", **inputs)
    assert "<p>Decoded at temperature 0:</p>" in doc
    assert "<td>dflash</td><td>3.29</td><td>3.12</td><td>2</td>" in doc  # the headline: T=0's, as before
    assert "<h3>tau by temperature</h3>" in doc and "<th>tau pooled T=1</th>" in doc
    assert "<td>dflash</td><td>3.29</td><td>3.12</td>" in doc.split("tau by temperature")[1]
    assert "<td>1.48</td><td>1.62</td>" in doc.split("tau by temperature")[1]  # dflash at T=1: 46/31, mean
    header = "<th>tau dflash T=0</th><th>tau ngram T=0</th><th>tau dflash T=1</th><th>tau ngram T=1</th>"
    assert header in doc
    assert "<td>a</td><td>36</td><td>3.50</td><td>1.25</td><td>1.40</td><td>1.00</td><td>NO</td>" in doc
    assert "<td>b</td><td>12</td><td>2.75</td><td>1.10</td><td>1.83</td><td>1.00</td><td>yes</td>" in doc
    assert "<th>val_sim_tau</th><th>val_expected_tau</th>" in doc and "<td>2.30</td><td>1.75</td>" in doc
    assert "<th>sim_tau</th><th>expected_tau</th>" in doc


def test_serve_commands_follow_the_family():
    """DFlash's anchor slot drafts nothing (B - 1 drafts per block), DSpark's does (B); each engine's name."""
    dflash = serve_commands("/t", "/d", {"architectures": ["DFlashDraftModel"], "block_size": 8})
    dspark = serve_commands("/t", "/d", {"architectures": ["Qwen3DSparkModel"], "block_size": 7})
    assert '"method": "dflash", "model": "/d", "num_speculative_tokens": 7' in dflash["vLLM"]
    assert '"method": "dspark", "model": "/d", "num_speculative_tokens": 7' in dspark["vLLM"]
    assert "--speculative-algorithm DSPARK" in dspark["SGLang"]


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
    build_report(out, **inputs, target=tmp_path / "target")
    # After the page loads, record each image's decoded width: 0 means the browser could not draw it.
    mark_widths = "for (const i of document.images) i.setAttribute('data-w', i.naturalWidth)"
    dom = headless_dom(out, tmp_path, mark_widths)
    widths = dict(re.findall(r'<img id="([\w-]+)" alt="[^"]+" src="[^"]+" data-w="(\d+)"', dom))
    assert set(widths) == {"acceptance", "tau-hist", "train-loss", "train-acc", "stage-time"}
    assert all(int(w) > 100 for w in widths.values()), widths
    assert "Drafter report" in dom


# What a hostile target path would make of Snakemake's report page, were it rendered as RST markup: a
# javascript: link, a raw HTML directive, an element with a handler. Each would set data-ran="yes".
RAN = "document.body.setAttribute('data-ran', 'y' + 'es')"
HOSTILE = [
    f"x`` `click <javascript:{RAN}>`_ ``y",
    f'x``\n\n.. raw:: html\n\n   <img src=x onerror="{RAN}">\n\n``y',
    f'x\u2028\u2028.. raw:: html\u2028\u2028   <img src=x onerror="{RAN}">',
    f'<img src=x onerror="{RAN}">',
]


def snakemake_workflow_description(config: dict) -> str:
    """workflow/report/workflow.rst as `snakemake --report` renders it (snakemake.report: Jinja with its
    settings, then docutils to an HTML body) into the page, where its script sets it as innerHTML."""
    from docutils.core import publish_parts
    from jinja2 import Environment

    class Snakemake:
        pass

    Snakemake.config = config
    text = (Path(__file__).parents[1] / "workflow" / "report" / "workflow.rst").read_text()
    rst = Environment(trim_blocks=True, lstrip_blocks=True).from_string(text).render(snakemake=Snakemake)
    return publish_parts(rst, writer_name="html")["html_body"]  # as snakemake.report calls it


def test_config_values_in_snakemake_s_report_run_no_script(tmp_path):
    """Hostile target paths and family names, rendered into the description of Snakemake's report and
    opened in headless Chromium with every link clicked: no script runs, and the value reads as text."""
    page = tmp_path / "page.html"
    descs = [
        snakemake_workflow_description({"target": {"path": p}, "drafter": {"family": p}}) for p in HOSTILE
    ]
    put = "".join(f"<div id='d{i}'></div>" for i in range(len(descs)))
    fill = "".join(
        f"document.getElementById('d{i}').innerHTML = {json.dumps(d)};" for i, d in enumerate(descs)
    )
    page.write_text(f"<!doctype html><html><body>{put}<script>{fill}</script></body></html>")
    dom = headless_dom(page, tmp_path, "for (const a of document.querySelectorAll('a')) a.click()")
    assert 'data-ran="yes"' not in dom
    assert dom.count("<img") == 0 and "javascript:" not in re.sub(r"<tt[^>]*>.*?</tt>", "", dom, flags=re.S)
    plain = snakemake_workflow_description({"target": {"path": "results/toy/target"}})
    assert (
        'A <tt class="docutils literal">dflash</tt> drafter trained for the target at '
        '<tt class="docutils literal">results/toy/target</tt>'
    ) in plain
