# 2026 §9: the leaderboard's training step, one job per stack of the run's `train_step` (the plain model, the
# PyTorch-native stack, ours and ours with one PyTorch piece put back), each at every depth listed, with the
# per-layer fit and its extrapolation to the leaderboard's 34 layers.
TRAIN_STEP = R["train_step"]
TRAIN_STEP_CSV = f"{RESULTS}/train_step/{{stack}}.csv"


# The library code every train_step job runs; each job adds its own CLI.
TRAIN_STEP_LIBRARY = ("training/stacks.py", "training/workload.py", "kernels/fused_cross_entropy.py", "kernels/fused_adamw.py",
                      "kernels/rope.py", *FLASH_KERNEL_CODE,
                      "model/checkpointing.py", "model/transformer.py", "measure/profiling.py")
TRAIN_STEP_CODE = code("experiments/train_step_benchmark.py", "bench/stack_timing.py", "measure/gpu_telemetry.py",
                       *TRAIN_STEP_LIBRARY)
# The model every train_step job runs, sharded or not: its dimensions, and its LM head's tokens per chunk by head
# (so that a sharded step and the one-GPU fits it is compared with run the same head).
HEAD_CHUNKS = TRAIN_STEP.get("head_chunks", {})
TRAIN_STEP_MODEL = " ".join(
    [f"--{key.replace('_', '-')} {TRAIN_STEP[key]}" for key in
     ("d_model", "d_ff", "num_heads", "vocab_size", "context_length", "batch_size")]
    + ([f"--head-chunk {' '.join(f'{head}={tokens}' for head, tokens in HEAD_CHUNKS.items())}"] if HEAD_CHUNKS else []))
COMPONENTS = TRAIN_STEP["components"]
COMPONENTS_CSV = f"{RESULTS}/train_step_components/components.csv"


rule train_step:
    message:
        "2026 §9 leaderboard step, stack {wildcards.stack}, by depth -> {output.csv}"
    input:
        TRAIN_STEP_CODE,
    output:
        csv=report(TRAIN_STEP_CSV, caption="report/train_step.rst", category="Results",
                   subcategory="9 The leaderboard's training step"),
        json=f"{RESULTS}/train_step/{{stack}}.json",
    wildcard_constraints:
        stack="|".join(TRAIN_STEP["stacks"]),
    params:
        dims=TRAIN_STEP_MODEL,
        num_layers=listed(TRAIN_STEP["num_layers"]),
        dtype=TRAIN_STEP["dtype"],
        options=train_step_options(TRAIN_STEP, TRAIN_STEP["compile"]),
        device=R["device"],
        gpus_ok=lambda w: gpus_ok(GPU_JOB, TRAIN_STEP_CSV.format(**w)),
    threads: NEEDS["heavy"].threads
    resources:
        **job("heavy", gpu=GPU_JOB),
    log:
        f"{RESULTS}/logs/train_step/{{stack}}.log",
    conda:
        ENV
    shell:
        "pin_gpus {resources.gpu}; "
        "python -m cs336_systems.experiments.train_step_benchmark {params.dims} --num-layers {params.num_layers} "
        "--stacks {wildcards.stack} --dtype {params.dtype} {params.options} --device {params.device} "
        "--out {output.csv} 2> {log}"


# Where the time of one step goes, by component (attention, matmuls, head + loss, optimizer, the rest): one
# profiled step per stack at one depth.
rule train_step_components:
    message:
        "2026 §9 leaderboard step: time by component -> {output.csv}"
    input:
        TRAIN_STEP_CODE,
    output:
        csv=report(COMPONENTS_CSV, caption="report/train_step.rst", category="Results",
                   subcategory="9 The leaderboard's training step"),
        json=f"{RESULTS}/train_step_components/components.json",
    params:
        dims=TRAIN_STEP_MODEL,
        num_layers=COMPONENTS["num_layers"],
        stacks=listed(COMPONENTS["stacks"]),
        dtype=TRAIN_STEP["dtype"],
        options=train_step_options(TRAIN_STEP, TRAIN_STEP["compile"]),
        device=R["device"],
        gpus_ok=lambda w: gpus_ok(GPU_JOB, COMPONENTS_CSV),
    threads: NEEDS["heavy"].threads
    resources:
        **job("heavy", gpu=GPU_JOB),
    log:
        f"{RESULTS}/logs/train_step/components.log",
    conda:
        ENV
    shell:
        "pin_gpus {resources.gpu}; "
        "python -m cs336_systems.experiments.train_step_benchmark {params.dims} --num-layers {params.num_layers} "
        "--stacks {params.stacks} --dtype {params.dtype} {params.options} --components --device {params.device} "
        "--out {output.csv} 2> {log}"


