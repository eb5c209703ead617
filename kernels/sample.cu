// The sampler (src/cuda/sample.rs launches it; src/sampling.rs is its reference and says what
// it computes): the logit bias, penalties, then the thresholds of top-k and top-p, then a
// Gumbel-max draw over the ids left. Uses common.cuh.
//
// Everything a request can change is read from device memory (SampleParams, written by the
// host at dv2_set_sampling, and the bias at dv2_set_logit_bias), since kernel arguments are
// frozen in the captured graph. One cooperative kernel (every CTA resident, one per SM) runs
// the phases a setting needs with grid barriers between them, one launch and one graph node a
// step. A phase's time is its chain of L2 round trips (~7 us a select pass, docs/lab.md
// session 24), so the kernel saves passes: top-k counts its first digit in the maximum's pass
// and, when the ids in and above the bin of the k-th largest logit are few, one CTA ranks them
// and finishes; top-p alone draws first and keeps the draw when the winner is in its set.
// Every buffer the kernel counts in (barrier, bins, counts) is zero again when it ends.
//
// Why a Gumbel-max draw: argmax over the kept ids of z_i + G_i, z the logit over the
// temperature and G_i Gumbel noise from Philox keyed by (seed, slot, id), draws from the
// renormalized softmax of the kept ids in one parallel pass, the greedy argmax's reduction,
// with no sort and no prefix sum over the vocabulary; and the draw over a set is the draw over
// any superset whose winner is in the set. Why thresholds: top-k and top-p keep the ids at or
// above a logit, found by a radix select over the logits' order-preserving keys (12, 12 and 8
// bits a pass): top-k counts ids, top-p sums their softmax mass in 2^-44 fixed point, so the
// sums do not depend on the order the CTAs add them in, and every CTA reads the same
// histogram and finds the same bin.

// The settings of the request (src/cuda/sample.rs SampleParams).
struct SampleParams {
    float temperature;
    int top_k;
    float top_p;
    float log_min_p;  // ln(min_p), -inf when min_p is 0
    float repeat_penalty;
    float presence_penalty;
    float frequency_penalty;
    int penalty_last_n;
    u32 seed_lo;
    u32 seed_hi;
};
static_assert(sizeof(SampleParams) == SIZEOF_SAMPLEPARAMS, "SampleParams differs from the host's");

// The kernel's scratch.
struct SampleWork {
    unsigned long long cta_mass[SAMPLE_MAX_CTAS];   // per CTA: the softmax mass of its ids (top-p's total)
    unsigned long long cta_above[SAMPLE_MAX_CTAS];  // per CTA: the mass of its ids above the draw's winner
    unsigned barrier_count;  // CTAs arrived at the current grid barrier
    unsigned barrier_gen;    // barriers completed (only rises)
    int n_saved;             // window entries penalize() saved for the draw to restore
    int n_candidates;        // top-k's candidates gathered so far (zero between launches)
    float cta_max[SAMPLE_MAX_CTAS];
    float cta_best[SAMPLE_MAX_CTAS];  // per CTA: its Gumbel-max winner's key and id
    int cta_best_i[SAMPLE_MAX_CTAS];
    int candidates[SAMPLE_CANDIDATES];  // top-k's candidates, for the one-CTA finish
};
static_assert(sizeof(SampleWork) == 4 * SAMPLE_WORK_WORDS, "SampleWork differs from the host's");
static_assert(SAMPLE_BINS % SAMPLE_THREADS == 0, "a thread reads SAMPLE_BINS / SAMPLE_THREADS bins");
static_assert(SAMPLE_CANDIDATES <= SAMPLE_THREADS, "a thread ranks one candidate");
static_assert(2 * SAMPLE_CANDIDATES <= SAMPLE_BINS, "the candidates and the ids kept fit in the histogram's halves");

// The logits the draw changes in place and puts back at its end: the logit bias's (bias: its
// count, then per id (id, bias bits, the logit it replaced)), then the penalties' (saved).
struct Changed {
    int* bias;
    const int* saved;
    int biased;
    int penalties;
};

// The radix select's passes: key bits [20, 32), [8, 20), [0, 8).
__device__ __forceinline__ int select_shift(int pass) { return pass == 0 ? 20 : pass == 1 ? 8 : 0; }
__device__ __forceinline__ int select_bits(int pass) { return pass == 2 ? 8 : 12; }

