# The CS336 systems pipeline: `snakemake --cores 1 report/writeup.md`. Logic lives in rules/ and src/.
from snakemake.utils import min_version

min_version("9.0")


# The config: rules/config.smk reads config.yaml (its `configfile:`, after a parse of its own that names a YAML
# mistake's line and column), validates it and selects the run.
include: "rules/config.smk"
include: "rules/common.smk"
include: "rules/e2e.smk"
include: "rules/single_gpu.smk"
include: "rules/flash.smk"
include: "rules/distributed.smk"
include: "rules/fsdp.smk"
include: "rules/residuals.smk"
include: "rules/checkpointing.smk"
include: "rules/parallelism.smk"
include: "rules/train_step.smk"
include: "rules/report.smk"


rule all:
    default_target: True
    input:
        "report/writeup.md",


# A failed job: beside Snakemake's report of its command and log, the one line of its log that says why.
onerror:
    log_failed_jobs()
