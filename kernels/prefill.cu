// decodev2 chunked-prefill kernels: the NF4 x f16 tensor-core GEMM (also the decode step's
// linears under DV2_LINEAR=mma), causal attention over a chunk, and the row-wise helpers.
// Compiled in one unit after decode.cu, whose helpers (Nf4Ref, bf16 bits, warp sums) they use.
//
// Layouts: a chunk's activations are f32 [n tokens][width], token-major (row i of the
// chunk is position pos0 + i, pos0 = state[POSITION] when the chunk starts). Shared constants
// from the host: GEMM_WARPS, ATTNM_WARPS, ATTNP_THREADS, ATTNP_TILE, ATTNP_Q_FLOATS.
#if !defined(GEMM_WARPS) || !defined(ATTNM_WARPS) || !defined(ATTNP_THREADS) || \
    !defined(ATTNP_TILE) || !defined(ATTNP_Q_FLOATS)
#error "the host passes the prefill constants as -D options (src/cuda/kernels.rs)"
#endif
#define GEMM_THREADS (GEMM_WARPS * 32)
#define ATTNP_WARPS (ATTNP_THREADS / 32)

// ---------------------------------------------------------------------------------------
// NF4 GEMM on tensor cores: Y[n][r] (+)= sum_k W[r][k] X[n][k] for n < N columns (tokens).
//
// mma.sync m16n8k16, f16 inputs, f32 accumulation. A (weights) comes from global memory
// straight into fragments, never through shared memory and never as a dequantized copy:
// the k order inside each 64-element NF4 block is permuted (the same permutation on A and B
// leaves the sum unchanged) so that a thread's fragments of one block are 8 contiguous bytes
// of its row: thread (g = lane/4, t = lane%4) loads bytes 8t..8t+7 of the block for rows g
// and g+8 of each m16 tile; in k-step s (0..3) byte 2s is its "pair t" and byte 2s+1 its
// "pair t+4". B (activations, f32) is read at the matching elements 16t+4s..16t+4s+3 and
// rounded to f16 pairs. Each weight is codebook(nibble) * absmax * mma_scale in f16, where
// mma_scale is a per-matrix power of two that keeps the product in f16's normal range; the
// epilogue divides it out. The residual stream and the outputs stay f32.
//
// A warp computes 32 rows x 8*NT columns (two m16 tiles; for SwiGLU the 16 gate rows and
// the 16 up rows of the same outputs). The CTA's GEMM_WARPS warps are (GEMM_WARPS / kw) row
// tiles x kw parts of K; the parts are summed through shared memory before the epilogue.

struct GemmArgs {
    Nf4Ref m[3];           // stacked matrices (q, k, v); SwiGLU: gate, up
    const float* bias[3];  // per matrix, may be null
    int rows[3];           // rows of each matrix (0 for unused)
    const float* x;        // [n][k]
    float* y;              // [n][ldy]
    const int* skip_if;    // when not null and *skip_if != 0, do nothing
    int n, k, ldy, kw;
    // GEMV v3 only (kernels/gemv_mma.cu): the RMSNorm of x, and where the accumulate
    // epilogue leaves each CTA's sum of squares of y (may be null).
    NormArgs norm;
    float* ss_out;
};

enum { EPI_STORE = 0, EPI_ACCUMULATE = 1, EPI_SWIGLU = 2 };

__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

__device__ __forceinline__ void mma_16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The byte of a packed pair dequantized to an f16 pair (high nibble = even element = low
// half), scaled by s2 (the row's absmax * scale, duplicated).
__device__ __forceinline__ u32 dequant_pair(const u32* lut16, u32 byte, u32 s2) {
    return hmul2(__byte_perm(lut16[(byte >> 4) & 15], lut16[byte & 15], 0x5410), s2);
}

// Row `r` of the stacked matrices: which matrix and which of its rows (r past the last:
// valid = false and a harmless stand-in, row 0 of matrix 0, that is never stored).
struct StackedRow {
    int matrix, local;
    bool valid;
};

__device__ __forceinline__ StackedRow stacked_row(const GemmArgs& a, int r) {
    StackedRow s;
    s.valid = r < a.rows[0] + a.rows[1] + a.rows[2];
    s.matrix = !s.valid ? 0 : (r < a.rows[0] ? 0 : (r < a.rows[0] + a.rows[1] ? 1 : 2));
    s.local = !s.valid ? 0 : r - (s.matrix == 0 ? 0 : (s.matrix == 1 ? a.rows[0] : a.rows[0] + a.rows[1]));
    return s;
}

// Row r of SwiGLU matrix i (0: gate, 1: up); past the last output, valid = false and row 0.
__device__ __forceinline__ StackedRow swiglu_row(const GemmArgs& a, int r, int i) {
    StackedRow s;
    s.valid = r < a.rows[0];
    s.matrix = i;
    s.local = s.valid ? r : 0;
    return s;
}

// The stacked row of row g + 8h of m16 tile i of warp tile `tile` (not SwiGLU).
__device__ __forceinline__ int fragment_index(int tile, int i, int h, int g) { return tile * 32 + i * 16 + g + 8 * h; }

// The row a thread's fragments hold: row g + 8h of m16 tile i of warp tile `tile`. SwiGLU
// tiles are tile 0 = gate rows, tile 1 = up rows of the same 16 outputs.
template <int EPI>
__device__ __forceinline__ StackedRow fragment_row(const GemmArgs& a, int tile, int i, int h, int g) {
    if (EPI == EPI_SWIGLU) return swiglu_row(a, tile * 16 + g + 8 * h, i);
    return stacked_row(a, fragment_index(tile, i, h, g));
}

// Constant indices only: a run-time index into the struct's arrays would copy it to local
// memory.
__device__ __forceinline__ Nf4Ref pick(const GemmArgs& a, int i) { return i == 0 ? a.m[0] : (i == 1 ? a.m[1] : a.m[2]); }
__device__ __forceinline__ float pick_scale(const GemmArgs& a, int i) {
    return i == 0 ? a.m[0].mma_scale : (i == 1 ? a.m[1].mma_scale : a.m[2].mma_scale);
}
__device__ __forceinline__ const float* pick_bias(const GemmArgs& a, int i) {
    return i == 0 ? a.bias[0] : (i == 1 ? a.bias[1] : a.bias[2]);
}

// A warp's place in the GEMM and the rows its fragments hold.
struct GemmWarp {
    int lane, g, t, mw, kp, tile, col0;
    const u8* wrow[2][2];  // packed bytes of row g + 8h of m16 tile i
    const float* srow[2][2];
    float scale[2][2];
};

template <int NT, int EPI>
__device__ __forceinline__ GemmWarp gemm_warp(const GemmArgs& a) {
    GemmWarp w;
    const int warp = threadIdx.x >> 5;
    w.lane = threadIdx.x & 31;
    w.g = w.lane >> 2;
    w.t = w.lane & 3;
    const int row_tiles = GEMM_WARPS / a.kw;
    w.mw = warp % row_tiles;
    w.kp = warp / row_tiles;
    w.tile = blockIdx.x * row_tiles + w.mw;
    w.col0 = blockIdx.y * 8 * NT;
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const StackedRow r = fragment_row<EPI>(a, w.tile, i, h, w.g);
            const Nf4Ref m = pick(a, r.matrix);
            w.wrow[i][h] = m.packed + (size_t)r.local * (a.k >> 1);
            w.srow[i][h] = m.absmax + (size_t)r.local * (a.k >> 6);
            w.scale[i][h] = pick_scale(a, r.matrix);
        }
    return w;
}

