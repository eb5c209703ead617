//! decodev2 bench: kernel microbenchmarks against the streaming-read floor, and decode speed
//! (graph vs eager) on the synthetic presets and the Qwen2.5-3B shape.
//!
//!     cargo run --release --example bench -- [--json PATH] [--skip-kernels] [--skip-3b] [--probe]
//!                                               [--prefill-only] [--skip-gemm] [--skip-variants]
//!                                               [--split] [--boundary] [--l2-hot] [--rows A,B,..]
//!                                               [--prefill-profile LEN CHUNK] [--decode-profile STEPS [DEPTH [PRESET]]]
//!                                               [--cta-timeline PATH [DEPTH [PRESET]]] [--context [PRESET [DEPTHS]] [--against VAR=VALUE]
//!                                               [--against-loaded-first]]
//!                                               [--shapes PRESET] [--load PATH [REPS]]
//!                                               [--sampling [PRESET [DEPTHS]]] [--step-loop [PRESET [DEPTHS]]]
//!                                               [--rest [PRESET [DEPTHS]]] [--turns [PRESET [DEPTHS]]]
//!                                               [--short-chunks [PRESET [DEPTHS]]] [--speculate [PRESET [DEPTHS]]]
//!                                               [--checks [PRESET [DEPTHS]] [--against VAR=VALUE]]
//!
//! load s is `Engine::new` (upload, allocation, kernels, warm-up); warmup ms is its eager
//! probe step + graph capture; prefill ms is the prompt to the first token; ms/token the steps
//! after the first. The default run measures the default configuration; `--skip-variants` keeps
//! the 3B run to the default graph (no eager step, `DV2_LINEAR=mma` row, stage split or prefill
//! tables); `--split` adds the stage split back.
//! `--boundary` prints only what a kernel boundary costs in a graph (chain of empty launches),
//! grid-wide barriers inside one launch, alone and with a hand-over of data (or flagged pairs
//! without one), and a skeleton of a persistent step (issue 36).
//! `--l2-hot` prints only the decode GEMVs with their weights from HBM and from L2.
//! `--context [PRESET [D1,D2,..]]` prints only the context sweep: prefill and decode against
//! depth (48 to 32k unless listed) at max_seq 32768 (`--max-seq N` for another), beside the
//! bandwidth floor at each depth, on the Qwen2.5-3B shape or the named preset (e.g. `--context qwen25_32b 48,8192`), and
//! decode and prefill again under `--against`'s setting (default `DV2_ATTN_LONG=0`) in the same process,
//! the two engines' requests (and their decodes, 16 steps at a time) alternating at each depth,
//! with the paired chunks' median ratio, that of two pairs' sums in both turn orders and the
//! pairs in the order they ran, after the ids and logits of both at 20, 300, 2,100 and
//! 5,000 prompt tokens (`--against-loaded-first`: that engine loaded before the default's).
//! `--sampling [PRESET [D1,D2,..]]` prints only sampled decode against greedy decode by depth
//! (48 and 8k unless listed), in one engine, on the Qwen2.5-3B shape or the named preset.
//! `--step-loop [PRESET [D1,D2,..]]` prints only decode a step a call (`Engine::step`, what a
//! host streaming tokens through `dv2_step` runs) against `step_n` in the same engine, by depth
//! (48 and 8k unless listed): the host's cost a token between the steps.
//! `--rest [PRESET [D1,D2,..]]` prints only decode as one `step_n` request after 1 s idle and
//! after another request, and in 16-step chunks back to back and each after 100 ms idle, by depth
//! (48 and 8k unless listed): whether the board's power cap slows the step.
//! `--turns [PRESET [D1,D2,..]]` prints only the time to the first id of a chat turn of 32
//! new ids after a conversation of each depth (48 and 8k unless listed), prefilled whole
//! against from the depth after a rewind (what a host that keeps the earlier turns pays).
//! `--short-chunks [PRESET [D1,D2,..]]` prints only the time to the next id of a chunk of 1 to
//! 16 ids after a rewind to each depth (48 and 8k unless listed), on GEMV v3's column kernels
//! against the GEMM (`DV2_PREFILL_GEMV=0`), beside a decode step.
//! `--speculate [PRESET [D1,D2,..]]` prints only speculative greedy decoding against plain
//! steps by depth (48 and 8k unless listed): tok/s at drafts of 4, 7 and 15, the drafts
//! accepted, and what a check of k ids costs where none is taken.
//! `--checks [PRESET [D1,D2,..]]` prints only what a speculative check of k = 1, 7 and 15
//! draft ids costs where none is taken, 24 checks in a row after a prompt of each depth (48 and
//! 8k unless listed), against 24 steps, and with `--against` the same in a second engine under
//! that setting: the run tests/gpu/trace-checks.sh traces kernel by kernel.
//! `--shapes PRESET` takes the kernel table's matrices from that preset (default qwen25_3b).
//! `--load PATH [REPS]` prints only load times of a model file or directory (read and device
//! parts), REPS times (3): the first cold or warm as the page cache is, the rest warm.
//! `--rows A,B` adds the decode table's rows of the switches (src/config.rs) whose names contain
//! A or B, each set to 0, against the defaults in the same process (none without `--rows`).
//!
//! `--cta-timeline PATH [DEPTH [PRESET]]` (with `DV2_CTA_TIMELINE=1`) writes one graph step's
//! CTA records of PRESET (qwen25_3b) after a prompt of DEPTH tokens (48) as CSV
//! (tests/gpu/cta-timeline.sh reads them).
//!
//! Prints tables and writes every number to the JSON file (default bench.json).

use std::fmt::Write as _;
use std::time::Instant;

use decodev2::arch::{ArchSpec, MEDIUM_LLAMA, QWEN25_3B};
use decodev2::config::VARIABLES;
use decodev2::cuda::bench::{Bench, GlRing, Handover, Timing, CHAIN_LINK_MAX_SMEM};
use decodev2::cuda::ops::{Gemv, GemvChoice};
use decodev2::cuda::CudaBackend;
use decodev2::engine::{Backend, BackendKind, Engine, EngineOptions};
use decodev2::model::HostModel;
use decodev2::sampling::Sampling;
use decodev2::synth;

struct StepRun {
    label: String,
    max_seq: usize,
    prompt: usize,
    tokens: usize,
    graph: bool,
    load_s: f64,
    warmup_ms: f64,
    prefill_ms: f64,
    ms_per_token: f64,
}

/// Runs `f` with the environment variables `vars` set, then removes them: the variants are
/// read when an engine loads, so one process measures them all.
fn with_env<K: AsRef<str>, V: AsRef<str>, T>(vars: &[(K, V)], f: impl FnOnce() -> T) -> T {
    vars.iter()
        .for_each(|(k, v)| std::env::set_var(k.as_ref(), v.as_ref()));
    let out = f();
    vars.iter()
        .for_each(|(k, _)| std::env::remove_var(k.as_ref()));
    out
}

/// The decode table's switch rows for `model`: each switch of the configuration table
/// (src/config.rs) that `--rows` names (a comma-separated list of parts of names), set to
/// `0`; none without `--rows`. Not `DV2_GRAPH`: these rows set the graph explicitly, and the
/// eager rows already measure it.
fn switch_rows(model: &str, rows: Option<&String>) -> Vec<(String, Vec<(String, String)>)> {
    let Some(rows) = rows else {
        return Vec::new();
    };
    VARIABLES
        .iter()
        .filter(|v| v.effect.starts_with("`0`") && v.name != "DV2_GRAPH")
        .filter(|v| rows.split(',').any(|p| v.name.contains(p)))
        .map(|v| {
            (
                format!("{model} {}=0", v.name),
                vec![(v.name.to_string(), "0".to_string())],
            )
        })
        .collect()
}

/// The middle value, or the mean of the middle two where `v` has an even count (the context
/// sweep's two timed requests a side: before session 41 it took the larger).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n.is_multiple_of(2) {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    } else {
        v[n / 2]
    }
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
    let warmup_ms = e.warmup_ms().unwrap_or(0.0);
    let prompt = synth::prompt(model.spec.vocab, prompt_len, 1);
    let (prefill_ms, ms_per_token) = time_request(&mut e, &prompt, tokens, reps);
    StepRun {
        label: label.into(),
        max_seq,
        prompt: prompt_len,
        tokens,
        graph,
        load_s,
        warmup_ms,
        prefill_ms,
        ms_per_token,
    }
}

/// Medians over `reps` requests (after one more that warms caches) of the prefill of
/// `prompt` (ms, to the first token) and of the decode of `tokens` ids after it (ms per
/// token; the first decode step is not timed: seed §10, decode tok/s is steps after the first).
fn time_request(e: &mut Engine, prompt: &[u32], tokens: usize, reps: usize) -> (f64, f64) {
    let runs: Vec<_> = (0..reps + 1)
        .map(|_| one_request(e, prompt, tokens))
        .collect();
    medians_after_warmup(&runs)
}

/// Decode steps in each timed chunk of [`time_request_pair`].
const PAIR_CHUNK: usize = 16;

