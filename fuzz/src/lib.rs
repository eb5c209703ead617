//! What each fuzz target runs on one input, shared with the corpus replay in the library's
//! tests (tests/fuzz_corpus.rs includes this file): `gguf` and `hf` lay the input out as model
//! files in a scratch directory and load them, `hf_tokenizer` as a directory's tokenizer files
//! and reads its tokenizer; `text` puts it through a real model's tokenizer and chat template,
//! `spm_text` through a SentencePiece one;
//! `abi` reads it as a sequence of C ABI calls on one engine. Any error is fine; a panic (a
//! broken round trip or a broken contract of the ABI included), an abort or a hang is a
//! finding.

use std::path::Path;

use decodev2::chat::Message;
use decodev2::ffi;
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
    if let Ok(tokenizer) = loaded.tokenizer {
        text_through(&tokenizer);
    }
}

/// Two texts (special tokens' names, accents, CJK, an emoji, digits) encoded and decoded, and a
/// chat through the template: what a host does first with a tokenizer it loaded.
fn text_through(tokenizer: &Tokenizer) {
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

/// The files a Hugging Face directory's tokenizer is read from, in a `hf_tokenizer` input's
/// order: SentencePiece's protobuf first (the reader written here), tokenizer.json last (a
/// tokenizer.json present is read instead of tokenizer.model).
pub const HF_TOKENIZER_FILES: [&str; 4] = [
    "tokenizer.model",
    "tokenizer_config.json",
    "config.json",
    "tokenizer.json",
];

/// A Hugging Face tokenizer input: its files laid out in `dir` ([`write_hf_tokenizer_files`]),
/// read as `dv2_load` reads a model directory's tokenizer; where they read, text through it
/// and its chat template.
pub fn hf_tokenizer(dir: &Path, data: &[u8]) {
    if !write_hf_tokenizer_files(dir, data) {
        return;
    }
    if let Ok(tokenizer) = Tokenizer::from_hf_dir(dir) {
        text_through(&tokenizer);
    }
}

/// Writes a `hf_tokenizer` input's parts ([`HF_SEPARATOR`] between them) into `dir` as the
/// files of [`HF_TOKENIZER_FILES`] (a part empty or missing: no such file, an earlier input's
/// removed); false where a file could not be written.
pub fn write_hf_tokenizer_files(dir: &Path, data: &[u8]) -> bool {
    let mut parts = split(data, HF_SEPARATOR);
    HF_TOKENIZER_FILES.iter().all(|name| {
        let path = dir.join(name);
        let _ = std::fs::remove_file(&path);
        let part = parts.next().unwrap_or_default();
        part.is_empty() || std::fs::write(&path, part).is_ok()
    })
}

/// The separator between a `text` input's chat messages, and between a message's role and
/// content.
pub const TEXT_SEPARATOR: &[u8] = b"\x1e";

/// A tokenizer for the `text` and `spm_text` targets, with what its round trip must give back.
pub struct TextTarget {
    pub tokenizer: Tokenizer,
    /// Whether a one-byte piece exists for each byte value. SmolLM2's vocabulary has none for
    /// 4, 6, 19, 20, 22 and 29 (nor some bytes no UTF-8 text holds): its encoder drops them, as
    /// Hugging Face's does.
    pub has_piece: [bool; 256],
    /// Whether the vocabulary writes a space as SentencePiece's "▁" (U+2581): a "▁" in the text
    /// then comes back as a space, as the `sentencepiece` package gives it back.
    pub escapes_space: bool,
}

impl TextTarget {
    pub fn new(tokenizer: Tokenizer, escapes_space: bool) -> Self {
        let mut has_piece = [false; 256];
        for id in 0..tokenizer.vocab_size() as u32 {
            if let Ok(&[b]) = tokenizer.piece(id) {
                has_piece[b as usize] = true;
            }
        }
        Self {
            tokenizer,
            has_piece,
            escapes_space,
        }
    }

    /// Whether decode(encode(text)), with no special tokens, must give `text` back.
    fn round_trips(&self, text: &[u8]) -> bool {
        text.iter().all(|&b| self.has_piece[b as usize])
            && !(self.escapes_space && text.windows(3).any(|w| w == "\u{2581}".as_bytes()))
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
                if !flag_a && !flag_b && target.round_trips(rest) {
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
    Tokenizer::from_gguf(&file)
        .ok()
        .map(|tokenizer| TextTarget::new(tokenizer, false))
}

/// The SentencePiece vocabulary of tests/fixtures: BPE with byte fallback and digits split,
/// trained like Llama's; tests/tokenizer.rs checks its ids against the `sentencepiece` package.
const SPM_MODEL: &[u8] = include_bytes!("../../tests/fixtures/spm_tokenizer.model");

/// The tokenizer the `spm_text` target and its replay use: [`SPM_MODEL`] read as a Hugging
/// Face directory's tokenizer.model (the reader and encoder written here, where `text`'s
/// SmolLM2 vocabulary is byte-level BPE), with BOS, EOS and a Llama 2 style chat template from
/// its tokenizer_config.json; the files go in `dir`, which it removes.
pub fn spm_text_target(dir: &Path) -> Result<TextTarget, Box<dyn std::error::Error>> {
    let config = r#"{"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": true,
 "chat_template": "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"}"#;
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("tokenizer.model"), SPM_MODEL)?;
    std::fs::write(dir.join("tokenizer_config.json"), config)?;
    let tokenizer = Tokenizer::from_hf_dir(dir);
    std::fs::remove_dir_all(dir)?;
    Ok(TextTarget::new(tokenizer?, true))
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

/// The `abi` target's engine: a handle from `dv2_load` on the CPU backend, kept across
/// inputs (each input starts with a reset and greedy sampling), with the facts the checks
/// need. What else an input leaves (the last logits, the tokenizer's caches) carries over, so
/// a crash that does not come back from its input alone comes back after the queue's earlier
/// entries, replayed in id order.
pub struct AbiTarget {
    engine: *mut ffi::dv2_engine,
    vocab: i32,
    max_seq: i32,
    /// Where the state op saves the request and loads it back (one file a process).
    state_file: std::ffi::CString,
}

impl AbiTarget {
    /// The engine on `model` (the `gguf` corpus' tiny Llama with a BPE tokenizer and a chat
    /// template: fuzz/corpus/gguf/seed-tiny-llama-bpe), or None where it does not load.
    pub fn new(model: &Path) -> Option<Self> {
        let path = std::ffi::CString::new(model.to_str()?).ok()?;
        let mut opts = ffi::dv2_options_default();
        opts.backend = ffi::dv2_backend::DV2_BACKEND_CPU as i32;
        // An id of the model's 32 (the tokenizer's own EOS lies past them), so that some
        // requests finish.
        opts.eos_id = 3;
        let mut engine = std::ptr::null_mut();
        // SAFETY: a NUL-terminated path, the default options, a writable out-pointer.
        if unsafe { ffi::dv2_load(path.as_ptr(), &opts, &mut engine) } != ffi::dv2_status::DV2_OK {
            return None;
        }
        let mut info = ffi::dv2_model_info {
            struct_size: std::mem::size_of::<ffi::dv2_model_info>() as u32,
            ..Default::default()
        };
        // SAFETY: a live handle and a writable struct of the size it names.
        if unsafe { ffi::dv2_get_model_info(engine, &mut info) } != ffi::dv2_status::DV2_OK {
            // SAFETY: the live handle, freed once.
            unsafe { ffi::dv2_free(engine) };
            return None;
        }
        let state_file =
            std::env::temp_dir().join(format!("dv2-fuzz-abi-{}.dv2state", std::process::id()));
        Some(Self {
            engine,
            vocab: info.vocab,
            max_seq: info.max_seq,
            state_file: std::ffi::CString::new(state_file.to_str()?).ok()?,
        })
    }
}

impl Drop for AbiTarget {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.state_file.to_str().unwrap_or_default());
        // SAFETY: the handle from dv2_load, freed once.
        unsafe { ffi::dv2_free(self.engine) };
    }
}

