"""FlashAttention for Hopper (sm_90) in Gluon: TMA, mbarrier rings, warp specialisation and async wgmma.

The contract is `flash_triton`'s: (batch, seq, d) Q, K, V (batch = batch * heads flattened), O (contiguous, or
written into the `out` it is given, in place wherever TMA can span it) in the input dtype and the logsumexp L
(batch, N_q) in natural-log units, float32; causal masking top-left aligned
(query i sees keys j <= i). Inputs need not be contiguous: TMA reads any view whose rows are contiguous with
16-byte aligned strides (the model's V, a slice of its QKV projection, and the dO of its output projection, both
(heads, seq, d) views with rows `3 * heads * d` or `heads * d` apart), so only other layouts are copied.
`supports(...)` says where this tier runs: bf16 or fp16, head dim 64 or 128, a GPU of capability (9, 0), gluon
importable. Gluon is imported on first launch (the kernels live in `_kernels.py`), so importing this module never
fails on a CPU-only machine.

Design (FlashAttention-3 as far as Gluon in Triton 3.6 goes):

- Forward, persistent: one program per SM takes work items (a query tile of BM = 128 rows of one batch element)
  from a counter in global memory (zeroed by a launch of its own), in sections of one or two batch elements
  (`_section`) and, causal, the longest tiles first; the producer hands each item to the consumers through
  shared memory and loads the next item's Q, K and V while they finish the current one, so that a tile's
  prologue and epilogue no longer stand alone (measured: FINDINGS.md). `gl.warp_specialize` splits each program
  into a producer partition (one warp, 24 registers) that TMA-loads each consumer's 64 rows of Q once per item
  and K, V of each key tile into a STAGES-deep shared-memory ring guarded by ready/empty mbarriers (K and V on
  separate barriers, the ring running on across items), and two consumer partitions of one warpgroup each (the
  default partition, num_warps = 4, and a 4-warp worker; 240 registers after `setmaxnreg`), 64 query rows each.
  Being separate partitions, each arrives on the 'empty' barriers (count 2) with a barrier of its own 128
  threads only, so the warpgroups never wait for each other. Each runs S = Q K^T and O += P V as asynchronous
  wgmma with both accumulators in registers and P fed to the second wgmma from registers, software pipelined as
  FA3's intra-warpgroup overlap (S of tile i+1 and P V of tile i in flight while the softmax of tile i+1 runs),
  and at d = 128 the two take turns issuing their GEMMs (ping-pong through two 'turn' mbarriers), so that one's
  softmax runs under the other's GEMMs. Softmax in base 2 (exp2 of s * scale * log2(e) - m); only diagonal (and
  ragged last) tiles build a mask, tiles above the diagonal are never loaded. Each consumer writes its O rows
  through a shared-memory buffer of its own by a TMA store, and its L rows. At d = 64 up to 4,096 tokens a
  program has one consumer (BM = 64) and two programs share an SM.
- Backward, one program per (key tile of BN = 128 rows at d = 128, 64 at d = 64, batch element): the producer
  warp loads K, V once, then Q, dO, L log2(e) and Delta of each query tile (BM = 64) into a ring; the consumer
  warpgroups (64 keys each: two at d = 128; one at d = 64, two programs per SM) compute S^T = K Q^T and
  dP^T = V dO^T (in flight together), P^T, dV += P^T dO, dS^T, dK += dS^T Q by wgmma with the accumulators dK,
  dV in registers, and dQ = dS K by a wgmma reading dS from shared memory. Each query
  tile's dQ goes from registers to one of two shared-memory buffers, and the next tile issues a TMA reduce-add
  of it into a float32 buffer (FA3's reduction; Gluon 3.6 has the builder's op, wrapped here as
  `tma_reduce_add`), so the TMA unit adds dQ while the tensor cores run the next tile. The buffers are
  unswizzled and each row's columns permuted as the registers write them without bank conflicts
  (`_kernels.DQ_STORE_LAYOUT`); the float32 buffer is converted (times the softmax scale, the permutation undone)
  to the input dtype at the end, into any view whose rows are contiguous. Given RoPE's tables (`rope`), the
  conversion rotates dQ back and the epilogue dK (RoPE's backward, for `rope_attention`: both hold each feature
  pair in one thread), and dK, dV go by TMA into the projection's gradient where it lies. A small Gluon kernel
  first writes L log2(e) and Delta = rowsum(O * dO) into padded rows (TMA needs 16-byte aligned rows; padded
  queries get L = +inf, so their P is 0 without a mask) and zeroes the dQ buffer.
- Launches: after a shape's first, each kernel is launched from `flash_triton.CachedLaunch` (the compiled kernel's
  own launcher, no JIT dispatch); only the TMA descriptors are built per call.
- Descriptors are 3-D (batch, seq, d) with (1, tile, d) blocks: a tile never reads the next batch element's rows
  (TMA zero-fills rows past seq) and TMA stores clip them.

Not (yet) of FA3: FP8, a persistent backward (tried: no gain, FINDINGS.md), a separate dQ-writer warp (the
consumers issue the TMA reduction themselves), separate consumer partitions in the backward (its two warpgroups
share dS for dQ).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 128)
PRODUCER_REGS = 24  # the producer warp's registers (in _kernels: `gl.warp_specialize(..., [24])`)
_PREPROCESS_ROWS = 64
_CONVERT_ROWS = 16  # dQ's conversion: query rows per program


@functools.cache
def gluon_available() -> bool:
    """Whether Triton's Gluon with its Hopper ops imports here."""
    try:
        from triton.experimental import gluon  # noqa: F401
        from triton.experimental.gluon.language.nvidia.hopper import tma, warpgroup_mma  # noqa: F401
    except Exception:
        return False
    return True


