// GEMV v3: the decode step's smaller NF4 matrix-vector products (below GEMV3_MAX_BYTES on the
// host: q/k/v and o on the Qwen2.5-3B shape) on tensor cores. Compiled after gemm.cu, whose
// GemmArgs, epilogue kinds, stacked rows and mma_16816 it uses.
//
// Why: GEMV v2 spends ~4 instructions per weight (nibble extract, codebook load, FMA) and
// is issue-bound at ~50% of the bandwidth floor (docs/lab.md). Here a warp runs
// mma.sync m16n8k16 with x replicated in all eight columns, so one MMA does 256
// multiply-adds, and the dequantization is one shared-memory load per two weights: the
// byte -> f16 pair table of common.cuh (load_byte_codebook).
//
// Fragment layout as in the prefill GEMM: thread (g = lane/4, t = lane%4) holds bytes
// 8t..8t+7 of each 64-element block of rows g and g+8 of a 16-row tile; in k-step s its A
// pairs are bytes 2s and 2s+1, its B pairs x[16t+4s .. 16t+4s+3] (f16 words 8t+2s, 8t+2s+1
// of the block). The four k-steps of a block sum into a fresh accumulator that the block's
// absmax then scales in f32, so no scale touches an f16 value and every column of C holds
// the same row sums.
//
// A row group is T 16-row tiles (SwiGLU: T = 2, the gate and up rows of 16 outputs). A
// persistent CTA takes every gridDim.x-th group; its GEMV3_WARPS warps split K, and their
// sums meet in shared memory for the epilogue. x is staged once per CTA as f16 pairs
// (dynamic shared memory, K/2 words), the table once per CTA too.
#define GEMV3_THREADS (GEMV3_WARPS * 32)
// x's quads per thread per round of loads when staging: K up to 4,096 in one round at 256
// threads. Fewer than X_BATCH = 8 because every warp runs this code once: its size is fetched
// cold (docs/lab.md, session 13).
#define GEMV3_X_BATCH 4

// One block of one tile for this thread: 8 bytes of rows g and g+8, and their absmax.
struct Gemv3Block {
    uint2 w[2];
    u16 s[2];  // f16 bits, converted where used
};

template <int T, int S>
struct Gemv3Stage {
    Gemv3Block b[S][T];
};

// Output row r as a row of the stacked matrices: the accumulate epilogue (o) always has one
// matrix (the host checks), so its kernel carries no code to pick among three (code each warp runs once, whose fetch is the cost:
// docs/lab.md, session 13). Past the last row, row 0 (as stacked_row gives): the walk loads
// every row of its last group, stored or not, and a row past the matrix read past its codes
// and scales (memcheck on cuda_gemv's 200-row matrices, docs/lab.md session 80).
template <int EPI>
__device__ __forceinline__ StackedRow gemv3_stacked(const GemmArgs& a, int r) {
    if (EPI == EPI_ACCUMULATE) {
        const bool valid = r < a.rows[0];
        return StackedRow{0, valid ? r : 0, valid};
    }
    return stacked_row(a, r);
}
template <int EPI>
__device__ __forceinline__ Nf4Ref gemv3_pick(const GemmArgs& a, int matrix) {
    return EPI == EPI_ACCUMULATE ? a.m[0] : pick(a, matrix);
}
template <int EPI>
__device__ __forceinline__ const float* gemv3_bias(const GemmArgs& a, int matrix) {
    return EPI == EPI_ACCUMULATE ? a.bias[0] : pick_bias(a, matrix);
}

// EPI_ROPE: row group `group` is 8 dims of a head's first half and the 8 they rotate with
// (rope_half rows on), so that one thread's epilogue holds both of a pair. The head and the
// dim of the group's pair j8 (of 8).
struct RopeGroupPair {
    int head, j;
};
__device__ __forceinline__ RopeGroupPair rope_group_pair(int group, int j8, int rope_half) {
    const int per_head = rope_half >> 3, head = group / per_head;
    return {head, 8 * (group - head * per_head) + j8};
}

