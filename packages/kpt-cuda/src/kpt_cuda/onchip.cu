// One row per block, held on chip between its two uses: softmax, the cross-entropy loss with its
// gradient (the softmax minus the target's one-hot), and the softmax's backward.
//
// A row of 128K bf16 logits (256 KB) is too big for one multiprocessor's shared memory
// (227 KB) but not for its shared memory and registers together. A wider row (Gemma's 256000
// words) keeps SPILL_VECS vectors a thread off chip: pass A reads them after the rest, pass B
// reads them again first, from L2 (they were read last), so a row costs one read, one write and
// a re-read of its spilled part from L2 instead of two reads. Each block (one per
// multiprocessor, THREADS threads) owns one row at a time: thread `tid` holds the 16-byte
// vectors `k * THREADS + tid` of the row, the first REG_VECS of them in registers and the next
// SMEM_VECS in its own slots of shared memory (so no thread ever reads another's slots, and the
// row data needs no barrier). A row whose width or stride is not a whole number of vectors
// (GPT-2's 50257) starts and ends with fewer than a vector's elements: its head and tail, one
// element each for the first threads of the block (`Span`). The row is read from memory once:
//
//   pass A (as the row arrives): m = max z, s = sum exp(z - m), lse = m + log s  (online per
//                     thread, as each of its vectors lands; then two block reductions)
//   pass B (on chip): softmax: y = exp((z - m) - log s);
//                     LOSS: dz = g * (exp((z - m) - log s) - (1 - eps) * onehot(t) - eps / V);
//                     stored; as each vector is done, the same slot starts loading the next row
//                     (cp.async for shared memory), so the next row's reads overlap this row's
//                     writes.
//
// With LOSS: loss = (1 - eps) * (lse - z_t) + eps * (lse - mean z), 0 for ignored rows; g is the
// gradient reaching each row's loss (*grad, the same for every row); an ignored row's dz is 0. A
// target outside [0, V) that is not ignored gives a NaN loss. A slot's next load is issued after
// the thread has read the slot into registers, so the asynchronous copy never overwrites a value
// still to be read.
//
// The softmax's backward, dx = y * (dy - sum(y * dy)) (`softmax_bwd_onchip`), holds the row of y the
// same way and streams dy past it twice: once for the sum, once for dx. The second read of dy finds
// most of it in L2 (one row per multiprocessor: 33 MB at 128K bf16 columns on an H100, of 50 MB),
// where reading both y and dy twice (the portable kernel) does not fit. Compiled by NVRTC (no
// headers needed).

typedef unsigned int u32;

// KIND: 0 bfloat16, 1 float16, 2 float32; a 16-byte vector holds EL elements.
template <int KIND> struct Elem;

// The 16-bit kinds: 8 per vector, two per 32-bit word. Each kind K derives from Elem16<K> and
// gives its word conversions (unpack2, pack2) and its one-element load and store (scalar, store).
template <class K> struct Elem16 {
    static constexpr int EL = 8;
    __device__ static void unpack(uint4 v, float (&f)[8]) {
        u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) K::unpack2(w[i], f[2 * i], f[2 * i + 1]);
    }
    __device__ static uint4 pack(const float (&f)[8]) {
        return make_uint4(K::pack2(f[0], f[1]), K::pack2(f[2], f[3]), K::pack2(f[4], f[5]), K::pack2(f[6], f[7]));
    }
};

