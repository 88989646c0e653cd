"""Gluon attention forward, warp-specialized, FA3-style: a 1-warp TMA producer with separate K and V
rings; two 4-warp consumers of 64 query rows each; in every consumer, block j's scores S_j are issued
together with block j-1's P V (intra-warpgroup overlap) and, with PINGPONG, the two consumers take
turns to issue that pair (an mbarrier per consumer), so one's softmax runs while the other's products
occupy the tensor cores."""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import (
    tma, mbarrier, fence_async_shared, warpgroup_mma, warpgroup_mma_wait)

LOG2E = 1.4426950408889634


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_bars,
              q_row0, kv_row0, n_blocks, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    for i in gl.static_range(2):
        mbarrier.expect(q_bars.index(i), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row0 + i * q_desc.block_type.shape[0], 0], q_bars.index(i),
                                        q_smem.index(i))
    for j in range(n_blocks):
        slot = j % STAGES
        free = ((j // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(slot), free)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row0 + j * BLOCK_N, 0], k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), free)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [kv_row0 + j * BLOCK_N, 0], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _softmax(s, m_i, l_i, MASKED: gl.constexpr, offs_m, cols, qk_scale):
    """Online softmax of one block of raw scores, the scale folded into the exponent's FMA:
    (p, alpha, m, l), m in log2 units."""
    if MASKED:
        s = gl.where(cols[None, :] <= offs_m[:, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)



@gluon.jit
def _step(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turns, p, alpha, m_i, l_i, acc, zero_s, j,
          MASKED: gl.constexpr, offs_m, offs_n, qk_scale, WG: gl.constexpr, STAGES: gl.constexpr,
          PINGPONG: gl.constexpr, p_layout: gl.constexpr, row_o: gl.constexpr):
    """Block j: S_j issued with block j-1's P V, then S_j's softmax while P V runs."""
    BLOCK_N: gl.constexpr = k_smem.type.shape[1]
    slot = j % STAGES
    prev = (j - 1) % STAGES
    mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
    mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
    if PINGPONG:
        mbarrier.wait(turns.index(WG), (j & 1) ^ 1 ^ WG)
    s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    acc = warpgroup_mma(gl.convert_layout(p.to(q.dtype), p_layout), v_smem.index(prev), acc, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turns.index(1 - WG), count=1)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
    mbarrier.arrive(k_empty.index(slot), count=1)
    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, MASKED, offs_m, j * BLOCK_N + offs_n, qk_scale)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(prev), count=1)
    return p, alpha, m_i, l_i, acc


@gluon.jit
def _consumer(o_desc, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_bars, turns, LSE,
              q_row0, lse_row0, n_blocks, m0, qk_scale, WG: gl.constexpr, CAUSAL: gl.constexpr,
              STAGES: gl.constexpr, S_INSTR_N: gl.constexpr, O_INSTR_N: gl.constexpr, PINGPONG: gl.constexpr):
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
    first = m0 + WG * ROWS
    offs_m = first + gl.arange(0, ROWS, layout=row_s)
    offs_n = gl.arange(0, BLOCK_N, layout=col_s)
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.full([ROWS], 0.0, gl.float32, layout=row_s)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    mbarrier.wait(q_bars.index(WG), 0)

    mbarrier.wait(k_ready.index(0), 0)
    if PINGPONG:
        mbarrier.wait(turns.index(WG), 1 ^ WG)
    s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turns.index(1 - WG), count=1)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    mbarrier.arrive(k_empty.index(0), count=1)
    if CAUSAL:  # one block: the diagonal
        if n_blocks == 1:
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, True, offs_m, offs_n, qk_scale)
        else:
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, False, offs_m, offs_n, qk_scale)
    else:
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, False, offs_m, offs_n, qk_scale)
    # the causal diagonal block is the last one: only it is masked, outside the loop
    for j in range(1, n_blocks - CAUSAL):
        p, alpha, m_i, l_i, acc = _step(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turns, p, alpha, m_i,
                                        l_i, acc, zero_s, j, False, offs_m, offs_n, qk_scale, WG, STAGES, PINGPONG,
                                        p_layout, row_o)
    if CAUSAL:
        if n_blocks > 1:
            p, alpha, m_i, l_i, acc = _step(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, turns, p, alpha,
                                            m_i, l_i, acc, zero_s, n_blocks - 1, True, offs_m, offs_n, qk_scale, WG,
                                            STAGES, PINGPONG, p_layout, row_o)
    last = (n_blocks - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // STAGES) & 1)
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(last), count=1)

    o = acc / gl.convert_layout(l_i, row_o)[:, None]
    gl.store(LSE + lse_row0 + WG * ROWS + gl.arange(0, ROWS, layout=row_s), (m_i + gl.log2(l_i)) * 0.6931471805599453)
    q.store(o.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row0 + WG * ROWS, 0], q)
    tma.store_wait(pendings=0)


@gluon.jit
def attn_ws(q_desc, k_desc, v_desc, o_desc, LSE, Hq, GROUP, Sq, Skv, qk_scale,
            CAUSAL: gl.constexpr, STAGES: gl.constexpr, S_INSTR_N: gl.constexpr, O_INSTR_N: gl.constexpr,
            CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, PINGPONG: gl.constexpr):
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
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
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(turns.index(i), count=1)

    gl.warp_specialize([
        (_consumer, (o_desc, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_bars, turns, LSE, q_row0,
                     bh * Sq + m0, n_blocks, m0, qk_scale, 0, CAUSAL, STAGES, S_INSTR_N, O_INSTR_N, PINGPONG)),
        (_consumer, (o_desc, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_bars, turns, LSE, q_row0,
                     bh * Sq + m0, n_blocks, m0, qk_scale, 1, CAUSAL, STAGES, S_INSTR_N, O_INSTR_N, PINGPONG)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_bars,
                     q_row0, kv_row0, n_blocks, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def descriptors(q, k, v, o, rows, block_n):
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    d = q.shape[-1]
    out = []
    for t, r in ((q, rows), (k, block_n), (v, block_n), (o, rows)):
        t2 = t.reshape(-1, d)
        layout = gl.NVMMASharedLayout.get_default_for([r, d], gdt)
        out.append(TensorDescriptor(t2, list(t2.shape), list(t2.stride()), [r, d], layout))
    return out


def attention(q, k, v, causal, scale, block_n=128, stages=2, pingpong=True, regs=(240, 24)):
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    assert Sq % 128 == 0 and Skv % block_n == 0 and (not causal or Sq == Skv)
    o = torch.empty_like(q)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
    qd, kd, vd, od = descriptors(q, k, v, o, 64, block_n)
    attn_ws[(Sq // 128, B * Hq)](
        qd, kd, vd, od, lse, Hq, Hq // Hkv, Sq, Skv, scale * LOG2E,
        CAUSAL=causal, STAGES=stages, S_INSTR_N=min(block_n, 256), O_INSTR_N=min(D, 256),
        CONSUMER_REGS=regs[0], PRODUCER_REGS=regs[1], PINGPONG=pingpong, num_warps=4)
    return o, lse
