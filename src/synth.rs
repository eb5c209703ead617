//! Seeded synthetic models: the same seed gives the same bytes on every machine.
//!
//! Every tensor row draws from its own SplitMix64 stream keyed by (seed, tensor, row), so rows
//! can be generated on any number of threads. Values use only integer ops and exactly-rounded
//! f32 `+`/`*`, so no libm difference can change a byte.

use half::bf16;

use crate::arch::{ArchSpec, Family};
use crate::error::Result;
use crate::model::{HostModel, Layer, Linear, QkvWeights};
use crate::nf4::Nf4Matrix;
use crate::rope::RopeScaling;

/// Logit scale: lm_head rows have norm ~LOGIT_GAIN, so logits spread over a few units and
/// the greedy argmax has a margin well above bf16 rounding.
const LOGIT_GAIN: f32 = 4.0;

/// SplitMix64 (Steele, Lea, Flood 2014).
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 24 bits: exact in f32.
    fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / 16_777_216.0)
    }

    /// Mean 0, variance 1, bounded by ±2√3: a sum of four uniforms (Irwin–Hall), scaled.
    fn normalish(&mut self) -> f32 {
        let s = self.uniform() + self.uniform() + self.uniform() + self.uniform();
        (s - 2.0) * 1.732_050_8
    }
}

/// The stream for one row of one tensor.
fn stream(seed: u64, tensor: u64, row: u64) -> SplitMix64 {
    let mut key = SplitMix64(seed);
    let a = key.next_u64();
    let mut key = SplitMix64(a ^ tensor.wrapping_mul(0xD6E8_FEB8_6659_FD93));
    let b = key.next_u64();
    let mut rng = SplitMix64(b ^ row.wrapping_mul(0xA076_1D64_78BD_642F));
    rng.next_u64();
    rng
}

/// Tensor ids: one per (layer, role); globals use layer index `n_layers`.
#[derive(Clone, Copy)]
enum Role {
    Q = 0,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
    AttnNorm,
    FfnNorm,
    QBias,
    KBias,
    VBias,
    Wqkv,
    Embed,
    LmHead,
    FinalNorm,
}

struct Gen {
    seed: u64,
}

impl Gen {
    fn id(layer: usize, role: Role) -> u64 {
        (layer as u64) << 8 | role as u64
    }

    /// NF4 matrix with entries of standard deviation `std`.
    fn matrix(
        &self,
        layer: usize,
        role: Role,
        rows: usize,
        cols: usize,
        std: f32,
    ) -> Result<Nf4Matrix> {
        let tensor = Self::id(layer, role);
        Nf4Matrix::quantize_with(rows, cols, |r, row| {
            let mut rng = stream(self.seed, tensor, r as u64);
            row.iter_mut().for_each(|v| *v = rng.normalish() * std);
        })
    }

    /// `1 + 0.2 n` per element, rounded to bf16 (norm weights near one, but not one).
    fn norm(&self, layer: usize, role: Role, len: usize) -> Vec<bf16> {
        let mut rng = stream(self.seed, Self::id(layer, role), 0);
        (0..len)
            .map(|_| bf16::from_f32(1.0 + 0.2 * rng.normalish()))
            .collect()
    }

    /// Bias of standard deviation 0.5, rounded to bf16 precision (as checkpoints store it).
    fn bias(&self, layer: usize, role: Role, len: usize) -> Vec<f32> {
        let mut rng = stream(self.seed, Self::id(layer, role), 0);
        (0..len)
            .map(|_| bf16::from_f32(0.5 * rng.normalish()).to_f32())
            .collect()
    }

    fn linear(
        &self,
        layer: usize,
        role: Role,
        bias: Option<Role>,
        rows: usize,
        cols: usize,
    ) -> Result<Linear> {
        Ok(Linear {
            weight: self.matrix(layer, role, rows, cols, 1.0 / (cols as f32).sqrt())?,
            bias: bias.map(|b| self.bias(layer, b, rows)),
        })
    }
}

