"""Write the self-contained HTML report: the run and how to serve its drafter, the evaluation, training
metrics, prompt stats and benchmarks."""

import argparse

from flashdraft.errors import cli
from flashdraft.report import build_report


@cli
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True, help="the HTML file to write")
    p.add_argument("--eval-dir", required=True, help="directory with summary.json (and per_prompt.parquet)")
    p.add_argument("--metrics", required=True, help="training metrics.csv")
    p.add_argument("--prompt-stats", required=True, help="prompts stats.json")
    p.add_argument("--benchmarks-dir", required=True, help="Snakemake benchmark TSV files")
    p.add_argument("--plots-dir", default=None, help="also write each plot as <id>.png here")
    p.add_argument("--hidden-dir", default=None, help="hidden-state shard manifests (for tokens/s)")
    p.add_argument("--regenerated", nargs="*", default=None, help="regenerated shards (answers/s)")
    p.add_argument("--target", default=None, help="the target's HF directory (the serve commands)")
    p.add_argument("--drafter", default=None, help="the drafter's export directory")
    p.add_argument("--checkpoints", default=None, help="the runs' checkpoint directories")
    a = p.parse_args(argv)
    build_report(
        a.out,
        a.eval_dir,
        a.metrics,
        a.prompt_stats,
        a.benchmarks_dir,
        a.plots_dir,
        a.hidden_dir,
        a.regenerated,
        a.target,
        a.drafter,
        a.checkpoints,
    )
    print(f"report: {a.out}")


if __name__ == "__main__":
    main()