template <> struct Elem<0> : Elem16<Elem<0>> {
    __device__ static void unpack2(u32 w, float& lo, float& hi) {
        lo = __uint_as_float(w << 16);
        hi = __uint_as_float(w & 0xffff0000u);
    }
    __device__ static u32 pack2(float lo, float hi) {
        u32 r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    __device__ static float scalar(const void* p, long long i) {
        return __uint_as_float(u32(static_cast<const unsigned short*>(p)[i]) << 16);
    }
    __device__ static void store(void* p, long long i, float f) {
        unsigned short h;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
        static_cast<unsigned short*>(p)[i] = h;
    }
};

template <> struct Elem<1> : Elem16<Elem<1>> {
    __device__ static void unpack2(u32 w, float& lo, float& hi) {
        asm("{.reg .f16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h;}"
            : "=f"(lo), "=f"(hi) : "r"(w));
    }
    __device__ static u32 pack2(float lo, float hi) {
        u32 r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    __device__ static float scalar(const void* p, long long i) {
        float f;
        asm("{.reg .f16 h; mov.b16 h, %1; cvt.f32.f16 %0, h;}"
            : "=f"(f) : "h"(static_cast<const unsigned short*>(p)[i]));
        return f;
    }
    __device__ static void store(void* p, long long i, float f) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
        static_cast<unsigned short*>(p)[i] = h;
    }
};

template <> struct Elem<2> {
    static constexpr int EL = 4;
    __device__ static void unpack(uint4 v, float (&f)[4]) {
        f[0] = __uint_as_float(v.x);
        f[1] = __uint_as_float(v.y);
        f[2] = __uint_as_float(v.z);
        f[3] = __uint_as_float(v.w);
    }
    __device__ static uint4 pack(const float (&f)[4]) {
        return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                          __float_as_uint(f[3]));
    }
    __device__ static float scalar(const void* p, long long i) { return static_cast<const float*>(p)[i]; }
    __device__ static void store(void* p, long long i, float f) { static_cast<float*>(p)[i] = f; }
};

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ void cp_async16(uint4* smem_slot, const uint4* src) {
    u32 s = static_cast<u32>(__cvta_generic_to_shared(smem_slot));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Wait until at most `pending` of this thread's latest cp.async groups are still in flight
// (the instruction takes a constant: called from unrolled loops, the switch folds away; more
// than 15 waits for all).
__device__ __forceinline__ void cp_async_wait_group(int pending) {
#define KPT_WAIT(N) case N: asm volatile("cp.async.wait_group " #N ";" ::: "memory"); break;
    switch (pending) {
        KPT_WAIT(1) KPT_WAIT(2) KPT_WAIT(3) KPT_WAIT(4) KPT_WAIT(5) KPT_WAIT(6) KPT_WAIT(7) KPT_WAIT(8)
        KPT_WAIT(9) KPT_WAIT(10) KPT_WAIT(11) KPT_WAIT(12) KPT_WAIT(13) KPT_WAIT(14) KPT_WAIT(15)
        default: asm volatile("cp.async.wait_group 0;" ::: "memory");
    }
#undef KPT_WAIT
}

__device__ __forceinline__ uint4 load_streaming(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ void store_streaming(uint4* p, uint4 v) {
    asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

constexpr float LOG2E = 1.4426950408889634f;
#define NEG_INF __int_as_float(0xff800000)
#define POS_INF __int_as_float(0x7f800000)

// The larger of x and y, NaN if either is (fmaxf drops a NaN: a row's NaN must reach its lse).
__device__ __forceinline__ float nan_max(float x, float y) { return x > y || x != x ? x : y; }

__device__ __forceinline__ bool finite(float x) { return fabsf(x) < POS_INF; }

// The block's combined value of one float per thread (OP 0: max, 1: sum); `scratch` holds one
// float per warp. Ends with every thread holding the result; the caller's next use of `scratch`
// must follow a barrier (the next reduction's own barrier is enough when it uses other scratch).
template <int THREADS, int OP>
__device__ __forceinline__ float block_reduce(float x, float* scratch) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float y = __shfl_xor_sync(0xffffffffu, x, o);
        x = OP == 0 ? nan_max(x, y) : x + y;
    }
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = x;
    __syncthreads();
    x = scratch[0];
#pragma unroll
    for (int w = 1; w < THREADS / 32; ++w) x = OP == 0 ? nan_max(x, scratch[w]) : x + scratch[w];
    return x;
}


// Where one row's 16-byte vectors lie. A row that starts `offset` elements past a 16-byte aligned
// base has `head` elements before its first vector boundary, then `nvec` whole vectors, then a
// tail; the head and the tail together (`edges`, fewer than 2 * EL) are read and written one
// element each, by threads 0 .. edges - 1. Without EDGES (a width and row stride that are multiples
// of EL) every row is whole vectors, and the compiler drops the edges' code.
template <int EL, bool EDGES>
struct Span {
    long long offset;
    int head;
    int nvec;
    int edges;

    __device__ static Span at(long long offset, int v) {
        if (!EDGES) return {offset, 0, v / EL, 0};
        const int head = min(static_cast<int>((EL - offset % EL) % EL), v);
        const int nvec = (v - head) / EL;
        return {offset, head, nvec, v - nvec * EL};
    }
    // the column of thread `tid`'s edge element (tid < edges): the head's, then the tail's
    __device__ int edge_column(int tid) const { return tid < head ? tid : tid + nvec * EL; }
    // the row's first whole vector, in a tensor of 16/EL-byte elements based at `base`
    __device__ const uint4* vectors(const void* base) const {
        return reinterpret_cast<const uint4*>(static_cast<const char*>(base) + (offset + head) * (16 / EL));
    }
    __device__ uint4* vectors(void* base) const {
        return reinterpret_cast<uint4*>(static_cast<char*>(base) + (offset + head) * (16 / EL));
    }
};

// Vector k of this thread's part of a row (its `k * THREADS + tid`-th, where the row has it and
// `load` holds) into its register or, for k >= REG_VECS, its shared-memory slot by cp.async. Each
// shared-memory vector closes one cp.async group, even an empty one, so that a thread's i-th group
// is always its i-th slot's.
template <int THREADS, int REG_VECS>
__device__ __forceinline__ void load_vector(int k, uint4 (&reg)[REG_VECS > 0 ? REG_VECS : 1], uint4* slots,
                                            const uint4* vectors, int nvec, bool load) {
    const int j = k * THREADS + threadIdx.x;
    if (load && j < nvec) {
        if (k < REG_VECS) reg[k] = vectors[j];
        else cp_async16(&slots[(k - REG_VECS) * THREADS + threadIdx.x], vectors + j);
    }
    if (k >= REG_VECS) cp_async_commit();
}

// A block's first row, first vector to last, and this thread's element of its head or tail.
template <int KIND, int THREADS, int REG_VECS, int SMEM_VECS, bool EDGES>
__device__ __forceinline__ void load_first_row(uint4 (&reg)[REG_VECS > 0 ? REG_VECS : 1], uint4* slots, float& edge,
                                               const Span<Elem<KIND>::EL, EDGES>& span, const void* base) {
    const uint4* vectors = span.vectors(base);
#pragma unroll
    for (int k = 0; k < REG_VECS + SMEM_VECS; ++k) load_vector<THREADS, REG_VECS>(k, reg, slots, vectors, span.nvec, true);
    if (threadIdx.x < span.edges) edge = Elem<KIND>::scalar(base, span.offset + span.edge_column(threadIdx.x));
}

// Adds N logits to a thread's running maximum m, its sum s of exp(z - m) (rescaled whenever m
// grows) and, for label smoothing, its sum of z. Exponents are taken of differences,
// (z - m) * log2(e), never of z * log2(e): that overflows for |z| > 2.4e38.
template <bool SMOOTHING, int N>
__device__ __forceinline__ void fold(const float (&f)[N], float& m, float& s, float& zsum) {
    float m_new = m;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        m_new = nan_max(m_new, f[i]);
        if (SMOOTHING) zsum += f[i];
    }
    // a maximum of -inf adds nothing; one of +inf or NaN decides the lse alone
    if (finite(m_new)) {
        s *= ex2((m - m_new) * LOG2E);  // 0 while m is -inf
#pragma unroll
        for (int i = 0; i < N; ++i) s += ex2((f[i] - m_new) * LOG2E);
    }
    m = m_new;
}

