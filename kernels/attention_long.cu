// Long-context decode attention (flash-decoding): the decode step's attention at every depth
// where the model's shape takes it (src/cuda/ops/mod.rs, Ops::attn_long and attn_long_flat;
// attention v2 elsewhere). Uses common.cuh and its own RoPE prologue (rotate_live_group).
//
// Why: attention v3 (deleted in session 86) gave each CTA one q head, so every K/V row was read
// by all the q heads of its GQA group (8x the bytes on the 3B shape), and its 8-CTA clusters
// walked the context in 32-slot steps with one load in flight: 0.1 TB/s of useful KV, 76 tok/s
// at 32k (docs/lab.md, session 21). Here a CTA takes every q head of its KV head, so each K/V
// row is read once, and the context is split over (clusters x ATTNL_RANKS) CTAs per KV head.
//
// Grid (ATTNL_RANKS, clusters, n_kv), clusters of (ATTNL_RANKS, 1, 1), ATTN_THREADS threads.
// On the device, from valid_len: the clusters in use (attnl_clusters: at most gridDim.y; the
// rest leave at once), and each CTA's even share of the tiles of 16 slots.
// A warp takes every ATTN_WARPS-th tile of its CTA's share, two tiles in flight (the first two
// loaded before the wait on the q/k/v GEMV: those slots were written by earlier steps), and
// keeps an online softmax per q head:
//   S^T = K Q^T  (mma m16n8k16: M = 16 slots, N = 8 q heads, K = head dims)
//   O^T += V^T P^T (M = 16 head dims, N = 8 q heads, K = 16 slots)
// on bf16 tensor cores, q and p each split into a bf16 high part and the bf16 rest, so the
// products keep ~16 bits of q and p (K and V are bf16 in the cache: exact). K comes from
// 16-byte loads straight into A fragments (the head dims permuted the same way in q's B
// fragments: a dot product does not care); V and P are transposed in registers (movmatrix).
// Then the warps merge in shared memory, the cluster's CTAs through distributed shared memory
// (rank r: dims [r, r + 1) * head_dim / ATTNL_RANKS, which every rank pushes to it), and where
// more than one cluster ran, the last cluster CTA of each rank to arrive (a counter per KV head
// and rank) merges the clusters' partials from global memory and resets its counter.
// Needs head_dim 64 or 128 and at most 8 q heads per KV head (the host checks).
// Measured (docs/lab.md, sessions 22 and 27-29): 706 tok/s at 32k against attention v3's 76,
// 937 at 2k against 577, 1,022 at 256 against 939, 1,028 at 48 against 1,010; KV streamed at
// 2.6-3.7 TB/s past 2k.

// ATTNL_RANKS (CTAs per cluster), ATTNL_MAX_GROUP and ATTNL_MAX_CLUSTERS come from the host
// (src/cuda/kernels.rs).
#define ATTNL_TILE 16
// A tile a warp: the tiles of one cluster's turn.
#define ATTNL_CLUSTER_TILES (ATTNL_RANKS * ATTN_WARPS)
#define LOG2E 1.4426950408889634f

__device__ __forceinline__ void mma_bf16_16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The 8x8 b16 matrix whose row lane / 4, columns 2 (lane % 4) + {0, 1} this lane holds,
// transposed across the warp.
__device__ __forceinline__ u32 transpose8x8(u32 x) {
    u32 r;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}

// bf16 pair {lo, hi} (lo in the low half), rounded to nearest even.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// (x, y) as a bf16 pair `hi` and the bf16 pair of what rounding left, `lo`.
__device__ __forceinline__ void split_bf16x2(float x, float y, u32& hi, u32& lo) {
    hi = pack_bf16x2(x, y);
    lo = pack_bf16x2(x - __uint_as_float(hi << 16), y - __uint_as_float(hi & 0xffff0000u));
}

