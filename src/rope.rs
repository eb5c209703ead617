//! Rotary position embedding, rotate-half convention (Hugging Face Llama / Qwen2), with the
//! frequency scalings llama-style checkpoints ship. Every backend reads RoPE from the cos/sin
//! tables built here, so a scaling lives in the tables alone and no kernel knows of it.

use std::f64::consts::PI;
use std::sync::Arc;

use crate::error::{host_buffer, Error, Result};
use crate::model::HostModel;

/// How a model's rotary frequencies depart from RoPE's `theta^(-2i/head_dim)`. Each form comes
/// down to one divisor a frequency pair ([`RopeScaling::divisors`]) and, for YaRN, a magnitude
/// both cos and sin are multiplied by ([`RopeScaling::magnitude`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub enum RopeScaling {
    #[default]
    None,
    /// Every frequency over `factor`: positions interpolated (`linear` in a Hugging Face
    /// config, `rope.scaling.type = linear` in a GGUF).
    Linear { factor: f32 },
    /// Llama 3.1's bands (`llama3` in a Hugging Face config): a pair whose wavelength is under
    /// `original_max_position / high_freq_factor` is kept, one over
    /// `original_max_position / low_freq_factor` is divided by `factor`, and one between is
    /// blended smoothly, as transformers' `_compute_llama3_parameters` does.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position: f32,
    },
    /// One divisor a pair, as a GGUF carries Llama 3.1's bands (`rope_freqs.weight`: llama.cpp's
    /// converter computes them from the `llama3` parameters, and its rope divides each pair's
    /// frequency by its entry).
    Divisors(Arc<[f32]>),
    /// YaRN (`yarn` in a Hugging Face config or a GGUF; Qwen2.5's long-context setting): pairs
    /// that turn more than `beta_fast` times over `original_max_position` are kept, fewer than
    /// `beta_slow` times divided by `factor`, a linear ramp between (its ends rounded out to
    /// whole pairs with `truncate`); cos and sin scaled by `attention_factor`. As transformers
    /// 5's `_compute_yarn_parameters`, vLLM and llama.cpp compute it, with `factor` as given
    /// (transformers 4.x recomputed it as max_position_embeddings / original).
    Yarn {
        factor: f32,
        original_max_position: f32,
        beta_fast: f32,
        beta_slow: f32,
        truncate: bool,
        attention_factor: f32,
    },
    /// Dynamic NTK (`dynamic` in a Hugging Face config; InternLM2's): the plain frequencies up
    /// to `max_position` positions, where transformers starts raising the base with the
    /// sequence's length. Past it the frequencies depend on the request's own length, which
    /// these tables cannot hold, so a table longer than `max_position` is refused.
    DynamicNtk { factor: f32, max_position: usize },
}

/// `v` as f64 when finite and > 0; else an error naming the parameter.
fn positive(name: &str, v: f32) -> Result<f64> {
    if v.is_finite() && v > 0.0 {
        Ok(v as f64)
    } else {
        Err(Error::InvalidSpec(format!(
            "RoPE scaling: {name} ({v}) must be finite and > 0"
        )))
    }
}

/// YaRN's default attention factor for a context stretched `factor` times (transformers'
/// `get_mscale`): 0.1 ln(factor) + 1, or 1 where it is not stretched.
pub fn yarn_mscale(factor: f64, mscale: f64) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * mscale * factor.ln() + 1.0
    }
}

