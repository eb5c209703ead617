//! Hugging Face directories the test writes itself: good ones load (single file, sharded,
//! bf16/f16/f32, Qwen2 biases and tied embeddings), bad ones are errors naming the problem.

mod common;

use common::safetensors_writer::HfWriter;
use common::{fixture_json, json_ids};
use decodev2::chat::Message;
use decodev2::engine::{BackendKind, Engine, EngineOptions};
use decodev2::load::load;
use decodev2::model::QkvWeights;
use decodev2::nf4::Nf4Matrix;
use decodev2::oracle::{step_logits, KvCache};
use decodev2::rope::RopeScaling;
use decodev2::Error;

fn dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir()
        .join(format!("dv2-hf-{}", std::process::id()))
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn good_directories_load() {
    for (arch, shards, dtype) in [
        ("LlamaForCausalLM", 1, "F32"),
        ("Qwen2ForCausalLM", 3, "BF16"),
        ("MistralForCausalLM", 2, "F16"),
    ] {
        let mut w = HfWriter::tiny(arch);
        w.dtype = dtype;
        let d = dir(&format!("{arch}-{dtype}"));
        w.write(&d, shards);
        let m = load(&d).unwrap_or_else(|e| panic!("{arch}: {e}"));
        let qwen = arch.starts_with("Qwen2");
        assert_eq!(
            (m.spec.qkv_bias, m.spec.tied_embed, m.spec.n_kv_heads),
            (qwen, qwen, 2),
            "{arch}"
        );
        let QkvWeights::Separate { k, .. } = &m.layers[0].qkv else {
            panic!()
        };
        assert_eq!(k.bias.is_some(), qwen);
        // k rows are stored as written (no permutation for Hugging Face files).
        let src = &w
            .tensors
            .iter()
            .find(|t| t.0.ends_with("k_proj.weight"))
            .unwrap()
            .2;
        let rounded: Vec<f32> = src[3 * 64..4 * 64]
            .iter()
            .map(|v| match dtype {
                "BF16" => half::bf16::from_f32(*v).to_f32(),
                "F16" => half::f16::from_f32(*v).to_f32(),
                _ => *v,
            })
            .collect();
        let mut got = vec![0f32; 64];
        k.weight.dequantize_row(3, &mut got);
        assert_eq!(
            got,
            Nf4Matrix::quantize(1, 64, &rounded).unwrap().dequantize(),
            "{arch}"
        );
    }
}