__device__ __forceinline__ u32 word_of(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// A warp's tile of 16 slots: lane (g, t) holds slots t0 + g (row 0) and t0 + g + 8 (row 1),
// dims 32 i + 8 t .. + 8 of each, i < HD / 32.
template <int HD>
struct LongTile {
    static constexpr int V4 = HD / 32;
    uint4 k[2][V4], v[2][V4];

    // Slots below `limit` from the cache (the older slots: the live one is patched in);
    // zeros elsewhere, so that a zero weight times V stays zero. A tile wholly below `limit`
    // (all but the last) loads without conditions.
    __device__ __forceinline__ void load(const AttnArgs& a, int kvh, int t0, int limit, int g, int t) {
        const size_t stride = (size_t)a.n_kv * HD;
        const u16* kp = a.k_cache + (size_t)(t0 + g) * stride + kvh * HD + 8 * t;
        const u16* vp = a.v_cache + (size_t)(t0 + g) * stride + kvh * HD + 8 * t;
        const bool whole = t0 + ATTNL_TILE <= limit;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const bool in = whole || t0 + g + 8 * r < limit;
#pragma unroll
            for (int i = 0; i < V4; i++) {
                const size_t at = 8 * r * stride + 32 * i;
                k[r][i] = in ? *reinterpret_cast<const uint4*>(kp + at) : make_uint4(0, 0, 0, 0);
                v[r][i] = in ? *reinterpret_cast<const uint4*>(vp + at) : make_uint4(0, 0, 0, 0);
            }
        }
    }

    // The live slot's row (0 or 1) from the rotated k and the projected v, as the cache stores
    // them (the rows indexed by constants: registers, not local memory).
    __device__ __forceinline__ void patch(int row, const float* kcur, const float* vcur, int t) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            if (r != row) continue;
#pragma unroll
            for (int i = 0; i < V4; i++) {
                const float* kc = kcur + 32 * i + 8 * t;
                const float* vc = vcur + 32 * i + 8 * t;
                k[r][i] = make_uint4(pack_bf16x2(kc[0], kc[1]), pack_bf16x2(kc[2], kc[3]), pack_bf16x2(kc[4], kc[5]),
                                     pack_bf16x2(kc[6], kc[7]));
                v[r][i] = make_uint4(pack_bf16x2(vc[0], vc[1]), pack_bf16x2(vc[2], vc[3]), pack_bf16x2(vc[4], vc[5]),
                                     pack_bf16x2(vc[6], vc[7]));
            }
        }
    }
};

// The head dim of O^T's m16 tile j, row half p2 (0: rows g, 1: rows g + 8) for lane row g.
template <int HD>
__device__ __forceinline__ int long_dim(int j, int p2, int g) {
    return 32 * (j >> 1) + 8 * (g >> 1) + 2 * (2 * (j & 1) + p2) + (g & 1);
}

