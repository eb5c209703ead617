// GEMV v2: the decode step's larger NF4 matrix-vector products (gate/up, down, lm_head on the
// Qwen2.5-3B shape) on CUDA cores with an f16-pair table. Uses common.cuh.

// GEMV v2 (the larger matrices). Persistent CTAs walk a block of rows; each warp holds its
// slice of x in registers for the whole walk (x is read once per warp, not once per row: the
// v1 kernels, removed after a1b9aaa, re-read 128 bytes of x for every 16 bytes of weights,
// with lanes 128 bytes apart, which made L1 the bottleneck), and issues the loads of R rows
// before using any of them.
//
// A row's 16-byte chunks are split over `kparts` warps (runtime: 1, 2, 4 or 8); each warp's
// lane holds J chunks (compile time: 1..3) of the row part, so a part covers 32*J chunks.
// The CTA's 8 warps are (8 / kparts) row lanes x kparts parts. Every warp runs the same
// number of iterations, so the per-iteration part reduction may use __syncthreads.

#define GEMV2_MAX_LANES_X_R 32  // (row lanes) x (rows in flight) held in shared memory
#define GEMV2_LATE_FLOATS 1024  // K-part sums of a CTA's rows kept for one final reduction
// x is staged in shared memory from f32 (stage_x) or, in the _x16 kernels, from f16 (down's
// input, written so by SwiGLU: DV2_FFN_F16). A kernel holds one x path: a warp runs it once,
// and paths it never takes cost their fetch (docs/lab.md, session 13: 600-1,100 SASS
// instructions a path).

// A row's epilogue operands (its bias, the old y a residual adds to), which GEMV v2 loads
// right after its wait instead of after the row's sums (see gemv2_walk).
struct RowEpi {
    float bias, old;
};

template <int J>
struct XSlice {
    float v[J][32];
};

// GEMV v2's x staged once per CTA in dynamic shared memory: the
// CTA loads x (and the norm's weights) coalesced, applies the norm, and stores chunk c (32
// floats) at X_STAGE_STRIDE * c; each lane then reads its own chunks with 16-byte shared
// loads, which the stride keeps conflict-free (the 8 lanes of a quarter-warp, on consecutive
// chunks, start 4 banks apart). Why: read straight from global memory (until a1b9aaa), each
// 16-byte load of a warp touches 32 cache lines (a chunk is one 128-byte line per lane), 8x
// the L1 wavefronts of a coalesced load; the same pattern in the norm's weights (2-byte
// loads, 16 lines each) cost ~3 us per kernel (docs/lab.md, session 7). Same values in the
// same order. X_STAGE_STRIDE comes from the host (src/cuda/kernels.rs), which sizes the
// dynamic shared memory.
// GEMV2_X_BATCH: quads per thread per round of loads; 4 stage K up to 4,096 in one round
// (gate/up and lm_head at K = 2,048 need 2) in fewer instructions than 8, code each warp runs
// once (docs/lab.md, session 13).
#define GEMV2_X_BATCH 4
// A quad of x as for_each_x_quad gives it (v; the norm's bf16 weights w and reciprocal r),
// times the norm where norm.w: what the stages write.
__device__ __forceinline__ void normed_quad(float4 v, uint2 w, float r, NormArgs norm, float (&e)[4]) {
    e[0] = v.x, e[1] = v.y, e[2] = v.z, e[3] = v.w;
    if (norm.w) {
        const u32 w2[2] = {w.x, w.y};
#pragma unroll
        for (int i = 0; i < 4; i++) e[i] = e[i] * r * bf16_to_f32((u16)(w2[i >> 1] >> (16 * (i & 1))));
    }
}
template <int THREADS = GEMV_THREADS>
__device__ __forceinline__ void stage_x(const float* __restrict__ x, int cols, NormArgs norm, float* x_staged) {
    for_each_x_quad<THREADS, GEMV2_X_BATCH>(x, cols, norm, [&](int q, float4 v, uint2 w, float r) {
        float e[4];
        normed_quad(v, w, r, norm, e);
        *reinterpret_cast<float4*>(x_staged + (q >> 3) * X_STAGE_STRIDE + (q & 7) * 4) = make_float4(e[0], e[1], e[2], e[3]);
    });
}

// This lane's chunks of x from the staged copy (zeros past the last chunk).
template <int J>
__device__ __forceinline__ void read_x_slice(const float* x_staged, int part, int cols, XSlice<J>& xs) {
    const int lane = threadIdx.x & 31, n_chunks = cols >> 5;
#pragma unroll
    for (int j = 0; j < J; j++) {
        const int c = (part * J + j) * 32 + lane;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const float4 v = c < n_chunks ? *reinterpret_cast<const float4*>(x_staged + c * X_STAGE_STRIDE + 4 * k)
                                          : make_float4(0.f, 0.f, 0.f, 0.f);
            xs.v[j][4 * k] = v.x, xs.v[j][4 * k + 1] = v.y, xs.v[j][4 * k + 2] = v.z, xs.v[j][4 * k + 3] = v.w;
        }
    }
}

// x given as f16 (the _x16 kernels: down's input, written so by SwiGLU), staged as the f16-pair
// walk reads it: chunk c's 16 words (its 32 halves, element 2i in the low half of word i) at
// X16_STAGE_STRIDE * c, whose 4 words of padding keep a quarter-warp's 16-byte reads of
// consecutive chunks conflict-free. Why: f32 x staged at K = 11008 is 44 KB of L2 reads per
// CTA, as many bytes as the CTA's weights, in two round trips of X_BATCH loads; f16 halves
// them and fits one round trip. The bits are those of the f32 path (the same rounding, done
// by the writer).
template <int THREADS = GEMV_THREADS>
__device__ __forceinline__ void stage_x16(const u16* __restrict__ x, int cols, u32* staged) {
    const int pieces = cols >> 3;  // 16 bytes each, 4 per chunk
    for (int base = threadIdx.x; base < pieces; base += X_BATCH * THREADS) {
        uint4 v[X_BATCH];
#pragma unroll
        for (int u = 0; u < X_BATCH; u++) {
            const int i = base + u * THREADS;
            if (i < pieces) v[u] = reinterpret_cast<const uint4*>(x)[i];
        }
#pragma unroll
        for (int u = 0; u < X_BATCH; u++) {
            const int i = base + u * THREADS;
            if (i < pieces) *reinterpret_cast<uint4*>(staged + (i >> 2) * X16_STAGE_STRIDE + (i & 3) * 4) = v[u];
        }
    }
}

// x given as f32 (the RMSNorm applied where norm.w), staged as stage_x16 stages f16 x: each
// value rounded to f16 once here, as GEMV v3 stages its x (the K walk's f32-x kernels).
template <int THREADS = GEMV_THREADS>
__device__ __forceinline__ void stage_x_as16(const float* __restrict__ x, int cols, NormArgs norm, u32* staged) {
    for_each_x_quad<THREADS>(x, cols, norm, [&](int q, float4 v, uint2 w, float r) {
        float e[4];
        normed_quad(v, w, r, norm, e);
        *reinterpret_cast<uint2*>(staged + (q >> 3) * X16_STAGE_STRIDE + (q & 7) * 2) =
            make_uint2(pack_f16x2(e[0], e[1]), pack_f16x2(e[2], e[3]));
    });
}

template <int J>
struct XHalves;

