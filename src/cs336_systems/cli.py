"""What every experiment CLI shares: a parser with `--out`, argument types that reject a bad value by its flag
before any work starts, and the model flags (a size by name, the batch, the attention)."""

from __future__ import annotations

import argparse

from cs336_systems.measure.timing import resolve_device
from cs336_systems.model.sizes import MODEL_SIZES
from cs336_systems.model.transformer import ATTENTION, ModelConfig


class Parser(argparse.ArgumentParser):
    """A parser that also runs `checks`: functions of the parsed flags that raise ValueError where flags do not
    fit together (a checkpoint policy beyond the size's layers), reported as errors of the parse."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.checks: list = []

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        for check in self.checks:
            try:
                check(parsed)
            except ValueError as error:
                self.error(str(error))
        return parsed, rest


def parser(doc: str | None, seed: bool = True) -> argparse.ArgumentParser:
    """An experiment's parser: its module docstring as help, `--out` and (for runs with randomness) `--seed`."""
    p = Parser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="CSV to write (a .json provenance file goes beside it)")
    if seed:
        p.add_argument("--seed", type=int, default=0)
    return p


def _number(kind: type, lowest: float, inclusive: bool, words: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}"
            ) from None
        if value < lowest or (value == lowest and not inclusive):
            raise argparse.ArgumentTypeError(f"must be {words}, got {text}")
        return value

    parse.__name__ = words  # argparse names the type in some messages
    return parse


positive_int = _number(int, 1, True, ">= 1")
nonnegative_int = _number(int, 0, True, ">= 0")
positive_float = _number(float, 0.0, False, "> 0")


def head_dim(text: str) -> int:
    """A head dim our Triton FlashAttention takes (imports triton: only where a head dim is asked for)."""
    from cs336_systems.kernels.flash_triton import unsupported_head_dim

    try:
        d = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if (problem := unsupported_head_dim(d)) is not None:
        raise argparse.ArgumentTypeError(problem)
    return d


def device(name: str) -> str:
    """`--device`: checked at parse time (an unknown device, or CUDA without a GPU, is an error), kept as given."""
    try:
        resolve_device(name)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return name


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device", type=device, default="auto", help="auto (CUDA where present), cpu, cuda or cuda:N"
    )


def add_model_args(p: argparse.ArgumentParser, batch_size: int = 4) -> None:
    """The flags that define a model and its batch; shared by every experiment that runs the Transformer."""
    g = p.add_argument_group("model")
    g.add_argument(
        "--size", choices=list(MODEL_SIZES), required=True, help="model size (cs336_systems.model.sizes)"
    )
    g.add_argument(
        "--batch-size", type=positive_int, default=batch_size, help="sequences per batch (per rank)"
    )
    g.add_argument("--attention", choices=sorted(ATTENTION), default="naive")
    g.add_argument(
        "--checkpoint",
        default="none",
        help="activation checkpointing: none, every:K, nested, selective or selective:attention",
    )
    if isinstance(p, Parser):  # the policy is checked against the size's number of layers
        p.checks.append(lambda args: ModelConfig.from_name(args.size, checkpoint=args.checkpoint))


def model_config(args: argparse.Namespace, context_length: int) -> ModelConfig:
    return ModelConfig.from_name(
        args.size, context_length=context_length, attention=args.attention, checkpoint=args.checkpoint
    )


def params(args: argparse.Namespace) -> dict:
    """The parameters recorded beside the results: the flags, plus the dimensions of the named size, so a result
    still says which model ran if the size table changes (and the report reads them from there)."""
    recorded = dict(vars(args))
    if getattr(args, "size", None) in MODEL_SIZES:
        recorded.update(MODEL_SIZES[args.size], vocab_size=ModelConfig.vocab_size)
    return recorded


def add_step_sweep_args(p: argparse.ArgumentParser, warmup: int, steps: int, measured: str = "timed") -> None:
    """The flags of a sweep that measures the Transformer's step (workload.MODES) per context length: the model
    and device flags, `--context-lengths`, `--modes`, `--warmup` and `--steps` (`measured` says how the steps
    are measured), `--autocast`."""
    from cs336_systems.training import (
        workload,  # only the CLIs that run the workload need it (and list it as code)
    )

    add_model_args(p)
    add_device(p)
    p.add_argument("--context-lengths", type=positive_int, nargs="+", required=True)
    p.add_argument("--modes", nargs="+", choices=workload.MODES, default=list(workload.MODES))
    p.add_argument("--warmup", type=nonnegative_int, default=warmup, help=f"steps before the {measured} ones")
    p.add_argument("--steps", type=positive_int, default=steps, help=f"{measured} steps")
    p.add_argument("--autocast", choices=sorted(workload.AUTOCAST), default="none")