/// Two engines timed as [`time_request`] times one, beside each other: their requests
/// alternate (a b, b a, a b, ...) and, within a request, so do their decodes, `PAIR_CHUNK`
/// steps at a time (a b, b a, ... again), so that both see the same minutes of the run and
/// each chunk of b has a chunk of a beside it. Why chunks: with whole requests alternating,
/// the same decode against itself still read 0.4-0.9% apart at depth 48 (docs/lab.md, sessions
/// 40-41), from two requests a side; the chunks give `tokens / PAIR_CHUNK` pairs a request and
/// the ratio's own spread. Returns each engine's (prefill ms, decode ms per token) medians and
/// the pairs' ratios ([`Paired`]).
fn time_request_pair(
    a: &mut Engine,
    b: &mut Engine,
    prompt: &[u32],
    tokens: usize,
    reps: usize,
) -> ([(f64, f64); 2], Paired) {
    assert!(
        tokens.is_multiple_of(2 * PAIR_CHUNK),
        "whole chunks, two turn orders a request"
    );
    let mut runs: [Vec<(f64, f64)>; 2] = [Vec::new(), Vec::new()];
    // Each counted chunk's times [a, b] in the order they ran.
    let mut chunks: Vec<[f64; 2]> = Vec::new();
    let mut out = vec![0u32; PAIR_CHUNK];
    for rep in 0..reps + 1 {
        let order = if rep % 2 == 0 { [0, 1] } else { [1, 0] };
        let mut prefill_ms = [0.0; 2];
        for i in order {
            prefill_ms[i] = start_request(if i == 0 { &mut *a } else { &mut *b }, prompt);
        }
        let mut decode_ms = [0.0; 2];
        for chunk in 0..tokens / PAIR_CHUNK {
            let mut chunk_ms = [0.0; 2];
            let turn = if chunk % 2 == 0 {
                order
            } else {
                [order[1], order[0]]
            };
            for i in turn {
                chunk_ms[i] = timed_steps(if i == 0 { &mut *a } else { &mut *b }, &mut out);
            }
            decode_ms[0] += chunk_ms[0];
            decode_ms[1] += chunk_ms[1];
            // The first request warms caches: its pairs are not counted either.
            if rep > 0 {
                chunks.push(chunk_ms);
            }
        }
        for i in 0..2 {
            runs[i].push((prefill_ms[i], decode_ms[i] / tokens as f64));
        }
    }
    let in_order: Vec<f64> = chunks.iter().map(|c| c[1] / c[0]).collect();
    let mut ratios = in_order.clone();
    ratios.sort_by(f64::total_cmp);
    // The value at fraction q (0 to 1) of the sorted ratios, by its nearest rank.
    let quantile = |q: f64| ratios[((ratios.len() - 1) as f64 * q).round() as usize];
    // Two consecutive pairs (a request holds an even number) ran in both turn orders (a b, b a):
    // each engine once first in its pair, right after its own chunk, and once second, right
    // after the other engine's.
    let mut both_turns: Vec<f64> = chunks
        .chunks_exact(2)
        .map(|p| (p[0][1] + p[1][1]) / (p[0][0] + p[1][0]))
        .collect();
    both_turns.sort_by(f64::total_cmp);
    let paired = Paired {
        q1: quantile(0.25),
        median: quantile(0.5),
        q3: quantile(0.75),
        pairs: ratios.len(),
        both_turns,
        in_order,
    };
    (runs.map(|r| medians_after_warmup(&r)), paired)
}

/// [`time_request_pair`]'s paired chunks: their ratios' quartiles and median (b's time over
/// a's) and how many pairs; the ratios of two consecutive pairs' sums, sorted (each engine
/// once after its own chunk and once after the other's: if the engine that ran last is faster
/// at its next chunk, the single pairs' ratios split in two groups and their median falls
/// anywhere between, which these do not); and the pairs' ratios in the order they ran.
struct Paired {
    q1: f64,
    median: f64,
    q3: f64,
    pairs: usize,
    both_turns: Vec<f64>,
    in_order: Vec<f64>,
}

/// The medians of (prefill, decode) over `runs` past the first, which warmed caches.
fn medians_after_warmup(runs: &[(f64, f64)]) -> (f64, f64) {
    let measured = &runs[1..];
    (
        median(measured.iter().map(|t| t.0).collect()),
        median(measured.iter().map(|t| t.1).collect()),
    )
}

/// One request from a reset: its prefill (ms) and its decode of `tokens` ids after the first
/// (ms per token).
fn one_request(e: &mut Engine, prompt: &[u32], tokens: usize) -> (f64, f64) {
    let prefill_ms = start_request(e, prompt);
    (
        prefill_ms,
        timed_steps(e, &mut vec![0u32; tokens]) / tokens as f64,
    )
}

/// One `step_n` of `out.len()` decode steps, timed (ms); every step runs (EOS is off).
fn timed_steps(e: &mut Engine, out: &mut [u32]) -> f64 {
    let t = Instant::now();
    let n = e.step_n(out).unwrap();
    let ms = t.elapsed().as_secs_f64() * 1e3;
    assert_eq!(n, out.len(), "EOS is off: every step runs");
    ms
}

/// A request's start from a reset: the prefill of `prompt` (timed, ms) and the first decode
/// step (not timed: seed §10, decode tok/s is steps after the first).
fn start_request(e: &mut Engine, prompt: &[u32]) -> f64 {
    e.reset().unwrap();
    let t = Instant::now();
    e.prefill(prompt).unwrap();
    let prefill_ms = t.elapsed().as_secs_f64() * 1e3;
    e.step().unwrap();
    prefill_ms
}

/// One graph step of a preset's shape (a prompt of `depth` tokens, then 7 steps) recorded
/// CTA by CTA (`DV2_CTA_TIMELINE=1`): grid id, kind (0 wait, 1 end, 2 start, 3 and up a
/// kernel's phases), SM, CTAs, CTA, t0 and t1 in ns.
fn cta_timeline(path: &str, depth: usize, preset: &str) {
    let spec = decodev2::arch::preset(preset).expect("preset");
    let model = synth::build(&spec, 0).unwrap();
    let max_seq = 2048.max(depth + 64);
    let mut b = CudaBackend::new(&model, max_seq, None, 0, true, 0).expect("cuda backend");
    b.prefill(&synth::prompt(spec.vocab, depth, 1)).unwrap();
    let records = b.cta_timeline(8).expect("CTA timeline");
    let mut csv = String::from("grid_id,kind,sm,ctas,cta,t0,t1\n");
    for [grid, packed, t0, t1] in &records {
        let _ = writeln!(
            csv,
            "{grid},{},{},{},{},{t0},{t1}",
            packed >> 56,
            (packed >> 48) & 0xff,
            (packed >> 24) & 0xff_ffff,
            packed & 0xff_ffff
        );
    }
    std::fs::write(path, csv).unwrap();
    println!("{} CTA records written to {path}", records.len());
}

