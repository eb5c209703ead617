//! The attention launches: the decode step's (v1 and v2, kernels/attention.cu; the long-context
//! attention, kernels/attention_long.cu) and the prefill chunk's (kernels/attention_prefill.cu).

use cudarc::driver::{CudaFunction, DeviceRepr, LaunchConfig};

use super::Ops;
use crate::arch::ArchSpec;
use crate::cuda::kernels::{
    ATTN2_CHUNK, ATTN2_MAX_CHUNKS, ATTNF_COUNTS, ATTNL_MAX_CLUSTERS, ATTNL_MAX_GROUP, ATTNL_RANKS,
    ATTNM_ROWS, ATTNM_THREADS, ATTNP_MERGE_WAYS, ATTNP_Q_FLOATS, ATTNP_ROWS, ATTNP_THREADS,
    ATTNP_TILE, ATTN_THREADS,
};
use crate::error::{Error, Result};

/// kernels/attention.cu `AttnArgs`.
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
    /// Attention v2's q heads per CTA (set by [`Ops::attention`]).
    pub heads_per_cta: i32,
    /// Where kernels built with `DV2_QKV_KHALVES` (default) find q/k/v's second K-half sums, which
    /// the attention adds ([`Ops::qkv`] says whether it wrote them after its rows; else a
    /// zeroed buffer of the rows; unread otherwise).
    pub qkv2: u64,
}

// SAFETY: plain old data matching the kernel's struct.
unsafe impl DeviceRepr for AttnArgs {}

/// kernels/attention_prefill.cu `PrefillAttnArgs`.
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
    /// Splits of the slots (set by [`Ops::attn_prefill`]) and their partials' room.
    pub splits: i32,
    pub part_acc: u64,
    pub part_ml: u64,
}

/// Where a prefill chunk's attention may split its slots (`DV2_PREFILL_SPLIT`): the
/// position of its row 0 and the floats the partial buffers hold.
#[derive(Clone, Copy)]
pub struct PrefillSplitRoom {
    pub pos0: usize,
    pub acc_floats: usize,
    pub ml_floats: usize,
}

/// Splits of a tensor-core prefill attention of `ctas` CTAs whose last row is at `last`: up to
/// two CTAs an SM with at least 12 tiles (384 slots) a split, or, where that leaves SMs without
/// a CTA, up to one an SM with at least 8 tiles; as many as the partials hold. On the 3B
/// shape's 32-id turn (an H100) that is 8 / 21 / 32 splits after 2k / 8k / 32k, the best of
/// the (CTAs an SM, least tiles) settings measured at each: (1, 8), (2, 12), (2, 8..16)
/// (docs/lab.md, session 69).
fn prefill_splits(
    sms: usize,
    ctas: usize,
    last: usize,
    rows: usize,
    hd: usize,
    room: PrefillSplitRoom,
) -> usize {
    let tiles = last / ATTNP_TILE + 1;
    let fit = (room.acc_floats / (rows * hd)).min(room.ml_floats / (rows * 2));
    let one_an_sm = (sms / ctas).min(tiles / 8);
    (2 * sms / ctas)
        .min((tiles / 12).max(one_an_sm))
        .min(fit)
        .max(1)
}

// SAFETY: plain old data matching the kernel's struct.
unsafe impl DeviceRepr for PrefillAttnArgs {}

/// Tokens per CTA of the prefill attention for a model's group and head_dim, with at most
/// `rows` (token, q head) rows per CTA, or None when one token's rows do not fit a CTA.
pub fn attn_prefill_tokens(group: usize, head_dim: usize, rows: usize) -> Option<usize> {
    let rows = rows.min(ATTNP_ROWS).min(ATTNP_Q_FLOATS / head_dim);
    (group <= rows).then(|| rows / group)
}

/// The decode attention kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attention {
    /// A CTA per (q head, split) and a merge kernel: the fallback where v2's shared memory
    /// does not fit the model (a GQA group over 16, or over 2,048 q values per KV head, or
    /// over 32k slots).
    V1,
    /// CTAs per (KV head, split of the context), `ATTN2_SPLIT` of them sharing the group's q
    /// heads, each walking its split in 32-slot chunks, then the merge kernel: the default
    /// where the long-context attention does not take the shape.
    V2,
}

/// Attention v2's CTAs sharing a KV head's q heads (the largest divisor of the group at most
/// this): two q heads a CTA on the 3B shape, where one lost 0.7% at depth 48 and gained 14% at
/// 8k and 42% at 32k on an H100 (its splits each read by half as many CTAs; four heads: -5.0% /
/// +7.9% / +52%; docs/lab.md, session 65).
const ATTN2_SPLIT: usize = 4;

