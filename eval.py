"""eval.py — the paper's evaluation: its metrics and `evaluate`.

SCOPE (Ren et al., arXiv 2602.24110), as pure functions: unbiased pass@k (Chen et al. 2021); the Table-4 diversity
metrics distinct-1/4, self-BLEU, self-ROUGE-L and div-score, median with p10/p90 across prompts; Near-miss@k
(r = 0) (Fig. 7); the share of discarded valid trajectories (Fig. 3); then `evaluate` (avg@n and pass@k of any
generator backend). The verifier: harness/data/grader.py (docs/grader.md); the benchmarks of Table 1 and out of
domain: harness/data/problems.py; training curves and the rectification viewer (Figs. 3-7, 12): tools/report.py.
Run: `python eval.py --model CKPT --benchmarks math500,aime24 --n 8 --temperature 0.6` (`--diversity`: Table 4;
every command: docs/running.md); the command line, its checks and its report: harness/run/eval_cli.py.
Definitions: docs/metrics.md; the choices the paper leaves open (avg@n at T = 0.6, whitespace tokens, div-score,
near-miss, discarded valid): docs/choices.md, rows "metrics".
"""
# ==== imports ====
import math
import sys
from collections import Counter

import numpy as np

from harness.data.grader import grade


# ==== 1. metrics: pass@k, diversity, near misses ====
# Pure functions: numbers or strings in, a number out. The diversity metrics all tokenise a response the
# same way, by whitespace (`text.split()`): cheap, model-independent, and the same for every checkpoint.


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem (Chen et al. 2021, eq. 1): 1 − C(n−c, k) / C(n, k).

    n samples were drawn and c of them are correct; the value is the chance that a k-subset drawn
    without replacement holds at least one correct sample. Computed in the product form
    1 − Π_{i=n−c+1}^{n} (1 − k/i), which never forms the (huge) binomials; it is exactly 1 when fewer
    than k samples are wrong, because then every k-subset holds a correct one.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    all_wrong = 1.0  # C(n−c, k) / C(n, k): probability that all k drawn samples are wrong
    for i in range(n - c + 1, n + 1):
        all_wrong *= 1.0 - k / i
    return 1.0 - all_wrong


def pass_ks(n: int) -> list[int]:
    """The k reported for n samples: 1, 2, 4, 8, ... up to n, and n itself."""
    ks = [2**i for i in range(n.bit_length()) if 2**i <= n]
    return ks if ks[-1] == n else ks + [n]


