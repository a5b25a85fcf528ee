"""experiment.py — the toy-world comparison: SCOPE vs on-policy GRPO vs whole-trajectory replacement vs
PRM-as-reward, several seeds each, plus SCOPE with an imperfect PRM (issue 7; paper Tables 1, 3, 4, Figs 3, 7).

What it runs: from the same SFT-warm-started toy policy (toy.warm_start, cached under cache/) and the same
compute budget (same steps, prompts per step, rollouts per prompt, lr), one `python scope.py --toy` process
per (mode, seed) — paper Table 3's four rows — and per (PRM noise, seed) for SCOPE with a toy PRM that
flips each step score with that probability (plus any --variants rows). Then every final policy, and the
starting policy as the baseline row, is evaluated on the SAME held-out toy problems with the same sampling
seed: avg@n (= pass@1), pass@k, the Table-4 diversity metrics (medians across prompts), and, over the
zero-reward samples scored by the exact toy PRM, the near-miss@1 share and the discarded-valid share.

Run (from the repository root; wall times measured on the shared 2-core machine are in results/toy/):
    python experiment.py                                  # 4 modes x seeds 0,1,2 + SCOPE at PRM noise 0.1, 0.3
    python experiment.py --seeds 0 --modes scope,grpo --noise ""             # a quick two-row check
    python experiment.py --variants "scope-append=--mode scope --merge append"   # extra rows: label=flags
    python experiment.py --tag hard --task '{"min_ops": 3, "max_ops": 5}' --out results/toy/hard  # harder task
    python experiment.py --steps 100 --lr 5e-5            # any other flag goes to every scope.py run
Writes <out>/{table.md, table.json, curves.png, pass_at_k.png}; runs go to runs/<tag>-<row>-s<seed>/
(gitignored; each also holds train.log and final_eval.json). A run whose metrics.jsonl reaches --steps
with the same scope.py command, and whose final_eval.json has the same eval settings, is skipped: rerunning
resumes an interrupted experiment (its printed wall time then covers only what was left).

Choices:
 1. Training uses scope.py's --toy defaults (8 prompts x 8 rollouts, lr 1e-4, 30 steps, 128 new tokens):
    GRPO climbs from 0.43 to ~0.64 accuracy at T = 1.0 there, far from saturation, so the comparison
    can show a difference either way.
 2. Evaluation at temperature 1.0 (the rollout temperature), n = 8 samples on 200 problems
    (load_problems("toy") = toy.make_problems(200, seed=0); training draws from seed 1). At T = 0.6 the
    warm start is already right ~80 % of the time; at T = 1.0 (~43 %) the modes have room to differ.
 3. Near misses are measured with the exact toy PRM (noise 0) for every row, so noisy-PRM runs are judged
    by the truth, not by the PRM they trained with.
 4. Mean ± sample std (ddof = 1) over seeds; per-run numbers (and accuracy by number of operations) are in
    table.json.
 5. Each job runs with one torch thread (OMP_NUM_THREADS=1): on the shared 2-core machine two threads per
    process were ~15x slower. At most --jobs processes (train, then its evaluation) at once.
 6. The curves PNG (eval.plot_runs) shows seed 0 of each row (one line per row) to stay readable. All rows of one seed see
    the same prompts and rollout seeds at step 1 (scope.py derives them from (seed, step)).
 7. --task writes its own train (500 problems, toy seed 1) and eval (toy seed 0) JSONL files, the seeds
    load_problems("toy") uses, so a harder problem mix runs through the same scope.py flags.
"""
import argparse
import json
import multiprocessing
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor

