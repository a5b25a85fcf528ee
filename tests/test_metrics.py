"""Hand-computed checks of the evaluation metrics in eval.py (section 3): pass@k, distinct-n, BLEU /
self-BLEU, LCS / ROUGE-L / self-ROUGE-L, div-score, near-miss@k, discarded-valid share, median/p10/p90.

All diversity metrics tokenise by whitespace, so "a b c d" is the four tokens a, b, c, d.
"""
import math
import random
from fractions import Fraction
from itertools import combinations

import pytest

import eval as ev

# The three tiny texts worked by hand below.
A, B, C = "a b c d", "a b c e", "f g h i"


# ---- pass@k ----

def brute_force_pass_at_k(n, c, k):
    """Exact expectation over all k-subsets of n samples (c correct): share of subsets with a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_brute_force_over_subsets():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert ev.pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_hand_values():
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert ev.pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # k=1 is the plain accuracy c/n
    assert ev.pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert ev.pass_at_k(5, 0, 3) == 0.0
    assert ev.pass_at_k(5, 3, 3) == 1.0  # only 2 wrong samples: every 3-subset holds a correct one


def test_pass_at_k_is_stable_for_large_n():
    """Guards the naive C(n-c,k)/C(n,k) in floats, which overflows (inf/inf = nan) for n in the thousands."""
    n, c, k = 2000, 30, 200
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert ev.pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-9)
    assert math.isfinite(ev.pass_at_k(100_000, 1, 50_000))


def test_pass_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError, match="c <= n"):
        ev.pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="k <= n"):
        ev.pass_at_k(4, 1, 5)


def test_pass_ks():
    assert ev.pass_ks(1) == [1]
    assert ev.pass_ks(8) == [1, 2, 4, 8]
    assert ev.pass_ks(10) == [1, 2, 4, 8, 10]


# ---- distinct-n ----

def test_distinct_n_by_hand():
    # unigrams of A, B, C: a b c d | a b c e | f g h i -> 12 in all, 9 different (a..i) -> 9/12
    assert ev.distinct_n([A, B, C], 1) == pytest.approx(9 / 12)
    # bigrams: ab bc cd | ab bc ce | fg gh hi -> 9 in all, 7 different (ab, bc repeat) -> 7/9
    assert ev.distinct_n([A, B, C], 2) == pytest.approx(7 / 9)
    # 4-grams: abcd | abce | fghi -> 3 in all, all different -> 1
    assert ev.distinct_n([A, B, C], 4) == pytest.approx(1.0)


def test_distinct_n_identical_disjoint_and_short():
    assert ev.distinct_n([A, A, A], 1) == pytest.approx(1 / 3)  # k identical copies -> 1/k
    assert ev.distinct_n([A, C], 1) == 1.0 and ev.distinct_n([A, C], 4) == 1.0  # disjoint -> 1
    assert ev.distinct_n(["x y", "z"], 4) == 0.0  # no 4-gram at all
    # n-grams never cross from one sample into the next: "a b" + "b a" has bigrams ab, ba only
    assert ev.distinct_n(["a b", "b a"], 2) == 1.0


# ---- BLEU and self-BLEU (Chen & Cherry smoothing method 1, epsilon = 0.1) ----

def test_bleu_by_hand():
    # BLEU(A; refs B, C):
    #   p1 = a,b,c match of a,b,c,d      = 3/4
    #   p2 = ab,bc match of ab,bc,cd     = 2/3
    #   p3 = abc matches of abc,bcd      = 1/2
    #   p4 = abcd has no match           -> smoothed 0.1/1
    #   BP: h = 4, closest reference length 4 -> exp(1 - 4/4) = 1
    expected = (3 / 4 * 2 / 3 * 1 / 2 * 0.1) ** 0.25  # = 0.025 ** 0.25 ≈ 0.3976
    assert ev.bleu(A.split(), [B.split(), C.split()]) == pytest.approx(expected)
    # C shares no unigram with A or B -> 0 (as NLTK)
    assert ev.bleu(C.split(), [A.split(), B.split()]) == 0.0


def test_bleu_clipping_brevity_and_tie_rule():
    # clipping: "the" x4 against one "the": p1 = 1/4; p2, p3, p4 unmatched -> 0.1/3, 0.1/2, 0.1/1; BP = 1 (4 > 2)
    expected = (1 / 4 * 0.1 / 3 * 0.1 / 2 * 0.1 / 1) ** 0.25
    assert ev.bleu("the the the the".split(), ["the cat".split()]) == pytest.approx(expected)
    # brevity: every n-gram of "a b c d" is in the 6-token reference; BP = exp(1 - 6/4)
    assert ev.bleu("a b c d".split(), ["a b c d e f".split()]) == pytest.approx(math.exp(-0.5))
    # closest reference length: 3 and 5 are both 1 away from 4 -> the shorter (3) -> BP = 1, BLEU = 1
    assert ev.bleu("a b c d".split(), ["a b c".split(), "a b c d e".split()]) == pytest.approx(1.0)


def test_self_bleu_by_hand():
    # BLEU(A; B, C) = BLEU(B; A, C) = 0.025 ** 0.25 (B mirrors A: abce vs abcd), BLEU(C; A, B) = 0
    assert ev.self_bleu([A, B, C]) == pytest.approx(2 * 0.025 ** 0.25 / 3)


def test_identical_samples_have_zero_diversity_and_disjoint_ones_full():
    same = ["x plus y equals z so the answer is 3"] * 4
    assert 1 - ev.self_bleu(same) == pytest.approx(0.0)
    assert 1 - ev.self_rouge_l(same) == pytest.approx(0.0)
    disjoint = ["a b c d", "e f g h", "i j k l"]
    assert ev.self_bleu(disjoint) == 0.0 and ev.self_rouge_l(disjoint) == 0.0
    assert ev.distinct_n(disjoint, 1) == 1.0 and ev.distinct_n(disjoint, 4) == 1.0
    assert ev.div_score(disjoint) == pytest.approx(1.0)


def test_self_metrics_need_two_samples():
    with pytest.raises(ValueError, match="at least 2"):
        ev.self_bleu([A])
    with pytest.raises(ValueError, match="at least 2"):
        ev.self_rouge_l([A])


# ---- LCS, ROUGE-L and self-ROUGE-L ----

def lcs_dp(a, b):
    """The textbook O(|a|·|b|) dynamic programme, to check the bit-parallel version against."""
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            table[i][j] = table[i - 1][j - 1] + 1 if a[i - 1] == b[j - 1] else max(table[i - 1][j], table[i][j - 1])
    return table[-1][-1]


def test_lcs_bit_parallel_equals_dynamic_programme():
    rng = random.Random(0)
    for _ in range(300):
        a = [rng.choice("abcd") for _ in range(rng.randint(0, 40))]
        b = [rng.choice("abcd") for _ in range(rng.randint(0, 40))]
        assert ev.lcs_length(a, b) == lcs_dp(a, b)
    assert ev.lcs_length(list("abc"), list("cba")) == 1


def test_rouge_l_by_hand():
    # "a b c d e" vs "a c e": LCS = a c e = 3; P = 3/5, R = 3/3; F1 = 2·0.6·1/(0.6+1) = 0.75
    assert ev.rouge_l_f1("a b c d e".split(), "a c e".split()) == pytest.approx(0.75)
    assert ev.rouge_l_f1("a c e".split(), "a b c d e".split()) == pytest.approx(0.75)  # symmetric
    # "the cat sat on the mat" vs "the cat is on the mat": LCS "the cat on the mat" = 5 of 6 each -> 5/6
    assert ev.rouge_l_f1("the cat sat on the mat".split(), "the cat is on the mat".split()) == pytest.approx(5 / 6)
    assert ev.rouge_l_f1([], ["a"]) == 0.0


def test_self_rouge_by_hand():
    # pairs: (A, B) LCS a b c -> F1 3/4; (A, C) and (B, C) share nothing -> 0; mean = 0.75 / 3 = 0.25
    assert ev.self_rouge_l([A, B, C]) == pytest.approx(0.25)


def test_div_score_is_mean_of_the_four_indicators():
    m = ev.diversity_metrics([A, B, C])
    assert m["distinct_1"] == pytest.approx(0.75)
    assert m["distinct_4"] == pytest.approx(1.0)
    assert m["one_minus_self_bleu"] == pytest.approx(1 - 2 * 0.025 ** 0.25 / 3)
    assert m["one_minus_self_rouge"] == pytest.approx(0.75)
    expected = (0.75 + 1.0 + (1 - 2 * 0.025 ** 0.25 / 3) + 0.75) / 4
    assert m["div_score"] == pytest.approx(expected)
    assert ev.div_score([A, B, C]) == pytest.approx(expected)


# ---- near misses and discarded valid trajectories ----

def test_near_miss_at_k_by_hand():
    pairs = [(5, 4), (5, 2), (4, 0), (3, 2)]  # N - K = 1, 3, 4, 1
    assert ev.near_miss_at_k(pairs, 0) == 0.0
    assert ev.near_miss_at_k(pairs, 1) == pytest.approx(2 / 4)
    assert ev.near_miss_at_k(pairs, 3) == pytest.approx(3 / 4)
    assert ev.near_miss_at_k(pairs, 4) == 1.0
    assert ev.near_miss_at_k([], 1) == 0.0
    with pytest.raises(ValueError, match=r"\(N, K\) = \(2, 3\)"):
        ev.near_miss_at_k([(2, 3)], 1)


def test_near_miss_with_prm_cut_point():
    """K comes from prm.cut_point: the first step scored below tau, else the last step."""
    prm = pytest.importorskip("prm")
    flagged = [0.9, 0.8, 0.2, 0.9]  # first error at step 2 -> K = 2, N - K = 2
    unflagged = [0.9, 0.9, 0.9]  # no step flagged, answer wrong -> the last step is the error: K = 2, N - K = 1
    pairs = [(len(s), prm.cut_point(s, 0.5)) for s in (flagged, unflagged)]
    assert pairs == [(4, 2), (3, 2)]
    assert ev.near_miss_at_k(pairs, 1) == pytest.approx(0.5)


def test_discarded_valid_share_by_hand():
    assert ev.discarded_valid_share([0.5, 0.49, 0.8, 0.0]) == pytest.approx(2 / 4)  # 0.5 counts (>=)
    assert ev.discarded_valid_share([0.5, 0.49, 0.8, 0.0], threshold=0.8) == pytest.approx(1 / 4)
    assert ev.discarded_valid_share([]) == 0.0


def test_median_p10_p90():
    assert ev.median_p10_p90(list(range(11))) == pytest.approx((5.0, 1.0, 9.0))
    # linear interpolation: [0, 1] -> median 0.5, p10 0.1, p90 0.9
    assert ev.median_p10_p90([0.0, 1.0]) == pytest.approx((0.5, 0.1, 0.9))
    assert all(math.isnan(v) for v in ev.median_p10_p90([]))
