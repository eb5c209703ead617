//! The model on the device: packed NF4 matrices, f32 biases, bf16 norm weights.

use cudarc::driver::{CudaSlice, DeviceRepr};
use half::f16;
use half::slice::HalfFloatSliceExt;

use super::device::Gpu;
use super::staging::{Staging, WEIGHT_STAGE_BYTES};
use crate::error::Result;
use crate::model::{internlm_wqkv_rows, HostModel, QkvWeights};
use crate::nf4::Nf4Matrix;

/// A matrix as the kernels take it (kernels/common.cuh `Nf4Ref`): two device addresses and
/// the tensor-core GEMM's scale.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Nf4Ref {
    pub packed: u64,
    pub absmax: u64,
    /// See [`mma_scale`].
    pub mma_scale: f32,
}

// SAFETY: plain old data, laid out as the kernels' struct (two pointers, a float, padding).
unsafe impl DeviceRepr for Nf4Ref {}

/// The power of two the tensor-core GEMM multiplies a matrix's absmax by before rounding
/// weights to f16: it brings the largest |weight| near 2^14, so weights keep f16's full
/// precision (no subnormals) and never overflow; the GEMM divides it out of its sums.
pub fn mma_scale(absmax: &[f16]) -> f32 {
    // The largest finite |a| by its bits: a non-negative half's bits order as its value, and
    // an integer max vectorizes where a float one (NaN-aware, not reassociable) does not
    // (docs/lab.md, session 34: the float fold was ~1.5 s of each 32B load).
    const INFINITY_BITS: u16 = 0x7c00;
    let finite_bits = |a: &f16| {
        let b = a.to_bits() & 0x7fff;
        if b < INFINITY_BITS {
            b
        } else {
            0
        }
    };
    // Sixteen lanes of maxima (one vector register's worth), then the tail and the lanes.
    let mut lanes = [0u16; 16];
    let chunks = absmax.chunks_exact(16);
    let tail = chunks.remainder().iter().map(finite_bits).fold(0, u16::max);
    for chunk in chunks {
        for (lane, a) in lanes.iter_mut().zip(chunk) {
            *lane = (*lane).max(finite_bits(a));
        }
    }
    let max = f16::from_bits(lanes.into_iter().fold(tail, u16::max)).to_f32();
    if max == 0.0 {
        return 1.0;
    }
    let exp = (16384.0 / max).log2().floor().clamp(-120.0, 120.0) as i32;
    2f32.powi(exp)
}

/// A matrix's f16 scales as the device takes them: their bits.
pub fn scale_bits(absmax: &[f16]) -> &[u16] {
    absmax.reinterpret_cast()
}

pub struct DeviceMatrix {
    pub rows: usize,
    pub cols: usize,
    packed: CudaSlice<u8>,
    absmax: CudaSlice<u16>,
    mma_scale: f32,
}

impl DeviceMatrix {
    pub fn upload(gpu: &Gpu, m: &Nf4Matrix) -> Result<Self> {
        Self::upload_through(&mut Staging::new(gpu, false, WEIGHT_STAGE_BYTES), m)
    }

    fn upload_through(up: &mut Staging, m: &Nf4Matrix) -> Result<Self> {
        Ok(Self {
            rows: m.rows,
            cols: m.cols,
            packed: up.upload(&m.packed)?,
            absmax: up.upload(scale_bits(&m.absmax))?,
            mma_scale: mma_scale(&m.absmax),
        })
    }

    pub fn as_ref(&self, gpu: &Gpu) -> Nf4Ref {
        Nf4Ref {
            packed: gpu.ptr(&self.packed),
            absmax: gpu.ptr(&self.absmax),
            mma_scale: self.mma_scale,
        }
    }
}

pub struct DeviceLayer {
    pub attn_norm: CudaSlice<u16>,
    /// q, k, v (InternLM2's fused wqkv split by rows at upload: byte-exact).
    pub qkv: [DeviceMatrix; 3],
    pub qkv_bias: [Option<CudaSlice<f32>>; 3],
    pub o: DeviceMatrix,
    pub ffn_norm: CudaSlice<u16>,
    pub gate: DeviceMatrix,
    pub up: DeviceMatrix,
    pub down: DeviceMatrix,
}

pub struct DeviceModel {
    pub embed: DeviceMatrix,
    pub layers: Vec<DeviceLayer>,
    pub final_norm: CudaSlice<u16>,
    /// `None` when tied to `embed`.
    pub lm_head: Option<DeviceMatrix>,
}

