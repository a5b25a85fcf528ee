"""where_it_helps.py — the toy-world study: where does step-wise rectification help?

What it runs, all from the same SFT-warm-started toy policy (harness/data/toy.py:warm_start, shipped under cache/) with the
same budget (steps, 8 prompts x 8 rollouts, lr) and one `python scope.py --toy` process per (row, seed):
  stage 1, the grid (--seeds, >= 5):  grpo; SCOPE with each of --rectify-groups {any, all-fail} x
      --merge {replace, append}; whole-trajectory replacement (--mode replace); PRM as reward.
  stage 2, decided by stage 1: "best" = the SCOPE grid cell whose policy solved most of its own TRAINING rollouts
      over the last 5 steps (choice 6); then best + unit credit on refiner tokens (--offpolicy-credit unit),
      best + the model refiner (--refiner toy-model), best + toy PRM noise 0.2 (same seeds); the LONG runs,
      --long-factor x the steps, of grpo and best (--long-seeds, 3); the WEAK START (choice 7): grpo and best
      (--weak-runner-up adds the second-best cell), --seeds.
Every final policy, and the warm start, is evaluated on the SAME held-out problems with the same sampling
seeds (each problem's count of correct samples is kept, `per_problem_correct`, for intervals that resample
the problems): n = --eval-n (16) samples at T = 1.0 -> acc@T1 (= avg@16 = pass@1), pass@4, pass@16, accuracy per
difficulty (number of operations), near-miss@1 and discarded-valid share over the zero-reward samples (exact
toy PRM), the Table-4 diversity metrics (medians across prompts); --eval-n-cool (8) samples at T = 0.6 ->
acc@T0.6 (= avg@8). From the metrics: all-fail share of the policy's own groups over training, the policy's
token entropy (last 5 steps), the refiner's acceptance rate, repairs in all-fail groups. From the traces
(`mechanism`): where the cuts fell, what was kept, all-fail vs mixed groups, and the gradient coefficient each
kind of token got. Each SCOPE-like row gets its PAIRED difference to GRPO (same seed) with a 95 % t-interval.

Run (one command does both stages; stage 2 starts when the grid is done):
    python -m tools.studies                       # the whole study -> results/toy/study.{json,md}, curves.png
    python -m tools.studies --describe            # the starting policies -> results/toy/warm_start.json
    python -m tools.studies --seeds 0,1 --long-seeds 0 --steps 20 --tag pilot --out results/toy/pilot   # a pilot
    python -m tools.studies --only grid           # stage 1 only
Runs go to runs/<tag>-<group>-<row>-s<seed>/ (gitignored; train.log, metrics.jsonl, traces.jsonl, final_eval.json).
A run whose metrics.jsonl reaches its steps with the same scope.py command, and whose final_eval.json has the
same eval settings, is skipped: rerunning resumes an interrupted study (the printed time then covers the rest),
and a second study under another --tag retrains from scratch (how reproducibility is checked).

Choices:
 1. The eval accuracy is reported at T = 1.0 (the rollout temperature, where the modes differ most) AND
    at T = 0.6; at T = 1.0 all 16 samples give avg@16, an estimate of the same pass@1 avg@8 estimates, with
    half the variance.
 2. In-training eval (the curves): scope.py's eval at step 0 and every --eval-every (5) steps (the long runs:
    --long-eval-every, 10) on --train-eval-size (400) held-out problems x --train-eval-n (1) samples at
    T = 0.6: one seed's point moves ~ +-2.4 points from sampling alone, the mean over 5 seeds ~ +-1.1. The
    figure shows that mean and a band of +- one standard deviation across seeds, smoothed over 3 points by a
    window that shrinks at the ends, so every row starts from the step-0 value it shares with the others (the
    step-0 eval of a seed is the same policy with the same sampling seed in every row).
 3. 95 % interval of a paired difference: mean +- t_{0.975, n-1} * sd / sqrt(n) over the n seeds.
 4. Workers: --jobs processes (default 2 = the two cores), each training one run with one torch thread and
    then evaluating it; the longest jobs are submitted first so the two cores finish together. Ctrl-C or
    SIGTERM to the study stops its workers and the scope.py runs they started (each worker leads its own
    process group); rerunning resumes from the finished runs.
 5. Budget (at most 90 min): with two jobs on the 2-core machine a 20-step run costs about a minute
    of training (with its in-training evals) and half a minute of final eval; the model refiner costs ~1.5x.
    The defaults are sized to stay under 90 min (measured: 51.9 min for the whole study on the quiet 2-core
    machine); the wall time is printed and written to study.json.
 6. Stage 2's "best" cell is chosen on the training reward (the policy's own rollouts, last 5 steps, mean over
    seeds), not on the held-out evaluation the tables report, so the stage-2 rows carry no selection bias
    from that evaluation (they may still be optimistic on training problems).
 7. The weak start: a starting policy on which most G = 8 groups are all-fail, like the paper's Table 2
    setting where standard RL often fails: --weak-task (default: the hardest rung, 6 operations) for the
    training and evaluation problems, and --weak-start for the policy (default {"lateness": 1.5}: the same
    SFT with slips drawn less late, which trained to a much weaker policy, 16 % accuracy on the ladder and
    about two thirds of 6-operation groups all-fail; {} = the main warm start, whose 6-operation groups are
    only ~28 % all-fail; an earlier stop of the same SFT, {"sft_steps": 400}, fails nearly
    everything at step 0, so a repair would keep no prefix).
"""
import argparse
import json
import os
import sys
import time