// Row h (0: g, 1: g + 8) of tile i of row group `group`, as a stacked-matrix row (EPI_ROPE:
// the first or second of pair g, rope_group_pair).
template <int T, int EPI>
__device__ __forceinline__ StackedRow gemv3_row(const GemmArgs& a, int group, int i, int h, int g, int rope_half = 0) {
    if (EPI == EPI_SWIGLU) return swiglu_row(a, group * 16 + g + 8 * h, i);
    if (EPI == EPI_ROPE) {
        const RopeGroupPair p = rope_group_pair(group, g, rope_half);
        return stacked_row(a, 2 * rope_half * p.head + p.j + h * rope_half);
    }
    return gemv3_stacked<EPI>(a, (group * T + i) * 16 + g + 8 * h);
}

// Issues the loads of blocks kb .. kb+S-1 (those below kb1) of a row group's tiles.
template <int T, int S, int EPI>
__device__ __forceinline__ void gemv3_load(const GemmArgs& a, int group, int kb, int kb1, int g, int t,
                                           Gemv3Stage<T, S>& st, int rope_half = 0) {
#pragma unroll
    for (int i = 0; i < T; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const StackedRow r = gemv3_row<T, EPI>(a, group, i, h, g, rope_half);
            const Nf4Ref m = gemv3_pick<EPI>(a, r.matrix);
            const u8* wrow = m.packed + (size_t)r.local * (a.k >> 1) + 8 * t;
            const u16* srow = m.absmax + (size_t)r.local * (a.k >> 6);
#pragma unroll
            for (int j = 0; j < S; j++) {
                const bool in = kb + j < kb1;
                st.b[j][i].w[h] = in ? __ldg(reinterpret_cast<const uint2*>(wrow + (kb + j) * 32)) : make_uint2(0u, 0u);
                st.b[j][i].s[h] = in ? __ldg(srow + kb + j) : (u16)0;
            }
        }
}

// One 64-element block of one tile: its four k-steps' MMAs into `c`, the A pairs dequantized
// by the byte table, B the block's x words `bw` (every column alike, or a column a thread's g).
__device__ __forceinline__ void gemv3_block_mma(const u32* lut, const Gemv3Block& blk, const u32 (&bw)[8], u32 lane4,
                                                float (&c)[4]) {
#pragma unroll
    for (int s = 0; s < 4; s++) {
        const int k = (s & 1) * 2;
        u32 af[4];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const u32 word = s < 2 ? blk.w[h].x : blk.w[h].y;
            af[h] = byte_lut_entry(lut, word, k, lane4);
            af[2 + h] = byte_lut_entry(lut, word, k + 1, lane4);
        }
        mma_16816(c, af, bw[2 * s], bw[2 * s + 1]);
    }
}

// What a GEMV v3 kernel's code holds for its input and output (IO): GEMV3_IO_ANY, both
// chosen at run time (a.norm.w, a.ss_out); else the bits GEMV3_IO_NORM (x normed on load)
// and GEMV3_IO_SUMS (partial sums of squares left for the next norm), and nothing for what
// is not set. The decode step's calls each use one pattern (q/k/v norm, o sums), and code a
// warp runs once or skips costs its fetch (docs/lab.md, sessions 13-14).
#define GEMV3_IO_ANY -1
#define GEMV3_IO_NORM 1
#define GEMV3_IO_SUMS 2

