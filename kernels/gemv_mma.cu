// GEMV v3 (DV2_GEMV=v3): the decode step's NF4 matrix-vector products on tensor cores.
// Compiled after prefill.cu, whose GemmArgs, epilogue kinds, stacked rows and mma_16816 it
// uses.
//
// Why: GEMV v2 spends ~4 instructions per weight (nibble extract, codebook load, FMA) and
// is issue-bound at ~50% of the bandwidth floor (docs/lab.md). Here a warp runs
// mma.sync m16n8k16 with x replicated in all eight columns, so one MMA does 256
// multiply-adds, and the dequantization is one shared-memory load per two weights: a
// 256-entry table maps a packed byte to its f16 pair, replicated once per bank (entry b of
// lane l at word 32b + l) so a warp's 32 lookups never conflict.
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
//
// Weights reach the warps through shared memory: each warp keeps a ring of GEMV3_STAGES
// slots, each S blocks of its T tiles, filled by cp.async, with GEMV3_STAGES - 1 slots in
// flight while it computes one. Held in registers instead (the first version), the data
// in flight was bounded by the register file to ~32 KB per SM, and the big matrices ran
// no faster than GEMV v2 (docs/lab.md); the ring holds ~2x that without registers.
#if !defined(GEMV3_WARPS) || !defined(GEMV3_STAGES) || !defined(GEMV3_STAGE_BLOCKS) || !defined(GEMV3_ENTRY_BYTES)
#error "the host passes the GEMV v3 constants as -D options (src/cuda/kernels.rs)"
#endif
#define GEMV3_THREADS (GEMV3_WARPS * 32)
#define GEMV3_LUT_WORDS (256 * 32)
// One ring entry (GEMV3_ENTRY_BYTES): a block of one tile, 16 bytes per lane (8 of row g,
// then 8 of row g + 8, where lane = 4g + t), then the 16 rows' absmax.
static_assert(GEMV3_ENTRY_BYTES == 32 * 16 + 16 * 4, "ring entry layout");

// The byte -> f16 pair table, replicated per bank (GEMV3_LUT_WORDS words).
__device__ __forceinline__ void load_byte_codebook(u32* lut) {
    __shared__ float nf4[16];
    load_codebook(nf4);
    __syncthreads();
    for (int i = threadIdx.x; i < GEMV3_LUT_WORDS; i += blockDim.x) {
        const int b = i >> 5;
        lut[i] = pack_f16x2(nf4[b >> 4], nf4[b & 15]);
    }
}

__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
    const unsigned saddr = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(saddr), "l"(src));
}

__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
    const unsigned saddr = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(saddr), "l"(src));
}

// Row h (0: g, 1: g + 8) of tile i of row group `group`, as a stacked-matrix row.
template <int T, int EPI>
__device__ __forceinline__ StackedRow gemv3_row(const GemmArgs& a, int group, int i, int h, int g) {
    if (EPI == EPI_SWIGLU) {
        const int r = group * 16 + g + 8 * h;
        StackedRow s;
        s.valid = r < a.rows[0];
        s.matrix = i;
        s.local = s.valid ? r : 0;
        return s;
    }
    return stacked_row(a, (group * T + i) * 16 + g + 8 * h);
}

// Starts the copies of blocks kb .. kb+S-1 (those below kb1) of a row group's tiles into
// ring slot `slot` (S x T entries). Lane (g, t) copies its 8 bytes of rows g and g + 8;
// lanes t = 0 and 1 copy the absmax of rows g and g + 8.
template <int T, int S, int EPI>
__device__ __forceinline__ void gemv3_issue(const GemmArgs& a, int group, int kb, int kb1, int lane, u8* slot) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < T; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const StackedRow r = gemv3_row<T, EPI>(a, group, i, h, g);
            const Nf4Ref m = pick(a, r.matrix);
            const u8* wrow = m.packed + (size_t)r.local * (a.k >> 1) + 8 * t;
            const float* srow = m.absmax + (size_t)r.local * (a.k >> 6);
#pragma unroll
            for (int j = 0; j < S; j++) {
                if (kb + j >= kb1) break;
                u8* entry = slot + (j * T + i) * GEMV3_ENTRY_BYTES;
                cp_async8(entry + lane * 16 + 8 * h, wrow + (kb + j) * 32);
                if (t == h) cp_async4(entry + 512 + (g + 8 * h) * 4, srow + kb + j);
            }
        }
}