fn stage_split(model: &HostModel, max_seq: usize, prompt_len: usize) -> Vec<(&'static str, f64)> {
    let mut b = CudaBackend::new(model, max_seq, None, 0, false, 0).expect("cuda backend");
    b.prefill(&synth::prompt(model.spec.vocab, prompt_len, 1))
        .unwrap();
    let runs: Vec<Vec<(&'static str, f64)>> = (0..7).map(|_| b.profile_step().unwrap()).collect();
    runs[0]
        .iter()
        .enumerate()
        .map(|(i, (label, _))| (*label, median(runs[1..].iter().map(|r| r[i].1).collect())))
        .collect()
}

/// Median wall time of `prefill(prompt)` (ends in a device sync and the next_token read:
/// the time to first token) over `reps` runs after one warm-up, for a prefill chunk
/// (0: tokens one at a time through the decode step, `DV2_PREFILL=n1`).
/// An eager CUDA engine that prefills in chunks of `chunk` (0: token by token, through the
/// decode step).
fn prefill_engine(model: &HostModel, max_seq: usize, chunk: usize) -> Engine {
    if chunk == 0 {
        std::env::set_var("DV2_PREFILL", "n1");
    }
    let opts = EngineOptions {
        backend: BackendKind::Cuda,
        max_seq,
        graph: false,
        prefill_chunk: chunk,
        ..EngineOptions::default()
    };
    let e = Engine::new(model.clone(), &opts).expect("cuda engine");
    std::env::remove_var("DV2_PREFILL");
    e
}

/// Wall-clock ms of one prefill of `prompt` from a reset engine.
fn timed_prefill(e: &mut Engine, prompt: &[u32]) -> f64 {
    e.reset().unwrap();
    let t = Instant::now();
    e.prefill(prompt).unwrap();
    t.elapsed().as_secs_f64() * 1e3
}

fn time_prefill(
    model: &HostModel,
    max_seq: usize,
    prompt_len: usize,
    chunk: usize,
    reps: usize,
) -> f64 {
    let mut e = prefill_engine(model, max_seq, chunk);
    let prompt = synth::prompt(model.spec.vocab, prompt_len, 1);
    let ms: Vec<f64> = (0..reps + 1)
        .map(|_| timed_prefill(&mut e, &prompt))
        .collect();
    median(ms[1..].to_vec())
}

/// One GEMM table: every shape at N = 1, 16, 64, 128, 256 columns under the current environment.
fn gemm_table(variant: &str, shapes: &[(&str, usize, usize)], json: &mut String) {
    let bench = Bench::new(0).expect("CUDA device");
    for (name, rows, k) in shapes.iter().copied() {
        for n in [1, 16, 64, 128, 256] {
            let (t, tflops) = bench.gemm(name, rows, k, n).expect("gemm bench");
            println!(
                "  {:<6} {:<10} {:>6} {:>10.2} {:>9.1} {:>7.0}%",
                variant,
                name,
                n,
                t.median_us,
                tflops,
                100.0 * t.of_floor()
            );
            writeln!(json, "    {{\"gemm\": \"{variant}\", \"matrix\": \"{name}\", \"rows\": {rows}, \"k\": {k}, \"n\": {n}, \"median_us\": {:.3}, \"tflops\": {tflops:.2}, \"floor_us\": {:.3}}},", t.median_us, t.floor_us).unwrap();
        }
    }
}

/// Prefill on the Qwen2.5-3B shape: the GEMM's TFLOP/s by width for each kernel variant,
/// time to first token for a 48-token prompt and throughput for a 2,048-token prompt by chunk
/// size, and the kernel ablations (each switch against the default, same process).
fn prefill_tables(qwen: &HostModel, json: &mut String, skip_gemm: bool) {
    let s = &qwen.spec;
    println!("\nNF4 tensor-core GEMM (plain store, rotated weights), TFLOP/s by columns N:");
    println!(
        "  {:<6} {:<10} {:>6} {:>10} {:>9} {:>8}",
        "gemm", "matrix", "N", "µs", "TFLOP/s", "floor%"
    );
    *json += "  \"gemm\": [\n";
    let shapes = [
        ("q/k/v", s.qkv_rows(), s.hidden),
        ("o", s.hidden, s.hidden),
        ("gate|up", 2 * s.intermediate, s.hidden),
        ("down", s.hidden, s.intermediate),
    ];
    if !skip_gemm {
        gemm_table("v1h", &shapes, json);
    }
    *json = json.trim_end_matches(",\n").to_string() + "\n  ],\n";
    println!("\nprefill, Qwen2.5-3B shape, max_seq 2048 (median ms, wall clock to next_token):");
    println!(
        "  {:<24} {:>6} {:>14} {:>16} {:>10}",
        "variant", "chunk", "48 tokens ms", "2048 tokens ms", "tok/s"
    );
    *json += "  \"prefill\": [\n";
    // (label, environment, chunk)
    type Run = (&'static str, &'static [(&'static str, &'static str)], usize);
    let runs: [Run; 8] = [
        ("n1 (decode step)", &[], 0),
        ("default", &[], 32),
        ("default", &[], 64),
        ("default", &[], 128),
        ("default", &[], 256),
        ("default", &[], 512),
        ("default", &[], 1024),
        ("DV2_PREFILL_TAIL=0", &[("DV2_PREFILL_TAIL", "0")], 1024),
    ];
    for (label, env, chunk) in runs {
        let (ttft, long) = with_env(env, || {
            let ttft = time_prefill(qwen, 2048, 48, chunk, 5);
            // The token-at-a-time path takes seconds at 2,048 tokens: 48 tokens show its rate.
            let long = if chunk == 0 {
                f64::NAN
            } else {
                time_prefill(qwen, 2048, 2048, chunk, 3)
            };
            (ttft, long)
        });
        println!(
            "  {:<24} {:>6} {:>14.2} {:>16.1} {:>10.0}",
            label,
            chunk,
            ttft,
            long,
            2048.0 / long * 1e3
        );
        let long_json = if long.is_nan() {
            "null".to_string()
        } else {
            format!("{long:.3}")
        };
        writeln!(json, "    {{\"variant\": \"{label}\", \"chunk\": {chunk}, \"ttft_48_ms\": {ttft:.3}, \"prefill_2048_ms\": {long_json}}},").unwrap();
    }
    *json = json.trim_end_matches(",\n").to_string() + "\n  ],\n";
}

/// The decode kernels at the shapes of `s`; a kernel that does not take a shape (GEMV v2 past
/// its K) is left out with its reason printed.
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
    rows.into_iter()
        .filter_map(|r| r.map_err(|e| println!("  (left out: {e})")).ok())
        .collect()
}

/// `--l2-hot`: each decode GEMV with its weights from HBM (rotated copies) and from L2 (one
/// copy, launched again and again): what prefetching a kernel's weights into L2 while earlier
/// kernels run could win at most.
fn l2_hot() {
    let s = QWEN25_3B;
    let bench = Bench::new(0).expect("CUDA device");
    let (h, kv, inter) = (s.hidden, s.kv_dim(), s.intermediate);
    println!("decode GEMVs on the Qwen2.5-3B shape, weights from HBM / from L2 (µs per launch):");
    for (name, kind, rows, k) in [
        ("q/k/v", "qkv", &[h, kv, kv][..], h),
        ("o", "residual", &[h][..], h),
        ("gate+up", "swiglu", &[inter][..], h),
        ("down", "residual", &[h][..], inter),
    ] {
        let [cold, hot] = [false, true].map(|l2| bench.gemv_in(name, kind, rows, k, l2).unwrap());
        println!(
            "l2 {name:<8} {:>6.2} MB  HBM {:>6.2} µs  L2 {:>6.2} µs  ({:.2} / {:.2} TB/s)",
            cold.bytes as f64 / 1e6,
            cold.median_us,
            hot.median_us,
            cold.bytes as f64 / cold.median_us * 1e-6,
            hot.bytes as f64 / hot.median_us * 1e-6
        );
    }
    // Time against rows at a fixed K, weights from L2: the intercept is what a launch costs
    // besides its rows (prologue, x, tail) with no HBM in the way, the slope the loop's rate.
    for (name, kind, k, rows) in [
        ("o", "residual", h, [h / 4, h / 2, h, 2 * h]),
        (
            "gate+up",
            "swiglu",
            h,
            [inter / 4, inter / 2, inter, 2 * inter],
        ),
        ("down", "residual", inter, [h / 4, h / 2, h, 2 * h]),
    ] {
        let us = rows.map(|r| bench.gemv_in(name, kind, &[r], k, true).unwrap().median_us);
        println!("l2 scaling {name} K {k} rows {rows:?}: {us:.2?} µs");
    }
    for valid_len in [49, 176, 1024] {
        let t = bench.attention(&s, 2048, valid_len).unwrap();
        println!(
            "attention + merge, max_seq 2048, valid_len {valid_len}: {:.2} µs",
            t.median_us
        );
    }
}

/// `--boundary`: µs per launch of a graph of 216 dependent launches that do nothing else (the
/// decode step's 6 per layer times 36 layers), one CTA per SM, with programmatic dependent
/// launch and without, and with the next launch's CTA able to be resident beside the running
/// one or not (a CTA of ~200 KB of shared memory, as a GEMV v2 CTA's registers fill its SM);
/// then, for comparison, a grid-wide barrier's cost inside one launch of a CTA per SM (two
/// ways), alone and as a persistent kernel's hand-over with data (after each barrier, or as
/// flagged pairs without one); then the skeleton of a persistent step on the 3B shape, by its
/// hand-over and its ring of pages (docs/lab.md, session 48).
fn boundary() {
    const LINKS: usize = 216;
    println!("kernel boundary in a graph, {LINKS} dependent empty launches, µs per launch:");
    for pdl in ["1", "0"] {
        std::env::set_var("DV2_PDL", pdl);
        let bench = Bench::new(0).expect("CUDA device");
        for (what, smem) in [("co-resident", 0), ("SM-filling", CHAIN_LINK_MAX_SMEM)] {
            let us = bench.boundary_us(LINKS, smem).expect("boundary bench");
            println!("  pdl={pdl} {what:<12} {us:8.3}");
        }
    }
    std::env::remove_var("DV2_PDL");
    // What a persistent kernel would pay instead: a barrier of every SM inside one launch, by
    // a generation (four trips through L2) or by one growing count (two); then a hand-over
    // with data: the 3B shape's hidden vector read, a 2,048-wide matrix's rows from shared
    // memory, the sums written, a barrier; or the sums written as flagged pairs that their
    // readers poll (no barrier).
    let bench = Bench::new(0).expect("CUDA device");
    println!("inside one launch of a CTA an SM, {LINKS} rounds, µs a round:");
    for (what, by_count) in [("by generation", false), ("by count", true)] {
        let barrier = bench
            .grid_barrier_us(LINKS, by_count)
            .expect("grid barrier bench");
        let handover = if by_count {
            Handover::ByCount
        } else {
            Handover::ByGeneration
        };
        let phase = bench
            .grid_phase_us(LINKS, 2048, handover)
            .expect("grid phase bench");
        println!(
            "  grid-wide barrier {what:<14} {barrier:8.3}   with x of 2,048 and W x: {phase:8.3}"
        );
    }
    let flagged = bench
        .grid_phase_us(LINKS, 2048, Handover::Flagged)
        .expect("grid phase bench");
    println!(
        "  no barrier, x as flagged pairs              with x of 2,048 and W x: {flagged:8.3}"
    );
    // The same at a quarter of the vector (x of 2 KB, 4 rows of 512 a CTA).
    for (what, handover) in [
        ("by count", Handover::ByCount),
        ("flagged", Handover::Flagged),
    ] {
        let us = bench
            .grid_phase_us(LINKS, 512, handover)
            .expect("grid phase bench");
        println!("  {what:<8}                                    with x of 512 and W x: {us:8.3}");
    }
    // A skeleton of a persistent step (issue 36): the 3B shape's layers in one launch, their
    // weights streamed through shared memory by a producer warp, the walks' table lookups and
    // FMAs, hand-overs between the operators; against the per-kernel step's ~26 µs a layer
    // (docs/lab.md).
    let s = QWEN25_3B;
    let ring = |pages, kb: usize| GlRing {
        pages,
        page: kb << 10,
    };
    let runs = [
        (ring(4, 32), "barriers", Handover::ByCount, true),
        (ring(4, 32), "flagged pairs", Handover::Flagged, true),
        (ring(4, 32), "no hand-over", Handover::None, true),
        (
            ring(4, 32),
            "no hand-over, pages unread",
            Handover::None,
            false,
        ),
        // The ring alone by its shape: a fixed cost a page, not the bytes in flight.
        (
            ring(8, 16),
            "no hand-over, pages unread",
            Handover::None,
            false,
        ),
        (
            ring(16, 8),
            "no hand-over, pages unread",
            Handover::None,
            false,
        ),
    ];
    for (ring, what, handover, walk) in runs {
        let us = bench
            .grid_layers_us(&s, s.n_layers, handover, walk, ring)
            .expect("grid layers bench");
        println!(
            "persistent skeleton, {} layers of the 3B shape, {:>2} x {:>2} KB pages, {what:<26} {us:8.3} µs a layer",
            s.n_layers,
            ring.pages,
            ring.page >> 10
        );
    }
}

