"""Check and time the Hopper tier on an H100/H200 in one call:

    python -m cs336_systems.kernels.hopper.devcheck [--quick] [--no-timing] [--no-check] [--shapes 'b,h,N,d;...']
        [--variants hopper,triton,sdpa_cudnn,sdpa_flash] [--configs 'fwd=bm,bn,st,pingpong/bwd=bm,bn,st;...']

(1) correctness against float64 attention at a few shapes, odd lengths included: max relative errors of O, L,
dQ, dK, dV and PASS/FAIL per case; (2) medians of `triton.testing.do_bench`, bf16 causal, forward / backward /
forward+backward, for the Hopper tier, the portable Triton tier (`flash_triton`, autotuned on first use: its
first shapes take minutes) and `scaled_dot_product_attention` pinned to cuDNN and to FlashAttention, in ms and
TFLOP/s (causal forward FLOPs = 2 N^2 d heads batch; backward 2.5x, forward+backward 3.5x); (3) each compiled
Hopper kernel's registers, spills and shared memory. Every case and variant catches its own exception.
"""

from __future__ import annotations

import argparse
import math
import traceback

import torch

from cs336_systems.kernels import hopper
from cs336_systems.kernels.hopper import flash_attention as hopper_fa

TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 1e-2}
# (batch*heads, N_q, N_k, d, causal, dtype)
CHECKS = [
    (2, 1, 1, 64, True, torch.bfloat16),
    (3, 17, 17, 128, True, torch.bfloat16),
    (3, 130, 130, 64, False, torch.float16),
    (2, 1000, 1000, 128, True, torch.float16),
    (2, 1537, 1537, 64, True, torch.bfloat16),
    (1, 1537, 1537, 128, False, torch.bfloat16),
    (2, 2048, 2048, 128, True, torch.bfloat16),
    (2, 1024, 1024, 64, False, torch.bfloat16),
    (2, 300, 100, 128, True, torch.bfloat16),
    (2, 100, 300, 64, True, torch.float16),
]
# (batch, heads, tokens, head dim)
TIMINGS = [(1, 32, 32768, 128), (1, 16, 16384, 64), (4, 16, 2048, 64), (8, 32, 1024, 128)]
VARIANTS = ["hopper", "triton", "sdpa_cudnn", "sdpa_flash"]
# Configs to compare, each "fwd=bm,bn,stages,pingpong/bwd=bm,bn,stages" (either part may be left out;
# through the HOPPER_FWD and HOPPER_BWD variables); empty: the launchers' own.
CONFIGS: list[str] = []


def _set_config(cfg: str) -> None:
    import os

    parts = dict(part.split("=") for part in cfg.split("/")) if cfg else {}
    for key, var in (("fwd", "HOPPER_FWD"), ("bwd", "HOPPER_BWD")):
        if key in parts:
            os.environ[var] = parts[key]
        else:
            os.environ.pop(var, None)


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |error| / max |reference|; the absolute error where the reference is exactly zero (N = 1: dQ and
    dK vanish, one key gets all the weight), so that the kernel's output must be ~0 there."""
    scale = expected.abs().max().item()
    return ((actual.double() - expected).abs().max() / (scale if scale > 0 else 1.0)).item()


def _reference(q, k, v, do, causal):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = q64 @ k64.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    o = torch.softmax(s, dim=-1) @ v64
    o.backward(do.double())
    return o.detach(), torch.logsumexp(s, dim=-1).detach(), q64.grad, k64.grad, v64.grad


def check_correctness(label: str = "") -> int:
    failures = 0
    print(f"== correctness against float64 (max |error| / max |reference|) {label}==")
    for i, (b, n_q, n_k, d, causal, dtype) in enumerate(CHECKS):
        name = f"b={b} Nq={n_q} Nk={n_k} d={d} {'causal' if causal else 'full'} {str(dtype)[6:]}"
        try:
            g = torch.Generator(device="cuda").manual_seed(i)
            q, do = (torch.randn(b, n_q, d, generator=g, device="cuda").to(dtype) for _ in range(2))
            k, v = (torch.randn(b, n_k, d, generator=g, device="cuda").to(dtype) for _ in range(2))
            o, lse = hopper.forward(q, k, v, causal)
            grads = hopper.backward(q, k, v, o, do, lse, causal)
            torch.cuda.synchronize()
            expected = _reference(q, k, v, do, causal)
            names = ("O", "L", "dQ", "dK", "dV")
            errors = {
                key: _rel_err(a, e) for key, a, e in zip(names, (o, lse, *grads), expected, strict=True)
            }
            ok = all(e < TOLERANCE[dtype] for e in errors.values())  # NaN fails
            failures += not ok
            print(
                f"{'PASS' if ok else 'FAIL'} {name}: " + "  ".join(f"{k} {e:.2e}" for k, e in errors.items())
            )
        except Exception as e:
            failures += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}")
            traceback.print_exc(limit=3)
    return failures


