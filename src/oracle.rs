//! The CPU f32 oracle: the judge of every backend (seed spec §3).
//!
//! Math, all f32: embedding row gather (NF4 row dequantized); RMSNorm
//! `x * rsqrt(mean(x^2) + eps) * w`; NF4 weights dequantized then multiplied; rotate-half
//! RoPE; GQA attention without repeating KV, scale `head_dim^-0.5`, over slots
//! `t < valid_len = pos + 1` only (slots past it are never read, whatever they hold); residual
//! adds; SwiGLU `down(silu(gate) * up)`; final RMSNorm; lm_head (the embedding when tied).

use half::bf16;

use crate::arch::ArchSpec;
use crate::error::{Error, Result};
use crate::model::{internlm_wqkv_rows, HostModel, Layer, QkvWeights};
use crate::nf4::Nf4Matrix;
use crate::rope::RopeTable;
use crate::state::Kv;

/// f32 KV cache `[layers, max_seq, n_kv, head_dim]` for keys and for values.
#[derive(Clone, Debug)]
pub struct KvCache {
    pub max_seq: usize,
    kv_dim: usize,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

impl KvCache {
    pub fn new(spec: &ArchSpec, max_seq: usize) -> Result<Self> {
        let len = spec
            .n_layers
            .checked_mul(max_seq)
            .and_then(|n| n.checked_mul(spec.kv_dim()))
            .ok_or_else(|| {
                Error::OutOfMemory(format!("a KV cache of {max_seq} slots overflows"))
            })?;
        Ok(Self {
            max_seq,
            kv_dim: spec.kv_dim(),
            k: crate::error::host_buffer(len, "KV cache (keys)")?,
            v: crate::error::host_buffer(len, "KV cache (values)")?,
        })
    }

    fn slot(&self, layer: usize, pos: usize) -> std::ops::Range<usize> {
        let start = (layer * self.max_seq + pos) * self.kv_dim;
        start..start + self.kv_dim
    }

    /// Layer `layer`'s slots 0..n in [`Self::k`] and [`Self::v`].
    fn prefix_of(&self, layer: usize, n: usize) -> std::ops::Range<usize> {
        let first = self.slot(layer, 0).start;
        first..first + n * self.kv_dim
    }

    /// Layer `layer`'s keys or values at slots 0..n: what a state file holds of it.
    pub fn layer_prefix(&self, kv: Kv, layer: usize, n: usize) -> &[f32] {
        let at = self.prefix_of(layer, n);
        match kv {
            Kv::Keys => &self.k[at],
            Kv::Values => &self.v[at],
        }
    }

    /// [`Self::layer_prefix`], to be written (a state file loaded).
    pub fn layer_prefix_mut(&mut self, kv: Kv, layer: usize, n: usize) -> &mut [f32] {
        let at = self.prefix_of(layer, n);
        match kv {
            Kv::Keys => &mut self.k[at],
            Kv::Values => &mut self.v[at],
        }
    }

