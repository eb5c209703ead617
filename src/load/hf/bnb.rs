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
    let absmax = if sh.has(&format!("{name}.nested_absmax")) {
        nested_absmax(sh, name, &state, blocks)?
    } else {
        f32s(sh, &format!("{name}.absmax"), blocks)?
    };
    // Kept in f16 (src/nf4.rs): refused where f16 cannot hold one.
    let absmax16 = to_f16(&absmax);
    if let Some(b) = absmax16.iter().position(|a| !a.is_finite()) {
        return Err(bad(format!(
            "block {b} has scale {}, which an f16 scale does not hold (finite, up to {})",
            absmax[b],
            f16::MAX
        )));
    }
    let mut packed = sh.mapped(name)?;
    if !crate::config::Config::from_env().mapped_codes {
        packed.make_owned();
    }
    Ok(Some(Nf4Matrix {
        rows,
        cols,
        packed,
        absmax: absmax16,
    }))
}

/// The per-block scales of a nested (double-quantized) weight, decoded as bitsandbytes does in
/// f32: the 8-bit code's entry times its group's scale, plus the offset.
fn nested_absmax(sh: &Shards, name: &str, state: &Value, blocks: usize) -> Result<Vec<f32>> {
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
    Ok(codes
        .iter()
        .enumerate()
        .map(|(b, &c)| map[c as usize] * scales[b / group] + offset)
        .collect())
}

/// An f32 tensor of exactly `len` elements (any shape).
fn f32s(sh: &Shards, name: &str, len: usize) -> Result<Vec<f32>> {
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
    Ok(le_f32s(data))
}

/// Little-endian f32 values, on every core: the 32B shape's scales are 2 GB, whose page
/// faults (their map's and the new Vec's) one thread would take in turn.
fn le_f32s(data: &[u8]) -> Vec<f32> {
    const PIECE: usize = 1 << 18;
    let mut out = vec![0f32; data.len() / 4];
    crate::par::for_rows(&mut out, PIECE, PIECE, |first, piece| {
        let bytes = data[4 * first * PIECE..].chunks_exact(4);
        for (v, b) in piece.iter_mut().zip(bytes) {
            *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
    });
    out
}

/// `values` rounded to f16, on every core: the 32B shape's 0.5 G scales are 1 GB of new pages
/// (zeroed lazily, each thread faulting its own) and a conversion 8 wide where the CPU has F16C.
fn to_f16(values: &[f32]) -> Vec<f16> {
    const PIECE: usize = 1 << 18;
    let mut out: Vec<f16> = vec![0u16; values.len()].reinterpret_into();
    crate::par::for_rows(&mut out, PIECE, PIECE, |first, piece| {
        let at = first * PIECE;
        piece.convert_from_f32_slice(&values[at..at + piece.len()]);
    });
    out
}

#[cfg(test)]
mod tests {
    use half::f16;

    /// Past one piece a thread, every value rounded as f16::from_f32 rounds it, the values
    /// past f16's range to infinities.
    #[test]
    fn to_f16_rounds_every_value_in_place() {
        let values: Vec<f32> = (0..(5 << 18) + 77)
            .map(|i| (i as f32 - 300_000.0) * 0.37)
            .collect();
        let want: Vec<f16> = values.iter().map(|&v| f16::from_f32(v)).collect();
        assert_eq!(super::to_f16(&values), want);
        assert!(super::to_f16(&[7.0e4, -1.0e6])
            .iter()
            .all(|v| v.is_infinite()));
    }

    /// Past one piece a thread (12 pieces and a part), every value from its own 4 bytes.
    #[test]
    fn le_f32s_reads_every_value_in_place() {
        let values: Vec<f32> = (0..(12 << 18) + 1000)
            .map(|i| i as f32 * 0.5 - 7.0)
            .collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(super::le_f32s(&bytes), values);
    }
}
