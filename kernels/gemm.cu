// The NF4 x f16 tensor-core GEMM of the chunked prefill (also the decode step's linears under
// DV2_LINEAR=mma). Uses common.cuh.
//
// Layouts: a chunk's activations are f32 [n tokens][width], token-major (row i of the
// chunk is position pos0 + i, pos0 = state[POSITION] when the chunk starts).
#define GEMM_THREADS (GEMM_WARPS * 32)

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
static_assert(sizeof(GemmArgs) == SIZEOF_GEMMARGS, "GemmArgs differs from the host's (src/cuda/ops)");

// EPI_ROPE: GEMV v3's column kernels only (q/k/v stored rotated, k and v into the cache).
enum { EPI_STORE = 0, EPI_ACCUMULATE = 1, EPI_SWIGLU = 2, EPI_ROPE = 3 };

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
    const u16* srow[2][2];
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
    u16 s[2][2];  // f16 bits, converted where used
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
            const float sc = scale_f32(b.s[i][h]) * w.scale[i][h];
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
// (The cluster helpers are in common.cuh.)

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
