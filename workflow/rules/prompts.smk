rule prompts:
    input:
        [s.path for s in CFG.prompts.sources if s.format != "hf"],
        # its tokenizer and max_position_embeddings: a prompt it cannot take is rejected here
        target=target_dir(),
    output:
        train=f"{RESULTS}/prompts/train.parquet",
        eval=f"{RESULTS}/prompts/eval.parquet",
        rejects=f"{RESULTS}/prompts/rejects.parquet",
        stats=f"{RESULTS}/prompts/stats.json",
        stats_table=f"{RESULTS}/prompts/stats.parquet",
    params:
        cfg=section("prompts"),
        sources=source_digests,
        out_dir=parent("output"),
        cmd=stage("prompts.py"),
        # regeneration disabled: training uses the sources' own answers, so keep only rows that have one
        need_answers="" if CFG.regenerate.enabled else "--need-answers",
        # regeneration renders the prompts with thinking on: count them that way too
        thinking="--thinking" if CFG.regenerate.enabled and CFG.regenerate.thinking else "",
    conda:
        CONDA_ENV
    log:
        f"{LOGS}/prompts.log",
    benchmark:
        f"{BENCH}/prompts.tsv"
    shell:
        "{params.cmd} --cfg {params.cfg:q} --out-dir {params.out_dir:q} --target {input.target:q}"
        " {params.need_answers} {params.thinking} > {log:q} 2>&1"
