// Decode attention: v1 (a CTA per q head and split, then a merge) and v2 (CTAs per KV head and
// split of the context, walked in 32-slot chunks, then a merge), with RoPE and the step's KV
// write fused. Uses common.cuh.

// GEMV3_KHALVES (an NVRTC define the host sets, DV2_QKV_KHALVES; 1 by default): q/k/v's
// GEMV v3 in K halves (kernels/gemv_mma.cu, gemv3_store_lean_kh2), the attention adding the
// two parts (AttnArgs::qkv2: the second, or zeros where q/k/v ran in one).

// Flash-decode attention, one (q head, time split) per CTA, RoPE and the KV write fused.
//
// Reads position p from the state; valid_len = p + 1. Every CTA rotates q and the current k
// itself (the live slot is taken from the projections, never read back from the cache, so
// sibling heads cannot race the write); the first q head of each KV group, split 0, writes
// the slot. Slots t < valid_len are split evenly over n_splits; each CTA writes its online-
// softmax partial (max, sum, acc[head_dim]) for attn_merge.
struct AttnArgs {
    const float* qkv;  // this step's q [n_q*hd] | k [n_kv*hd] | v [n_kv*hd]
    u16* k_cache;      // this layer: [kv_stride][n_kv][hd]
    u16* v_cache;
    const float* rope_cos;  // [max_seq][hd/2]
    const float* rope_sin;
    const int* state;
    float* part_acc;  // [n_q][n_splits][hd]
    float* part_ml;   // [n_q][n_splits][2]
    int n_q, n_kv, head_dim, max_seq, n_splits;
    float scale;
    int heads_per_cta;  // attention v2: q heads per CTA (the host's division)
    const float* qkv2;  // GEMV3_KHALVES: q/k/v's K-half-1 sums (half 0's, with the bias, at qkv), or zeros
};
static_assert(sizeof(AttnArgs) == SIZEOF_ATTNARGS, "AttnArgs differs from the host's (src/cuda/ops)");

extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn_decode(AttnArgs a) {
    pdl_enter();
    const int h = blockIdx.x, split = blockIdx.y, hd = a.head_dim, half = hd >> 1;
    const int group = a.n_q / a.n_kv, kvh = h / group;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int pos = a.state[STATE_POSITION];
    if (pos >= a.max_seq) return;  // no slot: nothing to write or read
    const int valid = pos + 1;

    __shared__ float q_s[MAX_HEAD_DIM], k_s[MAX_HEAD_DIM], v_s[MAX_HEAD_DIM];
    const float* q = a.qkv + h * hd;
    const float* k = a.qkv + a.n_q * hd + kvh * hd;
    const float* v = a.qkv + (a.n_q + a.n_kv) * hd + kvh * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        int i = d < half ? d : d - half;
        float c = a.rope_cos[pos * half + i], s = a.rope_sin[pos * half + i];
        const float2 qr = rope_pair(q[i], q[i + half], c, s), kr = rope_pair(k[i], k[i + half], c, s);
        q_s[d] = d < half ? qr.x : qr.y;
        k_s[d] = d < half ? kr.x : kr.y;
        v_s[d] = v[d];
    }
    __syncthreads();
    const size_t slot_stride = (size_t)a.n_kv * hd;
    if (h % group == 0 && split == 0) {
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            a.k_cache[pos * slot_stride + kvh * hd + d] = f32_to_bf16(k_s[d]);
            a.v_cache[pos * slot_stride + kvh * hd + d] = f32_to_bf16(v_s[d]);
        }
    }

    const int chunk = (valid + a.n_splits - 1) / a.n_splits;
    const int t0 = split * chunk, t1 = min(valid, t0 + chunk);
    constexpr int MAX_E = MAX_HEAD_DIM / 32;
    float m = NEG_INF, l = 0.0f, acc[MAX_E];
#pragma unroll
    for (int e = 0; e < MAX_E; e++) acc[e] = 0.0f;
    for (int t = t0 + warp; t < t1; t += ATTN_WARPS) {
        const u16* kc = a.k_cache + t * slot_stride + kvh * hd;
        const u16* vc = a.v_cache + t * slot_stride + kvh * hd;
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < MAX_E; e++) {
            int d = e * 32 + lane;
            if (d < hd) dot += q_s[d] * (t == pos ? k_s[d] : bf16_to_f32(kc[d]));
        }
        float score = warp_sum(dot) * a.scale;
        float m_new = fmaxf(m, score);
        float corr = expf(m - m_new), p = expf(score - m_new);
        l = l * corr + p;
