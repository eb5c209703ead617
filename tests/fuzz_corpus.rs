//! The fuzz targets' corpus replayed through the same code as the targets (fuzz/src/lib.rs):
//! each input must return, with or without an error, on every machine. fuzz/corpus/<target>
//! holds whole inputs (the seeds the runs grew from, and every input that ever crashed or hung
//! a target) and queue.patches: the inputs AFL++ kept for new coverage, as edits on a seed
//! (fuzz/pack_corpus.py packs them; the few past 4 KB of edits are left out).
//! `DV2_WRITE_FUZZ_SEEDS=1` writes the seeds (tiny valid model files) that are not there yet: a
//! seed already there is kept as it is, since queue.patches holds edits on its bytes.

mod common;

#[path = "../fuzz/src/lib.rs"]
mod targets;

use std::path::{Path, PathBuf};

fn corpus(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target)
}

fn scratch(target: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dv2-corpus-{target}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A little-endian u32 at `at`, advancing it.
fn u32_at(b: &[u8], at: &mut usize) -> usize {
    let v = u32::from_le_bytes(b[*at..*at + 4].try_into().unwrap()) as usize;
    *at += 4;
    v
}

/// The inputs of queue.patches: each a seed with its edits applied (see fuzz/pack_corpus.py).
fn patched_inputs(dir: &Path) -> Vec<Vec<u8>> {
    let Ok(packed) = std::fs::read(dir.join("queue.patches")) else {
        return Vec::new();
    };
    let mut inputs = Vec::new();
    let mut at = 0;
    while at < packed.len() {
        let len = u32_at(&packed, &mut at);
        let record = &packed[at..at + len];
        at += len;
        let name_len = record[0] as usize;
        let name = std::str::from_utf8(&record[1..1 + name_len]).unwrap();
        let seed = std::fs::read(dir.join(name)).unwrap();
        let mut r = 1 + name_len;
        let (mut input, mut copied) = (Vec::new(), 0);
        for _ in 0..u32_at(record, &mut r) {
            let (offset, removed, inserted) = (
                u32_at(record, &mut r),
                u32_at(record, &mut r),
                u32_at(record, &mut r),
            );
            input.extend_from_slice(&seed[copied..offset]);
            input.extend_from_slice(&record[r..r + inserted]);
            r += inserted;
            copied = offset + removed;
        }
        input.extend_from_slice(&seed[copied..]);
        inputs.push(input);
    }
    inputs
}

/// Every input of a target's corpus: its whole files, then its queue.
fn inputs(target: &str) -> Vec<Vec<u8>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(corpus(target))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_none_or(|e| e != "patches"))
        .collect();
    files.sort();
    let mut inputs: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(f).unwrap()).collect();
    inputs.extend(patched_inputs(&corpus(target)));
    assert!(inputs.len() > files.len(), "no queue for {target}");
    inputs
}

