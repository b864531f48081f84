"""Run an experiment under torchrun with N processes, or record why it cannot run on this machine.

    python -m cs336_systems.launch --nproc N --backend nccl --out OUT.csv -- cs336_systems.experiments.X [flags]

NCCL needs one GPU per process: with fewer visible GPUs (CUDA_VISIBLE_DEVICES, SLURM's allocation) the launcher
writes a `skipped` row to OUT.csv ("needs N GPUs, found M"), and to each `--also` CSV (the experiment's other
outputs), instead of failing, so the pipeline completes and the writeup says what was not run. Otherwise it hands
over to torchrun (`--standalone`: a free port on one node), which ends every rank when one fails.
"""

from __future__ import annotations

import argparse
import os
import sys

from cs336_systems import cli
from cs336_systems.distributed import BACKENDS, gpus_available
from cs336_systems.provenance import write_rows


def main(argv: list[str] | None = None) -> None:
    p = cli.parser(__doc__, seed=False)  # --out: the experiment's output, passed on to it
    p.add_argument("--nproc", type=cli.positive_int, required=True, help="processes (one per GPU with nccl)")
    p.add_argument("--backend", choices=BACKENDS, required=True)
    p.add_argument("--also", action="append", default=[], metavar="CSV",
                   help="another output of the experiment, which gets the skipped row too (repeatable)")
    p.add_argument("module", help="experiment module, e.g. cs336_systems.experiments.ddp_benchmark")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="the experiment's own flags (after --)")
    args = p.parse_args(argv)
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    found = gpus_available()
    if args.backend == "nccl" and found < args.nproc:
        reason = f"needs {args.nproc} GPUs, found {found}"
        print(f"[launch] {args.module}: {reason}; writing a skipped row", file=sys.stderr)
        row = {"status": "skipped", "reason": reason, "backend": args.backend, "world_size": args.nproc}
        for out in [args.out, *args.also]:
            write_rows([row], out, {"module": args.module, "flags": flags, "nproc": args.nproc})
        return
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        "-m",
        args.module,
        "--backend",
        args.backend,
        "--out",
        args.out,
        *flags,
    ]
    print("[launch] " + " ".join(cmd), file=sys.stderr, flush=True)
    os.execv(sys.executable, cmd)


if __name__ == "__main__":
    main()
