"""why_it_helps.py — does the toy world test the paper's *because*? The controls of its two causal claims.

Not part of the paper's code; its claims are the paper's (Ren et al., arXiv 2602.24110):
 (C1) keeping the policy's own prefix beats whole-trajectory replacement BECAUSE a foreign model's whole
      solution is out of the policy's distribution;
 (C2) SCOPE keeps solutions diverse BECAUSE partially correct explorations are salvaged, not discarded.
The regime map (tools/studies/when_it_helps.py) cannot test either: the oracle refiner writes the policy's own format (its
tokens are likely under the weak start), any reward-1 trajectory in an all-fail group moves the group
mean off 0 whatever its content, and two fixed biases (the "shorter" tie-break of prm.select_candidate and the
oracle's style 0 after an empty prefix) point the three-style runs at style 0. This stage adds the controls:

    python -m tools.studies --stage because                     # 25 + 5 added runs; resumes from its records
    python -m tools.studies --stage because --records-only      # the report from the runs recorded so far
    python -m tools.studies.why_it_helps --precheck             # the zero-training pre-checks (~3 min)

THE PRE-REGISTRATION (written and committed before any run of this stage; the report computes exactly this)

Runs, 5 seeds (0-4) x 100 steps each, the regime map's settings (8 prompts x 8 rollouts, final eval on 64
held-out problems x 16 samples at T = 1.0, in-training eval every 25 steps on 200 problems):
  weak-ladder start (the lateness-1.5 SFT, one style, on the ladder; about half of its G = 8 groups all-fail):
    keep-foreign           SCOPE (paper) any/replace, --toy-refiner-style 1: the refiner writes style 1
                           ("7 add 5 is 12."), which this policy never wrote: a repair = own prefix + a
                           foreign-voice suffix
    whole-foreign          --mode replace --toy-refiner-style 1: the whole repair in the foreign voice
    keep-in-style-phantom  SCOPE (paper) any/replace, --repair-advantage zero: the repair counts in its
                           group's mean (the all-fail group's 7 failures get A = -1/8), its own A is 0
    read from the regime map's records (same commands): grpo, SCOPE (paper) = keep-in-style, whole
    replacement = whole-in-style.
  three-style start (harness/data/toy.py choice 10; the diversity stage's start and settings):
    scope index tie-break  SCOPE (paper) any/replace, --select-tiebreak index (the earlier rollout among
                           equally promising failures; an empty prefix's oracle style drawn uniformly from the
                           three with the refine seed)
    whole one-style teacher  --mode replace --toy-refiner-style 1 (the LUFFY analogue: a teacher with one
                           voice). Style 1, not 0: it is as easy for the tiny model as style 0 (style 2 is
                           the hard one), and a drift to it cannot be style 0's head start.
    read from the diversity stage's records: grpo, SCOPE (paper) (length tie-break).

Contrasts, paired by seed, mean and 95 % t-interval over the 5 seeds (tools/studies/common.py ci95), on held-out
accuracy at T = 1.0 (acc) unless named; next to each interval of a new contrast, a seed x problem bootstrap
interval (`seed_problem_bootstrap`: seeds and problems both resampled, 4000 draws, percentiles; the reference
records predate per-problem counts, so their runs enter it through the seed draw only).
  K1  interaction  (keep-foreign − whole-foreign) − (keep-in-style − whole-in-style)
      C1 predicts > 0: a foreign whole solution is off-distribution, a foreign suffix after the policy's own
      prefix much less so. "No off-distribution penalty in this world" predicts ≈ 0.
      Also shown: keep-foreign − whole-foreign alone, and each foreign row − grpo.
  K2  phantom − keep-in-style
      "the gain is the mean shift, content-free" predicts ≈ 0 (and phantom − grpo > 0);
      "the repair's content matters" predicts < 0 (and phantom ≈ grpo).
  K3  whole-foreign − phantom
      > 0: even a foreign-voice solution teaches more than a bare mean shift; < 0: its content hurts (the
      off-distribution harm C1 is about); ≈ 0: content does not matter either way.
  K4  style entropy of the correct samples of the final policy (nats; evaluate_policy's style_entropy): each
      three-style row − grpo and − SCOPE (paper), paired by seed, and each seed's dominant style (the style
      with the largest share of correct samples).
      C2 with a neutral pick predicts: scope index tie-break's entropy ≥ grpo's (Δ interval not below 0) and
      above SCOPE (paper)'s. "The collapse came from the two fixed biases" predicts index − SCOPE (paper) > 0
      and dominant styles that are not style 0 in every seed. "Rich get richer" (repairs copy whatever style
      the picks favour, and the lead compounds) predicts a low entropy again (index − grpo < 0) but a dominant
      style that varies by seed. The LUFFY-analogue reading of C2 predicts whole one-style teacher − grpo < 0
      with style 1 dominant in most seeds.
      For the weak-ladder foreign rows: the share of style 1 (and of mixed/other) among all samples of the
      final policy: does the policy pick up the foreign voice?
  K5  multiplicity: the nine map comparisons (3 starts x {SCOPE (paper), best cell any/append, whole
      replacement} − grpo, acc, from the regime records) and ONE pooled contrast named here: SCOPE (paper) −
      grpo pooled over the two weak starts (weak-ladder and weak-6ops, 10 seed pairs, one t-test), all ten
      under a Holm correction (two-sided paired t-test p-values). The per-start map numbers were already
      published when this was named; only the pooled number is new.
Reading rule (fixed now): a contrast SUPPORTS a prediction of a sign when its 95 % t-interval excludes 0 on
that side; it supports "≈ 0" when the interval lies inside ±0.02 acc (two thirds of the paper row's gain over
GRPO on weak-ladder in the regime map) or ±0.15 nats; otherwise the toy cannot tell. The t-interval decides; the bootstrap
is reported next to it as a check of the problem-sampling variance the t-interval leaves out.
Pre-check that must hold for K1 to mean anything (`precheck`, threshold stated before it was computed): the
weak start's mean π of the oracle's style-1 solution tokens, teacher-forced, must be at most 0.60 (well below
its own style's): far below means the policy would write well under two thirds of those tokens. If
it is not, K1 is reported as "not a test of C1".

ADDED AFTER THE STUDY (an optional cell, named here before its runs, outside K5's Holm family; chosen after
the regime map's strong-start numbers were seen, so post hoc):
  main-ladder start (the shipped warm start, the regime map's strongest): whole-append  --mode replace
      --merge append: the whole repair joins its group instead of replacing the failure. On this start the
      regime map's only SCOPE cell above GRPO is any/append, and both --merge replace rows (keeping the
      prefix or not) sit at GRPO's level. A1  whole-append − best any/append: ≈ 0 says the edge belongs to
      --merge append, not to keeping the prefix; < 0 says keeping the prefix matters once repairs are
      appended. Also shown: whole-append − grpo.

Choices:
 1. The foreign voice is style 1 for both starts (see above). On the weak start all three styles are foreign
    but style 0; style 1 is the one whose step words ("add", "minus", "times") the policy reads in every
    question, so it is the mildest foreign voice: a penalty found with it is not an artefact of gibberish.
 2. The reference rows are the recorded regime / diversity runs, not reruns: the same commands, trained by
    the same code (a record whose command differs would be retrained by those stages).
 3. Cost: 25 runs of ~5 min of two cores each, two at a time (~65 min on an idle 2-core machine; more
    under load). Jobs are seed-major, so a study stopped early holds complete seeds.
"""
import argparse
import json
import math
import os
import time

