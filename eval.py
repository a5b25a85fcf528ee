"""eval.py — the paper's evaluation: metrics, `evaluate` and its command line.

SCOPE (Ren et al., arXiv 2602.24110), as pure functions: unbiased pass@k (Chen et al. 2021); the Table-4 diversity
metrics distinct-1/4, self-BLEU, self-ROUGE-L and div-score, median with p10/p90 across prompts; Near-miss@k
(r = 0) (Fig. 7); the share of discarded valid trajectories (Fig. 3); then `evaluate` (avg@n and pass@k of any
generator backend) and the command line. The verifier: harness/data/grader.py (docs/grader.md); the benchmarks of
Table 1 and out of domain: harness/data/problems.py; training curves and the rectification viewer (Figs. 3-7, 12):
tools/report.py. Run: `python eval.py --model CKPT --benchmarks math500,aime24 --n 8 --temperature 0.6`
(`--diversity`: Table 4; every command: docs/running.md); what the input alone decides (values, paths, aliases,
the network) is checked with scope.py's pre-flight functions before any model loads. Definitions: docs/metrics.md; the choices the paper
leaves open (avg@n at T = 0.6, whitespace tokens, div-score, near-miss, discarded valid): docs/choices.md, rows
"metrics".
"""
# ==== imports ====
import argparse
import json
import math
import os
import re
import sys
import time
from collections import Counter

import numpy as np

from harness.data.grader import grade, grader_benchmark
from harness.data.problems import load_problems, maybe_cached


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


# ==== 2. evaluation, plots, trace viewer, command line ====
# Everything heavy (torch, transformers, vLLM, matplotlib, tqdm, generate.py) is imported inside the
# function that needs it, so `import eval` stays cheap for the training loop and the grader tests.


def evaluate(generator, tokenizer, problems: list[dict], *, n: int = 1, temperature: float = 0.6,
             top_p: float = 1.0, max_new_tokens: int = 1024, seed: int | None = 0, batch_size: int = 64,
             keep_samples: bool = False, grade_fn=None, system: str | None = None, progress: str = "") -> dict:
    """avg@n accuracy and unbiased pass@k of `generator` on `problems` ({"id", "question", "answer"}).

    Prompts come from `generate.format_prompt` (chat template + "put your answer in \\boxed{}" when the
    tokenizer has one), n samples per problem in one generate call per `batch_size` problems, each
    sample graded by `grade` (multiple-choice answers are letters, which `grade` compares as such) or by
    `grade_fn` (`--grader math-verify`: harness/data/mathverify.py). `system`: the system turn (None = the default
    one of generate.format_prompt, "" = none).
    Returns {"acc": mean over problems of c/n (avg@n), "pass@k": {k: mean pass_at_k(n, c, k)} for
    k in pass_ks(n), "n", "num_problems", "truncated": share of samples cut at max_new_tokens,
    "response_len": mean sampled tokens, "per_problem": [{"id", "correct": c, "n"}]}; with
    keep_samples each per_problem row also holds "samples" (texts) and "sample_correct" (bools). `progress`
    names the problems in a progress line per generate call off a terminal (`eval_progress`).
    """
    from harness.data.prompt import DEFAULT_SYSTEM, format_prompt
    from harness.engines.generate import VLLMGenerator

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


def eval_progress(total: int, batch_size: int, label: str = ""):
    """Where an evaluation of `total` problems is: a tqdm bar on a terminal (none for one batch); off a terminal,
    with a `label`, one line per update: "eval math500: 64/500 problems, 41 s, ETA 4 min 39 s" (a log file gets
    no carriage returns); without a label, nothing (the training loop's periodic evaluation)."""
    from tqdm.auto import tqdm

    from harness.run.progress import bar_disabled, duration

    if not bar_disabled() or not label:
        return tqdm(total=total, desc="eval", unit="problem", disable=total <= batch_size or bar_disabled())

    class Lines:
        def __init__(self):
            self.done, self.t0 = 0, time.time()

        def update(self, k: int) -> None:
            self.done += k
            spent = time.time() - self.t0
            left = "done" if self.done >= total else f"ETA {duration(spent / self.done * (total - self.done))}"
            print(f"eval {label}: {self.done}/{total} problems, {duration(spent)}, {left}", flush=True)

        def close(self) -> None:
            pass

    return Lines()


