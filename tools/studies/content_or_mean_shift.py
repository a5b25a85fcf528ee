"""content_or_mean_shift.py — does the repair's content matter, or only the shift of an all-fail group's mean?

Not part of the paper's code. The follow-up of the because stage (tools/studies/why_it_helps.py), pre-registered in
docs/because2-preregistration.md (cells, seeds, contrasts, margins, reading rules; this module computes exactly
those). From the weak-ladder start with the regime map's settings:
  K2'  GRPO, SCOPE in style (the paper's row) and the phantom repair (--repair-advantage zero), seeds 5-12,
       paired with the recorded seeds 0-4: phantom - SCOPE against a +-0.02 margin;
  D    the same-dose control, seeds 0-4: keep-foreign's repairs with their whole text credited as the
       refiner's (a whole replacement whose first kappa steps are the oracle's in-style text, the rest foreign);
  M    the step-1 gradient split into the failures' part, the kept prefix, the regenerated suffix and the
       rest, each applied alone, and its effect on log pi of correct solutions (no training);
  T    pi of kept vs regenerated tokens through training, from the SCOPE runs' checkpoints every 25 steps.

    python -m tools.studies.content_or_mean_shift                  # everything, resumed from its records (2 at a time)
    python -m tools.studies.content_or_mean_shift --records-only   # the report from the records (results/toy/because2.md)

Every record (results/toy/because2/records/<run>.json, mechanism.json) holds its command, its eval settings,
the result and harness.run.runs.environment(). Ctrl-C or SIGTERM stops the workers and their scope.py runs.

The same-dose cells and the checkpoints of T need two things scope.py has no flag for; `scope_run` runs
scope.py's own main with them added from outside (`python -m tools.studies.content_or_mean_shift --scope-run ...`):
  --same-dose         scope.rectify (step 5) is wrapped: each accepted prefix-keeping repair gets offpolicy_mask 1 on
                      every token and source "replaced" (whole-replacement credit), its first kappa steps being
                      the oracle's style-0 text of those steps (the policy's own text where they are equal,
                      which in this world is expected: a correct step is one fixed string; counted in
                      runs/<run>/same_dose.json);
  --keep-checkpoints  each checkpoint is also copied to runs/<run>/checkpoints/step-<n>.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

import numpy as np

from tools.studies import why_it_helps
from tools.studies import common, where_it_helps
from tools.studies import when_it_helps

STAGE = "because2"
WEAK = "weak-ladder"
GROUP = f"regime-{WEAK}"
NEW_SEEDS = tuple(range(5, 13))     # K2' cells
DOSE_SEEDS = tuple(range(0, 5))     # the same-dose control, paired with keep-foreign's recorded seeds
OLD_SEEDS = tuple(range(0, 5))      # the recorded seeds of the regime map and the because stage
KEEP, PHANTOM, DOSE = "scope (paper): any/replace", "keep-in-style-phantom", "same-dose"
FOREIGN, WHOLE_FOREIGN, GRPO, WHOLE = "keep-foreign", "whole-foreign", "grpo", "replace (whole)"
ROWS = {   # label: (scope.py flags, wrapper option or None); labels as in the recorded runs they pair with
    GRPO: (common.GRID["grpo"], None),
    KEEP: (common.GRID["scope any/replace"], "keep-checkpoints"),
    PHANTOM: (f"{common.GRID['scope any/replace']} --repair-advantage zero", None),
    DOSE: (f"{common.GRID['scope any/replace']} --toy-refiner-style 1", "same-dose"),
}
KEEP_EVERY = 25                      # T: a checkpoint copy every 25 steps
TRACK_WINDOW = 5                     # T: the repairs of steps t+1 .. t+5 under the checkpoint of step t
MARGIN = 0.02
MECH_PROBLEMS = 200
BOOT_DRAWS = 4000
RUN_TIMEOUT_S = 4 * 3600             # one run's bound (under heavy load a run took 25 min)
REFERENCES = {   # (row, folder of its records, file slug) of the recorded seeds 0-4
    GRPO: ("regime", "grpo"), KEEP: ("regime", "scope-paper--any-replace"), WHOLE: ("regime", "replace-whole"),
    PHANTOM: ("because", "keep-in-style-phantom"), FOREIGN: ("because", "keep-foreign"),
    WHOLE_FOREIGN: ("because", "whole-foreign"),
}


# ---------------------------------------------------------------- scope.py with the two study hooks

def same_dose_credit(t, tokenizer):
    """An accepted prefix-keeping repair re-credited as a whole replacement: every token marked as the
    refiner's, its kept steps replaced by the oracle's style-0 text of the same steps when they differ.
    Returns (new trajectory, whether the kept text already equalled the oracle's)."""
    from dataclasses import replace

    from harness.data import toy

    prefix = t.response_ids[:t.prefix_len]
    prefix_text = tokenizer.decode(prefix, skip_special_tokens=True)
    start, ops = toy.parse_question(t.question)
    done = [m for m in toy.ITEM_RE.finditer(prefix_text) if m["v"] is None]
    body = prefix_text.rstrip("\n")
    oracle = toy.STEP_SEP.join(toy._chain_steps(start, ops, style=0)[:len(done)]) + prefix_text[len(body):]
    equal = oracle == prefix_text
    ids = list(t.response_ids) if equal else tokenizer.encode(oracle, add_special_tokens=False) + \
        list(t.response_ids[t.prefix_len:])
    text = t.text if equal else tokenizer.decode(ids, skip_special_tokens=True)
    return replace(t, response_ids=ids, text=text, offpolicy_mask=[1] * len(ids), source="replaced",
                   sampler_logp=None), equal


def with_same_dose(rectify, counts: dict):
    """refine.rectify, its accepted prefix-keeping repairs re-credited (`same_dose_credit`); `counts` gathers
    {"repairs", "prefix_equal"}."""
    def wrapped(trajs, picks, refiner, tokenizer, **kw):
        merged, traces = rectify(trajs, picks, refiner, tokenizer, **kw)
        out = []
        for t in merged:
            if t.source == "rectified":
                t, equal = same_dose_credit(t, tokenizer)
                counts["repairs"] += 1
                counts["prefix_equal"] += int(equal)
            out.append(t)
        for tr in traces:
            if tr["accepted"] and tr["mode"] == "scope":
                tr["mode"] = "replace"   # trained as a whole replacement
                tr["same_dose"] = True
        return out, traces
    return wrapped


def scope_run(argv: list[str]) -> None:
    """scope.py's main with --same-dose and/or --keep-checkpoints (module docstring) taken off argv; the hooks
    are removed again when it returns."""
    import scope
    from harness.run import config, wiring

    same_dose, keep = "--same-dose" in argv, "--keep-checkpoints" in argv
    argv = [a for a in argv if a not in ("--same-dose", "--keep-checkpoints")]
    args = scope.parse_args(argv)
    run_dir = os.path.join("runs", args.run_name)
    rectify, checkpoint = scope.rectify, wiring.Run.checkpoint   # step 5 as scope.main calls it
    if same_dose:
        counts = {"repairs": 0, "prefix_equal": 0}
        credited = with_same_dose(rectify, counts)

        def counted(*a, **kw):
            out = credited(*a, **kw)
            with open(os.path.join(run_dir, "same_dose.json"), "w") as f:
                json.dump(counts, f)
            return out
        scope.rectify = counted
    if keep:
        def keep_copy(self, step):
            checkpoint(self, step)
            if self.dist.main:
                shutil.copytree(os.path.join(self.run_dir, "checkpoint"),
                                os.path.join(self.run_dir, "checkpoints", f"step-{step}"), dirs_exist_ok=True)
        wiring.Run.checkpoint = keep_copy
    try:
        with config.run_interrupt(args):
            scope.main(args)
    finally:
        scope.rectify, wiring.Run.checkpoint = rectify, checkpoint


# ---------------------------------------------------------------- the plan

def job(row: str, seed: int, args) -> dict:
    settings, task = when_it_helps.STARTS[WEAK]
    flags, wrap = ROWS[row]
    j = common.job(row, seed, flags, args, group=GROUP, steps=args.regime_steps, task=task,
                    start=json.dumps(settings), eval_every=args.regime_eval_every)
    return {**j, "kind": "run", "wrap": wrap}


def plan(args) -> list[dict]:
    """The mechanism measurement first, then one same-dose run and one K2' seed (three cells) in turn until the
    same-dose seeds are done, then the remaining K2' seeds (the pre-registered order)."""
    jobs = [{"kind": "mechanism", "name": "mechanism", "row": "mechanism", "seed": None}]
    for i, seed in enumerate(NEW_SEEDS):
        if i < len(DOSE_SEEDS):
            jobs.append(job(DOSE, DOSE_SEEDS[i], args))
        jobs += [job(row, seed, args) for row in (GRPO, KEEP, PHANTOM)]
    return jobs


def command(j: dict, args) -> list[str]:
    """The run's command: scope.py's, or through `scope_run` with its hook (keep-checkpoints saves every 25)."""
    cmd = common.scope_command(j, args)
    if not j.get("wrap"):
        return cmd
    extra = ["--save-every", str(KEEP_EVERY)] if j["wrap"] == "keep-checkpoints" else []
    return [cmd[0], "-m", "tools.studies.content_or_mean_shift", "--scope-run", f"--{j['wrap']}", *cmd[2:], *extra]


def record_path(j: dict, args) -> str:
    return os.path.join(args.out, STAGE, "records", j["name"] + ".json")


def record_key(j: dict, args) -> tuple[list[str], dict]:
    return command(j, args)[1:], {k: getattr(args, k) for k in ("eval_size", "eval_n", "eval_n_cool", "eval_seed",
                                                                "max_new_tokens")}


def recorded(j: dict, args) -> dict | None:
    """The job's record's result when it holds this command and these eval settings, else None."""
    if j["kind"] == "mechanism":
        old = common.read_json(os.path.join(args.out, STAGE, "mechanism.json"))
        return old if old is not None and old.get("settings") == mechanism_settings() else None
    cmd, settings = record_key(j, args)
    old = common.read_json(record_path(j, args))
    same = old is not None and common.as_now(old["command"]) == cmd and old["eval_settings"] == settings
    return old["result"] if same else None


# ---------------------------------------------------------------- one job (in a worker process)

def train(j: dict, args) -> None:
    """Run the job's command unless runs/<name> holds a finished run of it (bounded by RUN_TIMEOUT_S)."""
    run_dir, cmd = os.path.join("runs", j["name"]), command(j, args)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    done = os.path.exists(metrics) and any(json.loads(line)["step"] == j["steps"] for line in open(metrics))
    if done and common.read_json(os.path.join(run_dir, "command.json")) == {"command": cmd[1:]}:
        return
    os.makedirs(run_dir, exist_ok=True)
    for stale in ("final_eval.json", "command.json", "same_dose.json"):
        if os.path.exists(os.path.join(run_dir, stale)):
            os.remove(os.path.join(run_dir, stale))
    shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
    with open(os.path.join(run_dir, "train.log"), "w") as log:
        rc = subprocess.run([*cmd, "--overwrite"], stdout=log, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S).returncode
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {rc}); see {run_dir}/train.log")
    with open(os.path.join(run_dir, "command.json"), "w") as f:
        json.dump({"command": cmd[1:]}, f)