// Persistent: CTA b takes row groups b, b + gridDim.x, ...; each warp walks its K range of
// every group S blocks at a time, the loads of the next S blocks (of this group or the next)
// in flight during the math.
// KH = 2 (q/k/v's kernel gemv3_store_lean_kh2, DV2_QKV_KHALVES, default): each row group is two CTAs,
// CTA b taking K half b % 2 of group b / 2 (a grid of 2 x groups), its warps splitting that
// half; half 0 stores its sums plus the bias at y, half 1 its sums at y + ldy, and the
// consumer (attention, rotate_live_batched) adds the two in that order, so the result does not
// depend on which CTA ends first. Why: q/k/v's 160 row groups on 132 SMs put two CTAs on 28
// SMs, whose CTAs ended ~0.7 us after the others (docs/lab.md, session 19): in halves an SM
// holds 1 to 3 of the 320 (3 on most), 1.5 groups' work at most instead of 2. Measured:
// -0.007..-0.014 ms/token (session 19, runs 5-10).
template <int T, int S, int EPI, int IO, int KH = 1>
__device__ __forceinline__ void gemv3_body(const GemmArgs& a) {
    static_assert(KH == 1 || (KH == 2 && EPI == EPI_STORE), "K halves: the store epilogue only");
    __shared__ __align__(16) u32 lut[BYTE_LUT_WORDS];
    __shared__ float red[2][GEMV3_WARPS][T * 16];  // by group parity: one barrier per group
    extern __shared__ u32 x16[];                   // K/2 f16 pairs
    const int outputs = EPI == EPI_SWIGLU ? a.rows[0] : a.rows[0] + a.rows[1] + a.rows[2];
    const int groups = (outputs + 16 * (EPI == EPI_SWIGLU ? 1 : T) - 1) / (16 * (EPI == EPI_SWIGLU ? 1 : T));
    timeline_start();
    load_byte_codebook<GEMV3_THREADS>(lut);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 lane4 = 4 * lane;
    const int kh = KH == 1 ? 0 : blockIdx.x & 1, kblocks = (a.k >> 6) / KH, kfirst = kh * kblocks;
    const int kb0 = kfirst + warp * kblocks / GEMV3_WARPS, kb1 = kfirst + (warp + 1) * kblocks / GEMV3_WARPS;
    const int group0 = KH == 1 ? blockIdx.x : blockIdx.x >> 1, group_step = KH == 1 ? gridDim.x : gridDim.x >> 1;
    const int stages = (kb1 - kb0 + S - 1) / S;
    // The first stage's weights go out before the wait on the previous kernel (weights are
    // constant), so a CTA resident early (after the attention's, whose CTAs leave room)
    // fetches them while that kernel runs, and before x is staged, so their fetch overlaps
    // the round trips for the norm's partial sums and x (docs/lab.md, sessions 10 and 13).
    Gemv3Stage<T, S> cur, nxt;
    const bool first_ok = stages > 0 && group0 < groups;
    if (first_ok) gemv3_load<T, S, EPI>(a, group0, kb0, kb1, g, t, cur);
    pdl_enter<true>();
    if (a.skip_if && *a.skip_if) return;
    // x (normed) staged as f16 pairs.
    NormArgs norm = a.norm;
    if (IO != GEMV3_IO_ANY && !(IO & GEMV3_IO_NORM)) norm.w = nullptr;
    auto stage = [&](int i, float4 v, uint2 w, float r) {
        if (norm.w) {
            v.x *= r * bf16_to_f32((u16)(w.x & 0xffffu));
            v.y *= r * bf16_to_f32((u16)(w.x >> 16));
            v.z *= r * bf16_to_f32((u16)(w.y & 0xffffu));
            v.w *= r * bf16_to_f32((u16)(w.y >> 16));
        }
        x16[2 * i] = pack_f16x2(v.x, v.y);
        x16[2 * i + 1] = pack_f16x2(v.z, v.w);
    };
    if (KH == 1) for_each_x_quad<GEMV3_THREADS, GEMV3_X_BATCH>(a.x, a.k, norm, stage);
    else for_each_x_quad<GEMV3_THREADS, GEMV3_X_BATCH>(a.x, a.k, norm, stage, kh * (a.k >> 2) / KH, (kh + 1) * (a.k >> 2) / KH);
    __syncthreads();
    int parity = 0;
    float ss = 0.0f;  // squares of the values this thread stored (warp 0 stores)
    for (int group = group0; group < groups; group += group_step, parity ^= 1) {
        float acc[T][2] = {};
        // The epilogue's operands for this group's rows (a thread per row: the bias, the
        // residual's old y) loaded as the group starts, so their round trip overlaps the group's math instead of following its reduction.
        float e_bias = 0.0f, e_old = 0.0f;
        if (EPI != EPI_SWIGLU && threadIdx.x < T * 16) {
            const int row = (group * T + threadIdx.x / 16) * 16 + threadIdx.x % 16;
            const StackedRow r = gemv3_stacked<EPI>(a, row);
            if (r.valid) {
                const float* bias = kh == 0 ? gemv3_bias<EPI>(a, r.matrix) : nullptr;
                if (bias) e_bias = bias[r.local];
                if (EPI == EPI_ACCUMULATE) e_old = a.y[row];
            }
        }
        for (int st = 0; st < stages; st++) {
            const int kb = kb0 + st * S;
            const bool last = st + 1 == stages;
            const int next_group = last ? group + group_step : group;
            if (next_group < groups)
                gemv3_load<T, S, EPI>(a, next_group, last ? kb0 : kb + S, kb1, g, t, nxt);
#pragma unroll
            for (int j = 0; j < S; j++) {
                if (kb + j >= kb1) break;
                const uint4* xb = reinterpret_cast<const uint4*>(x16 + (kb + j) * 32 + 8 * t);
                const uint4 x0 = xb[0], x1 = xb[1];
                const u32 bw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
                for (int i = 0; i < T; i++) {
                    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    const Gemv3Block& blk = cur.b[j][i];
                    gemv3_block_mma(lut, blk, bw, lane4, c);
                    acc[i][0] = fmaf(c[0], scale_f32(blk.s[0]), acc[i][0]);
                    acc[i][1] = fmaf(c[2], scale_f32(blk.s[1]), acc[i][1]);
                }
            }
            cur = nxt;
        }

        // Every column holds the same sums: lanes t = 0 hand rows g and g + 8 of each tile over.
        if (t == 0) {
#pragma unroll
            for (int i = 0; i < T; i++) {
                red[parity][warp][i * 16 + g] = acc[i][0];
                red[parity][warp][i * 16 + g + 8] = acc[i][1];
            }
        }
        __syncthreads();
        if (threadIdx.x < T * 16) {
            const int i = threadIdx.x / 16, rr = threadIdx.x % 16;
            float sum = 0.0f;
#pragma unroll
            for (int w = 0; w < GEMV3_WARPS; w++) sum += red[parity][w][threadIdx.x];
            if (EPI == EPI_SWIGLU) {
                if (i == 0) {
                    float up = 0.0f;
#pragma unroll
                    for (int w = 0; w < GEMV3_WARPS; w++) up += red[parity][w][16 + rr];
                    const int r = group * 16 + rr;
                    if (r < a.rows[0]) a.y[r] = sum / (1.0f + expf(-sum)) * up;
                }
            } else {
                const int row = (group * T + i) * 16 + rr;
                const StackedRow r = gemv3_stacked<EPI>(a, row);
                if (r.valid) {
                    const float v = sum + e_bias;
                    const float out = EPI == EPI_ACCUMULATE ? e_old + v : v;
                    a.y[row + kh * a.ldy] = out;
                    ss += sq(out);
                }
            }
        }
    }
    const bool sums = IO == GEMV3_IO_ANY ? a.ss_out != nullptr : (IO & GEMV3_IO_SUMS) != 0;
    if (sums) block_sum_to(ss, a.ss_out + blockIdx.x);
    timeline_end();
}