// One logit's gradient: g * (softmax - (1 - eps) * onehot - eps / V); 0 in an ignored row, whose
// inf or NaN logits reach nothing (not 0 * NaN).
__device__ __forceinline__ float grad_of(float z, bool is_target, bool kept, float top, float ls, float g, float off,
                                         float hit) {
    const float d = ex2(((z - top) - ls) * LOG2E) - off;
    return kept ? g * (is_target ? d - hit : d) : 0.f;
}

// z: [n, v] logits, rows stride_zn elements apart; dz: [n, v] contiguous, the softmax or (LOSS) the
// gradient; target, grad and loss are read and written only with LOSS.
template <int KIND, int THREADS, int REG_VECS, int SMEM_VECS, int SPILL_VECS, bool SMOOTHING, bool LOSS, bool EDGES>
__global__ void __launch_bounds__(THREADS, 1)
row_onchip(const void* __restrict__ z, const long long* __restrict__ target, const float* __restrict__ grad,
           float* __restrict__ loss, void* __restrict__ dz, long long n, long long stride_zn,
           long long ignore_index, int v, float smoothing) {
    using E = Elem<KIND>;
    constexpr int EL = E::EL;
    constexpr int VECS = REG_VECS + SMEM_VECS;
    extern __shared__ uint4 slots[];  // [SMEM_VECS][THREADS]
    __shared__ float scratch[3][THREADS / 32];

    const int tid = threadIdx.x;
    uint4 reg[REG_VECS > 0 ? REG_VECS : 1];
    float edge = 0.f;  // this thread's element of the row's head or tail, where it has one

    long long row = blockIdx.x;
    if (row >= n) return;
    Span<EL, EDGES> span = Span<EL, EDGES>::at(row * stride_zn, v);

    load_first_row<KIND, THREADS, REG_VECS, SMEM_VECS>(reg, slots, edge, span, z);

    for (; row < n; row += gridDim.x) {
        const long long t = LOSS ? target[row] : -1;  // softmax: no column is a target
        const bool kept = !LOSS || t != ignore_index;

        // pass A, vector by vector as they arrive, then the edge element
        float m = NEG_INF;
        float s = 0.f;
        float zsum = 0.f;
#pragma unroll
        for (int k = 0; k < VECS; ++k) {
            if (k >= REG_VECS) cp_async_wait_group(VECS - 1 - k);
            if (k * THREADS + tid < span.nvec) {
                float f[EL];
                E::unpack(k < REG_VECS ? reg[k] : slots[(k - REG_VECS) * THREADS + tid], f);
                fold<SMOOTHING>(f, m, s, zsum);
            }
        }
        const uint4* row_vectors = span.vectors(z);
#pragma unroll
        for (int k = VECS; k < VECS + SPILL_VECS; ++k) {  // the part off chip, read from memory
            const int j = k * THREADS + tid;
            if (j < span.nvec) {
                float f[EL];
                E::unpack(row_vectors[j], f);
                fold<SMOOTHING>(f, m, s, zsum);
            }
        }
        if (tid < span.edges) {
            const float f[1] = {edge};
            fold<SMOOTHING>(f, m, s, zsum);
        }
        const float m_row = block_reduce<THREADS, 0>(m, scratch[0]);
        s = block_reduce<THREADS, 1>(finite(m) ? s * ex2((m - m_row) * LOG2E) : 0.f, scratch[1]);
        if (SMOOTHING) zsum = block_reduce<THREADS, 1>(zsum, scratch[2]);
        m = m_row;
        // a maximum of -inf, +inf or NaN: the row's lse for the loss; the softmax exp(z - max) / sum
        // is NaN throughout such a row (inf - inf, or a NaN sum), as the contract's. The lse is kept
        // as two terms, top + ls, subtracted one after the other: z - m is exact for the logits that
        // matter, and their float32 sum is up to 2^-11 off at logits near 1e4, an error every output
        // would carry
        const float top = finite(m) || LOSS ? m : __int_as_float(0x7fc00000);
        const float ls = finite(m) ? __logf(s) : 0.f;

        if (LOSS && tid == 0) {
            const bool in_range = t >= 0 && t < v;
            const float z_t = kept && in_range ? E::scalar(z, span.offset + t) : __int_as_float(0x7fc00000);  // NaN
            float l = (1.f - smoothing) * ((top - z_t) + ls);
            if (SMOOTHING) l += smoothing * ((top - zsum / v) + ls);
            loss[row] = kept ? l : 0.f;
        }

        // pass B: the gradient, each slot then loading the next row. dz is contiguous and its rows
        // start where z's do modulo a vector (the caller checks stride_zn ≡ v mod EL), so its rows
        // have z's head, vectors and tail.
        const float g = LOSS ? *grad : 1.f;
        const float off = smoothing / v;
        const float hit = 1.f - smoothing;
        const long long next = row + gridDim.x;
        const Span<EL, EDGES> after = Span<EL, EDGES>::at(next * stride_zn, v);
        const uint4* next_vectors = after.vectors(z);
        const long long dz_offset = row * v;
        uint4* dz_vectors = Span<EL, EDGES>::at(dz_offset, v).vectors(dz);
#pragma unroll
        for (int p = 0; p < SPILL_VECS; ++p) {  // the part off chip first, last read: from L2
            const int k = VECS + SPILL_VECS - 1 - p;
            const int j = k * THREADS + tid;
            if (j < span.nvec) {
                float f[EL];
                E::unpack(load_streaming(row_vectors + j), f);
                const long long col = span.head + static_cast<long long>(j) * EL;
#pragma unroll
                for (int i = 0; i < EL; ++i) f[i] = grad_of(f[i], col + i == t, kept, top, ls, g, off, hit);
                store_streaming(dz_vectors + j, E::pack(f));
            }
        }
#pragma unroll
        for (int k = 0; k < VECS; ++k) {
            const int j = k * THREADS + tid;
            if (j < span.nvec) {
                float f[EL];
                E::unpack(k < REG_VECS ? reg[k] : slots[(k - REG_VECS) * THREADS + tid], f);
                const long long col = span.head + static_cast<long long>(j) * EL;
#pragma unroll
                for (int i = 0; i < EL; ++i) f[i] = grad_of(f[i], col + i == t, kept, top, ls, g, off, hit);
                store_streaming(dz_vectors + j, E::pack(f));
            }
            load_vector<THREADS, REG_VECS>(k, reg, slots, next_vectors, after.nvec, next < n);
        }
        if (tid < span.edges) {
            const int c = span.edge_column(tid);
            E::store(dz, dz_offset + c, grad_of(edge, c == t, kept, top, ls, g, off, hit));
        }
        if (next < n && tid < after.edges) edge = E::scalar(z, after.offset + after.edge_column(tid));
        span = after;
    }
}