# common first: it sets one thread per process before numpy (and torch) load
from tools.studies.common import (COLS, GRID, ROOT, curves, environment, job, mechanism, paired, problem_files,  # noqa: E402
                                  read_json, run_all, start_path, tables, typed)
import numpy as np  # noqa: E402

SCOPE_CELLS = [row for row in GRID if row.startswith("scope ")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m tools.studies", description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                epilog="Any other --flag VALUE is passed to every scope.py run.")
    p.add_argument("--seeds", default="0,1,2,3,4", help="training seeds of every row (comma-separated)")
    p.add_argument("--long-seeds", default="0,1,2", help="seeds of the long runs")
    p.add_argument("--steps", type=int, default=20, help="training steps of every run (long runs: x --long-factor)")
    p.add_argument("--long-factor", type=int, default=4, help="the long runs train this many times --steps")
    p.add_argument("--weak-task", default='{"min_ops": 6, "max_ops": 6}',
                   help="toy.make_problems settings (JSON) of the weak-start condition's train/eval problems")
    p.add_argument("--weak-start", default='{"lateness": 1.5}', help="toy.warm_start settings (JSON) of the weak-start condition's "
                   "policy, e.g. '{\"sft_steps\": 300}' for an earlier stop of the same SFT; {} = the main warm start")
    p.add_argument("--describe", action="store_true", help="only describe the warm start (accuracy per difficulty, "
                   "all-fail share, first-error positions) -> <out>/warm_start.json")
    p.add_argument("--grid", default=",".join(GRID), help="stage-1 rows to run (comma-separated labels; the pilot "
                   "runs a subset); stage 2 ranks the SCOPE cells among them")
    p.add_argument("--weak-runner-up", action="store_true", help="the weak start also runs the second-best SCOPE "
                   "cell (5 more runs, about +5 min)")
    p.add_argument("--compare", default="", help="only compare two study.json files 'A,B' run by run (the "
                   "reproducibility check) and exit 1 if any number differs")
    p.add_argument("--only", default="all", choices=("all", "grid"), help="'grid' stops after stage 1")
    p.add_argument("--stage", default="study", choices=("study", "regime", "diversity", "because"),
                   help="study: the grid and stage 2 above; regime: the regime map; diversity: GRPO vs SCOPE on "
                   "a warm start with several solution styles (both: tools/studies/when_it_helps.py); because: the controls "
                   "of the paper's two causal claims (tools/studies/why_it_helps.py)")
    p.add_argument("--records-only", action="store_true", help="regime / diversity: report from the runs' records "
                   "only (train nothing; the runs not recorded yet are listed)")
    p.add_argument("--styles", type=int, default=3, help="diversity: solution styles of the warm start (toy.STYLES)")
    p.add_argument("--diversity-steps", type=int, default=100, help="diversity: training steps of every run")
    p.add_argument("--regime-starts", default="main-ladder,weak-ladder,weak-6ops", help="regime: starting policies (tools/studies/when_it_helps.py STARTS)")
    p.add_argument("--regime-rows", default="", help="regime: only these rows (comma-separated labels; default all)")
    p.add_argument("--regime-steps", type=int, default=100, help="regime: training steps of every run")
    p.add_argument("--regime-eval-every", type=int, default=25, help="regime: in-training eval every N steps")
    p.add_argument("--regime-eval-size", type=int, default=200, help="regime: held-out problems of the in-training eval")
    p.add_argument("--regime-best", default="scope any/append", help="regime: the grid's best SCOPE cell (a --grid label)")
    p.add_argument("--regime-ablations", default="auto", help="regime: auto (starts where a SCOPE row separates), "
                   "none, or a comma list of starts")
    p.add_argument("--max-new-tokens", type=int, default=128, help="response budget, training and evaluation")
    p.add_argument("--jobs", type=int, default=2, help="processes at once (each: one run, then its evaluation)")
    p.add_argument("--eval-size", type=int, default=64, help="held-out toy problems of the final eval")
    p.add_argument("--train-eval-size", type=int, default=400, help="held-out toy problems of the in-training eval")
    p.add_argument("--eval-n", type=int, default=16, help="samples per problem at T = 1.0 (final eval)")
    p.add_argument("--eval-n-cool", type=int, default=8, help="samples per problem at T = 0.6 (final eval)")
    p.add_argument("--train-eval-n", type=int, default=1, help="samples per problem of the in-training eval")
    p.add_argument("--eval-every", type=int, default=5, help="in-training eval every N steps (and at step 0)")
    p.add_argument("--long-eval-every", type=int, default=10, help="in-training eval every N steps of the long runs")
    p.add_argument("--eval-seed", type=int, default=0, help="sampling seed of the final eval (same for all)")
    p.add_argument("--tag", default="study", help="run names: runs/<tag>-<row>-s<seed>")
    p.add_argument("--out", default="results/toy", help="where study.json, study.md and curves.png go")
    args, passthrough = p.parse_known_args(argv)
    args.passthrough = passthrough
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]     # noqa: E731
    args.seed_list, args.long_seed_list = ints(args.seeds), ints(args.long_seeds)
    if not args.seed_list:
        p.error("--seeds is empty")
    for flag in ("weak_task", "weak_start"):   # a bad JSON fails here, before any run
        try:
            json.loads(getattr(args, flag))
        except json.JSONDecodeError as e:
            p.error(f"--{flag.replace('_', '-')}: not JSON ({e})")
    from tools.studies.when_it_helps import STARTS
    bad = [x for x in args.regime_starts.split(",") if x.strip() not in STARTS]
    if not 2 <= args.styles <= 3 or args.diversity_steps < 1:
        p.error(f"--styles {args.styles} (2 or 3: harness/data/toy.py STYLES) or --diversity-steps {args.diversity_steps} "
                "is not valid")
    if bad or args.regime_best not in SCOPE_CELLS or args.regime_steps < 1:
        p.error(f"--regime-starts {bad} (known: {list(STARTS)}) or --regime-best {args.regime_best!r} "
                f"(one of {SCOPE_CELLS}) or --regime-steps {args.regime_steps} is not valid")
    args.grid_rows = [row.strip() for row in args.grid.split(",") if row.strip()]
    unknown = [row for row in args.grid_rows if row not in GRID]
    if unknown or "grpo" not in args.grid_rows:
        p.error(f"--grid: unknown row(s) {unknown} or no grpo; rows: {list(GRID)}")
    return args