os.environ.setdefault("OMP_NUM_THREADS", "1")   # before torch is imported, here and in spawned workers
os.environ.setdefault("MKL_NUM_THREADS", "1")
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DIVERSITY = ["distinct_1", "distinct_4", "one_minus_self_bleu", "one_minus_self_rouge", "div_score"]
LABELS = {"acc": "acc (avg@n)", "near_miss@1": "near-miss@1 (r=0)", "discarded_valid": "discarded valid (r=0)",
          "distinct_1": "distinct-1", "distinct_4": "distinct-4", "one_minus_self_bleu": "1-self-BLEU",
          "one_minus_self_rouge": "1-self-ROUGE", "div_score": "div-score", "frac_all_fail": "all-fail groups",
          "reward_first5": "reward, steps 1-5", "reward_last5": "reward, last 5", "accept_rate": "accepted",
          "keep_ratio": "keep ratio κ", "offpolicy_share": "off-policy tokens", "entropy_last5": "entropy, last 5"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                epilog="Any other --flag VALUE is passed to every scope.py run.")
    p.add_argument("--seeds", default="0,1,2", help="training seeds (comma-separated)")
    p.add_argument("--modes", default="scope,grpo,replace,prm-reward", help="scope.py --mode values")
    p.add_argument("--noise", default="0.1,0.3", help="toy PRM flip probabilities for extra SCOPE rows ('' = none)")
    p.add_argument("--noise-seeds", default=None, help="seeds of the noisy-PRM rows (default: --seeds)")
    p.add_argument("--variants", default="", help="extra rows, 'label=scope.py flags' separated by ';' "
                   "(e.g. 'scope-append=--mode scope --merge append')")
    p.add_argument("--task", default="", help="toy task settings as JSON (toy.make_problems keywords, e.g. "
                   "'{\"max_ops\": 5}'): train/eval problems are then written to runs/<tag>-data/")
    p.add_argument("--steps", type=int, default=30, help="training steps of every run")
    p.add_argument("--max-new-tokens", type=int, default=128, help="response budget, training and evaluation")
    p.add_argument("--jobs", type=int, default=2, help="processes at once (each: one run, then its evaluation)")
    p.add_argument("--eval-size", type=int, default=200, help="held-out toy problems")
    p.add_argument("--eval-n", type=int, default=8, help="samples per problem")
    p.add_argument("--eval-temperature", type=float, default=1.0, help="sampling temperature of the evaluation")
    p.add_argument("--eval-seed", type=int, default=0, help="sampling seed of the evaluation (same for all policies)")
    p.add_argument("--tag", default="toy", help="run names: runs/<tag>-<row>-s<seed>")
    p.add_argument("--out", default="results/toy", help="where the tables and PNGs go")
    args, passthrough = p.parse_known_args(argv)
    args.passthrough = passthrough
    return args


def plan(args) -> list[dict]:
    """One job per run: {"row" (table row), "seed", "name", "flags" (for scope.py)}; seeds outermost."""
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]     # noqa: E731
    seeds = ints(args.seeds)
    noise_seeds = seeds if args.noise_seeds is None else ints(args.noise_seeds)
    jobs = []
    for seed in sorted(set(seeds) | set(noise_seeds)):
        for mode in (m for m in args.modes.split(",") if m and seed in seeds):
            jobs.append({"row": mode, "seed": seed, "flags": ["--mode", mode]})
        for noise in (float(x) for x in args.noise.split(",") if x.strip() and seed in noise_seeds):
            jobs.append({"row": f"scope, PRM noise {noise:g}", "seed": seed,
                         "flags": ["--mode", "scope", "--toy-prm-noise", str(noise)]})
        for variant in (v for v in args.variants.split(";") if v.strip() and seed in seeds):
            label, flags = variant.split("=", 1)
            jobs.append({"row": label.strip(), "seed": seed, "flags": flags.split()})
    for job in jobs:
        slug = job["row"].replace("scope, PRM noise ", "scope-noise")
        job["name"] = f"{args.tag}-{slug}-s{job['seed']}"
        job["flags"] += ["--seed", str(job["seed"])]
    return jobs


def problem_files(args, write: bool = False) -> dict:
    """With --task: train (toy seed 1) and eval (toy seed 0) problems of those settings as JSONL files, the
    same seeds load_problems("toy") uses; returns {"train": path, "eval": path}, or {} without --task."""
    if not args.task:
        return {}
    import toy

    folder, task = os.path.join("runs", f"{args.tag}-data"), json.loads(args.task)
    files = {"train": os.path.join(folder, "train.jsonl"), "eval": os.path.join(folder, "eval.jsonl")}
    os.makedirs(folder, exist_ok=True)
    for split, n, seed in (("train", 500, 1), ("eval", args.eval_size, 0)) if write else ():
        with open(files[split], "w") as f:
            for p in toy.make_problems(n, seed=seed, **task):
                f.write(json.dumps({"id": p["id"], "question": p["question"], "answer": p["answer"]}) + "\n")
    return files


def scope_command(job: dict, args) -> list[str]:
    data = problem_files(args)
    data_flags = ["--dataset", data["train"], "--eval-dataset", data["eval"]] if data else []
    return [sys.executable, "scope.py", "--toy", "--run-name", job["name"], "--steps", str(args.steps),
            "--max-new-tokens", str(args.max_new_tokens), *data_flags, *job["flags"], *args.passthrough]


