# 2026 §8 parallelism analysis: every answer derived with sympy, and its device-count bounds on the configured
# hardware and FFNs. CPU-only and the same in every run.
import shlex

PARALLELISM = config["parallelism"]
TIMING = PARALLELISM["timing"]
# The world sizes of the timing and the checks: the run's own where it names them (the smoke run's are fewer).
RUN_WORLD_SIZES = R.get("parallelism_world_sizes", {})
TIMING_WORLD_SIZES = RUN_WORLD_SIZES.get("timing", TIMING["world_sizes"])
CHECK_WORLD_SIZES = RUN_WORLD_SIZES.get("checks", PARALLELISM["check_world_sizes"])
RING_TIMING_CSV = f"{RESULTS}/parallelism_timing/n{{world_size}}.csv"
CHECKS_CSV = f"{RESULTS}/parallelism_checks/n{{world_size}}.csv"


rule parallelism_analysis:
    message:
        "2026 §8 parallelism analysis (sympy) -> {output.csv}"
    input:
        code("experiments/parallelism_analysis.py", "accounting/parallelism.py"),
    output:
        csv=report(f"{RESULTS}/parallelism/answers.csv", caption="report/parallelism.rst", category="Results",
                   subcategory="8 Parallelism analysis"),
        json=f"{RESULTS}/parallelism/answers.json",
    params:
        hardware=" ".join(shlex.quote(f"{h['name']}:{h['flops_per_s']}:{h['egress_bytes_per_s']}")
                          for h in PARALLELISM["hardware"]),
        ffn=" ".join(shlex.quote(f"{f['name']}:{f['batch_tokens']}:{f['d_model']}:{f['d_ff']}")
                     for f in PARALLELISM["ffn"]),
    threads: NEEDS["light"].threads
    resources:
        **job("light", gpu=0),
    log:
        f"{RESULTS}/logs/parallelism/answers.log",
    conda:
        ENV
    shell:
        "python -m cs336_systems.experiments.parallelism_analysis --hardware {params.hardware} "
        "--ffn {params.ffn} --out {output.csv} 2> {log}"


use rule launch_ranks as ring_allreduce_timing with:
    message:
        "2026 §8.1 ring and alternate all-reduce timing on {params.nproc} ranks -> {output.csv}"
    input:
        code("experiments/ring_allreduce_timing.py", "parallel/ring_collectives.py", "accounting/parallelism.py", *DIST_CODE),
    output:
        csv=report(RING_TIMING_CSV, caption="report/parallelism.rst", category="Results",
                   subcategory="8 Parallelism analysis"),
        json=f"{RESULTS}/parallelism_timing/n{{world_size}}.json",
    wildcard_constraints:
        world_size=r"\d+",
    params:
        **launched(lambda w: w.world_size, "gloo", RING_TIMING_CSV),
        cli=f"cs336_systems.experiments.ring_allreduce_timing --sizes-mb {listed(TIMING['sizes_mb'])} "
            f"--warmup {TIMING['warmup']} --iters {TIMING['iters']}",
    threads: rank_threads(lambda w: w.world_size)
    resources:
        **ranks(lambda w: w.world_size, "gloo"),
    log:
        f"{RESULTS}/logs/parallelism/timing_n{{world_size}}.log",


use rule launch_ranks as parallelism_checks with:
    message:
        "2026 §8 ring collectives and parallel FFN checks on {params.nproc} ranks -> {output.csv}"
    input:
        code("experiments/parallelism_checks.py", "bench/strategy_checks.py", "parallel/ring_collectives.py", "parallel/ffn_parallel.py",
             "accounting/parallelism.py", *DIST_CODE),
    output:
        csv=report(CHECKS_CSV, caption="report/parallelism.rst", category="Results",
                   subcategory="8 Parallelism analysis"),
        json=f"{RESULTS}/parallelism_checks/n{{world_size}}.json",
    wildcard_constraints:
        world_size=r"\d+",
    params:
        **launched(lambda w: w.world_size, "gloo", CHECKS_CSV),
        cli="cs336_systems.experiments.parallelism_checks",
    threads: rank_threads(lambda w: w.world_size)
    resources:
        **ranks(lambda w: w.world_size, "gloo"),
    log:
        f"{RESULTS}/logs/parallelism/checks_n{{world_size}}.log",


WRITEUP_INPUTS += [f"{RESULTS}/parallelism/answers.csv",
                   *(RING_TIMING_CSV.format(world_size=n) for n in TIMING_WORLD_SIZES),
                   *(CHECKS_CSV.format(world_size=n) for n in CHECK_WORLD_SIZES)]