fn replay(target: &str, run: fn(&Path, &[u8])) {
    let dir = scratch(target);
    let inputs = inputs(target);
    for input in &inputs {
        run(&dir, input);
    }
    println!("{target}: {} inputs replayed", inputs.len());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn gguf_corpus_replays() {
    write_seeds_if_asked();
    replay("gguf", targets::gguf);
}

#[test]
fn hf_corpus_replays() {
    replay("hf", targets::hf);
}

#[test]
fn hf_tokenizer_corpus_replays() {
    replay("hf_tokenizer", targets::hf_tokenizer);
}

/// The `text` target's corpus through SmolLM2's tokenizer and chat template (SKIP without the
/// model file).
#[test]
fn text_corpus_replays() {
    if common::smollm2_path().is_none() {
        return;
    }
    let target = targets::smollm2_text_target().expect("SmolLM2's tokenizer");
    replay_text("text", &target);
}

/// The `spm_text` target's corpus through the SentencePiece tokenizer of tests/fixtures.
#[test]
fn spm_text_corpus_replays() {
    let target = targets::spm_text_target(&scratch("spm_text")).expect("the fixture reads");
    let hi = [decodev2::chat::Message {
        role: "user".into(),
        content: "hi".into(),
    }];
    let prompt = target.tokenizer.apply_chat_template(&hi, true).unwrap();
    assert_eq!(
        prompt, "<s>[INST] hi [/INST]",
        "the chat ops reach the template"
    );
    replay_text("spm_text", &target);
}

/// A text target's corpus through `target`'s tokenizer.
fn replay_text(name: &str, target: &targets::TextTarget) {
    let inputs = inputs(name);
    for input in &inputs {
        targets::text(target, input);
    }
    println!("{name}: {} inputs replayed", inputs.len());
}

/// The `abi` target's corpus through the C ABI on the tiny BPE GGUF of the `gguf` corpus,
/// one engine for all of it as in the fuzzer.
#[test]
fn abi_corpus_replays() {
    let target = targets::AbiTarget::new(&corpus("gguf").join("seed-tiny-llama-bpe"))
        .expect("the tiny GGUF loads on the CPU");
    let inputs = inputs("abi");
    for input in &inputs {
        targets::abi(&target, input);
    }
    println!("abi: {} inputs replayed", inputs.len());
}

/// The `hf_tokenizer` seeds, each checked to read and to give back a text: a SentencePiece
/// tokenizer.model (tests/fixtures, checked against the `sentencepiece` package) with BOS, EOS
/// and a chat template from tokenizer_config.json; a byte-level BPE tokenizer.json (Qwen2's
/// style) with its tokenizer_config.json.
fn write_hf_tokenizer_seeds() {
    std::fs::create_dir_all(corpus("hf_tokenizer")).unwrap();
    let fixture = |name: &str| std::fs::read(common::repo_file(&format!("tests/fixtures/{name}")));
    let spm_config = br#"{"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": true,
 "chat_template": "{% for m in messages %}<s>{{ m.role }}: {{ m.content }}</s>{% endfor %}"}"#;
    let seeds: [(&str, [Vec<u8>; 4]); 2] = [
        (
            "seed-spm-model",
            [
                fixture("spm_tokenizer.model").unwrap(),
                spm_config.to_vec(),
                Vec::new(),
                Vec::new(),
            ],
        ),
        (
            "seed-bpe-json",
            [
                Vec::new(),
                fixture("hf_tokenizer_qwen2_style/tokenizer_config.json").unwrap(),
                Vec::new(),
                fixture("hf_tokenizer_qwen2_style/tokenizer.json").unwrap(),
            ],
        ),
    ];
    let dir = scratch("hf_tokenizer-seeds");
    for (name, parts) in seeds {
        let sep = targets::HF_SEPARATOR;
        assert!(
            parts
                .iter()
                .all(|p| !p.windows(sep.len()).any(|w| w == sep)),
            "{name}: a part holds the separator, so the input would not split back into them"
        );
        let input = parts.join(sep);
        assert!(targets::write_hf_tokenizer_files(&dir, &input), "{name}");
        let tk = decodev2::tokenizer::Tokenizer::from_hf_dir(&dir).expect(name);
        let ids = tk.encode("the ab", false, false).unwrap();
        assert_eq!(tk.decode(&ids, false).unwrap(), b"the ab", "{name}");
        tk.apply_chat_template(&[], true).expect(name);
        write_seed(&corpus("hf_tokenizer").join(name), &input);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Writes a seed where none is (see the module's note).
fn write_seed(path: &Path, bytes: &[u8]) {
    if !path.exists() {
        std::fs::write(path, bytes).unwrap();
    }
}

fn write_seeds_if_asked() {
    if std::env::var_os("DV2_WRITE_FUZZ_SEEDS").is_none() {
        return;
    }
    use common::gguf_writer::{GgufWriter, Meta};
    use common::safetensors_writer::HfWriter;
    std::fs::create_dir_all(corpus("gguf")).unwrap();
    write_seed(
        &corpus("gguf").join("seed-tiny-llama"),
        &GgufWriter::tiny_llama().bytes(),
    );
    // The same with a tokenizer and a chat template: SentencePiece (byte pieces, scores,
    // control tokens), then byte-level BPE (the 256 byte characters, three merges).
    let template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}</s>{% endfor %}\
                    {% if add_generation_prompt %}<|assistant|>{% endif %}";
    let mut spm = GgufWriter::tiny_llama();
    let mut tokens: Vec<String> = [
        "<unk>",
        "<s>",
        "</s>",
        "\u{2581}",
        "a",
        "b",
        "\u{2581}a",
        "ab",
    ]
    .map(String::from)
    .to_vec();
    tokens.extend((0..=255).map(|b| format!("<0x{b:02X}>")));
    let types: Vec<i32> = (0..tokens.len())
        .map(|i| match i {
            0 => 2,
            1 | 2 => 3,
            3..=7 => 1,
            _ => 6,
        })
        .collect();
    let scores: Vec<f32> = (0..tokens.len()).map(|i| -(i as f32)).collect();
    spm.set_meta("tokenizer.ggml.model", Meta::Str("llama".into()));
    spm.set_meta("tokenizer.ggml.tokens", Meta::StrArray(tokens));
    spm.set_meta("tokenizer.ggml.scores", Meta::F32Array(scores));
    spm.set_meta("tokenizer.ggml.token_type", Meta::I32Array(types));
    spm.set_meta("tokenizer.ggml.bos_token_id", Meta::U32(1));
    spm.set_meta("tokenizer.ggml.eos_token_id", Meta::U32(2));
    spm.set_meta("tokenizer.ggml.unknown_token_id", Meta::U32(0));
    spm.set_meta("tokenizer.chat_template", Meta::Str(template.into()));
    write_seed(&corpus("gguf").join("seed-tiny-llama-spm"), &spm.bytes());
    let mut bpe = GgufWriter::tiny_llama();
    let mut tokens: Vec<String> = common::gguf_writer::byte_level_chars()
        .into_iter()
        .map(String::from)
        .collect();
    tokens.extend(["\u{120}t", "he", "\u{120}the", "<|endoftext|>"].map(String::from));
    let mut types = vec![1i32; tokens.len()];
    *types.last_mut().unwrap() = 3;
    let merges = ["\u{120} t", "h e", "\u{120}t he"]
        .map(String::from)
        .to_vec();
    bpe.set_meta("tokenizer.ggml.model", Meta::Str("gpt2".into()));
    bpe.set_meta("tokenizer.ggml.pre", Meta::Str("smollm".into()));
    bpe.set_meta(
        "tokenizer.ggml.eos_token_id",
        Meta::U32(tokens.len() as u32 - 1),
    );
    bpe.set_meta("tokenizer.ggml.tokens", Meta::StrArray(tokens));
    bpe.set_meta("tokenizer.ggml.token_type", Meta::I32Array(types));
    bpe.set_meta("tokenizer.ggml.merges", Meta::StrArray(merges));
    bpe.set_meta("tokenizer.chat_template", Meta::Str(template.into()));
    write_seed(&corpus("gguf").join("seed-tiny-llama-bpe"), &bpe.bytes());
    for seed in ["seed-tiny-llama-spm", "seed-tiny-llama-bpe"] {
        let path = corpus("gguf").join(seed);
        let loaded = decodev2::load::load_all(&path).unwrap();
        let tk = loaded.tokenizer.expect("the seed's tokenizer reads");
        let ids = tk.encode("the ab", false, false).unwrap();
        assert_eq!(tk.decode(&ids, false).unwrap(), b"the ab", "{seed}");
        tk.apply_chat_template(&[], true)
            .expect("the seed's chat template renders");
    }
    // The RoPE scalings a file names: YaRN's keys under the internlm2 architecture's prefix,
    // and Llama 3.1's rope_freqs tensor with a linear factor.
    let mut yarn = GgufWriter::tiny_llama();
    for (key, _) in yarn.meta.iter_mut() {
        if let Some(rest) = key.strip_prefix("llama.") {
            *key = format!("internlm2.{rest}");
        }
    }
    yarn.set_meta("general.architecture", Meta::Str("internlm2".into()));
    yarn.set_meta("internlm2.rope.scaling.type", Meta::Str("yarn".into()));
    yarn.set_meta("internlm2.rope.scaling.factor", Meta::F32(4.0));
    yarn.set_meta(
        "internlm2.rope.scaling.original_context_length",
        Meta::U32(64),
    );
    let mut freqs = GgufWriter::tiny_llama();
    let divisors = (1..=8).map(|d| d as f32).collect();
    freqs
        .tensors
        .push(("rope_freqs.weight".into(), vec![8], divisors));
    freqs.set_meta("llama.rope.scale_linear", Meta::F32(2.0));
    for (seed, w) in [
        ("seed-internlm2-yarn", yarn),
        ("seed-llama-rope-freqs", freqs),
    ] {
        let path = corpus("gguf").join(seed);
        write_seed(&path, &w.bytes());
        let m = decodev2::load::load_all(&path).unwrap().model;
        assert_ne!(m.rope_scaling, decodev2::rope::RopeScaling::None, "{seed}");
    }
    write_hf_tokenizer_seeds();
    std::fs::create_dir_all(corpus("hf")).unwrap();
    // InternLM2's own layout (its tensor names, q/k/v fused into one wqkv of the q heads' and
    // the k and v heads' rows) with Llama 3.1's rope_scaling.
    let mut internlm = HfWriter::tiny("LlamaForCausalLM");
    internlm.config["architectures"] = serde_json::json!(["InternLM2ForCausalLM"]);
    internlm.config["model_type"] = serde_json::json!("internlm2");
    internlm.config["bias"] = serde_json::json!(false);
    internlm.config["rope_scaling"] = serde_json::json!({
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8,
    });
    let mut wqkv = Vec::new();
    internlm.tensors.retain(|(name, _, values)| {
        let fused = ["q_proj", "k_proj", "v_proj"]
            .iter()
            .any(|m| name.contains(m));
        if fused {
            wqkv.extend_from_slice(values);
        }
        !fused
    });
    let renames = [
        ("model.embed_tokens.", "model.tok_embeddings."),
        ("lm_head.", "output."),
        ("input_layernorm.", "attention_norm."),
        ("self_attn.o_proj.", "attention.wo."),
        ("post_attention_layernorm.", "ffn_norm."),
        ("mlp.gate_proj.", "feed_forward.w1."),
        ("mlp.up_proj.", "feed_forward.w3."),
        ("mlp.down_proj.", "feed_forward.w2."),
    ];
    for (name, _, _) in internlm.tensors.iter_mut() {
        for (from, to) in renames {
            *name = name.replace(from, to);
        }
    }
    let rows = wqkv.len() / 64;
    internlm.tensors.push((
        "model.layers.0.attention.wqkv.weight".into(),
        vec![rows, 64],
        wqkv,
    ));
    let writers = [
        ("LlamaForCausalLM", HfWriter::tiny("LlamaForCausalLM")),
        ("Qwen2ForCausalLM", HfWriter::tiny("Qwen2ForCausalLM")),
        ("InternLM2ForCausalLM-llama3-rope", internlm),
    ];
    for (name, writer) in writers {
        let dir = scratch(name);
        writer.write(&dir, 1);
        let loaded = decodev2::load::load_all(&dir).unwrap().model;
        assert_eq!(loaded.spec.n_layers, 1, "{name}");
        let scaled = loaded.rope_scaling != decodev2::rope::RopeScaling::None;
        assert_eq!(scaled, name.ends_with("-rope"), "{name}");
        let mut input = std::fs::read(dir.join("config.json")).unwrap();
        input.extend_from_slice(targets::HF_SEPARATOR);
        input.extend_from_slice(targets::HF_SEPARATOR);
        input.extend(std::fs::read(dir.join("model.safetensors")).unwrap());
        write_seed(&corpus("hf").join(format!("seed-{name}")), &input);
        std::fs::remove_dir_all(&dir).unwrap();
    }
    // A bitsandbytes 4-bit directory (decodev2's writer), its down_proj with nested scales.
    let dir = scratch("bnb");
    let model = decodev2::synth::build(&decodev2::arch::TINY_LLAMA, 1).unwrap();
    decodev2::save::write_bnb_dir(&model, &dir).unwrap();
    let weights = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&weights).unwrap();
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    let down = "model.layers.0.mlp.down_proj.weight";
    let f32s = |v: Vec<f32>| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    for t in tensors.iter_mut() {
        if t.0 == format!("{down}.absmax") {
            let blocks = t.3.len() / 4;
            *t = (
                t.0.clone(),
                safetensors::Dtype::U8,
                vec![blocks],
                (0..blocks).map(|b| b as u8).collect(),
            );
        } else if t.0 == format!("{down}.quant_state.bitsandbytes__nf4") {
            let state = r#"{"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [64, 128], "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 0.25}"#.to_string();
            *t = (
                t.0.clone(),
                safetensors::Dtype::U8,
                vec![state.len()],
                state.into_bytes(),
            );
        }
    }
    tensors.push((
        format!("{down}.nested_absmax"),
        safetensors::Dtype::F32,
        vec![1],
        f32s(vec![0.5]),
    ));
    let map: Vec<f32> = (0..256).map(|i| i as f32 / 256.0).collect();
    tensors.push((
        format!("{down}.nested_quant_map"),
        safetensors::Dtype::F32,
        vec![256],
        f32s(map),
    ));
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, d, sh, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, sh.clone(), b).unwrap(),
            )
        })
        .collect();
    let weights = safetensors::serialize(views, None).unwrap();
    std::fs::write(dir.join("model.safetensors"), &weights).unwrap();
    let mut input = std::fs::read(dir.join("config.json")).unwrap();
    input.extend_from_slice(targets::HF_SEPARATOR);
    input.extend_from_slice(targets::HF_SEPARATOR);
    input.extend(weights);
    decodev2::load::load(&dir).expect("the bnb seed loads");
    write_seed(&corpus("hf").join("seed-bnb-nf4"), &input);
    std::fs::remove_dir_all(&dir).unwrap();
}