import numpy as np

from tools.studies import common
from tools.studies import when_it_helps

FOREIGN = "1"   # choice 1
WEAK = "weak-ladder"
WEAK_ROWS = {   # label: scope.py flags (tools/studies/common.py GRID rows + the new switches)
    "keep-foreign": f"{common.GRID['scope any/replace']} --toy-refiner-style {FOREIGN}",
    "whole-foreign": f"{common.GRID['replace (whole)']} --toy-refiner-style {FOREIGN}",
    "keep-in-style-phantom": f"{common.GRID['scope any/replace']} --repair-advantage zero",
}
WEAK_REFS = ("grpo", "scope (paper): any/replace", "replace (whole)")   # regime records of weak-ladder
STYLE_ROWS = {
    "scope index tie-break": f"{common.GRID['scope any/replace']} --select-tiebreak index",
    "whole one-style teacher": f"{common.GRID['replace (whole)']} --toy-refiner-style {FOREIGN}",
}
STYLE_REFS = ("grpo", "scope (paper): any/replace")   # diversity records
STRONG = "main-ladder"
STRONG_ROWS = {"whole-append": f"{common.GRID['replace (whole)']} --merge append"}   # added after the study (A1)
APPEND = "best: scope any/append"   # its regime-map reference row
KEEP_I, WHOLE_I = "scope (paper): any/replace", "replace (whole)"
ACC_MARGIN, NATS_MARGIN = 0.02, 0.15   # the "≈ 0" margins of the reading rule
PI_THRESHOLD = 0.60                    # the pre-check's threshold (stated before it was computed)
BOOT_DRAWS = 4000


