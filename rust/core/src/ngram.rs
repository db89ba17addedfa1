//! N-gram prompt lookup: draft tokens for speculative decoding taken from the request's own
//! history. Where the sequence's last few tokens occurred before, what followed them then is a
//! cheap guess at what follows now (code, quotes and templated text repeat a lot).

/// Up to `k` tokens that followed the best earlier occurrence of a suffix of `tokens`.
///
/// The best occurrence is the one matching the longest suffix (between `min_n` and `max_n`
/// tokens; longer is more specific), the most recent among equally long ones. Empty when no
/// suffix of at least `min_n` tokens occurs earlier. O(len * max_n) time, no allocation.
pub fn propose(tokens: &[u32], min_n: usize, max_n: usize, k: usize) -> &[u32] {
    let len = tokens.len();
    if k == 0 || min_n == 0 || max_n < min_n || len < 2 {
        return &[];
    }
    let (mut best_len, mut best_end) = (0, 0);
    // `end` is one past a candidate occurrence; the continuation starts there.
    for end in (1..len).rev() {
        let limit = max_n.min(end);
        let matched = (0..limit).take_while(|&j| tokens[end - 1 - j] == tokens[len - 1 - j]).count();
        if matched > best_len {
            (best_len, best_end) = (matched, end);
            if matched == max_n {
                break;
            }
        }
    }
    if best_len < min_n {
        return &[];
    }
    &tokens[best_end..(best_end + k).min(len)]
}

#[cfg(test)]
mod tests {
    use super::propose;

    #[test]
    fn continues_the_most_recent_longest_match() {
        // "1 2 3" occurred twice; the later occurrence was followed by 7 8.
        let t = [1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 9, 1, 2, 3];
        assert_eq!(propose(&t, 1, 3, 2), &[7, 8]);
        assert_eq!(propose(&t, 1, 3, 10), &[7, 8, 9, 1, 2, 3]); // stops at the end of the history
    }

    #[test]
    fn prefers_a_longer_match_to_a_more_recent_one() {
        // Suffix "5 6": an old occurrence matches 2 tokens (-> 10), a recent one only "6" (-> 20).
        let t = [5, 6, 10, 11, 6, 20, 21, 5, 6];
        assert_eq!(propose(&t, 1, 4, 1), &[10]);
        assert_eq!(propose(&t, 1, 1, 1), &[20]); // max_n = 1: only the last token counts
    }

    #[test]
    fn nothing_below_min_n_or_without_history() {
        let t = [1, 2, 3, 9, 3];
        assert_eq!(propose(&t, 2, 4, 3), &[] as &[u32]); // only "3" recurs
        assert_eq!(propose(&t, 1, 4, 3), &[9, 3]);
        assert_eq!(propose(&[4], 1, 3, 3), &[] as &[u32]);
        assert_eq!(propose(&t, 1, 4, 0), &[] as &[u32]);
    }

    #[test]
    fn a_run_of_one_token_proposes_more_of_it() {
        let t = [7, 7, 7, 7];
        assert_eq!(propose(&t, 1, 2, 3), &[7]); // end = 3 matches "7 7"; continuation is the last 7
    }
}
