//! Prompt-lookup drafts for speculative greedy decoding: the ids that followed the last
//! earlier occurrence of the request's last few ids. Text that repeats its context (code being
//! edited, a summary quoting its source, a list continued) repeats such runs; the backend
//! checks a draft in one forward ([`crate::backend::Backend::step_draft`]), so a draft only
//! costs time, never changes an id.

/// The longest draft a speculative step checks (the ABI's `DV2_MAX_DRAFT`): with the pending
/// id, 16 rows of one forward.
pub const MAX_DRAFT: usize = 15;

/// A request's ids (those fed, then the pending one) with an index of their runs of three and
/// of two ids (a draft is looked up by the last three ids, else two: a longer match predicts
/// better; one id alone matches too often to pay for the check), so that a draft takes a few
/// hash lookups instead of a scan of the whole context (at 32k ids, ~100 µs a step on a 2-core
/// host, against ~1 µs). The index is built the first time a draft is asked for and follows the
/// ids from then on: pushed ids are indexed at the next draft, truncated ones undone exactly.
#[derive(Debug, Default)]
pub struct Context {
    ids: Vec<u32>,
    pairs: Runs<2>,
    triples: Runs<3>,
}

impl Context {
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    pub fn push(&mut self, id: u32) {
        self.ids.push(id);
    }

    pub fn extend_from_slice(&mut self, ids: &[u32]) {
        self.ids.extend_from_slice(ids);
    }

    /// Keeps the first `len` ids (and the index of the runs among them).
    pub fn truncate(&mut self, len: usize) {
        self.pairs.forget_past(&self.ids, len);
        self.triples.forget_past(&self.ids, len);
        self.ids.truncate(len);
    }

    pub fn clear(&mut self) {
        self.truncate(0);
    }

    /// Replaces the ids (a loaded state's).
    pub fn set(&mut self, ids: &[u32]) {
        self.clear();
        self.extend_from_slice(ids);
    }

    /// Up to `max` ids that followed the most recent earlier occurrence of the last three (else
    /// two) ids; empty where none occurs. Where the occurrence is so recent that fewer than
    /// `max` ids follow it, the copy runs on into the ids it has copied (as an LZ77 match
    /// overlaps itself): the span between the two occurrences is taken to repeat, as in a loop.
    pub fn draft(&mut self, max: usize) -> Vec<u32> {
        if max == 0 {
            return Vec::new();
        }
        self.triples.index(&self.ids);
        self.pairs.index(&self.ids);
        let start = self
            .triples
            .latest_of_tail(&self.ids)
            .map(|s| (s, 3))
            .or_else(|| self.pairs.latest_of_tail(&self.ids).map(|s| (s, 2)));
        let Some((start, n)) = start else {
            return Vec::new();
        };
        let len = self.ids.len();
        let period = len - n - start;
        let mut draft: Vec<u32> = Vec::with_capacity(max);
        for i in 0..max {
            let at = start + n + i;
            draft.push(if at < len {
                self.ids[at]
            } else {
                draft[i - period]
            });
        }
        draft
    }
}

/// The runs of N ids of a context that end before its last id (the last run is the tail a
/// draft looks up, whose own occurrence does not count), as hash chains (LZ77's, zlib's):
/// `head[bucket]` is the latest start whose run hashes there, `earlier[start]` the start
/// before it in the same bucket (both + 1, 0 for none). A run is inserted in O(1) and undone
/// in O(1) (the chains are last in, first out); a lookup walks its bucket's chain to the first
/// start whose ids equal the tail, which with at least twice as many buckets as runs is
/// nearly always the first link.
#[derive(Debug, Default)]
struct Runs<const N: usize> {
    head: Vec<u32>,
    earlier: Vec<u32>,
}

