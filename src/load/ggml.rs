//! ggml tensor types as stored in GGUF files, and their dequantization to f32 (the formulas
//! of ggml's `dequantize_row_*`, one block at a time).

use half::{bf16, f16};

use crate::error::{Error, Result};

/// The ggml types decodev2 reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Iq4Nl,
    Iq4Xs,
}

impl GgmlType {
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            10 => Self::Q2K,
            11 => Self::Q3K,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            20 => Self::Iq4Nl,
            23 => Self::Iq4Xs,
            30 => Self::Bf16,
            _ => return None,
        })
    }

    /// (elements per block, bytes per block).
    pub const fn block(self) -> (usize, usize) {
        match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::Bf16 => (1, 2),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q5_0 => (32, 22),
            Self::Q5_1 => (32, 24),
            Self::Q8_0 => (32, 34),
            Self::Q2K => (256, 84),
            Self::Q3K => (256, 110),
            Self::Q4K => (256, 144),
            Self::Q5K => (256, 176),
            Self::Q6K => (256, 210),
            Self::Iq4Nl => (32, 18),
            Self::Iq4Xs => (256, 136),
        }
    }

    /// Bytes of `n` elements (`n` a multiple of the block size).
    pub fn bytes(self, n: usize) -> Result<usize> {
        let (elems, bytes) = self.block();
        if !n.is_multiple_of(elems) {
            return Err(Error::ModelFile(format!(
                "{n} elements is not a whole number of {self:?} blocks of {elems}"
            )));
        }
        Ok(n / elems * bytes)
    }

    /// Dequantizes `out.len()` elements from `src` (exactly their bytes).
    pub fn dequantize(self, src: &[u8], out: &mut [f32]) {
        let (elems, bytes) = self.block();
        debug_assert_eq!(src.len(), out.len() / elems * bytes);
        for (b, y) in src.chunks_exact(bytes).zip(out.chunks_exact_mut(elems)) {
            match self {
                Self::F32 => y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                Self::F16 => y[0] = f16_at(b, 0),
                Self::Bf16 => y[0] = bf16::from_le_bytes([b[0], b[1]]).to_f32(),
                Self::Q4_0 => q4_0(b, y),
                Self::Q4_1 => q4_1(b, y),
                Self::Q5_0 => q5_0(b, y),
                Self::Q5_1 => q5_1(b, y),
                Self::Q8_0 => q8_0(b, y),
                Self::Q2K => q2_k(b, y),
                Self::Q3K => q3_k(b, y),
                Self::Q4K => q4_k(b, y),
                Self::Q5K => q5_k(b, y),
                Self::Q6K => q6_k(b, y),
                Self::Iq4Nl => iq4_nl(b, y),
                Self::Iq4Xs => iq4_xs(b, y),
            }
        }
    }
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// d (f16), 16 bytes: element j in the low nibble of byte j, element j+16 in the high one.
fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, q) in b[2..18].iter().enumerate() {
        y[j] = ((q & 0x0f) as i32 - 8) as f32 * d;
        y[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

/// d, m (f16), then nibbles as Q4_0: x = q*d + m.
fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for (j, q) in b[4..20].iter().enumerate() {
        y[j] = (q & 0x0f) as f32 * d + m;
        y[j + 16] = (q >> 4) as f32 * d + m;
    }
}

/// The 5-bit quants of a Q5_0 / Q5_1 block: nibbles as Q4_0, and bit j of the u32 `qh` the
/// fifth bit of element j.
fn q5_quants(qh: &[u8], qs: &[u8]) -> [i32; 32] {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let mut q = [0i32; 32];
    for (j, byte) in qs.iter().enumerate() {
        q[j] = ((byte & 0x0f) as u32 | ((qh >> j) & 1) << 4) as i32;
        q[j + 16] = ((byte >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4) as i32;
    }
    q
}

/// d (f16), qh (u32), 16 bytes of nibbles: x = (q - 16) * d.
fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (y, q) in y.iter_mut().zip(q5_quants(&b[2..6], &b[6..22])) {
        *y = (q - 16) as f32 * d;
    }
}

/// d, m (f16), qh (u32), 16 bytes of nibbles: x = q * d + m.
fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for (y, q) in y.iter_mut().zip(q5_quants(&b[4..8], &b[8..24])) {
        *y = q as f32 * d + m;
    }
}