// The prologue after the wait, every load in one round trip: the group's q heads and the live
// k rotated (RoPE), the live v taken. A thread takes 8 dims of one vector's first half and
// the 8 they pair with (16-byte loads of x, cos and sin): (8 + 1) * 8 units for 8 q heads of
// 128 dims, one round of 128 threads. q goes straight into its B fragments (qf, see below:
// scale and log2(e) folded in, bf16 high part and rest; zero for heads past the group), the
// live k and v into kcur and vcur as f32. rotate_live_batched (two pairs a thread a round)
// took three rounds for 8 q heads and k, each waiting on the last one's shared stores, and a
// warp then built the fragments from an f32 copy of q behind another barrier (docs/lab.md,
// session 27).
template <int HD>
__device__ __forceinline__ void rotate_live_group(const AttnArgs& a, int kvh, int q0, int gn, int pos,
                                                  uint4 (*qf)[HD / 32][32], float* kcur, float* vcur) {
    constexpr int HALF = HD / 2, OCTETS = HALF / 8;  // units of 8 dims per half vector
    static_assert((ATTNL_MAX_GROUP + 1) * OCTETS <= ATTN_THREADS, "one unit a thread");
    static_assert(HD <= ATTN_THREADS, "one live v element a thread");
    auto load8 = [](const float* p, float* x) {
        *reinterpret_cast<float4*>(x) = *reinterpret_cast<const float4*>(p);
        *reinterpret_cast<float4*>(x + 4) = *reinterpret_cast<const float4*>(p + 4);
    };
    const int head = threadIdx.x / OCTETS, j = 8 * (threadIdx.x % OCTETS);
    const float* k_row = a.qkv + a.n_q * HD + kvh * HD;
    const bool rotates = head < gn || head == ATTNL_MAX_GROUP;  // a q head of the group, or k
    float c[8], sn[8], x1[8], x2[8];
    if (rotates) {
        const float* src = head < gn ? a.qkv + (q0 + head) * HD : k_row;
        load8(a.rope_cos + pos * HALF + j, c);
        load8(a.rope_sin + pos * HALF + j, sn);
        load8(src + j, x1);
        load8(src + j + HALF, x2);
#if GEMV3_KHALVES
        float y1[8], y2[8];
        const float* src2 = a.qkv2 + (src - a.qkv);
        load8(src2 + j, y1);
        load8(src2 + j + HALF, y2);
#pragma unroll
        for (int e = 0; e < 8; e++) {
            x1[e] += y1[e];
            x2[e] += y2[e];
        }
#endif
    }
    const int vd = threadIdx.x;
    float v = 0.0f;
    if (vd < HD) {
        v = k_row[a.n_kv * HD + vd];
#if GEMV3_KHALVES
        v += a.qkv2[(k_row - a.qkv) + a.n_kv * HD + vd];
#endif
    }
    float lo[8], hi[8];
#pragma unroll
    for (int e = 0; e < 8; e++) {
        const float2 r = rope_pair(x1[e], x2[e], c[e], sn[e]);
        lo[e] = rotates ? r.x : 0.0f;
        hi[e] = rotates ? r.y : 0.0f;
    }
    if (head == ATTNL_MAX_GROUP) {
#pragma unroll
        for (int e = 0; e < 8; e++) {
            kcur[j + e] = lo[e];
            kcur[j + HALF + e] = hi[e];
        }
    } else if (head < ATTNL_MAX_GROUP) {
        // Dims d .. d + 8 (d = j, then j + HALF) are fragment i = d / 32 of lane (head, d % 32 / 8).
        const float f = a.scale * LOG2E;
#pragma unroll
        for (int part = 0; part < 2; part++) {
            const float* x = part ? hi : lo;
            const int d = j + part * HALF;
            u32 h[4], r[4];
#pragma unroll
            for (int w = 0; w < 4; w++) split_bf16x2(x[2 * w] * f, x[2 * w + 1] * f, h[w], r[w]);
            const int lane = 4 * head + (d % 32) / 8;
            qf[0][d / 32][lane] = make_uint4(h[0], h[1], h[2], h[3]);
            qf[1][d / 32][lane] = make_uint4(r[0], r[1], r[2], r[3]);
        }
    }
    if (vd < HD) vcur[vd] = v;
}

// Clusters of a KV head for `tiles` tiles: one while its warps take at most three tiles each,
// past that one per ATTNL_CLUSTER_TILES (a tile a warp, loaded before the wait), up to `n_cl`.
// Why: the cross-cluster merge through global memory costs more than a warp's second and
// third tile, but less than the fourth and later, which load only after the wait; measured
// against one cluster per two tiles a warp: equal to 1,280 slots, 1.3-2.1% faster from 1,536
// to 6,144, equal at 8,192 (docs/lab.md, session 28).
__device__ __forceinline__ int attnl_clusters(int tiles, int n_cl) {
    return tiles < 3 * ATTNL_CLUSTER_TILES ? 1 : min(tiles / ATTNL_CLUSTER_TILES, n_cl);
}