/// `--probe`: a few launches of the kernels under study, for a profiler (ncu -k ...): the
/// four GEMMs of a layer at 48 columns under each GEMM switch, the gate+up GEMV, each timed
/// as in the tables.
fn probe() {
    let s = QWEN25_3B;
    let bench = Bench::new(0).expect("CUDA device");
    for (name, rows, k) in [
        ("q/k/v", s.qkv_rows(), s.hidden),
        ("o", s.hidden, s.hidden),
        ("gate|up", 2 * s.intermediate, s.hidden),
        ("down", s.hidden, s.intermediate),
    ] {
        let (t, tflops) = bench.gemm(name, rows, k, 48).expect("gemm bench");
        println!(
            "gemm {name} N=48: {:.2} µs, {tflops:.1} TFLOP/s",
            t.median_us
        );
    }
    // The decode step's five GEMVs, each the kernel the default picks.
    let (h, kv, inter) = (s.hidden, s.kv_dim(), s.intermediate);
    for (name, kind, rows, k) in [
        ("q/k/v", "qkv", &[h, kv, kv][..], h),
        ("o", "residual", &[h][..], h),
        ("gate+up", "swiglu", &[inter][..], h),
        ("down", "residual", &[h][..], inter),
        ("lm_head", "plain", &[s.vocab][..], h),
    ] {
        let t = bench.gemv(name, kind, rows, k).expect("gemv bench");
        println!(
            "gemv {name}: {:.2} µs, {:.2} TB/s",
            t.median_us,
            t.bytes as f64 / t.median_us * 1e-6
        );
    }
    // Time against rows at a fixed K: the intercept is what a launch costs besides its rows
    // (prologue, pipeline fill, tail), the slope the steady state.
    for (name, kind, k, rows) in [
        (
            "gate+up",
            "swiglu",
            h,
            [inter / 4, inter / 2, inter, 2 * inter],
        ),
        ("down", "residual", inter, [h / 4, h / 2, h, 2 * h]),
    ] {
        for r in rows {
            let t = bench.gemv(name, kind, &[r], k).expect("gemv bench");
            println!("gemv scaling {name} rows {r} K {k}: {:.2} µs", t.median_us);
        }
    }
}

/// `--prefill-profile LEN CHUNK`: one prefill of a LEN-token prompt in chunks of CHUNK on the
/// Qwen2.5-3B shape (max_seq 2048, or the prompt's length) after the engine's warm-up, nothing
/// else, so that a profiler's per-kernel durations (ncu) add up to one prefill.
fn prefill_profile(len: usize, chunk: usize) {
    let qwen = synth::build(&QWEN25_3B, 0).unwrap();
    let mut e = prefill_engine(&qwen, 2048.max(len), chunk);
    let ms = timed_prefill(&mut e, &synth::prompt(qwen.spec.vocab, len, 1));
    println!("prefill of {len} tokens, chunk {chunk}: {ms:.2} ms (first, wall clock)");
}

/// `--decode-profile STEPS [DEPTH [PRESET]]`: a prompt of DEPTH tokens (48), then STEPS eager
/// decode steps on PRESET's shape (Qwen2.5-3B; max_seq 2048, or room for the prompt and the
/// steps), so that a profiler's per-kernel durations (ncu, filtered to the decode kernels)
/// cover whole steps.
fn decode_profile(steps: usize, depth: usize, preset: &str) {
    let spec = decodev2::arch::preset(preset).expect("preset");
    let qwen = synth::build(&spec, 0).unwrap();
    let max_seq = 2048.max(depth + steps + 64);
    let mut e = prefill_engine(&qwen, max_seq, depth.min(1024));
    e.prefill(&synth::prompt(qwen.spec.vocab, depth, 1))
        .unwrap();
    let ids: Vec<u32> = (0..steps).map(|_| e.step().unwrap()).collect();
    println!("{steps} eager decode steps after a {depth}-token prompt: {ids:?}");
}

/// The device's bandwidth in TB/s by a streaming read of 1 GiB (the bench kernels' floor).
fn streaming_tb_per_s() -> f64 {
    let probe = 1 << 30;
    let bench = Bench::new(0).expect("CUDA device");
    probe as f64 / bench.floor_us(probe).expect("floor") / 1e6
}