__device__ __forceinline__ void load_codebook_f16(u32* lut16) {
    if (threadIdx.x < 16) {
        const float nf4[16] = NF4_CODEBOOK;
        lut16[threadIdx.x] = pack_f16x2(nf4[threadIdx.x], 0.0f);
    }
}

// A thread's weights of one 64-element block: 8 bytes of each of its four rows.
struct ABlock {
    uint2 w[2][2];
    float s[2][2];
};

__device__ __forceinline__ void load_a_block(const GemmWarp& w, int kb, ABlock& b) {
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            b.w[i][h] = __ldg(reinterpret_cast<const uint2*>(w.wrow[i][h] + kb * 32 + 8 * w.t));
            b.s[i][h] = __ldg(w.srow[i][h] + kb);
        }
}

// The A fragments of k-step s (0..3) of a block, dequantized and scaled. BYTE: `lut` is the
// byte -> f16 pair table (one shared load per pair); else the 16-entry codebook (two loads
// and a permute per pair).
template <bool BYTE>
__device__ __forceinline__ void a_fragments(const GemmWarp& w, const ABlock& b, const u32* lut, int s,
                                            u32 (&af)[2][4]) {
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const float sc = b.s[i][h] * w.scale[i][h];
            const u32 s2 = pack_f16x2(sc, sc);
            const u32 word = s < 2 ? b.w[i][h].x : b.w[i][h].y;
            const int k = (s & 1) * 2;  // the pair t byte; k + 1: the pair t + 4 byte
            if (BYTE) {
                const u32 lane4 = 4 * w.lane;
                af[i][h] = hmul2(byte_lut_entry(lut, word, k, lane4), s2);
                af[i][2 + h] = hmul2(byte_lut_entry(lut, word, k + 1, lane4), s2);
            } else {
                const u32 lo = (word >> (8 * k)) & 0xff, hi = (word >> (8 * k + 8)) & 0xff;
                af[i][h] = dequant_pair(lut, lo, s2);
                af[i][2 + h] = dequant_pair(lut, hi, s2);
            }
        }
}

// The MMAs of one 64-element block from f32 activations (the f32 kernels: DV2_LINEAR=mma's
// decode step): B's four elements 16t+4s .. +3 of the warp's column in n8 tile j come from
// b(j, s) and are rounded to f16 pairs here.
template <int NT, typename B>
__device__ __forceinline__ void mma_block_f32(const GemmWarp& w, const ABlock& cur, const u32* lut16,
                                              float (&acc)[2][NT][4], B b) {
#pragma unroll
    for (int s = 0; s < 4; s++) {
        u32 af[2][4];
        a_fragments<false>(w, cur, lut16, s, af);
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const float4 xv = b(j, s);
            const u32 b0 = pack_f16x2(xv.x, xv.y), b1 = pack_f16x2(xv.z, xv.w);
#pragma unroll
            for (int i = 0; i < 2; i++) mma_16816(acc[i][j], af[i], b0, b1);
        }
    }
}

// Thread-block clusters (Hopper): where a GEMM's grid would leave half the SMs idle (few
// columns, few row tiles: o and down in a short prompt), the host launches it in clusters of
// two CTAs (grid z = 2) that split K between them; rank 1 hands its sums to rank 0 through
// distributed shared memory and rank 0 adds them, in a fixed order, before the epilogue.
// Launched without clusters, the cluster is the CTA alone (size 1) and none of this runs.
// (The cluster helpers are in decode.cu.)

