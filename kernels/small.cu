// The small kernels: RMSNorm, the embedding rows, the greedy argmax and the decode state's
// updates (the decode step's and the chunked prefill's). Uses common.cuh.

// out = x * rsqrt(mean(x^2) + eps) * w over n elements; CTA b takes row b of x and out.
// With `out_f16` the output row is f16 (n even).
extern "C" __global__ void rms_norm(const float* __restrict__ x, const u16* __restrict__ w, float* out, int n,
                                    float eps, int out_f16) {
    pdl_enter();
    x += (size_t)blockIdx.x * n;
    out = out_f16 ? reinterpret_cast<float*>(reinterpret_cast<u16*>(out) + (size_t)blockIdx.x * n)
                  : out + (size_t)blockIdx.x * n;
    // Pairs of elements, RMS_BATCH pairs per thread loaded together: a strided loop issues
    // one round of loads per iteration and waits for it before the next.
    constexpr int RMS_BATCH = 4;
    const int pairs = n >> 1;  // n is even (head_dim and hidden are)
    const float2* x2 = reinterpret_cast<const float2*>(x);
    __shared__ float sums[32];
    float ss = 0.0f;
    for (int base = threadIdx.x; base < pairs; base += RMS_BATCH * blockDim.x) {
        float2 v[RMS_BATCH];
#pragma unroll
        for (int u = 0; u < RMS_BATCH; u++) {
            const int p = base + u * blockDim.x;
            v[u] = p < pairs ? x2[p] : make_float2(0.0f, 0.0f);
        }
#pragma unroll
        for (int u = 0; u < RMS_BATCH; u++) ss += v[u].x * v[u].x + v[u].y * v[u].y;
    }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) sums[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < (blockDim.x >> 5) ? sums[threadIdx.x] : 0.0f;
        v = warp_sum(v);
        if (threadIdx.x == 0) sums[0] = v;
    }
    __syncthreads();
    const float r = rsqrtf(sums[0] / (float)n + eps);
    const u32* w2 = reinterpret_cast<const u32*>(w);
    for (int base = threadIdx.x; base < pairs; base += RMS_BATCH * blockDim.x) {
        float2 v[RMS_BATCH];
        u32 wp[RMS_BATCH];
#pragma unroll
        for (int u = 0; u < RMS_BATCH; u++) {
            const int p = base + u * blockDim.x;
            if (p < pairs) {
                v[u] = x2[p];
                wp[u] = w2[p];
            }
        }
#pragma unroll
        for (int u = 0; u < RMS_BATCH; u++) {
            const int p = base + u * blockDim.x;
            if (p < pairs)
                store_pair(out, 2 * (size_t)p, v[u].x * r * bf16_to_f32((u16)(wp[u] & 0xffffu)),
                           v[u].y * r * bf16_to_f32((u16)(wp[u] >> 16)), out_f16);
        }
    }
}

