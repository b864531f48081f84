# The single-GPU deliverables: §1.1.4 profiling, §1.1.5 mixed precision, §1.1.6 memory, §1.2.1 attention,
# §1.3.1 torch.compile. The Transformer runs share e2e's batch size (and, for the bf16 and compile comparisons,
# its warm-up and step counts), so their timings compare with §1.1.3's.
PROFILE = R["profile"]
MIXED = R["mixed_precision"]
MEMORY = R["memory"]
ATTENTION_GRID = R["attention"]
COMPILE = R["compile"]
NAIVE_ATTENTION_CODE = code(
    "experiments/attention_benchmark.py", "bench/attention_timing.py", "accounting/attention_memory.py", "measure/cuda_memory.py"
)
# The e2e CLI as §1.1.5 (c) and §1.3.1 (b) run it: two variants of one size in the same job.
E2E_PAIR = ("python -m cs336_systems.experiments.e2e_benchmark --size {wildcards.size} "
            "--batch-size {params.batch_size} --context-lengths {params.contexts} --warmup {params.warmup} "
            "--steps {params.steps} --device {params.device}")


rule profile_model:
    message:
        "§1.1.4 profiler, size {wildcards.size} -> {output.csv}"
    input:
        code("experiments/profile_model.py", "measure/profiling.py", *MODEL_CODE),
    output:
        csv=report(f"{RESULTS}/profile/{{size}}.csv", caption="report/profile.rst", category="Results",
                   subcategory="1.1.4 Profiling"),
        json=f"{RESULTS}/profile/{{size}}.json",
        # Chrome traces (and the nsys report where nsys exists); large, ignored by git.
        traces=directory(f"{RESULTS}/traces/{{size}}"),
    params:
        model=model_dims(),
        contexts=listed(PROFILE["context_lengths"]),
        batch_size=E2E["batch_size"],
        warmup=PROFILE["warmup"],
        steps=PROFILE["steps"],
        device=R["device"],
        gpus_ok=lambda w: gpus_ok(GPU_JOB, f"{RESULTS}/profile/{w.size}.csv"),
    threads: NEEDS["heavy"].threads
    resources:
        **job("heavy", gpu=GPU_JOB),
    log:
        f"{RESULTS}/logs/profile/{{size}}.log",
    conda:
        ENV
    shell:
        "pin_gpus {resources.gpu}; "
        "python -m cs336_systems.experiments.profile_model --size {wildcards.size} --batch-size {params.batch_size} "
        "--context-lengths {params.contexts} --warmup {params.warmup} --steps {params.steps} "
        "--device {params.device} --nsys --trace-dir {output.traces} --out {output.csv} 2> {log}"


# A CPU-only toy (float accumulation), whatever the run's device.
rule mixed_precision_accumulation:
    message:
        "§1.1.5 mixed precision: accumulation -> {output.csv}"
    input:
        code("experiments/mixed_precision_benchmark.py", "bench/precision.py", "model/toy.py"),
    output:
        csv=report(f"{RESULTS}/mixed_precision/accumulation.csv", caption="report/mixed_precision.rst",
                   category="Results", subcategory="1.1.5 Mixed precision"),
        json=f"{RESULTS}/mixed_precision/accumulation.json",
    threads: NEEDS["light"].threads
    resources:
        **job("light", gpu=0),
    log:
        f"{RESULTS}/logs/mixed_precision/accumulation.log",
    conda:
        ENV
    shell:
        "python -m cs336_systems.experiments.mixed_precision_benchmark accumulation --out {output.csv} 2> {log}"


rule mixed_precision_autocast_dtypes:
    message:
        "§1.1.5 mixed precision: autocast dtypes -> {output.csv}"
    input:
        code("experiments/mixed_precision_benchmark.py", "bench/precision.py", "model/toy.py"),
    output:
        csv=report(f"{RESULTS}/mixed_precision/autocast_dtypes.csv", caption="report/mixed_precision.rst",
                   category="Results", subcategory="1.1.5 Mixed precision"),
        json=f"{RESULTS}/mixed_precision/autocast_dtypes.json",
    params:
        device=R["device"],
        gpus_ok=lambda w: gpus_ok(GPU_JOB, f"{RESULTS}/mixed_precision/autocast_dtypes.csv"),
    threads: NEEDS["model"].threads
    resources:
        **job("model", gpu=GPU_JOB),
    log:
        f"{RESULTS}/logs/mixed_precision/autocast_dtypes.log",
    conda:
        ENV
    shell:
        "pin_gpus {resources.gpu}; "
        "python -m cs336_systems.experiments.mixed_precision_benchmark autocast-dtypes --dtypes float16 bfloat16 "
        "--device {params.device} --out {output.csv} 2> {log}"