// A key that orders floats as their values do (-inf lowest), with NaN at 0 below all of them.
__device__ __forceinline__ u32 order_key(float f) {
    if (f != f) return 0u;
    const u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Philox4x32-10 of `c` under (k0, k1) (src/sampling.rs philox4x32).
__device__ __forceinline__ uint4 philox4x32(uint4 c, u32 k0, u32 k1) {
#pragma unroll
    for (int round = 0; round < 10; round++) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const u32 hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const u32 hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    }
    return c;
}

// Gumbel noise -ln(E), E = -ln(1 - v) exponential, v uniform in (0, 1) from 32 random bits
// (src/sampling.rs gumbel: the same operations, each rounded alike).
__device__ __forceinline__ float gumbel(u32 r) {
    const float v = __fmul_rn(__fadd_rn(__uint2float_rn(r), 0.5f), 2.3283064365386963e-10f);
    return -logf(-log1pf(-v));
}

// z = (l - max) / t <= 0: the logit the softmax and the Gumbel draw take.
__device__ __forceinline__ float scaled_logit(float l, float max, float t) { return __fdiv_rn(__fsub_rn(l, max), t); }

// The softmax weight exp(z) in 2^-44 fixed point.
__device__ __forceinline__ unsigned long long fixed_weight(float z) {
    return __float2ull_rz(__fmul_rn(expf(z), 17592186044416.0f));
}

__device__ __forceinline__ unsigned long long fixed_mass(float l, float max, float t) {
    return fixed_weight(scaled_logit(l, max, t));
}

// A select's target clamped to [1, total]: the most likely id stays, and a target past the
// total keeps every id.
__device__ __forceinline__ unsigned long long clamp_target(unsigned long long target, unsigned long long total) {
    return min(max(target, 1ull), total);
}

// The mass top-p keeps the ids strictly above which weigh less than: top_p of `total`. Every
// path that decides top-p (select_threshold's passes, the one-CTA finish, the rejection's
// check) takes it from here, so that they keep the same ids.
__device__ __forceinline__ unsigned long long top_p_target(unsigned long long total, float top_p) {
    return clamp_target((unsigned long long)((double)total * (double)top_p), total);
}

__device__ __forceinline__ float block_max(float v) {
    __shared__ float s[32];
    v = warp_max(v);
    __syncthreads();  // s is free (an earlier call may still read it)
    if ((threadIdx.x & 31) == 0) s[threadIdx.x >> 5] = v;
    __syncthreads();
    v = s[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); w++) v = fmaxf(v, s[w]);
    return v;
}

// `after`: the sum of `v` over the CTA's threads after this one; `total`: over all of them.
__device__ __forceinline__ void block_suffix_sum(unsigned long long v, unsigned long long& after,
                                                 unsigned long long& total) {
    __shared__ unsigned long long s_warp[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned long long incl = v;
    __syncthreads();  // s_warp is free (an earlier call may still read it)
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long x = __shfl_down_sync(0xffffffffu, incl, o);
        if (lane + o < 32) incl += x;
    }
    if (lane == 0) s_warp[warp] = incl;
    __syncthreads();
    after = incl - v;
    total = 0;
    for (int u = 0; u < (int)(blockDim.x >> 5); u++) {
        total += s_warp[u];
        if (u > warp) after += s_warp[u];
    }
}

// f(logit, index) for this thread's share of the logits (grid-stride), LOAD_BATCH loads in
// flight at a time: the logits are in L2, and a loop that waits for each load before the next
// pays the L2's latency per logit.
template <typename F>
__device__ __forceinline__ void for_logits(const float* __restrict__ logits, int vocab, F f) {
    constexpr int LOAD_BATCH = 4;
    const int stride = gridDim.x * blockDim.x;
    for (int base = blockIdx.x * blockDim.x + threadIdx.x; base < vocab; base += LOAD_BATCH * stride) {
        float v[LOAD_BATCH];
#pragma unroll
        for (int u = 0; u < LOAD_BATCH; u++) {
            const int i = base + u * stride;
            v[u] = i < vocab ? logits[i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < LOAD_BATCH; u++)
            if (base + u * stride < vocab) f(v[u], base + u * stride);
    }
}

// Every CTA of the (cooperative) grid waits here until all have arrived; their writes before
// it are visible to all after it (as cooperative groups' grid sync).
__device__ __forceinline__ void grid_barrier(SampleWork* w) {
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile unsigned* gen = &w->barrier_gen;
        const unsigned g = *gen;
        __threadfence();
        if (atomicAdd(&w->barrier_count, 1u) == gridDim.x - 1) {
            w->barrier_count = 0;
            __threadfence();
            atomicAdd(&w->barrier_gen, 1u);
        } else {
            while (*gen == g) {
            }
        }
        __threadfence();
    }
    __syncthreads();
}

