//! What each fuzz target runs on one input, shared with the corpus replay in the library's
//! tests (tests/fuzz_corpus.rs includes this file): `gguf` and `hf` lay the input out as model
//! files in a scratch directory and load them; `text` puts it through a real model's
//! tokenizer and chat template. Any error is fine; a panic (a broken round trip included), an
//! abort or a hang is a finding.

use std::path::Path;

use decodev2::chat::Message;
use decodev2::tokenizer::Tokenizer;

/// The separator between an `hf` input's parts: config.json, model.safetensors.index.json
/// (absent when empty), model.safetensors.
pub const HF_SEPARATOR: &[u8] = b"\n--8<--\n";

/// A GGUF input: the bytes as one file, loaded; where it carries a tokenizer, text through it
/// and its chat template.
pub fn gguf(dir: &Path, data: &[u8]) {
    let path = dir.join("model.gguf");
    if std::fs::write(&path, data).is_err() {
        return;
    }
    let Ok(loaded) = decodev2::load::load_all(&path) else {
        return;
    };
    let Ok(tokenizer) = loaded.tokenizer else {
        return;
    };
    for text in [
        "Hello, world! <s></s> <|im_start|>",
        " na\u{ef}ve \u{6771}\u{4eac} \u{1f680} 12345\n",
    ] {
        if let Ok(ids) = tokenizer.encode(text, true, true) {
            let _ = tokenizer.decode(&ids, true);
        }
    }
    let chat = [Message {
        role: "user".into(),
        content: "hi".into(),
    }];
    let _ = tokenizer.apply_chat_template(&chat, true);
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

/// The separator between a `text` input's chat messages, and between a message's role and
/// content.
pub const TEXT_SEPARATOR: &[u8] = b"\x1e";

/// A tokenizer for the `text` target, with the bytes its vocabulary has a piece for.
pub struct TextTarget {
    pub tokenizer: Tokenizer,
    /// Whether a one-byte piece exists for each byte value. SmolLM2's vocabulary has none for
    /// 4, 6, 19, 20, 22 and 29 (nor some bytes no UTF-8 text holds): its encoder drops them, as
    /// Hugging Face's does.
    pub has_piece: [bool; 256],
}

impl TextTarget {
    pub fn new(tokenizer: Tokenizer) -> Self {
        let mut has_piece = [false; 256];
        for id in 0..tokenizer.vocab_size() as u32 {
            if let Ok(&[b]) = tokenizer.piece(id) {
                has_piece[b as usize] = true;
            }
        }
        Self {
            tokenizer,
            has_piece,
        }
    }
}

/// A text input: the first byte picks what runs on the rest (bits 0-1) and its flags (bits
/// 2-3): 0, encode (add_special, parse_special), and without special parsing the ids of a text
/// whose every byte has a piece must decode to the very bytes (byte-level BPE loses nothing
/// else); 1, the rest as
/// little-endian u32 ids, decoded (skip_control) and each one's piece; 2, chat messages (role
/// and content, [`TEXT_SEPARATOR`] between each) through the chat template (the generation
/// prompt), the result encoded with special parsing; 3, the rest as lossy UTF-8 encoded and
/// decoded.
pub fn text(target: &TextTarget, data: &[u8]) {
    let tokenizer = &target.tokenizer;
    let Some((&op, rest)) = data.split_first() else {
        return;
    };
    let (flag_a, flag_b) = (op & 4 != 0, op & 8 != 0);
    match op & 3 {
        0 => {
            let Ok(text) = std::str::from_utf8(rest) else {
                return;
            };
            if let Ok(ids) = tokenizer.encode(text, flag_a, flag_b) {
                if !flag_a && !flag_b && rest.iter().all(|&b| target.has_piece[b as usize]) {
                    let back = tokenizer
                        .decode(&ids, false)
                        .expect("ids the tokenizer gave");
                    assert_eq!(back, rest, "decode(encode(text)) differs from the text");
                }
            }
        }
        1 => {
            let ids: Vec<u32> = rest
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            let _ = tokenizer.decode(&ids, flag_a);
            for &id in &ids {
                let _ = tokenizer.piece(id);
                let _ = tokenizer.is_eog(id);
            }
        }
        2 => {
            let parts: Vec<String> = split(rest, TEXT_SEPARATOR)
                .map(|p| String::from_utf8_lossy(p).into_owned())
                .collect();
            let messages: Vec<Message> = parts
                .chunks(2)
                .map(|m| Message {
                    role: m[0].clone(),
                    content: m.get(1).cloned().unwrap_or_default(),
                })
                .collect();
            if let Ok(prompt) = tokenizer.apply_chat_template(&messages, flag_a) {
                let _ = tokenizer.encode(&prompt, true, true);
            }
        }
        _ => {
            let text = String::from_utf8_lossy(rest);
            if let Ok(ids) = tokenizer.encode(&text, flag_a, true) {
                let _ = tokenizer.decode(&ids, flag_b);
            }
        }
    }
}

/// The tokenizer the `text` target and its replay use: SmolLM2-135M-Instruct's
/// (`DV2_SMOLLM2_GGUF`, else ~/.cache/decodev2-models/, where .ci/run puts it), or None when the
/// file is absent.
pub fn smollm2_text_target() -> Option<TextTarget> {
    let path = std::env::var_os("DV2_SMOLLM2_GGUF")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/decodev2-models/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    let file = decodev2::load::gguf::Gguf::open(&path).ok()?;
    Tokenizer::from_gguf(&file).ok().map(TextTarget::new)
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
