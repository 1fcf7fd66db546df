# Stream mode (hidden.mode: stream): tokens -> data plan -> per chunk: hidden parts -> verify -> train.
# A chunk's hidden states are temp(): deleted once its training job has finished; the parts of chunk i
# wait for the training of chunk i - STREAM_RING, so at most STREAM_RING chunks are on disk at once.


rule hidden_tokens:
    input:
        data=regenerated_for_hidden,
        target=target_dir(),
    output:
        f"{RESULTS}/tokens/shard-{{shard}}.parquet",
    wildcard_constraints:
        shard=r"\d{5}",
    params:
        cfg=section("hidden"),
        num_shards=CFG.hidden.shards,
        cmd=stage("hidden_tokens.py"),
    conda:
        CONDA_ENV
    log:
        f"{LOGS}/hidden_tokens/{{shard}}.log",
    benchmark:
        f"{BENCH}/hidden_tokens/{{shard}}.tsv"
    shell:
        "{params.cmd} --cfg {params.cfg:q} --target {input.target:q} --data {input.data:q}"
        " --shard {wildcards.shard} --num-shards {params.num_shards} --out {output:q} > {log:q} 2>&1"


checkpoint data_plan:
    input:
        tokens=tokens_files(),
        target=target_dir(),
    output:
        directory(PLAN),
    params:
        hidden=section("hidden"),
        drafter=section("drafter", HIDDEN_DRAFTER_KEYS),
        train=section("train", PLAN_TRAIN_KEYS),
        world=train_world(),
        **last_hidden_params(),
        cmd=stage("data_plan.py", flags=LAST_HIDDEN_FLAGS),
    conda:
        CONDA_ENV
    log:
        f"{LOGS}/data_plan.log",
    benchmark:
        f"{BENCH}/data_plan.tsv"
    shell:
        "{params.cmd} --hidden-cfg {params.hidden:q} --drafter-cfg {params.drafter:q} --train-cfg {params.train:q}"
        " --world {params.world} --target {input.target:q} --out-dir {output:q} {input.tokens:q} > {log:q} 2>&1"


rule hidden_chunk:
    input:
        plan=PLAN,
        tokens=tokens_files(),
        target=target_dir(),
        ring=ring_wait,
    output:
        arrow=temp(f"{CHUNKS}/{{chunk}}/part-{{part}}.arrow"),
        manifest=temp(f"{CHUNKS}/{{chunk}}/part-{{part}}.json"),
    wildcard_constraints:
        chunk=CHUNK_RE,
        part=r"\d{5}",
    params:
        cfg=section("hidden"),
        drafter=section("drafter", HIDDEN_DRAFTER_KEYS),
        target=section("target"),
        epoch=lambda wc: int(wc.chunk[6:9]),
        chunk=lambda wc: int(wc.chunk[-5:]),
        parts=chunk_parts(),
        **last_hidden_params(),
        cmd=stage("hidden_chunk.py", gpus=target_gpus(), flags=LAST_HIDDEN_FLAGS),
    resources:
        gpu=target_gpus(),
    conda:
        CONDA_ENV
    log:
        f"{LOGS}/hidden_chunk/{{chunk}}/{{part}}.log",
    benchmark:
        f"{BENCH}/hidden_chunk/{{chunk}}/{{part}}.tsv"
    shell:
        "{params.cmd} --cfg {params.cfg:q} --drafter-cfg {params.drafter:q} --target-cfg {params.target:q}"
        " --plan {input.plan:q} --epoch {params.epoch} --chunk {params.chunk}"
        " --part {wildcards.part} --parts {params.parts} --out {output.arrow:q} > {log:q} 2>&1"