def read_json(path: str):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def train(job: dict, args) -> None:
    """Run scope.py unless runs/<name> already holds a finished run of the same command."""
    run_dir, cmd = os.path.join("runs", job["name"]), scope_command(job, args)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    done = os.path.exists(metrics) and any(json.loads(line)["step"] == args.steps for line in open(metrics))
    if done and read_json(os.path.join(run_dir, "command.json")) == cmd[1:]:
        return
    os.makedirs(run_dir, exist_ok=True)
    for stale in ("final_eval.json", "command.json"):
        if os.path.exists(os.path.join(run_dir, stale)):
            os.remove(os.path.join(run_dir, stale))
    with open(os.path.join(run_dir, "train.log"), "w") as log:
        # --overwrite: this job's folder may hold an unfinished or outdated run of it, redone from step 1
        rc = subprocess.run([*cmd, "--overwrite"], stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {rc}); see {run_dir}/train.log")
    with open(os.path.join(run_dir, "command.json"), "w") as f:
        json.dump(cmd[1:], f)


def evaluate_policy(path: str, args) -> dict:
    """avg@n, pass@k, diversity medians, near-miss@1 and discarded-valid share of the policy saved at `path`."""
    import torch

    import toy
    from eval import diversity_summary, discarded_valid_share, evaluate, load_problems, near_miss_at_k
    from generate import HFGenerator, load_causal_lm
    from prm import cut_point, keep_ratio, split_steps

    torch.set_num_threads(1)
    model, tokenizer = load_causal_lm(path, "cpu")
    problems = load_problems(problem_files(args).get("eval", "toy"), limit=args.eval_size)
    res = evaluate(HFGenerator(model.eval(), tokenizer, micro_batch_size=64), tokenizer, problems,
                   n=args.eval_n, temperature=args.eval_temperature, max_new_tokens=args.max_new_tokens,
                   seed=args.eval_seed, keep_samples=True)
    exact_prm, misses = toy.ToyPRM(noise=0.0), []   # (N steps, K kept) of every zero-reward sample
    by_ops = {}                                      # number of operations -> [c / n per problem]
    for problem, row in zip(problems, res["per_problem"]):
        by_ops.setdefault(len(toy.parse_question(problem["question"])[1]), []).append(row["correct"] / row["n"])
        for text, ok in zip(row["samples"], row["sample_correct"]):
            if not ok:
                steps = split_steps(text)
                misses.append((len(steps), cut_point(exact_prm.score(problem["question"], steps))))
    div = diversity_summary(res["per_problem"])
    return {"acc": res["acc"], **{f"pass@{k}": v for k, v in res["pass@k"].items()},
            **{key: div[key]["median"] for key in DIVERSITY},
            "near_miss@1": near_miss_at_k(misses, k=1),
            "discarded_valid": discarded_valid_share([keep_ratio(kept, n) for n, kept in misses]),
            "acc_by_ops": {k: float(np.mean(v)) for k, v in sorted(by_ops.items())},
            "zero_reward_samples": len(misses), "truncated": res["truncated"], "response_len": res["response_len"]}