/// Whether the long-context decode attention takes the model's shape: head_dim 64 or 128, at
/// most [`ATTNL_MAX_GROUP`] q heads per KV head.
pub fn attn_long_fits(s: &ArchSpec) -> bool {
    matches!(s.head_dim, 64 | 128)
        && s.n_q_heads.is_multiple_of(s.n_kv_heads)
        && s.n_q_heads / s.n_kv_heads <= ATTNL_MAX_GROUP
}

/// The decode attention's counters (zeroed ints that every kernel leaves zeroed): the long
/// attention's cluster merge counts on ATTNL_RANKS a KV head; the tail merge
/// (`DV2_X_TAIL_MERGE=1`) on ATTNF_COUNTS for each set of CTAs sharing q heads, up to
/// `ATTN2_SPLIT` (4) a KV head (v2's parts; the flat long attention's one).
pub fn attn_counts_len(s: &ArchSpec) -> usize {
    s.n_kv_heads * ATTNL_RANKS.max(ATTN2_SPLIT * ATTNF_COUNTS)
}

/// Floats of the long-context attention's partials (outputs, then max and sum pairs): per KV
/// head, rank and cluster, [`ATTNL_MAX_GROUP`] heads of head_dim / ATTNL_RANKS dims.
pub fn attn_long_partials(s: &ArchSpec) -> (usize, usize) {
    let slices = s.n_kv_heads * ATTNL_RANKS * ATTNL_MAX_CLUSTERS * ATTNL_MAX_GROUP;
    (slices * s.head_dim / ATTNL_RANKS, slices * 2)
}

/// Attention time splits of a KV capacity: v1 splits it in up to 32 parts; v2 in at most one
/// split per 32 slots (`attn2_splits`). The arena holds partials for the larger of the two.
pub fn attn_partials(max_seq: usize) -> usize {
    attn_splits_v1(max_seq).max(max_seq.div_ceil(ATTN2_CHUNK))
}

fn attn_splits_v1(max_seq: usize) -> usize {
    (max_seq / 64).clamp(1, 32)
}