/// Builds the synthetic model of `spec` from `seed`. Deterministic from the seed alone.
pub fn build(spec: &ArchSpec, seed: u64) -> Result<HostModel> {
    spec.validate()?;
    let g = Gen { seed };
    let (h, kv, inter) = (spec.hidden, spec.kv_dim(), spec.intermediate);
    let k_std = 1.0 / (h as f32).sqrt();
    let mut layers = Vec::with_capacity(spec.n_layers);
    for l in 0..spec.n_layers {
        let qkv = match spec.family {
            Family::LlamaSwiglu => {
                let bias = |role| spec.qkv_bias.then_some(role);
                QkvWeights::Separate {
                    q: g.linear(l, Role::Q, bias(Role::QBias), spec.q_dim(), h)?,
                    k: g.linear(l, Role::K, bias(Role::KBias), kv, h)?,
                    v: g.linear(l, Role::V, bias(Role::VBias), kv, h)?,
                }
            }
            Family::InternlmGqa => QkvWeights::InternlmFused {
                wqkv: g.matrix(l, Role::Wqkv, spec.qkv_rows(), h, k_std)?,
            },
        };
        layers.push(Layer {
            attn_norm: g.norm(l, Role::AttnNorm, h),
            qkv,
            o: g.matrix(
                l,
                Role::O,
                h,
                spec.q_dim(),
                1.0 / (spec.q_dim() as f32).sqrt(),
            )?,
            ffn_norm: g.norm(l, Role::FfnNorm, h),
            gate: g.matrix(l, Role::Gate, inter, h, k_std)?,
            up: g.matrix(l, Role::Up, inter, h, k_std)?,
            down: g.matrix(l, Role::Down, h, inter, 1.0 / (inter as f32).sqrt())?,
        });
    }
    let top = spec.n_layers;
    let model = HostModel {
        spec: *spec,
        rope_scaling: RopeScaling::None,
        // Tied models read logits off the embedding, so it gets the lm_head scale.
        embed: g.matrix(
            top,
            Role::Embed,
            spec.vocab,
            h,
            if spec.tied_embed {
                LOGIT_GAIN * k_std
            } else {
                1.0
            },
        )?,
        layers,
        final_norm: g.norm(top, Role::FinalNorm, h),
        lm_head: if spec.tied_embed {
            None
        } else {
            Some(g.matrix(top, Role::LmHead, spec.vocab, h, LOGIT_GAIN * k_std)?)
        },
    };
    model.validate()?;
    Ok(model)
}

/// A deterministic prompt of `len` ids in `0..vocab` (for gates and benchmarks).
pub fn prompt(vocab: usize, len: usize, seed: u64) -> Vec<u32> {
    let mut rng = stream(seed, u64::MAX, 0);
    (0..len)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::{TINY_INTERNLM, TINY_LLAMA};

    fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
        bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
        })
    }

    #[test]
    fn same_seed_same_bytes_other_seed_other_bytes() {
        let a = build(&TINY_LLAMA, 0).unwrap();
        let b = build(&TINY_LLAMA, 0).unwrap();
        let c = build(&TINY_LLAMA, 1).unwrap();
        assert_eq!(a.embed, b.embed);
        assert_eq!(a.layers[1].down, b.layers[1].down);
        assert_ne!(a.embed, c.embed);
    }

    #[test]
    fn bytes_are_pinned_across_machines() {
        // A digest of the packed bytes of one matrix: if the generator or the codec changes
        // by one bit, this fails, on any machine.
        let m = build(&TINY_INTERNLM, 1).unwrap();
        let QkvWeights::InternlmFused { wqkv } = &m.layers[0].qkv else {
            panic!("family")
        };
        let digest = fnv1a(
            wqkv.packed
                .iter()
                .copied()
                .chain(wqkv.absmax.iter().flat_map(|a| a.to_le_bytes())),
        );
        assert_eq!(digest, PINNED_WQKV_DIGEST, "got {digest:#x}");
    }

    const PINNED_WQKV_DIGEST: u64 = 0x7de5_4380_bbdd_85d9;

    #[test]
    fn values_look_like_the_intended_distribution() {
        let m = build(&TINY_LLAMA, 3).unwrap();
        let w = m.layers[0].gate.dequantize();
        let mean = w.iter().sum::<f32>() / w.len() as f32;
        let var = w.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / w.len() as f32;
        let want = 1.0 / 64.0;
        assert!(
            mean.abs() < 0.02 && (var - want).abs() < 0.25 * want,
            "mean {mean} var {var}"
        );
        assert!(w.iter().all(|v| v.is_finite()));
        let p = prompt(32, 100, 9);
        assert!(
            p.iter().all(|&id| id < 32)
                && p.iter().collect::<std::collections::HashSet<_>>().len() > 10
        );
    }
}
