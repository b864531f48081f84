# The multi-process deliverables: §2.1.3 all-reduce benchmark, §2.2-2.3 DDP (correctness check, benchmarks and
# the overlap timeline), §2.4 communication accounting, §3 optimizer state sharding.
# Every multi-process job is the one launch pattern below (`use rule launch_ranks as ... with:`): it starts through
# cs336_systems.parallel.launch, which writes a `skipped` row ("needs N GPUs, found M") where an NCCL job has too few GPUs,
# so the pipeline completes and the writeup says what did not run; the `gpus_ok` param (rules/common.smk)
# reruns such a result once the GPUs are there.
ALLREDUCE = R["allreduce"]
DDP = R["ddp"]
SHARDING = R["sharding"]
ACCOUNTING = config["communication_accounting"]
# DDP and sharding run on NCCL (one GPU per process) on a GPU run, on gloo (CPU processes) on a CPU run.
DIST_BACKEND = "nccl" if R["device"] == "cuda" else "gloo"
DIST_CODE = ("parallel/distributed.py", "parallel/launch.py")
# What the DDP and sharding benchmarks share (gathering, rows) and what it builds on.
BENCHMARK_CODE = ("bench/data_parallel.py", "accounting/formulas.py", "parallel/partition.py", "parallel/ddp.py", *MODEL_CODE)
ALLREDUCE_CSV = f"{RESULTS}/allreduce/{{backend}}_n{{world_size}}.csv"
CHECK_CSV = f"{RESULTS}/naive_ddp/check.csv"
DDP_CSV = f"{RESULTS}/ddp/benchmark.csv"
TIMELINE_CSV = f"{RESULTS}/ddp_timeline/intervals.csv"
SHARDING_CSV = f"{RESULTS}/sharding/benchmark.csv"
DDP_REPORT = dict(caption="report/ddp.rst", category="Results",
                  subcategory="2.2–2.3 Distributed data parallel training")


# The launch pattern: no output of its own, so it never matches a target (nothing asks for its log, a placeholder).
# A rule derived from it gives its outputs (`csv` the table), log (replacing the placeholder), params (launched(...)
# and `cli`: the experiment module with its flags), threads (rank_threads(...)) and resources (ranks(...)); those helpers
# are in rules/common.smk.
rule launch_ranks:
    log:
        f"{RESULTS}/logs/launch_ranks.log",
    conda:
        ENV
    shell:
        "pin_gpus {params.gpus}; "
        "{params.launcher} --nproc {params.nproc} --backend {params.backend} --out {output.csv} "
        "{params.also} -- {params.cli} 2> {log}"


use rule launch_ranks as allreduce_benchmark with:
    message:
        "§2.1.3 all-reduce timing over {params.nproc} ranks ({params.backend}) -> {output.csv}"
    input:
        code("experiments/allreduce_benchmark.py", *DIST_CODE),
    output:
        csv=report(ALLREDUCE_CSV, caption="report/allreduce.rst", category="Results",
                   subcategory="2.1.3 All-reduce benchmark"),
        json=f"{RESULTS}/allreduce/{{backend}}_n{{world_size}}.json",
    wildcard_constraints:
        backend="gloo|nccl",
        world_size=r"\d+",
    params:
        **launched(lambda w: w.world_size, lambda w: w.backend, ALLREDUCE_CSV),
        cli=f"cs336_systems.experiments.allreduce_benchmark --sizes-mb {listed(ALLREDUCE['sizes_mb'])} "
            f"--warmup {ALLREDUCE['warmup']} --iters {ALLREDUCE['iters']}",
    threads: rank_threads(lambda w: w.world_size)
    resources:
        **ranks(lambda w: w.world_size, lambda w: w.backend),
    log:
        f"{RESULTS}/logs/allreduce/{{backend}}_n{{world_size}}.log",


