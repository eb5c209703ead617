//! Kernel launches with their launch shapes: the one place that knows each kernel's argument
//! list and grid. The backend and the microbenchmarks both launch through [`Ops`].
//!
//! What runs by default, and the switches that turn a part of it off ([`Config`]): GEMV v3
//! (tensor cores) below [`GEMV3_MAX_BYTES`] of weights, v2 above; the RMSNorm folded into the
//! next GEMV's x load (`DV2_FUSE_RMS`); SwiGLU's output in f16 for down (`DV2_FFN_F16`); q/k/v
//! in K halves (`DV2_QKV_KHALVES`); lm_head with the argmax and the step's commit
//! (`DV2_LOGITS_ARGMAX`); attention v3 where the GPU has clusters (`DV2_ATTN_CLUSTERS`); the
//! prefill's tensor-core GEMM on f16 activations, its attention on tensor cores where head_dim
//! is 16, 32, 64 or 128, and its last layer on the last token alone (`DV2_PREFILL_TAIL`);
//! `DV2_LINEAR=mma` runs the decode step's linears through that GEMM (the seed's ablation).
//! The tuning numbers are named constants below, each citing the lab row that chose it.

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaFunction, DeviceRepr, LaunchConfig};

use super::device::{driver_error, Gpu};
use super::kernels::{
    Kernels, ATTN2_CHUNK, ATTN2_MAX_CHUNKS, ATTN2_MAX_GROUP, ATTN2_MAX_GROUP_X_HD, ATTNM_ROWS,
    ATTNM_THREADS, ATTNP_Q_FLOATS, ATTNP_ROWS, ATTNP_THREADS, ATTN_THREADS, GEMM_NT, GEMM_WARPS,
    GEMM_WARP_ROWS, GEMV2_MAX_K, GEMV2_PRMT_TABLE, GEMV2_X16_STRIDE, GEMV2_X_STRIDE, GEMV3_MAX_K,
    GEMV3_WARPS, GEMV_THREADS, GEMV_WARPS, MAX_HEAD_DIM,
};
use super::weights::Nf4Ref;
use crate::arch::ArchSpec;
use crate::config::Config;
use crate::error::{Error, Result};

/// kernels/decode.cu `QkvArgs`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct QkvArgs {
    pub m: [Nf4Ref; 3],
    pub bias: [u64; 3],
    pub rows: [i32; 3],
}
// SAFETY: plain old data matching the kernel's struct (pointers as u64, ints as i32).
unsafe impl DeviceRepr for QkvArgs {}

/// Where lm_head's argmax kernel ([`Ops::logits_argmax`]) leaves its result: the decode
/// state (next_token), the argmax scratch ([`ARGMAX_SCRATCH`] words, zero between launches),
/// and with `ring` (a device address, 0: none) the commit of the greedy id, as commit_step
/// (appended to the ring, fed next, finished at `eos`, -1: none).
#[derive(Clone, Copy, Debug)]
pub struct LogitsHead {
    pub state: u64,
    pub scratch: u64,
    pub eos: i32,
    pub ring: u64,
}

/// kernels/decode.cu `AttnArgs`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct AttnArgs {
    pub qkv: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub rope_cos: u64,
    pub rope_sin: u64,
    pub state: u64,
    pub part_acc: u64,
    pub part_ml: u64,
    pub n_q: i32,
    pub n_kv: i32,
    pub head_dim: i32,
    pub max_seq: i32,
    pub n_splits: i32,
    pub scale: f32,
    /// Attention v3's q heads per CTA (set by [`Ops::attention`]).
    pub heads_per_cta: i32,
    /// Where kernels built with `DV2_QKV_KHALVES` (default) find q/k/v's second K-half sums, which
    /// the attention adds ([`Ops::qkv`] says whether it wrote them after its rows; else a
    /// zeroed buffer of the rows; unread otherwise).
    pub qkv2: u64,
}
// SAFETY: plain old data matching the kernel's struct.
unsafe impl DeviceRepr for AttnArgs {}

/// kernels/prefill.cu `GemmArgs`.
#[repr(C)]
#[derive(Clone, Copy)]
struct GemmArgs {
    m: [Nf4Ref; 3],
    bias: [u64; 3],
    rows: [i32; 3],
    x: u64,
    y: u64,
    skip_if: u64,
    n: i32,
    k: i32,
    ldy: i32,
    kw: i32,
    norm: NormArgs,
    ss_out: u64,
}
// SAFETY: plain old data matching the kernel's struct.
unsafe impl DeviceRepr for GemmArgs {}

/// kernels/prefill.cu `PrefillAttnArgs`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct PrefillAttnArgs {
    pub qkv: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub state: u64,
    pub out: u64,
    pub n: i32,
    pub ld: i32,
    pub n_q: i32,
    pub n_kv: i32,
    pub head_dim: i32,
    /// Tokens per CTA of the CUDA-core kernels: set by [`Ops::attn_prefill`].
    pub qb: i32,
    pub scale: f32,
    /// Nonzero: `out` is written as f16 (the next GEMM's input).
    pub out_f16: i32,
    /// The chunk's token at row 0 of `qkv` and `out` (0, or the last token alone: its
    /// position is the state's plus `first`; the KV slots of the whole chunk are written).
    pub first: i32,
}
// SAFETY: plain old data matching the kernel's struct.
unsafe impl DeviceRepr for PrefillAttnArgs {}

/// What the tensor-core GEMM does with its sums.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Epilogue {
    /// `y = W x (+ bias)`.
    Store,
    /// `y += W x` (the residual add).
    Accumulate,
    /// `y = silu(gate x) * (up x)`: the matrices are gate and up.
    Swiglu,
}

/// One matrix of a GEMM: stacked matrices (q, k, v) write consecutive rows of y.
#[derive(Clone, Copy, Debug)]
pub struct GemmMatrix {
    pub m: Nf4Ref,
    pub rows: usize,
    /// Device address of f32 [rows], or 0.
    pub bias: u64,
}