def run_one(j: dict, args) -> dict:
    """A job's result: from its record, else trained, evaluated and recorded (with the environment)."""
    import torch

    from harness.run.runs import environment

    os.chdir(common.ROOT)
    torch.set_num_threads(1)
    done = recorded(j, args)
    if done is not None:
        return {**j, "result": done, "fresh": False}
    t0, env = time.time(), environment()   # the commit the job starts from
    if j["kind"] == "mechanism":
        res = mechanism()
        res["wall_s"] = round(time.time() - t0, 1)
        res["environment"] = env
        os.makedirs(os.path.join(args.out, STAGE), exist_ok=True)
        with open(os.path.join(args.out, STAGE, "mechanism.json"), "w") as f:
            json.dump(res, f, indent=1)
        return {**j, "result": res, "fresh": True}
    train(j, args)
    t1 = time.time()
    run_dir = os.path.join("runs", j["name"])
    path = os.path.join(run_dir, "checkpoint")
    ev = common.evaluate_policy(path, j["task"], args, common.eval_styles(j, args))
    r = {**{k: v for k, v in j.items() if k not in ("kind",)}, "eval": ev, "train": common.training_stats(run_dir),
         "repairs": when_it_helps.repairs_of(run_dir, j["steps"]),
         "wall_s": {"train": round(t1 - t0, 1), "eval": round(time.time() - t1, 1)}}
    if j["wrap"] == "same-dose":
        r["same_dose"] = common.read_json(os.path.join(run_dir, "same_dose.json"))
    if j["wrap"] == "keep-checkpoints":
        r["tracking"] = tracking(run_dir, common.start_path(j, args))
    cmd, settings = record_key(j, args)
    os.makedirs(os.path.dirname(record_path(j, args)), exist_ok=True)
    with open(record_path(j, args), "w") as f:
        json.dump({"command": cmd, "start": j["start"], "eval_settings": settings, "environment": env,
                   "result": r}, f)
    return {**j, "result": r, "fresh": True}


