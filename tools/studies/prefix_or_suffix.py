"""prefix_or_suffix.py — which part of a repair teaches: the policy's own kept prefix or the refiner's suffix?

Not part of the paper's code. The follow-up of tools/studies/content_or_mean_shift.py, pre-registered in
docs/because3-preregistration.md (cells, seeds, contrasts, margin, reading rules; this module computes exactly
those). From the weak-ladder start with the regime map's settings, seeds 0-12:
  P  prefix credit only (--repair-credit prefix): the accepted repair keeps its reward and advantage, its
     refiner tokens carry no loss;
  S  suffix credit only (--repair-credit suffix): its kept prefix's tokens carry no loss;
paired with the recorded SCOPE-in-style, phantom and GRPO runs of the regime map, the because stage and
because2 (read, not rerun). Each run keeps a checkpoint every 25 steps and records T, pi of a fixed set of
repairs followed from one checkpoint onward (`tracking`). Then, exploratory: the SCOPE-in-style runs of
seeds 5-12 retrained with their recorded commands, for T on the method itself and as a reproduction check.

    python -m tools.studies.prefix_or_suffix --out /path/to/results/toy   # train what is not recorded (2 at a time)
    python -m tools.studies.prefix_or_suffix --records-only               # the report (results/toy/because3.md)

A record is written once (never replaced); a record that holds another command stops the study. Training
refuses a dirty tree: the records' commit is the code that made them. Every record holds its command, eval
settings, result and harness.run.runs.environment().
"""
import argparse
import json
import os
import sys
import time

import numpy as np

from tools.studies import content_or_mean_shift, why_it_helps
from tools.studies import common, where_it_helps
from tools.studies import when_it_helps

STAGE = "because3"
SEEDS = tuple(range(13))
RETRAIN_SEEDS = tuple(range(5, 13))   # the because2 SCOPE-in-style runs retrained for T
PREFIX, SUFFIX = "prefix-credit", "suffix-credit"
KEEP, PHANTOM, GRPO = content_or_mean_shift.KEEP, content_or_mean_shift.PHANTOM, content_or_mean_shift.GRPO
SCOPE_FLAGS = common.GRID["scope any/replace"]
ROWS = {PREFIX: f"{SCOPE_FLAGS} --repair-credit prefix", SUFFIX: f"{SCOPE_FLAGS} --repair-credit suffix"}
ORIGINS = (0, 25, 50)                 # T: a fixed set of repairs (steps o+1 .. o+5) from the checkpoint of step o
CHECKPOINTS = (0, 25, 50, 75, 100)
MARGIN = content_or_mean_shift.MARGIN
CONTRASTS = {   # name: ({row: coefficient}, primary); every one paired by seed over seeds 0-12
    "prefix-only − SCOPE in style": ({PREFIX: 1, KEEP: -1}, True),
    "suffix-only − SCOPE in style": ({SUFFIX: 1, KEEP: -1}, True),
    "prefix-only − phantom": ({PREFIX: 1, PHANTOM: -1}, True),
    "suffix-only − phantom": ({SUFFIX: 1, PHANTOM: -1}, False),
    "prefix-only − suffix-only": ({PREFIX: 1, SUFFIX: -1}, False),
    "interaction SCOPE − prefix-only − suffix-only + phantom": ({KEEP: 1, PREFIX: -1, SUFFIX: -1, PHANTOM: 1}, False),
    "phantom − GRPO (the mean shift)": ({PHANTOM: 1, GRPO: -1}, False),
    "SCOPE in style − GRPO": ({KEEP: 1, GRPO: -1}, False),
}


# ---------------------------------------------------------------- the plan and its records

def plan(args) -> list[dict]:
    """Per seed, prefix-only then suffix-only (a study stopped early holds whole pairs), then the retrained
    SCOPE-in-style runs (exactly because2's jobs and commands)."""
    settings, task = when_it_helps.STARTS[content_or_mean_shift.WEAK]
    jobs = []
    for seed in SEEDS:
        for row, flags in ROWS.items():
            j = common.job(row, seed, flags, args, group=content_or_mean_shift.GROUP, steps=args.regime_steps, task=task,
                            start=json.dumps(settings), eval_every=args.regime_eval_every)
            jobs.append({**j, "kind": "run", "wrap": "keep-checkpoints"})
    return jobs + [{**content_or_mean_shift.job(KEEP, seed, args), "kind": "retrain"} for seed in RETRAIN_SEEDS]


def record_path(j: dict, args) -> str:
    return os.path.join(args.out, STAGE, "records" if j["kind"] == "run" else "retrained", j["name"] + ".json")


