"""FlashAttention-2 Triton kernels: forward (Algorithm 1) and an atomic-free backward (Algorithm 2, two passes).

The kernels index contiguous (batch, seq, d) tensors, so every row stride is the constexpr D (the launchers copy
a strided input); `flash_attention.py` does the reshaping, validation and autograd plumbing. Conventions shared
by all kernels:

- Scores are handled in base 2: s2 = (q . k) * scale * log2(e), so `exp2` replaces `exp` (one fewer multiply
  per score); the logsumexp L is stored in natural-log units, as the autograd contract requires.
- Causal masking is top-left aligned (query i sees keys j <= i, as `scaled_dot_product_attention`). Key tiles
  that lie wholly below the diagonal run without index comparisons; only the diagonal tiles build a mask, and
  tiles wholly above the diagonal are never visited.
- EVEN_Q / EVEN_K say that a sequence length is a multiple of every tile size in use, which lets the compiler
  drop the bounds masks on loads and scores in the common case.
- Any head dim d up to MAX_HEAD_DIM: tiles are D_PAD = the next power of two (at least 16, `tl.dot`'s least) wide,
  and the columns past d load as zeros and are never stored; at a power-of-two d (D == D_PAD) no mask is built.
- Accumulators (m, l, O, dQ, dK, dV) are float32; P and dS are cast to the input dtype before their matmuls.
  For float32 inputs `tl.dot` uses TF32 on the GPU (Triton's default), so fp32 results agree with an fp32
  reference to ~1e-3, not 1e-6 (the CPU interpreter computes exact fp32 dots).

Launches: Triton's dispatch (the autotuner's config lookup, the JIT's argument binding and cache lookup) costs
~100 us of host time per launch, more than these kernels run at short sequences. So each launcher goes through
Triton only at the first launch of a shape, records what ran (`CachedLaunch`) and from then on calls the compiled
kernel's launcher directly.
"""

from __future__ import annotations

import math
import threading

import torch
import triton
import triton.language as tl
from triton.runtime import Autotuner, driver

from cs336_systems.kernels import rope as rotary
from cs336_systems.kernels import triton_interpreter

# Interpreted or compiled is fixed when the kernels below are decorated: record it, and patch the interpreter's gaps
# before any kernel runs. The tests set TRITON_INTERPRET=1 before importing this module.
INTERPRET = triton_interpreter.enabled()
if INTERPRET:
    triton_interpreter.patch()

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
MAX_HEAD_DIM = 256
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def supports(device: torch.device, dtype: torch.dtype, head_dim: int, is_causal: bool) -> bool:
    """Whether these kernels run such inputs: on CUDA (or the CPU, interpreting), in DTYPES, head dims 1 to 256."""
    return (device.type == "cuda" or INTERPRET) and dtype in DTYPES and unsupported_head_dim(head_dim) is None


def unsupported_head_dim(d: int) -> str | None:
    """Why the kernels cannot take head dim d, or None."""
    if 1 <= d <= MAX_HEAD_DIM:
        return None
    return f"head dim {d} is not supported by the Triton kernels (they take 1 to {MAX_HEAD_DIM})"


def padded_head_dim(d: int) -> int:
    """The tile width for head dim d: the next power of two, at least 16."""
    return max(16, triton.next_power_of_2(d))


def _configs(tiles: list[tuple[int, ...]]) -> list[triton.Config]:
    """(Q_TILE_SIZE, K_TILE_SIZE, num_warps, num_stages[, maxnreg]) tuples as autotune configs."""
    return [
        triton.Config(
            {"Q_TILE_SIZE": bq, "K_TILE_SIZE": bk},
            num_warps=warps,
            num_stages=stages,
            maxnreg=cap[0] if cap else None,
        )
        for bq, bk, warps, stages, *cap in tiles
    ]


def _by_head_dim(narrow: list[triton.Config], wide: list[triton.Config]) -> dict:
    """`triton.autotune` arguments that tune over `narrow` up to 128-wide tiles and over `wide` (smaller tiles, to fit
    shared memory and registers) for 256-wide ones."""

    def prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
        return wide if kwargs["D_PAD"] > 128 and wide else narrow  # interpreting, the one config serves all

    return {"configs": narrow + wide, "prune_configs_by": {"early_config_prune": prune}}