/// Tokens per CTA of the prefill attention for a model's group and head_dim, with at most
/// `rows` (token, q head) rows per CTA, or None when one token's rows do not fit a CTA.
pub fn attn_prefill_tokens(group: usize, head_dim: usize, rows: usize) -> Option<usize> {
    let rows = rows.min(ATTNP_ROWS).min(ATTNP_Q_FLOATS / head_dim);
    (group <= rows).then(|| rows / group)
}

/// kernels/decode.cu `NormArgs`: RMSNorm weights (bf16; 0 = no norm), epsilon, and the
/// producer's partial sums of squares of x.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct NormArgs {
    pub w: u64,
    pub eps: f32,
    pub ss_parts: i32,
    pub ss: u64,
}
// SAFETY: plain old data matching the kernel's struct (pointer, float, int, pointer).
unsafe impl DeviceRepr for NormArgs {}

impl NormArgs {
    const NONE: Self = Self {
        w: 0,
        eps: 0.0,
        ss_parts: 0,
        ss: 0,
    };
}
/// Room for partial sums of squares: more than any GEMV grid (v2: at most 8 CTAs per SM,
/// v3: 2) on a 132-SM device.
pub const MAX_PARTIAL_SUMS: usize = 4096;

/// The most CTAs argmax_logits runs; its scratch holds an arrival count and a (value,
/// index) pair per CTA.
pub const MAX_ARGMAX_CTAS: usize = 1024;
pub const ARGMAX_SCRATCH: usize = 1 + 2 * MAX_ARGMAX_CTAS;

/// Partial sums of squares of a vector, one per CTA of the kernel that wrote it: `parts`
/// f32 at device address `ptr`.
#[derive(Clone, Copy, Debug)]
pub struct PartialSums {
    pub ptr: u64,
    pub parts: usize,
}

/// An RMSNorm to apply to a GEMV's input: weights, epsilon, a buffer for the normed x when
/// the norm runs as its own kernel, and the partial sums of squares of x when its producer
/// left them (then the GEMV v2/v3 kernels fold the norm into their x load).
#[derive(Clone, Copy)]
pub struct Norm {
    pub w: u64,
    pub eps: f32,
    pub scratch: u64,
    pub sums: Option<PartialSums>,
}

/// A GEMV's input vector, raw or to be RMS-normed first; f32, or f16 where its writer made
/// it so ([`Ops::ffn_act_f16`]).
#[derive(Clone, Copy)]
pub struct Input {
    pub x: u64,
    pub norm: Option<Norm>,
    pub f16: bool,
}

impl Input {
    pub fn raw(x: u64) -> Self {
        Self {
            x,
            norm: None,
            f16: false,
        }
    }

    /// A raw input of f16 values.
    pub fn raw_f16(x: u64) -> Self {
        Self {
            f16: true,
            ..Self::raw(x)
        }
    }
}

/// The GEMV kernel family of a matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gemv {
    /// Persistent CTAs, x held in registers, an f16-pair table in shared memory
    /// (kernels/decode.cu, gemv2_*).
    V2,
    /// Tensor cores (kernels/gemv_mma.cu).
    V3,
}

/// How the GEMV family is chosen: by matrix size (the default), or one for every matrix
/// (tests and the bench compare the two at every shape).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemvChoice {
    /// v3 for matrices under [`GEMV3_MAX_BYTES`] of packed weights, v2 for the larger ones.
    Auto,
    Fixed(Gemv),
}

/// Packed NF4 bytes below which [`GemvChoice::Auto`] takes GEMV v3: v3 measured faster on
/// q/k/v (3.0 MB) and o (2.4 MB), v2 on down (12.7 MB), gate+up (25 MB) and lm_head (16 MB
/// put down on v3: 1.958 vs 1.860 ms/token, docs/lab.md session 7).
pub const GEMV3_MAX_BYTES: usize = 8 << 20;

/// The decode attention kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attention {
    /// A CTA per (q head, split) and a merge kernel: the fallback where v2's shared memory
    /// does not fit the model (a GQA group over 16, or over 2,048 q values per KV head, or
    /// over 32k slots).
    V1,
    /// CTAs per (KV head, 32-slot chunk), [`ATTN_SPLIT`] of them sharing the group's q heads,
    /// then the merge kernel: the default without thread-block clusters.
    V2,
    /// v2's CTAs in clusters of [`ATTN3_SPLITS`] that split the context and merge through
    /// distributed shared memory, no merge kernel (kernels/decode.cu, attn3_decode).
    V3,
}

/// Attention v2/v3: CTAs sharing a KV head's q heads (the largest divisor of the group at
/// most this): one q head per CTA on the 3B shape, -0.005..-0.006 ms/token against 4
/// (docs/lab.md, session 12).
pub const ATTN_SPLIT: usize = 8;
/// Attention v3: CTAs per cluster, each an equal slice of the context (4: +0.027, 2: +0.113
/// ms/token against 8, docs/lab.md session 14).
pub const ATTN3_SPLITS: u32 = 8;
/// GEMV v2's CTAs per SM: its 128-register kernels fit two (1: 1.4457 vs 1.3076 ms/token,
/// docs/lab.md session 10).
pub const GEMV2_CTAS_PER_SM: u32 = 2;
/// The SwiGLU GEMV v2's first half of CTAs (those placed beside o's) takes this many rows more
/// each than an equal share ([`skewed_split`]): -0.024..-0.026 ms/token, the best of -8..8
/// (docs/lab.md, sessions 17-18; down and lm_head measured slower with any skew).
pub const GEMV2_SWIGLU_SKEW: i32 = 2;

/// Attention time splits of a KV capacity: v1 splits it in up to 32 parts; v2 in chunks
/// of 32 slots. The arena holds partials for the larger of the two.
pub fn attn_partials(max_seq: usize) -> usize {
    attn_splits_v1(max_seq).max(max_seq.div_ceil(ATTN2_CHUNK))
}

fn attn_splits_v1(max_seq: usize) -> usize {
    (max_seq / 64).clamp(1, 32)
}

