# The multi-process deliverables: §2.1.3 all-reduce benchmark, §2.2-2.3 DDP (correctness check, benchmarks and
# the overlap timeline), §2.4 communication accounting, §3 optimizer state sharding.
# Every multi-process job starts through cs336_systems.launch, which writes a `skipped` row ("needs N GPUs,
# found M") where an NCCL job has too few GPUs, so the pipeline completes and the writeup says what did not run.
import csv

ALLREDUCE = R["allreduce"]
DDP = R["ddp"]
SHARDING = R["sharding"]
ACCOUNTING = config["communication_accounting"]
# DDP and sharding run on NCCL (one GPU per process) on a GPU run, on gloo (CPU processes) on a CPU run.
DIST_BACKEND = "nccl" if R["device"] == "cuda" else "gloo"
DIST_CODE = code("distributed.py", "launch.py", "benchmarking.py", "provenance.py")
LAUNCH = "python -m cs336_systems.launch"
# The results each NCCL job's `gpus_ok` param inspects (a function of `output` would not be tracked).
ALLREDUCE_CSV = f"{RESULTS}/allreduce/{{backend}}_n{{world_size}}.csv"
CHECK_CSV = f"{RESULTS}/naive_ddp/check.csv"
DDP_CSV = f"{RESULTS}/ddp/benchmark.csv"
SHARDING_CSV = f"{RESULTS}/sharding/benchmark.csv"


def gpus_needed(backend, nproc):
    return nproc if backend == "nccl" else 0


def ran_before(csv_path):
    """Whether `csv_path` holds a result that was not skipped for lack of GPUs."""
    path = Path(csv_path)
    if not path.exists():
        return False
    with path.open(newline="") as rows:
        return not any(
            row.get("status") == "skipped" and row.get("reason", "").startswith("needs ")
            for row in csv.DictReader(rows)
        )


def gpus_ok(backend, nproc, csv_path):
    """A param that turns True once this machine has the GPUs an NCCL job needs, so a result skipped for lack of
    them reruns there; a result that did run stays True, so a smaller machine never replaces it by a skip."""
    return backend != "nccl" or min(gpu_count(), nproc) >= nproc or ran_before(csv_path)


rule allreduce_benchmark:
    input:
        code("experiments/allreduce_benchmark.py") + DIST_CODE,
    output:
        csv=ALLREDUCE_CSV,
        json=f"{RESULTS}/allreduce/{{backend}}_n{{world_size}}.json",
    wildcard_constraints:
        backend="gloo|nccl",
        world_size=r"\d+",
    params:
        sizes=listed(ALLREDUCE["sizes_mb"]),
        warmup=ALLREDUCE["warmup"],
        iters=ALLREDUCE["iters"],
        gpus_ok=lambda w: gpus_ok(w.backend, int(w.world_size), ALLREDUCE_CSV.format(**w)),
    threads: lambda w: int(w.world_size)  # one process per rank
    resources:
        gpu=lambda w: gpus_needed(w.backend, int(w.world_size)),
    log:
        f"{RESULTS}/logs/allreduce/{{backend}}_n{{world_size}}.log",
    shell:
        "{LAUNCH} --nproc {wildcards.world_size} --backend {wildcards.backend} --out {output.csv} -- "
        "cs336_systems.experiments.allreduce_benchmark --sizes-mb {params.sizes} --warmup {params.warmup} "
        "--iters {params.iters} 2> {log}"


rule naive_ddp_check:
    input:
        code("experiments/naive_ddp_check.py", "ddp.py", "toy_model.py") + DIST_CODE,
    output:
        csv=CHECK_CSV,
        json=f"{RESULTS}/naive_ddp/check.json",
    params:
        nproc=DDP["world_size"],
        gpus_ok=lambda w: gpus_ok(DIST_BACKEND, DDP["world_size"], CHECK_CSV),
    threads: DDP["world_size"]
    resources:
        gpu=gpus_needed(DIST_BACKEND, DDP["world_size"]),
    log:
        f"{RESULTS}/logs/naive_ddp/check.log",
    shell:
        "{LAUNCH} --nproc {params.nproc} --backend {DIST_BACKEND} --out {output.csv} -- "
        "cs336_systems.experiments.naive_ddp_check 2> {log}"