# Each kernel's causal split needs the smaller tile to divide the larger one (all sizes are powers of 2), and the
# tile it walks to be no larger than the tile it holds: K_TILE <= Q_TILE for the forward and dQ (key tiles inside
# a query tile), Q_TILE <= K_TILE for dK/dV (an H100 run showed the other way reading out of bounds).
# Interpreting, one small config keeps tests fast; its uneven tile pair still exercises multi-tile diagonals.
if INTERPRET:
    _FWD = _configs([(32, 16, 4, 1)])
    _DKDV = _configs([(16, 32, 4, 1)])
    _DQ = _configs([(32, 16, 4, 1)])
    _FWD_WIDE = _DKDV_WIDE = _DQ_WIDE = []
else:
    # A small Hopper-oriented search, checked offline for sm_90 (shared memory fits, no register spills for bf16
    # d = 64 and 128 in most configs); (64, 64, 4, 2) and (32, 64, 4, 2) also fit fp32 inputs with d = 128.
    # A fifth entry caps the registers per thread (maxnreg). At 32 heads x 32,768 x 128, causal, bf16 on an H200
    # the capped forward took 16.2 ms against 17.0 (246 registers down to 208, a few spilled) and the capped dQ pass
    # 19.5 ms against 21.6 (191 down to 174, none spilled): the same occupancy, a better schedule; found by a sweep.
    _FWD = _configs(
        [
            (128, 64, 4, 3),
            (128, 64, 8, 3),
            (128, 64, 8, 4),
            (128, 128, 8, 3),
            (128, 128, 8, 3, 208),
            (64, 64, 4, 3),
            (64, 64, 4, 2),
        ]
    )
    # (64, 64, 4, 2): 30.0 ms against 31.0 ms for (64, 128, 8, 3), the one tuned before it, at 32 heads x 32,768 x
    # 128, causal, bf16 on an H200 (a sweep of 30 configs of this kernel).
    _DKDV = _configs(
        [
            (32, 128, 8, 3),
            (64, 128, 8, 3),
            (32, 128, 4, 3),
            (64, 64, 4, 3),
            (64, 64, 4, 2),
            (32, 64, 8, 3),
            (32, 64, 4, 2),
        ]
    )
    _DQ = _configs(
        [
            (128, 64, 8, 3),
            (128, 64, 8, 3, 176),
            (128, 64, 8, 4, 176),
            (128, 64, 8, 2),
            (128, 32, 8, 3),
            (64, 64, 8, 3),
            (64, 64, 4, 3),
            (64, 32, 4, 2),
        ]
    )
    # Head dims 129-256 (256-wide tiles): two stages of small tiles, so that float32 inputs fit shared memory too.
    _FWD_WIDE = _configs([(64, 32, 4, 2), (32, 32, 4, 2), (64, 64, 8, 2)])
    _DKDV_WIDE = _configs([(32, 32, 4, 2), (16, 32, 4, 2), (32, 64, 8, 2)])
    _DQ_WIDE = _configs([(64, 32, 4, 2), (32, 32, 4, 2), (64, 64, 8, 2)])

# Every tile size in use divides this, so "length % TILE_MULTIPLE == 0" means "no ragged tile".
TILE_MULTIPLE = max(max(c.kwargs["Q_TILE_SIZE"], c.kwargs["K_TILE_SIZE"]) for c in _FWD + _DKDV + _DQ)
_PREPROCESS_ROWS = 32 if INTERPRET else 128
# Autotune once per sequence-length bucket rather than per length: a sweep over 10 lengths would otherwise re-tune
# (compile and time every config of three kernels) at each one. TUNE_BUCKET is a kernel argument only for this key.
_KEY = ["TUNE_BUCKET", "D", "IS_CAUSAL"]


# The kernels keep Triton's usual compact argument lists; the formatter would put every argument on its own line.
# fmt: off
# ----------------------------------------------------------------------------------------------------------
# Shared by the forward and the dQ pass, which both walk the key tiles of one query tile (inlined by Triton).
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _load_tile(ptrs, rows, n_rows, D: tl.constexpr, D_PAD: tl.constexpr, ROW_MASK: tl.constexpr):
    """A (rows x D_PAD) tile: rows at or past n_rows (where ROW_MASK) and the padding columns past D load as zeros,
    which add nothing to any dot product over d."""
    if ROW_MASK:
        if D == D_PAD:
            tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (tl.arange(0, D_PAD)[None, :] < D), other=0.0)
    elif D == D_PAD:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=tl.arange(0, D_PAD)[None, :] < D, other=0.0)
    return tile


