"""Does every one-device stack of the leaderboard's step train the model as the plain one does? (2026 §9)

    python -m cs336_systems.experiments.train_step_check --stacks native ours --dtype bfloat16 \\
        --out results/gpu/train_step_check/check.csv

On a small model (odd vocabulary and context, so our kernels' ragged tiles run), every stack starts from the same
weights and batch (cs336_systems.training.stacks.build_step, one seed) and takes `--steps` AdamW steps in
`--dtype`. The reference is the plain model in float32 (TF32 off). Per stack and quantity, one row:
- `loss`, `gradients`: the first step's loss and all gradients (concatenated), relative error
  ‖x − ref‖ / ‖ref‖ against the reference;
- `weights`: the weights after the first step (concatenated), relative error likewise;
- `loss_curve`: the largest relative error of the loss over all `--steps` steps.
The plain model in `--dtype` is the yardstick: the error that dtype's rounding alone makes. A stack passes where
its error is within `--tolerance` × the yardstick + `--floor` (float32's own summation-order differences, where
the yardstick is zero).
"""

from __future__ import annotations

import argparse

import torch

from cs336_systems import cli
from cs336_systems.kernels import triton_interpreter
from cs336_systems.measure.provenance import write_rows
from cs336_systems.measure.timing import resolve_device
from cs336_systems.training.stacks import DTYPES, STACKS, Stack, build_step

ONE_DEVICE = [s for s, stack in STACKS.items() if stack.sharding == "none"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    for name, default, meaning in (
        ("d_model", 256, "the model width"),
        ("d_ff", 688, "the FFN's hidden width"),
        ("num_heads", 2, "attention heads (d_model / num_heads: an even head dim)"),
        ("num_layers", 2, "Transformer blocks"),
        ("vocab_size", 1009, "vocabulary size"),
        ("context_length", 515, "tokens per sequence"),
        ("batch_size", 2, "sequences per step"),
        ("steps", 20, "AdamW steps each stack takes"),
    ):
        p.add_argument(f"--{name.replace('_', '-')}", type=cli.positive_int, default=default, help=meaning)
    p.add_argument(
        "--stacks",
        nargs="+",
        choices=[s for s in ONE_DEVICE if s != "plain"],
        required=True,
        help="the stacks to check against the plain model",
    )
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="bfloat16",
        help="the stacks' dtype (the reference's: float32)",
    )
    p.add_argument("--head-chunk", type=cli.positive_int, default=256, help="tokens per LM-head chunk")
    p.add_argument("--no-compile", action="store_true", help="run every stack's blocks eagerly")
    p.add_argument(
        "--tolerance", type=float, default=2.0, help="bound = tolerance x the plain model's error + floor"
    )
    p.add_argument(
        "--floor", type=float, default=1e-5, help="bound = tolerance x the plain model's error + floor"
    )
    cli.add_device(p)
    args = p.parse_args(argv)
    if args.d_model % args.num_heads or (args.d_model // args.num_heads) % 2:
        p.error(f"--d-model {args.d_model} must split into --num-heads {args.num_heads} heads of even size")
    return args


def train(
    stack: Stack, args: argparse.Namespace, device: torch.device, dtype: torch.dtype, compile_blocks: bool
):
    """(losses over the steps, the first step's gradients, the weights after it), all float32 on the CPU."""
    dims = {
        k: getattr(args, k)
        for k in ("d_model", "d_ff", "num_heads", "num_layers", "vocab_size", "context_length")
    }
    step = build_step(
        stack,
        dims,
        args.batch_size,
        device,
        dtype,
        compile_blocks=compile_blocks,
        head_chunk=args.head_chunk,
        seed=args.seed,
    )
    losses, grads, weights = [], None, None
    for i in range(args.steps):
        losses.append(step.train_step().item())
        if (
            i == 0
        ):  # the step's gradients stay until the next one's zero_grad; the optimizer leaves them as they are
            grads = torch.cat([p.grad.detach().float().flatten().cpu() for p in step.model.parameters()])
            weights = torch.cat([p.detach().float().flatten().cpu() for p in step.model.parameters()])
    return torch.tensor(losses, dtype=torch.float64), grads, weights


def relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def errors(run, ref) -> dict[str, float]:
    (losses, grads, weights), (ref_losses, ref_grads, ref_weights) = run, ref
    return {
        "loss": relative(losses[:1], ref_losses[:1]),
        "gradients": relative(grads, ref_grads),
        "weights": relative(weights, ref_weights),
        "loss_curve": ((losses - ref_losses).abs() / ref_losses.abs()).max().item(),
    }


def check_rows(args: argparse.Namespace, device: torch.device) -> list[dict]:
    dtype = DTYPES[args.dtype]
    plain = STACKS["plain"]
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = (
            False  # the reference's matmuls in full float32 (bf16's unaffected)
        )
    reference = train(plain, args, device, torch.float32, compile_blocks=False)
    yardstick = errors(train(plain, args, device, dtype, compile_blocks=False), reference)
    rows = []
    for name in args.stacks:
        run = train(STACKS[name], args, device, dtype, compile_blocks=not args.no_compile)
        for quantity, error in errors(run, reference).items():
            bound = args.tolerance * yardstick[quantity] + args.floor
            rows.append(
                {
                    "stack": name,
                    "quantity": quantity,
                    "error": error,
                    "yardstick": yardstick[quantity],
                    "bound": bound,
                    "passed": error <= bound,
                }
            )
    return [row | {"dtype": args.dtype, "steps": args.steps} for row in rows]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = resolve_device(args.device)
    triton_interpreter.use_off_cuda(device)
    write_rows(check_rows(args, device), args.out, cli.params(args))


if __name__ == "__main__":
    main()