// The logit bias added in place in the logits, by one CTA, each id's logit saved beside its
// bias for the draw to put back (the ids are distinct: src/sampling.rs LogitBias).
__device__ void add_bias(float* logits, int* bias) {
    const int n = bias[0];
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        int* e = bias + 1 + 3 * j;
        const float l = logits[e[0]];
        e[2] = __float_as_int(l);
        logits[e[0]] = __fadd_rn(l, __int_as_float(e[1]));
    }
    __syncthreads();
}

// The penalties over the window (the last penalty_last_n ids before `slot`, -1: all) in place
// in the logits, by one CTA: counts per id in `counts` (zero before and after), and the first
// window entry of each id saves that id's logit in `saved` (pairs: id or -1, logit bits) for
// the draw to put back, so that the logits read back afterwards are the model's.
__device__ void penalize(float* logits, int vocab, int slot, const SampleParams* p, SampleWork* w,
                         const int* __restrict__ hist, int* counts, int* saved) {
    const int n = p->penalty_last_n < 0 ? slot : min(p->penalty_last_n, slot);
    const int* window = hist + (slot - n);
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const int id = window[j];
        if (id >= 0 && id < vocab) atomicAdd(&counts[id], 1);
    }
    __syncthreads();
    const float rp = p->repeat_penalty, fp = p->frequency_penalty, pp = p->presence_penalty;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const int id = window[j];
        const int c = id >= 0 && id < vocab ? atomicExch(&counts[id], 0) : 0;
        saved[2 * j] = c ? id : -1;
        if (!c) continue;
        const float l = logits[id];
        saved[2 * j + 1] = __float_as_int(l);
        const float v = l > 0.0f ? __fdiv_rn(l, rp) : __fmul_rn(l, rp);
        logits[id] = __fsub_rn(v, __fadd_rn(__fmul_rn((float)c, fp), pp));
    }
    if (threadIdx.x == 0) w->n_saved = n;
}


// The CTA's histogram in shared memory (`lo`, `hi`: the 32-bit halves of each bin) added into
// the grid's `buffer`.
__device__ __forceinline__ void add_histogram(const u32* lo, const u32* hi, unsigned long long* buffer, int n_bins) {
    __syncthreads();
    for (int b = threadIdx.x; b < n_bins; b += blockDim.x) {
        const unsigned long long v = (unsigned long long)hi[b] << 32 | lo[b];
        if (v) atomicAdd(&buffer[b], v);
    }
}

// The largest logit, in every CTA (each reduces the CTAs' maxima in the same order). With
// `counts`, the same read of the logits counts their keys' top 12 bits into it (NaN left out):
// top-k's first select pass, at the price of shared atomics instead of a pass of its own.
__device__ float grid_max(const float* __restrict__ logits, int vocab, SampleWork* w, unsigned long long* counts,
                          u32* lo, u32* hi) {
    if (counts) {
        for (int b = threadIdx.x; b < SAMPLE_BINS; b += blockDim.x) lo[b] = hi[b] = 0;
        __syncthreads();
    }
    float m = NEG_INF;
    for_logits(logits, vocab, [&](float l, int) {
        m = fmaxf(m, l);
        const u32 key = order_key(l);
        if (counts && key) atomicAdd(&lo[key >> select_shift(0)], 1u);
    });
    if (counts) add_histogram(lo, hi, counts, SAMPLE_BINS);
    m = block_max(m);
    if (threadIdx.x == 0) w->cta_max[blockIdx.x] = m;
    grid_barrier(w);
    float v = NEG_INF;
    for (int c = threadIdx.x; c < (int)gridDim.x; c += blockDim.x) v = fmaxf(v, __ldcg(&w->cta_max[c]));
    return block_max(v);
}