def _ngrams(tokens: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(texts: list[str], n: int) -> float:
    """distinct-n (Li et al. 2016) of one prompt's samples: |unique n-grams| / |all n-grams|.

    n-grams are counted inside each sample (never across two samples) over whitespace tokens, and pooled
    over the samples. A sample shorter than n tokens adds none; no n-grams at all gives 0.0.
    k identical samples (no n-gram repeated inside) give 1/k; samples sharing no n-gram give 1.
    """
    grams = [g for text in texts for g in _ngrams(text.split(), n)]
    return len(set(grams)) / len(grams) if grams else 0.0


def bleu(hypothesis: list[str], references: list[list[str]], max_n: int = 4, epsilon: float = 0.1) -> float:
    """Sentence BLEU-4 (Papineni et al. 2002) of a token list against several references, smoothed.

    p_n  = Σ_g min(count_hyp(g), max_ref count_ref(g)) / Σ_g count_hyp(g)    (clipped n-gram precision)
    BLEU = BP · exp(Σ_{n=1..4} ¼ · log p_n),   BP = 1 if h > r else exp(1 − r/h)
    with h = |hypothesis| and r the reference length closest to h (the shorter on a tie).
    Smoothing: Chen & Cherry (2014) method 1, as in NLTK's SmoothingFunction().method1 that Texygen's
    self-BLEU uses: a p_n with no clipped match becomes ε / max(1, Σ_g count_hyp(g)), ε = 0.1.
    Like NLTK, a hypothesis with no unigram match at all (or an empty one) scores 0.
    """
    if not hypothesis:
        return 0.0
    log_p = 0.0
    for n in range(1, max_n + 1):
        hyp_counts = Counter(_ngrams(hypothesis, n))
        max_ref = Counter()
        for ref in references:
            max_ref |= Counter(_ngrams(ref, n))  # `|` keeps the max count per n-gram
        matched = sum(min(c, max_ref[g]) for g, c in hyp_counts.items())
        total = max(1, sum(hyp_counts.values()))
        if matched == 0 and n == 1:
            return 0.0
        log_p += math.log((matched if matched else epsilon) / total) / max_n
    h = len(hypothesis)
    r = min((len(ref) for ref in references), key=lambda length: (abs(length - h), length))
    brevity = 1.0 if h > r else math.exp(1.0 - r / h)
    return brevity * math.exp(log_p)


def self_bleu(texts: list[str]) -> float:
    """Self-BLEU (Zhu et al. 2018, Texygen): (1/k) Σ_i BLEU-4(y_i; references = the other k−1 samples).

    Whitespace tokens, smoothing as in `bleu`. High = the samples repeat each other; diversity is
    1 − self-BLEU. Needs at least two samples.
    """
    if len(texts) < 2:
        raise ValueError(f"self_bleu needs at least 2 samples, got {len(texts)}")
    tokens = [t.split() for t in texts]
    return sum(bleu(tokens[i], tokens[:i] + tokens[i + 1:]) for i in range(len(tokens))) / len(tokens)


def lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence of two token lists (bit-parallel, Hyyrö 2004).

    Bit i of `match[token]` is set where a[i] == token. V starts as all ones over |a| bits; for each
    token of b, U = V & match, V = (V + U) | (V − U). The LCS length is the number of zero bits of V.
    Same result as the O(|a|·|b|) dynamic programme (tested), with one big-integer update per token of b.
    """
    match: dict[str, int] = {}
    for i, token in enumerate(a):
        match[token] = match.get(token, 0) | (1 << i)
    full = (1 << len(a)) - 1
    v = full
    for token in b:
        u = v & match.get(token, 0)
        v = ((v + u) | (v - u)) & full
    return len(a) - bin(v).count("1")


def rouge_l_f1(a: list[str], b: list[str]) -> float:
    """ROUGE-L F1 (Lin 2004) of two token lists: 2PR/(P+R), P = LCS/|a|, R = LCS/|b| (symmetric).

    0.0 when there is no common token (including an empty side).
    """
    lcs = lcs_length(a, b)
    if lcs == 0:
        return 0.0
    p, r = lcs / len(a), lcs / len(b)
    return 2 * p * r / (p + r)


def self_rouge_l(texts: list[str]) -> float:
    """Self-ROUGE-L: mean ROUGE-L F1 over all pairs of one prompt's samples (pairwise mean).

    (1/k) Σ_i mean_{j≠i} F1(y_i, y_j); F1 is symmetric, so this is the mean over the k(k−1)/2 pairs.
    (Taking the max over references is the other convention in use; we take the mean.) Diversity is
    1 − self-ROUGE. Needs at least two samples.
    """
    if len(texts) < 2:
        raise ValueError(f"self_rouge_l needs at least 2 samples, got {len(texts)}")
    tokens = [t.split() for t in texts]
    pairs = [(i, j) for i in range(len(tokens)) for j in range(i + 1, len(tokens))]
    return sum(rouge_l_f1(tokens[i], tokens[j]) for i, j in pairs) / len(pairs)


def diversity_metrics(texts: list[str]) -> dict[str, float]:
    """The five Table-4 diversity numbers for one prompt's samples (≥ 2), each in [0, 1], higher = more diverse.

    div_score = mean(distinct-1, distinct-4, 1 − self-BLEU, 1 − self-ROUGE-L): our reading of the
    paper's "div-score", which it does not define in the parts we could read.
    """
    out = {
        "distinct_1": distinct_n(texts, 1),
        "distinct_4": distinct_n(texts, 4),
        "one_minus_self_bleu": 1.0 - self_bleu(texts),
        "one_minus_self_rouge": 1.0 - self_rouge_l(texts),
    }
    out["div_score"] = sum(out.values()) / 4
    return out


def div_score(texts: list[str]) -> float:
    """div-score = (distinct-1 + distinct-4 + (1 − self-BLEU) + (1 − self-ROUGE-L)) / 4; see diversity_metrics."""
    return diversity_metrics(texts)["div_score"]


def near_miss_at_k(steps_and_kept: list[tuple[int, int]], k: int) -> float:
    """Near-miss@k (r = 0), paper Fig. 7: the share of zero-reward samples with N − K ≤ k.

    Pass one (N, K) pair per zero-reward sample: N = its number of steps, K = the number of steps judged
    correct before the first error, i.e. `prm.cut_point(scores, tau)` (the first step scored below tau;
    when none is, the last step counts as the error, so K = N − 1). 0.0 when there are no samples.
    """
    for n_steps, kept in steps_and_kept:
        if not 0 <= kept <= n_steps:
            raise ValueError(f"near_miss_at_k: need 0 <= K <= N, got (N, K) = ({n_steps}, {kept})")
    if not steps_and_kept:
        return 0.0
    return sum(n_steps - kept <= k for n_steps, kept in steps_and_kept) / len(steps_and_kept)


def discarded_valid_share(keep_ratios: list[float], threshold: float = 0.5) -> float:
    """Share of zero-reward samples that are "discarded valid trajectories" (paper Fig. 3).

    Pass the keep ratio κ = K / N of each zero-reward sample; it counts as valid reasoning that an
    outcome-only reward throws away when κ ≥ threshold (0.5). 0.0 when there are no samples.
    """
    if not keep_ratios:
        return 0.0
    return sum(ratio >= threshold for ratio in keep_ratios) / len(keep_ratios)


def median_p10_p90(values: list[float]) -> tuple[float, float, float]:
    """(median, 10th percentile, 90th percentile) with linear interpolation, as Table 4 reports across prompts."""
    if len(values) == 0:
        return (math.nan, math.nan, math.nan)
    med, p10, p90 = np.percentile(np.asarray(values, dtype=float), [50, 10, 90])
    return (float(med), float(p10), float(p90))


def diversity_summary(per_problem: list[dict]) -> dict[str, dict[str, float]]:
    """Table 4 across prompts: for each diversity metric, {"median", "p10", "p90"} over the prompts.

    `per_problem` rows need "samples" (evaluate(..., keep_samples=True)) with at least 2 samples each.
    """
    rows = [diversity_metrics(row["samples"]) for row in per_problem]
    summary = {}
    for key in rows[0]:
        med, p10, p90 = median_p10_p90([r[key] for r in rows])
        summary[key] = {"median": med, "p10": p10, "p90": p90}
    return summary


# ==== 2. evaluation: avg@n and pass@k of a generator ====


def evaluate(generator, tokenizer, problems: list[dict], *, n: int = 1, temperature: float = 0.6,
             top_p: float = 1.0, max_new_tokens: int = 1024, seed: int | None = 0, batch_size: int = 64,
             keep_samples: bool = False, grade_fn=None, system: str | None = None, progress: str = "") -> dict:
    """avg@n accuracy and unbiased pass@k of `generator` on `problems` ({"id", "question", "answer"}).

    Prompts come from `prompt.format_prompt` (chat template + "put your answer in \\boxed{}" when the
    tokenizer has one), n samples per problem in one generate call per `batch_size` problems, each
    sample graded by `grade` (multiple-choice answers are letters, which `grade` compares as such) or by
    `grade_fn` (`--grader math-verify`: harness/data/mathverify.py). `system`: the system turn (None = the default
    one of prompt.format_prompt, "" = none).
    Returns {"acc": mean over problems of c/n (avg@n), "pass@k": {k: mean pass_at_k(n, c, k)} for
    k in pass_ks(n), "n", "num_problems", "truncated": share of samples cut at max_new_tokens,
    "response_len": mean sampled tokens, "per_problem": [{"id", "correct": c, "n"}]}; with
    keep_samples each per_problem row also holds "samples" (texts) and "sample_correct" (bools). `progress`
    names the problems in a progress line per generate call off a terminal (`eval_progress`).
    """
    from harness.data.prompt import DEFAULT_SYSTEM, format_prompt
    from harness.engines.generate import VLLMGenerator
    from harness.run.progress import eval_progress

    if not problems:
        raise ValueError("evaluate: `problems` is empty")
    if n < 1:
        raise ValueError(f"evaluate: n must be >= 1, got {n}")
    per_problem, n_truncated, n_tokens = [], 0, 0
    # vLLM schedules all prompts itself: one call (no batch waits on another's longest answer), no log-probs asked
    whole = isinstance(generator, VLLMGenerator)
    batch_size, extra = (len(problems), {"logprobs": False}) if whole else (batch_size, {})
    bar = eval_progress(len(problems), batch_size, progress)
    for start in range(0, len(problems), batch_size):
        batch = problems[start:start + batch_size]
        prompts = [format_prompt(tokenizer, p["question"], DEFAULT_SYSTEM if system is None else system or None)
                   for p in batch]
        outputs = generator.generate(prompts, n=n, temperature=temperature, top_p=top_p,
                                     max_tokens=max_new_tokens, **extra,
                                     seed=None if seed is None else seed + start)  # [prompt][sample]
        for problem, completions in zip(batch, outputs):
            marks = [(grade_fn or grade)(c.text, problem["answer"]) for c in completions]
            row = {"id": problem["id"], "correct": sum(marks), "n": len(completions)}
            if keep_samples:
                row["samples"] = [c.text for c in completions]
                row["sample_correct"] = marks
            per_problem.append(row)
            n_truncated += sum(not c.finished for c in completions)
            n_tokens += sum(len(c.ids) for c in completions)
        bar.update(len(batch))
    bar.close()
    n_samples = sum(row["n"] for row in per_problem)
    return {
        "acc": sum(row["correct"] / row["n"] for row in per_problem) / len(per_problem),
        "pass@k": {k: sum(pass_at_k(row["n"], row["correct"], k) for row in per_problem) / len(per_problem)
                   for k in pass_ks(n)},
        "n": n,
        "num_problems": len(per_problem),
        "truncated": n_truncated / n_samples,
        "response_len": n_tokens / n_samples,
        "per_problem": per_problem,
    }


def main(argv=None) -> int:
    """`python eval.py ...`: the command line (harness/run/eval_cli.py), evaluating with this file's functions."""
    from harness.run import eval_cli

    return eval_cli.main(argv, evaluate, diversity_summary)


if __name__ == "__main__":
    sys.exit(main())
