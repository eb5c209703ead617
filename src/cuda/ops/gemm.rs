//! The tensor-core NF4 GEMM's launch (kernels/gemm.cu): the chunked prefill's linears, and the
//! decode step's under `DV2_LINEAR=mma`.

use cudarc::driver::{DeviceRepr, LaunchConfig};

use super::{NormArgs, Ops};
use crate::cuda::kernels::{
    GEMM_NT, GEMM_WARPS, GEMM_WARP_ROWS, GEMV3_COLS, GEMV3_CTAS_PER_SM, GEMV3_WARPS,
};
use crate::cuda::weights::Nf4Ref;
use crate::error::{Error, Result};

/// kernels/gemm.cu `GemmArgs`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct GemmArgs {
    pub(super) m: [Nf4Ref; 3],
    pub(super) bias: [u64; 3],
    pub(super) rows: [i32; 3],
    pub(super) x: u64,
    pub(super) y: u64,
    pub(super) skip_if: u64,
    pub(super) n: i32,
    pub(super) k: i32,
    pub(super) ldy: i32,
    pub(super) kw: i32,
    pub(super) norm: NormArgs,
    pub(super) ss_out: u64,
}

// SAFETY: plain old data matching the kernel's struct.
unsafe impl DeviceRepr for GemmArgs {}

impl GemmArgs {
    /// The arguments of `mats` (at most three, stacked by rows) for y = W x over `n` columns of
    /// K = `k`; `kw` K parts per CTA, set by the caller's launch shape.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        mats: &[GemmMatrix],
        x: u64,
        y: u64,
        skip_if: u64,
        n: usize,
        k: usize,
        norm: NormArgs,
        ss_out: u64,
    ) -> Self {
        let mut args = GemmArgs {
            m: [Nf4Ref::default(); 3],
            bias: [0; 3],
            rows: [0; 3],
            x,
            y,
            skip_if,
            n: n as i32,
            k: k as i32,
            ldy: 0,
            kw: 1,
            norm,
            ss_out,
        };
        for (i, m) in mats.iter().enumerate() {
            args.m[i] = m.m;
            args.bias[i] = m.bias;
            args.rows[i] = m.rows as i32;
        }
        args
    }
}

/// kernels/gemv_mma.cu `RopeArgs`: what rope_kv_rows takes, for GEMV v3's column kernels to
/// store a short chunk's q/k/v rotated and k and v into the cache (`DV2_QKV_ROPE`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RopeArgs {
    pub k_cache: u64,
    pub v_cache: u64,
    pub cos: u64,
    pub sin: u64,
    pub state: u64,
    pub n_q: i32,
    pub n_kv: i32,
    pub head_dim: i32,
    /// The launch's first column of the chunk (set by the launch: x too big for one).
    pub col0: i32,
}

// SAFETY: plain old data matching the kernel's struct.
unsafe impl DeviceRepr for RopeArgs {}

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
    /// Device address of f32 `[rows]`, or 0.
    pub bias: u64,
}

impl Ops {
    /// The NF4 tensor-core GEMM over `n` columns: `x` is `[n][k]`, f16 (`f16`, a prefill chunk:
    /// the producers write it so) or f32 (at n = 1 only: `DV2_LINEAR=mma`'s decode step), `y`
    /// f32 `[n][ldy]` (SwiGLU with `f16`: f16); the matrices are stacked by rows (SwiGLU: gate
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
        if self.takes_columns(n, f16) {
            return self.gemv3_cols(epilogue, mats, k, x, n, y, ldy, skip_if, None);
        }
        let mut args = GemmArgs::new(mats, x, y, skip_if, n, k, NormArgs::NONE, 0);
        args.ldy = ldy as i32;
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
        let cluster_z = if self.gpu.caps.clusters {
            gemm_cluster(ctas_m * ctas_n, kw, k / 64, self.sms as usize)
        } else {
            1
        };
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

    /// Whether [`Ops::gemm`] takes `n` columns through GEMV v3's column kernels.
    fn takes_columns(&self, n: usize, f16: bool) -> bool {
        f16 && n <= GEMV3_COLS && self.cfg.prefill_gemv
    }

    /// q/k/v of a chunk of `n` f16 columns as [`Ops::gemm`]'s store, each row's q and k heads
    /// then rotated and its k and v written into the cache as `rope_kv_rows` does, in one
    /// launch (`DV2_QKV_ROPE`, default). Ok(false), nothing launched, where the
    /// chunk does not take the column kernels or the heads do not split into groups of 16
    /// pairs' rows; the caller then runs the GEMM and rope_kv_rows.
    #[allow(clippy::too_many_arguments)]
    pub fn qkv_rope(
        &self,
        mats: &[GemmMatrix],
        k: usize,
        x: u64,
        n: usize,
        y: u64,
        ldy: usize,
        rope: RopeArgs,
    ) -> Result<bool> {
        if !self.cfg.qkv_rope || !self.takes_columns(n, true) || rope.head_dim % 16 != 0 {
            return Ok(false);
        }
        self.gemv3_cols(Epilogue::Store, mats, k, x, n, y, ldy, 0, Some(rope))?;
        Ok(true)
    }

