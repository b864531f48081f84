"""2026 §8 checked by running it (gloo): every ring collective against torch.distributed's own, every FFN strategy
against the single-device FFN (float64), and the bytes, steps and FLOPs counted during the run against the
expressions of cs336_systems.accounting.parallelism. Each check is a row:

    check, world_size, shape, quantity, counted, derived, passed

(a "max error" row has `derived` 0 and passes within 1e-12 of the reference's largest value).
tests/workers/ring_worker.py and tests/workers/ffn_parallel_worker.py assert that every row passes; the experiment
cs336_systems.experiments.parallelism_checks writes them for the writeup.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cs336_systems.accounting import parallelism as p
from cs336_systems.parallel import ffn_parallel
from cs336_systems.parallel.distributed import all_gather_flat, reduce_scatter_flat
from cs336_systems.parallel.ring_collectives import (
    Traffic,
    alternate_all_reduce,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)

TOLERANCE = 1e-12
FFN_SHAPES = [
    (12, 12, 24),
    (24, 12, 36),
]  # (B, D, D_FF), divisible as every sharding needs at 2, 3, 4 and 6 ranks
MESHES = {4: (2, 2), 6: (2, 3)}  # world size -> (N_FSDP, N_TP) of the 2D check
FLOAT64_PER_FP16 = 4  # the expressions count fp16 (2 bytes); the runs send float64 (8)


def _row(check: str, shape, quantity: str, counted: float, derived: float) -> dict:
    passed = abs(counted) <= TOLERANCE if quantity.startswith("max error") else counted == derived
    return {
        "check": check,
        "world_size": dist.get_world_size(),
        "shape": "x".join(map(str, shape)),
        "quantity": quantity,
        "counted": float(counted),
        "derived": float(derived),
        "passed": bool(passed),
    }


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()


def _traffic_rows(check: str, collective: str, shape, size_bytes: int, traffic: Traffic) -> list[dict]:
    at = {p.S: size_bytes, p.N: dist.get_world_size()}
    return [
        _row(
            check, shape, "bytes sent", traffic.bytes_sent, int(p.bytes_sent_per_device(collective).subs(at))
        ),
        _row(check, shape, "steps", traffic.steps, int(p.COLLECTIVE_STEPS[collective].subs(at))),
    ]


def ring_collective_rows(rows: int, generator: torch.Generator) -> list[dict]:
    """The four §8.1 collectives on a (rows, 5) float64 tensor, different on every rank (`rows` divisible by the
    world size): each against torch.distributed's, its input left unchanged, its bytes and steps."""
    world = dist.get_world_size()
    x = torch.randn(rows, 5, generator=generator, dtype=torch.float64) * (dist.get_rank() + 1)
    size, shape, out = x.numel() * x.element_size(), tuple(x.shape), []
    reference = x.clone()
    dist.all_reduce(reference)
    for name, algorithm in [("all_reduce", ring_all_reduce), ("alternate_all_reduce", alternate_all_reduce)]:
        traffic, before = Traffic(), x.clone()
        result = algorithm(x, traffic)
        out.append(_row(f"ring {name}", shape, "max error", _error(result, reference), 0))
        out.append(_row(f"ring {name}", shape, "input unchanged", float(torch.equal(x, before)), 1.0))
        out += _traffic_rows(f"ring {name}", name, shape, size, traffic)
    traffic, reference = Traffic(), torch.empty(rows // world, 5, dtype=x.dtype)
    reduce_scatter_flat(reference, x)
    out.append(
        _row("ring reduce_scatter", shape, "max error", _error(ring_reduce_scatter(x, traffic), reference), 0)
    )
    out += _traffic_rows("ring reduce_scatter", "reduce_scatter", shape, size, traffic)
    traffic, chunk = Traffic(), x[: rows // world].clone()
    reference = torch.empty_like(x)
    all_gather_flat(reference, chunk)
    out.append(
        _row("ring all_gather", shape, "max error", _error(ring_all_gather(chunk, traffic), reference), 0)
    )
    out += _traffic_rows("ring all_gather", "all_gather", shape, size, traffic)
    return out


def _expression(question: str, quantity: str) -> p.sp.Expr:
    (answer,) = [a for a in p.all_answers() if a.question == question and a.quantity.startswith(quantity)]
    return answer.expr


def single_device_ffn(x, w1, w2, w3, dy) -> dict[str, torch.Tensor]:
    """The FFN's output and gradients by autograd, on one device."""
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w3)]
    xl, w1l, w2l, w3l = leaves
    y = (torch.nn.functional.silu(xl @ w1l) * (xl @ w2l)) @ w3l
    y.backward(dy)
    return {"y": y.detach(), "dx": xl.grad, "dW1": w1l.grad, "dW2": w2l.grad, "dW3": w3l.grad}


