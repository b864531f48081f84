# 2026 §8 parallelism analysis: every answer derived with sympy, and its device-count bounds on the configured
# hardware and FFNs. CPU-only and the same in every run.
import shlex

PARALLELISM = config["parallelism"]


rule parallelism_analysis:
    input:
        code("experiments/parallelism_analysis.py", "parallelism.py"),
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


WRITEUP_INPUTS += [f"{RESULTS}/parallelism/answers.csv"]