impl DeviceModel {
    pub fn lm_head(&self) -> &DeviceMatrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

fn norm(up: &mut Staging, w: &[half::bf16]) -> Result<CudaSlice<u16>> {
    let bits: Vec<u16> = w.iter().map(|v| v.to_bits()).collect();
    up.upload(&bits)
}

fn bias(up: &mut Staging, b: &Option<Vec<f32>>) -> Result<Option<CudaSlice<f32>>> {
    b.as_ref().map(|b| up.upload(b)).transpose()
}

/// The model on `gpu`; `staged`: through page-locked staging buffers ([`Staging`]), else
/// each tensor copied from pageable memory (`DV2_STAGED_UPLOAD=0`).
pub fn upload(gpu: &Gpu, model: &HostModel, staged: bool) -> Result<DeviceModel> {
    let s = &model.spec;
    let up = &mut Staging::new(gpu, staged, WEIGHT_STAGE_BYTES);
    let m = DeviceMatrix::upload_through;
    let mut layers = Vec::with_capacity(model.layers.len());
    for layer in &model.layers {
        let (qkv, qkv_bias) = match &layer.qkv {
            QkvWeights::Separate { q, k, v } => (
                [m(up, &q.weight)?, m(up, &k.weight)?, m(up, &v.weight)?],
                [bias(up, &q.bias)?, bias(up, &k.bias)?, bias(up, &v.bias)?],
            ),
            QkvWeights::InternlmFused { wqkv } => {
                let rows = internlm_wqkv_rows(s);
                let (q, rest) = rows.split_at(s.q_dim());
                let (k, v) = rest.split_at(s.kv_dim());
                let mut part = |r: &[usize]| m(up, &wqkv.select_rows(r));
                ([part(q)?, part(k)?, part(v)?], [None, None, None])
            }
        };
        layers.push(DeviceLayer {
            attn_norm: norm(up, &layer.attn_norm)?,
            qkv,
            qkv_bias,
            o: m(up, &layer.o)?,
            ffn_norm: norm(up, &layer.ffn_norm)?,
            gate: m(up, &layer.gate)?,
            up: m(up, &layer.up)?,
            down: m(up, &layer.down)?,
        });
    }
    Ok(DeviceModel {
        embed: m(up, &model.embed)?,
        layers,
        final_norm: norm(up, &model.final_norm)?,
        lm_head: model.lm_head.as_ref().map(|x| m(up, x)).transpose()?,
    })
}

#[cfg(test)]
mod tests {
    use half::f16;

    use super::mma_scale;

    fn halves(a: &[f32]) -> Vec<f16> {
        a.iter().map(|&v| f16::from_f32(v)).collect()
    }

    #[test]
    fn mma_scale_brings_the_largest_absmax_near_2_pow_14() {
        for max in [1e-6f32, 0.013, 0.5, 1.0, 3.0, 700.0] {
            let s = mma_scale(&halves(&[max / 4.0, -max, f32::NAN, max / 2.0]));
            assert_eq!(s.log2().fract(), 0.0, "a power of two");
            let top = f16::from_f32(max).to_f32() * s;
            assert!((8192.0..=16384.0).contains(&top), "{max} * {s} = {top}");
        }
        assert_eq!(mma_scale(&halves(&[0.0, 0.0])), 1.0);
    }

    /// The bitwise maximum finds the float maximum of the finite |a|, wherever in the lanes or
    /// the tail it lies, past NaN, infinities, negative values and subnormals.
    #[test]
    fn mma_scale_takes_the_largest_finite_magnitude_anywhere() {
        let reference = |a: &[f16]| {
            let max = a
                .iter()
                .map(|v| v.to_f32())
                .filter(|v| v.is_finite())
                .fold(0f32, |m, v| m.max(v.abs()));
            if max == 0.0 {
                1.0
            } else {
                2f32.powi((16384.0 / max).log2().floor().clamp(-120.0, 120.0) as i32)
            }
        };
        let odd = halves(&[
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -0.0,
            1e-7,
            -3e-6,
        ]);
        for len in [1, 7, 15, 16, 17, 33, 64, 67] {
            for at in 0..len {
                for big in halves(&[-5.5, 0.75, 6.2e-5, 60000.0]) {
                    let mut a: Vec<f16> = (0..len).map(|i| odd[i % odd.len()]).collect();
                    assert_eq!(mma_scale(&a), reference(&a), "len {len}, no big value");
                    a[at] = big;
                    assert_eq!(mma_scale(&a), reference(&a), "len {len}, {big} at {at}");
                }
            }
        }
    }
}