// Chunk c of x as f16 pairs from stage_x16's copy: zeros past the last chunk, or with
// LAST_PAST_END that last chunk itself (for weights whose zero scales multiply it by 0);
// STRIDE 16: from x itself, unstaged (its chunks 16 words apart).
template <int STRIDE = X16_STAGE_STRIDE, bool LAST_PAST_END = false>
__device__ __forceinline__ void read_x16_chunk(const u32* __restrict__ staged, int c, int n_chunks, u32 (&h)[16]) {
    if (LAST_PAST_END) c = min(c, n_chunks - 1);
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const uint4 v = LAST_PAST_END || c < n_chunks ? *reinterpret_cast<const uint4*>(staged + c * STRIDE + 4 * q)
                                                      : make_uint4(0u, 0u, 0u, 0u);
        h[4 * q] = v.x, h[4 * q + 1] = v.y, h[4 * q + 2] = v.z, h[4 * q + 3] = v.w;
    }
}

// This lane's chunks of x as f16 pairs from stage_x16's copy, or from x itself with STRIDE 16
// (zeros past the last chunk).
template <int J, int STRIDE = X16_STAGE_STRIDE>
__device__ __forceinline__ void read_x16_slice(const u32* __restrict__ staged, int part, int cols,
                                               XHalves<J>& xh) {
    const int lane = threadIdx.x & 31, n_chunks = cols >> 5;
#pragma unroll
    for (int j = 0; j < J; j++) read_x16_chunk<STRIDE>(staged, (part * J + j) * 32 + lane, n_chunks, xh.h[j]);
}

template <int J>
struct RowChunks {
    uint4 q[J];
    u16 s[J];  // the chunks' scales as loaded (f16 bits), converted where they are used
};