def recorded(j: dict, args) -> dict | None:
    """The job's recorded result, None when there is no record; a record of another command or other eval
    settings is an error (records are never replaced)."""
    old = common.read_json(record_path(j, args))
    if old is None:
        return None
    cmd, settings = content_or_mean_shift.record_key(j, args)
    if common.as_now(old["command"]) != cmd or old["eval_settings"] != settings:
        raise SystemExit(f"prefix_or_suffix: {record_path(j, args)} holds another command or eval settings; "
                         "records are never replaced (move it away by hand)")
    return old["result"]


def run_one(j: dict, args) -> dict:
    """Train, evaluate and record one job (in a worker); a dirty tree is refused before any training."""
    import torch

    os.chdir(common.ROOT)
    torch.set_num_threads(1)
    env = clean_environment()
    t0 = time.time()
    content_or_mean_shift.train(j, args)
    t1 = time.time()
    run_dir = os.path.join("runs", j["name"])
    ev = common.evaluate_policy(os.path.join(run_dir, "checkpoint"), j["task"], args, common.eval_styles(j, args))
    r = {**{k: v for k, v in j.items() if k != "kind"}, "eval": ev, "train": common.training_stats(run_dir),
         "repairs": when_it_helps.repairs_of(run_dir, j["steps"]), "tracking": tracking(run_dir, common.start_path(j, args)),
         "wall_s": {"train": round(t1 - t0, 1), "eval": round(time.time() - t1, 1)}}
    cmd, settings = content_or_mean_shift.record_key(j, args)
    os.makedirs(os.path.dirname(record_path(j, args)), exist_ok=True)
    with open(record_path(j, args), "x") as f:   # "x": an existing record is never overwritten
        json.dump({"command": cmd, "start": j["start"], "eval_settings": settings, "environment": env,
                   "result": r}, f)
    return r


def clean_environment() -> dict:
    """harness.run.runs.environment(), or a one-line error when the tree is not exactly its commit."""
    from harness.run.runs import environment

    env = environment()
    if env["dirty"] is not False:
        raise RuntimeError(f"prefix_or_suffix: the tree at {common.ROOT} differs from commit {env['commit']} "
                           f"({', '.join(env['changed']) or 'git status failed'}); commit, or run from a clean worktree")
    return env


# ---------------------------------------------------------------- T: a fixed set of repairs through training

def tracking(run_dir: str, start_path: str) -> dict:
    """For each origin o in ORIGINS, the accepted repairs of steps o+1 .. o+5 (a fixed set) teacher-forced
    under every kept checkpoint from o on: mean π of their kept, regenerated and corrected tokens.
    {origin: {checkpoint: {...}}}; a checkpoint not kept is left out."""
    from harness.engines.generate import load_causal_lm

    traces = [json.loads(line) for line in open(os.path.join(run_dir, "traces.jsonl"))]
    sets = {o: [t for t in traces if t["accepted"] and o < t["step"] <= o + content_or_mean_shift.TRACK_WINDOW] for o in ORIGINS}
    out = {str(o): {} for o in ORIGINS}
    for c in CHECKPOINTS:
        path = start_path if c == 0 else os.path.join(run_dir, "checkpoints", f"step-{c}")
        if not os.path.isdir(path):
            continue
        model, tok = load_causal_lm(path, "cpu")
        model.eval()
        for o in (o for o in ORIGINS if o <= c):
            out[str(o)][str(c)] = token_pi(model, tok, sets[o])
    return out


def token_pi(model, tokenizer, repairs: list[dict]) -> dict:
    """Mean π of the repairs' kept tokens, regenerated tokens and corrected tokens under `model`."""
    kept, regen, corrected = [], [], []
    for t in repairs:
        pi, n_kept, c = common.repair_token_probs(model, tokenizer, t)
        kept += pi[:n_kept]
        regen += pi[n_kept:]
        if c is not None and c < len(pi) - n_kept:
            corrected.append(pi[n_kept + c])
    return {"repairs": len(repairs), "corrected_tokens": len(corrected), "kept_pi": common.mean(kept),
            "regenerated_pi": common.mean(regen), "corrected_pi": common.mean(corrected)}


# ---------------------------------------------------------------- statistics (pure) and the report

def leave_one_out(per_seed: dict) -> list[str]:
    """The reading rule's verdict with each seed left out in turn."""
    return [content_or_mean_shift.verdict(content_or_mean_shift.t_interval([v for t, v in per_seed.items() if t != s]), len(per_seed) - 1)
            for s in per_seed]


