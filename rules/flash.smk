# §1.3.2–1.3.4 FlashAttention-2: the benchmark grid (ours vs naive PyTorch vs SDPA) and the leaderboard timing;
# the grid against PyTorch's fastest attention (SDPA's cuDNN and flash backends, compiled FlexAttention), an
# Nsight Compute profile of our kernels beside cuDNN's, and ours against cuDNN at the shapes of the Hopper tier's
# goals, and the host's per-call time of back-to-back calls at the spec grid's short sequences (flash_host). Without
# a GPU, flash_benchmark, flash_peers and flash_goals check our kernels in the Triton interpreter against a float64
# reference instead of timing them, and flash_host writes skipped rows.
FLASH, BOARD, PEERS, GOALS, FLASH_NCU = R["flash"], R["leaderboard"], R["flash_peers"], R["flash_goals"], R["flash_ncu"]
FLASH_HOST = R["flash_host"]
FLASH_CODE = code("bench/flash_variants.py", *FLASH_KERNEL_CODE)


rule flash_benchmark:
    message:
        "§1.3.2 FlashAttention-2 grid, {wildcards.dtype}, head dim {wildcards.d_head} -> {output.csv}"
    input:
        code("experiments/flash_benchmark.py") + FLASH_CODE,
    output:
        csv=report(f"{RESULTS}/flash/benchmark_{{dtype}}_d{{d_head}}.csv", caption="report/flash.rst",
                   category="Results", subcategory="1.3.2–1.3.4 FlashAttention-2"),
        json=f"{RESULTS}/flash/benchmark_{{dtype}}_d{{d_head}}.json",
    params:
        seq_lens=listed(FLASH["seq_lens"]),
        warmup_ms=FLASH["warmup_ms"],
        rep_ms=FLASH["rep_ms"],
        gpus_ok=lambda w: gpus_ok(GPU_JOB, f"{RESULTS}/flash/benchmark_{w.dtype}_d{w.d_head}.csv"),
    threads: NEEDS["model"].threads
    resources:
        **job("model", gpu=GPU_JOB),
    log:
        f"{RESULTS}/logs/flash/benchmark_{{dtype}}_d{{d_head}}.log",
    conda:
        ENV
    shell:
        "pin_gpus {resources.gpu}; "
        "python -m cs336_systems.experiments.flash_benchmark --seq-lens {params.seq_lens} "
        "--d-heads {wildcards.d_head} --dtypes {wildcards.dtype} --warmup-ms {params.warmup_ms} "
        "--rep-ms {params.rep_ms} --out {output.csv} 2> {log}"


rule flash_leaderboard:
    message:
        "§1.3.3 FlashAttention-2 leaderboard timing -> {output.csv}"
    input:
        code("experiments/flash_leaderboard.py") + FLASH_CODE,
    output:
        csv=report(f"{RESULTS}/leaderboard/leaderboard.csv", caption="report/leaderboard.rst",
                   category="Results", subcategory="1.3.2–1.3.4 FlashAttention-2"),
        json=f"{RESULTS}/leaderboard/leaderboard.json",
    params:
        heads=BOARD["heads"],
        seq_len=BOARD["seq_len"],
        d_head=BOARD["d_head"],
        warmup_ms=BOARD["warmup_ms"],
        rep_ms=BOARD["rep_ms"],
        gpus_ok=lambda w: gpus_ok(GPU_JOB, f"{RESULTS}/leaderboard/leaderboard.csv"),
    threads: NEEDS["model"].threads
    resources:
        **job("model", gpu=GPU_JOB),
    log:
        f"{RESULTS}/logs/leaderboard.log",
    conda:
        ENV
    shell:
        "pin_gpus {resources.gpu}; "
        "python -m cs336_systems.experiments.flash_leaderboard --heads {params.heads} --seq-len {params.seq_len} "
        "--d-head {params.d_head} --warmup-ms {params.warmup_ms} --rep-ms {params.rep_ms} --out {output.csv} "
        "2> {log}"