# ---------------------------------------------------------------- the plan

def plan(args) -> list[dict]:
    """The 25 pre-registered runs, seed-major (every row of seed 0 first), then the 5 added ones (A1)."""
    weak_settings, weak_task = when_it_helps.STARTS[WEAK]
    strong_settings, strong_task = when_it_helps.STARTS[STRONG]
    styles_start = json.dumps({"styles": 3})
    jobs = []
    for seed in args.seed_list:
        jobs += [common.job(row, seed, flags, args, group=f"regime-{WEAK}", steps=args.regime_steps, task=weak_task,
                             start=json.dumps(weak_settings), eval_every=args.regime_eval_every)
                 for row, flags in WEAK_ROWS.items()]
        jobs += [common.job(row, seed, f"{flags} --toy-styles 3", args, group="diversity", steps=args.diversity_steps,
                             start=styles_start, eval_every=args.regime_eval_every)
                 for row, flags in STYLE_ROWS.items()]
    for seed in args.seed_list:
        jobs += [common.job(row, seed, flags, args, group=f"regime-{STRONG}", steps=args.regime_steps,
                             task=strong_task, start=json.dumps(strong_settings), eval_every=args.regime_eval_every)
                 for row, flags in STRONG_ROWS.items()]
    return jobs


def reference_jobs(args) -> dict:
    """{stage: jobs} of the recorded runs the contrasts pair with: the regime map (all three starts, for K5)
    and the diversity stage's two rows."""
    regime_jobs = [j for j in when_it_helps.plan_regime(args, list(when_it_helps.STARTS)) if j["steps"]]
    diversity_jobs = [j for j in when_it_helps.plan_diversity(args) if j["steps"] and j["row"] in STYLE_REFS]
    return {"regime": regime_jobs, "diversity": diversity_jobs}


def read_references(args) -> list[dict]:
    """The reference runs' results from their stages' records (only the records whose command matches)."""
    out = []
    stage = args.stage
    try:
        for ref_stage, jobs in reference_jobs(args).items():
            args.stage = ref_stage
            out += [r for r in (when_it_helps.recorded(j, args) for j in jobs) if r is not None]
    finally:
        args.stage = stage
    return out


def run_one(j: dict, args) -> dict:
    """A new run's record (trained first if missing), with its mechanism figures (π of the refiner's tokens
    at step 1, `common.mechanism`) added to the record once."""
    os.chdir(common.ROOT)
    r = when_it_helps.run_recorded(j, args)
    if "mechanism" not in r:
        mech = common.mechanism([r], args) if os.path.exists(os.path.join("runs", j["name"], "traces.jsonl")) else {}
        r["mechanism"] = next(iter(mech.values()), None)
        path = when_it_helps.record_path(j, args)
        record = common.read_json(path)
        record["result"] = r
        with open(path, "w") as f:
            json.dump(record, f)
    return r


# ---------------------------------------------------------------- statistics (pure)

def contrast_by_seed(results: list[dict], group: str, coefs: dict, key: str = "acc_t1") -> dict:
    """{seed: Σ_row coef · value(row, seed)} over the seeds where every row of `coefs` has a value."""
    by = {(r["row"], r["seed"]): r for r in results if r["group"] == group and r["steps"]}
    seeds = sorted({s for _, s in by})
    out = {}
    for s in seeds:
        vals = [common.value(by[(row, s)], key) if (row, s) in by else None for row in coefs]
        if all(v is not None for v in vals):
            out[s] = sum(c * v for c, v in zip(coefs.values(), vals))
    return out


def per_problem_matrix(results: list[dict], group: str, coefs: dict, seeds: list[int], n: int = 16
                       ) -> np.ndarray | None:
    """D[s, p] = Σ_row coef · x_row[s, p]: x = correct / 16 of problem p where the record has per-problem
    counts, else the run's acc (the same for every p, so it varies with the seed draw only). None when no run
    of the contrast has counts."""
    by = {(r["row"], r["seed"]): r for r in results if r["group"] == group and r["steps"]}
    counts = [by[(row, s)]["eval"].get("per_problem_correct") for row in coefs for s in seeds]
    sizes = {len(c) for c in counts if c}
    if not sizes:
        return None
    (P,) = sizes
    D = np.zeros((len(seeds), P))
    for i, s in enumerate(seeds):
        for row, c in coefs.items():
            r = by[(row, s)]
            pp = r["eval"].get("per_problem_correct")
            D[i] += c * (np.asarray(pp, dtype=float) / n if pp else r["eval"]["acc_t1"])
    return D