// A bin of a select pass: the lowest non-empty bin whose weight above it is under the target.
struct Pick {
    int bin;                    // n_bins where the histogram is empty (every logit NaN)
    unsigned long long target;  // the target less the weight above the bin
    unsigned long long above;   // the weight of the bins above it
    unsigned long long weight;  // the bin's
};

// The bin of the grid's histogram `buffer` (after the barrier that completed it), the same in
// every CTA: each reads the whole histogram into `lo`, `hi`, all of a thread's loads in flight
// at once (one L2 round trip, not one per bin). `fraction` >= 0: the target is that fraction
// of the histogram's total (top-p's first pass, top_p_target); else `target`, clamped.
__device__ Pick pick_bin(const unsigned long long* buffer, int n_bins, unsigned long long target, float fraction,
                         u32* lo, u32* hi) {
    __shared__ Pick s_pick;
    {
        constexpr int PER = SAMPLE_BINS / SAMPLE_THREADS;
        unsigned long long v[PER];
#pragma unroll
        for (int u = 0; u < PER; u++) {
            const int b = threadIdx.x + u * SAMPLE_THREADS;
            v[u] = b < n_bins ? __ldcg(&buffer[b]) : 0ull;
        }
#pragma unroll
        for (int u = 0; u < PER; u++) {
            const int b = threadIdx.x + u * SAMPLE_THREADS;
            if (b < n_bins) lo[b] = (u32)v[u], hi[b] = (u32)(v[u] >> 32);
        }
    }
    const auto h = [&](int b) { return (unsigned long long)hi[b] << 32 | lo[b]; };
    if (threadIdx.x == 0) s_pick.bin = n_bins;
    __syncthreads();
    // Each thread takes a run of bins; `above`: the weight of the runs above its run.
    const int per = (n_bins + blockDim.x - 1) / blockDim.x, b0 = threadIdx.x * per, b1 = min(n_bins, b0 + per);
    unsigned long long run = 0;
    for (int b = b0; b < b1; b++) run += h(b);
    unsigned long long above, total;
    block_suffix_sum(run, above, total);
    target = fraction >= 0.0f ? top_p_target(total, fraction) : clamp_target(target, total);
    int found = n_bins;
    unsigned long long found_above = 0;
    for (int b = b1 - 1; b >= b0; b--) {
        if (h(b) && above < target) found = b, found_above = above;
        above += h(b);
    }
    atomicMin(&s_pick.bin, found);
    __syncthreads();
    if (found == s_pick.bin && found < n_bins) {
        s_pick.target = target - found_above;
        s_pick.above = found_above;
        s_pick.weight = h(found);
    }
    __syncthreads();
    const Pick pick = s_pick;
    __syncthreads();  // s_pick is read before a later call writes it
    return pick;
}