# ---------------------------------------------------------------- M: the step-1 gradient split

def mechanism_settings() -> dict:
    return {"seeds": list(OLD_SEEDS), "styles": ["prefix", "1"], "problems": MECH_PROBLEMS, "lr": 1e-4,
            "parts": ["F", "K", "S", "M"]}


def part_masks(batch: dict, trajs: list, all_fail_before: set) -> dict:
    """(N, L) 0/1 masks of the four parts of the step's loss, a partition of the response tokens:
    F the policy's rollouts in groups that were all-fail before repair and hold an accepted repair; K the kept
    (policy-written) tokens of the repairs; S the refiner's tokens of the repairs; M everything else."""
    import torch

    resp = batch["response_mask"].bool()
    off = batch["offpolicy_mask"].bool() & resp
    repaired_groups = {t.group for t in trajs if t.source != "policy"}
    is_repair = torch.tensor([t.source != "policy" for t in trajs]).unsqueeze(1)
    in_f = torch.tensor([t.source == "policy" and t.group in all_fail_before and t.group in repaired_groups
                         for t in trajs]).unsqueeze(1)
    F = resp & in_f
    K = resp & is_repair & ~off
    S = off & is_repair
    M = resp & ~F & ~K & ~S
    return {"F": F, "K": K, "S": S, "M": M}