    /// [`Ops::gemm`]'s f16 case at `n` <= GEMV3_COLS columns on GEMV v3's column kernels:
    /// the columns that fit the shared memory the device allows a CTA at K = `k` a launch
    /// (the 32B shape's down: three), each launch reading the weights once.
    #[allow(clippy::too_many_arguments)]
    fn gemv3_cols(
        &self,
        epilogue: Epilogue,
        mats: &[GemmMatrix],
        k: usize,
        x: u64,
        n: usize,
        y: u64,
        ldy: usize,
        skip_if: u64,
        rope: Option<RopeArgs>,
    ) -> Result<()> {
        if epilogue == Epilogue::Accumulate && mats.len() != 1 {
            return Err(Error::Internal(
                "GEMV v3 accumulates one matrix at a time".into(),
            ));
        }
        let (kernel, outputs, y_bytes) = match epilogue {
            Epilogue::Store if rope.is_some() => (3, mats.iter().map(|m| m.rows).sum(), 4),
            Epilogue::Store => (0, mats.iter().map(|m| m.rows).sum(), 4),
            Epilogue::Accumulate => (1, mats[0].rows, 4),
            Epilogue::Swiglu => (2, mats[0].rows, 2),
        };
        let swiglu = epilogue == Epilogue::Swiglu;
        let groups = outputs.div_ceil(16) as u32;
        // CTAs of the kernels that read x from L2 (no dynamic shared memory) resident at once.
        let slots = cols_ctas_per_sm(0, swiglu) * self.sms;
        // Where each group of 16 outputs gets a CTA of its own at once (the 3B shape's q/k/v, o
        // and down in a check), staging x buys no reuse and holds the weights' loads back:
        // every column goes in one launch of the kernels that read x from L2 beside the weights
        // (DV2_COLS_X_L2=0: staged, in as many launches as fit; docs/lab.md, sessions 74 and
        // 76, the latter for an x of any size). Where CTAs walk several groups (the LM head,
        // gate/up, the 32B shape's), x stays staged, as timed.
        let from_l2 = self.cfg.cols_x_l2 && groups <= slots;
        let per_launch = if from_l2 {
            GEMV3_COLS
        } else {
            (self.k.gemv3_cols_room / (2 * k)).min(GEMV3_COLS)
        };
        if per_launch == 0 || !k.is_multiple_of(64) {
            return Err(Error::Unsupported(format!(
                "K = {k}: GEMV v3's column kernels take multiples of 64 whose column fits {} \
                 bytes of shared memory",
                self.k.gemv3_cols_room
            )));
        }
        let f = if from_l2 {
            &self.k.gemv3_cols_l2[kernel]
        } else {
            &self.k.gemv3_cols[kernel]
        };
        // From L2, a cluster of two CTAs a group, K split between them, where the groups alone
        // would leave over half the CTA slots empty (the 3B shape's o and down;
        // `DV2_COLS_SPLIT=0`: never).
        let cluster =
            if from_l2 && self.cfg.cols_split && self.gpu.caps.clusters && 2 * groups <= slots {
                2
            } else {
                1
            };
        let mut col = 0;
        while col < n {
            let cols = per_launch.min(n - col);
            let smem = if from_l2 { 0 } else { 2 * k * cols };
            let mut args = GemmArgs::new(
                mats,
                x + (2 * k * col) as u64,
                y + (y_bytes * ldy * col) as u64,
                skip_if,
                cols,
                k,
                NormArgs::NONE,
                0,
            );
            args.ldy = ldy as i32;
            args.kw = GEMV3_WARPS as i32;
            // Persistent CTAs over groups of 16 outputs: as many as stay resident together.
            let resident = cols_ctas_per_sm(smem, swiglu);
            let ctas = if cluster > 1 {
                cluster * groups
            } else {
                groups.min(resident * self.sms).max(1)
            };
            let cfg = LaunchConfig {
                grid_dim: (ctas, 1, 1),
                block_dim: ((GEMV3_WARPS * 32) as u32, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            match rope {
                Some(mut rope) => {
                    rope.col0 = col as i32;
                    launch!(self.gpu, f, cfg, cluster = (cluster, 1, 1); args, rope)?
                }
                None => launch!(self.gpu, f, cfg, cluster = (cluster, 1, 1); args)?,
            }
            col += cols;
        }
        Ok(())
    }
}

/// CTAs of GEMV v3's column kernels an SM holds at once with `smem` bytes of columns: their
/// registers allow GEMV3_CTAS_PER_SM; each also takes its 32 KiB table, its sums (T = 2 tiles
/// for SwiGLU) and the 1 KiB the driver reserves, of an SM's 228 KiB.
fn cols_ctas_per_sm(smem: usize, swiglu: bool) -> u32 {
    let tiles = if swiglu { 2 } else { 1 };
    let fixed = 32 * 1024 + GEMV3_WARPS * tiles * 16 * (GEMV3_COLS + 1) * 4 + 1024;
    ((228 * 1024) / (smem + fixed)).clamp(1, GEMV3_CTAS_PER_SM as usize) as u32
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn column_kernels_resident_by_their_shared_memory() {
        // 3B q/k/v and o (K = 2,048) at eight columns: two; down (K = 11,008): one.
        assert_eq!(cols_ctas_per_sm(8 * 2 * 2048, false), 2);
        assert_eq!(cols_ctas_per_sm(8 * 2 * 11008, false), 1);
        assert_eq!(cols_ctas_per_sm(8 * 2 * 5120, true), 1);
        assert_eq!(cols_ctas_per_sm(2 * 2048, true), 2);
    }

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
    }
}
