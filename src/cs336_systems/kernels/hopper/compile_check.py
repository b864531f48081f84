"""Compile the Hopper tier's Gluon kernels for sm_90 on any machine (no GPU needed) and report their resources.

    python -m cs336_systems.kernels.hopper.compile_check [--all]

Triton compiles for a named target (`GPUTarget("cuda", 90, 32)`) with the ptxas its wheel bundles; the
resources come from the cubin: registers per thread at launch (`REG`, the `maxnreg` the launch reserves),
the registers the partitions ask for with `setmaxnreg`, the highest register the SASS touches, local memory
and spill instructions (LDL/STL), those inside the innermost loops that issue wgmma (the main loops, where a
spill costs every key tile), shared memory, and whether the tensor-core instructions are HGMMA (wgmma), not HMMA.
A kernel passes with no spill in a main loop and at most SPILL_BOUND spill instructions elsewhere (the persistent
forward keeps a few values per work item in local memory around its main loop). The configs are the launchers' own
(`forward_config`, `backward_config`), so what is checked here is what runs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cs336_systems.kernels.hopper.flash_attention import (
    DTYPES,
    HEAD_DIMS,
    _smem_layout,
    backward_config,
    forward_config,
)

_TORCH_TO_TRITON = {torch.bfloat16: "bf16", torch.float16: "fp16"}
SEQ_LENS = (1024, 32768)  # a short and a long sequence: the configs the launchers pick for each
KERNELS = ("fwd", "bwd", "bwd_rope")  # the backward with and without RoPE's backward in its epilogue
SPILL_BOUND = 64  # spill instructions allowed outside the main loops


@dataclass
class Report:
    """What one compiled kernel uses on sm_90."""

    kernel: str
    dtype: str
    head_dim: int
    causal: bool
    config: str
    launch_regs: int | None = None  # registers per thread the launch reserves (REG)
    setmaxnreg: list[int] = field(default_factory=list)  # what the partitions ask for at run time
    max_reg_used: int | None = None  # highest register index in the SASS, plus one
    spill_bytes: int | None = None  # ptxas's spill stores + loads, where its log was seen
    spill_instructions: int | None = None  # LDL/STL in the SASS
    loop_spill_instructions: int | None = None  # LDL/STL in the innermost loops that issue HGMMA
    local_bytes: int | None = None
    shared_bytes: int = 0
    hgmma: int = 0  # HGMMA instructions in the SASS
    hmma: int = 0

    @property
    def spills(self) -> bool:
        return bool(self.spill_instructions or self.local_bytes or self.spill_bytes)

    @property
    def acceptable(self) -> bool:
        """Whether the spills are few and outside the main loops (and wgmma is what the tensor cores run)."""
        return (
            self.loop_spill_instructions == 0
            and (self.spill_instructions or 0) <= SPILL_BOUND
            and not self.local_bytes
            and self.hgmma > 0
            and self.hmma == 0
        )

    def line(self) -> str:
        return (
            f"{self.kernel:8s} {self.dtype:4s} d={self.head_dim:<3d} causal={self.causal!s:5s} {self.config:26s} "
            f"regs {self.launch_regs} (setmaxnreg {'/'.join(map(str, sorted(set(self.setmaxnreg)))) or '-'}, "
            f"max used {self.max_reg_used})  spills {'YES' if self.spills else 'none'} "
            f"(LDL/STL {self.spill_instructions}, in main loops {self.loop_spill_instructions}, local {self.local_bytes} B)  smem {self.shared_bytes / 1024:.1f} KiB  "
            f"HGMMA {self.hgmma}  HMMA {self.hmma}"
        )


def available() -> str | None:
    """Why compiling for sm_90 here cannot work, or None."""
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.experimental.gluon._runtime import GluonASTSource  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the installed triton
        return f"triton with gluon is not importable: {e!r}"
    for tool in ("ptxas", "cuobjdump"):
        if _nvidia_tool(tool) is None:
            return f"{tool} is missing (Triton's wheel bundles it)"
    return None


def _nvidia_tool(name: str) -> str | None:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(path) if path.exists() else shutil.which(name)


def _desc(dtype: torch.dtype, block_shape: list[int]) -> str:
    """The signature type of a TMA descriptor with the launcher's own shared-memory layout."""
    layout = _smem_layout(dtype, tuple(block_shape))
    name = {**_TORCH_TO_TRITON, torch.float32: "fp32"}[dtype]
    return f"tensordesc<{name}[{','.join(map(str, block_shape))}],{layout!r}>"


def _signature(kernel: str, dtype: torch.dtype, d: int, bm: int, bn: int) -> dict:
    names = ("IS_CAUSAL", "BM", "BN", "D", "STAGES", "num_warps")
    names += ("PINGPONG", "CONS_REGS") if kernel == "fwd" else ("ROTATE",)
    constexprs = {name: "constexpr" for name in names}
    if kernel == "fwd":
        q, kv = _desc(dtype, [1, 64, d]), _desc(dtype, [1, bn, d])
        return {"q_desc": q, "k_desc": kv, "v_desc": kv, "o_desc": q, "L_ptr": "*fp32", "counter_ptr": "*i32",
                "N_QUERIES": "i32", "N_KEYS": "i32", "BH": "i32", "SECTION": "i32", "qk_scale": "fp32",
                **constexprs}  # fmt: skip
    q, kv, rows = _desc(dtype, [1, bm, d]), _desc(dtype, [1, bn, d]), _desc(torch.float32, [1, bm])
    return {"k_desc": kv, "v_desc": kv, "q_desc": q, "do_desc": q, "lse_desc": rows, "delta_desc": rows,
            "dk_desc": kv, "dv_desc": kv, "dq_desc": _desc(torch.float32, [1, bm, d]), "cos_ptr": "*fp32",
            "sin_ptr": "*fp32", "N_QUERIES": "i32", "N_KEYS": "i32", "qk_scale": "fp32", "scale": "fp32",
            **constexprs}  # fmt: skip


