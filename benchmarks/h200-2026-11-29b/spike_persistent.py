"""Spike: kpt-cuda's warp-specialized attention forward as a persistent kernel whose tiles run in
L2 sections (the query tiles of a few heads at a time, longest first), and the same tile order
with one program per tile. Built from `kpt_cuda.attention`'s kernel; `attention(...)` runs it."""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

from kpt_cuda import attention as A

_tma_load, _tma_store = A._tma_load, A._tma_store


@gluon.jit
def _tile(t, Hq, Sq, Skv, n_heads, sec_heads, CAUSAL: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
    """Tile t: (b, h, first query row, key blocks). Sections of sec_heads heads (batch-major), in each
    the query tiles from the last (longest causal rows) to the first, the heads fastest."""
    n_q = gl.cdiv(Sq, 2 * ROWS)
    per_section = sec_heads * n_q
    section = t // per_section
    within = t - section * per_section
    head0 = section * sec_heads
    n_sec = gl.minimum(sec_heads, n_heads - head0)
    qi = within // n_sec
    bh = head0 + within - qi * n_sec
    q_row = (n_q - 1 - qi) * 2 * ROWS
    if CAUSAL:
        n_blocks = gl.cdiv(gl.minimum(q_row + 2 * ROWS + Skv - Sq, Skv), BLOCK_N)
    else:
        n_blocks = gl.cdiv(Skv, BLOCK_N)
    return bh // Hq, bh % Hq, q_row, n_blocks


@gluon.jit
def _order(r, SNAKE: gl.constexpr):
    """This program's tile of round r: program p takes tile r·G + p, or with SNAKE in odd rounds
    r·G + G − 1 − p (the programs with the longest causal tiles of one round get the shortest of the next)."""
    G = gl.num_programs(0)
    p = gl.program_id(0)
    if SNAKE:
        p = gl.where(r % 2 == 0, p, G - 1 - p)
    return r * G + p


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_ready, q_empty,
              tile_smem, COUNTER, Hq, GROUP, Sq, Skv, n_tiles, sec_heads, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
              SNAKE: gl.constexpr, DYNAMIC: gl.constexpr):
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    n_heads = n_tiles // gl.cdiv(Sq, 2 * ROWS)
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    c = 0
    it = 0
    t = gl.program_id(0)
    while t < n_tiles:
        b, h, q_row, n_blocks = _tile(t, Hq, Sq, Skv, n_heads, sec_heads, CAUSAL, ROWS, BLOCK_N)
        kv_h = h // GROUP
        qs = it % 2
        mbarrier.wait(q_empty.index(qs), ((it // 2) & 1) ^ 1)
        tile_smem.index(qs).store(gl.full([1], t, gl.int32, layout=one))
        mbarrier.expect(q_ready.index(qs), 2 * q_desc.block_type.nbytes)
        for w in gl.static_range(2):
            _tma_load(q_desc, [b, h, q_row + w * ROWS, 0], q_ready.index(qs), q_smem.index(2 * qs + w))
        for j in range(n_blocks):
            slot = c % STAGES
            free = ((c // STAGES) & 1) ^ 1
            mbarrier.wait(k_empty.index(slot), free)
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
            _tma_load(k_desc, [b, kv_h, j * BLOCK_N, 0], k_ready.index(slot), k_smem.index(slot))
            mbarrier.wait(v_empty.index(slot), free)
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            _tma_load(v_desc, [b, kv_h, j * BLOCK_N, 0], v_ready.index(slot), v_smem.index(slot))
            c += 1
        it += 1
        if DYNAMIC:
            t = gl.num_programs(0) + gl.atomic_add(COUNTER, 1)
        else:
            t = _order(it, SNAKE)
    # no more tiles: the consumers read an index past the last
    qs = it % 2
    mbarrier.wait(q_empty.index(qs), ((it // 2) & 1) ^ 1)
    tile_smem.index(qs).store(gl.full([1], n_tiles, gl.int32, layout=one))
    mbarrier.arrive(q_ready.index(qs), count=1)


@gluon.jit
def _step(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, p, alpha, m_i, l_i, acc, zero_s, j, g,
          MASKED: gl.constexpr, CAUSAL: gl.constexpr, rows, offs_n, off, Skv, qk_scale, STAGES: gl.constexpr,
          p_layout: gl.constexpr, row_o: gl.constexpr):
    BLOCK_N: gl.constexpr = k_smem.type.shape[3]
    HEAD_DIM: gl.constexpr = k_smem.type.shape[4]
    slot = g % STAGES
    prev = (g - 1) % STAGES
    mbarrier.wait(k_ready.index(slot), (g // STAGES) & 1)
    mbarrier.wait(v_ready.index(prev), ((g - 1) // STAGES) & 1)
    k = k_smem.index(slot).reshape([BLOCK_N, HEAD_DIM])
    s = warpgroup_mma(q, k.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    acc = warpgroup_mma(gl.convert_layout(p.to(q.dtype), p_layout), v_smem.index(prev).reshape([BLOCK_N, HEAD_DIM]),
                        acc, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
    mbarrier.arrive(k_empty.index(slot), count=1)
    p, alpha, m_i, l_i = A._ws_softmax(s, m_i, l_i, MASKED, CAUSAL, rows, j * BLOCK_N + offs_n, off, Skv, qk_scale)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(prev), count=1)
    return p, alpha, m_i, l_i, acc


@gluon.jit
def _consumer(o_desc, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_ready, q_empty, tile_smem, LSE,
              Hq, Sq, Skv, n_tiles, sec_heads, qk_scale, WG: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    ROWS: gl.constexpr = q_smem.type.shape[3]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[4]
    BLOCK_N: gl.constexpr = k_smem.type.shape[3]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    off = Skv - Sq
    n_heads = n_tiles // gl.cdiv(Sq, 2 * ROWS)
    one: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    c = 0
    it = 0
    mbarrier.wait(q_ready.index(0), 0)
    t = gl.max(tile_smem.index(0).load(one), axis=0)
    while t < n_tiles:
        b, h, q_row, n_blocks = _tile(t, Hq, Sq, Skv, n_heads, sec_heads, CAUSAL, ROWS, BLOCK_N)
        qs = it % 2
        q_buf = q_smem.index(2 * qs + WG)
        q = q_buf.reshape([ROWS, HEAD_DIM])
        first = q_row + WG * ROWS
        rows = first + gl.arange(0, ROWS, layout=row_s)
        if CAUSAL:
            n_full = gl.minimum(first + off + 1, Skv) // BLOCK_N
        else:
            n_full = Skv // BLOCK_N
        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.full([ROWS], 0.0, gl.float32, layout=row_s)
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
        slot0 = c % STAGES
        mbarrier.wait(k_ready.index(slot0), (c // STAGES) & 1)
        s = warpgroup_mma(q, k_smem.index(slot0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s,
                          use_acc=False, is_async=True)
        if it > 0:  # the previous tile's output has left its Q slot
            tma.store_wait(pendings=0)
            mbarrier.arrive(q_empty.index(1 - qs), count=1)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        mbarrier.arrive(k_empty.index(slot0), count=1)
        if n_full == 0:
            p, alpha, m_i, l_i = A._ws_softmax(s, m_i, l_i, True, CAUSAL, rows, offs_n, off, Skv, qk_scale)
        else:
            p, alpha, m_i, l_i = A._ws_softmax(s, m_i, l_i, False, CAUSAL, rows, offs_n, off, Skv, qk_scale)
        for j in range(1, n_full):
            p, alpha, m_i, l_i, acc = _step(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, p, alpha, m_i,
                                            l_i, acc, zero_s, j, c + j, False, CAUSAL, rows, offs_n, off, Skv,
                                            qk_scale, STAGES, p_layout, row_o)
        for j in range(gl.maximum(n_full, 1), n_blocks):
            p, alpha, m_i, l_i, acc = _step(q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, p, alpha, m_i,
                                            l_i, acc, zero_s, j, c + j, True, CAUSAL, rows, offs_n, off, Skv,
                                            qk_scale, STAGES, p_layout, row_o)
        g = c + n_blocks - 1
        last = g % STAGES
        mbarrier.wait(v_ready.index(last), (g // STAGES) & 1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout),
                            v_smem.index(last).reshape([BLOCK_N, HEAD_DIM]), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(last), count=1)
        o = acc / gl.convert_layout(l_i, row_o)[:, None]
        gl.store(LSE + (b * Hq + h) * Sq + rows, (m_i + gl.log2(l_i)) * 0.6931471805599453, mask=rows < Sq)
        q.store(o.to(dtype))
        fence_async_shared()
        _tma_store(o_desc, [b, h, first, 0], q_buf)
        c += n_blocks
        it += 1
        mbarrier.wait(q_ready.index(it % 2), (it // 2) & 1)
        t = gl.max(tile_smem.index(it % 2).load(one), axis=0)
    tma.store_wait(pendings=0)


@gluon.jit
def attn_fwd_persistent(q_desc, k_desc, v_desc, o_desc, LSE, COUNTER, Hq, GROUP, Sq, Skv, n_tiles, sec_heads, qk_scale,
                        CAUSAL: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                        PRODUCER_REGS: gl.constexpr, SNAKE: gl.constexpr,
                        DYNAMIC: gl.constexpr):
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [4, 1, 1, ROWS, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    tile_smem = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
    gl.warp_specialize([
        (_consumer, (o_desc, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_ready, q_empty, tile_smem,
                     LSE, Hq, Sq, Skv, n_tiles, sec_heads, qk_scale, 0, CAUSAL, STAGES)),
        (_consumer, (o_desc, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_ready, q_empty, tile_smem,
                     LSE, Hq, Sq, Skv, n_tiles, sec_heads, qk_scale, 1, CAUSAL, STAGES)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, q_ready,
                     q_empty, tile_smem, COUNTER, Hq, GROUP, Sq, Skv, n_tiles, sec_heads, CAUSAL, STAGES, SNAKE,
                     DYNAMIC)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def sections(b, hq, hkv, skv, d, budget, n_q, programs):
    """Heads per section: the query heads whose K and V (shared by a group) fit ``budget`` bytes;
    ``budget`` None: every head in one section (the heads fastest over the whole grid); "wave": as
    many groups as give one tile per program."""
    if budget is None:
        return b * hq
    group = hq // hkv
    if budget == "wave":
        return min(b * hq, max(1, round(programs / n_q / group)) * group)
    kv_heads = max(1, budget // (skv * d * 2 * 2))
    return min(b * hq, kv_heads * group)


def attention(q, k, v, causal, scale, programs=None, budget=16 << 20, stages=2, regs=(240, 24), snake=False,
              poison=False, dynamic=False):
    """``(o, lse)``; ``programs`` None: one program per tile, else that many (persistent)."""
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    o = torch.empty((b, hq, sq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    if poison:
        o.fill_(float("nan"))
        lse.fill_(float("nan"))
    n_q = -(-sq // (2 * A.WS_ROWS))
    n_tiles = b * hq * n_q
    grid = n_tiles if programs is None else min(programs, n_tiles)
    desc = (A._descriptor(q, A.WS_ROWS), A._descriptor(k, A.WS_BLOCK_N), A._descriptor(v, A.WS_BLOCK_N),
            A._descriptor(o, A.WS_ROWS))
    counter = torch.zeros(1, dtype=torch.int32, device=q.device)
    attn_fwd_persistent[(grid, )](*desc, lse, counter, hq, hq // hkv, sq, skv, n_tiles, sections(b, hq, hkv, skv, d, budget, n_q, grid),
                                  scale * A.LOG2E, CAUSAL=causal and sq > 1, STAGES=stages, CONSUMER_REGS=regs[0],
                                  PRODUCER_REGS=regs[1], SNAKE=snake, DYNAMIC=dynamic,
                                  num_warps=4)
    return o, lse
