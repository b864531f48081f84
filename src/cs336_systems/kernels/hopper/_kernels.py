"""Gluon kernels of the Hopper FlashAttention tier (imported lazily by `flash_attention.py`: needs gluon).

See `flash_attention.py` for the design; this module holds only the kernels and their layouts.
"""

from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)
LN2: gl.constexpr = gl.constexpr(0.6931471805599453)


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Adds the shared-memory tile `src` into the global tile of `tensor_desc` at `coord` by a TMA reduction
    (cp.reduce.async.bulk.tensor ... .add): Gluon 3.6 has the builder's op but no Python wrapper for it.
    Completion is waited for like a TMA store's (`tma.store_wait`)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(
        ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle
    )


# dQ's float32 tile in shared memory is unswizzled, as its TMA reduction reads it, but written from the wgmma layout
# with row r's 8-column groups permuted (column c at c ^ 8 (r % 4)), so that a warp's 8 rows of 8 columns spread
# over the banks; the dQ accumulator in global memory holds each row so permuted, and dq_convert_kernel undoes it.
# (Stored into the 128-byte-swizzled tile TMA would otherwise use, the stores took 3x the shared-memory wavefronts.)
DQ_STORE_LAYOUT: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=4, order=[1, 0])


@gluon.constexpr_function
def mma_layout(num_warps, n):
    """The wgmma accumulator layout of an (M x n) tile: warps stacked along M (16 rows per warp, 64 per
    warpgroup), one instruction n wide (n <= 256)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


# fmt: off
# ----------------------------------------------------------------------------------------------------------
# Forward, persistent: one program per SM (two with one consumer warpgroup) takes work items (a query tile of a batch
# element) from a counter, so that its producer loads the next item's Q, K and V while the consumers finish the
# current one and its epilogue, instead of each program paying its prologue and epilogue alone.
# ----------------------------------------------------------------------------------------------------------
@gluon.jit
def _masked_scores(s, tile, row_start, n_unmasked, N_KEYS, IS_CAUSAL: gl.constexpr, BM: gl.constexpr,
                   BN: gl.constexpr, s_layout: gl.constexpr):
    """-inf where a key is past N_KEYS or (causal) after the query; only tiles that need it build the mask."""
    if (tile >= n_unmasked) | (tile * BN + BN > N_KEYS):
        # Keys counted from the tile's first: a column keeps its score below a limit per row (N_KEYS, and causal the
        # row's own key + 1), so the columns are the layout's constants, not a register each for every tile.
        limit = gl.full([BM], N_KEYS - tile * BN, gl.int32, gl.SliceLayout(1, s_layout))
        if IS_CAUSAL:
            rows = row_start - tile * BN + gl.arange(0, BM, gl.SliceLayout(1, s_layout))
            limit = gl.minimum(limit, rows + 1)
        keep = gl.arange(0, BN, gl.SliceLayout(0, s_layout))[None, :] < limit[:, None]
        s = gl.where(keep, s, float("-inf"))
    return s


@gluon.jit
def _turn_wait(turn, WG: gl.constexpr, j, PINGPONG: gl.constexpr):
    """Ping-pong: wait until the previous consumer warpgroup has issued its j-th group of GEMMs (warpgroup 0
    passes its first wait: a fresh barrier counts as having completed the phase before phase 0)."""
    if PINGPONG:
        if WG == 0:
            mbarrier.wait(turn.index(0), (j & 1) ^ 1)
        else:
            mbarrier.wait(turn.index(WG), j & 1)


@gluon.jit
def _turn_pass(turn, WG: gl.constexpr, N_CONS: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turn.index((WG + 1) % N_CONS))


@gluon.jit
def _fwd_item(item, n_q_tiles, BH, SECTION, N_KEYS, IS_CAUSAL: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
    """Work item -> (batch element, first query, key tiles, key tiles before the diagonal). Items go by sections of
    SECTION batch elements (the launcher's choice: items handed out together share their K and V in L2) and, within
    one, query tile by query tile across the section, the longest first when causal (a short tail)."""
    per_section = SECTION * n_q_tiles
    section = item // per_section
    size = gl.minimum(SECTION, BH - section * SECTION)
    r = item - section * per_section
    q_tile = r // size
    if IS_CAUSAL:
        q_tile = n_q_tiles - 1 - q_tile
    q_start = q_tile * BM
    n_key_tiles = gl.cdiv(N_KEYS, BN)
    if IS_CAUSAL:
        n_tiles = gl.minimum(gl.cdiv(q_start + BM, BN), n_key_tiles)
        n_unmasked = q_start // BN
    else:
        n_tiles = n_key_tiles
        n_unmasked = n_key_tiles
    return section * SECTION + r % size, q_start, n_tiles, n_unmasked


@gluon.jit
def _fetch_add_one(counter_ptr, layout: gl.constexpr):
    """The counter's old value, incremented once by lane 0 of this (one-warp) partition and shared by shuffle."""
    ptr = (counter_ptr + gl.zeros([1], gl.int32, layout)).to(gl.int64, bitcast=True)
    old = gl.inline_asm_elementwise(
        "{ .reg .pred lane0; .reg .b32 lane, got; mov.u32 lane, %laneid; mov.u32 got, 0; setp.eq.u32 lane0, lane, 0; "
        "@lane0 atom.global.add.u32 got, [$1], 1; shfl.sync.idx.b32 $0, got, 0, 0x1f, 0xffffffff; }",
        "=r,l", [ptr], dtype=gl.int32, is_pure=False, pack=1,
    )
    return gl.max(old, 0)


@gluon.jit
def _post_item(sched, item_ready, item_empty, j, item, layout: gl.constexpr):
    """Hand work item `item` (n_work: none left) to the consumers through slot j % 2."""
    slot = j % 2
    mbarrier.wait(item_empty.index(slot), ((j // 2) & 1) ^ 1)
    sched.index(slot).store(gl.full([1], item, gl.int32, layout))
    mbarrier.arrive(item_ready.index(slot))


@gluon.jit
def _take_item(sched, item_ready, j, layout: gl.constexpr):
    """Work item j (its slot stays the consumers' until they arrive on its 'empty' barrier)."""
    slot = j % 2
    mbarrier.wait(item_ready.index(slot), (j // 2) & 1)
    return gl.max(sched.index(slot).load(layout), 0)


@gluon.jit
def _fwd_load(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, sched, counter_ptr, n_work, n_q_tiles, BH,
              SECTION, N_KEYS, IS_CAUSAL: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
              N_CONS: gl.constexpr):
    """Producer (one warp): takes items from the counter (the first one is the program's id), hands each to the
    consumers, then loads its Q once both consumers are done with the previous Q, and its K and V tiles into the
    ring, which runs on across items."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, item_ready, item_empty = bars
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    Q_BYTES: gl.constexpr = q_desc.block_type.nbytes * N_CONS
    item = gl.program_id(0)
    n_programs = gl.num_programs(0)
    j = 0
    it = 0
    while item < n_work:
        _post_item(sched, item_ready, item_empty, j, item, layout)
        batch, q_start, n_tiles, n_unmasked = _fwd_item(item, n_q_tiles, BH, SECTION, N_KEYS, IS_CAUSAL, BM, BN)
        mbarrier.wait(q_empty, (j & 1) ^ 1)
        mbarrier.expect(q_ready, Q_BYTES)
        for w in gl.static_range(N_CONS):
            tma.async_copy_global_to_shared(q_desc, [batch, q_start + w * 64, 0], q_ready, q_smem.index(w))
        for i in range(n_tiles):
            stage = it % STAGES
            phase = (it // STAGES) & 1
            mbarrier.wait(k_empty.index(stage), phase ^ 1)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [batch, i * BN, 0], k_ready.index(stage), k_smem.index(stage))
            mbarrier.wait(v_empty.index(stage), phase ^ 1)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [batch, i * BN, 0], v_ready.index(stage), v_smem.index(stage))
            it += 1
        item = _fetch_add_one(counter_ptr, layout) + n_programs
        j += 1
    _post_item(sched, item_ready, item_empty, j, n_work, layout)


@gluon.jit
def _fwd_consumer(WG: gl.constexpr, args, IS_CAUSAL: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                  D: gl.constexpr, STAGES: gl.constexpr, N_CONS: gl.constexpr, PINGPONG: gl.constexpr):
    """One consumer warpgroup (its own partition: its barrier arrivals synchronise only its 128 threads) owning 64
    query rows of each work item: S = Q K^T and O += P V by asynchronous wgmma, the accumulators in registers, online
    softmax in base 2, then its own epilogue (O through a shared-memory buffer by TMA, L by a masked store).

    Software pipelined as FlashAttention-3's intra-warpgroup overlap: S of tile i+1 and P V of tile i are both
    in flight while the softmax of tile i+1 runs; O is rescaled once its wgmma has retired. With PINGPONG the
    warpgroups take turns issuing their GEMMs (mbarriers 'turn'), so that one's softmax runs under the other's
    GEMMs. The ring's position, the turns and Q's phase run on across items; Q is released as soon as the item's
    last S has retired (the producer loads the next item's Q under the last P V and the epilogue), and O's buffer is
    waited for (its previous TMA store) only when it is next written."""
    q_smem, k_smem, v_smem, o_smem, bars, sched, o_desc, L_ptr, n_work, n_q_tiles, BH, SECTION, N_QUERIES, \
        N_KEYS, qk_scale = args
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, item_ready, item_empty = bars
    BMW: gl.constexpr = 64
    s_layout: gl.constexpr = mma_layout(4, BN)
    o_layout: gl.constexpr = mma_layout(4, D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    item_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    dtype: gl.constexpr = q_smem.dtype
    q = q_smem.index(WG).reshape([BMW, D])
    s_zero = gl.zeros([BMW, BN], gl.float32, s_layout)
    j = 0
    it = 0  # key tiles of the items before: the ring's position; it + j is the ping-pong turn's
    item = _take_item(sched, item_ready, j, item_layout)
    while item < n_work:
        batch, q_start, n_tiles, n_unmasked = _fwd_item(item, n_q_tiles, BH, SECTION, N_KEYS, IS_CAUSAL, BM, BN)
        row_start = q_start + WG * BMW
        mbarrier.wait(q_ready, j & 1)
        stage = it % STAGES
        mbarrier.wait(k_ready.index(stage), (it // STAGES) & 1)
        _turn_wait(turn, WG, it + j, PINGPONG)
        s = warpgroup_mma(q, k_smem.index(stage).reshape([BN, D]).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        _turn_pass(turn, WG, N_CONS, PINGPONG)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(stage))
        s = _masked_scores(s, 0, row_start, n_unmasked, N_KEYS, IS_CAUSAL, BMW, BN, s_layout)
        m_i = gl.max(s, 1) * qk_scale
        p = gl.exp2(s * qk_scale - m_i[:, None])
        l_i = gl.sum(p, 1)
        acc = gl.zeros([BMW, D], gl.float32, o_layout)
        for i in range(1, n_tiles):
            stage = (it + i) % STAGES
            prev = (it + i - 1) % STAGES
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            mbarrier.wait(k_ready.index(stage), ((it + i) // STAGES) & 1)
            mbarrier.wait(v_ready.index(prev), ((it + i - 1) // STAGES) & 1)
            _turn_wait(turn, WG, it + j + i, PINGPONG)
            s = warpgroup_mma(q, k_smem.index(stage).reshape([BN, D]).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
            acc = warpgroup_mma(p_op, v_smem.index(prev).reshape([BN, D]), acc, is_async=True)
            _turn_pass(turn, WG, N_CONS, PINGPONG)
            s = warpgroup_mma_wait(1, deps=(s,))
            mbarrier.arrive(k_empty.index(stage))
            s = _masked_scores(s, i, row_start, n_unmasked, N_KEYS, IS_CAUSAL, BMW, BN, s_layout)
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s * qk_scale - m_new[:, None])
            l_i = l_i * alpha + gl.sum(p, 1)
            m_i = m_new
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
            mbarrier.arrive(v_empty.index(prev))
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        mbarrier.arrive(q_empty)  # every S of this item has retired: the producer may load the next Q
        last = (it + n_tiles - 1) % STAGES
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        mbarrier.wait(v_ready.index(last), ((it + n_tiles - 1) // STAGES) & 1)
        _turn_wait(turn, WG, it + j + n_tiles, PINGPONG)
        acc = warpgroup_mma(p_op, v_smem.index(last).reshape([BN, D]), acc, is_async=True)
        _turn_pass(turn, WG, N_CONS, PINGPONG)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        mbarrier.arrive(v_empty.index(last))

        # the item again from its slot (fewer registers live across the loop), then the slot goes back
        item = _take_item(sched, item_ready, j, item_layout)
        mbarrier.arrive(item_empty.index(j % 2))
        batch, q_start, n_tiles, n_unmasked = _fwd_item(item, n_q_tiles, BH, SECTION, N_KEYS, IS_CAUSAL, BM, BN)
        row_start = q_start + WG * BMW
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        o = (acc / l_o[:, None]).to(dtype)
        tma.store_wait(0)  # the previous item's O has left this buffer
        gl.thread_barrier()
        # The buffer's index as a function of the item read after the loop (it is WG: items are never negative), so
        # that the compiler cannot compute the store's addresses once before every loop and hold them throughout.
        o_buf = o_smem.index(WG + (item < 0).to(gl.int32))
        o_buf.reshape([BMW, D]).store(o)
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [batch, row_start, 0], o_buf)
        rows = row_start + gl.arange(0, BMW, m_i.type.layout)
        lse = (m_i + gl.log2(l_i)) * LN2  # natural-log units
        gl.store(L_ptr + batch.to(gl.int64) * N_QUERIES + rows, lse, mask=rows < N_QUERIES)
        it += n_tiles
        j += 1
        item = _take_item(sched, item_ready, j, item_layout)
    mbarrier.arrive(item_empty.index(j % 2))
    tma.store_wait(0)


@gluon.jit
def flash_fwd_kernel(q_desc, k_desc, v_desc, o_desc, L_ptr, counter_ptr, N_QUERIES, N_KEYS, BH, SECTION, qk_scale,
                     IS_CAUSAL: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                     STAGES: gl.constexpr, PINGPONG: gl.constexpr, CONS_REGS: gl.constexpr,
                     num_warps: gl.constexpr):
    """BM = 64 x (consumer warpgroups, one or two): the default partition (num_warps = 4) is consumer 0; the other
    and the producer warp are worker partitions. `counter_ptr` (int32, zero at launch) hands out the work items after each
    program's first (its program id); BH batch elements, in sections of SECTION (`_fwd_item`)."""
    N_CONS: gl.constexpr = BM // 64
    n_q_tiles = gl.cdiv(N_QUERIES, BM)
    n_work = n_q_tiles * BH
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [N_CONS, 1, 64, D], q_desc.layout)
    o_smem = gl.allocate_shared_memory(dtype, [N_CONS, 1, 64, D], o_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BN, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BN, D], v_desc.layout)
    sched = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [N_CONS, 1], mbarrier.MBarrierLayout())
    item_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    item_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    mbarrier.init(q_empty, count=N_CONS)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=N_CONS)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(v_empty.index(s), count=N_CONS)
    for w in gl.static_range(N_CONS):
        mbarrier.init(turn.index(w), count=1)
    for s in gl.static_range(2):
        mbarrier.init(item_ready.index(s), count=1)
        mbarrier.init(item_empty.index(s), count=N_CONS)
    bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, item_ready, item_empty)

    args = (q_smem, k_smem, v_smem, o_smem, bars, sched, o_desc, L_ptr, n_work, n_q_tiles, BH, SECTION, N_QUERIES,
            N_KEYS, qk_scale)
    if N_CONS == 1:
        gl.warp_specialize([
            (_fwd_consumer, (0, args, IS_CAUSAL, BM, BN, D, STAGES, N_CONS, PINGPONG)),
            (_fwd_load, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, sched, counter_ptr, n_work, n_q_tiles, BH, SECTION, N_KEYS, IS_CAUSAL, BM, BN, STAGES, N_CONS)),
        ], [1], [24])
    else:
        gl.warp_specialize([
            (_fwd_consumer, (0, args, IS_CAUSAL, BM, BN, D, STAGES, N_CONS, PINGPONG)),
            (_fwd_consumer, (1, args, IS_CAUSAL, BM, BN, D, STAGES, N_CONS, PINGPONG)),
            (_fwd_load, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, sched, counter_ptr, n_work, n_q_tiles, BH, SECTION, N_KEYS, IS_CAUSAL, BM, BN, STAGES, N_CONS)),
        ], [4, 1], [CONS_REGS, 24])