def step1_batch(seed: int, style: str, start_path: str):
    """The step-1 batch of `scope.py --toy` SCOPE (paper) from `start_path` with seed `seed` (the refiner in
    the prefix's style or in style `style`): (run, merged trajectories, advantages, all-fail groups)."""
    import scope
    from harness.run import wiring
    from harness.data.grader import grade

    argv = ["--toy", "--model", os.path.relpath(start_path, common.ROOT), "--run-name",
            f"because2-mechanism-{style}-s{seed}", "--steps", "1", "--eval-every", "0", "--save-every", "1",
            "--max-new-tokens", "128", "--overwrite", *common.GRID["scope any/replace"].split(), "--seed", str(seed)]
    if style != "prefix":
        argv += ["--toy-refiner-style", style]
    args = scope.parse_args(argv)
    run = wiring.start(args, scope.paper())
    step, problems, mine = next(run.steps())   # step 1: its torch seed and its B problems, as scope.main draws them
    trajs = run.rollout(problems, mine)
    for t in trajs:
        t.correct = grade(t.text, t.answer)
        t.reward = float(t.correct)
    with run.prm_phase():
        scope.locate_first_errors(trajs, run.prm, run.tokenizer, args.tau, args.mode, args.prm_reward_coef)
    picks = scope.select_failures(trajs, mine, args.mode, args.rectify_groups, args.select_tiebreak)
    with run.refine_phase(picks) as seed:
        merged, traces = scope.rectify(trajs, picks, run.refiner, run.tokenizer, attempts=args.refine_attempts,
                                       merge=args.merge, max_new_tokens=args.max_new_tokens, grade_fn=grade, seed=seed)
    advantages = scope.group_advantages([t.reward for t in merged], groups=[t.group for t in merged],
                                        scale_std=args.adv_std)
    all_fail = {b for b in mine if not any(t.correct for t in trajs if t.group == b)}
    for log in (run.metrics_file, run.traces_file):
        log.close()
    return run, merged, traces, advantages, all_fail


def correct_logprob(model, tokenizer, problems: list[dict]):
    """J: the mean over `problems` of the summed log π of the oracle's correct style-0 solution, teacher-forced
    (with gradient)."""
    import torch

    from grpo import logprobs_and_entropy
    from harness.data import toy
    from harness.data.prompt import format_prompt

    total = 0.0
    for p in problems:
        head = format_prompt(tokenizer, p["question"])
        body = tokenizer.encode(toy.solution_text(p), add_special_tokens=False)
        ids = torch.tensor([head + body])
        logp, _ = logprobs_and_entropy(model(input_ids=ids).logits[:, :-1], ids[:, 1:])
        total = total + logp[0, len(head) - 1:].sum()
    return total / len(problems)


