# §1.1.3 end-to-end benchmark: (b) every size x context x mode, (c) the warm-up study.
E2E = R["e2e"]


rule e2e_benchmark:
    message:
        "§1.1.3 end-to-end timing, size {wildcards.size} -> {output.csv}"
    input:
        code("experiments/e2e_benchmark.py", *MODEL_CODE),
    output:
        csv=report(f"{RESULTS}/e2e/{{size}}.csv", caption="report/e2e.rst", category="Results",
                   subcategory="1.1.3 End-to-end"),
        json=f"{RESULTS}/e2e/{{size}}.json",
    params:
        model=model_dims(),
        contexts=listed(E2E["context_lengths"]),
        batch_size=E2E["batch_size"],
        warmup=E2E["warmup"],
        steps=E2E["steps"],
        device=R["device"],
        gpus_ok=lambda w: gpus_ok(GPU_JOB, f"{RESULTS}/e2e/{w.size}.csv"),
    threads: NEEDS["model"].threads
    resources:
        **job("model", gpu=GPU_JOB),
    log:
        f"{RESULTS}/logs/e2e/{{size}}.log",
    conda:
        ENV
    shell:
        "pin_gpus {resources.gpu}; "
        "python -m cs336_systems.experiments.e2e_benchmark --size {wildcards.size} --batch-size {params.batch_size} "
        "--context-lengths {params.contexts} --warmup {params.warmup} --steps {params.steps} "
        "--device {params.device} --out {output.csv} 2> {log}"


rule e2e_warmup_study:
    message:
        "§1.1.3 warm-up study, size {wildcards.size}, {wildcards.warmup} warm-up steps -> {output.csv}"
    input:
        code("experiments/e2e_benchmark.py", *MODEL_CODE),
    output:
        csv=report(f"{RESULTS}/e2e_warmup/{{size}}_w{{warmup}}.csv", caption="report/e2e_warmup.rst",
                   category="Results", subcategory="1.1.3 End-to-end"),
        json=f"{RESULTS}/e2e_warmup/{{size}}_w{{warmup}}.json",
    params:
        model=model_dims(),
        batch_size=E2E["batch_size"],
        context_length=E2E["warmup_study"]["context_length"],
        steps=E2E["warmup_study"]["steps"],
        device=R["device"],
        gpus_ok=lambda w: gpus_ok(GPU_JOB, f"{RESULTS}/e2e_warmup/{w.size}_w{w.warmup}.csv"),
    threads: NEEDS["model"].threads
    resources:
        **job("model", gpu=GPU_JOB),
    log:
        f"{RESULTS}/logs/e2e_warmup/{{size}}_w{{warmup}}.log",
    conda:
        ENV
    shell:
        "pin_gpus {resources.gpu}; "
        "python -m cs336_systems.experiments.e2e_benchmark --size {wildcards.size} --batch-size {params.batch_size} "
        "--context-lengths {params.context_length} --modes forward forward_backward --warmup {wildcards.warmup} "
        "--steps {params.steps} --device {params.device} --out {output.csv} 2> {log}"


WRITEUP_INPUTS += expand(f"{RESULTS}/e2e/{{size}}.csv", size=E2E["sizes"])
WRITEUP_INPUTS += expand(f"{RESULTS}/e2e_warmup/{{size}}_w{{warmup}}.csv", size=E2E["warmup_study"]["sizes"],
                         warmup=E2E["warmup_study"]["warmups"])