impl RopeScaling {
    /// Each pair's divisor of its frequency `theta^(-2i/head_dim)`. The loaders call it to
    /// check a scaling whole: the error names the parameter that makes no table (a zero,
    /// negative or non-finite one, bands or betas in the wrong order, a divisor list of the
    /// wrong length).
    pub fn divisors(&self, head_dim: usize, theta: f32) -> Result<Vec<f64>> {
        let half = head_dim / 2;
        match self {
            Self::None => Ok(vec![1.0; half]),
            Self::DynamicNtk { factor, .. } => {
                positive("factor", *factor)?;
                Ok(vec![1.0; half])
            }
            Self::Linear { factor } => Ok(vec![positive("factor", *factor)?; half]),
            Self::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => {
                let factor = positive("factor", *factor)?;
                let low = positive("low_freq_factor", *low_freq_factor)?;
                let high = positive("high_freq_factor", *high_freq_factor)?;
                let old_len = positive("original_max_position_embeddings", *original_max_position)?;
                if high <= low {
                    return Err(Error::InvalidSpec(format!(
                        "RoPE scaling: high_freq_factor ({high}) must be > low_freq_factor ({low})"
                    )));
                }
                let (low_freq_wavelen, high_freq_wavelen) = (old_len / low, old_len / high);
                Ok((0..half)
                    .map(|i| {
                        let wavelen = 2.0 * PI / inverse_frequency(theta, i, head_dim);
                        if wavelen < high_freq_wavelen {
                            1.0
                        } else if wavelen > low_freq_wavelen {
                            factor
                        } else {
                            let smooth = (old_len / wavelen - low) / (high - low);
                            1.0 / ((1.0 - smooth) / factor + smooth)
                        }
                    })
                    .collect())
            }
            Self::Yarn {
                factor,
                original_max_position,
                beta_fast,
                beta_slow,
                truncate,
                attention_factor,
            } => {
                let factor = positive("factor", *factor)?;
                let old_len = positive("original_max_position_embeddings", *original_max_position)?;
                let (fast, slow) = (
                    positive("beta_fast", *beta_fast)?,
                    positive("beta_slow", *beta_slow)?,
                );
                positive("attention_factor", *attention_factor)?;
                if fast <= slow {
                    return Err(Error::InvalidSpec(format!(
                        "RoPE scaling: beta_fast ({fast}) must be > beta_slow ({slow})"
                    )));
                }
                // The dimension at which a pair turns `rotations` times over the original
                // length (transformers' find_correction_dim), then the ramp's ends.
                let dim = head_dim as f64;
                let turns_at = |rotations: f64| {
                    dim * (old_len / (rotations * 2.0 * PI)).ln() / (2.0 * (theta as f64).ln())
                };
                let (mut low, mut high) = (turns_at(fast), turns_at(slow));
                if *truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, high) = (low.max(0.0), high.min(dim - 1.0));
                let span = if high == low { 0.001 } else { high - low };
                // Pair i's frequency: (1 - ramp) of the original plus ramp of it over factor.
                Ok((0..half)
                    .map(|i| {
                        let ramp = ((i as f64 - low) / span).clamp(0.0, 1.0);
                        1.0 / (1.0 - ramp + ramp / factor)
                    })
                    .collect())
            }
            Self::Divisors(d) => {
                if d.len() != half {
                    return Err(Error::InvalidSpec(format!(
                        "RoPE scaling: {} frequency divisors for head_dim {head_dim} ({half} pairs)",
                        d.len()
                    )));
                }
                d.iter()
                    .enumerate()
                    .map(|(i, &v)| positive(&format!("divisor {i}"), v))
                    .collect()
            }
        }
    }

    /// What cos and sin are multiplied by: YaRN's attention factor, else 1.
    pub fn magnitude(&self) -> f64 {
        match self {
            Self::Yarn {
                attention_factor, ..
            } => *attention_factor as f64,
            _ => 1.0,
        }
    }
}

/// Pair `i`'s unscaled frequency, `theta^(-2i/head_dim)`, in f64.
fn inverse_frequency(theta: f32, i: usize, head_dim: usize) -> f64 {
    (theta as f64).powf(-((2 * i) as f64) / head_dim as f64)
}

/// cos/sin tables `[max_seq, head_dim/2]`, built once.
#[derive(Clone, Debug)]
pub struct RopeTable {
    half: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

impl RopeTable {
    /// Angles `pos * theta^(-2i/head_dim) / divisor_i`, computed in f64; their cos and sin times
    /// the scaling's magnitude, rounded to f32.
    pub fn new(max_seq: usize, head_dim: usize, theta: f32, scaling: &RopeScaling) -> Result<Self> {
        let half = head_dim / 2;
        let divisors = scaling.divisors(head_dim, theta)?;
        if let RopeScaling::DynamicNtk { max_position, .. } = *scaling {
            if max_seq > max_position {
                return Err(Error::Unsupported(format!(
                    "RoPE scaling dynamic: past {max_position} positions (max_position_embeddings) \
                     its frequencies follow the request's length, which decodev2 does not compute; \
                     set max_seq to {max_position} or less (asked: {max_seq})"
                )));
            }
        }
        let len = max_seq.checked_mul(half).ok_or_else(|| {
            Error::OutOfMemory(format!("RoPE tables for {max_seq} positions overflow"))
        })?;
        let mut cos: Vec<f32> = host_buffer(len, "RoPE cos table")?;
        let mut sin: Vec<f32> = host_buffer(len, "RoPE sin table")?;
        let frequencies: Vec<f64> = (0..half)
            .map(|i| inverse_frequency(theta, i, head_dim) / divisors[i])
            .collect();
        let magnitude = scaling.magnitude();
        for pos in 0..max_seq {
            for (i, f) in frequencies.iter().enumerate() {
                let angle = pos as f64 * f;
                cos[pos * half + i] = (angle.cos() * magnitude) as f32;
                sin[pos * half + i] = (angle.sin() * magnitude) as f32;
            }
        }
        Ok(Self { half, cos, sin })
    }

