rule train:
    input:
        **train_data(),
        cache=f"{RESULTS}/compile_cache/meta.json",
        target=target_dir(),
        **init_from(),
    output:
        config=f"{RESULTS}/drafter/config.json",
        weights=f"{RESULTS}/drafter/model.safetensors",
        metrics=f"{RESULTS}/train/metrics.csv",
        export=f"{RESULTS}/train/export.json",  # which step was exported and why (train.export)
    params:
        cfg=section("train"),
        drafter=section("drafter"),
        cache_dir=parent("input", "cache"),
        drafter_dir=parent("output"),
        checkpoints=f"{RESULTS}/checkpoints",  # not an output: Snakemake never deletes it
        data=train_data_args,
        cmd=stage("train.py", gpus=CFG.gpus.drafter, nproc=max(1, CFG.gpus.drafter),
                  nodes=CFG.gpus.drafter_nodes),
    resources:
        **train_resources(),
    threads: train_threads()
    conda:
        CONDA_ENV
    log:
        f"{LOGS}/train.log",
    benchmark:
        f"{BENCH}/train.tsv"
    shell:
        "{params.cmd} --cfg {params.cfg:q}"
        " --drafter-cfg {params.drafter:q} --target {input.target:q} --compile-cache {params.cache_dir:q}"
        " --checkpoints {params.checkpoints:q} --metrics {output.metrics:q} --out {params.drafter_dir:q}"
        " {params.data} > {log:q} 2>&1"
