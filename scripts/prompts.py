"""Expand prompt sources into one cleaned, deduplicated, mixed prompt set (train.parquet, eval.parquet)."""

import argparse

from flashdraft.config import PromptsConfig, load_section
from flashdraft.errors import cli
from flashdraft.prompts import expand


@cli
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cfg", default="{}", help="JSON of the `prompts` config section")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument(
        "--need-answers",
        action="store_true",
        help="regeneration is disabled: keep only rows with an assistant answer, augment nothing",
    )
    ap.add_argument(
        "--target",
        default=None,
        help="the target's HF directory: reject prompts longer than its positions allow, in "
        "tokens of its tokenizer (leaving room for one answer token)",
    )
    ap.add_argument(
        "--thinking",
        action="store_true",
        help="regenerate.thinking: also count the prompt as rendered with thinking on",
    )
    args = ap.parse_args(argv)
    s = expand(
        load_section(PromptsConfig, args.cfg, "prompts"),
        args.out_dir,
        need_answers=args.need_answers,
        target=args.target,
        thinking=args.thinking,
    )
    t = s["totals"]
    if "target" in s:
        x = s["target"]
        print(
            f"prompts: {x['too_long']} longer than the target's positions (max_position_embeddings "
            f"{x['max_position_embeddings']}, in tokens of its tokenizer, one answer token left), rejected"
        )
    print(
        f"prompts: read {t['read']}, rejected {t['rejected']}, duplicates {t['duplicates']}, "
        f"near duplicates {t['near_duplicates']}, kept {t['kept']} -> train {t['sampled_train']} "
        f"({t['augmented']} augmented), eval {t['sampled_eval']} in {args.out_dir}"
        + (f" ({s['note']})" if "note" in s else "")
    )


if __name__ == "__main__":
    main()