def seed_problem_bootstrap(D: np.ndarray, draws: int = BOOT_DRAWS, seed: int = 0) -> dict:
    """Percentile 95 % interval of the mean of D (seeds x problems) when both the seeds and the problems are
    resampled with replacement (one problem draw shared by all seeds: every run is evaluated on the same
    problems, so problem difficulty is common to the pair)."""
    D = np.asarray(D, dtype=float)
    S, P = D.shape
    rng = np.random.default_rng(seed)
    stats = np.empty(draws)
    for b in range(draws):
        si, pi = rng.integers(S, size=S), rng.integers(P, size=P)
        stats[b] = D[np.ix_(si, pi)].mean()
    return {"mean": float(D.mean()), "lo": float(np.percentile(stats, 2.5)), "hi": float(np.percentile(stats, 97.5)),
            "draws": draws}


def paired_p(diffs: list[float]) -> float | None:
    """Two-sided p-value of a paired t-test of mean(diffs) = 0 (None with fewer than 2 values)."""
    from scipy import stats

    d = np.asarray([x for x in diffs if x is not None], dtype=float)
    if len(d) < 2:
        return None
    sd = d.std(ddof=1)
    if sd == 0:
        return 0.0 if d.mean() != 0 else 1.0
    t = d.mean() / (sd / math.sqrt(len(d)))
    return float(2 * stats.t.sf(abs(t), len(d) - 1))


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order: sort ascending, p_(i) · (m − i + 1) (i from 1),
    made monotone by a running maximum, capped at 1. Reject at level α where the adjusted p ≤ α."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, pvalues[i] * (m - rank)))
        adjusted[i] = running
    return adjusted


def verdict(c: dict, margin: float) -> str:
    """The pre-registered reading rule of one contrast interval."""
    if c["lo"] is None:
        return "too few seeds"
    if c["lo"] > 0:
        return "> 0"
    if c["hi"] < 0:
        return "< 0"
    if -margin < c["lo"] and c["hi"] < margin:
        return "≈ 0"
    return "cannot tell"


def dominant_style(share: list[float] | None) -> int | None:
    return None if not share else int(np.argmax(share))


# ---------------------------------------------------------------- the report

CONTRASTS = {   # name: (group, {row: coefficient}, key, margin, new)
    "K1 interaction (keep − whole | foreign) − (keep − whole | in-style)":
        (f"regime-{WEAK}", {"keep-foreign": 1, "whole-foreign": -1, KEEP_I: -1, WHOLE_I: 1}, "acc_t1", ACC_MARGIN),
    "keep-foreign − whole-foreign": (f"regime-{WEAK}", {"keep-foreign": 1, "whole-foreign": -1}, "acc_t1", ACC_MARGIN),
    "keep-in-style − whole-in-style (recorded)": (f"regime-{WEAK}", {KEEP_I: 1, WHOLE_I: -1}, "acc_t1", ACC_MARGIN),
    "keep-foreign − grpo": (f"regime-{WEAK}", {"keep-foreign": 1, "grpo": -1}, "acc_t1", ACC_MARGIN),
    "whole-foreign − grpo": (f"regime-{WEAK}", {"whole-foreign": 1, "grpo": -1}, "acc_t1", ACC_MARGIN),
    "K2 phantom − keep-in-style": (f"regime-{WEAK}", {"keep-in-style-phantom": 1, KEEP_I: -1}, "acc_t1", ACC_MARGIN),
    "phantom − grpo": (f"regime-{WEAK}", {"keep-in-style-phantom": 1, "grpo": -1}, "acc_t1", ACC_MARGIN),
    "K3 whole-foreign − phantom": (f"regime-{WEAK}", {"whole-foreign": 1, "keep-in-style-phantom": -1}, "acc_t1",
                                   ACC_MARGIN),
    "K4 style entropy: scope index tie-break − grpo": ("diversity", {"scope index tie-break": 1, "grpo": -1},
                                                       "style_entropy", NATS_MARGIN),
    "K4 style entropy: scope index tie-break − SCOPE (paper)": ("diversity", {"scope index tie-break": 1, KEEP_I: -1},
                                                                "style_entropy", NATS_MARGIN),
    "K4 style entropy: whole one-style teacher − grpo": ("diversity", {"whole one-style teacher": 1, "grpo": -1},
                                                         "style_entropy", NATS_MARGIN),
    "K4 style entropy: whole one-style teacher − SCOPE (paper)":
        ("diversity", {"whole one-style teacher": 1, KEEP_I: -1}, "style_entropy", NATS_MARGIN),
    "acc: scope index tie-break − SCOPE (paper)": ("diversity", {"scope index tie-break": 1, KEEP_I: -1}, "acc_t1",
                                                   ACC_MARGIN),
    "acc: whole one-style teacher − grpo": ("diversity", {"whole one-style teacher": 1, "grpo": -1}, "acc_t1", ACC_MARGIN),
    "A1 (added) strong start: whole-append − any/append": (f"regime-{STRONG}", {"whole-append": 1, APPEND: -1}, "acc_t1",
                                                           ACC_MARGIN),
    "strong start (added): whole-append − grpo": (f"regime-{STRONG}", {"whole-append": 1, "grpo": -1}, "acc_t1",
                                                  ACC_MARGIN),
}
MAP_ROWS = ("scope (paper): any/replace", "best: scope any/append", "replace (whole)")
WEAK_STARTS = ("weak-ladder", "weak-6ops")