# One job for every variant (ours, PyTorch's DDP at the same bucket sizes, one rank alone), so that all run on the
# same machine and state. The Chrome traces go to traces/ (ignored by git); the timeline of the last traced step
# per variant is the committed, plotted result. The launcher writes only --out when it skips, so the timeline then
# copies that skipped row.
rule ddp_benchmark:
    input:
        code("experiments/ddp_benchmark.py", "ddp.py") + DIST_CODE + MODEL_CODE,
    output:
        csv=DDP_CSV,
        json=f"{RESULTS}/ddp/benchmark.json",
        timeline=f"{RESULTS}/ddp_timeline/intervals.csv",
        timeline_json=f"{RESULTS}/ddp_timeline/intervals.json",
    params:
        nproc=DDP["world_size"],
        model=model_flags(DDP["size"]),
        buckets=listed(DDP["bucket_sizes_mb"]),
        traces=f"{RESULTS}/traces/ddp",
        gpus_ok=lambda w: gpus_ok(DIST_BACKEND, DDP["world_size"], DDP_CSV),
    threads: DDP["world_size"]
    resources:
        gpu=gpus_needed(DIST_BACKEND, DDP["world_size"]),
    log:
        f"{RESULTS}/logs/ddp/benchmark.log",
    shell:
        "{LAUNCH} --nproc {params.nproc} --backend {DIST_BACKEND} --out {output.csv} -- "
        "cs336_systems.experiments.ddp_benchmark {params.model} --batch-size {DDP[batch_size]} "
        "--context-length {DDP[context_length]} --bucket-sizes-mb {params.buckets} --warmup {DDP[warmup]} "
        "--steps {DDP[steps]} --trace-steps {DDP[trace_steps]} --trace-dir {params.traces} "
        "--timeline-out {output.timeline} 2> {log}; "
        "[ -e {output.timeline} ] || {{ cp {output.csv} {output.timeline} && cp {output.json} {output.timeline_json}; }}"


rule sharding_benchmark:
    input:
        code("experiments/sharding_benchmark.py", "sharded_optimizer.py", "accounting.py", "ddp.py")
        + DIST_CODE
        + MODEL_CODE,
    output:
        csv=SHARDING_CSV,
        json=f"{RESULTS}/sharding/benchmark.json",
    params:
        nproc=SHARDING["world_size"],
        model=model_flags(SHARDING["size"]),
        gpus_ok=lambda w: gpus_ok(DIST_BACKEND, SHARDING["world_size"], SHARDING_CSV),
    threads: SHARDING["world_size"]
    resources:
        gpu=gpus_needed(DIST_BACKEND, SHARDING["world_size"]),
    log:
        f"{RESULTS}/logs/sharding/benchmark.log",
    shell:
        "{LAUNCH} --nproc {params.nproc} --backend {DIST_BACKEND} --out {output.csv} -- "
        "cs336_systems.experiments.sharding_benchmark {params.model} --batch-size {SHARDING[batch_size]} "
        "--context-length {SHARDING[context_length]} --warmup {SHARDING[warmup]} --steps {SHARDING[steps]} "
        "2> {log}"


rule communication_accounting:
    input:
        code("experiments/communication_accounting.py", "accounting.py", "provenance.py"),
    output:
        csv=f"{RESULTS}/communication_accounting/xxl.csv",
        json=f"{RESULTS}/communication_accounting/xxl.json",
    params:
        flags=" ".join(
            f"--{key.replace('_', '-')} {ACCOUNTING[key]}"
            for key in ("d_model", "d_ff", "num_blocks", "batch_size", "seq_len", "h100_memory_gb",
                        "tpu_v5p_memory_gb", "ici_bandwidth_bytes_per_s", "flops_per_s")
        ),
        mesh="--x {X} --y {Y} --m-x {M_X} --m-y {M_Y}".format(**ACCOUNTING["mesh"]),
    log:
        f"{RESULTS}/logs/communication_accounting/xxl.log",
    shell:
        "{PY}.communication_accounting {params.flags} {params.mesh} --out {output.csv} 2> {log}"


WRITEUP_INPUTS += expand(ALLREDUCE_CSV, backend=ALLREDUCE["backends"], world_size=ALLREDUCE["world_sizes"])
WRITEUP_INPUTS += [
    CHECK_CSV,
    DDP_CSV,
    f"{RESULTS}/ddp_timeline/intervals.csv",
    SHARDING_CSV,
    f"{RESULTS}/communication_accounting/xxl.csv",
]