# §1.1.5 (c): fp32 and bf16 autocast of one size in the same job, so both run on the same machine and state.
rule mixed_precision_e2e:
    message:
        "§1.1.5 bf16 end to end, size {wildcards.size} -> {output.fp32}"
    input:
        code("experiments/e2e_benchmark.py", *MODEL_CODE),
    output:
        fp32=report(f"{RESULTS}/mixed_precision_e2e/{{size}}_fp32.csv", caption="report/mixed_precision.rst",
                    category="Results", subcategory="1.1.5 Mixed precision"),
        fp32_json=f"{RESULTS}/mixed_precision_e2e/{{size}}_fp32.json",
        bf16=report(f"{RESULTS}/mixed_precision_e2e/{{size}}_bf16.csv", caption="report/mixed_precision.rst",
                    category="Results", subcategory="1.1.5 Mixed precision"),
        bf16_json=f"{RESULTS}/mixed_precision_e2e/{{size}}_bf16.json",
    params:
        model=model_dims(),
        contexts=listed(MIXED["context_lengths"]),
        batch_size=E2E["batch_size"],
        warmup=E2E["warmup"],
        steps=E2E["steps"],
        device=R["device"],
        gpus_ok=lambda w: gpus_ok(GPU_JOB, f"{RESULTS}/mixed_precision_e2e/{w.size}_bf16.csv"),
    threads: NEEDS["model"].threads
    resources:
        **job("model", gpu=GPU_JOB),
    log:
        f"{RESULTS}/logs/mixed_precision_e2e/{{size}}.log",
    conda:
        ENV
    shell:
        "pin_gpus {resources.gpu}; "
        f"{E2E_PAIR} --modes forward forward_backward --autocast none --out {{output.fp32}} 2> {{log}} && "
        f"{E2E_PAIR} --modes forward forward_backward --autocast bf16 --out {{output.bf16}} 2>> {{log}}"


rule memory_profile:
    message:
        "§1.1.6 memory profile -> {output.peaks}"
    input:
        code("experiments/memory_profile.py", "measure/cuda_memory.py", *MODEL_CODE),
    output:
        peaks=report(f"{RESULTS}/memory/peaks.csv", caption="report/memory.rst", category="Results",
                     subcategory="1.1.6 Memory profiling"),
        peaks_json=f"{RESULTS}/memory/peaks.json",
        allocations=report(f"{RESULTS}/memory_allocations/largest.csv", caption="report/memory.rst",
                           category="Results", subcategory="1.1.6 Memory profiling"),
        allocations_json=f"{RESULTS}/memory_allocations/largest.json",
        # Snapshot pickles (large, ignored by git) and their timeline PNGs, which the writeup copies.
        snapshots=directory(f"{RESULTS}/memory_snapshots"),
    params:
        size=MEMORY["size"],
        model=model_dims(MEMORY["size"]),
        contexts=listed(MEMORY["context_lengths"]),
        batch_size=E2E["batch_size"],
        device=R["device"],
        gpus_ok=lambda w: gpus_ok(GPU_JOB, f"{RESULTS}/memory/peaks.csv"),
    threads: NEEDS["heavy"].threads
    resources:
        **job("heavy", gpu=GPU_JOB),
    log:
        f"{RESULTS}/logs/memory/{MEMORY['size']}.log",
    conda:
        ENV
    shell:
        "pin_gpus {resources.gpu}; "
        "python -m cs336_systems.experiments.memory_profile --size {params.size} --batch-size {params.batch_size} "
        "--context-lengths {params.contexts} --modes forward train_step --autocast none bf16 "
        "--device {params.device} --snapshot-dir {output.snapshots} --allocations-out {output.allocations} "
        "--out {output.peaks} 2> {log}"


