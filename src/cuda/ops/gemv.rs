//! The GEMV launches: v2 (CUDA cores, kernels/gemv.cu) and v3 (tensor cores,
//! kernels/gemv_mma.cu), the family picked per matrix by its size.

use cudarc::driver::{CudaFunction, DeviceRepr, LaunchConfig};

use super::attention::Attention;
use super::gemm::{Epilogue, GemmArgs, GemmMatrix};
use super::{check_sums, no_sums, Input, NormArgs, Ops, MAX_ARGMAX_CTAS};
use crate::cuda::device::driver_error;
use crate::cuda::kernels::{
    gemv2_x_smem, Kernels, GEMV2_KWALK_KPARTS, GEMV2_KWALK_QKV_ROWS, GEMV2_KWALK_ROWS,
    GEMV2_KWALK_W16_ROWS, GEMV2_KWALK_W16_WARPS, GEMV2_MAX_K, GEMV2_PRMT_TABLE, GEMV2_X16_MAX_K,
    GEMV3_CTAS_PER_SM, GEMV3_KH2_CTAS_PER_SM, GEMV3_MAX_K, GEMV3_WARPS, GEMV_WARPS, KWALK_TABLE_AT,
};
use crate::cuda::weights::Nf4Ref;
use crate::error::{Error, Result};

/// kernels/common.cuh `QkvArgs`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct QkvArgs {
    pub m: [Nf4Ref; 3],
    pub bias: [u64; 3],
    pub rows: [i32; 3],
}

// SAFETY: plain old data matching the kernel's struct (pointers as u64, ints as i32).
unsafe impl DeviceRepr for QkvArgs {}

/// The K-part sums of its rows `gemv2_logits_j1_w20` keeps for one final reduction (the
/// kernel's `late_floats`, from this define): a vocabulary whose rows a CTA, times
/// [`SWIGLU_W20_KPARTS`], are more (past ~174k at 132 SMs) takes the J = 3 walk, since the
/// 20-warp walk's store as it goes runs in no test.
pub const LOGITS_W20_LATE_SUMS: usize = 6 * 1024;

/// Where lm_head's argmax kernel ([`Ops::logits_argmax`]) leaves its result: the decode
/// state (next_token), the argmax scratch ([`super::ARGMAX_SCRATCH`] words, zero between launches),
/// and with `ring` (a device address, 0: none) the commit of the greedy id, as commit_step
/// (appended to the ring and the request's history `hist`, fed next, finished at `eos`, -1:
/// none).
#[derive(Clone, Copy, Debug)]
pub struct LogitsHead {
    pub state: u64,
    pub scratch: u64,
    pub eos: i32,
    pub ring: u64,
    pub hist: u64,
}

/// The GEMV kernel family of a matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gemv {
    /// Persistent CTAs, x held in registers, an f16-pair table in shared memory
    /// (kernels/gemv.cu).
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

/// GEMV v2's CTAs per SM: its 128-register kernels fit two (1: 1.4457 vs 1.3076 ms/token,
/// docs/lab.md session 10).
pub const GEMV2_CTAS_PER_SM: u32 = 2;

/// The SwiGLU GEMV v2's first half of CTAs (those placed beside o's) takes this many rows more
/// each than an equal share (`skewed_split`): -0.024..-0.026 ms/token, the best of -8..8
/// (docs/lab.md, sessions 17-18; down and lm_head measured slower with any skew).
pub const GEMV2_SWIGLU_SKEW: i32 = 2;

/// The K at which SwiGLU runs over 5 warps a row, 20 warps a CTA, one chunk a lane
/// (`gemv2_swiglu_j1_w20`): 160 chunks, where the 8-warp shapes leave 3 of 8 chunk slots past K
/// (J = 2 over 4 warps) or spill (J = 3 over 2). +12.4% decode on the 32B shape against J = 2
/// over 4 warps (docs/lab.md, session 31). The kernel takes it and [`SWIGLU_W20_KPARTS`] as
/// compile-time constants (NVRTC defines).
pub const SWIGLU_W20_K: usize = 5 * 1024;

/// `gemv2_swiglu_j1_w20`'s K parts: 5 warps a row.
pub const SWIGLU_W20_KPARTS: u32 = 5;

/// `gemv2_swiglu_j1_w20`'s CTA: 20 warps, 4 rows a step of its walk, one CTA an SM (an NVRTC
/// define, as K and the K parts).
pub const SWIGLU_W20_WARPS: u32 = 20;