def _strategy_rows(check, shape, counted, want: dict, flops: dict, comm: dict, at: dict) -> list[dict]:
    out = [
        _row(check, shape, f"max error {name}", _error(counted.outputs[name], tensor), 0)
        for name, tensor in want.items()
    ]
    for phase, expr in flops.items():
        out.append(_row(check, shape, f"{phase} FLOPs", counted.flops[phase], int(expr.subs(at))))
    for phase, time in comm.items():  # a time at W = 1 byte/s is the bytes sent
        derived = int(time.subs(at) * FLOAT64_PER_FP16)
        out.append(_row(check, shape, f"{phase} bytes sent", counted.traffic[phase].bytes_sent, derived))
    return out


def ffn_rows(shape: tuple[int, int, int], mesh=None) -> list[dict]:
    """The FFN of (B, D, D_FF) under DP, FSDP and TP over all ranks, and under 2D FSDP x TP on `mesh` (dims
    "fsdp", "tp") if given: outputs and gradients against the single device's, FLOPs and bytes against §8.2–8.5."""
    batch, d_model, d_ff = shape
    generator = torch.Generator().manual_seed(0)  # the same full tensors on every rank
    sizes = [(batch, d_model), (d_model, d_ff), (d_model, d_ff), (d_ff, d_model), (batch, d_model)]
    tensors = [torch.randn(s, generator=generator, dtype=torch.float64) for s in sizes]
    ref = single_device_ffn(*tensors)
    rank, n = dist.get_rank(), dist.get_world_size()
    at = {p.B: batch, p.D: d_model, p.D_FF: d_ff, p.W: 1, p.N_DP: n, p.N_FSDP: n, p.N_TP: n}

    def chunk(t, dim=0):
        return t.chunk(n, dim)[rank]

    rows = _strategy_rows(
        "FFN DP",
        shape,
        ffn_parallel.data_parallel(*tensors),
        {
            "y": chunk(ref["y"]),
            "dx": chunk(ref["dx"]),
            "dW1": ref["dW1"],
            "dW2": ref["dW2"],
            "dW3": ref["dW3"],
        },
        {
            "forward": _expression("8.3(a)", "forward FLOPs").subs(p.N_FSDP, p.N_DP),
            "backward": _expression("8.2(a)", "backward FLOPs"),
        },
        {"backward": _expression("8.2(b)", "backward comm")},
        at,
    )
    rows += _strategy_rows(
        "FFN FSDP",
        shape,
        ffn_parallel.fsdp(*tensors),
        {k: chunk(ref[k]) for k in ("y", "dx", "dW1", "dW2", "dW3")},
        {
            "forward": _expression("8.3(a)", "forward FLOPs"),
            "backward": _expression("8.3(a)", "backward FLOPs"),
        },
        {
            "forward": _expression("8.3(b)", "forward comm"),
            "backward": _expression("8.3(b)", "backward comm"),
        },
        at,
    )
    rows += _strategy_rows(
        "FFN TP",
        shape,
        ffn_parallel.tensor_parallel(*tensors),
        {
            "y": ref["y"],
            "dx": ref["dx"],
            "dW1": chunk(ref["dW1"], 1),
            "dW2": chunk(ref["dW2"], 1),
            "dW3": chunk(ref["dW3"]),
        },
        {
            "forward": _expression("8.4(b)", "forward FLOPs"),
            "backward": _expression("8.4(b)", "backward FLOPs"),
        },
        {
            "forward": _expression("8.4(c)", "forward comm"),
            "backward": _expression("8.4(c)", "backward comm"),
        },
        at,
    )
    if mesh is not None:
        fsdp_group, tp_group = mesh.get_group("fsdp"), mesh.get_group("tp")
        n_fsdp, n_tp = dist.get_world_size(fsdp_group), dist.get_world_size(tp_group)
        counted = ffn_parallel.fsdp_tp_forward(*tensors[:4], fsdp_group=fsdp_group, tp_group=tp_group)
        rows += _strategy_rows(
            f"FFN 2D FSDP x TP ({n_fsdp} x {n_tp})",
            shape,
            counted,
            {"y": ref["y"].chunk(n_fsdp)[dist.get_rank(fsdp_group)]},
            {"forward": _expression("8.5(a)", "forward FLOPs")},
            {"forward_fsdp": p.fsdp_axis_time(), "forward_tp": p.tp_axis_time()},
            {**at, p.N_FSDP: n_fsdp, p.N_TP: n_tp},
        )
    return rows
