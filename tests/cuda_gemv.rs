//! Every GEMV kernel family against the CPU: `y = W x`, `y += W x`, SwiGLU of gate and up and
//! q/k/v stacked (with a bias), on random NF4 rows, at a K for each of GEMV v2's shapes (1, 2
//! and 3 chunks of 32 bytes per lane, K split over 1 to 8 warps; SwiGLU at 3 only past K =
//! 16,384). The model gates launch only the shapes of their presets and of the Qwen2.5-3B
//! shape; SwiGLU over 2 warps a row at 2 chunks a lane, the default kernel for K =
//! 2080..4096, and SwiGLU at 3 chunks, are checked only here, and so is GEMV v2's f16 input
//! (DV2_FFN_F16) against the same values in f32, bit for bit.
//! J = 4 from f16 x (K past 24,576) has its own test below; it and SwiGLU over 5 warps a row
//! (K = 5,120) run in the 32B shape's oracle gate too (cuda_gates).
//! With no CUDA device: SKIP; under DV2_REQUIRE_CUDA=1 a missing device fails.

mod common;

use common::cuda_or_skip;
use decodev2::config::Config;
use decodev2::cuda::bench::random_f32 as random;
use decodev2::cuda::device::Gpu;
use decodev2::cuda::kernels::state;
use decodev2::cuda::ops::{
    Epilogue, GemmMatrix, Gemv, GemvChoice, Input, LogitsHead, Ops, QkvArgs, RopeArgs,
    ARGMAX_SCRATCH,
};
use decodev2::cuda::weights::DeviceMatrix;
use decodev2::nf4::Nf4Matrix;
use half::f16;

/// K for each GEMV v2 shape (chunks per lane J, warps per row): (1, 1), (2, 1), (3, 1), (2, 2),
/// (3, 4), (2, 8), (3, 8) — the last is the largest K v2 takes — and 5,120, where SwiGLU runs
/// over 5 warps a row, 10 a CTA (the others at J = 3 over 2 warps).
const KS: [usize; 8] = [256, 2048, 2560, 4096, 5120, 11008, 16384, 24576];

/// A random NF4 matrix: its host copy (dequantized for the reference) and its device copy.
struct Matrix {
    w: Vec<f32>,
    cols: usize,
    dev: DeviceMatrix,
}

impl Matrix {
    fn new(gpu: &Gpu, rows: usize, cols: usize, seed: u64) -> Matrix {
        let q = Nf4Matrix::quantize(rows, cols, &random(rows * cols, seed, -1.0, 1.0)).unwrap();
        Matrix {
            w: q.dequantize(),
            cols,
            dev: DeviceMatrix::upload(gpu, &q).unwrap(),
        }
    }

    /// Row r of W x, and the sum of |w x| over the row (what rounding errors scale with).
    fn dot(&self, r: usize, x: &[f32]) -> (f32, f32) {
        let row = &self.w[r * self.cols..(r + 1) * self.cols];
        let (mut sum, mut mag) = (0f64, 0f64);
        for (w, x) in row.iter().zip(x) {
            sum += (*w as f64) * (*x as f64);
            mag += (*w as f64 * *x as f64).abs();
        }
        (sum as f32, mag as f32)
    }
}

/// The kernels round x and the products to f16 (v2's f16 table, v3, the GEMM): allow 2^-9 of
/// the sum of |w x| (four times f16's unit roundoff), and a floor for sums near zero.
fn tolerance(mag: f32) -> f32 {
    mag / 512.0 + 1e-4
}

/// `x` rounded to f16: its bits, and their values back in f32 (what a kernel reading f16 sees).
fn f16_rounded(x: &[f32]) -> (Vec<u16>, Vec<f32>) {
    let bits: Vec<u16> = x.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
    let values = bits.iter().map(|&h| f16::from_bits(h).to_f32()).collect();
    (bits, values)
}

fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