/// IQ4_NL's 16 non-linear levels (ggml's `kvalues_iq4nl`).
const IQ4_NL_LEVELS: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// d (f16), 16 bytes of nibbles as Q4_0's, each an index into [`IQ4_NL_LEVELS`]. What
/// llama.cpp writes for a Q2_K / Q3_K file's tensors whose rows are not whole super-blocks.
fn iq4_nl(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, q) in b[2..18].iter().enumerate() {
        y[j] = d * IQ4_NL_LEVELS[(q & 0x0f) as usize] as f32;
        y[j + 16] = d * IQ4_NL_LEVELS[(q >> 4) as usize] as f32;
    }
}

/// d (f16), scales_h (u16), scales_l[4], qs[128]: 8 sub-blocks of 32 as IQ4_NL's, each with a
/// 6-bit scale (minus 32): its low 4 bits a nibble of scales_l, its high 2 from scales_h.
fn iq4_xs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let scales_h = u16::from_le_bytes([b[2], b[3]]);
    let (scales_l, qs) = (&b[4..8], &b[8..136]);
    for (s, (q, y)) in qs.chunks_exact(16).zip(y.chunks_exact_mut(32)).enumerate() {
        let low = (scales_l[s / 2] >> (4 * (s % 2))) & 0x0f;
        let high = ((scales_h >> (2 * s)) & 3) as u8;
        let dl = d * ((low | high << 4) as i32 - 32) as f32;
        for (j, byte) in q.iter().enumerate() {
            y[j] = dl * IQ4_NL_LEVELS[(byte & 0x0f) as usize] as f32;
            y[j + 16] = dl * IQ4_NL_LEVELS[(byte >> 4) as usize] as f32;
        }
    }
}

/// d (f16), 32 signed bytes.
fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, q) in b[2..34].iter().enumerate() {
        y[j] = *q as i8 as f32 * d;
    }
}

/// The 6-bit scale and min of sub-block `j` of a K-quant super-block (`get_scale_min_k4`).
fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    if j < 4 {
        ((q[j] & 63) as f32, (q[j + 4] & 63) as f32)
    } else {
        (
            ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4)) as f32,
            ((q[j + 4] >> 4) | ((q[j] >> 6) << 4)) as f32,
        )
    }
}

/// scales[16], qs[64], d, dmin (f16): 16 sub-blocks of 16 with a 4-bit scale and min each,
/// 2-bit quants four to a byte, x = d*sc*q - dmin*m.
fn q2_k(b: &[u8], y: &mut [f32]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    let mut out = y.iter_mut();
    // Sub-block s covers 16 bytes of its half's 32, at bit `shift` of each.
    for (s, sc) in scales.iter().enumerate() {
        let (half, shift, bytes) = (s / 8, 2 * ((s % 8) / 2), 16 * (s % 2));
        let (dl, ml) = (d * (sc & 0x0f) as f32, dmin * (sc >> 4) as f32);
        for q in &qs[32 * half + bytes..32 * half + bytes + 16] {
            *out.next().unwrap() = dl * ((q >> shift) & 3) as f32 - ml;
        }
    }
}

/// hmask[32], qs[64], scales[12], d (f16): 16 sub-blocks of 16 with a 6-bit scale each (minus
/// 32), 2-bit quants four to a byte, less 4 where the element's bit in hmask is clear.
fn q3_k(b: &[u8], y: &mut [f32]) {
    let (hmask, qs, packed) = (&b[0..32], &b[32..96], &b[96..108]);
    let d = f16_at(b, 108);
    // Scale s: its low 4 bits from nibble s % 8 of packed[s / 8 * ..], its high 2 from
    // packed[8..12] (ggml's kmask shuffle).
    let scale = |s: usize| -> i32 {
        let low = if s < 8 {
            packed[s] & 0x0f
        } else {
            packed[s - 8] >> 4
        };
        let high = (packed[8 + s % 4] >> (2 * (s / 4))) & 3;
        (low | high << 4) as i32 - 32
    };
    let mut out = y.iter_mut();
    for s in 0..16 {
        let (half, shift, bytes) = (s / 8, 2 * ((s % 8) / 2), 16 * (s % 2));
        let bit = 1u8 << ((s % 8) / 2 + 4 * half);
        let dl = d * scale(s) as f32;
        for l in bytes..bytes + 16 {
            let q = ((qs[32 * half + l] >> shift) & 3) as i32;
            let high = if hmask[l] & bit != 0 { 0 } else { 4 };
            *out.next().unwrap() = dl * (q - high) as f32;
        }
    }
}