/// The bytes of an `abi` input, read as the arguments of its calls (zeros past the end).
struct Args<'a>(&'a [u8]);

impl Args<'_> {
    fn bytes(&mut self, n: usize) -> &[u8] {
        let (head, rest) = self.0.split_at(n.min(self.0.len()));
        self.0 = rest;
        head
    }
    fn u8(&mut self) -> u8 {
        self.bytes(1).first().copied().unwrap_or(0)
    }
    fn u16(&mut self) -> u16 {
        u16::from(self.u8()) | u16::from(self.u8()) << 8
    }
    fn u32(&mut self) -> u32 {
        u32::from(self.u16()) | u32::from(self.u16()) << 16
    }
    /// A token id: one in the vocabulary, or (the flag byte's low bit) any i32.
    fn id(&mut self, vocab: i32) -> i32 {
        if self.u8() & 1 == 0 {
            i32::from(self.u16()) % vocab.max(1)
        } else {
            self.u32() as i32
        }
    }
    /// A float: one of the values at the edges of the sampling ranges, or any bits.
    fn f32(&mut self) -> f32 {
        const EDGES: [f32; 12] = [
            0.0,
            1.0,
            0.5,
            2.0,
            -1.0,
            1e-30,
            1e30,
            0.999_999,
            -0.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ];
        let pick = self.u8();
        match EDGES.get(pick as usize) {
            Some(&v) => v,
            None => f32::from_bits(self.u32()),
        }
    }
    /// A NUL-terminated string of up to `max` bytes (any NUL inside dropped).
    fn c_string(&mut self, max: usize) -> std::ffi::CString {
        let n = self.u8() as usize % (max + 1);
        let bytes: Vec<u8> = self.bytes(n).iter().copied().filter(|&b| b != 0).collect();
        std::ffi::CString::new(bytes).unwrap_or_default()
    }
}

