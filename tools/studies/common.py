"""common.py — what the toy studies share: a run as a job, its training and final evaluation, the
workers, paired intervals and tables, and the records' commands under the modules' present names.

where_it_helps.py (the grid study, and the command line of the regime, diversity and because stages),
when_it_helps.py, why_it_helps.py, content_or_mean_shift.py and prefix_or_suffix.py plan their runs with `job` and
run them with `run_all`: each job is one `python scope.py --toy` process (`train`) and the final evaluation of its
policy (`evaluate_policy`), cached in its run folder (`run_job`). The settings and their reasons (the evaluation
temperatures, the in-training eval, the 95 % interval, the workers, the budget) are where_it_helps.py's choices 1-5.
"""
import json
import math
import multiprocessing
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor

os.environ.setdefault("OMP_NUM_THREADS", "1")   # before torch is imported, here and in spawned workers
os.environ.setdefault("MKL_NUM_THREADS", "1")
import numpy as np  # noqa: E402

from harness.run.progress import StudyClock  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repository root
# A record keeps the command that made it; the modules renamed since, by the name a record holds -> the name now
RENAMED = {"tools.because2": "tools.studies.content_or_mean_shift"}
DIVERSITY = ["distinct_1", "distinct_4", "one_minus_self_bleu", "one_minus_self_rouge", "div_score"]
GRID = {"grpo": "--mode grpo",
        "scope any/replace": "--mode scope --rectify-groups any --merge replace",
        "scope any/append": "--mode scope --rectify-groups any --merge append",
        "scope all-fail/replace": "--mode scope --rectify-groups all-fail --merge replace",
        "scope all-fail/append": "--mode scope --rectify-groups all-fail --merge append",
        "replace (whole)": "--mode replace",
        "prm-reward": "--mode prm-reward"}


def slug(row: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in row).strip("-").replace("--", "-")


def job(row: str, seed: int, flags: str, args, *, group: str = "main", steps: int | None = None,
        task: str = "", start: str | None = None, eval_every: int | None = None) -> dict:
    """One training run. `start`: toy.warm_start settings (JSON) of its starting policy; None = the group's
    default (`start_settings`)."""
    j = {"row": row, "seed": seed, "group": group, "steps": steps or args.steps, "task": task,
         "eval_every": eval_every or (args.long_eval_every if group == "long" else args.eval_every),
         "name": f"{args.tag}-{group}-{slug(row)}-s{seed}", "flags": flags.split() + ["--seed", str(seed)]}
    return j if start is None else {**j, "start": start}


def start_settings(j: dict, args) -> dict:
    """toy.warm_start settings of a job's starting policy: its own "start", else the shipped warm start, or for
    the "weak" group the --weak-start one."""
    if "start" in j:
        return json.loads(j["start"])
    return json.loads(args.weak_start) if j["group"] == "weak" else {}


def start_path(j: dict, args) -> str:
    """Where a job's starting policy is cached (see `start_settings`)."""
    from harness.data import toy

    return toy.cache_path(os.path.join(ROOT, "cache"), seed=0, **start_settings(j, args))


def problem_files(task: str, args, write: bool = False) -> dict:
    """Train (toy seed 1, 500 problems) and eval (toy seed 0) problems of a task as JSONL files, the seeds
    load_problems("toy") uses; {} for the default task ("")."""
    if not task:
        return {}
    from harness.data import toy

    folder = os.path.join("runs", f"{args.tag}-data-{slug(task)}")
    files = {"train": os.path.join(folder, "train.jsonl"), "eval": os.path.join(folder, "eval.jsonl")}
    if write:   # planning a command only names the files
        os.makedirs(folder, exist_ok=True)
    for split, n, seed in (("train", 500, 1), ("eval", max(args.eval_size, args.train_eval_size), 0)) if write else ():
        with open(files[split], "w") as f:
            for p in toy.make_problems(n, seed=seed, **json.loads(task)):
                f.write(json.dumps({"id": p["id"], "question": p["question"], "answer": p["answer"]}) + "\n")
    return files


def scope_command(j: dict, args) -> list[str]:
    data = problem_files(j["task"], args)
    data_flags = ["--dataset", data["train"], "--eval-dataset", data["eval"]] if data else []
    if start_settings(j, args):
        data_flags += ["--model", os.path.relpath(start_path(j, args), ROOT)]
    return [sys.executable, "scope.py", "--toy", "--run-name", j["name"], "--steps", str(j["steps"]),
            "--max-new-tokens", str(args.max_new_tokens), "--eval-size", str(args.train_eval_size),
            "--eval-n", str(args.train_eval_n), "--eval-every", str(j["eval_every"]),
            "--save-every", str(j["steps"]), *data_flags, *j["flags"], *args.passthrough]


