rule report:
    input:
        summary=f"{RESULTS}/eval/summary.json",
        metrics=f"{RESULTS}/train/metrics.csv",
        export=f"{RESULTS}/train/export.json",
        drafter=f"{RESULTS}/drafter/config.json",
        target=target_dir(),
        stats=f"{RESULTS}/prompts/stats.json",
        manifests=hidden_manifests(),
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
        drafter_dir=parent("input", "drafter"),
        checkpoints=f"{RESULTS}/checkpoints",
        bench_dir=BENCH,
        hidden_dir=report_hidden_args(),
        cmd=stage("report.py"),
    conda:
        CONDA_ENV
    log:
        f"{LOGS}/report.log",
    benchmark:
        f"{BENCH}/report.tsv"
    shell:
        "{params.cmd} --out {output.html:q} --plots-dir {output.plots:q} --eval-dir {params.eval_dir:q}"
        " --metrics {input.metrics:q} --prompt-stats {input.stats:q} --benchmarks-dir {params.bench_dir:q}"
        " {params.hidden_dir:q} --regenerated {input.regenerated:q} --target {input.target:q}"
        " --drafter {params.drafter_dir:q} --checkpoints {params.checkpoints:q}"
        " > {log:q} 2>&1"
