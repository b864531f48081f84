# The writeup: report/<run>/writeup.md (kept per run) and report/writeup.md (the selected run's, for reading).


rule writeup:
    input:
        WRITEUP_INPUTS,
        code("report/__init__.py", "report/__main__.py", "report/context.py"),
        lambda w: sorted(str(p) for p in Path(workflow.basedir, "src/cs336_systems/report/sections").glob("*.py")),
    output:
        run=f"report/{RUN}/writeup.md",
        top="report/writeup.md",
    log:
        f"{RESULTS}/logs/writeup.log",
    shell:
        "python -m cs336_systems.report --run {RUN} --results {RESULTS} --out {output.run} --copy {output.top} "
        "2> {log}"