/// A kernel choice: its name and what it changes in [`Ops`].
type Setting = (&'static str, fn(&mut Ops));

/// The choices checked, each applied to [`Ops`] at its defaults: each GEMV family forced on
/// every shape, and the decode step's linears through the tensor-core GEMM (`DV2_LINEAR=mma`).
fn settings() -> Vec<Setting> {
    vec![
        ("default (auto)", |_| {}),
        ("v2", |o| o.gemv = GemvChoice::Fixed(Gemv::V2)),
        ("v3", |o| o.gemv = GemvChoice::Fixed(Gemv::V3)),
        ("tensor-core GEMM", |o| o.cfg.linear_mma = true),
    ]
}

#[test]
fn every_gemv_kernel_matches_the_cpu_at_every_v2_shape() {
    let cfg = Config::from_env();
    let Some(gpu) = cuda_or_skip("GPU", Gpu::open(0, &cfg)) else {
        return;
    };
    let mut ops = Ops::new(gpu, cfg.clone()).unwrap();
    let gpu = &ops.gpu;
    let mats: Vec<[Matrix; 3]> = KS
        .iter()
        .enumerate()
        .map(|(i, &k)| {
            // Rows not a multiple of 16 (v3's tiles) nor of the CTAs' row blocks.
            let rows = if k > 8192 { 72 } else { 200 };
            // Odd seeds: random_f32's generator takes seed | 1.
            [0, 1, 2].map(|m| Matrix::new(gpu, rows, k, (20 * i + 2 * m + 1) as u64))
        })
        .collect();
    let mut worst = 0f32;
    for (name, set) in settings() {
        (ops.gemv, ops.cfg) = (GemvChoice::Auto, cfg.clone());
        set(&mut ops);
        let gpu = &ops.gpu;
        for (&k, [a, b, c]) in KS.iter().zip(&mats) {
            let rows = a.w.len() / k;
            let x = random(k, k as u64, -1.0, 1.0);
            let xd = gpu.upload(&x).unwrap();
            let xp = Input::raw(gpu.ptr(&xd));
            let mut check = |what: &str, got: &[f32], want: &dyn Fn(usize) -> (f32, f32)| {
                for (r, g) in got.iter().enumerate() {
                    let (v, tol) = want(r);
                    let err = (g - v).abs();
                    worst = worst.max(err / tol);
                    assert!(
                        err <= tol,
                        "{name}, K = {k}, {what}: row {r} got {g}, want {v} (tolerance {tol})"
                    );
                }
            };

            // y = A x, then y += A x over it.
            let y = gpu.zeros::<f32>(rows).unwrap();
            ops.gemv(a.dev.as_ref(gpu), rows, k, xp, gpu.ptr(&y), false, 0, 0)
                .unwrap();
            let once = gpu.download(&y, rows).unwrap();
            check("y = W x", &once, &|r| {
                let (v, m) = a.dot(r, &x);
                (v, tolerance(m))
            });
            ops.gemv(a.dev.as_ref(gpu), rows, k, xp, gpu.ptr(&y), true, 0, 0)
                .unwrap();
            check("y += W x", &gpu.download(&y, rows).unwrap(), &|r| {
                let (v, m) = a.dot(r, &x);
                (once[r] + v, 2.0 * tolerance(m))
            });

            // SwiGLU: silu(A x) * (B x); the error of each dot product carried through.
            let out = gpu.zeros::<f32>(rows).unwrap();
            ops.swiglu(
                a.dev.as_ref(gpu),
                b.dev.as_ref(gpu),
                rows,
                k,
                xp,
                gpu.ptr(&out),
                false,
            )
            .unwrap();
            let swiglu = gpu.download(&out, rows).unwrap();
            if ops.swiglu_writes_f16(rows, k) {
                // Written as f16 (DV2_FFN_F16): the f32 outputs rounded to nearest.
                let out16 = gpu.zeros::<u16>(rows).unwrap();
                let (ga, gb) = (a.dev.as_ref(gpu), b.dev.as_ref(gpu));
                ops.swiglu(ga, gb, rows, k, xp, gpu.ptr(&out16), true)
                    .unwrap();
                let want: Vec<u16> = swiglu.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
                assert_eq!(
                    gpu.download(&out16, rows).unwrap(),
                    want,
                    "{name}, K = {k}, SwiGLU in f16"
                );
            }
            if ops.gemv_takes_f16(rows, k) {
                // An f16 x gives the bits of the same values in f32: the kernel rounds x to f16.
                let (x16, x_r) = f16_rounded(&x);
                let (x16d, x_rd) = (gpu.upload(&x16).unwrap(), gpu.upload(&x_r).unwrap());
                let y = gpu.zeros::<f32>(2 * rows).unwrap();
                let m = a.dev.as_ref(gpu);
                let y_f32 = gpu.ptr(&y);
                let y_f16 = y_f32 + 4 * rows as u64;
                ops.gemv(m, rows, k, Input::raw(gpu.ptr(&x_rd)), y_f32, false, 0, 0)
                    .unwrap();
                ops.gemv(
                    m,
                    rows,
                    k,
                    Input::raw_f16(gpu.ptr(&x16d)),
                    y_f16,
                    false,
                    0,
                    0,
                )
                .unwrap();
                let both = gpu.download(&y, 2 * rows).unwrap();
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&both[rows..]),
                    bits(&both[..rows]),
                    "{name}, K = {k}, f16 x"
                );
            }
            check("SwiGLU", &swiglu, &|r| {
                let ((g, gm), (u, um)) = (a.dot(r, &x), b.dot(r, &x));
                let (tg, tu) = (tolerance(gm), tolerance(um));
                // |silu'| <= 1.1; the bound takes the larger |u| and |silu(g)| within reach.
                let tol = 1.1 * tg * (u.abs() + tu) + (silu(g).abs() + 1.1 * tg) * tu;
                (silu(g) * u, tol + 1e-4)
            });

            // q/k/v: three matrices in one grid (q the first half of A's rows, k and v a
            // quarter each of B's and C's), q with a bias.
            let (qr, kr) = (rows / 2, rows / 4);
            let bias = random(qr, 7, -0.5, 0.5);
            let bias_d = gpu.upload(&bias).unwrap();
            let out = gpu.zeros::<f32>(qr + 2 * kr).unwrap();
            let args = QkvArgs {
                m: [a, b, c].map(|m| m.dev.as_ref(gpu)),
                bias: [gpu.ptr(&bias_d), 0, 0],
                rows: [qr as i32, kr as i32, kr as i32],
            };
            ops.qkv(args, k, xp, gpu.ptr(&out)).unwrap();
            check("q/k/v", &gpu.download(&out, qr + 2 * kr).unwrap(), &|r| {
                let (m, row, b) = match r {
                    r if r < qr => (a, r, bias[r]),
                    r if r < qr + kr => (b, r - qr, 0.0),
                    r => (c, r - qr - kr, 0.0),
                };
                let (v, mag) = m.dot(row, &x);
                (v + b, tolerance(mag))
            });
        }
    }
    println!(
        "GEMV kernels at K = {KS:?}: worst |error| / tolerance {worst:.3} over {} settings",
        settings().len()
    );
}