def contrasts(results: list[dict], n: int = 16) -> dict:
    out = {}
    for name, (group, coefs, key, margin) in CONTRASTS.items():
        by_seed = contrast_by_seed(results, group, coefs, key)
        c = common.ci95(list(by_seed.values()))
        row = {"seeds": sorted(by_seed), "per_seed": by_seed, "t": c, "verdict": verdict(c, margin), "key": key}
        if key == "acc_t1" and by_seed:
            D = per_problem_matrix(results, group, coefs, sorted(by_seed), n)
            row["bootstrap"] = seed_problem_bootstrap(D) if D is not None else None
        out[name] = row
    return out


def multiplicity(refs: list[dict]) -> list[dict]:
    """K5: the nine map comparisons and the pooled weak-start contrast, with Holm-adjusted p-values."""
    tests = []
    for start in when_it_helps.STARTS:
        for row in MAP_ROWS:
            d = list(contrast_by_seed(refs, f"regime-{start}", {row: 1, "grpo": -1}).values())
            tests.append({"name": f"{start}: {row} − grpo", "diffs": d})
    pooled = [x for s in WEAK_STARTS for x in contrast_by_seed(refs, f"regime-{s}", {KEEP_I: 1, "grpo": -1}).values()]
    tests.append({"name": "pooled weak starts: SCOPE (paper) − grpo", "diffs": pooled})
    tests = [t for t in tests if len(t["diffs"]) >= 2]
    ps = [paired_p(t["diffs"]) for t in tests]
    for t, p, adj in zip(tests, ps, holm(ps)):
        t.update(ci=common.ci95(t["diffs"]), p=p, p_holm=adj, survives=adj <= 0.05)
    return tests


def style_table(results: list[dict]) -> list[dict]:
    """Per new or reference row with style data: mean style shares of correct samples, each seed's dominant
    style, and for the foreign rows the shares among all samples."""
    rows = []
    for group in (f"regime-{WEAK}", "diversity"):
        for row in dict.fromkeys(r["row"] for r in results if r["group"] == group and r["steps"]):
            rs = sorted([r for r in results if r["group"] == group and r["row"] == row], key=lambda r: r["seed"])
            shares = [r["eval"].get("style_share") for r in rs]
            if not any(shares):
                continue
            rows.append({"group": group, "row": row, "seeds": [r["seed"] for r in rs],
                         "entropy": common.mean([r["eval"].get("style_entropy") for r in rs]),
                         "share_correct": np.mean([s for s in shares if s], 0).tolist(),
                         "dominant": [dominant_style(s) for s in shares],
                         "share_all": np.mean([r["eval"]["style_share_all"] for r in rs if r["eval"].get("style_share_all")],
                                              0).tolist() if any(r["eval"].get("style_share_all") for r in rs) else None,
                         "other_all": common.mean([r["eval"].get("style_other_all") for r in rs])})
    return rows


def mechanism_table(results: list[dict]) -> dict:
    """Per new row: the mean over its runs of the step-1 mechanism figures (π of refiner tokens, A, coefficient)."""
    out = {}
    for row in dict.fromkeys(r["row"] for r in results if r.get("mechanism")):
        ms = [r["mechanism"] for r in results if r["row"] == row and r.get("mechanism")]
        out[row] = {k: common.mean([m.get(k) for m in ms]) for k in
                    ("per_run", "in_all_fail_groups", "kept", "refiner_tokens", "a_repair",
                     "refiner_pi", "refiner_coef", "corrected_pi")}
        out[row]["runs"] = len(ms)
    return out


