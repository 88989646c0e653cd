"""Spike: a Hopper attention forward written in Gluon (Triton's lower-level language: TMA loads
with mbarriers, warpgroup MMA with the accumulator in registers). Not wired into kpt: it measures
whether this route can reach cuDNN. Restrictions of the spike: 16-bit, contiguous [B, H, S, D],
Sq and Skv multiples of the tiles, causal only with Sq == Skv.

One program per (128-query block, batch x head), 8 warps (two warpgroups of 64 rows). K and V stream
through a ring of STAGES shared-memory slots filled by TMA; S = Q K^T and O += P V run on wgmma,
P from registers. With OVERLAP, the next block's Q K^T is issued before this block's softmax, so
the tensor cores work while the softmax runs (FA3's intra-warpgroup overlap)."""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import (
    tma, mbarrier, fence_async_shared, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)

LOG2E = 1.4426950408889634


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, bars, j, kv_row0, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    s = j % STAGES
    bar = bars.index(s)
    mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [kv_row0 + j * BLOCK_N, 0], bar, k_smem.index(s))
    tma.async_copy_global_to_shared(v_desc, [kv_row0 + j * BLOCK_N, 0], bar, v_smem.index(s))


@gluon.jit
def gluon_attn_fwd(q_desc, k_desc, v_desc, o_desc, LSE,
                   Hq, GROUP, Sq, Skv, qk_scale,
                   CAUSAL: gl.constexpr, STAGES: gl.constexpr, OVERLAP: gl.constexpr,
                   S_INSTR_N: gl.constexpr, O_INSTR_N: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype

    num_m = gl.num_programs(0)
    pid_m = num_m - 1 - gl.program_id(0)  # the longest causal rows first
    bh = gl.program_id(1)
    kv_head = (bh // Hq) * (Hq // GROUP) + (bh % Hq) // GROUP
    q_row0 = bh * Sq + pid_m * BLOCK_M
    kv_row0 = kv_head * Skv
    if CAUSAL:
        n_blocks = (pid_m * BLOCK_M + BLOCK_M) // BLOCK_N
    else:
        n_blocks = Skv // BLOCK_N

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, S_INSTR_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, O_INSTR_N, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row0, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES - 1):
        if i < n_blocks:
            _load_kv(k_desc, v_desc, k_smem, v_smem, bars, i, kv_row0, BLOCK_N, STAGES)
    mbarrier.wait(q_bar, phase=0)

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
    offs_n = gl.arange(0, BLOCK_N, layout=col_s)

    if OVERLAP:
        mbarrier.wait(bars.index(0), phase=0)
        s_next = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    for j in range(n_blocks):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        # the slot of block j - 1 is free once its P V finished (waited below): refill it
        if j + STAGES - 1 < n_blocks:
            _load_kv(k_desc, v_desc, k_smem, v_smem, bars, j + STAGES - 1, kv_row0, BLOCK_N, STAGES)
        if OVERLAP:
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, ))
            if j + 1 < n_blocks:  # the next block's scores run on the tensor cores during this softmax
                nslot = (j + 1) % STAGES
                mbarrier.wait(bars.index(nslot), phase=((j + 1) // STAGES) & 1)
                s_next = warpgroup_mma(q_smem, k_smem.index(nslot).permute((1, 0)), zero_s, use_acc=False,
                                       is_async=True)
        else:
            mbarrier.wait(bars.index(slot), phase=phase)
            s = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        s = s * qk_scale
        if CAUSAL:
            if j * BLOCK_N + BLOCK_N > pid_m * BLOCK_M:
                cols = j * BLOCK_N + offs_n
                s = gl.where(cols[None, :] <= offs_m[:, None], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        p = gl.exp2(s - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc = warpgroup_mma(p_op, v_smem.index(slot), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    o = acc / gl.convert_layout(l_i, row_o)[:, None]
    gl.store(LSE + bh * Sq + offs_m, (m_i + gl.log2(l_i)) / 1.4426950408889634)
    q_smem.store(o.to(dtype))  # Q's tile is free: every product that read it has finished
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row0, 0], q_smem)
    tma.store_wait(pendings=0)


def descriptors(q, k, v, o, block_m, block_n):
    """2-D TMA descriptors over [B·H·S, D] views (the spike's S are tile multiples, so a block never
    crosses a head)."""
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    d = q.shape[-1]
    out = []
    for t, rows in ((q, block_m), (k, block_n), (v, block_n), (o, block_m)):
        t2 = t.reshape(-1, d)
        layout = gl.NVMMASharedLayout.get_default_for([rows, d], gdt)
        out.append(TensorDescriptor(t2, list(t2.shape), list(t2.stride()), [rows, d], layout))
    return out


def attention(q, k, v, causal, scale, block_m=128, block_n=128, stages=3, overlap=True, num_warps=8):
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    assert Sq % block_m == 0 and Skv % block_n == 0 and (not causal or Sq == Skv)
    o = torch.empty_like(q)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
    qd, kd, vd, od = descriptors(q, k, v, o, block_m, block_n)
    gluon_attn_fwd[(Sq // block_m, B * Hq)](
        qd, kd, vd, od, lse, Hq, Hq // Hkv, Sq, Skv, scale * LOG2E,
        CAUSAL=causal, STAGES=stages, OVERLAP=overlap, S_INSTR_N=min(block_n, 256), O_INSTR_N=min(D, 256),
        num_warps=num_warps)
    return o, lse


# ---------------------------------------------------------------------------------------------
# Warp-specialized: a 1-warp producer streams Q, K, V by TMA; two 4-warp consumer partitions take
# 64 query rows each of the 128-row tile and run independently, so one's softmax overlaps the
# other's products (the warp schedulers interleave them; FA3 enforces the alternation).


@gluon.jit
def _ws_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, ready, empty, q_bars, q_row0, kv_row0,
                 n_blocks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    for i in gl.static_range(2):
        mbarrier.expect(q_bars.index(i), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row0 + i * q_desc.block_type.shape[0], 0], q_bars.index(i),
                                        q_smem.index(i))
    for j in range(n_blocks):
        slot = j % STAGES
        mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row0 + j * BLOCK_N, 0], bar, k_smem.index(slot))
        tma.async_copy_global_to_shared(v_desc, [kv_row0 + j * BLOCK_N, 0], bar, v_smem.index(slot))


@gluon.jit
def _ws_softmax(s, m_i, l_i, j, first_row, offs_m, offs_n, qk_scale, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """Online softmax of one block of scores: (p, alpha, m, l)."""
    s = s * qk_scale
    if CAUSAL:
        if j * BLOCK_N + BLOCK_N > first_row:
            cols = j * BLOCK_N + offs_n
            s = gl.where(cols[None, :] <= offs_m[:, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    p = gl.exp2(s - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _ws_consumer(o_desc, q_smem, k_smem, v_smem, ready, empty, q_bars, LSE, q_row0, lse_row0, n_blocks, m0,
                 qk_scale, WG: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                 S_INSTR_N: gl.constexpr, O_INSTR_N: gl.constexpr, OVERLAP: gl.constexpr):
    ROWS: gl.constexpr = q_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, S_INSTR_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, O_INSTR_N, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)

    q = q_smem.index(WG)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.full([ROWS], 0.0, gl.float32, layout=row_s)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    offs_m = m0 + WG * ROWS + gl.arange(0, ROWS, layout=row_s)
    offs_n = gl.arange(0, BLOCK_N, layout=col_s)
    mbarrier.wait(q_bars.index(WG), phase=0)
    if OVERLAP:
        # FA3's intra-warpgroup overlap: block j+1's scores are issued before block j's softmax, and
        # block j's P V runs while the next iteration waits; the last block is peeled off
        mbarrier.wait(ready.index(0), 0)
        s_next = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        acc = warpgroup_mma_init(acc)
        for j in range(n_blocks - 1):
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_next, ))  # in flight before: S_j, P V_{j-1}
            nslot = (j + 1) % STAGES
            mbarrier.wait(ready.index(nslot), ((j + 1) // STAGES) & 1)
            s_next = warpgroup_mma(q, k_smem.index(nslot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            p, alpha, m_i, l_i = _ws_softmax(s, m_i, l_i, j, m0 + WG * ROWS, offs_m, offs_n, qk_scale, CAUSAL,
                                             BLOCK_N)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))  # P V_{j-1} done, S_{j+1} may run
            if j > 0:
                mbarrier.arrive(empty.index((j - 1) % STAGES), count=1)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(j % STAGES), acc,
                                is_async=True)
        j = n_blocks - 1
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, ))
        p, alpha, m_i, l_i = _ws_softmax(s, m_i, l_i, j, m0 + WG * ROWS, offs_m, offs_n, qk_scale, CAUSAL, BLOCK_N)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(j % STAGES), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    else:
        for j in range(n_blocks):
            slot = j % STAGES
            mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
            p, alpha, m_i, l_i = _ws_softmax(s, m_i, l_i, j, m0 + WG * ROWS, offs_m, offs_n, qk_scale, CAUSAL,
                                             BLOCK_N)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(slot), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index(slot), count=1)
    o = acc / gl.convert_layout(l_i, row_o)[:, None]
    gl.store(LSE + lse_row0 + WG * ROWS + gl.arange(0, ROWS, layout=row_s),
             (m_i + gl.log2(l_i)) / 1.4426950408889634)
    q.store(o.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row0 + WG * ROWS, 0], q)
    tma.store_wait(pendings=0)