@triton.jit
def _store_tile(ptrs, tile, rows, n_rows, D: tl.constexpr, D_PAD: tl.constexpr, ROW_MASK: tl.constexpr):
    """Store a (rows x D_PAD) tile but its rows at or past n_rows (where ROW_MASK) and its padding columns."""
    if ROW_MASK:
        if D == D_PAD:
            tl.store(ptrs, tile, mask=rows[:, None] < n_rows)
        else:
            tl.store(ptrs, tile, mask=(rows[:, None] < n_rows) & (tl.arange(0, D_PAD)[None, :] < D))
    elif D == D_PAD:
        tl.store(ptrs, tile)
    else:
        tl.store(ptrs, tile, mask=tl.arange(0, D_PAD)[None, :] < D)


@triton.jit
def _key_tile_scores(q, k_ptrs, v_ptrs, offs_q, cols, N_KEYS, D: tl.constexpr, D_PAD: tl.constexpr,
                     CAUSAL_MASK: tl.constexpr, BOUNDS_MASK: tl.constexpr):
    """K and V of the key tile `cols`, and the raw scores Q K^T, -inf where the causal mask or N_KEYS hides a key.

    Padded keys need their -inf even though they load as zeros: a score of 0 would join the forward's softmax,
    and in the dQ pass exp2(0 - L) can overflow when all of a row's real scores are very negative."""
    k = _load_tile(k_ptrs, cols, N_KEYS, D, D_PAD, BOUNDS_MASK)
    v = _load_tile(v_ptrs, cols, N_KEYS, D, D_PAD, BOUNDS_MASK)
    s = tl.dot(q, tl.trans(k))
    if CAUSAL_MASK:
        s = tl.where(offs_q[:, None] >= cols[None, :], s, float("-inf"))
    if BOUNDS_MASK:
        s = tl.where(cols[None, :] < N_KEYS, s, float("-inf"))
    return k, v, s


# ----------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _fwd_key_tiles(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_q, lo, hi, N_KEYS, qk_scale, D: tl.constexpr,
                   D_PAD: tl.constexpr, K_TILE_SIZE: tl.constexpr, CAUSAL_MASK: tl.constexpr,
                   BOUNDS_MASK: tl.constexpr):
    """Online-softmax update of one query tile over the key tiles in [lo, hi)."""
    offs_k = tl.arange(0, K_TILE_SIZE)
    k_ptrs += lo * D
    v_ptrs += lo * D
    for start_k in range(lo, hi, K_TILE_SIZE):
        k, v, s = _key_tile_scores(q, k_ptrs, v_ptrs, offs_q, start_k + offs_k, N_KEYS, D, D_PAD, CAUSAL_MASK,
                                   BOUNDS_MASK)
        # Each row's first visited tile holds key 0 <= its index, so m_new is finite: no exp2(-inf + inf).
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None])
        m_i = m_new
        k_ptrs += K_TILE_SIZE * D
        v_ptrs += K_TILE_SIZE * D
    return acc, l_i, m_i