#[test]
fn rope_theta_from_either_config_generation() {
    // transformers 4.x: top-level rope_theta; 5.x: rope_parameters.rope_theta.
    let mut w = HfWriter::tiny("Qwen2ForCausalLM");
    w.config["rope_theta"] = serde_json::json!(5e5);
    let d = dir("theta4");
    w.write(&d, 1);
    assert_eq!(load(&d).unwrap().spec.rope_theta, 5e5);
    w.config.as_object_mut().unwrap().remove("rope_theta");
    w.config["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 1e6});
    let d = dir("theta5");
    w.write(&d, 1);
    assert_eq!(load(&d).unwrap().spec.rope_theta, 1e6);
    // Mistral's sliding window caps the capacity.
    let mut w = HfWriter::tiny("MistralForCausalLM");
    w.config["sliding_window"] = serde_json::json!(8);
    let d = dir("mistral-window");
    w.write(&d, 1);
    assert_eq!(load(&d).unwrap().spec.max_seq, 8);
}

/// Llama 3.1's RoPE bands as the tiny model's head (16 dims, theta 10,000) meets them with an
/// original length of 32: pair 0 (wavelength 6.3) is kept, pair 1 (19.9) blended, pairs 2..7
/// divided by the factor.
fn llama3_scaling() -> serde_json::Value {
    serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
}

#[test]
fn rope_scaling_from_either_config_generation() {
    let want = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position: 32.0,
    };
    // transformers 4.x: rope_scaling beside rope_theta.
    let mut w = HfWriter::tiny("LlamaForCausalLM");
    w.config["rope_scaling"] = llama3_scaling();
    let d = dir("llama3-4");
    w.write(&d, 1);
    let scaled = load(&d).unwrap();
    assert_eq!(scaled.rope_scaling, want);
    // 5.x: both inside rope_parameters.
    let mut w5 = HfWriter::tiny("LlamaForCausalLM");
    w5.config.as_object_mut().unwrap().remove("rope_theta");
    w5.config["rope_parameters"] = llama3_scaling();
    w5.config["rope_parameters"]["rope_theta"] = serde_json::json!(10000.0);
    let d = dir("llama3-5");
    w5.write(&d, 1);
    let m5 = load(&d).unwrap();
    assert_eq!((m5.rope_scaling, m5.spec.rope_theta), (want, 10000.0));
    // YaRN in Qwen2.5's long-context form: the attention factor from the factor, betas 32 and
    // 1; then with the factor's mscale ratio (mscale, mscale_all_dim), and one given outright.
    let mut q = HfWriter::tiny("Qwen2ForCausalLM");
    q.config["rope_scaling"] = serde_json::json!({"type": "yarn", "factor": 4.0,
        "original_max_position_embeddings": 32768});
    let d = dir("yarn");
    q.write(&d, 1);
    let yarn = |attention_factor: f64| RopeScaling::Yarn {
        factor: 4.0,
        original_max_position: 32768.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: true,
        attention_factor: attention_factor as f32,
    };
    assert_eq!(load(&d).unwrap().rope_scaling, yarn(1.0 + 0.1 * 4f64.ln()));
    q.config["rope_scaling"]["mscale"] = serde_json::json!(1.0);
    q.config["rope_scaling"]["mscale_all_dim"] = serde_json::json!(0.5);
    q.write(&d, 1);
    let ratio = (1.0 + 0.1 * 4f64.ln()) / (1.0 + 0.05 * 4f64.ln());
    assert_eq!(load(&d).unwrap().rope_scaling, yarn(ratio));
    q.config["rope_scaling"]["attention_factor"] = serde_json::json!(1.25);
    q.write(&d, 1);
    assert_eq!(load(&d).unwrap().rope_scaling, yarn(1.25));

    // Dynamic NTK (InternLM2's): the plain frequencies within max_position_embeddings, and an
    // engine asked for more is refused.
    let mut n = HfWriter::tiny("LlamaForCausalLM");
    n.config["rope_scaling"] = serde_json::json!({"type": "dynamic", "factor": 2.0});
    let ntk = load(&dir_written(&n, "dynamic")).unwrap();
    assert_eq!(
        ntk.rope_scaling,
        RopeScaling::DynamicNtk {
            factor: 2.0,
            max_position: 16
        }
    );
    let cpu = |max_seq| EngineOptions {
        backend: BackendKind::Cpu,
        max_seq,
        ..EngineOptions::default()
    };
    Engine::new(ntk.clone(), &cpu(0)).expect("the model's own 16 positions");
    let err = Engine::new(ntk, &cpu(32))
        .err()
        .expect("past max_position_embeddings");
    assert!(
        err.to_string()
            .contains("set max_seq to 16 or less (asked: 32)"),
        "{err}"
    );

    // The older key name `type`, and linear interpolation.
    w.config["rope_scaling"] = serde_json::json!({"type": "linear", "factor": 2.0});
    let d = dir("linear");
    w.write(&d, 1);
    assert_eq!(
        load(&d).unwrap().rope_scaling,
        RopeScaling::Linear { factor: 2.0 }
    );

    // The scaling reaches the decode: the same weights unscaled give other logits from the
    // second position on (the first token's rotation is the identity either way).
    let plain = load(&dir_written(&HfWriter::tiny("LlamaForCausalLM"), "plain")).unwrap();
    let logits = |model: decodev2::model::HostModel| {
        let opts = EngineOptions {
            backend: BackendKind::Cpu,
            ..EngineOptions::default()
        };
        let mut engine = Engine::new(model, &opts).unwrap();
        let mut rows = Vec::new();
        for id in [3, 17, 5] {
            engine.prefill(&[id]).unwrap();
            let mut row = vec![0f32; 32];
            engine.logits(&mut row).unwrap();
            rows.push(row);
        }
        rows
    };
    let (a, b) = (logits(scaled), logits(plain));
    assert_eq!(a[0], b[0]);
    assert_ne!(a[1], b[1]);
    assert_ne!(a[2], b[2]);
}

fn dir_written(w: &HfWriter, name: &str) -> std::path::PathBuf {
    let d = dir(name);
    w.write(&d, 1);
    d
}