rule hidden_val:
    # train.val_samples: the plan's validation samples, one shard kept (not temp) through every chunk
    input:
        plan=PLAN,
        tokens=tokens_files(),
        target=target_dir(),
    output:
        arrow=VAL_SHARD,
        manifest=VAL_SHARD.replace(".arrow", ".json"),
    params:
        cfg=section("hidden"),
        drafter=section("drafter", HIDDEN_DRAFTER_KEYS),
        target=section("target"),
        **last_hidden_params(),
        cmd=stage("hidden_val.py", gpus=target_gpus(), flags=LAST_HIDDEN_FLAGS),
    resources:
        gpu=target_gpus(),
    conda:
        CONDA_ENV
    log:
        f"{LOGS}/hidden_val.log",
    benchmark:
        f"{BENCH}/hidden_val.tsv"
    shell:
        "{params.cmd} --cfg {params.cfg:q} --drafter-cfg {params.drafter:q} --target-cfg {params.target:q}"
        " --plan {input.plan:q} --out {output.arrow:q} > {log:q} 2>&1"


rule hidden_val_verify:
    # the validation shard against its manifest, as every chunk's parts (a bad one is moved aside)
    input:
        arrow=VAL_SHARD,
        manifest=VAL_SHARD.replace(".arrow", ".json"),
    output:
        VAL_VERIFIED,
    params:
        cmd=stage("hidden_verify.py"),
    conda:
        CONDA_ENV
    log:
        f"{LOGS}/hidden_val_verify.log",
    benchmark:
        f"{BENCH}/hidden_val_verify.tsv"
    shell:
        "{params.cmd} --out {output:q} {input.arrow:q} > {log:q} 2>&1"


rule hidden_chunk_verify:
    input:
        arrows=chunk_part_files("arrow"),
        manifests=chunk_part_files("json"),
    output:
        temp(f"{CHUNKS}/{{chunk}}/verify.json"),
    wildcard_constraints:
        chunk=CHUNK_RE,
    params:
        cmd=stage("hidden_verify.py"),
    conda:
        CONDA_ENV
    log:
        f"{LOGS}/hidden_chunk_verify/{{chunk}}.log",
    benchmark:
        f"{BENCH}/hidden_chunk_verify/{{chunk}}.tsv"
    shell:
        "{params.cmd} --out {output:q} {input.arrows:q} > {log:q} 2>&1"


rule train_chunk:
    input:
        arrows=chunk_part_files("arrow"),
        verified=f"{CHUNKS}/{{chunk}}/verify.json",
        previous=previous_chunk,
        plan=PLAN,
        cache=f"{RESULTS}/compile_cache/meta.json",
        target=target_dir(),
        **init_from(),
        **val_shard(),
    output:
        f"{RESULTS}/train/chunks/{{chunk}}.json",
    wildcard_constraints:
        chunk=CHUNK_RE,
    params:
        # A chunk reruns when what makes the run changes (a new run dir), not on the other train keys
        # (train.export: the export job alone reruns). The job gets both sections whole, untracked.
        run=run_config(),
        cfg=untracked(section("train")),
        drafter=untracked(section("drafter")),
        cache_dir=parent("input", "cache"),
        checkpoints=f"{RESULTS}/checkpoints",  # not an output: Snakemake never deletes it
        val=f"--val {shlex.quote(VAL_SHARD)}" if CFG.train.val_samples else "",
        cmd=stage("train.py", gpus=CFG.gpus.drafter, nproc=max(1, CFG.gpus.drafter),
                  nodes=CFG.gpus.drafter_nodes),
    resources:
        **train_resources(),
    threads: train_threads()
    priority: 1  # the chain is the critical path: it goes first when a chunk's parts and a training wait
    conda:
        CONDA_ENV
    log:
        f"{LOGS}/train_chunk/{{chunk}}.log",
    benchmark:
        f"{BENCH}/train_chunk/{{chunk}}.tsv"
    shell:
        "{params.cmd} --cfg {params.cfg:q} --drafter-cfg {params.drafter:q} --target {input.target:q}"
        " --compile-cache {params.cache_dir:q} --checkpoints {params.checkpoints:q} --plan {input.plan:q}"
        " --chunk {wildcards.chunk} --done {output:q} {params.val}"
        " {input.arrows:q} > {log:q} 2>&1"
