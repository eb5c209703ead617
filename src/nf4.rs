//! NF4 (4-bit NormalFloat) codec, byte-compatible with bitsandbytes `nf4`.
//!
//! Layout, the one place it is written down:
//! - A matrix `[rows, cols]` (row-major, `cols` = K, the input dimension) is cut into blocks
//!   of [`BLOCK`] = 64 consecutive elements of the flattened array; since `cols % 64 == 0`,
//!   every block lies inside one row. Block `b` covers elements `64*b .. 64*b+64`.
//! - Each block keeps one `absmax` = max |v| over the block, in f32 while encoding.
//! - Each element is encoded as the 4-bit index of the nearest [`CODEBOOK`] entry to
//!   `v * (1/absmax)` (the reciprocal taken in f32, as bitsandbytes does); ties go to the
//!   lower entry, via bitsandbytes' own decision thresholds ([`encode`]).
//! - The absmax is then kept in f16 (rounded to nearest): the codes are bitsandbytes' byte
//!   for byte, the scale bitsandbytes keeps in f32 is 2 bytes a block instead of 4. Every
//!   64-element block streams 34 bytes instead of 36 (−5.6% of a decode step's weight
//!   bytes), and the scale's relative change (≤ 2^-12 from f16's smallest normal, 6.1e-5, up;
//!   below it, an absolute change ≤ 3e-8) is under the f16 rounding the kernels apply to
//!   their inputs. Every backend, the CPU oracle included, decodes with the same f16
//!   value, so the backends agree on the model exactly; a block whose absmax f16 cannot hold
//!   (above 65,504) is refused with its row and column.
//! - Two elements per byte: element `2i` in the **high** nibble of byte `i`, element `2i+1`
//!   in the low nibble (bitsandbytes `kQuantizeBlockwise`: `q[2j] << 4 | q[2j+1]`).
//! - Decoding: `CODEBOOK[nibble] * absmax` (the f16 absmax, in f32).
//!
//! An all-zero block has absmax 0; bitsandbytes then computes `0 * (1/0) = NaN`, which falls
//! through its decision tree to index 0, so the codes are 0 and decode to `-1.0 * 0 = 0`.
//! We reproduce that byte for byte.

use std::ops::{Deref, Range};
use std::sync::Arc;

use half::f16;

use crate::error::{Error, Result};

/// Elements per quantization block (along K).
pub const BLOCK: usize = 64;

/// Bytes a `[rows, cols]` matrix takes as stored and uploaded: its packed codes and an f16
/// scale a block.
pub const fn stored_bytes(rows: usize, cols: usize) -> usize {
    rows * cols / 2 + rows * cols / BLOCK * std::mem::size_of::<f16>()
}

/// The NF4 codebook of QLoRA / bitsandbytes (`get_4bit_type("nf4")`), to f32 precision.
#[allow(clippy::excessive_precision)] // bitsandbytes' values, verbatim
pub const CODEBOOK: [f32; 16] = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
];

/// bitsandbytes' decision thresholds (`dQuantizeNF4`'s literals: midpoints of neighbouring
/// codebook entries), ascending.
#[allow(clippy::excessive_precision)] // bitsandbytes' literals, verbatim
const THRESHOLDS: [f32; 15] = [
    -0.8480964004993439,
    -0.6106329262256622,
    -0.4599952697753906,
    -0.33967943489551544,
    -0.23460740596055984,
    -0.13791173323988914,
    -0.045525018125772476,
    0.03979014977812767,
    0.1202552504837513,
    0.2035212516784668,
    0.2920137718319893,
    0.3893125355243683,
    0.5016634166240692,
    0.6427869200706482,
    0.8614784181118011,
];

/// Index of the codebook entry bitsandbytes picks for a normalized value: how many thresholds
/// it exceeds. bitsandbytes walks them as a binary tree; counting gives the same index (a
/// value exactly on a threshold goes to the lower entry, NaN to index 0) without the tree's
/// branches, which random weights mispredict (the tree was 63% of a 3B bnb directory's read,
/// re-quantizing its 16-bit embedding: docs/lab.md session 26).
#[inline(always)]
pub fn encode(x: f32) -> u8 {
    THRESHOLDS.iter().map(|&t| (x > t) as u8).sum()
}

/// A matrix's packed codes: bytes of its own, or where they lie in a read-only file map (a
/// bitsandbytes checkpoint's codes are this layout: taken there, with no copy at load).
#[derive(Clone)]
pub enum Codes {
    Owned(Vec<u8>),
    Mapped(Arc<MappedBytes>),
}