def plan_grid(args) -> list[dict]:
    jobs = [{"row": "warm start", "seed": 0, "group": "main", "steps": 0, "task": "", "flags": [],
             "name": f"{args.tag}-main-start"},
            {"row": "warm start", "seed": 0, "group": "weak", "steps": 0, "task": args.weak_task, "flags": [],
             "name": f"{args.tag}-weak-start"}]
    for seed in args.seed_list:
        jobs += [job(row, seed, GRID[row], args) for row in args.grid_rows]
    return jobs


def rank_cells(results: list[dict]) -> list[str]:
    """The SCOPE grid cells, best first, by the policy's own rollout accuracy on the TRAINING problems over the
    last 5 steps, mean over seeds (choice 6: not the held-out eval the tables report; ties keep grid order)."""
    score = {row: np.mean([r["train"]["reward_last5"] for r in results if r["row"] == row and r["group"] == "main"])
             for row in SCOPE_CELLS if any(r["row"] == row for r in results)}
    return sorted(score, key=lambda row: -score[row])


def plan_stage2(args, ranked: list[str]) -> list[dict]:
    best, second = ranked[0], ranked[min(1, len(ranked) - 1)]
    flags = GRID[best]
    jobs = []
    for seed in args.long_seed_list:   # longest first
        jobs += [job("grpo", seed, GRID["grpo"], args, group="long", steps=args.steps * args.long_factor),
                 job(f"best: {best}", seed, flags, args, group="long", steps=args.steps * args.long_factor)]
    for seed in args.seed_list:
        jobs += [job(f"{best} + unit credit", seed, flags + " --offpolicy-credit unit", args),
                 job(f"{best} + model refiner", seed, flags + " --refiner toy-model", args),
                 job(f"{best} + PRM noise 0.2", seed, flags + " --toy-prm-noise 0.2", args)]
        jobs += [job(row, seed, GRID[row], args, group="weak", task=args.weak_task)
                 for row in dict.fromkeys(("grpo", best, second) if args.weak_runner_up else ("grpo", best))]
    return jobs


    # foreground group) only; it then ends every worker's group through this handler


