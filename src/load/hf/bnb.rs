//! bitsandbytes 4-bit linears in a Hugging Face directory, as transformers saves a model
//! loaded with `load_in_4bit` (`bnb_4bit_quant_type="nf4"`): for a weight `W`,
//! - `W`: the packed codes, `rows * cols / 2` bytes (uint8 `[n/2, 1]` by default; any
//!   `bnb_4bit_quant_storage` dtype holds the same bytes);
//! - `W.absmax`: one f32 scale per block of `blocksize` elements of the flattened matrix, or,
//!   with the nested (double) quantization, one uint8 code per block, decoded as
//!   `W.nested_quant_map[code] * W.nested_absmax[block / nested_blocksize] + nested_offset`;
//! - `W.quant_map`: the 16-entry codebook;
//! - `W.quant_state.bitsandbytes__nf4`: uint8 bytes of a JSON object (quant_type, blocksize,
//!   dtype, shape, and nested_blocksize, nested_offset where nested).
//!
//! With blocksize 64 and the NF4 codebook this is decodev2's own layout (src/nf4.rs, same
//! nibble order), so the codes are taken as they are: no re-quantization; the scales are kept
//! in f16 as every NF4 scale is (rounded to nearest: src/nf4.rs says what that changes). fp4
//! and other block sizes are refused, naming what was found.

use half::f16;
use half::slice::HalfFloatSliceExt;
use half::vec::HalfBitsVecExt;
use serde_json::Value;

use super::{file_err, Shards};
use crate::error::{Error, Result};
use crate::nf4::{Nf4Matrix, BLOCK, CODEBOOK};

/// Entries of the nested quantization's codebook (bitsandbytes' 8-bit dynamic map).
const NESTED_CODES: usize = 256;

/// The bitsandbytes NF4 matrix stored as `name`, or None where `name` is not a bitsandbytes
/// 4-bit weight (a 16- or 32-bit one, which the caller re-quantizes).
pub(super) fn matrix(
    sh: &Shards,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<Option<Nf4Matrix>> {
    let state_key = |kind: &str| format!("{name}.quant_state.bitsandbytes__{kind}");
    if sh.has(&state_key("fp4")) {
        return Err(Error::Unsupported(format!(
            "tensor {name}: bitsandbytes fp4 (decodev2 computes nf4; quantize with bnb_4bit_quant_type=\"nf4\")"
        )));
    }
    if !sh.has(&state_key("nf4")) {
        return Ok(None);
    }
    let (_, _, json, path) = sh.get(&state_key("nf4"))?;
    let bad = |what: String| file_err(path, format!("tensor {name}: {what}"));
    let state: Value =
        serde_json::from_slice(json).map_err(|e| bad(format!("quant_state is not JSON: {e}")))?;
    let blocksize = state["blocksize"].as_u64().unwrap_or(0) as usize;
    if blocksize != BLOCK {
        return Err(Error::Unsupported(format!(
            "{}: tensor {name}: bitsandbytes blocksize {} (decodev2 takes {BLOCK})",
            path.display(),
            state["blocksize"]
        )));
    }
    let shape: Vec<u64> = state["shape"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default();
    if shape != [rows as u64, cols as u64] {
        return Err(bad(format!(
            "quant_state shape {}, config.json says [{rows}, {cols}]",
            state["shape"]
        )));
    }
    let blocks = rows * cols / BLOCK;
    let (_, _, packed, _) = sh.get(name)?;
    if packed.len() != rows * cols / 2 {
        return Err(bad(format!(
            "{} bytes of codes, a [{rows}, {cols}] matrix needs {}",
            packed.len(),
            rows * cols / 2
        )));
    }
    let quant_map = f32s(sh, &format!("{name}.quant_map"), CODEBOOK.len())?;
    if quant_map
        .iter()
        .zip(&CODEBOOK)
        .any(|(a, b)| a.to_bits() != b.to_bits())
    {
        return Err(bad(format!(
            "quant_map {quant_map:?} is not the NF4 codebook"
        )));
    }
    // Kept in f16 (src/nf4.rs): refused where f16 cannot hold one.
    let absmax = if sh.has(&format!("{name}.nested_absmax")) {
        f16_scales(blocks, nested_absmax(sh, name, &state, blocks)?)
    } else {
        let data = f32_bytes(sh, &format!("{name}.absmax"), blocks)?;
        f16_scales(blocks, |b| le_f32(&data[4 * b..]))
    }
    .map_err(|(b, scale)| {
        bad(format!(
            "block {b} has scale {scale}, which an f16 scale does not hold (finite, up to {})",
            f16::MAX
        ))
    })?;
    let mut packed = sh.mapped(name)?;
    if !crate::config::Config::from_env().mapped_codes {
        packed.make_owned();
    }
    Ok(Some(Nf4Matrix {
        rows,
        cols,
        packed,
        absmax,
    }))
}

/// The per-block scales of a nested (double-quantized) weight, block b's decoded as
/// bitsandbytes does in f32: the 8-bit code's entry times its group's scale, plus the offset.
fn nested_absmax<'a>(
    sh: &'a Shards,
    name: &str,
    state: &Value,
    blocks: usize,
) -> Result<impl Fn(usize) -> f32 + Sync + 'a> {
    let (_, _, codes, path) = sh.get(&format!("{name}.absmax"))?;
    let group = state["nested_blocksize"].as_u64().unwrap_or(0) as usize;
    let offset = state["nested_offset"].as_f64();
    let (true, Some(offset)) = (group > 0 && codes.len() == blocks, offset) else {
        return Err(file_err(
            path,
            format!(
                "tensor {name}: nested absmax of {} codes in groups of {} with offset {} ({blocks} blocks)",
                codes.len(),
                state["nested_blocksize"],
                state["nested_offset"]
            ),
        ));
    };
    let scales = f32s(sh, &format!("{name}.nested_absmax"), blocks.div_ceil(group))?;
    let map = f32s(sh, &format!("{name}.nested_quant_map"), NESTED_CODES)?;
    let offset = offset as f32;
    Ok(move |b: usize| map[codes[b] as usize] * scales[b / group] + offset)
}

