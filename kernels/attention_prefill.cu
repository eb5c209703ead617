// Causal attention of a prefill chunk over the cache: on tensor cores for head_dim 16, 32, 64
// and 128, on CUDA cores for the others. Uses common.cuh.
#define ATTNP_WARPS (ATTNP_THREADS / 32)

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
    // DV2_PREFILL_SPLIT: gridDim.z splits of the slots, each CTA's rows written
    // unnormalized to part_acc [split][token][q head][head_dim] with (m, l) in part_ml, for
    // attn_prefill_merge (tensor-core kernels only; 1: no split, out written directly).
    int splits;
    float* part_acc;
    float* part_ml;
};
static_assert(sizeof(PrefillAttnArgs) == SIZEOF_PREFILLATTNARGS, "PrefillAttnArgs differs from the host's (src/cuda/ops)");

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

// Staging of the KV tiles: K and V both row-major f16 at a padded stride (HD/2 + 4 words: the
// rows of an 8x8 fragment matrix fall in distinct banks), written with 16-byte stores from
// 16-byte loads that were issued one tile ahead into registers, into two buffers, so each tile
// costs one barrier and its global latency hides behind the previous tile's MMAs; K's and V's
// fragments come out by ldmatrix (V's transposed). (The first version, V transposed by 2-byte
// stores with loads issued and awaited inside the tile's two barriers, measured slower:
// docs/lab.md; removed after a1b9aaa.)
template <int HD>
struct KvStage {
    static constexpr int STRIDE = HD / 2 + 4;               // u32 words per staged row
    static constexpr int CHUNKS = ATTNP_TILE * HD / 8;      // 16-byte chunks of K (and of V)
    static constexpr int PER = (CHUNKS + 32 * ATTNM_WARPS - 1) / (32 * ATTNM_WARPS);
    static constexpr bool EVEN = PER * 32 * ATTNM_WARPS == CHUNKS;  // every thread's every chunk is in
    uint4 k[PER], v[PER];

    // This thread's chunk i: its slot in the tile and its column of 8 dims. Each pass of the
    // CTA's threads covers KEYS_PER_PASS whole slots (32 * ATTNM_WARPS is a multiple of HD / 8).
    static constexpr int KEYS_PER_PASS = 32 * ATTNM_WARPS / (HD / 8);
    __device__ __forceinline__ static int chunk(int i) { return threadIdx.x + i * 32 * ATTNM_WARPS; }
    __device__ __forceinline__ static int key(int i) { return chunk(i) / (HD / 8); }
    __device__ __forceinline__ static int col(int i) { return chunk(i) % (HD / 8); }

    // Loads a tile (bf16) into registers: `k_at` and `v_at` point at this thread's chunk 0 of
    // the tile, `pass_stride` elements from chunk i to i + 1; only the `left` first slots when
    // the tile is not whole (the others read as zeros). Every tile but the last is whole and
    // loads without conditions or address arithmetic beyond the pointers' sums.
    __device__ __forceinline__ void load(const u16* k_at, const u16* v_at, size_t pass_stride, bool whole, int left) {
        if (whole && EVEN) {
#pragma unroll
            for (int i = 0; i < PER; i++) {
                k[i] = *reinterpret_cast<const uint4*>(k_at + i * pass_stride);
                v[i] = *reinterpret_cast<const uint4*>(v_at + i * pass_stride);
            }
            return;
        }
#pragma unroll
        for (int i = 0; i < PER; i++) {
            const bool in = chunk(i) < CHUNKS && key(i) < left;
            k[i] = in ? *reinterpret_cast<const uint4*>(k_at + i * pass_stride) : make_uint4(0, 0, 0, 0);
            v[i] = in ? *reinterpret_cast<const uint4*>(v_at + i * pass_stride) : make_uint4(0, 0, 0, 0);
        }
    }

    // Converts the registers to f16 and stores them, row-major, into k_s / v_s.
    __device__ __forceinline__ void store(u32* k_s, u32* v_s) const {
#pragma unroll
        for (int i = 0; i < PER; i++) {
            if (!EVEN && chunk(i) >= CHUNKS) continue;
            *reinterpret_cast<uint4*>(k_s + key(i) * STRIDE + 4 * col(i)) = to_f16(k[i]);
            *reinterpret_cast<uint4*>(v_s + key(i) * STRIDE + 4 * col(i)) = to_f16(v[i]);
        }
    }

