rule report:
    input:
        summary=f"{RESULTS}/eval/summary.json",
        metrics=f"{RESULTS}/train/metrics.csv",
        stats=f"{RESULTS}/prompts/stats.json",
    output:
        f"{RESULTS}/report.html",
    params:
        eval_dir=parent("input"),
        cmd=stage("report.py"),
        bench_dir=BENCH,
    conda:
        CONDA_ENV
    log:
        f"{LOGS}/report.log",
    benchmark:
        f"{BENCH}/report.tsv"
    shell:
        "{params.cmd} --out {output} --eval-dir {params.eval_dir} --metrics {input.metrics}"
        " --prompt-stats {input.stats} --benchmarks-dir {params.bench_dir} > {log} 2>&1"
