# The multi-process deliverables: §2.1.3 all-reduce benchmark, §2.2-2.3 DDP (correctness check, benchmarks and
# the overlap timeline), §2.4 communication accounting, §3 optimizer state sharding.
# Every multi-process job starts through cs336_systems.launch, which writes a `skipped` row ("needs N GPUs,
# found M") where an NCCL job has too few GPUs, so the pipeline completes and the writeup says what did not run;
# the `gpus_ok` param (rules/common.smk) reruns such a result once the GPUs are there.
ALLREDUCE = R["allreduce"]
DDP = R["ddp"]
SHARDING = R["sharding"]
ACCOUNTING = config["communication_accounting"]
# DDP and sharding run on NCCL (one GPU per process) on a GPU run, on gloo (CPU processes) on a CPU run.
DIST_BACKEND = "nccl" if R["device"] == "cuda" else "gloo"
DIST_CODE = code("distributed.py", "launch.py")
ALLREDUCE_CSV = f"{RESULTS}/allreduce/{{backend}}_n{{world_size}}.csv"
CHECK_CSV = f"{RESULTS}/naive_ddp/check.csv"
DDP_CSV = f"{RESULTS}/ddp/benchmark.csv"
SHARDING_CSV = f"{RESULTS}/sharding/benchmark.csv"
# Resources of a job with `nproc` ranks: NEEDS["rank"] per rank. Its `gpus` param is what pin_gpus must hold: the
# `gpu` resource says the same, but Snakemake lowers it to the profile's limit (`--resources gpu=1`), and an
# NCCL job alone on a 2-GPU box should still get both.
RANK = NEEDS["rank"]


rule allreduce_benchmark:
    input:
        code("experiments/allreduce_benchmark.py") + DIST_CODE,
    output:
        csv=report(ALLREDUCE_CSV, caption="report/allreduce.rst", category="Results",
                   subcategory="2.1.3 All-reduce benchmark"),
        json=f"{RESULTS}/allreduce/{{backend}}_n{{world_size}}.json",
    wildcard_constraints:
        backend="gloo|nccl",
        world_size=r"\d+",
    params:
        sizes=listed(ALLREDUCE["sizes_mb"]),
        warmup=ALLREDUCE["warmup"],
        iters=ALLREDUCE["iters"],
        gpus=lambda w: gpus_needed(w.backend, int(w.world_size)),
        gpus_ok=lambda w: gpus_ok(gpus_needed(w.backend, int(w.world_size)), ALLREDUCE_CSV.format(**w)),
    threads: lambda w: int(w.world_size) * RANK.threads
    resources:
        gpu=lambda w: gpus_needed(w.backend, int(w.world_size)),
        mem_mb=lambda w: int(w.world_size) * RANK.mem_mb,
        runtime=RANK.runtime,
    log:
        f"{RESULTS}/logs/allreduce/{{backend}}_n{{world_size}}.log",
    conda:
        ENV
    shell:
        "pin_gpus {params.gpus}; "
        "python -m cs336_systems.launch --nproc {wildcards.world_size} --backend {wildcards.backend} "
        "--out {output.csv} -- cs336_systems.experiments.allreduce_benchmark --sizes-mb {params.sizes} "
        "--warmup {params.warmup} --iters {params.iters} 2> {log}"


rule naive_ddp_check:
    input:
        code("experiments/naive_ddp_check.py", "ddp.py", "toy_model.py") + DIST_CODE,
    output:
        csv=report(CHECK_CSV, caption="report/ddp.rst", category="Results",
                   subcategory="2.2–2.3 Distributed data parallel training"),
        json=f"{RESULTS}/naive_ddp/check.json",
    params:
        nproc=DDP["world_size"],
        backend=DIST_BACKEND,
        gpus=gpus_needed(DIST_BACKEND, DDP["world_size"]),
        gpus_ok=lambda w: gpus_ok(gpus_needed(DIST_BACKEND, DDP["world_size"]), CHECK_CSV),
    threads: DDP["world_size"] * RANK.threads
    resources:
        gpu=gpus_needed(DIST_BACKEND, DDP["world_size"]),
        mem_mb=DDP["world_size"] * RANK.mem_mb,
        runtime=RANK.runtime,
    log:
        f"{RESULTS}/logs/naive_ddp/check.log",
    conda:
        ENV
    shell:
        "pin_gpus {params.gpus}; "
        "python -m cs336_systems.launch --nproc {params.nproc} --backend {params.backend} --out {output.csv} -- "
        "cs336_systems.experiments.naive_ddp_check 2> {log}"