#pragma unroll
        for (int e = 0; e < MAX_E; e++) {
            int d = e * 32 + lane;
            if (d < hd) acc[e] = acc[e] * corr + p * (t == pos ? v_s[d] : bf16_to_f32(vc[d]));
        }
        m = m_new;
    }

    // Combine the warps of this CTA.
    __shared__ float w_m[ATTN_WARPS], w_l[ATTN_WARPS], w_acc[ATTN_WARPS][MAX_HEAD_DIM];
    if (lane == 0) {
        w_m[warp] = m;
        w_l[warp] = l;
    }
#pragma unroll
    for (int e = 0; e < MAX_E; e++) {
        int d = e * 32 + lane;
        if (d < hd) w_acc[warp][d] = acc[e];
    }
    __syncthreads();
    float M = NEG_INF;
    for (int w = 0; w < ATTN_WARPS; w++) M = fmaxf(M, w_m[w]);
    float* out_acc = a.part_acc + ((size_t)h * a.n_splits + split) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float sum = 0.0f;
        for (int w = 0; w < ATTN_WARPS; w++)
            if (w_m[w] != NEG_INF) sum += w_acc[w][d] * expf(w_m[w] - M);
        out_acc[d] = sum;
    }
    if (threadIdx.x == 0) {
        float L = 0.0f;
        for (int w = 0; w < ATTN_WARPS; w++)
            if (w_m[w] != NEG_INF) L += w_l[w] * expf(w_m[w] - M);
        a.part_ml[((size_t)h * a.n_splits + split) * 2] = M;
        a.part_ml[((size_t)h * a.n_splits + split) * 2 + 1] = L;
    }
}

// The parts of attention v2 (attn2_decode_body below). A CTA computes several q heads of a
// KV head's GQA group, so each K/V row is read from memory once per step (and from L2 by the
// KV head's other CTAs) instead of once per q head; the group's heads are split over up to 4
// CTAs (ATTN2_SPLIT on the host): the scores and the weighted sum of V are serial loops per
// thread over heads, so a CTA with a quarter of the heads finishes them in a quarter of the
// rounds (docs/lab.md, session 8); v2's splits are long at long context, where fewer CTAs
// reading each chunk won (session 65). K and V are staged in shared memory by 32-slot chunks
// with 16-byte loads issued together; scores, softmax and the weighted sum of V run from
// shared memory. The live slot (t == position) comes from the rotated projections, never from
// the cache; one CTA of the KV head writes it.

// Every global load of the prologue (the chunk's K and V rows, the q/k pairs to rotate with
// their cos and sin, the live v) is issued before its first shared store. Interleaved, each
// round of loads waited for the previous round's data to be stored (in program order a load
// may not pass a store the compiler cannot prove to be elsewhere): nine round trips in a row
// at head_dim 128 (docs/lab.md, session 12).
// The chunk's K and V rows are loaded before the wait on the q/k/v GEMV, so their round trip overlaps its tail (an attention CTA,
// 128 threads, fits beside the GEMV's CTAs). They were written by earlier steps, and so was
// the position; a kernel starts only after the one before it has passed its own wait, so
// every step before this one's q/k/v GEMV is complete when these loads issue. The live slot
// and this step's q/k/v are read after the wait, as before.
// Attention's RoPE: pair i (of (gn + 1) * half: the gn q heads from q0, then the live k of
// KV head kvh) is elements (j, j + half) of its vector, j = i % half; the source row, and the
// rotated pair into q_s (scale folded in) or kcur.
// hd is the head_dim: a constant where the caller's kernel has it built in (its divisions
// then shifts), else a.head_dim.
__device__ __forceinline__ const float* rope_pair_src(const AttnArgs& a, int hd, int kvh, int q0, int gn, int i) {
    const int half = hd >> 1;
    return i / half < gn ? a.qkv + (q0 + i / half) * hd : a.qkv + a.n_q * hd + kvh * hd;
}
__device__ __forceinline__ void rope_rotate(const AttnArgs& a, int hd, int gn, int i, float c, float s, float x1,
                                            float x2, float* q_s, float* kcur) {
    const int half = hd >> 1;
    const int g = i / half, j = i % half;
    const float2 r = rope_pair(x1, x2, c, s);
    const float lo = r.x, hi = r.y;
    if (g < gn) {
        q_s[g * hd + j] = lo * a.scale;
        q_s[g * hd + j + half] = hi * a.scale;
    } else {
        kcur[j] = lo;
        kcur[j + half] = hi;
    }
}

