//! A real pretrained model end to end: SmolLM2-135M-Instruct (llama architecture, Q4_1 GGUF
//! with tied Q8_0 embeddings), re-quantized to NF4 at load, greedy on the CPU backend.

mod common;

use common::bpe::Bpe;
use common::{cuda_or_skip, smollm2_path};
use decodev2::engine::{BackendKind, Engine, EngineOptions};
use decodev2::load::gguf::Gguf;

const PROMPT: &str = "The capital of France is";

#[test]
fn smollm2_completes_a_fact_on_the_cpu() {
    let Some(path) = smollm2_path() else { return };
    let gguf = Gguf::open(&path).unwrap();
    let bpe = Bpe::new(gguf.tokens(), &gguf.merges());
    let prompt = bpe.encode(PROMPT);
    assert_eq!(bpe.decode(&prompt), PROMPT, "the tokenizer round-trips");
    let t = std::time::Instant::now();
    let opts = EngineOptions {
        backend: BackendKind::Cpu,
        max_seq: 64,
        eos: gguf.eos_id(),
        ..EngineOptions::default()
    };
    let mut e = Engine::load_file(&path, &opts).unwrap();
    println!(
        "loaded in {:.2} s: {:?}",
        t.elapsed().as_secs_f64(),
        e.spec()
    );
    let mut ids = vec![e.prefill(&prompt).unwrap()];
    let mut rest = [0u32; 7];
    let n = e.step_n(&mut rest).unwrap();
    ids.extend(&rest[..n]);
    let text = bpe.decode(&ids);
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
    let bpe = Bpe::new(gguf.tokens(), &gguf.merges());
    let prompt = bpe.encode(PROMPT);
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
    println!("cuda {g:?}\ncpu  {c:?}\n{PROMPT}|{}", bpe.decode(&g));
    assert_eq!(g, c);
}
