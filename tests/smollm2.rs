//! A real pretrained model end to end: SmolLM2-135M-Instruct (llama architecture, Q4_1 GGUF
//! with tied Q8_0 embeddings), re-quantized to NF4 at load, greedy on the CPU backend.

mod common;

use common::{cuda_or_skip, smollm2_path};
use decodev2::engine::{BackendKind, Engine, EngineOptions};
use decodev2::load::gguf::Gguf;
use decodev2::tokenizer::Tokenizer;

const PROMPT: &str = "The capital of France is";

#[test]
fn smollm2_completes_a_fact_on_the_cpu() {
    let Some(path) = smollm2_path() else { return };
    let t = std::time::Instant::now();
    let opts = EngineOptions {
        backend: BackendKind::Cpu,
        max_seq: 64,
        eos: Gguf::open(&path).unwrap().eos_id(),
        ..EngineOptions::default()
    };
    let mut e = Engine::load_file(&path, &opts).unwrap();
    // The model file's own tokenizer (tests/tokenizer.rs checks it against a reference).
    let tk = e.tokenizer().unwrap();
    let prompt = tk.encode(PROMPT, true, false).unwrap();
    let decode = |tk: &Tokenizer, ids: &[u32]| String::from_utf8(tk.decode(ids, false).unwrap());
    println!(
        "loaded in {:.2} s: {:?}",
        t.elapsed().as_secs_f64(),
        e.spec()
    );
    let mut ids = vec![e.prefill(&prompt).unwrap()];
    let mut rest = [0u32; 7];
    let n = e.step_n(&mut rest).unwrap();
    ids.extend(&rest[..n]);
    let text = decode(e.tokenizer().unwrap(), &ids).unwrap();
    println!("prompt ids {prompt:?}\ngreedy ids {ids:?}\n{PROMPT}|{text}");
    assert!(
        text.contains("Paris"),
        "expected the capital of France, got {text:?}"
    );
}

#[test]
fn smollm2_cuda_ids_equal_cpu_ids_for_32_steps() {
    let Some(path) = smollm2_path() else { return };
    let gguf = Gguf::open(&path).unwrap();
    let tk = Tokenizer::from_gguf(&gguf).unwrap();
    let prompt = tk.encode(PROMPT, true, false).unwrap();
    let model = gguf.model().unwrap();
    let opts = |backend| EngineOptions {
        backend,
        max_seq: 64,
        ..EngineOptions::default()
    };
    let gpu = Engine::new(model.clone(), &opts(BackendKind::Cuda));
    let Some(mut gpu) = cuda_or_skip("CUDA engine for SmolLM2", gpu) else {
        return;
    };
    let mut cpu = Engine::new(model, &opts(BackendKind::Cpu)).unwrap();
    let run = |e: &mut Engine| {
        let mut ids = vec![e.prefill(&prompt).unwrap()];
        let mut rest = [0u32; 31];
        assert_eq!(e.step_n(&mut rest).unwrap(), 31);
        ids.extend(rest);
        ids
    };
    let (g, c) = (run(&mut gpu), run(&mut cpu));
    let text = String::from_utf8_lossy(&tk.decode(&g, false).unwrap()).into_owned();
    println!("cuda {g:?}\ncpu  {c:?}\n{PROMPT}|{text}");
    assert_eq!(g, c);
}