def plot_pass_at_k(report: dict, path: str) -> str:
    """The picture beside a report: pass@k (%) against k, one line per benchmark (math and out-of-domain), k on a
    log-2 axis. Returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for group in ("benchmarks", "ood"):
        for name, result in (report.get(group) or {}).items():
            points = sorted((int(k), 100 * v) for k, v in result["pass@k"].items())   # keys: ints, or str from JSON
            ax.plot([k for k, _ in points], [v for _, v in points], marker="o", label=_label(name))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k (samples per problem)")
    ax.set_ylabel("pass@k (%)")
    ax.set_title(f"{report.get('model_label') or model_label(report['model'])}: n = {report['n']}, T = {report['temperature']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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


TINY_MODEL = 10_000_000   # parameters: below this a CPU model is sampled on one thread (the toy policy: 0.3 M)


def make_generator(name_or_path: str, backend: str, *, seed: int = 0, vllm_mem: float = 0.85,
                   gen_batch_size: int = 64):
    """(generator, tokenizer) for evaluation: vLLM when asked, or with `auto` when vLLM imports and CUDA
    is present; else Hugging Face generate on CUDA or CPU, `gen_batch_size` rows per generate call (training's
    --gen-batch-size: then its periodic evaluation and this one draw the same samples)."""
    import torch

    from harness.engines import lora
    from harness.engines.generate import HFGenerator, VLLMGenerator, load_causal_lm, load_tokenizer, vllm_importable

    adapter = lora.is_adapter(name_or_path) and not os.path.isfile(os.path.join(name_or_path, "config.json"))
    if backend == "auto":
        backend = "vllm" if vllm_importable() and torch.cuda.is_available() and not adapter else "hf"
    if backend == "vllm":

        try:
            tokenizer = load_tokenizer(name_or_path)
        except (OSError, ValueError) as err:
            raise RuntimeError(f"could not load the tokenizer of model '{name_or_path}' "
                               f"(no local directory and no network?). [{err}]") from err
        return VLLMGenerator(name_or_path, tokenizer=tokenizer, gpu_memory_utilization=vllm_mem,
                             seed=seed), tokenizer
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_adapter(name_or_path, device) if adapter else load_causal_lm(name_or_path, device)
    if device == "cpu" and sum(p.numel() for p in model.parameters()) < TINY_MODEL:
        torch.set_num_threads(1)   # as the toy world trains and evaluates: the same samples, no oversubscription
    return HFGenerator(model.eval(), tokenizer, micro_batch_size=gen_batch_size), tokenizer


def load_adapter(path: str, device: str):
    """(model, tokenizer) of a LoRA run's checkpoint: its adapter merged into the base that adapter_config.json
    names (lora.export_merged, as model/ is written), bfloat16 on CUDA, float32 on the CPU; the checkpoint's
    tokenizer. A base that cannot load: RuntimeError naming it."""
    import torch

    from harness.engines import lora
    from harness.engines.generate import load_tokenizer

    print(f"{path}: a LoRA adapter, evaluated merged into its base with HF generate")
    try:
        model = lora.export_merged(path)
    except SystemExit as err:   # lora's one-line refusal: the base named in adapter_config.json does not load
        raise RuntimeError(str(err.code).removeprefix("error: ")) from None
    return model.to(device, torch.bfloat16 if device.startswith("cuda") else torch.float32), load_tokenizer(path)


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain text table, columns padded to their widest cell."""
    widths = [max(len(str(cell)) for cell in col) for col in zip(headers, *rows)]

    def line(cells):  # first column left-aligned, numbers right-aligned
        return "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def _label(name: str) -> str:
    """A benchmark's name for a table: its file name when it is a path."""
    return os.path.basename(name) if os.sep in name else name