@gluon.jit
def zero_kernel(ptr, num_warps: gl.constexpr):
    """Zeroes one int32 (the persistent forward's work counter: a launch, so that flash_replay repeats it)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    gl.store(ptr + gl.arange(0, 1, layout), gl.zeros([1], gl.int32, layout))


# ----------------------------------------------------------------------------------------------------------
# Backward: one program per key tile computes its dK, dV over the query tiles in registers and adds each query
# tile's share of dQ into a float32 buffer by a TMA reduction. Delta = rowsum(O * dO) comes from a preprocessing
# kernel. Everything is in transposed (key x query) form, so that the key tile is the wgmma M dimension.
# ----------------------------------------------------------------------------------------------------------
@gluon.jit
def _bwd_load(k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem, lse_smem,
              delta_smem, bars, batch, k_start, first_tile, n_tiles, BM: gl.constexpr, STAGES: gl.constexpr):
    """Producer partition (one warp): K, V of the program's key tile once, then Q, dO, L and Delta of each
    query tile into a STAGES-deep ring (Q with L and Delta on one barrier, dO on another; one 'empty' barrier)."""
    kv_bar, q_ready, do_ready, qdo_empty = bars
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [batch, k_start, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [batch, k_start, 0], kv_bar, v_smem)
    for i in range(n_tiles):
        stage = i % STAGES
        phase = (i // STAGES) & 1
        q_start = (first_tile + i) * BM
        mbarrier.wait(qdo_empty.index(stage), phase ^ 1)
        mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes + 2 * lse_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [batch, q_start, 0], q_ready.index(stage), q_smem.index(stage))
        tma.async_copy_global_to_shared(lse_desc, [batch, q_start], q_ready.index(stage), lse_smem.index(stage))
        tma.async_copy_global_to_shared(delta_desc, [batch, q_start], q_ready.index(stage), delta_smem.index(stage))
        mbarrier.expect(do_ready.index(stage), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [batch, q_start, 0], do_ready.index(stage), do_smem.index(stage))


@gluon.jit
def _bwd_mma(k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, bars, dq_desc, batch, k_start,
             first_tile, n_tiles, N_KEYS, qk_scale, IS_CAUSAL: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
             D: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """Consumer partition: per query tile, S^T = K Q^T and dP^T = V dO^T (both in flight together), P^T, dV +=
    P^T dO, dS^T = P^T (dP^T - Delta), dK += dS^T Q, and dQ = dS K (dS through shared memory). dQ goes to one
    of two shared-memory buffers; the next tile issues its TMA reduction into the float32 dQ buffer, which then
    runs beside that tile's GEMMs (the consumers never issue an atomic)."""
    kv_bar, q_ready, do_ready, qdo_empty = bars
    st_layout: gl.constexpr = mma_layout(num_warps, BM)  # (keys x queries) tiles: S^T, dP^T
    kv_layout: gl.constexpr = mma_layout(num_warps, D)  # dK, dV
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                        instr_shape=[16, D // (num_warps // 4), 16])
    dtype: gl.constexpr = k_smem.dtype
    k = k_smem.reshape([BN, D])
    v = v_smem.reshape([BN, D])
    st_zero = gl.zeros([BN, BM], gl.float32, st_layout)
    dq_zero = gl.zeros([BM, D], gl.float32, dq_layout)
    dk = gl.zeros([BN, D], gl.float32, kv_layout)
    dv = gl.zeros([BN, D], gl.float32, kv_layout)
    keys = k_start + gl.arange(0, BN, gl.SliceLayout(1, st_layout))
    arange_q = gl.arange(0, BM, gl.SliceLayout(0, st_layout))
    ragged_keys = k_start + BN > N_KEYS

    mbarrier.wait(kv_bar, 0)
    for i in range(n_tiles):
        stage = i % STAGES
        phase = (i // STAGES) & 1
        q_start = (first_tile + i) * BM
        q = q_smem.index(stage).reshape([BM, D])
        do = do_smem.index(stage).reshape([BM, D])
        mbarrier.wait(q_ready.index(stage), phase)
        s_t = warpgroup_mma(k, q.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        mbarrier.wait(do_ready.index(stage), phase)
        dp_t = warpgroup_mma(v, do.permute((1, 0)), st_zero, use_acc=False, is_async=True)
        s_t = warpgroup_mma_wait(1, deps=(s_t,))
        if (IS_CAUSAL & (q_start < k_start + BN)) | ragged_keys:
            # Keys past N_KEYS must be -inf too: exp2(0 - L) of a zero-filled key can overflow.
            keep = keys[:, None] < N_KEYS
            if IS_CAUSAL:
                keep = keep & (keys[:, None] <= (q_start + arange_q)[None, :])
            s_t = gl.where(keep, s_t, float("-inf"))
        # L log2(e) and Delta of the query tile; padded queries have L = +inf, so their P is exactly 0.
        lse2 = lse_smem.index(stage).reshape([BM]).load(gl.SliceLayout(0, st_layout))
        p_t = gl.exp2(s_t * qk_scale - lse2[None, :])
        p_op = gl.convert_layout(p_t.to(dtype), op_layout)
        dv = warpgroup_mma(p_op, do, dv, is_async=True)
        dp_t = warpgroup_mma_wait(1, deps=(dp_t,))
        delta = delta_smem.index(stage).reshape([BM]).load(gl.SliceLayout(0, st_layout))
        ds_t = (p_t * (dp_t - delta[None, :])).to(dtype)
        ds_op = gl.convert_layout(ds_t, op_layout)
        dk = warpgroup_mma(ds_op, q, dk, is_async=True)
        ds_smem.store(ds_t)
        # Orders the generic-proxy accesses of this iteration (dS and the previous tile's dQ written; L and Delta
        # read) before the async proxy's: the dQ wgmma and TMA reduction below, and the producer's next TMA into
        # this stage once it is released.
        fence_async_shared()
        tma.store_wait(0)  # the reduction that last read this tile's dQ buffer (two tiles back) is done
        gl.thread_barrier()  # every warpgroup's rows of dS^T and of the previous tile's dQ are in place
        if i > 0:  # the previous tile's dQ: the TMA unit adds it while this tile's dQ, dK, dV run
            tma_reduce_add(dq_desc, [batch, q_start - BM, 0], dq_smem.index((i - 1) % 2))
        dq = warpgroup_mma(ds_smem.permute((1, 0)), k, dq_zero, use_acc=False, is_async=True)
        dv, p_op, dk, ds_op, dq = warpgroup_mma_wait(0, deps=(dv, p_op, dk, ds_op, dq))
        mbarrier.arrive(qdo_empty.index(stage))
        dq_smem.index(i % 2).reshape([BM, D])._reinterpret(gl.float32, [BM, D], DQ_STORE_LAYOUT).store(dq)
    if n_tiles > 0:  # the last tile's dQ
        fence_async_shared()
        gl.thread_barrier()
        tma_reduce_add(dq_desc, [batch, (first_tile + n_tiles - 1) * BM, 0], dq_smem.index((n_tiles - 1) % 2))
        tma.store_wait(0)
    return dk, dv


@gluon.jit
def _rotated_back(x, cos_ptr, sin_ptr, start, n_rows, ROWS: gl.constexpr, D: gl.constexpr, layout: gl.constexpr):
    """x (ROWS x D rows of positions start.., in `layout`, which holds each feature pair (2i, 2i+1) in one thread,
    as wgmma's accumulator does) with every pair rotated back by its position's angle: RoPE's backward as
    kernels/rope.py computes it (float32, the tables rounded to x's dtype first), so that the two agree."""
    rows = start + gl.arange(0, ROWS, gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, gl.SliceLayout(0, layout))
    # each pair's table entry, split as the pairs are below (so in their layout); rows past n_rows are not stored
    table, _ = gl.split(gl.reshape(rows[:, None] * (D // 2) + cols[None, :] // 2, [ROWS, D // 2, 2]))
    in_table = table < n_rows * (D // 2)
    c = gl.load(cos_ptr + table, mask=in_table, other=0.0).to(x.dtype).to(gl.float32)
    s = gl.load(sin_ptr + table, mask=in_table, other=0.0).to(x.dtype).to(gl.float32) * -1.0
    even, odd = gl.split(gl.reshape(x.to(gl.float32), [ROWS, D // 2, 2]))
    return gl.reshape(gl.join(even * c - odd * s, even * s + odd * c), [ROWS, D]).to(x.dtype)


@gluon.jit
def flash_bwd_kernel(k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, dk_desc, dv_desc, dq_desc, cos_ptr,
                     sin_ptr, N_QUERIES, N_KEYS, qk_scale, scale, IS_CAUSAL: gl.constexpr, ROTATE: gl.constexpr,
                     BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                     num_warps: gl.constexpr):
    """dK and dV of one key tile (dK rotated back by RoPE's tables cos, sin where ROTATE); dQ's tiles added to the
    float32 accumulator (see _bwd_mma)."""
    batch = gl.program_id(1)
    k_start = gl.program_id(0) * BN
    n_q_tiles = gl.cdiv(N_QUERIES, BM)
    if IS_CAUSAL:
        first_tile = gl.minimum(k_start // BM, n_q_tiles)  # earlier queries never see this key tile
    else:
        first_tile = 0
    n_tiles = n_q_tiles - first_tile

    dtype: gl.constexpr = k_desc.dtype
    k_smem = gl.allocate_shared_memory(dtype, [1, BN, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, BN, D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BM, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BM, D], do_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BM], lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BM], delta_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BM], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [BN, BM], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, 1, BM, D], dq_desc.layout)  # two query tiles' dQ
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(s), count=1)
        mbarrier.init(do_ready.index(s), count=1)
        mbarrier.init(qdo_empty.index(s), count=1)
    bars = (kv_bar, q_ready, do_ready, qdo_empty)

    dk, dv = gl.warp_specialize([
        (_bwd_mma, (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, bars, dq_desc, batch,
                    k_start, first_tile, n_tiles, N_KEYS, qk_scale, IS_CAUSAL, BM, BN, D, STAGES, num_warps)),
        (_bwd_load, (k_desc, v_desc, q_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem, do_smem,
                     lse_smem, delta_smem, bars, batch, k_start, first_tile, n_tiles, BM, STAGES)),
    ], [1], [24])

    # K and V are spent: their buffers stage dK and dV for TMA stores, which clip rows past N_KEYS.
    v_smem.reshape([BN, D]).store(dv.to(dtype))
    dk = (dk * scale).to(dtype)
    if ROTATE:
        dk = _rotated_back(dk, cos_ptr, sin_ptr, k_start, N_KEYS, BN, D, mma_layout(num_warps, D))
    k_smem.reshape([BN, D]).store(dk)
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [batch, k_start, 0], k_smem)
    tma.async_copy_shared_to_global(dv_desc, [batch, k_start, 0], v_smem)
    tma.store_wait(0)
# fmt: on


# ----------------------------------------------------------------------------------------------------------
# Small helpers of the backward (Gluon too, so that they compile even where TRITON_INTERPRET=1 turned plain
# Triton kernels into interpreted ones): L log2(e) and Delta into padded rows for TMA, and dQ's conversion.
# ----------------------------------------------------------------------------------------------------------
@gluon.jit
def bwd_preprocess_kernel(
    O_ptr,
    dO_ptr,
    L_ptr,
    Lse2_ptr,
    Delta_ptr,
    dQacc_ptr,
    stride_ob,
    stride_os,
    stride_dob,
    stride_dos,
    N_QUERIES,
    N_PAD,
    D: gl.constexpr,
    ROWS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Per query row: L log2(e) and Delta = rowsum(O * dO) into (batch, N_PAD) float32 buffers whose rows are
    16-byte aligned (TMA); padded rows get L = +inf (P = 0) and Delta = 0. Zeroes the row's dQ accumulator too
    (one launch fewer than a memset). O and dO: (batch, row) strides as given, unit stride along d."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    batch = gl.program_id(1).to(gl.int64)
    rows = gl.program_id(0) * ROWS + gl.arange(0, ROWS, gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, gl.SliceLayout(0, layout))
    in_bounds = rows < N_QUERIES
    offs = (batch * N_QUERIES + rows)[:, None] * D + cols[None, :]  # the dQ accumulator's (contiguous)
    o_offs = batch * stride_ob + rows[:, None].to(gl.int64) * stride_os + cols[None, :]
    do_offs = batch * stride_dob + rows[:, None].to(gl.int64) * stride_dos + cols[None, :]
    o = gl.load(O_ptr + o_offs, mask=in_bounds[:, None], other=0.0).to(gl.float32)
    do = gl.load(dO_ptr + do_offs, mask=in_bounds[:, None], other=0.0).to(gl.float32)
    lse = gl.load(L_ptr + batch * N_QUERIES + rows, mask=in_bounds, other=float("inf"))
    gl.store(Delta_ptr + batch * N_PAD + rows, gl.sum(o * do, 1), mask=rows < N_PAD)
    gl.store(Lse2_ptr + batch * N_PAD + rows, lse * LOG2E, mask=rows < N_PAD)
    gl.store(dQacc_ptr + offs, gl.zeros([ROWS, D], gl.float32, layout), mask=in_bounds[:, None])


@gluon.jit
def dq_convert_kernel(
    dQacc_ptr,
    dQ_ptr,
    cos_ptr,
    sin_ptr,
    N_QUERIES,
    stride_b,
    stride_s,
    scale,
    D: gl.constexpr,
    ROTATE: gl.constexpr,
    ROWS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """dQ = scale * the float32 accumulator, in dQ's dtype, for ROWS query rows of one batch element; the
    accumulator's rows hold their columns as DQ_STORE_LAYOUT permuted them (column c of row r at c ^ 8 (r % 4): XOR
    within 32 columns, D a multiple of 32). dQ: (batch, row) strides as given, unit stride along d. Where ROTATE,
    each feature pair (2i, 2i+1) is rotated back by its position's angle from the tables cos, sin as RoPE's
    backward (kernels/rope.py) does to the rounded dQ: float32, the tables rounded to dQ's dtype first."""
    dtype: gl.constexpr = dQ_ptr.dtype.element_ty
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [128 // D, D // 4], [num_warps, 1], [1, 0])
    batch = gl.program_id(1).to(gl.int64)
    row_start = gl.program_id(0) * ROWS
    rows = row_start + gl.arange(0, ROWS, gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, gl.SliceLayout(0, layout))
    in_bounds = (rows < N_QUERIES)[:, None] & (cols < D)[None, :]
    # the permutation moves whole runs of 8 columns (XOR by multiples of 8): each thread's 4 stay together
    permuted = gl.max_contiguous(gl.multiple_of(cols[None, :] ^ ((rows % 4) * 8)[:, None], [1, 4]), [1, 4])
    acc = dQacc_ptr + (batch * N_QUERIES + rows)[:, None] * D  # the rows in the (contiguous) accumulator
    dq = (gl.load(acc + permuted, mask=in_bounds) * scale).to(dtype)
    if ROTATE:  # each thread holds whole feature pairs
        dq = _rotated_back(dq, cos_ptr, sin_ptr, row_start, N_QUERIES, ROWS, D, layout)
    out = dQ_ptr + batch * stride_b + rows[:, None].to(gl.int64) * stride_s + cols[None, :]
    gl.store(out, dq, mask=in_bounds)