impl Ops {
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
    /// The tensor-core kernels split the slots where their CTAs would leave SMs idle (a short
    /// chunk deep in the context; as many splits as `room` holds), then attn_prefill_merge
    /// (`DV2_PREFILL_SPLIT=0`: never).
    pub fn attn_prefill(&self, args: PrefillAttnArgs, room: PrefillSplitRoom) -> Result<()> {
        if let Some(f) = self.attn_prefill_mma(args.head_dim as usize) {
            let rows = (args.n * args.n_q / args.n_kv) as u32;
            let (n_kv, tiles) = (args.n_kv as u32, rows.div_ceil(ATTNM_ROWS as u32));
            let splits = if self.cfg.prefill_split {
                prefill_splits(
                    self.sms as usize,
                    (n_kv * tiles) as usize,
                    room.pos0 + args.n as usize - 1,
                    (args.n * args.n_q) as usize,
                    args.head_dim as usize,
                    room,
                )
            } else {
                1
            };
            let args = PrefillAttnArgs {
                splits: splits as i32,
                ..args
            };
            let cfg = LaunchConfig {
                grid_dim: (n_kv, tiles, splits as u32),
                block_dim: (ATTNM_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            launch!(self.gpu, f, cfg; args)?;
            if splits == 1 {
                return Ok(());
            }
            let merge = LaunchConfig {
                grid_dim: ((args.n * args.n_q) as u32, 1, 1),
                block_dim: (
                    (args.head_dim as u32 / 2).next_multiple_of(32),
                    ATTNP_MERGE_WAYS as u32,
                    1,
                ),
                shared_mem_bytes: 0,
            };
            return launch!(self.gpu, &self.k.attn_prefill_merge, merge; args);
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

    /// Attention of one layer (RoPE and the KV write fused), then the merge into `out` (v2 with
    /// `DV2_X_TAIL_MERGE=1`: by its own last CTAs, counting on `counts`, [`attn_counts_len`]
    /// zeroed ints). `args.n_splits` and `args.heads_per_cta` are ignored: each kernel sets its
    /// own.
    pub fn attention(&self, args: AttnArgs, out: u64, counts: u64) -> Result<()> {
        let max_seq = args.max_seq as usize;
        let group = (args.n_q / args.n_kv) as usize;
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
                launch!(self.gpu, &self.k.attn_decode, cfg; args)?;
                self.merge_splits(&self.k.attn_merge, &args, out, args.n_splits)
            }
            Attention::V2 => {
                let parts = attn_split_parts(ATTN2_SPLIT, group);
                let heads = group / parts;
                let splits = attn2_splits(
                    ATTN2_CTAS_PER_SM,
                    self.sms as usize,
                    args.n_kv as usize * parts,
                    max_seq,
                );
                let args = AttnArgs {
                    n_splits: splits as i32,
                    heads_per_cta: heads as i32,
                    ..args
                };
                // Grid (parts, splits, KV heads): the kernel takes its KV head from z and its
                // heads per CTA from the arguments; dynamic shared memory: the running outputs
                // of a CTA's q heads.
                let cfg = LaunchConfig {
                    grid_dim: (parts as u32, splits as u32, args.n_kv as u32),
                    block_dim: (ATTN_THREADS, 1, 1),
                    shared_mem_bytes: (heads * args.head_dim as usize * 4) as u32,
                };
                let f = &self.k.attn2_decode[match args.head_dim {
                    128 => 1,
                    64 => 2,
                    _ => 0,
                }];
                self.walk_then_merge(f, cfg, args, out, counts, splits)
            }
        }
    }

    /// The merge of a decode attention's `splits` partials (`merge`: attn_merge or
    /// attn2_merge) into `out`: a CTA per q head, a thread per dim.
    fn merge_splits(
        &self,
        merge: &CudaFunction,
        args: &AttnArgs,
        out: u64,
        splits: i32,
    ) -> Result<()> {
        let cfg = LaunchConfig {
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
        launch!(self.gpu, merge, cfg; pa, pm, st, out, hd, splits, ms)
    }

    /// The long-context attention's walk without clusters, then attn2_merge into `out` (or,
    /// `DV2_X_TAIL_MERGE=1`, the walk's last CTAs merge, counting on `counts`,
    /// [`attn_counts_len`] zeroed ints): grid (1, splits, n_kv), about a CTA an SM, each every
    /// q head of its KV head over a split of whole 16-slot tiles. Measured against attention v2
    /// under `DV2_HOPPER=0` on an H100: +3.7% decode at depth 48, +5.7% at 2k, +23% at 8k, +81%
    /// at 32k (docs/lab.md, session 67).
    pub fn attention_long_flat(&self, args: AttnArgs, out: u64, counts: u64) -> Result<()> {
        let splits = attn2_splits(
            1,
            self.sms as usize,
            args.n_kv as usize,
            args.max_seq as usize,
        );
        let cfg = LaunchConfig {
            grid_dim: (1, splits as u32, args.n_kv as u32),
            block_dim: (ATTN_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = &self.k.attn_long_flat_decode[(args.head_dim == 128) as usize];
        self.walk_then_merge(f, cfg, args, out, counts, splits)
    }

    /// A walk of the context in `splits` splits (attention v2's or the flat long attention's
    /// kernel `f`), merged into `out`: by its own last CTAs counting on `counts`
    /// (`DV2_X_TAIL_MERGE=1`), else (null `out` and `counts`: partials alone) by attn2_merge.
    fn walk_then_merge(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        args: AttnArgs,
        out: u64,
        counts: u64,
        splits: usize,
    ) -> Result<()> {
        if self.cfg.tail_merge {
            return launch!(self.gpu, f, cfg; args, out, counts);
        }
        let (no_out, no_counts) = (0u64, 0u64);
        launch!(self.gpu, f, cfg; args, no_out, no_counts)?;
        self.merge_splits(&self.k.attn2_merge, &args, out, splits as i32)
    }

    /// The long-context decode attention of one layer (RoPE and the KV write fused) into
    /// `out`: grid (ATTNL_RANKS, clusters, n_kv) in clusters of ATTNL_RANKS, one CTA per SM
    /// at most when every cluster runs (the kernel leaves clusters idle at shorter context;
    /// two per SM measured slower past 8k, the second CTA of an SM rarely finding its
    /// registers free beside the kernels around it: docs/lab.md, session 22);
    /// `counts`: n_kv * ATTNL_RANKS zeroed ints the kernel's cross-cluster merge counts on.
    pub fn attention_long(&self, args: AttnArgs, out: u64, counts: u64) -> Result<()> {
        let clusters =
            (self.sms as usize / (ATTNL_RANKS * args.n_kv as usize)).clamp(1, ATTNL_MAX_CLUSTERS);
        let cfg = LaunchConfig {
            grid_dim: (ATTNL_RANKS as u32, clusters as u32, args.n_kv as u32),
            block_dim: (ATTN_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let f = &self.k.attn_long_decode[(args.head_dim == 128) as usize];
        launch!(self.gpu, f, cfg, cluster = (ATTNL_RANKS as u32, 1, 1); args, out, counts)
    }
}

/// Attention v2's CTAs an SM that its splits aim for: 4 measured faster than 16 on an H100 at
/// depths 48, 8k and 32k of the 3B shape, and than 8 with one CTA a KV head (docs/lab.md,
/// session 65).
const ATTN2_CTAS_PER_SM: usize = 4;

/// The splits of the context of a decode attention merged by attn2_merge: enough for
/// `ctas_per_sm` CTAs an SM ([`ATTN2_CTAS_PER_SM`] for attention v2, 1 for the long-context
/// one without clusters) over the `ctas_per_split` CTAs of a split, at most the chunks of
/// `max_seq` (the room [`attn_partials`] makes) and [`ATTN2_MAX_CHUNKS`] (attn2_merge's).
fn attn2_splits(ctas_per_sm: usize, sms: usize, ctas_per_split: usize, max_seq: usize) -> usize {
    (ctas_per_sm * sms)
        .div_ceil(ctas_per_split.max(1))
        .clamp(1, ATTN2_MAX_CHUNKS)
        .min(max_seq.div_ceil(ATTN2_CHUNK))
}

/// CTAs per KV head for attention v2: the largest divisor of the GQA `group` that is at
/// most `requested`, so every CTA takes the same number of q heads.
fn attn_split_parts(requested: usize, group: usize) -> usize {
    (1..=requested.min(group).max(1))
        .rev()
        .find(|p| group.is_multiple_of(*p))
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_splits_a_group_evenly() {
        assert_eq!(attn_prefill_tokens(8, 128, 32), Some(4));
        assert_eq!(attn_prefill_tokens(8, 128, 8), Some(1));
        assert_eq!(attn_prefill_tokens(16, 128, 8), None);
        assert_eq!(attn_prefill_tokens(2, 256, 32), Some(8));
        assert_eq!(attn_prefill_tokens(32, 256, 32), None);
        assert_eq!(attn_split_parts(2, 8), 2);
        // v2's splits: four CTAs an SM (the 3B shape's 8 a split on 132 SMs), capped by
        // max_seq's chunks and the merge's limit.
        assert_eq!(attn2_splits(ATTN2_CTAS_PER_SM, 132, 8, 32768), 66);
        assert_eq!(attn2_splits(ATTN2_CTAS_PER_SM, 132, 8, 64), 2);
        assert_eq!(attn2_splits(ATTN2_CTAS_PER_SM, 132, 8, 1), 1);
        assert_eq!(
            attn2_splits(ATTN2_CTAS_PER_SM, 4096, 1, 1 << 20),
            ATTN2_MAX_CHUNKS
        );
        assert_eq!(attn_split_parts(4, 6), 3);
        assert_eq!(attn_split_parts(2, 1), 1);
        assert_eq!(attn_split_parts(16, 8), 8);
        assert_eq!(attn_split_parts(1, 8), 1);
    }

    #[test]
    fn a_short_chunk_deep_in_the_context_splits_and_a_long_one_does_not() {
        // The 3B shape at max_seq 32,768: partials for 1,024 splits of 16 q heads of 128.
        let room = PrefillSplitRoom {
            pos0: 0,
            acc_floats: 16 * 1024 * 128,
            ml_floats: 16 * 1024 * 2,
        };
        // 32 ids after 32,512: 8 CTAs, two an SM (33 splits), as many as the partials hold.
        assert_eq!(prefill_splits(132, 8, 32543, 32 * 16, 128, room), 32);
        // After 8,192: 257 tiles, 12 a split (two CTAs an SM would be 33).
        assert_eq!(prefill_splits(132, 8, 8223, 32 * 16, 128, room), 21);
        // After 4,096: 129 tiles; 12 a split would leave SMs idle: one CTA an SM, 8 tiles or more.
        assert_eq!(prefill_splits(132, 8, 4127, 32 * 16, 128, room), 16);
        // After 2,048: 65 tiles, at least 8 a split.
        assert_eq!(prefill_splits(132, 8, 2079, 32 * 16, 128, room), 8);
        // A first chunk of 48 ids: 2 tiles, no split.
        assert_eq!(prefill_splits(132, 8, 47, 48 * 16, 128, room), 1);
        // A chunk of 2,048 ids fills the GPU: 2 x 256 CTAs.
        assert_eq!(prefill_splits(132, 512, 34559, 2048 * 16, 128, room), 1);
        // Partials for fewer: as many as fit (here 4 of the 32).
        let small = PrefillSplitRoom {
            acc_floats: 4 * 32 * 16 * 128,
            ml_floats: 4 * 32 * 16 * 2,
            ..room
        };
        assert_eq!(prefill_splits(132, 8, 32543, 32 * 16, 128, small), 4);
    }
}