def accuracy_table(results: dict[str, dict]) -> str:
    """One row per benchmark: problems, avg@n, pass@k for k in pass_ks(n), share of samples cut at
    max_new_tokens (all in percent), plus the unweighted mean over benchmarks (the paper's "Avg.")."""
    n = next(iter(results.values()))["n"]
    ks = pass_ks(n)
    headers = ["benchmark", "problems", f"avg@{n}"] + [f"pass@{k}" for k in ks] + ["truncated"]
    rows = [[_label(name), str(r["num_problems"]), f"{100 * r['acc']:.1f}"]
            + [f"{100 * r['pass@k'][k]:.1f}" for k in ks] + [f"{100 * r['truncated']:.1f}"]
            for name, r in results.items()]
    if len(results) > 1:
        def mean(key, k=None):
            return f"{100 * sum(r[key] if k is None else r[key][k] for r in results.values()) / len(results):.1f}"

        rows.append(["average", "", mean("acc")] + [mean("pass@k", k) for k in ks] + [mean("truncated")])
    return format_table(headers, rows)


DIVERSITY_COLUMNS = [("distinct_1", "distinct-1"), ("distinct_4", "distinct-4"),
                     ("one_minus_self_bleu", "1-self-BLEU"), ("one_minus_self_rouge", "1-self-ROUGE"),
                     ("div_score", "div-score")]


def diversity_table(results: dict[str, dict], model: str) -> str:
    """Paper Table 4: per benchmark, each diversity metric as median [p10, p90] across prompts, plus
    pass@1 and pass@n (percent)."""
    n = next(iter(results.values()))["n"]
    headers = ["model", "benchmark"] + [label for _, label in DIVERSITY_COLUMNS] + ["pass@1", f"pass@{n}"]
    rows = []
    for name, r in results.items():
        d = r["diversity"]
        rows.append([model, _label(name)]
                    + [f"{d[key]['median']:.2f} [{d[key]['p10']:.2f}, {d[key]['p90']:.2f}]"
                       for key, _ in DIVERSITY_COLUMNS]
                    + [f"{100 * r['pass@k'][1]:.1f}", f"{100 * r['pass@k'][n]:.1f}"])
    return format_table(headers, rows)


class DefaultsShown(argparse.HelpFormatter):
    """--help with each flag's default after its text, where it has one (not for switches or an unset path)."""

    def _get_help_string(self, action):
        shown = action.option_strings and not any(action.default is x for x in (None, False, argparse.SUPPRESS))
        shown = shown and action.default != "" and "(default:" not in action.help   # the data flags say their own
        return f"{action.help} (default: %(default)s)" if shown else action.help


class OneLineErrors(argparse.ArgumentParser):
    """argparse whose refusals are one line naming the culprit (and the closest flag), not the usage screen."""

    def error(self, message):
        self.exit(2, f"eval.py: {message} (python eval.py --help lists every flag)\n")