def environment() -> dict:
    """The versions, CPU, threads and commit a record was made with (harness/run/runs.py environment)."""
    from harness.run.runs import environment as now

    return now()


def read_json(path: str):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def as_now(command: list[str]) -> list[str]:
    """A recorded command with the modules renamed since it was recorded (RENAMED) under their present names."""
    return [RENAMED.get(word, word) for word in command]


def typed(default: list[str]) -> str:
    """The study's command: `python -m tools.studies` and the arguments it was run with, or `default` when it was
    called from code."""
    run = sys.argv[0] == os.path.join(os.path.dirname(os.path.abspath(__file__)), "__main__.py")
    return shlex.join(["python", "-m", "tools.studies", *(sys.argv[1:] if run else default)])


def train(j: dict, args) -> None:
    """Run scope.py unless runs/<name> already holds a finished run of the same command."""
    run_dir, cmd = os.path.join("runs", j["name"]), scope_command(j, args)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    done = os.path.exists(metrics) and any(json.loads(line)["step"] == j["steps"] for line in open(metrics))
    record = {"command": cmd[1:], "start": os.path.relpath(start_path(j, args), ROOT)}   # a new warm start retrains
    if done and read_json(os.path.join(run_dir, "command.json")) == record:
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
        json.dump(record, f)


def evaluate_policy(path: str, task: str, args, styles: int = 1) -> dict:
    """The final-eval metrics of the policy saved at `path` (tools/studies/where_it_helps.py's docstring); with `styles` > 1 also
    the styles of its correct samples at T = 1.0 (toy.style_stats) and the mean number of distinct styles among
    the correct samples of a problem (problems with at least two)."""
    import torch

    from harness.data import toy
    from eval import diversity_summary, discarded_valid_share, evaluate, near_miss_at_k
    from harness.data.problems import load_problems
    from harness.engines.generate import HFGenerator, load_causal_lm
    from prm import cut_point, keep_ratio, split_steps

    torch.set_num_threads(1)
    model, tokenizer = load_causal_lm(path, "cpu")
    problems = load_problems(problem_files(task, args).get("eval", "toy"), limit=args.eval_size)
    generator = HFGenerator(model.eval(), tokenizer, micro_batch_size=128)
    hot = evaluate(generator, tokenizer, problems, n=args.eval_n, temperature=1.0, max_new_tokens=args.max_new_tokens,
                   seed=args.eval_seed, keep_samples=True, batch_size=16)
    cool = evaluate(generator, tokenizer, problems, n=args.eval_n_cool, temperature=0.6,
                    max_new_tokens=args.max_new_tokens, seed=args.eval_seed + 1,
                    batch_size=16) if args.eval_n_cool else {"acc": None}
    exact_prm, misses, by_ops = toy.ToyPRM(noise=0.0), [], {}   # misses: (N steps, K kept) per zero-reward sample
    for problem, row in zip(problems, hot["per_problem"]):
        by_ops.setdefault(len(toy.parse_question(problem["question"])[1]), []).append(row["correct"] / row["n"])
        for text, ok in zip(row["samples"], row["sample_correct"]):
            if not ok:
                steps = split_steps(text)
                misses.append((len(steps), cut_point(exact_prm.score(problem["question"], steps))))
    div = diversity_summary(hot["per_problem"])
    style = {}
    if styles > 1:
        correct = [[text for text, ok in zip(row["samples"], row["sample_correct"]) if ok] for row in hot["per_problem"]]
        stats = toy.style_stats([text for texts in correct for text in texts], styles)
        every = toy.style_stats([text for row in hot["per_problem"] for text in row["samples"]], styles)
        style = {"style_entropy": stats["entropy"], "style_share": stats["share"], "style_other": stats["other"],
                 "styles_per_problem": mean([len({toy.style_of(t) for t in texts} - {None})
                                             for texts in correct if len(texts) >= 2]),
                 "style_share_all": every["share"], "style_other_all": every["other"]}   # all samples, wrong ones too
    return {**style, "acc_t1": hot["acc"], "acc_t06": cool["acc"], **{f"pass@{k}": v for k, v in hot["pass@k"].items()},
            **{key: div[key]["median"] for key in DIVERSITY},
            "near_miss@1": near_miss_at_k(misses, k=1) if misses else None,
            "discarded_valid": discarded_valid_share([keep_ratio(kept, n) for n, kept in misses]) if misses else None,
            "acc_by_ops": {str(k): float(np.mean(v)) for k, v in sorted(by_ops.items())},
            "all_fail_16": float(np.mean([row["correct"] == 0 for row in hot["per_problem"]])),
            # correct samples of each problem at T = 1.0, in problem order (for a seed x problem bootstrap)
            "per_problem_correct": [row["correct"] for row in hot["per_problem"]],
            "zero_reward_samples": len(misses), "truncated": hot["truncated"], "response_len": hot["response_len"]}