// Calls f(sum, k) for each of a warp's accumulators, k = its word in an 8NT x 32 block
// laid out lane-minor (add the lane), the layout every hand-over of sums below uses.
template <int NT, typename F>
__device__ __forceinline__ void each_sum(float (&acc)[2][NT][4], F f) {
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) f(acc[i][j][e], ((i * NT + j) * 4 + e) * 32);
}

// The epilogues issue every load before their first store: the compiler cannot tell that a
// store does not alias a later load, so it keeps each load after the store before it, and
// with each store waiting for the load before it, every element cost a round trip in turn.
// mma_scale is a power of two, so multiplying by its reciprocal is exact (a division calls a
// slow-path routine).

// Calls f(j, e, h, n) for each sum acc[.][j][e] of the n8 tiles j0, j0 + jstep, ... whose
// column n exists: c[e] is row g + 8h (h = e/2) of the tile, column n = 2t + e%2 of the n8 tile.
template <int NT, typename F>
__device__ __forceinline__ void each_element(const GemmArgs& a, const GemmWarp& w, int j0, int jstep, F f) {
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int n = w.col0 + 8 * j + 2 * w.t + (e & 1);
            if (j % jstep == j0 && n < a.n) f(j, e, e >> 1, n);
        }
}

// SwiGLU: silu(gate) * up of each output; with X16 stored as f16 (the next GEMM's input).
template <int NT, bool X16>
__device__ __forceinline__ void swiglu_epilogue(const GemmArgs& a, const GemmWarp& w, float (&acc)[2][NT][4], int j0,
                                                int jstep) {
    const float inv_gate = 1.0f / a.m[0].mma_scale, inv_up = 1.0f / a.m[1].mma_scale;
    each_element<NT>(a, w, j0, jstep, [&](int j, int e, int h, int n) {
        if (!fragment_row<EPI_SWIGLU>(a, w.tile, 0, h, w.g).valid) return;
        const float gs = acc[0][j][e] * inv_gate, us = acc[1][j][e] * inv_up;
        const float v = gs / (1.0f + expf(-gs)) * us;
        const size_t at = (size_t)n * a.ldy + w.tile * 16 + w.g + 8 * h;
        if (X16) reinterpret_cast<u16*>(a.y)[at] = f32_to_f16(v);
        else a.y[at] = v;
    });
}

// Store (+ bias) or accumulate each of a thread's sums.
template <int NT, int EPI>
__device__ __forceinline__ void linear_epilogue(const GemmArgs& a, const GemmWarp& w, float (&acc)[2][NT][4], int j0,
                                                int jstep) {
    // A thread's four rows (m16 tile i, half h): where they go, their bias, their scale.
    StackedRow r[2][2];
    int row[2][2];
    float bias[2][2], inv[2][2];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            r[i][h] = fragment_row<EPI>(a, w.tile, i, h, w.g);
            row[i][h] = fragment_index(w.tile, i, h, w.g);
            const float* b = pick_bias(a, r[i][h].matrix);
            bias[i][h] = b && r[i][h].valid ? b[r[i][h].local] : 0.0f;
            inv[i][h] = 1.0f / pick_scale(a, r[i][h].matrix);
        }
    // ACCUMULATE: y's old values, all loaded before the first store.
    float old[EPI == EPI_ACCUMULATE ? NT : 1][4][2];
    if constexpr (EPI == EPI_ACCUMULATE) {
        each_element<NT>(a, w, j0, jstep, [&](int j, int e, int h, int n) {
#pragma unroll
            for (int i = 0; i < 2; i++) old[j][e][i] = r[i][h].valid ? a.y[(size_t)n * a.ldy + row[i][h]] : 0.0f;
        });
    }
    each_element<NT>(a, w, j0, jstep, [&](int j, int e, int h, int n) {
        float v[2];
#pragma unroll
        for (int i = 0; i < 2; i++) v[i] = acc[i][j][e] * inv[i][h] + bias[i][h];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            if (!r[i][h].valid) continue;
            float* out = a.y + (size_t)n * a.ldy + row[i][h];
            if constexpr (EPI == EPI_ACCUMULATE) *out = old[j][e][i] + v[i];
            else *out = v[i];
        }
    });
}

