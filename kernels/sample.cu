// The sampler (src/cuda/sample.rs schedules it; src/sampling.rs is its reference and says what
// it computes): penalties, then the thresholds of top-k and top-p, then a Gumbel-max draw over
// the ids left. Uses common.cuh.
//
// Everything a request can change is read from device memory (SampleParams, written by the
// host at dv2_set_sampling), since kernel arguments are frozen in the captured graph. The
// grid kernels take one CTA per SM; their CTAs leave partial results in SampleWork and the
// CTA that arrives last (last_to_arrive) finishes the reduction, so no kernel waits on
// another CTA. Every buffer the kernels count in (arrivals, bins, counts) is zero again when a
// launch ends.
//
// Why a Gumbel-max draw: argmax over the kept ids of z_i + G_i, z the logit over the
// temperature and G_i Gumbel noise from Philox keyed by (seed, slot, id), draws from the
// renormalized softmax of the kept ids in one parallel pass, the greedy argmax's reduction,
// with no sort and no prefix sum over the vocabulary. Why thresholds: top-k and top-p keep the
// ids at or above a logit, found by a radix select over the logits' order-preserving keys
// (12, 12 and 8 bits a pass): top-k counts ids, top-p sums their softmax mass in 2^-44 fixed
// point, so the sums do not depend on the order the CTAs add them in.

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

// The kernels' scratch between launches of one draw.
struct SampleWork {
    int arrivals;        // CTAs arrived at last_to_arrive in this launch
    float max;           // the largest (penalized) logit
    u32 tau;             // ids with order_key(logit) >= tau are kept so far
    u32 prefix;          // the radix select: the key bits fixed by the passes so far
    unsigned long long target;  // and the count or mass it still looks for below them
    int n_saved;         // window entries sample_penalize saved for sample_draw to restore
    int pad;
    float cta_max[SAMPLE_MAX_CTAS];
};
static_assert(sizeof(SampleWork) == 4 * SAMPLE_WORK_WORDS, "SampleWork differs from the host's");

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

// True in every thread of the CTA that arrives last at `count` in this launch (which resets
// it); every CTA's writes before the call are visible to that CTA after it.
__device__ __forceinline__ bool last_to_arrive(int* count) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(count, 1) == (int)gridDim.x - 1;
        if (last) *count = 0;
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

// The penalties over the window (the last penalty_last_n ids before `slot`, -1: all) in place
// in the logits, one CTA: counts per id in `counts` (zero before and after), and the first
// window entry of each id saves that id's logit in `saved` (pairs: id or -1, logit bits) for
// sample_draw to put back, so that the logits read back afterwards are the model's.
// slot = state[POSITION] + slot_offset: the position the drawn id will take.
extern "C" __global__ void sample_penalize(float* logits, int vocab, const int* state, int slot_offset,
                                           const SampleParams* p, SampleWork* w, const int* __restrict__ hist,
                                           int* counts, int* saved) {
    pdl_enter();
    if (state[STATE_FINISHED]) return;
    const int slot = state[STATE_POSITION] + slot_offset;
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

// The largest logit, and every non-NaN id kept (tau = 1) for the passes after.
extern "C" __global__ void sample_max(const float* __restrict__ logits, int vocab, const int* state, SampleWork* w) {
    pdl_enter();
    if (state[STATE_FINISHED]) return;
    float m = NEG_INF;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < vocab; i += gridDim.x * blockDim.x)
        m = fmaxf(m, logits[i]);
    m = block_max(m);
    if (threadIdx.x == 0) w->cta_max[blockIdx.x] = m;
    if (!last_to_arrive(&w->arrivals)) return;
    float v = NEG_INF;
    for (int c = threadIdx.x; c < (int)gridDim.x; c += blockDim.x) v = fmaxf(v, __ldcg(&w->cta_max[c]));
    v = block_max(v);
    if (threadIdx.x == 0) {
        w->max = v;
        w->tau = 1u;
    }
}