rule flash_peers:
    message:
        "FlashAttention-2 against PyTorch's fastest attention, {wildcards.mask}, head dim {wildcards.d_head} -> {output.csv}"
    input:
        code("experiments/flash_benchmark.py") + FLASH_CODE,
    output:
        csv=report(f"{RESULTS}/flash_peers/{{mask}}_d{{d_head}}.csv", caption="report/flash_peers.rst",
                   category="Results", subcategory="1.3.2–1.3.4 FlashAttention-2"),
        json=f"{RESULTS}/flash_peers/{{mask}}_d{{d_head}}.json",
    wildcard_constraints:
        mask="causal|noncausal",
    params:
        seq_lens=listed(PEERS["seq_lens"]),
        impls=listed(PEERS["impls"]),
        heads=PEERS["heads"],
        tokens=PEERS["tokens"],
        warmup_ms=PEERS["warmup_ms"],
        rep_ms=PEERS["rep_ms"],
        causal=lambda w: "--causal" if w.mask == "causal" else "--no-causal",
        gpus_ok=lambda w: gpus_ok(GPU_JOB, f"{RESULTS}/flash_peers/{w.mask}_d{w.d_head}.csv"),
    threads: NEEDS["model"].threads
    resources:
        **job("model", gpu=GPU_JOB),
    log:
        f"{RESULTS}/logs/flash_peers/{{mask}}_d{{d_head}}.log",
    conda:
        ENV
    shell:
        "pin_gpus {resources.gpu}; "
        "python -m cs336_systems.experiments.flash_benchmark --seq-lens {params.seq_lens} "
        "--d-heads {wildcards.d_head} --dtypes bfloat16 --heads {params.heads} --tokens {params.tokens} "
        "{params.causal} --impls {params.impls} --warmup-ms {params.warmup_ms} --rep-ms {params.rep_ms} "
        "--out {output.csv} 2> {log}"


rule flash_goals:
    message:
        "FlashAttention-2 against cuDNN at the Hopper tier's goal shape {wildcards.shape} (causal) -> {output.csv}"
    input:
        code("experiments/flash_benchmark.py") + FLASH_CODE,
    output:
        csv=report(f"{RESULTS}/flash_goals/{{shape}}.csv", caption="report/flash_goals.rst",
                   category="Results", subcategory="1.3.2–1.3.4 FlashAttention-2"),
        json=f"{RESULTS}/flash_goals/{{shape}}.json",
    wildcard_constraints:
        shape=r"[0-9]+x[0-9]+x[0-9]+x[0-9]+",
    params:
        shape=lambda w: attention_shape_args(w.shape),
        impls=listed(GOALS["impls"]),
        warmup_ms=GOALS["warmup_ms"],
        rep_ms=GOALS["rep_ms"],
        rounds=GOALS["rounds"],
        gpus_ok=lambda w: gpus_ok(GPU_JOB, f"{RESULTS}/flash_goals/{w.shape}.csv"),
    threads: NEEDS["model"].threads
    resources:
        **job("model", gpu=GPU_JOB),
    log:
        f"{RESULTS}/logs/flash_goals/{{shape}}.log",
    conda:
        ENV
    shell:
        "pin_gpus {resources.gpu}; "
        "python -m cs336_systems.experiments.flash_benchmark {params.shape} --dtypes bfloat16 --causal "
        "--impls {params.impls} --warmup-ms {params.warmup_ms} --rep-ms {params.rep_ms} --rounds {params.rounds} "
        "--out {output.csv} 2> {log}"


# The short-sequence goal's measure: at the spec grid's cells (batch 1, one head, causal, d 64) do_bench times the
# host's per-call path less its L2 flush, so the goal is judged on back-to-back calls instead, one job per dtype.
rule flash_host:
    message:
        "FlashAttention-2 host time per call, back to back, {wildcards.dtype}, head dim 64 (causal) -> {output.csv}"
    input:
        code("experiments/flash_benchmark.py") + FLASH_CODE,
    output:
        csv=report(f"{RESULTS}/flash_host/{{dtype}}.csv", caption="report/flash_host.rst",
                   category="Results", subcategory="1.3.2–1.3.4 FlashAttention-2"),
        json=f"{RESULTS}/flash_host/{{dtype}}.json",
    wildcard_constraints:
        dtype="bfloat16|float32",
    params:
        seq_lens=listed(FLASH_HOST["seq_lens"]),
        impls=listed(FLASH_HOST["impls"]),
        calls=FLASH_HOST["calls"],
        repeats=FLASH_HOST["repeats"],
        gpus_ok=lambda w: gpus_ok(GPU_JOB, f"{RESULTS}/flash_host/{w.dtype}.csv"),
    threads: NEEDS["model"].threads
    resources:
        **job("model", gpu=GPU_JOB),
    log:
        f"{RESULTS}/logs/flash_host/{{dtype}}.log",
    conda:
        ENV
    shell:
        "pin_gpus {resources.gpu}; "
        "python -m cs336_systems.experiments.flash_benchmark --host-overhead --seq-lens {params.seq_lens} "
        "--d-heads 64 --dtypes {wildcards.dtype} --heads 1 --causal --impls {params.impls} --calls {params.calls} "
        "--repeats {params.repeats} --out {output.csv} 2> {log}"


