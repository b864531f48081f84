"""Run an experiment under torchrun with N processes per node, or record why it cannot run on this machine.

    python -m cs336_systems.parallel.launch --nproc N --backend nccl --out OUT.csv -- cs336_systems.experiments.X [flags]

NCCL needs one GPU per process: with fewer visible GPUs (CUDA_VISIBLE_DEVICES, SLURM's allocation) the launcher
writes a `skipped` row to OUT.csv ("needs N GPUs, found M"), and to each `--also` CSV (the experiment's other
outputs), instead of failing, so the pipeline completes and the writeup says what was not run. Otherwise it hands
over to torchrun, which ends every rank when one fails.

One node (`--nnodes 1`, the default): torchrun `--standalone`, a free port on this machine. Several nodes: run
one launcher per node (under SLURM: `srun --ntasks-per-node=1 python -m cs336_systems.parallel.launch --nnodes 2 ...`);
they meet at a c10d rendezvous, `--rdzv-endpoint HOST:PORT` and `--rdzv-id`, which default under SLURM to the
allocation's first host, a port derived from the job id (every node derives the same one; 20000-39999) and the
job id.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

from cs336_systems import cli
from cs336_systems.measure.provenance import write_rows
from cs336_systems.parallel.distributed import BACKENDS, gpus_available


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: "gpu[07-09,12],cpu1" -> "gpu07" (what `scontrol show hostnames`
    prints first; used where scontrol is not on the PATH)."""
    match = re.match(r"([^,\[]+)(?:\[([^\],-]+))?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot read a host from the SLURM node list {nodelist!r}")
    prefix, first = match.groups()
    return prefix + (first or "")


def slurm_rendezvous(environ: dict[str, str]) -> tuple[str, str] | None:
    """(HOST:PORT, id) of the job's rendezvous from SLURM's environment, or None outside a SLURM job."""
    nodelist, job = environ.get("SLURM_JOB_NODELIST"), environ.get("SLURM_JOB_ID")
    if not nodelist or not job:
        return None
    if shutil.which("scontrol"):
        hosts = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
        ).stdout.split()
        host = hosts[0]
    else:
        host = first_host(nodelist)
    return f"{host}:{20000 + int(job) % 20000}", job


def torchrun_nodes(args: argparse.Namespace, p: argparse.ArgumentParser) -> list[str]:
    """torchrun's flags that place this launcher's processes among the job's nodes."""
    if args.nnodes == 1:
        return ["--standalone", f"--nproc-per-node={args.nproc}"]
    endpoint, rdzv_id = args.rdzv_endpoint, args.rdzv_id
    if endpoint is None or rdzv_id is None:
        found = slurm_rendezvous(dict(os.environ))
        if found is None:
            p.error(
                f"--nnodes {args.nnodes} needs --rdzv-endpoint and --rdzv-id, or a SLURM job "
                "(SLURM_JOB_NODELIST and SLURM_JOB_ID) to take them from"
            )
        endpoint, rdzv_id = endpoint or found[0], rdzv_id or found[1]
    return [
        f"--nnodes={args.nnodes}",
        f"--nproc-per-node={args.nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={rdzv_id}",
    ]


def main(argv: list[str] | None = None) -> None:
    p = cli.parser(__doc__, seed=False)  # --out: the experiment's output, passed on to it
    p.add_argument(
        "--nproc", type=cli.positive_int, required=True, help="processes on this node (one per GPU with nccl)"
    )
    p.add_argument("--nnodes", type=cli.positive_int, default=1, help="nodes, one launcher on each")
    p.add_argument(
        "--rdzv-endpoint", metavar="HOST:PORT", help="several nodes: where they meet (default: SLURM's)"
    )
    p.add_argument("--rdzv-id", help="several nodes: the job's rendezvous id (default: SLURM_JOB_ID)")
    p.add_argument(
        "--backend", choices=BACKENDS, required=True, help="the process group's (nccl: one GPU per process)"
    )
    p.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="CSV",
        help="another output of the experiment, which gets the skipped row too (repeatable)",
    )
    p.add_argument("module", help="experiment module, e.g. cs336_systems.experiments.ddp_benchmark")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="the experiment's own flags (after --)")
    args = p.parse_args(argv)
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    placement = torchrun_nodes(args, p)
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
        *placement,
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
