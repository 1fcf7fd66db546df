if CFG.target.build_toy:

    rule toy_target:
        output:
            directory(target_dir()),
        params:
            cfg=section("toy"),
            cmd=stage("toy_target.py"),
        conda:
            CONDA_ENV
        log:
            f"{LOGS}/toy_target.log",
        benchmark:
            f"{BENCH}/toy_target.tsv"
        threads: workflow.cores
        shell:
            "{params.cmd} --cfg {params.cfg:q} --out {output:q} > {log:q} 2>&1"

    rule toy_sources:
        output:
            f"{RESULTS}/toy/sources/sharegpt.jsonl",
            f"{RESULTS}/toy/sources/messages.parquet",
            f"{RESULTS}/toy/sources/alpaca.json",
        params:
            cfg=section("toy"),
            out_dir=parent("output"),
            cmd=stage("toy_sources.py"),
        conda:
            CONDA_ENV
        log:
            f"{LOGS}/toy_sources.log",
        benchmark:
            f"{BENCH}/toy_sources.tsv"
        shell:
            "{params.cmd} --cfg {params.cfg:q} --out-dir {params.out_dir:q} > {log:q} 2>&1"