rule flash_ncu:
    message:
        "FlashAttention-2 under Nsight Compute -> {output.csv}"
    input:
        code("experiments/flash_ncu.py", "measure/ncu.py") + FLASH_CODE,
    output:
        csv=report(f"{RESULTS}/flash_ncu/kernels.csv", caption="report/flash_ncu.rst",
                   category="Results", subcategory="1.3.2–1.3.4 FlashAttention-2"),
        json=f"{RESULTS}/flash_ncu/kernels.json",
    params:
        shapes=listed(FLASH_NCU["shapes"]),
        gpus_ok=lambda w: gpus_ok(GPU_JOB, f"{RESULTS}/flash_ncu/kernels.csv"),
    threads: NEEDS["model"].threads
    resources:
        **job("model", gpu=GPU_JOB),
    log:
        f"{RESULTS}/logs/flash_ncu.log",
    conda:
        ENV
    shell:
        "pin_gpus {resources.gpu}; "
        "python -m cs336_systems.experiments.flash_ncu --shapes {params.shapes} --out {output.csv} 2> {log}"


# The kernels' tests on the GPU that times them, each file in a pytest process of its own: the Hopper tier's against
# float64 and against the portable tier compiled on CUDA, and the portable tier's launch cache. Their pass/fail
# table is published beside the timings.
GPU_TESTS = ["tests/kernels/test_flash_hopper.py", "tests/kernels/test_flash_launch_gpu.py"]
TEST_HELPERS = ["tests/conftest.py", "tests/attention_reference.py"]


rule gpu_tests:
    message:
        "the kernels' tests on this run's GPU -> {output.csv}"
    input:
        tests=[ancient(t) if VIEW_ONLY else t for t in GPU_TESTS],
        helpers=[ancient(t) if VIEW_ONLY else t for t in TEST_HELPERS],
        code=code("experiments/gpu_tests.py") + FLASH_CODE,
    output:
        csv=report(f"{RESULTS}/gpu_tests/kernels.csv", caption="report/gpu_tests.rst",
                   category="Results", subcategory="1.3.2–1.3.4 FlashAttention-2"),
        json=f"{RESULTS}/gpu_tests/kernels.json",
    params:
        gpus_ok=lambda w: gpus_ok(GPU_JOB, f"{RESULTS}/gpu_tests/kernels.csv"),
    threads: NEEDS["model"].threads
    resources:
        **job("model", gpu=GPU_JOB),
    log:
        f"{RESULTS}/logs/gpu_tests.log",
    conda:
        ENV
    shell:
        "pin_gpus {resources.gpu}; "
        "python -m cs336_systems.experiments.gpu_tests --tests {input.tests} --out {output.csv} 2> {log}"


# One job per (dtype, d_head): each is a few minutes on a GPU, so a cut-short run keeps the cells it finished.
WRITEUP_INPUTS += expand(f"{RESULTS}/flash/benchmark_{{dtype}}_d{{d_head}}.csv", dtype=FLASH["dtypes"],
                         d_head=FLASH["d_heads"])
WRITEUP_INPUTS += [f"{RESULTS}/leaderboard/leaderboard.csv"]
WRITEUP_INPUTS += expand(f"{RESULTS}/flash_peers/{{mask}}_d{{d_head}}.csv", mask=PEERS["masks"],
                         d_head=PEERS["d_heads"])
WRITEUP_INPUTS += expand(f"{RESULTS}/flash_goals/{{shape}}.csv", shape=GOALS["shapes"])
WRITEUP_INPUTS += expand(f"{RESULTS}/flash_host/{{dtype}}.csv", dtype=FLASH_HOST["dtypes"])
WRITEUP_INPUTS += [f"{RESULTS}/flash_ncu/kernels.csv", f"{RESULTS}/gpu_tests/kernels.csv"]
