rule hidden_shard:
    input:
        data=regenerated_for_hidden,
        target=target_dir(),
    output:
        arrow=f"{RESULTS}/hidden/shard-{{shard}}.arrow",
        manifest=f"{RESULTS}/hidden/shard-{{shard}}.json",
    wildcard_constraints:
        shard=r"\d{5}",
    params:
        cfg=section("hidden"),
        drafter=section("drafter", HIDDEN_DRAFTER_KEYS),
        target=section("target"),
        num_shards=CFG.hidden.shards,
        **last_hidden_params(),
        cmd=stage("hidden_shard.py", gpus=target_gpus(), flags=LAST_HIDDEN_FLAGS),
    resources:
        gpu=target_gpus(),
    conda:
        CONDA_ENV
    log:
        f"{LOGS}/hidden_shard/{{shard}}.log",
    benchmark:
        f"{BENCH}/hidden_shard/{{shard}}.tsv"
    shell:
        "{params.cmd} --cfg {params.cfg:q} --drafter-cfg {params.drafter:q}"
        " --target-cfg {params.target:q} --data {input.data:q}"
        " --shard {wildcards.shard} --num-shards {params.num_shards} --out {output.arrow:q} > {log:q} 2>&1"


rule hidden_verify:
    input:
        arrows=shard_files("arrow"),
        manifests=shard_files("json"),
    output:
        f"{RESULTS}/hidden/verify.json",
    params:
        cmd=stage("hidden_verify.py"),
    conda:
        CONDA_ENV
    log:
        f"{LOGS}/hidden_verify.log",
    benchmark:
        f"{BENCH}/hidden_verify.tsv"
    shell:
        "{params.cmd} --out {output:q} {input.arrows:q} > {log:q} 2>&1"