pub fn one_cta(threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}
pub struct Ops {
    pub gpu: Gpu,
    pub k: Kernels,
    /// The switches this backend was loaded with.
    pub cfg: Config,
    /// The GEMV family per matrix ([`GemvChoice::Auto`]; tests force one).
    pub gemv: GemvChoice,
    /// The decode attention: v3 where the device has thread-block clusters and
    /// `DV2_ATTN_CLUSTERS` is on, else v2; v1 where [`Ops::fit`] finds v2's layout too small.
    pub attn: Attention,
    /// Streaming multiprocessors of the device.
    pub(super) sms: u32,
}

impl Ops {
    pub fn new(gpu: Gpu, cfg: Config) -> Result<Self> {
        let k = Kernels::load(&gpu, &cfg)?;
        let sms = gpu
            .ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver_error("multiprocessor count"))? as u32;
        let attn = if gpu.clusters && cfg.attn_clusters {
            Attention::V3
        } else {
            Attention::V2
        };
        Ok(Self {
            gpu,
            k,
            cfg,
            gemv: GemvChoice::Auto,
            attn,
            sms,
        })
    }

    /// Checks the shapes the kernels take; attention v2 and v3 fall back to v1 where their
    /// shared-memory layout does not fit the model.
    pub fn fit(&mut self, s: &ArchSpec, max_seq: usize) -> Result<()> {
        if s.head_dim > MAX_HEAD_DIM || s.head_dim % 8 != 0 {
            return Err(Error::Unsupported(format!(
                "head_dim {} (the CUDA kernels take a multiple of 8 up to {MAX_HEAD_DIM})",
                s.head_dim
            )));
        }
        let group = s.n_q_heads / s.n_kv_heads;
        if group > ATTN2_MAX_GROUP
            || group * s.head_dim > ATTN2_MAX_GROUP_X_HD
            || max_seq.div_ceil(ATTN2_CHUNK) > ATTN2_MAX_CHUNKS
        {
            self.attn = Attention::V1;
        }
        for k in [s.hidden, s.intermediate] {
            gemv2_shape(k)?;
        }
        Ok(())
    }

    /// argmax_logits' grid: a CTA of 256 threads per SM, each taking a slice of the logits
    /// (one CTA of 1024 threads measured slower: docs/lab.md, 25af0c8).
    pub fn argmax_launch(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (self.sms.min(MAX_ARGMAX_CTAS as u32), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// v2: (chunks per lane J, warps per row) for K = cols, and the persistent grid (x staged
    /// from f16 with `x_f16`).
    fn gemv_v2_launch(
        &self,
        rows: usize,
        cols: usize,
        x_f16: bool,
    ) -> Result<(usize, u32, LaunchConfig)> {
        let (j, kparts) = gemv2_shape(cols)?;
        let row_lanes = (GEMV_WARPS / kparts) as usize;
        let ctas = (self.sms * GEMV2_CTAS_PER_SM)
            .min(rows.div_ceil(row_lanes) as u32)
            .max(1);
        let stride = if x_f16 {
            GEMV2_X16_STRIDE
        } else {
            GEMV2_X_STRIDE
        };
        let cfg = LaunchConfig {
            grid_dim: (ctas, 1, 1),
            block_dim: (GEMV_THREADS, 1, 1),
            shared_mem_bytes: (cols / 32 * stride * 4) as u32,
        };
        Ok((j, kparts, cfg))
    }

    /// Resolves a GEMV input: with a norm whose partial sums the producer left, the raw x and
    /// the norm arguments for the GEMV's x load; otherwise (no sums, or `DV2_LINEAR=mma`) the
    /// RMSNorm kernel writes the normed x to the scratch buffer, which the linear then reads.
    fn input(&self, input: Input, cols: usize) -> Result<(u64, NormArgs)> {
        match input.norm {
            None => Ok((input.x, NormArgs::NONE)),
            Some(Norm {
                w,
                eps,
                sums: Some(sums),
                ..
            }) if !self.cfg.linear_mma => Ok((
                input.x,
                NormArgs {
                    w,
                    eps,
                    ss_parts: sums.parts as i32,
                    ss: sums.ptr,
                },
            )),
            Some(n) => {
                self.rms(input.x, n.w, n.scratch, cols, n.eps)?;
                Ok((n.scratch, NormArgs::NONE))
            }
        }
    }

    /// `out = x * rsqrt(mean(x^2) + eps) * w` over `n` elements (one CTA).
    pub fn rms(&self, x: u64, w: u64, out: u64, n: usize, eps: f32) -> Result<()> {
        self.rms_rows(x, w, out, n, eps, 1, false)
    }

    /// [`Self::rms`] on each of `rows` consecutive rows of `n` elements (a CTA per row);
    /// with `out_f16`, `out` is written as f16.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_rows(
        &self,
        x: u64,
        w: u64,
        out: u64,
        n: usize,
        eps: f32,
        rows: usize,
        out_f16: bool,
    ) -> Result<()> {
        let (n, f16) = (n as i32, out_f16 as i32);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            ..one_cta(512)
        };
        launch!(self.gpu, &self.k.rms_norm, cfg; x, w, out, n, eps, f16)
    }

    /// The NF4 tensor-core GEMM over `n` columns: `x` is [n][k], f16 (`f16`, a prefill chunk:
    /// the producers write it so) or f32 (at n = 1 only: `DV2_LINEAR=mma`'s decode step), `y`
    /// f32 [n][ldy] (SwiGLU with `f16`: f16); the matrices are stacked by rows (SwiGLU: gate
    /// and up). Skipped on the device while `*skip_if != 0` (0: never).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        epilogue: Epilogue,
        mats: &[GemmMatrix],
        k: usize,
        x: u64,
        n: usize,
        y: u64,
        ldy: usize,
        skip_if: u64,
        f16: bool,
    ) -> Result<()> {
        if !f16 && n != 1 {
            return Err(Error::Internal(
                "the GEMM takes f32 activations at one column only".into(),
            ));
        }
        let mut args = GemmArgs {
            m: [Nf4Ref::default(); 3],
            bias: [0; 3],
            rows: [0; 3],
            x,
            y,
            skip_if,
            n: n as i32,
            k: k as i32,
            ldy: ldy as i32,
            kw: 1,
            norm: NormArgs::NONE,
            ss_out: 0,
        };
        for (i, m) in mats.iter().enumerate() {
            args.m[i] = m.m;
            args.bias[i] = m.bias;
            args.rows[i] = m.rows as i32;
        }
        // SwiGLU sums only the gate's rows into outputs; its warps take 16 outputs each.
        let (out_rows, warp_rows) = match epilogue {
            Epilogue::Swiglu => (mats[0].rows, GEMM_WARP_ROWS / 2),
            _ => (mats.iter().map(|m| m.rows).sum(), GEMM_WARP_ROWS),
        };
        let (width, ctas_n) = gemm_width(n);
        let tiles = out_rows.div_ceil(warp_rows);
        let kw = gemm_k_parts(tiles, ctas_n, k / 64, self.sms as usize);
        args.kw = kw as i32;
        let ctas_m = tiles.div_ceil(GEMM_WARPS / kw);
        let cluster_z = gemm_cluster(ctas_m * ctas_n, kw, k / 64, self.sms as usize);
        let cfg = LaunchConfig {
            grid_dim: (ctas_m as u32, ctas_n as u32, cluster_z),
            block_dim: ((GEMM_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let kernels = match epilogue {
            Epilogue::Store => &self.k.gemm_store,
            Epilogue::Accumulate => &self.k.gemm_acc,
            Epilogue::Swiglu => &self.k.gemm_swiglu,
        };
        let f = if f16 {
            &kernels.f16[width]
        } else {
            &kernels.f32_one
        };
        launch!(self.gpu, f, cfg, cluster = (1, 1, cluster_z); args)
    }

    /// The GEMV family for a `rows` x `cols` NF4 matrix (gate and up count together).
    fn gemv_kernel(&self, rows: usize, cols: usize) -> Gemv {
        match self.gemv {
            GemvChoice::Fixed(v) => v,
            GemvChoice::Auto => auto_gemv(rows, cols),
        }
    }

    /// GEMV v3: `y = W x` on tensor cores for the stacked matrices `mats` (store with bias,
    /// accumulate into y, or SwiGLU of gate and up); with `halves` (the store epilogue, its
    /// lean use) in K halves: the first half's sums with the bias at y, the second's at y +
    /// the rows.
    #[allow(clippy::too_many_arguments)]
    fn gemv3(
        &self,
        epilogue: Epilogue,
        mats: &[GemmMatrix],
        k: usize,
        x: u64,
        norm: NormArgs,
        y: u64,
        skip_if: u64,
        ss_out: u64,
        halves: bool,
    ) -> Result<usize> {
        if k > GEMV3_MAX_K || k % 64 != 0 {
            return Err(Error::Unsupported(format!(
                "K = {k}: GEMV v3 takes multiples of 64 up to {GEMV3_MAX_K}"
            )));
        }
        // The accumulate kernel takes one matrix only (kernels/gemv_mma.cu, gemv3_stacked).
        if epilogue == Epilogue::Accumulate && mats.len() != 1 {
            return Err(Error::Internal(
                "GEMV v3 accumulates one matrix at a time".into(),
            ));
        }
        let mut args = GemmArgs {
            m: [Nf4Ref::default(); 3],
            bias: [0; 3],
            rows: [0; 3],
            x,
            y,
            skip_if,
            n: 1,
            k: k as i32,
            ldy: 0,
            kw: GEMV3_WARPS as i32,
            norm,
            ss_out,
        };
        for (i, m) in mats.iter().enumerate() {
            args.m[i] = m.m;
            args.bias[i] = m.bias;
            args.rows[i] = m.rows as i32;
        }
        // The lean kernels where the call is the decode step's use of its epilogue (-0.005
        // ms/token against the kernels for any use, docs/lab.md session 14).
        let lean = match epilogue {
            Epilogue::Store | Epilogue::Swiglu => norm.w != 0 && ss_out == 0,
            Epilogue::Accumulate => norm.w == 0 && ss_out != 0,
        };
        let kernels = if lean {
            &self.k.gemv3_lean
        } else {
            &self.k.gemv3
        };
        let (f, outputs) = match epilogue {
            Epilogue::Store => (&kernels[0], mats.iter().map(|m| m.rows).sum()),
            Epilogue::Accumulate => (&kernels[1], mats[0].rows),
            Epilogue::Swiglu => (&kernels[2], mats[0].rows),
        };
        // Persistent: two CTAs per SM (the registers allow two), each looping over groups
        // of 16 outputs.
        let groups = outputs.div_ceil(16) as u32;
        let mut cfg = LaunchConfig {
            grid_dim: (groups.min(2 * self.sms).max(1), 1, 1),
            block_dim: ((GEMV3_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: (k * 2) as u32,
        };
        if let (true, Some(kh2)) = (halves, &self.k.gemv3_qkv_kh2) {
            if epilogue != Epilogue::Store || ss_out != 0 {
                return Err(Error::Internal(
                    "GEMV v3 in K halves stores without sums".into(),
                ));
            }
            // Two CTAs a row group, three an SM (the kernel's bounds).
            cfg.grid_dim.0 = 2 * groups.min(3 * self.sms / 2).max(1);
            args.ldy = outputs as i32;
            launch!(self.gpu, kh2, cfg; args)?;
            return Ok(cfg.grid_dim.0 as usize);
        }
        check_sums(ss_out, cfg.grid_dim.0)?;
        launch!(self.gpu, f, cfg; args)?;
        Ok(cfg.grid_dim.0 as usize)
    }

    /// The tensor-core prefill attention for `head_dim` (16, 32, 64 or 128).
    fn attn_prefill_mma(&self, head_dim: usize) -> Option<&CudaFunction> {
        let i = [16, 32, 64, 128].iter().position(|&d| d == head_dim)?;
        Some(&self.k.attn_prefill_mma[i])
    }

    /// Whether the prefill attention takes the model's shape (else prefill runs token by
    /// token through the decode step).
    pub fn attn_prefill_fits(&self, group: usize, head_dim: usize) -> bool {
        self.attn_prefill_mma(head_dim).is_some()
            || attn_prefill_tokens(group, head_dim, ATTNP_ROWS).is_some()
    }

    /// Causal attention of a chunk of `args.n` tokens (q and k already rotated, the chunk's
    /// K/V already in the cache). `args.qb` is ignored: the CUDA-core kernels (head_dims the
    /// tensor-core kernels lack) take 8 rows per CTA, measured faster than 32 (docs/lab.md),
    /// raised to ATTNP_ROWS when one token's q heads need it.
    pub fn attn_prefill(&self, args: PrefillAttnArgs) -> Result<()> {
        if let Some(f) = self.attn_prefill_mma(args.head_dim as usize) {
            let rows = (args.n * args.n_q / args.n_kv) as u32;
            let cfg = LaunchConfig {
                grid_dim: (args.n_kv as u32, rows.div_ceil(ATTNM_ROWS as u32), 1),
                block_dim: (ATTNM_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            return launch!(self.gpu, f, cfg; args);
        }
        let (group, head_dim) = ((args.n_q / args.n_kv) as usize, args.head_dim as usize);
        let tokens = attn_prefill_tokens(group, head_dim, 8)
            .or_else(|| attn_prefill_tokens(group, head_dim, ATTNP_ROWS))
            .ok_or_else(|| {
                Error::Unsupported(format!(
                    "prefill attention: {group} q heads per KV head at head_dim {head_dim}"
                ))
            })?;
        let args = PrefillAttnArgs {
            qb: tokens as i32,
            ..args
        };
        let cfg = LaunchConfig {
            grid_dim: (
                args.n_kv as u32,
                (args.n as u32).div_ceil(args.qb as u32),
                1,
            ),
            block_dim: (ATTNP_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // The kernel with the fewest rows per warp that holds the CTA's rows.
        let rows = (args.qb * args.n_q / args.n_kv) as usize;
        let f = &self.k.attn_prefill[(rows > 8) as usize];
        launch!(self.gpu, f, cfg; args)
    }

    /// `y = W x`; with `accumulate`, `y += W x`. Skipped on the device while `*skip_if != 0`
    /// (`skip_if` = 0: never). With `ss_out` (a device address, 0: none; see
    /// [`Ops::producer_sums`]), each CTA leaves the sum of squares of the y it wrote there;
    /// returns how many (the CTAs of the launch).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv(
        &self,
        m: Nf4Ref,
        rows: usize,
        cols: usize,
        input: Input,
        y: u64,
        accumulate: bool,
        skip_if: u64,
        ss_out: u64,
    ) -> Result<usize> {
        let (rows_i, cols_i, acc, bias) = (rows as i32, cols as i32, accumulate as i32, 0u64);
        let kernel = self.gemv_kernel(rows, cols);
        if input.f16 && !self.stages_f16(kernel) {
            return Err(Error::Internal(
                "an f16 input given to a GEMV kernel that reads f32".into(),
            ));
        }
        let (x, norm) = self.input(input, cols)?;
        let epilogue = if accumulate {
            Epilogue::Accumulate
        } else {
            Epilogue::Store
        };
        let mats = [GemmMatrix { m, rows, bias: 0 }];
        if self.cfg.linear_mma {
            no_sums(ss_out)?;
            self.gemm(epilogue, &mats, cols, x, 1, y, rows, skip_if, false)?;
            return Ok(0);
        }
        match kernel {
            Gemv::V3 => self.gemv3(epilogue, &mats, cols, x, norm, y, skip_if, ss_out, false),
            Gemv::V2 => {
                let (j, kparts, cfg) = self.gemv_v2_launch(rows, cols, input.f16)?;
                let kp = kparts as i32;
                check_sums(ss_out, cfg.grid_dim.0)?;
                let f = if input.f16 {
                    &self.k.gemv2_nf4_x16
                } else {
                    &self.k.gemv2_nf4
                };
                launch!(self.gpu, &f[j - 1], cfg; m, x, norm, y, bias, rows_i, cols_i, kp, acc, skip_if, ss_out)?;
                Ok(cfg.grid_dim.0 as usize)
            }
        }
    }

    /// lm_head and the greedy argmax in one GEMV v2 kernel (`DV2_LOGITS_ARGMAX`, which
    /// compiles it): the logits of `m` into `y` as [`Ops::gemv`] stores them, their argmax into
    /// the state's next_token, and with `head.ring` the step's commit as commit_step does it;
    /// all skipped while `*skip_if != 0`. Returns false, having launched nothing, where the
    /// kernel does not apply (switched off, or lm_head not on GEMV v2); the caller then runs
    /// [`Ops::gemv`] and argmax_logits.
    #[allow(clippy::too_many_arguments)]
    pub fn logits_argmax(
        &self,
        m: Nf4Ref,
        rows: usize,
        cols: usize,
        input: Input,
        y: u64,
        skip_if: u64,
        head: LogitsHead,
    ) -> Result<bool> {
        let Some(kernels) = &self.k.gemv2_logits else {
            return Ok(false);
        };
        if self.cfg.linear_mma || self.gemv_kernel(rows, cols) != Gemv::V2 || input.f16 {
            return Ok(false);
        }
        let (j, kparts, mut cfg) = self.gemv_v2_launch(rows, cols, false)?;
        if cfg.grid_dim.0 as usize > MAX_ARGMAX_CTAS {
            return Ok(false);
        }
        cfg.shared_mem_bytes += GEMV2_PRMT_TABLE as u32; // the table, before x
                                                         // After the last check: without the producer's sums this launches the RMSNorm kernel.
        let (x, norm) = self.input(input, cols)?;
        let (rows_i, cols_i, kp) = (rows as i32, cols as i32, kparts as i32);
        let LogitsHead {
            state,
            scratch,
            eos,
            ring,
        } = head;
        launch!(self.gpu, &kernels[j - 1], cfg; m, x, norm, y, rows_i, cols_i, kp, skip_if, state, scratch, eos, ring)?;
        Ok(true)
    }

    /// Whether a GEMV `kernel` takes an f16 input ([`Input::raw_f16`]): GEMV v2.
    fn stages_f16(&self, kernel: Gemv) -> bool {
        !self.cfg.linear_mma && kernel == Gemv::V2
    }

    /// Whether the GEMV of a `rows` x `cols` matrix takes an f16 input.
    pub fn gemv_takes_f16(&self, rows: usize, cols: usize) -> bool {
        self.stages_f16(self.gemv_kernel(rows, cols))
    }

    /// Whether the SwiGLU of two `rows` x `cols` matrices can write f16 (GEMV v2).
    pub fn swiglu_writes_f16(&self, rows: usize, cols: usize) -> bool {
        !self.cfg.linear_mma && self.gemv_kernel(2 * rows, cols) == Gemv::V2
    }

    /// Whether the decode step writes the SwiGLU output (`intermediate` values from K =
    /// `hidden`) as f16 for the down GEMV (`DV2_FFN_F16`, default on): both are GEMV v2.
    pub fn ffn_act_f16(&self, intermediate: usize, hidden: usize) -> bool {
        self.cfg.ffn_f16
            && self.swiglu_writes_f16(intermediate, hidden)
            && self.gemv_takes_f16(hidden, intermediate)
    }

    /// Whether the decode step's GEMVs leave partial sums of squares for the next RMSNorm
    /// (`DV2_FUSE_RMS`, default on).
    pub fn producer_sums(&self) -> bool {
        self.cfg.fuse_rms && !self.cfg.linear_mma
    }

    /// q, k and v rows of `args` in one grid, written contiguously to `out`.
    /// Returns whether GEMV v3 ran in K halves (`DV2_QKV_KHALVES`, default, with attention v3,
    /// which adds them): `out` then holds the second half's sums after the rows.
    pub fn qkv(&self, args: QkvArgs, cols: usize, input: Input, out: u64) -> Result<bool> {
        let rows = args.rows.iter().sum::<i32>() as usize;
        let cols_i = cols as i32;
        let kernel = self.gemv_kernel(rows, cols);
        let (x, norm) = self.input(input, cols)?;
        let mats = [0, 1, 2].map(|i| GemmMatrix {
            m: args.m[i],
            rows: args.rows[i] as usize,
            bias: args.bias[i],
        });
        if self.cfg.linear_mma {
            return self
                .gemm(Epilogue::Store, &mats, cols, x, 1, out, rows, 0, false)
                .map(|_| false);
        }
        match kernel {
            Gemv::V3 => {
                let halves = self.k.gemv3_qkv_kh2.is_some()
                    && self.attn == Attention::V3
                    && norm.w != 0
                    && cols % 128 == 0;
                self.gemv3(Epilogue::Store, &mats, cols, x, norm, out, 0, 0, halves)?;
                Ok(halves)
            }
            Gemv::V2 => {
                let (j, kparts, cfg) = self.gemv_v2_launch(rows, cols, false)?;
                let kp = kparts as i32;
                launch!(self.gpu, &self.k.gemv2_qkv[j - 1], cfg; args, x, norm, out, cols_i, kp)
                    .map(|_| false)
            }
        }
    }

    /// `out = silu(gate x) * (up x)`, f32, or f16 with `out_f16` (only as
    /// [`Ops::swiglu_writes_f16`] allows).
    #[allow(clippy::too_many_arguments)]
    pub fn swiglu(
        &self,
        gate: Nf4Ref,
        up: Nf4Ref,
        rows: usize,
        cols: usize,
        input: Input,
        out: u64,
        out_f16: bool,
    ) -> Result<()> {
        let (rows_i, cols_i) = (rows as i32, cols as i32);
        let kernel = self.gemv_kernel(2 * rows, cols);
        if out_f16 && !self.swiglu_writes_f16(rows, cols) {
            return Err(Error::Internal(
                "an f16 SwiGLU output asked of a kernel that writes f32".into(),
            ));
        }
        let (x, norm) = self.input(input, cols)?;
        let mats = [gate, up].map(|m| GemmMatrix { m, rows, bias: 0 });
        if self.cfg.linear_mma {
            return self.gemm(Epilogue::Swiglu, &mats, cols, x, 1, out, rows, 0, false);
        }
        match kernel {
            Gemv::V3 => self
                .gemv3(Epilogue::Swiglu, &mats, cols, x, norm, out, 0, 0, false)
                .map(|_| ()),
            Gemv::V2 => {
                let (j, kparts, cfg) = self.gemv_v2_launch(rows, cols, false)?;
                let kp = kparts as i32;
                let f16 = i32::from(out_f16);
                let (early_ctas, early_rows) =
                    skewed_split(rows, cfg.grid_dim.0, GEMV2_SWIGLU_SKEW);
                launch!(self.gpu, &self.k.gemv2_swiglu[j - 1], cfg; gate, up, x, norm, out, rows_i, cols_i, kp, f16, early_ctas, early_rows)
            }
        }
    }

    /// Attention of one layer (RoPE and the KV write fused), then the merge into `out`.
    /// `args.n_splits` and `args.heads_per_cta` are ignored: each kernel sets its own.
    pub fn attention(&self, args: AttnArgs, out: u64) -> Result<()> {
        let max_seq = args.max_seq as usize;
        let merge = LaunchConfig {
            grid_dim: (args.n_q as u32, 1, 1),
            block_dim: ((args.head_dim as u32).next_multiple_of(32), 1, 1),
            shared_mem_bytes: 0,
        };
        let (pa, pm, st, hd, ms) = (
            args.part_acc,
            args.part_ml,
            args.state,
            args.head_dim,
            args.max_seq,
        );
        let parts = attn_split_parts(ATTN_SPLIT, (args.n_q / args.n_kv) as usize);
        match self.attn {
            Attention::V1 => {
                let args = AttnArgs {
                    n_splits: attn_splits_v1(max_seq) as i32,
                    ..args
                };
                let cfg = LaunchConfig {
                    grid_dim: (args.n_q as u32, args.n_splits as u32, 1),
                    block_dim: (ATTN_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                let ns = args.n_splits;
                launch!(self.gpu, &self.k.attn_decode, cfg; args)?;
                launch!(self.gpu, &self.k.attn_merge, merge; pa, pm, st, out, hd, ns, ms)
            }
            Attention::V3 => {
                // Dynamic shared memory: the running outputs of a CTA's q heads.
                let heads = (args.n_q / args.n_kv) as usize / parts;
                let args = AttnArgs {
                    n_splits: ATTN3_SPLITS as i32,
                    heads_per_cta: heads as i32,
                    ..args
                };
                // Grid (parts, splits, KV heads): the kernel takes its KV head from z and its
                // heads per CTA from the arguments, no division in code each warp runs once.
                let cfg = LaunchConfig {
                    grid_dim: (parts as u32, ATTN3_SPLITS, args.n_kv as u32),
                    block_dim: (ATTN_THREADS, 1, 1),
                    shared_mem_bytes: (heads * args.head_dim as usize * 4) as u32,
                };
                let f = &self.k.attn3_decode[match args.head_dim {
                    128 => 1,
                    64 => 2,
                    _ => 0,
                }];
                launch!(self.gpu, f, cfg, cluster = (1, ATTN3_SPLITS, 1); args, out)
            }
            Attention::V2 => {
                let chunks = max_seq.div_ceil(ATTN2_CHUNK);
                let args = AttnArgs {
                    n_splits: chunks as i32,
                    ..args
                };
                let cfg = LaunchConfig {
                    grid_dim: ((args.n_kv as usize * parts) as u32, chunks as u32, 1),
                    block_dim: (ATTN_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                let nc = chunks as i32;
                // For head_dim <= 128 the kernel unrolled for it: 1,720 SASS instructions
                // against 2,896, -0.018..-0.020 ms/token (docs/lab.md, 01f5749).
                let f = if args.head_dim <= 128 {
                    &self.k.attn2_decode_hd128
                } else {
                    &self.k.attn2_decode
                };
                launch!(self.gpu, f, cfg; args)?;
                launch!(self.gpu, &self.k.attn2_merge, merge; pa, pm, st, out, hd, nc, ms)
            }
        }
    }
}

fn no_sums(ss_out: u64) -> Result<()> {
    if ss_out != 0 {
        return Err(Error::Internal(
            "partial sums of squares asked of a kernel without them".into(),
        ));
    }
    Ok(())
}

/// CTAs per KV head for attention v2: the largest divisor of the GQA `group` that is at
/// most `requested`, so every CTA takes the same number of q heads.
fn attn_split_parts(requested: usize, group: usize) -> usize {
    (1..=requested.min(group).max(1))
        .rev()
        .find(|p| group % p == 0)
        .unwrap_or(1)
}

/// The partial sums of a grid of `ctas` must fit [`MAX_PARTIAL_SUMS`].
fn check_sums(ss_out: u64, ctas: u32) -> Result<()> {
    if ss_out != 0 && ctas as usize > MAX_PARTIAL_SUMS {
        return Err(Error::Unsupported(format!(
            "{ctas} CTAs leave more partial sums than the {MAX_PARTIAL_SUMS} the arena holds"
        )));
    }
    Ok(())
}

/// [`GemvChoice::Auto`]'s kernel for a `rows` x `cols` NF4 matrix.
fn auto_gemv(rows: usize, cols: usize) -> Gemv {
    if rows * cols / 2 < GEMV3_MAX_BYTES {
        Gemv::V3
    } else {
        Gemv::V2
    }
}

/// The GEMM width for `n` columns: the index into [`GEMM_NT`] of the narrowest width that
/// holds them, and the CTAs along n. (Without the 6-tile width, 33 to 48 columns took 8
/// tiles: docs/lab.md, 8cee403.)
fn gemm_width(n: usize) -> (usize, usize) {
    let idx = GEMM_NT
        .iter()
        .position(|&nt| 8 * nt >= n)
        .unwrap_or(GEMM_NT.len() - 1);
    (idx, n.div_ceil(8 * GEMM_NT[idx]).max(1))
}

/// CTAs per cluster of the GEMM (1 or 2): two, splitting K, when the grid of `ctas` CTAs of
/// one row tile each (`kw` = all warps on K) would leave half the SMs idle and each of the 2
/// `kw` parts still gets two 64-element blocks (docs/lab.md, 012ec78).
fn gemm_cluster(ctas: usize, kw: usize, k_blocks: usize, sms: usize) -> u32 {
    if kw == GEMM_WARPS && 2 * ctas <= sms && k_blocks >= 2 * 2 * kw {
        2
    } else {
        1
    }
}

/// Parts of K per CTA (1, 2, 4, 8): split K while the grid is under two CTAs per SM and each
/// part keeps at least two 64-element blocks.
fn gemm_k_parts(row_tiles: usize, ctas_n: usize, k_blocks: usize, sms: usize) -> usize {
    let mut kw = 1;
    while kw < GEMM_WARPS
        && k_blocks / (2 * kw) >= 2
        && row_tiles.div_ceil(GEMM_WARPS / kw) * ctas_n < 2 * sms
    {
        kw *= 2;
    }
    kw
}

/// GEMV v2's (early CTAs, rows each) for `rows` over `ctas` CTAs with the first half taking
/// `skew` rows more than an equal share (kernels/decode.cu, gemv2_walk); (0, 0): equal shares,
/// as without a skew or where the rest would get none.
fn skewed_split(rows: usize, ctas: u32, skew: i32) -> (i32, i32) {
    let (rows, ctas) = (rows as i64, ctas as i64);
    let early = ctas / 2;
    let early_rows = (rows + ctas - 1) / ctas + skew as i64;
    let rest = rows - early * early_rows;
    if skew == 0 || early == 0 || early_rows < 0 || rest < 0 {
        return (0, 0);
    }
    (early as i32, early_rows as i32)
}

/// GEMV v2 shape for K = cols: the fewest warps per row (1, 2, 4, 8) whose lanes need at most
/// 3 chunks of 32 elements each (the register budget for x).
pub fn gemv2_shape(cols: usize) -> Result<(usize, u32)> {
    let chunks = cols / 32;
    for kparts in [1u32, 2, 4, 8] {
        let j = chunks.div_ceil(32 * kparts as usize).max(1);
        if j <= 3 {
            return Ok((j, kparts));
        }
    }
    Err(Error::Unsupported(format!(
        "K = {cols}: the GEMV kernels take K up to {GEMV2_MAX_K}"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemm_shapes() {
        assert_eq!(gemm_width(1), (0, 1));
        assert_eq!(gemm_width(8), (0, 1));
        assert_eq!(gemm_width(9), (1, 1));
        assert_eq!(gemm_width(33), (2, 1));
        assert_eq!(gemm_width(48), (2, 1));
        assert_eq!(gemm_width(49), (3, 1));
        assert_eq!(gemm_width(64), (3, 1));
        assert_eq!(gemm_width(200), (3, 4));
        // Qwen2.5-3B q/k/v at N = 64: 80 row tiles -> split K until the grid fills 132 SMs.
        assert_eq!(gemm_k_parts(80, 1, 32, 132), 8);
        // gate/up at N = 128: 688 tiles in 172 CTAs -> two K parts for 2.6 waves.
        assert_eq!(gemm_k_parts(688, 2, 32, 132), 2);
        assert_eq!(gemm_k_parts(2752, 1, 32, 132), 1);
        // K of one block cannot be split.
        assert_eq!(gemm_k_parts(1, 1, 1, 132), 1);
        // 48 tokens: o and down (64 row tiles, 64 CTAs) in clusters of two; q/k/v (80 CTAs)
        // and anything with K parts to spare not.
        assert_eq!(gemm_cluster(64, 8, 32, 132), 2);
        assert_eq!(gemm_cluster(64, 8, 172, 132), 2);
        assert_eq!(gemm_cluster(80, 8, 32, 132), 1);
        assert_eq!(gemm_cluster(64, 4, 32, 132), 1);
        assert_eq!(gemm_cluster(64, 8, 16, 132), 1);
        assert_eq!(attn_prefill_tokens(8, 128, 32), Some(4));
        assert_eq!(attn_prefill_tokens(8, 128, 8), Some(1));
        assert_eq!(attn_prefill_tokens(16, 128, 8), None);
        assert_eq!(attn_prefill_tokens(2, 256, 32), Some(8));
        assert_eq!(attn_prefill_tokens(32, 256, 32), None);
    }

    #[test]
    fn partial_sums_must_fit_the_arena() {
        assert!(check_sums(0, u32::MAX).is_ok(), "no sums asked: any grid");
        assert!(check_sums(0x1000, MAX_PARTIAL_SUMS as u32).is_ok());
        let err = check_sums(0x1000, MAX_PARTIAL_SUMS as u32 + 1).unwrap_err();
        assert!(err.to_string().contains("partial sums"), "{err}");
    }

    #[test]
    fn auto_gemv_takes_tensor_cores_for_the_small_matrices() {
        let s = &crate::arch::QWEN25_3B;
        let qkv = (s.n_q_heads + 2 * s.n_kv_heads) * s.head_dim;
        assert_eq!(auto_gemv(qkv, s.hidden), Gemv::V3);
        assert_eq!(auto_gemv(s.hidden, s.n_q_heads * s.head_dim), Gemv::V3);
        assert_eq!(auto_gemv(2 * s.intermediate, s.hidden), Gemv::V2);
        assert_eq!(auto_gemv(s.hidden, s.intermediate), Gemv::V2);
        assert_eq!(auto_gemv(s.vocab, s.hidden), Gemv::V2);
    }

    #[test]
    fn attention_splits_a_group_evenly() {
        assert_eq!(attn_split_parts(2, 8), 2);
        assert_eq!(attn_split_parts(4, 6), 3);
        assert_eq!(attn_split_parts(2, 1), 1);
        assert_eq!(attn_split_parts(16, 8), 8);
        assert_eq!(attn_split_parts(1, 8), 1);
    }

    #[test]
    fn skewed_splits_cover_the_rows() {
        // Gate/up at the 3B shape: 42 rows a CTA, 132 CTAs of 50, the other 132 share 4408.
        assert_eq!(skewed_split(11008, 264, 8), (132, 50));
        assert_eq!(skewed_split(11008, 264, 0), (0, 0));
        assert_eq!(skewed_split(11008, 264, -8), (132, 34));
        // Past the rows: equal shares.
        assert_eq!(skewed_split(100, 264, 8), (0, 0));
        for (rows, ctas, skew) in [
            (11008usize, 264u32, 8i32),
            (11008, 264, -10),
            (4864, 264, 3),
        ] {
            let (e, er) = skewed_split(rows, ctas, skew);
            let rest = ctas as i32 - e;
            let late = (rows as i32 - e * er + rest - 1) / rest;
            assert!(e * er + (ctas as i32 - e) * late >= rows as i32);
        }
    }

    #[test]
    fn gemv2_shapes_cover_k_with_little_waste() {
        assert_eq!(gemv2_shape(64).unwrap(), (1, 1));
        assert_eq!(gemv2_shape(2048).unwrap(), (2, 1));
        assert_eq!(gemv2_shape(3072).unwrap(), (3, 1));
        assert_eq!(gemv2_shape(11008).unwrap(), (3, 4));
        assert_eq!(gemv2_shape(18944).unwrap(), (3, 8));
        assert!(gemv2_shape(32768).is_err());
    }
}