/// The bytes of an f32 tensor of exactly `len` elements (any shape).
fn f32_bytes<'a>(sh: &'a Shards, name: &str, len: usize) -> Result<&'a [u8]> {
    let (dtype, _, data, path) = sh.get(name)?;
    if dtype != safetensors::Dtype::F32 || data.len() != 4 * len {
        return Err(file_err(
            path,
            format!(
                "tensor {name}: {dtype:?} of {} bytes, bitsandbytes stores {len} f32",
                data.len()
            ),
        ));
    }
    Ok(data)
}

/// An f32 tensor of exactly `len` elements (any shape).
fn f32s(sh: &Shards, name: &str, len: usize) -> Result<Vec<f32>> {
    Ok(f32_bytes(sh, name, len)?
        .chunks_exact(4)
        .map(le_f32)
        .collect())
}

/// The little-endian f32 at the start of `bytes`.
fn le_f32(bytes: &[u8]) -> f32 {
    f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
}

/// The `blocks` scales `scale(b)` (bitsandbytes' f32 values) rounded to f16, on every core: the
/// 32B shape's 0.5 G scales are 2 GB of the file's map read once and 1 GB of new pages (zeroed
/// lazily, each thread faulting its own), converted 8 wide where the CPU has F16C. Refused
/// (the first block and its f32 scale) where f16 cannot hold one.
fn f16_scales(
    blocks: usize,
    scale: impl Fn(usize) -> f32 + Sync,
) -> std::result::Result<Vec<f16>, (usize, f32)> {
    const PIECE: usize = 1 << 18;
    let mut out: Vec<f16> = vec![0u16; blocks].reinterpret_into();
    crate::par::for_rows(&mut out, PIECE, PIECE, |first, piece| {
        let mut values = [0f32; 64];
        for (i, part) in piece.chunks_mut(values.len()).enumerate() {
            let at = first * PIECE + i * values.len();
            for (j, v) in values[..part.len()].iter_mut().enumerate() {
                *v = scale(at + j);
            }
            part.convert_from_f32_slice(&values[..part.len()]);
        }
    });
    // A pass without an early exit, which vectorizes (as nf4::encode_row's), and the scalar
    // `position` only where it finds a refused scale: the 32B shape's 0.5 G scales 115 -> 37 ms
    // on the build machine.
    if out.iter().fold(true, |finite, a| finite & a.is_finite()) {
        return Ok(out);
    }
    let b = out.iter().position(|a| !a.is_finite()).unwrap_or(0);
    Err((b, scale(b)))
}

#[cfg(test)]
mod tests {
    use half::f16;

    /// Past one piece a thread, every value rounded as f16::from_f32 rounds it; a value past
    /// f16's range refused, named by its block and f32 value.
    #[test]
    fn f16_scales_rounds_every_value_in_place() {
        let values: Vec<f32> = (0..(5 << 18) + 77)
            .map(|i| (i as f32 - 300_000.0) * 0.037)
            .collect();
        let want: Vec<f16> = values.iter().map(|&v| f16::from_f32(v)).collect();
        assert_eq!(super::f16_scales(values.len(), |b| values[b]), Ok(want));
        let huge = [0.5, 7.0e4, -1.0e6];
        assert_eq!(super::f16_scales(3, |b| huge[b]), Err((1, 7.0e4)));
    }

    /// Every value from its own 4 bytes.
    #[test]
    fn f32s_read_every_value_in_place() {
        let values: Vec<f32> = (0..(12 << 18) + 1000)
            .map(|i| i as f32 * 0.5 - 7.0)
            .collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let read: Vec<f32> = bytes.chunks_exact(4).map(super::le_f32).collect();
        assert_eq!(read, values);
    }
}
