//! The model file's own tokenizer against an independent reference: SmolLM2-135M-Instruct's
//! ids for 330 strings (tests/fixtures/smollm2_tokenizer.json, written by the Python
//! `tokenizers` package with SmolLM2's own pre-tokenizer: make_smollm2_tokenizer.py beside it),
//! special-token text parsed and not; every string round-trips through its pieces.

mod common;

use common::gguf_writer::{byte_level_chars, GgufWriter, Meta};
use common::{fixture_json, json_ids, smollm2_path};
use decodev2::chat::Message;
use decodev2::load::gguf::Gguf;
use decodev2::tokenizer::Tokenizer;

struct Case {
    text: String,
    ids: Vec<u32>,
    literal_ids: Vec<u32>,
}

fn cases() -> Vec<Case> {
    fixture_json("smollm2_tokenizer.json")["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            text: c["text"].as_str().unwrap().to_string(),
            ids: json_ids(&c["ids"]),
            literal_ids: json_ids(&c["literal_ids"]),
        })
        .collect()
}

fn smollm2_tokenizer() -> Option<Tokenizer> {
    let path = smollm2_path()?;
    Some(Tokenizer::from_gguf(&Gguf::open(&path).unwrap()).unwrap())
}

#[test]
fn smollm2_ids_equal_the_reference_on_330_strings() {
    let Some(tk) = smollm2_tokenizer() else {
        return;
    };
    let cases = cases();
    assert!(cases.len() >= 300);
    let mut special = 0;
    for c in &cases {
        assert_eq!(
            tk.encode(&c.text, false, true).unwrap(),
            c.ids,
            "{:?}",
            c.text
        );
        assert_eq!(
            tk.encode(&c.text, false, false).unwrap(),
            c.literal_ids,
            "{:?} (special text as text)",
            c.text
        );
        special += (c.ids != c.literal_ids) as usize;
    }
    println!("{} strings, {special} with special-token text", cases.len());
    assert!(special >= 10, "the fixture exercises special-token text");
}

#[test]
fn smollm2_detokenize_of_tokenize_is_the_text() {
    let Some(tk) = smollm2_tokenizer() else {
        return;
    };
    for c in cases() {
        for parse_special in [false, true] {
            let ids = tk.encode(&c.text, false, parse_special).unwrap();
            let bytes = tk.decode(&ids, false).unwrap();
            assert_eq!(bytes, c.text.as_bytes(), "{:?}", c.text);
        }
    }
}

#[test]
fn smollm2_special_ids_and_pieces_come_from_the_file() {
    let Some(tk) = smollm2_tokenizer() else {
        return;
    };
    assert_eq!(tk.special.bos, Some(1));
    assert_eq!(tk.special.eos, Some(2));
    assert_eq!(tk.special.pad, Some(2));
    assert_eq!(tk.vocab_size(), 49152);
    assert_eq!(tk.piece(1).unwrap(), b"<|im_start|>");
    assert!(tk.is_control(2) && !tk.is_control(504));
    // End of generation: EOS (<|im_end|>) and <|endoftext|>, not <|im_start|> or text.
    assert!(tk.is_eog(2) && tk.is_eog(0));
    assert!(!tk.is_eog(1) && !tk.is_eog(504));
    // SmolLM2 asks for no BOS: add_special changes nothing.
    assert_eq!(
        tk.encode("Hi", true, true).unwrap(),
        tk.encode("Hi", false, true).unwrap()
    );
    // A piece may end inside a UTF-8 character; the pieces together are the text.
    let ids = tk.encode("😀", false, true).unwrap();
    assert!(ids.len() > 1, "{ids:?}");
    assert!(std::str::from_utf8(tk.piece(ids[0]).unwrap()).is_err());
    let text = tk.encode("<|im_start|>user", false, true).unwrap();
    assert_eq!(
        tk.decode(&text, true).unwrap(),
        b"user",
        "control tokens left out"
    );
    let err = tk.piece(49152).unwrap_err();
    assert!(
        err.to_string().contains("out of the tokenizer's range"),
        "{err}"
    );
}