#[test]
fn bad_directories_are_named_errors() {
    let check = |name: &str, w: &HfWriter, needle: &str| {
        let d = dir(name);
        w.write(&d, 1);
        let err = load(&d).unwrap_err();
        assert!(
            matches!(err, Error::ModelFile(_) | Error::Unsupported(_)),
            "{name}: {err:?}"
        );
        assert!(
            err.to_string().contains(needle),
            "{name}: {err} should mention {needle:?}"
        );
    };
    let mut w = HfWriter::tiny("GPT2LMHeadModel");
    check("arch", &w, "GPT2LMHeadModel");
    w = HfWriter::tiny("LlamaForCausalLM");
    w.config["rope_scaling"] = serde_json::json!({"type": "longrope", "factor": 2.0});
    check("rope", &w, "rope_scaling of type longrope");
    w = HfWriter::tiny("LlamaForCausalLM");
    w.config["rope_parameters"] = serde_json::json!({"rope_type": "longrope", "rope_theta": 1e6});
    check("rope5", &w, "rope_parameters of type longrope");
    w.config["rope_parameters"] = serde_json::json!({"rope_type": "yarn", "rope_theta": 1e6});
    check("rope5-yarn", &w, "rope_parameters yarn: factor is missing");
    w = HfWriter::tiny("LlamaForCausalLM");
    w.config["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32});
    check(
        "rope-key",
        &w,
        "rope_scaling llama3: low_freq_factor is missing",
    );
    w.config["rope_scaling"]["low_freq_factor"] = serde_json::json!(4.0);
    check(
        "rope-bands",
        &w,
        "high_freq_factor (4) must be > low_freq_factor (4)",
    );
    w.config["rope_scaling"] = serde_json::json!("llama3");
    check("rope-form", &w, "rope_scaling \"llama3\" is not an object");
    // A tensor the loader would pass over: an o-projection bias (an old checkpoint's
    // rotary_emb.inv_freq buffer, which config.json determines, loads).
    w = HfWriter::tiny("LlamaForCausalLM");
    w.tensors.push((
        "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
        vec![8],
        vec![1.0; 8],
    ));
    load(&dir_written(&w, "inv-freq")).expect("an inv_freq buffer loads");
    w.tensors.push((
        "model.layers.0.self_attn.o_proj.bias".into(),
        vec![64],
        vec![0.5; 64],
    ));
    check(
        "o-bias",
        &w,
        "tensor model.layers.0.self_attn.o_proj.bias (1 unread in all)",
    );
    w = HfWriter::tiny("LlamaForCausalLM");
    w.config["partial_rotary_factor"] = serde_json::json!(0.5);
    check("partial-rotary", &w, "partial_rotary_factor 0.5");
    w = HfWriter::tiny("Qwen2ForCausalLM");
    w.config["use_sliding_window"] = serde_json::json!(true);
    check("window", &w, "use_sliding_window");
    w = HfWriter::tiny("LlamaForCausalLM");
    w.tensors.retain(|t| !t.0.ends_with("down_proj.weight"));
    check(
        "missing",
        &w,
        "model.layers.0.mlp.down_proj.weight is missing",
    );
    w = HfWriter::tiny("LlamaForCausalLM");
    w.tensor_mut("model.layers.0.self_attn.v_proj.weight").1 = vec![64, 32];
    check("shape", &w, "v_proj.weight has shape [64, 32]");
    w = HfWriter::tiny("LlamaForCausalLM");
    w.tensor_mut("model.layers.0.mlp.up_proj.weight").2[5] = f32::NAN;
    check("nan", &w, "up_proj.weight");
    w = HfWriter::tiny("LlamaForCausalLM");
    w.config["hidden_size"] = serde_json::json!(48);
    w.config["num_attention_heads"] = serde_json::json!(3);
    w.config["num_key_value_heads"] = serde_json::json!(1);
    check("hidden", &w, "hidden (48) is not a multiple of 64");
    w = HfWriter::tiny("LlamaForCausalLM");
    w.config
        .as_object_mut()
        .unwrap()
        .remove("num_hidden_layers");
    check("key", &w, "num_hidden_layers is missing");

    // A truncated safetensors file.
    let d = dir("truncated");
    HfWriter::tiny("LlamaForCausalLM").write(&d, 1);
    let f = d.join("model.safetensors");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() - 10]).unwrap();
    let err = load(&d).unwrap_err();
    assert!(matches!(err, Error::ModelFile(_)), "{err:?}");
    // No weights at all.
    let d = dir("empty");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(
        d.join("config.json"),
        serde_json::to_vec(&HfWriter::tiny("LlamaForCausalLM").config).unwrap(),
    )
    .unwrap();
    assert!(load(&d)
        .unwrap_err()
        .to_string()
        .contains("no model.safetensors"));
}