def make_parser() -> OneLineErrors:
    """eval.py's flags (--help)."""
    from harness.run import cli

    p = OneLineErrors(
        prog="eval.py", allow_abbrev=False, formatter_class=DefaultsShown, description="Evaluate a checkpoint on math / OOD benchmarks (avg@n, "
        "pass@k, diversity), or time the grader (curves and traces: python -m tools.report).")
    p.add_argument("--model", help="HF model id, alias (Qwen2.5-1.5B, ... as scope.py takes them) or local model "
                   "folder (a run's runs/NAME/checkpoint or runs/NAME/model; a LoRA run's checkpoint/ is its "
                   "adapter, evaluated on its base with HF generate)")
    p.add_argument("--benchmarks", default="math500,aime24,aime25,amc,minerva,olympiad",
                   help="comma-separated names from BENCHMARKS, 'toy', or local .jsonl paths")
    p.add_argument("--ood", default="", help="comma-separated out-of-domain benchmarks, e.g. arc-c,gpqa,mmlu-pro "
                   "(default: none)")
    p.add_argument("--n", type=int, default=8, help="samples per problem (avg@n, pass@k for k <= n)")
    p.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling top-p")
    p.add_argument("--max-new-tokens", type=int, default=1024,
                   help="new tokens per sample (clamped to the context)")
    p.add_argument("--batch-size", type=int, default=64, help="problems per generate call")
    p.add_argument("--gen-batch-size", type=int, default=64, help="sequences per HF generate call (training's "
                   "--gen-batch-size: the same samples as its periodic evaluation)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--limit", type=int, default=None,
                   help="first K problems of each benchmark (default: all)")
    cli.add_data_flags(p)   # --system-prompt, --question-field, --answer-field: as scope.py has them
    p.add_argument("--backend", choices=["auto", "vllm", "hf"], default="auto",
                   help="generation backend; auto = vLLM when importable and CUDA is present, else HF")
    p.add_argument("--vllm-mem", type=float, default=0.85, help="vLLM gpu_memory_utilization")
    p.add_argument("--out", default=None,
                   help="the results JSON file (default: eval_<folder>.json next to a local model folder, else "
                        "runs/eval_<hub id>.json), its pass@k picture beside it (.png)")
    p.add_argument("--overwrite", action="store_true", help="replace a report already at the --out path (without "
                   "it the evaluation stops before it starts)")
    p.add_argument("--save-samples", action="store_true", help="keep every sampled text in the results JSON")
    p.add_argument("--diversity", action="store_true",
                   help="also print the Table-4 diversity table (needs --n >= 2; paper: --n 10 --temperature 1.0)")
    p.add_argument("--grader", choices=["ours", "math-verify"], default="ours",
                   help="who grades: our grader (docs/grader.md) or Math-Verify, the paper's tables' convention "
                        "(pip install math-verify==0.9.0; LaTeX extraction only, in a child process)")
    p.add_argument("--grader-bench", action="store_true", help="time the grader on generated pairs and exit")
    return p


# TRL's names (GRPOConfig, TrainingArguments, ModelConfig) of eval.py's flags: (ours, what differs). "" = the same
# meaning: taken as ours (--max_completion_length 512 = --max-new-tokens 512); else a one-line hint naming ours.
# Our own flags with underscores (--max_new_tokens, --top_p) are taken too, as scope.py takes them.
TRL_NAMES = {
    "model_name_or_path": ("--model", ""),
    "max_completion_length": ("--max-new-tokens", ""),
    "vllm_gpu_memory_utilization": ("--vllm-mem", ""),
    "num_generations": ("--n", "samples per problem, for avg@n and pass@k"),
    "per_device_eval_batch_size": ("--batch-size", "ours counts problems per generate call, each sampled --n times"),
    "output_dir": ("--out", "ours is the report's JSON file, by default beside the evaluated model folder"),
    "dataset_name": ("--benchmarks", "a comma-separated list of benchmark names or local .jsonl files"),
    "use_vllm": ("--backend", "--backend vllm (auto: vLLM when installed and CUDA is present)"),
    "top_k": (None, "nucleus sampling only (--top-p)"),
    "torch_dtype": (None, "bfloat16 on CUDA, float32 on the CPU"),
    "bf16": (None, "bfloat16 on CUDA, float32 on the CPU"),
}


def trl_argv(argv: list[str]) -> list[str]:
    """argv with TRL's names of the same meaning in ours (`--max_completion_length 512` → `--max-new-tokens 512`)."""
    out = []
    for word in argv:
        name, eq, value = word.partition("=")
        ours, note = TRL_NAMES.get(name[2:].replace("-", "_"), (None, None)) if name.startswith("--") else (None, None)
        out.append(ours + eq + value if ours and not note else word)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, each value checked: a refusal is one line (exit 2) before anything loads. TRL's names: TRL_NAMES."""
    from harness.run import cli

    p = make_parser()
    flags = [o for a in p._actions for o in a.option_strings]
    argv = cli.normalise(trl_argv(list(sys.argv[1:] if argv is None else argv)), flags)
    args, unknown = p.parse_known_args(argv)
    if unknown:
        from harness.run.config import unknown_argument
        p.error(cli.trl_hint(unknown[0], TRL_NAMES) or unknown_argument(unknown[0], flags))
    if not (args.grader_bench or args.model):
        p.error("--model is required (or --grader-bench; curves and traces: python -m tools.report --plot/--trace RUN)")
    for flag, ok, valid in (("n", args.n >= 1, "an integer >= 1"),
                            ("limit", args.limit is None or args.limit >= 1, "an integer >= 1 (omit it: every problem)"),
                            ("temperature", args.temperature >= 0, ">= 0 (0 = greedy)"),
                            ("top-p", 0 < args.top_p <= 1, "in (0, 1]"),
                            ("max-new-tokens", args.max_new_tokens >= 1, "an integer >= 1"),
                            ("batch-size", args.batch_size >= 1, "an integer >= 1"),
                            ("gen-batch-size", args.gen_batch_size >= 1, "an integer >= 1"),
                            ("vllm-mem", 0 < args.vllm_mem < 1, "a share of the GPU's memory in (0, 1)")):
        if not ok:
            p.error(f"--{flag} {getattr(args, flag.replace('-', '_'))}: must be {valid}")
    if args.diversity and args.n < 2:
        p.error("--diversity needs --n >= 2 samples per prompt")
    return args