/// SmolLM2's chat template from the GGUF, rendered byte for byte as Jinja2 with transformers'
/// settings renders it (tests/fixtures/smollm2_chat.json: 12 conversations, with and without
/// the generation prompt).
#[test]
fn smollm2_chat_template_renders_as_jinja2_does() {
    let Some(tk) = smollm2_tokenizer() else {
        return;
    };
    let json = fixture_json("smollm2_chat.json");
    let cases = json["cases"].as_array().unwrap();
    assert!(cases.len() >= 20);
    for c in cases {
        let messages: Vec<Message> = c["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| Message {
                role: m["role"].as_str().unwrap().into(),
                content: m["content"].as_str().unwrap().into(),
            })
            .collect();
        let add = c["add_generation_prompt"].as_bool().unwrap();
        let got = tk.apply_chat_template(&messages, add).unwrap();
        assert_eq!(got, c["text"].as_str().unwrap(), "{messages:?}, {add}");
    }
}

/// A SentencePiece vocabulary (`tokenizer.ggml.model = llama`, as Llama 2, Mistral and
/// InternLM2 GGUFs carry it) against the `sentencepiece` package's ids for 80 strings
/// (tests/fixtures/spm_tokenizer.json, written by make_spm_tokenizer.py: a vocabulary trained
/// like Llama's, byte fallback and digits split), written into a GGUF; every string
/// round-trips, and BOS comes first as llama.cpp's default asks.
#[test]
fn sentencepiece_ids_equal_the_reference_on_80_strings() {
    use common::gguf_writer::{GgufWriter, Meta};
    let json = fixture_json("spm_tokenizer.json");
    let strings = |k: &str| -> Vec<String> {
        json[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect()
    };
    let numbers = |k: &str| -> Vec<f64> {
        json[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect()
    };
    let mut w = GgufWriter::tiny_llama();
    w.set_meta("tokenizer.ggml.model", Meta::Str("llama".into()));
    w.set_meta("tokenizer.ggml.tokens", Meta::StrArray(strings("tokens")));
    let scores = numbers("scores").iter().map(|v| *v as f32).collect();
    w.set_meta("tokenizer.ggml.scores", Meta::F32Array(scores));
    let types = numbers("token_type").iter().map(|v| *v as i32).collect();
    w.set_meta("tokenizer.ggml.token_type", Meta::I32Array(types));
    w.set_meta("tokenizer.ggml.bos_token_id", Meta::U32(1));
    w.set_meta("tokenizer.ggml.eos_token_id", Meta::U32(2));
    w.set_meta("tokenizer.ggml.unknown_token_id", Meta::U32(0));
    let file = std::env::temp_dir().join(format!("dv2-spm-{}.gguf", std::process::id()));
    std::fs::write(&file, w.bytes()).unwrap();
    let tk = Tokenizer::from_gguf(&Gguf::open(&file).unwrap()).unwrap();
    std::fs::remove_file(&file).unwrap();
    let cases = json["cases"].as_array().unwrap();
    assert!(cases.len() >= 80);
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want = json_ids(&c["ids"]);
        let ids = tk.encode(text, false, false).unwrap();
        assert_eq!(ids, want, "{text:?}");
        assert_eq!(tk.decode(&ids, false).unwrap(), text.as_bytes(), "{text:?}");
        let with_bos = tk.encode(text, true, false).unwrap();
        assert_eq!(with_bos[0], 1, "BOS first");
        assert_eq!(tk.decode(&with_bos, true).unwrap(), text.as_bytes());
    }
    // Special-token text parsed: "<s>" becomes BOS; as text it is spelled out.
    assert_eq!(tk.encode("<s>", false, true).unwrap(), [1]);
    assert_ne!(tk.encode("<s>", false, false).unwrap(), [1]);
}

/// GGUF byte-level vocabularies under Llama 3's and Mistral's Tekken pre-tokenizers take a
/// pre-token that is a token whole, before any merge, and put BOS first unless the file says
/// otherwise, as llama.cpp reads those vocabularies; under another pre-tokenizer the merges
/// decide and BOS waits for the file's flag. Tekken also breaks words where lower case turns
/// upper. The toy vocabulary: the 256 byte pieces, "ab" (merge "a b"), "abc" and "aB", which no
/// merge makes.
#[test]
fn llama3_and_tekken_vocabularies_take_whole_tokens_and_bos() {
    let mut tokens: Vec<String> = byte_level_chars().into_iter().map(String::from).collect();
    tokens.extend(["ab", "abc", "aB", "<s>"].map(String::from));
    let (ab, abc, a_upper_b, bos) = (256, 257, 258, 259);
    let mut types = vec![1i32; tokens.len()];
    types[bos as usize] = 3;
    let tokenizer = |pre: &str| {
        let mut w = GgufWriter::tiny_llama();
        w.set_meta("tokenizer.ggml.model", Meta::Str("gpt2".into()));
        w.set_meta("tokenizer.ggml.pre", Meta::Str(pre.into()));
        w.set_meta("tokenizer.ggml.tokens", Meta::StrArray(tokens.clone()));
        w.set_meta("tokenizer.ggml.token_type", Meta::I32Array(types.clone()));
        w.set_meta("tokenizer.ggml.merges", Meta::StrArray(vec!["a b".into()]));
        w.set_meta("tokenizer.ggml.bos_token_id", Meta::U32(bos));
        let path = std::env::temp_dir().join(format!("dv2-tok-{}-{pre}.gguf", std::process::id()));
        std::fs::write(&path, w.bytes()).unwrap();
        Tokenizer::from_gguf(&Gguf::open(&path).unwrap()).unwrap()
    };
    // Byte b's piece is the vocabulary's entry b.
    let byte = |c: u8| c as u32;
    let llama3 = tokenizer("llama-bpe");
    assert_eq!(llama3.encode("abc", true, false).unwrap(), [bos, abc]);
    assert_eq!(llama3.encode("aB", false, false).unwrap(), [a_upper_b]);
    // Whole pre-tokens only: "abcab" is one, and no token, so the merges make it.
    assert_eq!(
        llama3.encode("abcab", false, false).unwrap(),
        [ab, byte(b'c'), ab]
    );
    let tekken = tokenizer("tekken");
    assert_eq!(tekken.encode("abc", true, false).unwrap(), [bos, abc]);
    assert_eq!(
        tekken.encode("aB 12", false, false).unwrap(),
        [byte(b'a'), byte(b'B'), byte(b' '), byte(b'1'), byte(b'2')]
    );
    let smollm = tokenizer("smollm");
    assert_eq!(smollm.encode("abc", true, false).unwrap(), [ab, byte(b'c')]);
}

/// A Hugging Face directory with no tokenizer.json but a SentencePiece tokenizer.model
/// (InternLM2's, older Llama-2 uploads'): the same vocabulary as above written as the
/// ModelProto (make_spm_model.py, checked there against the `sentencepiece` package) gives the
/// reference ids for all 80 strings, BOS and EOS from tokenizer_config.json; a unigram model,
/// and a normalizer that collapses whitespace, are refused by name.
#[test]
fn a_directorys_sentencepiece_model_equals_the_reference() {
    let json = fixture_json("spm_tokenizer.json");
    let model = std::fs::read(common::repo_file("tests/fixtures/spm_tokenizer.model")).unwrap();
    let dir = std::env::temp_dir().join(format!("dv2-spm-model-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.model"), &model).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": true}"#,
    )
    .unwrap();
    let tk = Tokenizer::from_hf_dir(&dir).unwrap();
    assert_eq!((tk.special.bos, tk.special.eos), (Some(1), Some(2)));
    for c in json["cases"].as_array().unwrap() {
        let text = c["text"].as_str().unwrap();
        let ids = tk.encode(text, false, false).unwrap();
        assert_eq!(ids, json_ids(&c["ids"]), "{text:?}");
        assert_eq!(tk.decode(&ids, false).unwrap(), text.as_bytes(), "{text:?}");
        assert_eq!(tk.encode(text, true, false).unwrap()[0], 1, "BOS first");
    }
    // The same proto with its model type set to unigram (TrainerSpec field 3 = 1), then with
    // remove_extra_whitespaces on (NormalizerSpec field 4 = 1): both refused.
    let refused = |patched: Vec<u8>, needle: &str| {
        std::fs::write(dir.join("tokenizer.model"), patched).unwrap();
        let err = Tokenizer::from_hf_dir(&dir).err().expect("refused");
        assert!(err.to_string().contains(needle), "{err}");
    };
    let mut trainer = model.clone();
    trainer.extend([0x12, 0x02, 0x18, 0x01]); // field 2 (LEN 2): field 3 varint 1
    refused(trainer, "SentencePiece model type 1");
    let mut normalizer = model.clone();
    normalizer.extend([0x1a, 0x02, 0x20, 0x01]); // field 3 (LEN 2): field 4 varint 1
    refused(normalizer, "remove_extra_whitespaces true");
    std::fs::remove_dir_all(&dir).unwrap();
}
