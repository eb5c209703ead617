// The sampler (src/cuda/sample.rs launches it; src/sampling.rs is its reference and says what
// it computes): penalties, then the thresholds of top-k and top-p, then a Gumbel-max draw over
// the ids left. Uses common.cuh.
//
// Everything a request can change is read from device memory (SampleParams, written by the
// host at dv2_set_sampling), since kernel arguments are frozen in the captured graph. One
// cooperative kernel (every CTA resident, one per SM) runs the phases a setting needs with
// grid barriers between them, one launch and one graph node a step. (It measured no faster than
// a kernel per phase: a phase's time is its chain of L2 round trips, ~7 us a select pass,
// docs/lab.md session 24.) Every buffer the kernel counts in (barrier, bins, counts) is zero
// again when it ends.
//
// Why a Gumbel-max draw: argmax over the kept ids of z_i + G_i, z the logit over the
// temperature and G_i Gumbel noise from Philox keyed by (seed, slot, id), draws from the
// renormalized softmax of the kept ids in one parallel pass, the greedy argmax's reduction,
// with no sort and no prefix sum over the vocabulary. Why thresholds: top-k and top-p keep the
// ids at or above a logit, found by a radix select over the logits' order-preserving keys
// (12, 12 and 8 bits a pass): top-k counts ids, top-p sums their softmax mass in 2^-44 fixed
// point, so the sums do not depend on the order the CTAs add them in, and every CTA reads the
// same histogram and finds the same bin.

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
    unsigned barrier_count;  // CTAs arrived at the current grid barrier
    unsigned barrier_gen;    // barriers completed (only rises)
    int n_saved;             // window entries penalize() saved for the draw to restore
    int n_kept;              // ids gathered into `kept` (zero between launches)
    float cta_max[SAMPLE_MAX_CTAS];
    int kept[SAMPLE_LOCAL_MAX];  // the ids top-k kept, for the one-CTA finish
};
static_assert(sizeof(SampleWork) == 4 * SAMPLE_WORK_WORDS, "SampleWork differs from the host's");
static_assert(SAMPLE_BINS % SAMPLE_THREADS == 0, "a thread reads SAMPLE_BINS / SAMPLE_THREADS bins");

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