@triton.autotune(**_by_head_dim(_FWD, _FWD_WIDE), key=_KEY)
@triton.jit
def flash_fwd_kernel(Q_ptr, K_ptr, V_ptr, O_ptr, L_ptr, N_QUERIES, N_KEYS, scale, TUNE_BUCKET,
                     D: tl.constexpr, D_PAD: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_Q: tl.constexpr,
                     EVEN_K: tl.constexpr, Q_TILE_SIZE: tl.constexpr, K_TILE_SIZE: tl.constexpr):
    query_tile_index = tl.program_id(0)
    if IS_CAUSAL:
        # Later query tiles have the most key tiles; launching them first shortens the tail of the grid.
        query_tile_index = tl.num_programs(0) - 1 - query_tile_index
    batch_index = tl.program_id(1).to(tl.int64)
    q_start = query_tile_index * Q_TILE_SIZE
    offs_q = q_start + tl.arange(0, Q_TILE_SIZE)
    offs_k = tl.arange(0, K_TILE_SIZE)
    offs_d = tl.arange(0, D_PAD)
    q_rows = batch_index * N_QUERIES + offs_q
    k_ptrs = K_ptr + (batch_index * N_KEYS + offs_k)[:, None] * D + offs_d[None, :]
    v_ptrs = V_ptr + (batch_index * N_KEYS + offs_k)[:, None] * D + offs_d[None, :]
    q = _load_tile(Q_ptr + q_rows[:, None] * D + offs_d[None, :], offs_q, N_QUERIES, D, D_PAD, not EVEN_Q)

    scale = tl.cast(scale, tl.float32)  # torch.compile passes Python floats as fp64, which would promote the tiles
    qk_scale = scale * LOG2E  # softmax in base 2
    m_i = tl.full([Q_TILE_SIZE], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([Q_TILE_SIZE], dtype=tl.float32)
    acc = tl.zeros([Q_TILE_SIZE, D_PAD], dtype=tl.float32)
    if IS_CAUSAL:
        # Keys before the tile's first query are visible to all its rows; then the diagonal tiles, masked.
        off_diag_end = tl.minimum(q_start, N_KEYS)
        acc, l_i, m_i = _fwd_key_tiles(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_q, 0, off_diag_end, N_KEYS,
                                       qk_scale, D, D_PAD, K_TILE_SIZE, False, not EVEN_K)
        diag_end = tl.minimum(q_start + Q_TILE_SIZE, N_KEYS)
        acc, l_i, m_i = _fwd_key_tiles(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_q, q_start, diag_end, N_KEYS,
                                       qk_scale, D, D_PAD, K_TILE_SIZE, True, not EVEN_K)
    else:
        acc, l_i, m_i = _fwd_key_tiles(acc, l_i, m_i, q, k_ptrs, v_ptrs, offs_q, 0, N_KEYS, N_KEYS,
                                       qk_scale, D, D_PAD, K_TILE_SIZE, False, not EVEN_K)

    o = (acc / l_i[:, None]).to(O_ptr.dtype.element_ty)
    lse = (m_i + tl.log2(l_i)) * LN2  # back to natural-log units
    _store_tile(O_ptr + q_rows[:, None] * D + offs_d[None, :], o, offs_q, N_QUERIES, D, D_PAD, not EVEN_Q)
    if EVEN_Q:
        tl.store(L_ptr + q_rows, lse)
    else:
        tl.store(L_ptr + q_rows, lse, mask=offs_q < N_QUERIES)


# ----------------------------------------------------------------------------------------------------------
# Backward: D = rowsum(O * dO), then one pass over key tiles (dK, dV) and one over query tiles (dQ).
# Padded query rows load L = +inf, so their P is exactly 0 and they add nothing to dK and dV.
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def flash_bwd_preprocess_kernel(O_ptr, dO_ptr, Delta_ptr, N_ROWS, D: tl.constexpr, D_PAD: tl.constexpr,
                                ROWS: tl.constexpr):
    """Delta = rowsum(O * dO) in float32 over all (batch * N_q) rows."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * D + tl.arange(0, D_PAD)[None, :]
    o = _load_tile(O_ptr + offs, rows, N_ROWS, D, D_PAD, True).to(tl.float32)
    do = _load_tile(dO_ptr + offs, rows, N_ROWS, D, D_PAD, True).to(tl.float32)
    tl.store(Delta_ptr + rows, tl.sum(o * do, 1), mask=rows < N_ROWS)


@triton.jit
def _dkdv_query_tiles(dk, dv, k, v, Q_ptr, dO_ptr, L_ptr, Delta_ptr, q_row0, offs_k, lo, hi, N_QUERIES, qk_scale,
                      D: tl.constexpr, D_PAD: tl.constexpr, Q_TILE_SIZE: tl.constexpr, CAUSAL_MASK: tl.constexpr,
                      EVEN_Q: tl.constexpr):
    """Accumulate dK, dV of one key tile over the query tiles in [lo, hi), in transposed (key x query) form."""
    arange_q = tl.arange(0, Q_TILE_SIZE)
    offs_d = tl.arange(0, D_PAD)
    q_ptrs = Q_ptr + (q_row0 + lo + arange_q)[:, None] * D + offs_d[None, :]
    do_ptrs = dO_ptr + (q_row0 + lo + arange_q)[:, None] * D + offs_d[None, :]
    l_ptrs = L_ptr + q_row0 + lo + arange_q
    delta_ptrs = Delta_ptr + q_row0 + lo + arange_q
    for start_q in range(lo, hi, Q_TILE_SIZE):
        offs_q = start_q + arange_q
        q = _load_tile(q_ptrs, offs_q, N_QUERIES, D, D_PAD, not EVEN_Q)
        do = _load_tile(do_ptrs, offs_q, N_QUERIES, D, D_PAD, not EVEN_Q)
        if EVEN_Q:
            lse2 = tl.load(l_ptrs) * LOG2E
            delta = tl.load(delta_ptrs)
        else:
            in_bounds = offs_q < N_QUERIES
            lse2 = tl.load(l_ptrs, mask=in_bounds, other=float("inf")) * LOG2E
            delta = tl.load(delta_ptrs, mask=in_bounds, other=0.0)
        s_t = tl.dot(k, tl.trans(q))
        if CAUSAL_MASK:
            s_t = tl.where(offs_q[None, :] >= offs_k[:, None], s_t, float("-inf"))
        p_t = tl.exp2(s_t * qk_scale - lse2[None, :])
        dv = tl.dot(p_t.to(do.dtype), do, acc=dv)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, acc=dk)
        q_ptrs += Q_TILE_SIZE * D
        do_ptrs += Q_TILE_SIZE * D
        l_ptrs += Q_TILE_SIZE
        delta_ptrs += Q_TILE_SIZE
    return dk, dv


@triton.autotune(**_by_head_dim(_DKDV, _DKDV_WIDE), key=_KEY)
@triton.jit
def flash_bwd_dkdv_kernel(Q_ptr, K_ptr, V_ptr, dO_ptr, L_ptr, Delta_ptr, dK_ptr, dV_ptr, N_QUERIES, N_KEYS, scale, TUNE_BUCKET,
                          D: tl.constexpr, D_PAD: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_Q: tl.constexpr,
                          EVEN_K: tl.constexpr, Q_TILE_SIZE: tl.constexpr, K_TILE_SIZE: tl.constexpr):
    batch_index = tl.program_id(1).to(tl.int64)
    k_start = tl.program_id(0) * K_TILE_SIZE
    offs_k = k_start + tl.arange(0, K_TILE_SIZE)
    offs_d = tl.arange(0, D_PAD)
    kv_offs = (batch_index * N_KEYS + offs_k)[:, None] * D + offs_d[None, :]
    # Key rows past N_KEYS load as zeros; their dK, dV rows are garbage but never stored.
    k = _load_tile(K_ptr + kv_offs, offs_k, N_KEYS, D, D_PAD, not EVEN_K)
    v = _load_tile(V_ptr + kv_offs, offs_k, N_KEYS, D, D_PAD, not EVEN_K)

    q_row0 = batch_index * N_QUERIES
    scale = tl.cast(scale, tl.float32)  # fp64 under torch.compile
    qk_scale = scale * LOG2E
    dk = tl.zeros([K_TILE_SIZE, D_PAD], dtype=tl.float32)
    dv = tl.zeros([K_TILE_SIZE, D_PAD], dtype=tl.float32)
    if IS_CAUSAL:
        # Queries before the key tile never see it; the diagonal query tiles are masked, later ones are not.
        diag_end = tl.minimum(k_start + K_TILE_SIZE, N_QUERIES)
        dk, dv = _dkdv_query_tiles(dk, dv, k, v, Q_ptr, dO_ptr, L_ptr, Delta_ptr, q_row0, offs_k, k_start, diag_end,
                                   N_QUERIES, qk_scale, D, D_PAD, Q_TILE_SIZE, True, EVEN_Q)
        dk, dv = _dkdv_query_tiles(dk, dv, k, v, Q_ptr, dO_ptr, L_ptr, Delta_ptr, q_row0, offs_k,
                                   k_start + K_TILE_SIZE, N_QUERIES, N_QUERIES, qk_scale, D, D_PAD, Q_TILE_SIZE, False,
                                   EVEN_Q)
    else:
        dk, dv = _dkdv_query_tiles(dk, dv, k, v, Q_ptr, dO_ptr, L_ptr, Delta_ptr, q_row0, offs_k, 0, N_QUERIES,
                                   N_QUERIES, qk_scale, D, D_PAD, Q_TILE_SIZE, False, EVEN_Q)
    dk *= scale
    _store_tile(dK_ptr + kv_offs, dk.to(dK_ptr.dtype.element_ty), offs_k, N_KEYS, D, D_PAD, not EVEN_K)
    _store_tile(dV_ptr + kv_offs, dv.to(dV_ptr.dtype.element_ty), offs_k, N_KEYS, D, D_PAD, not EVEN_K)


@triton.jit
def _dq_key_tiles(dq, q, do, lse2, delta, k_ptrs, v_ptrs, offs_q, lo, hi, N_KEYS, qk_scale,
                  D: tl.constexpr, D_PAD: tl.constexpr, K_TILE_SIZE: tl.constexpr, CAUSAL_MASK: tl.constexpr,
                  BOUNDS_MASK: tl.constexpr):
    """Accumulate dQ of one query tile over the key tiles in [lo, hi)."""
    offs_k = tl.arange(0, K_TILE_SIZE)
    k_ptrs += lo * D
    v_ptrs += lo * D
    for start_k in range(lo, hi, K_TILE_SIZE):
        k, v, s = _key_tile_scores(q, k_ptrs, v_ptrs, offs_q, start_k + offs_k, N_KEYS, D, D_PAD, CAUSAL_MASK,
                                   BOUNDS_MASK)
        p = tl.exp2(s * qk_scale - lse2[:, None])
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, acc=dq)
        k_ptrs += K_TILE_SIZE * D
        v_ptrs += K_TILE_SIZE * D
    return dq


@triton.autotune(**_by_head_dim(_DQ, _DQ_WIDE), key=_KEY)
@triton.jit
def flash_bwd_dq_kernel(Q_ptr, K_ptr, V_ptr, dO_ptr, L_ptr, Delta_ptr, dQ_ptr, N_QUERIES, N_KEYS, scale, TUNE_BUCKET,
                        D: tl.constexpr, D_PAD: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_Q: tl.constexpr,
                        EVEN_K: tl.constexpr, Q_TILE_SIZE: tl.constexpr, K_TILE_SIZE: tl.constexpr):
    query_tile_index = tl.program_id(0)
    if IS_CAUSAL:
        query_tile_index = tl.num_programs(0) - 1 - query_tile_index  # heaviest tiles first
    batch_index = tl.program_id(1).to(tl.int64)
    q_start = query_tile_index * Q_TILE_SIZE
    offs_q = q_start + tl.arange(0, Q_TILE_SIZE)
    offs_k = tl.arange(0, K_TILE_SIZE)
    offs_d = tl.arange(0, D_PAD)
    q_rows = batch_index * N_QUERIES + offs_q
    q_offs = q_rows[:, None] * D + offs_d[None, :]
    q = _load_tile(Q_ptr + q_offs, offs_q, N_QUERIES, D, D_PAD, not EVEN_Q)
    do = _load_tile(dO_ptr + q_offs, offs_q, N_QUERIES, D, D_PAD, not EVEN_Q)
    if EVEN_Q:
        lse2 = tl.load(L_ptr + q_rows) * LOG2E
        delta = tl.load(Delta_ptr + q_rows)
    else:
        in_bounds = offs_q < N_QUERIES
        lse2 = tl.load(L_ptr + q_rows, mask=in_bounds, other=float("inf")) * LOG2E
        delta = tl.load(Delta_ptr + q_rows, mask=in_bounds, other=0.0)

    k_ptrs = K_ptr + (batch_index * N_KEYS + offs_k)[:, None] * D + offs_d[None, :]
    v_ptrs = V_ptr + (batch_index * N_KEYS + offs_k)[:, None] * D + offs_d[None, :]
    scale = tl.cast(scale, tl.float32)  # fp64 under torch.compile
    qk_scale = scale * LOG2E
    dq = tl.zeros([Q_TILE_SIZE, D_PAD], dtype=tl.float32)
    if IS_CAUSAL:
        off_diag_end = tl.minimum(q_start, N_KEYS)
        dq = _dq_key_tiles(dq, q, do, lse2, delta, k_ptrs, v_ptrs, offs_q, 0, off_diag_end, N_KEYS, qk_scale,
                           D, D_PAD, K_TILE_SIZE, False, not EVEN_K)
        diag_end = tl.minimum(q_start + Q_TILE_SIZE, N_KEYS)
        dq = _dq_key_tiles(dq, q, do, lse2, delta, k_ptrs, v_ptrs, offs_q, q_start, diag_end, N_KEYS, qk_scale,
                           D, D_PAD, K_TILE_SIZE, True, not EVEN_K)
    else:
        dq = _dq_key_tiles(dq, q, do, lse2, delta, k_ptrs, v_ptrs, offs_q, 0, N_KEYS, N_KEYS, qk_scale,
                           D, D_PAD, K_TILE_SIZE, False, not EVEN_K)
    dq = (dq * scale).to(dQ_ptr.dtype.element_ty)
    _store_tile(dQ_ptr + q_offs, dq, offs_q, N_QUERIES, D, D_PAD, not EVEN_Q)
# fmt: on


@triton.jit
def empty_kernel(x_ptr):
    """Does nothing: the floor of a launch's host time (`bench.flash_variants.host_overhead`)."""
    pass


# ----------------------------------------------------------------------------------------------------------
# Launches: through Triton once per shape, then the compiled kernel directly.
# ----------------------------------------------------------------------------------------------------------
class CachedLaunch:
    """Launches one kernel (`triton.autotune`d or a plain `triton.jit`) by a key of everything the compiled kernel
    is specialised on but the pointers' alignment: the caller's key (dtype, sizes, causal flag) and the current
    device; pointers must all be 16-byte aligned (Triton specialises on that) for the cache to be used. The leading
    arguments are tensors or TMA descriptors (the Hopper tier's), whose base tensor counts.

    A key's first launch goes through Triton (the autotuner tunes or looks up its config, the JIT binds arguments
    and finds or compiles the kernel) and records what ran (`RecordedLaunch`). Later launches of the key call that
    kernel's launcher with them, as `JITFunction.run` does last. Interpreting, they call the interpreted function
    with the recorded config. While this thread's `RECORDING.launches` is a list, each launch appends (its
    RecordedLaunch, None when uncached; its tensors) to it: what `flash_replay` turns into a plan for C++."""

    MAX_KEYS = 4096  # a sweep over shapes cannot grow the cache without bound

    def __init__(self, kernel):
        self.kernel = kernel
        self.fn = kernel.fn if isinstance(kernel, Autotuner) else kernel  # the JIT (or interpreted) function
        self.launches: dict = {}

    def __call__(self, key: tuple, grid, tensors: tuple, scalars) -> None:
        """Launch on `tensors` (the kernel's leading arguments) with the arguments `scalars()` (by name, computed
        only at a key's first launch) over `grid`, a tuple or a function of the arguments and config."""
        aligned = _aligned(tensors)
        if not INTERPRET:
            key = (driver.active.get_current_device(), *key)
        launch = self.launches.get(key) if aligned else None
        if launch is not None:
            launch(tensors)
        else:
            args = scalars()
            compiled = self.kernel[grid](*tensors, **args)
            if aligned:
                if len(self.launches) >= self.MAX_KEYS:
                    self.launches.clear()
                launch = self.launches[key] = RecordedLaunch(self, compiled, grid, tensors, args)
        records = getattr(RECORDING, "launches", None)
        if records is not None:
            records.append((launch, tensors))


# Per thread, `RECORDING.launches`, while a list, is where CachedLaunch records each launch (`flash_replay`).
RECORDING = threading.local()


class RecordedLaunch:
    """What a key's first launch ran: the compiled kernel, its grid and the arguments after the tensors, in the
    kernel's order (constexprs too, which the launcher skips). Called with a later launch's tensors, it calls
    that kernel's launcher (the config's num_warps, num_stages and maxnreg are compiled into the kernel)."""

    def __init__(self, cached: CachedLaunch, compiled, grid, tensors: tuple, args: dict):
        kernel = cached.kernel
        config = kernel.best_config if kernel is not cached.fn else None
        meta = {**args, **config.all_kwargs()} if config is not None else args
        self.grid = tuple(grid(meta)) if callable(grid) else tuple(grid)
        self.trailing = tuple(meta[name] for name in cached.fn.arg_names[len(tensors) :])
        if INTERPRET:
            fn = cached.fn
            self._launch = lambda tensors: fn.run(*tensors, grid=self.grid, warmup=False, **meta)
            self.compiled = None
            return
        if hasattr(compiled, "result"):  # a future, under Triton's async compilation
            compiled = compiled.result()
        self.compiled = compiled
        self._launch = self._launcher(compiled)

    def _launcher(self, compiled):
        trailing = self.trailing
        run = compiled.run  # first, as it loads the module and sets `function`
        function, packed = compiled.function, compiled.packed_metadata
        grid = self.grid
        grid_xyz = (*grid, 1, 1)[:3]
        get_device, get_stream = driver.active.get_current_device, driver.active.get_current_stream
        hooks = triton.knobs.runtime

        def launch(tensors: tuple) -> None:
            stream = get_stream(get_device())
            enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
            if getattr(enter, "calls", True) or getattr(leave, "calls", True):  # a profiler's hooks (proton)
                metadata = compiled.launch_metadata(grid, stream, *tensors, *trailing)
            else:  # no hooks: skip building their metadata and calling two empty chains
                metadata = enter = leave = None
            run(*grid_xyz, stream, function, packed, metadata, enter, leave, *tensors, *trailing)

        return launch

    def __call__(self, tensors: tuple) -> None:
        self._launch(tensors)


def _aligned(tensors: tuple) -> bool:
    bits = 0
    for t in tensors:
        bits |= getattr(t, "base", t).data_ptr()  # a TMA descriptor's base tensor
    return bits % 16 == 0


def clear_launch_cache() -> None:
    """Forget every recorded launch: the next launch of each shape goes through Triton again."""
    for launcher in (_fwd, _preprocess, _dkdv, _dq):
        launcher.launches.clear()


_fwd = CachedLaunch(flash_fwd_kernel)
_preprocess = CachedLaunch(flash_bwd_preprocess_kernel)
_dkdv = CachedLaunch(flash_bwd_dkdv_kernel)
_dq = CachedLaunch(flash_bwd_dq_kernel)


# ----------------------------------------------------------------------------------------------------------
# Launchers: (batch, seq, d) tensors of one dtype (copied where not contiguous); new outputs contiguous.
# ----------------------------------------------------------------------------------------------------------
def _tune_bucket(n: int) -> int:
    """Short (<= 1024), medium (<= 8192) and long sequences get their own autotuned tile configs."""
    return 0 if n <= 1024 else 1 if n <= 8192 else 2


def _shape_args(q: torch.Tensor, k: torch.Tensor, is_causal: bool) -> dict:
    n_queries, n_keys, d = q.shape[1], k.shape[1], q.shape[2]
    return {
        "N_QUERIES": n_queries,
        "N_KEYS": n_keys,
        "scale": 1.0 / math.sqrt(d),
        "TUNE_BUCKET": _tune_bucket(max(n_queries, n_keys)),
        "D": d,
        "D_PAD": padded_head_dim(d),
        "IS_CAUSAL": is_causal,
        "EVEN_Q": n_queries % TILE_MULTIPLE == 0,
        "EVEN_K": n_keys % TILE_MULTIPLE == 0,
    }


def flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """O (batch, N_q, d) in q's dtype and the logsumexp L (batch, N_q) in float32. O is written into `out` where
    given (any strides: through a contiguous copy unless it is contiguous itself), else into a new tensor."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    batch, n_queries, d = q.shape
    o = out if out is not None and out.is_contiguous() else torch.empty_like(q)
    lse = q.new_empty((batch, n_queries), dtype=torch.float32)
    _fwd(
        (q.dtype, batch, n_queries, k.shape[1], d, is_causal),
        lambda meta: (triton.cdiv(n_queries, meta["Q_TILE_SIZE"]), batch),
        (q, k, v, o, lse),
        lambda: _shape_args(q, k, is_causal),
    )
    if out is not None and o is not out:
        o = out.copy_(o)
    return o, lse


def flash_backward(
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
    """dQ, dK, dV (shapes and dtypes of q, k, v) by recomputation from L, without atomics; copied into `out` (three
    views of those shapes, any strides) where given, and then those returned. With `rope` (RoPE's tables cos, sin,
    (seq, d / 2)), dQ and dK come out rotated back by them, as RoPE's backward (kernels/rope.py) does."""
    q, k, v, o, do, lse = (t.contiguous() for t in (q, k, v, o, do, lse))
    batch, n_queries, d = q.shape
    n_keys = k.shape[1]
    key = (q.dtype, batch, n_queries, n_keys, d, is_causal)
    n_rows = batch * n_queries
    delta = torch.empty_like(lse)
    _preprocess(
        key,
        (triton.cdiv(n_rows, _PREPROCESS_ROWS),),
        (o, do, delta),
        lambda: {"N_ROWS": n_rows, "D": d, "D_PAD": padded_head_dim(d), "ROWS": _PREPROCESS_ROWS},
    )
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    scalars = lambda: _shape_args(q, k, is_causal)  # noqa: E731 - computed at a shape's first launch only
    _dkdv(
        key,
        lambda meta: (triton.cdiv(n_keys, meta["K_TILE_SIZE"]), batch),
        (q, k, v, do, lse, delta, dk, dv),
        scalars,
    )
    _dq(
        key,
        lambda meta: (triton.cdiv(n_queries, meta["Q_TILE_SIZE"]), batch),
        (q, k, v, do, lse, delta, dq),
        scalars,
    )
    grads = (dq, dk, dv)
    targets = out if out is not None else grads
    if rope is not None:  # on their way to the targets (in place without `out`)
        views = tuple(g[None] for g in grads)  # (1, batch, seq, d): RoPE's (batch, heads, seq, d_head)
        rotary.backward_into(views, views if out is None else tuple(t[None] for t in out), *rope)
    elif out is not None:
        for target, grad in zip(targets, grads, strict=True):
            target.copy_(grad)
    return targets