    __device__ __forceinline__ static u32 pair_to_f16(u32 w) {
        return pack_f16x2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
    }
    __device__ __forceinline__ static uint4 to_f16(uint4 w) {
        return make_uint4(pair_to_f16(w.x), pair_to_f16(w.y), pair_to_f16(w.z), pair_to_f16(w.w));
    }
};

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const u32* p) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const u32* p) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// 2^x by the MUFU alone (-inf gives 0): the scores are in the log2 domain (q carries log2 e).
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Per tile and warp the loop below issues its 64 MMAs among few other instructions: scores in
// the log2 domain with ex2 alone and no branch (expf's range reduction and a branch per score
// were ~10 instructions each), the causal mask only on tiles that reach past the warp's first
// row, O rescaled only when a row's maximum moved, K's fragments by ldmatrix, the staging's
// addresses formed once (ncu at 32k, before: ~1,000 instructions per warp and tile, 1.8 IPC,
// docs/lab.md session 26).
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
    // Split blockIdx.z of gridDim.z walks the whole tiles t_begin .. end - 1 of slots 0 .. last
    // (the whole of them without a split); a split past `last` walks none.
    const int split = blockIdx.z, n_tiles = last / ATTNP_TILE + 1;
    const int per = (n_tiles + gridDim.z - 1) / gridDim.z * ATTNP_TILE;
    const int t_begin = split * per, end = min(last + 1, t_begin + per);

    // This thread's chunk 0 of tile t_begin; a tile, and a pass of the staging, further in
    // elements.
    const size_t slot_stride = (size_t)a.n_kv * HD, tile_stride = ATTNP_TILE * slot_stride;
    const size_t pass_stride = Stage::KEYS_PER_PASS * slot_stride;
    const size_t first_chunk =
        (t_begin + Stage::key(0)) * slot_stride + (size_t)kvh * HD + 8 * Stage::col(0);
    const u16 *k_at = a.k_cache + first_chunk, *v_at = a.v_cache + first_chunk;
    Stage next;
    if (t_begin < end) next.load(k_at, v_at, pass_stride, t_begin + ATTNP_TILE <= end, end - t_begin);

    // This thread's two rows (g, g + 8 of the warp's 16): positions; padding rows take the
    // CTA's last position (finite, never stored, and no mask on their account).
    int qpos[2];
    u32 qf[KS][4];
    const float q_scale = a.scale * 1.4426950408889634f;  // log2 e: scores for exp2
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int rr = row0 + warp * 16 + g + 8 * h;
        const bool valid = rr < rows_total;
        qpos[h] = valid ? pos0 + rr / group : last;
        const float* q = a.qkv + (size_t)(valid ? rr / group : 0) * a.ld + (kvh * group + (valid ? rr % group : 0)) * HD;
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            const float2 lo = *reinterpret_cast<const float2*>(q + 16 * ks + 2 * t);
            const float2 hi = *reinterpret_cast<const float2*>(q + 16 * ks + 2 * t + 8);
            const float sc = valid ? q_scale : 0.0f;
            qf[ks][h] = pack_f16x2(lo.x * sc, lo.y * sc);
            qf[ks][2 + h] = pack_f16x2(hi.x * sc, hi.y * sc);
        }
    }
    // The warp's last and first positions: tiles past the last are skipped, tiles wholly at or
    // before the first need no mask.
    int w_last = max(qpos[0], qpos[1]), w_first = min(qpos[0], qpos[1]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        w_last = max(w_last, __shfl_xor_sync(0xffffffffu, w_last, o));
        w_first = min(w_first, __shfl_xor_sync(0xffffffffu, w_first, o));
    }

    float o_acc[DT][4];
#pragma unroll
    for (int d = 0; d < DT; d++)
#pragma unroll
        for (int e = 0; e < 4; e++) o_acc[d][e] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};

    for (int t0 = t_begin; t0 < end; t0 += ATTNP_TILE) {
        // Buffer (tile & 1) was last read two tiles ago, before the previous barrier.
        k_s = kv_s + ((t0 / ATTNP_TILE) & 1) * BUF_WORDS;
        next.store(k_s, k_s + ATTNP_TILE * Stage::STRIDE);
        __syncthreads();
        k_at += tile_stride;
        v_at += tile_stride;
        const int t1 = t0 + ATTNP_TILE;
        if (t1 < end) next.load(k_at, v_at, pass_stride, t1 + ATTNP_TILE <= end, end - t1);
        if (t0 > w_last) continue;  // every row of this warp is before the tile

        // S = Q K^T: 16 rows x 32 slots. Lane l addresses row l % 8 of matrix l / 8: slots
        // 8 nt + l % 8, dims 16 kp + 8 (l / 8); the four matrices are b0, b1 of k-steps 2 kp
        // and 2 kp + 1 (words 16 kp + 4 (l / 8) of the staged row).
        float s[4][4];
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[nt][e] = 0.0f;
#pragma unroll
        for (int kp = 0; kp < KS / 2; kp++) {
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                u32 b[4];
                ldmatrix_x4(b, k_s + (8 * nt + (lane & 7)) * Stage::STRIDE + 16 * kp + 4 * (lane >> 3));
                mma_16816(s[nt], qf[2 * kp], b[0], b[1]);
                mma_16816(s[nt], qf[2 * kp + 1], b[2], b[3]);
            }
        }
        if (KS & 1) {  // head_dim 16: one k-step, its B fragments by 4-byte loads
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                const u32* kr = k_s + (8 * nt + g) * Stage::STRIDE + 8 * (KS - 1) + t;
                mma_16816(s[nt], qf[KS - 1], kr[0], kr[4]);
            }
        }
        // The mask where the tile reaches past the warp's first row; row maxima (the 4 lanes
        // of a quad share a row), online softmax.
        if (t0 + ATTNP_TILE - 1 > w_first) {
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    if (t0 + 8 * nt + 2 * t + (e & 1) > qpos[e >> 1]) s[nt][e] = NEG_INF;
        }
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
        float corr[2], sum[2] = {0.0f, 0.0f}, m_use[2];
        bool moved = false;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            // Finite from a row's first tile with a slot at or before it: slot 0's without a
            // split; a split that begins past the row sees -inf, taken as 0 so that its p and
            // corr are 0, not NaN (the same values wherever m is finite).
            const float m_new = fmaxf(m[h], mx[h]);
            moved |= m_new != m[h];
            m_use[h] = m_new == NEG_INF ? 0.0f : m_new;
            corr[h] = exp2_approx(m[h] - m_use[h]);
            m[h] = m_new;
        }
        u32 pf[2][4];  // P as the A fragments of the two 16-slot k-steps
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            float p[4];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                p[e] = exp2_approx(s[nt][e] - m_use[e >> 1]);
                sum[e >> 1] += p[e];
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
        if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
            for (int d = 0; d < DT; d++) {
                o_acc[d][0] *= corr[0];
                o_acc[d][1] *= corr[0];
                o_acc[d][2] *= corr[1];
                o_acc[d][3] *= corr[1];
            }
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
        const size_t row = (size_t)(rr / group) * a.n_q + kvh * group + rr % group;
        if (gridDim.z > 1) {  // the split's partial, unnormalized, for attn_prefill_merge
            const size_t part = (size_t)split * a.n * a.n_q + row;
#pragma unroll
            for (int d = 0; d < DT; d++)
                store_pair(a.part_acc, part * HD + 8 * d + 2 * t, o_acc[d][2 * h], o_acc[d][2 * h + 1], false);
            if (t == 0) {
                a.part_ml[2 * part] = m[h];
                a.part_ml[2 * part + 1] = l[h];
            }
            continue;
        }
        const float inv = 1.0f / l[h];