# One job for every variant (ours, PyTorch's DDP at the same bucket sizes, one rank alone), so that all run on the
# same machine and state. The Chrome traces go to traces/ (ignored by git); the timeline of the last traced step
# per variant is the committed, plotted result. The launcher writes only --out when it skips, so the timeline then
# copies that skipped row.
rule ddp_benchmark:
    input:
        code("experiments/ddp_benchmark.py", "ddp.py", *MODEL_CODE) + DIST_CODE,
    output:
        csv=report(DDP_CSV, caption="report/ddp.rst", category="Results",
                   subcategory="2.2–2.3 Distributed data parallel training"),
        json=f"{RESULTS}/ddp/benchmark.json",
        timeline=report(f"{RESULTS}/ddp_timeline/intervals.csv", caption="report/ddp.rst", category="Results",
                        subcategory="2.2–2.3 Distributed data parallel training"),
        timeline_json=f"{RESULTS}/ddp_timeline/intervals.json",
    params:
        nproc=DDP["world_size"],
        backend=DIST_BACKEND,
        size=DDP["size"],
        batch_size=DDP["batch_size"],
        context_length=DDP["context_length"],
        buckets=listed(DDP["bucket_sizes_mb"]),
        warmup=DDP["warmup"],
        steps=DDP["steps"],
        trace_steps=DDP["trace_steps"],
        traces=f"{RESULTS}/traces/ddp",
        gpus=gpus_needed(DIST_BACKEND, DDP["world_size"]),
        gpus_ok=lambda w: gpus_ok(gpus_needed(DIST_BACKEND, DDP["world_size"]), DDP_CSV),
    threads: DDP["world_size"] * RANK.threads
    resources:
        gpu=gpus_needed(DIST_BACKEND, DDP["world_size"]),
        mem_mb=DDP["world_size"] * RANK.mem_mb,
        runtime=RANK.runtime,
    log:
        f"{RESULTS}/logs/ddp/benchmark.log",
    conda:
        ENV
    shell:
        "pin_gpus {params.gpus}; "
        "python -m cs336_systems.launch --nproc {params.nproc} --backend {params.backend} --out {output.csv} -- "
        "cs336_systems.experiments.ddp_benchmark --size {params.size} --batch-size {params.batch_size} "
        "--context-length {params.context_length} --bucket-sizes-mb {params.buckets} --warmup {params.warmup} "
        "--steps {params.steps} --trace-steps {params.trace_steps} --trace-dir {params.traces} "
        "--timeline-out {output.timeline} 2> {log}; "
        "[ -e {output.timeline} ] || {{ cp {output.csv} {output.timeline} && cp {output.json} {output.timeline_json}; }}"


rule sharding_benchmark:
    input:
        code("experiments/sharding_benchmark.py", "sharded_optimizer.py", "accounting.py", "ddp.py", *MODEL_CODE)
        + DIST_CODE,
    output:
        csv=report(SHARDING_CSV, caption="report/sharding.rst", category="Results",
                   subcategory="3 Optimizer state sharding"),
        json=f"{RESULTS}/sharding/benchmark.json",
    params:
        nproc=SHARDING["world_size"],
        backend=DIST_BACKEND,
        size=SHARDING["size"],
        batch_size=SHARDING["batch_size"],
        context_length=SHARDING["context_length"],
        warmup=SHARDING["warmup"],
        steps=SHARDING["steps"],
        gpus=gpus_needed(DIST_BACKEND, SHARDING["world_size"]),
        gpus_ok=lambda w: gpus_ok(gpus_needed(DIST_BACKEND, SHARDING["world_size"]), SHARDING_CSV),
    threads: SHARDING["world_size"] * RANK.threads
    resources:
        gpu=gpus_needed(DIST_BACKEND, SHARDING["world_size"]),
        mem_mb=SHARDING["world_size"] * RANK.mem_mb,
        runtime=RANK.runtime,
    log:
        f"{RESULTS}/logs/sharding/benchmark.log",
    conda:
        ENV
    shell:
        "pin_gpus {params.gpus}; "
        "python -m cs336_systems.launch --nproc {params.nproc} --backend {params.backend} --out {output.csv} -- "
        "cs336_systems.experiments.sharding_benchmark --size {params.size} --batch-size {params.batch_size} "
        "--context-length {params.context_length} --warmup {params.warmup} --steps {params.steps} 2> {log}"


rule communication_accounting:
    input:
        code("experiments/communication_accounting.py", "accounting.py"),
    output:
        csv=report(f"{RESULTS}/communication_accounting/xxl.csv", caption="report/communication_accounting.rst",
                   category="Results", subcategory="2.4 Communication accounting"),
        json=f"{RESULTS}/communication_accounting/xxl.json",
    params:
        flags=" ".join(
            f"--{key.replace('_', '-')} {ACCOUNTING[key]}"
            for key in ("d_model", "d_ff", "num_blocks", "batch_size", "seq_len", "h100_memory_gb",
                        "tpu_v5p_memory_gb", "ici_bandwidth_bytes_per_s", "flops_per_s")
        ),
        mesh="--x {X} --y {Y} --m-x {M_X} --m-y {M_Y}".format(**ACCOUNTING["mesh"]),
    threads: NEEDS["light"].threads
    resources:
        **job("light", gpu=0),
    log:
        f"{RESULTS}/logs/communication_accounting/xxl.log",
    conda:
        ENV
    shell:
        "python -m cs336_systems.experiments.communication_accounting {params.flags} {params.mesh} "
        "--out {output.csv} 2> {log}"


WRITEUP_INPUTS += expand(ALLREDUCE_CSV, backend=ALLREDUCE["backends"], world_size=ALLREDUCE["world_sizes"])
WRITEUP_INPUTS += [
    CHECK_CSV,
    DDP_CSV,
    f"{RESULTS}/ddp_timeline/intervals.csv",
    SHARDING_CSV,
    f"{RESULTS}/communication_accounting/xxl.csv",
]