    /// Fills slot `pos` of every layer, keys and values, with `value` (dirty-tail tests).
    pub fn fill_slot(&mut self, n_layers: usize, pos: usize, value: f32) {
        for l in 0..n_layers {
            let r = self.slot(l, pos);
            self.k[r.clone()].fill(value);
            self.v[r].fill(value);
        }
    }
}

/// Rows (or keys) whose dot products one pass carries together: each sum is one chain of adds
/// in K order, and interleaving independent chains lets the CPU overlap them (the sums, and so
/// every result, are unchanged).
const ROWS_TOGETHER: usize = 8;

/// `y = W x` with W in NF4, rows computed on every core (each row's sum in K order).
pub fn matvec(w: &Nf4Matrix, x: &[f32], y: &mut [f32]) {
    debug_assert_eq!((x.len(), y.len()), (w.cols, w.rows));
    crate::par::for_rows(y, 1, w.cols, |first, ys| {
        let rest = first + ys.len() / ROWS_TOGETHER * ROWS_TOGETHER;
        let mut groups = ys.chunks_exact_mut(ROWS_TOGETHER);
        for (g, out) in groups.by_ref().enumerate() {
            out.copy_from_slice(&w.dot_rows::<ROWS_TOGETHER>(first + g * ROWS_TOGETHER, x));
        }
        for (i, out) in groups.into_remainder().iter_mut().enumerate() {
            [*out] = w.dot_rows::<1>(rest + i, x);
        }
    });
}

/// `W x` for each of the `xs.len() / cols` inputs of `xs` (row-major), row-major in the result:
/// each value the one [`matvec`] gives for that input, to the bit, with each weight decoded once
/// for 8 inputs ([`Nf4Matrix::dot_rows_x8`]). Rows on every core, each thread's rows over every
/// group of 8 inputs (their weights stay in its cache).
pub fn matmul(w: &Nf4Matrix, xs: &[f32]) -> Vec<f32> {
    let (rows, cols) = (w.rows, w.cols);
    let n = xs.len() / cols;
    let groups = n.div_ceil(8);
    // Input group g's column c at xt[g * cols + c], lane t: input 8 g + t (0 past n).
    let mut xt = vec![[0f32; 8]; groups * cols];
    for (i, x) in xs.chunks_exact(cols).enumerate() {
        for (c, v) in x.iter().enumerate() {
            xt[(i / 8) * cols + c][i % 8] = *v;
        }
    }
    // Row r's sums for group g at yt[r * groups + g].
    let mut yt = vec![[0f32; 8]; rows * groups];
    crate::par::for_rows(&mut yt, groups, 8 * groups * cols, |first, out| {
        let mut row = first;
        let mut left = out;
        while !left.is_empty() {
            let together = if left.len() >= ROWS_TOGETHER * groups {
                ROWS_TOGETHER
            } else {
                1
            };
            let (now, rest) = left.split_at_mut(together * groups);
            for g in 0..groups {
                let inputs = &xt[g * cols..(g + 1) * cols];
                if together == ROWS_TOGETHER {
                    let sums = w.dot_rows_x8::<ROWS_TOGETHER>(row, inputs);
                    for (j, s) in sums.into_iter().enumerate() {
                        now[j * groups + g] = s;
                    }
                } else {
                    [now[g]] = w.dot_rows_x8::<1>(row, inputs);
                }
            }
            row += together;
            left = rest;
        }
    });
    let mut ys = vec![0f32; n * rows];
    for (r, sums) in yt.chunks_exact(groups).enumerate() {
        for (i, y) in ys.iter_mut().skip(r).step_by(rows).enumerate() {
            *y = sums[i / 8][i % 8];
        }
    }
    ys
}

/// RMSNorm into `out`.
pub fn rms_norm(x: &[f32], w: &[bf16], eps: f32, out: &mut [f32]) {
    let mean_sq = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let r = 1.0 / (mean_sq + eps).sqrt();
    for ((o, v), g) in out.iter_mut().zip(x).zip(w) {
        *o = v * r * g.to_f32();
    }
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Index of the largest value; the lowest index wins a tie, NaN never wins.
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in values.iter().enumerate() {
        if *v > values[best] || values[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

/// `W x` for each input of `xs` (one or more rows of `w.cols`): [`matvec`] for one, [`matmul`]
/// for more (the same values).
fn linear(w: &Nf4Matrix, xs: &[f32]) -> Vec<f32> {
    if xs.len() == w.cols {
        let mut y = vec![0f32; w.rows];
        matvec(w, xs, &mut y);
        return y;
    }
    matmul(w, xs)
}

/// Projects the normed inputs (`xn`: rows of hidden) to (q, k, v) (rows of q_dim, kv_dim,
/// kv_dim), biases added, InternLM2 packing undone.
fn project_qkv(spec: &ArchSpec, layer: &Layer, xn: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let kv = spec.kv_dim();
    match &layer.qkv {
        QkvWeights::Separate { q, k, v } => {
            let [q, k, v] = [q, k, v].map(|lin| {
                let mut y = linear(&lin.weight, xn);
                if let Some(b) = &lin.bias {
                    y.chunks_exact_mut(b.len())
                        .for_each(|y| y.iter_mut().zip(b).for_each(|(y, b)| *y += b));
                }
                y
            });
            (q, k, v)
        }
        QkvWeights::InternlmFused { wqkv } => {
            let packed = linear(wqkv, xn);
            let order = internlm_wqkv_rows(spec);
            let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
            for row in packed.chunks_exact(wqkv.rows) {
                let split: Vec<f32> = order.iter().map(|&r| row[r]).collect();
                let (qr, rest) = split.split_at(spec.q_dim());
                let (kr, vr) = rest.split_at(kv);
                q.extend_from_slice(qr);
                k.extend_from_slice(kr);
                v.extend_from_slice(vr);
            }
            (q, k, v)
        }
    }
}

/// `x`'s dot products with each of the N rows, each summed in order from −0.0 (`Iterator::sum`'s
/// result, to the bit), the N chains of adds interleaved (see [`ROWS_TOGETHER`]).
fn dots<const N: usize>(x: &[f32], rows: [&[f32]; N]) -> [f32; N] {
    let mut sums = [-0.0f32; N];
    for (d, xd) in x.iter().enumerate() {
        for (sum, row) in sums.iter_mut().zip(&rows) {
            *sum += xd * row[d];
        }
    }
    sums
}

/// One query head's attention over slots `0..scores.len()` of layer `l`, KV head `kvh`, into
/// `out`: softmax of the scaled scores, then the values weighted by it.
fn attend(
    kv: &KvCache,
    l: usize,
    kvh: usize,
    q_head: &[f32],
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let hd = q_head.len();
    let key = |t: usize| &kv.k[kv.slot(l, t)][kvh * hd..(kvh + 1) * hd];
    // Scores of ROWS_TOGETHER keys at a time, the rest one by one.
    let rest = scores.len() / ROWS_TOGETHER * ROWS_TOGETHER;
    let mut groups = scores.chunks_exact_mut(ROWS_TOGETHER);
    for (g, group) in groups.by_ref().enumerate() {
        let keys = std::array::from_fn(|j| key(g * ROWS_TOGETHER + j));
        for (score, sum) in group.iter_mut().zip(dots::<ROWS_TOGETHER>(q_head, keys)) {
            *score = sum * scale;
        }
    }
    for (i, score) in groups.into_remainder().iter_mut().enumerate() {
        let [sum] = dots(q_head, [key(rest + i)]);
        *score = sum * scale;
    }
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
    scores.iter_mut().for_each(|v| *v = (*v - max).exp());
    let denom: f32 = scores.iter().sum();
    out.fill(0.0);
    for (t, p) in scores.iter().enumerate() {
        let value = &kv.v[kv.slot(l, t)][kvh * hd..(kvh + 1) * hd];
        out.iter_mut().zip(value).for_each(|(o, v)| *o += p * v);
    }
    out.iter_mut().for_each(|o| *o /= denom);
}

/// One teacher-forced position: feeds `id` at `pos`, writes its K/V into slot `pos`, attends
/// to slots `0..=pos`, returns the logits `[vocab]`.
pub fn forward_token(
    model: &HostModel,
    rope: &RopeTable,
    kv: &mut KvCache,
    id: u32,
    pos: usize,
) -> Result<Vec<f32>> {
    forward_chunk(model, rope, kv, &[id], pos)
}

/// The most prompt ids the CPU backend's prefill and [`greedy`] feed through one
/// [`forward_chunk`]: its activations are that many rows of each linear's output, a few MB
/// at most.
pub const FORWARD_CHUNK: usize = 64;

/// Feeds `ids` at positions `pos0..` (their K/V into those slots) and returns the last one's
/// logits `[vocab]`: the same values as [`forward_token`] on each id in turn, to the bit (each
/// token's sums in the same order), with each linear's weights decoded once for up to 8 ids.
/// Refused, with nothing written, where an id is past the vocabulary or the ids past max_seq.
pub fn forward_chunk(
    model: &HostModel,
    rope: &RopeTable,
    kv: &mut KvCache,
    ids: &[u32],
    pos0: usize,
) -> Result<Vec<f32>> {
    let x = forward_layers(model, rope, kv, ids, pos0)?;
    Ok(logits_of_row(
        model,
        &x[(ids.len() - 1) * model.spec.hidden..],
    ))
}

/// [`forward_chunk`] with every id's logits `[ids.len()][vocab]`: row i the same values as
/// [`forward_token`] on `ids[i]` after the ids before it (a speculative draft's check).
pub fn forward_chunk_rows(
    model: &HostModel,
    rope: &RopeTable,
    kv: &mut KvCache,
    ids: &[u32],
    pos0: usize,
) -> Result<Vec<Vec<f32>>> {
    let x = forward_layers(model, rope, kv, ids, pos0)?;
    Ok(x.chunks_exact(model.spec.hidden)
        .map(|row| logits_of_row(model, row))
        .collect())
}

/// The final norm and lm_head of one row of the last layer's output.
fn logits_of_row(model: &HostModel, x: &[f32]) -> Vec<f32> {
    let s = &model.spec;
    let mut xn = vec![0f32; s.hidden];
    rms_norm(x, &model.final_norm, s.rms_eps, &mut xn);
    let mut logits = vec![0f32; s.vocab];
    matvec(model.lm_head(), &xn, &mut logits);
    logits
}

/// The layers of [`forward_chunk`]: the residual stream `[ids.len()][hidden]` after the last.
fn forward_layers(
    model: &HostModel,
    rope: &RopeTable,
    kv: &mut KvCache,
    ids: &[u32],
    pos0: usize,
) -> Result<Vec<f32>> {
    let s = &model.spec;
    if let Some(id) = ids.iter().find(|&&id| id as usize >= s.vocab) {
        return Err(Error::InvalidArgument(format!(
            "token id {id} >= vocab {}",
            s.vocab
        )));
    }
    let n = ids.len();
    if n == 0 {
        return Err(Error::InvalidArgument("no ids to feed".into()));
    }
    if pos0 + n > kv.max_seq {
        return Err(Error::SequenceFull(format!(
            "position {} >= max_seq {}",
            pos0 + n - 1,
            kv.max_seq
        )));
    }
    let (h, hd) = (s.hidden, s.head_dim);
    let group = s.n_q_heads / s.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut x = vec![0f32; n * h];
    for (row, &id) in x.chunks_exact_mut(h).zip(ids) {
        model.embed.dequantize_row(id as usize, row);
    }
    let mut xn = vec![0f32; n * h];
    let norm = |x: &[f32], w: &[bf16], xn: &mut [f32]| {
        for (x, xn) in x.chunks_exact(h).zip(xn.chunks_exact_mut(h)) {
            rms_norm(x, w, s.rms_eps, xn);
        }
    };
    let mut attn = vec![0f32; n * s.q_dim()];
    for (l, layer) in model.layers.iter().enumerate() {
        norm(&x, &layer.attn_norm, &mut xn);
        let (mut q, mut k, v) = project_qkv(s, layer, &xn);
        for (t, (q, k)) in q
            .chunks_exact_mut(s.q_dim())
            .zip(k.chunks_exact_mut(s.kv_dim()))
            .enumerate()
        {
            q.chunks_exact_mut(hd)
                .for_each(|head| rope.apply(head, pos0 + t));
            k.chunks_exact_mut(hd)
                .for_each(|head| rope.apply(head, pos0 + t));
            let slot = kv.slot(l, pos0 + t);
            kv.k[slot.clone()].copy_from_slice(k);
            kv.v[slot].copy_from_slice(&v[t * s.kv_dim()..(t + 1) * s.kv_dim()]);
        }
        // Each token attends to the slots up to its own. Heads on every core where the
        // context is long enough to pay for it; each head is one call's, so the split changes
        // no result.
        let kv = &*kv;
        for (t, (q, attn)) in q
            .chunks_exact(s.q_dim())
            .zip(attn.chunks_exact_mut(s.q_dim()))
            .enumerate()
        {
            let pos = pos0 + t;
            crate::par::for_rows(attn, hd, (pos + 1) * hd, |first, heads| {
                let mut scores = vec![0f32; pos + 1];
                for (i, out) in heads.chunks_exact_mut(hd).enumerate() {
                    let qh = first + i;
                    let q_head = &q[qh * hd..(qh + 1) * hd];
                    attend(kv, l, qh / group, q_head, scale, &mut scores, out);
                }
            });
        }
        let proj = linear(&layer.o, &attn);
        x.iter_mut().zip(&proj).for_each(|(x, p)| *x += p);

        norm(&x, &layer.ffn_norm, &mut xn);
        let mut gate = linear(&layer.gate, &xn);
        let up = linear(&layer.up, &xn);
        gate.iter_mut()
            .zip(&up)
            .for_each(|(g, u)| *g = silu(*g) * u);
        let proj = linear(&layer.down, &gate);
        x.iter_mut().zip(&proj).for_each(|(x, p)| *x += p);
    }
    Ok(x)
}

/// Teacher-forced logits `[ids.len()][vocab]` for `ids` fed at positions `pos0..`, over the
/// given cache (slots before `pos0` hold whatever earlier calls wrote).
pub fn step_logits(
    model: &HostModel,
    kv: &mut KvCache,
    ids: &[u32],
    pos0: usize,
) -> Result<Vec<Vec<f32>>> {
    let rope = RopeTable::for_model(model, kv.max_seq)?;
    ids.iter()
        .enumerate()
        .map(|(i, &id)| forward_token(model, &rope, kv, id, pos0 + i))
        .collect()
}

/// Greedy decoding from a fresh cache of the spec's max_seq: the prompt teacher-forced, then
/// `n_new` generated ids (the first is the argmax after the prompt).
pub fn greedy(model: &HostModel, prompt: &[u32], n_new: usize) -> Result<Vec<u32>> {
    let s = &model.spec;
    if prompt.is_empty() {
        return Err(Error::InvalidArgument("empty prompt".into()));
    }
    let mut kv = KvCache::new(s, s.max_seq)?;
    let rope = RopeTable::for_model(model, s.max_seq)?;
    // The prompt in chunks: the logits after it are the same bits as fed an id at a time.
    let mut logits = Vec::new();
    for (i, chunk) in prompt.chunks(FORWARD_CHUNK).enumerate() {
        logits = forward_chunk(model, &rope, &mut kv, chunk, FORWARD_CHUNK * i)?;
    }
    continue_greedy(model, &rope, &mut kv, logits, prompt.len(), n_new)
}

/// [`greedy`]'s ids after a prompt already fed: `kv` holds its `len` tokens and `logits` are
/// the logits after the last of them (the first id is their argmax).
pub fn greedy_after(
    model: &HostModel,
    kv: &mut KvCache,
    logits: Vec<f32>,
    len: usize,
    n_new: usize,
) -> Result<Vec<u32>> {
    let rope = RopeTable::for_model(model, kv.max_seq)?;
    continue_greedy(model, &rope, kv, logits, len, n_new)
}

fn continue_greedy(
    model: &HostModel,
    rope: &RopeTable,
    kv: &mut KvCache,
    mut logits: Vec<f32>,
    len: usize,
    n_new: usize,
) -> Result<Vec<u32>> {
    let mut out = Vec::with_capacity(n_new);
    for i in 0..n_new {
        let id = argmax(&logits);
        out.push(id);
        if i + 1 < n_new {
            logits = forward_token(model, rope, kv, id, len + i)?;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::{MEDIUM_LLAMA, TINY_INTERNLM, TINY_LLAMA};
    use crate::synth;

    #[test]
    fn matvec_equals_each_row_summed_alone() {
        let model = synth::build(&TINY_LLAMA, 0).unwrap();
        let gate = &model.layers[0].gate;
        let mut x = vec![0f32; gate.cols];
        model.embed.dequantize_row(3, &mut x);
        // Row counts below, at and past the interleave, not multiples of it.
        for rows in [1, 7, 8, 37] {
            let w = gate.select_rows(&(0..rows).collect::<Vec<_>>());
            let mut y = vec![f32::NAN; rows];
            matvec(&w, &x, &mut y);
            let mut row = vec![0f32; w.cols];
            for (r, got) in y.iter().enumerate() {
                w.dequantize_row(r, &mut row);
                let want: f32 = row.iter().zip(&x).map(|(a, b)| a * b).sum();
                assert_eq!(got.to_bits(), want.to_bits(), "{rows} rows, row {r}");
            }
        }
    }

    #[test]
    fn matmul_equals_matvec_for_each_input_to_the_bit() {
        let model = synth::build(&TINY_LLAMA, 0).unwrap();
        let up = &model.layers[0].up;
        let mut xs = vec![0f32; 13 * up.cols];
        for (t, x) in xs.chunks_exact_mut(up.cols).enumerate() {
            model.embed.dequantize_row(3 + t, x);
        }
        // Inputs below, at and past a group of 8; rows below, at and past the interleave.
        for (n, rows) in [(2, 1), (8, 7), (13, 37), (13, up.rows)] {
            let w = up.select_rows(&(0..rows).collect::<Vec<_>>());
            let ys = matmul(&w, &xs[..n * w.cols]);
            for (t, (x, got)) in xs
                .chunks_exact(w.cols)
                .zip(ys.chunks_exact(rows))
                .enumerate()
            {
                let mut want = vec![0f32; rows];
                matvec(&w, x, &mut want);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(got), bits(&want), "{n} inputs, {rows} rows, input {t}");
            }
        }
    }

    /// A chunk fed in one forward gives the same last logits and K/V, to the bit, as its ids fed
    /// one by one, with q/k/v biases, InternLM2's fused wqkv and GQA.
    #[test]
    fn a_chunk_equals_its_ids_fed_one_by_one() {
        let mut biased = synth::build(&TINY_LLAMA, 2).unwrap();
        for (l, layer) in biased.layers.iter_mut().enumerate() {
            let QkvWeights::Separate { q, k, v } = &mut layer.qkv else {
                unreachable!()
            };
            for (i, lin) in [q, k, v].into_iter().enumerate() {
                let rows = lin.weight.rows;
                lin.bias = Some(
                    (0..rows)
                        .map(|r| ((r * 7 + i + l) % 11) as f32 * 0.05 - 0.25)
                        .collect(),
                );
            }
        }
        let models = [
            biased,
            synth::build(&TINY_INTERNLM, 1).unwrap(),
            synth::build(&MEDIUM_LLAMA, 1).unwrap(),
        ];
        for model in &models {
            let spec = model.spec;
            let rope = RopeTable::for_model(model, 32).unwrap();
            let prompt = synth::prompt(spec.vocab, 18, 3);
            let (mut one, mut chunked) = (
                KvCache::new(&spec, 32).unwrap(),
                KvCache::new(&spec, 32).unwrap(),
            );
            let mut want = Vec::new();
            for (pos, &id) in prompt.iter().enumerate() {
                want = forward_token(model, &rope, &mut one, id, pos).unwrap();
            }
            for (pos, &id) in prompt[..5].iter().enumerate() {
                forward_token(model, &rope, &mut chunked, id, pos).unwrap();
            }
            let got = forward_chunk(model, &rope, &mut chunked, &prompt[5..], 5).unwrap();
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{:?}: logits", spec.family);
            for l in 0..spec.n_layers {
                for pos in 0..prompt.len() {
                    let slot = one.slot(l, pos);
                    assert_eq!(bits(&one.k[slot.clone()]), bits(&chunked.k[slot.clone()]));
                    assert_eq!(bits(&one.v[slot.clone()]), bits(&chunked.v[slot]));
                }
            }
        }
        let model = &models[0];
        let rope = RopeTable::for_model(model, model.spec.max_seq).unwrap();
        let mut kv = KvCache::new(&model.spec, model.spec.max_seq).unwrap();
        let full = forward_chunk(model, &rope, &mut kv, &[1, 2], model.spec.max_seq - 1);
        assert!(matches!(full, Err(Error::SequenceFull(_))), "{full:?}");
        let bad = forward_chunk(model, &rope, &mut kv, &[1, model.spec.vocab as u32], 0);
        assert!(matches!(bad, Err(Error::InvalidArgument(_))), "{bad:?}");
    }

    #[test]
    fn attention_equals_each_key_scored_alone() {
        let spec = ArchSpec {
            max_seq: 40,
            ..TINY_LLAMA
        };
        let model = synth::build(&spec, 0).unwrap();
        let mut kv = KvCache::new(&spec, spec.max_seq).unwrap();
        step_logits(&model, &mut kv, &synth::prompt(spec.vocab, 40, 5), 0).unwrap();
        let hd = spec.head_dim;
        let mut q = vec![0f32; spec.hidden];
        model.embed.dequantize_row(3, &mut q);
        let q = &q[..hd];
        let scale = 0.25;
        // Slot counts below, at and past the interleave, not multiples of it.
        for (len, l, kvh) in [(1, 0, 0), (8, 1, 1), (21, 1, 0), (40, 0, 1)] {
            let mut scores = vec![0f32; len];
            let mut out = vec![0f32; hd];
            attend(&kv, l, kvh, q, scale, &mut scores, &mut out);
            // The plain definition: each score alone, softmax, the weighted values.
            let head = |c: &[f32], t: usize| c[kv.slot(l, t)][kvh * hd..(kvh + 1) * hd].to_vec();
            let want_scores: Vec<f32> = (0..len)
                .map(|t| {
                    q.iter()
                        .zip(head(&kv.k, t))
                        .map(|(a, b)| a * b)
                        .sum::<f32>()
                        * scale
                })
                .collect();
            let max = want_scores.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
            let p: Vec<f32> = want_scores.iter().map(|v| (v - max).exp()).collect();
            let denom: f32 = p.iter().sum();
            let mut want = vec![0f32; hd];
            for (t, p) in p.iter().enumerate() {
                want.iter_mut()
                    .zip(head(&kv.v, t))
                    .for_each(|(o, v)| *o += p * v);
            }
            want.iter_mut().for_each(|o| *o /= denom);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&out), bits(&want), "{len} slots");
        }
    }

    #[test]
    fn greedy_after_a_fed_prompt_equals_greedy() {
        let spec = MEDIUM_LLAMA;
        let model = synth::build(&spec, 1).unwrap();
        let prompt = synth::prompt(spec.vocab, 10, 2);
        let mut kv = KvCache::new(&spec, spec.max_seq).unwrap();
        let logits = step_logits(&model, &mut kv, &prompt, 0)
            .unwrap()
            .pop()
            .unwrap();
        assert_eq!(
            greedy_after(&model, &mut kv, logits, prompt.len(), 9).unwrap(),
            greedy(&model, &prompt, 9).unwrap()
        );
    }

    #[test]
    fn greedy_is_deterministic_on_the_seed_presets() {
        for (spec, seed) in [(TINY_LLAMA, 0), (TINY_INTERNLM, 1)] {
            let prompt = synth::prompt(spec.vocab, 8, seed);
            let a = greedy(&synth::build(&spec, seed).unwrap(), &prompt, 8).unwrap();
            let b = greedy(&synth::build(&spec, seed).unwrap(), &prompt, 8).unwrap();
            assert_eq!(a, b);
            // Not degenerate: a constant stream would hide broken attention or RoPE.
            assert!(
                a.iter().collect::<std::collections::HashSet<_>>().len() > 1,
                "{a:?}"
            );
        }
    }

    #[test]
    fn dirty_tail_is_ignored() {
        for (spec, seed) in [(TINY_LLAMA, 0), (TINY_INTERNLM, 1)] {
            let model = synth::build(&spec, seed).unwrap();
            let ids = [3u32, 7, 1];
            let mut clean = KvCache::new(&spec, spec.max_seq).unwrap();
            let want = step_logits(&model, &mut clean, &ids, 0).unwrap();
            let mut dirty = KvCache::new(&spec, spec.max_seq).unwrap();
            dirty.fill_slot(spec.n_layers, spec.max_seq - 1, 1.0e30);
            dirty.fill_slot(spec.n_layers, 5, -7.0e20);
            let got = step_logits(&model, &mut dirty, &ids, 0).unwrap();
            assert_eq!(got, want, "valid_len = pos + 1 must hide slots past it");
        }
    }

    #[test]
    fn the_dirty_slot_would_matter_if_read() {
        // Guards the test above: the same poison inside the valid range changes the output.
        let model = synth::build(&TINY_LLAMA, 0).unwrap();
        let mut kv = KvCache::new(&TINY_LLAMA, 16).unwrap();
        let clean = step_logits(&model, &mut kv, &[3, 7], 0).unwrap();
        kv.fill_slot(2, 0, 1.0e3);
        let rope = RopeTable::for_model(&model, 16).unwrap();
        let poisoned = forward_token(&model, &rope, &mut kv, 7, 1).unwrap();
        assert_ne!(poisoned, clean[1]);
    }

    #[test]
    fn gqa_and_internlm_split_agree_with_an_explicit_separate_model() {
        // Rebuild TINY_INTERNLM as a Separate model by selecting wqkv rows; outputs must match.
        let fused = synth::build(&TINY_INTERNLM, 1).unwrap();
        let mut separate = fused.clone();
        separate.spec.family = crate::arch::Family::LlamaSwiglu;
        let rows = internlm_wqkv_rows(&TINY_INTERNLM);
        for layer in &mut separate.layers {
            let QkvWeights::InternlmFused { wqkv } = &layer.qkv else {
                unreachable!()
            };
            let (h, kv) = (TINY_INTERNLM.hidden, TINY_INTERNLM.kv_dim());
            let lin = |r: &[usize]| crate::model::Linear {
                weight: wqkv.select_rows(r),
                bias: None,
            };
            layer.qkv = QkvWeights::Separate {
                q: lin(&rows[..h]),
                k: lin(&rows[h..h + kv]),
                v: lin(&rows[h + kv..]),
            };
        }
        separate.validate().unwrap();
        let ids = [1u32, 2, 3, 4];
        let a = step_logits(
            &fused,
            &mut KvCache::new(&TINY_INTERNLM, 16).unwrap(),
            &ids,
            0,
        )
        .unwrap();
        let b = step_logits(
            &separate,
            &mut KvCache::new(&TINY_INTERNLM, 16).unwrap(),
            &ids,
            0,
        )
        .unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn bad_ids_and_positions_are_errors() {
        let model = synth::build(&TINY_LLAMA, 0).unwrap();
        let mut kv = KvCache::new(&TINY_LLAMA, 16).unwrap();
        assert!(matches!(
            step_logits(&model, &mut kv, &[32], 0),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            step_logits(&model, &mut kv, &[1], 16),
            Err(Error::SequenceFull(_))
        ));
        assert_eq!(argmax(&[1.0, 3.0, 3.0, f32::NAN]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5]), 1);
    }
}