def report(new: list[dict], refs: list[dict], args, wall_minutes: float) -> tuple[str, dict]:
    f3 = lambda x: "–" if x is None else f"{x:.3f}"   # noqa: E731
    results = new + [r for r in refs if r["group"] in (f"regime-{WEAK}", "diversity", f"regime-{STRONG}")]
    con, mult, styles, mech = contrasts(results, args.eval_n), multiplicity(refs), style_table(results), mechanism_table(new)
    planned = len(plan(args))
    partial = "" if len(new) >= planned else f" — PARTIAL: {len(new)} of {planned} runs"
    md = [f"# Toy world: does it test the paper's *because*?{partial}\n",
          "Command: `python -m tools.studies --stage because` (pre-registered contrasts: tools/studies/why_it_helps.py "
          f"docstring).  \nNew runs recorded: {len(new)} of {planned}; their own wall time (training + final eval, "
          f"as recorded): {when_it_helps.run_minutes(new):.0f} min; this report: {wall_minutes:.1f} min.  \n"
          "Reference rows read from the regime and diversity records (no per-problem counts: they enter the "
          "bootstrap through the seed draw only).\n",
          "## Pre-registered contrasts (paired by seed; the last two, A1, were added after the study)\n",
          "| contrast | seeds | mean [95 % t-interval] | seed × problem bootstrap 95 % | reading |", "|---" * 5 + "|"]
    for name, c in con.items():
        b = c.get("bootstrap")
        boot = f"[{b['lo']:+.3f}, {b['hi']:+.3f}]" if b else "–"
        md.append(f"| {name} | {len(c['seeds'])} | {common.fmt_ci(c['t'])} | {boot} | {c['verdict']} |")
    md += ["", "## Rows (mean ± sd over seeds)\n", "| start | row | seeds | acc T=1.0 | pass@16 | style entropy |",
           "|---" * 6 + "|"]
    for group in (f"regime-{WEAK}", "diversity", f"regime-{STRONG}"):
        for row in dict.fromkeys(r["row"] for r in results if r["group"] == group and r["steps"]):
            rs = [r for r in results if r["group"] == group and r["row"] == row]
            md.append(f"| {group} | {row} | {len(rs)} | {common.mean_sd([common.value(r, 'acc_t1') for r in rs])} | "
                      f"{common.mean_sd([common.value(r, 'pass@16') for r in rs])} | "
                      f"{common.mean_sd([r['eval'].get('style_entropy') for r in rs])} |")
    md += ["", "## Styles of the final policy (T = 1.0)\n",
           "| start | row | seeds | entropy of correct | shares of correct 0 / 1 / 2 | dominant style per seed | "
           "shares of all samples 0 / 1 / 2 | other (mixed or malformed) of all |", "|---" * 8 + "|"]
    for s in styles:
        sh = lambda v: "–" if v is None else " / ".join(f"{x:.2f}" for x in v)   # noqa: E731
        md.append(f"| {s['group']} | {s['row']} | {s['seeds']} | {f3(s['entropy'])} | {sh(s['share_correct'])} | "
                  f"{s['dominant']} | {sh(s['share_all'])} | {f3(s['other_all'])} |")
    md += ["", "## Mechanism of the new rows (step 1, policy = the start; tools/studies/common.py mechanism)\n",
           "| row | runs | repairs/run | in all-fail groups | kept / refiner tokens | A_repair | "
           "π refiner | coef refiner | π corrected |", "|---" * 9 + "|"]
    for row, m in mech.items():
        md.append(f"| {row} | {m['runs']} | {f3(m['per_run'])} | {f3(m['in_all_fail_groups'])} | "
                  f"{f3(m['kept'])} / {f3(m['refiner_tokens'])} | {f3(m['a_repair'])} | "
                  f"{f3(m['refiner_pi'])} | {f3(m['refiner_coef'])} | {f3(m['corrected_pi'])} |")
    md += ["", "## Multiplicity: the nine map comparisons and the pooled weak-start contrast (Holm)\n",
           "| comparison (acc T=1.0) | pairs | mean [95 % t-interval] | p | Holm p | survives at 0.05 |", "|---" * 6 + "|"]
    for t in mult:
        md.append(f"| {t['name']} | {t['ci']['n']} | {common.fmt_ci(t['ci'])} | {t['p']:.4f} | {t['p_holm']:.4f} | "
                  f"{'yes' if t['survives'] else 'no'} |")
    summary = {"contrasts": con, "multiplicity": mult, "styles": styles, "mechanism": mech,
               "new_runs": len(new), "planned": planned}
    return "\n".join(md) + "\n", summary