// out = dequantized embedding row of `token` (one CTA; no dense table on the device). Returns
// the sum of the squares of the values this thread wrote. A thread takes 16-byte chunks of the
// row (32 values, half a scale block) and loads each whole before it stores: read byte by byte,
// each load waited behind the last one's stores to `out` (the compiler may not move a load past
// a store that could alias it), so a row of hidden 5,120 took 10 round trips to memory, one
// after another: embed_row 7.25 us a step at the 32B shape (docs/lab.md, session 45).
__device__ __forceinline__ float embed_token(int token, Nf4Ref embed, float* __restrict__ out, int hidden,
                                             int vocab) {
    if (token < 0 || token >= vocab) token = 0;  // the engine never lets this happen
    const uint4* row = reinterpret_cast<const uint4*>(embed.packed + (size_t)token * (hidden >> 1));
    const u16* scales = embed.absmax + (size_t)token * (hidden >> 6);
    __shared__ float lut[16];
    load_codebook(lut);
    __syncthreads();
    float ss = 0.0f;
    for (int c = threadIdx.x; c < (hidden >> 5); c += blockDim.x) {
        const uint4 q = row[c];
        const float s = scale_f32(scales[c >> 1]);
        const u32 words[4] = {q.x, q.y, q.z, q.w};
        float v[32];
#pragma unroll
        for (int i = 0; i < 16; i++) {  // byte i of the chunk: its high nibble first
            const u32 b = (words[i >> 2] >> (8 * (i & 3))) & 0xffu;
            v[2 * i] = lut[b >> 4] * s;
            v[2 * i + 1] = lut[b & 15] * s;
            ss += sq(v[2 * i]) + sq(v[2 * i + 1]);
        }
        float4* o = reinterpret_cast<float4*>(out + 32 * (size_t)c);
#pragma unroll
        for (int k = 0; k < 8; k++) o[k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
    }
    return ss;
}

// x = embedding row of state[TOKEN]; with ss_out, its sum of squares there (NormArgs).
extern "C" __global__ void embed_row(const int* __restrict__ state, Nf4Ref embed, float* x, int hidden,
                                     int vocab, float* ss_out) {
    pdl_enter();
    const float ss = embed_token(state[STATE_TOKEN], embed, x, hidden, vocab);
    if (ss_out) block_sum_to(ss, ss_out);
}

// state[NEXT_TOKEN] = argmax(logits): lowest index wins ties, NaN never wins. Does nothing
// once the request is finished (next_token stays the EOS id).
// The grid's CTAs (one per SM) each take a contiguous slice of the
// logits and leave their (value, index) in `scratch` (1 + 2 * gridDim.x words: an arrival
// count, then the pairs); the CTA that arrives last adds nothing but the final argmax over
// the pairs, in CTA order (so the result does not depend on which CTA is last), and resets
// the count for the next launch. Why: one CTA reading the whole vocabulary (600 KB at 152k
// ids) runs at one SM's share of the L2 bandwidth, several microseconds a token.
// A grid of gridDim.y rows (a speculative check's, one launch for all): row y's logits at
// y * n, its state at y * STATE_LEN and its scratch at y * (1 + 2 * gridDim.x).
extern "C" __global__ void argmax_logits(const float* __restrict__ logits, int n, int* state, int* scratch) {
    pdl_enter();
    logits += (size_t)blockIdx.y * n;
    state += blockIdx.y * STATE_LEN;
    scratch += blockIdx.y * (1 + 2 * gridDim.x);
    if (state[STATE_FINISHED]) return;
    float best = NEG_INF;
    int best_i = -1;
    auto take = [&](float v, int i) {
        if (!isfinite(v)) mark_non_finite(state);
        if (v > best || (best_i < 0 && v == v)) {
            best = v;
            best_i = i;
        }
    };
    // Load latency bounds a slice, so each thread keeps four 16-byte loads in flight per
    // round. A thread's indices only rise, so the strict > above keeps the lowest index of a
    // tie. The last CTA also takes the n % 4 logits past the last float4.
    const int n4 = n >> 2, per = (n4 + gridDim.x - 1) / gridDim.x;
    const int q0 = blockIdx.x * per, q1 = min(n4, q0 + per);
    const float4* l4 = reinterpret_cast<const float4*>(logits);
    for (int base = q0 + threadIdx.x; base < q1; base += 4 * blockDim.x) {
        float4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int i = base + u * blockDim.x;
            if (i < q1) v[u] = l4[i];
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int i = base + u * blockDim.x;
            if (i >= q1) break;
            take(v[u].x, 4 * i);
            take(v[u].y, 4 * i + 1);
            take(v[u].z, 4 * i + 2);
            take(v[u].w, 4 * i + 3);
        }
    }
    if (blockIdx.x == gridDim.x - 1)
        for (int i = 4 * n4 + threadIdx.x; i < n; i += blockDim.x) take(logits[i], i);
    block_argmax(best, best_i);
    if (gridDim.x == 1) {
        if (threadIdx.x == 0) state[STATE_NEXT_TOKEN] = best_i < 0 ? 0 : best_i;
        return;
    }
    if (!argmax_across_ctas(best, best_i, scratch)) return;
    if (threadIdx.x == 0) state[STATE_NEXT_TOKEN] = best_i < 0 ? 0 : best_i;
}

// Prefill: the token of prompt position i (eager only: i is a launch argument).
extern "C" __global__ void load_token(int* state, const int* __restrict__ ids, int i) {
    pdl_enter();
    state[STATE_TOKEN] = ids[i];
}

// After a teacher-forced forward: the slot is written, move on.
extern "C" __global__ void advance(int* state) {
    pdl_enter();
    state[STATE_POSITION] += 1;
    state[STATE_VALID_LEN] = state[STATE_POSITION];
}

// After the last prompt id: feed the chosen id next (into the history at its position);
// finished iff it is EOS (eos < 0: none).
extern "C" __global__ void finish_prefill(int* state, int eos, int* hist) {
    pdl_enter();
    int next = state[STATE_NEXT_TOKEN];
    state[STATE_TOKEN] = next;
    hist[state[STATE_POSITION]] = next;
    state[STATE_FINISHED] = next == eos ? 1 : 0;
}

// The commit: token = next_token, position += 1, valid_len = position, history[position] =
// next_token, finished |= (next_token == eos), and the id appended to the step ring. A step
// that runs after the request finished (a replay past EOS) commits nothing.
extern "C" __global__ void commit_step(int* state, int eos, int* ring, int* hist) {
    pdl_enter();
    if (state[STATE_FINISHED]) return;
    int next = state[STATE_NEXT_TOKEN];
    ring[state[STATE_RING_COUNT]++] = next;
    state[STATE_TOKEN] = next;
    state[STATE_POSITION] += 1;
    state[STATE_VALID_LEN] = state[STATE_POSITION];
    hist[state[STATE_POSITION]] = next;
    if (next == eos) state[STATE_FINISHED] = 1;
}

// Empties the step ring before a batch of steps.
extern "C" __global__ void ring_reset(int* state) {
    pdl_enter();
    state[STATE_RING_COUNT] = 0;
}
// Row-wise helpers of a chunk.

// x[i] = dequantized embedding row of ids[i], one CTA per token.
extern "C" __global__ void embed_rows(const int* __restrict__ ids, Nf4Ref embed, float* x, int hidden,
                                      int vocab) {
    pdl_enter();
    embed_token(ids[blockIdx.x], embed, x + (size_t)blockIdx.x * hidden, hidden, vocab);
}

// RoPE on q and k of token i (position pos0 + i) in place, k and v into the KV cache as bf16
// at that slot: the same arithmetic as the decode attention's, so both paths store the same bits.
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
                const float2 r = rope_pair(x1[u], x2[u], c[u], s[u]);
                const float lo = r.x, hi = r.y;
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
