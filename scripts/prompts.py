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
    ap.add_argument("--need-answers", action="store_true",
                    help="regeneration is disabled: keep only rows with an assistant answer, augment nothing")
    args = ap.parse_args(argv)
    s = expand(load_section(PromptsConfig, args.cfg, "prompts"), args.out_dir, need_answers=args.need_answers)
    t = s["totals"]
    print(
        f"prompts: read {t['read']}, rejected {t['rejected']}, duplicates {t['duplicates']}, "
        f"near duplicates {t['near_duplicates']}, kept {t['kept']} -> train {t['sampled_train']} "
        f"({t['augmented']} augmented), eval {t['sampled_eval']} in {args.out_dir}"
        + (f" ({s['note']})" if "note" in s else "")
    )


if __name__ == "__main__":
    main()