def contrasts(results: list[dict]) -> dict:
    out = {}
    for name, (coefs, primary) in CONTRASTS.items():
        rs = [r for r in results if r["seed"] in SEEDS]
        by = why_it_helps.contrast_by_seed(rs, content_or_mean_shift.GROUP, coefs)
        c = content_or_mean_shift.t_interval(list(by.values()))
        row = {"seeds": sorted(by), "per_seed": by, "t": c, "p": why_it_helps.paired_p(list(by.values())),
               "verdict": content_or_mean_shift.verdict(c, len(SEEDS)), "primary": primary, "leave_one_out": leave_one_out(by)}
        if len(by) >= 2:
            D = why_it_helps.per_problem_matrix(rs, content_or_mean_shift.GROUP, coefs, sorted(by))
            row["bootstrap"] = why_it_helps.seed_problem_bootstrap(D, content_or_mean_shift.BOOT_DRAWS) if D is not None else None
        out[name] = row
    primaries = [n for n in out if out[n]["primary"] and out[n]["p"] is not None]
    for n, adjusted in zip(primaries, holm([out[n]["p"] for n in primaries])):
        out[n]["p_holm"] = adjusted
    return out


def holm(ps: list[float]) -> list[float]:
    """Holm's step-down adjustment of p-values (family-wise error over the list), in the given order."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    out, running = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        out[i] = running
    return out


def reading(con: dict) -> str:
    """The pre-registered answer from the three primaries (docs/because3-preregistration.md): "drops less than
    the margin" = a t-interval whose lower end is above −MARGIN; "costs" = one whose upper end is below 0."""
    p_scope, s_scope, p_phantom = (con[n]["t"] for n in ("prefix-only − SCOPE in style",
                                                         "suffix-only − SCOPE in style", "prefix-only − phantom"))
    if any(c["lo"] is None or c["n"] < len(SEEDS) for c in (p_scope, s_scope, p_phantom)):
        return "partial: no reading"
    costs = lambda c: c["hi"] < 0  # noqa: E731
    within = lambda c: c["lo"] > -MARGIN  # noqa: E731
    if costs(p_scope) and costs(s_scope):
        return "both parts add to the gain (dropping either one's loss costs accuracy)"
    if within(p_scope) and p_phantom["lo"] > 0:
        return ("the kept prefix's credit carries the gain (alone it beats the phantom; dropping the suffix's loss "
                "costs less than the margin)")
    if within(s_scope) and costs(p_scope):
        return ("the refiner suffix's credit carries the gain (dropping it costs accuracy; dropping the prefix's "
                "loss costs less than the margin)")
    return "the toy cannot tell which part carries the gain"


def tracking_table(runs: list[dict]) -> list[str]:
    f = lambda c: common.fmt_ci(c) if c["lo"] is not None else ("–" if c["mean"] is None else f"{c['mean']:+.3f}")  # noqa: E731
    md = ["| cell | origin | checkpoint | runs | kept π | regenerated π | corrected π (mean [t-interval], SD) | "
          "corrected π − its value at the origin |", "|---" * 8 + "|"]
    for row in (PREFIX, SUFFIX, KEEP):
        track = [r["tracking"] for r in runs if r["row"] == row and r.get("tracking")]
        for o in map(str, ORIGINS):
            for c in map(str, CHECKPOINTS):
                xs = [t[o][c] for t in track if c in t.get(o, {})]
                if not xs:
                    continue
                corr = [x["corrected_pi"] for x in xs if x["corrected_pi"] is not None]
                rise = [t[o][c]["corrected_pi"] - t[o][o]["corrected_pi"] for t in track if c in t.get(o, {})
                        and o in t[o] and t[o][c]["corrected_pi"] is not None and t[o][o]["corrected_pi"] is not None]
                sd = f"{np.std(corr, ddof=1):.3f}" if len(corr) > 1 else "–"
                md.append(f"| {row} | {o} | {c} | {len(xs)} | " + " | ".join(
                    f(content_or_mean_shift.t_interval([x[k] for x in xs])) for k in ("kept_pi", "regenerated_pi")) +
                    f" | {f(content_or_mean_shift.t_interval(corr))}, SD {sd} | {f(content_or_mean_shift.t_interval(rise))} |")
    return md


