//! Prompt-lookup drafts for speculative greedy decoding: the ids that followed the last
//! earlier occurrence of the request's last few ids. Text that repeats its context (code being
//! edited, a summary quoting its source, a list continued) repeats such runs; the backend
//! checks a draft in one forward ([`crate::backend::Backend::step_draft`]), so a draft only
//! costs time, never changes an id.

/// The longest draft a speculative step checks (the ABI's `DV2_MAX_DRAFT`): with the pending
/// id, 16 rows of one forward.
pub const MAX_DRAFT: usize = 15;

/// The longest and shortest run of last ids a draft is looked up by: a longer match first (it
/// predicts better); one id alone matches too often to pay for the check.
const NGRAM_MAX: usize = 3;
const NGRAM_MIN: usize = 2;

/// Up to `max` ids that followed the most recent earlier occurrence of the last `NGRAM_MAX`
/// (then fewer, down to `NGRAM_MIN`) ids of `context`; empty where none occurs. Where the
/// occurrence is so recent that fewer than `max` ids follow it, the copy runs on into the ids
/// it has copied (as an LZ77 match overlaps itself): the span between the two occurrences is
/// taken to repeat, as in a loop.
pub fn lookup(context: &[u32], max: usize) -> Vec<u32> {
    let len = context.len();
    for n in (NGRAM_MIN..=NGRAM_MAX).rev() {
        if max == 0 || len <= n {
            break;
        }
        let tail = &context[len - n..];
        // Starts of earlier occurrences, latest first; the one at len - n is the tail itself.
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