def compile_kernel(kernel: str, dtype: torch.dtype, head_dim: int, causal: bool, seq_len: int = 4096):
    """Compile the forward ("fwd") or backward kernel for sm_90, the backward plain ("bwd") or rotating dK back by
    RoPE's tables in its epilogue ("bwd_rope", as the model's attention runs it); returns (CompiledKernel, config,
    ptxas log)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from cs336_systems.kernels.hopper import _kernels

    cfg = (forward_config if kernel == "fwd" else backward_config)(head_dim, seq_len, causal)
    fn = _kernels.flash_fwd_kernel if kernel == "fwd" else _kernels.flash_bwd_kernel
    sig = _signature(kernel, dtype, head_dim, cfg.bm, cfg.bn)
    constexprs = {"IS_CAUSAL": causal, "BM": cfg.bm, "BN": cfg.bn, "D": head_dim, "STAGES": cfg.stages,
                  "num_warps": cfg.num_warps}  # fmt: skip
    if kernel == "fwd":
        constexprs |= {"PINGPONG": cfg.pingpong, "CONS_REGS": cfg.cons_regs}
    else:
        constexprs |= {"ROTATE": kernel == "bwd_rope"}
    src = GluonASTSource(fn, sig, constexprs=constexprs)
    log = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True  # printed only when ptxas runs (not from Triton's cache)
        compiled = triton.compile(
            src,
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": cfg.num_warps, "maxnreg": cfg.maxnreg},
        )
    return compiled, cfg, log.getvalue()


def inspect(kernel: str, dtype: torch.dtype, head_dim: int, causal: bool, seq_len: int = 4096) -> Report:
    compiled, cfg, log = compile_kernel(kernel, dtype, head_dim, causal, seq_len)
    report = Report(
        kernel, _TORCH_TO_TRITON[dtype], head_dim, causal,
        f"BM={cfg.bm} BN={cfg.bn} st={cfg.stages} w={cfg.num_warps}{' pp' if cfg.pingpong else ''}",
        shared_bytes=compiled.metadata.shared,
    )  # fmt: skip
    report.setmaxnreg = [
        int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", compiled.asm["ptx"])
    ]
    if m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log):
        report.spill_bytes = int(m[1]) + int(m[2])
    if m := re.search(r"Used (\d+) registers", log):
        report.launch_regs = int(m[1])
    cuobjdump = _nvidia_tool("cuobjdump")
    if cuobjdump is None:
        return report
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        res = subprocess.run([cuobjdump, "-res-usage", str(cubin)], capture_output=True, text=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True).stdout
    if m := re.search(r"REG:(\d+)", res):
        report.launch_regs = int(m[1])
    if m := re.search(r"LOCAL:(\d+)", res):
        report.local_bytes = int(m[1])
    registers = [int(r) for r in re.findall(r"\bR(\d+)\b", sass)]
    report.max_reg_used = max(registers) + 1 if registers else None
    report.spill_instructions = len(re.findall(r"\b(?:LDL|STL)\b", sass))
    report.loop_spill_instructions = main_loop_spills(sass)
    report.hgmma = len(re.findall(r"\bHGMMA\.", sass))
    report.hmma = len(re.findall(r"\bHMMA\.", sass))
    return report


def main_loop_spills(sass: str) -> int:
    """LDL/STL inside the innermost loops that issue HGMMA: each loop is a conditional backward branch's span of
    addresses (the unconditional ones return from the out-of-line retries of mbarrier waits)."""
    code = [(int(a, 16), text) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for address, text in code:
        m = re.search(r"^@!?P\d\s+BRA\b[^;]*?0x([0-9a-f]+)\s*$", text.strip())
        if m and int(m[1], 16) < address:
            loops.append((int(m[1], 16), address))
    issuing = [(lo, hi) for lo, hi in loops if any(lo <= a <= hi and "HGMMA" in t for a, t in code)]
    innermost = [
        (lo, hi)
        for lo, hi in issuing
        if not any((lo, hi) != (l2, h2) and lo <= l2 and h2 <= hi for l2, h2 in issuing)
    ]
    return sum(
        any(lo <= a <= hi for lo, hi in innermost) and re.search(r"\b(?:LDL|STL)\b", t) is not None
        for a, t in code
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--all", action="store_true", help="fp16 too (default: bf16 only; same code)")
    parser.add_argument("--kernel", choices=KERNELS, help="only this kernel")
    args = parser.parse_args(argv)
    if (why := available()) is not None:
        print(f"cannot compile for sm_90 here: {why}")
        return 1
    dtypes = DTYPES if args.all else (torch.bfloat16,)
    kernels = (args.kernel,) if args.kernel else KERNELS
    # the launchers choose by sequence length too: each distinct config once
    configs, seen = [], set()
    for k, t, d, c, n in itertools.product(kernels, dtypes, HEAD_DIMS, (True, False), SEQ_LENS):
        cfg = (forward_config if k == "fwd" else backward_config)(d, n, c)
        if (k, t, d, c, cfg) not in seen:
            seen.add((k, t, d, c, cfg))
            configs.append((k, t, d, c, n))
    bad = 0
    for config in configs:
        try:
            report = inspect(*config)
        except Exception as e:  # one failing kernel should not hide the others
            print(f"{config}: compile FAILED: {type(e).__name__}: {str(e)[:2000]}")
            bad += 1
            continue
        print(report.line())
        bad += not report.acceptable
    print("OK" if not bad else f"{bad} problem(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