// Sums the K parts through shared memory (`red`: GEMM_WARPS/2 x 8NT x 32 floats), then the
// epilogue on part 0's warps. With X16 the SwiGLU output is f16 (the next GEMM's input).
//
// In a cluster of two (v1 only; then kw = GEMM_WARPS, one row tile per CTA) `xred` (8NT x 32
// floats) receives rank 1's sums in rank 0; rank 1 stops there. The caller arrived at the
// cluster barrier once, at its start (relaxed), so the first wait here also means the peer
// CTA has started and its shared memory exists.
template <int NT, int EPI, bool X16 = false>
__device__ __forceinline__ void gemm_finish(const GemmArgs& a, const GemmWarp& w, float (&acc)[2][NT][4],
                                            float* red, float* xred = nullptr) {
    // A tree over the K parts (kw a power of two): in the round of step s, part p with
    // p % 2s == s hands its sums to part p - s, through slot (mw kw + p) / 2 of `red`
    // (distinct for every writer of a round, fewer than GEMM_WARPS / 2).
    for (int step = 1; step < a.kw; step <<= 1) {
        const int role = w.kp & (2 * step - 1);
        if (role == step) {
            float* slot = red + ((w.mw * a.kw + w.kp) >> 1) * 8 * NT * 32;
            each_sum(acc, [&](float& v, int k) { slot[k + w.lane] = v; });
        }
        __syncthreads();
        if (role == 0) {
            const float* slot = red + ((w.mw * a.kw + w.kp + step) >> 1) * 8 * NT * 32;
            each_sum(acc, [&](float& v, int k) { v += slot[k + w.lane]; });
        }
        __syncthreads();
    }
    if (xred && cluster_size() > 1) {
        const int rank = cluster_rank();
        cluster_wait();
        if (rank == 1 && w.kp == 0) {
            each_sum(acc, [&](float& v, int k) { store_in_cta(&xred[k + w.lane], 0, v); });
        }
        cluster_arrive();
        cluster_wait();
        if (rank == 1) return;
        if (w.kp == 0) {
            each_sum(acc, [&](float& v, int k) { v += xred[k + w.lane]; });
        }
    }
    // Spread: part 0 leaves the row tile's sums in `red` (free after the tree) and each of
    // the tile's kw warps runs the epilogue of its n8 tiles j = kp, kp + kw, ... (the
    // epilogue is a chain of dependent steps; in one warp per tile it is a serial tail).
    const bool spread = a.kw > 1;
    if (spread) {
        float* slot = red + w.mw * 8 * NT * 32;
        if (w.kp == 0) each_sum(acc, [&](float& v, int k) { slot[k + w.lane] = v; });
        __syncthreads();
        if (w.kp >= NT) return;
        each_sum(acc, [&](float& v, int k) { v = slot[k + w.lane]; });
    } else if (w.kp != 0) {
        return;
    }
    const int j0 = spread ? w.kp : 0, jstep = spread ? a.kw : 1;
    if constexpr (EPI == EPI_SWIGLU) swiglu_epilogue<NT, X16>(a, w, acc, j0, jstep);
    else linear_epilogue<NT, EPI>(a, w, acc, j0, jstep);
}

// Every warp reads its B fragments straight from global memory, through L1. Each warp
// re-reads B for its 32 rows, so L1 is the bottleneck (docs/lab.md); B staged once per CTA in
// shared memory by cp.async (GEMM v2, until a1b9aaa) measured slower with f16 activations.
// With X16 (prefill) x is f16, written so by its producer: a thread's 16 elements of a block
// are two 16-byte loads, one cache line per column, a quarter of the L1 wavefronts of f32 x,
// no conversion; the sums are bit-identical (the producer rounds the same value the same
// way). From f32 x (DV2_LINEAR=mma's decode step), a fragment (elements 16t+4s .. +3 of a
// column) is a 16-byte load per k-step touching two cache lines per column, rounded to f16
// here.
template <int NT, int EPI, bool X16>
__device__ __forceinline__ void gemm_v1_body(const GemmArgs& a) {
    constexpr int RED_WORDS = GEMM_WARPS / 2 * 8 * NT * 32;
    // X16: the byte table, whose space the K-part reduction reuses after the main loop.
    __shared__ __align__(16) u32 smem[X16 ? (RED_WORDS > BYTE_LUT_WORDS ? RED_WORDS : BYTE_LUT_WORDS) : RED_WORDS];
    __shared__ u32 lut16[16];
    __shared__ float xred[8 * NT * 32];  // rank 1's sums, in a cluster of two
    // Before waiting for the previous kernel (programmatic dependent launch), what does not
    // depend on it: the codebook table and the first block of weights, so that this overlaps
    // the previous kernel's tail.
    float* red = reinterpret_cast<float*>(smem);
    if (X16) load_byte_codebook<GEMM_THREADS>(smem);
    else load_codebook_f16(lut16);
    const GemmWarp w = gemm_warp<NT, EPI>(a);
    const int kblocks = a.k >> 6;
    const int split = cluster_size(), rank = cluster_rank();
    // K part of this warp: kp of this CTA's kw, after the kw parts of the lower ranks.
    const int part = rank * a.kw + w.kp, parts = split * a.kw;
    const int kb0 = part * kblocks / parts, kb1 = (part + 1) * kblocks / parts;
    ABlock next;
    if (kb0 < kb1) load_a_block(w, kb0, next);
    pdl_enter();
    if (a.skip_if && *a.skip_if) return;
    if (split > 1) cluster_arrive_relaxed();
    __syncthreads();  // the table
    const float* xcol[NT];
    // X16: the column's f16 elements 16t.. of block 0. Columns past n read column n - 1
    // instead of testing and zeroing every load: their sums are never stored.
    const uint4* xcol16[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) {
        const int n = w.col0 + 8 * j + w.g;
        xcol[j] = n < a.n ? a.x + (size_t)n * a.k + 16 * w.t : nullptr;
        xcol16[j] = reinterpret_cast<const uint4*>(reinterpret_cast<const u16*>(a.x) + (size_t)min(n, a.n - 1) * a.k +
                                                   16 * w.t);
    }
    float acc[2][NT][4] = {};
    for (int kb = kb0; kb < kb1; kb++) {
        const ABlock cur = next;
        if (kb + 1 < kb1) load_a_block(w, kb + 1, next);
        if constexpr (X16) {
            u32 af[4][2][4];
#pragma unroll
            for (int s = 0; s < 4; s++) a_fragments<true>(w, cur, smem, s, af[s]);
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const uint4 lo = __ldg(xcol16[j] + kb * 8), hi = __ldg(xcol16[j] + kb * 8 + 1);
                const u32 bw[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
                for (int s = 0; s < 4; s++)
#pragma unroll
                    for (int i = 0; i < 2; i++) mma_16816(acc[i][j], af[s][i], bw[2 * s], bw[2 * s + 1]);
            }
        } else {
            mma_block_f32<NT>(w, cur, lut16, acc, [&](int j, int s) {
                return xcol[j] ? __ldg(reinterpret_cast<const float4*>(xcol[j] + kb * 64 + 4 * s))
                               : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            });
        }
    }
    if (X16) __syncthreads();  // every warp is done with the table before red overwrites it
    gemm_finish<NT, EPI, X16>(a, w, acc, red, xred);
}

