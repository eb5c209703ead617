//! decodev2 bench: kernel microbenchmarks against the streaming-read floor, and decode speed
//! (graph vs eager) on the synthetic presets and the Qwen2.5-3B shape.
//!
//!     cargo run --release --example bench -- [--json PATH] [--skip-kernels] [--skip-3b]
//!
//! Prints tables and writes every number to the JSON file (default bench.json).

use std::fmt::Write as _;
use std::time::Instant;

use decodev2::arch::{ArchSpec, MEDIUM_LLAMA, QWEN25_3B};
use decodev2::cuda::bench::{Bench, Timing};
use decodev2::cuda::CudaBackend;
use decodev2::engine::{Backend, BackendKind, Engine, EngineOptions};
use decodev2::model::HostModel;
use decodev2::synth;

struct StepRun {
    label: String,
    max_seq: usize,
    prompt: usize,
    tokens: usize,
    graph: bool,
    load_s: f64,
    prefill_ms: f64,
    ms_per_token: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Loads `model` on CUDA and times prefill and decode (host clock around calls that end in
/// one device sync; medians of `reps` runs).
fn time_decode(
    label: &str,
    model: &HostModel,
    max_seq: usize,
    prompt_len: usize,
    tokens: usize,
    graph: bool,
    reps: usize,
) -> StepRun {
    let opts = EngineOptions {
        backend: BackendKind::Cuda,
        max_seq,
        graph,
        ..EngineOptions::default()
    };
    let t = Instant::now();
    let mut e = Engine::new(model.clone(), &opts).expect("cuda engine");
    let load_s = t.elapsed().as_secs_f64();
    let prompt = synth::prompt(model.spec.vocab, prompt_len, 1);
    let mut out = vec![0u32; tokens];
    let (mut prefill, mut decode) = (Vec::new(), Vec::new());
    for _ in 0..reps + 1 {
        e.reset().unwrap();
        let t = Instant::now();
        e.prefill(&prompt).unwrap();
        prefill.push(t.elapsed().as_secs_f64() * 1e3);
        // The first decode step is not timed (seed §10: decode tok/s is steps after the first).
        e.step().unwrap();
        let t = Instant::now();
        let n = e.step_n(&mut out).unwrap();
        assert_eq!(n, tokens, "EOS is off: every step runs");
        decode.push(t.elapsed().as_secs_f64() * 1e3 / tokens as f64);
    }
    // The first repetition warms caches; drop it.
    StepRun {
        label: label.into(),
        max_seq,
        prompt: prompt_len,
        tokens,
        graph,
        load_s,
        prefill_ms: median(prefill[1..].to_vec()),
        ms_per_token: median(decode[1..].to_vec()),
    }
}

fn stage_split(model: &HostModel, max_seq: usize, prompt_len: usize) -> Vec<(&'static str, f64)> {
    let mut b = CudaBackend::new(model, max_seq, None, 0, false).expect("cuda backend");
    b.prefill(&synth::prompt(model.spec.vocab, prompt_len, 1))
        .unwrap();
    let runs: Vec<Vec<(&'static str, f64)>> = (0..7).map(|_| b.profile_step().unwrap()).collect();
    runs[0]
        .iter()
        .enumerate()
        .map(|(i, (label, _))| (*label, median(runs[1..].iter().map(|r| r[i].1).collect())))
        .collect()
}

fn kernel_table(bench: &Bench, s: &ArchSpec) -> Vec<Timing> {
    let (h, kv, inter) = (s.hidden, s.kv_dim(), s.intermediate);
    let mut rows = vec![
        bench.gemv("q/k/v fused (+bias)", "qkv", &[h, kv, kv], h),
        bench.gemv("o_proj (+residual)", "residual", &[h], h),
        bench.gemv("gate+up SwiGLU", "swiglu", &[inter], h),
        bench.gemv("down (+residual)", "residual", &[h], inter),
        bench.gemv("lm_head", "plain", &[s.vocab], h),
    ];
    for len in [48, 512, 2048] {
        rows.push(bench.attention(s, 2048, len));
    }
    rows.into_iter().map(|r| r.expect("kernel bench")).collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let flag = |f: &str| args.iter().any(|a| a == f);
    let json_path = args
        .iter()
        .position(|a| a == "--json")
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| "bench.json".into());
    let mut json = String::from("{\n");

    // Kernel microbenchmarks, per variant (DV2_GEMV / DV2_ATTN), in one process.
    let mut first = true;
    json += "  \"kernels\": {\n";
    for variant in ["v2", "v1"] {
        std::env::set_var("DV2_GEMV", variant);
        std::env::set_var("DV2_ATTN", variant);
        let bench = Bench::new(0).expect("CUDA device");
        if first {
            println!("device: {}", bench.device_name());
            first = false;
        }
        if flag("--skip-kernels") {
            break;
        }
        if variant == "v2" {
            println!("\nstreaming-read floor (16-byte loads, graph of rotated copies):");
            for mb in [0.26, 1.0, 2.4, 12.4, 24.8, 168.0] {
                let bytes = (mb * 1e6) as usize;
                let us = bench.floor_us(bytes).unwrap();
                println!(
                    "  {:>7.2} MB  {:>8.2} µs  {:>6.0} GB/s",
                    mb,
                    us,
                    bytes as f64 / us / 1e3
                );
            }
        }
        println!(
            "\nkernels on the Qwen2.5-3B shapes, {} (median µs per launch over rotated copies):",
            bench.variants()
        );
        println!(
            "  {:<26} {:>9} {:>9} {:>8} {:>9} {:>7}",
            "kernel", "MB", "µs", "GB/s", "floor µs", "floor%"
        );
        writeln!(json, "    \"{variant}\": [").unwrap();
        for t in kernel_table(&bench, &QWEN25_3B) {
            println!(
                "  {:<26} {:>9.2} {:>9.2} {:>8.0} {:>9.2} {:>6.0}%",
                t.name,
                t.bytes as f64 / 1e6,
                t.median_us,
                t.gb_per_s(),
                t.floor_us,
                100.0 * t.of_floor()
            );
            writeln!(json, "      {{\"name\": \"{}\", \"bytes\": {}, \"median_us\": {:.3}, \"floor_us\": {:.3}}},", t.name, t.bytes, t.median_us, t.floor_us).unwrap();
        }
        json = json.trim_end_matches(",\n").to_string() + "\n    ],\n";
    }
    json = json.trim_end_matches(",\n").to_string() + "\n  },\n";
    if !flag("--skip-kernels") {
        println!("\nGEMV v2, CTAs per SM (DV2_GEMV_CTAS), gate+up / down / lm_head µs:");
        std::env::set_var("DV2_GEMV", "v2");
        for ctas in ["1", "2", "4"] {
            std::env::set_var("DV2_GEMV_CTAS", ctas);
            let bench = Bench::new(0).expect("CUDA device");
            let s = QWEN25_3B;
            let t = [
                bench
                    .gemv("gate+up", "swiglu", &[s.intermediate], s.hidden)
                    .unwrap(),
                bench
                    .gemv("down", "residual", &[s.hidden], s.intermediate)
                    .unwrap(),
                bench
                    .gemv("lm_head", "plain", &[s.vocab], s.hidden)
                    .unwrap(),
            ];
            println!(
                "  {ctas}: {:.2} / {:.2} / {:.2}",
                t[0].median_us, t[1].median_us, t[2].median_us
            );
        }
        std::env::remove_var("DV2_GEMV_CTAS");
    }
    std::env::remove_var("DV2_GEMV");
    std::env::remove_var("DV2_ATTN");

    let mut runs = Vec::new();
    let medium = synth::build(&MEDIUM_LLAMA, 0).unwrap();
    for graph in [true, false] {
        runs.push(time_decode("medium_llama", &medium, 32, 4, 24, graph, 5));
    }
    let mut split = Vec::new();
    if !flag("--skip-3b") {
        let t = Instant::now();
        let qwen = synth::build(&QWEN25_3B, 0).unwrap();
        println!(
            "\nsynthetic Qwen2.5-3B shape built in {:.1} s",
            t.elapsed().as_secs_f64()
        );
        for graph in [true, false] {
            runs.push(time_decode("qwen25_3b", &qwen, 2048, 48, 128, graph, 3));
        }
        // RMSNorm folded into the GEMV prologue instead of its own kernel.
        std::env::set_var("DV2_FUSE_RMS", "1");
        runs.push(time_decode(
            "qwen25_3b rms-fused",
            &qwen,
            2048,
            48,
            128,
            true,
            3,
        ));
        std::env::remove_var("DV2_FUSE_RMS");
        // The v1 kernels, same process, for the ratio.
        std::env::set_var("DV2_GEMV", "v1");
        std::env::set_var("DV2_ATTN", "v1");
        runs.push(time_decode("qwen25_3b v1", &qwen, 2048, 48, 128, true, 3));
        std::env::remove_var("DV2_GEMV");
        std::env::remove_var("DV2_ATTN");
        split = stage_split(&qwen, 2048, 48);
    }
    println!("\ndecode (ignore EOS; median of runs; first decode step excluded):");
    println!(
        "  {:<22} {:>8} {:>7} {:>7} {:>6} {:>8} {:>11} {:>10} {:>9}",
        "model",
        "max_seq",
        "prompt",
        "tokens",
        "graph",
        "load s",
        "prefill ms",
        "ms/token",
        "tok/s"
    );
    json += "  \"decode\": [\n";
    for r in &runs {
        println!(
            "  {:<22} {:>8} {:>7} {:>7} {:>6} {:>8.2} {:>11.2} {:>10.4} {:>9.1}",
            r.label,
            r.max_seq,
            r.prompt,
            r.tokens,
            r.graph,
            r.load_s,
            r.prefill_ms,
            r.ms_per_token,
            1e3 / r.ms_per_token
        );
        writeln!(json, "    {{\"model\": \"{}\", \"max_seq\": {}, \"prompt\": {}, \"tokens\": {}, \"graph\": {}, \"load_s\": {:.3}, \"prefill_ms\": {:.3}, \"ms_per_token\": {:.5}}},", r.label, r.max_seq, r.prompt, r.tokens, r.graph, r.load_s, r.prefill_ms, r.ms_per_token).unwrap();
    }
    json = json.trim_end_matches(",\n").to_string() + "\n  ],\n";
    if !split.is_empty() {
        let total: f64 = split.iter().map(|(_, ms)| ms).sum();
        println!("\nQwen2.5-3B step, eager, events between kernel groups (valid_len 49), summed over layers:");
        json += "  \"stages_ms\": {";
        for (label, ms) in &split {
            println!(
                "  {:<32} {:>8.4} ms {:>5.1}%",
                label,
                ms,
                100.0 * ms / total
            );
            write!(json, "\"{label}\": {ms:.5}, ").unwrap();
        }
        println!("  {:<32} {:>8.4} ms", "total", total);
        json = json.trim_end_matches(", ").to_string() + "},\n";
    }
    json = json.trim_end_matches(",\n").to_string() + "\n}\n";
    std::fs::write(&json_path, json).unwrap();
    println!("\nwrote {json_path}");
}