def _variants(q4, k4, v4, do4):
    """name -> (forward, backward, forward+backward) closures for one (batch, heads, seq, d) input."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cs336_systems.kernels import flash_triton

    b, h, n, d = q4.shape
    flat = [t.reshape(b * h, n, d).contiguous() for t in (q4, k4, v4, do4)]
    out = {}

    def ours(fwd, bwd):
        q, k, v, do = flat
        o, lse = fwd(q, k, v, True)
        return (
            lambda: fwd(q, k, v, True),
            lambda: bwd(q, k, v, o, do, lse, True),
            _fwd_bwd(fwd, bwd, q, k, v, do),
        )

    for cfg in CONFIGS or [""]:

        def make(cfg=cfg):
            _set_config(cfg)
            return ours(hopper.forward, hopper.backward)

        out["hopper" + (f"[{cfg}]" if cfg else "")] = make
    out["triton"] = lambda: ours(flash_triton.flash_forward, flash_triton.flash_backward)

    def sdpa(backend):
        def make():
            q, k, v = (t.detach().requires_grad_() for t in (q4, k4, v4))
            attn = torch.nn.functional.scaled_dot_product_attention

            def fwd():
                with sdpa_kernel(backend), torch.no_grad():
                    return attn(q, k, v, is_causal=True)

            with sdpa_kernel(backend):
                o = attn(q, k, v, is_causal=True)

            def bwd():
                return torch.autograd.grad(o, (q, k, v), do4, retain_graph=True)

            def fwd_bwd():
                with sdpa_kernel(backend):
                    o2 = attn(q, k, v, is_causal=True)
                return torch.autograd.grad(o2, (q, k, v), do4)

            return fwd, bwd, fwd_bwd

        return make

    out["sdpa_cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    out["sdpa_flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
    return out


def _fwd_bwd(fwd, bwd, q, k, v, do):
    def run():
        o, lse = fwd(q, k, v, True)
        return bwd(q, k, v, o, do, lse, True)

    return run


def time_all() -> None:
    import triton

    print("\n== timings: bf16, causal, do_bench medians (ms, TFLOP/s) ==")
    print(f"{'shape (b, h, N, d)':24s} {'variant':11s} {'fwd':>16s} {'bwd':>16s} {'fwd+bwd':>16s}")
    for b, h, n, d in TIMINGS:
        g = torch.Generator(device="cuda").manual_seed(0)
        q4, k4, v4, do4 = (
            torch.randn(b, h, n, d, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(4)
        )
        flops = 2 * n * n * d * h * b  # causal forward
        for name, make in _variants(q4, k4, v4, do4).items():
            if name.split("[")[0] not in VARIANTS:
                continue
            cells = []
            try:
                fns = make()
            except Exception as e:
                print(f"{str((b, h, n, d)):24s} {name:11s} setup failed: {type(e).__name__}: {str(e)[:300]}")
                continue
            for fn, mult in zip(fns, (1.0, 2.5, 3.5), strict=True):
                try:
                    if "[" in name:
                        _set_config(name[name.index("[") + 1 : -1])
                    ms = triton.testing.do_bench(fn, return_mode="median")
                    cells.append(f"{ms:8.3f} {flops * mult / ms / 1e9:6.1f}")
                except Exception as e:
                    cells.append(f"{'ERR ' + type(e).__name__:>16s}")
                    print(f"  {name} failed: {type(e).__name__}: {str(e)[:300]}")
            print(f"{str((b, h, n, d)):24s} {name:11s} " + " ".join(f"{c:>16s}" for c in cells))
        del q4, k4, v4, do4
        torch.cuda.empty_cache()


def print_kernel_resources() -> None:
    print("\n== compiled Hopper kernels (registers per thread at launch; consumers setmaxnreg to 240) ==")
    kernels = hopper_fa._kernels()
    for fn_name in ("flash_fwd_kernel", "flash_bwd_kernel", "bwd_preprocess_kernel", "dq_convert_kernel"):
        fn = getattr(kernels, fn_name)
        try:
            for cache in fn.device_caches.values():
                for compiled in cache[0].values():
                    compiled._init_handles()
                    c = compiled.metadata.constants if hasattr(compiled.metadata, "constants") else ""
                    print(
                        f"{fn_name:22s} n_regs {compiled.n_regs:3d}  n_spills {compiled.n_spills:3d}  "
                        f"shared {compiled.metadata.shared / 1024:6.1f} KiB  num_warps {compiled.metadata.num_warps}"
                        f"{'  ' + str(c) if c else ''}"
                    )
        except Exception as e:
            print(f"{fn_name}: could not read its compiled kernels: {type(e).__name__}: {e}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--no-timing", action="store_true", help="correctness and kernel resources only")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness cases")
    parser.add_argument("--quick", action="store_true", help="time only the two smaller shapes")
    parser.add_argument("--shapes", help="shapes to time, 'b,h,N,d;b,h,N,d' (default: all four)")
    parser.add_argument("--variants", help=f"comma-separated subset of {VARIANTS}")
    parser.add_argument(
        "--configs",
        help="Hopper configs to check and time: 'fwd=bm,bn,stages,pingpong/bwd=bm,bn,stages;...'",
    )
    args = parser.parse_args(argv)
    if args.shapes:
        TIMINGS[:] = [tuple(int(x) for x in sh.split(",")) for sh in args.shapes.split(";")]
    if args.variants:
        VARIANTS[:] = args.variants.split(",")
    if args.configs:
        CONFIGS[:] = args.configs.split(";")
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    print(f"device: {torch.cuda.get_device_name()} capability {torch.cuda.get_device_capability()}")
    print(f"supports(bf16, d=128): {hopper.supports(torch.device('cuda'), torch.bfloat16, 128, True)}")
    failures = 0
    for cfg in [] if args.no_check else CONFIGS or [""]:
        _set_config(cfg)
        failures += check_correctness(f"[{cfg}] " if cfg else "")
    _set_config("")
    if not args.no_timing:
        if args.quick:
            TIMINGS[:] = TIMINGS[2:]
        time_all()
    print_kernel_resources()
    print(f"\n{failures} correctness failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