/// `--context [PRESET [D1,D2,..]] [--max-seq N]`: a preset's shape (Qwen2.5-3B by default) at
/// max_seq N (32,768 unless given), by context depth (48 to 32k by default): prefill of a prompt
/// that long (ms and tok/s, wall clock to the first token), then decode of 128 tokens after it
/// (graph replays, ms/token), beside the floor (weight bytes plus the KV bytes at that depth, over
/// the bandwidth the streaming-read kernel measures in this process), and the decode again under
/// `against` (`--against VAR=VALUE`; `DV2_ATTN_LONG=0`, attention v2 at every depth, unless given:
/// `DV2_HOPPER=0` times the pre-Hopper path beside the default). One engine per configuration, both
/// resident, serves the ids check and every depth; at each depth their requests alternate, and
/// their decodes chunk by chunk ([`time_request_pair`]): the paired chunks' median ratio and
/// quartiles follow the table. Writes the table and the JSON (`tests/gpu/plot-context.py` draws
/// it), and prints at each depth how long the board's power cap held the clocks down while it was
/// timed ([`power_capped_s`]).
fn context_sweep(
    json_path: &str,
    preset: &str,
    depths: &[usize],
    against: (&str, &str),
    against_loaded_first: bool,
    max_seq: usize,
) {
    const TOKENS: usize = 128;
    // Checked before the minute the model build and loads take: a depth with no room for its
    // decode would otherwise end the sweep with SequenceFull after them.
    if let Some(d) = depths.iter().find(|&&d| d + TOKENS + 1 > max_seq) {
        panic!(
            "depth {d} leaves no room for {TOKENS} decode steps at max_seq {max_seq} (deepest: {})",
            max_seq - TOKENS - 1
        );
    }
    let spec = decodev2::arch::preset(preset).expect("preset");
    let t = Instant::now();
    let model = synth::build(&spec, 0).unwrap();
    println!("{preset}: built in {:.1} s", t.elapsed().as_secs_f64());
    // The floor's divisor.
    let tb_per_s = streaming_tb_per_s();
    let weights = decodev2::cuda::budget::weight_bytes(&spec);
    println!(
        "device bandwidth (1 GiB streaming read): {tb_per_s:.2} TB/s; weights {:.2} GB/token",
        weights as f64 / 1e9
    );
    let against_label = format!("{}={}", against.0, against.1);
    // One engine per configuration, loaded under its setting (the engine reads the
    // configuration at load), serves the check and every depth.
    let load = |default: bool| -> Engine {
        let env: &[(&str, &str)] = if default { &[] } else { &[against] };
        with_env(env, || {
            let opts = EngineOptions {
                backend: BackendKind::Cuda,
                max_seq,
                ..EngineOptions::default()
            };
            let t = Instant::now();
            let mut e = Engine::new(model.clone(), &opts).expect("cuda engine");
            let used = e.device_used_bytes().unwrap().unwrap_or(0);
            let budget = decodev2::cuda::budget::estimate(&spec, max_seq, 0);
            println!(
                "loaded ({}) in {:.1} s; device memory in use {:.2} GB \
                 (budget without prefill activations or reserve: {:.2} GB)",
                if default { "default" } else { &against_label },
                t.elapsed().as_secs_f64(),
                used as f64 / 1e9,
                (budget.total() - budget.reserve) as f64 / 1e9
            );
            e
        })
    };
    // `--against-loaded-first`: the same engines, the against one loaded (its weights, KV cache
    // and graphs allocated) first, to tell the load order's share of a control's spread from
    // the timing order's (which alternates).
    let (mut a, mut b) = if against_loaded_first {
        let b = load(false);
        (load(true), b)
    } else {
        (load(true), load(false))
    };
    // Ids and logits under `against` beside the default's first, so that a faster column is
    // never of another answer (a lossless setting leaves both equal; the print says).
    for depth in [20, 300, 2100, 5000] {
        let prompt = synth::prompt(spec.vocab, depth, 1);
        let (mut ia, mut ib) = (vec![0u32; 32], vec![0u32; 32]);
        let (mut la, mut lb) = (vec![0f32; spec.vocab], vec![0f32; spec.vocab]);
        let (mut pa, mut pb) = (0u32, 0u32);
        for (e, ids, logits, first) in [
            (&mut a, &mut ia, &mut la, &mut pa),
            (&mut b, &mut ib, &mut lb, &mut pb),
        ] {
            e.reset().unwrap();
            *first = e.prefill(&prompt).unwrap();
            e.step_n(ids).unwrap();
            e.logits(logits).unwrap();
        }
        let diff = la
            .iter()
            .zip(&lb)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        // Free-running greedy steps: after the first differing id the two engines decode
        // different sequences. At that step both saw the same ids, so each one's top two there
        // tell a near-tie (a margin within the logits' error; log-probabilities differ by the
        // logits' difference) from a wrong answer.
        let ids = match ia.iter().zip(&ib).position(|(x, y)| x != y) {
            _ if pa != pb => format!("the prefill's ids DIFFER: {pb} against the default's {pa}"),
            None => "ids equal the default's".to_string(),
            Some(step) => {
                let tops = [&mut a, &mut b].map(|e| {
                    e.reset().unwrap();
                    e.prefill(&prompt).unwrap();
                    e.step_n(&mut vec![0u32; step + 1]).unwrap();
                    e.logprobs(0, 2).unwrap().top
                });
                format!(
                    "ids DIFFER from the default's from step {step} of {}; there the top two \
                     (id, log-probability) {:?} against the default's {:?}",
                    ia.len(),
                    tops[1],
                    tops[0]
                )
            }
        };
        println!(
            "{against_label} at depth {depth}: {ids}, max |logit diff| {diff:e} at the last step"
        );
    }
    let mut paired = Vec::new();
    let (default, other): (Vec<_>, Vec<_>) = depths
        .iter()
        .map(|&depth| {
            let prompt = synth::prompt(spec.vocab, depth, 1);
            let (capped, t) = (power_capped_s(), Instant::now());
            let ([on_a, on_b], pairs) = time_request_pair(&mut a, &mut b, &prompt, TOKENS, 2);
            if let (Some(before), Some(after)) = (capped, power_capped_s()) {
                println!(
                    "  depth {depth}: the board's power cap held the clocks down {:.1} s of the {:.1} s its timing took",
                    after - before,
                    t.elapsed().as_secs_f64()
                );
            }
            paired.push(pairs);
            (on_a, on_b)
        })
        .unzip();
    println!("  (last three columns: {against_label})");
    println!(
        "  {:>6} {:>11} {:>9} {:>10} {:>8} {:>10} {:>9} {:>7} {:>9} {:>8} {:>9}",
        "depth",
        "prefill ms",
        "tok/s",
        "ms/token",
        "tok/s",
        "floor ms",
        "floor t/s",
        "floor%",
        "ms/t",
        "tok/s",
        "prefill/s"
    );
    let mut json = format!("{{\n  \"preset\": \"{preset}\",\n  \"device_tb_per_s\": {tb_per_s:.3},\n  \"weight_bytes\": {weights},\n  \"against\": \"{against_label}\",\n  \"context\": [\n");
    // KV bytes of `slots` positions: every layer's K and V rows, bf16.
    let kv_bytes = |slots: usize| spec.n_layers * slots * 2 * spec.kv_dim() * 2;
    for (((&depth, &(prefill_ms, ms)), &(other_prefill_ms, other_ms)), p) in
        depths.iter().zip(&default).zip(&other).zip(&paired)
    {
        // What a step reads at this depth: the weights and the KV rows up to the position.
        let floor_ms = (weights + kv_bytes(depth + 64)) as f64 / (tb_per_s * 1e12) * 1e3;
        let prefill_tok_s = depth as f64 / prefill_ms * 1e3;
        println!(
            "  {:>6} {:>11.2} {:>9.0} {:>10.4} {:>8.1} {:>10.4} {:>9.0} {:>6.0}% {:>9.4} {:>8.1} {:>9.0}",
            depth,
            prefill_ms,
            prefill_tok_s,
            ms,
            1e3 / ms,
            floor_ms,
            1e3 / floor_ms,
            100.0 * floor_ms / ms,
            other_ms,
            1e3 / other_ms,
            depth as f64 / other_prefill_ms * 1e3
        );
        writeln!(json, "    {{\"depth\": {depth}, \"prefill_ms\": {prefill_ms:.3}, \"prefill_tok_s\": {prefill_tok_s:.1}, \"ms_per_token\": {ms:.5}, \"tok_s\": {:.2}, \"floor_ms\": {floor_ms:.5}, \"against_ms_per_token\": {other_ms:.5}, \"against_prefill_ms\": {other_prefill_ms:.3}, \"paired_ratio\": {:.5}, \"paired_q1\": {:.5}, \"paired_q3\": {:.5}}},", 1e3 / ms, p.median, p.q1, p.q3).unwrap();
    }
    // The same comparison chunk by chunk: the median of the paired ratios is the speed-up to
    // quote; the quartiles say how far one pair strays from it.
    for (&depth, p) in depths.iter().zip(&paired) {
        let speedup = |r: f64| (1.0 / r - 1.0) * 1e2;
        println!(
            "  depth {depth}: {against_label} {:+.2}% by the median of {} paired chunks of {PAIR_CHUNK} steps \
             (quartiles {:+.2}% .. {:+.2}%)",
            speedup(p.median),
            p.pairs,
            speedup(p.q3),
            speedup(p.q1)
        );
        let turns = &p.both_turns;
        if let (Some(&fastest), Some(&slowest)) = (turns.first(), turns.last()) {
            println!(
                "  depth {depth}: {against_label} {:+.2}% by the median of {} sums of two pairs in both turn orders \
                 ({:+.2}% .. {:+.2}%)",
                speedup(turns[turns.len() / 2]),
                turns.len(),
                speedup(slowest),
                speedup(fastest)
            );
        }
        let in_order: Vec<String> = p
            .in_order
            .iter()
            .map(|&r| format!("{:+.2}", speedup(r)))
            .collect();
        println!(
            "  depth {depth}: the pairs in the order they ran (%): {}",
            in_order.join(" ")
        );
    }
    json = json.trim_end_matches(",\n").to_string() + "\n  ],\n  \"kv_marginal\": [\n";
    // The decode attention's KV streaming rate in the graph: between two depths, the extra KV
    // bytes a step reads over the extra time it takes (the weights' share cancels).
    for (pair, times) in depths.windows(2).zip(default.windows(2)) {
        let (bytes, ms) = (
            (kv_bytes(pair[1]) - kv_bytes(pair[0])) as f64,
            times[1].1 - times[0].1,
        );
        let gb_per_s = bytes / (ms * 1e-3) / 1e9;
        println!(
            "  KV streamed in the graph, depth {} -> {}: {:.3} GB more a step in {:.4} ms more: {gb_per_s:.0} GB/s",
            pair[0],
            pair[1],
            bytes / 1e9,
            ms
        );
        writeln!(
            json,
            "    {{\"from\": {}, \"to\": {}, \"gb_per_s\": {gb_per_s:.1}}},",
            pair[0], pair[1]
        )
        .unwrap();
    }
    json = json.trim_end_matches(",\n").to_string() + "\n  ]\n}\n";
    std::fs::write(json_path, json).unwrap();
    println!("wrote {json_path}");
}

/// A CUDA engine on `preset`'s synthetic weights (seed 0) with room for 512 tokens past the
/// deepest of `depths`, and the preset's shape: the one engine of a sweep by depth.
fn sweep_engine(preset: &str, depths: &[usize]) -> (decodev2::arch::ArchSpec, Engine) {
    let (spec, mut engines) = sweep_engines(preset, depths, &[&[]]);
    (spec, engines.remove(0))
}

/// A sweep's engines on one synthetic model of `preset`, each loaded under its settings
/// (environment variables; the engine reads them at load), with room for the deepest depth
/// and 512 ids after it.
fn sweep_engines(
    preset: &str,
    depths: &[usize],
    settings: &[&[(&str, &str)]],
) -> (decodev2::arch::ArchSpec, Vec<Engine>) {
    let spec = decodev2::arch::preset(preset).expect("preset");
    let model = synth::build(&spec, 0).unwrap();
    let opts = EngineOptions {
        backend: BackendKind::Cuda,
        max_seq: depths.iter().max().unwrap() + 512,
        ..EngineOptions::default()
    };
    let engines = settings
        .iter()
        .map(|env| {
            with_env(env, || {
                Engine::new(model.clone(), &opts).expect("cuda engine")
            })
        })
        .collect();
    (spec, engines)
}

/// `--step-loop [PRESET [D1,D2,..]]`: decode ms/token of 128 tokens after a prompt of each
/// depth, a step a call (`Engine::step` per id) and in one `step_n`, requests of each alternating
/// in one engine (max_seq: the deepest depth + 256), medians of 5 requests after a warm one; the
/// difference is what the host's turn between two steps costs a token.
fn step_loop(preset: &str, depths: &[usize]) {
    const TOKENS: usize = 128;
    const REPS: usize = 5;
    let (spec, mut e) = sweep_engine(preset, depths);
    println!(
        "{preset}: ms/token of {TOKENS} tokens, a step a call against step_n (medians of {REPS})"
    );
    println!(
        "  {:>6} {:>10} {:>10} {:>12}",
        "depth", "step", "step_n", "host µs/tok"
    );
    for &depth in depths {
        let prompt = synth::prompt(spec.vocab, depth, 1);
        let (mut by_step, mut by_n) = (Vec::new(), Vec::new());
        for rep in 0..REPS + 1 {
            start_request(&mut e, &prompt);
            let t = Instant::now();
            for _ in 0..TOKENS {
                e.step().unwrap();
            }
            let step_ms = t.elapsed().as_secs_f64() * 1e3 / TOKENS as f64;
            let (_, n_ms) = one_request(&mut e, &prompt, TOKENS);
            if rep > 0 {
                by_step.push(step_ms);
                by_n.push(n_ms);
            }
        }
        let (a, b) = (median(by_step), median(by_n));
        println!("  {depth:>6} {a:>10.4} {b:>10.4} {:>12.1}", (a - b) * 1e3);
    }
}

