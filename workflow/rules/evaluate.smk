rule evaluate:
    input:
        prompts=f"{RESULTS}/prompts/eval.parquet",
        drafter=f"{RESULTS}/drafter/config.json",
        target=target_dir(),
    output:
        per_prompt=f"{RESULTS}/eval/per_prompt.parquet",
        summary=f"{RESULTS}/eval/summary.json",
    params:
        cfg=section("eval"),
        dtype=CFG.target.dtype,
        drafter_dir=parent("input", "drafter"),
        out_dir=parent("output"),
        cmd=stage("evaluate.py", gpus=target_gpus()),
    resources:
        gpu=target_gpus(),
    conda:
        CONDA_ENV
    log:
        f"{LOGS}/evaluate.log",
    benchmark:
        f"{BENCH}/evaluate.tsv"
    shell:
        "{params.cmd} --cfg {params.cfg:q} --target {input.target:q}"
        " --dtype {params.dtype} --drafter {params.drafter_dir:q} --prompts {input.prompts:q}"
        " --out-dir {params.out_dir:q} > {log:q} 2>&1"