// CLUSTER false (GPUs without clusters, or DV2_HOPPER=0): grid (1, splits, n_kv), CTA y
// takes attn2_merge's split y (attn2_split_slots: whole tiles), merges its warps as below and
// writes its partial (m in natural-log units, as attention v2's) instead of the cluster's and
// the clusters' merges: for attn2_merge, or, with `counts`, for tail_merge_splits into `out`.
template <int HD, bool CLUSTER = true>
__device__ __forceinline__ void attn_long_body(const AttnArgs& a, float* out, int* counts) {
    constexpr int V4 = HD / 32, MT = HD / 16, DR = HD / ATTNL_RANKS;
    // CTA_TIMELINE marks: 3 prologue done, 4 tiles done, 6 warps merged, 5 cluster merge read.
    timeline_start();
    const int rank = CLUSTER ? cluster_rank() : 0, cl = blockIdx.y, kvh = blockIdx.z, n_cl = gridDim.y;
    const int gn = a.n_q / a.n_kv, q0 = kvh * gn;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int pos = a.state[STATE_POSITION];
    if (pos >= a.max_seq) return;  // every CTA: no slot to write or read
    const int valid = pos + 1, tiles = (valid + ATTNL_TILE - 1) / ATTNL_TILE;
    const int used = CLUSTER ? attnl_clusters(tiles, n_cl) : 1;
    if (cl >= used && CLUSTER) return;  // the whole cluster: no barrier waits for it
    const int split_slots = CLUSTER ? 0 : attn2_split_slots(valid, n_cl);
    if (!CLUSTER && cl * split_slots >= valid) return;  // a split past the context
    // The cluster merge's inbox: from every rank, its m and l and its partial of this rank's
    // dims of each head, pushed (st.async) and counted in bytes on push_bar. Why pushes: the
    // loads from the peers' shared memory waited behind a cluster barrier whose release fence
    // is a MEMBAR.ALL.GPU; pushed, the merge waits for its own bytes alone: +0.1-0.6% at every
    // depth from 48 to 32,512, the same bits (docs/lab.md, session 29).
    __shared__ __align__(16) float recv_o[ATTNL_RANKS][ATTNL_MAX_GROUP][DR];
    __shared__ __align__(8) float recv_ml[ATTNL_RANKS][ATTNL_MAX_GROUP][2];
    __shared__ __align__(8) u64 push_bar;
    if constexpr (CLUSTER) {
        if (threadIdx.x == 0) push_barrier_init(&push_bar);
        cluster_arrive_relaxed();  // the wait before the pushes: every peer's push_bar initialised
    }
    const long long cta = cl * ATTNL_RANKS + rank, ctas = used * ATTNL_RANKS;
    const int tile_end = CLUSTER ? (int)(tiles * (cta + 1) / ctas)
                                 : (min(valid, (cl + 1) * split_slots) + ATTNL_TILE - 1) / ATTNL_TILE;
    int tile = (CLUSTER ? (int)(tiles * cta / ctas) : cl * split_slots / ATTNL_TILE) + warp;

    // Two tiles a warp in flight, in two buffers used in turn (a copy from one to the other
    // waited for the loads it copied).
    LongTile<HD> buf[2];
    if (tile < tile_end) buf[0].load(a, kvh, tile * ATTNL_TILE, pos, g, t);
    if (tile + ATTN_WARPS < tile_end) buf[1].load(a, kvh, (tile + ATTN_WARPS) * ATTNL_TILE, pos, g, t);
    pdl_enter<true>();

    // q head g's B fragments (zero past the group), scale and log2(e) folded in for exp2: i's
    // uint4 of K holds k-steps 2i (words 0, 1) and 2i + 1 (words 2, 3); [high, rest][i][lane],
    // which every warp reads again at each tile (in registers they pushed the kernel past 255
    // and into local memory).
    __shared__ uint4 qf_s[2][V4][32];
    __shared__ __align__(16) float kcur[HD], vcur[HD];
    rotate_live_group<HD>(a, kvh, q0, gn, pos, qf_s, kcur, vcur);
    __syncthreads();
    timeline_mark(3);
    const size_t slot_stride = (size_t)a.n_kv * HD;
    if (rank == 0 && cl == 0) {  // one CTA of the KV head writes its slot (a split: the first)
        for (int d = threadIdx.x; d < HD; d += blockDim.x) {
            a.k_cache[pos * slot_stride + kvh * HD + d] = f32_to_bf16(kcur[d]);
            a.v_cache[pos * slot_stride + kvh * HD + d] = f32_to_bf16(vcur[d]);
        }
    }

    // This lane's q heads 2t and 2t + 1: running max and sum (log2 domain), and O^T.
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    float o[MT][4];
#pragma unroll
    for (int j = 0; j < MT; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;

    // The tile at `tile` in `cur`, then the tile two turns on loaded into it.
    auto step = [&](LongTile<HD>& cur, int tile) {
        const int t0 = tile * ATTNL_TILE;
        if (pos >= t0 && pos < t0 + ATTNL_TILE && (pos - t0) % 8 == g) cur.patch((pos - t0) >> 3, kcur, vcur, t);
        // S^T: s[0], s[1] slot g, heads 2t, 2t + 1; s[2], s[3] slot g + 8. Four accumulators,
        // so that the products do not wait on each other in one chain.
        float sp[4][4] = {};
#pragma unroll
        for (int i = 0; i < V4; i++) {
            const u32 a0[4] = {cur.k[0][i].x, cur.k[1][i].x, cur.k[0][i].y, cur.k[1][i].y};
            const u32 a1[4] = {cur.k[0][i].z, cur.k[1][i].z, cur.k[0][i].w, cur.k[1][i].w};
            const uint4 qh = qf_s[0][i][lane], ql = qf_s[1][i][lane];
            mma_bf16_16816(sp[0], a0, qh.x, qh.y);
            mma_bf16_16816(sp[1], a0, ql.x, ql.y);
            mma_bf16_16816(sp[2], a1, qh.z, qh.w);
            mma_bf16_16816(sp[3], a1, ql.z, ql.w);
        }
        float s[4];
#pragma unroll
        for (int e = 0; e < 4; e++) s[e] = (sp[0][e] + sp[1][e]) + (sp[2][e] + sp[3][e]);
        if (t0 + g >= valid) s[0] = s[1] = NEG_INF;
        if (t0 + g + 8 >= valid) s[2] = s[3] = NEG_INF;
        float corr[2], p[4];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float mx = fmaxf(s[h], s[h + 2]);
#pragma unroll
            for (int x = 4; x < 32; x <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, x));
            const float m_new = fmaxf(m[h], mx);  // finite: the tile's first slot is valid
            corr[h] = exp2f(m[h] - m_new);
            m[h] = m_new;
            p[h] = exp2f(s[h] - m_new);
            p[h + 2] = exp2f(s[h + 2] - m_new);
            l[h] = fmaf(l[h], corr[h], p[h] + p[h + 2]);
        }
        // P^T's B fragments: lane (g, t) holds P[slot g (+8)][heads 2t, 2t + 1]; transposed,
        // P[head g][slots 2t, 2t + 1 (+8)].
        u32 ph[2], pl[2];
        split_bf16x2(p[0], p[1], ph[0], pl[0]);
        split_bf16x2(p[2], p[3], ph[1], pl[1]);
#pragma unroll
        for (int r = 0; r < 2; r++) {
            ph[r] = transpose8x8(ph[r]);
            pl[r] = transpose8x8(pl[r]);
        }
#pragma unroll
        for (int j = 0; j < MT; j++) {
            const uint4 &v0 = cur.v[0][j >> 1], &v1 = cur.v[1][j >> 1];
            const int w = 2 * (j & 1);
            const u32 av[4] = {transpose8x8(word_of(v0, w)), transpose8x8(word_of(v0, w + 1)),
                               transpose8x8(word_of(v1, w)), transpose8x8(word_of(v1, w + 1))};
            o[j][0] *= corr[0];
            o[j][1] *= corr[1];
            o[j][2] *= corr[0];
            o[j][3] *= corr[1];
            mma_bf16_16816(o[j], av, ph[0], ph[1]);
            mma_bf16_16816(o[j], av, pl[0], pl[1]);
        }
        if (tile + 2 * ATTN_WARPS < tile_end) cur.load(a, kvh, (tile + 2 * ATTN_WARPS) * ATTNL_TILE, pos, g, t);
    };
    for (; tile < tile_end; tile += 2 * ATTN_WARPS) {
        step(buf[0], tile);
        if (tile + ATTN_WARPS >= tile_end) break;
        step(buf[1], tile + ATTN_WARPS);
    }
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int x = 4; x < 32; x <<= 1) l[h] += __shfl_xor_sync(0xffffffffu, l[h], x);
    timeline_mark(4);

    // The warps' partials and their maxima and sums, behind one barrier; then each element's
    // sum over the warps, weighted to the CTA's max, into o_w[0]. A row of HD + 1 floats: the
    // lanes' stores (rows 2t, 2t + 1, dims long_dim) fall in 32 different banks.
    __shared__ float o_w[ATTN_WARPS][ATTNL_MAX_GROUP][HD + 1];
    __shared__ float m_w[ATTN_WARPS][ATTNL_MAX_GROUP], l_w[ATTN_WARPS][ATTNL_MAX_GROUP];
    __shared__ float m_cta[ATTNL_MAX_GROUP], l_cta[ATTNL_MAX_GROUP];
    if (g == 0) {
        m_w[warp][2 * t] = m[0];
        m_w[warp][2 * t + 1] = m[1];
        l_w[warp][2 * t] = l[0];
        l_w[warp][2 * t + 1] = l[1];
    }
