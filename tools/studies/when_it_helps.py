"""when_it_helps.py — the long toy studies: when does SCOPE help (the regime map), and does it keep diverse solutions?

Not part of the paper's code; its questions are the paper's. Two named stages of `python -m tools.studies`:

  --stage regime     the REGIME MAP. Starting policies from strong to weak (`STARTS`: the shipped warm start on
      the ladder, the weaker SFT of the same recipe on the ladder, and that weaker SFT on 6-operation problems,
      whose G = 8 groups are 20 %, 52 % and 59 % all-fail at the start, as measured by choice 2),
      each trained --regime-steps (100)
      steps, --seeds (5) seeds per cell, with the rows of `rows()`: grpo; SCOPE as the paper runs it (any group,
      replace); the study's best SCOPE cell (--regime-best, the grid's winner on training reward in the shipped
      study.json); the whole-trajectory replacement. Where a SCOPE row's final Δ to GRPO has a 95 % interval
      above 0, that start also runs the ablations of that row (all-fail only, unit credit, model refiner, PRM
      noise 0.2), weakest start first: `--regime-ablations auto` (the default; a comma list of starts adds them,
      `none` skips).
  --stage diversity  DIVERSE CORRECT SOLUTIONS: the warm start trained on --styles (3) phrasings of each step
      (harness/data/toy.py, `styles`), grpo vs SCOPE (paper) on the ladder, --seeds seeds, --diversity-steps
      (100) steps: the share and entropy of styles among the policy's correct rollouts over training
      (scope.py's style_* metrics) and among the final policy's correct samples, and the Table-4 metrics.

Every finished run leaves a record, results/toy/<stage>/records/<run name>.json (its scope.py command, its starting
policy, its eval settings, its result), committed with the study: a rerun with the same settings reads the
record instead of training (so the study resumes across clones and sessions), and `--compare` between two
study JSON files checks that a retrained run reproduces its numbers. A record whose command differs is
retrained. Output: results/toy/<stage>.json and <stage>.md, and the figures regime.png (Δ vs the starting
all-fail share) and regime_curves.png, or diversity.png.

Choices (numbered):
 1. Cost, measured on this 2-core machine: a toy step takes ~2.4 s of one core (rollout 1.3 s, update 1.0 s),
    so a 100-step run is ~5 min with its evaluations (measured with two jobs at once and nothing else running:
    250-280 s of training with its in-training evals, 27-33 s of final eval) and the map's 60 runs ~150 min;
    the diversity stage's 10 runs ~30 min (on the full map: 148 s of wall time per run, two at a time). Under
    other load a run took up to 2.5x as long. Each start whose SCOPE row separates adds 20 ablation runs (~50 min), so the whole stage from scratch
    (two such starts here) is ~250 min: it resumes from its records, and `--regime-ablations none` is the
    150-minute map alone. To stay in that budget the regime runs evaluate held-out accuracy
    during training every --regime-eval-every (25) steps on --regime-eval-size (200) problems x 1 sample at
    T = 0.6, and the final eval at T = 1.0 only (16 samples per problem, acc = avg@16, pass@k): the curves
    "along the way" lean on the training reward of the policy's own rollouts, which costs nothing (every
    step, 64 rollouts). A longer budget would buy more seeds (narrower intervals), 200+ steps, and the
    ablations on every start.
 2. The starting all-fail share of a start is measured, not assumed: GRPO's share of all-fail groups over
    its first 3 steps, mean over seeds (step 1's rollouts are the same in every row of a seed).
 3. "Separates": the first evaluation step (held-out) or 20-step block (training reward) at which the 95 %
    interval of the paired difference excludes 0, with its side (above / below). One such point in several is what chance gives now and
    then (no correction for looking at several points); the final-eval interval is the headline.
 4. --regime-best is read, not searched: running the grid again on every start would cost 3x the map.
"""
import json
import math
import os
import time

import numpy as np

from tools.studies import common