def split_one(seed: int, style: str, start_path: str, problems: list[dict], lr: float) -> dict:
    """M for one seed and refiner style: each part's gradient, its plain step at lr and its AdamW step, and
    the change of J under each."""
    import copy

    import torch

    from grpo import build_batch, logprobs_and_entropy, loss_normaliser, policy_loss
    from harness.run import wiring

    run, merged, traces, advantages, all_fail = step1_batch(seed, style, start_path)
    a, model, tok = run.args, run.policy, run.tokenizer
    model.eval()   # dropout-free toy model; eval() only fixes the mode
    batch = build_batch([t.prompt_ids for t in merged], [t.response_ids for t in merged],
                        [t.offpolicy_mask for t in merged], advantages, wiring.pad_or_eos(tok))
    masks = part_masks(batch, merged, all_fail)
    params = [p for p in model.parameters() if p.requires_grad]
    z = loss_normaliser(batch["response_mask"], a.loss_agg, a.max_new_tokens)

    def grad_of(mask):
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        taken, _ = logprobs_and_entropy(logits[:, :-1], batch["input_ids"][:, 1:])
        logp = torch.nn.functional.pad(taken, (1, 0)) * batch["response_mask"]
        loss, _ = policy_loss(logp, logp.detach(), batch["advantages"], mask.long(), batch["offpolicy_mask"],
                              clip_eps=a.clip_eps, shaping_gamma=a.shaping_gamma, z=z,
                              offpolicy_credit=a.offpolicy_credit)   # the whole batch's Z, as in the step
        loss.backward()
        return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]

    grads = {name: grad_of(m) for name, m in masks.items()}
    grads["full"] = grad_of(batch["response_mask"].bool())
    additivity = max(float((sum(grads[n][i] for n in masks) - x).abs().max()) for i, x in enumerate(grads["full"]))
    model.zero_grad(set_to_none=True)
    model = copy.deepcopy(model).double()   # J and the steps in float64: a step at lr moves J by ~1e-5
    params = [p for p in model.parameters() if p.requires_grad]
    grads = {name: [x.double() for x in g] for name, g in grads.items()}
    base = copy.deepcopy(model.state_dict())
    J = correct_logprob(model, tok, problems)
    J.backward()
    dJ = [p.grad.detach().clone() for p in params]
    model.zero_grad(set_to_none=True)
    J0 = float(J.detach())
    out = {"seed": seed, "style": style, "J0": J0, "additivity_max_abs_error": additivity, "parts": {}}
    for name, g in grads.items():
        norm = float(torch.sqrt(sum((x ** 2).sum() for x in g)))
        first_order = float(-lr * sum((x * y).sum() for x, y in zip(g, dJ)))
        with torch.no_grad():
            for p, x in zip(params, g):
                p.sub_(lr * x)
            plain = float(correct_logprob(model, tok, problems)) - J0
        model.load_state_dict(base)
        opt = torch.optim.AdamW(params, lr=lr)   # the run's optimizer, fresh state (its first step)
        for p, x in zip(params, g):
            p.grad = x.clone()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():
            adamw = float(correct_logprob(model, tok, problems)) - J0
        model.load_state_dict(base)
        model.zero_grad(set_to_none=True)
        out["parts"][name] = {"grad_norm": norm, "dJ_plain": plain, "dJ_first_order": first_order, "dJ_adamw": adamw,
                              "tokens": int(masks[name].sum()) if name in masks else int(batch["response_mask"].sum())}
    repairs = [t for t in merged if t.source != "policy"]
    equal = 0
    for t in repairs:
        if t.prefix_len:
            _, same = same_dose_credit(t, tok)
            equal += int(same)
    out.update(repairs=len(repairs), all_fail_groups=len(all_fail),
               kept_tokens_mean=float(np.mean([t.prefix_len for t in repairs])) if repairs else None,
               refiner_tokens_mean=float(np.mean([sum(t.offpolicy_mask) for t in repairs])) if repairs else None,
               prefix_equal_oracle=equal, prefix_nonempty=sum(bool(t.prefix_len) for t in repairs))
    shutil.rmtree(run.run_dir, ignore_errors=True)
    return out


def mechanism() -> dict:
    """M over the pre-registered seeds and refiner styles (docs/because2-preregistration.md)."""
    from harness.data import toy

    s = mechanism_settings()
    start = toy.cache_path(os.path.join(common.ROOT, "cache"), seed=0, **when_it_helps.STARTS[WEAK][0])
    problems = toy.make_problems(s["problems"], seed=0)
    results = [split_one(seed, style, start, problems, s["lr"]) for style in s["styles"] for seed in s["seeds"]]
    return {"settings": s, "command": "python -m tools.studies.content_or_mean_shift (its first job)", "results": results}


# ---------------------------------------------------------------- T: π of kept vs regenerated tokens

def tracking(run_dir: str, start_path: str) -> dict:
    """At the start and at each kept checkpoint t (25, 50, 75): the accepted repairs of steps t+1 .. t+5 of
    traces.jsonl teacher-forced under the policy of step t: mean π of kept, regenerated and corrected tokens.
    Each checkpoint gets its own repairs, so the rows compare different tokens (tools/studies/prefix_or_suffix.py `tracking`
    follows one fixed set from a checkpoint on)."""
    from harness.engines.generate import load_causal_lm

    traces = [json.loads(line) for line in open(os.path.join(run_dir, "traces.jsonl"))]
    traces = [t for t in traces if t["accepted"]]
    out = {}
    for step in (0, 25, 50, 75):
        path = start_path if step == 0 else os.path.join(run_dir, "checkpoints", f"step-{step}")
        if not os.path.isdir(path):
            continue
        model, tok = load_causal_lm(path, "cpu")
        model.eval()
        kept, regen, corrected = [], [], []
        for t in traces:
            if not step < t["step"] <= step + TRACK_WINDOW:
                continue
            pi, n_kept, c = common.repair_token_probs(model, tok, t)
            kept += pi[:n_kept]
            regen += pi[n_kept:]
            if c is not None and c < len(pi) - n_kept:
                corrected.append(pi[n_kept + c])
        out[str(step)] = {"repairs": sum(step < t["step"] <= step + TRACK_WINDOW for t in traces),
                          "kept_pi": common.mean(kept), "regenerated_pi": common.mean(regen),
                          "corrected_pi": common.mean(corrected)}
    return out


