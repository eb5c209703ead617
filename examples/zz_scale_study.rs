// STUDY (not for commit): teacher-forced log-probs of a text under NF4 scale formats.
use decodev2::engine::{BackendKind, Engine, EngineOptions};
fn logsoftmax(v: &mut [f32]) {
    let m = v.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let s: f64 = v.iter().map(|&x| ((x - m) as f64).exp()).sum();
    let ls = m as f64 + s.ln();
    v.iter_mut().for_each(|x| *x = (*x as f64 - ls) as f32);
}
fn run(path: &str, text: &str, sim: &str) -> (Vec<u32>, Vec<Vec<f32>>) {
    std::env::set_var("DV2_SIM_SCALE", sim);
    let opts = EngineOptions { backend: BackendKind::Cpu, max_seq: 1024, ..EngineOptions::default() };
    let mut e = Engine::load_file(std::path::Path::new(path), &opts).unwrap();
    let ids = e.tokenizer().unwrap().encode(text, true, false).unwrap();
    let ids: Vec<u32> = ids.into_iter().take(400).collect();
    let vocab = e.spec().vocab;
    let mut out = Vec::new();
    e.reset().unwrap();
    for &t in &ids[..ids.len() - 1] {
        e.prefill(&[t]).unwrap();
        let mut l = vec![0f32; vocab];
        e.logits(&mut l).unwrap();
        logsoftmax(&mut l);
        out.push(l);
    }
    (ids, out)
}
fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a[1] == "flips" { flips(); return; }
    let text = std::fs::read_to_string(&a[2]).unwrap();
    let (ids, base) = run(&a[1], &text, "");
    let nll = |lp: &Vec<Vec<f32>>| lp.iter().zip(&ids[1..]).map(|(l, &t)| -l[t as usize] as f64).sum::<f64>() / lp.len() as f64;
    println!("tokens {} base nll {:.5} ppl {:.3}", ids.len(), nll(&base), nll(&base).exp());
    for sim in a[3..].iter() {
        let (_, v) = run(&a[1], &text, sim);
        let (mut kl, mut agree, mut maxkl) = (0f64, 0usize, 0f64);
        for (p, q) in base.iter().zip(&v) {
            let k: f64 = p.iter().zip(q).map(|(&a, &b)| (a as f64).exp() * (a - b) as f64).sum();
            kl += k; maxkl = maxkl.max(k);
            let am = |x: &Vec<f32>| x.iter().enumerate().fold((0, f32::MIN), |m, (i, &y)| if y > m.1 { (i, y) } else { m }).0;
            agree += (am(p) == am(q)) as usize;
        }
        let n = base.len() as f64;
        println!("{sim:>12}: nll {:.5} (ppl {:.3}, {:+.3}%), KL mean {:.6} max {:.5}, top-1 agree {:.1}%", nll(&v), nll(&v).exp(), (nll(&v).exp()/nll(&base).exp()-1.0)*100.0, kl / n, maxkl, agree as f64 / n * 100.0);
    }
}
#[allow(dead_code)]
pub fn flips() {
    let (rows, cols) = (64usize, 1024usize);
    let mut s = 12345u64;
    let data: Vec<f32> = (0..rows * cols).map(|_| { s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407); ((s >> 33) as f32 / 2f32.powi(31) - 0.5) * 2.0 }).collect();
    std::env::set_var("DV2_SIM_SCALE", "");
    let a = decodev2::nf4::Nf4Matrix::quantize(rows, cols, &data).unwrap();
    std::env::set_var("DV2_SIM_SCALE", std::env::var("V").unwrap());
    let b = decodev2::nf4::Nf4Matrix::quantize(rows, cols, &data).unwrap();
    let mut f = 0; let mut n = 0;
    for (x, y) in a.packed.iter().zip(b.packed.iter()) { f += ((x >> 4) != (y >> 4)) as usize + ((x & 15) != (y & 15)) as usize; n += 2; }
    let (da, db) = (a.dequantize(), b.dequantize());
    let err = |d: &Vec<f32>| d.iter().zip(&data).map(|(p, q)| ((p - q) as f64).powi(2)).sum::<f64>();
    let diff: f64 = da.iter().zip(&db).map(|(p, q)| ((p - q) as f64).powi(2)).sum();
    println!("flips {f} of {n}; err base {:.4} sim {:.4}; diff {:.4}", err(&da), err(&db), diff);
}