def checked_inputs(args: argparse.Namespace) -> str:
    """What the input alone decides, checked before anything loads (scope.py's pre-flight functions, so both
    answer alike); returns the model to load. A model name resolved as scope.py resolves it (an alias → its hub
    id); a path that does not exist names the closest one, a run folder its checkpoint/ and model/; a LoRA run's
    checkpoint/ (an adapter) is taken, for HF generate only (load_adapter); without
    network (no connection within 3 s) the hub libraries go offline at once, and a model or benchmark that must
    come from the hub and is not in the local cache stops here. --question-field / --answer-field need a data set
    of one's own. runs.Refused (a ValueError): one line."""
    from harness.engines import lora
    from harness.run import cli, preflight
    from harness.data.problems import BENCHMARKS
    from harness.run.runs import stop

    model = preflight.check_model_name("--model", args.model, adapter=True)   # a LoRA checkpoint: on its base
    if lora.is_adapter(model) and args.backend == "vllm":
        stop(f"--model {args.model}: a LoRA adapter, which eval.py evaluates on its base with HF generate; pass "
             f"--backend hf, or the run's merged model{lora_merged_hint(model)} for vLLM")
    names = [name.strip() for names in (args.benchmarks, args.ood) for name in names.split(",") if name.strip()]
    refusal = cli.own_data_refusal(names, args.question_field, args.answer_field)
    if refusal:
        stop(refusal)
    from_hub = [n for n in names if n in BENCHMARKS or ("/" in n and not os.path.exists(n))]
    loads = adapter_base(model) if lora.is_adapter(model) else model   # an adapter loads its base first
    if (from_hub or not os.path.exists(loads)) and preflight.offline_now():
        if not os.path.exists(loads) and not preflight.in_hub_cache(loads):
            stop(f"--model {args.model}: {'its base ' + loads + ': ' if loads != model else ''}"
                 f"{preflight.uncached(loads)}")
        args.offline = True
        for name in from_hub:
            if not maybe_cached(name):
                stop(f"{'--ood' if name in args.ood.split(',') else '--benchmarks'} {name}: no network: cannot reach "
                     f"the Hugging Face hub and it is not in the local cache; {LOCAL_FILE_HINT}")
    return model


def adapter_base(adapter: str) -> str:
    """The base model a LoRA adapter folder names (adapter_config.json's base_model_name_or_path)."""
    with open(os.path.join(adapter, "adapter_config.json"), encoding="utf-8") as f:
        return json.load(f).get("base_model_name_or_path") or ""


def lora_merged_hint(adapter: str) -> str:
    """" (runs/R/model: python -m harness.run.export runs/R writes it)" for a run's LoRA checkpoint; else ""."""
    from harness.run.runs import run_of

    run = run_of(adapter)
    return f" ({os.path.join(run, 'model')}: python -m harness.run.export {run} writes it)" if run else ""


LOCAL_FILE_HINT = 'pass a local .jsonl file ({"question": ..., "answer": ...} per line)'