// GEMV v2's weight loads as ld.global.nc.L1::no_allocate (each 16-byte piece is read once). Why: with
// L1 cut to 28 KiB the decode step lost 0.069 ms (docs/lab.md, session 15, run 8), so L1 may
// bound the weight loads in flight; a load that allocates no line is not. Measured: -0.004
// ms/token against __ldg (session 16, runs 1-2).
__device__ __forceinline__ uint4 load_weights16(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// A chunk's scale (absmax, f16 bits), loaded as the weights are, past L1's allocation: a warp's
// 32 bytes of scales an iteration are a sector no later iteration reads, so allocating them only
// takes L1 from the loads in flight. Measured against __ldg at the 32B shape (f32 scales then):
// +1.07% at depth 48 where the same decode against itself read +0.4..+0.9%, +0.4 / +0.1% at 2k
// / 8k (within that); the 3B shape within its control (docs/lab.md, session 41). Kept as loaded
// until its use: converted where it is loaded, a walk's buffered loads each waited for their
// scale in the iteration that issued them (the 32B step -7.4%, docs/lab.md, session 42).
__device__ __forceinline__ u16 load_scale(const u16* p) {
    unsigned short v;
    asm("ld.global.nc.L1::no_allocate.b16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

// Issues the loads of this lane's chunks of one row part (zero scale past the row's end).
template <int J>
__device__ __forceinline__ void load_row(Nf4Ref m, int row, int cols, int part, RowChunks<J>& rc) {
    const int lane = threadIdx.x & 31, n_chunks = cols >> 5;
    // Unsigned 32 x 32 -> 64-bit row offsets: one IMAD.WIDE.U32 each, where a signed row takes
    // its sign's products too (rows and K are never negative).
    const uint4* w = reinterpret_cast<const uint4*>(m.packed + (size_t)(u32)row * (u32)(cols >> 1));
    const u16* a = m.absmax + (size_t)(u32)row * (u32)(cols >> 6);
#pragma unroll
    for (int j = 0; j < J; j++) {
        const int c = (part * J + j) * 32 + lane;
        const bool in = c < n_chunks;
        rc.q[j] = in ? load_weights16(w + c) : make_uint4(0u, 0u, 0u, 0u);
        rc.s[j] = in ? load_scale(a + (c >> 1)) : (u16)0;
    }
}

// One row part's dot product with this lane's x, shared by the v2 tables: each chunk's four
// 32-bit words of weights (four bytes each, each byte two weights) summed GROUP words at a
// time by `group_sum(j, w0, words)` (words w0 .. w0 + GROUP - 1 of chunk j), the groups
// added in f32, then times the chunk's absmax, added to acc in the same FMA.
template <int J, int GROUP, typename GroupSum>
__device__ __forceinline__ float dot_chunks(const RowChunks<J>& rc, GroupSum group_sum, float acc) {
    static_assert(GROUP == 1 || GROUP == 2 || GROUP == 4, "groups of 1, 2 or 4 words");
#pragma unroll
    for (int j = 0; j < J; j++) {
        const u32 words[4] = {rc.q[j].x, rc.q[j].y, rc.q[j].z, rc.q[j].w};
        // Started from the first group, not from 0.0f: ptxas keeps a `0.0f + s` (an FADD a
        // chunk: it is -0.0f's sign), and the sums are the same to the bit.
        float part = group_sum(j, 0, words);
#pragma unroll
        for (int w0 = GROUP; w0 < 4; w0 += GROUP) part += group_sum(j, w0, words);
        acc = fmaf(part, scale_f32(rc.s[j]), acc);
    }
    return acc;
}

// GEMV v2's table: the byte -> f16-pair table above, 4 bytes per lookup instead of the f32
// pairs' 8 (removed after a1b9aaa, as was the 16-entry codebook), so a warp's lookup is one
// shared-memory wavefront instead of two (the v2 loop is bound by these lookups, docs/lab.md
// session 9). The pairs multiply x as f16x2 (x packed once per walk),
// each word's four pairs summed by two lanes of an f16x2 FMA chain, then added in f32: the
// products and those 4-term sums are f16, whose rounding (~2e-5 of the terms' magnitude in a
// numpy model at K = 2048) is of the order of x's own f16 rounding in GEMV v3; like v3, an |x|
// past 65504 would overflow. (hfma2 and half2_sum: common.cuh.)

// A lane's x as f16 pairs (element 2i in the low half of h[j][i]).
template <int J>
struct XHalves {
    u32 h[J][16];
};

template <int J>
__device__ __forceinline__ void pack_x_halves(const XSlice<J>& xs, XHalves<J>& xh) {
#pragma unroll
    for (int j = 0; j < J; j++)
#pragma unroll
        for (int i = 0; i < 16; i++) xh.h[j][i] = pack_f16x2(xs.v[j][2 * i], xs.v[j][2 * i + 1]);
}

// The PRMT-addressed table at window offset KWALK_TABLE_AT of shared memory (the host's, as a
// -D option: src/cuda/kernels.rs), so the PRMT's result is a lookup's whole address (lane_at:
// KWALK_TABLE_AT | 4 * lane; the table's high byte comes from it): one PRMT and the load, where
// a table at an offset the compiler keeps in an ordinary register takes an add more.
__device__ __forceinline__ u32 fixed_lut_entry(u32 word, int k, u32 lane_at) {
    const u32 addr = __byte_perm(lane_at, word, 0x3240u | ((u32)k << 4));  // {lane4, byte k, 2, 0}
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}

#define GEMV2_CHAIN 2
// GEMV2_CHAIN: words of a chunk
// whose pairs one f16x2 FMA chain sums before it is added in f32 (1: each word's four pairs,
// as before session 15). Longer chains convert and add fewer times: per chunk of 16 bytes 17
// instructions of sums with 1, 9 with 2, 5 with 4, against 64 for the lookups and products,
// and the walk is issue-bound (docs/lab.md, session 15). Each f16 partial sum holds 8 (16)
// products instead of 4: its rounding grows (the gates' logit errors with every linear on
// v2 moved by up to 0.004, cap 0.05), as does the reach of an |x| outlier toward f16's
// 65504, which is why the default is 2, not 4.
// dot_chunks with the f16-pair table (lane4 = 4 * lane): each group of GEMV2_CHAIN words one
// f16x2 FMA chain, summed in f32. PRMT: the table laid out for prmt_lut_entry.
// FIXED: the PRMT table at window offset KWALK_TABLE_AT, lane4 holding it (fixed_lut_entry).
// acc: what the row's sum adds to (the K walk's running sum: its FMA's addend, where an add
// after the FMA was one instruction more a chunk).
template <int J, bool PRMT = false, bool FIXED = false>
__device__ __forceinline__ float dot_row_pair16(const RowChunks<J>& rc, const XHalves<J>& xh, const u32* lut,
                                                u32 lane4, float acc = 0.0f) {
    return dot_chunks<J, GEMV2_CHAIN>(rc, [&](int j, int w0, const u32* words) {
        u32 h = 0u;
#pragma unroll
        for (int w = w0; w < w0 + GEMV2_CHAIN; w++)
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const u32 e = FIXED  ? fixed_lut_entry(words[w], k, lane4)
                              : PRMT ? prmt_lut_entry(lut, words[w], k, lane4)
                                     : byte_lut_entry(lut, words[w], k, lane4);
                h = hfma2(e, xh.h[j][4 * w + k], h);
            }
        return half2_sum(h);
    }, acc);
}

// The walk shared by the v2 kernels. `Rows` maps a row index to its matrix and epilogue:
//   Nf4Ref matrix(int row, int* local_row); void store(int row, float sum[NM]) for NM
//   matrices per row (1, or 2 for SwiGLU's gate and up); void tail(), run as the walk ends,
//   and void finish() after the epilogues (every thread of the CTA).
// X16: x comes as f16 (stage_x16), else f32 (stage_x). WARPS: the CTA's warps (GEMV_WARPS,
// or 20 for gemv2_swiglu_j1_w20's 5 warps a row).
// X_DIRECT (with X16): each lane loads its own chunks of x from global memory, nothing staged
// (every chunk of x is read by one lane of the CTA: J = 1 over K / 32 lanes).
template <int J, int R, int NM, bool X16, int WARPS = GEMV_WARPS, bool X_DIRECT = false, typename Rows>
__device__ __forceinline__ void gemv2_walk(Rows rows_of, int rows, int cols, const float* __restrict__ x,
                                           NormArgs norm, int kparts, const int* skip_if, int early_ctas = 0,
                                           int early_rows = 0) {
    // Rows::prmt_table: the f16-pair table in dynamic shared memory as load_byte_codebook_prmt
    // lays it out, before x; else in static shared memory.
    constexpr bool prmt_table = Rows::prmt_table;
    __shared__ __align__(16) u32 pair16_static[prmt_table ? 1 : BYTE_LUT_WORDS];
    __shared__ float partial[GEMV2_MAX_LANES_X_R * NM][WARPS];
    // With other WARPS: 4 times the floats for gemv2_swiglu_j1_w20's 5 K-parts of ~210 rows of 2
    // sums; for gemv2_logits_j1_w20's 5 K-parts of 1,152 rows (the 32B shape's lm_head over 132
    // CTAs) the host's LOGITS_W20_LATE_SUMS, which it checks a vocabulary against.
    constexpr int late_floats = WARPS == GEMV_WARPS ? GEMV2_LATE_FLOATS
                                : NM == 2           ? 4 * GEMV2_LATE_FLOATS
                                                    : LOGITS_W20_LATE_SUMS;
    __shared__ float late_partial[late_floats];
    // Dynamic shared memory: that table (PRMT_LUT_WORDS words), then x as staged: cols / 32 *
    // X_STAGE_STRIDE floats, or cols / 32 * X16_STAGE_STRIDE words from f16.
    extern __shared__ __align__(16) float gemv2_dyn[];
    u32* pair16_lut = prmt_table ? reinterpret_cast<u32*>(gemv2_dyn) : pair16_static;
    float* x_staged = gemv2_dyn + (prmt_table ? PRMT_LUT_WORDS : 0);
    timeline_start();
    // The table build is written for GEMV_THREADS threads; a larger CTA's others skip it.
    auto build_table = [&] {
        if (WARPS == GEMV_WARPS || (int)threadIdx.x < GEMV_THREADS) {
            if (prmt_table) load_byte_codebook_prmt<GEMV_THREADS>(pair16_lut);
            else load_byte_codebook<GEMV_THREADS>(pair16_lut);
        }
    };
    // The one-CTA-an-SM walks (other WARPS: gemv2_swiglu_j1_w20, gemv2_down_j1_w27,
    // gemv2_logits_j1_w20) build the table after their first loads: with the build first,
    // ptxas placed those loads after the PDL wait in the last two. +1.0..+2.0% decode at the
    // 32B shape at 48 and 8k; in every walk it cost the 3B shape 0.6-1.0% at 48 (docs/lab.md,
    // session 50). GEMV2_LOADS_FIRST: the host's switch (DV2_LOADS_FIRST).
    constexpr bool loads_first = GEMV2_LOADS_FIRST && WARPS != GEMV_WARPS;
    if (!loads_first) build_table();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 lane4 = lane * 4;
    // kparts is 1, 2, 4 or 8 (the host's gemv2_shape): the warp's roles by shifts and masks;
    // with other WARPS any divisor of them, by division.
    const int kshift = log2_pow2(kparts);
    const int part = WARPS == GEMV_WARPS ? warp & (kparts - 1) : warp % kparts;
    const int row_lane = WARPS == GEMV_WARPS ? warp >> kshift : warp / kparts;
    const int row_lanes = WARPS == GEMV_WARPS ? GEMV_WARPS >> kshift : WARPS / kparts;
    // Rows by CTA: an equal share each, or (early_ctas > 0; SwiGLU, GEMV2_SWIGLU_SKEW on the
    // host) early_rows for each of the first early_ctas CTAs and an equal share of the rest for
    // the others. Why: the CTAs the scheduler places first (beside the previous kernel's)
    // start ~1-2 us before those that wait for its CTAs to leave, and the kernel ends with its
    // last CTA. The plain and lm_head kernels measured slower with it (session 18) and hold no
    // such code.
    if (NM != 2) early_ctas = 0;
    const int late_rows =
        early_ctas > 0 ? (rows - early_ctas * early_rows + (int)gridDim.x - early_ctas - 1) / ((int)gridDim.x - early_ctas)
                       : 0;
    const int per_cta = early_ctas == 0 ? (rows + gridDim.x - 1) / gridDim.x
                        : (int)blockIdx.x < early_ctas ? early_rows
                                                       : late_rows;
    const int r0 = early_ctas == 0 || (int)blockIdx.x < early_ctas
                       ? blockIdx.x * per_cta
                       : early_ctas * early_rows + ((int)blockIdx.x - early_ctas) * late_rows;
    const int r1 = min(rows, r0 + per_cta);
    const int block = row_lanes * R;  // rows per iteration
    // Late sums: each iteration leaves its K-part sums in shared memory and the CTA adds them
    // and runs the epilogue once, after its last iteration: one barrier instead of two per
    // iteration, every row's epilogue loads (a residual's old y) in flight together instead of
    // one round trip per iteration, and without a K split (gate/up, lm_head) a warp's rows'
    // epilogues (SwiGLU's exp and division by lane 0) leave the walk and run in parallel at
    // its end. Same sums in the same order. A CTA whose sums do not fit shared memory stores
    // as it goes.
    const bool late = (r1 - r0) * NM * kparts <= late_floats;
    // Software pipeline: the loads of the next block are issued before this block's math.
    RowChunks<J> cur[R][NM], nxt[R][NM];
    // The one-matrix one-CTA-an-SM walks (the 27-warp down, the 20-warp lm_head: K a constant
    // whose chunks the CTA's K parts cover exactly, a row lane's rows a block apart) load from
    // two running pointers, this lane's chunk of its first row of the block and that chunk's
    // scale, each row of the block an immediate offset from them, where each row's addresses
    // were made from its index (~10 instructions a row): their loops 460 -> 437 and 411 -> 386
    // SASS instructions, +0.6..+1.2% decode at the 32B shape at 48 and +0.4..+0.8% at 8k
    // (docs/lab.md, session 59).
    constexpr bool stepped = WARPS != GEMV_WARPS && J == 1 && NM == 1;
    const int row_words = cols >> 5, row_scales = cols >> 6;  // uint4s, scales a row
    const uint4* w_at = nullptr;
    const u16* s_at = nullptr;
    if (stepped) {
        const Nf4Ref m = rows_of.matrix(r0, 0);
        const u32 c = (u32)(part * 32 + lane), r = (u32)(r0 + row_lane);
        w_at = reinterpret_cast<const uint4*>(m.packed) + (size_t)r * (u32)row_words + c;
        s_at = m.absmax + (size_t)r * (u32)row_scales + (c >> 1);
    }
    auto load_block = [&](int base, RowChunks<J> (&rc)[R][NM]) {
        if (stepped) {
            // A block wholly inside the CTA's rows loads without the per-row test: ptxas then
            // issues those loads ahead of the current block's products, where behind the test
            // it issued them after (loops 437 -> 461 and 386 -> 410 SASS instructions, yet
            // +0.8..+0.9% decode at the 32B shape at 48 and 8k on an H100: the loads' timing
            // over their count; docs/lab.md, session 60).
            const bool full = base + block <= r1;
#pragma unroll
            for (int i = 0; i < R; i++) {
                if (full || base + i * row_lanes + row_lane < r1) {
                    rc[i][0].q[0] = load_weights16(w_at + i * row_lanes * row_words);
                    rc[i][0].s[0] = load_scale(s_at + i * row_lanes * row_scales);
                }
            }
            w_at += block * row_words;
            s_at += block * row_scales;
            return;
        }
#pragma unroll
        for (int i = 0; i < R; i++) {
            const int r = base + i * row_lanes + row_lane;
            if (r < r1) {
#pragma unroll
                for (int k = 0; k < NM; k++) load_row<J>(rows_of.matrix(r, k), rows_of.local(r), cols, part, rc[i][k]);
            }
        }
    };
    // The first block's weights go out before the wait on the previous kernel (weights are
    // constant; it pays where the CTA is resident early, as the 128-register kernels are
    // beside a GEMV v3 CTA: 0.01-0.02 ms/token, docs/lab.md session 10).
    load_block(r0, cur);
    if (loads_first) build_table();
    pdl_enter<true>();
    if (skip_if && *skip_if) return;
    // With late sums the epilogue operands of the CTA's first blockDim.x rows (thread i: row
    // r0 + i, as in the final reduction below) load now, so their round trip overlaps the walk
    // instead of following the last barrier.
    RowEpi early_epi{0.0f, 0.0f};
    if (late && (int)threadIdx.x < r1 - r0) early_epi = rows_of.epi(r0 + threadIdx.x);
    XHalves<J> xh;
    if (X16 && X_DIRECT) {
        read_x16_slice<J, 16>(reinterpret_cast<const u32*>(x), part, cols, xh);
        __syncthreads();  // the table
    } else if (X16) {
        stage_x16<WARPS * 32>(reinterpret_cast<const u16*>(x), cols, reinterpret_cast<u32*>(x_staged));
        __syncthreads();
        read_x16_slice<J>(reinterpret_cast<const u32*>(x_staged), part, cols, xh);
    } else {
        XSlice<J> xs;
        stage_x<WARPS * 32>(x, cols, norm, x_staged);
        __syncthreads();
        read_x_slice<J>(x_staged, part, cols, xs);
        pack_x_halves<J>(xs, xh);
    }
    float ss = 0.0f;  // squares of the values this thread stored
    for (int base = r0; base < r1; base += block) {
        if (base + block < r1) load_block(base + block, nxt);
        float sums[R][NM];
#pragma unroll
        for (int i = 0; i < R; i++)
#pragma unroll
            for (int k = 0; k < NM; k++) sums[i][k] = dot_row_pair16<J, prmt_table>(cur[i][k], xh, pair16_lut, lane4);
#pragma unroll
        for (int i = 0; i < R; i++)
#pragma unroll
            for (int k = 0; k < NM; k++) cur[i][k] = nxt[i][k];
        // Late sums: the block's reduced all at once (warp_sum_spread), each stored by the lane
        // that holds it: the 32B shape's SwiGLU iteration ~395 -> ~372 SASS instructions, +2.2-3.1%
        // decode at the 32B shape, the 3B shape's within noise (docs/lab.md, session 38).
        constexpr int n_sums = R * NM, spread = 32 / n_sums;
        if (late) {
            const float s = warp_sum_spread<n_sums>(&sums[0][0]);
            if ((lane & (spread - 1)) == 0) {
                const int idx = lane / spread, i = idx / NM, k = idx % NM;
                const int r = base + i * row_lanes + row_lane;
                if (r < r1) late_partial[((r - r0) * NM + k) * kparts + part] = s;
            }
            continue;
        }
#pragma unroll
        for (int i = 0; i < R; i++)
#pragma unroll
            for (int k = 0; k < NM; k++) sums[i][k] = warp_sum(sums[i][k]);
        if (kparts == 1) {
            if (lane == 0) {
#pragma unroll
                for (int i = 0; i < R; i++) {
                    const int r = base + i * row_lanes + row_lane;
                    if (r < r1) ss += sq(rows_of.store(r, sums[i]));
                }
            }
            continue;
        }
        if (lane == 0) {
#pragma unroll
            for (int i = 0; i < R; i++)
#pragma unroll
                for (int k = 0; k < NM; k++) partial[(i * row_lanes + row_lane) * NM + k][part] = sums[i][k];
        }
        __syncthreads();
        if (threadIdx.x < block) {
            const int r = base + threadIdx.x;
            if (r < r1) {
                const int i = WARPS == GEMV_WARPS ? threadIdx.x >> log2_pow2(row_lanes) : threadIdx.x / row_lanes;
                const int rl = WARPS == GEMV_WARPS ? threadIdx.x & (row_lanes - 1) : threadIdx.x % row_lanes;
                float total[NM];
#pragma unroll
                for (int k = 0; k < NM; k++) {
                    total[k] = 0.0f;
                    for (int p = 0; p < kparts; p++) total[k] += partial[(i * row_lanes + rl) * NM + k][p];
                }
                ss += sq(rows_of.store(r, total));
            }
        }
        __syncthreads();
    }
    rows_of.tail();
    if (late) {
        __syncthreads();
        for (int idx = threadIdx.x; idx < r1 - r0; idx += blockDim.x) {
            float total[NM];
#pragma unroll
            for (int k = 0; k < NM; k++) {
                total[k] = 0.0f;
                for (int p = 0; p < kparts; p++) total[k] += late_partial[(idx * NM + k) * kparts + p];
            }
            const RowEpi e = idx == (int)threadIdx.x ? early_epi : rows_of.epi(r0 + idx);
            ss += sq(rows_of.store(r0 + idx, total, e));
        }
    }
    if (float* out = rows_of.ss_out()) block_sum_to(ss, out + blockIdx.x);
    rows_of.finish();
    timeline_end();
}

// Each Rows type's store returns the value it wrote; ss_out() (may be null) is where the
// walk leaves this CTA's sum of their squares, for the next RMSNorm (NormArgs).
struct PlainRows {
    static constexpr bool prmt_table = false;
    Nf4Ref m;
    float* y;
    const float* bias;
    int accumulate;
    float* ss;
    __device__ void tail() const {}
    __device__ void finish() const {}
    __device__ Nf4Ref matrix(int, int) const { return m; }
    __device__ int local(int r) const { return r; }
    __device__ RowEpi epi(int r) const { return {bias ? bias[r] : 0.0f, accumulate ? y[r] : 0.0f}; }
    __device__ float store(int r, const float* s, RowEpi e) const {
        const float v = s[0] + e.bias;
        const float out = accumulate ? e.old + v : v;
        y[r] = out;
        return out;
    }
    __device__ float store(int r, const float* s) const { return store(r, s, epi(r)); }
    __device__ float* ss_out() const { return ss; }
};

struct QkvRows {
    static constexpr bool prmt_table = false;
    QkvArgs a;
    float* out;
    __device__ void tail() const {}
    __device__ void finish() const {}
    __device__ int seg(int r) const { return r < a.rows[0] ? 0 : (r < a.rows[0] + a.rows[1] ? 1 : 2); }
    __device__ Nf4Ref matrix(int r, int) const {
        const int s = seg(r);
        return s == 0 ? a.m[0] : (s == 1 ? a.m[1] : a.m[2]);
    }
    __device__ int local(int r) const {
        const int s = seg(r);
        return s == 0 ? r : (s == 1 ? r - a.rows[0] : r - a.rows[0] - a.rows[1]);
    }
    __device__ RowEpi epi(int r) const {
        const int g = seg(r);
        const float* b = g == 0 ? a.bias[0] : (g == 1 ? a.bias[1] : a.bias[2]);
        return {b ? b[local(r)] : 0.0f, 0.0f};
    }
    __device__ float store(int r, const float* s, RowEpi e) const {
        const float v = s[0] + e.bias;
        out[r] = v;
        return v;
    }
    __device__ float store(int r, const float* s) const { return store(r, s, epi(r)); }
    __device__ float* ss_out() const { return nullptr; }
};

struct SwigluRows {
    static constexpr bool prmt_table = false;
    Nf4Ref gate, up;
    float* out;
    bool out_f16;  // for a down GEMV that stages f16 (DV2_FFN_F16)
    __device__ void tail() const {}
    __device__ void finish() const {}
    __device__ Nf4Ref matrix(int, int k) const { return k == 0 ? gate : up; }
    __device__ int local(int r) const { return r; }
    __device__ RowEpi epi(int) const { return {0.0f, 0.0f}; }
    __device__ float store(int r, const float* s, RowEpi) const { return store(r, s); }
    __device__ float store(int r, const float* s) const {
        const float v = s[0] / (1.0f + expf(-s[0])) * s[1];
        if (out_f16) reinterpret_cast<u16*>(out)[r] = f32_to_f16(v);
        else out[r] = v;
        return v;
    }
    __device__ float* ss_out() const { return nullptr; }
};

// lm_head with the greedy argmax folded in (DV2_LOGITS_ARGMAX, default): the logits are
// stored as by PlainRows, each thread keeps the best of the rows it stored (rows in rising
// order, so the strict > keeps the lowest index of a tie; NaN never wins), and finish() takes
// the argmax over the CTAs as argmax_logits does (argmax_across_ctas); the CTA that arrives
// last writes state[NEXT_TOKEN]. Why: the argmax kernel after lm_head added
// 4.75-5.25 us a step in the graph (docs/lab.md, sessions 15-16): its launch, wait and second
// read of the 600 KB of logits. Measured: -0.0017 ms/token (session 16, run 2). With
// `ring` (the decode step's graph), that CTA also commits the id as
// commit_step would, one kernel fewer a step (its launch added 1.0 us, session 16's trace).
struct LogitRows {
    static constexpr bool prmt_table = true;  // the walk's table for PRMT
    Nf4Ref m;
    float* y;
    int* state;
    int* scratch;
    int eos;
    int* ring;  // null: no commit
    int* hist;
    mutable float best;
    mutable int best_i;
    __device__ Nf4Ref matrix(int, int) const { return m; }
    __device__ int local(int r) const { return r; }
    __device__ RowEpi epi(int) const { return {0.0f, 0.0f}; }
    __device__ float store(int r, const float* s, RowEpi) const { return store(r, s); }
    __device__ float store(int r, const float* s) const {
        y[r] = s[0];
        if (!isfinite(s[0])) mark_non_finite(state);
        if (s[0] > best || (best_i < 0 && s[0] == s[0])) best = s[0], best_i = r;
        return s[0];
    }
    __device__ float* ss_out() const { return nullptr; }
    __device__ void tail() const {}
    __device__ void finish() const {
        float b = best;
        int bi = best_i;
        block_argmax(b, bi);
        if (!argmax_across_ctas(b, bi, scratch)) return;
        if (threadIdx.x == 0) {
            const int next = bi < 0 ? 0 : bi;
            state[STATE_NEXT_TOKEN] = next;
            if (ring) commit(next);
        }
    }
    // commit_step's work: the CTAs skipped this launch while finished was
    // set, so finished is clear here.
    __device__ void commit(int next) const {
        ring[state[STATE_RING_COUNT]++] = next;
        state[STATE_TOKEN] = next;
        state[STATE_POSITION] += 1;
        state[STATE_VALID_LEN] = state[STATE_POSITION];
        hist[state[STATE_POSITION]] = next;
        if (next == eos) state[STATE_FINISHED] = 1;
    }
};

// The kernels of one J by what the rows feed: a plain matrix (nf4; _x16: its x in f16),
// q/k/v, SwiGLU, and lm_head with the argmax (logits). R: rows in flight per warp, half of
// what fits 255 registers, so that each kernel stays within 128 (no spills but SwiGLU's at J
// = 3, 184 bytes, which the host takes only past K = 16,384: at the 32B shape's K = 5,120
// SwiGLU at J = 2 over 4 warps a row ran +16% decode against J = 3 over 2, docs/lab.md
// session 30, and 5 warps a row below +12% more, session 31): a CTA fits beside a
// GEMV v3 CTA (o's, before gate/up), so it becomes resident and builds its table while that
// kernel runs, and two fit an SM (GEMV2_CTAS_PER_SM on the host): 6% faster decode than one
// CTA of twice the rows (docs/lab.md, session 10).
// The _narrow suffix names that bound.
// The register bound that fits GEMV2_CTAS_PER_SM CTAs on an SM's 65,536 registers (128).
#define GEMV2_MAX_REGS (65536 / (GEMV_THREADS * GEMV2_CTAS_PER_SM))
#define GEMV2_NF4_KERNEL(J, R, X16, SUFFIX)                                                                    \
    extern "C" __global__ void __maxnreg__(GEMV2_MAX_REGS)                                                                \
        gemv2_nf4_j##J##SUFFIX(Nf4Ref m, const float* __restrict__ x, NormArgs norm, float* y,                 \
                               const float* __restrict__ bias, int rows, int cols, int kparts, int accumulate, \
                               const int* skip_if, float* ss_out) {                                            \
        PlainRows p{m, y, bias, accumulate, ss_out};                                                           \
        gemv2_walk<J, R, 1, X16>(p, rows, cols, x, norm, kparts, skip_if);                                     \
    }
#define GEMV2_KERNELS(J, R, R_X16)                                                                             \
    GEMV2_NF4_KERNEL(J, R, false, _narrow)                                                                     \
    GEMV2_NF4_KERNEL(J, R_X16, true, _narrow_x16)                                                              \
    extern "C" __global__ void __maxnreg__(GEMV2_MAX_REGS)                                                                \
        gemv2_qkv_j##J##_narrow(QkvArgs a, const float* __restrict__ x, NormArgs norm, float* out, int cols,   \
                                int kparts) {                                                                  \
        QkvRows q{a, out};                                                                                     \
        gemv2_walk<J, R, 1, false>(q, a.rows[0] + a.rows[1] + a.rows[2], cols, x, norm, kparts, nullptr);      \
    }                                                                                                          \
    extern "C" __global__ void __maxnreg__(GEMV2_MAX_REGS)                                                                \
        gemv2_swiglu_j##J##_narrow(Nf4Ref gate, Nf4Ref up, const float* __restrict__ x, NormArgs norm,         \
                                   float* out, int rows, int cols, int kparts, int out_f16, int early_ctas,    \
                                   int early_rows) {                                                           \
        SwigluRows g{gate, up, out, out_f16 != 0};                                                             \
        gemv2_walk<J, (R > 1 ? R / 2 : 1), 2, false>(g, rows, cols, x, norm, kparts, nullptr, early_ctas,     \
                                                     early_rows);                                              \
    }                                                                                                          \
    GEMV2_LOGITS_KERNEL(J, R)
