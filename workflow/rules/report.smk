rule report:
    input:
        summary=f"{RESULTS}/eval/summary.json",
        metrics=f"{RESULTS}/train/metrics.csv",
        stats=f"{RESULTS}/prompts/stats.json",
        manifests=shard_files("json"),
        regenerated=regenerated(),
    output:
        html=report(f"{RESULTS}/report.html", caption="../report/report.rst", category="Summary"),
        plots=report(
            directory(f"{RESULTS}/report_plots"),
            patterns=["{name}.png"],
            caption="../report/plots.rst",
            category="Plots",
        ),
    params:
        eval_dir=parent("input"),
        bench_dir=BENCH,
        hidden_dir=parent("input", "manifests"),
        cmd=stage("report.py"),
    conda:
        CONDA_ENV
    log:
        f"{LOGS}/report.log",
    benchmark:
        f"{BENCH}/report.tsv"
    shell:
        "{params.cmd} --out {output.html} --plots-dir {output.plots} --eval-dir {params.eval_dir}"
        " --metrics {input.metrics} --prompt-stats {input.stats} --benchmarks-dir {params.bench_dir}"
        " --hidden-dir {params.hidden_dir} --regenerated {input.regenerated:q}"
        " > {log} 2>&1"
