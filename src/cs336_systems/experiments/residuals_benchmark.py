"""Autograd residuals (2026 spec §3.1, §3.1.1): what RMSNorm and one Transformer block save for backward.

Configurations: module (rmsnorm, block) x mode (eager, compiled: torch.compile) x attention (naive: the model's
materialised softmax; flash: our Triton FlashAttention, `attention=flash_triton`) x heads (block only; RMSNorm
runs once per mode). Dimensions: d_model and d_ff of `--size`, `--heads` in place of its head count, a float32
input of (`--batch-size`, `--context-length`, d_model). Rows, tidy:
  source=measured  one per saved tensor (shape, dtype, bytes, storage_bytes, saved_by, producer, module_path,
                   is_parameter, alias_of, counted, counted_bytes), recorded with saved-tensor hooks
  source=analytic  one per saved tensor of the eager count from the dimensions (cs336_systems.measure.saved_tensors)
A configuration that cannot run (flash at an unsupported head dim or without CUDA or the Triton interpreter;
torch.compile without a working compiler) is one `skipped` row with the reason; out of memory, one `OOM` row.
On the CPU, flash runs in the Triton interpreter (TRITON_INTERPRET=1 is set unless given): keep sizes tiny.
"""

from __future__ import annotations

import argparse
import itertools

from cs336_systems import cli
from cs336_systems.kernels import triton_interpreter
from cs336_systems.measure import saved_tensors
from cs336_systems.measure.provenance import write_rows
from cs336_systems.measure.timing import is_oom, resolve_device, rows_or_oom
from cs336_systems.model.sizes import MODEL_SIZES
from cs336_systems.model.transformer import ModelConfig

ATTENTION = {"naive": "naive", "flash": "flash_triton"}  # our name -> the model's attention option


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    p.add_argument("--size", choices=list(MODEL_SIZES), required=True, help="d_model and d_ff of this size")
    p.add_argument("--batch-size", type=cli.positive_int, default=4, help="sequences per batch")
    p.add_argument("--context-length", type=cli.positive_int, required=True, help="tokens per sequence")
    p.add_argument(
        "--heads", type=cli.positive_int, nargs="+", required=True, help="head counts of the block"
    )
    p.add_argument(
        "--modules",
        nargs="+",
        choices=saved_tensors.MODULES,
        default=list(saved_tensors.MODULES),
        help="what to run forward",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        choices=saved_tensors.MODES,
        default=list(saved_tensors.MODES),
        help="eager, and/or compiled with torch.compile",
    )
    p.add_argument(
        "--attention",
        nargs="+",
        choices=list(ATTENTION),
        default=list(ATTENTION),
        help="the block's attention: naive (materialised softmax) or flash (our Triton kernels)",
    )
    cli.add_device(p)
    args = p.parse_args(argv)
    for heads in args.heads:  # every block must be buildable before any work starts
        try:
            model_config(args, heads, "naive")
        except ValueError as error:
            p.error(f"--heads {heads}: {error}")
    return args


def model_config(args: argparse.Namespace, heads: int, attention: str) -> ModelConfig:
    return ModelConfig.from_name(
        args.size,
        num_heads=heads,
        num_layers=1,
        context_length=args.context_length,
        attention=ATTENTION[attention],
    )


def configurations(args: argparse.Namespace):
    """(module, mode, attention, heads): RMSNorm has no attention or heads."""
    for module, mode in itertools.product(args.modules, args.modes):
        if module == "rmsnorm":
            yield module, mode, "none", args.heads[0]
            continue
        for attention, heads in itertools.product(args.attention, args.heads):
            yield module, mode, attention, heads


def config_rows(args, module: str, mode: str, attention: str, heads: int, device) -> list[dict]:
    cfg = model_config(args, heads, "naive" if attention == "none" else attention)
    base = {
        "module": module,
        "mode": mode,
        "attention": attention,
        "heads": heads if module == "block" else None,
        "size": args.size,
        "batch_size": args.batch_size,
        "context_length": args.context_length,
        "d_model": cfg.d_model,
        "d_ff": cfg.d_ff,
    }
    rows = []
    if mode == "eager":  # the analytic count is of eager autograd
        analytic = saved_tensors.analytic_residuals(
            module, args.batch_size, cfg.context_length, cfg.d_model, cfg.d_ff, heads, cfg.attention
        )
        rows += [{**base, "source": "analytic", "status": "ok", **r} for r in analytic]
    measured = {**base, "source": "measured"}
    reason = saved_tensors.flash_unavailable(cfg, device) if attention == "flash" else None
    if reason:
        return [*rows, {**measured, "status": "skipped", "reason": reason}]

    def measure() -> list[dict]:
        try:
            records = saved_tensors.measure(module, mode, cfg, args.batch_size, device, args.seed)
        except Exception as exc:  # noqa: BLE001 - a compiler that cannot run here skips the configuration
            if mode != "compiled" or is_oom(exc):
                raise
            first_line = (str(exc).strip().splitlines() or [""])[0]
            return [
                {
                    **measured,
                    "status": "skipped",
                    "reason": f"torch.compile failed: {type(exc).__name__}: {first_line[:300]}",
                }
            ]
        return [{**measured, "status": "ok", **r} for r in records]

    cell = f"{module} {mode} attention={attention} heads={heads}"
    return rows + rows_or_oom("residuals", cell, measure, lambda: [{**measured, "status": "OOM"}])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = resolve_device(args.device)
    triton_interpreter.use_off_cuda(device)
    rows = []
    for module, mode, attention, heads in configurations(args):
        rows += config_rows(args, module, mode, attention, heads, device)
    write_rows(rows, args.out, cli.params(args))


if __name__ == "__main__":
    main()