// T = 1 tile for the plain epilogues, S = 4 blocks per load; SwiGLU: 2 tiles, 2 blocks.
// Each for any input and output (DV2_FUSE_RMS=0 takes these), and (suffix _lean) in less
// code for the decode step's use of it: q/k/v and SwiGLU norm their x and leave no sums, o
// leaves sums of a raw x.
#define GEMV3_KERNEL(NAME, T, S, EPI, IO)                                                                      \
    extern "C" __global__ void __launch_bounds__(GEMV3_THREADS, GEMV3_CTAS_PER_SM) NAME(GemmArgs a) {                          \
        gemv3_body<T, S, EPI, IO>(a);                                                                          \
    }
GEMV3_KERNEL(gemv3_store, 1, 4, EPI_STORE, GEMV3_IO_ANY)
GEMV3_KERNEL(gemv3_acc, 1, 4, EPI_ACCUMULATE, GEMV3_IO_ANY)
GEMV3_KERNEL(gemv3_swiglu, 2, 2, EPI_SWIGLU, GEMV3_IO_ANY)
GEMV3_KERNEL(gemv3_store_lean, 1, 4, EPI_STORE, GEMV3_IO_NORM)
GEMV3_KERNEL(gemv3_acc_lean, 1, 4, EPI_ACCUMULATE, GEMV3_IO_SUMS)
GEMV3_KERNEL(gemv3_swiglu_lean, 2, 2, EPI_SWIGLU, GEMV3_IO_NORM)
#if GEMV3_KHALVES
// q/k/v in K halves (KH = 2 above): two blocks a warp at K = 2048, three CTAs an SM (at 64
// registers, four, two of which fit beside one of down's CTAs: +0.033 ms/token, session 19).
extern "C" __global__ void __launch_bounds__(GEMV3_THREADS, GEMV3_KH2_CTAS_PER_SM) gemv3_store_lean_kh2(GemmArgs a) {
    gemv3_body<1, 2, EPI_STORE, GEMV3_IO_NORM, 2>(a);
}
#endif

