# 2026 §3.2 activation checkpointing: (b) every policy of one size, one job per autocast setting (a run cut
# short keeps the settings it finished); (a) the depth study of a few policies on a smaller size.
CHECKPOINTING = R["checkpointing"]
CKPT_POLICIES, CKPT_DEPTHS = CHECKPOINTING["policies"], CHECKPOINTING["depths"]  # sizes: checked by config.smk
CHECKPOINTING_CODE = code("experiments/checkpointing_benchmark.py", "model/checkpointing.py",
                          "bench/checkpoint_memory.py", "measure/cuda_memory.py", *MODEL_CODE)
CHECKPOINTING_CLI = ("python -m cs336_systems.experiments.checkpointing_benchmark --size {params.size} "
                     "--batch-size {params.batch_size} --context-length {params.context_length} "
                     "--attention {params.attention} --warmup {params.warmup} --steps {params.steps} "
                     "--device {params.device}")


rule checkpointing_policies:
    message:
        "2026 §3.2 activation checkpointing: every policy, autocast {wildcards.autocast} -> {output.csv}"
    input:
        CHECKPOINTING_CODE,
    output:
        csv=report(f"{RESULTS}/checkpointing/{{autocast}}.csv", caption="report/checkpointing.rst",
                   category="Results", subcategory="3.2 Activation checkpointing"),
        json=f"{RESULTS}/checkpointing/{{autocast}}.json",
    wildcard_constraints:
        autocast="none|bf16|fp16",
    params:
        size=CKPT_POLICIES["size"],
        model=model_dims(CKPT_POLICIES["size"]),
        batch_size=CKPT_POLICIES["batch_size"],
        context_length=CKPT_POLICIES["context_length"],
        attention=CKPT_POLICIES["attention"],
        warmup=CKPT_POLICIES["warmup"],
        steps=CKPT_POLICIES["steps"],
        # every policy and K unless the run lists some (one fp32 cell of a 3B model takes half a minute on an H100)
        policies=f"--policies {listed(CKPT_POLICIES['policies'])}" if "policies" in CKPT_POLICIES else "",
        device=R["device"],
        gpus_ok=lambda w: gpus_ok(GPU_JOB, f"{RESULTS}/checkpointing/{w.autocast}.csv"),
    threads: NEEDS["heavy"].threads
    resources:
        **job("heavy", gpu=GPU_JOB),
    log:
        f"{RESULTS}/logs/checkpointing/{{autocast}}.log",
    conda:
        ENV
    shell:
        "pin_gpus {resources.gpu}; "
        f"{CHECKPOINTING_CLI} --autocast {{wildcards.autocast}} {{params.policies}} --skip-after-oom "
        "--out {output.csv} 2> {log}"


rule checkpointing_depths:
    message:
        "2026 §3.2 activation checkpointing: the depth study -> {output.csv}"
    input:
        CHECKPOINTING_CODE,
    output:
        csv=report(f"{RESULTS}/checkpointing_depths/depths.csv", caption="report/checkpointing.rst",
                   category="Results", subcategory="3.2 Activation checkpointing"),
        json=f"{RESULTS}/checkpointing_depths/depths.json",
    params:
        size=CKPT_DEPTHS["size"],
        model=model_dims(CKPT_DEPTHS["size"]),
        batch_size=CKPT_DEPTHS["batch_size"],
        context_length=CKPT_DEPTHS["context_length"],
        attention=CKPT_DEPTHS["attention"],
        warmup=CKPT_DEPTHS["warmup"],
        steps=CKPT_DEPTHS["steps"],
        autocast=CKPT_DEPTHS["autocast"],
        depths=listed(CKPT_DEPTHS["depths"]),
        policies=listed(CKPT_DEPTHS["policies"]),
        device=R["device"],
        gpus_ok=lambda w: gpus_ok(GPU_JOB, f"{RESULTS}/checkpointing_depths/depths.csv"),
    threads: NEEDS["heavy"].threads
    resources:
        **job("heavy", gpu=GPU_JOB),
    log:
        f"{RESULTS}/logs/checkpointing/depths.log",
    conda:
        ENV
    shell:
        "pin_gpus {resources.gpu}; "
        f"{CHECKPOINTING_CLI} --autocast {{params.autocast}} --depths {{params.depths}} "
        "--policies {params.policies} --out {output.csv} 2> {log}"


WRITEUP_INPUTS += expand(f"{RESULTS}/checkpointing/{{autocast}}.csv", autocast=CKPT_POLICIES["autocast"])
WRITEUP_INPUTS += [f"{RESULTS}/checkpointing_depths/depths.csv"]