/// InternLM2's own checkpoint layout (its remote code's names, one fused wqkv in its grouped
/// packing): tiny_internlm's synthetic weights written that way load back to the same model,
/// the oracle's logits bit for bit (every NF4 block re-quantizes to its codes and scale).
#[test]
fn an_internlm2_directory_loads_its_fused_wqkv() {
    use decodev2::arch::TINY_INTERNLM;
    let model = decodev2::synth::build(&TINY_INTERNLM, 5).unwrap();
    let s = model.spec;
    let matrix = |name: String, m: &Nf4Matrix| (name, vec![m.rows, m.cols], m.dequantize());
    let norm = |name: String, w: &[half::bf16]| {
        let values: Vec<f32> = w.iter().map(|v| v.to_f32()).collect();
        (name, vec![values.len()], values)
    };
    let mut tensors = vec![
        matrix("model.tok_embeddings.weight".into(), &model.embed),
        norm("model.norm.weight".into(), &model.final_norm),
    ];
    if let Some(head) = &model.lm_head {
        tensors.push(matrix("output.weight".into(), head));
    }
    for (i, l) in model.layers.iter().enumerate() {
        let p = |t: &str| format!("model.layers.{i}.{t}");
        let QkvWeights::InternlmFused { wqkv } = &l.qkv else {
            panic!("tiny_internlm keeps a fused wqkv")
        };
        tensors.extend([
            norm(p("attention_norm.weight"), &l.attn_norm),
            matrix(p("attention.wqkv.weight"), wqkv),
            matrix(p("attention.wo.weight"), &l.o),
            norm(p("ffn_norm.weight"), &l.ffn_norm),
            matrix(p("feed_forward.w1.weight"), &l.gate),
            matrix(p("feed_forward.w3.weight"), &l.up),
            matrix(p("feed_forward.w2.weight"), &l.down),
        ]);
    }
    let config = serde_json::json!({
        "architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2", "bias": false,
        "hidden_size": s.hidden, "intermediate_size": s.intermediate,
        "num_hidden_layers": s.n_layers, "num_attention_heads": s.n_q_heads,
        "num_key_value_heads": s.n_kv_heads, "vocab_size": s.vocab,
        "max_position_embeddings": s.max_seq, "rms_norm_eps": s.rms_eps,
        "rope_theta": s.rope_theta, "tie_word_embeddings": s.tied_embed, "hidden_act": "silu",
    });
    let w = HfWriter {
        config,
        tensors,
        dtype: "F32",
    };
    let back = load(&dir_written(&w, "internlm2")).unwrap();
    assert_eq!(back.spec, s);
    let logits = |m: &decodev2::model::HostModel| {
        let mut kv = KvCache::new(&m.spec, m.spec.max_seq).unwrap();
        step_logits(m, &mut kv, &[3, 1, 4, 1, 5], 0).unwrap()
    };
    assert_eq!(logits(&back), logits(&model));
    // Its `bias` (on wqkv and wo alike) is refused, as any InternLM2 with biases is.
    let mut biased = w;
    biased.config["bias"] = serde_json::json!(true);
    let err = load(&dir_written(&biased, "internlm2-bias")).unwrap_err();
    assert!(
        err.to_string().contains("internlm_gqa with qkv_bias"),
        "{err}"
    );
}