// A threshold over the ids kept so far (key >= tau) by a radix select: top-k (by_mass false:
// each id weighs 1, the target is k) or top-p (each weighs its softmax mass, the target is top_p
// of the kept mass). The threshold is the smallest key whose kept ids strictly above it weigh
// less than the target: the k-th largest logit, or the least likely logit top-p keeps. Each of
// the passes from `first_pass` (an earlier one found `prefix` and left `target`; from the
// first: top-k's k, while top-p's first pass sets its own) histograms one digit of the keys
// under the prefix fixed so far into its own buffer of `bins` (zero before; `dirty`, the
// buffer of the pass before, is zeroed after this pass's barrier, when every CTA has read it,
// the last one by the draw); then every CTA finds the same bin
// (pick_bin). A top-k that needs every id of the bin it found is done there (its lower bound
// is the threshold). `lo`, `hi`: the CTA's histogram in shared memory as 32-bit halves:
// Hopper's shared 64-bit atomic add is a compare-and-swap loop (ATOMS.CAST.SPIN.64 in the
// SASS), which contended bins made the pass's slowest part; two native 32-bit adds with the
// carry sum the same integers. Returns the threshold (a key past every key where nothing is
// kept).
__device__ u32 select_threshold(const float* __restrict__ logits, int vocab, SampleWork* w, const SampleParams* p,
                                unsigned long long* bins, int first_buffer, bool by_mass, u32 tau, float m, u32* lo,
                                u32* hi, int& dirty, int first_pass, u32 prefix, unsigned long long target) {
    const float t = p->temperature;
    for (int pass = first_pass; pass < 3; pass++) {
        const int shift = select_shift(pass), n_bins = 1 << select_bits(pass);
        const u32 mask = pass == 0 ? 0u : ~((1u << (shift + select_bits(pass))) - 1u);
        unsigned long long* buffer = bins + (size_t)(first_buffer + pass) * SAMPLE_BINS;
        for (int b = threadIdx.x; b < n_bins; b += blockDim.x) lo[b] = hi[b] = 0;
        __syncthreads();
        for_logits(logits, vocab, [&](float l, int) {
            const u32 key = order_key(l);
            if (key < tau || (key & mask) != prefix) return;
            const int b = (key >> shift) & (n_bins - 1);
            if (!by_mass) {
                atomicAdd(&lo[b], 1u);
                return;
            }
            const unsigned long long v = fixed_mass(l, m, t);
            const u32 low = (u32)v, old = atomicAdd(&lo[b], low);
            const u32 high = (u32)(v >> 32) + (old + low < old ? 1u : 0u);
            if (high) atomicAdd(&hi[b], high);
        });
        add_histogram(lo, hi, buffer, n_bins);
        grid_barrier(w);
        if (dirty >= 0) {
            // The previous pass's buffer: every CTA read it before this pass's barrier.
            unsigned long long* done = bins + (size_t)dirty * SAMPLE_BINS;
            for (int b = blockIdx.x * blockDim.x + threadIdx.x; b < SAMPLE_BINS; b += gridDim.x * blockDim.x)
                done[b] = 0;
        }
        dirty = first_buffer + pass;
        const Pick pick = pick_bin(buffer, n_bins, target, by_mass && pass == 0 ? p->top_p : -1.0f, lo, hi);
        if (pick.bin == n_bins) return 0xffffffffu;
        prefix |= (u32)pick.bin << shift;
        target = pick.target;
        if (!by_mass && pick.target == pick.weight) return prefix;
    }
    return prefix;
}

// The Gumbel-max key of id i (logit l, z = (l - max) / t) in the draw for `slot`: Philox's
// block (slot, i / 4), word i % 4 (src/sampling.rs gumbel).
__device__ __forceinline__ float gumbel_key(float z, int i, unsigned long long slot, u32 k0, u32 k1) {
    const uint4 r = philox4x32(make_uint4((u32)slot, (u32)(slot >> 32), (u32)(i >> 2), 0u), k0, k1);
    const int u = i & 3;
    return __fadd_rn(z, gumbel(u == 0 ? r.x : u == 1 ? r.y : u == 2 ? r.z : r.w));
}

// This thread's share of the draw (grid-stride over groups of 4 ids, a Philox block each): the
// kept id (key >= tau, z >= ln(min_p)) of the largest z + gumbel into (best, best_i), or at
// temperature 0 the argmax of the logits. MASS: `mass` also sums the softmax mass of the ids at
// or above tau (min-p aside), top-p's total.
template <bool MASS>
__device__ __forceinline__ void draw_share(const float* __restrict__ logits, int vocab, float m, const SampleParams* p,
                                           u32 tau, unsigned long long slot, float& best, int& best_i,
                                           unsigned long long& mass) {
    const float t = p->temperature, log_min_p = p->log_min_p;
    const u32 k0 = p->seed_lo, k1 = p->seed_hi;
    const int groups = (vocab + 3) >> 2;
    for (int q = blockIdx.x * blockDim.x + threadIdx.x; q < groups; q += gridDim.x * blockDim.x) {
        float l[4];
        if (4 * q + 3 < vocab) {
            const float4 v = reinterpret_cast<const float4*>(logits)[q];
            l[0] = v.x, l[1] = v.y, l[2] = v.z, l[3] = v.w;
        } else {
            for (int u = 0; u < 4; u++) l[u] = 4 * q + u < vocab ? logits[4 * q + u] : __int_as_float(0x7fc00000);
        }
        uint4 r = make_uint4(0, 0, 0, 0);
        bool drawn = false;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            float s = l[u];
            if (s != s) continue;
            if (t > 0.0f) {
                if (order_key(l[u]) < tau) continue;
                const float z = scaled_logit(l[u], m, t);
                if (MASS) mass += fixed_weight(z);
                if (!(z >= log_min_p)) continue;
                if (!drawn) {
                    r = philox4x32(make_uint4((u32)slot, (u32)(slot >> 32), (u32)q, 0u), k0, k1);
                    drawn = true;
                }
                s = __fadd_rn(z, gumbel(u == 0 ? r.x : u == 1 ? r.y : u == 2 ? r.z : r.w));
            }
            if (argmax_beats(s, 4 * q + u, best, best_i)) best = s, best_i = 4 * q + u;
        }
    }
}