// The prologue after the wait: every load (the live v, RoPE pairs
// with cos/sin, RB pairs per thread at once) before the stores they feed, the caller's
// `stage()` (K/V rows from registers into shared memory) between the rotations' stores and v's.
// HD: the largest head_dim it takes (smaller: fewer loads unrolled per thread); EXACT: the
// head_dim when the kernel has it built in (0: a.head_dim).
template <int HD = MAX_HEAD_DIM, int EXACT = 0, typename Stage>
__device__ __forceinline__ void rotate_live_batched(const AttnArgs& a, int kvh, int q0, int gn, int pos, float* q_s,
                                                    float* kcur, float* vcur, Stage stage) {
    const int hd = EXACT ? EXACT : a.head_dim, half = hd >> 1;
    const float* qkv_v = a.qkv + (a.n_q + a.n_kv) * hd + kvh * hd;
    const float* cos_p = a.rope_cos + pos * half;
    const float* sin_p = a.rope_sin + pos * half;
    constexpr int RB = HD <= 128 ? 2 : 8;  // pairs per thread loaded together
    constexpr int VL = (HD + ATTN_THREADS - 1) / ATTN_THREADS;
    float vl[VL];
#pragma unroll
    for (int u = 0; u < VL; u++) {
        const int d = threadIdx.x + u * ATTN_THREADS;
        vl[u] = d < hd ? qkv_v[d] : 0.0f;
#if GEMV3_KHALVES
        if (d < hd) vl[u] += a.qkv2[(a.n_q + a.n_kv) * hd + kvh * hd + d];  // half 0 (with the bias) first
#endif
    }
    for (int base = threadIdx.x; base < (gn + 1) * half; base += RB * ATTN_THREADS) {
        float c[RB], sn[RB], x1[RB], x2[RB];
#pragma unroll
        for (int u = 0; u < RB; u++) {
            const int i = base + u * ATTN_THREADS;
            if (i < (gn + 1) * half) {
                const float* src = rope_pair_src(a, hd, kvh, q0, gn, i);
                c[u] = cos_p[i % half];
                sn[u] = sin_p[i % half];
                x1[u] = src[i % half];
                x2[u] = src[i % half + half];
#if GEMV3_KHALVES
                const float* src2 = a.qkv2 + (src - a.qkv);
                x1[u] += src2[i % half];
                x2[u] += src2[i % half + half];
#endif
            }
        }
#pragma unroll
        for (int u = 0; u < RB; u++) {
            const int i = base + u * ATTN_THREADS;
            if (i < (gn + 1) * half) rope_rotate(a, hd, gn, i, c[u], sn[u], x1[u], x2[u], q_s, kcur);
        }
    }
    stage();
#pragma unroll
    for (int u = 0; u < VL; u++) {
        const int d = threadIdx.x + u * ATTN_THREADS;
        if (d < hd) vcur[d] = vl[u];
    }
}

// The splits' merge by the attention's own last CTAs, instead of attn2_merge
// (DV2_X_TAIL_MERGE=1, an experiment: docs/lab.md, session 87), for attention v2 and the flat
// long attention. Their partials lie in attn2_merge's layout: per q head, gridDim.y splits of
// head_dim floats, and m (natural-log units) and l.
// TAIL_MAX_HEADS: the most q heads one CTA merges (v2's heads per CTA, up to ATTN2_MAX_GROUP;
// the flat walk's group, up to ATTNL_MAX_GROUP).
#define TAIL_MAX_HEADS (ATTN2_MAX_GROUP > ATTNL_MAX_GROUP ? ATTN2_MAX_GROUP : ATTNL_MAX_GROUP)

// The shared floats the tail merge's weights take: the caller lends an array its walk no
// longer uses (v2 is 3.6 KB under the 48 KB of static shared memory a kernel may hold).
#define TAIL_SCRATCH_FLOATS (TAIL_MAX_HEADS * ATTNF_MAX_MERGE)