# §1.2.1 and §1.3.1 (a): the eager and the compiled attention grid in one job.
rule attention_benchmark:
    message:
        "§1.2.1 PyTorch attention timing and memory -> {output.csv}"
    input:
        NAIVE_ATTENTION_CODE,
    output:
        csv=report(f"{RESULTS}/attention/naive.csv", caption="report/attention.rst", category="Results",
                   subcategory="1.2.1 PyTorch attention"),
        json=f"{RESULTS}/attention/naive.json",
    params:
        d_heads=listed(ATTENTION_GRID["d_heads"]),
        seq_lens=listed(ATTENTION_GRID["seq_lens"]),
        batch_size=ATTENTION_GRID["batch_size"],
        warmup=ATTENTION_GRID["warmup"],
        passes=ATTENTION_GRID["passes"],
        device=R["device"],
        gpus_ok=lambda w: gpus_ok(GPU_JOB, f"{RESULTS}/attention/naive.csv"),
    threads: NEEDS["heavy"].threads
    resources:
        **job("heavy", gpu=GPU_JOB),
    log:
        f"{RESULTS}/logs/attention/naive.log",
    conda:
        ENV
    shell:
        "pin_gpus {resources.gpu}; "
        "python -m cs336_systems.experiments.attention_benchmark --batch-size {params.batch_size} "
        "--head-dims {params.d_heads} --seq-lens {params.seq_lens} --warmup {params.warmup} "
        "--passes {params.passes} --variants eager compiled --device {params.device} --out {output.csv} 2> {log}"


# §1.3.1 (b): the Transformer eager and torch.compile'd, in the same job, with e2e's warm-up and steps. One job
# per size and context: the compiled graph is specialised to its input shape and compiling the largest sizes
# takes minutes, so each cell is its own job and a run cut short keeps the cells it finished.
rule compile_e2e:
    message:
        "§1.3.1 torch.compile'd model, size {wildcards.size}, context {wildcards.context} -> {output.eager}"
    input:
        code("experiments/e2e_benchmark.py", *MODEL_CODE),
    output:
        eager=report(f"{RESULTS}/compile/{{size}}_{{context}}_eager.csv", caption="report/compile.rst",
                     category="Results", subcategory="1.3.1 torch.compile"),
        eager_json=f"{RESULTS}/compile/{{size}}_{{context}}_eager.json",
        compiled=report(f"{RESULTS}/compile/{{size}}_{{context}}_compiled.csv", caption="report/compile.rst",
                        category="Results", subcategory="1.3.1 torch.compile"),
        compiled_json=f"{RESULTS}/compile/{{size}}_{{context}}_compiled.json",
    params:
        model=model_dims(),
        contexts=lambda w: w.context,
        batch_size=E2E["batch_size"],
        warmup=E2E["warmup"],
        steps=E2E["steps"],
        device=R["device"],
        gpus_ok=lambda w: gpus_ok(GPU_JOB, f"{RESULTS}/compile/{w.size}_{w.context}_compiled.csv"),
    threads: NEEDS["heavy"].threads
    resources:
        **job("heavy", gpu=GPU_JOB),
    log:
        f"{RESULTS}/logs/compile/{{size}}_{{context}}.log",
    conda:
        ENV
    shell:
        "pin_gpus {resources.gpu}; "
        f"{E2E_PAIR} --modes forward train_step --out {{output.eager}} 2> {{log}} && "
        f"{E2E_PAIR} --modes forward train_step --compile --out {{output.compiled}} 2>> {{log}}"


WRITEUP_INPUTS += expand(f"{RESULTS}/profile/{{size}}.csv", size=PROFILE["sizes"])
WRITEUP_INPUTS += [f"{RESULTS}/mixed_precision/accumulation.csv", f"{RESULTS}/mixed_precision/autocast_dtypes.csv"]
WRITEUP_INPUTS += expand(f"{RESULTS}/mixed_precision_e2e/{{size}}_{{precision}}.csv", size=MIXED["sizes"],
                         precision=["fp32", "bf16"])
WRITEUP_INPUTS += [f"{RESULTS}/memory/peaks.csv", f"{RESULTS}/memory_allocations/largest.csv",
                   f"{RESULTS}/memory_snapshots"]
WRITEUP_INPUTS += [f"{RESULTS}/attention/naive.csv"]
WRITEUP_INPUTS += expand(f"{RESULTS}/compile/{{size}}_{{context}}_{{variant}}.csv", size=COMPILE["sizes"],
                         context=COMPILE["context_lengths"], variant=["eager", "compiled"])