def supports(device: torch.device, dtype: torch.dtype, head_dim: int, is_causal: bool) -> bool:
    """Whether this tier runs attention of this dtype and head dim on `device` (causal or not: both)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if dtype not in DTYPES or head_dim not in HEAD_DIMS:
        return False
    return _is_sm90(device) and gluon_available()


@functools.cache
def _is_sm90(device: torch.device) -> bool:  # cached: every launch checks its inputs
    return torch.cuda.get_device_capability(device) == (9, 0)


@dataclass(frozen=True)
class Config:
    """One kernel's tiles: BM query rows, BN key rows, a STAGES-deep ring, the default partition's warps and the
    registers per thread the launch reserves; for the forward also whether the consumer warpgroups ping-pong and
    the registers each consumer asks for."""

    bm: int
    bn: int
    stages: int
    num_warps: int
    maxnreg: int
    pingpong: bool = False
    cons_regs: int = 240


def _register_split(n_cons: int) -> tuple[int, int]:
    """(maxnreg, consumer registers) for `n_cons` consumer warpgroups plus the producer warp, whose warpgroup
    counts whole (registers are handed out per warpgroup): the launch reserves maxnreg per thread, then the
    producer drops to 24 registers (setmaxnreg) and the consumers rise to what is left, at most 240 (FA3's
    split). One consumer leaves registers for two programs per SM: 8 warps x 128."""
    registers = 65536 // (2 if n_cons == 1 else 1)
    maxnreg = registers // (128 * (n_cons + 1)) // 8 * 8
    cons_regs = min(240, (registers - 128 * PRODUCER_REGS) // (128 * n_cons) // 8 * 8)
    return maxnreg, cons_regs


def _env_config(name: str) -> Config | None:
    """A config from the environment (`HOPPER_FWD=bm,bn,stages,pingpong`): for timing variants in devcheck."""
    value = os.environ.get(name)
    if not value:
        return None
    bm, bn, stages, pingpong = (int(x) for x in value.split(","))
    return _fwd_config(bm, bn, stages, bool(pingpong))


def _fwd_config(bm: int, bn: int, stages: int, pingpong: bool) -> Config:
    # One consumer warpgroup per 64 query rows, each its own partition (the default one: 4 warps).
    if bm not in (64, 128):
        raise ValueError(f"the forward runs one or two consumer warpgroups: BM 64 or 128, got {bm}")
    n_cons = bm // 64
    maxnreg, cons_regs = _register_split(n_cons)
    return Config(bm=bm, bn=bn, stages=stages, num_warps=4, maxnreg=maxnreg, pingpong=pingpong and n_cons > 1,
                  cons_regs=cons_regs)  # fmt: skip


def forward_config(head_dim: int, seq_len: int, is_causal: bool) -> Config:
    """Two consumer warpgroups of 64 query rows (BM = 128), 128 keys per tile, two K/V stages, ping-pong at
    d = 128; at d = 64 up to 4,096 tokens one consumer (BM = 64) and two programs per SM, which keeps more SMs
    busy on short sequences (longer ones lose by loading each K/V tile for half as many rows). Measured:
    FINDINGS.md; checked spill-free for sm_90 by `compile_check`."""
    if (cfg := _env_config("HOPPER_FWD")) is not None:
        return cfg
    if head_dim == 64 and seq_len <= 4096:
        return _fwd_config(64, 128, 2, pingpong=False)
    return _fwd_config(128, 128, 2, pingpong=head_dim > 64)


def _bwd_config(bm: int, bn: int, stages: int) -> Config:
    # One consumer warpgroup per 64 keys, all in the default partition (they share dS for dQ = dS K).
    n_cons = bn // 64
    maxnreg, _ = _register_split(n_cons)  # the consumers' setmaxnreg: Gluon's, from what the producer leaves
    return Config(bm=bm, bn=bn, stages=stages, num_warps=4 * n_cons, maxnreg=maxnreg)


def _env_bwd_config() -> Config | None:
    """A backward config from the environment (`HOPPER_BWD=bm,bn,stages`): for timing variants."""
    value = os.environ.get("HOPPER_BWD")
    if not value:
        return None
    bm, bn, stages = (int(x) for x in value.split(","))
    return _bwd_config(bm, bn, stages)


def backward_config(head_dim: int, seq_len: int, is_causal: bool) -> Config:
    """Query tiles of 64. d = 128: 128 keys per program (64 per consumer warpgroup); dK and dV (2 x 64 registers
    per thread) plus S^T, dP^T and dQ fit 240 registers without spills; shared memory holds K, V, two stages of
    Q and dO, dS and two float32 dQ tiles (209 KiB). d = 64: 64 keys per program (one consumer, 232 registers),
    three Q/dO stages, two programs per SM (106 KiB each). Measured: FINDINGS.md."""
    if (cfg := _env_bwd_config()) is not None:
        return cfg
    return _bwd_config(64, 64, 3) if head_dim == 64 else _bwd_config(64, 128, 2)


def _programs_per_sm(cfg: Config) -> int:
    """A forward program with one consumer warpgroup leaves room for a second on its SM (`_register_split`)."""
    return 2 if cfg.bm == 64 else 1


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _section(device: torch.device, n_keys: int, head_dim: int, element_size: int, batch: int) -> int:
    """Batch elements per section of the forward's work order: 2 where two elements' K and V take at most a third
    of L2, else 1. Measured on an H200 (FINDINGS.md): two beat one at 4k-16k tokens, and sections as large as half
    of L2 lost to both (at 32k tokens, d = 128, two elements' K and V are 32 MiB and two lost 1-4 %)."""
    kv_bytes = 2 * n_keys * head_dim * element_size
    fits = 2 * kv_bytes <= torch.cuda.get_device_properties(device).L2_cache_size // 3
    return min(batch, 2 if fits else 1)


@functools.cache
def _kernels():
    from cs336_systems.kernels.hopper import _kernels

    return _kernels


@functools.cache
def _launch(kernel: str):
    """The launch cache of one kernel (`flash_triton.CachedLaunch`): Triton's dispatch at a key's first launch
    only. A key is everything the compiled kernel and its grid depend on: dtype, sizes, causal flag, config."""
    from cs336_systems.kernels.flash_triton import CachedLaunch

    return CachedLaunch(getattr(_kernels(), kernel))


def clear_launch_cache() -> None:
    """Forget every recorded launch (and the kernels' launch caches)."""
    _launch.cache_clear()


@functools.cache
def _smem_layout(dtype: torch.dtype, block_shape: tuple[int, ...]):
    from triton.experimental.gluon import language as gl

    # float32: the rows of L and Delta (1-D per tile), and dQ's tiles, which the kernel writes from registers in
    # its own bank-spreading order (_kernels.DQ_STORE_LAYOUT) and TMA reads as they lie: no swizzle
    if dtype == torch.float32:
        return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=len(block_shape))
    # Q, K, V, dO tiles (MMA operands): swizzled
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), gl_dtype)


