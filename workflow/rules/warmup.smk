rule warmup:
    input:
        manifests=hidden_manifests(),
        target=target_dir(),
        **init_from(),
    output:
        artifacts=f"{RESULTS}/compile_cache/artifacts.bin",
        inductor=f"{RESULTS}/compile_cache/inductor.tar",
        meta=f"{RESULTS}/compile_cache/meta.json",
    params:
        cfg=section("train", WARMUP_TRAIN_KEYS),
        drafter=section("drafter"),
        out_dir=parent("output"),
        arrows=warmup_shards(),
        world=train_world(),  # with train.parallel, whether training shards the drafter (then: nothing to do)
        cmd=stage("warmup.py", gpus=min(1, CFG.gpus.drafter)),
    resources:
        gpu=min(1, CFG.gpus.drafter),
    # One process compiles on its main thread (torch.compile is not thread-safe); `threads` is the
    # intra-op count training will use, which is part of Inductor's CPU cache keys.
    threads: 1 if CFG.gpus.drafter > 0 else train_threads()
    conda:
        CONDA_ENV
    log:
        f"{LOGS}/warmup.log",
    benchmark:
        f"{BENCH}/warmup.tsv"
    shell:
        "{params.cmd} --cfg {params.cfg:q} --drafter-cfg {params.drafter:q}"
        " --target {input.target:q} --out-dir {params.out_dir:q} --world {params.world} {params.arrows:q}"
        " > {log:q} 2>&1"
