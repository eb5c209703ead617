//! Kernel launches with their launch shapes: the one place that knows each kernel's argument
//! list and grid. The backend and the microbenchmarks both launch through [`Ops`].
//!
//! What runs by default, and the switches that turn a part of it off ([`Config`]): GEMV v3
//! (tensor cores) below [`GEMV3_MAX_BYTES`] of weights, v2 above; the RMSNorm folded into the
//! next GEMV's x load (`DV2_FUSE_RMS`); SwiGLU's output in f16 for down (`DV2_FFN_F16`); q/k/v
//! in K halves (`DV2_QKV_KHALVES`); lm_head with the argmax and the step's commit
//! (`DV2_LOGITS_ARGMAX`); the long-context attention where the model's shape fits it
//! (`DV2_ATTN_LONG`), else attention v2; the prefill's tensor-core GEMM on f16 activations,
//! its attention on tensor cores where head_dim is 16, 32, 64 or 128, and its last layer on
//! the last token alone (`DV2_PREFILL_TAIL`);
//! `DV2_LINEAR=mma` runs the decode step's linears through that GEMM (the seed's ablation).
//! The tuning numbers are named constants below, each citing the lab row that chose it.

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{DeviceRepr, LaunchConfig};

use super::device::{driver_error, Gpu};
use super::kernels::{
    Kernels, ATTN2_MAX_GROUP, ATTN2_MAX_GROUP_X_HD, GEMV2_MAX_K, GEMV3_MAX_K, MAX_HEAD_DIM,
};
use crate::arch::ArchSpec;
use crate::config::Config;
use crate::error::{Error, Result};

mod attention;
mod gemm;
mod gemv;

pub use attention::{
    attn_counts_len, attn_long_fits, attn_long_partials, attn_partials, attn_prefill_tokens,
    Attention, AttnArgs, PrefillAttnArgs, PrefillSplitRoom,
};
pub(super) use gemm::GemmArgs;
pub use gemm::{Epilogue, GemmMatrix, RopeArgs};
pub use gemv::{
    Gemv, GemvChoice, LogitsHead, QkvArgs, DOWN_W27_K, DOWN_W27_WARPS, GEMV2_CTAS_PER_SM,
    GEMV2_SWIGLU_SKEW, GEMV3_MAX_BYTES, LOGITS_W20_LATE_SUMS, SWIGLU_W20_K, SWIGLU_W20_KPARTS,
    SWIGLU_W20_WARPS,
};

/// kernels/common.cuh `NormArgs`: RMSNorm weights (bf16; 0 = no norm), epsilon, and the
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
    /// The decode attention: v2, or v1 where [`Ops::fit`] finds v2's layout too small.
    pub attn: Attention,
    /// The long-context decode attention at every depth, in place of [`Ops::attn`]: where the
    /// device has clusters, `DV2_ATTN_LONG` is on and [`Ops::fit`] finds the model's shape
    /// taken.
    pub attn_long: bool,
    /// Without clusters, the long-context attention's walk in splits and attn2_merge
    /// ([`Ops::attention_long_flat`]), in place of [`Ops::attn`]: where `DV2_ATTN_LONG` is on
    /// and [`Ops::fit`] finds the shape taken.
    pub attn_long_flat: bool,
    /// Streaming multiprocessors of the device.
    pub(super) sms: u32,
    /// SwiGLU at K = 5,120 over 20 warps a CTA with its table in shared memory
    /// (`gemv2_swiglu_j1_w20`), where [`gemv::swiglu_w20_fits`].
    pub(super) swiglu_w20: bool,
    /// Down at K = [`DOWN_W27_K`] on `gemv2_down_j1_w27` (27 warps walking rows): with
    /// `DV2_DOWN_W27` on, where [`gemv::down_w27_fits`].
    pub(super) down_w27: bool,
}