# ---------------------------------------------------------------- statistics (pure)

def t_interval(d) -> dict:
    """Mean and 95 % t-interval (scipy.stats.t, n − 1 degrees of freedom)."""
    from scipy import stats

    d = np.asarray([x for x in d if x is not None], dtype=float)
    if len(d) < 2:
        return {"mean": float(d[0]) if len(d) else None, "lo": None, "hi": None, "n": len(d)}
    half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
    return {"mean": float(d.mean()), "lo": float(d.mean() - half), "hi": float(d.mean() + half), "n": len(d)}


def sd_ratio(a, b) -> dict:
    """SD(a) / SD(b) with a 95 % interval from the F distribution (independent normal samples)."""
    from scipy import stats

    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(a) < 2 or len(b) < 2:
        return {"ratio": None, "lo": None, "hi": None}
    f = a.var(ddof=1) / b.var(ddof=1)
    d1, d2 = len(a) - 1, len(b) - 1
    return {"ratio": math.sqrt(f), "lo": math.sqrt(f / stats.f.ppf(0.975, d1, d2)),
            "hi": math.sqrt(f / stats.f.ppf(0.025, d1, d2)), "n": [len(a), len(b)]}


def verdict(c: dict, planned: int) -> str:
    """The pre-registered reading rule; a contrast short of its planned seeds is partial, without a verdict."""
    if c["lo"] is not None and c["n"] < planned:
        return f"partial ({c['n']} of {planned} seeds): no verdict"
    return why_it_helps.verdict(c, MARGIN)   # the because study's rule, this study's margin


CONTRASTS = {   # name: ({row: coefficient}, planned seeds, primary)
    "K2' phantom − SCOPE in style (seeds 0–12)": ({PHANTOM: 1, KEEP: -1}, tuple(OLD_SEEDS) + NEW_SEEDS, True),
    "D1 same-dose − keep-foreign (seeds 0–4)": ({DOSE: 1, FOREIGN: -1}, DOSE_SEEDS, True),
    "K2' on the new seeds 5–12 alone": ({PHANTOM: 1, KEEP: -1}, NEW_SEEDS, False),
    "phantom − GRPO (seeds 0–12)": ({PHANTOM: 1, GRPO: -1}, tuple(OLD_SEEDS) + NEW_SEEDS, False),
    "SCOPE in style − GRPO (seeds 0–12)": ({KEEP: 1, GRPO: -1}, tuple(OLD_SEEDS) + NEW_SEEDS, False),
    "D2 same-dose − whole-foreign (seeds 0–4)": ({DOSE: 1, WHOLE_FOREIGN: -1}, DOSE_SEEDS, False),
}


def contrasts(results: list[dict]) -> dict:
    from tools.studies import why_it_helps

    out = {}
    for name, (coefs, seeds, primary) in CONTRASTS.items():
        rs = [r for r in results if r["seed"] in seeds]
        by = why_it_helps.contrast_by_seed(rs, GROUP, coefs)
        c = t_interval(list(by.values()))
        row = {"seeds": sorted(by), "per_seed": by, "t": c, "verdict": verdict(c, len(seeds)), "primary": primary}
        if len(by) >= 2:
            D = why_it_helps.per_problem_matrix(rs, GROUP, coefs, sorted(by))
            row["bootstrap"] = why_it_helps.seed_problem_bootstrap(D, BOOT_DRAWS) if D is not None else None
        out[name] = row
    accs = {row: {r["seed"]: r["eval"]["acc_t1"] for r in results if r["row"] == row} for row in (GRPO, KEEP, PHANTOM)}
    common = sorted(set(accs[GRPO]) & set(accs[KEEP]) & set(accs[PHANTOM]))
    out["SD ratio phantom / SCOPE in style (exploratory)"] = sd_ratio([accs[PHANTOM][s] for s in common],
                                                                      [accs[KEEP][s] for s in common])
    out["SD ratio GRPO / SCOPE in style (exploratory)"] = sd_ratio([accs[GRPO][s] for s in common],
                                                                   [accs[KEEP][s] for s in common])
    return out