use rule launch_ranks as naive_ddp_check with:
    message:
        "§2.2 naive DDP against single-process training -> {output.csv}"
    input:
        code("experiments/naive_ddp_check.py", "parallel/ddp.py", "model/toy.py", *DIST_CODE),
    output:
        csv=report(CHECK_CSV, **DDP_REPORT),
        json=f"{RESULTS}/naive_ddp/check.json",
    params:
        **launched(DDP["world_size"], DIST_BACKEND, CHECK_CSV),
        cli="cs336_systems.experiments.naive_ddp_check",
    threads: rank_threads(DDP["world_size"])
    resources:
        **ranks(DDP["world_size"], DIST_BACKEND),
    log:
        f"{RESULTS}/logs/naive_ddp/check.log",


# One job for every variant (ours, PyTorch's DDP at the same bucket sizes, one rank alone), so that all run on the
# same machine and state. The Chrome traces go to traces/ (ignored by git); the timeline of the last traced step
# per variant is the committed, plotted result (where the launcher skips, it gets the skipped row too).
use rule launch_ranks as ddp_benchmark with:
    message:
        "§2.2–2.3 DDP variants on {params.nproc} ranks -> {output.csv}"
    input:
        code("experiments/ddp_benchmark.py", "measure/timeline.py", *BENCHMARK_CODE, *DIST_CODE),
    output:
        csv=report(DDP_CSV, **DDP_REPORT),
        json=f"{RESULTS}/ddp/benchmark.json",
        timeline=report(TIMELINE_CSV, **DDP_REPORT),
        timeline_json=f"{RESULTS}/ddp_timeline/intervals.json",
    params:
        model=model_dims(DDP["size"]),
        **launched(DDP["world_size"], DIST_BACKEND, DDP_CSV, also=TIMELINE_CSV),
        cli=f"cs336_systems.experiments.ddp_benchmark --size {DDP['size']} --batch-size {DDP['batch_size']} "
            f"--context-length {DDP['context_length']} --bucket-sizes-mb {listed(DDP['bucket_sizes_mb'])} "
            f"--warmup {DDP['warmup']} --steps {DDP['steps']} --trace-steps {DDP['trace_steps']} "
            f"--trace-dir {RESULTS}/traces/ddp --timeline-out {TIMELINE_CSV}",
    threads: rank_threads(DDP["world_size"])
    resources:
        **ranks(DDP["world_size"], DIST_BACKEND),
    log:
        f"{RESULTS}/logs/ddp/benchmark.log",


use rule launch_ranks as sharding_benchmark with:
    message:
        "§3 optimizer state sharding on {params.nproc} ranks -> {output.csv}"
    input:
        code("experiments/sharding_benchmark.py", "parallel/sharded_optimizer.py", *BENCHMARK_CODE, *DIST_CODE),
    output:
        csv=report(SHARDING_CSV, caption="report/sharding.rst", category="Results",
                   subcategory="3 Optimizer state sharding"),
        json=f"{RESULTS}/sharding/benchmark.json",
    params:
        model=model_dims(SHARDING["size"]),
        **launched(SHARDING["world_size"], DIST_BACKEND, SHARDING_CSV),
        cli=f"cs336_systems.experiments.sharding_benchmark --size {SHARDING['size']} "
            f"--batch-size {SHARDING['batch_size']} --context-length {SHARDING['context_length']} "
            f"--warmup {SHARDING['warmup']} --steps {SHARDING['steps']}",
    threads: rank_threads(SHARDING["world_size"])
    resources:
        **ranks(SHARDING["world_size"], DIST_BACKEND),
    log:
        f"{RESULTS}/logs/sharding/benchmark.log",


rule communication_accounting:
    message:
        "§2.4 communication accounting (closed forms) -> {output.csv}"
    input:
        code("experiments/communication_accounting_analysis.py", "accounting/formulas.py", "parallel/partition.py"),
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
        "python -m cs336_systems.experiments.communication_accounting_analysis {params.flags} {params.mesh} "
        "--out {output.csv} 2> {log}"


WRITEUP_INPUTS += expand(ALLREDUCE_CSV, backend=ALLREDUCE["backends"], world_size=ALLREDUCE["world_sizes"])
WRITEUP_INPUTS += [CHECK_CSV, DDP_CSV, TIMELINE_CSV, SHARDING_CSV, f"{RESULTS}/communication_accounting/xxl.csv"]