@gluon.jit
def gluon_attn_ws(q_desc, k_desc, v_desc, o_desc, LSE, Hq, GROUP, Sq, Skv, qk_scale,
                  CAUSAL: gl.constexpr, STAGES: gl.constexpr, S_INSTR_N: gl.constexpr, O_INSTR_N: gl.constexpr,
                  CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, OVERLAP: gl.constexpr):
    ROWS: gl.constexpr = q_desc.block_type.shape[0]  # per consumer; the tile is 2 x ROWS queries
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    num_m = gl.num_programs(0)
    pid_m = num_m - 1 - gl.program_id(0)
    bh = gl.program_id(1)
    kv_head = (bh // Hq) * (Hq // GROUP) + (bh % Hq) // GROUP
    m0 = pid_m * 2 * ROWS
    q_row0 = bh * Sq + m0
    kv_row0 = kv_head * Skv
    if CAUSAL:
        n_blocks = (m0 + 2 * ROWS) // BLOCK_N
    else:
        n_blocks = Skv // BLOCK_N

    q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)

    gl.warp_specialize([
        (_ws_consumer, (o_desc, q_smem, k_smem, v_smem, ready, empty, q_bars, LSE, q_row0, bh * Sq + m0, n_blocks,
                        m0, qk_scale, 0, CAUSAL, STAGES, S_INSTR_N, O_INSTR_N, OVERLAP)),
        (_ws_consumer, (o_desc, q_smem, k_smem, v_smem, ready, empty, q_bars, LSE, q_row0, bh * Sq + m0, n_blocks,
                        m0, qk_scale, 1, CAUSAL, STAGES, S_INSTR_N, O_INSTR_N, OVERLAP)),
        (_ws_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, ready, empty, q_bars, q_row0, kv_row0,
                        n_blocks, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def attention_ws(q, k, v, causal, scale, block_n=128, stages=2, consumer_regs=232, producer_regs=40, overlap=False):
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    assert Sq % 128 == 0 and Skv % block_n == 0 and (not causal or Sq == Skv)
    o = torch.empty_like(q)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
    qd, kd, vd, od = descriptors(q, k, v, o, 64, block_n)
    gluon_attn_ws[(Sq // 128, B * Hq)](
        qd, kd, vd, od, lse, Hq, Hq // Hkv, Sq, Skv, scale * LOG2E,
        CAUSAL=causal, STAGES=stages, S_INSTR_N=min(block_n, 256), O_INSTR_N=min(D, 256),
        CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs, OVERLAP=overlap, num_warps=4)
    return o, lse