def mechanism_table(mech: dict | None) -> dict:
    """Per refiner style and part: ΔJ (plain step) and its share of the full step's, t-intervals over seeds."""
    if not mech:
        return {}
    out = {}
    for style in mech["settings"]["styles"]:
        rs = [r for r in mech["results"] if r["style"] == style]
        full = [r["parts"]["full"]["dJ_plain"] for r in rs]
        row = {}
        for part in ("F", "K", "S", "M", "K+S", "full"):
            names = ("K", "S") if part == "K+S" else (part,)
            plain = [sum(r["parts"][n]["dJ_plain"] for n in names) for r in rs]
            row[part] = {"dJ_plain": t_interval(plain), "share": t_interval([p / f for p, f in zip(plain, full)]),
                         "dJ_adamw": t_interval([sum(r["parts"][n]["dJ_adamw"] for n in names) for r in rs]),
                         "dJ_first_order": t_interval([sum(r["parts"][n]["dJ_first_order"] for n in names) for r in rs])}
        f_share, ks_share = row["F"]["share"], row["K+S"]["share"]
        row["reading"] = ("the failures' part carries the step's push" if f_share["lo"] is not None and f_share["lo"] > 0.5
                          else "the repair's tokens carry it" if ks_share["lo"] is not None and ks_share["lo"] > 0.5
                          else "neither")
        row["repairs_per_seed"] = [r["repairs"] for r in rs]
        row["prefix_equal_oracle"] = [f"{r['prefix_equal_oracle']}/{r['prefix_nonempty']}" for r in rs]
        out[style] = row
    return out


# ---------------------------------------------------------------- references, report, runner

def read_references(args) -> list[dict]:
    """The recorded seeds 0-4 of the rows the contrasts pair with (files of the regime and because stages)."""
    out = []
    for row, (folder, slug) in REFERENCES.items():
        for seed in OLD_SEEDS:
            rec = common.read_json(os.path.join(args.out, folder, "records", f"study-{GROUP}-{slug}-s{seed}.json"))
            if rec is not None:
                out.append(rec["result"])
    return out


