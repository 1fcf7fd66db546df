"""One self-contained HTML report: what was trained and where it is, the commands that serve it, evaluation
table, training curves, acceptance plots, stage times, prompts.

Plots are matplotlib (Agg) PNGs inlined as base64, so the file can be mailed or archived alone. A missing
input leaves a note in its section instead of failing the report.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import shlex
from datetime import datetime, timezone
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CSS = """body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}.note{color:#a60}img{max-width:100%}
pre{background:#f6f6f6;padding:6px 8px;white-space:pre-wrap;word-break:break-all}"""


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1 else f"{v:,.2f}"
    return html.escape(str(v))


def table(header: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(v)}</td>" for v in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


def img(fig, element_id: str, alt: str) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    data = base64.b64encode(buf.getvalue()).decode()
    return f'<img id="{element_id}" alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


# ---------------------------------------------------------------------------------------------------------
# sections


def serve_commands(target: str, drafter: str, config: dict) -> dict[str, str]:
    """The command lines that serve `target` with the drafter export at `drafter` (its config.json's
    `config`), by engine: vLLM's speculative_config and SGLang's flags, as the family names itself there."""
    from .families import FAMILIES, family_name_of_export

    info = FAMILIES[family_name_of_export(config)]
    block = int(config["block_size"])
    spec = {"method": info.vllm_method, "model": drafter, "num_speculative_tokens": info.drafts(block)}
    sglang = [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        target,
        "--speculative-algorithm",
        info.sglang_algorithm,
        "--speculative-draft-model-path",
        drafter,
    ]
    return {
        "vLLM": shlex.join(["vllm", "serve", target, "--speculative-config", json.dumps(spec)]),
        "SGLang": shlex.join(sglang),
    }


def run_section(metrics_csv, target=None, drafter_dir=None, checkpoints=None) -> str:
    """What was trained, with which code, where its export is, and the commands that serve it."""
    from .io import code_version

    exported = export_info(Path(metrics_csv).parent / "export.json") or {}
    rows = [["target", str(Path(target).resolve()) if target else None]]
    if drafter_dir is not None:
        rows.append(["drafter (the export)", str(Path(drafter_dir).resolve())])
    run = exported.get("run")
    if run and checkpoints is not None:
        rows.append(["checkpoints and run.json (its config)", str((Path(checkpoints) / run).resolve())])
    if "step" in exported:
        step = f"{exported['step']} of {exported['last_step']} ({exported['export']})"
        rows.append(["exported step", step])
    for who, version in (("trained by commit", exported), ("report by commit", code_version())):
        if version.get("commit"):
            dirty = " with uncommitted changes" if version.get("dirty") else ""
            rows.append([who, version["commit"] + dirty])
    rows.append(["report written", datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")])
    out = "<h2>Run</h2>" + table(["what", "where"], rows)
    config = Path(drafter_dir) / "config.json" if drafter_dir is not None else None
    if target is None or config is None or not config.exists():
        return out + note("no drafter export to serve (the report was given no target or drafter)")
    cmds = serve_commands(
        str(Path(target).resolve()), str(Path(drafter_dir).resolve()), json.loads(config.read_text())
    )
    out += "<h2>Serve it</h2>"
    for engine, cmd in cmds.items():
        out += f"<p>{engine}:</p><pre>{html.escape(cmd)}</pre>"
    return out + note(
        'Engine versions that load each family\'s format: docs/outputs.md, "Serving the drafter".'
    )


def eval_section(eval_dir) -> str:
    path = Path(eval_dir) / "summary.json"
    if not path.exists():
        return "<h2>Evaluation</h2>" + note(f"no evaluation summary at {path}")
    summary = json.loads(path.read_text())
    base = summary.get("target_only", {}).get("tokens_per_s")
    drafters = {k: v for k, v in summary.items() if k != "target_only"}
    rows = [["target_only", 1.0, 1.0, None, base, 1.0, None, None, None]]
    rows += [
        [
            k,
            v.get("tau_pooled"),
            v.get("tau_prompt_mean"),
            v.get("prompts"),
            v.get("tokens_per_s"),
            v.get("speedup"),
            v.get("lossless_all"),
            v.get("exact_match_rate"),
            None if v.get("mismatches") is None else f"{v['mismatches']} ({v.get('numerical_ties')})",
        ]
        for k, v in drafters.items()
    ]
    header = [
        "drafter",
        "tau pooled",
        "tau mean of prompts",
        "prompts",
        "tokens/s",
        "speedup",
        "lossless",
        "exact match",
        "differing (numerical ties)",
    ]
    first = summary.get("target_only", {}).get("temperature")
    at = "" if first is None else f" at temperature {first:g}"
    out = f"<h2>Evaluation</h2><p>Decoded{at}:</p>" + table(header, rows)
    out += "<p>tau: tokens a target verify step emits (accepted drafts + the target's bonus token, cut at "
    out += "the stop token and at max_new_tokens). Pooled: all emitted tokens over all steps; mean of "
    out += "prompts: the mean of each prompt's tau (what the reference DFlash benchmark prints). Lossless: "
    out += "greedy output equals the target's own greedy output on every prompt; exact match: the fraction "
    out += "of prompts where it does (sampled outputs are not compared: '-'). A differing output is a "
    out += "numerical tie when, where it first leaves the target's, the target's two choices lie within a "
    out += "few ulps of its dtype of the top logit: a block verify and a one-token step rounded a near-tie "
    out += "differently, not a drafter bug.</p>"
    out += temperatures_table(summary)
    out += divergences_table(drafters)
    if not drafters:
        return out
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for k, v in drafters.items():
        acc = [math.nan if a is None else a for a in v.get("per_position_acceptance") or []]
        ax.plot(range(1, len(acc) + 1), acc, marker="o", label=k)
    ax.set(xlabel="draft position k", ylabel="P(accepted | verified, emittable)", ylim=(0, 1.02))
    ax.legend()
    out += "<h3>Acceptance per draft position</h3>"
    out += img(fig, "acceptance", "acceptance rate per draft position")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(drafters)
    for i, (k, v) in enumerate(drafters.items()):
        hist = v.get("tau_hist") or []
        total = max(sum(hist), 1)
        ax.bar(
            [t + 1 + (i - (len(drafters) - 1) / 2) * width for t in range(len(hist))],
            [h / total for h in hist],
            width=width,
            label=k,
        )
    ax.set(xlabel="tokens emitted by a verify step", ylabel="fraction of steps")
    ax.set_xticks(range(1, max(len(v.get("tau_hist") or []) for v in drafters.values()) + 1))
    ax.legend()
    return out + "<h3>tau per verify step</h3>" + img(fig, "tau-hist", "histogram of tau per verify step")


def temperatures_table(summary: dict) -> str:
    """tau and speedup per drafter at every evaluated temperature (eval.temperatures); empty for one."""
    temps = list(summary.get("target_only", {}).get("by_temperature", {}))
    if len(temps) < 2:
        return ""
    keys = {"tau_pooled": "tau pooled", "tau_prompt_mean": "tau mean of prompts", "speedup": "speedup"}
    rows = [
        [k, *(v["by_temperature"][t].get(m) for t in temps for m in keys)]
        for k, v in summary.items()
        if k != "target_only"
    ]
    header = ["drafter", *(f"{what} T={t}" for t in temps for what in keys.values())]
    return (
        "<h3>tau by temperature</h3>" + table(header, rows) + "<p>T=0: greedy; above: sampled from the "
        "target's softmax at T, drafts accepted by rejection sampling (the output keeps the target's "
        "distribution); the DSpark paper reports T=1.</p>"
    )


def divergences_table(drafters: dict) -> str:
    """Where each differing output first left the target's, folded away (empty when none differ)."""
    rows = [
        [k, d["id"], d["position"], d["logit_gap"], d["numerical_tie"]]
        for k, v in drafters.items()
        for d in v.get("divergences") or []
    ]
    if not rows:
        return ""
    header = ["drafter", "prompt", "first divergence (new token)", "target logit gap", "numerical tie"]
    return f"<details><summary>differing outputs ({len(rows)})</summary>{table(header, rows)}</details>"


def per_prompt_section(eval_dir) -> str:
    """tau per prompt and drafter (collapsed): shows whether a mean hides a few bad prompts."""
    import pandas as pd

    path = Path(eval_dir) / "per_prompt.parquet"
    if not path.exists():
        return note(f"no per-prompt results at {path}")
    import pyarrow.parquet as pq

    columns = ["id", "drafter", "tau", "new_tokens", "lossless"]
    has_t = "temperature" in pq.read_schema(path).names  # not in files written before eval.temperatures
    df = pd.read_parquet(path, columns=columns + ["temperature"] * has_t)
    if not has_t:
        df["temperature"] = 0.0
    temps = list(dict.fromkeys(df["temperature"]))
    first = df[df["temperature"] == temps[0]]
    # one column per drafter and temperature (named by T only when several were evaluated)
    df["column"] = df["drafter"] + ("" if len(temps) < 2 else " T=" + df["temperature"].map("{:g}".format))
    tau = df.pivot_table(index="id", columns="column", values="tau", sort=False)
    names = [c for c in tau.columns if not c.startswith("target_only")]
    greedy = df[(df["drafter"] != "target_only") & (df["temperature"] == 0)]
    lossless = greedy.groupby("id", sort=False)["lossless"].agg(
        lambda x: None if x.isna().any() else bool(x.all())
    )
    new = first[first["drafter"] == "target_only"].set_index("id")["new_tokens"]
    rows = [[i, new.get(i), *(tau.at[i, c] for c in names), lossless.get(i)] for i in tau.index]
    header = ["prompt", "new tokens", *(f"tau {c}" for c in names), "lossless (greedy)"]
    return f"<details><summary>tau per prompt ({len(rows)} prompts)</summary>{table(header, rows)}</details>"


def training_section(metrics_csv) -> str:
    import pandas as pd

    path = Path(metrics_csv)
    if not path.exists():
        return "<h2>Training</h2>" + note(f"no training metrics at {path}")
    df = pd.read_csv(path)
    if df.empty or "step" not in df:
        return "<h2>Training</h2>" + note(f"{path} has no rows")
    out = "<h2>Training</h2>"
    val = df.dropna(subset=["val_sim_tau"]) if "val_sim_tau" in df else df.iloc[:0]
    exported = export_info(path.parent / "export.json")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(df["step"], df["loss"], label="training")
    if len(val):
        ax.plot(val["step"], val["val_loss"], "o-", label="validation (held-out samples, fixed anchors)")
        ax.legend()
    positive = (df["loss"] > 0).all() and (val["val_loss"] > 0).all() if len(val) else (df["loss"] > 0).all()
    ax.set(xlabel="step", ylabel="loss", yscale="log" if positive else "linear")
    out += img(fig, "train-loss", "training loss per step")
    if len(val):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.plot(df["step"], df["sim_tau"], label="training")
        ax.plot(val["step"], val["val_sim_tau"], "o-", label="validation")
        if "val_expected_tau" in val:
            ax.plot(val["step"], val["val_expected_tau"], "s--", label="validation, expected_tau (T=1)")
        if exported:
            ax.axvline(exported["step"], color="k", ls=":", label=f"exported: step {exported['step']}")
        ax.set(xlabel="step", ylabel="simulated acceptance length")
        ax.legend()
        out += img(fig, "train-val-tau", "training and validation sim_tau (and expected_tau) per step")
    pos = [c for c in df.columns if c.startswith("acc_pos_")]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    if "acc" in df:
        ax.plot(df["step"], df["acc"], lw=2, color="k", label="acc (all positions)")
    shown = [pos[0], pos[len(pos) // 2], pos[-1]] if len(pos) > 3 else pos  # first, middle, last position
    for c in shown:
        ax.plot(df["step"], df[c], label=c.replace("acc_pos_", "position "))
    ax.set(xlabel="step", ylabel="draft accuracy", ylim=(0, 1.02))
    ax.legend()
    out += img(fig, "train-acc", "training accuracy per step")
    cols = [
        c
        for c in ["step", "epoch", "loss", "acc", "sim_tau", "expected_tau", "lr", "tokens_per_s"]
        if c in df
    ]
    last = [
        df[c].iloc[-1].item() for c in cols
    ]  # per column: a row of mixed dtypes would turn ints to floats
    out += "<h3>Last logged step</h3>" + table(cols, [last])
    if len(val):
        vcols = [c for c in ["step", "val_loss", "val_acc", "val_sim_tau", "val_expected_tau"] if c in val]
        out += "<h3>Validation</h3>" + table(vcols, [[r[c] for c in vcols] for _, r in val.iterrows()])
        out += (
            "<p>Both taus are teacher-forced, per anchored block of the held-out samples. sim_tau: the "
            "drafts the drafter's greedy picks get right up to the first miss, + the bonus token. "
            "expected_tau (DeepSpec's tau_probabilistic): the tokens a verify step emits on average when "
            "the drafter samples at T=1, 1 + the sum over draft positions of the product of the "
            "acceptance probabilities up to it, each 1 - the total variation distance between the "
            "drafter's and the target's distributions: dspark against the target's own distribution, "
            "dflash, whose hidden shards hold none, against the stored token (the drafter's probability "
            "of it).</p>"
        )
    if exported:
        out += note(f"Exported step {exported['step']} of {exported['last_step']}: {exported['why']}.")
    return out


def export_info(path: Path) -> dict | None:
    """Which step training exported and why (train.export), when training wrote it."""
    return json.loads(path.read_text()) if path.exists() else None


def benchmarks_section(benchmarks_dir) -> str:
    import pandas as pd

    files = sorted(Path(benchmarks_dir).rglob("*.tsv")) if Path(benchmarks_dir).is_dir() else []
    if not files:
        return "<h2>Stage wall time</h2>" + note(f"no benchmark files under {benchmarks_dir}")
    rows = []
    for f in files:
        df = pd.read_csv(f, sep="\t")
        if "s" not in df or df.empty:
            continue
        rss = df["max_rss"].mean() if "max_rss" in df else None
        rows.append([str(f.relative_to(benchmarks_dir).with_suffix("")), float(df["s"].mean()), rss])
    if not rows:
        return "<h2>Stage wall time</h2>" + note(f"no readable benchmark rows under {benchmarks_dir}")
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(rows) + 1))
    ax.barh([r[0] for r in rows][::-1], [r[1] for r in rows][::-1])
    ax.set(xlabel="wall time (s)")
    total = sum(r[1] for r in rows)
    return (
        "<h2>Stage wall time</h2>"
        + img(fig, "stage-time", "wall time per workflow job")
        + table(["job", "wall s", "max RSS MB"], rows + [["total", total, None]])
    )


def throughput_section(benchmarks_dir, hidden_dir=None, regenerated=None) -> str:
    """Work per second of the data stages: tokens/s per hidden-state shard, answers/s of regeneration."""
    import pandas as pd

    def seconds(job):
        f = Path(benchmarks_dir) / f"{job}.tsv"
        return float(pd.read_csv(f, sep="\t")["s"].mean()) if f.exists() else None

    rows = []
    for path in map(Path, regenerated or []):  # regenerated/train/shard-NNNNN.parquet
        if path.exists():
            import pyarrow.parquet as pq

            job = f"regenerate/{path.stem[6:]}"
            n, s = pq.read_metadata(path).num_rows, seconds(job)
            rows.append([job, f"{n} answers", s, n / s if s else None])
    for manifest in sorted(Path(hidden_dir).glob("shard-*.json")) if hidden_dir else []:
        tokens, s = json.loads(manifest.read_text())["tokens"], seconds(f"hidden_shard/{manifest.stem[6:]}")
        rows.append([f"hidden_shard/{manifest.stem[6:]}", f"{tokens} tokens", s, tokens / s if s else None])
    if not rows:
        return ""
    return "<h2>Throughput</h2>" + table(["job", "work", "wall s", "per s"], rows)


def _counts_row(st: dict) -> dict:
    """One table row from a source's counts; a nested count dict (rejected by reason) gives its total
    and one column per key."""
    row = {}
    for k, v in st.items():
        if isinstance(v, dict):
            row[k] = sum(x for x in v.values() if isinstance(x, (int, float)))
            row.update({f"{k}: {r}": x for r, x in v.items()})
        else:
            row[k] = v
    return row


def prompts_section(stats_json) -> str:
    """Per-source counts from prompts/stats.json ({sources: {name: counts}, totals: counts, ...})."""
    path = Path(stats_json)
    if not path.exists():
        return "<h2>Prompts</h2>" + note(f"no prompt statistics at {path}")
    stats = json.loads(path.read_text())
    stats = stats if isinstance(stats, dict) else {}
    sources = stats.get("sources") if isinstance(stats.get("sources"), dict) else {}
    rows = {k: _counts_row(v) for k, v in sources.items() if isinstance(v, dict)}
    if isinstance(stats.get("totals"), dict):
        total = _counts_row(stats["totals"])
        # a count the totals hold only as a sum (rejected) is summed per reason over the sources
        by_reason = {c for r in rows.values() for c in r if c not in total}
        rows["total"] = total | {c: sum(r.get(c, 0) for r in rows.values()) for c in sorted(by_reason)}
    out = "<h2>Prompts</h2>"
    if rows:
        cols = list(dict.fromkeys(c for r in rows.values() for c in r))
        # a reason one source never hit is a zero there, not a missing value
        out += table(["source", *cols], [[k, *(r.get(c, 0) for c in cols)] for k, r in rows.items()])
    else:
        out += note(f"{path} has no per-source statistics (no 'sources' section)")
    other = {k: v for k, v in stats.items() if k not in ("sources", "totals", "note")}
    if other:
        out += table(["setting", "value"], [[k, v] for k, v in other.items()])
    if stats.get("note"):
        out += note(str(stats["note"]))
    return out


def export_plots(doc: str, plots_dir) -> list[str]:
    """Write every plot embedded in the report as `<id>.png` (what `snakemake --report` shows)."""
    import re

    plots_dir = Path(plots_dir)
    plots_dir.mkdir(parents=True, exist_ok=True)
    ids = []
    for m in re.finditer(r'<img id="([\w-]+)" alt="[^"]*" src="data:image/png;base64,([^"]+)">', doc):
        (plots_dir / f"{m[1]}.png").write_bytes(base64.b64decode(m[2]))
        ids.append(m[1])
    return ids


def build_report(
    out,
    eval_dir,
    metrics_csv,
    prompt_stats,
    benchmarks_dir,
    plots_dir=None,
    hidden_dir=None,
    regenerated=None,
    target=None,
    drafter_dir=None,
    checkpoints=None,
) -> str:
    """Write the report to `out` (atomically), its plots to `plots_dir` if given, and return its HTML."""
    from .io import atomic_path

    body = "".join(
        [
            run_section(metrics_csv, target, drafter_dir, checkpoints),
            eval_section(eval_dir),
            per_prompt_section(eval_dir),
            training_section(metrics_csv),
            prompts_section(prompt_stats),
            benchmarks_section(benchmarks_dir),
            throughput_section(benchmarks_dir, hidden_dir, regenerated),
        ]
    )
    doc = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>flashdraft report</title>"
        f"<style>{CSS}</style></head><body><h1>Drafter report</h1>{body}</body></html>\n"
    )
    with atomic_path(out) as tmp:
        tmp.write_text(doc)
    if plots_dir is not None:
        export_plots(doc, plots_dir)
    return doc
