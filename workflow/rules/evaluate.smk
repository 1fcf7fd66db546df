rule evaluate:
    input:
        prompts=f"{RESULTS}/prompts/eval.parquet",
        drafter=f"{RESULTS}/drafter/config.json",
        target=target_dir(),
    output:
        f"{RESULTS}/eval/shards/shard-{{shard}}.parquet",
    wildcard_constraints:
        shard=r"\d{5}",
    params:
        cfg=section("eval"),
        target=section("target"),
        num_shards=eval_shards(),
        drafter_dir=parent("input", "drafter"),
        cmd=stage("evaluate.py", gpus=target_gpus()),
    resources:
        gpu=target_gpus(),
    conda:
        CONDA_ENV
    log:
        f"{LOGS}/evaluate/{{shard}}.log",
    benchmark:
        f"{BENCH}/evaluate/{{shard}}.tsv"
    shell:
        "{params.cmd} --cfg {params.cfg:q} --target-cfg {params.target:q}"
        " --drafter {params.drafter_dir:q} --prompts {input.prompts:q}"
        " --shard {wildcards.shard} --num-shards {params.num_shards} --out-rows {output:q} > {log:q} 2>&1"


rule evaluate_merge:
    input:
        shards=eval_shard_files(),
        drafter=f"{RESULTS}/drafter/config.json",
    output:
        per_prompt=f"{RESULTS}/eval/per_prompt.parquet",
        summary=f"{RESULTS}/eval/summary.json",
    params:
        drafter_dir=parent("input", "drafter"),
        out_dir=parent("output"),
        cmd=stage("evaluate_merge.py"),
    conda:
        CONDA_ENV
    log:
        f"{LOGS}/evaluate_merge.log",
    benchmark:
        f"{BENCH}/evaluate_merge.tsv"
    shell:
        "{params.cmd} --drafter {params.drafter_dir:q} --out-dir {params.out_dir:q} {input.shards:q}"
        " > {log:q} 2>&1"
