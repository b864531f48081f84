"""Mixed precision (spec §1.1.5): accumulation accuracy and the dtypes autocast produces in the toy model.

Commands:
  accumulation     the four loops of ADDENDUM.md, each adding 0.01 a thousand times (exact answer 10);
                   one row per loop with its value and |error|.
  autocast-dtypes  the ToyModel with float32 parameters run under torch.autocast (`--dtypes`, on `--device`);
                   one row per quantity with the dtype observed (forward hooks, returned tensors, `.grad`
                   after backward) per autocast dtype.
The measurements are cs336_systems.bench.precision's.
"""

from __future__ import annotations

import argparse

import torch

from cs336_systems import cli
from cs336_systems.bench import precision
from cs336_systems.measure.provenance import write_rows
from cs336_systems.measure.timing import resolve_device

AUTOCAST_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    p.add_argument("command", choices=["accumulation", "autocast-dtypes"], help="what to measure (see above)")
    p.add_argument(
        "--dtypes",
        nargs="+",
        choices=sorted(AUTOCAST_DTYPES),
        default=["float16"],
        help="autocast-dtypes: the dtypes to run",
    )
    cli.add_device(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.command == "accumulation":
        rows = precision.accumulation_rows()
    else:
        device = resolve_device(args.device)
        dtypes = [AUTOCAST_DTYPES[name] for name in args.dtypes]
        rows = [
            row for dtype in dtypes for row in precision.observe_autocast_dtypes(device, dtype, args.seed)
        ]
    write_rows(rows, args.out, vars(args))


if __name__ == "__main__":
    main()
