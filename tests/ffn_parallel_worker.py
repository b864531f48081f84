"""Worker for tests/test_ffn_parallel.py, run by the real launcher:
    python -m torch.distributed.run --standalone --nproc-per-node N tests/ffn_parallel_worker.py

On every rank, for several (B, D, D_FF): the FFN under DP, FSDP and TP over all ranks (and, at 4 and 6 ranks, 2D FSDP x
TP on a 2 x 2 or 2 x 3 DeviceMesh) equals the single-device FFN's forward and autograd backward (float64), and its counted
matmul FLOPs and ring bytes equal cs336_systems.parallelism's expressions. A mismatch raises, ending the job.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from cs336_systems import ffn_parallel
from cs336_systems import parallelism as p
from cs336_systems.distributed import distributed

SHAPES = [(12, 12, 24), (24, 12, 36)]  # (B, D, D_FF), each divisible as the shardings need at 2, 3, 4 and 6 ranks
MESHES = {4: (2, 2), 6: (2, 3)}  # world size -> (N_FSDP, N_TP) of the 2D check
BYTES_PER_FP16 = {torch.float64: 4}  # the formulas count fp16 (2 bytes); these tensors are float64 (8)


def expression(question: str, quantity: str) -> p.sp.Expr:
    (a,) = [a for a in p.all_answers() if a.question == question and a.quantity.startswith(quantity)]
    return a.expr


def reference(x, w1, w2, w3, dy) -> dict[str, torch.Tensor]:
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w3)]
    xl, w1l, w2l, w3l = leaves
    y = (torch.nn.functional.silu(xl @ w1l) * (xl @ w2l)) @ w3l
    y.backward(dy)
    return {"y": y.detach(), "dx": xl.grad, "dW1": w1l.grad, "dW2": w2l.grad, "dW3": w3l.grad}


def expect(counted: ffn_parallel.Counted, flops: dict, bytes_sent: dict, at: dict, what: str) -> None:
    for phase, expr in flops.items():
        assert counted.flops[phase] == int(expr.subs(at)), (what, phase, counted.flops[phase], expr.subs(at))
    for phase, time in bytes_sent.items():
        expected = int(time.subs(at) * at[p.W] * BYTES_PER_FP16[torch.float64])
        assert counted.traffic[phase].bytes_sent == expected, (what, phase, counted.traffic[phase], expected)


def close(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m: f"{what}: {m}")


def check_1d(rank: int, world: int, tensors: list[torch.Tensor], ref: dict, at: dict) -> None:
    def chunk(t, dim=0):
        return t.chunk(world, dim)[rank]

    dp = ffn_parallel.data_parallel(*tensors)
    for name, want in {"y": chunk(ref["y"]), "dx": chunk(ref["dx"]), "dW1": ref["dW1"], "dW2": ref["dW2"],
                       "dW3": ref["dW3"]}.items():
        close(f"DP {name}", dp.outputs[name], want)
    expect(dp, {"forward": expression("8.3(a)", "forward FLOPs").subs(p.N_FSDP, p.N_DP),
                "backward": expression("8.2(a)", "backward FLOPs")},
           {"backward": expression("8.2(b)", "backward comm")}, at, "DP")

    fs = ffn_parallel.fsdp(*tensors)
    for name in ("y", "dx", "dW1", "dW2", "dW3"):
        close(f"FSDP {name}", fs.outputs[name], chunk(ref[name]))
    expect(fs, {"forward": expression("8.3(a)", "forward FLOPs"), "backward": expression("8.3(a)", "backward FLOPs")},
           {"forward": expression("8.3(b)", "forward comm"), "backward": expression("8.3(b)", "backward comm")},
           at, "FSDP")

    tp = ffn_parallel.tensor_parallel(*tensors)
    for name, want in {"y": ref["y"], "dx": ref["dx"], "dW1": chunk(ref["dW1"], 1), "dW2": chunk(ref["dW2"], 1),
                       "dW3": chunk(ref["dW3"])}.items():
        close(f"TP {name}", tp.outputs[name], want)
    expect(tp, {"forward": expression("8.4(b)", "forward FLOPs"), "backward": expression("8.4(b)", "backward FLOPs")},
           {"forward": expression("8.4(c)", "forward comm"), "backward": expression("8.4(c)", "backward comm")},
           at, "TP")


def check_2d(mesh, tensors: list[torch.Tensor], ref: dict, at: dict) -> None:
    fsdp_group, tp_group = mesh.get_group("fsdp"), mesh.get_group("tp")
    counted = ffn_parallel.fsdp_tp_forward(*tensors[:4], fsdp_group=fsdp_group, tp_group=tp_group)
    want = ref["y"].chunk(dist.get_world_size(fsdp_group))[dist.get_rank(fsdp_group)]
    close("2D y", counted.outputs["y"], want)
    expect(counted, {"forward": expression("8.5(a)", "forward FLOPs")},
           {"forward_fsdp": p.fsdp_axis_time(), "forward_tp": p.tp_axis_time()}, at, "2D")


def main() -> None:
    with distributed("gloo") as ctx:
        shape = MESHES.get(ctx.world_size)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("fsdp", "tp")) if shape else None
        generator = torch.Generator().manual_seed(0)  # the same full tensors on every rank
        for batch, d_model, d_ff in SHAPES:
            shapes = [(batch, d_model), (d_model, d_ff), (d_model, d_ff), (d_ff, d_model), (batch, d_model)]
            tensors = [torch.randn(s, generator=generator, dtype=torch.float64) for s in shapes]
            ref = reference(*tensors)
            n = ctx.world_size
            at = {p.B: batch, p.D: d_model, p.D_FF: d_ff, p.W: 1, p.N_DP: n, p.N_FSDP: n, p.N_TP: n}
            check_1d(ctx.rank, n, tensors, ref, at)
            if mesh is not None:
                check_2d(mesh, tensors, ref, {**at, p.N_FSDP: shape[0], p.N_TP: shape[1]})
        print(f"FFN parallel OK on rank {ctx.rank} of {ctx.world_size}", flush=True)


if __name__ == "__main__":
    main()