impl<const N: usize> Runs<N> {
    /// The bucket of the run at `start`: a multiplicative hash of its ids, top bits.
    fn bucket(&self, ids: &[u32], start: usize) -> usize {
        let key = ids[start..start + N].iter().fold(0u64, |h, &id| {
            (h ^ id as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
        });
        (key >> (64 - self.head.len().trailing_zeros())) as usize
    }

    fn insert(&mut self, ids: &[u32], start: usize) {
        let b = self.bucket(ids, start);
        self.earlier.push(self.head[b]);
        self.head[b] = start as u32 + 1;
    }

    /// Indexes the runs pushed since the last call, with at least twice as many buckets as
    /// runs (re-inserting every run where the table grows).
    fn index(&mut self, ids: &[u32]) {
        let wanted = ids.len().saturating_sub(N);
        if 2 * wanted > self.head.len() {
            self.head = vec![0; (2 * wanted).next_power_of_two().max(1 << 10)];
            let indexed = self.earlier.len();
            self.earlier.clear();
            for start in 0..indexed {
                self.insert(ids, start);
            }
        }
        for start in self.earlier.len()..wanted {
            self.insert(ids, start);
        }
    }

    /// Undoes the runs that will not end before the last id once `ids` keep `len` of theirs,
    /// latest first, so each bucket's head goes back to the start before.
    fn forget_past(&mut self, ids: &[u32], len: usize) {
        let keep = len.saturating_sub(N);
        while self.earlier.len() > keep {
            let b = self.bucket(ids, self.earlier.len() - 1);
            self.head[b] = self.earlier.pop().expect("a run to undo");
        }
    }

    /// The latest start of an earlier occurrence of the last N ids.
    fn latest_of_tail(&self, ids: &[u32]) -> Option<usize> {
        if ids.len() <= N || self.head.is_empty() {
            return None;
        }
        let tail = &ids[ids.len() - N..];
        let mut link = self.head[self.bucket(ids, ids.len() - N)];
        while link != 0 {
            let start = link as usize - 1;
            if ids[start..start + N] == *tail {
                return Some(start);
            }
            link = self.earlier[start];
        }
        None
    }
}

/// The rows a check keeps: row i's id is what the step feeding the pending id and then
/// `draft[..i]` gives, and `draft[i]` was fed on the guess that it is that id; so rows are kept
/// through the first whose id is not the draft's next (or has none), or is EOS. `ids` holds
/// every row's id (`draft.len() + 1`); returns 1 to `ids.len()`.
pub fn kept_rows(draft: &[u32], ids: &[u32], is_eos: impl Fn(u32) -> bool) -> usize {
    ids.iter()
        .enumerate()
        .position(|(i, &id)| is_eos(id) || draft.get(i) != Some(&id))
        .map_or(ids.len(), |i| i + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup(ids: &[u32], max: usize) -> Vec<u32> {
        let mut c = Context::default();
        c.extend_from_slice(ids);
        c.draft(max)
    }

    /// The lookup by a scan of the whole context, latest first: what the index must give.
    fn scanned(context: &[u32], max: usize) -> Vec<u32> {
        let len = context.len();
        for n in [3, 2] {
            if max == 0 || len <= n {
                break;
            }
            let tail = &context[len - n..];
            if let Some(start) = (0..len - n).rev().find(|&i| &context[i..i + n] == tail) {
                let period = len - n - start;
                let mut draft: Vec<u32> = Vec::with_capacity(max);
                for i in 0..max {
                    let at = start + n + i;
                    draft.push(if at < len {
                        context[at]
                    } else {
                        draft[i - period]
                    });
                }
                return draft;
            }
        }
        Vec::new()
    }

    #[test]
    fn the_index_gives_the_scans_drafts_through_pushes_and_truncations() {
        // A small alphabet so that runs recur; pushes, truncations (a rewind, a prefill
        // dropping the pending id), drafts asked for at random between them.
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        };
        let mut c = Context::default();
        let mut drafts = 0;
        for _ in 0..20_000 {
            match next(10) {
                0 => {
                    let len = c.ids().len();
                    c.truncate(len - (next(4) as usize).min(len));
                }
                1 => {
                    let ids: Vec<u32> = (0..next(5)).map(|_| next(6) as u32).collect();
                    c.extend_from_slice(&ids);
                }
                2 | 3 => {
                    let max = next(8) as usize;
                    let want = scanned(c.ids(), max);
                    drafts += !want.is_empty() as usize;
                    assert_eq!(c.draft(max), want, "context {:?}", c.ids());
                }
                _ => c.push(next(6) as u32),
            }
            if c.ids().len() > 300 {
                let keep = next(300) as usize;
                c.truncate(keep);
            }
        }
        assert!(drafts > 1000, "{drafts} drafts found");
        c.set(&[1, 2, 3, 1, 2]);
        assert_eq!(c.draft(2), [3, 1]);
        c.clear();
        assert!(c.draft(2).is_empty());
    }

    #[test]
    fn rows_are_kept_through_the_first_miss_or_eos() {
        let none = |_| false;
        assert_eq!(kept_rows(&[4, 5, 6], &[4, 5, 6, 7], none), 4, "all taken");
        assert_eq!(kept_rows(&[4, 5, 6], &[4, 9, 6, 7], none), 2, "a miss");
        assert_eq!(
            kept_rows(&[4, 5, 6], &[1, 5, 6, 7], none),
            1,
            "the first missed"
        );
        assert_eq!(
            kept_rows(&[4, 5, 6], &[4, 5, 6, 7], |id| id == 5),
            2,
            "EOS taken"
        );
        assert_eq!(kept_rows(&[], &[3], none), 1);
    }

    #[test]
    fn the_ids_after_the_latest_match_of_the_longest_tail() {
        // Tail [7, 8, 9] occurs at 1 and at 6: the later one's followers.
        let c = [1, 7, 8, 9, 2, 3, 7, 8, 9, 4, 5, 6, 7, 8, 9];
        assert_eq!(lookup(&c, 3), [4, 5, 6]);
        assert_eq!(lookup(&c, 6), [4, 5, 6, 7, 8, 9]);
        assert!(lookup(&c, 0).is_empty());
    }

    #[test]
    fn a_shorter_tail_where_the_longest_does_not_recur() {
        // [5, 8, 9] never occurred before; [8, 9] did, followed by 4.
        let c = [8, 9, 4, 1, 5, 8, 9];
        assert_eq!(lookup(&c, 4), [4, 1, 5, 8]);
    }

    #[test]
    fn none_where_no_pair_recurs() {
        assert!(lookup(&[1, 2, 3, 4, 5], 4).is_empty());
        assert!(lookup(&[3], 4).is_empty());
        assert!(lookup(&[], 4).is_empty());
        // A single id recurring is not enough.
        assert!(lookup(&[1, 2, 3, 1], 4).is_empty());
    }

    #[test]
    fn a_recent_match_continues_its_period() {
        // A greedy loop [25, 20]: the match two ids back leaves one id, then the period runs on.
        let c = [9, 25, 20, 25, 20, 25];
        assert_eq!(lookup(&c, 5), [20, 25, 20, 25, 20]);
        // A period of three: [1, 2, 3] repeated.
        let c = [7, 1, 2, 3, 1, 2, 3, 1];
        assert_eq!(lookup(&c, 4), [2, 3, 1, 2]);
        // Past the copied ids of a match far back, the span between the two occurrences.
        let c = [5, 6, 7, 8, 5, 6];
        assert_eq!(lookup(&c, 4), [7, 8, 5, 6]);
    }
}
