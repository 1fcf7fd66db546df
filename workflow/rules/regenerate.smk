rule regenerate:
    input:
        prompts=f"{RESULTS}/prompts/train.parquet",
        target=target_dir(),
    output:
        regenerated(),
    params:
        cfg=section("regenerate"),
        dtype=CFG.target.dtype,
        work_dir=f"{RESULTS}/regenerated/parts",  # committed parts survive a crash: not an output
        cmd=stage("regenerate.py", gpus=regenerate_gpus()),
    resources:
        gpu=regenerate_gpus(),
    conda:
        CONDA_ENV
    log:
        f"{LOGS}/regenerate.log",
    benchmark:
        f"{BENCH}/regenerate.tsv"
    shell:
        "{params.cmd} --cfg {params.cfg:q} --target {input.target}"
        " --dtype {params.dtype} --prompts {input.prompts} --out {output} --work-dir {params.work_dir}"
        " > {log} 2>&1"
