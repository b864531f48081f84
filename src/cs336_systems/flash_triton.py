"""FlashAttention-2 Triton kernels: forward (Algorithm 1) and an atomic-free backward (Algorithm 2, two passes).

Tensors reach these kernels as (batch, seq, d) with a contiguous last dimension; `flash_attention.py` does the
reshaping, validation and autograd plumbing. Conventions shared by all kernels:

- Scores are handled in base 2: s2 = (q . k) * scale * log2(e), so `exp2` replaces `exp` (one fewer multiply
  per score); the logsumexp L is stored in natural-log units, as the autograd contract requires.
- Causal masking is top-left aligned (query i sees keys j <= i, as `scaled_dot_product_attention`). Key tiles
  that lie wholly below the diagonal run without index comparisons; only the diagonal tiles build a mask, and
  tiles wholly above the diagonal are never visited.
- EVEN_Q / EVEN_K say that a sequence length is a multiple of every tile size in use, which lets the compiler
  drop the bounds masks on loads and scores in the common case.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

# Triton decides at decoration time whether kernels are compiled or interpreted, so this module records the
# choice at import; the tests reload the module after setting TRITON_INTERPRET=1.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

LOG2E = 1.4426950408889634
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)


def _configs(tiles: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    """(Q_TILE_SIZE, K_TILE_SIZE, num_warps, num_stages) tuples as autotune configs."""
    return [
        triton.Config({"Q_TILE_SIZE": bq, "K_TILE_SIZE": bk}, num_warps=warps, num_stages=stages)
        for bq, bk, warps, stages in tiles
    ]


# Each kernel's causal split needs the smaller tile to divide the larger one (all sizes are powers of 2).
# Interpreting, one small config keeps tests fast; its uneven tile pair still exercises multi-tile diagonals.
if INTERPRET:
    _FWD = _configs([(32, 16, 4, 1)])
    _DKDV = _configs([(16, 32, 4, 1)])
    _DQ = _configs([(32, 16, 4, 1)])
else:
    # A small Hopper-oriented search; (64, 64, 4, 2) also fits fp32 inputs with d = 128 in shared memory.
    _FWD = _configs(
        [(128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 4), (128, 128, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2)]
    )
    _DKDV = _configs(
        [(64, 128, 8, 3), (64, 128, 4, 3), (32, 128, 4, 3), (64, 64, 4, 3), (64, 64, 4, 2), (32, 64, 4, 2)]
    )
    _DQ = _configs(
        [(128, 64, 8, 3), (128, 64, 4, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 2)]
    )

# Every tile size in use divides this, so "length % TILE_MULTIPLE == 0" means "no ragged tile".
TILE_MULTIPLE = max(max(c.kwargs["Q_TILE_SIZE"], c.kwargs["K_TILE_SIZE"]) for c in _FWD + _DKDV + _DQ)
_PREPROCESS_ROWS = 32 if INTERPRET else 128
_KEY = ["N_QUERIES", "N_KEYS", "D", "IS_CAUSAL"]


# ----------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def _fwd_key_tiles(
    acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kk, stride_vk, offs_q, offs_k, lo, hi, N_KEYS, qk_scale,
    K_TILE_SIZE: tl.constexpr, CAUSAL_MASK: tl.constexpr, BOUNDS_MASK: tl.constexpr,
):
    """Online-softmax update of one query tile over key tiles [lo, hi)."""
    k_ptrs += lo * stride_kk
    v_ptrs += lo * stride_vk
    for start_k in range(lo, hi, K_TILE_SIZE):
        cols = start_k + offs_k
        if BOUNDS_MASK:
            k = tl.load(k_ptrs, mask=cols[:, None] < N_KEYS, other=0.0)
            v = tl.load(v_ptrs, mask=cols[:, None] < N_KEYS, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = tl.dot(q, tl.trans(k))
        if CAUSAL_MASK:
            s = tl.where(offs_q[:, None] >= cols[None, :], s, float("-inf"))
        if BOUNDS_MASK:
            s = tl.where(cols[None, :] < N_KEYS, s, float("-inf"))
        # Each row's first visited tile holds key 0 <= its index, so m_new is finite and no exp2(-inf + inf).
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None])
        m_i = m_new
        k_ptrs += K_TILE_SIZE * stride_kk
        v_ptrs += K_TILE_SIZE * stride_vk
    return acc, l_i, m_i


@triton.autotune(configs=_FWD, key=_KEY)
@triton.jit
def flash_fwd_kernel(
    Q_ptr, K_ptr, V_ptr, O_ptr, L_ptr,
    stride_qb, stride_qq, stride_kb, stride_kk, stride_vb, stride_vk, stride_ob, stride_oq, stride_lb,
    N_QUERIES, N_KEYS, scale,
    D: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_Q: tl.constexpr, EVEN_K: tl.constexpr,
    Q_TILE_SIZE: tl.constexpr, K_TILE_SIZE: tl.constexpr,
):
    query_tile_index = tl.program_id(0)
    if IS_CAUSAL:
        # Later query tiles have the most key tiles; launching them first shortens the tail of the grid.
        query_tile_index = tl.num_programs(0) - 1 - query_tile_index
    batch_index = tl.program_id(1).to(tl.int64)
    q_start = query_tile_index * Q_TILE_SIZE
    offs_q = q_start + tl.arange(0, Q_TILE_SIZE)
    offs_k = tl.arange(0, K_TILE_SIZE)
    offs_d = tl.arange(0, D)

    q_ptrs = Q_ptr + batch_index * stride_qb + offs_q[:, None] * stride_qq + offs_d[None, :]
    k_ptrs = K_ptr + batch_index * stride_kb + offs_k[:, None] * stride_kk + offs_d[None, :]
    v_ptrs = V_ptr + batch_index * stride_vb + offs_k[:, None] * stride_vk + offs_d[None, :]
    if EVEN_Q:
        q = tl.load(q_ptrs)
    else:
        q = tl.load(q_ptrs, mask=offs_q[:, None] < N_QUERIES, other=0.0)

    qk_scale = scale * 1.4426950408889634  # log2(e): softmax in base 2
    m_i = tl.full([Q_TILE_SIZE], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([Q_TILE_SIZE], dtype=tl.float32)
    acc = tl.zeros([Q_TILE_SIZE, D], dtype=tl.float32)
    if IS_CAUSAL:
        # Keys before the tile's first query are visible to all its rows; then the diagonal tiles, masked.
        off_diag_end = tl.minimum(q_start, N_KEYS)
        acc, l_i, m_i = _fwd_key_tiles(
            acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kk, stride_vk, offs_q, offs_k, 0, off_diag_end, N_KEYS,
            qk_scale, K_TILE_SIZE, False, not EVEN_K,
        )
        diag_end = tl.minimum(q_start + Q_TILE_SIZE, N_KEYS)
        acc, l_i, m_i = _fwd_key_tiles(
            acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kk, stride_vk, offs_q, offs_k, q_start, diag_end, N_KEYS,
            qk_scale, K_TILE_SIZE, True, not EVEN_K,
        )
    else:
        acc, l_i, m_i = _fwd_key_tiles(
            acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kk, stride_vk, offs_q, offs_k, 0, N_KEYS, N_KEYS,
            qk_scale, K_TILE_SIZE, False, not EVEN_K,
        )

    o = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # back to natural-log units
    o_ptrs = O_ptr + batch_index * stride_ob + offs_q[:, None] * stride_oq + offs_d[None, :]
    l_ptrs = L_ptr + batch_index * stride_lb + offs_q
    if EVEN_Q:
        tl.store(o_ptrs, o.to(O_ptr.dtype.element_ty))
        tl.store(l_ptrs, lse)
    else:
        tl.store(o_ptrs, o.to(O_ptr.dtype.element_ty), mask=offs_q[:, None] < N_QUERIES)
        tl.store(l_ptrs, lse, mask=offs_q < N_QUERIES)


# ----------------------------------------------------------------------------------------------------------
# Backward: D = rowsum(O * dO), then one pass over key tiles (dK, dV) and one over query tiles (dQ).
# Padded query rows load L = +inf, so their P is exactly 0 and they add nothing to dK, dV.
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def flash_bwd_preprocess_kernel(
    O_ptr, dO_ptr, Delta_ptr, stride_ob, stride_oq, stride_dob, stride_doq, stride_deltab,
    N_QUERIES, D: tl.constexpr, ROWS: tl.constexpr,
):
    batch_index = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_d = tl.arange(0, D)
    in_bounds = rows < N_QUERIES
    o = tl.load(O_ptr + batch_index * stride_ob + rows[:, None] * stride_oq + offs_d[None, :],
                mask=in_bounds[:, None], other=0.0)
    do = tl.load(dO_ptr + batch_index * stride_dob + rows[:, None] * stride_doq + offs_d[None, :],
                 mask=in_bounds[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta_ptr + batch_index * stride_deltab + rows, delta, mask=in_bounds)


@triton.jit
def _dkdv_query_tiles(
    dk, dv, k, v, q_ptrs, do_ptrs, l_ptrs, delta_ptrs, stride_qq, stride_doq, offs_q, offs_k, lo, hi,
    N_QUERIES, qk_scale, Q_TILE_SIZE: tl.constexpr, CAUSAL_MASK: tl.constexpr, EVEN_Q: tl.constexpr,
):
    """Accumulate dK, dV of one key tile over query tiles [lo, hi); works with transposed scores (keys x queries)."""
    q_ptrs += lo * stride_qq
    do_ptrs += lo * stride_doq
    l_ptrs += lo
    delta_ptrs += lo
    for start_q in range(lo, hi, Q_TILE_SIZE):
        rows = start_q + offs_q
        if EVEN_Q:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
            lse2 = tl.load(l_ptrs) * 1.4426950408889634
            delta = tl.load(delta_ptrs)
        else:
            in_bounds = rows < N_QUERIES
            q = tl.load(q_ptrs, mask=in_bounds[:, None], other=0.0)
            do = tl.load(do_ptrs, mask=in_bounds[:, None], other=0.0)
            lse2 = tl.load(l_ptrs, mask=in_bounds, other=float("inf")) * 1.4426950408889634
            delta = tl.load(delta_ptrs, mask=in_bounds, other=0.0)
        s_t = tl.dot(k, tl.trans(q))
        if CAUSAL_MASK:
            s_t = tl.where(rows[None, :] >= offs_k[:, None], s_t, float("-inf"))
        p_t = tl.exp2(s_t * qk_scale - lse2[None, :])
        dv = tl.dot(p_t.to(do.dtype), do, acc=dv)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, acc=dk)
        q_ptrs += Q_TILE_SIZE * stride_qq
        do_ptrs += Q_TILE_SIZE * stride_doq
        l_ptrs += Q_TILE_SIZE
        delta_ptrs += Q_TILE_SIZE
    return dk, dv


@triton.autotune(configs=_DKDV, key=_KEY)
@triton.jit
def flash_bwd_dkdv_kernel(
    Q_ptr, K_ptr, V_ptr, dO_ptr, L_ptr, Delta_ptr, dK_ptr, dV_ptr,
    stride_qb, stride_qq, stride_kb, stride_kk, stride_vb, stride_vk, stride_dob, stride_doq,
    stride_lb, stride_dkb, stride_dkk, stride_dvb, stride_dvk,
    N_QUERIES, N_KEYS, scale,
    D: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_Q: tl.constexpr, EVEN_K: tl.constexpr,
    Q_TILE_SIZE: tl.constexpr, K_TILE_SIZE: tl.constexpr,
):
    batch_index = tl.program_id(1).to(tl.int64)
    k_start = tl.program_id(0) * K_TILE_SIZE
    offs_k = k_start + tl.arange(0, K_TILE_SIZE)
    offs_q = tl.arange(0, Q_TILE_SIZE)
    offs_d = tl.arange(0, D)

    k_ptrs = K_ptr + batch_index * stride_kb + offs_k[:, None] * stride_kk + offs_d[None, :]
    v_ptrs = V_ptr + batch_index * stride_vb + offs_k[:, None] * stride_vk + offs_d[None, :]
    # Key rows past N_KEYS load as zeros; their dK, dV rows are garbage but never stored.
    if EVEN_K:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=offs_k[:, None] < N_KEYS, other=0.0)
        v = tl.load(v_ptrs, mask=offs_k[:, None] < N_KEYS, other=0.0)

    q_ptrs = Q_ptr + batch_index * stride_qb + offs_q[:, None] * stride_qq + offs_d[None, :]
    do_ptrs = dO_ptr + batch_index * stride_dob + offs_q[:, None] * stride_doq + offs_d[None, :]
    l_ptrs = L_ptr + batch_index * stride_lb + offs_q
    delta_ptrs = Delta_ptr + batch_index * stride_lb + offs_q

    qk_scale = scale * 1.4426950408889634
    dk = tl.zeros([K_TILE_SIZE, D], dtype=tl.float32)
    dv = tl.zeros([K_TILE_SIZE, D], dtype=tl.float32)
    if IS_CAUSAL:
        # Queries before the key tile never see it; the diagonal query tiles are masked, later ones are not.
        diag_end = tl.minimum(k_start + K_TILE_SIZE, N_QUERIES)
        dk, dv = _dkdv_query_tiles(
            dk, dv, k, v, q_ptrs, do_ptrs, l_ptrs, delta_ptrs, stride_qq, stride_doq, offs_q, offs_k,
            k_start, diag_end, N_QUERIES, qk_scale, Q_TILE_SIZE, True, EVEN_Q,
        )
        dk, dv = _dkdv_query_tiles(
            dk, dv, k, v, q_ptrs, do_ptrs, l_ptrs, delta_ptrs, stride_qq, stride_doq, offs_q, offs_k,
            k_start + K_TILE_SIZE, N_QUERIES, N_QUERIES, qk_scale, Q_TILE_SIZE, False, EVEN_Q,
        )
    else:
        dk, dv = _dkdv_query_tiles(
            dk, dv, k, v, q_ptrs, do_ptrs, l_ptrs, delta_ptrs, stride_qq, stride_doq, offs_q, offs_k,
            0, N_QUERIES, N_QUERIES, qk_scale, Q_TILE_SIZE, False, EVEN_Q,
        )
    dk *= scale

    dk_ptrs = dK_ptr + batch_index * stride_dkb + offs_k[:, None] * stride_dkk + offs_d[None, :]
    dv_ptrs = dV_ptr + batch_index * stride_dvb + offs_k[:, None] * stride_dvk + offs_d[None, :]
    if EVEN_K:
        tl.store(dk_ptrs, dk.to(dK_ptr.dtype.element_ty))
        tl.store(dv_ptrs, dv.to(dV_ptr.dtype.element_ty))
    else:
        tl.store(dk_ptrs, dk.to(dK_ptr.dtype.element_ty), mask=offs_k[:, None] < N_KEYS)
        tl.store(dv_ptrs, dv.to(dV_ptr.dtype.element_ty), mask=offs_k[:, None] < N_KEYS)


@triton.jit
def _dq_key_tiles(
    dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kk, stride_vk, offs_q, offs_k, lo, hi, N_KEYS, qk_scale,
    K_TILE_SIZE: tl.constexpr, CAUSAL_MASK: tl.constexpr, BOUNDS_MASK: tl.constexpr,
):
    """Accumulate dQ of one query tile over key tiles [lo, hi)."""
    k_ptrs += lo * stride_kk
    v_ptrs += lo * stride_vk
    for start_k in range(lo, hi, K_TILE_SIZE):
        cols = start_k + offs_k
        if BOUNDS_MASK:
            k = tl.load(k_ptrs, mask=cols[:, None] < N_KEYS, other=0.0)
            v = tl.load(v_ptrs, mask=cols[:, None] < N_KEYS, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = tl.dot(q, tl.trans(k))
        if CAUSAL_MASK:
            s = tl.where(offs_q[:, None] >= cols[None, :], s, float("-inf"))
        if BOUNDS_MASK:
            # Not just cosmetic: exp2(0 - L) of a padded key can overflow when all real scores are very negative.
            s = tl.where(cols[None, :] < N_KEYS, s, float("-inf"))
        p = tl.exp2(s * qk_scale - lse2[:, None])
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, acc=dq)
        k_ptrs += K_TILE_SIZE * stride_kk
        v_ptrs += K_TILE_SIZE * stride_vk
    return dq


@triton.autotune(configs=_DQ, key=_KEY)
@triton.jit
def flash_bwd_dq_kernel(
    Q_ptr, K_ptr, V_ptr, dO_ptr, L_ptr, Delta_ptr, dQ_ptr,
    stride_qb, stride_qq, stride_kb, stride_kk, stride_vb, stride_vk, stride_dob, stride_doq,
    stride_lb, stride_dqb, stride_dqq,
    N_QUERIES, N_KEYS, scale,
    D: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_Q: tl.constexpr, EVEN_K: tl.constexpr,
    Q_TILE_SIZE: tl.constexpr, K_TILE_SIZE: tl.constexpr,
):
    query_tile_index = tl.program_id(0)
    if IS_CAUSAL:
        query_tile_index = tl.num_programs(0) - 1 - query_tile_index  # heaviest tiles first
    batch_index = tl.program_id(1).to(tl.int64)
    q_start = query_tile_index * Q_TILE_SIZE
    offs_q = q_start + tl.arange(0, Q_TILE_SIZE)
    offs_k = tl.arange(0, K_TILE_SIZE)
    offs_d = tl.arange(0, D)

    q_ptrs = Q_ptr + batch_index * stride_qb + offs_q[:, None] * stride_qq + offs_d[None, :]
    do_ptrs = dO_ptr + batch_index * stride_dob + offs_q[:, None] * stride_doq + offs_d[None, :]
    l_ptrs = L_ptr + batch_index * stride_lb + offs_q
    delta_ptrs = Delta_ptr + batch_index * stride_lb + offs_q
    if EVEN_Q:
        q = tl.load(q_ptrs)
        do = tl.load(do_ptrs)
        lse2 = tl.load(l_ptrs) * 1.4426950408889634
        delta = tl.load(delta_ptrs)
    else:
        in_bounds = offs_q < N_QUERIES
        q = tl.load(q_ptrs, mask=in_bounds[:, None], other=0.0)
        do = tl.load(do_ptrs, mask=in_bounds[:, None], other=0.0)
        lse2 = tl.load(l_ptrs, mask=in_bounds, other=float("inf")) * 1.4426950408889634
        delta = tl.load(delta_ptrs, mask=in_bounds, other=0.0)

    k_ptrs = K_ptr + batch_index * stride_kb + offs_k[:, None] * stride_kk + offs_d[None, :]
    v_ptrs = V_ptr + batch_index * stride_vb + offs_k[:, None] * stride_vk + offs_d[None, :]
    qk_scale = scale * 1.4426950408889634
    dq = tl.zeros([Q_TILE_SIZE, D], dtype=tl.float32)
    if IS_CAUSAL:
        off_diag_end = tl.minimum(q_start, N_KEYS)
        dq = _dq_key_tiles(
            dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kk, stride_vk, offs_q, offs_k, 0, off_diag_end,
            N_KEYS, qk_scale, K_TILE_SIZE, False, not EVEN_K,
        )
        diag_end = tl.minimum(q_start + Q_TILE_SIZE, N_KEYS)
        dq = _dq_key_tiles(
            dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kk, stride_vk, offs_q, offs_k, q_start, diag_end,
            N_KEYS, qk_scale, K_TILE_SIZE, True, not EVEN_K,
        )
    else:
        dq = _dq_key_tiles(
            dq, q, do, lse2, delta, k_ptrs, v_ptrs, stride_kk, stride_vk, offs_q, offs_k, 0, N_KEYS,
            N_KEYS, qk_scale, K_TILE_SIZE, False, not EVEN_K,
        )
    dq *= scale

    dq_ptrs = dQ_ptr + batch_index * stride_dqb + offs_q[:, None] * stride_dqq + offs_d[None, :]
    if EVEN_Q:
        tl.store(dq_ptrs, dq.to(dQ_ptr.dtype.element_ty))
    else:
        tl.store(dq_ptrs, dq.to(dQ_ptr.dtype.element_ty), mask=offs_q[:, None] < N_QUERIES)


# ----------------------------------------------------------------------------------------------------------
# Launchers: (batch, seq, d) tensors whose last dimension is contiguous.
# ----------------------------------------------------------------------------------------------------------
def _shape_args(q: torch.Tensor, k: torch.Tensor, is_causal: bool) -> dict:
    n_queries, n_keys, d = q.shape[1], k.shape[1], q.shape[2]
    return {
        "N_QUERIES": n_queries,
        "N_KEYS": n_keys,
        "scale": 1.0 / math.sqrt(d),
        "D": d,
        "IS_CAUSAL": is_causal,
        "EVEN_Q": n_queries % TILE_MULTIPLE == 0,
        "EVEN_K": n_keys % TILE_MULTIPLE == 0,
    }


def flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """O (batch, N_q, d) in q's dtype and the logsumexp L (batch, N_q) in float32."""
    batch, n_queries, _ = q.shape
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, n_queries), dtype=torch.float32, device=q.device)

    def grid(meta):
        return (triton.cdiv(n_queries, meta["Q_TILE_SIZE"]), batch)

    flash_fwd_kernel[grid](
        q, k, v, o, lse,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1), lse.stride(0),
        **_shape_args(q, k, is_causal),
    )
    return o, lse


def flash_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV (shapes and dtypes of q, k, v) by recomputation from L, without atomics."""
    batch, n_queries, d = q.shape
    n_keys = k.shape[1]
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    flash_bwd_preprocess_kernel[(triton.cdiv(n_queries, _PREPROCESS_ROWS), batch)](
        o, do, delta, o.stride(0), o.stride(1), do.stride(0), do.stride(1), delta.stride(0),
        n_queries, D=d, ROWS=_PREPROCESS_ROWS,
    )
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    shape_args = _shape_args(q, k, is_causal)

    def dkdv_grid(meta):
        return (triton.cdiv(n_keys, meta["K_TILE_SIZE"]), batch)

    flash_bwd_dkdv_kernel[dkdv_grid](
        q, k, v, do, lse, delta, dk, dv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        lse.stride(0), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        **shape_args,
    )

    def dq_grid(meta):
        return (triton.cdiv(n_queries, meta["Q_TILE_SIZE"]), batch)

    flash_bwd_dq_kernel[dq_grid](
        q, k, v, do, lse, delta, dq,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0), do.stride(1),
        lse.stride(0), dq.stride(0), dq.stride(1),
        **shape_args,
    )
    return dq, dk, dv