#pragma unroll
    for (int j = 0; j < MT; j++) {
        const int d0 = long_dim<HD>(j, 0, g), d1 = long_dim<HD>(j, 1, g);
        o_w[warp][2 * t][d0] = o[j][0];
        o_w[warp][2 * t + 1][d0] = o[j][1];
        o_w[warp][2 * t][d1] = o[j][2];
        o_w[warp][2 * t + 1][d1] = o[j][3];
    }
    __syncthreads();
    // Weight of a partial with max mp against the overall max mx (0 for an empty one).
    auto weight = [](float mp, float mx) { return mp == NEG_INF ? 0.0f : exp2f(mp - mx); };
    if ((int)threadIdx.x < gn) {
        const int h = threadIdx.x;
        float mx = NEG_INF, sum = 0.0f;
        for (int w = 0; w < ATTN_WARPS; w++) mx = fmaxf(mx, m_w[w][h]);
        for (int w = 0; w < ATTN_WARPS; w++) sum = fmaf(l_w[w][h], weight(m_w[w][h], mx), sum);
        m_cta[h] = mx;
        l_cta[h] = sum;
    }
    // A thread's elements: dim threadIdx.x % HD of heads threadIdx.x / HD + k * (threads / HD).
    static_assert(ATTN_THREADS % HD == 0, "a thread keeps one dim");
    constexpr int HEADS_A_ROUND = ATTN_THREADS / HD;
    const int dim = threadIdx.x % HD;