/// Down past K = 24,576 (GEMV2_MAX_K), which only an f16 x reaches (the 32B shape's K =
/// 27,648), against the CPU on the f16-rounded x: `y = W x`, then `y += W x` over it as down
/// adds to the residual, and the CTAs' sums of squares of what they wrote. 77 rows take a
/// K-walking kernel: on the device as it is, where it lets a CTA take 192 KiB (Hopper), the
/// 16-warp one (2 CTAs of 40 rows, the last one 3 short); with 163 KiB a CTA (sm_80's limit,
/// set on the device's capabilities before the kernels load) the 8-warp one (4 CTAs of 20
/// rows, the last one's fourth row lane 2 rows short). 6,000 rows (past the H200's 132 SMs x 2
/// x 20) take the J = 4 walk. K = 32,768 is the largest any takes. On Hopper, K = 27,648
/// takes the 27-warp row walk instead (`DV2_DOWN_W27`; 77 CTAs of a row, and 6,000 rows over
/// the SMs), its K walk under `DV2_DOWN_W27=0`.
#[test]
fn gemv_v2_from_f16_x_past_the_f32_limit_matches_the_cpu() {
    for (smem_cap, down_w27) in [(None, true), (None, false), (Some(163 << 10), true)] {
        if !f16_x_past_the_f32_limit_matches_the_cpu(smem_cap, down_w27) {
            return;
        }
    }
}