// By epilogue and width (n8 tiles per warp) with f16 activations (prefill), and at one tile
// with f32 activations (_f32: DV2_LINEAR=mma runs the decode step's linears through them).
#define GEMM_KERNEL(name, NT, EPI, X16)                                                                      \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1) name(GemmArgs a) {                         \
        gemm_v1_body<NT, EPI, X16>(a);                                                                       \
    }
#define GEMM_KERNELS(name, EPI)                                                                              \
    GEMM_KERNEL(name##_nt1, 1, EPI, true)                                                                    \
    GEMM_KERNEL(name##_nt4, 4, EPI, true)                                                                    \
    GEMM_KERNEL(name##_nt6, 6, EPI, true)                                                                    \
    GEMM_KERNEL(name##_nt8, 8, EPI, true)                                                                    \
    GEMM_KERNEL(name##_nt1_f32, 1, EPI, false)
GEMM_KERNELS(gemm_store, EPI_STORE)
GEMM_KERNELS(gemm_acc, EPI_ACCUMULATE)
GEMM_KERNELS(gemm_swiglu, EPI_SWIGLU)

// ---------------------------------------------------------------------------------------
// Row-wise helpers of a chunk.

// x[i] = dequantized embedding row of ids[i], one CTA per token.
extern "C" __global__ void embed_rows(const int* __restrict__ ids, Nf4Ref embed, float* x, int hidden,
                                      int vocab) {
    pdl_enter();
    embed_token(ids[blockIdx.x], embed, x + (size_t)blockIdx.x * hidden, hidden, vocab);
}

// RoPE on q and k of token i (position pos0 + i) in place, k and v into the KV cache as bf16
// at that slot: the same arithmetic as attn2_decode's, so both paths store the same bits.
// One CTA per token. Work items: the (n_q + n_kv) * head_dim/2 pairs to rotate, then the
// kv_dim elements of v; a thread loads ROPE_BATCH items before it stores any (in program
// order a load may not pass a store to the same row, so a strided loop waited a round trip
// per iteration).
extern "C" __global__ void rope_kv_rows(float* qkv, u16* k_cache, u16* v_cache, const float* __restrict__ rope_cos,
                                        const float* __restrict__ rope_sin, const int* __restrict__ state, int ld,
                                        int n_q, int n_kv, int head_dim) {
    pdl_enter();
    constexpr int ROPE_BATCH = 8;
    const int i = blockIdx.x, pos = state[STATE_POSITION] + i, half = head_dim >> 1;
    float* row = qkv + (size_t)i * ld;
    const float* cos_p = rope_cos + (size_t)pos * half;
    const float* sin_p = rope_sin + (size_t)pos * half;
    const int kv_dim = n_kv * head_dim, rotations = (n_q + n_kv) * half, items = rotations + kv_dim;
    const size_t slot = (size_t)pos * kv_dim;
    const float* v_row = row + n_q * head_dim + kv_dim;
    for (int base = threadIdx.x; base < items; base += ROPE_BATCH * blockDim.x) {
        float c[ROPE_BATCH], s[ROPE_BATCH], x1[ROPE_BATCH], x2[ROPE_BATCH];
#pragma unroll
        for (int u = 0; u < ROPE_BATCH; u++) {
            const int idx = base + u * blockDim.x;
            if (idx < rotations) {
                const int h = idx / half, j = idx % half;
                c[u] = cos_p[j];
                s[u] = sin_p[j];
                x1[u] = row[h * head_dim + j];
                x2[u] = row[h * head_dim + j + half];
            } else if (idx < items) {
                x1[u] = v_row[idx - rotations];
            }
        }
#pragma unroll
        for (int u = 0; u < ROPE_BATCH; u++) {
            const int idx = base + u * blockDim.x;
            if (idx < rotations) {
                const int h = idx / half, j = idx % half;
                const float lo = x1[u] * c[u] - x2[u] * s[u], hi = x2[u] * c[u] + x1[u] * s[u];
                row[h * head_dim + j] = lo;
                row[h * head_dim + j + half] = hi;
                if (h >= n_q) {
                    k_cache[slot + (h - n_q) * head_dim + j] = f32_to_bf16(lo);
                    k_cache[slot + (h - n_q) * head_dim + j + half] = f32_to_bf16(hi);
                }
            } else if (idx < items) {
                v_cache[slot + idx - rotations] = f32_to_bf16(x1[u]);
            }
        }
    }
}

// Before a prompt: a prefill computes its logits even after a finished request.
extern "C" __global__ void begin_prefill(int* state) {
    pdl_enter();
    state[STATE_FINISHED] = 0;
}

// After a chunk of n tokens: its slots are written, move on.
extern "C" __global__ void advance_by(int* state, int n) {
    pdl_enter();
    state[STATE_POSITION] += n;
    state[STATE_VALID_LEN] = state[STATE_POSITION];
}

// ---------------------------------------------------------------------------------------
// Causal attention of a chunk. One CTA per (KV head, qb consecutive tokens): its rows are the
// qb x group (token, q head) pairs, at most 4R (R rows per warp: 2 or 8), each
// with its online-softmax state in registers. The CTA walks the KV slots 0 .. (its last
// position) in tiles of ATTNP_TILE, staged in shared memory once for all its rows; a row
// stops at its own position. Scores: a lane per slot; weighted sum: a lane per pair of dims.
// K rows are stored rotated by their slot index, so the lanes of a score step hit distinct
// banks without padding.

struct PrefillAttnArgs {
    const float* qkv;  // [n][ld]: rotated q | rotated k | v of each token
    const u16* k_cache;
    const u16* v_cache;
    const int* state;
    float* out;  // [n][n_q * head_dim], f32 or (out_f16) f16
    int n, ld, n_q, n_kv, head_dim, qb;
    float scale;
    int out_f16;
    int first;  // the chunk's token of row 0 (qkv and out start there): position pos0 + first
};

template <int R>
__device__ __forceinline__ void attn_prefill_body(const PrefillAttnArgs& a) {
    const int kvh = blockIdx.x, hd = a.head_dim, half = hd >> 1, group = a.n_q / a.n_kv;
    const int tok0 = blockIdx.y * a.qb, ntok = min(a.qb, a.n - tok0), rows = ntok * group;
    const int pos0 = a.state[STATE_POSITION] + a.first;
    const int last = pos0 + tok0 + ntok - 1;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const size_t slot_stride = (size_t)a.n_kv * hd;

    __shared__ float q_s[ATTNP_Q_FLOATS];
    __shared__ u32 k_s[ATTNP_TILE * MAX_HEAD_DIM / 2], v_s[ATTNP_TILE * MAX_HEAD_DIM / 2];
    for (int idx = threadIdx.x; idx < rows * hd; idx += blockDim.x) {
        const int rr = idx / hd, d = idx % hd, ti = rr / group, h = kvh * group + rr % group;
        q_s[idx] = a.qkv[(size_t)(tok0 + ti) * a.ld + h * hd + d] * a.scale;
    }

    constexpr int P = MAX_HEAD_DIM / 64;  // pairs of dims per lane
    float m[R], l[R], acc[R][2 * P];
#pragma unroll
    for (int r = 0; r < R; r++) {
        m[r] = NEG_INF;
        l[r] = 0.0f;
#pragma unroll
        for (int e = 0; e < 2 * P; e++) acc[r][e] = 0.0f;
    }

    for (int t0 = 0; t0 <= last; t0 += ATTNP_TILE) {
        const int n_t = min(ATTNP_TILE, last + 1 - t0);
        __syncthreads();  // the previous tile is no longer read
        for (int idx = threadIdx.x; idx < n_t * half; idx += blockDim.x) {
            const int t = idx / half, w = idx % half;
            const size_t off = (size_t)(t0 + t) * slot_stride + kvh * hd + 2 * w;
            const u32 kw = *reinterpret_cast<const u32*>(a.k_cache + off);  // off is even
            const u32 vw = *reinterpret_cast<const u32*>(a.v_cache + off);
            int p = w + t;
            p = p % half;
            k_s[t * half + p] = kw;
            v_s[t * half + w] = vw;
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < R; r++) {
            const int rr = warp + ATTNP_WARPS * r;
            if (rr >= rows) continue;
            const int qpos = pos0 + tok0 + rr / group;
            if (t0 > qpos) continue;
            const int t = t0 + lane;
            float score = NEG_INF;
            if (lane < n_t && t <= qpos) {
                const float* q = q_s + rr * hd;
                const u32* krow = k_s + lane * half;
                float s0 = 0.0f, s1 = 0.0f;
                int p = lane % half;
                for (int w = 0; w < half; w++) {
                    const u32 pair = krow[p];
                    s0 = fmaf(q[2 * w], bf16_to_f32((u16)(pair & 0xffffu)), s0);
                    s1 = fmaf(q[2 * w + 1], bf16_to_f32((u16)(pair >> 16)), s1);
                    p = p + 1 == half ? 0 : p + 1;
                }
                score = s0 + s1;
            }
            const float m_new = fmaxf(m[r], warp_max(score));
            const float corr = expf(m[r] - m_new);
            const float p = score == NEG_INF ? 0.0f : expf(score - m_new);
            l[r] = l[r] * corr + warp_sum(p);
#pragma unroll
            for (int e = 0; e < 2 * P; e++) acc[r][e] *= corr;
            const int n_use = min(n_t, qpos - t0 + 1);
            for (int tt = 0; tt < n_use; tt++) {
                const float pt = __shfl_sync(0xffffffffu, p, tt);
#pragma unroll
                for (int e = 0; e < P; e++) {
                    const int w = e * 32 + lane;
                    if (w < half) {
                        const u32 pair = v_s[tt * half + w];
                        acc[r][2 * e] = fmaf(pt, bf16_to_f32((u16)(pair & 0xffffu)), acc[r][2 * e]);
                        acc[r][2 * e + 1] = fmaf(pt, bf16_to_f32((u16)(pair >> 16)), acc[r][2 * e + 1]);
                    }
                }
            }
            m[r] = m_new;
        }
    }

#pragma unroll
    for (int r = 0; r < R; r++) {
        const int rr = warp + ATTNP_WARPS * r;
        if (rr >= rows) continue;
        const int ti = rr / group, h = kvh * group + rr % group;
        const size_t out0 = (size_t)(tok0 + ti) * a.n_q * hd + h * hd;
        const float inv = 1.0f / l[r];
#pragma unroll
        for (int e = 0; e < P; e++) {
            const int w = e * 32 + lane;
            if (w < half) store_pair(a.out, out0 + 2 * w, acc[r][2 * e] * inv, acc[r][2 * e + 1] * inv, a.out_f16);
        }
    }
}

extern "C" __global__ void __launch_bounds__(ATTNP_THREADS) attn_prefill_r2(PrefillAttnArgs a) {
    pdl_enter();
    attn_prefill_body<2>(a);
}
extern "C" __global__ void __launch_bounds__(ATTNP_THREADS) attn_prefill_r8(PrefillAttnArgs a) {
    pdl_enter();
    attn_prefill_body<8>(a);
}

// ---------------------------------------------------------------------------------------
// Causal attention of a chunk on tensor cores (head_dim 16, 32, 64 or 128; the kernels above
// take the others). One CTA per (KV head, 64 rows), rows = (token, q head of the
// group) pairs in token-major order, 16 per warp. Per tile of ATTNP_TILE slots, staged in
// shared memory as f16 (K row-major, V transposed): S = Q K^T by mma.sync m16n8k16, the
// causal mask, online softmax on the S fragments, and O += P V with P taken straight from
// the S fragments (the C layout of one MMA is the A layout of the next). Q (rotated,
// scaled), K, V and P enter as f16, sums stay f32.

#define ATTNM_ROWS (16 * ATTNM_WARPS)

// Staging of the KV tiles: K and V both row-major f16 at a padded
// stride (HD/2 + 4 words: the rows of an 8x8 fragment matrix fall in distinct banks), written
// with 16-byte stores from 16-byte loads that were issued one tile ahead into registers, into
// two buffers, so each tile costs one barrier and its global latency hides behind the previous
// tile's MMAs; V's fragments come out transposed by ldmatrix.trans. (The first version, V
// transposed by 2-byte stores with loads issued and awaited inside the tile's two barriers,
// measured slower: docs/lab.md; removed after a1b9aaa.)
template <int HD>
struct KvStage {
    static constexpr int STRIDE = HD / 2 + 4;               // u32 words per staged row
    static constexpr int CHUNKS = ATTNP_TILE * HD / 8;      // 16-byte chunks of K (and of V)
    static constexpr int PER = (CHUNKS + 32 * ATTNM_WARPS - 1) / (32 * ATTNM_WARPS);
    uint4 k[PER], v[PER];

    // Loads tile t0's K and V (bf16) into registers; slots past `last` read as zeros.
    __device__ __forceinline__ void load(const PrefillAttnArgs& a, int kvh, int t0, int last) {
        const size_t slot_stride = (size_t)a.n_kv * HD;
#pragma unroll
        for (int i = 0; i < PER; i++) {
            const int c = threadIdx.x + i * 32 * ATTNM_WARPS, key = c / (HD / 8), col = c % (HD / 8);
            k[i] = v[i] = make_uint4(0, 0, 0, 0);
            if (c < CHUNKS && t0 + key <= last) {
                const size_t off = (size_t)(t0 + key) * slot_stride + kvh * HD + 8 * col;
                k[i] = *reinterpret_cast<const uint4*>(a.k_cache + off);
                v[i] = *reinterpret_cast<const uint4*>(a.v_cache + off);
            }
        }
    }

    // Converts the registers to f16 and stores them, row-major, into k_s / v_s.
    __device__ __forceinline__ void store(u32* k_s, u32* v_s) const {
#pragma unroll
        for (int i = 0; i < PER; i++) {
            const int c = threadIdx.x + i * 32 * ATTNM_WARPS, key = c / (HD / 8), col = c % (HD / 8);
            if (c >= CHUNKS) continue;
            *reinterpret_cast<uint4*>(k_s + key * STRIDE + 4 * col) = to_f16(k[i]);
            *reinterpret_cast<uint4*>(v_s + key * STRIDE + 4 * col) = to_f16(v[i]);
        }
    }

    __device__ __forceinline__ static u32 pair_to_f16(u32 w) {
        return pack_f16x2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
    }
    __device__ __forceinline__ static uint4 to_f16(uint4 w) {
        return make_uint4(pair_to_f16(w.x), pair_to_f16(w.y), pair_to_f16(w.z), pair_to_f16(w.w));
    }
};

__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const u32* p) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

template <int HD>
__device__ __forceinline__ void attn_prefill_mma_body(const PrefillAttnArgs& a) {
    constexpr int KS = HD / 16;          // k-steps of S = Q K^T
    constexpr int DT = HD / 8;           // n8 tiles of O
    static_assert(ATTNP_TILE == 32, "the S tile is 4 n8 tiles");
    using Stage = KvStage<HD>;
    // Two buffers of [K | V] row-major at Stage::STRIDE.
    constexpr int BUF_WORDS = 2 * ATTNP_TILE * Stage::STRIDE;
    __shared__ __align__(16) u32 kv_s[2 * BUF_WORDS];
    u32* k_s = kv_s;

    const int kvh = blockIdx.x, group = a.n_q / a.n_kv, rows_total = a.n * group;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int pos0 = a.state[STATE_POSITION] + a.first;
    const int row0 = blockIdx.y * ATTNM_ROWS;
    const int last_row = min(row0 + ATTNM_ROWS, rows_total) - 1;
    const int last = pos0 + last_row / group;  // the CTA's last slot

    Stage next;
    next.load(a, kvh, 0, last);

    // This thread's two rows (g, g + 8 of the warp's 16): positions; padding rows attend
    // to slot 0 only (finite, never stored).
    int qpos[2];
    u32 qf[KS][4];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int rr = row0 + warp * 16 + g + 8 * h;
        const bool valid = rr < rows_total;
        qpos[h] = valid ? pos0 + rr / group : 0;
        const float* q = a.qkv + (size_t)(valid ? rr / group : 0) * a.ld + (kvh * group + (valid ? rr % group : 0)) * HD;
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            const float2 lo = *reinterpret_cast<const float2*>(q + 16 * ks + 2 * t);
            const float2 hi = *reinterpret_cast<const float2*>(q + 16 * ks + 2 * t + 8);
            const float sc = valid ? a.scale : 0.0f;
            qf[ks][h] = pack_f16x2(lo.x * sc, lo.y * sc);
            qf[ks][2 + h] = pack_f16x2(hi.x * sc, hi.y * sc);
        }
    }
    const int warp_last = max(qpos[0], qpos[1]);  // the lanes' maximum, below
    int wl = warp_last;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) wl = max(wl, __shfl_xor_sync(0xffffffffu, wl, o));

    float o_acc[DT][4];
#pragma unroll
    for (int d = 0; d < DT; d++)
#pragma unroll
        for (int e = 0; e < 4; e++) o_acc[d][e] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};

    for (int t0 = 0; t0 <= last; t0 += ATTNP_TILE) {
        // Buffer (tile & 1) was last read two tiles ago, before the previous barrier.
        k_s = kv_s + ((t0 / ATTNP_TILE) & 1) * BUF_WORDS;
        next.store(k_s, k_s + ATTNP_TILE * Stage::STRIDE);
        __syncthreads();
        if (t0 + ATTNP_TILE <= last) next.load(a, kvh, t0 + ATTNP_TILE, last);
        if (t0 > wl) continue;  // every row of this warp is before the tile

        // S = Q K^T: 16 rows x 32 slots.
        float s[4][4];
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) s[nt][e] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                const u32* kr = k_s + (8 * nt + g) * Stage::STRIDE + 8 * ks + t;
                mma_16816(s[nt], qf[ks], kr[0], kr[4]);
            }
        }
        // Mask, row maxima (the 4 lanes of a quad share a row), online softmax.
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int h = e >> 1, key = t0 + 8 * nt + 2 * t + (e & 1);
                if (key > qpos[h]) s[nt][e] = NEG_INF;
                mx[h] = fmaxf(mx[h], s[nt][e]);
            }
        float corr[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
        for (int h = 0; h < 2; h++) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            const float m_new = fmaxf(m[h], mx[h]);
            corr[h] = m[h] == NEG_INF ? 0.0f : expf(m[h] - m_new);
            m[h] = m_new;
        }
        u32 pf[2][4];  // P as the A fragments of the two 16-slot k-steps
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            float p[4];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int h = e >> 1;
                p[e] = s[nt][e] == NEG_INF ? 0.0f : expf(s[nt][e] - m[h]);
                sum[h] += p[e];
            }
            pf[nt >> 1][(nt & 1) * 2 + 0] = pack_f16x2(p[0], p[1]);
            pf[nt >> 1][(nt & 1) * 2 + 1] = pack_f16x2(p[2], p[3]);
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 1);
            sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 2);
            l[h] = l[h] * corr[h] + sum[h];
        }