def main(args) -> None:
    """--stage because: the 25 pre-registered runs and the 5 added ones (resumed from their records), then the
    report."""
    from harness.data import toy

    t0 = time.time()
    args.eval_n_cool = 0                          # the regime stage's settings (its choice 1)
    args.train_eval_size = args.regime_eval_size
    toy.warm_start(os.path.join(common.ROOT, "cache"), seed=0, **when_it_helps.STARTS[WEAK][0])
    toy.warm_start(os.path.join(common.ROOT, "cache"), seed=0, styles=3)
    jobs = plan(args)
    refs = read_references(args)
    print(f"because: {len(jobs)} runs, {args.jobs} at a time; {len(refs)} reference runs read from records", flush=True)
    if args.records_only:
        new = [r for r in (when_it_helps.recorded(j, args) for j in jobs) if r is not None]
        print(f"{len(new)} of {len(jobs)} runs recorded; not run yet: "
              f"{[j['name'] for j in jobs if when_it_helps.recorded(j, args) is None]}", flush=True)
    else:
        new = common.run_all(jobs, args, t0, worker=run_one)
    text, summary = report(new, refs, args, (time.time() - t0) / 60)
    with open(os.path.join(args.out, "because.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "because.json"), "w") as f:
        json.dump({"command": "python -m tools.studies --stage because", "wall_minutes": round((time.time() - t0) / 60, 2),
                   "run_minutes": round(when_it_helps.run_minutes(new), 1), "summary": summary, "runs": new}, f, indent=1)
    print(text + f"wrote {args.out}/because.md, because.json in {(time.time() - t0) / 60:.1f} min")


# ---------------------------------------------------------------- the zero-training pre-checks

def pi_of_tokens(model, tokenizer, question: str, prefix: str, text: str) -> list[float]:
    """π under `model` of each token of `text` after the prompt and `prefix`, teacher-forced."""
    import torch

    from grpo import logprobs_and_entropy
    from harness.data.prompt import format_prompt

    head = format_prompt(tokenizer, question) + tokenizer.encode(prefix, add_special_tokens=False)
    body = tokenizer.encode(text, add_special_tokens=False)
    ids = torch.tensor([head + body])
    with torch.no_grad():
        logp, _ = logprobs_and_entropy(model(input_ids=ids).logits[:, :-1], ids[:, 1:])   # (1, T - 1)
    return logp[0, len(head) - 1:].exp().tolist()


def precheck_pi(start: dict, n_problems: int = 200) -> dict:
    """Per style k: the mean π of the oracle's whole solution in style k (the whole-replacement text) and of
    the oracle's style-k suffix after the correct style-0 prefix of the first half of the steps (the
    prefix-keeping text), teacher-forced under the starting policy `start` (toy.warm_start settings), on
    ladder problems of their own seed (5)."""
    from harness.data import toy
    from harness.engines.generate import load_causal_lm

    model, tokenizer = load_causal_lm(toy.cache_path(os.path.join(common.ROOT, "cache"), seed=0, **start), "cpu")
    model.eval()
    problems = toy.make_problems(n_problems, seed=5)
    out = {}
    for k in range(len(toy.STYLES)):
        whole, suffix = [], []
        for p in problems:
            start_value, ops = toy.parse_question(p["question"])
            steps = toy._chain_steps(start_value, ops, style=k)
            whole += pi_of_tokens(model, tokenizer, p["question"], "", toy.STEP_SEP.join(steps))
            half = max(1, len(ops) // 2)
            prefix = toy.STEP_SEP.join(toy._chain_steps(start_value, ops)[:half]) + toy.STEP_SEP
            rest = toy.OracleRefiner(style=k).continue_from([p["question"]], [prefix], n=1, max_tokens=256)[0][0][0]
            pis = pi_of_tokens(model, tokenizer, p["question"], prefix, rest)
            suffix += pis
        out[str(k)] = {"whole_mean_pi": float(np.mean(whole)), "whole_geo_pi": float(np.exp(np.mean(np.log(whole)))),
                       "whole_tokens": len(whole), "suffix_mean_pi": float(np.mean(suffix)),
                       "suffix_geo_pi": float(np.exp(np.mean(np.log(suffix)))), "suffix_tokens": len(suffix)}
    return out


def precheck_picks(n_problems: int = 300, group_size: int = 8, seed: int = 0) -> dict:
    """From the three-style start: G samples per ladder training problem at T = 1.0, the exact toy PRM's cut
    of every failure, and the pick of each group with a failure under both tie-breaks (scope.py
    select_failures' keys): the share of picks whose kept prefix ends in style 0 / 1 / 2 or is empty (the
    oracle's style then: 0 with the length tie-break, drawn uniformly with index), the share of groups whose
    pick was decided by a tie on (κ, prefix mean), and the style the repair is written in."""
    import torch

    from harness.data import toy
    from harness.data.prompt import format_prompt
    from harness.engines.generate import HFGenerator, load_causal_lm
    from harness.data.grader import grade
    from prm import cut_point, keep_ratio, mean_score, select_candidate, split_steps

    torch.manual_seed(seed)
    model, tokenizer = load_causal_lm(toy.cache_path(os.path.join(common.ROOT, "cache"), seed=0, styles=3), "cpu")
    problems = toy.make_problems(n_problems, seed=1)
    gen = HFGenerator(model.eval(), tokenizer, micro_batch_size=128)
    prompts = [format_prompt(tokenizer, p["question"]) for p in problems]
    groups = []
    for i in range(0, len(prompts), 16):
        groups += gen.generate(prompts[i:i + 16], n=group_size, temperature=1.0, max_tokens=128, seed=seed + i)
    prm = toy.ToyPRM()
    labels = ["0", "1", "2", "empty"]
    counts = {tb: dict.fromkeys(labels, 0) for tb in ("length", "index")}
    repair_style = {tb: [0.0, 0.0, 0.0] for tb in ("length", "index")}
    ties = picks = correct = samples = 0
    for p, group in zip(problems, groups):
        fails = []
        for c in group:
            samples += 1
            ok = grade(c.text, p["answer"])
            correct += ok
            if ok:
                continue
            steps = split_steps(c.text)
            scores = prm.score(p["question"], steps)
            cut = cut_point(scores)
            prefix = "".join(steps[:cut])
            done = [toy._item(m) for m in toy.ITEM_RE.finditer(prefix) if m["v"] is None]
            fails.append({"kappa": keep_ratio(cut, len(steps)), "mean": mean_score(scores[:cut]),
                          "len": len(c.ids), "style": str(done[-1][1]) if done else "empty"})
        if not fails:
            continue
        picks += 1
        best = max((f["kappa"], f["mean"]) for f in fails)
        ties += sum((f["kappa"], f["mean"]) == best for f in fails) > 1
        for tb in ("length", "index"):
            j = select_candidate([f["kappa"] for f in fails], [f["mean"] for f in fails], [f["len"] for f in fails],
                                 tiebreak=tb)
            s = fails[j]["style"]
            counts[tb][s] += 1
            if s == "empty":   # the oracle's style after an empty prefix
                if tb == "length":
                    repair_style[tb][0] += 1
                else:
                    repair_style[tb] = [x + 1 / 3 for x in repair_style[tb]]
            else:
                repair_style[tb][int(s)] += 1
    return {"groups": len(problems), "groups_with_a_failure": picks, "samples": samples, "correct": correct,
            "tie_decided_share": ties / picks,
            "pick_prefix_style_share": {tb: {k: v / picks for k, v in c.items()} for tb, c in counts.items()},
            "repair_style_share": {tb: [x / picks for x in v] for tb, v in repair_style.items()}}


def precheck(out: str) -> dict:
    t0 = time.time()
    res = {"threshold_foreign_mean_pi": PI_THRESHOLD,
           "pi_weak_start": precheck_pi(when_it_helps.STARTS[WEAK][0]), "pi_three_style_start": precheck_pi({"styles": 3}),
           "picks_three_style_start": precheck_picks()}
    foreign = res["pi_weak_start"][FOREIGN]["whole_mean_pi"]
    res["foreign_far_below"] = foreign <= PI_THRESHOLD
    res["seconds"] = round(time.time() - t0, 1)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="the because stage's zero-training pre-checks")
    p.add_argument("--precheck", action="store_true", help="π of oracle solutions per style, pick shares per tie-break")
    p.add_argument("--out", default="results/toy/because_precheck.json")
    a = p.parse_args()
    os.chdir(common.ROOT)
    if not a.precheck:
        p.error("nothing to do: pass --precheck (the study itself: python -m tools.studies --stage because)")
    import torch
    torch.set_num_threads(1)
    print(json.dumps(precheck(a.out), indent=1))
