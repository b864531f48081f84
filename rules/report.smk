# The writeup: report/<run>/writeup.md (kept per run) and report/writeup.md (the selected run's, for reading).
# `snakemake --report report/report.html` collects it, its figures and every tidy table, each with its caption
# from rules/report/.
# Every module of the report package (renderer, context, analysis, formatting, sections), relative like all
# inputs (so a moved checkout stays up to date). The writeup runs anywhere, so editing these re-renders it even
# where the results are view-only.
REPORT_PACKAGE = Path(workflow.basedir, "src/cs336_systems")
REPORT_CODE = code(*sorted(p.relative_to(REPORT_PACKAGE).as_posix()
                           for p in (REPORT_PACKAGE / "report").rglob("*.py")), view_only=False)
# The model's parameter count orders the sizes: library code, view-only like the experiments'.
REPORT_CODE += code("model/transformer.py", "model/sizes.py")


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