# What one layer costs kernel by kernel: profiled steps per stack at each of two depths or more (the report takes
# each kernel's slope over depth); its component rows come along, as the components job's do.
KERNELS = TRAIN_STEP.get("kernels")
KERNELS_CSV = f"{RESULTS}/train_step_kernels/kernels.csv"
if KERNELS:

    use rule train_step_components as train_step_kernels with:
        message:
            "2026 §9 leaderboard step: time per kernel and layer -> {output.csv}"
        output:
            csv=report(KERNELS_CSV, caption="report/train_step.rst", category="Results",
                       subcategory="9 The leaderboard's training step"),
            json=f"{RESULTS}/train_step_kernels/kernels.json",
        params:
            dims=TRAIN_STEP_MODEL,
            num_layers=listed(KERNELS["num_layers"]),
            stacks=listed(KERNELS["stacks"]),
            dtype=TRAIN_STEP["dtype"],
            options=train_step_options(TRAIN_STEP, TRAIN_STEP["compile"]) + " --kernels",
            device=R["device"],
            gpus_ok=lambda w: gpus_ok(GPU_JOB, KERNELS_CSV),
        log:
            f"{RESULTS}/logs/train_step/kernels.log",

    WRITEUP_INPUTS.append(KERNELS_CSV)


# Does every stack train as the plain model does? A small model, the run's dtype against float32 (one job).
CHECK = TRAIN_STEP.get("check")
CHECK_CSV = f"{RESULTS}/train_step_check/check.csv"
if CHECK:

    rule train_step_check:
        message:
            "2026 §9 every stack trains as the plain model does -> {output.csv}"
        input:
            code("experiments/train_step_check.py", *TRAIN_STEP_LIBRARY),
        output:
            csv=report(CHECK_CSV, caption="report/train_step.rst", category="Results",
                       subcategory="9 The leaderboard's training step"),
            json=f"{RESULTS}/train_step_check/check.json",
        params:
            dims=" ".join(f"--{key.replace('_', '-')} {value}" for key, value in CHECK.items() if key != "stacks"),
            stacks=listed(CHECK["stacks"]),
            dtype=TRAIN_STEP["dtype"],
            compile="" if TRAIN_STEP["compile"] else "--no-compile",
            device=R["device"],
            gpus_ok=lambda w: gpus_ok(GPU_JOB, CHECK_CSV),
        threads: NEEDS["heavy"].threads
        resources:
            **job("heavy", gpu=GPU_JOB),
        log:
            f"{RESULTS}/logs/train_step/check.log",
        conda:
            ENV
        shell:
            "pin_gpus {resources.gpu}; "
            "python -m cs336_systems.experiments.train_step_check {params.dims} --stacks {params.stacks} "
            "--dtype {params.dtype} {params.compile} --device {params.device} --out {output.csv} 2> {log}"

    WRITEUP_INPUTS.append(CHECK_CSV)


# The spec's rule for the leaderboard's run: from an empty PyTorch/Triton cache, the whole run (build, compile,
# autotune, do_bench with the spec's warm-up and repetition) ends within 10 minutes. One job per stack, one depth,
# its own process and a new empty cache folder (`--cold-cache`).
COLD = TRAIN_STEP.get("cold")
COLD_CSV = f"{RESULTS}/train_step_cold/{{stack}}.csv"
if COLD:

    use rule train_step as train_step_cold with:
        message:
            "2026 §9 leaderboard step from empty compile caches, stack {wildcards.stack} -> {output.csv}"
        output:
            csv=report(COLD_CSV, caption="report/train_step.rst", category="Results",
                       subcategory="9 The leaderboard's training step"),
            json=f"{RESULTS}/train_step_cold/{{stack}}.json",
        wildcard_constraints:
            stack="|".join(COLD["stacks"]),
        params:
            dims=TRAIN_STEP_MODEL,
            num_layers=COLD["num_layers"],
            dtype=TRAIN_STEP["dtype"],
            options=train_step_options(COLD, TRAIN_STEP["compile"]) + " --cold-cache",
            device=R["device"],
            gpus_ok=lambda w: gpus_ok(GPU_JOB, COLD_CSV.format(**w)),
        log:
            f"{RESULTS}/logs/train_step/cold_{{stack}}.log",

    WRITEUP_INPUTS += expand(COLD_CSV, stack=COLD["stacks"])