// The draw's end, in the one CTA that has the id: next_token, the logits the penalties and the
// bias changed put back (the penalties' first: an id of both saved the biased logit there),
// the histogram buffer last used (dirty >= 0) zeroed.
__device__ void finish_draw(int id, float* logits, int* state, const SampleWork* w, Changed changed,
                            unsigned long long* bins, int dirty) {
    if (threadIdx.x == 0) state[STATE_NEXT_TOKEN] = id < 0 ? 0 : id;
    const int n_saved = changed.penalties ? __ldcg(&w->n_saved) : 0;
    for (int j = threadIdx.x; j < n_saved; j += blockDim.x) {
        const int i = __ldcg(&changed.saved[2 * j]);
        if (i >= 0) logits[i] = __int_as_float(__ldcg(&changed.saved[2 * j + 1]));
    }
    if (changed.biased) {
        __syncthreads();
        const int n = __ldcg(&changed.bias[0]);
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            const int* e = changed.bias + 1 + 3 * j;
            logits[__ldcg(&e[0])] = __int_as_float(__ldcg(&e[2]));
        }
    }
    if (dirty >= 0)
        for (int b = threadIdx.x; b < SAMPLE_BINS; b += blockDim.x) bins[(size_t)dirty * SAMPLE_BINS + b] = 0;
}

// Top-k's candidates: the ids whose key's top 12 bits are at least `bin`, the bin of the k-th
// largest logit (so every id top-k keeps, and every id above any of them), into
// w->candidates: a CTA's in shared memory (`lo`) first, then one atomic for its run of the list.
__device__ void gather_candidates(const float* __restrict__ logits, int vocab, SampleWork* w, int bin, u32* lo) {
    __shared__ int s_n, s_base;
    if (threadIdx.x == 0) s_n = 0;
    __syncthreads();
    for_logits(logits, vocab, [&](float l, int i) {
        const u32 key = order_key(l);
        if (key && (int)(key >> select_shift(0)) >= bin) lo[atomicAdd(&s_n, 1)] = (u32)i;
    });
    __syncthreads();
    if (threadIdx.x == 0) s_base = s_n ? atomicAdd(&w->n_candidates, s_n) : 0;
    __syncthreads();
    for (int j = threadIdx.x; j < s_n; j += blockDim.x) w->candidates[s_base + j] = (int)lo[j];
}