def _descriptor(t: torch.Tensor, block_shape: tuple[int, ...]):
    """A TMA descriptor over the whole contiguous tensor `t` with `block_shape` tiles."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(
        t, list(t.shape), list(t.stride()), list(block_shape), _smem_layout(t.dtype, block_shape)
    )


def _tma_readable(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor can span `t` as it is: contiguous rows, a 16-byte aligned base and strides."""
    size = t.element_size()
    return (
        t.stride(-1) == 1
        and t.data_ptr() % 16 == 0
        and all(stride > 0 and stride * size % 16 == 0 for stride in t.stride()[:-1])
    )


def _prepared(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The (batch, seq, d) inputs as the kernels take them: themselves where TMA can read them, else copies."""
    q = tensors[0]
    for t in tensors:
        if t.dim() != 3:
            raise ValueError(f"expected (batch, seq, d) tensors, got shape {tuple(t.shape)}")
    if not supports(q.device, q.dtype, q.shape[-1], True):
        raise ValueError(
            f"the Hopper tier does not support {q.dtype}, head dim {q.shape[-1]} on {q.device} "
            f"(it takes {DTYPES}, head dims {HEAD_DIMS}, on a capability (9, 0) GPU)"
        )
    return tuple(t if _tma_readable(t) else t.contiguous() for t in tensors)


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """O (batch, N_q, d) in q's dtype and the logsumexp L (batch, N_q) in float32, natural-log units. O is written
    into `out` where given: by the kernel's TMA stores where a descriptor can span it, else through a copy."""
    q, k, v = _prepared(q, k, v)
    batch, n_queries, d = q.shape
    n_keys = k.shape[1]
    cfg = forward_config(d, max(n_queries, n_keys), is_causal)
    if out is not None and _tma_readable(out):
        o = out
    else:  # contiguous whatever q's strides
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, n_queries), dtype=torch.float32, device=q.device)
    # the persistent kernel's work counter, zeroed by a launch of its own (flash_replay repeats launches, not fills)
    counter = torch.empty(1, dtype=torch.int32, device=q.device)
    _launch("zero_kernel")((), (1,), (counter,), lambda: {"num_warps": 1})
    n_work = math.ceil(n_queries / cfg.bm) * batch
    section = _section(q.device, n_keys, d, q.element_size(), batch)
    descriptors = _descriptor(q, (1, 64, d)), _descriptor(k, (1, cfg.bn, d)), _descriptor(v, (1, cfg.bn, d))
    _launch("flash_fwd_kernel")(
        (q.dtype, batch, n_queries, n_keys, d, is_causal, cfg),
        (min(n_work, _programs_per_sm(cfg) * _sm_count(q.device)),),
        (*descriptors, _descriptor(o, (1, 64, d)), lse, counter),
        lambda: {
            "N_QUERIES": n_queries,
            "N_KEYS": n_keys,
            "BH": batch,
            "SECTION": section,
            "qk_scale": math.log2(math.e) / math.sqrt(d),
            "IS_CAUSAL": is_causal,
            "BM": cfg.bm,
            "BN": cfg.bn,
            "D": d,
            "STAGES": cfg.stages,
            "PINGPONG": cfg.pingpong,
            "CONS_REGS": cfg.cons_regs,
            "num_warps": cfg.num_warps,
            "maxnreg": cfg.maxnreg,
        },
    )
    if out is not None and o is not out:
        o = out.copy_(o)
    return o, lse


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    is_causal: bool,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV (shapes and dtypes of q, k, v) by recomputation from L; dQ through a float32 buffer. Written into
    `out` (three views of those shapes) where given, and then those returned: by the kernels' stores (dK and dV by
    TMA) where they can reach them, the rest through copies. With `rope` (RoPE's tables cos, sin, (seq, d / 2),
    contiguous), dQ and dK come out rotated back by them: RoPE's backward, run by dQ's conversion and by the
    backward's epilogue."""
    q, k, v, o, do = _prepared(q, k, v, o, do)
    lse = lse.contiguous()
    batch, n_queries, d = q.shape
    n_keys = k.shape[1]
    if rope is not None and any(
        t.shape[0] < max(n_queries, n_keys) or t.shape[1:] != (d // 2,) for t in rope
    ):
        raise ValueError(
            f"RoPE's tables must be (seq >= {max(n_queries, n_keys)}, {d // 2}), got {[tuple(t.shape) for t in rope]}"
        )
    cfg = backward_config(d, max(n_queries, n_keys), is_causal)
    # the tables' dtype: the compiled kernels load them as such
    key = (q.dtype, batch, n_queries, n_keys, d, is_causal, cfg, None if rope is None else rope[0].dtype)
    n_pad = math.ceil(n_queries / cfg.bm) * cfg.bm
    lse2 = torch.empty((batch, n_pad), dtype=torch.float32, device=q.device)
    delta = torch.empty_like(lse2)
    # dQ's float32 accumulator, zeroed by the preprocess kernel
    dq_accum = torch.empty((batch, n_queries, d), dtype=torch.float32, device=q.device)
    cos, sin = rope if rope is not None else (dq_accum, dq_accum)  # unread without rope
    # O's and dO's (batch, row) strides: scalars the compiled kernel is specialised on (16-divisibility), so keyed
    strides = (*o.stride()[:2], *do.stride()[:2])
    _launch("bwd_preprocess_kernel")(
        (*key, strides),
        (math.ceil(n_pad / _PREPROCESS_ROWS), batch),
        (o, do, lse, lse2, delta, dq_accum),
        lambda: {
            **dict(zip(("stride_ob", "stride_os", "stride_dob", "stride_dos"), strides, strict=True)),
            **{"N_QUERIES": n_queries, "N_PAD": n_pad, "D": d, "ROWS": _PREPROCESS_ROWS, "num_warps": 4},
        },
    )
    # contiguous whatever k's and v's strides, unless written in place
    dk, dv = (
        out[i]
        if out is not None and _tma_readable(out[i])
        else torch.empty(t.shape, dtype=t.dtype, device=t.device)
        for i, t in ((1, k), (2, v))
    )
    scale = 1.0 / math.sqrt(d)
    # the kernel's TMA descriptors, in its argument order (dQ's tiles are added to dq_accum by TMA reductions)
    tiles = ((k, (1, cfg.bn, d)), (v, (1, cfg.bn, d)), (q, (1, cfg.bm, d)), (do, (1, cfg.bm, d)),
             (lse2, (1, cfg.bm)), (delta, (1, cfg.bm)), (dk, (1, cfg.bn, d)), (dv, (1, cfg.bn, d)),
             (dq_accum, (1, cfg.bm, d)))  # fmt: skip
    _launch("flash_bwd_kernel")(
        key,
        (math.ceil(n_keys / cfg.bn), batch),
        (*(_descriptor(t, block) for t, block in tiles), cos, sin),
        lambda: {
            "N_QUERIES": n_queries,
            "N_KEYS": n_keys,
            "qk_scale": scale * math.log2(math.e),
            "scale": scale,
            "IS_CAUSAL": is_causal,
            "ROTATE": rope is not None,
            "BM": cfg.bm,
            "BN": cfg.bn,
            "D": d,
            "STAGES": cfg.stages,
            "num_warps": cfg.num_warps,
            "maxnreg": cfg.maxnreg,
        },
    )
    # dQ straight into out's view where its rows are contiguous
    if out is not None and out[0].stride(-1) == 1 and out[0].data_ptr() % 16 == 0:
        dq = out[0]
    else:
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dq_strides = dq.stride()[:2]  # specialised on (16-divisibility) as O's and dO's above
    _launch("dq_convert_kernel")(
        (*key, dq_strides),
        (math.ceil(n_queries / _CONVERT_ROWS), batch),
        (dq_accum, dq, cos, sin),
        lambda: {
            "N_QUERIES": n_queries,
            "stride_b": dq_strides[0],
            "stride_s": dq_strides[1],
            "scale": scale,
            "D": d,
            "ROTATE": rope is not None,
            "ROWS": _CONVERT_ROWS,
            "num_warps": 4,
        },
    )
    if out is not None:
        return tuple(
            target if target is grad else target.copy_(grad)
            for target, grad in zip(out, (dq, dk, dv), strict=True)
        )
    return dq, dk, dv
