# The writeup: report/<run>/writeup.md (kept per run) and report/writeup.md (the selected run's, for reading).
# `snakemake --report report/report.html` collects it, its figures and every tidy table, each with its caption
# from rules/report/.
# The renderer and every section module, relative like all inputs (so a moved checkout stays up to date). The
# writeup runs anywhere, so editing these re-renders it even where the results are view-only.
REPORT_SECTIONS = sorted(Path(workflow.basedir, "src/cs336_systems/report/sections").glob("*.py"))
REPORT_CODE = code("report/__init__.py", "report/__main__.py", "report/context.py",
                   *(f"report/sections/{p.name}" for p in REPORT_SECTIONS), view_only=False)


rule writeup:
    input:
        WRITEUP_INPUTS,
        REPORT_CODE,
    output:
        run=report(f"report/{RUN}/writeup.md", caption="report/writeup.rst", category="Writeup"),
        figures=report(directory(f"report/{RUN}/figures"), patterns=["{name}.png"], caption="report/figure.rst",
                       category="Figures", labels={"figure": "{name}"}),
        top="report/writeup.md",
    params:
        run=RUN,
    threads: NEEDS["light"].threads
    resources:
        **job("light", gpu=0),
    log:
        f"{RESULTS}/logs/writeup.log",
    conda:
        ENV
    shell:
        "mkdir -p {output.figures}; "
        "python -m cs336_systems.report --run {params.run} --results results/{params.run} --out {output.run} "
        "--copy {output.top} 2> {log}"