/// d, dmin (f16), scales[12], qs[128]: 8 sub-blocks of 32, x = d*sc*q - dmin*m.
fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for (n, q) in qs.chunks_exact(32).enumerate() {
        let (s1, m1) = scale_min_k4(2 * n, scales);
        let (s2, m2) = scale_min_k4(2 * n + 1, scales);
        for l in 0..32 {
            y[64 * n + l] = d * s1 * (q[l] & 0x0f) as f32 - dmin * m1;
            y[64 * n + 32 + l] = d * s2 * (q[l] >> 4) as f32 - dmin * m2;
        }
    }
}

/// d, dmin (f16), scales[12], qh[32], qs[128]: Q4_K plus one high bit per element.
fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for (n, q) in qs.chunks_exact(32).enumerate() {
        let (s1, m1) = scale_min_k4(2 * n, scales);
        let (s2, m2) = scale_min_k4(2 * n + 1, scales);
        let (u1, u2) = (1u8 << (2 * n), 2u8 << (2 * n));
        for l in 0..32 {
            let hi1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let hi2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[64 * n + l] = d * s1 * ((q[l] & 0x0f) + hi1) as f32 - dmin * m1;
            y[64 * n + 32 + l] = d * s2 * ((q[l] >> 4) + hi2) as f32 - dmin * m2;
        }
    }
}

