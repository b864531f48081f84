# §1.3.2–1.3.4 FlashAttention-2: the benchmark grid (ours vs naive PyTorch vs SDPA) and the leaderboard timing.
FLASH, BOARD = R["flash"], R["leaderboard"]
FLASH_CODE = code("flash_attention.py", "flash_triton.py", "benchmarking.py", "provenance.py")


rule flash_benchmark:
    input:
        code("experiments/flash_benchmark.py", "model.py") + FLASH_CODE,
    output:
        f"{RESULTS}/flash/benchmark_{{dtype}}_d{{d_head}}.csv",
        f"{RESULTS}/flash/benchmark_{{dtype}}_d{{d_head}}.json",
    params:
        seq_lens=listed(FLASH["seq_lens"]),
        timing=[FLASH["warmup_ms"], FLASH["rep_ms"]],
    resources:
        gpu=GPU_JOB,
    log:
        f"{RESULTS}/logs/flash/benchmark_{{dtype}}_d{{d_head}}.log",
    shell:
        "{PY}.flash_benchmark --seq-lens {params.seq_lens} --d-heads {wildcards.d_head} --dtypes {wildcards.dtype} "
        "--warmup-ms {FLASH[warmup_ms]} --rep-ms {FLASH[rep_ms]} --out {output[0]} 2> {log}"


rule flash_leaderboard:
    input:
        code("experiments/leaderboard.py") + FLASH_CODE,
    output:
        f"{RESULTS}/leaderboard/leaderboard.csv",
        f"{RESULTS}/leaderboard/leaderboard.json",
    params:
        board=BOARD,
    resources:
        gpu=GPU_JOB,
    log:
        f"{RESULTS}/logs/leaderboard.log",
    shell:
        "{PY}.leaderboard --heads {BOARD[heads]} --seq-len {BOARD[seq_len]} --d-head {BOARD[d_head]} "
        "--warmup-ms {BOARD[warmup_ms]} --rep-ms {BOARD[rep_ms]} --out {output[0]} 2> {log}"


# One job per (dtype, d_head): each is a few minutes on a GPU, so a cut-short run keeps the cells it finished.
WRITEUP_INPUTS += expand(f"{RESULTS}/flash/benchmark_{{dtype}}_d{{d_head}}.csv", dtype=FLASH["dtypes"],
                         d_head=FLASH["d_heads"])
WRITEUP_INPUTS += [f"{RESULTS}/leaderboard/leaderboard.csv"]
