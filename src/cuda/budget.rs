//! VRAM estimate, checked against the device's free memory before anything is allocated.

use super::sample::SamplerLens;
use crate::arch::ArchSpec;
use crate::error::{Error, Result};

/// Room kept free for the graph, the module and the driver's own allocations.
pub const RESERVE_BYTES: usize = 256 << 20;

/// Bytes the CUDA backend allocates for a model, by part.
#[derive(Clone, Copy, Debug)]
pub struct Budget {
    pub weights: usize,
    pub kv: usize,
    pub arena: usize,
    pub reserve: usize,
}

impl Budget {
    pub fn total(&self) -> usize {
        self.weights + self.kv + self.arena + self.reserve
    }

    /// `Err(OutOfMemory)` naming both numbers when the total exceeds `free`.
    pub fn check(&self, free: usize, total_device: usize) -> Result<()> {
        if self.total() <= free {
            return Ok(());
        }
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        Err(Error::OutOfMemory(format!(
            "the model needs {:.0} MiB (weights {:.0}, KV cache {:.0}, activations {:.0}, reserve {:.0}) \
             but the device has {:.0} MiB free of {:.0} MiB",
            mib(self.total()),
            mib(self.weights),
            mib(self.kv),
            mib(self.arena),
            mib(self.reserve),
            mib(free),
            mib(total_device)
        )))
    }
}

/// Packed NF4 bytes + block scales + biases + norm weights, as uploaded.
pub fn weight_bytes(s: &ArchSpec) -> usize {
    let nf4 = crate::nf4::stored_bytes;
    let per_layer = nf4(s.qkv_rows(), s.hidden)
        + nf4(s.hidden, s.q_dim())
        + 2 * nf4(s.intermediate, s.hidden)
        + nf4(s.hidden, s.intermediate)
        + if s.qkv_bias { s.qkv_rows() * 4 } else { 0 }
        + 2 * s.hidden * 2;
    let heads = if s.tied_embed { 1 } else { 2 };
    s.n_layers * per_layer + heads * nf4(s.vocab, s.hidden) + s.hidden * 2
}

/// KV capacities fitted to a device ([`largest_fitting`]) are multiples of this many slots.
pub const FIT_STEP: usize = 256;

/// The largest multiple of [`FIT_STEP`] up to `limit` for which `fits` holds, or None where not
/// even one step does. `fits` must be monotone (a budget that fits some capacity fits every
/// smaller one), as [`estimate`]'s total is.
pub fn largest_fitting(limit: usize, fits: impl Fn(usize) -> bool) -> Option<usize> {
    let mut most = limit / FIT_STEP;
    if most == 0 || !fits(FIT_STEP) {
        return None;
    }
    // Steps: `least` fits; `most` bounds the answer from above.
    let mut least = 1;
    while least < most {
        let mid = least + (most - least).div_ceil(2);
        if fits(mid * FIT_STEP) {
            least = mid;
        } else {
            most = mid - 1;
        }
    }
    Some(least * FIT_STEP)
}

/// Slots per layer in the KV cache: max_seq plus one poisoned guard slot.
pub fn kv_stride(max_seq: usize) -> usize {
    max_seq + 1
}

pub fn kv_bytes(s: &ArchSpec, max_seq: usize) -> usize {
    2 * s.n_layers * kv_stride(max_seq) * s.kv_dim() * 2
}

/// Elements (4 bytes each) of the activation arena's buffers, as the backend allocates them:
/// one list, so that the budget counts what is allocated.
pub struct ArenaLens {
    /// x and xn: a prefill chunk's rows of hidden (the decode step uses the first).
    pub rows_hidden: usize,
    /// attn: a chunk's rows of the attention's output, n_q_heads x head_dim.
    pub rows_q: usize,
    /// q/k/v: two rows at least (q/k/v's K halves, `DV2_QKV_KHALVES`, in the decode step).
    pub qkv: usize,
    pub act: usize,
    pub logits: usize,
    /// Attention partials: v1/v2's splits, or the long-context attention's, the larger.
    pub part_acc: usize,
    pub part_ml: usize,
    pub sums: usize,
    /// The prompt ids and the step ring.
    pub ids: usize,
    pub argmax: usize,
    pub attn_counts: usize,
    pub qkv_zeros: usize,
    pub state: usize,
    /// RoPE cos and sin, each `max_seq x head_dim / 2`.
    pub rope: usize,
    pub sampler: SamplerLens,
}