/// ql[128], qh[64], scales[16] (i8), d (f16): 6-bit quants minus 32, 16 scales of 16.
fn q6_k(b: &[u8], y: &mut [f32]) {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for half in 0..2 {
        let (ql, qh, sc) = (&ql[64 * half..], &qh[32 * half..], &sc[8 * half..]);
        let y = &mut y[128 * half..];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * sc[is] as i8 as f32 * q1 as f32;
            y[l + 32] = d * sc[is + 2] as i8 as f32 * q2 as f32;
            y[l + 64] = d * sc[is + 4] as i8 as f32 * q3 as f32;
            y[l + 96] = d * sc[is + 6] as i8 as f32 * q4 as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16b(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_le_bytes()
    }

    #[test]
    fn q4_0_q4_1_q8_0_by_hand() {
        // Q4_0: d = 0.5, byte j = (hi << 4) | lo with lo = j % 16, hi = 15 - j % 16.
        let mut b = f16b(0.5).to_vec();
        b.extend((0..16u8).map(|j| ((15 - j) << 4) | j));
        let mut y = [0f32; 32];
        GgmlType::Q4_0.dequantize(&b, &mut y);
        assert_eq!(y[0], -4.0); // (0 - 8) * 0.5
        assert_eq!(y[16], 3.5); // (15 - 8) * 0.5
        assert_eq!(y[5], -1.5);
        // Q4_1: d = 2, m = -1: x = q*2 - 1.
        let mut b = [f16b(2.0), f16b(-1.0)].concat();
        b.extend((0..16u8).map(|j| ((15 - j) << 4) | j));
        GgmlType::Q4_1.dequantize(&b, &mut y);
        assert_eq!((y[0], y[15], y[16], y[31]), (-1.0, 29.0, 29.0, -1.0));
        // Q8_0: d = 0.25, q = j - 16.
        let mut b = f16b(0.25).to_vec();
        b.extend((0..32i32).map(|j| (j - 16) as i8 as u8));
        GgmlType::Q8_0.dequantize(&b, &mut y);
        assert_eq!((y[0], y[16], y[31]), (-4.0, 0.0, 3.75));
    }

    #[test]
    fn q4_k_scales_and_mins() {
        // d = 1, dmin = 0.5; sub-block scales 1..8 and mins 0..7 packed as get_scale_min_k4
        // reads them; every quant 3 (low nibble) / 5 (high nibble).
        let (sc, mn): (Vec<u8>, Vec<u8>) = ((1..=8).collect(), (0..8).collect());
        let mut s = [0u8; 12];
        s[..4].copy_from_slice(&sc[..4]);
        s[4..8].copy_from_slice(&mn[..4]);
        for j in 4..8 {
            s[j + 4] = (sc[j] & 0x0f) | ((mn[j] & 0x0f) << 4);
            s[j - 4] |= (sc[j] >> 4) << 6;
            s[j] |= (mn[j] >> 4) << 6;
        }
        let mut b = [f16b(1.0), f16b(0.5)].concat();
        b.extend_from_slice(&s);
        b.extend([0x53u8; 128]);
        let mut y = [0f32; 256];
        GgmlType::Q4K.dequantize(&b, &mut y);
        for n in 0..4 {
            let (s1, m1) = (sc[2 * n] as f32, mn[2 * n] as f32);
            let (s2, m2) = (sc[2 * n + 1] as f32, mn[2 * n + 1] as f32);
            assert_eq!(y[64 * n], s1 * 3.0 - 0.5 * m1, "sub-block {}", 2 * n);
            assert_eq!(
                y[64 * n + 40],
                s2 * 5.0 - 0.5 * m2,
                "sub-block {}",
                2 * n + 1
            );
        }
    }

    #[test]
    fn q6_k_layout() {
        // All ql = 0x21 (lo 1, hi 2), qh = 0 except qh[0] = 0b11 (element 0 gets +48),
        // scales 1..16, d = 0.5.
        let mut b = vec![0x21u8; 128];
        let mut qh = vec![0u8; 64];
        qh[0] = 0b11;
        b.extend(qh);
        b.extend((1..=16i8).map(|v| v as u8));
        b.extend(f16b(0.5));
        let mut y = [0f32; 256];
        GgmlType::Q6K.dequantize(&b, &mut y);
        assert_eq!(y[0], 0.5 * 1.0 * (1 + 48 - 32) as f32);
        assert_eq!(y[1], 0.5 * 1.0 * (1 - 32) as f32);
        assert_eq!(y[64], 0.5 * 5.0 * (2 - 32) as f32); // q3 uses scale is + 4
        assert_eq!(y[128 + 96 + 17], 0.5 * 16.0 * (2 - 32) as f32); // second half, is = 1 + 6 + 8
    }

    /// Every type against llama.cpp's own gguf-py (numpy) on seeded random blocks
    /// (tests/fixtures/make_ggml_blocks.py wrote them).
    #[test]
    fn every_type_equals_gguf_py() {
        let fixture: serde_json::Value =
            serde_json::from_str(include_str!("../../tests/fixtures/ggml_blocks.json")).unwrap();
        let cases = fixture["cases"].as_array().unwrap();
        assert_eq!(cases.len(), 12);
        for case in cases {
            let name = case["name"].as_str().unwrap();
            let ty = GgmlType::from_id(case["type"].as_u64().unwrap() as u32).expect(name);
            let hex = case["hex"].as_str().unwrap();
            let bytes: Vec<u8> = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                .collect();
            let want: Vec<f32> = case["values"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap() as f32)
                .collect();
            assert_eq!(ty.bytes(want.len()).unwrap(), bytes.len(), "{name}");
            let mut got = vec![0f32; want.len()];
            ty.dequantize(&bytes, &mut got);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                    "{name} [{i}]: {g} vs {w}"
                );
            }
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(GgmlType::Q4K.bytes(512).unwrap(), 288);
        assert!(GgmlType::Q8_0.bytes(48).is_err());
        assert_eq!(GgmlType::from_id(14), Some(GgmlType::Q6K));
        assert_eq!(GgmlType::from_id(6), Some(GgmlType::Q5_0));
        assert_eq!(GgmlType::from_id(16), None, "IQ2_XXS is not read");
    }
}