# The leaderboard as the spec runs it: the sharded stacks (FSDP2's native stack, ours, the plain baseline under our
# FSDP) in one job of `sharded.world_size` ranks, one sequence of `batch_size` per rank, on the launch pattern of
# rules/distributed.smk (a machine with too few GPUs gets a `skipped` row).
SHARDED = TRAIN_STEP.get("sharded")
SHARDED_CSV = f"{RESULTS}/train_step_sharded/n{{world_size}}.csv"
if SHARDED:

    use rule launch_ranks as train_step_sharded with:
        message:
            "2026 §9 leaderboard step sharded over {params.nproc} ranks -> {output.csv}"
        input:
            TRAIN_STEP_CODE,
            code("parallel/fsdp.py", *DIST_CODE),
        output:
            csv=report(SHARDED_CSV, caption="report/train_step.rst", category="Results",
                       subcategory="9 The leaderboard's training step"),
            json=f"{RESULTS}/train_step_sharded/n{{world_size}}.json",
        wildcard_constraints:
            world_size=str(SHARDED["world_size"]),
        params:
            **launched(SHARDED["world_size"], DIST_BACKEND, SHARDED_CSV),
            cli=(f"cs336_systems.experiments.train_step_benchmark {TRAIN_STEP_MODEL} "
                 f"--num-layers {listed(SHARDED['num_layers'])} --stacks {listed(SHARDED['stacks'])} "
                 f"--dtype {TRAIN_STEP['dtype']} --warmup-steps {SHARDED['warmup_steps']} --steps {SHARDED['steps']}"
                 + ("" if TRAIN_STEP["compile"] else " --no-compile")),
        threads: rank_threads(SHARDED["world_size"])
        resources:
            **ranks(SHARDED["world_size"], DIST_BACKEND),
        log:
            f"{RESULTS}/logs/train_step/sharded_n{{world_size}}.log",

    WRITEUP_INPUTS.append(SHARDED_CSV.format(world_size=SHARDED["world_size"]))

    # The spec's 10-minute rule where the spec runs the leaderboard: per stack, its own launch from empty compile
    # caches at the first depth listed, timed by do_bench's budgets turned into step counts every rank shares.
    SHARDED_COLD = SHARDED.get("cold")
    SHARDED_COLD_CSV = f"{RESULTS}/train_step_sharded_cold/{{stack}}.csv"
    if SHARDED_COLD:

        use rule train_step_sharded as train_step_sharded_cold with:
            message:
                "2026 §9 leaderboard step from empty compile caches over {params.nproc} ranks, stack "
                "{wildcards.stack} -> {output.csv}"
            output:
                csv=report(SHARDED_COLD_CSV, caption="report/train_step.rst", category="Results",
                           subcategory="9 The leaderboard's training step"),
                json=f"{RESULTS}/train_step_sharded_cold/{{stack}}.json",
            wildcard_constraints:
                stack="|".join(SHARDED_COLD["stacks"]),
            params:
                **launched(SHARDED["world_size"], DIST_BACKEND, SHARDED_COLD_CSV),
                cli=lambda w: (f"cs336_systems.experiments.train_step_benchmark {TRAIN_STEP_MODEL} "
                               f"--num-layers {SHARDED['num_layers'][0]} --stacks {w.stack} --dtype {TRAIN_STEP['dtype']} "
                               f"--time-budgets --warmup-ms {SHARDED_COLD['warmup_ms']} --rep-ms {SHARDED_COLD['rep_ms']} "
                               "--cold-cache"
                               + ("" if TRAIN_STEP["compile"] else " --no-compile")),
            log:
                f"{RESULTS}/logs/train_step/sharded_cold_{{stack}}.log",

        WRITEUP_INPUTS += expand(SHARDED_COLD_CSV, stack=SHARDED_COLD["stacks"])


WRITEUP_INPUTS += [*expand(TRAIN_STEP_CSV, stack=TRAIN_STEP["stacks"]), COMPONENTS_CSV]
