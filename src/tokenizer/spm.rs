//! SentencePiece BPE as llama.cpp runs it for a GGUF's `tokenizer.ggml.model = llama`
//! (Llama 2, Mistral, InternLM2): spaces as `▁` with a space before the text, the text's
//! characters merged pair by pair, always the adjacent pair whose merged piece scores highest
//! (leftmost on a tie), and what no piece covers spelled in byte pieces `<0xAB>`.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// A candidate merge of the symbols `left` and `right` (adjacent when queued), worth `score`;
/// `len`: their bytes together, which tells a stale candidate (one side merged since) apart.
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// Highest score first, then the leftmost.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// A run of the text's bytes, linked to its neighbours (`usize::MAX`: none).
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: usize,
    next: usize,
}

pub(super) struct Spm {
    ids: HashMap<String, u32>,
    scores: Vec<f32>,
    /// The id of each byte's `<0xAB>` piece.
    bytes: [Option<u32>; 256],
    unk: u32,
}

impl Spm {
    pub(super) fn new(tokens: &[String], scores: &[f32], unk: u32) -> Self {
        let mut bytes = [None; 256];
        for (i, t) in tokens.iter().enumerate() {
            if let Some(b) = byte_piece(t) {
                bytes[b as usize].get_or_insert(i as u32);
            }
        }
        let mut ids = HashMap::with_capacity(tokens.len());
        for (i, t) in tokens.iter().enumerate() {
            ids.entry(t.clone()).or_insert(i as u32);
        }
        Self {
            ids,
            scores: scores.to_vec(),
            bytes,
            unk,
        }
    }

    /// The ids of `text` (a fragment between special tokens); `space_prefix`: a space before
    /// it, as SentencePiece's dummy prefix.
    pub(super) fn encode(&self, text: &str, space_prefix: bool, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        let mut s = String::with_capacity(text.len() + 3);
        if space_prefix {
            s.push('\u{2581}');
        }
        s.push_str(&text.replace(' ', "\u{2581}"));
        let mut symbols: Vec<Symbol> = s
            .char_indices()
            .map(|(start, c)| Symbol {
                start,
                len: c.len_utf8(),
                prev: 0,
                next: 0,
            })
            .collect();
        let n = symbols.len();
        for (i, sym) in symbols.iter_mut().enumerate() {
            sym.prev = if i == 0 { usize::MAX } else { i - 1 };
            sym.next = if i + 1 == n { usize::MAX } else { i + 1 };
        }
        let mut queue = BinaryHeap::new();
        let push =
            |queue: &mut BinaryHeap<Bigram>, symbols: &[Symbol], left: usize, right: usize| {
                if left == usize::MAX || right == usize::MAX {
                    return;
                }
                let (l, r) = (symbols[left], symbols[right]);
                let piece = &s[l.start..r.start + r.len];
                if let Some(&id) = self.ids.get(piece) {
                    queue.push(Bigram {
                        score: self.scores.get(id as usize).copied().unwrap_or(0.0),
                        left,
                        right,
                        len: piece.len(),
                    });
                }
            };
        for i in 1..n {
            push(&mut queue, &symbols, i - 1, i);
        }
        while let Some(b) = queue.pop() {
            let (l, r) = (symbols[b.left], symbols[b.right]);
            if l.len == 0 || r.len == 0 || l.len + r.len != b.len || l.next != b.right {
                continue; // a side was merged since
            }
            symbols[b.left].len += r.len;
            symbols[b.left].next = r.next;
            symbols[b.right].len = 0;
            if r.next != usize::MAX {
                symbols[r.next].prev = b.left;
            }
            push(&mut queue, &symbols, l.prev, b.left);
            push(&mut queue, &symbols, b.left, symbols[b.left].next);
        }
        let mut i = if n > 0 { 0 } else { usize::MAX };
        while i != usize::MAX {
            let sym = symbols[i];
            let piece = &s[sym.start..sym.start + sym.len];
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                None => out.extend(
                    piece
                        .bytes()
                        .map(|b| self.bytes[b as usize].unwrap_or(self.unk)),
                ),
            }
            i = sym.next;
        }
    }
}

/// The byte a `<0xAB>` piece stands for.
pub(super) fn byte_piece(token: &str) -> Option<u8> {
    let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_the_best_scoring_pair_first() {
        let tokens: Vec<String> = ["<unk>", "\u{2581}", "a", "b", "ab", "\u{2581}a", "<0x63>"]
            .iter()
            .map(|t| t.to_string())
            .collect();
        // "▁ab": ▁a (score -1) beats ab (-2) only when it scores higher.
        let spm = Spm::new(&tokens, &[0.0, 0.0, 0.0, 0.0, -2.0, -1.0, 0.0], 0);
        let mut out = Vec::new();
        spm.encode("ab", true, &mut out);
        assert_eq!(out, [5, 3]);
        let spm = Spm::new(&tokens, &[0.0, 0.0, 0.0, 0.0, -1.0, -2.0, 0.0], 0);
        out.clear();
        spm.encode("ab", true, &mut out);
        assert_eq!(out, [1, 4]);
        // No piece for 'c': its byte piece; none for 'd': unknown.
        out.clear();
        spm.encode("cd", false, &mut out);
        assert_eq!(out, [6, 0]);
    }
}
