//! Rotary position embedding, rotate-half convention (Hugging Face Llama / Qwen2).

use crate::error::{host_buffer, Error, Result};

/// cos/sin tables `[max_seq, head_dim/2]`, built once.
#[derive(Clone, Debug)]
pub struct RopeTable {
    half: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

impl RopeTable {
    /// Angles `pos * theta^(-2i/head_dim)`, computed in f64 and rounded to f32.
    pub fn new(max_seq: usize, head_dim: usize, theta: f32) -> Result<Self> {
        let half = head_dim / 2;
        let len = max_seq.checked_mul(half).ok_or_else(|| {
            Error::OutOfMemory(format!("RoPE tables for {max_seq} positions overflow"))
        })?;
        let mut cos: Vec<f32> = host_buffer(len, "RoPE cos table")?;
        let mut sin: Vec<f32> = host_buffer(len, "RoPE sin table")?;
        for pos in 0..max_seq {
            for i in 0..half {
                let inv_freq = (theta as f64).powf(-((2 * i) as f64) / head_dim as f64);
                let angle = pos as f64 * inv_freq;
                cos[pos * half + i] = angle.cos() as f32;
                sin[pos * half + i] = angle.sin() as f32;
            }
        }
        Ok(Self { half, cos, sin })
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
        let t = RopeTable::new(8, 16, 10000.0).unwrap();
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
}