def load_benchmarks(args: argparse.Namespace) -> dict[str, dict[str, list[dict]]]:
    """{"benchmarks": {name: problems}, "ood": {...}}, every one loaded before the model; a source that cannot
    load is one line naming it (offline: with the hint to pass a local file)."""
    from harness.run.runs import stop

    problems = {}
    for group, names in (("benchmarks", args.benchmarks), ("ood", args.ood)):
        problems[group] = {}
        for name in (n.strip() for n in names.split(",") if n.strip()):
            flag = "--" + group if group == "ood" else "--benchmarks"
            try:
                problems[group][name] = load_problems(name, limit=args.limit, question_field=args.question_field,
                                                      answer_field=args.answer_field)
            except (OSError, ValueError, RuntimeError) as err:
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                hint = f"; no network: {LOCAL_FILE_HINT}" if getattr(args, "offline", False) else ""
                stop(f"{flag} {name}: cannot load problems: {first}{hint}")
    return problems


def report_path(model: str) -> str:
    """Where the results JSON goes without --out: next to the evaluated run (a local checkpoint folder
    runs/X/checkpoint gives runs/X/eval_checkpoint.json), so evaluating two runs never overwrites one file;
    a hub id gives runs/eval_<owner_name>.json (beside the runs, never in the working directory itself)."""
    if os.path.isdir(model):
        folder = os.path.normpath(model)
        return os.path.join(os.path.dirname(folder) or ".", f"eval_{os.path.basename(folder)}.json")
    return os.path.join("runs", f"eval_{re.sub(r'[^A-Za-z0-9_.-]+', '_', model.strip('/'))}.json")


def checked_out(args: argparse.Namespace) -> str:
    """The report's path, checked before anything loads: an earlier report there is kept unless --overwrite,
    and a folder that cannot be written stops here rather than after the evaluation. ValueError: one line."""
    from harness.run.runs import unwritable

    out = args.out or report_path(args.model)
    if os.path.isdir(out) or out.endswith(("/", os.sep)):   # the report is a file; a folder fails only at the write
        raise ValueError(f"--out {out}: a folder; the report is a JSON file: pass --out "
                         f"{os.path.join(out, os.path.basename(report_path(args.model)))}, say")
    if os.path.exists(out) and not args.overwrite:
        raise ValueError(f"{out} already holds a report; pass --overwrite to replace it, or --out another path")
    blocked = unwritable(os.path.dirname(os.path.abspath(out)))
    if blocked is not None or (os.path.exists(out) and not os.access(out, os.W_OK)):
        raise ValueError(f"--out {out}: cannot write there ({blocked or out} is not writable); pass --out another "
                         f"path")
    return out


def model_label(model: str) -> str:
    """The model's name in the tables: a run's checkpoint/ or model/ folder is named by its run (runs/X/checkpoint
    → X), any other folder or id by its last part."""
    folder = os.path.normpath(model)
    if os.path.isdir(model) and os.path.basename(folder) in ("checkpoint", "model") and os.path.dirname(folder):
        return os.path.basename(os.path.dirname(folder))
    return os.path.basename(folder)


def run_changes(model: str) -> list[str]:
    """The accepted config changes of the training run a checkpoint folder belongs to (runs/X/checkpoint ->
    runs/X/changes.jsonl), one line each; [] for anything else."""
    run_dir = os.path.dirname(os.path.normpath(model))
    if not (os.path.isdir(model) and os.path.isfile(os.path.join(run_dir, "changes.jsonl"))):
        return []
    from harness.run.runs import format_changes, read_changes

    return format_changes(read_changes(run_dir))