/// A range of bytes in a read-only file map, which stays open while they are held.
pub struct MappedBytes {
    pub map: Arc<memmap2::Mmap>,
    pub bytes: Range<usize>,
}

impl Codes {
    /// Makes the bytes owned: a mapped range is copied out, on every core (so that what keeps
    /// the codes past the load no longer reads the file, which may change after it).
    pub fn make_owned(&mut self) {
        if let Self::Mapped(_) = self {
            let mut out = vec![0u8; self.len()];
            crate::par::copy(&mut out, self, 1 << 20);
            *self = Self::Owned(out);
        }
    }
}

impl Deref for Codes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Self::Owned(v) => v,
            Self::Mapped(m) => &m.map[m.bytes.clone()],
        }
    }
}

impl From<Vec<u8>> for Codes {
    fn from(v: Vec<u8>) -> Self {
        Self::Owned(v)
    }
}

impl PartialEq for Codes {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl std::fmt::Debug for Codes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            Self::Owned(_) => "owned",
            Self::Mapped(_) => "mapped",
        };
        write!(f, "Codes({} bytes, {kind})", self.len())
    }
}

/// A row-major `[rows, cols]` matrix in packed NF4 with per-block f16 absmax.
#[derive(Clone, Debug, PartialEq)]
pub struct Nf4Matrix {
    pub rows: usize,
    pub cols: usize,
    /// `rows * cols / 2` bytes, two elements per byte (layout in the module docs).
    pub packed: Codes,
    /// `rows * cols / 64` block scales.
    pub absmax: Vec<f16>,
}

impl Nf4Matrix {
    /// Quantizes `data` (`rows * cols` values, row-major). `cols` must be a multiple of 64
    /// and every value finite.
    pub fn quantize(rows: usize, cols: usize, data: &[f32]) -> Result<Self> {
        if data.len() != rows * cols {
            return Err(Error::Quantize(format!(
                "got {} values for a {rows}x{cols} matrix",
                data.len()
            )));
        }
        Self::quantize_with(rows, cols, |r, row| {
            row.copy_from_slice(&data[r * cols..(r + 1) * cols])
        })
    }

    /// Quantizes a matrix whose row `r` is written by `fill(r, row)`, on every core, one row
    /// at a time (the f32 matrix never exists whole). `cols` must be a multiple of 64 and
    /// every value finite; the error names the first bad row and column.
    pub fn quantize_with(
        rows: usize,
        cols: usize,
        fill: impl Fn(usize, &mut [f32]) + Sync,
    ) -> Result<Self> {
        if !cols.is_multiple_of(BLOCK) || cols == 0 {
            return Err(Error::Quantize(format!(
                "cols ({cols}) is not a positive multiple of {BLOCK}"
            )));
        }
        let (row_bytes, row_blocks) = (cols / 2, cols / BLOCK);
        let mut packed = vec![0u8; rows * row_bytes];
        let mut absmax = vec![f16::ZERO; rows * row_blocks];
        let per = crate::par::rows_per_thread(rows, cols);
        // The first refused row, its column, the value there and what refused it.
        let first_error = std::sync::Mutex::new(None::<(usize, usize, f32, Refused)>);
        let chunks = packed
            .chunks_mut(per * row_bytes)
            .zip(absmax.chunks_mut(per * row_blocks))
            .enumerate();
        crate::par::for_each(chunks, |(i, (packed, absmax))| {
            let mut row = vec![0f32; cols];
            let rows = packed
                .chunks_exact_mut(row_bytes)
                .zip(absmax.chunks_exact_mut(row_blocks));
            for (j, (codes, scales)) in rows.enumerate() {
                let r = i * per + j;
                fill(r, &mut row);
                if let Err(refused) = encode_row(&row, codes, scales) {
                    let c = match refused {
                        Refused::NonFinite => row.iter().position(|v| !v.is_finite()).unwrap_or(0),
                        Refused::ScaleBeyondF16 { block, .. } => block * BLOCK,
                    };
                    let mut e = first_error.lock().unwrap_or_else(|p| p.into_inner());
                    if e.is_none_or(|(er, ..)| r < er) {
                        *e = Some((r, c, row[c], refused));
                    }
                    return;
                }
            }
        });
        if let Some((r, c, v, refused)) =
            first_error.into_inner().unwrap_or_else(|p| p.into_inner())
        {
            return Err(Error::Quantize(match refused {
                Refused::NonFinite => format!("non-finite value {v} at row {r}, col {c}"),
                Refused::ScaleBeyondF16 { absmax, .. } => format!(
                    "the block at row {r}, cols {c}..{} has absmax {absmax}, past the {} an f16 \
                     scale holds",
                    c + BLOCK,
                    f16::MAX
                ),
            }));
        }
        Ok(Self {
            rows,
            cols,
            packed: packed.into(),
            absmax,
        })
    }