def training_stats(run_dir: str) -> dict:
    """What metrics.jsonl says: all-fail share, reward, rectifications, κ, entropy, eval curve, minutes."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if r["step"] > 0]
    tried = sum(r["rectify_tried"] for r in steps)
    return {"frac_all_fail": mean([r["frac_all_fail"] for r in steps]),
            "frac_all_fail_first3": mean([r["frac_all_fail"] for r in steps[:3]]),
            "reward_first5": mean([r["reward_mean"] for r in steps[:5]]),
            "reward_last5": mean([r["reward_mean"] for r in steps[-5:]]),
            "accept_rate": sum(r["rectify_accepted"] for r in steps) / tried if tried else None,
            "rectified": sum(r["rectify_accepted"] for r in steps),
            "rectified_all_fail": sum(r.get("rectify_all_fail", 0) for r in steps),
            "keep_ratio": mean([r["keep_ratio_steps"] for r in steps if r["keep_ratio_steps"] is not None]),
            "offpolicy_share": mean([r["offpolicy_share"] for r in steps if r.get("offpolicy_share") is not None]),
            "entropy_last5": mean([r["entropy"] for r in steps[-5:]]),
            "curve": {"step": [r["step"] for r in rows if "eval_acc" in r],
                      "eval_acc": [r["eval_acc"] for r in rows if "eval_acc" in r],
                      "all_fail": [r["frac_all_fail"] for r in steps], "entropy": [r["entropy"] for r in steps]},
            "minutes": sum(r["time_step"] for r in steps) / 60}


def eval_styles(j: dict, args) -> int:
    """How many styles the final eval reads (evaluate_policy's `styles`): the starting policy's, or all of
    toy.STYLES when the run's refiner writes a style of its own (the policy may pick up a foreign one)."""
    from harness.data import toy

    own = start_settings(j, args).get("styles", 1)
    return len(toy.STYLES) if "--toy-refiner-style" in j["flags"] else own


def run_job(j: dict, args) -> dict:
    """Train (unless done), evaluate (unless cached); runs in a worker process."""
    os.chdir(ROOT)
    t0 = time.time()
    settings = {k: getattr(args, k) for k in ("eval_size", "eval_n", "eval_n_cool", "eval_seed", "max_new_tokens")}
    settings["task"] = j["task"]
    run_dir = os.path.join("runs", j["name"])
    if j["steps"] == 0:   # the warm start itself
        path = start_path(j, args)
        os.makedirs(run_dir, exist_ok=True)
    else:
        train(j, args)
        path = os.path.join(run_dir, "checkpoint")
    settings["policy"] = os.path.relpath(path, ROOT)   # a new warm start is a new policy: evaluated again
    t1 = time.time()
    cache = os.path.join(run_dir, "final_eval.json")
    cached = read_json(cache)
    if cached is None or cached["settings"] != settings:
        cached = {"settings": settings, "eval": evaluate_policy(path, j["task"], args, eval_styles(j, args)),
                  "environment": environment()}
        with open(cache, "w") as f:
            json.dump(cached, f, indent=1)
    train_info = training_stats(run_dir) if j["steps"] else {}
    return {**j, "eval": cached["eval"], "train": train_info,
            "wall_s": {"train": round(t1 - t0, 1), "eval": round(time.time() - t1, 1)}}


def _stop_on_sigterm() -> None:
    """The study's own process: SIGTERM raises SystemExit, so run_all stops its workers as on Ctrl-C."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def _worker_group() -> None:
    """Each pool worker (its initializer): the leader of its own process group, which the scope.py runs it
    starts join; SIGTERM ends the whole group (the worker, its run). A handler that raised instead would not
    do: the pool catches any exception of a job and keeps the worker alive for the next one."""
    os.setpgrp()

    def end_group(*_):
        # ignore, not default: the pool sends a second SIGTERM when it sees a worker die, and under the default
        # action it could end this worker between these two lines, before its run got the signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.killpg(os.getpgrp(), signal.SIGTERM)
        os._exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, end_group)   # Ctrl-C at a terminal reaches the study's process (the


def run_all(jobs: list[dict], args, t0: float, worker=None) -> list[dict]:
    """Every job through `worker` (default run_job), --jobs at a time, results in job order. Ctrl-C or SIGTERM
    stops the workers and the scope.py runs they started (a stopped study leaves no process behind; rerun
    it to resume from the finished runs)."""
    results = []
    if threading.current_thread() is threading.main_thread():
        _stop_on_sigterm()
    pool = ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_group)
    try:
        futures = [pool.submit(worker or run_job, j, args) for j in jobs]
        clock = StudyClock(len(jobs))   # "run k/N, ETA ..." (harness/run/progress.py)
        for future in futures:
            r = future.result()
            results.append(r)
            cool = f" acc@T0.6 {r['eval']['acc_t06']:.3f}" if r["eval"].get("acc_t06") is not None else ""
            where = clock.finished(sum(r.get("wall_s", {}).values()))
            print(f"[{time.time() - t0:5.0f}s] {where} | {r['name']}: acc@T1 {r['eval']['acc_t1']:.3f}{cool} "
                  f"pass@16 {r['eval'].get('pass@16', float('nan')):.3f} "
                  f"(train {r['wall_s']['train']:.0f}s, eval {r['wall_s']['eval']:.0f}s)", flush=True)
    except BaseException:   # Ctrl-C, SIGTERM, a failed run: stop the workers, which stop their scope.py children
        stop_pool(pool)
        raise
    pool.shutdown(wait=True)
    return results


# ---------------------------------------------------------------- statistics and reporting

def t975(df: int) -> float:
    """The two-sided 95 % quantile of Student's t with `df` degrees of freedom (scipy.stats.t.ppf(0.975, df))."""
    from scipy import stats

    return float(stats.t.ppf(0.975, df))


def stop_pool(pool) -> None:
    """Stop a ProcessPoolExecutor's workers now (each stops the scope.py run it started on SIGTERM)."""
    workers = list((getattr(pool, "_processes", None) or {}).values())   # the pool's own processes
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in workers:
        if proc.is_alive():
            proc.terminate()
    for proc in workers:
        proc.join(timeout=30)


def ci95(diffs: list[float]) -> dict:
    """Mean and 95 % t-interval of paired differences (tools/studies/where_it_helps.py choice 3); no interval from one seed."""
    d = np.asarray([x for x in diffs if x is not None], dtype=float)
    if len(d) == 0:
        return {"mean": None, "lo": None, "hi": None, "n": 0}
    if len(d) == 1:
        return {"mean": float(d[0]), "lo": None, "hi": None, "n": 1}
    half = t975(len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
    return {"mean": float(d.mean()), "lo": float(d.mean() - half), "hi": float(d.mean() + half), "n": len(d)}


def value(r: dict, key: str):
    return r["eval"].get(key) if key in r["eval"] else r["train"].get(key)


def paired(results: list[dict], group: str, keys: list[str]) -> dict:
    """{row: {key: ci95 of (row - grpo) over the seeds both have}} within one group."""
    base = {r["seed"]: r for r in results if r["group"] == group and r["row"] == "grpo"}
    out = {}
    for row in dict.fromkeys(r["row"] for r in results if r["group"] == group and r["steps"]):
        if row == "grpo":
            continue
        rs = [r for r in results if r["group"] == group and r["row"] == row and r["seed"] in base]
        out[row] = {k: ci95([value(r, k) - value(base[r["seed"]], k) for r in rs
                             if value(r, k) is not None and value(base[r["seed"]], k) is not None]) for k in keys}
    return out


def fmt_ci(c: dict) -> str:
    if c["mean"] is None:
        return "–"
    return f"{c['mean']:+.3f}" + (f" [{c['lo']:+.3f}, {c['hi']:+.3f}]" if c["lo"] is not None else "")


def mean_sd(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    return f"{np.mean(values):.3f}" + (f" ± {np.std(values, ddof=1):.3f}" if len(values) > 1 else "")


COLS = [("acc_t1", "acc T=1.0"), ("acc_t06", "acc T=0.6"), ("pass@4", "pass@4"), ("pass@16", "pass@16"),
        ("frac_all_fail", "all-fail (train)"), ("near_miss@1", "near-miss@1"), ("discarded_valid", "discarded valid"),
        ("div_score", "div-score"), ("entropy_last5", "entropy"), ("accept_rate", "accepted"),
        ("rectified_all_fail", "repairs in all-fail groups")]
DIFFS = [("acc_t1", "Δ acc T=1.0"), ("acc_t06", "Δ acc T=0.6"), ("pass@16", "Δ pass@16")]


def tables(results: list[dict], group: str, title: str) -> list[str]:
    rs_group = [r for r in results if r["group"] == group]
    if not rs_group:
        return []
    rows = list(dict.fromkeys(r["row"] for r in rs_group))
    by_row = {row: [r for r in rs_group if r["row"] == row] for row in rows}
    out = [f"## {title}\n", "| row | seeds | " + " | ".join(h for _, h in COLS) + " |", "|---" * (len(COLS) + 2) + "|"]
    for row, rs in by_row.items():
        out.append(f"| {row} | {len(rs)} | " + " | ".join(mean_sd([value(r, k) for r in rs]) for k, _ in COLS) + " |")
    diffs = paired(results, group, [k for k, _ in DIFFS])
    if diffs:
        out += ["", "Paired difference to grpo (same seed), mean [95 % interval]:\n",
                "| row | " + " | ".join(h for _, h in DIFFS) + " |", "|---" * (len(DIFFS) + 1) + "|"]
        out += [f"| {row} | " + " | ".join(fmt_ci(d[k]) for k, _ in DIFFS) + " |" for row, d in diffs.items()]
    ops = sorted({k for r in rs_group for k in r["eval"]["acc_by_ops"]}, key=int)
    out += ["", "Accuracy at T = 1.0 per difficulty (number of operations):\n",
            "| row | " + " | ".join(f"{k} ops" for k in ops) + " |", "|---" * (len(ops) + 1) + "|"]
    out += [f"| {row} | " + " | ".join(mean_sd([r["eval"]["acc_by_ops"].get(k) for r in rs]) for k in ops) + " |"
            for row, rs in by_row.items()]
    return out + [""]


def curves(results: list[dict], group: str, key: str) -> dict:
    """{row: (x, mean over seeds, sd over seeds)} of a per-run curve (runs cut to the shortest)."""
    out = {}
    for row in dict.fromkeys(r["row"] for r in results if r["group"] == group and r["steps"]):
        rs = [r["train"]["curve"] for r in results if r["group"] == group and r["row"] == row]
        n = min(len(c[key]) for c in rs)
        if n == 0:
            continue
        ys = np.array([c[key][:n] for c in rs], dtype=float)
        x = rs[0]["step"][:n] if key == "eval_acc" else list(range(1, n + 1))
        out[row] = (x, ys.mean(0), ys.std(0, ddof=1) if len(rs) > 1 else np.zeros(n))
    return out


def repair_credit(trace: dict, merge: str, pi: list[float], corrected: int | None, *, credit: str = "shaped",
                  gamma: float = 0.1) -> dict:
    """The coefficient each kind of token of one accepted repair gets on ∇log π in the step's loss (the loss's
    common 1/(N·max_new_tokens) factor left out; ρ = 1 on policy tokens, one optimizer step per batch):
      A_repair = 1 − mean of the merged group's rewards (the pick's 0 becomes 1 with replace; a 1 joins the
      G with append); kept-prefix tokens (the policy's own) get A_repair; a refiner token with probability π
      under the policy gets A_repair · γπ/(π+γ)² with LUFFY's shaping (d/dlog π of π/(π+γ)) or A_repair with
      unit credit; the failed rollout's tokens, still in the group with append, get A_fail = 0 − mean."""
    rewards = list(trace["group_rewards"])
    if merge == "append":
        merged = rewards + [trace["reward_after"]]
    else:
        merged = list(rewards)
        merged[merged.index(trace["reward_before"])] = trace["reward_after"]
    a_repair = trace["reward_after"] - sum(merged) / len(merged)
    weight = (lambda p: gamma * p / (p + gamma) ** 2) if credit == "shaped" else (lambda p: 1.0)
    return {"a_repair": a_repair, "a_fail": (trace["reward_before"] - sum(merged) / len(merged)) if merge == "append"
            else None, "refiner_pi": float(np.mean(pi)) if pi else None,
            "refiner_coef": float(np.mean([a_repair * weight(p) for p in pi])) if pi else None,
            "corrected_pi": pi[corrected] if corrected is not None else None,
            "corrected_coef": a_repair * weight(pi[corrected]) if corrected is not None else None}


def repair_token_probs(model, tokenizer, trace: dict) -> tuple[list[float], int, int | None]:
    """An accepted repair of traces.jsonl teacher-forced under `model`: (π of each token of the kept prefix and
    the accepted suffix, the prefix's token count, the corrected token's index in the suffix or None). The
    corrected token is the first suffix character that differs from the failed rollout's text after the prefix
    (the toy tokenizer is one character per token)."""
    import torch

    from grpo import logprobs_and_entropy
    from harness.data.prompt import format_prompt

    suffix = trace["suffixes"][trace["attempt_correct"].index(True)]
    head = format_prompt(tokenizer, trace["question"])
    prefix = tokenizer.encode(trace["prefix_text"], add_special_tokens=False)
    body = tokenizer.encode(suffix, add_special_tokens=False)
    ids = torch.tensor([head + prefix + body])
    with torch.no_grad():   # logits at t - 1 produced the token at t
        logp, _ = logprobs_and_entropy(model(input_ids=ids).logits[:, :-1], ids[:, 1:])   # (1, T - 1)
    failed = "".join(trace["steps"])[len(trace["prefix_text"]):]
    corrected = next((i for i, ch in enumerate(suffix) if i >= len(failed) or ch != failed[i]), None)
    return logp[0, len(head) - 1:].exp().tolist(), len(prefix), corrected


def mechanism(results: list[dict], args) -> dict:
    """From the traces of every SCOPE-like run: where the cuts fell and what was kept (all steps), and, on step 1
    (where the policy IS the starting policy, so π can be recomputed exactly), the gradient coefficient each kind
    of token got (`repair_credit`). The corrected token = the first refiner token that differs from the failed
    rollout's text after the kept prefix (char-level toy tokenizer: one character = one token)."""
    import torch

    from harness.engines.generate import load_causal_lm
    from harness.engines.refiner import MODES_WITH_REFINER

    torch.set_num_threads(1)
    models, out = {}, {}
    for (group, row), rs in _by_group_row(results).items():
        traces = [(r, json.loads(line)) for r in rs for line in open(os.path.join("runs", r["name"], "traces.jsonl"))]
        acc = [(r, t) for r, t in traces if t["accepted"]]
        if not acc or flag_value(rs[0]["flags"], "--mode", "scope") not in MODES_WITH_REFINER:
            continue
        if group not in models:
            models[group] = load_causal_lm(start_path(rs[0], args), "cpu")
        model, tokenizer = models[group]
        credits = []
        for r, t in acc:
            if t["step"] != 1:
                continue
            pi, kept, corrected = repair_token_probs(model, tokenizer, t)
            pi = pi[kept:]   # π of each refiner token
            credit = repair_credit(t, flag_value(r["flags"], "--merge", "replace"), pi, corrected,
                                   credit=flag_value(r["flags"], "--offpolicy-credit", "shaped"))
            if flag_value(r["flags"], "--repair-advantage", "keep") == "zero":   # the phantom: no gradient
                credit.update(a_repair=0.0, refiner_coef=0.0 if pi else None,
                              corrected_coef=0.0 if corrected is not None else None)
            credits.append({**credit,
                            "kept": kept,
                            "refiner_tokens": len(pi)})
        n_steps = [len(t["steps"]) for _, t in acc]
        out[f"{group}: {row}"] = {
            "repairs": len(acc), "per_run": len(acc) / len(rs),
            "in_all_fail_groups": mean([float(t["group_all_fail"]) for _, t in acc]),
            "cut_relative": mean([t["cut"] / n for (_, t), n in zip(acc, n_steps)]),
            "last_step_only": mean([float(t["cut"] == n - 1) for (_, t), n in zip(acc, n_steps)]),
            "keep_ratio_tokens": mean([t["keep_ratio_tokens"] for _, t in acc]),
            "step1_repairs": len(credits), **{k: mean([c[k] for c in credits]) for k in
                                              ("kept", "refiner_tokens", "a_repair", "a_fail", "refiner_pi",
                                               "refiner_coef", "corrected_pi", "corrected_coef")}}
    return out


def flag_value(flags: list[str], name: str, default: str) -> str:
    """The value after `name` in a run's scope.py flags, or scope.py's default when the flag is not given."""
    return flags[flags.index(name) + 1] if name in flags else default


def mean(xs) -> float | None:
    """Mean of the values that are not None; None when there are none."""
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def _by_group_row(results: list[dict]) -> dict:
    out = {}
    for r in results:
        if r["steps"]:
            out.setdefault((r["group"], r["row"]), []).append(r)
    return out
