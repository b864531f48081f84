# §1.1.3 end-to-end benchmark: (b) every size x context x mode, (c) the warm-up study.
E2E = R["e2e"]
MODEL_CODE = code("model.py", "workload.py", "benchmarking.py", "provenance.py")


rule e2e_benchmark:
    input:
        code("experiments/e2e_benchmark.py") + MODEL_CODE,
    output:
        f"{RESULTS}/e2e/{{size}}.csv",
        f"{RESULTS}/e2e/{{size}}.json",
    params:
        model=lambda w: model_flags(w.size),
        contexts=listed(E2E["context_lengths"]),
        device=R["device"],
    resources:
        gpu=GPU_JOB,
    log:
        f"{RESULTS}/logs/e2e/{{size}}.log",
    shell:
        "{PY}.e2e_benchmark {params.model} --batch-size {E2E[batch_size]} --context-lengths {params.contexts} "
        "--warmup {E2E[warmup]} --steps {E2E[steps]} --device {params.device} --out {output[0]} 2> {log}"


rule e2e_warmup_study:
    input:
        code("experiments/e2e_benchmark.py") + MODEL_CODE,
    output:
        f"{RESULTS}/e2e_warmup/{{size}}_w{{warmup}}.csv",
        f"{RESULTS}/e2e_warmup/{{size}}_w{{warmup}}.json",
    params:
        model=lambda w: model_flags(w.size),
        device=R["device"],
    resources:
        gpu=GPU_JOB,
    log:
        f"{RESULTS}/logs/e2e_warmup/{{size}}_w{{warmup}}.log",
    shell:
        "{PY}.e2e_benchmark {params.model} --batch-size {E2E[batch_size]} "
        "--context-lengths {E2E[warmup_study][context_length]} --modes forward forward_backward "
        "--warmup {wildcards.warmup} --steps {E2E[warmup_study][steps]} --device {params.device} "
        "--out {output[0]} 2> {log}"


WRITEUP_INPUTS += expand(f"{RESULTS}/e2e/{{size}}.csv", size=E2E["sizes"])
WRITEUP_INPUTS += expand(f"{RESULTS}/e2e_warmup/{{size}}_w{{warmup}}.csv", size=E2E["warmup_study"]["sizes"],
                         warmup=E2E["warmup_study"]["warmups"])