    /// Bytes of packed codes in one row.
    pub fn row_bytes(&self) -> usize {
        self.cols / 2
    }

    /// Decodes row `r` into `out` (`cols` values).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let blocks = self.cols / BLOCK;
        let packed = &self.packed[r * self.row_bytes()..(r + 1) * self.row_bytes()];
        let scales = &self.absmax[r * blocks..(r + 1) * blocks];
        for ((codes, scale), dst) in packed
            .chunks_exact(BLOCK / 2)
            .zip(scales)
            .zip(out.chunks_exact_mut(BLOCK))
        {
            decode_block(codes, *scale, dst);
        }
    }

    /// Block `b` of rows `first .. first + N`: each row's 16 code values (scaled) and its
    /// packed codes.
    #[inline(always)]
    fn blocks_of<const N: usize>(
        &self,
        first: usize,
        b: usize,
    ) -> ([[f32; 16]; N], [&[u8; BLOCK / 2]; N]) {
        let (row_bytes, blocks) = (self.row_bytes(), self.cols / BLOCK);
        let values = std::array::from_fn(|j| block_values(self.absmax[(first + j) * blocks + b]));
        let codes = std::array::from_fn(|j| {
            let at = (first + j) * row_bytes + b * BLOCK / 2;
            self.packed[at..at + BLOCK / 2].try_into().unwrap()
        });
        (values, codes)
    }

    /// `x`'s dot products with rows `first .. first + N`, each the sum in column order, from
    /// −0.0, of the products of x with the values [`Self::dequantize_row`] gives
    /// (`Iterator::sum`'s result, to the bit). The N rows' chains of adds are interleaved: one
    /// chain alone waits an add's latency per element, N of them overlap.
    pub fn dot_rows<const N: usize>(&self, first: usize, x: &[f32]) -> [f32; N] {
        debug_assert_eq!(x.len(), self.cols);
        let mut sums = [-0.0f32; N];
        for (b, xb) in x.chunks_exact(BLOCK).enumerate() {
            let (values, codes) = self.blocks_of::<N>(first, b);
            for (i, pair) in xb.chunks_exact(2).enumerate() {
                for j in 0..N {
                    let byte = codes[j][i];
                    sums[j] += values[j][(byte >> 4) as usize] * pair[0];
                    sums[j] += values[j][(byte & 0x0f) as usize] * pair[1];
                }
            }
        }
        sums
    }

    /// The dot products of rows `first .. first + N` with 8 inputs at once, `xt` holding them
    /// by column (`xt[c][t]`: input t's column c): `out[j][t]` is what [`Self::dot_rows`] gives
    /// for row first + j and input t, to the bit (the same products added in the same order),
    /// each weight decoded once for the 8 and the 8 sums of a row one vector add.
    pub fn dot_rows_x8<const N: usize>(&self, first: usize, xt: &[[f32; 8]]) -> [[f32; 8]; N] {
        debug_assert_eq!(xt.len(), self.cols);
        let mut sums = [[-0.0f32; 8]; N];
        for (b, xb) in xt.chunks_exact(BLOCK).enumerate() {
            let (values, codes) = self.blocks_of::<N>(first, b);
            for (i, pair) in xb.chunks_exact(2).enumerate() {
                for j in 0..N {
                    let byte = codes[j][i];
                    let (hi, lo) = (
                        values[j][(byte >> 4) as usize],
                        values[j][(byte & 0x0f) as usize],
                    );
                    for (sum, x) in sums[j].iter_mut().zip(pair[0]) {
                        *sum += hi * x;
                    }
                    for (sum, x) in sums[j].iter_mut().zip(pair[1]) {
                        *sum += lo * x;
                    }
                }
            }
        }
        sums
    }

    /// Decodes the whole matrix (row-major).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, row) in out.chunks_exact_mut(self.cols).enumerate() {
            self.dequantize_row(r, row);
        }
        out
    }

    /// A matrix made of the given rows of `self`, in that order. Rows are independent in
    /// this layout, so this is a byte-exact copy (used to split InternLM2's fused wqkv).
    pub fn select_rows(&self, rows: &[usize]) -> Self {
        let rb = self.row_bytes();
        let blocks = self.cols / BLOCK;
        let mut packed = Vec::with_capacity(rows.len() * rb);
        let mut absmax = Vec::with_capacity(rows.len() * blocks);
        for &r in rows {
            packed.extend_from_slice(&self.packed[r * rb..(r + 1) * rb]);
            absmax.extend_from_slice(&self.absmax[r * blocks..(r + 1) * blocks]);
        }
        Self {
            rows: rows.len(),
            cols: self.cols,
            packed: packed.into(),
            absmax,
        }
    }
}