    /// The tables of `model`'s RoPE for positions `0..max_seq`.
    pub fn for_model(model: &HostModel, max_seq: usize) -> Result<Self> {
        let s = &model.spec;
        Self::new(max_seq, s.head_dim, s.rope_theta, &model.rope_scaling)
    }

    /// Rotates one head in place: `x*cos + rotate_half(x)*sin`, where
    /// `rotate_half([a, b]) = [-b, a]` over the two halves of the head.
    pub fn apply(&self, head: &mut [f32], pos: usize) {
        let (c, s) = (
            &self.cos[pos * self.half..(pos + 1) * self.half],
            &self.sin[pos * self.half..(pos + 1) * self.half],
        );
        let (a, b) = head.split_at_mut(self.half);
        for i in 0..self.half {
            let (x1, x2) = (a[i], b[i]);
            a[i] = x1 * c[i] - x2 * s[i];
            b[i] = x2 * c[i] + x1 * s[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn position_zero_is_identity_and_rotation_keeps_norm() {
        let t = RopeTable::new(8, 16, 10000.0, &RopeScaling::None).unwrap();
        let orig: Vec<f32> = (0..16).map(|i| i as f32 - 7.5).collect();
        let mut x = orig.clone();
        t.apply(&mut x, 0);
        assert_eq!(x, orig);
        t.apply(&mut x, 5);
        let n0: f32 = orig.iter().map(|v| v * v).sum();
        let n1: f32 = x.iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-3 * n0);
        // Pair 0 rotates by angle 5 (inv_freq 1).
        let (c, s) = (5f32.cos(), 5f32.sin());
        assert!((x[0] - (orig[0] * c - orig[8] * s)).abs() < 1e-5);
        assert!((x[8] - (orig[8] * c + orig[0] * s)).abs() < 1e-5);
    }

    const LLAMA31: RopeScaling = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position: 8192.0,
    };

    #[test]
    fn llama3_bands_match_transformers_form() {
        // transformers' _compute_llama3_parameters, written as it is there (a `where` on the
        // frequencies, the blend of inv/factor and inv), against the divisor form here.
        let (theta, head_dim) = (500_000.0f32, 128);
        let got = LLAMA31.divisors(head_dim, theta).unwrap();
        let (factor, low, high, old) = (8.0f64, 1.0f64, 4.0f64, 8192.0f64);
        for (i, d) in got.iter().enumerate() {
            let inv = inverse_frequency(theta, i, head_dim);
            let wavelen = 2.0 * PI / inv;
            let llama = if wavelen > old / low {
                inv / factor
            } else {
                inv
            };
            let smooth = (old / wavelen - low) / (high - low);
            let smoothed = (1.0 - smooth) * llama / factor + smooth * llama;
            // `~(wavelen < high_wl) * ~(wavelen > low_wl)` there; the values are finite.
            let medium = wavelen >= old / high && wavelen <= old / low;
            let want = if medium { smoothed } else { llama };
            let rel = (inv / d - want).abs() / want;
            assert!(rel < 1e-12, "pair {i}: {} vs {want}", inv / d);
        }
        // Llama 3.1 8B's bands, by hand: wavelength 2*pi*500000^(i/64) is under 2048 for
        // i <= 28 and over 8192 for i >= 35.
        assert!(got[..29].iter().all(|&d| d == 1.0));
        assert!(got[29..35].iter().all(|&d| d > 1.0 && d < 8.0));
        assert!(got[29..35].windows(2).all(|w| w[0] < w[1]));
        assert!(got[35..].iter().all(|&d| d == 8.0));
    }

    #[test]
    fn yarn_matches_transformers_form() {
        // Qwen2.5's long-context setting over Qwen2.5-7B's heads (128 dims, theta 1e6).
        let (theta, head_dim, factor, old) = (1e6f32, 128usize, 4.0f64, 32768.0f64);
        let yarn = RopeScaling::Yarn {
            factor: 4.0,
            original_max_position: 32768.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
            attention_factor: yarn_mscale(factor, 1.0) as f32,
        };
        let got = yarn.divisors(head_dim, theta).unwrap();
        // transformers' _compute_yarn_parameters, written as it is there.
        let dim = head_dim as f64;
        let base = theta as f64;
        let correction_dim = |rot: f64| (dim * (old / (rot * 2.0 * PI)).ln()) / (2.0 * base.ln());
        let low = correction_dim(32.0).floor().max(0.0);
        let high = correction_dim(1.0).ceil().min(dim - 1.0);
        // By hand: 128 ln(32768 / 64 pi) / 2 ln 1e6 = 23.6 and, for one turn, 39.65.
        assert_eq!((low, high), (23.0, 40.0));
        for (i, d) in got.iter().enumerate() {
            let extrapolation = 1.0 / base.powf(2.0 * i as f64 / dim);
            let interpolation = extrapolation / factor;
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let extrapolation_factor = 1.0 - ramp;
            let want =
                interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor;
            let inv = inverse_frequency(theta, i, head_dim) / d;
            assert!(
                (inv - want).abs() / want < 1e-12,
                "pair {i}: {inv} vs {want}"
            );
        }
        assert!(got[..=23].iter().all(|&d| d == 1.0));
        assert!(got[40..].iter().all(|&d| d == 4.0));
        // The magnitude: 0.1 ln 4 + 1 on cos and sin alike.
        let table = RopeTable::new(4, head_dim, theta, &yarn).unwrap();
        let m = 1.0 + 0.1 * 4f64.ln();
        assert_eq!(table.cos[0], m as f32);
        let (c, s) = (table.cos[3 * 64 + 5] as f64, table.sin[3 * 64 + 5] as f64);
        assert!(((c * c + s * s).sqrt() - m).abs() < 1e-6);
    }

    #[test]
    fn dynamic_ntk_is_the_plain_rope_within_its_length_and_refused_past_it() {
        let dynamic = RopeScaling::DynamicNtk {
            factor: 2.0,
            max_position: 64,
        };
        let plain = RopeTable::new(64, 16, 10_000.0, &RopeScaling::None).unwrap();
        let within = RopeTable::new(64, 16, 10_000.0, &dynamic).unwrap();
        assert_eq!((within.cos, within.sin), (plain.cos, plain.sin));
        let err = RopeTable::new(65, 16, 10_000.0, &dynamic).unwrap_err();
        assert!(
            err.to_string()
                .contains("set max_seq to 64 or less (asked: 65)"),
            "{err}"
        );
    }

    #[test]
    fn a_table_divides_each_pairs_angle() {
        let (theta, head_dim, pos) = (10_000.0f32, 16, 5usize);
        let plain = RopeTable::new(8, head_dim, theta, &RopeScaling::None).unwrap();
        let linear =
            RopeTable::new(8, head_dim, theta, &RopeScaling::Linear { factor: 4.0 }).unwrap();
        let divisors: Arc<[f32]> = (1..=8).map(|d| d as f32).collect();
        let per_pair =
            RopeTable::new(8, head_dim, theta, &RopeScaling::Divisors(divisors)).unwrap();
        for i in 0..head_dim / 2 {
            let angle = pos as f64 * inverse_frequency(theta, i, head_dim);
            let at = pos * head_dim / 2 + i;
            assert_eq!(plain.cos[at], angle.cos() as f32);
            assert_eq!(linear.sin[at], (angle / 4.0).sin() as f32);
            assert_eq!(per_pair.sin[at], (angle / (i + 1) as f64).sin() as f32);
        }
    }

    #[test]
    fn scalings_that_make_no_frequency_are_refused() {
        let llama3 = |low: f32, high: f32| RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: low,
            high_freq_factor: high,
            original_max_position: 8192.0,
        };
        for (scaling, needle) in [
            (RopeScaling::Linear { factor: 0.0 }, "factor (0)"),
            (RopeScaling::Linear { factor: f32::NAN }, "factor (NaN)"),
            (
                llama3(4.0, 1.0),
                "high_freq_factor (1) must be > low_freq_factor (4)",
            ),
            (llama3(1.0, 1.0), "must be > low_freq_factor"),
            (llama3(-1.0, 4.0), "low_freq_factor (-1)"),
            (
                RopeScaling::Divisors(Arc::from([1.0f32; 7])),
                "7 frequency divisors",
            ),
            (
                RopeScaling::Yarn {
                    factor: 4.0,
                    original_max_position: 64.0,
                    beta_fast: 1.0,
                    beta_slow: 32.0,
                    truncate: true,
                    attention_factor: 1.1,
                },
                "beta_fast (1) must be > beta_slow (32)",
            ),
            (
                RopeScaling::Yarn {
                    factor: 4.0,
                    original_max_position: 0.0,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                    truncate: true,
                    attention_factor: 1.1,
                },
                "original_max_position_embeddings (0)",
            ),
            (
                RopeScaling::Divisors(Arc::from([1.0, 2.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0f32])),
                "divisor 2 (0)",
            ),
        ] {
            let err = RopeTable::new(4, 16, 10_000.0, &scaling).unwrap_err();
            assert!(
                matches!(&err, Error::InvalidSpec(m) if m.contains(needle)),
                "{scaling:?}: {err}"
            );
        }
    }
}