/// `--turns [PRESET [D1,D2,..]]`: time to the first token of a chat turn that adds 32 ids
/// to a conversation of each depth, prefilled whole (`reset`, then the prefill of depth + 32
/// ids) against from where it leaves the earlier turns (`rewind` to the depth, then the
/// prefill of the 32 new ids), alternating in one engine (max_seq: the deepest depth + 256),
/// wall clock to the first id, medians of 5 after a warm round; and whether the two chose the
/// same first id.
fn turns_sweep(preset: &str, depths: &[usize]) {
    const NEW: usize = 32;
    const REPS: usize = 5;
    let (spec, mut e) = sweep_engine(preset, depths);
    println!(
        "{preset}: ms to the first id of a turn of {NEW} new ids after DEPTH ids, prefilled \
         whole against after a rewind to DEPTH (medians of {REPS})"
    );
    println!(
        "  {:>6} {:>10} {:>10} {:>8} {:>9}",
        "depth", "whole", "rewound", "ratio", "same id"
    );
    for &depth in depths {
        let turn = synth::prompt(spec.vocab, depth + NEW, 1);
        let (mut whole, mut rewound, mut same) = (Vec::new(), Vec::new(), true);
        for rep in 0..REPS + 1 {
            e.reset().unwrap();
            let t = Instant::now();
            let a = e.prefill(&turn).unwrap();
            let whole_ms = t.elapsed().as_secs_f64() * 1e3;
            e.rewind(depth).unwrap();
            let t = Instant::now();
            let b = e.prefill(&turn[depth..]).unwrap();
            let rewound_ms = t.elapsed().as_secs_f64() * 1e3;
            if rep > 0 {
                whole.push(whole_ms);
                rewound.push(rewound_ms);
                same &= a == b;
            }
        }
        let (w, r) = (median(whole), median(rewound));
        println!("  {depth:>6} {w:>10.2} {r:>10.2} {:>8.1} {same:>9}", w / r);
    }
}