impl ArenaLens {
    pub fn new(s: &ArchSpec, max_seq: usize, chunk: usize) -> Self {
        use super::kernels::state;
        use super::ops::{
            attn_counts_len, attn_long_partials, attn_partials, ARGMAX_SCRATCH, MAX_PARTIAL_SUMS,
        };
        let rows = chunk.max(1);
        let partials = attn_partials(max_seq);
        let (long_acc, long_ml) = attn_long_partials(s);
        Self {
            rows_hidden: rows * s.hidden,
            rows_q: rows * s.q_dim(),
            qkv: rows.max(2) * s.qkv_rows(),
            act: rows * s.intermediate,
            logits: s.vocab,
            part_acc: (s.n_q_heads * partials * s.head_dim).max(long_acc),
            part_ml: (s.n_q_heads * partials * 2).max(long_ml),
            sums: MAX_PARTIAL_SUMS,
            ids: max_seq,
            argmax: ARGMAX_SCRATCH,
            attn_counts: attn_counts_len(s),
            qkv_zeros: s.qkv_rows(),
            state: state::LEN,
            rope: max_seq * (s.head_dim / 2),
            sampler: SamplerLens::new(s.vocab, max_seq),
        }
    }

    pub fn bytes(&self) -> usize {
        4 * (2 * self.rows_hidden
            + self.rows_q
            + self.qkv
            + self.act
            + self.logits
            + self.part_acc
            + self.part_ml
            + self.sums
            + 2 * self.ids
            + self.argmax
            + self.attn_counts
            + self.qkv_zeros
            + self.state
            + 2 * self.rope)
            + self.sampler.bytes()
    }
}

/// The budget of a model of shape `s` with `max_seq` KV slots and prefill chunks of `chunk`
/// tokens: from the shape alone, so that it is checked before any weight is read.
pub fn estimate(s: &ArchSpec, max_seq: usize, chunk: usize) -> Budget {
    Budget {
        weights: weight_bytes(s),
        kv: kv_bytes(s, max_seq),
        arena: ArenaLens::new(s, max_seq, chunk).bytes(),
        reserve: RESERVE_BYTES,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::QWEN25_3B;

    #[test]
    fn the_largest_fitting_capacity_is_a_whole_step() {
        // Every capacity up to 10,000 slots fits: 39 steps of 256 (9,984).
        assert_eq!(largest_fitting(131_072, |m| m <= 10_000), Some(9_984));
        assert_eq!(largest_fitting(131_072, |m| m <= 131_072), Some(131_072));
        assert_eq!(largest_fitting(1_000, |_| true), Some(768));
        assert_eq!(largest_fitting(131_072, |m| m < 256), None);
        assert_eq!(largest_fitting(100, |_| true), None);
        // On the budget itself: the 3B shape's weights and a KV cache in 8 GiB.
        let s = QWEN25_3B;
        let fits = |m: usize| estimate(&s, m, 512).check(8 << 30, 80 << 30).is_ok();
        let m = largest_fitting(1 << 20, fits).unwrap();
        assert!(fits(m) && !fits(m + FIT_STEP), "{m}");
    }

    #[test]
    fn too_big_names_both_numbers() {
        let b = Budget {
            weights: 3 << 30,
            kv: 1 << 30,
            arena: 1 << 20,
            reserve: RESERVE_BYTES,
        };
        let err = b.check(2 << 30, 4 << 30).unwrap_err().to_string();
        assert!(
            err.contains("needs 4353 MiB") && err.contains("2048 MiB free of 4096"),
            "{err}"
        );
        assert!(b.check(8 << 30, 8 << 30).is_ok());
    }

    #[test]
    fn qwen_3b_weights_are_about_1_7_gb() {
        // Only the spec matters for the estimate; build a model-free check of the formula.
        let s = QWEN25_3B;
        let nf4 = |r: usize, c: usize| r * c / 2 + r * c / 16;
        let linear = s.n_layers
            * (nf4(s.qkv_rows(), s.hidden)
                + nf4(s.hidden, s.hidden)
                + 3 * nf4(s.intermediate, s.hidden));
        let total = linear + nf4(s.vocab, s.hidden);
        assert!((1_700_000_000..1_800_000_000).contains(&total), "{total}");
        assert_eq!(kv_bytes(&s, 2048), 2 * 36 * 2049 * 256 * 2);
    }
}