/// [`gemv_v2_from_f16_x_past_the_f32_limit_matches_the_cpu`] with the device's shared memory a
/// CTA capped at `smem_cap` and `DV2_DOWN_W27` set to `down_w27`; false where CUDA is absent
/// (skipped).
fn f16_x_past_the_f32_limit_matches_the_cpu(smem_cap: Option<usize>, down_w27: bool) -> bool {
    let cfg = Config {
        down_w27,
        ..Config::from_env()
    };
    let Some(mut gpu) = cuda_or_skip("GPU", Gpu::open(0, &cfg)) else {
        return false;
    };
    if let Some(cap) = smem_cap {
        gpu.caps.max_smem_per_cta = cap;
    }
    let mut ops = Ops::new(gpu, cfg).unwrap();
    // The 16-warp walk's table at 128 KiB of the window, 64 KiB long.
    let w16 = ops.k.gemv2_kwalk_w16_room >= (128 + 64) << 10;
    assert_eq!(
        w16,
        smem_cap.is_none() && ops.gpu.caps.max_smem_per_cta >= 227 << 10,
        "the 16-warp K walk where a CTA may take 192 KiB, on Hopper"
    );
    // Forced: Auto takes v3 for a matrix this small (GEMV3_MAX_BYTES).
    ops.gemv = GemvChoice::Fixed(Gemv::V2);
    let gpu = &ops.gpu;
    for (i, (rows, k)) in [(77usize, 27_648usize), (77, 32_768), (6_000, 27_648)]
        .into_iter()
        .enumerate()
    {
        let a = Matrix::new(gpu, rows, k, 2 * i as u64 + 101);
        let (x16, x) = f16_rounded(&random(k, k as u64 + i as u64, -1.0, 1.0));
        let x16d = gpu.upload(&x16).unwrap();
        let parts = store_then_add_match_the_cpu(&ops, &a, Input::raw_f16(gpu.ptr(&x16d)), &x);
        // K = 27,648 on Hopper (DV2_DOWN_W27): the 27-warp row walk, a CTA a row up to the SMs.
        let w27 = k == 27_648 && w16 && ops.cfg.down_w27;
        if w27 && rows == 77 {
            assert_eq!(
                parts, 77,
                "K = {k}: 77 rows in the 27-warp walk's CTAs of one"
            );
        } else if rows == 77 {
            let (want, per_cta) = if w16 { (2, 40) } else { (4, 20) };
            assert_eq!(
                parts, want,
                "K = {k}: 77 rows in the K walk's CTAs of {per_cta}"
            );
        }
    }
    // Past 32,768 even an f16 x is refused, with the limits named.
    let k = 32_832;
    let a = Matrix::new(gpu, 16, k, 7);
    let x16 = gpu.zeros::<u16>(k).unwrap();
    let y = gpu.zeros::<f32>(16).unwrap();
    let err = ops
        .gemv(
            a.dev.as_ref(gpu),
            16,
            k,
            Input::raw_f16(gpu.ptr(&x16)),
            gpu.ptr(&y),
            false,
            0,
            0,
        )
        .unwrap_err();
    assert!(err.to_string().contains("32768 from f16 x"), "{err}");
    true
}

/// The K walk from f32 x, which GEMV v2 takes for matrices no wider than tall (the 32B shape's
/// o: 5,120 x 5,120; here also 290 x 256, its last CTA 10 rows short, and 1,030 x 1,024),
/// against the CPU on an x whose values f16 holds exactly (the walk stages x as f16): `y = W x`,
/// `y += W x` over it, and the sums of squares of one CTA a 20 rows.
#[test]
fn the_k_walk_from_f32_x_matches_the_cpu() {
    let cfg = Config::from_env();
    let Some(gpu) = cuda_or_skip("GPU", Gpu::open(0, &cfg)) else {
        return;
    };
    let mut ops = Ops::new(gpu, cfg).unwrap();
    // Forced: Auto takes v3 for the two small ones (GEMV3_MAX_BYTES).
    ops.gemv = GemvChoice::Fixed(Gemv::V2);
    let gpu = &ops.gpu;
    for (i, (rows, k)) in [(290usize, 256usize), (1_030, 1_024), (5_120, 5_120)]
        .into_iter()
        .enumerate()
    {
        let a = Matrix::new(gpu, rows, k, 2 * i as u64 + 301);
        let (_, x) = f16_rounded(&random(k, k as u64 + 7, -1.0, 1.0));
        let xd = gpu.upload(&x).unwrap();
        let parts = store_then_add_match_the_cpu(&ops, &a, Input::raw(gpu.ptr(&xd)), &x);
        assert_eq!(
            parts,
            rows.div_ceil(20),
            "{rows} x {k}: the K walk's CTAs of 20 rows"
        );
    }
}

/// `y = W x` from `xp` (on the device; `x` its values here), then `y += W x` over it, against
/// the CPU, and the CTAs' sums of squares of the first against its values; the count of those
/// sums (the GEMV's CTAs).
fn store_then_add_match_the_cpu(ops: &Ops, a: &Matrix, xp: Input, x: &[f32]) -> usize {
    let (gpu, k) = (&ops.gpu, x.len());
    let rows = a.w.len() / k;
    let y = gpu.zeros::<f32>(rows).unwrap();
    let ss = gpu.zeros::<f32>(1024).unwrap();
    let (m, y_at) = (a.dev.as_ref(gpu), gpu.ptr(&y));
    let parts = ops
        .gemv(m, rows, k, xp, y_at, false, 0, gpu.ptr(&ss))
        .unwrap();
    let once = gpu.download(&y, rows).unwrap();
    let sums: f32 = gpu.download(&ss, parts).unwrap().iter().sum();
    let want_ss: f32 = once.iter().map(|v| v * v).sum();
    assert!(
        (sums - want_ss).abs() <= 1e-4 * want_ss.max(1.0),
        "{rows} rows, K = {k}: {parts} partial sums add to {sums}, want {want_ss}"
    );
    ops.gemv(m, rows, k, xp, y_at, true, 0, 0).unwrap();
    let twice = gpu.download(&y, rows).unwrap();
    for r in 0..rows {
        let (v, mag) = a.dot(r, x);
        let tol = tolerance(mag);
        assert!(
            (once[r] - v).abs() <= tol,
            "{rows} rows, K = {k}, y = W x: row {r} got {}, want {v} (tolerance {tol})",
            once[r]
        );
        assert!(
            (twice[r] - (once[r] + v)).abs() <= 2.0 * tol,
            "{rows} rows, K = {k}, y += W x: row {r} got {}, want {} (tolerance {})",
            twice[r],
            once[r] + v,
            2.0 * tol
        );
    }
    parts
}