// EPI_ROPE's operands (DV2_QKV_ROPE): what rope_kv_rows takes.
struct RopeArgs {
    u16* k_cache;
    u16* v_cache;
    const float* cos;
    const float* sin;
    const int* state;
    int n_q, n_kv, head_dim;
    int col0;  // the launch's first column of the chunk
};
static_assert(sizeof(RopeArgs) == SIZEOF_ROPEARGS, "RopeArgs differs from the host's (src/cuda/ops)");

// EPI_ROPE's store of one pair (dims j and j + head_dim/2 of a head, j8 of the group's 8) at
// chunk column col: the bias, then RoPE on q and k heads as rope_kv_rows computes it, the
// pair into y, and k's and v's into the cache at the column's position. Replaces
// rope_kv_rows after a short chunk's q/k/v, one launch a layer fewer.
__device__ __forceinline__ void gemv3_rope_store(const GemmArgs& a, const RopeArgs& r, int group, int j8, int col,
                                                 float lo, float hi) {
    const int half = r.head_dim >> 1;
    const RopeGroupPair p = rope_group_pair(group, j8, half);
    const int head = p.head, j = p.j, row = head * r.head_dim + j;
    const StackedRow s0 = stacked_row(a, row), s1 = stacked_row(a, row + half);
    if (!s0.valid) return;
    const float* bias = gemv3_bias<EPI_ROPE>(a, s0.matrix);
    if (bias) lo += bias[s0.local], hi += bias[s1.local];
    const int pos = r.state[STATE_POSITION] + r.col0 + col, rotated = r.n_q + r.n_kv;
    if (head < rotated) {
        const float c = r.cos[(size_t)pos * half + j], s = r.sin[(size_t)pos * half + j];
        const float2 rotated_pair = rope_pair(lo, hi, c, s);
        lo = rotated_pair.x;
        hi = rotated_pair.y;
    }
    float* out = a.y + (size_t)col * a.ldy;
    out[row] = lo;
    out[row + half] = hi;
    if (head >= r.n_q) {
        u16* cache = head < rotated ? r.k_cache : r.v_cache;
        const int kv_head = head - (head < rotated ? r.n_q : rotated);
        const size_t at = (size_t)pos * r.n_kv * r.head_dim + (size_t)kv_head * r.head_dim + j;
        cache[at] = f32_to_bf16(lo);
        cache[at + half] = f32_to_bf16(hi);
    }
}

