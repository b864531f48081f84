# The writeup: report/<run>/writeup.md (kept per run) and report/writeup.md (the selected run's, for reading).
# `snakemake --report report/report.html` collects it, its figures and every tidy table, each with its caption
# from rules/report/.
# The writeup's code: every module of the report package (renderer, context, analysis, formatting, sections) and
# every module of the package those import, directly or transitively, even inside a function (imported_modules() in
# rules/common.smk reads the imports from the source). The writeup runs anywhere, so editing the report package
# re-renders it even where the results are view-only; the library code it imports (the model's parameter count,
# the FSDP units, the accounting formulas, ...) is view-only like the experiments'.
REPORT_MODULES = imported_modules(Path(workflow.basedir, "src/cs336_systems"), "report")
REPORT_CODE = code(*(m for m in REPORT_MODULES if m.startswith("report/")), view_only=False)
REPORT_CODE += code(*(m for m in REPORT_MODULES if not m.startswith("report/")))


rule writeup:
    message:
        "the writeup of run {params.run} -> {output.run}"
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


onsuccess:
    # Where to read what the run made (not after a dry run: Snakemake skips this handler there).
    writeup = Path(f"report/{RUN}/writeup.md")
    if writeup.exists():
        print(f"\nThe writeup of run {RUN}: {writeup} (and report/writeup.md). An HTML report with every table and "
              "figure: snakemake --report report/report.html", file=sys.stderr)