/// `gemv2_down_j1_w27`'s K (the 32B shape's down: 864 chunks, one a lane over 27 warps) and
/// its CTA, one an SM; the kernel takes both as constants.
pub const DOWN_W27_K: usize = 27 * 1024;
pub const DOWN_W27_WARPS: u32 = 27;

/// The shared memory a CTA may opt into on the devices that take the walks of one CTA an SM
/// (`gemv2_swiglu_j1_w20`, `gemv2_down_j1_w27`): an SM of 228 KB (sm_90, sm_100), where their
/// one table (and SwiGLU's x, ~76 KB in all) leave the rest to L1, as on the devices they were
/// measured on. SwiGLU's gain over two 10-warp CTAs an SM (+0.8-1.1% at depth 48 where the
/// same decode read +0.4%, docs/lab.md session 40) is thought to be that L1 (not profiled);
/// those two CTAs (~87 KB each) were taken only where they fit an SM too, so the 164 KB
/// (sm_80) and 100 KB (sm_86, sm_89, sm_120) SMs keep the J walk for SwiGLU and the K walk
/// (or GEMV v3) for down, as before.
pub(super) const ONE_CTA_AN_SM_MIN_SMEM: usize = 227 << 10;

/// Whether `gemv2_swiglu_j1_w20` runs with its table and x at K = [`SWIGLU_W20_K`]; else
/// SwiGLU at that K takes the J walk.
pub(super) fn swiglu_w20_fits(k: &Kernels, max_smem_per_cta: usize) -> Result<bool> {
    one_cta_an_sm_fits(
        &k.gemv2_swiglu_w20,
        "gemv2_swiglu_j1_w20",
        SWIGLU_W20_WARPS,
        prmt_table_and_x_smem(SWIGLU_W20_K, false),
        k.gemv2_swiglu_w20_room,
        max_smem_per_cta,
    )
}

/// Whether `gemv2_down_j1_w27` runs with its table at K = [`DOWN_W27_K`]; else down at that K
/// takes the K walk.
pub(super) fn down_w27_fits(k: &Kernels, max_smem_per_cta: usize) -> Result<bool> {
    one_cta_an_sm_fits(
        &k.gemv2_down_w27,
        "gemv2_down_j1_w27",
        DOWN_W27_WARPS,
        GEMV2_PRMT_TABLE,
        k.gemv2_down_w27_room,
        max_smem_per_cta,
    )
}

/// Whether a walk of one CTA an SM (`warps` warps asking `smem` bytes of dynamic shared
/// memory) runs here: on a device of [`ONE_CTA_AN_SM_MIN_SMEM`], within the room its function
/// was given, and with one CTA resident an SM (its registers and shared memory together).
fn one_cta_an_sm_fits(
    func: &CudaFunction,
    name: &str,
    warps: u32,
    smem: usize,
    room: usize,
    max_smem_per_cta: usize,
) -> Result<bool> {
    if max_smem_per_cta < ONE_CTA_AN_SM_MIN_SMEM || smem > room {
        return Ok(false);
    }
    let ctas = func
        .occupancy_max_active_blocks_per_multiprocessor(warps * 32, smem, None)
        .map_err(driver_error(&format!("{name}'s occupancy")))?;
    Ok(ctas >= 1)
}

