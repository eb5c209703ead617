//! What each fuzz target runs on one input, shared with the corpus replay in the library's
//! tests (tests/fuzz_corpus.rs includes this file): the input laid out as model files in a
//! scratch directory, then `decodev2::load::load` on it. Any error is fine; a panic, an abort
//! or a hang is a finding.

use std::path::Path;

/// The separator between an `hf` input's parts: config.json, model.safetensors.index.json
/// (absent when empty), model.safetensors.
pub const HF_SEPARATOR: &[u8] = b"\n--8<--\n";

/// A GGUF input: the bytes as one file.
pub fn gguf(dir: &Path, data: &[u8]) {
    let path = dir.join("model.gguf");
    if std::fs::write(&path, data).is_ok() {
        let _ = decodev2::load::load(&path);
    }
}

/// A Hugging Face input: its parts as a model directory.
pub fn hf(dir: &Path, data: &[u8]) {
    let mut parts = split(data, HF_SEPARATOR);
    let config = parts.next().unwrap_or_default();
    let index = parts.next().unwrap_or_default();
    let weights = parts.next().unwrap_or_default();
    let _ = std::fs::remove_file(dir.join("model.safetensors.index.json"));
    let written = std::fs::write(dir.join("config.json"), config).is_ok()
        && (index.is_empty()
            || std::fs::write(dir.join("model.safetensors.index.json"), index).is_ok())
        && std::fs::write(dir.join("model.safetensors"), weights).is_ok();
    if written {
        let _ = decodev2::load::load(dir);
    }
}

fn split<'a>(data: &'a [u8], sep: &'a [u8]) -> impl Iterator<Item = &'a [u8]> {
    let mut rest = Some(data);
    std::iter::from_fn(move || {
        let r = rest?;
        match r.windows(sep.len()).position(|w| w == sep) {
            Some(i) => {
                rest = Some(&r[i + sep.len()..]);
                Some(&r[..i])
            }
            None => {
                rest = None;
                Some(r)
            }
        }
    })
}