/// `--short-chunks [PRESET [D1,D2,..]]`: ms to the next id of a chunk of 1 to 16 ids after a
/// rewind to each depth (a chat turn's few new ids; a speculative draft's check), on GEMV v3's
/// column kernels (the default) and on the GEMM (`DV2_PREFILL_GEMV=0`), one engine each, their
/// requests alternating; beside them a step a call of the default engine. Medians of 7 after
/// a warm round; the last column says whether both engines gave the same ids. At 16 ids (past
/// GEMV3_COLS) both run the GEMM: the two engines' spread.
fn short_chunks_sweep(preset: &str, depths: &[usize]) {
    const REPS: usize = 7;
    const SIZES: [usize; 5] = [1, 2, 4, 8, 16];
    let (spec, mut engines) = sweep_engines(preset, depths, &[&[], &[("DV2_PREFILL_GEMV", "0")]]);
    println!(
        "{preset}: ms to the next id of a chunk of N ids after a rewind to DEPTH: GEMV v3 columns \
         (default) | GEMM (DV2_PREFILL_GEMV=0); a decode step (a step a call); medians of {REPS}"
    );
    println!(
        "  {:>6} {:>4} {:>9} {:>9} {:>7} {:>9} {:>6}",
        "depth", "N", "columns", "GEMM", "ratio", "step", "same"
    );
    for &depth in depths {
        let prompt = synth::prompt(spec.vocab, depth + 32, 1);
        for e in engines.iter_mut() {
            e.reset().unwrap();
            e.prefill(&prompt[..depth]).unwrap();
        }
        let mut steps = Vec::new();
        for rep in 0..REPS + 1 {
            engines[0].rewind(depth).unwrap();
            engines[0].prefill(&prompt[depth..depth + 1]).unwrap();
            let t = Instant::now();
            engines[0].step().unwrap();
            if rep > 0 {
                steps.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        let step = median(steps);
        for n in SIZES {
            let chunk = &prompt[depth..depth + n];
            let mut times = [Vec::new(), Vec::new()];
            let mut ids = [0u32; 2];
            for rep in 0..REPS + 1 {
                for (i, e) in engines.iter_mut().enumerate() {
                    e.rewind(depth).unwrap();
                    let t = Instant::now();
                    ids[i] = e.prefill(chunk).unwrap();
                    if rep > 0 {
                        times[i].push(t.elapsed().as_secs_f64() * 1e3);
                    }
                }
            }
            let [cols, gemm] = times.map(median);
            println!(
                "  {depth:>6} {n:>4} {cols:>9.3} {gemm:>9.3} {:>7.2} {step:>9.3} {:>6}",
                gemm / cols,
                ids[0] == ids[1]
            );
        }
    }
}

/// `--speculate [PRESET [D1,D2,..]]`: speculative greedy decoding (`Engine::set_speculation`)
/// against plain steps, one engine, by depth: 256 ids by one `step_n` after a prompt of each
/// depth at drafts of 0 (off), 4, 7 (eight rows: one launch of the column kernels) and 15 (ms/token, the checks and accepted draft ids, and
/// whether the ids equal the plain run's), medians of 3 after a warm round. The synthetic
/// model's greedy output loops, which drafts predict well: this is the best case. Then what a
/// check costs by draft length, from the same pending id: a draft of k ids none of which is
/// taken (every id the vocabulary's last but one, against a step's ms), medians of 7.
fn speculate_sweep(preset: &str, depths: &[usize]) {
    const TOKENS: usize = 256;
    const REPS: usize = 3;
    let (spec, mut e) = sweep_engine(preset, depths);
    println!(
        "{preset}: {TOKENS} greedy ids by step_n, speculative against plain (medians of {REPS})"
    );
    println!(
        "  {:>6} {:>6} {:>9} {:>8} {:>7} {:>9} {:>8} {:>6}",
        "depth", "draft", "ms/token", "tok/s", "speedup", "checks", "accepted", "same"
    );
    for &depth in depths {
        let prompt = synth::prompt(spec.vocab, depth, 1);
        let mut plain: Option<(Vec<u32>, f64)> = None;
        for draft in [0, 4, 7, 15] {
            e.set_speculation(draft).unwrap();
            let (mut times, mut ids) = (Vec::new(), Vec::new());
            let before = e.speculation_stats();
            for rep in 0..REPS + 1 {
                e.reset().unwrap();
                e.prefill(&prompt).unwrap();
                let mut out = vec![0u32; TOKENS];
                let t = Instant::now();
                let done = e.step_n(&mut out).unwrap();
                if rep > 0 {
                    times.push(t.elapsed().as_secs_f64() * 1e3 / done as f64);
                }
                out.truncate(done);
                ids = out;
            }
            let after = e.speculation_stats();
            let ms = median(times);
            let (base_ids, base_ms) = plain.get_or_insert_with(|| (ids.clone(), ms)).clone();
            let reps = (REPS + 1) as u64;
            println!(
                "  {depth:>6} {draft:>6} {ms:>9.4} {:>8.1} {:>7.2} {:>9} {:>8} {:>6}",
                1e3 / ms,
                base_ms / ms,
                (after.checks - before.checks) / reps,
                format!(
                    "{}/{}",
                    (after.accepted - before.accepted) / reps,
                    (after.drafted - before.drafted) / reps
                ),
                ids == base_ids
            );
        }
        e.set_speculation(0).unwrap();
        // A check's cost by draft length, no draft id taken, against a step.
        let wrong = (spec.vocab - 2) as u32;
        let mut row = format!("  {depth:>6} a check of k ids none taken, ms (a step:");
        let mut timed = |draft: &[u32]| {
            let mut times = Vec::new();
            for rep in 0..8 {
                e.rewind(depth - 1).unwrap();
                e.prefill(&prompt[depth - 1..]).unwrap();
                let mut out = vec![0u32; draft.len() + 1];
                let t = Instant::now();
                if draft.is_empty() {
                    e.step_n(&mut out).unwrap();
                } else {
                    e.step_draft(draft, &mut out).unwrap();
                }
                if rep > 0 {
                    times.push(t.elapsed().as_secs_f64() * 1e3);
                }
            }
            median(times)
        };
        write!(row, " {:.3})", timed(&[])).unwrap();
        for k in [1, 3, 7, 15] {
            write!(row, " k={k}: {:.3}", timed(&vec![wrong; k])).unwrap();
        }
        println!("{row}");
    }
}

/// `--against VAR=VALUE` among the arguments, if given (a value without `=` stops the bench).
fn against_arg(args: &[String]) -> Option<(&str, &str)> {
    let i = args.iter().position(|a| a == "--against")?;
    Some(
        args.get(i + 1)
            .and_then(|a| a.split_once('='))
            .expect("--against VAR=VALUE"),
    )
}

/// `--checks [PRESET [D1,D2,..]] [--against VAR=VALUE]`: after a prompt of each depth, 24 steps
/// one `step_n` call each, then for k = 1, 7, 15, 24 checks of k draft ids that are all wrong
/// (each keeps one id and moves the position by one, as a step), medians of their wall times;
/// with `--against`, a second engine loaded under that setting does the same after each of the
/// default's runs of 24 (one process, the runs alternating). No rewinds or prefills between a
/// run's calls, so a kernel trace holds its checks alone, back to back.
fn checks(preset: &str, depths: &[usize]) {
    const CHECKS: usize = 24;
    let args: Vec<String> = std::env::args().collect();
    let against: Vec<(&str, &str)> = against_arg(&args).into_iter().collect();
    let envs: &[&[(&str, &str)]] = &[&[], &against];
    let (spec, loaded) = sweep_engines(preset, depths, &envs[..1 + against.len()]);
    let labels = std::iter::once("default".to_string())
        .chain(against.iter().map(|(var, value)| format!("{var}={value}")));
    let mut engines: Vec<(String, Engine)> = labels.zip(loaded).collect();
    let wrong = (spec.vocab - 2) as u32;
    println!("{preset}: ms a call, {CHECKS} calls in a row (medians), none of a draft's ids taken");
    for &depth in depths {
        for (_, e) in engines.iter_mut() {
            e.reset().unwrap();
            e.prefill(&synth::prompt(spec.vocab, depth, 1)).unwrap();
        }
        let mut rows: Vec<String> = engines
            .iter()
            .map(|(label, _)| format!("  {depth:>6} {label:>20}"))
            .collect();
        for k in [0, 1, 7, 15] {
            let draft = vec![wrong; k];
            let mut out = vec![0u32; k + 1];
            for ((_, e), row) in engines.iter_mut().zip(rows.iter_mut()) {
                let times: Vec<f64> = (0..CHECKS)
                    .map(|_| {
                        let t = Instant::now();
                        if k == 0 {
                            e.step_n(&mut out).unwrap();
                        } else {
                            e.step_draft(&draft, &mut out).unwrap();
                        }
                        t.elapsed().as_secs_f64() * 1e3
                    })
                    .collect();
                let label = if k == 0 {
                    "a step".into()
                } else {
                    format!("k={k}")
                };
                write!(row, "  {label}: {:.3}", median(times)).unwrap();
            }
        }
        for row in rows {
            println!("{row}");
        }
    }
}

/// `--rest [PRESET [D1,D2,..]]`: decode ms/token of 128 tokens after a prompt of each depth,
/// as one `step_n` request after 1 s with the GPU idle and right after another such request
/// (untimed), and in 16-step `step_n` chunks back to back and each after 100 ms idle (only the
/// chunks timed), the four alternating in one engine, medians of 5 after a warm round. Why: the
/// 32B shape's decode meets the board's power cap (docs/lab.md, sessions 45-46 and 54) and its
/// step spreads ±5% on one machine (session 53); where the cap slows the step, a request or a
/// chunk that starts rested runs faster than one that follows others.
fn rest_sweep(preset: &str, depths: &[usize]) {
    const TOKENS: usize = 128;
    const CHUNK: usize = PAIR_CHUNK;
    const REPS: usize = 5;
    const REQUEST_REST: std::time::Duration = std::time::Duration::from_secs(1);
    const CHUNK_REST: std::time::Duration = std::time::Duration::from_millis(100);
    // The machine by its streaming bandwidth (H200s differ by up to 3%, docs/lab.md session 51).
    println!(
        "device bandwidth (1 GiB streaming read): {:.2} TB/s",
        streaming_tb_per_s()
    );
    let (spec, mut e) = sweep_engine(preset, depths);
    println!(
        "{preset}: ms/token of {TOKENS} tokens: one step_n after {} ms idle and after another \
         request, {CHUNK}-step chunks back to back and each after {} ms idle (medians of {REPS})",
        REQUEST_REST.as_millis(),
        CHUNK_REST.as_millis()
    );
    println!(
        "  {:>6} {:>13} {:>13} {:>10} {:>10} {:>13}",
        "depth", "rested req", "request", "chunks", "rested", "rested/chunks"
    );
    // A request's decode in chunks, each timed alone after `rest`: ms per token.
    let chunked = |e: &mut Engine, prompt: &[u32], rest: Option<std::time::Duration>| -> f64 {
        start_request(e, prompt);
        let mut out = vec![0u32; CHUNK];
        let mut ms = 0.0;
        for _ in 0..TOKENS / CHUNK {
            if let Some(r) = rest {
                std::thread::sleep(r);
            }
            ms += timed_steps(e, &mut out);
        }
        ms / TOKENS as f64
    };
    for &depth in depths {
        let prompt = synth::prompt(spec.vocab, depth, 1);
        let mut runs: [Vec<f64>; 4] = Default::default();
        for rep in 0..REPS + 1 {
            std::thread::sleep(REQUEST_REST);
            let rested_request = one_request(&mut e, &prompt, TOKENS).1;
            one_request(&mut e, &prompt, TOKENS);
            let request = one_request(&mut e, &prompt, TOKENS).1;
            let back = chunked(&mut e, &prompt, None);
            let rested = chunked(&mut e, &prompt, Some(CHUNK_REST));
            if rep > 0 {
                for (run, ms) in runs.iter_mut().zip([rested_request, request, back, rested]) {
                    run.push(ms);
                }
            }
        }
        let [rr, r, b, c] = runs.map(median);
        println!(
            "  {depth:>6} {rr:>13.4} {r:>13.4} {b:>10.4} {c:>10.4} {:>+12.2}%",
            (c / b - 1.0) * 1e2
        );
    }
}

/// How long the board's software power cap has held the GPU's clocks down since the driver
/// loaded, in seconds (nvidia-smi's "SW Power Capping" counter), or None where nvidia-smi does
/// not give it. Why: the 32B shape's decode runs at the 700 W cap, which slows it by up to 7%
/// (docs/lab.md, session 54); each timing says how much of it ran capped.
fn power_capped_s() -> Option<f64> {
    let out = std::process::Command::new("nvidia-smi")
        .args(["-q", "-d", "PERFORMANCE", "-i", "0"])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().find(|l| l.contains("SW Power Capping"))?;
    let us: f64 = line
        .split(':')
        .nth(1)?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(us / 1e6)
}

/// `--sampling [PRESET [D1,D2,..]]`: decode ms/token of 128 tokens after a prompt of each
/// depth, greedy and under three sampling settings (temperature alone; OpenAI's top_p; llama.cpp's
/// defaults: top-k, top-p, min-p and a repeat penalty), each timed right after the greedy run in
/// the same engine (max_seq: the deepest depth + 256), medians of 3 requests.
fn sampling_sweep(preset: &str, depths: &[usize]) {
    const TOKENS: usize = 128;
    let (spec, mut e) = sweep_engine(preset, depths);
    let settings = [
        (
            "temperature 1",
            Sampling {
                temperature: 1.0,
                seed: 1,
                ..Sampling::default()
            },
        ),
        (
            "top_p 0.9",
            Sampling {
                temperature: 1.0,
                top_p: 0.9,
                seed: 1,
                ..Sampling::default()
            },
        ),
        (
            "llama.cpp defaults",
            Sampling {
                temperature: 0.8,
                top_k: 40,
                top_p: 0.95,
                min_p: 0.05,
                repeat_penalty: 1.1,
                penalty_last_n: 64,
                seed: 1,
                ..Sampling::default()
            },
        ),
    ];
    println!(
        "  {:>6} {:<20} {:>10} {:>8} {:>10} {:>8} {:>7}",
        "depth", "sampling", "greedy ms", "tok/s", "sampled ms", "tok/s", "ratio"
    );
    for &depth in depths {
        let prompt = synth::prompt(spec.vocab, depth, 1);
        for (name, s) in &settings {
            e.set_sampling(&Sampling::default()).unwrap();
            let (_, greedy) = time_request(&mut e, &prompt, TOKENS, 3);
            e.set_sampling(s).unwrap();
            let (_, sampled) = time_request(&mut e, &prompt, TOKENS, 3);
            println!(
                "  {depth:>6} {name:<20} {greedy:>10.4} {:>8.1} {sampled:>10.4} {:>8.1} {:>6.1}%",
                1e3 / greedy,
                1e3 / sampled,
                100.0 * greedy / sampled
            );
        }
    }
}

/// `--load PATH [REPS]`: loads a model file or directory on CUDA REPS times (3), each split
/// into the read (parse, codes taken or re-quantized, on the host) and the device part
/// (context, kernels from their cache, the weights' upload (timed apart), the other buffers,
/// warm-up), then decodes 16 tokens as a check.
fn load_times(path: &str, reps: usize) {
    let opts = EngineOptions {
        backend: BackendKind::Cuda,
        max_seq: 4096,
        ..EngineOptions::default()
    };
    for rep in 0..reps {
        let t = Instant::now();
        let model = decodev2::load::load(std::path::Path::new(path)).expect("load");
        let read_s = t.elapsed().as_secs_f64();
        let mut e = Engine::new(model, &opts).expect("cuda engine");
        let total_s = t.elapsed().as_secs_f64();
        let prompt = synth::prompt(e.spec().vocab, 48, 1);
        e.prefill(&prompt).unwrap();
        let mut out = [0u32; 16];
        e.step_n(&mut out).unwrap();
        println!(
            "load {rep}: {total_s:.2} s (read {read_s:.2} s, device {:.2} s of which upload {:.2} s, warm-up {:.0} ms); decoded {:?}..",
            total_s - read_s,
            e.upload_ms().unwrap_or(0.0) / 1e3,
            e.warmup_ms().unwrap_or(0.0),
            &out[..4]
        );
    }
    // As a host loads it (dv2_load): the shape admitted on the device, then the weights.
    for rep in 0..reps {
        let t = Instant::now();
        let e = Engine::load_file(std::path::Path::new(path), &opts).expect("load_file");
        println!(
            "load_file {rep}: {:.2} s on {}",
            t.elapsed().as_secs_f64(),
            e.backend_name()
        );
    }
}

/// A sweep's arguments after its flag at `i` (`--context`, `--sampling`, ...): the preset (qwen25_3b
/// unless named) and the depths (a comma list after the preset, else `default`); a word
/// starting with `--` is the next flag, not either.
fn preset_and_depths<'a>(args: &'a [String], i: usize, default: &[usize]) -> (&'a str, Vec<usize>) {
    let preset = args.get(i + 1).filter(|a| !a.starts_with("--"));
    let depths = match args
        .get(i + 2)
        .filter(|a| preset.is_some() && !a.starts_with("--"))
    {
        Some(list) => list.split(',').map(|d| d.parse().expect("depth")).collect(),
        None => default.to_vec(),
    };
    (preset.map_or("qwen25_3b", |p| p.as_str()), depths)
}

/// A sweep of one engine by depth: its preset and depths.
type Sweep = fn(&str, &[usize]);

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let flag = |f: &str| args.iter().any(|a| a == f);
    let rows = args
        .iter()
        .position(|a| a == "--rows")
        .and_then(|i| args.get(i + 1));
    if let Some(i) = args.iter().position(|a| a == "--decode-profile") {
        let num = |j: usize| args.get(i + j).and_then(|a| a.parse().ok());
        let Some(steps) = num(1) else {
            eprintln!("usage: bench --decode-profile STEPS [DEPTH [PRESET]]");
            std::process::exit(2);
        };
        let preset = args.get(i + 3).map_or("qwen25_3b", String::as_str);
        decode_profile(steps, num(2).unwrap_or(48), preset);
        return;
    }
    if let Some(i) = args.iter().position(|a| a == "--cta-timeline") {
        let Some(path) = args.get(i + 1) else {
            eprintln!("usage: bench --cta-timeline PATH [DEPTH [PRESET]]");
            std::process::exit(2);
        };
        cta_timeline(
            path,
            args.get(i + 2).and_then(|a| a.parse().ok()).unwrap_or(48),
            args.get(i + 3).map_or("qwen25_3b", |p| p.as_str()),
        );
        return;
    }
    if let Some(i) = args.iter().position(|a| a == "--prefill-profile") {
        let num = |j: usize| args.get(i + j).and_then(|a| a.parse().ok());
        let (Some(len), Some(chunk)) = (num(1), num(2)) else {
            eprintln!("usage: bench --prefill-profile LEN CHUNK");
            std::process::exit(2);
        };
        prefill_profile(len, chunk);
        return;
    }
    let json_path = args
        .iter()
        .position(|a| a == "--json")
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| "bench.json".into());
    let mut json = String::from("{\n");
    if flag("--probe") {
        probe();
        return;
    }
    if flag("--boundary") {
        boundary();
        return;
    }
    if flag("--l2-hot") {
        l2_hot();
        return;
    }
    if let Some(i) = args.iter().position(|a| a == "--load") {
        let reps = args.get(i + 2).and_then(|r| r.parse().ok()).unwrap_or(3);
        load_times(args.get(i + 1).expect("--load PATH"), reps);
        return;
    }
    // The sweeps of one engine by depth (48 and 8k unless listed).
    let sweeps: [(&str, Sweep); 7] = [
        ("--step-loop", step_loop),
        ("--rest", rest_sweep),
        ("--sampling", sampling_sweep),
        ("--turns", turns_sweep),
        ("--short-chunks", short_chunks_sweep),
        ("--speculate", speculate_sweep),
        ("--checks", checks),
    ];
    for (name, sweep) in sweeps {
        if let Some(i) = args.iter().position(|a| a == name) {
            let (preset, depths) = preset_and_depths(&args, i, &[48, 8192]);
            sweep(preset, &depths);
            return;
        }
    }
    if let Some(i) = args.iter().position(|a| a == "--context") {
        let (preset, depths) = preset_and_depths(
            &args,
            i,
            &[48, 256, 512, 1024, 2048, 4096, 8192, 16384, 32512],
        );
        let against = against_arg(&args).unwrap_or(("DV2_ATTN_LONG", "0"));
        let max_seq = args
            .iter()
            .position(|a| a == "--max-seq")
            .map_or(32768, |i| {
                args.get(i + 1)
                    .and_then(|n| n.parse().ok())
                    .expect("--max-seq N")
            });
        context_sweep(
            &json_path,
            preset,
            &depths,
            against,
            flag("--against-loaded-first"),
            max_seq,
        );
        return;
    }

    let shapes = args
        .iter()
        .position(|a| a == "--shapes")
        .and_then(|i| args.get(i + 1))
        .map_or("qwen25_3b", |p| p.as_str());
    let shapes_spec = decodev2::arch::preset(shapes).expect("--shapes preset");
    // Kernel microbenchmarks, each GEMV family on every matrix, in one process.
    let mut first = true;
    json += "  \"kernels\": {\n";
    for (variant, gemv) in [("v2", Gemv::V2), ("v3", Gemv::V3)] {
        let mut bench = Bench::new(0).expect("CUDA device");
        bench.set_gemv(GemvChoice::Fixed(gemv));
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
            "\nkernels on the {shapes} shapes, {} (median µs per launch over rotated copies):",
            bench.variants()
        );
        println!(
            "  {:<26} {:>9} {:>9} {:>8} {:>9} {:>7}",
            "kernel", "MB", "µs", "GB/s", "floor µs", "floor%"
        );
        writeln!(json, "    \"{variant}\": [").unwrap();
        for t in kernel_table(&bench, &shapes_spec) {
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
    if flag("--prefill-only") {
        let qwen = synth::build(&QWEN25_3B, 0).unwrap();
        prefill_tables(&qwen, &mut json, flag("--skip-gemm"));
        json = json.trim_end_matches(",\n").to_string() + "\n}\n";
        std::fs::write(&json_path, json).unwrap();
        println!("\nwrote {json_path}");
        return;
    }
    let mut runs = Vec::new();
    let medium = synth::build(&MEDIUM_LLAMA, 0).unwrap();
    for graph in [true, false] {
        runs.push(time_decode("medium_llama", &medium, 32, 4, 24, graph, 5));
    }
    // Each switch off against the default, same process, for the ratio (only those `--rows`
    // names).
    for (label, env) in switch_rows("medium_llama", rows) {
        runs.push(with_env(&env, || {
            time_decode(&label, &medium, 32, 4, 24, true, 5)
        }));
    }
    let mut split = Vec::new();
    let qwen = (!flag("--skip-3b")).then(|| {
        let t = Instant::now();
        let qwen = synth::build(&QWEN25_3B, 0).unwrap();
        println!(
            "\nsynthetic Qwen2.5-3B shape built in {:.1} s",
            t.elapsed().as_secs_f64()
        );
        qwen
    });
    if let Some(qwen) = &qwen {
        runs.push(time_decode("qwen25_3b", qwen, 2048, 48, 128, true, 3));
        for (label, env) in switch_rows("qwen25_3b", rows) {
            runs.push(with_env(&env, || {
                time_decode(&label, qwen, 2048, 48, 128, true, 3)
            }));
        }
        // The default again, last: how far the first row of the table sits from it.
        runs.push(time_decode("qwen25_3b again", qwen, 2048, 48, 128, true, 3));
    }
    if let Some(qwen) = qwen.as_ref().filter(|_| !flag("--skip-variants")) {
        runs.push(time_decode("qwen25_3b", qwen, 2048, 48, 128, false, 3));
        // The decode step's linears through the tensor-core GEMM at N = 1 (the seed's ablation).
        runs.push(with_env(&[("DV2_LINEAR", "mma")], || {
            time_decode("qwen25_3b linear=mma", qwen, 2048, 48, 128, true, 3)
        }));
        prefill_tables(qwen, &mut json, flag("--skip-gemm"));
    }
    if let Some(qwen) = qwen
        .as_ref()
        .filter(|_| !flag("--skip-variants") || flag("--split"))
    {
        split = stage_split(qwen, 2048, 48);
    }
    println!("\ndecode (ignore EOS; median of runs; first decode step excluded):");
    println!(
        "  {:<22} {:>8} {:>7} {:>7} {:>6} {:>8} {:>10} {:>11} {:>10} {:>9}",
        "model",
        "max_seq",
        "prompt",
        "tokens",
        "graph",
        "load s",
        "warmup ms",
        "prefill ms",
        "ms/token",
        "tok/s"
    );
    json += "  \"decode\": [\n";
    for r in &runs {
        println!(
            "  {:<22} {:>8} {:>7} {:>7} {:>6} {:>8.2} {:>10.1} {:>11.2} {:>10.4} {:>9.1}",
            r.label,
            r.max_seq,
            r.prompt,
            r.tokens,
            r.graph,
            r.load_s,
            r.warmup_ms,
            r.prefill_ms,
            r.ms_per_token,
            1e3 / r.ms_per_token
        );
        writeln!(json, "    {{\"model\": \"{}\", \"max_seq\": {}, \"prompt\": {}, \"tokens\": {}, \"graph\": {}, \"load_s\": {:.3}, \"warmup_ms\": {:.2}, \"prefill_ms\": {:.3}, \"ms_per_token\": {:.5}}},", r.label, r.max_seq, r.prompt, r.tokens, r.graph, r.load_s, r.warmup_ms, r.prefill_ms, r.ms_per_token).unwrap();
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