def training_stats(run_dir: str) -> dict:
    """What the traces say: rollout reward early vs late, rectification acceptance, keep ratio, entropy."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if r["step"] > 0]
    mean = lambda xs: float(np.mean(xs)) if xs else None     # noqa: E731
    tried = sum(r["rectify_tried"] for r in steps)
    return {"frac_all_fail": mean([r["frac_all_fail"] for r in steps]),
            "reward_first5": mean([r["reward_mean"] for r in steps[:5]]),
            "reward_last5": mean([r["reward_mean"] for r in steps[-5:]]),
            "accept_rate": sum(r["rectify_accepted"] for r in steps) / tried if tried else None,
            "keep_ratio": mean([r["keep_ratio_steps"] for r in steps if r["keep_ratio_steps"] is not None]),
            "offpolicy_share": mean([r["offpolicy_share"] for r in steps if r.get("offpolicy_share") is not None]),
            "entropy_last5": mean([r["entropy"] for r in steps[-5:]]),
            "minutes": sum(r["time_step"] for r in steps) / 60}


def run_job(job: dict, args) -> dict:
    """Train (unless done), evaluate (unless cached); runs in a worker process."""
    os.chdir(HERE)
    settings = {k: getattr(args, k) for k in ("eval_size", "eval_n", "eval_temperature", "eval_seed", "max_new_tokens",
                                              "task")}
    run_dir = os.path.join("runs", job["name"])
    if job["row"] == "start":
        import toy
        path = toy.cache_path(os.path.join(HERE, "cache"), seed=0)
        os.makedirs(run_dir, exist_ok=True)
    else:
        train(job, args)
        path = os.path.join(run_dir, "checkpoint")
    cache = os.path.join(run_dir, "final_eval.json")
    cached = read_json(cache)
    if cached is None or cached["settings"] != settings:
        cached = {"settings": settings, "eval": evaluate_policy(path, args)}
        with open(cache, "w") as f:
            json.dump(cached, f, indent=1)
    train_info = training_stats(run_dir) if job["row"] != "start" else {}
    return {**job, "eval": cached["eval"], "train": train_info}


def mean_std(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    return f"{np.mean(values):.3f}" + (f" ± {np.std(values, ddof=1):.3f}" if len(values) > 1 else "")


def write_results(results: list[dict], args, wall_minutes: float) -> str:
    os.makedirs(args.out, exist_ok=True)
    rows = list(dict.fromkeys(r["row"] for r in results))
    by_row = {row: [r for r in results if r["row"] == row] for row in rows}
    ks = [k for k in (1, 2, 4, 8, 16, 32) if k <= args.eval_n]
    acc_cols = ["acc"] + [f"pass@{k}" for k in ks[1:]] + ["near_miss@1", "discarded_valid"]
    train_cols = ["frac_all_fail", "reward_first5", "reward_last5", "accept_rate", "keep_ratio", "offpolicy_share", "entropy_last5"]

    def table(cols, get):
        lines = ["| policy | runs | " + " | ".join(LABELS.get(c, c) for c in cols) + " |", "|---" * (len(cols) + 2) + "|"]
        for row, rs in by_row.items():
            if all(get(r, c) is None for r in rs for c in cols):
                continue   # the start row has no training traces
            lines.append(f"| {row} | {len(rs)} | " + " | ".join(mean_std([get(r, c) for r in rs]) for c in cols) + " |")
        return "\n".join(lines)

    command = shlex.join(["python", "experiment.py", *sys.argv[1:]])
    md = ["# Toy world: SCOPE vs GRPO vs replace vs PRM reward\n",
          f"Command: `{command.strip()}`  \nWall time of this invocation: {wall_minutes:.1f} min on this machine "
          f"(2 shared CPU cores, {args.jobs} jobs at once).  \nTraining: {args.steps} steps of "
          f"`scope.py --toy` defaults{' + ' + ' '.join(args.passthrough) if args.passthrough else ''}"
          f"{' on task ' + args.task if args.task else ''}; evaluation: {args.eval_size} held-out problems "
          f"x {args.eval_n} samples at T = {args.eval_temperature}. Mean ± std over seeds.\n",
          f"## Accuracy (acc = avg@{args.eval_n} = pass@1) and zero-reward samples (exact toy PRM)\n",
          table(acc_cols, lambda r, c: r["eval"][c]),
          "\n## Diversity (medians across prompts)\n", table(DIVERSITY, lambda r, c: r["eval"][c]),
          "\n## Training traces (policy rollouts; rectification acceptance, keep ratio κ, entropy)\n",
          table(train_cols, lambda r, c: r["train"].get(c)),
          "\nall-fail groups, reward: the policy's own rollouts (before rectification). accepted: repaired / tried. "
          "keep ratio κ: of the accepted repairs, as scope.py logs it (a whole-solution repair keeps nothing: 0). "
          "off-policy tokens: share of trained tokens.\n"]
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write("\n".join(md))
    with open(os.path.join(args.out, "table.json"), "w") as f:
        json.dump({"command": command.strip(), "wall_minutes": round(wall_minutes, 2), "runs": results}, f, indent=1)
    from eval import plot_runs

    first = [rs[0]["name"] for row, rs in by_row.items() if row != "start"]
    plot_runs([os.path.join("runs", name) for name in first], os.path.join(args.out, "curves.png"))
    plot_pass_at_k(by_row, ks, os.path.join(args.out, "pass_at_k.png"))
    return "\n".join(md)


def plot_pass_at_k(by_row: dict, ks: list[int], out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.6))
    for row, rs in by_row.items():
        ax.plot(ks, [np.mean([r["eval"][f"pass@{k}"] for r in rs]) for k in ks], marker="o", label=row)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k (mean over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    os.chdir(HERE)
    t0 = time.time()
    problem_files(args, write=True)   # once, before any worker reads them
    jobs = [{"row": "start", "seed": 0, "name": f"{args.tag}-start", "flags": []}] + plan(args)
    print(f"{len(jobs) - 1} runs of {args.steps} steps + the starting policy; {args.jobs} at a time; logs in "
          f"runs/<name>/train.log", flush=True)
    results = []
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(run_job, job, args) for job in jobs]
        for future in futures:
            results.append(future.result())
            r = results[-1]
            print(f"[{time.time() - t0:5.0f}s] {r['name']}: acc {r['eval']['acc']:.3f} "
                  f"pass@{args.eval_n} {r['eval'][f'pass@{args.eval_n}']:.3f} "
                  f"near-miss@1 {r['eval']['near_miss@1']:.2f}", flush=True)
    print(write_results(results, args, (time.time() - t0) / 60))
    print(f"wrote {args.out}/table.md, table.json, curves.png, pass_at_k.png in {(time.time() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main()