/// On a device that lets a CTA opt into 99 KiB of shared memory (sm_86, sm_89, sm_120: the
/// limit set on the H200's capabilities before the kernels load, so the driver holds every
/// GEMV to it), the 32B shape's down — K = 27,648 from f16 x, whose 69,120 bytes of x GEMV v2
/// stages beside ~38 KiB of its own — runs on GEMV v3 and matches the CPU, where GEMV v2
/// forced is refused naming both sizes instead of failing to launch.
#[test]
fn a_99_kib_device_runs_down_past_gemv_v2s_room_on_v3() {
    let cfg = Config::from_env();
    let Some(mut gpu) = cuda_or_skip("GPU", Gpu::open(0, &cfg)) else {
        return;
    };
    gpu.caps.max_smem_per_cta = 99 << 10;
    let mut ops = Ops::new(gpu, cfg).unwrap();
    let gpu = &ops.gpu;
    // 640 rows: 8.8 MB of NF4, past the size below which Auto takes v3 anyway.
    let (rows, k) = (640, 27_648);
    let a = Matrix::new(gpu, rows, k, 211);
    let (x16, x) = f16_rounded(&random(k, 5, -1.0, 1.0));
    let x16d = gpu.upload(&x16).unwrap();
    let xp = Input::raw_f16(gpu.ptr(&x16d));
    let y = gpu.zeros::<f32>(rows).unwrap();
    assert!(
        !ops.gemv_takes_f16(rows, k),
        "v3 takes down here, and v3 reads f32"
    );
    let x32 = gpu.upload(&x).unwrap();
    ops.gemv(
        a.dev.as_ref(gpu),
        rows,
        k,
        Input::raw(gpu.ptr(&x32)),
        gpu.ptr(&y),
        false,
        0,
        0,
    )
    .unwrap();
    let got = gpu.download(&y, rows).unwrap();
    for (r, &g) in got.iter().enumerate() {
        let (v, m) = a.dot(r, &x);
        let tol = tolerance(m);
        assert!(
            (g - v).abs() <= tol,
            "row {r}: got {g}, want {v} (tolerance {tol})"
        );
    }
    ops.gemv = GemvChoice::Fixed(Gemv::V2);
    let err = ops
        .gemv(a.dev.as_ref(gpu), rows, k, xp, gpu.ptr(&y), false, 0, 0)
        .unwrap_err();
    assert!(
        err.to_string().contains("69120 bytes of shared memory"),
        "{err}"
    );
}

/// lm_head and its argmax in one kernel at K = 5,120 against the CPU, by both walks: SwiGLU's
/// 20-warp walk (the default where the device runs it) and J = 3 (`DV2_LOGITS_W20=0`). The
/// logits within [`tolerance`] of the CPU's, and the id left in the state the lowest index
/// of the largest logit the kernel wrote. 40,003 rows: 304 a CTA at 132 SMs, the last CTA's
/// short (the 32B shape's 152,064 runs in its oracle gate, cuda_gates).
#[test]
fn lm_head_and_its_argmax_match_the_cpu_on_both_walks() {
    let cfg = Config::from_env();
    let Some(gpu) = cuda_or_skip("GPU", Gpu::open(0, &cfg)) else {
        return;
    };
    let mut ops = Ops::new(gpu, cfg).unwrap();
    let (rows, k) = (40_003usize, 5_120usize);
    let a = Matrix::new(&ops.gpu, rows, k, 911);
    let x = random(k, 913, -1.0, 1.0);
    let want: Vec<(f32, f32)> = (0..rows).map(|r| a.dot(r, &x)).collect();
    for w20 in [true, false] {
        ops.cfg.logits_w20 = w20;
        let gpu = &ops.gpu;
        let xd = gpu.upload(&x).unwrap();
        let y = gpu.zeros::<f32>(rows).unwrap();
        let st = gpu.zeros::<i32>(state::LEN).unwrap();
        let scratch = gpu.zeros::<i32>(ARGMAX_SCRATCH).unwrap();
        let head = LogitsHead {
            state: gpu.ptr(&st),
            scratch: gpu.ptr(&scratch),
            eos: -1,
            ring: 0,
            hist: 0,
        };
        let input = Input::raw(gpu.ptr(&xd));
        let ran = ops
            .logits_argmax(a.dev.as_ref(gpu), rows, k, input, gpu.ptr(&y), 0, head)
            .unwrap();
        assert!(
            ran,
            "w20 {w20}: lm_head's argmax kernel applies at {rows} x {k}"
        );
        let got = gpu.download(&y, rows).unwrap();
        for (r, (g, (v, mag))) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - v).abs() <= tolerance(*mag),
                "w20 {w20}: row {r}: {g} vs {v}"
            );
        }
        let id = gpu.download(&st, state::LEN).unwrap()[state::NEXT_TOKEN];
        assert_eq!(
            id as u32,
            decodev2::oracle::argmax(&got),
            "w20 {w20}: the argmax of the logits the kernel wrote"
        );
    }
}

