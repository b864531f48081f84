"""Parallelism analysis (2026 handout §8): every derived answer, and its device-count bounds on real hardware.

The answers are derived symbolically in cs336_systems.accounting.parallelism. Rows, tidy:
  kind=answer  one per answer: question, quantity, expression (sympy's string), latex, justification
  kind=bound   one per device-count answer x hardware x FFN: the bound's value (devices) at that hardware's
               C (FLOP/s per device) and W (egress bytes/s per device) and that FFN's B (tokens), D, D_FF
  kind=split   one per 8.5 (c)/(d) x hardware x FFN: the optimal N_FSDP and N_TP (continuous)
Hardware: `--hardware NAME:C:W`; FFNs: `--ffn NAME:B:D:D_FF`, each repeated.
"""

from __future__ import annotations

import argparse

from cs336_systems import cli
from cs336_systems.accounting import parallelism as p
from cs336_systems.measure.provenance import write_rows


def _fields(text: str, names: tuple[str, ...]) -> list[str]:
    parts = text.split(":")
    if len(parts) != len(names) + 1 or not parts[0]:
        raise argparse.ArgumentTypeError(f"expected NAME:{':'.join(names)}, got {text!r}")
    return parts


def hardware(text: str) -> tuple[str, float, float]:
    name, flops, egress = _fields(text, ("C", "W"))
    return name, cli.positive_float(flops), cli.positive_float(egress)


def ffn(text: str) -> tuple[str, int, int, int]:
    name, *dims = _fields(text, ("B", "D", "D_FF"))
    return name, *(cli.positive_int(d) for d in dims)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = cli.parser(__doc__, seed=False)
    parser.add_argument(
        "--hardware",
        type=hardware,
        nargs="+",
        required=True,
        help="NAME:C:W, C in FLOP/s and W in egress bytes/s per device",
    )
    parser.add_argument("--ffn", type=ffn, nargs="+", required=True, help="NAME:B:D:D_FF, B in tokens")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> list[dict]:
    answers = p.all_answers()
    rows = [
        {
            "kind": "answer",
            "question": a.question,
            "quantity": a.quantity,
            "expression": "" if a.expr is None else str(a.expr),
            "latex": a.latex,
            "justification": a.justification,
        }
        for a in answers
    ]
    splits = {"8.5(c)": p.optimal_split(overlapped=True), "8.5(d)": p.optimal_split(overlapped=False)}
    for hw_name, flops, egress in args.hardware:
        for ffn_name, batch, d_model, d_ff in args.ffn:
            at = {p.C: flops, p.W: egress, p.B: batch, p.D: d_model, p.D_FF: d_ff}
            setting = {
                "hardware": hw_name,
                "C": flops,
                "W": egress,
                "ffn": ffn_name,
                "B": batch,
                "D": d_model,
                "D_FF": d_ff,
            }
            for a in answers:
                if a.is_bound:
                    rows.append(
                        {
                            "kind": "bound",
                            "question": a.question,
                            "quantity": a.quantity,
                            **setting,
                            "value": p.evaluate(a.expr, at),
                        }
                    )
            for question, (n_fsdp, n_tp) in splits.items():
                rows.append(
                    {
                        "kind": "split",
                        "question": question,
                        "quantity": "optimal split",
                        **setting,
                        "N_FSDP": p.evaluate(n_fsdp, at),
                        "N_TP": p.evaluate(n_tp, at),
                    }
                )
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    write_rows(run(args), args.out, cli.params(args))


if __name__ == "__main__":
    main()