impl Ops {
    pub fn new(gpu: Gpu, cfg: Config) -> Result<Self> {
        let k = Kernels::load(&gpu, &cfg)?;
        let sms = gpu
            .ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver_error("multiprocessor count"))? as u32;
        let attn_long = gpu.caps.clusters && cfg.attn_long;
        let attn_long_flat = !gpu.caps.clusters && cfg.attn_long;
        let swiglu_w20 = gemv::swiglu_w20_fits(&k, gpu.caps.max_smem_per_cta)?;
        let down_w27 = cfg.down_w27 && gemv::down_w27_fits(&k, gpu.caps.max_smem_per_cta)?;
        Ok(Self {
            gpu,
            k,
            cfg,
            gemv: GemvChoice::Auto,
            attn: Attention::V2,
            attn_long,
            attn_long_flat,
            sms,
            swiglu_w20,
            down_w27,
        })
    }

    /// Checks the shapes the kernels take ([`check_shape`]); attention v2 falls back to v1
    /// where its shared-memory layout does not fit the model's GQA group; the long-context
    /// attention is off where it does not take the shape. (v2 takes any max_seq: its splits
    /// are bounded by the SMs, not by the slots.)
    pub fn fit(&mut self, s: &ArchSpec) -> Result<()> {
        check_shape(s)?;
        let group = s.n_q_heads / s.n_kv_heads;
        if group > ATTN2_MAX_GROUP || group * s.head_dim > ATTN2_MAX_GROUP_X_HD {
            self.attn = Attention::V1;
        }
        self.attn_long &= attn_long_fits(s);
        self.attn_long_flat &= attn_long_fits(s);
        Ok(())
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
}

/// Whether the CUDA kernels take the model's shape, from the spec alone (no device, no
/// weights): head_dim, and K of the linears (the spec's own check keeps them multiples of 64).
/// K = hidden feeds GEMV v2 (gate/up, lm_head with its argmax), K = n_q_heads x head_dim o,
/// held to the same limit, K = intermediate only down, which GEMV v3 takes past v2's limit.
pub fn check_shape(s: &ArchSpec) -> Result<()> {
    if s.head_dim > MAX_HEAD_DIM || !s.head_dim.is_multiple_of(8) {
        return Err(Error::Unsupported(format!(
            "head_dim {} (the CUDA kernels take a multiple of 8 up to {MAX_HEAD_DIM})",
            s.head_dim
        )));
    }
    if s.hidden > GEMV2_MAX_K {
        return Err(Error::Unsupported(format!(
            "hidden {}: the CUDA kernels take hidden up to {GEMV2_MAX_K}",
            s.hidden
        )));
    }
    if s.q_dim() > GEMV2_MAX_K {
        return Err(Error::Unsupported(format!(
            "{} q heads of {}: the CUDA kernels take n_q_heads x head_dim up to {GEMV2_MAX_K}",
            s.n_q_heads, s.head_dim
        )));
    }
    if s.intermediate > GEMV3_MAX_K {
        return Err(Error::Unsupported(format!(
            "intermediate {}: the CUDA kernels take intermediate up to {GEMV3_MAX_K}",
            s.intermediate
        )));
    }
    Ok(())
}

fn no_sums(ss_out: u64) -> Result<()> {
    if ss_out != 0 {
        return Err(Error::Internal(
            "partial sums of squares asked of a kernel without them".into(),
        ));
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::super::device::Capabilities;
    use super::*;

    /// Each architecture's limits pick its paths: clusters and PDL from sm_90 on (unless
    /// `DV2_HOPPER=0`), the opt-in shared memory as reported.
    #[test]
    fn capabilities_choose_the_paths_by_architecture() {
        let defaults = Config::default();
        let no_hopper = Config {
            hopper: false,
            ..Config::default()
        };
        let no_pdl = Config {
            pdl: false,
            ..Config::default()
        };
        // (arch, major, opt-in shared memory per CTA as the CUDA guide lists it)
        for (arch, major, smem) in [
            ("sm_80", 8, 163 << 10),
            ("sm_86", 8, 99 << 10),
            ("sm_89", 8, 99 << 10),
            ("sm_90", 9, 227 << 10),
            ("sm_100", 10, 227 << 10),
            ("sm_120", 12, 99 << 10),
        ] {
            let caps = Capabilities::of(major, smem, &defaults);
            let hopper = major >= 9;
            assert_eq!((caps.clusters, caps.pdl), (hopper, hopper), "{arch}");
            assert_eq!(caps.max_smem_per_cta, smem, "{arch}");
            let off = Capabilities::of(major, smem, &no_hopper);
            assert!(!off.clusters && !off.pdl, "{arch}");
            let caps = Capabilities::of(major, smem, &no_pdl);
            assert_eq!((caps.clusters, caps.pdl), (hopper, false), "{arch}");
        }
    }

    #[test]
    fn partial_sums_must_fit_the_arena() {
        assert!(check_sums(0, u32::MAX).is_ok(), "no sums asked: any grid");
        assert!(check_sums(0x1000, MAX_PARTIAL_SUMS as u32).is_ok());
        let err = check_sums(0x1000, MAX_PARTIAL_SUMS as u32 + 1).unwrap_err();
        assert!(err.to_string().contains("partial sums"), "{err}");
    }
}