STARTS = {   # name: (toy.warm_start settings of the starting policy, toy.make_problems settings of the task)
    "main-ladder": ({}, ""),                                       # the shipped warm start on the ladder
    "weak-ladder": ({"lateness": 1.5}, ""),                        # the weaker SFT of the same recipe
    "weak-6ops": ({"lateness": 1.5}, '{"min_ops": 6, "max_ops": 6}'),   # the same on 6-operation problems
}
ABLATIONS = {"all-fail only": " --rectify-groups all-fail", "unit credit": " --offpolicy-credit unit",
             "model refiner": " --refiner toy-model", "PRM noise 0.2": " --toy-prm-noise 0.2"}
BLOCK = 20   # steps per block of the training-reward and all-fail summaries


def rows(best: str) -> dict:
    """The map's rows: {label: scope.py flags}."""
    out = {"grpo": common.GRID["grpo"], "scope (paper): any/replace": common.GRID["scope any/replace"],
           f"best: {best}": common.GRID[best], "replace (whole)": common.GRID["replace (whole)"]}
    if best == "scope any/replace":
        out.pop(f"best: {best}")
    return out


def plan_regime(args, starts: list[str]) -> list[dict]:
    """Jobs seed by seed (all cells of seed 0 first): a study stopped early still holds every cell."""
    jobs = []
    for name in starts:
        settings, task = STARTS[name]
        jobs.append({"row": "warm start", "seed": 0, "group": f"regime-{name}", "steps": 0, "task": task,
                     "flags": [], "start": json.dumps(settings), "name": f"{args.tag}-regime-{name}-start"})
    for seed in args.seed_list:
        for name in starts:
            settings, task = STARTS[name]
            jobs += [common.job(row, seed, flags, args, group=f"regime-{name}", steps=args.regime_steps, task=task,
                                 start=json.dumps(settings), eval_every=args.regime_eval_every)
                     for row, flags in rows(args.regime_best).items()
                     if not args.regime_rows or row in args.regime_rows.split(",")]
    return jobs


def plan_ablations(args, results: list[dict], starts: list[str]) -> list[dict]:
    """The ablations of the first SCOPE row that separates upward on each start (or of the paper's row on a
    start named in --regime-ablations), the weakest start first (highest starting all-fail share): the paper's
    claim is about weak starts, and a study stopped early then holds those."""
    jobs = []
    for name in sorted(starts, key=lambda s: -(starting_all_fail(results, f"regime-{s}") or 0.0)):
        group = f"regime-{name}"
        diffs = common.paired(results, group, ["acc_t1"])
        up = [row for row, d in diffs.items() if row.startswith(("scope", "best")) and d["acc_t1"]["lo"] is not None
              and d["acc_t1"]["lo"] > 0]
        forced = name in args.regime_ablations.split(",")
        if not up and not forced:
            continue
        row = up[0] if up else "scope (paper): any/replace"
        base = rows(args.regime_best)[row]
        settings, task = STARTS[name]
        for seed in args.seed_list:
            jobs += [common.job(f"{row} + {label}", seed, base + extra, args, group=group, steps=args.regime_steps,
                                 task=task, start=json.dumps(settings), eval_every=args.regime_eval_every)
                     for label, extra in ABLATIONS.items()]
    return jobs


# ---------------------------------------------------------------- one run, recorded

def record_path(j: dict, args) -> str:
    return os.path.join(args.out, args.stage, "records", j["name"] + ".json")


