# 2026 §3.1 autograd residuals: what RMSNorm and one Transformer block save for backward, eager and compiled,
# naive and flash attention, measured with saved-tensor hooks beside the analytic count.
RESIDUALS = R["residuals"]  # its size and heads: checked by rules/config.smk


rule residuals:
    message:
        "2026 §3.1 autograd residuals of RMSNorm and one block -> {output.csv}"
    input:
        code("experiments/residuals_benchmark.py", "measure/saved_tensors.py", *FLASH_KERNEL_CODE),
    output:
        csv=report(f"{RESULTS}/residuals/residuals.csv", caption="report/residuals.rst", category="Results",
                   subcategory="3.1 Autograd residuals"),
        json=f"{RESULTS}/residuals/residuals.json",
    params:
        size=RESIDUALS["size"],
        model=model_dims(RESIDUALS["size"]),
        batch_size=RESIDUALS["batch_size"],
        context_length=RESIDUALS["context_length"],
        heads=listed(RESIDUALS["heads"]),
        device=R["device"],
        gpus_ok=lambda w: gpus_ok(GPU_JOB, f"{RESULTS}/residuals/residuals.csv"),
    threads: NEEDS["heavy"].threads
    resources:
        **job("heavy", gpu=GPU_JOB),
    log:
        f"{RESULTS}/logs/residuals.log",
    conda:
        ENV
    shell:
        "pin_gpus {resources.gpu}; "
        "python -m cs336_systems.experiments.residuals_benchmark --size {params.size} --batch-size {params.batch_size} "
        "--context-length {params.context_length} --heads {params.heads} --device {params.device} "
        "--out {output.csv} 2> {log}"


WRITEUP_INPUTS += [f"{RESULTS}/residuals/residuals.csv"]