/// Why [`encode_row`] refused a row.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Refused {
    /// A value is NaN or infinite.
    NonFinite,
    /// Block `block` of the row has an absmax past f16's largest value.
    ScaleBeyondF16 { block: usize, absmax: f32 },
}

/// Encodes a row: its blocks' codes into `codes`, their absmax (in f16) into `scales`, where
/// every value is finite (refused, having written nothing, where one is not) and every block's
/// absmax fits f16 (refused at the first that does not). The finiteness pass and [`encode`]'s
/// comparisons vectorize: on a CPU with AVX-512 the same code runs 16 lanes wide instead of
/// SSE2's 4 (docs/lab.md, session 34), with the same results (integer counts, exact
/// comparisons).
fn encode_row(
    row: &[f32],
    codes: &mut [u8],
    scales: &mut [f16],
) -> std::result::Result<(), Refused> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
    {
        // SAFETY: the CPU has AVX-512 F, BW and VL (BW implies F), checked just above.
        return unsafe { encode_row_avx512(row, codes, scales) };
    }
    encode_row_with(row, codes, scales)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn encode_row_avx512(
    row: &[f32],
    codes: &mut [u8],
    scales: &mut [f16],
) -> std::result::Result<(), Refused> {
    encode_row_with(row, codes, scales)
}

/// [`encode_row`]'s body, inlined into each caller so that it compiles for the caller's
/// target features.
#[inline(always)]
fn encode_row_with(
    row: &[f32],
    codes: &mut [u8],
    scales: &mut [f16],
) -> std::result::Result<(), Refused> {
    // A pass without an early exit, which the compiler vectorizes (`position`'s scalar loop
    // was 13% of a GGUF's read).
    if !row.iter().fold(true, |finite, v| finite & v.is_finite()) {
        return Err(Refused::NonFinite);
    }
    for (block, ((values, out), scale)) in row
        .chunks_exact(BLOCK)
        .zip(codes.chunks_exact_mut(BLOCK / 2))
        .zip(scales.iter_mut())
        .enumerate()
    {
        let absmax = encode_block(values, out);
        *scale = f16::from_f32(absmax);
        if scale.is_infinite() {
            return Err(Refused::ScaleBeyondF16 { block, absmax });
        }
    }
    Ok(())
}

/// Encodes one block of 64 finite values into 32 bytes; returns its absmax.
#[inline(always)]
fn encode_block(block: &[f32], out: &mut [u8]) -> f32 {
    let absmax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
    let inv = 1.0f32 / absmax;
    // The codes first, then the packing: a loop over values alone that the compiler vectorizes.
    let mut codes = [0u8; BLOCK];
    for (code, &v) in codes.iter_mut().zip(block) {
        *code = encode(v * inv);
    }
    for (byte, pair) in out.iter_mut().zip(codes.chunks_exact(2)) {
        *byte = (pair[0] << 4) | pair[1];
    }
    absmax
}

/// A block's 16 possible values: `CODEBOOK[nibble] * absmax`.
fn block_values(absmax: f16) -> [f32; 16] {
    let absmax = absmax.to_f32();
    std::array::from_fn(|nibble| CODEBOOK[nibble] * absmax)
}