/// A Hugging Face directory's own tokenizer (tokenizer.json of another family than SmolLM2's:
/// Qwen2's split and specials, tests/fixtures/hf_tokenizer_qwen2_style, written with its
/// reference ids by make_hf_tokenizer.py) and config.json as metadata; without tokenizer.json
/// the model still loads and says why it has no tokenizer.
#[test]
fn a_directory_brings_its_tokenizer_and_metadata() {
    let w = HfWriter::tiny("Qwen2ForCausalLM");
    let d = dir("with-tokenizer");
    w.write(&d, 1);
    let opts = EngineOptions {
        backend: BackendKind::Cpu,
        ..EngineOptions::default()
    };
    let bare = Engine::load_file(&d, &opts).unwrap();
    let err = bare.tokenizer().err().expect("no tokenizer.json");
    assert!(err.to_string().contains("no tokenizer.json"), "{err}");
    assert_eq!(
        bare.meta().get("architectures").cloned(),
        Some(Ok("[\"Qwen2ForCausalLM\"]".to_string()))
    );
    assert!(bare.meta().contains_key("hidden_size"));

    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf_tokenizer_qwen2_style");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture.join(f), d.join(f)).unwrap();
    }
    let e = Engine::load_file(&d, &opts).unwrap();
    let tk = e.tokenizer().unwrap();
    let reference = fixture_json("hf_tokenizer_qwen2_style/reference.json");
    let cases = reference["cases"].as_array().unwrap();
    assert!(cases.len() >= 50);
    for c in cases {
        let text = c["text"].as_str().unwrap();
        assert_eq!(
            tk.encode(text, true, true).unwrap(),
            json_ids(&c["ids"]),
            "{text:?}"
        );
        let literal = tk.encode(text, true, false).unwrap();
        assert_eq!(literal, json_ids(&c["literal_ids"]), "{text:?}");
        assert_eq!(
            tk.decode(&literal, false).unwrap(),
            text.as_bytes(),
            "{text:?}"
        );
    }
    let id = |t: &str| tk.encode(t, false, true).unwrap()[0];
    assert_eq!(tk.special.bos, None);
    assert_eq!(tk.special.eos, Some(id("<|im_end|>")));
    assert_eq!(tk.special.pad, Some(id("<|endoftext|>")));
    assert!(tk.is_eog(id("<|im_end|>")) && !tk.is_eog(id("<|im_start|>")));
    let chat = tk
        .apply_chat_template(
            &[Message {
                role: "user".into(),
                content: "Hi".into(),
            }],
            true,
        )
        .unwrap();
    assert_eq!(
        chat,
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}

/// A tokenizer.json the `tokenizers` crate panics on is the file's error, and the model still
/// loads: a syntax error inside "decoder" (the fuzz target hf_tokenizer's first find: the crate
/// panicked reading it), and a well-formed "Precompiled" normalizer whose charsmap is not
/// base64 (huggingface/tokenizers#2156: the crate's `expect`). One it panics on only when it
/// encodes (a FixedLength split of length 0: `chunks(0)`, huggingface/tokenizers#2151) loads,
/// and each text it is given is refused as the file's error, the engine usable after.
#[test]
fn a_tokenizer_json_the_tokenizers_crate_panics_on_is_the_files_error() {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf_tokenizer_qwen2_style/tokenizer.json");
    let json = std::fs::read_to_string(fixture).unwrap();
    let opts = EngineOptions {
        backend: BackendKind::Cpu,
        ..EngineOptions::default()
    };
    let load_with = |name: &str, tokenizer_json: String| {
        let d = dir(name);
        HfWriter::tiny("Qwen2ForCausalLM").write(&d, 1);
        std::fs::write(d.join("tokenizer.json"), tokenizer_json).unwrap();
        Engine::load_file(&d, &opts).expect("the model loads whatever its tokenizer")
    };
    let cases = [
        ("\"decoder\": {", "\"decoder\":A{", "expected value"),
        (
            "\"normalizer\": null",
            "\"normalizer\": {\"type\": \"Precompiled\", \"precompiled_charsmap\": \"#\"}",
            "the tokenizers crate panicked",
        ),
    ];
    for (i, (from, to, said)) in cases.into_iter().enumerate() {
        assert!(json.contains(from), "{from}");
        let e = load_with(&format!("broken-tokenizer-{i}"), json.replacen(from, to, 1));
        let err = e.tokenizer().err().expect("the tokenizer is refused");
        let text = err.to_string();
        assert!(
            text.contains("tokenizer.json") && text.contains(said),
            "{text}"
        );
    }

    let mut fixed_length: serde_json::Value = serde_json::from_str(&json).unwrap();
    fixed_length["pre_tokenizer"] = serde_json::json!({"type": "FixedLength", "length": 0});
    let mut e = load_with("fixed-length-0", fixed_length.to_string());
    for _ in 0..2 {
        let err = e
            .tokenizer()
            .unwrap()
            .encode("hello", false, false)
            .unwrap_err();
        assert!(matches!(err, Error::ModelFile(_)), "{err:?}");
        assert!(
            err.to_string().contains("the tokenizers crate panicked"),
            "{err}"
        );
    }
    e.prefill(&[1, 2, 3]).expect("the engine is usable after");
}
