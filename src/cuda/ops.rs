//! Kernel launches with their launch shapes: the one place that knows each kernel's argument
//! list and grid. The backend and the microbenchmarks both launch through [`Ops`].
//!
//! Variants, chosen at load (each kept so its gain can be measured against its absence):
//! `DV2_GEMV=v1|v2` (default v2: persistent CTAs, x held in registers) and `DV2_ATTN=v1|v2`
//! (default v2: one CTA per KV head and 32-slot chunk). `DV2_FUSE_RMS=1` folds RMSNorm into
//! the GEMV v2 prologue (off by default: it measured slower than the separate kernel). v1 GEMV takes `DV2_GEMV_NR=1|2|4|8`
//! (rows per CTA); v2 takes `DV2_GEMV_CTAS=n` (CTAs per SM, default 1).

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

use super::device::{driver_error, Gpu};
use super::kernels::{
    Kernels, ATTN2_CHUNK, ATTN2_MAX_CHUNKS, ATTN2_MAX_GROUP, ATTN2_MAX_GROUP_X_HD, ATTN_THREADS,
    GEMV_THREADS, GEMV_WARPS, MAX_HEAD_DIM,
};
use super::weights::Nf4Ref;
use crate::arch::ArchSpec;
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
}
// SAFETY: plain old data matching the kernel's struct.
unsafe impl DeviceRepr for AttnArgs {}

/// kernels/decode.cu `NormArgs`: RMSNorm weights (bf16; 0 = no norm) and epsilon.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct NormArgs {
    pub w: u64,
    pub eps: f32,
}
// SAFETY: plain old data matching the kernel's struct (pointer, float, tail padding).
unsafe impl DeviceRepr for NormArgs {}

impl NormArgs {
    const NONE: Self = Self { w: 0, eps: 0.0 };
}

/// An RMSNorm to apply to a GEMV's input: weights, epsilon, and a buffer for the normed x
/// when the norm runs as its own kernel.
#[derive(Clone, Copy)]
pub struct Norm {
    pub w: u64,
    pub eps: f32,
    pub scratch: u64,
}

/// A GEMV's input vector, raw or to be RMS-normed first.
#[derive(Clone, Copy)]
pub struct Input {
    pub x: u64,
    pub norm: Option<Norm>,
}

impl Input {
    pub fn raw(x: u64) -> Self {
        Self { x, norm: None }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    V1,
    V2,
}

fn variant(var: &str) -> Variant {
    match std::env::var(var).as_deref() {
        Ok("v1") => Variant::V1,
        _ => Variant::V2,
    }
}

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
    pub gemv: Variant,
    pub attn: Variant,
    /// RMSNorm folded into the GEMV v2 prologue (`DV2_FUSE_RMS=1`; off by default: measured
    /// slower, docs/lab.md).
    pub fuse_rms: bool,
    sms: u32,
}