// The softmax weight exp(z), z = (l - max) / t <= 0, in 2^-44 fixed point.
__device__ __forceinline__ unsigned long long fixed_mass(float l, float max, float t) {
    return __float2ull_rz(__fmul_rn(expf(__fdiv_rn(__fsub_rn(l, max), t)), 17592186044416.0f));
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

// The largest logit, in every CTA (each reduces the CTAs' maxima in the same order).
__device__ float grid_max(const float* __restrict__ logits, int vocab, SampleWork* w) {
    float m = NEG_INF;
    for_logits(logits, vocab, [&](float l, int) { m = fmaxf(m, l); });
    m = block_max(m);
    if (threadIdx.x == 0) w->cta_max[blockIdx.x] = m;
    grid_barrier(w);
    float v = NEG_INF;
    for (int c = threadIdx.x; c < (int)gridDim.x; c += blockDim.x) v = fmaxf(v, __ldcg(&w->cta_max[c]));
    return block_max(v);
}

// A threshold over the ids kept so far (key >= tau) by a radix select: top-k (by_mass false:
// each id weighs 1, the target is k) or top-p (each weighs its softmax mass, the target is top_p
// of the kept mass). The threshold is the smallest key whose kept ids strictly above it weigh
// less than the target: the k-th largest logit, or the least likely logit top-p keeps. Each of
// the 3 passes histograms one digit of the keys under the prefix fixed so far into its own
// buffer of `bins` (zero before; `dirty`, the buffer of the pass before, is zeroed after this
// pass's barrier, when every CTA has read it, the last one by the draw); after the barrier every CTA
// reads the whole histogram and finds the same bin. A top-k that needs every id of the bin it
// found is done there (its lower bound is the threshold). `lo`, `hi`: the CTA's histogram in
// shared memory as 32-bit halves (SAMPLE_BINS each): Hopper's shared 64-bit atomic add is a
// compare-and-swap loop (ATOMS.CAST.SPIN.64 in the SASS), which contended bins made the pass's
// slowest part; two native 32-bit adds with the carry sum the same integers.
// Returns the threshold (a key past every key where nothing is kept).
__device__ u32 select_threshold(const float* __restrict__ logits, int vocab, SampleWork* w, const SampleParams* p,
                                unsigned long long* bins, int first_buffer, bool by_mass, u32 tau, float m, u32* lo,
                                u32* hi, int& dirty) {
    __shared__ int s_bin;
    __shared__ unsigned long long s_target;
    const float t = p->temperature;
    u32 prefix = 0;
    unsigned long long target = by_mass ? 0ull : (unsigned long long)p->top_k;
    for (int pass = 0; pass < 3; pass++) {
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
        __syncthreads();
        for (int b = threadIdx.x; b < n_bins; b += blockDim.x) {
            const unsigned long long v = (unsigned long long)hi[b] << 32 | lo[b];
            if (v) atomicAdd(&buffer[b], v);
        }
        grid_barrier(w);
        if (dirty >= 0) {
            // The previous pass's buffer: every CTA read it before this pass's barrier.
            unsigned long long* done = bins + (size_t)dirty * SAMPLE_BINS;
            for (int b = blockIdx.x * blockDim.x + threadIdx.x; b < SAMPLE_BINS; b += gridDim.x * blockDim.x)
                done[b] = 0;
        }
        dirty = first_buffer + pass;
        // The whole histogram, in the same halves: all of a thread's loads in flight at once
        // (one L2 round trip, not one per bin).
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
        if (threadIdx.x == 0) s_bin = n_bins;
        __syncthreads();
        // Each thread takes a run of bins; `above`: the weight of the runs above its run.
        const int per = (n_bins + blockDim.x - 1) / blockDim.x, b0 = threadIdx.x * per,
                  b1 = min(n_bins, b0 + per);
        unsigned long long run = 0;
        for (int b = b0; b < b1; b++) run += h(b);
        unsigned long long above, total;
        block_suffix_sum(run, above, total);
        if (pass == 0 && by_mass) target = (unsigned long long)((double)total * (double)p->top_p);
        // At least the most likely id stays, and a target past the total keeps every id.
        target = min(max(target, 1ull), total);
        // The lowest non-empty bin whose weight above it is under the target.
        int found = n_bins;
        unsigned long long found_above = 0;
        for (int b = b1 - 1; b >= b0; b--) {
            if (h(b) && above < target) found = b, found_above = above;
            above += h(b);
        }
        atomicMin(&s_bin, found);
        __syncthreads();
        if (found == s_bin && found < n_bins) s_target = target - found_above;
        __syncthreads();
        if (s_bin == n_bins) return 0xffffffffu;  // nothing to keep (every logit NaN)
        prefix |= (u32)s_bin << shift;
        target = s_target;
        const bool whole_bin = !by_mass && target == h(s_bin);
        __syncthreads();  // s_bin and s_target are read before the next pass writes them
        if (whole_bin) return prefix;
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

// The draw's end, in the one CTA that has the id: next_token, the logits the penalties changed
// put back, the histogram buffer last used zeroed.
__device__ void finish_draw(int id, float* logits, int* state, const SampleWork* w, const int* saved, int penalties,
                            unsigned long long* bins, int dirty) {
    if (threadIdx.x == 0) state[STATE_NEXT_TOKEN] = id < 0 ? 0 : id;
    const int n_saved = penalties ? __ldcg(&w->n_saved) : 0;
    for (int j = threadIdx.x; j < n_saved; j += blockDim.x) {
        const int i = __ldcg(&saved[2 * j]);
        if (i >= 0) logits[i] = __int_as_float(__ldcg(&saved[2 * j + 1]));
    }
    if (dirty >= 0)
        for (int b = threadIdx.x; b < SAMPLE_BINS; b += blockDim.x) bins[(size_t)dirty * SAMPLE_BINS + b] = 0;
}

// Top-p, min-p and the draw over the ids top-k kept (key >= tau), when they are few: every CTA
// gathers its kept ids into w->kept, and after a barrier CTA 0 alone finishes: each kept id's
// mass above it summed over the others (n^2 / threads adds: 4 for top_k 40), the same test as
// select_threshold's (strictly above under top_p of the kept mass, 2^-44 fixed point), min-p,
// the Gumbel-max draw, finish_draw. Three select passes and the draw's reduction across CTAs
// become one barrier. Returns false, having gathered nothing, where top-k kept more than
// SAMPLE_LOCAL_MAX ids (ties): the caller takes the passes. `lo`, `hi`: shared scratch.
__device__ bool finish_in_one_cta(float* logits, int vocab, int* state, const SampleParams* p, SampleWork* w,
                                  const int* saved, int penalties, unsigned long long* bins, int dirty, u32 tau,
                                  float m, unsigned long long slot, u32* lo, u32* hi) {
    __shared__ int s_base;
    __shared__ unsigned long long s_mass[SAMPLE_LOCAL_MAX];
    // Count this thread's kept ids, reserve the CTA's run of the list, write them.
    int mine = 0;
    for_logits(logits, vocab, [&](float l, int) { mine += order_key(l) >= tau; });
    unsigned long long after, total;
    block_suffix_sum((unsigned long long)mine, after, total);
    if (threadIdx.x == 0) s_base = total ? atomicAdd(&w->n_kept, (int)total) : 0;
    __syncthreads();
    int at = s_base + (int)(total - after) - mine;
    for_logits(logits, vocab, [&](float l, int i) {
        if (order_key(l) >= tau && at < SAMPLE_LOCAL_MAX) w->kept[at] = i;
        at += order_key(l) >= tau;
    });
    grid_barrier(w);
    const int n = __ldcg(&w->n_kept);
    if (n > SAMPLE_LOCAL_MAX) {
        // Every CTA has read the count before the next barrier; the first pass's barrier is it.
        return false;
    }
    if (blockIdx.x != 0) return true;
    const float t = p->temperature;
    float* l_of = reinterpret_cast<float*>(hi);
    unsigned long long part = 0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const int i = __ldcg(&w->kept[j]);
        lo[j] = (u32)i;
        l_of[j] = logits[i];
        s_mass[j] = fixed_mass(l_of[j], m, t);
        part += s_mass[j];
    }
    // The kept mass (block_suffix_sum's barrier publishes the arrays), and each id's mass
    // strictly above it.
    unsigned long long rest, mass;
    block_suffix_sum(part, rest, mass);
    unsigned long long target = p->top_p < 1.0f ? (unsigned long long)((double)mass * (double)p->top_p) : mass;
    target = min(max(target, 1ull), mass);
    const u32 k0 = p->seed_lo, k1 = p->seed_hi;
    float best = NEG_INF;
    int best_i = -1;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float l = l_of[j];
        if (p->top_p < 1.0f) {
            unsigned long long above = 0;
            for (int k = 0; k < n; k++)
                if (l_of[k] > l) above += s_mass[k];
            if (above >= target) continue;
        }
        const float z = __fdiv_rn(__fsub_rn(l, m), t);
        if (!(z >= p->log_min_p)) continue;
        const int i = (int)lo[j];
        const float s = gumbel_key(z, i, slot, k0, k1);
        if (argmax_beats(s, i, best, best_i)) best = s, best_i = i;
    }
    block_argmax(best, best_i);
    finish_draw(best_i, logits, state, w, saved, penalties, bins, dirty);
    if (threadIdx.x == 0) w->n_kept = 0;
    return true;
}

// The sampler: state[NEXT_TOKEN] = the kept id of the largest z + gumbel (z = (l - max) / t;
// kept: at or above the top-k and top-p thresholds, z >= ln(min_p)), or at temperature 0 the
// argmax (lowest id on a tie) of the penalized logits; the slot the id takes is
// state[POSITION] + slot_offset (the decode step draws before its commit, the prefill after
// its last advance). `penalties`, `top_k`, `top_p`: the phases the captured plan runs (the
// host's Plan). The draw's last CTA (argmax_across_ctas) writes the id, puts back the logits
// the penalties changed and zeroes the histogram buffer last used.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_draw(float* logits, int vocab, int* state, int slot_offset, const SampleParams* p, SampleWork* w,
                unsigned long long* bins, int* scratch, const int* __restrict__ hist, int* counts, int* saved,
                int penalties, int top_k, int top_p) {
    pdl_enter();
    if (state[STATE_FINISHED]) return;
    __shared__ u32 lo[SAMPLE_BINS], hi[SAMPLE_BINS];
    const int slot = state[STATE_POSITION] + slot_offset;
    if (penalties) {
        if (blockIdx.x == 0) penalize(logits, vocab, slot, p, w, hist, counts, saved);
        grid_barrier(w);
    }
    const float t = p->temperature, log_min_p = p->log_min_p;
    float m = 0.0f;
    u32 tau = 1u;  // every id but NaN
    int dirty = -1;  // the histogram buffer last used
    if (t > 0.0f) {
        m = grid_max(logits, vocab, w);
        if (top_k) tau = select_threshold(logits, vocab, w, p, bins, 0, false, tau, m, lo, hi, dirty);
        if (top_k && p->top_k <= SAMPLE_LOCAL_MAX &&
            finish_in_one_cta(logits, vocab, state, p, w, saved, penalties, bins, dirty, tau, m, slot, lo, hi))
            return;
        if (top_p) tau = select_threshold(logits, vocab, w, p, bins, 3, true, tau, m, lo, hi, dirty);
    }
    const u32 k0 = p->seed_lo, k1 = p->seed_hi;
    const unsigned long long s64 = (unsigned long long)slot;
    float best = NEG_INF;
    int best_i = -1;
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
                const float z = __fdiv_rn(__fsub_rn(l[u], m), t);
                if (order_key(l[u]) < tau || !(z >= log_min_p)) continue;
                if (!drawn) {
                    r = philox4x32(make_uint4((u32)s64, (u32)(s64 >> 32), (u32)q, 0u), k0, k1);
                    drawn = true;
                }
                s = __fadd_rn(z, gumbel(u == 0 ? r.x : u == 1 ? r.y : u == 2 ? r.z : r.w));
            }
            if (argmax_beats(s, 4 * q + u, best, best_i)) best = s, best_i = 4 * q + u;
        }
    }
    block_argmax(best, best_i);
    if (!argmax_across_ctas(best, best_i, scratch)) return;
    finish_draw(best_i, logits, state, w, saved, penalties, bins, dirty);
    if (threadIdx.x == 0) w->n_kept = 0;
}