/// Bytes past an out-buffer's declared room that no call may touch.
const CANARY: usize = 16;
const CANARY_BYTE: u8 = 0xa5;

/// An out-buffer of `room` elements with [`CANARY`] guard elements after it.
struct Guarded<T: Copy> {
    data: Vec<T>,
    room: usize,
    fill: T,
}

impl<T: Copy + PartialEq> Guarded<T> {
    fn new(room: usize, fill: T) -> Self {
        Self {
            data: vec![fill; room + CANARY],
            room,
            fill,
        }
    }
    fn ptr(&mut self) -> *mut T {
        self.data.as_mut_ptr()
    }
    fn check(&self, call: &str) {
        assert!(
            self.data[self.room..].iter().all(|&v| v == self.fill),
            "{call} wrote past its {} elements of room",
            self.room
        );
    }
}

fn last_error() -> String {
    // SAFETY: dv2_last_error returns a NUL-terminated string valid until the next call.
    unsafe { std::ffi::CStr::from_ptr(ffi::dv2_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// An `abi` input: calls through the C ABI on one engine, as a C host would make them (every
/// pointer valid for the room it declares, or NULL), each chosen by a byte (its low 4 bits)
/// with its arguments from the bytes after it: prefill, step, step_n, logits, logprobs, reset
/// (rewind where the byte's top bit is set), set_sampling (set_logit_bias where it is), tokenize, detokenize, token_to_piece, chat_apply_template, token_special,
/// token_is_eog, meta_str, meta_key, and the queries (the state ops where bits 4-6 read 4, a
/// file, or 5, memory: the request saved, then loaded back as saved or with a byte changed;
/// 6: set_speculation and step_draft, a host's draft, so that later step_n calls speculate). A finding (a panic here, which AFL reports
/// as a crash): a call that returns DV2_ERR_INTERNAL (a panic the ABI caught) or an error
/// without a message, writes past the room it was given, leaves the handle unusable
/// (dv2_position failing after it) or its position outside 0..=max_seq, or returns ids or
/// lengths outside what it was asked for; an abort or a hang is one too.
pub fn abi(target: &AbiTarget, data: &[u8]) {
    use ffi::dv2_status::*;
    let (h, vocab) = (target.engine, target.vocab);
    // SAFETY (every call below): `h` is the live handle; each pointer is NULL or valid for
    // the room passed beside it.
    unsafe {
        assert_eq!(ffi::dv2_reset(h), DV2_OK, "{}", last_error());
        let greedy = ffi::dv2_sampling_default();
        assert_eq!(
            ffi::dv2_set_sampling(h, &greedy),
            DV2_OK,
            "{}",
            last_error()
        );
        let no_bias = ffi::dv2_set_logit_bias(h, std::ptr::null(), std::ptr::null(), 0);
        assert_eq!(no_bias, DV2_OK, "{}", last_error());
        assert_eq!(ffi::dv2_set_speculation(h, 0), DV2_OK, "{}", last_error());
    }
    let mut args = Args(data);
    while !args.0.is_empty() {
        let op = args.u8();
        let null = op & 0x80 != 0; // an optional pointer passed as NULL
        let mut position = 0i32;
        // SAFETY: as above.
        let before = unsafe { ffi::dv2_position(h, &mut position) };
        assert_eq!(before, DV2_OK, "{}", last_error());
        let (name, status) = match op & 15 {
            0 => {
                let n = args.u8() as usize % 24;
                let ids: Vec<i32> = (0..n).map(|_| args.id(vocab)).collect();
                let mut next = -7i32;
                let out: *mut i32 = if null {
                    std::ptr::null_mut()
                } else {
                    &mut next
                };
                let ptr = if n == 0 && args.u8() & 1 == 1 {
                    std::ptr::null()
                } else {
                    ids.as_ptr()
                };
                // SAFETY: `ptr` NULL or `n` readable ids; `out` NULL or writable.
                let s = unsafe { ffi::dv2_prefill(h, ptr, n, out) };
                if s == DV2_OK || s == DV2_ERR_NON_FINITE {
                    check_position(h, position + n as i32);
                }
                if s == DV2_OK && !null {
                    assert!((0..vocab).contains(&next), "prefill's next id {next}");
                }
                ("dv2_prefill", s)
            }
            1 => {
                let mut id = -7i32;
                let out: *mut i32 = if null { std::ptr::null_mut() } else { &mut id };
                // SAFETY: `out` NULL or writable.
                let s = unsafe { ffi::dv2_step(h, out) };
                if s == DV2_OK || s == DV2_ERR_NON_FINITE {
                    check_position(h, position + 1);
                }
                if s == DV2_OK && !null {
                    assert!((0..vocab).contains(&id), "step's id {id}");
                }
                ("dv2_step", s)
            }
            2 => {
                let n = args.u8() as usize % 12;
                let mut ids = Guarded::new(n, -7i32);
                let mut count = usize::MAX;
                let out = if null {
                    std::ptr::null_mut()
                } else {
                    ids.ptr()
                };
                // SAFETY: `out` NULL or room for `n` ids; `count` writable.
                let s = unsafe { ffi::dv2_step_n(h, n, out, &mut count) };
                ids.check("dv2_step_n");
                if s == DV2_OK {
                    assert!(count <= n, "step_n counted {count} of {n}");
                    check_position(h, position + count as i32);
                    assert!(ids.data[..count].iter().all(|id| (0..vocab).contains(id)));
                }
                if s == DV2_ERR_NON_FINITE {
                    let p = position_now(h);
                    assert!(
                        (position + 1..=position + n as i32).contains(&p),
                        "step_n of {n} at {position} failed non-finite at {p}"
                    );
                }
                ("dv2_step_n", s)
            }
            3 => {
                let n = args.u16() as usize % (2 * vocab.max(1) as usize + 1);
                let mut logits = Guarded::new(n, -1234.5f32);
                let out = if null {
                    std::ptr::null_mut()
                } else {
                    logits.ptr()
                };
                // SAFETY: `out` NULL or room for `n` floats.
                let s = unsafe { ffi::dv2_logits(h, out, n) };
                logits.check("dv2_logits");
                ("dv2_logits", s)
            }
            4 => {
                let id = args.id(vocab);
                let n_top = i32::from(args.u8() % 32) - 4;
                let room = n_top.max(0) as usize;
                let mut top_ids = Guarded::new(room, -7i32);
                let mut top = Guarded::new(room, 7.0f32);
                let mut lp = 7.0f32;
                let (ids_ptr, top_ptr) = if null {
                    (std::ptr::null_mut(), std::ptr::null_mut())
                } else {
                    (top_ids.ptr(), top.ptr())
                };
                // SAFETY: the arrays NULL or with room for `n_top` values each.
                let s = unsafe { ffi::dv2_logprobs(h, id, n_top, &mut lp, ids_ptr, top_ptr) };
                top_ids.check("dv2_logprobs' ids");
                top.check("dv2_logprobs' values");
                if s == DV2_OK {
                    assert!(lp <= 1e-4, "logprob {lp}");
                    let given = room.min(vocab as usize);
                    if !null {
                        assert!(top_ids.data[..given].iter().all(|i| (0..vocab).contains(i)));
                        assert!(
                            top.data[..given].iter().all(|&v| v <= 1e-4),
                            "{:?}",
                            top.data
                        );
                        assert!(top.data[..given].windows(2).all(|w| w[0] >= w[1]));
                    }
                }
                ("dv2_logprobs", s)
            }
            5 if null => {
                // A position from -1 to two past the current one.
                let to = i32::from(args.u16()) % (position + 4) - 1;
                // SAFETY: the live handle.
                let s = unsafe { ffi::dv2_rewind(h, to) };
                if (0..=position).contains(&to) {
                    assert_eq!(s, DV2_OK, "rewind to {to} of {position}: {}", last_error());
                    check_position(h, to);
                } else {
                    assert_eq!(s, DV2_ERR_INVALID_ARGUMENT, "rewind to {to} of {position}");
                    check_position(h, position);
                }
                ("dv2_rewind", s)
            }
            5 => {
                // SAFETY: the live handle.
                let s = unsafe { ffi::dv2_reset(h) };
                if s == DV2_OK {
                    check_position(h, 0);
                }
                ("dv2_reset", s)
            }
            6 if null => {
                // Ids inside the vocabulary and past it, repeated or not; any bias.
                let n = args.u8() as usize % 6;
                let ids: Vec<i32> = (0..n)
                    .map(|_| i32::from(args.u16() as i16) % (vocab + 2))
                    .collect();
                let biases: Vec<f32> = (0..n).map(|_| args.f32()).collect();
                let (ids_ptr, biases_ptr) = if n == 0 {
                    (std::ptr::null(), std::ptr::null())
                } else {
                    (ids.as_ptr(), biases.as_ptr())
                };
                // SAFETY: the arrays NULL (n = 0) or `n` readable values each.
                ("dv2_set_logit_bias", unsafe {
                    ffi::dv2_set_logit_bias(h, ids_ptr, biases_ptr, n)
                })
            }
            6 => {
                let mut sampling = ffi::dv2_sampling_default();
                if args.u8() & 7 == 0 {
                    sampling.struct_size = args.u32();
                }
                sampling.temperature = args.f32();
                sampling.top_k = (args.u16() as i16).into();
                sampling.top_p = args.f32();
                sampling.min_p = args.f32();
                sampling.repeat_penalty = args.f32();
                sampling.presence_penalty = args.f32();
                sampling.frequency_penalty = args.f32();
                sampling.penalty_last_n = (args.u16() as i16).into();
                sampling.seed = u64::from(args.u32());
                // SAFETY: a readable struct.
                ("dv2_set_sampling", unsafe {
                    ffi::dv2_set_sampling(h, &sampling)
                })
            }
            7 => {
                let asked = args.u8() as usize % 48;
                let text = args.bytes(asked).to_vec();
                let n = text.len(); // fewer where the input ends
                let flags = u32::from(args.u8() % 8);
                let cap = args.u8() as usize % 64;
                let text_ptr = if n == 0 && null {
                    std::ptr::null()
                } else {
                    text.as_ptr().cast()
                };
                let (s, ids, n_out) = buffer_call("dv2_tokenize", cap, -7i32, |out, n_out| {
                    // SAFETY: `n` readable bytes; room for `cap` ids.
                    unsafe { ffi::dv2_tokenize(h, text_ptr, n, flags, out, cap, n_out) }
                });
                if s == DV2_OK {
                    assert!(ids.data[..n_out].iter().all(|&i| i >= 0), "negative id");
                }
                ("dv2_tokenize", s)
            }
            8 => {
                let n = args.u8() as usize % 12;
                let ids: Vec<i32> = (0..n).map(|_| args.id(vocab)).collect();
                let flags = u32::from(args.u8() % 4);
                let cap = args.u8() as usize % 64;
                let (s, _, _) = buffer_call("dv2_detokenize", cap, CANARY_BYTE, |out, len| {
                    // SAFETY: `n` readable ids; room for `cap` bytes.
                    unsafe { ffi::dv2_detokenize(h, ids.as_ptr(), n, flags, out.cast(), cap, len) }
                });
                ("dv2_detokenize", s)
            }
            9 => {
                let id = args.id(vocab);
                let cap = args.u8() as usize % 16;
                let (s, _, _) = buffer_call("dv2_token_to_piece", cap, CANARY_BYTE, |out, len| {
                    // SAFETY: room for `cap` bytes.
                    unsafe { ffi::dv2_token_to_piece(h, id, out.cast(), cap, len) }
                });
                ("dv2_token_to_piece", s)
            }
            10 => {
                let n = args.u8() as usize % 4;
                let strings: Vec<(std::ffi::CString, std::ffi::CString)> = (0..n)
                    .map(|_| (args.c_string(12), args.c_string(24)))
                    .collect();
                let messages: Vec<ffi::dv2_chat_message> = strings
                    .iter()
                    .map(|(role, content)| ffi::dv2_chat_message {
                        role: role.as_ptr(),
                        content: content.as_ptr(),
                    })
                    .collect();
                let add = i32::from(args.u8() & 1);
                let cap = args.u8() as usize;
                let list = if n == 0 && null {
                    std::ptr::null()
                } else {
                    messages.as_ptr()
                };
                let name = "dv2_chat_apply_template";
                let (s, _, _) = buffer_call(name, cap, CANARY_BYTE, |out, len| {
                    // SAFETY: `n` messages of NUL-terminated strings; room for `cap` bytes.
                    unsafe { ffi::dv2_chat_apply_template(h, list, n, add, out.cast(), cap, len) }
                });
                (name, s)
            }
            11 => {
                let which = i32::from(args.u8() % 8) - 2;
                let mut id = -7i32;
                // SAFETY: a writable out-pointer.
                let s = unsafe { ffi::dv2_token_special(h, which, &mut id) };
                if s == DV2_OK {
                    assert!(id >= -1, "special id {id}");
                }
                ("dv2_token_special", s)
            }
            12 => {
                let id = args.id(vocab);
                let mut flag = -7i32;
                // SAFETY: a writable out-pointer.
                let s = unsafe { ffi::dv2_token_is_eog(h, id, &mut flag) };
                if s == DV2_OK {
                    assert!(flag == 0 || flag == 1, "eog flag {flag}");
                }
                ("dv2_token_is_eog", s)
            }
            13 => {
                let key = args.c_string(32);
                let cap = args.u8() as usize % 48;
                let (s, _, _) = buffer_call("dv2_meta_str", cap, CANARY_BYTE, |out, len| {
                    // SAFETY: a NUL-terminated key; room for `cap` bytes.
                    unsafe { ffi::dv2_meta_str(h, key.as_ptr(), out.cast(), cap, len) }
                });
                ("dv2_meta_str", s)
            }
            14 => {
                let index = args.u8() as usize;
                let cap = args.u8() as usize % 48;
                let mut count = usize::MAX;
                // SAFETY: a writable out-pointer.
                assert_eq!(unsafe { ffi::dv2_meta_count(h, &mut count) }, DV2_OK);
                let (s, _, _) = buffer_call("dv2_meta_key", cap, CANARY_BYTE, |out, len| {
                    // SAFETY: room for `cap` bytes.
                    unsafe { ffi::dv2_meta_key(h, index, out.cast(), cap, len) }
                });
                if index >= count {
                    assert_eq!(s, DV2_ERR_INVALID_ARGUMENT, "key {index} of {count}");
                }
                ("dv2_meta_key", s)
            }
            15 if op & 0x70 == 0x40 => {
                // SAFETY: a NUL-terminated path.
                let saved = unsafe { ffi::dv2_state_save_file(h, target.state_file.as_ptr()) };
                let path = target.state_file.to_str().unwrap_or_default();
                let (at, flip) = (args.u16() as usize, args.u8());
                if saved == DV2_OK && flip != 0 {
                    if let Ok(mut bytes) = std::fs::read(path) {
                        let at = at % bytes.len();
                        bytes[at] ^= flip;
                        let _ = std::fs::write(path, bytes);
                    }
                }
                let cap = if null { 0 } else { args.u8() as usize % 48 };
                let (s, out, n) = buffer_call("dv2_state_load_file", cap, -7i32, |out, n| {
                    let out = if null { std::ptr::null_mut() } else { out };
                    // SAFETY: a NUL-terminated path; `out` NULL (room 0) or room for `cap`.
                    unsafe { ffi::dv2_state_load_file(h, target.state_file.as_ptr(), out, cap, n) }
                });
                if s == DV2_OK {
                    check_loaded_state(h, position, vocab, &out.data[..n]);
                }
                ("dv2_state_load_file", s)
            }
            15 if op & 0x70 == 0x50 => {
                // The state in memory: saved into a guarded room (NULL with none), then loaded
                // back from the bytes it got, as saved or with a byte changed.
                let room = if null { 0 } else { args.u16() as usize };
                let (saved, bytes, size) =
                    buffer_call("dv2_state_save_data", room, CANARY_BYTE, |out, n| {
                        let out = if null { std::ptr::null_mut() } else { out };
                        // SAFETY: `out` NULL (room 0) or room for `room` bytes.
                        unsafe { ffi::dv2_state_save_data(h, out, room, n) }
                    });
                let mut data = bytes.data[..size.min(room)].to_vec();
                let (at, flip) = (args.u16() as usize, args.u8());
                if saved == DV2_OK && flip != 0 {
                    let at = at % data.len();
                    data[at] ^= flip;
                }
                let cap = args.u8() as usize % 48;
                let (s, out, n) = buffer_call("dv2_state_load_data", cap, -7i32, |out, n| {
                    // SAFETY: `data` readable for its length; room for `cap` ids.
                    unsafe { ffi::dv2_state_load_data(h, data.as_ptr(), data.len(), out, cap, n) }
                });
                if s == DV2_OK {
                    check_loaded_state(h, position, vocab, &out.data[..n]);
                }
                ("dv2_state_load_data", s)
            }
            15 if op & 0x70 == 0x60 => {
                // Speculation: its setting (-2 to 17), then a draft of the host's (0 to 17
                // ids, the vocabulary's and a little past it) into a guarded room; step_n
                // calls after it decode with the setting.
                let max_draft = i32::from(args.u8() % 20) - 2;
                // SAFETY: a live handle.
                let set = unsafe { ffi::dv2_set_speculation(h, max_draft) };
                let ok_setting = (0..=ffi::dv2_limits::DV2_MAX_DRAFT as i32).contains(&max_draft);
                assert_eq!(
                    set == DV2_OK,
                    ok_setting,
                    "set_speculation({max_draft}): {set:?}"
                );
                let n = args.u8() as usize % 18;
                let draft: Vec<i32> = (0..n).map(|_| args.id(vocab + 2)).collect();
                let room = args.u8() as usize % 20;
                let mut out = Guarded::new(room, -7i32);
                let mut count = usize::MAX;
                let ptr = if null {
                    std::ptr::null()
                } else {
                    draft.as_ptr()
                };
                // SAFETY: `ptr` NULL or `n` readable ids; room for `room` ids; `count` writable.
                let s = unsafe { ffi::dv2_step_draft(h, ptr, n, out.ptr(), room, &mut count) };
                out.check("dv2_step_draft");
                if s == DV2_OK {
                    assert!(
                        (1..=n + 1).contains(&count),
                        "step_draft wrote {count} of {n}"
                    );
                    check_position(h, position + count as i32);
                    let ids = &out.data[..count];
                    assert!(ids.iter().all(|id| (0..vocab).contains(id)));
                    // Every id but the last is the draft's (accepted), the last is free.
                    assert_eq!(ids[..count - 1], draft[..count - 1], "accepted ids");
                } else {
                    assert_eq!(count, 0, "step_draft failed ({s:?}) and counted {count}");
                }
                ("dv2_step_draft", s)
            }
            _ => {
                let mut info = ffi::dv2_model_info {
                    struct_size: if null {
                        args.u32()
                    } else {
                        std::mem::size_of::<ffi::dv2_model_info>() as u32
                    },
                    ..Default::default()
                };
                let (mut finished, mut next) = (-7i32, -7i32);
                // SAFETY: writable out-pointers (the struct as large as its own size).
                let s = unsafe {
                    let info_status = ffi::dv2_get_model_info(h, &mut info);
                    if info_status == DV2_OK {
                        assert_eq!(info.vocab, vocab);
                    }
                    let f = ffi::dv2_finished(h, &mut finished);
                    assert!(f == DV2_OK && (finished == 0 || finished == 1));
                    let n = ffi::dv2_next_token(h, &mut next);
                    assert!(
                        n != DV2_OK || (0..vocab).contains(&next),
                        "next token {next}"
                    );
                    info_status
                };
                ("dv2_get_model_info", s)
            }
        };
        assert_ne!(status, DV2_ERR_INTERNAL, "{name}: {}", last_error());
        if status != DV2_OK {
            assert!(
                !last_error().is_empty(),
                "{name} failed with {status:?} and no message"
            );
        }
        let mut after = -1i32;
        // SAFETY: as above.
        let usable = unsafe { ffi::dv2_position(h, &mut after) };
        assert_eq!(usable, DV2_OK, "after {name}: {}", last_error());
        assert!(
            (0..=target.max_seq).contains(&after),
            "position {after} after {name}"
        );
        // Only a forward finds non-finite logits, and it moved the position as it would have
        // on success (docs/api.md; checked by its op above): a state loaded with a value
        // changed to inf or NaN is one way to them. dv2_logprobs then refuses them.
        let forward = matches!(
            name,
            "dv2_prefill" | "dv2_step" | "dv2_step_n" | "dv2_step_draft"
        );
        assert!(
            status != DV2_ERR_NON_FINITE || forward || name == "dv2_logprobs",
            "{name} non-finite"
        );
        if status != DV2_OK && status != DV2_FINISHED && status != DV2_ERR_NON_FINITE {
            assert_eq!(
                after, position,
                "{name} failed ({status:?}) and moved the position"
            );
        }
    }
}

/// A state loaded back into the request it was saved from (at `position`): only one of this
/// request's length loads, whatever byte changed, and its ids are in the vocabulary.
fn check_loaded_state(h: *mut ffi::dv2_engine, position: i32, vocab: i32, ids: &[i32]) {
    let n = ids.len();
    assert_eq!(
        n as i32, position,
        "a state of {n} ids loaded at {position}"
    );
    check_position(h, position);
    assert!(ids.iter().all(|id| (0..vocab).contains(id)), "ids {ids:?}");
}

/// The position the last call left, which must be `want`.
fn check_position(h: *mut ffi::dv2_engine, want: i32) {
    assert_eq!(position_now(h), want, "position");
}

/// The handle's position (the call must succeed).
fn position_now(h: *mut ffi::dv2_engine) -> i32 {
    let mut p = -1i32;
    // SAFETY: the live handle and a writable out-pointer.
    assert_eq!(
        unsafe { ffi::dv2_position(h, &mut p) },
        ffi::dv2_status::DV2_OK
    );
    p
}

/// A call that writes up to `cap` elements and their count (`dv2_tokenize` and the text
/// calls' buffer rule), on a guarded buffer filled with `fill`: nothing written past the room,
/// the count checked by [`check_lengths`]; the status, the buffer and the count back.
fn buffer_call<T: Copy + PartialEq>(
    name: &str,
    cap: usize,
    fill: T,
    call: impl FnOnce(*mut T, &mut usize) -> ffi::dv2_status,
) -> (ffi::dv2_status, Guarded<T>, usize) {
    let mut out = Guarded::new(cap, fill);
    let mut len = usize::MAX;
    let status = call(out.ptr(), &mut len);
    out.check(name);
    check_lengths(name, status, len, cap);
    (status, out, len)
}

/// A buffer call's length: within the room on success, past it where the room was too small.
fn check_lengths(name: &str, status: ffi::dv2_status, len: usize, cap: usize) {
    use ffi::dv2_status::*;
    match status {
        DV2_OK => assert!(len <= cap, "{name}: {len} of {cap}"),
        DV2_ERR_BUFFER_TOO_SMALL => assert!(
            len > cap && len != usize::MAX,
            "{name}: needs {len}, room {cap}"
        ),
        _ => {}
    }
}
