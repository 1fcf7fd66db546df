"""What the planner's estimate reads before it runs anything, beside the config (config_load.load): the
target's shapes (its config.json, a file given on the command line or a preset of flashdraft.shapes),
and the token statistics of what earlier stages left under results/ (`token_stats`), or the assumptions
where nothing has run yet."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .config import Config
from .errors import UserError
from .hf_config import read_target_config
from .shapes import PRESETS

# Where no earlier stage has run: chat prompts and answers of ShareGPT/UltraChat-like mixes.
ASSUMED_PROMPT_TOKENS = 250
ASSUMED_ANSWER_TOKENS = 550
PROMPT_SAMPLE = 1000  # prompts tokenized to measure the mean prompt length


def read_shapes(source: str) -> dict:
    """A target's config.json from a file, or a preset of flashdraft.shapes by name (qwen3-8b, toy)."""
    if Path(source).is_file():
        try:
            shapes = json.loads(Path(source).read_text())
        except ValueError as e:
            raise UserError(f"--target-config {source}: not a config.json ({e})") from e
        return checked_shapes(shapes, source)
    if source not in PRESETS:
        raise UserError(
            f"--target-config {source}: no such file, nor a preset of flashdraft.shapes "
            f"({', '.join(sorted(PRESETS))})"
        )
    return dict(PRESETS[source])


SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def checked_shapes(shapes, source: str) -> dict:
    """A config.json dict whose shapes the cost model reads are positive integers, or a UserError naming
    the first that is not."""
    if not isinstance(shapes, dict):
        raise UserError(f"--target-config {source}: holds {type(shapes).__name__}, not a config.json object")
    text = shapes.get("text_config", shapes) if "hidden_size" not in shapes else shapes
    for key in SHAPE_KEYS:
        value = text.get(key) if isinstance(text, dict) else None
        if type(value) is not int or value <= 0:
            raise UserError(
                f"--target-config {source}: {key} is {value!r}; a target's config.json gives it "
                "as a positive integer"
            )
    return shapes


def target_shapes(cfg: Config, given: dict | None = None) -> dict:
    """The target's config.json (`given`, else from target.path), or the toy's shapes when the workflow
    has not built it yet."""
    if given is not None:
        return given.get("text_config", given) if "hidden_size" not in given else given
    if (Path(cfg.target.path) / "config.json").exists() or not cfg.target.build_toy:
        c = read_target_config(cfg.target.path)
        return c.get("text_config", c) if "hidden_size" not in c else c
    t = cfg.toy
    return {
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_hidden_layers": t.num_layers,
        "num_attention_heads": t.num_heads,
        "num_key_value_heads": t.num_kv_heads,
        "head_dim": t.head_dim,
        "vocab_size": (t.vocab_size // 64 + 1) * 64,
        "tie_word_embeddings": False,
    }


@dataclass
class Tokens:
    """The token counts the cost model reads (`token_stats`), and where each came from."""

    samples: int  # training samples
    prompt_tokens: float  # mean per sample
    answer_tokens: float
    total: int  # tokens in the hidden states (each sample cut at hidden.max_length)
    eval_prompts: int
    notes: list[str]  # where each figure came from


def results_target(results: Path) -> tuple[str, Path] | None:
    """The target an earlier run under `results` used, and the file saying so: a hidden manifest's
    `target`, else a regeneration shard's meta.json (relative paths are the workflow's, beside results/)."""
    files = sorted((results / "hidden").glob("shard-*.json"))[:1]
    files += sorted((results / "regenerated" / "parts").glob("shard-*/meta.json"))[:1]
    for file in files:
        try:
            target = json.loads(file.read_text()).get("target")
        except (OSError, ValueError):
            continue
        if target:
            return target, file
    return None


def same_target(a: str, b: str, base: Path) -> bool:
    return (base / a).resolve() == (base / b).resolve()  # an absolute path stays itself


def token_stats(cfg: Config, results) -> Tokens:
    import pandas as pd

    r, notes = Path(results), []
    used = results_target(r)
    if used and not same_target(used[0], cfg.target.path, r.resolve().parent):
        notes.append(
            f"IGNORED {r}: it holds a run of another target ({used[0]}, in {used[1]}), not "
            f"target.path {cfg.target.path}; its token statistics are not used"
        )
        r = r / "(another target's)"  # nothing exists under it: every figure below is assumed
    stats_file = r / "prompts" / "stats.json"
    stats = json.loads(stats_file.read_text()) if stats_file.exists() else {}
    requested = stats.get("requested_train", cfg.prompts.total)
    if stats and requested != cfg.prompts.total:
        notes.append(
            f"IGNORED {stats_file}: made for prompts.total {requested:,}, the config asks for "
            f"{cfg.prompts.total:,}"
        )
        stats = {}
    if stats:
        totals = stats["totals"]
        samples, evals = int(totals["sampled_train"]), int(totals["sampled_eval"])
        notes.append(f"training samples {samples:,}, eval prompts {evals:,}: {stats_file}")
    else:
        samples, evals = cfg.prompts.total, cfg.prompts.eval_count
        notes.append(f"training samples {samples:,}: prompts.total (no {stats_file} yet)")
    train = r / "prompts" / "train.parquet"
    if train.exists() and (Path(cfg.target.path) / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        from .chat import prompt_ids

        tok = AutoTokenizer.from_pretrained(cfg.target.path)
        rows = pd.read_parquet(train, columns=["messages"]).head(PROMPT_SAMPLE)["messages"]
        prompt = sum(len(prompt_ids(tok, list(m))) for m in rows) / max(len(rows), 1)
        notes.append(f"prompt tokens {prompt:,.0f} per sample: the first {len(rows)} of {train}")
    else:
        prompt = ASSUMED_PROMPT_TOKENS
        notes.append(f"prompt tokens {prompt} per sample: ASSUMED (no {train} and target tokenizer yet)")
    answers = sorted((r / "regenerated" / "train").glob("shard-*.parquet"))
    if cfg.regenerate.enabled and answers:
        lengths = pd.concat([pd.read_parquet(f, columns=["response_tokens"]) for f in answers])
        answer = float(lengths["response_tokens"].mean())
        notes.append(f"answer tokens {answer:,.0f} per sample: {len(answers)} file(s) in {answers[0].parent}")
    else:
        answer = min(ASSUMED_ANSWER_TOKENS, cfg.regenerate.max_new_tokens)
        notes.append(
            f"answer tokens {answer} per sample: ASSUMED (no regenerated answers yet; "
            f"regenerate.max_new_tokens {cfg.regenerate.max_new_tokens})"
        )
    shards = range(cfg.hidden.shards)  # each manifest looked for in turn, up to the first missing one

    def manifest(i: int) -> Path:
        return r / "hidden" / f"shard-{i:05d}.json"

    if all(manifest(i).exists() for i in shards):
        total = sum(json.loads(manifest(i).read_text())["tokens"] for i in shards)
        notes.append(f"hidden-state tokens {total:,}: the {len(shards)} manifests in {manifest(0).parent}")
    else:
        total = int(samples * min(prompt + answer, cfg.hidden.max_length))
        notes.append(
            f"hidden-state tokens {total:,}: samples x min(prompt + answer, hidden.max_length "
            f"{cfg.hidden.max_length})"
        )
    return Tokens(samples, prompt, answer, total, min(cfg.eval.num_prompts, evals), notes)
