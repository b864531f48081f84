"""Communication accounting for the XXL model (ADDENDUM.md §2.4 a-c): memory on H100s, FSDP sharding on
TPU v5p, and the batch size at which mixed FSDP + tensor parallelism is compute bound (scaling book
notation).

Writes one row per quantity: part (a/b/c), quantity, value, unit, formula. Defaults are the ADDENDUM's
numbers; the batch and sequence length of the activation memory are not fixed there, so they are flags.
"""

from __future__ import annotations

import argparse

from cs336_systems import cli
from cs336_systems.accounting.formulas import (
    FFNStack,
    fsdp_tp_compute_bound_batch,
    xxl_fsdp_memory,
    xxl_memory,
)
from cs336_systems.measure.provenance import write_rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__, seed=False)
    integer, number = cli.positive_int, cli.positive_float
    p.add_argument("--d-model", type=integer, default=16384, help="D, the model width")
    p.add_argument("--d-ff", type=integer, default=53248, help="F, the FFN's hidden width")
    p.add_argument("--num-blocks", type=integer, default=126, help="FFN blocks of the XXL model")
    p.add_argument(
        "--batch-size", type=integer, default=4, help="sequences per device for the activation memory"
    )
    p.add_argument(
        "--seq-len", type=integer, default=1024, help="tokens per sequence for the activation memory"
    )
    p.add_argument("--h100-memory-gb", type=number, default=80.0, help="(a) memory of one H100, 10^9 bytes")
    p.add_argument(
        "--tpu-v5p-memory-gb", type=number, default=95.0, help="(b) memory of one TPU v5p, 10^9 bytes"
    )
    p.add_argument("--ici-bandwidth-bytes-per-s", type=number, default=2 * 9e10, help="(c) W_ici")
    p.add_argument("--flops-per-s", type=number, default=4.6e14, help="(c) C, bf16 FLOP/s per chip")
    p.add_argument("--x", type=integer, default=16, help="(c) X, devices on the FSDP axis")
    p.add_argument("--y", type=integer, default=4, help="(c) Y, devices on the tensor-parallel axis")
    p.add_argument("--m-x", type=integer, default=2, help="(c) M_X, mesh axes of the FSDP dimension")
    p.add_argument(
        "--m-y", type=integer, default=1, help="(c) M_Y, mesh axes of the tensor-parallel dimension"
    )
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> list[dict]:
    model = FFNStack(args.d_model, args.d_ff, args.num_blocks)
    h100_bytes, v5p_bytes = args.h100_memory_gb * 1e9, args.tpu_v5p_memory_gb * 1e9
    parts = {
        "a": xxl_memory(model, args.batch_size, args.seq_len, device_memory_bytes=h100_bytes),
        "b": xxl_fsdp_memory(model, args.batch_size, args.seq_len, device_memory_bytes=v5p_bytes),
        "c": fsdp_tp_compute_bound_batch(
            model, args.flops_per_s, args.ici_bandwidth_bytes_per_s, args.x, args.y, args.m_x, args.m_y
        ),
    }
    return [{"part": part, **q.row()} for part, quantities in parts.items() for q in quantities]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    write_rows(run(args), args.out, vars(args))


if __name__ == "__main__":
    main()