def report(new: list[dict], mech: dict | None, args, planned: int) -> tuple[str, dict]:
    f = lambda c: common.fmt_ci(c) if c["lo"] is not None else ("–" if c["mean"] is None else f"{c['mean']:+.3f}")  # noqa: E731
    runs = [r for r in new if r.get("steps")]
    results = runs + read_references(args)
    con = contrasts(results)
    mt = mechanism_table(mech)
    md = [f"# Does the repair's content matter? ({len(runs)} of {planned} runs recorded"
          f"{', mechanism measured' if mech else ', mechanism not measured yet'})\n",
          "Pre-registration: docs/because2-preregistration.md. Command: `python -m tools.studies.content_or_mean_shift`. "
          f"Run time of the recorded runs (training + final eval, their own): {when_it_helps.run_minutes(runs):.0f} min.\n",
          "## Contrasts (acc at T = 1.0, paired by seed; t-interval first, seed × problem bootstrap second)\n",
          "| contrast | seeds | mean [95 % t-interval] | bootstrap 95 % | reading |", "|---" * 5 + "|"]
    for name, c in con.items():
        if name.startswith("SD ratio"):
            continue
        b = c.get("bootstrap")
        boot = f"[{b['lo']:+.3f}, {b['hi']:+.3f}]" if b else "–"
        label = f"**{name}**" if c["primary"] else name
        md.append(f"| {label} | {len(c['seeds'])} | {f(c['t'])} | {boot} | {c['verdict']} |")
    for name, c in con.items():
        if name.startswith("SD ratio") and c["ratio"] is not None:
            md.append(f"\n{name}: {c['ratio']:.2f} [{c['lo']:.2f}, {c['hi']:.2f}] over {c['n'][0]} seeds.")
    md += ["", "## Runs (acc at T = 1.0 per seed)\n", "| row | " + " | ".join(f"s{s}" for s in range(13)) + " |",
           "|---" * 14 + "|"]
    for row in (GRPO, KEEP, PHANTOM, DOSE, FOREIGN, WHOLE_FOREIGN):
        by = {r["seed"]: r["eval"]["acc_t1"] for r in results if r["row"] == row}
        md.append(f"| {row} | " + " | ".join(f"{by[s]:.3f}" if s in by else "" for s in range(13)) + " |")
    dose = [r for r in runs if r["row"] == DOSE and r.get("same_dose")]
    if dose:
        md.append(f"\nSame-dose runs: {sum(r['same_dose']['prefix_equal'] for r in dose)} of "
                  f"{sum(r['same_dose']['repairs'] for r in dose)} re-credited prefixes equalled the oracle's text.")
    if mt:
        md += ["", "## M: the step-1 gradient split (ΔJ = change of the mean summed log π of 200 correct solutions)\n",
               "| refiner | part | ΔJ, plain step at lr [t-interval] | share of the full step's | ΔJ, AdamW step alone |",
               "|---" * 5 + "|"]
        for style, row in mt.items():
            for part in ("F", "K", "S", "K+S", "M", "full"):
                p = row[part]
                md.append(f"| {style} | {part} | {p['dJ_plain']['mean']:+.2e} [{p['dJ_plain']['lo']:+.2e}, "
                          f"{p['dJ_plain']['hi']:+.2e}] | {f(p['share'])} | {p['dJ_adamw']['mean']:+.2e} |")
            md.append(f"| {style} | reading | {row['reading']} | repairs per seed {row['repairs_per_seed']} | "
                      f"kept prefix = oracle text: {row['prefix_equal_oracle']} |")
    track = [r["tracking"] for r in runs if r.get("tracking")]
    if track:
        md += ["", "## T: π of the repairs' tokens through training (SCOPE in style, seeds 5–12)\n",
               "| checkpoint step | runs | kept tokens | regenerated tokens | corrected token |", "|---" * 5 + "|"]
        for step in ("0", "25", "50", "75"):
            rows = [t[step] for t in track if step in t]
            md.append(f"| {step} | {len(rows)} | " + " | ".join(
                f(t_interval([x[k] for x in rows])) for k in ("kept_pi", "regenerated_pi", "corrected_pi")) + " |")
    summary = {"contrasts": con, "mechanism": mt, "runs_recorded": len(runs), "planned": planned}
    return "\n".join(md) + "\n", summary


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records-only", action="store_true", help="report from the records; train nothing")
    p.add_argument("--jobs", type=int, default=2, help="processes at once")
    p.add_argument("--out", default="results/toy")
    a = p.parse_args(argv)
    args = where_it_helps.parse_args(["--out", a.out, "--jobs", str(a.jobs)])
    args.stage, args.eval_n_cool, args.train_eval_size = STAGE, 0, args.regime_eval_size   # the regime map's settings
    os.chdir(common.ROOT)
    t0 = time.time()
    jobs = plan(args)
    planned = sum(j["kind"] == "run" for j in jobs)
    if a.records_only:
        done = [{**j, "result": r} for j in jobs if (r := recorded(j, args)) is not None]
    else:
        from harness.data import toy
        toy.warm_start(os.path.join(common.ROOT, "cache"), seed=0, **when_it_helps.STARTS[WEAK][0])
        done = run_jobs(jobs, args, t0)
    mech = next((d["result"] for d in done if d["kind"] == "mechanism"), None)
    new = [d["result"] for d in done if d["kind"] == "run"]
    text, summary = report(new, mech, args, planned)
    with open(os.path.join(args.out, f"{STAGE}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, f"{STAGE}.json"), "w") as f:
        json.dump({"command": "python -m tools.studies.content_or_mean_shift", "wall_minutes": round((time.time() - t0) / 60, 2),
                   "summary": summary}, f, indent=1)
    print(text, flush=True)


def run_jobs(jobs: list[dict], args, t0: float) -> list[dict]:
    """Every job, --jobs at a time, in plan order; prints k/N and an ETA as each finishes. Ctrl-C or SIGTERM
    stops the workers and the scope.py runs they started (rerun to resume from the records)."""
    import multiprocessing
    import threading

    if threading.current_thread() is threading.main_thread():
        common._stop_on_sigterm()
    todo = [j for j in jobs if recorded(j, args) is None]
    done = [{**j, "result": recorded(j, args), "fresh": False} for j in jobs if j not in todo]
    print(f"content_or_mean_shift: {len(jobs)} jobs, {len(done)} recorded, {len(todo)} to run, {args.jobs} at a time", flush=True)
    pool = ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=common._worker_group)
    try:
        pending = {pool.submit(run_one, j, args): j for j in todo}
        walls = []
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                j = pending.pop(fut)
                d = fut.result()
                done.append(d)
                r = d["result"]
                if j["kind"] == "run":
                    walls.append(sum(r["wall_s"].values()))
                left = sum(x["kind"] == "run" for x in pending.values())
                eta = (np.mean(walls) * left / args.jobs / 60) if walls else float("nan")
                what = (f"acc@T1 {r['eval']['acc_t1']:.3f} (train {r['wall_s']['train']:.0f}s, eval "
                        f"{r['wall_s']['eval']:.0f}s)" if j["kind"] == "run" else f"mechanism ({r['wall_s']:.0f}s)")
                print(f"[{len(done)}/{len(jobs)}] [{(time.time() - t0) / 60:.1f} min] {j['name']}: {what}; "
                      f"ETA {eta:.0f} min for {left} runs", flush=True)
    except BaseException:   # Ctrl-C, SIGTERM, a failed run: stop the workers and their scope.py runs
        common.stop_pool(pool)
        raise
    pool.shutdown(wait=True)
    order = {j["name"]: i for i, j in enumerate(jobs)}
    return sorted(done, key=lambda d: order[d["name"]])


if __name__ == "__main__":
    if "--scope-run" in sys.argv:
        os.chdir(common.ROOT)
        scope_run([x for x in sys.argv[1:] if x != "--scope-run"])
    else:
        main()