// GEMV v3 over up to eight columns: a prefill chunk of at most GEMV3_COLS ids (a chat turn's
// few new ids, a speculative draft's check) on the decode's tensor-core walk instead of the
// GEMM, whose tiles and K splits are sized for many columns. Column c of x (f16, [n][k], the
// prefill's producers write it so) goes to B's column c, so one MMA serves every column where
// the decode kernel above replicates one; columns from n to 7 repeat column 0 and are not
// stored. Thread (g, t) then holds rows g and g + 8 of columns 2t and 2t + 1. y is [n][ldy],
// f32 (SwiGLU: f16, down's input). No norm on load, no sums out: the prefill norms its rows
// before (rms_rows).
// X_L2 (where each group has a CTA of its own; DV2_COLS_X_L2=0 stages it): x is not staged;
// each thread reads its column's octets of the next S blocks from global memory (L2: every CTA
// reads the same x) right after the next stage's weights, so both are in flight during this
// stage's math. Why: down's x at 8 columns fills 176 KiB of a CTA, so an SM holds one CTA of
// 8 warps, which staged all of x (twice its rows' bytes of weights) before it streamed its
// rows: down's column walk ran at 29% of the bandwidth in a check (docs/lab.md, sessions
// 73-74).
// In a cluster of 2 (X_L2 only, where the groups alone would fill under half the CTA slots;
// DV2_COLS_SPLIT=0: never), a group's K is split across the cluster's CTAs (16 warps where one
// CTA has 8), so that down's 128 groups fill two CTAs an SM, each with its loads in flight;
// rank 1 stores its sums in rank 0's shared memory, which adds them after its own (a fixed
// order: the same sums every run), both having started (the barrier at the start). Down 13.6
// -> 8.8 us a launch in a check of 7 ids (H200, docs/lab.md session 75); at any x size, a
// check of 1 id 8% sooner (session 76).
template <int T, int S, int EPI, bool X_L2 = false>
__device__ __forceinline__ void gemv3_cols_body(const GemmArgs& a, const RopeArgs& rope) {
    __shared__ __align__(16) u32 lut[BYTE_LUT_WORDS];
    __shared__ float rope_sums[EPI == EPI_ROPE ? 16 : 1][GEMV3_COLS];  // a group's final sums
    __shared__ float red[GEMV3_WARPS][T * 16][GEMV3_COLS + 1];  // +1: rows 8 floats apart meet fewer banks
    __shared__ float peer[X_L2 ? T * 16 : 1][GEMV3_COLS];     // rank 1's sums, in rank 0
    extern __shared__ uint4 xs[];                              // [n][k / 8] f16 octets
    const int outputs = EPI == EPI_SWIGLU ? a.rows[0] : a.rows[0] + a.rows[1] + a.rows[2];
    const int groups = (outputs + 16 * (EPI == EPI_SWIGLU ? 1 : T) - 1) / (16 * (EPI == EPI_SWIGLU ? 1 : T));
    load_byte_codebook<GEMV3_THREADS>(lut);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 lane4 = 4 * lane;
    const int kblocks = a.k >> 6;
    // A cluster's CTAs share each group: rank r takes K's slices r * GEMV3_WARPS + warp.
    const int ctas = X_L2 ? cluster_size() : 1, rank = X_L2 ? cluster_rank() : 0;
    const int slice = rank * GEMV3_WARPS + warp, slices = ctas * GEMV3_WARPS;
    const int kb0 = slice * kblocks / slices, kb1 = (slice + 1) * kblocks / slices;
    const int stages = (kb1 - kb0 + S - 1) / S;
    const int first_group = blockIdx.x / ctas, group_step = gridDim.x / ctas;
    const int rope_half = EPI == EPI_ROPE ? rope.head_dim >> 1 : 0;
    Gemv3Stage<T, S> cur, nxt;
    if (stages > 0 && first_group < groups) gemv3_load<T, S, EPI>(a, first_group, kb0, kb1, g, t, cur, rope_half);
    pdl_enter();
    if (a.skip_if && *a.skip_if) return;
    // Rank 1 writes rank 0's shared memory only once both have started: this arrival, and the
    // wait before the first group's exchange (a CTA may start later than its cluster peer;
    // without it racecheck found the write landing in a CTA not yet entered, session 76).
    if (ctas > 1 && first_group < groups) cluster_arrive_relaxed();
    if (!X_L2) {
        const int octets = a.n * (a.k >> 3);
        for (int i = threadIdx.x; i < octets; i += GEMV3_THREADS) xs[i] = reinterpret_cast<const uint4*>(a.x)[i];
    }
    __syncthreads();  // the table, and x where staged, written before any warp reads them
    // This thread's B column: its own, or column 0 where the chunk has fewer.
    const uint4* xcol = (X_L2 ? reinterpret_cast<const uint4*>(a.x) : xs) + (g < a.n ? g : 0) * (a.k >> 3);
    // X_L2: this thread's octets of blocks kb .. kb + S - 1 (those below kb1), by stage.
    uint4 xcur[X_L2 ? S : 1][2], xnxt[X_L2 ? S : 1][2];
    auto load_x = [&](int kb, uint4 (*dst)[2]) {
#pragma unroll
        for (int j = 0; j < S; j++)
            if (kb + j < kb1) {
                dst[j][0] = __ldg(xcol + (kb + j) * 8 + 2 * t);
                dst[j][1] = __ldg(xcol + (kb + j) * 8 + 2 * t + 1);
            }
    };
    if (X_L2 && stages > 0) load_x(kb0, xcur);
    for (int group = first_group; group < groups; group += group_step) {
        float acc[T][4] = {};
        for (int st = 0; st < stages; st++) {
            const int kb = kb0 + st * S;
            const bool last = st + 1 == stages;
            const int next_group = last ? group + group_step : group;
            if (next_group < groups) {
                gemv3_load<T, S, EPI>(a, next_group, last ? kb0 : kb + S, kb1, g, t, nxt, rope_half);
                if (X_L2) load_x(last ? kb0 : kb + S, xnxt);
            }
#pragma unroll
            for (int j = 0; j < S; j++) {
                if (kb + j >= kb1) break;
                const uint4 x0 = X_L2 ? xcur[j][0] : xcol[(kb + j) * 8 + 2 * t];
                const uint4 x1 = X_L2 ? xcur[j][1] : xcol[(kb + j) * 8 + 2 * t + 1];
                const u32 bw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
                for (int i = 0; i < T; i++) {
                    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    const Gemv3Block& blk = cur.b[j][i];
                    gemv3_block_mma(lut, blk, bw, lane4, c);
                    const float s0 = scale_f32(blk.s[0]), s1 = scale_f32(blk.s[1]);
                    acc[i][0] = fmaf(c[0], s0, acc[i][0]);
                    acc[i][1] = fmaf(c[1], s0, acc[i][1]);
                    acc[i][2] = fmaf(c[2], s1, acc[i][2]);
                    acc[i][3] = fmaf(c[3], s1, acc[i][3]);
                }
            }
            cur = nxt;
            if (X_L2) {
#pragma unroll
                for (int j = 0; j < S; j++) xcur[j][0] = xnxt[j][0], xcur[j][1] = xnxt[j][1];
            }
        }
#pragma unroll
        for (int i = 0; i < T; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) red[warp][i * 16 + g + 8 * (e >> 1)][2 * t + (e & 1)] = acc[i][e];
        __syncthreads();
        // One thread an (output row, column) of the group: SwiGLU 16 x 8, the others T*16 x 8.
        const int row_in = threadIdx.x / GEMV3_COLS, col = threadIdx.x % GEMV3_COLS;
        const int group_rows = EPI == EPI_SWIGLU ? 16 : T * 16;
        const bool mine = row_in < group_rows && col < a.n;
        float sum = 0.0f, up = 0.0f;
        if (mine) {
#pragma unroll
            for (int w = 0; w < GEMV3_WARPS; w++) sum += red[w][row_in][col];
            if (EPI == EPI_SWIGLU) {
#pragma unroll
                for (int w = 0; w < GEMV3_WARPS; w++) up += red[w][16 + row_in][col];
            }
        }
        if (ctas > 1) {
            if (group == first_group) cluster_wait();
            if (mine && rank == 1) {
                store_in_cta(&peer[row_in][col], 0, sum);
                if (EPI == EPI_SWIGLU) store_in_cta(&peer[16 + row_in][col], 0, up);
            }
            cluster_arrive();
            cluster_wait();
            if (mine && rank == 0) {
                sum += peer[row_in][col];
                if (EPI == EPI_SWIGLU) up += peer[16 + row_in][col];
            }
        }
        if (EPI == EPI_ROPE) {
            // Each pair meets in one thread: rows j8 and j8 + 8 of the group.
            if (mine && rank == 0) rope_sums[row_in][col] = sum;
            __syncthreads();
            if (mine && rank == 0 && row_in < 8)
                gemv3_rope_store(a, rope, group, row_in, col, rope_sums[row_in][col], rope_sums[row_in + 8][col]);
        } else if (mine && rank == 0) {
            if (EPI == EPI_SWIGLU) {
                const int r = group * 16 + row_in;
                if (r < a.rows[0])
                    reinterpret_cast<u16*>(a.y)[(size_t)col * a.ldy + r] = f32_to_f16(sum / (1.0f + expf(-sum)) * up);
            } else {
                const int row = group * T * 16 + row_in;
                const StackedRow r = gemv3_stacked<EPI>(a, row);
                if (r.valid) {
                    float* out = a.y + (size_t)col * a.ldy + row;
                    const float* bias = gemv3_bias<EPI>(a, r.matrix);
                    const float v = sum + (bias ? bias[r.local] : 0.0f);
                    *out = EPI == EPI_ACCUMULATE ? *out + v : v;
                }
            }
        }
        // peer is rewritten by rank 1 for the next group only after rank 0 read it.
        if (ctas > 1) {
            cluster_arrive_relaxed();
            cluster_wait();
        }
        // red is rewritten by the next group's warps only after every thread read it.
        __syncthreads();
    }
}