/// A prefill chunk's linears at 1 to 8 columns (`Ops::gemm`, x f16 [n][K]), on GEMV v3's
/// column kernels (the default) and on the GEMM (`DV2_PREFILL_GEMV=0`), against the CPU on
/// the f16-rounded x: q/k/v stacked with a bias, `y += W x` over a residual, and SwiGLU
/// written as f16. K = 2,048 and 11,008 (the 3B shape's) fit eight columns a launch; 27,648
/// (the 32B shape's down) three, so its eight go in three launches staged (`DV2_COLS_X_L2=0`);
/// from L2 (the default where each group has a CTA of its own) every column in one launch, a
/// group's K split across a cluster of two CTAs (the default where the groups leave CTA slots
/// empty; 200 rows: every launch takes clusters) and not (`DV2_COLS_SPLIT=0`).
#[test]
fn a_short_prefill_chunks_linears_match_the_cpu_on_both_paths() {
    let cfg = Config::from_env();
    let Some(gpu) = cuda_or_skip("GPU", Gpu::open(0, &cfg)) else {
        return;
    };
    let mut ops = Ops::new(gpu, cfg.clone()).unwrap();
    let mut worst = 0f32;
    for k in [2048, 11008, 27648] {
        let rows = 200;
        let gpu = &ops.gpu;
        let seed = k as u64;
        let [a, b, c] = [1, 3, 5].map(|m| Matrix::new(gpu, rows, k, seed + m));
        let bias = random(rows, seed + 7, -0.5, 0.5);
        let bias_d = gpu.upload(&bias).unwrap();
        for n in [1, 3, 8] {
            let (x16, x) = f16_rounded(&random(n * k, seed + 9 + n as u64, -1.0, 1.0));
            let x16d = gpu.upload(&x16).unwrap();
            let residual = random(n * rows, seed + 11, -1.0, 1.0);
            let paths = [
                (true, false, false),
                (true, true, false),
                (true, true, true),
                (false, false, false),
            ];
            for (on, l2, split) in paths {
                ops.cfg.prefill_gemv = on;
                ops.cfg.cols_x_l2 = l2;
                ops.cfg.cols_split = split;
                let gpu = &ops.gpu;
                let path = match (on, l2, split) {
                    (true, false, _) => "GEMV v3 columns, x staged (DV2_COLS_X_L2=0)",
                    (true, true, false) => "GEMV v3 columns, x from L2 (DV2_COLS_SPLIT=0)",
                    (true, true, true) => "GEMV v3 columns, x from L2, K split in clusters",
                    _ => "GEMM",
                };
                let mut check =
                    |what: &str, got: &[f32], want: &dyn Fn(usize, usize) -> (f32, f32)| {
                        for (i, g) in got.iter().enumerate() {
                            let (col, r) = (i / (got.len() / n), i % (got.len() / n));
                            let (v, tol) = want(col, r);
                            let err = (g - v).abs();
                            worst = worst.max(err / tol);
                            assert!(
                                err <= tol,
                                "{path}, K = {k}, n = {n}, {what}: column {col} row {r} got {g}, \
                             want {v} (tolerance {tol})"
                            );
                        }
                    };
                let xcol = |col: usize| &x[col * k..(col + 1) * k];
                let x_ptr = gpu.ptr(&x16d);

                // q/k/v-like: A's rows with a bias, then B's and C's half each.
                let mats = [
                    GemmMatrix {
                        m: a.dev.as_ref(gpu),
                        rows,
                        bias: gpu.ptr(&bias_d),
                    },
                    GemmMatrix {
                        m: b.dev.as_ref(gpu),
                        rows: rows / 2,
                        bias: 0,
                    },
                    GemmMatrix {
                        m: c.dev.as_ref(gpu),
                        rows: rows / 2,
                        bias: 0,
                    },
                ];
                let ld = 2 * rows;
                let y = gpu.zeros::<f32>(n * ld).unwrap();
                ops.gemm(
                    Epilogue::Store,
                    &mats,
                    k,
                    x_ptr,
                    n,
                    gpu.ptr(&y),
                    ld,
                    0,
                    true,
                )
                .unwrap();
                check(
                    "stacked store",
                    &gpu.download(&y, n * ld).unwrap(),
                    &|col, r| {
                        let (m, row, add) = match r {
                            r if r < rows => (&a, r, bias[r]),
                            r if r < rows + rows / 2 => (&b, r - rows, 0.0),
                            r => (&c, r - rows - rows / 2, 0.0),
                        };
                        let (v, mag) = m.dot(row, xcol(col));
                        (v + add, tolerance(mag))
                    },
                );

                // The residual: y += A x.
                let y = gpu.upload(&residual).unwrap();
                ops.gemm(
                    Epilogue::Accumulate,
                    &mats[..1],
                    k,
                    x_ptr,
                    n,
                    gpu.ptr(&y),
                    rows,
                    0,
                    true,
                )
                .unwrap();
                check(
                    "accumulate",
                    &gpu.download(&y, n * rows).unwrap(),
                    &|col, r| {
                        let (v, mag) = a.dot(r, xcol(col));
                        (residual[col * rows + r] + v, tolerance(mag))
                    },
                );

                // SwiGLU of A and B, written as f16.
                let gate_up = [
                    GemmMatrix {
                        m: a.dev.as_ref(gpu),
                        rows,
                        bias: 0,
                    },
                    GemmMatrix {
                        m: b.dev.as_ref(gpu),
                        rows,
                        bias: 0,
                    },
                ];
                let out = gpu.zeros::<u16>(n * rows).unwrap();
                ops.gemm(
                    Epilogue::Swiglu,
                    &gate_up,
                    k,
                    x_ptr,
                    n,
                    gpu.ptr(&out),
                    rows,
                    0,
                    true,
                )
                .unwrap();
                let got: Vec<f32> = gpu
                    .download(&out, n * rows)
                    .unwrap()
                    .iter()
                    .map(|&h| f16::from_bits(h).to_f32())
                    .collect();
                check("SwiGLU (f16)", &got, &|col, r| {
                    let ((g, gm), (u, um)) = (a.dot(r, xcol(col)), b.dot(r, xcol(col)));
                    let (tg, tu) = (tolerance(gm), tolerance(um));
                    let v = silu(g) * u;
                    let tol = 1.1 * tg * (u.abs() + tu) + (silu(g).abs() + 1.1 * tg) * tu;
                    // Plus f16's rounding of the output.
                    (v, tol + v.abs() / 1024.0 + 1e-4)
                });
            }
        }
    }
    println!("short prefill chunks' linears: worst |error| / tolerance {worst:.3}");
}