// lm_head and the argmax in one (LogitRows; DV2_LOGITS_ARGMAX, default), compiled only with
// the switch (GEMV2_LOGITS, from the host's config).
#if GEMV2_LOGITS
#define GEMV2_LOGITS_KERNEL(J, R)                                                                              \
    extern "C" __global__ void __maxnreg__(GEMV2_MAX_REGS)                                                                \
        gemv2_logits_j##J##_narrow(Nf4Ref m, const float* __restrict__ x, NormArgs norm, float* y, int rows,   \
                                   int cols, int kparts, const int* skip_if, int* state, int* scratch, int eos, \
                                   int* ring, int* hist) {                                                     \
        LogitRows p{m, y, state, scratch, eos, ring, hist, NEG_INF, -1};                                       \
        gemv2_walk<J, R, 1, false>(p, rows, cols, x, norm, kparts, skip_if);                                   \
    }
#else
#define GEMV2_LOGITS_KERNEL(J, R)
#endif
// R rows in flight a warp; from f16 x (down) J = 3 holds 2 in 128 registers without spills,
// where the f32-x kernels spill (down at the 3B shape's K = 11,008 +0.8-1.0% decode from 2k to
// 32k against 1: docs/lab.md, session 33).
GEMV2_KERNELS(1, 2, 2)
GEMV2_KERNELS(2, 2, 2)
GEMV2_KERNELS(3, 1, 2)
// J = 4 from f16 x: K past GEMV2_MAX_K up to 32,768 where the K walk below would take more
// CTAs than fit (more than 20 x GEMV2_CTAS_PER_SM rows an SM; at the 32B shape's K = 27,648
// it ran +16% decode against GEMV v3: docs/lab.md, session 30).
GEMV2_NF4_KERNEL(4, 1, true, _narrow_x16)
// Down past GEMV2_MAX_K from f16 x (the 32B shape's K = 27,648) with its bytes in flight not
// capped by x's registers. The walk above holds a lane's slice of x in registers (J x 16 of
// them for the whole walk) and one block of rows ahead in registers; here a warp walks K
// instead, 32 chunks an iteration (chunk c = 32 t + lane, a coalesced 512 bytes a row), reads
// that chunk of x from shared memory (4 16-byte loads, shared by its R rows) and keeps D
// iterations of its R rows' weights in flight: D x R x 16 bytes a lane where the walk has J x
// R. A CTA is (8 / kparts) row lanes x kparts K parts, R rows a row lane, one block of rows
// (no persistent loop: the host launches one CTA per block where those fit GEMV2_CTAS_PER_SM
// an SM, else the J = 4 walk). +2.0-2.8% decode at the 32B shape from 48 to 8k against J = 4
// (5 rows x 2 iterations over K halves); 3 iterations, and at the 3B shape's K = 11,008 (1 x 8,
// 2 x 4), lost: docs/lab.md, session 33.
// X32: x comes as f32 (with the RMSNorm where norm.w) and is staged as f16 (stage_x_as16); else
// as f16. Rows: whose matrices and epilogue (PlainRows, QkvRows). WARPS: the CTA's warps.
// TABLE: where the byte table lies (KwalkTable).
enum class KwalkTable {
    Static,   // the byte table in static shared memory
    BeforeX,  // the PRMT-addressed table in dynamic shared memory, x after it (the host gives
              // the CTA GEMV2_PRMT_TABLE bytes more)
    Fixed,    // the PRMT-addressed table at window offset KWALK_TABLE_AT, past x
};
template <int R, int D, bool X32, int WARPS = GEMV_WARPS, KwalkTable TABLE = KwalkTable::Static, typename Rows>
__device__ __forceinline__ void gemv2_kwalk(Rows rows_of, int rows, int cols, const void* __restrict__ x,
                                            NormArgs norm, int kparts, const int* skip_if) {
    constexpr bool FIXED = TABLE == KwalkTable::Fixed, PRMT = TABLE != KwalkTable::Static;
    __shared__ __align__(16) u32 pair16_static[PRMT ? 1 : BYTE_LUT_WORDS];
    __shared__ float part_sums[WARPS * R];
    extern __shared__ __align__(16) float gemv2_dyn[];
    constexpr bool BEFORE_X = TABLE == KwalkTable::BeforeX;
    u32* x_staged = reinterpret_cast<u32*>(gemv2_dyn) + (BEFORE_X ? PRMT_LUT_WORDS : 0);
    u32* pair16_lut = BEFORE_X ? reinterpret_cast<u32*>(gemv2_dyn) : pair16_static;
    if (FIXED) {
        const u32 dyn_at = (u32)__cvta_generic_to_shared(gemv2_dyn);
        pair16_lut = reinterpret_cast<u32*>(reinterpret_cast<char*>(gemv2_dyn) + (KWALK_TABLE_AT - dyn_at));
    }
    timeline_start();
    // The table build is written for GEMV_THREADS threads; a larger CTA's others skip it.
    if (WARPS == GEMV_WARPS || (int)threadIdx.x < GEMV_THREADS) {
        if (PRMT) load_byte_codebook_prmt<GEMV_THREADS>(pair16_lut);
        else load_byte_codebook<GEMV_THREADS>(pair16_lut);
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 lane4 = FIXED ? KWALK_TABLE_AT | (lane * 4) : lane * 4;
    const int kshift = log2_pow2(kparts);
    const int part = warp & (kparts - 1), row_lane = warp >> kshift;
    const int block_rows = (WARPS >> kshift) * R;
    const int r0 = blockIdx.x * block_rows + row_lane * R;  // this warp's first row
    const int n_chunks = cols >> 5, iters = (n_chunks + 31) >> 5;
    const int per_part = (iters + kparts - 1) >> kshift;
    const int t_begin = part * per_part, t_end = min(iters, t_begin + per_part);
    // Each of the warp's rows: its matrix and its row there.
    Nf4Ref m[R];
    int lr[R];
#pragma unroll
    for (int i = 0; i < R; i++) m[i] = rows_of.matrix(r0 + i, 0), lr[i] = rows_of.local(r0 + i);
    // Iteration t's chunk of each of the warp's rows (zeros past K, past the part, past the rows).
    // Where every lane's chunk lies within K (K a multiple of 32 chunks) and the warp's rows
    // within the matrix (the 32B shape's q/k/v, o and down), an iteration past the part loads
    // nothing (its buffer is never read: the loop stops at t_end) and the others load
    // unpredicated, the row offsets as unsigned products: sm_90's round of 10 loads ~70 -> ~38
    // instructions, +1.0-1.4% decode at the 32B shape from 48 to 8k (docs/lab.md, session 39).
    const bool whole = (n_chunks & 31) == 0 && r0 + R <= rows;  // the same for the whole warp
    // Row i's chunk c and its scale, by unsigned offsets (a row or a chunk is never negative:
    // a signed c >> 1 cost the scale's address a sign extension a row).
    auto words_at = [&](int i, int c) {
        return reinterpret_cast<const uint4*>(m[i].packed + (size_t)(u32)lr[i] * (u32)(cols >> 1)) + c;
    };
    auto scale_at = [&](int i, int c) { return m[i].absmax + (size_t)(u32)lr[i] * (u32)(cols >> 6) + ((u32)c >> 1); };
    auto load_iter = [&](int t, RowChunks<1> (&b)[R]) {
        const int c = t * 32 + lane;
        if (whole) {
            if (t < t_end) {
#pragma unroll
                for (int i = 0; i < R; i++) {
                    b[i].q[0] = load_weights16(words_at(i, c));
                    b[i].s[0] = load_scale(scale_at(i, c));
                }
            }
            return;
        }
        const bool in_k = t < t_end && c < n_chunks;
#pragma unroll
        for (int i = 0; i < R; i++) {
            const bool in = in_k && r0 + i < rows;
            b[i].q[0] = in ? load_weights16(words_at(i, c)) : make_uint4(0u, 0u, 0u, 0u);
            b[i].s[0] = in ? load_scale(scale_at(i, c)) : (u16)0;
        }
    };
    RowChunks<1> buf[D][R];
    // The first D iterations' weights go out before the wait (weights are constant).
#pragma unroll
    for (int d = 0; d < D; d++) load_iter(t_begin + d, buf[d]);
    pdl_enter<true>();
    if (skip_if && *skip_if) return;
    if (X32)
        stage_x_as16<WARPS * 32>(reinterpret_cast<const float*>(x), cols, norm, x_staged);
    else
        stage_x16<WARPS * 32>(reinterpret_cast<const u16*>(x), cols, x_staged);
    __syncthreads();
    float acc[R];
#pragma unroll
    for (int i = 0; i < R; i++) acc[i] = 0.0f;
    for (int t = t_begin; t < t_end; t += D) {
#pragma unroll
        for (int d = 0; d < D; d++) {
            const int tt = t + d;
            if (tt < t_end) {  // the same for the whole warp
                XHalves<1> xh;
                // Past K (where K is not a multiple of 32 chunks) a lane reads x's last chunk,
                // which its zero scales multiply by 0, where zeros in its place took six register
                // clears and a predicate an iteration (the 32B shape's q/k/v and o loops -13 and
                // -11 SASS instructions). With the static table ptxas doubles that loop's LOP3s
                // under the clamp (1,002 -> 1,155), so that walk keeps the zeros.
                read_x16_chunk<X16_STAGE_STRIDE, PRMT>(x_staged, tt * 32 + lane, n_chunks, xh.h[0]);
#pragma unroll
                for (int i = 0; i < R; i++) acc[i] = dot_row_pair16<1, PRMT, FIXED>(buf[d][i], xh, pair16_lut, lane4, acc[i]);
                load_iter(tt + D, buf[d]);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < R; i++) {
        const float v = warp_sum(acc[i]);
        if (lane == 0) part_sums[warp * R + i] = v;
    }
    __syncthreads();
    // Thread i of the first block_rows: row r0 of its row lane + its index, the parts added in
    // order.
    float ss = 0.0f;
    if ((int)threadIdx.x < block_rows) {
        const int rl = threadIdx.x / R, i = threadIdx.x % R;
        const int r = blockIdx.x * block_rows + threadIdx.x;
        if (r < rows) {
            float total = 0.0f;
            for (int p = 0; p < kparts; p++) total += part_sums[((rl << kshift) + p) * R + i];
            ss = sq(rows_of.store(r, &total));
        }
    }
    if (float* out = rows_of.ss_out()) block_sum_to(ss, out + blockIdx.x);
    timeline_end();
}
// The K walk of one matrix (y = W x stored or added, with its sums of squares), 5 rows a row
// lane, 2 iterations in flight; the rest of gemv2_kwalk's arguments (X32, WARPS, TABLE) after
// them. One signature for all, as the host launches them alike (src/cuda/ops/gemv.rs).
#define GEMV2_KWALK_KERNEL(NAME, ...)                                                                           \
    extern "C" __global__ void __maxnreg__(GEMV2_MAX_REGS)                                                    \
        NAME(Nf4Ref m, const float* __restrict__ x, NormArgs norm, float* y, const float* __restrict__ bias,  \
             int rows, int cols, int kparts, int accumulate, const int* skip_if, float* ss_out) {             \
        PlainRows p{m, y, bias, accumulate, ss_out};                                                          \
        gemv2_kwalk<5, 2, __VA_ARGS__>(p, rows, cols, x, norm, kparts, skip_if);                              \
    }
// 2 K parts x 5 rows a row lane: 20 rows a CTA (the 32B shape's 5,120 rows: 256 CTAs; the
// host's GEMV2_KWALK_ROWS and GEMV2_KWALK_KPARTS), 2 iterations in flight, no spills.
GEMV2_KWALK_KERNEL(gemv2_kwalk_x16, false)
// The same over 16 warps, one CTA an SM (40 rows: the 32B shape's down in 128 CTAs), with
// lm_head's PRMT-addressed table at window offset KWALK_TABLE_AT: one PRMT and the load a
// lookup, where a shift and a LOP3 make the address (the loop 938 -> 780 instructions). The
// table (64 KB) past x16 (69 KB at K = 27,648) leaves room for one CTA an SM, hence the 16
// warps; a device with less than 192 KiB a CTA (the host's KWALK_TABLE_AT + GEMV2_PRMT_TABLE)
// runs the 8-warp kernel above. +2.4/+3.5/+5.3% decode at the 32B shape at 48/2k/8k over the
// SwiGLU table below (docs/lab.md, session 36).
GEMV2_KWALK_KERNEL(gemv2_kwalk_x16_w16, false, 16, KwalkTable::Fixed)
// The same from f32 x, for the matrices no wider than tall (the 32B shape's o: 5,120 rows, K =
// 5,120, 256 CTAs), where the J = 3 walk holds 48 bytes a lane in flight in 7 serial steps of 4
// rows a CTA. x is staged as f16, each value rounded once (as GEMV v3 stages it). With q/k/v
// below: +1.2-1.4% decode at the 32B shape from 48 to 8k; at the 3B shape's o and q/k/v in place
// of GEMV v3 (80 and 103 CTAs), -1.5..-5.3%: docs/lab.md, session 35. Both read the
// PRMT-addressed table before x (77 KB a CTA at K = 5,120, two an SM), one PRMT a lookup where
// a shift and a LOP3 made the address (the loops -16% and -15%): +0.7..+1.2% decode at the 32B
// shape from 48 to 8k (docs/lab.md, session 40).
GEMV2_KWALK_KERNEL(gemv2_kwalk_f32, true, GEMV_WARPS, KwalkTable::BeforeX)
// q/k/v walking K (the 32B shape's 7,168 rows, K = 5,120), 4 rows a warp over the whole K: 32
// rows a CTA (the host's GEMV2_KWALK_QKV_ROWS), 224 CTAs.
extern "C" __global__ void __maxnreg__(GEMV2_MAX_REGS)
    gemv2_kwalk_qkv(QkvArgs a, const float* __restrict__ x, NormArgs norm, float* out, int cols, int kparts) {
    QkvRows q{a, out};
    gemv2_kwalk<4, 2, true, GEMV_WARPS, KwalkTable::BeforeX>(q, a.rows[0] + a.rows[1] + a.rows[2], cols, x, norm,
                                                             kparts, nullptr);
}
// SwiGLU at K = 5,120 (the 32B shape's gate and up; the host's SWIGLU_W20_K): 160
// chunks, 5 x 32, so 1 chunk a lane over 5 warps a row, 2 rows in flight a warp. Why: over 4
// warps at 2 chunks a lane, 3 of a row's 8 chunk slots lie past K, and the walk is issue-bound
// (ncu at that shape: 0.78 issued per scheduler, compute 74%): 63.5 -> 44.8 us a launch, +12.4%
// decode at depth 48 over 10-warp CTAs, two an SM (docs/lab.md, session 31).
// The table is lm_head's PRMT-addressed one (64 KB of dynamic shared memory before x): one PRMT
// a lookup where a shift and a LOP3 make the address (the loop 870 -> 807 instructions), +2.3-3.1%
// decode at the 32B shape from 48 to 8k against the table in static shared memory (docs/lab.md,
// session 36). What runs before SwiGLU (o) never has a SwiGLU CTA beside it: the footprint that
// lost at the 3B shape (session 15) costs no start here.
// 20 warps a CTA, one CTA an SM (4 rows a step of the CTA's walk): the SM holds one table where
// two 10-warp CTAs held two, and the 64 KB freed goes to L1: +0.8-1.1% decode at the 32B shape
// at 48 (the same decode against itself: +0.4%), +0.3% at 2k, +-0.1% at 8k (docs/lab.md,
// session 40). The register bound is the 20 warps' (96: the allocation granularity of 8 below
// 65,536 / 640).
#define GEMV2_W20_MAX_REGS 96
struct SwigluRowsPrmt : SwigluRows {
    static constexpr bool prmt_table = true;
};
// K, the K split and the warps are the constants the host launches this kernel with
// (SWIGLU_W20_K, SWIGLU_W20_KPARTS, SWIGLU_W20_WARPS), so the walk's row addresses fold into immediates and its warps' roles (a
// division by 5) into constants: sm_90's late iteration ~372 -> ~344 instructions, +0.8-1.0%
// decode at the 32B shape from 48 to 8k (docs/lab.md, session 39).
extern "C" __global__ void __maxnreg__(GEMV2_W20_MAX_REGS)
    gemv2_swiglu_j1_w20(Nf4Ref gate, Nf4Ref up, const float* __restrict__ x, NormArgs norm, float* out, int rows,
                        int out_f16, int early_ctas, int early_rows) {
    SwigluRowsPrmt g{{gate, up, out, out_f16 != 0}};
    gemv2_walk<1, 2, 2, false, SWIGLU_W20_WARPS>(g, rows, SWIGLU_W20_K, x, norm, SWIGLU_W20_KPARTS, nullptr,
                                                 early_ctas, early_rows);
}
// Down at K = DOWN_W27_K (the 32B shape's 27,648: 864 chunks) walking rows as SwiGLU does: one
// chunk a lane over all 27 warps of the CTA, 4 rows a warp a step, so a CTA reads 4 whole
// rows (13.8 KB each, contiguous) a step where the K walk above reads 80 pieces of 512 bytes
// 13.8 KB apart; x from global memory straight into registers (no staging, nothing of x in
// shared memory), the PRMT table alone in dynamic shared memory; one CTA an SM (864 threads
// at 72 registers, no spills). +1.05/+2.25% decode at the 32B shape at 48 (the two load
// orders), +1.58/+1.20% at 8k, against the 16-warp K walk; 2 rows a step lost (-0.3% at
// 48): docs/lab.md, session 49. At 72 registers ptxas holds one step's rows in flight, not
// two (its SASS, the same session). DV2_DOWN_W27=0: the K walk.
struct PlainRowsPrmt : PlainRows {
    static constexpr bool prmt_table = true;
};
// The walk's running pointers (its `stepped` loads) take every lane's chunk to lie within K.
static_assert(DOWN_W27_K / 32 == DOWN_W27_WARPS * 32, "one chunk a lane covers K exactly");
extern "C" __global__ void __launch_bounds__(DOWN_W27_WARPS * 32, 1)
    gemv2_down_j1_w27(Nf4Ref m, const float* __restrict__ x, NormArgs norm, float* y, int rows, int accumulate,
                      const int* skip_if, float* ss_out) {
    PlainRowsPrmt p{{m, y, nullptr, accumulate, ss_out}};
    gemv2_walk<1, 4, 1, true, DOWN_W27_WARPS, true>(p, rows, DOWN_W27_K, x, norm, DOWN_W27_WARPS, skip_if);
}
#if GEMV2_LOGITS
// lm_head and its argmax at K = SWIGLU_W20_K (the 32B shape's 152,064 x 5,120) over SwiGLU's
// 20-warp CTA, one an SM, 4 rows in flight a warp (SwiGLU's 2 rows x gate and up), the table
// before x. Why: J = 3 over 2 warps a row holds 1 row in flight a warp; lm_head took 152 us a
// step in the graph against 92 for its bytes (61%), where SwiGLU's walk at the same K reaches
// 90%. Here 112 us alone under ncu and in the graph (docs/lab.md, session 46).
static_assert(SWIGLU_W20_K / 32 == SWIGLU_W20_KPARTS * 32, "one chunk a lane covers K exactly");
extern "C" __global__ void __maxnreg__(GEMV2_W20_MAX_REGS)
    gemv2_logits_j1_w20(Nf4Ref m, const float* __restrict__ x, NormArgs norm, float* y, int rows,
                        const int* skip_if, int* state, int* scratch, int eos, int* ring, int* hist) {
    LogitRows p{m, y, state, scratch, eos, ring, hist, NEG_INF, -1};
    gemv2_walk<1, 4, 1, false, SWIGLU_W20_WARPS>(p, rows, SWIGLU_W20_K, x, norm, SWIGLU_W20_KPARTS, skip_if);
}
#endif