def report(new: list[dict], retrained: list[dict], args, planned: int) -> tuple[str, dict]:
    results = new + content_or_mean_shift.read_references(args) + read_because2(args)
    con = contrasts(results)
    md = [f"# Which part of a repair teaches? ({len(new)} of {planned} runs recorded, "
          f"{len(retrained)} of {len(RETRAIN_SEEDS)} SCOPE-in-style runs retrained)\n",
          "Pre-registration: docs/because3-preregistration.md. Command: `python -m tools.studies.prefix_or_suffix --records-only`. "
          f"Run time of the recorded runs (training + final eval, their own): {when_it_helps.run_minutes(new):.0f} min.\n",
          f"**Reading (pre-registered rule): {reading(con)}.**\n",
          "## Contrasts (acc at T = 1.0, paired by seed; t-interval decides, seed × problem bootstrap checks)\n",
          "| contrast | seeds | mean [95 % t-interval] | p | bootstrap 95 % | reading | verdicts, one seed left out |",
          "|---" * 7 + "|"]
    for name, c in con.items():
        b, p, adj = c.get("bootstrap"), c["p"], c.get("p_holm")
        boot = f"[{b['lo']:+.3f}, {b['hi']:+.3f}]" if b else "–"
        pval = "–" if p is None else f"{p:.3f}" + ("" if adj is None else f" (Holm {adj:.3f})")
        loo = ", ".join(f"{v} ×{c['leave_one_out'].count(v)}" for v in sorted(set(c["leave_one_out"])))
        md.append(f"| {'**' + name + '**' if c['primary'] else name} | {len(c['seeds'])} | {common.fmt_ci(c['t'])} | "
                  f"{pval} | {boot} | {c['verdict']} | {loo} |")
    md += ["", "## Runs (acc at T = 1.0 per seed)\n", "| row | " + " | ".join(f"s{s}" for s in SEEDS) + " |",
           "|---" * 14 + "|"]
    for row in (GRPO, PHANTOM, KEEP, PREFIX, SUFFIX):
        by = {r["seed"]: r["eval"]["acc_t1"] for r in results if r["row"] == row}
        md.append(f"| {row} | " + " | ".join(f"{by[s]:.3f}" if s in by else "" for s in SEEDS) + " |")
    recorded_keep = {r["seed"]: r["eval"]["acc_t1"] for r in results if r["row"] == KEEP}
    same = [r["seed"] for r in retrained if r["eval"]["acc_t1"] == recorded_keep.get(r["seed"])]
    if retrained:
        md.append(f"\nRetrained SCOPE-in-style runs equal to their because2 records (acc at T = 1.0): "
                  f"{len(same)} of {len(retrained)} (seeds {same}).")
    md += ["", "## T: π of a fixed set of repairs (steps o+1 … o+5) under the checkpoints from o on (exploratory)\n",
           *tracking_table(new + retrained)]
    summary = {"contrasts": con, "reading": reading(con), "runs_recorded": len(new), "planned": planned,
               "retrained_equal": same}
    return "\n".join(md) + "\n", summary


def read_because2(args) -> list[dict]:
    """because2's recorded GRPO, SCOPE-in-style and phantom runs of seeds 5-12."""
    out = []
    for row in (GRPO, KEEP, PHANTOM):
        for seed in content_or_mean_shift.NEW_SEEDS:
            rec = common.read_json(os.path.join(args.out, content_or_mean_shift.STAGE, "records",
                                                 content_or_mean_shift.job(row, seed, args)["name"] + ".json"))
            if rec is not None:
                out.append(rec["result"])
    return out


# ---------------------------------------------------------------- the runner

def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records-only", action="store_true", help="report from the records; train nothing")
    p.add_argument("--jobs", type=int, default=2, help="processes at once")
    p.add_argument("--out", default="results/toy", help="the results folder (records are read from and written to it)")
    a = p.parse_args(argv)
    out = os.path.abspath(a.out)
    args = where_it_helps.parse_args(["--out", out, "--jobs", str(a.jobs)])
    args.stage, args.eval_n_cool, args.train_eval_size = STAGE, 0, args.regime_eval_size   # the regime map's settings
    os.chdir(common.ROOT)
    t0 = time.time()
    jobs = plan(args)
    if not a.records_only:
        from harness.data import toy
        toy.warm_start(os.path.join(common.ROOT, "cache"), seed=0, **when_it_helps.STARTS[content_or_mean_shift.WEAK][0])
        todo = [j for j in jobs if recorded(j, args) is None]
        try:
            env = clean_environment()
        except RuntimeError as e:
            raise SystemExit(str(e)) from None
        print(f"prefix_or_suffix: {len(jobs)} jobs, {len(jobs) - len(todo)} recorded, {len(todo)} to run, commit "
              f"{env['commit']}, CPU {env['cpu']} ({env['cpu_capability']})", flush=True)
        common.run_all(todo, args, t0, worker=run_one)
    done = [{**j, "result": r} for j in jobs if (r := recorded(j, args)) is not None]
    new = [d["result"] for d in done if d["kind"] == "run"]
    retrained = [d["result"] for d in done if d["kind"] == "retrain"]
    text, summary = report(new, retrained, args, sum(j["kind"] == "run" for j in jobs))
    with open(os.path.join(out, f"{STAGE}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, f"{STAGE}.json"), "w") as f:
        json.dump({"command": "python -m tools.studies.prefix_or_suffix --records-only", "summary": summary}, f, indent=1)
    print(text, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