/// `DV2_QKV_ROPE`: the q/k/v column kernel that applies RoPE itself stores what the plain
/// column store followed by rope_kv_rows' arithmetic would (that store's sums rotated on the
/// CPU), and writes k and v into the cache at each column's position, on every column path.
#[test]
fn qkv_rope_stores_the_rotated_sums_and_the_cache() {
    let cfg = Config::from_env();
    let Some(gpu) = cuda_or_skip("GPU", Gpu::open(0, &cfg)) else {
        return;
    };
    let mut ops = Ops::new(gpu, cfg.clone()).unwrap();
    let (k, hd, n_q, n_kv, max_seq, pos0) = (2048, 64, 4, 2, 32, 5);
    let (half, kv_dim) = (hd / 2, n_kv * hd);
    let (q_rows, qkv_rows) = (n_q * hd, (n_q + 2 * n_kv) * hd);
    let gpu = &ops.gpu;
    let [a, b, c] =
        [1, 3, 5].map(|m| Matrix::new(gpu, if m == 1 { q_rows } else { kv_dim }, k, 40 + m));
    let bias = random(q_rows, 47, -0.5, 0.5);
    let bias_d = gpu.upload(&bias).unwrap();
    let cos = random(max_seq * half, 48, -1.0, 1.0);
    let sin = random(max_seq * half, 49, -1.0, 1.0);
    let (cos_d, sin_d) = (gpu.upload(&cos).unwrap(), gpu.upload(&sin).unwrap());
    let mut st = vec![0i32; state::LEN];
    st[state::POSITION] = pos0 as i32;
    let state_d = gpu.upload(&st).unwrap();
    let bf16 = |v: f32| half::bf16::from_f32(v).to_bits();
    for n in [1, 3, 8] {
        let (x16, _) = f16_rounded(&random(n * k, 50 + n as u64, -1.0, 1.0));
        for (l2, split) in [(false, false), (true, false), (true, true)] {
            ops.cfg.prefill_gemv = true;
            ops.cfg.cols_x_l2 = l2;
            ops.cfg.cols_split = split;
            let gpu = &ops.gpu;
            let x16d = gpu.upload(&x16).unwrap();
            let mats = [
                GemmMatrix {
                    m: a.dev.as_ref(gpu),
                    rows: q_rows,
                    bias: gpu.ptr(&bias_d),
                },
                GemmMatrix {
                    m: b.dev.as_ref(gpu),
                    rows: kv_dim,
                    bias: 0,
                },
                GemmMatrix {
                    m: c.dev.as_ref(gpu),
                    rows: kv_dim,
                    bias: 0,
                },
            ];
            let plain = gpu.zeros::<f32>(n * qkv_rows).unwrap();
            ops.cfg.qkv_rope = false;
            let x = gpu.ptr(&x16d);
            ops.gemm(
                Epilogue::Store,
                &mats,
                k,
                x,
                n,
                gpu.ptr(&plain),
                qkv_rows,
                0,
                true,
            )
            .unwrap();
            let plain = gpu.download(&plain, n * qkv_rows).unwrap();
            let rotated = gpu.zeros::<f32>(n * qkv_rows).unwrap();
            let k_cache = gpu.zeros::<u16>(max_seq * kv_dim).unwrap();
            let v_cache = gpu.zeros::<u16>(max_seq * kv_dim).unwrap();
            let rope = RopeArgs {
                k_cache: gpu.ptr(&k_cache),
                v_cache: gpu.ptr(&v_cache),
                cos: gpu.ptr(&cos_d),
                sin: gpu.ptr(&sin_d),
                state: gpu.ptr(&state_d),
                n_q: n_q as i32,
                n_kv: n_kv as i32,
                head_dim: hd as i32,
                col0: 0,
            };
            ops.cfg.qkv_rope = true;
            let ran = ops
                .qkv_rope(&mats, k, x, n, gpu.ptr(&rotated), qkv_rows, rope)
                .unwrap();
            assert!(ran, "the column kernels take {n} columns");
            let rotated = gpu.download(&rotated, n * qkv_rows).unwrap();
            let k_cache = gpu.download(&k_cache, max_seq * kv_dim).unwrap();
            let v_cache = gpu.download(&v_cache, max_seq * kv_dim).unwrap();
            let path = format!("n = {n}, x from L2 {l2}, split {split}");
            for col in 0..n {
                let (pos, row) = (pos0 + col, &plain[col * qkv_rows..(col + 1) * qkv_rows]);
                let got = &rotated[col * qkv_rows..(col + 1) * qkv_rows];
                for head in 0..n_q + 2 * n_kv {
                    for j in 0..half {
                        let (r, x1, x2) =
                            (head * hd + j, row[head * hd + j], row[head * hd + j + half]);
                        let (lo, hi) = if head < n_q + n_kv {
                            let (c, s) = (cos[pos * half + j], sin[pos * half + j]);
                            (x1 * c - x2 * s, x2 * c + x1 * s)
                        } else {
                            (x1, x2)
                        };
                        let tol = 1e-5 * (x1.abs() + x2.abs()) + 1e-6;
                        assert!(
                            (got[r] - lo).abs() <= tol && (got[r + half] - hi).abs() <= tol,
                            "{path}: column {col} head {head} dim {j}: got ({}, {}), want ({lo}, {hi})",
                            got[r],
                            got[r + half]
                        );
                        if head >= n_q {
                            let (cache, h) = if head < n_q + n_kv {
                                (&k_cache, head - n_q)
                            } else {
                                (&v_cache, head - n_q - n_kv)
                            };
                            let at = pos * kv_dim + h * hd + j;
                            for (stored, want) in
                                [(cache[at], got[r]), (cache[at + half], got[r + half])]
                            {
                                assert_eq!(
                                    stored,
                                    bf16(want),
                                    "{path}: cache at slot {pos}, head {head}, dim {j}"
                                );
                            }
                        }
                    }
                }
            }
            // Slots other than the chunk's untouched.
            for slot in (0..max_seq).filter(|s| !(pos0..pos0 + n).contains(s)) {
                let at = slot * kv_dim;
                assert!(
                    k_cache[at..at + kv_dim]
                        .iter()
                        .chain(&v_cache[at..at + kv_dim])
                        .all(|&w| w == 0),
                    "{path}: slot {slot} written"
                );
            }
        }
    }
}