# ---------------------------------------------------------------- statistics and reporting


def smooth(y: np.ndarray, width: int = 3) -> np.ndarray:
    """Centred moving average over `width` points whose window shrinks symmetrically at the ends, so the first
    and last points are kept as measured (every row starts from the same step-0 value)."""
    out = np.empty_like(y, dtype=float)
    for i in range(len(y)):
        half = min(width // 2, i, len(y) - 1 - i)
        out[i] = y[i - half:i + half + 1].mean()
    return out


def plot(results: list[dict], out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("main", "eval_acc", 3, "held-out acc (T = 0.6) during training"),
              ("main", "all_fail", 5, "all-fail share of the policy's groups"),
              ("long", "eval_acc", 3, "long runs: held-out acc (T = 0.6)"),
              ("long", "entropy", 9, "long runs: policy token entropy"),
              ("weak", "eval_acc", 3, "weak start: held-out acc (T = 0.6)"),
              ("weak", "all_fail", 5, "weak start: all-fail share")]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    rows = list(dict.fromkeys(r["row"] for r in results if r["steps"]))
    colors = {row: f"C{i % 10}" for i, row in enumerate(rows)}
    colors.update({row: colors.get(row.split(": ", 1)[-1], "C9") for row in rows if row.startswith("best: ")})
    for ax, (group, key, width, title) in zip(axes.flat, panels):
        data = curves(results, group, key)
        for row, (x, m, sd) in data.items():
            m, sd = smooth(m, width), smooth(sd, width)
            ax.plot(x, m, color=colors[row], label=row, lw=1.5)
            ax.fill_between(x, m - sd, m + sd, color=colors[row], alpha=0.15, lw=0)
        if not data:
            ax.text(0.5, 0.5, "no runs", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
        if data:
            ax.legend(fontsize=6)
    fig.suptitle("mean over seeds, band = ± 1 sd across seeds, moving average (the window shrinks at the ends: step 0 as measured)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def write_results(results: list[dict], args, ranked: list[str] | None, wall_minutes: float) -> str:
    os.makedirs(args.out, exist_ok=True)
    command = typed([])
    keys = [k for k, _ in COLS]
    md = ["# Toy world study: SCOPE vs GRPO\n",
          f"Command: `{command}`  \nWall time: {wall_minutes:.1f} min ({args.jobs} jobs at once).  \n"
          f"Training: {args.steps} steps of `scope.py --toy` (8 prompts x 8 rollouts){' + ' + ' '.join(args.passthrough) if args.passthrough else ''}; "
          f"long runs x{args.long_factor}; weak start on task {args.weak_task}. Final eval on {args.eval_size} held-out "
          f"problems: {args.eval_n} samples at T = 1.0 (acc = avg@{args.eval_n}, pass@k), {args.eval_n_cool} at T = 0.6. "
          f"Mean ± sd over seeds.  \nBest SCOPE cell of the grid (mean acc at T = 1.0): "
          f"{ranked[0] if ranked else 'not ranked (grid only)'}; ranking: {ranked}\n"]
    md += tables(results, "main", "Main comparison (the ladder)")
    md += tables(results, "long", f"Long runs ({args.long_factor}x steps)")
    md += tables(results, "weak", f"Weak start (task {args.weak_task}, policy {args.weak_start})")
    mech = mechanism(results, args)
    md += ["## Mechanism (from the traces)\n",
           "Accepted repairs over all steps: how many per run, the share in all-fail groups, where the cut fell "
           "(first wrong step / steps), the share cut at the last step, the kept share of the response's tokens. "
           "Step 1 only (policy = the starting policy, π recomputed): mean kept and refiner tokens, A of the repair "
           "(and of the failure it came from, still in its group with append), mean π and gradient coefficient "
           "on the refiner's tokens and on the corrected token (kept-prefix tokens get A_repair each).\n",
           "| row | repairs/run | in all-fail groups | cut at | last-step cuts | kept tokens | step-1 repairs | "
           "kept / refiner tokens | A_repair | A_fail | π refiner | coef refiner | π corrected | coef corrected |",
           "|---" * 15 + "|"]
    f3 = lambda x: "–" if x is None else f"{x:.3f}"   # noqa: E731
    for row, m in mech.items():
        md.append(f"| {row} | {m['per_run']:.1f} | {f3(m['in_all_fail_groups'])} | {f3(m['cut_relative'])} | "
                  f"{f3(m['last_step_only'])} | {f3(m['keep_ratio_tokens'])} | {m['step1_repairs']} | "
                  f"{f3(m['kept'])} / {f3(m['refiner_tokens'])} | {f3(m['a_repair'])} | {f3(m['a_fail'])} | "
                  f"{f3(m['refiner_pi'])} | {f3(m['refiner_coef'])} | {f3(m['corrected_pi'])} | {f3(m['corrected_coef'])} |")
    md.append("")
    md.append("all-fail (train): share of the policy's own groups with no correct rollout, mean over training. "
              "accepted: repairs accepted / tried. entropy: the policy's token entropy on its rollouts, last 5 steps. "
              "near-miss@1 and discarded valid: over zero-reward samples at T = 1.0, exact toy PRM.\n")
    text = "\n".join(md)
    with open(os.path.join(args.out, "study.md"), "w") as f:
        f.write(text)
    summary = {"command": command, "wall_minutes": round(wall_minutes, 2), "ranked": ranked,
               "settings": {k: v for k, v in vars(args).items() if k not in ("seed_list", "long_seed_list", "grid_rows")},
               "paired": {g: paired(results, g, keys + ["pass@1"]) for g in ("main", "long", "weak")}, "mechanism": mech,
               "environment": environment(), "runs": results}
    with open(os.path.join(args.out, "study.json"), "w") as f:
        json.dump(summary, f, indent=1)
    plot(results, os.path.join(args.out, "curves.png"))
    return text


def describe_warm_start(args, group: str = "main", n_problems: int = 300, n: int = 16) -> dict:
    """A group's starting policy (`start_path`) on its problems (the ladder; --weak-task for "weak"): accuracy per difficulty at T = 1.0, the share of G = 8 groups with no
    success (first 8 of the n samples), and where the first errors of its failures fall (exact toy PRM):
    by step index k over the n_ops + 1 steps (k = n_ops: the answer copy), also relative (k / n_ops)."""
    import torch

    from harness.data import toy
    from eval import evaluate
    from harness.engines.generate import HFGenerator, load_causal_lm
    from prm import cut_point, split_steps

    torch.set_num_threads(1)
    model, tokenizer = load_causal_lm(start_path({"group": group}, args), "cpu")
    problems = toy.make_problems(n_problems, seed=0, **(json.loads(args.weak_task) if group == "weak" else {}))
    res = evaluate(HFGenerator(model.eval(), tokenizer, micro_batch_size=128), tokenizer, problems, n=n,
                   temperature=1.0, max_new_tokens=args.max_new_tokens, seed=args.eval_seed, keep_samples=True,
                   batch_size=16)
    by_ops, all_fail, first, rel, last_only = {}, {}, {}, [], 0
    for problem, row in zip(problems, res["per_problem"]):
        n_ops = len(toy.parse_question(problem["question"])[1])
        by_ops.setdefault(n_ops, []).append(row["correct"] / row["n"])
        all_fail.setdefault(n_ops, []).append(not any(row["sample_correct"][:8]))
        for text, ok in zip(row["samples"], row["sample_correct"]):
            if not ok:
                k = cut_point(toy.ToyPRM().score(problem["question"], split_steps(text)))
                first.setdefault(n_ops, {}).setdefault(k, 0)
                first[n_ops][k] += 1
                rel.append(min(k, n_ops) / n_ops)
                last_only += k >= n_ops
    out = {"acc_t1": res["acc"], "acc_by_ops": {k: float(np.mean(v)) for k, v in sorted(by_ops.items())},
           "all_fail_g8": float(np.mean([x for v in all_fail.values() for x in v])),
           "all_fail_g8_by_ops": {k: float(np.mean(v)) for k, v in sorted(all_fail.items())},
           "first_error_by_ops": {k: dict(sorted(v.items())) for k, v in sorted(first.items())},
           "first_error_relative_hist": np.histogram(rel, bins=[0, 0.2, 0.4, 0.6, 0.8, 1.0 - 1e-9, 1.0])[0].tolist(),
           "failures": len(rel), "failures_at_answer_copy": last_only, "problems": n_problems, "n": n,
           "policy": os.path.relpath(start_path({"group": group}, args), ROOT)}
    return out


def compare_studies(a: dict, b: dict) -> tuple[int, list[str]]:
    """Runs present in both study.json files (same group, row, seed, steps): how many, and each number of their
    final evaluation and training statistics that differs ("group/row/seed: key a != b"). Two studies under
    different --tag train every run from scratch, so an empty list means the numbers were reproduced."""
    index = {(r["group"], r["row"], r["seed"], r["steps"]): r for r in b["runs"]}
    matched, diffs = 0, []
    for r in a["runs"]:
        other = index.get((r["group"], r["row"], r["seed"], r["steps"]))
        if other is None:
            continue
        matched += 1
        for part in ("eval", "train"):
            for key, x in r[part].items():
                if key != "minutes" and other[part].get(key) != x:
                    diffs.append(f"{r['group']}/{r['row']}/s{r['seed']}: {part}.{key} {x} != {other[part].get(key)}")
    return matched, diffs


def main(argv=None) -> None:
    args = parse_args(argv)
    os.chdir(ROOT)
    t0 = time.time()
    if args.compare:
        first, second = (read_json(path) for path in args.compare.split(","))
        matched, diffs = compare_studies(first, second)
        print("\n".join(diffs[:50]) + f"\n{matched} runs in both; {len(diffs)} numbers differ")
        sys.exit(1 if diffs or not matched else 0)
    if args.stage in ("regime", "diversity"):
        from tools.studies import when_it_helps
        return when_it_helps.main(args) if args.stage == "regime" else when_it_helps.diversity_main(args)
    if args.stage == "because":
        from tools.studies import why_it_helps
        return why_it_helps.main(args)
    from harness.data import toy
    toy.warm_start(os.path.join(ROOT, "cache"), seed=0)            # trained here once if not shipped
    toy.warm_start(os.path.join(ROOT, "cache"), seed=0, **json.loads(args.weak_start))
    if args.describe:
        described = {"main": describe_warm_start(args, "main"), "weak": describe_warm_start(args, "weak"),
                     "weak_task": json.loads(args.weak_task), "weak_start": json.loads(args.weak_start),
                     "environment": environment()}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "warm_start.json"), "w") as f:
            json.dump(described, f, indent=1)
        print(json.dumps(described, indent=1))
        return
    problem_files(args.weak_task, args, write=True)   # once, before any worker reads them
    if args.only == "all":
        toy.refiner_model(os.path.join(ROOT, "cache"), seed=0)
    grid = plan_grid(args)
    print(f"stage 1: {len(grid) - 2} runs of {args.steps} steps + the warm start (2 tasks); {args.jobs} at a time",
          flush=True)
    results = run_all(grid, args, t0)
    ranked = None
    if args.only == "all" and any(row in SCOPE_CELLS for row in args.grid_rows):
        ranked = rank_cells(results)
        stage2 = plan_stage2(args, ranked)
        print(f"stage 2: best cell {ranked[0]!r}, runner-up {ranked[1]!r}; {len(stage2)} runs", flush=True)
        results += run_all(stage2, args, t0)
    print(write_results(results, args, ranked, (time.time() - t0) / 60))
    print(f"wrote {args.out}/study.md, study.json, curves.png in {(time.time() - t0) / 60:.1f} min")