#pragma unroll
        for (int d = 0; d < DT; d++) {
            o_acc[d][0] *= corr[0];
            o_acc[d][1] *= corr[0];
            o_acc[d][2] *= corr[1];
            o_acc[d][3] *= corr[1];
        }
        // O += P V: k = slots (two k-steps of 16), n = dims.
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            // Lane l addresses row l % 8 of matrix l / 8: slots 16kk + 8 (l/8 & 1) + l % 8,
            // dims 8d + 8 (l / 16) of V; transposed, the four matrices are b0, b1 of dim
            // tiles d and d + 1.
            const u32* v_s = k_s + ATTNP_TILE * Stage::STRIDE;
            const int mi = lane >> 3, slot = 16 * kk + 8 * (mi & 1) + (lane & 7);
#pragma unroll
            for (int d = 0; d < DT; d += 2) {
                u32 b[4];
                ldmatrix_x4_trans(b, v_s + slot * Stage::STRIDE + 4 * d + 4 * (mi >> 1));
                mma_16816(o_acc[d], pf[kk], b[0], b[1]);
                mma_16816(o_acc[d + 1], pf[kk], b[2], b[3]);
            }
        }
    }

#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int rr = row0 + warp * 16 + g + 8 * h;
        if (rr >= rows_total) continue;
        const size_t out0 = (size_t)(rr / group) * a.n_q * HD + (kvh * group + rr % group) * HD;
        const float inv = 1.0f / l[h];
#pragma unroll
        for (int d = 0; d < DT; d++)
            store_pair(a.out, out0 + 8 * d + 2 * t, o_acc[d][2 * h] * inv, o_acc[d][2 * h + 1] * inv, a.out_f16);
    }
}

#define ATTNM_KERNEL(HD)                                                                                       \
    extern "C" __global__ void __launch_bounds__(32 * ATTNM_WARPS) attn_prefill_mma_hd##HD(PrefillAttnArgs a) {  \
        pdl_enter();                                                                                           \
        attn_prefill_mma_body<HD>(a);                                                                          \
    }
ATTNM_KERNEL(16)
ATTNM_KERNEL(32)
ATTNM_KERNEL(64)
ATTNM_KERNEL(128)