// Partials first, first + stride, .. (`count` of them, at most ATTNF_MAX_MERGE) of q heads
// q0 .. q0 + gn merged: into out where given, else into partial `first` (each element read and
// written by one thread; m and l written after every thread read them). A warp a head finds
// the weights, into `scratch` (TAIL_SCRATCH_FLOATS). HD: the head_dim if built in, else 0
// (a.head_dim).
template <int HD>
__device__ __forceinline__ void merge_split_partials(const AttnArgs& a, float* out, float* scratch, int q0, int gn,
                                                     int first, int stride, int count) {
    const int hd = HD ? HD : a.head_dim, splits = gridDim.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float(*w_s)[ATTNF_MAX_MERGE] = reinterpret_cast<float(*)[ATTNF_MAX_MERGE]>(scratch);
    __shared__ float m_s[TAIL_MAX_HEADS], l_s[TAIL_MAX_HEADS];
    for (int h = warp; h < gn; h += ATTN_WARPS) {
        const float2* ml = reinterpret_cast<const float2*>(a.part_ml) + (size_t)(q0 + h) * splits + first;
        float mx = NEG_INF;
        for (int c = lane; c < count; c += 32) mx = fmaxf(mx, __ldcg(&ml[c * stride].x));
        mx = warp_max(mx);
        float l = 0.0f;
        for (int c = lane; c < count; c += 32) {
            const float2 mlc = __ldcg(&ml[c * stride]);
            const float w = expf(mlc.x - mx);  // finite: every split used holds a valid slot
            w_s[h][c] = w;
            l = fmaf(mlc.y, w, l);
        }
        l = warp_sum(l);
        if (lane == 0) {
            m_s[h] = mx;
            l_s[h] = l;
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < gn * hd; i += ATTN_THREADS) {
        const int h = i / hd, d = i % hd;
        float* acc = a.part_acc + ((size_t)(q0 + h) * splits + first) * hd + d;
        float o = 0.0f;
#pragma unroll 8
        for (int c = 0; c < count; c++) o = fmaf(__ldcg(acc + (size_t)c * stride * hd), w_s[h][c], o);
        if (out != nullptr) out[(size_t)(q0 + h) * hd + d] = o / l_s[h];
        else *acc = o;
    }
    if (out == nullptr && (int)threadIdx.x < gn) {
        float* ml = a.part_ml + ((size_t)(q0 + threadIdx.x) * splits + first) * 2;
        ml[0] = m_s[threadIdx.x];
        ml[1] = l_s[threadIdx.x];
    }
}

// After this CTA stored its partial of split `split` (q heads q0 .. q0 + gn): the splits in use
// in groups of ATTNF_MERGE_GROUP, the last CTA of a group to arrive (its counter) merges the
// group's partials into the group's first, and the last of those (the CTA set's counter) the
// groups' into out; one group's merger writes out itself. `counts`: ATTNF_COUNTS zeroed ints of
// the CTAs that share these q heads (the set's, then a group's); each last CTA resets its
// counter for the next layer. `scratch`: for merge_split_partials, unused by the caller now.
// Two levels keep each merge short: at 32k on the 3B shape the flat walk's 66 splits merge as
// 9 merges of at most 8 and one of 9, not one CTA reading ~270 KB.
template <int HD>
__device__ __forceinline__ void tail_merge_splits(const AttnArgs& a, float* out, int* counts, float* scratch, int q0,
                                                  int gn, int split) {
    // The splits in use, as the walk cut them, from the position read again: held from the
    // walk's start, the count took the flat long attention's 255th register and spilled
    // (volatile: not merged with that first load).
    const int valid = *reinterpret_cast<const volatile int*>(&a.state[STATE_POSITION]) + 1;
    const int used = attn2_splits_used(valid, gridDim.y);
    const int group = split / ATTNF_MERGE_GROUP, groups = (used + ATTNF_MERGE_GROUP - 1) / ATTNF_MERGE_GROUP;
    const int first = group * ATTNF_MERGE_GROUP, members = min(ATTNF_MERGE_GROUP, used - first);
    // The CTA's stores ordered before its count by the barrier and thread 0's release, the
    // merger's loads after the others' stores by its acquire and the barrier (CUTLASS's
    // semaphore, as the long attention's cluster merge).
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x == 0) last = atomic_add_acq_rel(&counts[1 + group], 1) == members - 1;
    __syncthreads();
    if (!last) return;
    if (threadIdx.x == 0) counts[1 + group] = 0;
    merge_split_partials<HD>(a, groups == 1 ? out : nullptr, scratch, q0, gn, first, 1, members);
    if (groups == 1) return;
    __syncthreads();
    if (threadIdx.x == 0) last = atomic_add_acq_rel(&counts[0], 1) == groups - 1;
    __syncthreads();
    if (!last) return;
    if (threadIdx.x == 0) counts[0] = 0;
    merge_split_partials<HD>(a, out, scratch, q0, gn, 0, ATTNF_MERGE_GROUP, groups);
}