#pragma unroll
    for (int h = threadIdx.x / HD; h < ATTNL_MAX_GROUP; h += HEADS_A_ROUND) {
        if (h >= gn) break;
        float mw[ATTN_WARPS], mx = NEG_INF, sum = 0.0f;
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; w++) mx = fmaxf(mx, mw[w] = m_w[w][h]);
#pragma unroll
        for (int w = 0; w < ATTN_WARPS; w++) sum = fmaf(o_w[w][h][dim], weight(mw[w], mx), sum);
        o_w[0][h][dim] = sum;  // this thread alone reads and writes element (h, dim)
    }
    timeline_mark(6);
    // The cluster's merge: rank r's dims of each head from every rank's partial, each rank's
    // share pushed to it.
    __syncthreads();  // o_w[0], m_cta and l_cta complete
    if constexpr (!CLUSTER) {  // the split's partial, for attn2_merge or the tail merge
        constexpr float LN2 = 0.6931471805599453f;
        for (int i = threadIdx.x; i < gn * HD; i += ATTN_THREADS) {
            const int h = i / HD, d = i % HD;
            a.part_acc[((size_t)(q0 + h) * n_cl + cl) * HD + d] = o_w[0][h][d];
        }
        if ((int)threadIdx.x < gn) {
            const size_t at = ((size_t)(q0 + threadIdx.x) * n_cl + cl) * 2;
            a.part_ml[at] = m_cta[threadIdx.x] * LN2;  // exp2's units to attn2_merge's expf
            a.part_ml[at + 1] = l_cta[threadIdx.x];
        }
        // The merge's weights in o_w, read by every thread above before the merge's first barrier.
        static_assert(sizeof(o_w) >= TAIL_SCRATCH_FLOATS * sizeof(float), "o_w holds the tail merge's weights");
        if (counts != nullptr) tail_merge_splits<HD>(a, out, counts + kvh * ATTNF_COUNTS, &o_w[0][0][0], q0, gn, cl);
        timeline_end();
        return;
    }
    cluster_wait();   // every peer's push_bar initialised (long ago)
    if (threadIdx.x == 0) push_barrier_expect(&push_bar, ATTNL_RANKS * gn * (DR + 2) * 4);
    static_assert(DR % 4 == 0, "a push carries 4 dims");
    for (int i = threadIdx.x; i < ATTNL_RANKS * gn * (DR / 4); i += ATTN_THREADS) {
        const int r = i / (gn * (DR / 4)), hq = i % (gn * (DR / 4)), hh = hq / (DR / 4), q4 = 4 * (hq % (DR / 4));
        const float* src = &o_w[0][hh][r * DR + q4];
        push_to_cta(&recv_o[rank][hh][q4], r, make_float4(src[0], src[1], src[2], src[3]), &push_bar);
    }
    if ((int)threadIdx.x < ATTNL_RANKS * gn) {
        const int r = threadIdx.x / gn, hh = threadIdx.x % gn;
        push2_to_cta(recv_ml[rank][hh], r, make_float2(m_cta[hh], l_cta[hh]), &push_bar);
    }
    push_barrier_wait(&push_bar);
    float merged_o = 0.0f, merged_m = NEG_INF, merged_l = 0.0f;
    const int h = threadIdx.x / DR, d = rank * DR + threadIdx.x % DR;
    const bool mine = (int)threadIdx.x < gn * DR;  // ATTNL_MAX_GROUP * DR <= ATTN_THREADS
    if (mine) {
        float mr[ATTNL_RANKS], lr[ATTNL_RANKS], orr[ATTNL_RANKS];
#pragma unroll
        for (int r = 0; r < ATTNL_RANKS; r++) {
            mr[r] = recv_ml[r][h][0];
            lr[r] = recv_ml[r][h][1];
            orr[r] = recv_o[r][h][threadIdx.x % DR];
        }
#pragma unroll
        for (int r = 0; r < ATTNL_RANKS; r++) merged_m = fmaxf(merged_m, mr[r]);
#pragma unroll
        for (int r = 0; r < ATTNL_RANKS; r++) {
            const float w = weight(mr[r], merged_m);
            merged_l = fmaf(lr[r], w, merged_l);
            merged_o = fmaf(orr[r], w, merged_o);
        }
    }
    timeline_mark(5);
    if (used == 1) {
        if (mine) out[(size_t)(q0 + h) * HD + d] = merged_o / merged_l;
        timeline_end();
        return;
    }
    // Several clusters: this rank's slice to global memory; the last of the rank merges.
    const size_t slice = ((size_t)kvh * ATTNL_RANKS + rank) * n_cl;  // + cluster
    if (mine) {
        a.part_acc[(slice + cl) * ATTNL_MAX_GROUP * DR + threadIdx.x] = merged_o;
        if (threadIdx.x % DR == 0) {
            a.part_ml[((slice + cl) * ATTNL_MAX_GROUP + h) * 2] = merged_m;
            a.part_ml[((slice + cl) * ATTNL_MAX_GROUP + h) * 2 + 1] = merged_l;
        }
    }
    // The CTA's stores ordered before the count by the barrier and thread 0's release; the
    // last CTA's loads after the others' stores by its acquire and the barrier (CUTLASS's
    // semaphore: one fence, not one per thread on each side).
    __syncthreads();
    __shared__ int last;
    int* count = counts + kvh * ATTNL_RANKS + rank;
    if (threadIdx.x == 0) last = atomic_add_acq_rel(count, 1) == used - 1;
    __syncthreads();
    if (last) {
        if (mine) {
            // Every cluster's partial in one round of loads, then the merge from registers.
            float mc[ATTNL_MAX_CLUSTERS], lc[ATTNL_MAX_CLUSTERS], oc[ATTNL_MAX_CLUSTERS];
#pragma unroll
            for (int c = 0; c < ATTNL_MAX_CLUSTERS; c++) {
                if (c >= used) break;
                mc[c] = __ldcg(&a.part_ml[((slice + c) * ATTNL_MAX_GROUP + h) * 2]);
                lc[c] = __ldcg(&a.part_ml[((slice + c) * ATTNL_MAX_GROUP + h) * 2 + 1]);
                oc[c] = __ldcg(&a.part_acc[(slice + c) * ATTNL_MAX_GROUP * DR + threadIdx.x]);
            }
            float mx = NEG_INF, lsum = 0.0f, osum = 0.0f;
#pragma unroll
            for (int c = 0; c < ATTNL_MAX_CLUSTERS; c++)
                if (c < used) mx = fmaxf(mx, mc[c]);
#pragma unroll
            for (int c = 0; c < ATTNL_MAX_CLUSTERS; c++) {
                if (c >= used) break;
                const float w = weight(mc[c], mx);
                lsum = fmaf(lc[c], w, lsum);
                osum = fmaf(oc[c], w, osum);
            }
            out[(size_t)(q0 + h) * HD + d] = osum / lsum;
        }
        if (threadIdx.x == 0) *count = 0;  // for the next layer: kernels run one after another
    }
    timeline_end();
}

#define ATTNL_KERNEL(HD)                                                                                          \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_long_decode_hd##HD(AttnArgs a, float* out, \
                                                                                         int* counts) {         \
        attn_long_body<HD>(a, out, counts);                                                                     \
    }
ATTNL_KERNEL(64)
ATTNL_KERNEL(128)
// counts null: the partials for attn2_merge; else merged into out (tail_merge_splits).
#define ATTNL_FLAT_KERNEL(HD)                                                                               \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS)                                              \
        attn_long_flat_decode_hd##HD(AttnArgs a, float* out, int* counts) {                                 \
        attn_long_body<HD, false>(a, out, counts);                                                          \
    }
ATTNL_FLAT_KERNEL(64)
ATTNL_FLAT_KERNEL(128)
