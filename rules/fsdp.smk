# 2026 §7: our FSDP beside PyTorch's FSDP2, our bucketed DDP and one rank alone (the floor), one job per world size
# of the run's `fsdp.jobs` (every variant of a world size in one job, so that they share the machine and its
# state). The GPU run: world 1 on one GPU (what our gather/free machinery costs over the unwrapped model) and
# world 2 on two (the goals against FSDP2, the accounting and the all-gather timeline). On the launch pattern of
# rules/distributed.smk: a machine with too few GPUs gets `skipped` rows in both tables.
FSDP = R["fsdp"]
# One job per world size, a multiple of its nodes: rules/config.smk checks both before any job starts.
FSDP_JOBS = {job["world_size"]: job for job in FSDP["jobs"]}
# A job may span `nodes` nodes (default 1; world_size / nodes ranks on each) of a SLURM job (profiles/slurm).
FSDP_NODES = {n: job.get("nodes", 1) for n, job in FSDP_JOBS.items()}
FSDP_CSV = f"{RESULTS}/fsdp/n{{world_size}}.csv"
FSDP_TIMELINE_CSV = f"{RESULTS}/fsdp_timeline/n{{world_size}}.csv"
FSDP_REPORT = dict(caption="report/fsdp.rst", category="Results", subcategory="7 Fully-sharded data parallel")


# The nodes and the benchmark's module and flags of the job of each world size (its batch size, if it names one), as
# functions of the wildcards.
fsdp_nodes = per_world_size(FSDP_NODES)
fsdp_cli = per_world_size({
    n: f"cs336_systems.experiments.fsdp_benchmark --size {FSDP['size']} "
       f"--batch-size {job.get('batch_size', FSDP['batch_size'])} --context-length {FSDP['context_length']} "
       f"--attention {FSDP['attention']} --variants {listed(job['variants'])} "
       f"--compute-dtype {FSDP['compute_dtype']} --prefetch-distance {FSDP['prefetch_distance']} "
       f"--bucket-size-mb {FSDP['bucket_size_mb']} --warmup {FSDP['warmup']} --steps {FSDP['steps']} "
       f"--trace-steps {FSDP['trace_steps']} --trace-dir {RESULTS}/traces/fsdp/n{n} "
       f"--timeline-out {FSDP_TIMELINE_CSV.format(world_size=n)}"
    for n, job in FSDP_JOBS.items()
})


use rule launch_ranks as fsdp_benchmark with:
    message:
        "2026 §7 FSDP against FSDP2, DDP and one rank, world size {wildcards.world_size} -> {output.csv}"
    input:
        code("experiments/fsdp_benchmark.py", "bench/fsdp_variants.py", "parallel/fsdp.py", "measure/timeline.py", "measure/cuda_memory.py",
             *BENCHMARK_CODE, *DIST_CODE),
    output:
        csv=report(FSDP_CSV, **FSDP_REPORT),
        json=f"{RESULTS}/fsdp/n{{world_size}}.json",
        timeline=report(FSDP_TIMELINE_CSV, **FSDP_REPORT),
        timeline_json=f"{RESULTS}/fsdp_timeline/n{{world_size}}.json",
    wildcard_constraints:
        world_size="|".join(str(n) for n in FSDP_JOBS),
    params:
        model=model_dims(FSDP["size"]),
        **launched(lambda w: w.world_size, DIST_BACKEND, FSDP_CSV, also=FSDP_TIMELINE_CSV, nodes=fsdp_nodes),
        cli=fsdp_cli,
    threads: rank_threads(lambda w: w.world_size, fsdp_nodes)
    resources:
        **ranks(lambda w: w.world_size, DIST_BACKEND, fsdp_nodes),
    log:
        f"{RESULTS}/logs/fsdp/n{{world_size}}.log",


WRITEUP_INPUTS += expand([FSDP_CSV, FSDP_TIMELINE_CSV], world_size=sorted(FSDP_JOBS))


# Our FSDP's GPU tests (the `gpu` tests of tests/parallel/test_fsdp.py: the protocol with CUDA tensors, and over
# NCCL with a GPU per rank) on two of the run's GPUs, their pass/fail table published beside the timings. Without
# CUDA the experiment writes `skipped` rows; with one GPU the NCCL test is reported skipped.
FSDP_TESTS = ["tests/parallel/test_fsdp.py"]
FSDP_TEST_HELPERS = ["tests/conftest.py", "tests/workers/fsdp_worker.py"]
FSDP_TESTS_CSV = f"{RESULTS}/fsdp_gpu_tests/tests.csv"
FSDP_TEST_GPUS = 2 * GPU_JOB


rule fsdp_gpu_tests:
    message:
        "our FSDP's GPU tests on {params.gpus} GPUs -> {output.csv}"
    input:
        tests=[ancient(t) if VIEW_ONLY else t for t in FSDP_TESTS],
        helpers=[ancient(t) if VIEW_ONLY else t for t in FSDP_TEST_HELPERS],
        code=code("experiments/gpu_tests.py", "parallel/fsdp.py", *DIST_CODE),
    output:
        csv=report(FSDP_TESTS_CSV, **FSDP_REPORT),
        json=f"{RESULTS}/fsdp_gpu_tests/tests.json",
    params:
        gpus=FSDP_TEST_GPUS,
        gpus_ok=lambda w: gpus_ok(FSDP_TEST_GPUS, FSDP_TESTS_CSV),
    threads: NEEDS["model"].threads
    resources:
        **job("model", gpu=FSDP_TEST_GPUS),
    log:
        f"{RESULTS}/logs/fsdp_gpu_tests.log",
    conda:
        ENV
    shell:
        "pin_gpus {params.gpus}; "
        "python -m cs336_systems.experiments.gpu_tests --tests {input.tests} --marker gpu --out {output.csv} 2> {log}"


WRITEUP_INPUTS.append(FSDP_TESTS_CSV)