// Attention v2 (where the long-context attention does not take the shape, or DV2_ATTN_LONG=0):
// grid (parts, splits, n_kv), gridDim.y splits of at least ATTN2_CHUNK slots each (the host
// picks about four CTAs an SM, each of two q heads on the 3B shape), each walking its slots in
// 32-slot chunks with an online softmax (the next chunk's K and V rows in registers while this
// one is used; the first before the wait), its partials to attn2_merge; a split past the
// context leaves at once. Why: v2 was a CTA a 32-slot chunk of max_seq (16 x 1,024 CTAs a
// layer on the 3B shape at max_seq 32,768, nearly all leaving at once), and streamed the KV at
// 100-135 GB/s. Measured against it with DV2_HOPPER=0 on an H100 (one q head a CTA): +14%
// decode at depth 48, +30% at 2k, +56% at 8k, +134% at 32k; two q heads a CTA then -0.7% /
// +14% / +42% at 48 / 8k / 32k (docs/lab.md, session 65, which names the commit that last held
// the old kernel). Attention v3, these CTAs in clusters that merged through distributed shared
// memory, led it by 7% at depth 48 (no merge kernel) and lost by 25% at 2k and 3.7x at 32k, its
// 8 splits a KV head fixed at any depth (docs/lab.md, session 86, which names its last commit).
// HD: the head_dim when known at compile time (64 or 128: the K/V indexing by shifts, half
// the vectors unrolled), 0 for any. Other loops stay rolled (#pragma unroll 1): each warp
// runs this code about once, and its cold fetch is the cost (docs/lab.md, session 13). The
// score and weighted-sum loops unrolled by 2 and 4 so that their shared loads issue together,
// and the softmax's max and sum over only the lanes that can hold a slot (3 shuffle rounds at
// <= 8 slots, 4 at <= 16); the same values in the same order. Why: one q head per CTA leaves
// those loops one shared-load round trip per iteration on the kernel's serial chain, and the
// kernel mostly waits (docs/lab.md, session 15: 0.08 issued per scheduler cycle). Measured:
// -0.0055 ms/token (session 16, run 2).
template <int HD>
__device__ __forceinline__ void attn2_decode_body(const AttnArgs& a, float* out, int* counts) {
    timeline_start();
    const int hd = HD ? HD : a.head_dim, half = hd >> 1;
    // Grid (parts, splits, n_kv): KV head z, its q heads [q0, q0 + gn) from the host's count.
    const int gn = a.heads_per_cta, group = gn * gridDim.x;
    const int kvh = blockIdx.z, q0 = kvh * group + blockIdx.x * gn;
    const int splits = gridDim.y, rank = blockIdx.y;
    const int pos = a.state[STATE_POSITION];
    if (pos >= a.max_seq) return;  // every CTA: no slot to write or read
    const int valid = pos + 1;
    const int per = attn2_split_slots(valid, splits);
    const int t_begin = min(valid, rank * per), t_end = min(valid, t_begin + per);
    if (t_begin >= t_end) return;  // a split past the context: attn2_merge never reads it
    const int row_words = half + 1;  // bf16 pairs per staged row, +1 word of padding

    __shared__ float q_s[ATTN2_MAX_GROUP_X_HD];
    __shared__ float kcur[MAX_HEAD_DIM], vcur[MAX_HEAD_DIM];
    __shared__ u32 k_s[ATTN2_CHUNK * (MAX_HEAD_DIM / 2 + 1)], v_s[ATTN2_CHUNK * (MAX_HEAD_DIM / 2 + 1)];
    __shared__ float p_s[ATTN2_MAX_GROUP][ATTN2_CHUNK];
    // Per head: the running max and sum, and the last chunk's rescale of the older terms.
    __shared__ float m_run[ATTN2_MAX_GROUP], l_run[ATTN2_MAX_GROUP], corr_s[ATTN2_MAX_GROUP];
    const size_t slot_stride = (size_t)a.n_kv * hd;

    // Rows t0 .. of K and V (16-byte loads) into registers, skipping the live slot.
    const int vec_per_row = hd >> 3;  // uint4 = 8 bf16
    constexpr int KV_VECS = ATTN2_CHUNK * ((HD ? HD : MAX_HEAD_DIM) / 8) / ATTN_THREADS;  // per thread, at most
    uint4 kreg[KV_VECS], vreg[KV_VECS];
    auto kv_vec = [&](int t0, int u, int n_t) {
        const int i = threadIdx.x + u * ATTN_THREADS;
        return i < n_t * vec_per_row && t0 + i / vec_per_row != pos ? i : -1;
    };
    auto load_rows = [&](int t0) {
        const int n_t = min(ATTN2_CHUNK, t_end - t0);
#pragma unroll
        for (int u = 0; u < KV_VECS; u++) {
            const int i = kv_vec(t0, u, n_t);
            if (i >= 0) {
                const size_t at = (size_t)(t0 + i / vec_per_row) * slot_stride + kvh * hd + (i % vec_per_row) * 8;
                kreg[u] = *reinterpret_cast<const uint4*>(a.k_cache + at);
                vreg[u] = *reinterpret_cast<const uint4*>(a.v_cache + at);
            }
        }
    };
    auto stage_rows = [&](int t0) {
        const int n_t = min(ATTN2_CHUNK, t_end - t0);
#pragma unroll
        for (int u = 0; u < KV_VECS; u++) {
            const int i = kv_vec(t0, u, n_t);
            if (i >= 0) {
                u32* kd = k_s + (i / vec_per_row) * row_words + (i % vec_per_row) * 4;
                u32* vd = v_s + (i / vec_per_row) * row_words + (i % vec_per_row) * 4;
                kd[0] = kreg[u].x; kd[1] = kreg[u].y; kd[2] = kreg[u].z; kd[3] = kreg[u].w;
                vd[0] = vreg[u].x; vd[1] = vreg[u].y; vd[2] = vreg[u].z; vd[3] = vreg[u].w;
            }
        }
    };
    load_rows(t_begin);  // written by earlier steps: before the wait
    pdl_enter<true>();
    rotate_live_batched<HD ? HD : MAX_HEAD_DIM, HD>(a, kvh, q0, gn, pos, q_s, kcur, vcur, [] {});
    if ((int)threadIdx.x < gn) {
        m_run[threadIdx.x] = NEG_INF;
        l_run[threadIdx.x] = 0.0f;
    }
    // The heads' running partial outputs, [gn][hd] (dynamic: gn * hd floats); a thread
    // keeps the same pairs of dims in every chunk.
    extern __shared__ __align__(16) float acc_s[];
    for (int i = threadIdx.x; i < gn * hd; i += blockDim.x) acc_s[i] = 0.0f;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int t0 = t_begin; t0 < t_end; t0 += ATTN2_CHUNK) {
        const int n_t = min(ATTN2_CHUNK, t_end - t0);
        stage_rows(t0);
        if (t0 + ATTN2_CHUNK < t_end) load_rows(t0 + ATTN2_CHUNK);
        __syncthreads();
        if (t0 == t_begin && rank == 0 && blockIdx.x == 0) {  // one CTA of the KV head writes its slot
            for (int d = threadIdx.x; d < hd; d += blockDim.x) {
                a.k_cache[pos * slot_stride + kvh * hd + d] = f32_to_bf16(kcur[d]);
                a.v_cache[pos * slot_stride + kvh * hd + d] = f32_to_bf16(vcur[d]);
            }
        }
        if (pos >= t0 && pos < t0 + n_t) {  // the live row, from the projections
            const int t = pos - t0;
            for (int w = threadIdx.x; w < half; w += blockDim.x) {
                k_s[t * row_words + w] = (u32)f32_to_bf16(kcur[2 * w]) | ((u32)f32_to_bf16(kcur[2 * w + 1]) << 16);
                v_s[t * row_words + w] = (u32)f32_to_bf16(vcur[2 * w]) | ((u32)f32_to_bf16(vcur[2 * w + 1]) << 16);
            }
            __syncthreads();
        }
        // Scores: a warp takes one q head at a time, `lanes` lanes a slot, each a 1/lanes of the
        // dims, added by shuffles; then lane t holds slot t's: 4 lanes a slot up to 8 slots, 2
        // up to 16 (docs/lab.md, session 16): the serial
        // dot product is 1/4 or 1/2 as long (a lane a slot walked every dim, most lanes idle at
        // a split's few slots). The running max and sum move on by this chunk.
        const int lanes = n_t <= 8 && half % 8 == 0 ? 4
                          : n_t <= 16 && half % 4 == 0 ? 2
                                                       : 1;
        const int lane_shift = lanes >> 1;  // log2(lanes) for 1, 2, 4
        const int slot = lane >> lane_shift, words = half >> lane_shift;
        for (int g = warp; g < gn; g += ATTN_WARPS) {
            float dot = 0.0f;
            if (slot < n_t) {
                const int w0 = (lane & (lanes - 1)) * words;
                const u32* krow = k_s + slot * row_words + w0;
                const float* q = q_s + g * hd + 2 * w0;
                float sacc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // independent chains
#pragma unroll 2
                for (int w = 0; w < words; w += 2) {
#pragma unroll
                    for (int u = 0; u < 2; u++) {
                        const u32 pair = krow[w + u];
                        sacc[2 * u] = fmaf(q[2 * (w + u)], bf16_to_f32((u16)(pair & 0xffffu)), sacc[2 * u]);
                        sacc[2 * u + 1] = fmaf(q[2 * (w + u) + 1], bf16_to_f32((u16)(pair >> 16)), sacc[2 * u + 1]);
                    }
                }
                dot = (sacc[0] + sacc[1]) + (sacc[2] + sacc[3]);
            }
            for (int o = 1; o < lanes; o <<= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
            if (lanes > 1) dot = __shfl_sync(0xffffffffu, dot, (lane << lane_shift) & 31);
            const float score = lane < n_t ? dot : NEG_INF;
            const float m_old = m_run[g];
            // The max and sum over lanes 0 .. span - 1 (every lane that can hold
            // a slot): lanes below n_t, which use the max, and lane 0, which keeps the sum, get
            // the warp-wide values, in the same order (the skipped rounds add zeros).
            const int span = n_t > 16 ? 32 : n_t > 8 ? 16 : 8;
            float m_chunk = score;
            for (int o = span >> 1; o > 0; o >>= 1) m_chunk = fmaxf(m_chunk, __shfl_xor_sync(0xffffffffu, m_chunk, o));
            const float m_new = fmaxf(m_old, m_chunk);
            const float p = lane < n_t ? expf(score - m_new) : 0.0f;
            float l = p;
            for (int o = span >> 1; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
            p_s[g][lane] = p;
            __syncwarp();  // every lane has read m_run[g]
            if (lane == 0) {
                const float corr = expf(m_old - m_new);
                corr_s[g] = corr;
                m_run[g] = m_new;
                l_run[g] = l_run[g] * corr + l;
            }
        }
        __syncthreads();
        // Weighted sum of V: a thread takes bf16 pairs of dims (g, w) of the group's heads.
        for (int i = threadIdx.x; i < gn * half; i += blockDim.x) {
            const int g = i / half, w = i % half;
            float ax = 0.0f, ay = 0.0f;
            constexpr int U = 4;  // slots per iteration, their loads together
#pragma unroll 1
            for (int t = 0; t < n_t; t += U) {
#pragma unroll
                for (int u = 0; u < U; u++) {
                    // Past n_t: p_s holds 0, and a zero pair keeps a stale row's bits out.
                    const u32 pair = t + u < n_t ? v_s[(t + u) * row_words + w] : 0u;
                    const float p = p_s[g][t + u];
                    ax = fmaf(p, bf16_to_f32((u16)(pair & 0xffffu)), ax);
                    ay = fmaf(p, bf16_to_f32((u16)(pair >> 16)), ay);
                }
            }
            const float c = corr_s[g];
            float2* acc = reinterpret_cast<float2*>(acc_s + g * hd + 2 * w);
            *acc = make_float2(fmaf(acc->x, c, ax), fmaf(acc->y, c, ay));
        }
        __syncthreads();  // k_s, v_s, p_s and corr_s free for the next chunk
    }
    // The split's partials, for attn2_merge or the tail merge.
    for (int i = threadIdx.x; i < gn * hd; i += blockDim.x) {
        const int g = i / hd, d = i % hd;
        a.part_acc[((size_t)(q0 + g) * splits + rank) * hd + d] = acc_s[i];
    }
    if ((int)threadIdx.x < gn) {
        const size_t at = ((size_t)(q0 + threadIdx.x) * splits + rank) * 2;
        a.part_ml[at] = m_run[threadIdx.x];
        a.part_ml[at + 1] = l_run[threadIdx.x];
    }
    // The merge's weights in k_s, free since the last chunk's barrier.
    static_assert(sizeof(k_s) >= TAIL_SCRATCH_FLOATS * sizeof(float), "k_s holds the tail merge's weights");
    if (counts != nullptr)
        tail_merge_splits<HD>(a, out, counts + (kvh * gridDim.x + blockIdx.x) * ATTNF_COUNTS,
                              reinterpret_cast<float*>(k_s), q0, gn, rank);
    timeline_end();
}
// counts null: the partials for attn2_merge; else merged into out (tail_merge_splits).
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn2_decode(AttnArgs a, float* out, int* counts) {
    attn2_decode_body<0>(a, out, counts);
}
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn2_decode_hd128(AttnArgs a, float* out, int* counts) {
    attn2_decode_body<128>(a, out, counts);
}
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attn2_decode_hd64(AttnArgs a, float* out, int* counts) {
    attn2_decode_body<64>(a, out, counts);
}

// Combines attn2_decode's splits in use ("chunks" here: n_chunks is its grid's splits) of each
// q head. Grid n_q; the chunk weights exp(m_c - M) / L are computed once, in parallel, then
// every output sums its chunks with the loads in flight together.
// The first MERGE_AHEAD chunks' partials are loaded
// together with the position, before the number of chunks in use is known: their addresses
// do not depend on it (the buffers hold n_chunks chunks), so the state, m/l and acc round
// trips become one. Values loaded for chunks past the used ones are never used. Same
// arithmetic in the same order.
// With at most 32 chunks in use, every warp finds M,
// the weights and L itself, lane c taking chunk c, and keeps the weights in its own slice of
// shared memory: no CTA barrier (three before). The same values: the CTA-wide path has only
// warp 0 holding chunks then, and adds the other warps' zeros.
#define MERGE_AHEAD 8
#define MERGE_MAX_WARPS (MAX_HEAD_DIM / 32)
extern "C" __global__ void attn2_merge(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                       const int* __restrict__ state, float* out, int head_dim, int n_chunks,
                                       int max_seq) {
    pdl_enter();
    const int h = blockIdx.x;
    const float* ml = part_ml + (size_t)h * n_chunks * 2;
    const float* acc = part_acc + (size_t)h * n_chunks * head_dim;
    // m and l of chunk `lane` (the per-warp path's) and of chunk d0 (the CTA-wide path's first).
    float2 ml_lane = make_float2(NEG_INF, 0.0f), ml_d0 = ml_lane;
    float acc_ahead[MERGE_AHEAD];
    const int d0 = threadIdx.x, lane = threadIdx.x & 31;
    if (lane < n_chunks) ml_lane = reinterpret_cast<const float2*>(ml)[lane];
    if (d0 != lane && d0 < n_chunks) ml_d0 = reinterpret_cast<const float2*>(ml)[d0];
#pragma unroll
    for (int c = 0; c < MERGE_AHEAD; c++) acc_ahead[c] = c < n_chunks && d0 < head_dim ? acc[(size_t)c * head_dim + d0] : 0.0f;
    const int pos = state[STATE_POSITION];
    if (pos >= max_seq) return;
    // The splits in use, as attn2_decode and attn_long_flat_decode cut them.
    const int used = attn2_splits_used(pos + 1, n_chunks);
    // m and l of chunk c (chunks `lane` and d0 from the early loads).
    auto ml_of = [&](int c) {
        return c == lane ? ml_lane : (c == d0 ? ml_d0 : reinterpret_cast<const float2*>(ml)[c]);
    };
    // out[d] for this thread's d's: the chunks' partial sums weighted by weight[c], times inv.
    auto weighted = [&](const float* weight, float inv) {
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
            float sum = 0.0f;
            int c = 0;
            if (d == d0) {
#pragma unroll
                for (; c < MERGE_AHEAD; c++) {
                    if (c >= used) break;
                    sum = fmaf(acc_ahead[c], weight[c], sum);
                }
            }
#pragma unroll 8
            for (; c < used; c++) sum = fmaf(acc[(size_t)c * head_dim + d], weight[c], sum);
            out[h * head_dim + d] = sum * inv;
        }
    };
    if (used <= 32) {
        __shared__ float warp_weight[MERGE_MAX_WARPS][32];
        const float2 mlc = lane < used ? ml_of(lane) : make_float2(NEG_INF, 0.0f);
        const float M = warp_max(mlc.x);
        const float w = lane < used ? expf(mlc.x - M) : 0.0f;
        const float L = warp_sum(mlc.y * w);
        float* mine = warp_weight[threadIdx.x >> 5];
        mine[lane] = w;
        __syncwarp();
        weighted(mine, 1.0f / L);
        return;
    }
    __shared__ float weight[ATTN2_MAX_CHUNKS];
    __shared__ float red[32];
    float m = NEG_INF;
    for (int c = threadIdx.x; c < used; c += blockDim.x) m = fmaxf(m, ml_of(c).x);
    m = warp_max(m);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    float M = NEG_INF;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) M = fmaxf(M, red[w]);
    __syncthreads();
    float l = 0.0f;
    for (int c = threadIdx.x; c < used; c += blockDim.x) {
        const float2 mlc = ml_of(c);
        const float w = expf(mlc.x - M);
        weight[c] = w;
        l += mlc.y * w;
    }
    l = warp_sum(l);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = l;
    __syncthreads();
    float L = 0.0f;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) L += red[w];
    weighted(weight, 1.0f / L);
}

// out[h*hd + d] = softmax-weighted sum over the splits of head h. Grid n_q, one thread per d.
extern "C" __global__ void attn_merge(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                      const int* __restrict__ state, float* out, int head_dim, int n_splits,
                                      int max_seq) {
    pdl_enter();
    if (state[STATE_POSITION] >= max_seq) return;
    const int h = blockIdx.x;
    const float* ml = part_ml + (size_t)h * n_splits * 2;
    float M = NEG_INF;
    for (int s = 0; s < n_splits; s++) M = fmaxf(M, ml[2 * s]);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float num = 0.0f, den = 0.0f;
        for (int s = 0; s < n_splits; s++) {
            if (ml[2 * s] == NEG_INF) continue;
            float w = expf(ml[2 * s] - M);
            num += part_acc[((size_t)h * n_splits + s) * head_dim + d] * w;
            den += ml[2 * s + 1] * w;
        }
        out[h * head_dim + d] = num / den;
    }
}