// Top-k, top-p, min-p and the draw over top-k's n candidates, in one CTA (the first), a thread
// per candidate: a candidate stays in top-k when fewer than k candidates are strictly above
// it; a kept id stays in top-p when the kept ids strictly above it weigh less than top_p of
// the kept mass (2^-44 fixed point, as select_threshold's); then min-p, the Gumbel-max draw
// and finish_draw. The thresholds' passes keep the same ids, by construction. `lo`, `hi`:
// the candidates' ids and keys, then from SAMPLE_CANDIDATES those top-k keeps.
__device__ void finish_from_candidates(float* logits, int n, int* state, const SampleParams* p, SampleWork* w,
                                       Changed changed, unsigned long long* bins, int dirty, float m,
                                       unsigned long long slot, u32* lo, u32* hi) {
    __shared__ unsigned long long s_mass[SAMPLE_CANDIDATES];
    __shared__ int s_kept;
    u32 *ids = lo, *keys = hi, *kept_ids = lo + SAMPLE_CANDIDATES, *kept_keys = hi + SAMPLE_CANDIDATES;
    const int j = threadIdx.x;
    if (j < n) {
        const int i = __ldcg(&w->candidates[j]);
        ids[j] = (u32)i;
        keys[j] = order_key(logits[i]);
    }
    if (j == 0) s_kept = 0;
    __syncthreads();
    if (j < n) {
        const u32 key = keys[j];
        int above = 0;
        for (int q = 0; q < n; q++) above += keys[q] > key;
        if (above < p->top_k) {
            const int at = atomicAdd(&s_kept, 1);
            kept_ids[at] = ids[j];
            kept_keys[at] = key;
        }
    }
    __syncthreads();
    const int kept = s_kept;
    const float t = p->temperature;
    unsigned long long mine = 0;
    if (j < kept) mine = s_mass[j] = fixed_mass(logits[kept_ids[j]], m, t);
    unsigned long long rest, mass;
    block_suffix_sum(mine, rest, mass);  // its barrier publishes s_mass
    const unsigned long long target = top_p_target(mass, p->top_p);
    float best = NEG_INF;
    int best_i = -1;
    if (j < kept) {
        const u32 key = kept_keys[j];
        unsigned long long above = 0;
        for (int q = 0; q < kept; q++)
            if (kept_keys[q] > key) above += s_mass[q];
        const int i = (int)kept_ids[j];
        const float z = scaled_logit(logits[i], m, t);
        if ((p->top_p >= 1.0f || above < target) && z >= p->log_min_p) {
            best = gumbel_key(z, i, slot, p->seed_lo, p->seed_hi);
            best_i = i;
        }
    }
    block_argmax(best, best_i);
    finish_draw(best_i, logits, state, w, changed, bins, dirty);
    if (threadIdx.x == 0) w->n_candidates = 0;
}

// Top-p without top-k by rejection: the Gumbel-max draw over every id min-p keeps, summing
// the total mass on the way; then one pass weighs the ids strictly above the winner. When
// they weigh less than top_p of the total, the winner is in top-p's set, and so also the draw
// over that set (the same keys over a subset that holds the winner): the id the thresholds'
// passes would find, two passes sooner. Else (less than 1 - top_p of the time) it returns
// false, the CTAs' scratch read, and the caller takes the passes. Returns true having finished.
__device__ bool draw_in_top_p(float* logits, int vocab, int* state, const SampleParams* p, SampleWork* w,
                              Changed changed, float m, unsigned long long slot) {
    __shared__ int s_winner;
    float best = NEG_INF;
    int best_i = -1;
    unsigned long long mass = 0, rest, total;
    draw_share<true>(logits, vocab, m, p, 1u, slot, best, best_i, mass);
    block_argmax(best, best_i);
    block_suffix_sum(mass, rest, total);
    if (threadIdx.x == 0) {
        w->cta_best[blockIdx.x] = best;
        w->cta_best_i[blockIdx.x] = best_i;
        w->cta_mass[blockIdx.x] = total;
    }
    grid_barrier(w);
    // The grid's winner and total mass, the same in every CTA (the argmax is a total order).
    best = NEG_INF, best_i = -1, mass = 0;
    for (int c = threadIdx.x; c < (int)gridDim.x; c += blockDim.x) {
        const float v = __ldcg(&w->cta_best[c]);
        const int i = __ldcg(&w->cta_best_i[c]);
        if (argmax_beats(v, i, best, best_i)) best = v, best_i = i;
        mass += __ldcg(&w->cta_mass[c]);
    }
    block_argmax(best, best_i);
    block_suffix_sum(mass, rest, total);
    if (threadIdx.x == 0) s_winner = best_i;
    __syncthreads();
    const int winner = s_winner;
    if (winner < 0) {  // every logit NaN
        if (blockIdx.x == 0) finish_draw(winner, logits, state, w, changed, nullptr, -1);
        return true;
    }
    const u32 key_w = order_key(logits[winner]);
    const float t = p->temperature;
    unsigned long long above = 0, cta_above;
    for_logits(logits, vocab, [&](float l, int) {
        if (order_key(l) > key_w) above += fixed_mass(l, m, t);
    });
    block_suffix_sum(above, rest, cta_above);
    if (threadIdx.x == 0) w->cta_above[blockIdx.x] = cta_above;
    grid_barrier(w);
    above = 0;
    for (int c = threadIdx.x; c < (int)gridDim.x; c += blockDim.x) above += __ldcg(&w->cta_above[c]);
    block_suffix_sum(above, rest, cta_above);
    const unsigned long long target = top_p_target(total, p->top_p);
    if (cta_above >= target) return false;
    if (blockIdx.x == 0) finish_draw(winner, logits, state, w, changed, nullptr, -1);
    return true;
}