#pragma unroll
        for (int d = 0; d < DT; d++)
            store_pair(a.out, row * HD + 8 * d + 2 * t, o_acc[d][2 * h] * inv, o_acc[d][2 * h + 1] * inv, a.out_f16);
    }
}

// The splits of a split prefill attention merged (attn_prefill_mma with gridDim.z = a.splits
// > 1): a CTA per (token, q head) row, ATTNP_MERGE_WAYS threads a pair of dims (blockDim.y),
// thread y taking splits y, y + ATTNP_MERGE_WAYS, .., its loop unrolled so that several
// splits' loads are in flight; the maximum by all the CTA's threads, the partial sums added in
// y order (a fixed order). m is in log2 units; a split that began past the row left m = -inf
// and l = 0, weight 0. Split 0 holds slot 0, so the largest m is finite. Why: with one thread
// a pair of dims walking every split in turn, a check's merge took 6 us a launch at 8k
// (session 74); this way a speculative check of 1 / 7 / 15 ids was 15 / 13 / 15% sooner at 32k
// and 4% at 8k (H200, docs/lab.md session 75).
extern "C" __global__ void attn_prefill_merge(PrefillAttnArgs a) {
    pdl_enter();
    __shared__ float warp_max[32];
    __shared__ float sums[ATTNP_MERGE_WAYS][3][MAX_HEAD_DIM / 2];
    const size_t row = blockIdx.x, rows = (size_t)a.n * a.n_q;
    const int x = threadIdx.x, way = threadIdx.y, d = 2 * x, hd = a.head_dim;
    const int tid = way * blockDim.x + x, threads = blockDim.x * ATTNP_MERGE_WAYS;
    float mx = NEG_INF;
    for (int s = tid; s < a.splits; s += threads) mx = fmaxf(mx, a.part_ml[2 * (s * rows + row)]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if ((tid & 31) == 0) warp_max[tid >> 5] = mx;
    __syncthreads();
    mx = NEG_INF;
    for (int w = 0; w < threads / 32; w++) mx = fmaxf(mx, warp_max[w]);
    float l = 0.0f, lo = 0.0f, hi = 0.0f;
#pragma unroll 4
    for (int s = way; s < a.splits; s += ATTNP_MERGE_WAYS) {
        const size_t part = s * rows + row;
        const float2 ml = *reinterpret_cast<const float2*>(a.part_ml + 2 * part);
        const float w = exp2_approx(ml.x - mx);
        l += w * ml.y;
        if (d < hd) {
            const float2 acc = *reinterpret_cast<const float2*>(a.part_acc + part * hd + d);
            lo += w * acc.x;
            hi += w * acc.y;
        }
    }
    if (way > 0 && d < hd) {
        sums[way][0][x] = l;
        sums[way][1][x] = lo;
        sums[way][2][x] = hi;
    }
    __syncthreads();
    if (way > 0 || d >= hd) return;
#pragma unroll
    for (int w = 1; w < ATTNP_MERGE_WAYS; w++) {
        l += sums[w][0][x];
        lo += sums[w][1][x];
        hi += sums[w][2][x];
    }
    store_pair(a.out, row * hd + d, lo / l, hi / l, a.out_f16);
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
