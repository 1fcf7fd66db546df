rule regenerate:
    input:
        prompts=f"{RESULTS}/prompts/train.parquet",
        target=target_dir(),
    output:
        f"{RESULTS}/regenerated/train/shard-{{shard}}.parquet",
    wildcard_constraints:
        shard=r"\d{5}",
    params:
        cfg=section("regenerate"),
        target=section("target"),
        num_shards=regenerate_shards(),
        errors=f"{RESULTS}/regenerated/errors/shard-{{shard}}.parquet",
        work_dir=f"{RESULTS}/regenerated/parts/shard-{{shard}}",  # survives a crash: not an output
        cmd=stage("regenerate.py", gpus=regenerate_gpus()),
    resources:
        gpu=regenerate_gpus(),
    conda:
        CONDA_ENV
    log:
        f"{LOGS}/regenerate/{{shard}}.log",
    benchmark:
        f"{BENCH}/regenerate/{{shard}}.tsv"
    shell:
        "{params.cmd} --cfg {params.cfg:q} --target-cfg {params.target:q}"
        " --prompts {input.prompts:q} --shard {wildcards.shard} --num-shards {params.num_shards}"
        " --out {output:q} --errors {params.errors:q} --work-dir {params.work_dir:q} > {log:q} 2>&1"