impl Ops {
    /// argmax_logits' grid: a CTA of 256 threads per SM, each taking a slice of the logits
    /// (one CTA of 1024 threads measured slower: docs/lab.md, 25af0c8).
    pub fn argmax_launch(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (self.sms.min(MAX_ARGMAX_CTAS as u32), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// v2: (chunks per lane J, warps per row) for K = cols, at most `max_j` chunks a lane, and
    /// the persistent grid (x staged from f16 with `x_f16`, which takes J = 4 past
    /// [`GEMV2_MAX_K`]).
    fn gemv_v2_launch(
        &self,
        rows: usize,
        cols: usize,
        x_f16: bool,
        max_j: usize,
    ) -> Result<(usize, u32, LaunchConfig)> {
        let max_j = if x_f16 && cols > GEMV2_MAX_K {
            4
        } else {
            max_j
        };
        let (j, kparts) = gemv2_shape(cols, max_j)?;
        let cfg = self.gemv2_grid(rows, cols, x_f16, GEMV_WARPS, kparts)?;
        Ok((j, kparts, cfg))
    }

    /// Whether GEMV v2 walks K (kernels/gemv.cu, `gemv2_kwalk`), one CTA per `rows_per_cta`
    /// rows: where that grid is resident at once ([`GEMV2_CTAS_PER_SM`] an SM: the walk has no
    /// persistent loop) and x fits its f16 staging, for K past [`GEMV2_MAX_K`] from f16 x (the
    /// 32B shape's down, +2.0-2.8% decode against J = 4, docs/lab.md session 33; past
    /// [`GEMV2_X16_MAX_K`], [`Ops::gemv_v2_launch`] refuses with the limits named) and for
    /// matrices no wider than tall (the 32B shape's o and q/k/v: +1.2-1.4% decode from 48 to
    /// 8k against the J walk, session 35). Not for the wider ones below [`GEMV2_MAX_K`]: the
    /// 3B shape's down at K = 11,008 lost (session 33). The same choice from f32 and f16 x,
    /// so that both give the same sums.
    fn walks_k(&self, rows: usize, cols: usize, x_f16: bool, rows_per_cta: usize) -> bool {
        let resident = (self.sms * GEMV2_CTAS_PER_SM) as usize;
        walks_k_by_shape(rows, cols, x_f16, rows_per_cta, resident)
            && if x_f16 {
                self.gemv2_x_room(cols, true).is_ok()
            } else {
                kwalk_f32_fits(cols, self.gpu.caps.max_smem_per_cta)
            }
    }

    /// The K walk's grid where [`Ops::walks_k`]: one CTA of [`GEMV_WARPS`] per `rows_per_cta`
    /// rows, x staged as f16 (after the PRMT-addressed table where x comes as f32).
    fn kwalk_launch(
        &self,
        rows: usize,
        cols: usize,
        x_f16: bool,
        rows_per_cta: usize,
    ) -> Result<LaunchConfig> {
        let shared_mem_bytes = if x_f16 {
            self.gemv2_x_room(cols, true)?
        } else {
            prmt_table_and_x_smem(cols, true) as u32
        };
        Ok(LaunchConfig {
            grid_dim: (rows.div_ceil(rows_per_cta) as u32, 1, 1),
            block_dim: (GEMV_WARPS * 32, 1, 1),
            shared_mem_bytes,
        })
    }

    /// Whether a GEMV from f16 x that walks K takes the 16-warp kernel with its table at
    /// [`KWALK_TABLE_AT`] (kernels/gemv.cu, `gemv2_kwalk_x16_w16`; the 32B shape's down): its
    /// grid ([`GEMV2_KWALK_W16_ROWS`] rows a CTA) one CTA an SM, x below the table (4 KiB left
    /// for the reserved and static shared memory before x) and the table within what the
    /// device lets the kernel take (192 KiB: Hopper's 227, not sm_80's 163).
    fn walks_k_w16(&self, rows: usize, cols: usize) -> bool {
        self.walks_k(rows, cols, true, GEMV2_KWALK_ROWS)
            && rows.div_ceil(GEMV2_KWALK_W16_ROWS) <= self.sms as usize
            && gemv2_x_smem(cols, true) + 4096 <= KWALK_TABLE_AT
            && KWALK_TABLE_AT + GEMV2_PRMT_TABLE <= self.k.gemv2_kwalk_w16_room
    }

    /// GEMV v2's persistent grid for `rows` in CTAs of `warps`, `kparts` of them a row:
    /// [`GEMV2_CTAS_PER_SM`] an SM, or fewer where the rows run out, x staged for K = cols.
    fn gemv2_grid(
        &self,
        rows: usize,
        cols: usize,
        x_f16: bool,
        warps: u32,
        kparts: u32,
    ) -> Result<LaunchConfig> {
        let row_lanes = (warps / kparts) as usize;
        let ctas = (self.sms * GEMV2_CTAS_PER_SM)
            .min(rows.div_ceil(row_lanes) as u32)
            .max(1);
        Ok(LaunchConfig {
            grid_dim: (ctas, 1, 1),
            block_dim: (warps * 32, 1, 1),
            shared_mem_bytes: self.gemv2_x_room(cols, x_f16)?,
        })
    }

    /// The shared memory GEMV v2 stages x in for K = cols, or an error where the device does
    /// not let its kernels take that much ([`Kernels::gemv2_room`]).
    fn gemv2_x_room(&self, cols: usize, x_f16: bool) -> Result<u32> {
        let (need, room) = (gemv2_x_smem(cols, x_f16), self.k.gemv2_room[x_f16 as usize]);
        if need > room {
            return Err(Error::Unsupported(format!(
                "K = {cols}: GEMV v2 stages x in {need} bytes of shared memory, this device \
                 allows its kernels {room}"
            )));
        }
        Ok(need as u32)
    }

    /// The GEMV family for a `rows` x `cols` NF4 matrix (gate and up count together) whose x
    /// comes as f16 with `x_f16`.
    fn gemv_kernel(&self, rows: usize, cols: usize, x_f16: bool) -> Gemv {
        match self.gemv {
            GemvChoice::Fixed(v) => v,
            GemvChoice::Auto => auto_gemv(rows, cols, x_f16, self.k.gemv2_room[x_f16 as usize]),
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
        if k > GEMV3_MAX_K || !k.is_multiple_of(64) {
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
        let mut args = GemmArgs::new(mats, x, y, skip_if, 1, k, norm, ss_out);
        args.kw = GEMV3_WARPS as i32;
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
        // Persistent: GEMV3_CTAS_PER_SM (the registers allow two), each looping over groups
        // of 16 outputs.
        let groups = outputs.div_ceil(16) as u32;
        let mut cfg = LaunchConfig {
            grid_dim: (groups.min(GEMV3_CTAS_PER_SM * self.sms).max(1), 1, 1),
            block_dim: ((GEMV3_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: (k * 2) as u32,
        };
        if let (true, Some(kh2)) = (halves, &self.k.gemv3_qkv_kh2) {
            if epilogue != Epilogue::Store || ss_out != 0 {
                return Err(Error::Internal(
                    "GEMV v3 in K halves stores without sums".into(),
                ));
            }
            // Two CTAs a row group, GEMV3_KH2_CTAS_PER_SM an SM (the kernel's bounds).
            cfg.grid_dim.0 = 2 * groups.min(GEMV3_KH2_CTAS_PER_SM * self.sms / 2).max(1);
            args.ldy = outputs as i32;
            launch!(self.gpu, kh2, cfg; args)?;
            return Ok(cfg.grid_dim.0 as usize);
        }
        check_sums(ss_out, cfg.grid_dim.0)?;
        launch!(self.gpu, f, cfg; args)?;
        Ok(cfg.grid_dim.0 as usize)
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
        let kernel = self.gemv_kernel(rows, cols, input.f16);
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
            Gemv::V2 if input.f16 && cols == DOWN_W27_K && self.down_w27 => {
                // One CTA a row up to the SMs: 39 rows each at the 32B shape's 5,120.
                let cfg = LaunchConfig {
                    grid_dim: (self.sms.min(rows as u32), 1, 1),
                    block_dim: (DOWN_W27_WARPS * 32, 1, 1),
                    shared_mem_bytes: GEMV2_PRMT_TABLE as u32,
                };
                check_sums(ss_out, cfg.grid_dim.0)?;
                let f = &self.k.gemv2_down_w27;
                launch!(self.gpu, f, cfg; m, x, norm, y, rows_i, acc, skip_if, ss_out)?;
                Ok(cfg.grid_dim.0 as usize)
            }
            Gemv::V2 if input.f16 && self.walks_k_w16(rows, cols) => {
                let kp = GEMV2_KWALK_KPARTS;
                let cfg = LaunchConfig {
                    grid_dim: (rows.div_ceil(GEMV2_KWALK_W16_ROWS) as u32, 1, 1),
                    block_dim: (GEMV2_KWALK_W16_WARPS * 32, 1, 1),
                    // x from the start, the table at KWALK_TABLE_AT of the window past it.
                    shared_mem_bytes: (KWALK_TABLE_AT + GEMV2_PRMT_TABLE) as u32,
                };
                check_sums(ss_out, cfg.grid_dim.0)?;
                let f = &self.k.gemv2_kwalk_x16_w16;
                launch!(self.gpu, f, cfg; m, x, norm, y, bias, rows_i, cols_i, kp, acc, skip_if, ss_out)?;
                Ok(cfg.grid_dim.0 as usize)
            }
            Gemv::V2 if self.walks_k(rows, cols, input.f16, GEMV2_KWALK_ROWS) => {
                let kp = GEMV2_KWALK_KPARTS;
                let cfg = self.kwalk_launch(rows, cols, input.f16, GEMV2_KWALK_ROWS)?;
                check_sums(ss_out, cfg.grid_dim.0)?;
                let f = if input.f16 {
                    &self.k.gemv2_kwalk_x16
                } else {
                    &self.k.gemv2_kwalk_f32
                };
                launch!(self.gpu, f, cfg; m, x, norm, y, bias, rows_i, cols_i, kp, acc, skip_if, ss_out)?;
                Ok(cfg.grid_dim.0 as usize)
            }
            Gemv::V2 => {
                let (j, kparts, cfg) = self.gemv_v2_launch(rows, cols, input.f16, 3)?;
                let kp = kparts as i32;
                check_sums(ss_out, cfg.grid_dim.0)?;
                let f = match (input.f16, j) {
                    (true, 4) => &self.k.gemv2_nf4_x16_j4,
                    (true, _) => &self.k.gemv2_nf4_x16[j - 1],
                    (false, _) => &self.k.gemv2_nf4[j - 1],
                };
                launch!(self.gpu, f, cfg; m, x, norm, y, bias, rows_i, cols_i, kp, acc, skip_if, ss_out)?;
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
        if self.cfg.linear_mma || self.gemv_kernel(rows, cols, false) != Gemv::V2 || input.f16 {
            return Ok(false);
        }
        let table_and_x = prmt_table_and_x_smem(cols, false);
        let LogitsHead {
            state,
            scratch,
            eos,
            ring,
            hist,
        } = head;
        let rows_i = rows as i32;
        if let Some(w20) = self.logits_w20_launch(rows, cols, table_and_x) {
            let (x, norm) = self.input(input, cols)?;
            let f = self
                .k
                .gemv2_logits_w20
                .as_ref()
                .expect("checked by logits_w20_launch");
            launch!(self.gpu, f, w20; m, x, norm, y, rows_i, skip_if, state, scratch, eos, ring, hist)?;
            return Ok(true);
        }
        let (j, kparts, mut cfg) = self.gemv_v2_launch(rows, cols, false, 3)?;
        if cfg.grid_dim.0 as usize > MAX_ARGMAX_CTAS || table_and_x > self.k.gemv2_logits_room {
            return Ok(false);
        }
        // The table, before x.
        cfg.shared_mem_bytes = table_and_x as u32;
        // After the last check: without the producer's sums this launches the RMSNorm kernel.
        let (x, norm) = self.input(input, cols)?;
        let (cols_i, kp) = (cols as i32, kparts as i32);
        launch!(self.gpu, &kernels[j - 1], cfg; m, x, norm, y, rows_i, cols_i, kp, skip_if, state, scratch, eos, ring, hist)?;
        Ok(true)
    }

    /// lm_head's launch over SwiGLU's 20-warp walk (`gemv2_logits_j1_w20`: K and its parts the
    /// kernel's constants, one CTA an SM, the table and x in `table_and_x` bytes) where K is
    /// [`SWIGLU_W20_K`], SwiGLU's walk runs on this device and `DV2_LOGITS_W20` is on; else
    /// None.
    fn logits_w20_launch(
        &self,
        rows: usize,
        cols: usize,
        table_and_x: usize,
    ) -> Option<LaunchConfig> {
        let ctas = self.sms.min(MAX_ARGMAX_CTAS as u32);
        let fits = self.cfg.logits_w20
            && self.swiglu_w20
            && cols == SWIGLU_W20_K
            && rows.div_ceil(ctas as usize) * SWIGLU_W20_KPARTS as usize <= LOGITS_W20_LATE_SUMS
            && self.k.gemv2_logits_w20.is_some()
            && table_and_x <= self.k.gemv2_logits_w20_room;
        fits.then_some(LaunchConfig {
            grid_dim: (ctas, 1, 1),
            block_dim: (SWIGLU_W20_WARPS * 32, 1, 1),
            shared_mem_bytes: table_and_x as u32,
        })
    }

    /// Whether a GEMV `kernel` takes an f16 input ([`Input::raw_f16`]) and, for SwiGLU, writes
    /// f16: GEMV v2, unless `DV2_LINEAR=mma` runs the linears.
    fn stages_f16(&self, kernel: Gemv) -> bool {
        !self.cfg.linear_mma && kernel == Gemv::V2
    }

    /// Whether the GEMV of a `rows` x `cols` matrix takes an f16 input.
    pub fn gemv_takes_f16(&self, rows: usize, cols: usize) -> bool {
        self.stages_f16(self.gemv_kernel(rows, cols, true))
    }

    /// Whether the SwiGLU of two `rows` x `cols` matrices can write f16 (GEMV v2).
    pub fn swiglu_writes_f16(&self, rows: usize, cols: usize) -> bool {
        self.stages_f16(self.gemv_kernel(2 * rows, cols, false))
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
    /// Returns whether GEMV v3 ran in K halves (`DV2_QKV_KHALVES`, default, where the attention
    /// adds them): `out` then holds the second half's sums after the rows.
    pub fn qkv(&self, args: QkvArgs, cols: usize, input: Input, out: u64) -> Result<bool> {
        let rows = args.rows.iter().sum::<i32>() as usize;
        let cols_i = cols as i32;
        let kernel = self.gemv_kernel(rows, cols, false);
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
            Gemv::V2 if self.walks_k(rows, cols, false, GEMV2_KWALK_QKV_ROWS) => {
                // 4 rows a warp, 8 warps, each over the whole K.
                let cfg = self.kwalk_launch(rows, cols, false, GEMV2_KWALK_QKV_ROWS)?;
                let kp = 1i32;
                launch!(self.gpu, &self.k.gemv2_kwalk_qkv, cfg; args, x, norm, out, cols_i, kp)
                    .map(|_| false)
            }
            Gemv::V3 => {
                // Attention v1 alone does not add the halves (v2 and both long attentions do);
                // it runs only where the GQA group is too large for v2 (Ops::fit), and so for
                // either long attention too.
                let halves = self.k.gemv3_qkv_kh2.is_some()
                    && self.attn == Attention::V2
                    && norm.w != 0
                    && cols.is_multiple_of(128);
                self.gemv3(Epilogue::Store, &mats, cols, x, norm, out, 0, 0, halves)?;
                Ok(halves)
            }
            Gemv::V2 => {
                let (j, kparts, cfg) = self.gemv_v2_launch(rows, cols, false, 3)?;
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
        let kernel = self.gemv_kernel(2 * rows, cols, false);
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
            Gemv::V2 if cols == SWIGLU_W20_K && self.swiglu_w20 => {
                // 5 warps a row (kparts), 20 a CTA, one CTA an SM; the table before x. K and
                // kparts are the kernel's constants.
                let row_lanes = SWIGLU_W20_WARPS / SWIGLU_W20_KPARTS;
                let cfg = LaunchConfig {
                    grid_dim: (self.sms.min(rows.div_ceil(row_lanes as usize) as u32), 1, 1),
                    block_dim: (SWIGLU_W20_WARPS * 32, 1, 1),
                    shared_mem_bytes: prmt_table_and_x_smem(cols, false) as u32,
                };
                let f16 = i32::from(out_f16);
                let (early_ctas, early_rows) =
                    skewed_split(rows, cfg.grid_dim.0, GEMV2_SWIGLU_SKEW);
                launch!(self.gpu, &self.k.gemv2_swiglu_w20, cfg; gate, up, x, norm, out, rows_i, f16, early_ctas, early_rows)
            }
            Gemv::V2 => {
                // At most 2 chunks a lane where K allows (up to 16,384): J = 3's kernel spills
                // (kernels/gemv.cu, GEMV2_KERNELS).
                let (j, kparts, cfg) = self
                    .gemv_v2_launch(rows, cols, false, 2)
                    .or_else(|_| self.gemv_v2_launch(rows, cols, false, 3))?;
                let kp = kparts as i32;
                let f16 = i32::from(out_f16);
                let (early_ctas, early_rows) =
                    skewed_split(rows, cfg.grid_dim.0, GEMV2_SWIGLU_SKEW);
                launch!(self.gpu, &self.k.gemv2_swiglu[j - 1], cfg; gate, up, x, norm, out, rows_i, cols_i, kp, f16, early_ctas, early_rows)
            }
        }
    }
}

/// [`GemvChoice::Auto`]'s kernel for a `rows` x `cols` NF4 matrix: v3 also past v2's K, which
/// is [`GEMV2_X16_MAX_K`] where x comes as f16 (`x_f16`: down's input with `DV2_FFN_F16`; down
/// at the 32B shape, K = 27,648: +16% decode against v3, docs/lab.md session 30), else
/// [`GEMV2_MAX_K`], and where v2's x would not fit the `v2_room` bytes of shared memory the
/// device lets it take (v3 stages x in f16 and takes K up to 32,768 in 99 KiB a CTA).
fn auto_gemv(rows: usize, cols: usize, x_f16: bool, v2_room: usize) -> Gemv {
    let v2_max_k = if x_f16 { GEMV2_X16_MAX_K } else { GEMV2_MAX_K };
    if rows * cols / 2 < GEMV3_MAX_BYTES || cols > v2_max_k || gemv2_x_smem(cols, x_f16) > v2_room {
        Gemv::V3
    } else {
        Gemv::V2
    }
}

/// The dynamic shared memory of the kernels that hold the PRMT-addressed table before x
/// (kernels/gemv.cu: the K walks from f32 x, x staged as f16; `gemv2_swiglu_j1_w20` and
/// lm_head's `gemv2_logits`, x as f32) for K = cols.
fn prmt_table_and_x_smem(cols: usize, x_f16: bool) -> usize {
    GEMV2_PRMT_TABLE + gemv2_x_smem(cols, x_f16)
}

/// Whether two CTAs of the K walks from f32 x fit an SM (the grids of [`Ops::walks_k`] assume
/// [`GEMV2_CTAS_PER_SM`]), each with ~2 KiB of static and reserved shared memory beside its
/// dynamic, in an SM's `max_smem_per_cta` + 1 KiB: at K = 5,120 (77 KB a CTA) on sm_90 (227
/// KiB a CTA) and sm_80 (163), not on sm_86, sm_89 or sm_120 (99), whose f32-x linears take
/// the J walk instead.
fn kwalk_f32_fits(cols: usize, max_smem_per_cta: usize) -> bool {
    let per_sm = GEMV2_CTAS_PER_SM as usize;
    per_sm * (prmt_table_and_x_smem(cols, true) + 2048) <= max_smem_per_cta + 1024
}

/// [`Ops::walks_k`] but for the shared memory: by the matrix's shape, its x's type and whether
/// one CTA per `rows_per_cta` rows fits the `resident` CTAs a grid holds at once.
fn walks_k_by_shape(
    rows: usize,
    cols: usize,
    x_f16: bool,
    rows_per_cta: usize,
    resident: usize,
) -> bool {
    let shape = if cols > GEMV2_MAX_K {
        x_f16 && cols <= GEMV2_X16_MAX_K
    } else {
        cols <= rows
    };
    shape && rows.div_ceil(rows_per_cta) <= resident
}

/// GEMV v2's (early CTAs, rows each) for `rows` over `ctas` CTAs with the first half taking
/// `skew` rows more than an equal share (kernels/gemv.cu, gemv2_walk); (0, 0): equal shares,
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
/// `max_j` chunks of 32 elements each (the register budget for x).
pub fn gemv2_shape(cols: usize, max_j: usize) -> Result<(usize, u32)> {
    let chunks = cols / 32;
    for kparts in [1u32, 2, 4, 8] {
        let j = chunks.div_ceil(32 * kparts as usize).max(1);
        if j <= max_j {
            return Ok((j, kparts));
        }
    }
    Err(Error::Unsupported(format!(
        "K = {cols}: the GEMV kernels take K up to {GEMV2_MAX_K} ({GEMV2_X16_MAX_K} from f16 x)"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The x room of GEMV v2's f32-x kernels on the H200: what they ask (GEMV2_MAX_SMEM; the
    /// f16-x kernels' is less, 81,920 bytes, still past any K they take).
    const H200: usize = crate::cuda::kernels::GEMV2_MAX_SMEM;

    #[test]
    fn the_k_walk_takes_the_32b_shapes_o_qkv_and_down_alone() {
        let resident = 2 * 132; // GEMV2_CTAS_PER_SM on the H200's SMs
        let walks =
            |rows, cols, x_f16, per_cta| walks_k_by_shape(rows, cols, x_f16, per_cta, resident);
        let s = &crate::arch::QWEN25_32B;
        let qkv = (s.n_q_heads + 2 * s.n_kv_heads) * s.head_dim;
        assert!(walks(
            s.hidden,
            s.n_q_heads * s.head_dim,
            false,
            GEMV2_KWALK_ROWS
        ));
        assert!(walks(qkv, s.hidden, false, GEMV2_KWALK_QKV_ROWS));
        assert!(walks(s.hidden, s.intermediate, true, GEMV2_KWALK_ROWS));
        // down from f32 x (DV2_FFN_F16=0) is past v2's K; gate/up have their own kernels.
        assert!(!walks(s.hidden, s.intermediate, false, GEMV2_KWALK_ROWS));
        // The same choice from f16 x as from f32 x below GEMV2_MAX_K (the same sums).
        assert!(walks(s.hidden, s.hidden, true, GEMV2_KWALK_ROWS));
        let s = &crate::arch::QWEN25_3B;
        // The 3B shape's down is wider than tall (K = 11,008): the J walk (session 33).
        assert!(!walks(s.hidden, s.intermediate, true, GEMV2_KWALK_ROWS));
        assert!(!walks(s.hidden, s.intermediate, false, GEMV2_KWALK_ROWS));
        // A grid past what is resident at once (lm_head's rows) keeps the persistent J walk.
        assert!(!walks(s.vocab, s.hidden, false, GEMV2_KWALK_ROWS));
    }

    #[test]
    fn auto_gemv_takes_tensor_cores_for_the_small_matrices() {
        let s = &crate::arch::QWEN25_3B;
        let qkv = (s.n_q_heads + 2 * s.n_kv_heads) * s.head_dim;
        assert_eq!(auto_gemv(qkv, s.hidden, true, H200), Gemv::V3);
        assert_eq!(
            auto_gemv(s.hidden, s.n_q_heads * s.head_dim, true, H200),
            Gemv::V3
        );
        assert_eq!(
            auto_gemv(2 * s.intermediate, s.hidden, true, H200),
            Gemv::V2
        );
        assert_eq!(auto_gemv(s.hidden, s.intermediate, true, H200), Gemv::V2);
        assert_eq!(auto_gemv(s.vocab, s.hidden, true, H200), Gemv::V2);
        let s = &crate::arch::QWEN25_32B;
        // down at K = 27,648: v2 from f16 x, v3 from f32 x (DV2_FFN_F16=0).
        assert_eq!(auto_gemv(s.hidden, s.intermediate, true, H200), Gemv::V2);
        assert_eq!(auto_gemv(s.hidden, s.intermediate, false, H200), Gemv::V3);
        assert_eq!(
            auto_gemv(2 * s.intermediate, s.hidden, true, H200),
            Gemv::V2
        );
    }

    /// On a device that lets a CTA opt into 99 KiB of shared memory (sm_86, sm_89, sm_120),
    /// beside GEMV v2's static ~43 KiB: the 32B shape's down (K = 27,648 from f16 x: 69,120
    /// bytes of x) goes to v3, where on the H200 it fit; every other linear of the 3B and 32B
    /// shapes chooses as on the H200.
    #[test]
    fn auto_gemv_takes_v3_where_v2_x_does_not_fit_the_device() {
        const SM_86: usize = (99 << 10) - 43_520;
        let s = &crate::arch::QWEN25_32B;
        assert_eq!(gemv2_x_smem(s.intermediate, true), 69_120);
        assert_eq!(auto_gemv(s.hidden, s.intermediate, true, SM_86), Gemv::V3);
        for s in [&crate::arch::QWEN25_3B, &crate::arch::QWEN25_32B] {
            let q = s.n_q_heads * s.head_dim;
            let qkv = (s.n_q_heads + 2 * s.n_kv_heads) * s.head_dim;
            for (rows, cols) in [
                (qkv, s.hidden),
                (s.hidden, q),
                (2 * s.intermediate, s.hidden),
                (s.vocab, s.hidden),
            ] {
                for x_f16 in [false, true] {
                    assert_eq!(
                        auto_gemv(rows, cols, x_f16, SM_86),
                        auto_gemv(rows, cols, x_f16, H200)
                    );
                }
            }
        }
        let s = &crate::arch::QWEN25_3B;
        assert_eq!(auto_gemv(s.hidden, s.intermediate, true, SM_86), Gemv::V2);
    }

    /// The 32B shape's o and q/k/v (K = 5,120 from f32 x) walk K with the table before x where
    /// two such CTAs fit an SM.
    #[test]
    fn the_f32_x_k_walk_takes_two_ctas_an_sm_or_is_not_taken() {
        let k = crate::arch::QWEN25_32B.hidden;
        assert_eq!(prmt_table_and_x_smem(k, true), 65_536 + 12_800);
        assert!(kwalk_f32_fits(k, 227 << 10));
        assert!(kwalk_f32_fits(k, 163 << 10));
        assert!(!kwalk_f32_fits(k, 99 << 10));
        assert!(!kwalk_f32_fits(GEMV2_MAX_K, 163 << 10));
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
        assert_eq!(gemv2_shape(64, 3).unwrap(), (1, 1));
        assert_eq!(gemv2_shape(2048, 3).unwrap(), (2, 1));
        assert_eq!(gemv2_shape(3072, 3).unwrap(), (3, 1));
        assert_eq!(gemv2_shape(11008, 3).unwrap(), (3, 4));
        assert_eq!(gemv2_shape(18944, 3).unwrap(), (3, 8));
        assert!(gemv2_shape(32768, 3).is_err());
        // SwiGLU (J <= 2) at the 32B shape's K = 5,120; down from f16 x at K = 27,648.
        assert_eq!(gemv2_shape(5120, 2).unwrap(), (2, 4));
        assert_eq!(gemv2_shape(27648, 4).unwrap(), (4, 8));
        assert_eq!(gemv2_shape(32768, 4).unwrap(), (4, 8));
        assert!(gemv2_shape(32832, 4).is_err());
    }
}
