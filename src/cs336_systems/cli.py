"""What every experiment CLI shares: a parser with `--out`, whose help keeps the module docstring's layout and
shows every flag's default, argument types that reject a bad value by its flag before any work starts, the model
flags (a size by name, the batch, the attention), and the check that a CLI of several ranks was launched as such."""

from __future__ import annotations

import argparse

from cs336_systems.measure.timing import resolve_device
from cs336_systems.model.sizes import MODEL_SIZES
from cs336_systems.model.transformer import ATTENTION, ModelConfig

# The help of a flag that several CLIs (or the library's flag helpers) define with one meaning, where one gives none
SHARED_HELP = {
    "--context-length": "tokens per sequence",
    "--batch-size": "sequences per batch",
    "--backend": "the process group's backend (under the launcher: the launcher's --backend)",
}


class Parser(argparse.ArgumentParser):
    """A parser that also runs `checks`: functions of the parsed flags that raise ValueError where flags do not
    fit together (a checkpoint policy beyond the size's layers), reported as errors of the parse. A flag of
    SHARED_HELP added without help gets that help."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.checks: list = []

    def add_argument(self, *names, **kwargs):
        if not kwargs.get("help") and names and names[0] in SHARED_HELP:
            kwargs["help"] = SHARED_HELP[names[0]]
        return super().add_argument(*names, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        for check in self.checks:
            try:
                check(parsed)
            except ValueError as error:
                self.error(str(error))
        return parsed, rest


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """`--help` as the module docstring lays it out (its example commands keep their lines), and each flag's
    default after its help, where it has one worth showing (not None, not a switch's False, not a required
    flag's)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or any(action.default is hidden for hidden in (None, False, argparse.SUPPRESS)):
            return action.help
        return super()._get_help_string(action)


def parser(doc: str | None, seed: bool = True) -> argparse.ArgumentParser:
    """An experiment's parser: its module docstring as help, `--out` and (for runs with randomness) `--seed`."""
    p = Parser(description=doc, formatter_class=HelpFormatter)
    p.add_argument("--out", required=True, help="CSV to write (a .json provenance file goes beside it)")
    if seed:
        p.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")
    return p


def require_launcher(p: argparse.ArgumentParser, module: str) -> None:
    """For a CLI that runs as ranks of a process group (call it with `__name__` once its flags are checked):
    started without the launcher, an error of the parse (exit status 2) in one line that says how to start it."""
    # imported here: torch.distributed, which only the CLIs of ranks need
    from cs336_systems.parallel.distributed import how_to_launch, launched

    if not launched():  # argparse's error line without the usage, which says nothing about the launcher
        p.exit(2, f"{p.prog}: error: runs as the ranks of a process group: {how_to_launch(module)}\n")


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
    g.add_argument(
        "--attention", choices=sorted(ATTENTION), default="naive", help="the attention's implementation"
    )
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
    p.add_argument(
        "--context-lengths", type=positive_int, nargs="+", required=True, help="tokens per sequence"
    )
    p.add_argument(
        "--modes", nargs="+", choices=workload.MODES, default=list(workload.MODES), help="what a step runs"
    )
    p.add_argument("--warmup", type=nonnegative_int, default=warmup, help=f"steps before the {measured} ones")
    p.add_argument("--steps", type=positive_int, default=steps, help=f"{measured} steps")
    p.add_argument(
        "--autocast",
        choices=sorted(workload.AUTOCAST),
        default="none",
        help="torch.autocast's dtype, or none",
    )
