//! GGUF loading on files the test writes itself: a good one loads with the right weights
//! (Q/K rows un-permuted), and every way a file can be wrong is an error naming the key or
//! tensor, never a panic.

mod common;

use common::gguf_writer::{GgufWriter, Meta};
use decodev2::load::load;
use decodev2::model::QkvWeights;
use decodev2::nf4::Nf4Matrix;
use decodev2::oracle::{step_logits, KvCache};
use decodev2::rope::{RopeScaling, RopeTable};
use decodev2::Error;

fn write(name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("dv2-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn load_err(name: &str, w: &GgufWriter) -> String {
    let err = load(&write(name, &w.bytes())).unwrap_err();
    assert!(
        matches!(err, Error::ModelFile(_) | Error::Unsupported(_)),
        "{err:?}"
    );
    err.to_string()
}

#[test]
fn a_good_file_loads_with_q_and_k_unpermuted() {
    let w = GgufWriter::tiny_llama();
    let model = load(&write("good.gguf", &w.bytes())).unwrap();
    let s = model.spec;
    assert_eq!(
        (
            s.n_layers,
            s.hidden,
            s.n_q_heads,
            s.n_kv_heads,
            s.head_dim,
            s.vocab
        ),
        (1, 64, 4, 2, 16, 32)
    );
    assert!(!s.tied_embed);
    let QkvWeights::Separate { q, v, .. } = &model.layers[0].qkv else {
        panic!("llama is separate q/k/v")
    };
    let src = &w
        .tensors
        .iter()
        .find(|t| t.0 == "blk.0.attn_q.weight")
        .unwrap()
        .2;
    // Row 1 (HF order) of head 0 is file row 2; row 8 (second half) is file row 1.
    let file_row = |r: usize| &src[r * 64..(r + 1) * 64];
    let want = |r: usize| {
        Nf4Matrix::quantize(1, 64, file_row(r))
            .unwrap()
            .dequantize()
    };
    let mut got = vec![0f32; 64];
    q.weight.dequantize_row(1, &mut got);
    assert_eq!(got, want(2));
    q.weight.dequantize_row(8, &mut got);
    assert_eq!(got, want(1));
    q.weight.dequantize_row(16 + 9, &mut got); // head 1, second half, j = 1
    assert_eq!(got, want(16 + 3));
    // v is not permuted.
    let vsrc = &w
        .tensors
        .iter()
        .find(|t| t.0 == "blk.0.attn_v.weight")
        .unwrap()
        .2;
    v.weight.dequantize_row(5, &mut got);
    assert_eq!(
        got,
        Nf4Matrix::quantize(1, 64, &vsrc[5 * 64..6 * 64])
            .unwrap()
            .dequantize()
    );
}

#[test]
fn internlm2_files_load_like_llama() {
    // Same tensors under the internlm2 architecture and key prefix: q/k un-permuted too.
    let mut w = GgufWriter::tiny_llama();
    for (k, _) in w.meta.iter_mut() {
        if let Some(rest) = k.strip_prefix("llama.") {
            *k = format!("internlm2.{rest}");
        }
    }
    w.set_meta("general.architecture", Meta::Str("internlm2".into()));
    let a = load(&write("internlm2.gguf", &w.bytes())).unwrap();
    let b = load(&write("llama-same.gguf", &GgufWriter::tiny_llama().bytes())).unwrap();
    let (QkvWeights::Separate { q: qa, .. }, QkvWeights::Separate { q: qb, .. }) =
        (&a.layers[0].qkv, &b.layers[0].qkv)
    else {
        panic!("separate q/k/v")
    };
    assert_eq!(qa.weight, qb.weight);
    assert_eq!(a.spec, b.spec);
}

#[test]
fn truncated_files_name_what_was_cut() {
    let bytes = GgufWriter::tiny_llama().bytes();
    for cut in [3, 10, 40, 300, bytes.len() - 100] {
        let err = load(&write("cut.gguf", &bytes[..cut]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("truncated") || err.contains("not a model file"),
            "cut at {cut}: {err}"
        );
    }
    let err = load(&write("cut2.gguf", &bytes[..bytes.len() - 100]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("past the end of the file"), "{err}");
}

/// Llama 3.1's bands as llama.cpp's converter stores them (`rope_freqs.weight`), computed by
/// its formula (convert_hf_to_gguf.py, LlamaModel) for the tiny head: 16 dims, theta 10,000,
/// factor 8, bands 1 and 4, original length 32.
fn llama31_rope_freqs() -> Vec<f32> {
    let (factor, low, high, old) = (8.0f64, 1.0f64, 4.0f64, 32.0f64);
    (0..8)
        .map(|i| {
            let freq = 1.0 / 10_000f64.powf((2 * i) as f64 / 16.0);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let f = if wavelen < old / high {
                1.0
            } else if wavelen > old / low {
                factor
            } else {
                let smooth = (old / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            };
            f as f32
        })
        .collect()
}

#[test]
fn rope_freqs_and_a_linear_factor_scale_the_rope() {
    let freqs = llama31_rope_freqs();
    assert_eq!((freqs[0], freqs[7]), (1.0, 8.0), "the three bands");
    let mut w = GgufWriter::tiny_llama();
    w.tensors
        .push(("rope_freqs.weight".into(), vec![8], freqs.clone()));
    let m = load(&write("freqs.gguf", &w.bytes())).unwrap();
    assert_eq!(m.rope_scaling, RopeScaling::Divisors(freqs.clone().into()));
    // The tables equal those of the Hugging Face parameters the factors came from, to the f32
    // rounding of the stored factors.
    let from_file = RopeTable::for_model(&m, 16).unwrap();
    let llama3 = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position: 32.0,
    };
    let from_params = RopeTable::new(16, 16, 10_000.0, &llama3).unwrap();
    let most = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
    };
    assert!(most(&from_file.cos, &from_params.cos) < 1e-6);
    assert!(most(&from_file.sin, &from_params.sin) < 1e-6);

    // A linear factor (llama.cpp: under the type linear, none or no type; rope.scale_linear
    // its older key), and with rope_freqs both.
    let mut w = GgufWriter::tiny_llama();
    w.set_meta("llama.rope.scaling.type", Meta::Str("linear".into()));
    w.set_meta("llama.rope.scaling.factor", Meta::F32(4.0));
    let m = load(&write("linear.gguf", &w.bytes())).unwrap();
    assert_eq!(m.rope_scaling, RopeScaling::Linear { factor: 4.0 });
    let mut w = GgufWriter::tiny_llama();
    w.set_meta("llama.rope.scale_linear", Meta::F32(2.0));
    w.tensors
        .push(("rope_freqs.weight".into(), vec![8], freqs.clone()));
    let m = load(&write("both.gguf", &w.bytes())).unwrap();
    let doubled: Vec<f32> = freqs.iter().map(|f| f * 2.0).collect();
    assert_eq!(m.rope_scaling, RopeScaling::Divisors(doubled.into()));

    // YaRN as llama.cpp reads it (Qwen2.5's long-context GGUFs); the keys that change its
    // magnitude or ramp weight are refused by name.
    let mut w = GgufWriter::tiny_llama();
    w.set_meta("llama.rope.scaling.type", Meta::Str("yarn".into()));
    w.set_meta("llama.rope.scaling.factor", Meta::F32(4.0));
    w.set_meta("llama.rope.scaling.original_context_length", Meta::U32(64));
    let m = load(&write("yarn.gguf", &w.bytes())).unwrap();
    let want = RopeScaling::Yarn {
        factor: 4.0,
        original_max_position: 64.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: true,
        attention_factor: (1.0 + 0.1 * 4f64.ln()) as f32,
    };
    assert_eq!(m.rope_scaling, want);
    let mut both = w.clone();
    both.tensors
        .push(("rope_freqs.weight".into(), vec![8], freqs.clone()));
    assert!(load_err("yarn-freqs.gguf", &both).contains("YaRN over the per-pair divisors"));
    w.set_meta("llama.rope.scaling.yarn_log_multiplier", Meta::F32(0.1));
    assert!(load_err("yarn-log.gguf", &w)
        .contains("YaRN with llama.rope.scaling.yarn_log_multiplier = 0.1"));

    // Factors that make no frequency, or not one a pair.
    let mut w = GgufWriter::tiny_llama();
    let mut zero = freqs.clone();
    zero[3] = 0.0;
    w.tensors.push(("rope_freqs.weight".into(), vec![8], zero));
    assert!(load_err("zero.gguf", &w).contains("divisor 3 (0)"));
    let mut w = GgufWriter::tiny_llama();
    w.tensors
        .push(("rope_freqs.weight".into(), vec![7], freqs[..7].to_vec()));
    assert!(load_err("short.gguf", &w).contains("rope_freqs.weight has dims [7]"));
}

/// Heads set apart from embedding_length / head_count (attention.key_length, as Mistral Nemo's
/// files have): q is [heads x key_length, hidden] and o [hidden, heads x key_length].
#[test]
fn heads_wider_than_hidden_over_heads_load() {
    let mut w = GgufWriter::tiny_llama();
    w.set_meta("llama.attention.key_length", Meta::U32(32));
    w.set_meta("llama.attention.value_length", Meta::U32(32));
    w.set_meta("llama.rope.dimension_count", Meta::U32(32));
    let resize = |w: &mut GgufWriter, name: &str, dims: Vec<usize>| {
        let t = w.tensor_mut(name);
        let n = dims.iter().product();
        t.2 = (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 500.0)
            .collect();
        t.1 = dims;
    };
    resize(&mut w, "blk.0.attn_q.weight", vec![64, 128]);
    resize(&mut w, "blk.0.attn_k.weight", vec![64, 64]);
    resize(&mut w, "blk.0.attn_v.weight", vec![64, 64]);
    resize(&mut w, "blk.0.attn_output.weight", vec![128, 64]);
    let model = load(&write("wide_heads.gguf", &w.bytes())).unwrap();
    let s = model.spec;
    assert_eq!(
        (s.hidden, s.head_dim, s.q_dim(), s.kv_dim()),
        (64, 32, 128, 64)
    );
    let QkvWeights::Separate { q, .. } = &model.layers[0].qkv else {
        panic!()
    };
    assert_eq!((q.weight.rows, q.weight.cols), (128, 64));
    assert_eq!((model.layers[0].o.rows, model.layers[0].o.cols), (64, 128));
    // q's rows un-permuted within heads of 32: llama.cpp's row 2 of head 1 is row 1 of it.
    let src = &w.tensor_mut("blk.0.attn_q.weight").2;
    let mut got = vec![0f32; 64];
    q.weight.dequantize_row(32 + 1, &mut got);
    let want = &src[(32 + 2) * 64..(32 + 3) * 64];
    assert_eq!(got, Nf4Matrix::quantize(1, 64, want).unwrap().dequantize());
    // It decodes (the oracle's math at q width 128 over hidden 64).
    let opts = decodev2::engine::EngineOptions {
        backend: decodev2::engine::BackendKind::Cpu,
        ..Default::default()
    };
    let mut engine = decodev2::engine::Engine::new(model, &opts).unwrap();
    engine.prefill(&[1, 5, 9]).unwrap();
    engine.step().unwrap();
}

/// A split GGUF (llama.cpp's `gguf-split`: NAME-00001-of-00003.gguf and its siblings, the
/// metadata in the first, each part's tensors in its own data section) loads from its first
/// part as the unsplit file does; a later part or a missing one is a clear error.
#[test]
fn a_split_file_loads_from_its_first_part() {
    let whole = GgufWriter::tiny_llama();
    let parts: Vec<GgufWriter> = (0..3)
        .map(|p| {
            let mut w = GgufWriter {
                meta: if p == 0 {
                    whole.meta.clone()
                } else {
                    Vec::new()
                },
                tensors: whole.tensors.iter().skip(p).step_by(3).cloned().collect(),
            };
            w.set_meta("split.no", Meta::U32(p as u32));
            w.set_meta("split.count", Meta::U32(3));
            w.set_meta("split.tensors.count", Meta::U32(whole.tensors.len() as u32));
            w
        })
        .collect();
    let paths: Vec<_> = parts
        .iter()
        .enumerate()
        .map(|(p, w)| write(&format!("split-{:05}-of-00003.gguf", p + 1), &w.bytes()))
        .collect();
    let split = load(&paths[0]).unwrap();
    let single = load(&write("unsplit.gguf", &whole.bytes())).unwrap();
    let logits = |m: &decodev2::model::HostModel| {
        let mut kv = KvCache::new(&m.spec, 8).unwrap();
        step_logits(m, &mut kv, &[1, 7, 3], 0).unwrap()
    };
    assert_eq!(logits(&split), logits(&single));
    let err = load(&paths[1]).unwrap_err().to_string();
    assert!(
        err.contains("part 2 of 3 of a split GGUF: open the first part"),
        "{err}"
    );
    std::fs::remove_file(&paths[2]).unwrap();
    let err = load(&paths[0]).unwrap_err().to_string();
    assert!(err.contains("split-00003-of-00003.gguf"), "{err}");
}

#[test]
fn every_inconsistency_is_named() {
    let mut w = GgufWriter::tiny_llama();
    w.set_meta("general.architecture", Meta::Str("gpt2".into()));
    assert!(load_err("arch.gguf", &w).contains("architecture gpt2"));

    let mut w = GgufWriter::tiny_llama();
    w.set_meta("llama.rope.scaling.type", Meta::Str("longrope".into()));
    assert!(load_err("rope.gguf", &w).contains("rope scaling longrope"));
    let mut w = GgufWriter::tiny_llama();
    w.set_meta("llama.rope.scaling.type", Meta::Str("linear".into()));
    w.set_meta("llama.rope.scaling.factor", Meta::F32(f32::INFINITY));
    assert!(load_err("rope-inf.gguf", &w).contains("factor (inf)"));

    let mut w = GgufWriter::tiny_llama();
    w.set_meta("llama.attention.key_length", Meta::U32(32));
    w.set_meta("llama.attention.value_length", Meta::U32(16));
    assert!(load_err("value_length.gguf", &w).contains("value heads of 16 beside key heads of 32"));
    let mut w = GgufWriter::tiny_llama();
    w.set_meta("llama.attention.key_length", Meta::U32(32));
    assert!(load_err("key_length.gguf", &w).contains("blk.0.attn_q.weight has dims [64, 64]"));
    // A tensor the reader would pass over: an o-projection bias.
    let mut w = GgufWriter::tiny_llama();
    w.tensors
        .push(("blk.0.attn_output.bias".into(), vec![64], vec![0.5; 64]));
    assert!(load_err("o_bias.gguf", &w).contains("tensor blk.0.attn_output.bias (1 unread in all)"));
    let mut w = GgufWriter::tiny_llama();
    w.tensors
        .push(("blk.1.attn_norm.weight".into(), vec![64], vec![1.0; 64]));
    assert!(load_err("layer_past.gguf", &w).contains("tensor blk.1.attn_norm.weight"));

    let mut w = GgufWriter::tiny_llama();
    w.set_meta("llama.expert_count", Meta::U32(8));
    assert!(load_err("experts.gguf", &w).contains("a mixture of 8 experts"));

    let mut w = GgufWriter::tiny_llama();
    w.tensors.retain(|t| t.0 != "blk.0.ffn_up.weight");
    assert!(load_err("missing.gguf", &w).contains("blk.0.ffn_up.weight is missing"));

    let mut w = GgufWriter::tiny_llama();
    w.tensor_mut("blk.0.attn_k.weight").1 = vec![64, 16];
    w.tensor_mut("blk.0.attn_k.weight").2.truncate(64 * 16);
    assert!(load_err("shape.gguf", &w).contains("blk.0.attn_k.weight has dims [64, 16]"));

    let mut w = GgufWriter::tiny_llama();
    w.tensor_mut("blk.0.ffn_down.weight").2[77] = f32::NAN;
    let err = load_err("nan.gguf", &w);
    assert!(
        err.contains("blk.0.ffn_down.weight") && err.contains("NaN"),
        "{err}"
    );

    let mut w = GgufWriter::tiny_llama();
    w.tensor_mut("output_norm.weight").2[3] = f32::INFINITY;
    assert!(load_err("inf.gguf", &w).contains("output_norm.weight holds inf"));

    let mut w = GgufWriter::tiny_llama();
    w.set_meta("llama.feed_forward_length", Meta::U32(100));
    assert!(load_err("inter.gguf", &w).contains("intermediate (100) is not a multiple of 64"));

    let mut w = GgufWriter::tiny_llama();
    w.meta.retain(|(k, _)| k != "llama.block_count");
    assert!(load_err("nokey.gguf", &w).contains("llama.block_count is missing"));

    // An unknown tensor type id.
    let mut bytes = GgufWriter::tiny_llama().bytes();
    let name = b"token_embd.weight";
    let at = bytes.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    let type_at = at + 4 + 2 * 8; // n_dims, two dims
    bytes[type_at..type_at + 4].copy_from_slice(&99u32.to_le_bytes());
    let err = load(&write("type.gguf", &bytes)).unwrap_err().to_string();
    assert!(err.contains("token_embd.weight: ggml type 99"), "{err}");

    // Wrong magic: not a model file at all.
    let err = load(&write("magic.gguf", b"GGUX\x03\0\0\0"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a model file"), "{err}");
}