// One row of the softmax's backward. Pass A takes the row's vectors of y in the order their loads
// were issued (REVERSE: last to first) and reads dy beside them; pass B goes the other way, so that
// it reads first the vectors of dy read last, the likeliest still in L2, and issues the next row's
// loads of y in its own order (the next row runs with !REVERSE).
template <int KIND, int THREADS, int REG_VECS, int SMEM_VECS, bool EDGES, bool REVERSE>
__device__ __forceinline__ void softmax_bwd_row(uint4 (&reg)[REG_VECS > 0 ? REG_VECS : 1], uint4* slots, float* scratch,
                                                Span<Elem<KIND>::EL, EDGES>& span, float& edge, const void* y,
                                                const void* dy, void* dx, long long row, long long n,
                                                long long stride_yn, long long stride_dyn, int v) {
    using E = Elem<KIND>;
    constexpr int EL = E::EL;
    constexpr int VECS = REG_VECS + SMEM_VECS;
    const int tid = threadIdx.x;
    const Span<EL, EDGES> dspan = Span<EL, EDGES>::at(row * stride_dyn, v);
    const uint4* dy_vectors = dspan.vectors(dy);
    const float dy_edge = tid < span.edges ? E::scalar(dy, dspan.offset + dspan.edge_column(tid)) : 0.f;

    // pass A: sum(y * dy), y's vectors as they arrive, dy read alongside
    float dot = tid < span.edges ? edge * dy_edge : 0.f;
#pragma unroll
    for (int p = 0; p < VECS; ++p) {
        const int k = REVERSE ? VECS - 1 - p : p;
        // the i-th shared-memory slot in this order waits for its group, the i-th issued
        if (k >= REG_VECS) cp_async_wait_group(SMEM_VECS - 1 - (REVERSE ? p : p - REG_VECS));
        const int j = k * THREADS + tid;
        if (j < span.nvec) {
            float fy[EL], fd[EL];
            E::unpack(k < REG_VECS ? reg[k] : slots[(k - REG_VECS) * THREADS + tid], fy);
            E::unpack(dy_vectors[j], fd);
#pragma unroll
            for (int i = 0; i < EL; ++i) dot += fy[i] * fd[i];
        }
    }
    dot = block_reduce<THREADS, 1>(dot, scratch);

    // pass B, the other way: dx, dy read again (its last use), each slot then loading the next row of y
    const long long next = row + gridDim.x;
    const Span<EL, EDGES> after = Span<EL, EDGES>::at(next * stride_yn, v);
    const uint4* next_vectors = after.vectors(y);
    const long long dx_offset = row * v;
    uint4* dx_vectors = Span<EL, EDGES>::at(dx_offset, v).vectors(dx);
#pragma unroll
    for (int p = 0; p < VECS; ++p) {
        const int k = REVERSE ? p : VECS - 1 - p;
        const int j = k * THREADS + tid;
        if (j < span.nvec) {
            float fy[EL], fd[EL];
            E::unpack(k < REG_VECS ? reg[k] : slots[(k - REG_VECS) * THREADS + tid], fy);
            E::unpack(load_streaming(dy_vectors + j), fd);
#pragma unroll
            for (int i = 0; i < EL; ++i) fy[i] *= fd[i] - dot;
            store_streaming(dx_vectors + j, E::pack(fy));
        }
        load_vector<THREADS, REG_VECS>(k, reg, slots, next_vectors, after.nvec, next < n);
    }
    if (tid < span.edges) E::store(dx, dx_offset + span.edge_column(tid), edge * (dy_edge - dot));
    if (next < n && tid < after.edges) edge = E::scalar(y, after.offset + after.edge_column(tid));
    span = after;
}