/// Decodes 32 bytes of one block into 64 values.
fn decode_block(codes: &[u8], absmax: f16, out: &mut [f32]) {
    let values = block_values(absmax);
    for (byte, pair) in codes.iter().zip(out.chunks_exact_mut(2)) {
        pair[0] = values[(byte >> 4) as usize];
        pair[1] = values[(byte & 0x0f) as usize];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The row encoder the CPU dispatches to (AVX-512 where present) writes what the portable
    /// build of the same code writes, and refuses the same rows.
    #[test]
    fn the_dispatched_row_encoder_equals_the_portable_one() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 * 6.0 - 3.0
        };
        let cols = 64 * 37;
        for (case, threshold) in THRESHOLDS.iter().take(8).enumerate() {
            let mut row: Vec<f32> = (0..cols).map(|_| next()).collect();
            // A zero block, a block of one value, a value on a threshold times its block's
            // absmax, and (case 7) a NaN.
            row[64..128].fill(0.0);
            row[128..192].fill(-1.5);
            row[192] = 2.0;
            row[193] = threshold * 2.0;
            for v in &mut row[194..256] {
                *v *= 0.3;
            }
            if case == 7 {
                row[cols - 1] = f32::NAN;
            }
            let (mut c1, mut s1) = (vec![0u8; cols / 2], vec![f16::ZERO; cols / 64]);
            let (mut c2, mut s2) = (vec![0u8; cols / 2], vec![f16::ZERO; cols / 64]);
            let ok1 = encode_row(&row, &mut c1, &mut s1);
            let ok2 = encode_row_with(&row, &mut c2, &mut s2);
            assert_eq!(ok1.is_ok(), case != 7, "case {case}");
            assert_eq!((ok1, &c1, &s1), (ok2, &c2, &s2), "case {case}");
        }
    }

    #[test]
    fn codebook_matches_bitsandbytes() {
        // bitsandbytes functional.py, get_4bit_type("nf4"), as printed by Python (f64 repr
        // of the f32 values).
        let bnb: [f64; 16] = [
            -1.0,
            -0.6961928009986877,
            -0.5250730514526367,
            -0.39491748809814453,
            -0.28444138169288635,
            -0.18477343022823334,
            -0.09105003625154495,
            0.0,
            0.07958029955625534,
            0.16093020141124725,
            0.24611230194568634,
            0.33791524171829224,
            0.44070982933044434,
            0.5626170039176941,
            0.7229568362236023,
            1.0,
        ];
        for (ours, theirs) in CODEBOOK.iter().zip(bnb) {
            assert_eq!(*ours as f64, theirs);
        }
    }

    #[test]
    fn every_code_encodes_to_itself_and_thresholds_are_midpoints() {
        for (i, v) in CODEBOOK.iter().enumerate() {
            assert_eq!(encode(*v) as usize, i);
        }
        for i in 0..15 {
            let mid = (CODEBOOK[i] + CODEBOOK[i + 1]) / 2.0;
            let below = encode(mid - 1e-6) as usize;
            let above = encode(mid + 1e-6) as usize;
            assert_eq!((below, above), (i, i + 1), "around midpoint {mid}");
        }
        assert_eq!(encode(f32::NAN), 0);
    }

    /// bitsandbytes' tree sends a value exactly on a threshold to the lower entry and the next
    /// f32 up to the higher one; the count does the same at each of the 15 (checked against
    /// the tree for all 2^32 f32 values when the count replaced it, docs/lab.md session 26).
    #[test]
    fn a_value_on_a_threshold_takes_the_lower_entry() {
        for (i, &t) in THRESHOLDS.iter().enumerate() {
            assert_eq!(encode(t) as usize, i, "on threshold {t}");
            assert_eq!(encode(t.next_up()) as usize, i + 1, "above threshold {t}");
            assert_eq!(encode(t.next_down()) as usize, i, "below threshold {t}");
        }
        assert_eq!((encode(f32::NEG_INFINITY), encode(f32::INFINITY)), (0, 15));
    }

    #[test]
    fn hand_worked_packing() {
        // Block: 0.5, -1.0, then 62 zeros. absmax 1.0. 0.5 lies between 0.4407 (12) and
        // 0.5626 (13), below their midpoint 0.5017, so code 12; -1.0 is code 0: element 0 sits
        // in the high nibble, so byte 0 is 0xC0. Zeros are code 7: 0x77.
        let mut block = [0f32; 64];
        block[0] = 0.5;
        block[1] = -1.0;
        let m = Nf4Matrix::quantize(1, 64, &block).unwrap();
        assert_eq!(m.absmax, vec![f16::ONE]);
        assert_eq!(m.packed[0], 0xC0);
        assert!(m.packed[1..].iter().all(|b| *b == 0x77));
        let back = m.dequantize();
        assert_eq!(back[0], CODEBOOK[12]);
        assert_eq!(back[1], -1.0);
    }

    #[test]
    fn round_trip_error_is_bounded_per_block() {
        // The error is at most half the widest gap between neighbouring codes (-1.0 to
        // -0.6962) times the block's absmax, plus what rounding the absmax to f16 moved a
        // code's value (|code| <= 1).
        let max_half_gap = CODEBOOK
            .windows(2)
            .map(|w| w[1] - w[0])
            .fold(0f32, f32::max)
            / 2.0;
        assert_eq!(max_half_gap, (CODEBOOK[1] - CODEBOOK[0]) / 2.0);
        let mut state = 12345u32;
        let data: Vec<f32> = (0..64 * 40)
            .map(|i| {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                let u = (state >> 8) as f32 / (1 << 24) as f32 - 0.5;
                u * (1 + i / 64) as f32
            })
            .collect();
        let m = Nf4Matrix::quantize(40, 64, &data).unwrap();
        let back = m.dequantize();
        for (b, (orig, dec)) in data.chunks(64).zip(back.chunks(64)).enumerate() {
            let absmax = orig.iter().fold(0f32, |a, v| a.max(v.abs()));
            assert_eq!(m.absmax[b], f16::from_f32(absmax));
            let rounding = (m.absmax[b].to_f32() - absmax).abs();
            assert!(
                rounding <= absmax * 2f32.powi(-11),
                "block {b}: {rounding} of {absmax}"
            );
            for (o, d) in orig.iter().zip(dec) {
                assert!(
                    (o - d).abs() <= absmax * max_half_gap * 1.0001 + rounding,
                    "block {b}"
                );
            }
        }
    }

    #[test]
    fn all_zero_block_decodes_to_zero() {
        let m = Nf4Matrix::quantize(1, 64, &[0.0; 64]).unwrap();
        assert_eq!(m.absmax, vec![f16::ZERO]);
        // bitsandbytes' NaN fall-through: every code is 0.
        assert!(m.packed.iter().all(|b| *b == 0));
        assert!(m.dequantize().iter().all(|v| *v == 0.0));
    }

    /// A value at f16's largest comes back exactly; past it (a block f16 cannot scale) the
    /// matrix is refused, naming the block.
    #[test]
    fn the_largest_f16_scale_survives_exactly_and_a_larger_is_refused() {
        let mut block = [0.01f32; 64];
        block[17] = -65504.0;
        let m = Nf4Matrix::quantize(1, 64, &block).unwrap();
        let back = m.dequantize();
        assert_eq!(back[17], -65504.0);
        assert!(back.iter().enumerate().all(|(i, v)| i == 17 || *v == 0.0));
        let mut rows = vec![0.5f32; 3 * 128];
        rows[2 * 128 + 64 + 5] = 1.0e6;
        let err = Nf4Matrix::quantize(3, 128, &rows).unwrap_err().to_string();
        assert!(
            err.contains("row 2, cols 64..128") && err.contains("absmax 1000000"),
            "{err}"
        );
    }

    #[test]
    fn non_finite_and_misshaped_input_is_rejected() {
        let mut block = [0.5f32; 64];
        block[3] = f32::INFINITY;
        let err = Nf4Matrix::quantize(1, 64, &block).unwrap_err().to_string();
        assert!(err.contains("non-finite") && err.contains("col 3"), "{err}");
        block[3] = f32::NAN;
        assert!(Nf4Matrix::quantize(1, 64, &block).is_err());
        let err = Nf4Matrix::quantize(1, 32, &[0.0; 32])
            .unwrap_err()
            .to_string();
        assert!(err.contains("multiple of 64"), "{err}");
        assert!(Nf4Matrix::quantize(2, 64, &[0.0; 64]).is_err());
    }

    #[test]
    fn select_rows_copies_rows_byte_exactly() {
        let data: Vec<f32> = (0..3 * 64).map(|i| (i as f32 * 0.37).sin()).collect();
        let m = Nf4Matrix::quantize(3, 64, &data).unwrap();
        let s = m.select_rows(&[2, 0]);
        let mut row = vec![0f32; 64];
        let mut want = vec![0f32; 64];
        s.dequantize_row(0, &mut row);
        m.dequantize_row(2, &mut want);
        assert_eq!(row, want);
        s.dequantize_row(1, &mut row);
        m.dequantize_row(0, &mut want);
        assert_eq!(row, want);
    }
}