#define GEMV3_COLS_KERNEL(NAME, T, S, EPI, X_L2)                                                      \
    extern "C" __global__ void __launch_bounds__(GEMV3_THREADS, GEMV3_CTAS_PER_SM) NAME(GemmArgs a) {             \
        gemv3_cols_body<T, S, EPI, X_L2>(a, RopeArgs{});                                              \
    }
#define GEMV3_COLS_ROPE_KERNEL(NAME, S, X_L2)                                                                  \
    extern "C" __global__ void __launch_bounds__(GEMV3_THREADS, GEMV3_CTAS_PER_SM) NAME(GemmArgs a, RopeArgs r) { \
        gemv3_cols_body<1, S, EPI_ROPE, X_L2>(a, r);                                                           \
    }
GEMV3_COLS_KERNEL(gemv3_cols_store, 1, 4, EPI_STORE, false)
GEMV3_COLS_KERNEL(gemv3_cols_acc, 1, 4, EPI_ACCUMULATE, false)
GEMV3_COLS_KERNEL(gemv3_cols_swiglu, 2, 2, EPI_SWIGLU, false)
GEMV3_COLS_ROPE_KERNEL(gemv3_cols_rope, 4, false)
// With x's octets in registers beside the weights', two blocks a stage (four spill).
GEMV3_COLS_KERNEL(gemv3_cols_store_l2, 1, 2, EPI_STORE, true)
GEMV3_COLS_KERNEL(gemv3_cols_acc_l2, 1, 2, EPI_ACCUMULATE, true)
GEMV3_COLS_KERNEL(gemv3_cols_swiglu_l2, 2, 2, EPI_SWIGLU, true)
GEMV3_COLS_ROPE_KERNEL(gemv3_cols_rope_l2, 2, true)