// y, dy: [n, v], rows stride_yn and stride_dyn elements apart, each stride equal to v modulo a vector
// (the caller checks), so a row of y, of dy and of the contiguous dx share their head, vectors and tail.
template <int KIND, int THREADS, int REG_VECS, int SMEM_VECS, bool EDGES>
__global__ void __launch_bounds__(THREADS, 1)
softmax_bwd_onchip(const void* __restrict__ y, const void* __restrict__ dy, void* __restrict__ dx, long long n,
                   long long stride_yn, long long stride_dyn, int v) {
    constexpr int EL = Elem<KIND>::EL;
    extern __shared__ uint4 slots[];  // [SMEM_VECS][THREADS]
    __shared__ float scratch[2][THREADS / 32];  // alternate rows' sums: one reduction a row, no barrier between

    uint4 reg[REG_VECS > 0 ? REG_VECS : 1];
    float edge = 0.f;  // this thread's element of y's head or tail, where it has one

    long long row = blockIdx.x;
    if (row >= n) return;
    Span<EL, EDGES> span = Span<EL, EDGES>::at(row * stride_yn, v);

    load_first_row<KIND, THREADS, REG_VECS, SMEM_VECS>(reg, slots, edge, span, y);

    for (int parity = 0; row < n; row += gridDim.x, parity ^= 1) {
        if (parity)
            softmax_bwd_row<KIND, THREADS, REG_VECS, SMEM_VECS, EDGES, true>(
                reg, slots, scratch[1], span, edge, y, dy, dx, row, n, stride_yn, stride_dyn, v);
        else
            softmax_bwd_row<KIND, THREADS, REG_VECS, SMEM_VECS, EDGES, false>(
                reg, slots, scratch[0], span, edge, y, dy, dx, row, n, stride_yn, stride_dyn, v);
    }
}