// The sampler: state[NEXT_TOKEN] = the kept id of the largest z + gumbel (z = (l - max) / t;
// kept: at or above the top-k and top-p thresholds, z >= ln(min_p)), or at temperature 0 the
// argmax (lowest id on a tie) of the penalized logits, the logit bias added first; the slot the
// id takes is state[POSITION] + slot_offset (the decode step draws before its commit, the
// prefill after its last advance). `biased`, `penalties`, `top_k`, `top_p`: the phases the
// captured plan runs (the host's Plan). Top-k counts its first digit in the maximum's pass;
// when its candidates are few, one CTA finishes over them (finish_from_candidates), else the
// select's passes go on.
// Top-p alone first tries the draw by rejection (draw_in_top_p). `shortcuts` 0
// (DV2_SAMPLE_SHORTCUTS=0): the select's passes alone. The passes end in the draw over the
// whole vocabulary, whose last CTA (argmax_across_ctas) writes the id, puts back the logits
// the bias and the penalties changed and zeroes the histogram buffer last used.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_draw(float* logits, int vocab, int* state, int slot_offset, const SampleParams* p, SampleWork* w,
                unsigned long long* bins, int* scratch, const int* __restrict__ hist, int* counts, int* saved,
                int* bias, int biased, int penalties, int top_k, int top_p, int shortcuts) {
    pdl_enter();
    if (state[STATE_FINISHED]) return;
    __shared__ u32 lo[SAMPLE_BINS], hi[SAMPLE_BINS];
    const int slot_i = state[STATE_POSITION] + slot_offset;
    const Changed changed = {bias, saved, biased, penalties};
    if (biased || penalties) {
        if (blockIdx.x == 0) {
            if (biased) add_bias(logits, bias);
            if (penalties) penalize(logits, vocab, slot_i, p, w, hist, counts, saved);
        }
        grid_barrier(w);
    }
    const unsigned long long slot = (unsigned long long)slot_i;
    float m = 0.0f;
    u32 tau = 1u;    // every id but NaN
    int dirty = -1;  // the histogram buffer last used
    if (p->temperature > 0.0f) {
        m = grid_max(logits, vocab, w, top_k && shortcuts ? bins : nullptr, lo, hi);
        if (top_k && !shortcuts) {
            tau = select_threshold(logits, vocab, w, p, bins, 0, false, tau, m, lo, hi, dirty, 0, 0u,
                                   (unsigned long long)p->top_k);
        } else if (top_k) {
            dirty = 0;  // grid_max counted into top-k's first buffer
            const Pick pick = pick_bin(bins, SAMPLE_BINS, (unsigned long long)p->top_k, -1.0f, lo, hi);
            const u32 prefix = (u32)pick.bin << select_shift(0);
            if (pick.bin == SAMPLE_BINS) {
                tau = 0xffffffffu;  // every logit NaN
            } else if (pick.above + pick.weight <= SAMPLE_CANDIDATES) {
                gather_candidates(logits, vocab, w, pick.bin, lo);
                grid_barrier(w);
                if (blockIdx.x == 0)
                    finish_from_candidates(logits, (int)(pick.above + pick.weight), state, p, w, changed, bins,
                                           dirty, m, slot, lo, hi);
                return;
            } else if (pick.target == pick.weight) {
                tau = prefix;  // every id of the bin stays
            } else {
                tau = select_threshold(logits, vocab, w, p, bins, 0, false, tau, m, lo, hi, dirty, 1, prefix,
                                       pick.target);
            }
        } else if (top_p && shortcuts && draw_in_top_p(logits, vocab, state, p, w, changed, m, slot)) {
            return;
        }
        if (top_p) tau = select_threshold(logits, vocab, w, p, bins, 3, true, tau, m, lo, hi, dirty, 0, 0u, 0ull);
    }
    float best = NEG_INF;
    int best_i = -1;
    unsigned long long unused = 0;
    draw_share<false>(logits, vocab, m, p, tau, slot, best, best_i, unused);
    block_argmax(best, best_i);
    if (!argmax_across_ctas(best, best_i, scratch)) return;
    finish_draw(best_i, logits, state, w, changed, bins, dirty);
}