// One pass of the radix select for a threshold over the kept ids: top-k (by_mass 0: each id
// weighs 1, the target is k) or top-p (by_mass 1: each weighs its softmax mass, the target is
// top_p of the kept mass). The threshold is the smallest key whose kept ids strictly above it
// weigh less than the target: the k-th largest logit, or the least likely logit top-p keeps.
// Each pass histograms one digit of the keys under the prefix fixed so far (`bins`, zero
// between launches); the last CTA finds the digit's bin and leaves the prefix and what is left
// of the target, and after pass 2 the threshold in tau.
extern "C" __global__ void sample_select(const float* __restrict__ logits, int vocab, const int* state,
                                         const SampleParams* p, SampleWork* w, unsigned long long* bins,
                                         int pass, int by_mass) {
    pdl_enter();
    if (state[STATE_FINISHED]) return;
    __shared__ unsigned long long h[SAMPLE_BINS];
    const int shift = select_shift(pass), n_bins = 1 << select_bits(pass);
    const u32 mask = pass == 0 ? 0u : ~((1u << (shift + select_bits(pass))) - 1u);
    const u32 prefix = pass == 0 ? 0u : w->prefix, tau = w->tau;
    const float m = w->max, t = p->temperature;
    for (int b = threadIdx.x; b < n_bins; b += blockDim.x) h[b] = 0;
    __syncthreads();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < vocab; i += gridDim.x * blockDim.x) {
        const float l = logits[i];
        const u32 key = order_key(l);
        if (key < tau || (key & mask) != prefix) continue;
        atomicAdd(&h[(key >> shift) & (n_bins - 1)], by_mass ? fixed_mass(l, m, t) : 1ull);
    }
    __syncthreads();
    for (int b = threadIdx.x; b < n_bins; b += blockDim.x)
        if (h[b]) atomicAdd(&bins[b], h[b]);
    if (!last_to_arrive(&w->arrivals)) return;

    // The last CTA: the bins into shared memory (and zero for the next launch).
    for (int b = threadIdx.x; b < n_bins; b += blockDim.x) {
        h[b] = __ldcg(&bins[b]);
        bins[b] = 0;
    }
    __syncthreads();
    // Each thread takes a run of bins; `above`: the weight of the runs above its run.
    const int per = (n_bins + blockDim.x - 1) / blockDim.x, b0 = threadIdx.x * per, b1 = min(n_bins, b0 + per);
    unsigned long long run = 0;
    for (int b = b0; b < b1; b++) run += h[b];
    __shared__ int s_bin;
    __shared__ unsigned long long s_target;
    if (threadIdx.x == 0) s_bin = n_bins;
    unsigned long long above, total;
    block_suffix_sum(run, above, total);
    unsigned long long target;
    if (pass > 0) {
        target = w->target;
    } else if (by_mass) {
        target = (unsigned long long)((double)total * (double)p->top_p);
    } else {
        target = (unsigned long long)p->top_k;
    }
    // At least the most likely id stays, and a target past the total keeps every id.
    target = min(max(target, 1ull), total);
    // The lowest non-empty bin whose weight above it is under the target.
    int found = n_bins;
    unsigned long long found_above = 0;
    for (int b = b1 - 1; b >= b0; b--) {
        if (h[b] && above < target) found = b, found_above = above;
        above += h[b];
    }
    atomicMin(&s_bin, found);
    __syncthreads();
    if (found == s_bin && found < n_bins) s_target = target - found_above;
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 fixed = s_bin < n_bins ? prefix | ((u32)s_bin << shift) : 0xffffffffu;
        if (pass == 2 || s_bin == n_bins) {
            w->tau = fixed;  // nothing to keep (every logit NaN) keeps nothing
        } else {
            w->prefix = fixed;
            w->target = s_target;
        }
    }
}

// The draw: state[NEXT_TOKEN] = the kept id of the largest z + gumbel (z = (l - max) / t; kept:
// key >= tau and z >= ln(min_p)), or at temperature 0 the argmax (lowest id on a tie) of the
// penalized logits. The last CTA writes the id and puts back the logits sample_penalize
// changed.
extern "C" __global__ void sample_draw(float* logits, int vocab, int* state, int slot_offset,
                                       const SampleParams* p, SampleWork* w, int* scratch, const int* saved) {
    pdl_enter();
    if (state[STATE_FINISHED]) return;
    const float t = p->temperature, m = w->max, log_min_p = p->log_min_p;
    const u32 tau = w->tau, k0 = p->seed_lo, k1 = p->seed_hi;
    const unsigned long long slot = (unsigned long long)(state[STATE_POSITION] + slot_offset);
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
                    r = philox4x32(make_uint4((u32)slot, (u32)(slot >> 32), (u32)q, 0u), k0, k1);
                    drawn = true;
                }
                s = __fadd_rn(z, gumbel(u == 0 ? r.x : u == 1 ? r.y : u == 2 ? r.z : r.w));
            }
            if (argmax_beats(s, 4 * q + u, best, best_i)) best = s, best_i = 4 * q + u;
        }
    }
    block_argmax(best, best_i);
    if (!argmax_across_ctas(best, best_i, scratch)) return;
    if (threadIdx.x == 0) state[STATE_NEXT_TOKEN] = best_i < 0 ? 0 : best_i;
    const int n_saved = w->n_saved;
    for (int j = threadIdx.x; j < n_saved; j += blockDim.x) {
        const int id = __ldcg(&saved[2 * j]);
        if (id >= 0) logits[id] = __int_as_float(__ldcg(&saved[2 * j + 1]));
    }
    __syncthreads();
    if (threadIdx.x == 0) w->n_saved = 0;
}