impl Ops {
    pub fn new(gpu: Gpu) -> Result<Self> {
        let k = Kernels::load(&gpu)?;
        let sms = gpu
            .ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver_error("multiprocessor count"))? as u32;
        Ok(Self {
            gpu,
            k,
            gemv: variant("DV2_GEMV"),
            attn: variant("DV2_ATTN"),
            fuse_rms: std::env::var("DV2_FUSE_RMS").is_ok_and(|v| v == "1"),
            sms,
        })
    }

    /// Checks the shapes the chosen kernels take; attention v2 falls back to v1 where its
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
            self.attn = Variant::V1;
        }
        for k in [s.hidden, s.intermediate] {
            gemv2_shape(k)?;
        }
        Ok(())
    }

    fn gemv_v1_launch(&self, rows: usize) -> (u32, LaunchConfig) {
        let kparts = match std::env::var("DV2_GEMV_NR")
            .ok()
            .and_then(|v| v.parse::<u32>().ok())
        {
            Some(nr @ (1 | 2 | 4 | 8)) => GEMV_WARPS / nr,
            _ if rows >= 4096 => 1,
            _ if rows >= 1024 => 2,
            _ => 8,
        };
        let rows_per_cta = (GEMV_WARPS / kparts) as usize;
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(rows_per_cta) as u32, 1, 1),
            block_dim: (GEMV_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        (kparts, cfg)
    }

    /// v2: (chunks per lane J, warps per row) for K = cols, and the persistent grid.
    fn gemv_v2_launch(&self, rows: usize, cols: usize) -> Result<(usize, u32, LaunchConfig)> {
        let (j, kparts) = gemv2_shape(cols)?;
        let per_sm = std::env::var("DV2_GEMV_CTAS")
            .ok()
            .and_then(|v| v.parse::<u32>().ok())
            .filter(|n| (1..=8).contains(n))
            .unwrap_or(1);
        let row_lanes = (GEMV_WARPS / kparts) as usize;
        let ctas = (self.sms * per_sm)
            .min(rows.div_ceil(row_lanes) as u32)
            .max(1);
        let cfg = LaunchConfig {
            grid_dim: (ctas, 1, 1),
            block_dim: (GEMV_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        Ok((j, kparts, cfg))
    }

    /// Resolves a GEMV input: with a norm and the fused path (GEMV v2 and
    /// `DV2_FUSE_RMS=1`), the raw x and the norm arguments for the kernel's prologue; otherwise the RMSNorm
    /// kernel writes the normed x to the scratch buffer, which the GEMV then reads.
    fn input(&self, input: Input, cols: usize) -> Result<(u64, NormArgs)> {
        match input.norm {
            None => Ok((input.x, NormArgs::NONE)),
            Some(n) if self.gemv == Variant::V2 && self.fuse_rms => {
                Ok((input.x, NormArgs { w: n.w, eps: n.eps }))
            }
            Some(n) => {
                self.rms(input.x, n.w, n.scratch, cols, n.eps)?;
                Ok((n.scratch, NormArgs::NONE))
            }
        }
    }

    /// `out = x * rsqrt(mean(x^2) + eps) * w` over `n` elements (one CTA).
    pub fn rms(&self, x: u64, w: u64, out: u64, n: usize, eps: f32) -> Result<()> {
        let n = n as i32;
        launch!(self.gpu, &self.k.rms_norm, one_cta(512); x, w, out, n, eps)
    }

    /// `y = W x`; with `accumulate`, `y += W x`. Skipped on the device while `*skip_if != 0`
    /// (`skip_if` = 0: never).
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
    ) -> Result<()> {
        let (rows_i, cols_i, acc, bias) = (rows as i32, cols as i32, accumulate as i32, 0u64);
        let (x, norm) = self.input(input, cols)?;
        match self.gemv {
            Variant::V1 => {
                let (kparts, cfg) = self.gemv_v1_launch(rows);
                let kp = kparts as i32;
                launch!(self.gpu, &self.k.gemv_nf4, cfg; m, x, y, bias, rows_i, cols_i, kp, acc, skip_if)
            }
            Variant::V2 => {
                let (j, kparts, cfg) = self.gemv_v2_launch(rows, cols)?;
                let kp = kparts as i32;
                launch!(self.gpu, &self.k.gemv2_nf4[j - 1], cfg; m, x, norm, y, bias, rows_i, cols_i, kp, acc, skip_if)
            }
        }
    }

    /// q, k and v rows of `args` in one grid, written contiguously to `out`.
    pub fn qkv(&self, args: QkvArgs, cols: usize, input: Input, out: u64) -> Result<()> {
        let rows = args.rows.iter().sum::<i32>() as usize;
        let cols_i = cols as i32;
        let (x, norm) = self.input(input, cols)?;
        match self.gemv {
            Variant::V1 => {
                let (kparts, cfg) = self.gemv_v1_launch(rows);
                let kp = kparts as i32;
                launch!(self.gpu, &self.k.gemv_qkv, cfg; args, x, out, cols_i, kp)
            }
            Variant::V2 => {
                let (j, kparts, cfg) = self.gemv_v2_launch(rows, cols)?;
                let kp = kparts as i32;
                launch!(self.gpu, &self.k.gemv2_qkv[j - 1], cfg; args, x, norm, out, cols_i, kp)
            }
        }
    }

    /// `out = silu(gate x) * (up x)`.
    #[allow(clippy::too_many_arguments)]
    pub fn swiglu(
        &self,
        gate: Nf4Ref,
        up: Nf4Ref,
        rows: usize,
        cols: usize,
        input: Input,
        out: u64,
    ) -> Result<()> {
        let (rows_i, cols_i) = (rows as i32, cols as i32);
        let (x, norm) = self.input(input, cols)?;
        match self.gemv {
            Variant::V1 => {
                let (kparts, cfg) = self.gemv_v1_launch(rows);
                let kp = kparts as i32;
                launch!(self.gpu, &self.k.gemv_swiglu, cfg; gate, up, x, out, rows_i, cols_i, kp)
            }
            Variant::V2 => {
                let (j, kparts, cfg) = self.gemv_v2_launch(rows, cols)?;
                let kp = kparts as i32;
                launch!(self.gpu, &self.k.gemv2_swiglu[j - 1], cfg; gate, up, x, norm, out, rows_i, cols_i, kp)
            }
        }
    }

    /// Attention of one layer (RoPE and the KV write fused), then the merge into `out`.
    /// `args.n_splits` is ignored: each variant sets its own from `args.max_seq`.
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
        match self.attn {
            Variant::V1 => {
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
            Variant::V2 => {
                let chunks = max_seq.div_ceil(ATTN2_CHUNK);
                let args = AttnArgs {
                    n_splits: chunks as i32,
                    ..args
                };
                let cfg = LaunchConfig {
                    grid_dim: (args.n_kv as u32, chunks as u32, 1),
                    block_dim: (ATTN_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                let nc = chunks as i32;
                launch!(self.gpu, &self.k.attn2_decode, cfg; args)?;
                launch!(self.gpu, &self.k.attn2_merge, merge; pa, pm, st, out, hd, nc, ms)
            }
        }
    }
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
        "K = {cols}: the GEMV kernels take K up to {}",
        3 * 32 * 8 * 32
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

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