def repairs_of(run_dir: str, steps: int) -> dict:
    """Where the accepted repairs of a run fell: per BLOCK of steps, in all-fail vs mixed groups, and where in the
    chain the cut was (first wrong step / steps, 5 bins)."""
    path = os.path.join(run_dir, "traces.jsonl")
    acc = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    acc = [t for t in acc if t["accepted"]]
    blocks = [0] * math.ceil(steps / BLOCK)
    for t in acc:
        blocks[(t["step"] - 1) // BLOCK] += 1
    rel = [t["cut"] / len(t["steps"]) for t in acc if t.get("steps")]
    return {"accepted": len(acc), "per_block": blocks,
            "in_all_fail_groups": common.mean([float(t["group_all_fail"]) for t in acc]),
            "cut_relative_hist": np.histogram(rel, bins=5, range=(0.0, 1.0))[0].tolist()}


def run_recorded(j: dict, args) -> dict:
    """The job's record if it holds this command and these eval settings, else train + evaluate + record it."""
    os.chdir(common.ROOT)
    done = recorded(j, args)
    if done is not None:
        return done
    command, settings = record_key(j, args)
    r = common.run_job(j, args)
    run_dir = os.path.join("runs", j["name"])
    if j["steps"]:
        metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
        r["train"]["curve"]["reward"] = [m["reward_mean"] for m in metrics if m["step"] > 0]
        for key in ("style_entropy_correct", "style_share_correct", "style_share_all", "style_other_all"):
            if any(key in m for m in metrics):
                r["train"]["curve"][key] = [m.get(key) for m in metrics if m["step"] > 0]
        r["repairs"] = repairs_of(run_dir, j["steps"])
    os.makedirs(os.path.dirname(record_path(j, args)), exist_ok=True)
    with open(record_path(j, args), "w") as f:
        json.dump({"command": command, "start": j.get("start", "{}"), "eval_settings": settings, "result": r,
                   "environment": common.environment()}, f)
    return r


def record_key(j: dict, args) -> tuple[list[str], dict]:
    """What a record must hold to stand in for the job: its scope.py command and the final eval's settings."""
    command = common.scope_command(j, args)[1:] if j["steps"] else []
    return command, {k: getattr(args, k) for k in ("eval_size", "eval_n", "eval_n_cool", "eval_seed", "max_new_tokens")}


def recorded(j: dict, args) -> dict | None:
    """The job's record's result when it holds this command and these eval settings, else None."""
    command, settings = record_key(j, args)
    old = common.read_json(record_path(j, args))
    return old["result"] if old is not None and old["command"] == command and old["eval_settings"] == settings else None


def run_all(jobs: list[dict], args, t0: float) -> list[dict]:
    """Every job's result; with --records-only only the recorded ones (nothing trains), the others listed."""
    if args.records_only:
        results = [r for r in (recorded(j, args) for j in jobs) if r is not None]
        missing = [j["name"] for j in jobs if recorded(j, args) is None]
        print(f"{len(results)} of {len(jobs)} runs recorded; not run yet: {missing}", flush=True)
        return results
    return common.run_all(jobs, args, t0, worker=run_recorded)


# ---------------------------------------------------------------- statistics

def starting_all_fail(results: list[dict], group: str) -> float | None:
    """Choice 2: GRPO's all-fail share over its first 3 steps, mean over seeds."""
    return common.mean([r["train"]["frac_all_fail_first3"] for r in results
                         if r["group"] == group and r["row"] == "grpo" and r["steps"]])


def paired_curve(results: list[dict], group: str, key: str, block: int = 1) -> dict:
    """{row: [(x, ci95 of row - grpo)]} along a per-run curve: the held-out eval points ("eval_acc", x = step)
    or per-step curves averaged over blocks of `block` steps (x = the block's last step)."""
    base = {r["seed"]: r["train"]["curve"] for r in results if r["group"] == group and r["row"] == "grpo" and r["steps"]}
    out = {}
    for row in dict.fromkeys(r["row"] for r in results if r["group"] == group and r["steps"] and r["row"] != "grpo"):
        pairs = [(r["train"]["curve"], base[r["seed"]]) for r in results
                 if r["group"] == group and r["row"] == row and r["seed"] in base]
        if not pairs:
            continue
        n = min(min(len(a[key]), len(b[key])) for a, b in pairs)
        if key == "eval_acc":
            xs = pairs[0][0]["step"][:n]
            out[row] = [(x, common.ci95([a[key][i] - b[key][i] for a, b in pairs])) for i, x in enumerate(xs)]
        else:
            out[row] = [(min(i + block, n), common.ci95([_diff(common.mean(a[key][i:i + block]),
                                                                common.mean(b[key][i:i + block])) for a, b in pairs]))
                        for i in range(0, n, block)]
    return out


def separates(points: list) -> int | None:
    """Choice 3: the first x (past 0) whose interval excludes 0."""
    return next((x for x, c in points if x and c["lo"] is not None and (c["lo"] > 0 or c["hi"] < 0)), None)


def separation_label(points: list) -> str:
    """The first separating x and its side ("50 (above)", "60 (below)"), or "no"."""
    x = separates(points)
    if x is None:
        return "no"
    return f"{x} ({'above' if dict(points)[x]['lo'] > 0 else 'below'})"


def ablation_deltas(results: list[dict], group: str, keys=("acc_t1", "pass@16")) -> dict:
    """{ablation row: {key: ci95 of (ablation - the row it ablates)}}, paired by seed: what removing or
    changing one part costs. An ablation row is named "<row> + <ablation>" (plan_ablations)."""
    by = {(r["row"], r["seed"]): r for r in results if r["group"] == group and r["steps"]}
    out = {}
    for row in dict.fromkeys(row for row, _ in by if " + " in row):
        base = row.split(" + ")[0]
        pairs = [(by[(row, seed)], by[(base, seed)]) for r, seed in by if r == row and (base, seed) in by]
        out[row] = {k: common.ci95([common.value(a, k) - common.value(b, k) for a, b in pairs]) for k in keys}
    return out


def block_means(results: list[dict], group: str, key: str) -> dict:
    """{row: [mean over seeds of the per-step curve averaged over each BLOCK of steps]}."""
    out = {}
    for row in dict.fromkeys(r["row"] for r in results if r["group"] == group and r["steps"]):
        ys = [r["train"]["curve"][key] for r in results if r["group"] == group and r["row"] == row]
        n = min(len(y) for y in ys)
        out[row] = [common.mean([common.mean(y[i:i + BLOCK]) for y in ys]) for i in range(0, n, BLOCK)]
    return out


def _diff(a: float | None, b: float | None) -> float | None:
    """a - b, None when either is missing (a step with no correct rollout has no style entropy)."""
    return None if a is None or b is None else a - b


def summarize(results: list[dict], groups: list[str]) -> dict:
    keys = ["acc_t1", "pass@4", "pass@16", "div_score", "frac_all_fail", "reward_last5", "rectified_all_fail"]
    out = {}
    for group in groups:
        evals = paired_curve(results, group, "eval_acc")
        rewards = paired_curve(results, group, "reward", BLOCK)
        reps = {}
        for row in dict.fromkeys(r["row"] for r in results if r["group"] == group and r.get("repairs") and r["row"] != "grpo"):
            rr = [r["repairs"] for r in results if r["group"] == group and r["row"] == row]
            reps[row] = {"per_run": float(np.mean([x["accepted"] for x in rr])),
                         "per_block": np.mean([x["per_block"] for x in rr], 0).tolist(),
                         "in_all_fail_groups": common.mean([x["in_all_fail_groups"] for x in rr]),
                         "cut_relative_hist": np.sum([x["cut_relative_hist"] for x in rr], 0).tolist()}
        out[group] = {"starting_all_fail": starting_all_fail(results, group),
                      "seeds": sorted({r["seed"] for r in results if r["group"] == group and r["steps"]}),
                      "final": common.paired(results, group, keys),
                      "eval_curve": evals, "reward_blocks": rewards,
                      "separates_eval": {row: separates(p) for row, p in evals.items()},
                      "separates_reward": {row: separates(p) for row, p in rewards.items()},
                      "all_fail_blocks": block_means(results, group, "all_fail"),
                      "reward_block_means": block_means(results, group, "reward"), "repairs": reps,
                      "ablations": ablation_deltas(results, group)}
    return out


# ---------------------------------------------------------------- figures and tables

def plot_map(summary: dict, out: str) -> None:
    """Δ(row − GRPO) of the final acc at T = 1.0 against the start's all-fail share, 95 % intervals; the map's
    rows only (the ablations, on some starts, are in the tables)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    labels = list(dict.fromkeys(row for s in summary.values() for row in s["final"] if " + " not in row))
    for i, row in enumerate(labels):
        xs, ys, lo, hi = [], [], [], []
        for s in summary.values():
            c = s["final"].get(row, {}).get("acc_t1")
            if c is None or c["mean"] is None or s["starting_all_fail"] is None:
                continue
            xs.append(s["starting_all_fail"] + 0.006 * (i - (len(labels) - 1) / 2))
            ys.append(c["mean"])
            lo.append(c["mean"] - (c["lo"] if c["lo"] is not None else c["mean"]))
            hi.append((c["hi"] if c["hi"] is not None else c["mean"]) - c["mean"])
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o-", capsize=3, lw=1, ms=4, label=row, color=f"C{i + 1}")
    for s in summary.values():   # seeds behind each start's points
        if s["starting_all_fail"] is not None and s["final"]:
            ax.annotate(f"n = {len(s['seeds'])}", (s["starting_all_fail"], 0), textcoords="offset points",
                        xytext=(0, -14), ha="center", fontsize=7, color="grey")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xlabel("all-fail share of GRPO's G = 8 groups at the start (first 3 steps)")
    ax.set_ylabel("Δ held-out acc at T = 1.0 vs GRPO")
    ax.set_title("toy world: SCOPE − GRPO after training, paired by seed, 95 % intervals", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def plot_curves(results: list[dict], summary: dict, out: str) -> None:
    """Per start: held-out acc during training (mean ± sd over seeds) and the paired Δ training reward per block."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(summary)
    fig, axes = plt.subplots(2, len(groups), figsize=(4.6 * len(groups), 7), squeeze=False)
    labels = list(dict.fromkeys(r["row"] for r in results if r["steps"]))
    colors = {row: f"C{i}" for i, row in enumerate(labels)}
    for col, group in enumerate(groups):
        top, bottom = axes[0][col], axes[1][col]
        for row, (x, m, sd) in common.curves(results, group, "eval_acc").items():
            top.plot(x, m, color=colors[row], label=row, lw=1.5)
            top.fill_between(x, m - sd, m + sd, color=colors[row], alpha=0.15, lw=0)
        for row, points in summary[group]["reward_blocks"].items():
            x = [p[0] for p in points]
            m = np.array([p[1]["mean"] for p in points], dtype=float)
            lo = np.array([p[1]["lo"] if p[1]["lo"] is not None else p[1]["mean"] for p in points], dtype=float)
            hi = np.array([p[1]["hi"] if p[1]["hi"] is not None else p[1]["mean"] for p in points], dtype=float)
            bottom.plot(x, m, "o-", color=colors[row], label=row, lw=1.2, ms=3)
            bottom.fill_between(x, lo, hi, color=colors[row], alpha=0.15, lw=0)
        bottom.axhline(0, color="k", lw=0.8)
        share = summary[group]["starting_all_fail"]
        top.set_title(f"{group} (start all-fail {share:.2f}): held-out acc, T = 0.6" if share is not None else group,
                      fontsize=9)
        bottom.set_title(f"{group}: Δ training reward vs grpo per {BLOCK} steps, 95 % CI", fontsize=9)
        for ax in (top, bottom):
            ax.set_xlabel("step", fontsize=8)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    fig.suptitle("top: mean ± 1 sd across seeds; bottom: paired by seed", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def run_minutes(results: list[dict]) -> float:
    """Sum of the runs' recorded wall times (training with its evals + final eval), minutes."""
    return sum(r["wall_s"]["train"] + r["wall_s"]["eval"] for r in results) / 60


def report(results: list[dict], summary: dict, args, wall_minutes: float, command: str) -> str:
    f3 = lambda x: "–" if x is None else f"{x:.3f}"   # noqa: E731
    md = ["# Toy world: the regime map\n", f"Command: `{command}`  \nWall time: {wall_minutes:.1f} min "
          f"({args.jobs} jobs at once; finished runs are read from their records).  \nEach run: "
          f"{args.regime_steps} steps of `scope.py --toy` (8 prompts x 8 rollouts); final eval on {args.eval_size} "
          f"held-out problems of its task, {args.eval_n} samples at T = 1.0. Seeds per cell: see the tables.  \n"
          f"Runs in this report: {sum(1 for r in results if r['steps'])} of the {args.planned_runs} planned; their "
          f"own wall time (training + final eval, as recorded): {run_minutes(results):.0f} min.\n",
          "## Δ to GRPO at the end (paired by seed, mean [95 % interval])\n",
          "| start | all-fail at start | row | seeds | Δ acc T=1.0 | Δ pass@16 | Δ train reward (last 5) | "
          "separates (eval step / reward block) |", "|---" * 8 + "|"]
    for group, s in summary.items():
        for row, d in s["final"].items():
            md.append(f"| {group.removeprefix('regime-')} | {f3(s['starting_all_fail'])} | {row} | "
                      f"{d['acc_t1']['n']} | {common.fmt_ci(d['acc_t1'])} | {common.fmt_ci(d['pass@16'])} | "
                      f"{common.fmt_ci(d['reward_last5'])} | {separation_label(s['eval_curve'].get(row, []))} / "
                      f"{separation_label(s['reward_blocks'].get(row, []))} |")
    md.append("")
    abl = [(group, row, d) for group, s in summary.items() for row, d in s.get("ablations", {}).items()]
    if abl:
        md += ["## Ablations: Δ to the row they ablate (paired by seed, mean [95 % interval])\n",
               "| start | ablation | seeds | Δ acc T=1.0 | Δ pass@16 |", "|---" * 5 + "|"]
        md += [f"| {group.removeprefix('regime-')} | {row} | {d['acc_t1']['n']} | {common.fmt_ci(d['acc_t1'])} | "
               f"{common.fmt_ci(d['pass@16'])} |" for group, row, d in abl]
        md.append("")
    for group, s in summary.items():
        md += common.tables(results, group, f"{group}: every row (mean ± sd over seeds)")
        md += [f"All-fail share of the policy's own groups, mean over seeds, per {BLOCK} steps:\n",
               "| row | " + " | ".join(f"{i * BLOCK + 1}-{(i + 1) * BLOCK}" for i in range(math.ceil(args.regime_steps / BLOCK)))
               + " |", "|---" * (1 + math.ceil(args.regime_steps / BLOCK)) + "|"]
        md += [f"| {row} | " + " | ".join(f3(v) for v in vals) + " |" for row, vals in s["all_fail_blocks"].items()]
        if s["repairs"]:
            md += ["", f"Where the repairs fell (accepted per run, per {BLOCK} steps; share in all-fail groups; "
                   "cut position = first wrong step / steps, 5 bins, all runs):\n",
                   "| row | per run | per block | in all-fail groups | cut position hist |", "|---" * 5 + "|"]
            md += [f"| {row} | {x['per_run']:.1f} | {' / '.join(f'{v:.1f}' for v in x['per_block'])} | "
                   f"{f3(x['in_all_fail_groups'])} | {x['cut_relative_hist']} |" for row, x in s["repairs"].items()]
        md.append("")
    return "\n".join(md)


def write(results: list[dict], summary: dict, args, wall_minutes: float) -> str:
    command = common.typed(["--stage", args.stage])
    text = report(results, summary, args, wall_minutes, command)
    with open(os.path.join(args.out, f"{args.stage}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, f"{args.stage}.json"), "w") as f:
        json.dump({"command": command, "wall_minutes": round(wall_minutes, 2),
                   "run_minutes": round(run_minutes(results), 1),
                   "settings": {k: v for k, v in vars(args).items() if k not in ("seed_list", "long_seed_list", "grid_rows")},
                   "starts": {k: {"start": v[0], "task": v[1]} for k, v in STARTS.items()},
                   "summary": summary, "environment": common.environment(), "runs": results}, f, indent=1)
    plot_map(summary, os.path.join(args.out, "regime.png"))
    plot_curves(results, summary, os.path.join(args.out, "regime_curves.png"))
    return text


def main(args) -> None:
    """--stage regime: the map, then the ablations of the starts where a SCOPE row separates."""
    from harness.data import toy

    t0 = time.time()
    args.eval_n_cool = 0   # choice 1: the final eval at T = 1.0 only
    args.train_eval_size = args.regime_eval_size
    starts = [s.strip() for s in args.regime_starts.split(",") if s.strip()]
    unknown = [row for row in args.regime_rows.split(",") if row and row not in rows(args.regime_best)]
    if unknown or (args.regime_rows and "grpo" not in args.regime_rows.split(",")):
        raise SystemExit(f"--regime-rows: unknown {unknown} or no grpo; rows: {list(rows(args.regime_best))}")
    for settings, task in (STARTS[s] for s in starts):
        toy.warm_start(os.path.join(common.ROOT, "cache"), seed=0, **settings)   # shipped; trained here once if not
        common.problem_files(task, args, write=True)
    jobs = plan_regime(args, starts)
    args.planned_runs = sum(1 for j in jobs if j["steps"])
    print(f"regime map: {len(jobs) - len(starts)} runs of {args.regime_steps} steps on {starts}; {args.jobs} at a time",
          flush=True)
    results = run_all(jobs, args, t0)
    if args.regime_ablations != "none":
        extra = plan_ablations(args, results, starts)
        if extra:
            toy.refiner_model(os.path.join(common.ROOT, "cache"), seed=0)
            args.planned_runs += len(extra)
            print(f"ablations: {len(extra)} runs", flush=True)
            results += run_all(extra, args, t0)
    summary = summarize(results, [f"regime-{s}" for s in starts])
    print(write(results, summary, args, (time.time() - t0) / 60))
    print(f"wrote {args.out}/regime.md, regime.json, regime.png, regime_curves.png in {(time.time() - t0) / 60:.1f} min")


# ---------------------------------------------------------------- the diversity stage

DIVERSITY_ROWS = {"grpo": common.GRID["grpo"], "scope (paper): any/replace": common.GRID["scope any/replace"]}
STYLE_KEYS = ["style_entropy", "styles_per_problem", "style_other", "acc_t1", "pass@16", "div_score",
              "distinct_4", "one_minus_self_bleu"]


def plan_diversity(args) -> list[dict]:
    start = json.dumps({"styles": args.styles})
    jobs = [{"row": "warm start", "seed": 0, "group": "diversity", "steps": 0, "task": "", "flags": [],
             "start": start, "name": f"{args.tag}-diversity-start"}]
    for seed in args.seed_list:
        jobs += [common.job(row, seed, f"{flags} --toy-styles {args.styles}", args, group="diversity",
                             steps=args.diversity_steps, start=start, eval_every=args.regime_eval_every)
                 for row, flags in DIVERSITY_ROWS.items()]
    return jobs


def diversity_report(results: list[dict], args, wall_minutes: float, command: str) -> tuple[str, dict]:
    f3 = lambda x: "–" if x is None else f"{x:.3f}"   # noqa: E731
    final = common.paired(results, "diversity", STYLE_KEYS)
    entropy = paired_curve(results, "diversity", "style_entropy_correct", BLOCK)
    blocks = block_means(results, "diversity", "style_entropy_correct")
    md = ["# Toy world: diverse correct solutions\n", f"Command: `{command}`  \nWall time: {wall_minutes:.1f} min "
          f"({args.jobs} jobs at once; finished runs are read from their records).  \nThe warm start writes each "
          f"solution in one of {args.styles} styles (harness/data/toy.py STYLES); {args.diversity_steps} steps per run; "
          f"final eval on {args.eval_size} held-out problems x {args.eval_n} samples at T = 1.0. style entropy: of "
          f"the styles among the correct samples (nats; ln {args.styles} = {math.log(args.styles):.3f} when even).\n",
          "| row | seeds | " + " | ".join(STYLE_KEYS) + " | style shares |", "|---" * (len(STYLE_KEYS) + 3) + "|"]
    for row in dict.fromkeys(r["row"] for r in results if r["group"] == "diversity"):
        rs = [r for r in results if r["group"] == "diversity" and r["row"] == row]
        shares = [r["eval"]["style_share"] for r in rs if r["eval"].get("style_share")]
        share = " / ".join(f"{x:.2f}" for x in np.mean(shares, 0)) if shares else "–"
        md.append(f"| {row} | {len(rs)} | "
                  + " | ".join(common.mean_sd([common.value(r, k) for r in rs]) for k in STYLE_KEYS)
                  + f" | {share} |")
    md += ["", "Paired difference to grpo (same seed), mean [95 % interval]:\n",
           "| row | " + " | ".join(STYLE_KEYS) + " |", "|---" * (len(STYLE_KEYS) + 1) + "|"]
    md += [f"| {row} | " + " | ".join(common.fmt_ci(d[k]) for k in STYLE_KEYS) + " |" for row, d in final.items()]
    md += ["", f"Style entropy of the policy's own correct rollouts during training, mean over seeds per {BLOCK} "
           "steps (and the paired Δ of SCOPE to GRPO):\n"]
    for row, vals in blocks.items():
        md.append(f"- {row}: " + " / ".join(f3(v) for v in vals))
    for row, points in entropy.items():
        md.append(f"- Δ {row}: " + " / ".join(common.fmt_ci(c) for _, c in points))
    return "\n".join(md) + "\n", {"final": final, "entropy_blocks": blocks, "entropy_paired": entropy}


def plot_diversity(results: list[dict], out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, row in enumerate(DIVERSITY_ROWS):
        rs = [r for r in results if r["group"] == "diversity" and r["row"] == row and r["steps"]]
        if not rs:
            continue
        curves = [[np.nan if v is None else v for v in r["train"]["curve"]["style_entropy_correct"]] for r in rs]
        n = min(len(c) for c in curves)
        ys = np.array([c[:n] for c in curves], dtype=float)
        m = np.array([np.nanmean(ys[:, max(0, t - 4):t + 1]) for t in range(n)])   # trailing 5-step mean
        x = np.arange(1, n + 1)
        axes[0].plot(x, m, color=f"C{i}", label=row)
        sd = np.array([np.nanstd(ys[:, max(0, t - 4):t + 1].mean(1)) for t in range(n)])
        axes[0].fill_between(x, m - sd, m + sd, color=f"C{i}", alpha=0.15, lw=0)
        shares = np.mean([r["eval"]["style_share"] for r in rs if r["eval"].get("style_share")], 0)
        axes[1].bar(np.arange(len(shares)) + 0.4 * i, shares, width=0.4, color=f"C{i}", label=row)
    axes[0].set_title("style entropy of the correct rollouts (5-step mean; band ± 1 sd over seeds)", fontsize=8)
    axes[0].set_xlabel("step")
    axes[1].set_title("final policy: share of each style among correct samples (T = 1.0)", fontsize=8)
    axes[1].set_xlabel("style")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def diversity_main(args) -> None:
    """--stage diversity: GRPO vs SCOPE from the warm start with --styles solution styles."""
    import shlex

    from harness.data import toy

    t0 = time.time()
    args.eval_n_cool = 0
    args.train_eval_size = args.regime_eval_size
    toy.warm_start(os.path.join(common.ROOT, "cache"), seed=0, styles=args.styles)   # shipped; trained here if not
    jobs = plan_diversity(args)
    print(f"diversity: {len(jobs) - 1} runs of {args.diversity_steps} steps, {args.styles} styles", flush=True)
    results = run_all(jobs, args, t0)
    command = shlex.join(["python", "-m", "tools.studies", "--stage", "diversity"])
    text, summary = diversity_report(results, args, (time.time() - t0) / 60, command)
    with open(os.path.join(args.out, "diversity.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "diversity.json"), "w") as f:
        json.dump({"command": command, "wall_minutes": round((time.time() - t0) / 60, 2),
                   "settings": {k: v for k, v in vars(args).items() if k not in ("seed_list", "long_seed_list", "grid_rows")},
                   "summary": summary, "environment": common.environment(), "runs": results}, f, indent=1)
    plot_diversity(results, os.path.join(args.out, "diversity.png"))
    print(text + f"wrote {args.out}/diversity.md, diversity.json, diversity.png in {(time.time() - t0) / 60:.1f} min")
