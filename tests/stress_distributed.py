"""Stress check of the distributed entry points' teardown: every distributed CLI many times, several at once,
beside a CPU-saturating process, on gloo, so that a rare race at exit (a rank aborting with "terminate called
without an active exception") shows up if it is there. Too long for the default test run (about 20 minutes on
2 cores with the defaults); run it by hand:

    python tests/stress_distributed.py      # 20 runs of each CLI at world 2 and 4, 3 at a time, 2 busy processes
    python tests/stress_distributed.py --runs 5 --worlds 2

It prints one line per failed launch (with the tail of its output) and a summary per (CLI, world size), and
exits 1 if any launch failed. PYTHONPATH decides which checkout's code runs (e.g. an older commit's src/).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TOY_MODEL = ["--size", "tiny"]
CLIS = {
    "allreduce_benchmark": "--sizes-mb 0.01 0.5 --warmup 1 --iters 3".split(),
    "naive_ddp_check": "--steps 3".split(),
    "ddp_benchmark": [
        *TOY_MODEL,
        *"--batch-size 1 --context-length 8 --bucket-sizes-mb 0.001 --warmup 1 --steps 2".split(),
    ],
    "sharding_benchmark": [*TOY_MODEL, *"--batch-size 1 --context-length 8 --warmup 1 --steps 2".split()],
    "fsdp_benchmark": [*TOY_MODEL, *"--batch-size 1 --context-length 8 --warmup 1 --steps 2".split()],
}


def launch(cli: str, world: int, out_dir: Path, index: int) -> tuple[str, int, int, str]:
    """(cli, world, return code, output tail) of one launch through torchrun with gloo."""
    out = out_dir / f"{cli}_{world}_{index}.csv"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    command += ["-m", f"cs336_systems.experiments.{cli}", "--backend", "gloo", *CLIS[cli], "--out", str(out)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        return cli, world, result.returncode, (result.stdout + result.stderr)[-1500:]
    except subprocess.TimeoutExpired:
        return cli, world, -1, "timed out after 600 s"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=20, help="launches of each CLI at each world size")
    p.add_argument("--parallel", type=int, default=3, help="launches running at once")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="world sizes")
    p.add_argument("--clis", nargs="+", choices=sorted(CLIS), default=sorted(CLIS))
    p.add_argument("--burners", type=int, default=2, help="CPU-saturating processes beside the launches")
    args = p.parse_args(argv)
    if args.runs < 1 or args.parallel < 1 or min(args.worlds) < 1 or args.burners < 0:
        p.error("--runs, --parallel and every --worlds must be >= 1, --burners >= 0")

    jobs = [(cli, world, i) for i in range(args.runs) for cli in args.clis for world in args.worlds]
    # Busy processes make the scheduler preempt the ranks' threads at random points, which is what widens a race.
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)]
    failures: Counter = Counter()
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.parallel) as pool:
            results = pool.map(lambda job: launch(job[0], job[1], Path(tmp), job[2]), jobs)
            for cli, world, code, tail in results:
                if code != 0:
                    failures[cli, world] += 1
                    print(f"FAILED {cli} world {world} (exit {code}):\n{tail}\n", flush=True)
    finally:
        for burner in burners:
            burner.kill()
    for cli in args.clis:
        for world in args.worlds:
            print(f"{cli:20s} world {world}: {failures[cli, world]} failed of {args.runs}")
    total = sum(failures.values())
    print(f"{total} failed of {len(jobs)} launches in {time.perf_counter() - start:.0f} s")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