template <int T, int S, int EPI>
__device__ __forceinline__ void gemv3_body(const GemmArgs& a) {
    static_assert(S * T == GEMV3_STAGE_BLOCKS, "a ring slot holds GEMV3_STAGE_BLOCKS entries");
    constexpr int P = GEMV3_STAGES;
    __shared__ u32 lut[GEMV3_LUT_WORDS];
    __shared__ float red[2][GEMV3_WARPS][T * 16];  // by group parity: one barrier per group
    // x as K/2 f16 pairs, then each warp's ring of P slots.
    extern __shared__ __align__(16) u32 dyn[];
    u32* x16 = dyn;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    u8* ring = reinterpret_cast<u8*>(dyn + ((a.k >> 1) + 3) / 4 * 4) + warp * P * GEMV3_STAGE_BLOCKS * GEMV3_ENTRY_BYTES;
    const int outputs = EPI == EPI_SWIGLU ? a.rows[0] : a.rows[0] + a.rows[1] + a.rows[2];
    const int groups = (outputs + 16 * (EPI == EPI_SWIGLU ? 1 : T) - 1) / (16 * (EPI == EPI_SWIGLU ? 1 : T));
    const int kblocks = a.k >> 6;
    const int kb0 = warp * kblocks / GEMV3_WARPS, kb1 = (warp + 1) * kblocks / GEMV3_WARPS;
    const int stages = (kb1 - kb0 + S - 1) / S;
    const int my_groups = (int)blockIdx.x < groups ? (groups - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    const int items = my_groups * stages;  // (group, stage) pairs this warp walks
    // Item n: stage n % stages of this CTA's group n / stages, into slot n % P. An item past
    // the end commits an empty group, so wait_group counts stay uniform.
    auto issue = [&](int n) {
        if (n < items) {
            const int group = (int)blockIdx.x + (n / stages) * (int)gridDim.x;
            gemv3_issue<T, S, EPI>(a, group, kb0 + (n % stages) * S, kb1, lane,
                                   ring + (n % P) * GEMV3_STAGE_BLOCKS * GEMV3_ENTRY_BYTES);
        }
        asm volatile("cp.async.commit_group;");
    };
    // The weights are constant: their first copies start before the wait.
#pragma unroll
    for (int n = 0; n < P - 1; n++) issue(n);
    load_byte_codebook(lut);
    pdl_enter();
    if (a.skip_if && *a.skip_if) {
        asm volatile("cp.async.wait_all;");
        return;
    }
    for (int i = threadIdx.x; i < (a.k >> 2); i += blockDim.x) {
        const float4 v = reinterpret_cast<const float4*>(a.x)[i];
        x16[2 * i] = pack_f16x2(v.x, v.y);
        x16[2 * i + 1] = pack_f16x2(v.z, v.w);
    }
    __syncthreads();

    const u32* lut_lane = lut + lane;
    int n = 0, parity = 0;
    for (int group = blockIdx.x; group < groups; group += gridDim.x, parity ^= 1) {
        float acc[T][2] = {};
        for (int st = 0; st < stages; st++, n++) {
            asm volatile("cp.async.wait_group %0;" ::"n"(P - 2));
            __syncwarp();  // every lane's copies of item n have landed; slot (n-1) % P is free
            issue(n + P - 1);
            const u8* slot = ring + (n % P) * GEMV3_STAGE_BLOCKS * GEMV3_ENTRY_BYTES;
            const int kb = kb0 + st * S;
#pragma unroll
            for (int j = 0; j < S; j++) {
                if (kb + j >= kb1) break;
                const uint4* xb = reinterpret_cast<const uint4*>(x16 + (kb + j) * 32 + 8 * t);
                const uint4 x0 = xb[0], x1 = xb[1];
                const u32 bw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
                for (int i = 0; i < T; i++) {
                    const u8* entry = slot + (j * T + i) * GEMV3_ENTRY_BYTES;
                    const uint4 w = *reinterpret_cast<const uint4*>(entry + lane * 16);
                    const float* sc = reinterpret_cast<const float*>(entry + 512);
                    const u32 words[2][2] = {{w.x, w.y}, {w.z, w.w}};  // [row half][word]
                    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                    for (int s = 0; s < 4; s++) {
                        const int shift = (s & 1) * 16;
                        u32 af[4];
#pragma unroll
                        for (int h = 0; h < 2; h++) {
                            const u32 word = words[h][s >> 1];
                            af[h] = lut_lane[((word >> shift) & 0xff) * 32];
                            af[2 + h] = lut_lane[((word >> (shift + 8)) & 0xff) * 32];
                        }
                        mma_16816(c, af, bw[2 * s], bw[2 * s + 1]);
                    }
                    acc[i][0] = fmaf(c[0], sc[g], acc[i][0]);
                    acc[i][1] = fmaf(c[2], sc[g + 8], acc[i][1]);
                }
            }
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
                const StackedRow r = stacked_row(a, row);
                if (r.valid) {
                    const float* bias = pick_bias(a, r.matrix);
                    const float v = sum + (bias ? bias[r.local] : 0.0f);
                    a.y[row] = EPI == EPI_ACCUMULATE ? a.y[row] + v : v;
                }
            }
        }
    }
    asm volatile("cp.async.wait_all;");
}

// T = 1 tile for the plain epilogues, S = 4 blocks per slot; SwiGLU: 2 tiles, 2 blocks.
extern "C" __global__ void __launch_bounds__(GEMV3_THREADS, 2) gemv3_store(GemmArgs a) {
    gemv3_body<1, 4, EPI_STORE>(a);
}
extern "C" __global__ void __launch_bounds__(GEMV3_THREADS, 2) gemv3_acc(GemmArgs a) {
    gemv3_body<1, 4, EPI_ACCUMULATE>(a);
}
extern "C" __global__ void __launch_bounds__(GEMV3_THREADS, 2) gemv3_swiglu(GemmArgs a) {
    gemv3_body<2, 2, EPI_SWIGLU>(a);
}