def run_evaluation(args: argparse.Namespace) -> dict:
    """Check every input and load every benchmark first (so a bad name fails before the model loads), then the
    model, then evaluate, print the tables and write the JSON report. Ctrl-C (or SIGTERM) stops calmly: the
    benchmarks already finished are written to the report, marked "interrupted", with the ones left named."""
    from harness.run.runs import refusals_raised

    with refusals_raised():   # a refusal raises runs.Refused (a ValueError): main prints it as one line
        model = checked_inputs(args)   # the model name, the hub (offline at once), the data flags
        out = checked_out(args)   # an earlier report or an unwritable folder stops before the work
        problems = load_benchmarks(args)
    from harness.data.mathverify import for_name
    from harness.run.progress import bars_only_on_a_terminal
    from harness.run.runs import environment
    grade_fn = for_name(args.grader)   # a missing math-verify stops here, before the model loads
    bars_only_on_a_terminal()   # no "Loading weights" bar with carriage returns in a log file
    generator, tokenizer = make_generator(model, args.backend, seed=args.seed, vllm_mem=args.vllm_mem,
                                          gen_batch_size=args.gen_batch_size)
    from harness.run.cli import unused_system_prompt
    note = unused_system_prompt(tokenizer, args.system_prompt)
    if note:
        print(note)
    model_name = model_label(args.model)
    settings = dict(n=args.n, temperature=args.temperature, top_p=args.top_p,
                    max_new_tokens=args.max_new_tokens, seed=args.seed, batch_size=args.batch_size)
    report = {"model": args.model, "model_label": model_name, **settings, "gen_batch_size": args.gen_batch_size,
              "limit": args.limit, "grader": args.grader, "system_prompt": args.system_prompt,
              "environment": environment()}
    changes = run_changes(args.model)
    if changes:   # the checkpoint was trained under settings that changed on a resume: say so with the numbers
        report["run_config_changes"] = changes
        print("\n".join(f"note: its run changed config {line}" for line in changes))
    keep = args.diversity or args.save_samples
    try:
        for group, benchmarks in problems.items():
            results = report[group] = {}
            for name, items in benchmarks.items():
                start = time.perf_counter()
                result = evaluate(generator, tokenizer, items, keep_samples=keep, grade_fn=grade_fn,
                                  progress=_label(name), system=args.system_prompt, **settings)
                result["seconds"] = round(time.perf_counter() - start, 3)   # sampling and grading, not the load
                if args.diversity:
                    result["diversity"] = diversity_summary(result["per_problem"])
                if keep and not args.save_samples:
                    for row in result["per_problem"]:
                        del row["samples"], row["sample_correct"]
                results[name] = result
            if results:
                title = "math benchmarks" if group == "benchmarks" else "out-of-domain benchmarks"
                print(f"\n{title} ({args.model}, n={args.n}, T={args.temperature}, grader {args.grader}; "
                      f"accuracy in %)")
                print(accuracy_table(results))
                if args.diversity:
                    print("\ndiversity across prompts: median [p10, p90] (paper Table 4)")
                    print(diversity_table(results, model_name))
    except KeyboardInterrupt:
        done = [name for group in problems for name in report.get(group, {})]
        left = [name for group in problems for name in problems[group] if name not in report.get(group, {})]
        if not done:
            raise
        report.update(interrupted=True, not_evaluated=left)
        write_report(report, out)
        raise Interrupted(f"interrupted: {out} holds the {len(done)} finished benchmark(s) ({', '.join(done)}); "
                          f"not evaluated: {', '.join(left)}") from None
    write_report(report, out)
    return report


class Interrupted(KeyboardInterrupt):
    """Ctrl-C after some benchmarks finished and were written; its message says where and which."""


def write_report(report: dict, out: str) -> None:
    """The JSON report at `out` and its pass@k picture beside it."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    picture = plot_pass_at_k(report, os.path.splitext(out)[0] + ".png") if any(report.get(g) for g in
                                                                               ("benchmarks", "ood")) else None
    print(f"\nwrote {out}" + (f" and {picture}" if picture else ""))


def main(argv=None) -> int:
    """The command line: 0 when done, 2 for a refusal (one line), 130 on Ctrl-C or SIGTERM (one line, no
    traceback; the benchmarks already finished are kept in the report)."""
    import signal

    args = parse_args(argv)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    previous, previous_int = signal.signal(signal.SIGTERM, on_term), signal.getsignal(signal.SIGINT)
    try:
        if args.grader_bench:
            print(json.dumps(grader_benchmark(), indent=2, default=str))
        else:
            run_evaluation(args)
    except (OSError, ValueError, RuntimeError) as err:  # missing files, bad rows, unloadable models: one line
        print(f"eval.py: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        signal.signal(signal.SIGINT, signal.SIG_IGN)   # a second Ctrl-C must not cut this line short
        print(f"\neval.py: {str(err) or 'interrupted before any benchmark finished; no report written'}", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
    return 0


if __name__ == "__main__":
    sys.exit(main())
