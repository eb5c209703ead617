//! A SentencePiece `tokenizer.model` (the `ModelProto` protobuf a Hugging Face directory ships
//! where it has no tokenizer.json): its pieces, scores and types, read by a minimal protobuf
//! reader, and the trainer and normalizer settings checked to be the ones the SentencePiece
//! BPE encoder here computes (BPE, identity normalization, whitespace kept as it is).

use super::SpmVocab;
use crate::error::{Error, Result};

/// Bounds-checked protobuf wire reads over one message's bytes.
struct Wire<'a> {
    buf: &'a [u8],
    at: usize,
}

/// A field's value: a varint, a fixed 32- or 64-bit word, or length-delimited bytes.
enum Field<'a> {
    Varint(u64),
    Fixed32(u32),
    Fixed64,
    Bytes(&'a [u8]),
}

fn bad(what: impl std::fmt::Display) -> Error {
    Error::ModelFile(format!("tokenizer.model: {what}"))
}

impl<'a> Wire<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Self { buf, at: 0 }
    }

    fn varint(&mut self) -> Result<u64> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = *self
                .buf
                .get(self.at)
                .ok_or_else(|| bad("truncated varint"))?;
            self.at += 1;
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(bad("varint longer than 10 bytes"))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .at
            .checked_add(n)
            .filter(|e| *e <= self.buf.len())
            .ok_or_else(|| bad("a field runs past its message"))?;
        let bytes = &self.buf[self.at..end];
        self.at = end;
        Ok(bytes)
    }

    /// The next (field number, value), or None at the message's end.
    fn next(&mut self) -> Result<Option<(u64, Field<'a>)>> {
        if self.at == self.buf.len() {
            return Ok(None);
        }
        let key = self.varint()?;
        let field = match key & 7 {
            0 => Field::Varint(self.varint()?),
            1 => {
                self.take(8)?;
                Field::Fixed64
            }
            2 => {
                let n = usize::try_from(self.varint()?).map_err(|_| bad("length overflows"))?;
                Field::Bytes(self.take(n)?)
            }
            5 => {
                let b = self.take(4)?;
                Field::Fixed32(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            }
            w => return Err(bad(format!("wire type {w}"))),
        };
        Ok(Some((key >> 3, field)))
    }
}

/// SentencePiece's `TrainerSpec.ModelType.BPE`.
const MODEL_BPE: u64 = 2;

/// The vocabulary of a `tokenizer.model`, refusing what the encoder here does not compute: a
/// model other than BPE, a normalizer other than identity, whitespace collapsed or kept
/// unescaped, pieces that are not UTF-8.
pub(super) fn read(bytes: &[u8]) -> Result<SpmVocab> {
    let (mut tokens, mut scores, mut types) = (Vec::new(), Vec::new(), Vec::new());
    let (mut model_type, mut unk) = (1u64, 0u64); // SentencePiece's defaults: unigram, id 0
    let (mut normalizer, mut space_prefix, mut collapse, mut escape) =
        (String::new(), true, true, true);
    let mut charsmap = false;
    let mut wire = Wire::new(bytes);
    while let Some((number, field)) = wire.next()? {
        match (number, field) {
            (1, Field::Bytes(piece_bytes)) => {
                let (mut piece, mut score, mut kind) = (None, 0f32, 1i64);
                let mut p = Wire::new(piece_bytes);
                while let Some((n, f)) = p.next()? {
                    match (n, f) {
                        (1, Field::Bytes(text)) => piece = Some(text),
                        (2, Field::Fixed32(bits)) => score = f32::from_bits(bits),
                        (3, Field::Varint(t)) => kind = t as i64,
                        _ => {}
                    }
                }
                let text = std::str::from_utf8(piece.unwrap_or_default())
                    .map_err(|_| bad(format!("piece {} is not UTF-8", tokens.len())))?;
                tokens.push(text.to_string());
                scores.push(score);
                types.push(kind);
            }
            (2, Field::Bytes(trainer)) => {
                let mut t = Wire::new(trainer);
                while let Some((n, f)) = t.next()? {
                    match (n, f) {
                        (3, Field::Varint(v)) => model_type = v,
                        (40, Field::Varint(v)) => unk = v,
                        _ => {}
                    }
                }
            }
            (3, Field::Bytes(spec)) => {
                let mut s = Wire::new(spec);
                while let Some((n, f)) = s.next()? {
                    match (n, f) {
                        (1, Field::Bytes(name)) => {
                            normalizer = String::from_utf8_lossy(name).into_owned()
                        }
                        (2, Field::Bytes(map)) => charsmap = !map.is_empty(),
                        (3, Field::Varint(v)) => space_prefix = v != 0,
                        (4, Field::Varint(v)) => collapse = v != 0,
                        (5, Field::Varint(v)) => escape = v != 0,
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    if tokens.is_empty() {
        return Err(bad("no pieces"));
    }
    if model_type != MODEL_BPE {
        return Err(Error::Unsupported(format!(
            "tokenizer.model: SentencePiece model type {model_type} (BPE, 2, is read)"
        )));
    }
    if !(normalizer.is_empty() || normalizer == "identity") || charsmap || collapse || !escape {
        return Err(Error::Unsupported(format!(
            "tokenizer.model: normalizer {normalizer:?} (remove_extra_whitespaces {collapse}, \
             escape_whitespaces {escape}); identity, whitespace kept and escaped, is read"
        )));
    }
    let unk = u32::try_from(unk)
        .ok()
        .filter(|u| (*u as usize) < tokens.len())
        .ok_or_else(|| bad(format!("unk_id {unk} is not a piece")))?;
    Ok(SpmVocab {
        tokens,
        scores,
        types,
        unk,
        space_prefix,
    })
}
