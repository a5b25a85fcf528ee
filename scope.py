"""scope.py — SCOPE training, top to bottom: one file that reads like the method.

SCOPE = Step-wise Correction for On-Policy Exploration (Ren et al., "Recycling Failures: Salvaging
Exploration in RLVR via Fine-Grained Off-Policy Guidance", arXiv 2602.24110). GRPO for maths in which a
failed rollout is not thrown away: a process reward model (PRM) finds its first wrong step, the policy's own
tokens before that step are kept, a refiner rewrites the rest, and the repaired trajectory rejoins its group.
One training step:

    rollout → grade → PRM first error of the failed rollouts → most promising failure per group →
    rectify (keep the token prefix, refiner writes the suffix, regrade) → advantages over the merged groups →
    update (PPO ratio on policy tokens, LUFFY shaping on refiner tokens) → weight sync →
    log → periodic eval → checkpoint

Run:
    python scope.py --toy                        # CPU toy world, one command: before/after accuracy (the toy
                                                 # warm start ships in cache/; trained again only when missing)
    python scope.py --toy --mode grpo            # the on-policy baseline in the same world (also: replace, prm-reward)
    python scope.py --model Qwen2.5-1.5B         # the real path on one GPU (vLLM rollouts when installed)
    python scope.py --resume runs/NAME           # continue a run exactly where its last checkpoint left it
                                                 # (Ctrl-C prints this command with the checkpoint's step)
    python scope.py --model Qwen2.5-1.5B --dry-run   # the pre-flight only: memory plan and resolved Args
    python scope.py --help                       # every flag with its default
    torchrun --nproc_per_node 8 scope.py --model Qwen2.5-Math-7B --fsdp   # several GPUs (docs/scaling.md)

Every choice the paper leaves open is a field of `Args` below (its help text is its `--help` line) and one
row of docs/choices.md, with its reason. The run folder, the pre-flight, checkpoints and resume are
described in docs/running.md; the logged metrics in docs/metrics.md.
"""
import argparse
import difflib
import sys
import time
import zlib
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import torch
from tqdm import tqdm

from eval import discarded_valid_share, near_miss_at_k
from grpo import build_batch, group_advantages, update_epoch
from harness import cli, dist, preflight, progress, toy, wiring
from harness.generate import GeneratorUnavailable, format_prompt
from harness.grader import grade
from harness.runs import read_changes, run_settings
from prm import cut_point, keep_ratio, mean_score, select_candidate, split_steps, step_token_spans
import refine
from refine import Trajectory

MODES = ("scope", "grpo", "replace", "prm-reward")


def arg(default, help, choices=None):
    """A dataclass field whose help text (and choices) become its --flag."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class Args:
    # --- models
    model: str = arg("Qwen2.5-1.5B", "policy: HF id, local path or alias (Qwen2.5-1.5B, Qwen2.5-Math-1.5B, "
                     "Qwen2.5-Math-7B, ...-Instruct); with --toy: 'toy' (cached warm start) or a saved toy model")
    prm: str = arg("Qwen/Qwen2.5-Math-PRM-7B", "process reward model (HF id or path); 'none' = no PRM (grpo "
                   "only, and --mode grpo's default off the toy world: there a PRM only feeds the near-miss metrics)")
    refiner: str = arg("Qwen/Qwen2.5-Math-7B-Instruct", "refiner: HF id or path, or 'policy' (self-refinement); "
                       "with --toy: 'toy-oracle' (rule-based, never fails) or 'toy-model' (a stronger toy model "
                       "through Refiner + HF generate; can fail)")
    refiner_url: str = arg("", "OpenAI-compatible server (e.g. `vllm serve` of --refiner) to refine through")
    refiner_mem: float = arg(0.25, "GPU memory share of the refiner's own `vllm serve` (started when vLLM is "
                             "installed and --refiner is a separate model without --refiner-url)")
    refiner_timeout: float = arg(600.0, "seconds one served-refiner request may take (2 retries; then the step "
                                 "goes on without rectification)")
    backend: str = arg("auto", "rollout engine; auto = vLLM when importable and CUDA present", ("auto", "vllm", "hf"))
    device: str = arg("auto", "auto = cuda when present; 'cpu' runs a real model on the CPU (slow)")
    # --- data
    dataset: str = arg("math-train", "training problems: anything harness.problems.load_problems takes (name or .jsonl)")
    eval_dataset: str = arg("math500", "held-out problems for the periodic evaluation")
    eval_size: int = arg(500, "number of evaluation problems (0 = all)")
    eval_n: int = arg(1, "samples per evaluation problem (accuracy = avg@n at temperature 0.6)")
    # --- the algorithm
    mode: str = arg("scope", "scope | grpo (no rectification) | replace (whole solution) | prm-reward", MODES)
    steps: int = arg(500, "training steps (one rollout batch each, --updates-per-batch optimizer steps on it)")
    prompts_per_step: int = arg(16, "prompts per step (B)")
    group_size: int = arg(8, "rollouts per prompt (G)")
    max_new_tokens: int = arg(1024, "response budget in tokens (clamped to the model context)")
    eval_max_new_tokens: int = arg(3000, "response budget of the periodic evaluation (clamped to the model context)")
    temperature: float = arg(1.0, "rollout sampling temperature")
    tau: float = arg(0.5, "PRM threshold: the first step scored below it is the first error")
    refine_attempts: int = arg(2, "refiner attempts per selected failure (one batched call); first correct wins")
    refine_prompt: str = arg("continue", "refiner prompt: continue the prefix, or hint that a mistake follows",
                             ("continue", "hint"))
    merge: str = arg("replace", "a repaired trajectory replaces the failure, or joins the group",
                     ("replace", "append"))
    rectify_groups: str = arg("any", "groups eligible for rectification: any group with a failure, or only "
                              "groups where every rollout failed", ("any", "all-fail"))
    grader: str = arg("ours", "who grades the periodic evaluation (the accuracy of the closing summary and the model "
                      "card): our grader or Math-Verify, the paper's tables' convention (pip install "
                      "math-verify==0.9.0); rewards are always ours (docs/grader.md)", ("ours", "math-verify"))
    prm_reward_coef: float = arg(0.5, "λ of --mode prm-reward: reward = outcome + λ · mean PRM step score")
    # --- the update
    lr: float = arg(1e-6, "AdamW learning rate")
    loss_agg: str = arg("constant", "constant = Σ tokens / (N · max_new_tokens) (Dr. GRPO); token-mean",
                        ("constant", "token-mean"))
    updates_per_batch: int = arg(2, "optimizer steps per rollout batch, one per mini-batch of whole groups (LUFFY: "
                                 "2); above 1, one no-grad pass gives π_old first, so the PPO ratio and clip act "
                                 "from the second mini-batch on; 1 = ρ ≡ 1, the clip never binds")
    clip_eps: float = arg(0.2, "PPO clip ε on the policy's tokens: ρ clipped to [1 − ε, 1 + ε]; it binds only "
                          "with --updates-per-batch > 1; inf = no clip (LUFFY's script)")
    shaping_gamma: float = arg(0.1, "LUFFY policy shaping γ on refiner tokens: f(π) = π / (π + γ)")
    offpolicy_credit: str = arg("shaped", "objective on refiner tokens: shaped = −f(π)·A (LUFFY); unit = −A·log π "
                                "(as if the policy had sampled them)", ("shaped", "unit"))
    adv_std: bool = arg(False, "divide group advantages by their std (GRPO) instead of mean-centring only")
    kl_coef: float = arg(0.0, "β of a k3 KL penalty to the initial policy (0 = no reference model)")
    entropy_coef: float = arg(0.0, "entropy bonus coefficient")
    micro_batch_size: int = arg(4, "sequences per forward/backward pass of the update")
    gen_batch_size: int = arg(64, "sequences per HF generate call (rollouts, evaluation, an in-process refiner)")
    tis_cap: float = arg(2.0, "truncated importance sampling on the policy's tokens with vLLM rollouts: weight "
                         "min(π_train/π_vLLM, C) with this C (>= 1); 0 = off; no weight with HF generate")
    # --- memory (docs/memory.md)
    gradient_checkpointing: bool = arg(True, "recompute each decoder layer in the backward pass (non-reentrant) "
                                       "instead of keeping its activations; off in the toy world")
    logprob_chunk: int = arg(512, "tokens per chunk of the update's float32 log-softmax (recomputed in the backward); "
                             "0 = one chunk, no recomputation (the toy world)")
    fused_adamw: bool = arg(True, "torch's fused AdamW kernel on CUDA (the same update, fewer kernels and temporaries)")
    rollout_sleep: bool = arg(True, "put the policy's vLLM engine to sleep during the update (level 2: weights and "
                              "KV cache freed); its weights are woken for the push, its KV cache for the next rollout")
    prm_offload: str = arg("auto", "move the PRM to CPU memory between its uses; auto = when the memory plan with "
                           "the PRM resident does not fit the GPU", ("auto", "on", "off"))
    # --- bookkeeping
    eval_every: int = arg(50, "evaluate every N steps (and before the first and after the last); 0 = never")
    save_every: int = arg(100, "checkpoint every N steps (and after the last)")
    seed: int = arg(0, "seed; every random draw derives from (seed, step)")
    run_name: str = arg("", "logs go to runs/<run_name>; default <mode>-<model>-s<seed>")
    resume: str = arg("", "continue the run in this folder (runs/<name>) from its checkpoint, with its settings")
    change_config: bool = arg(False, "with --resume: accept typed flags that change how the run trains (recorded "
                              "with their step in runs/<name>/changes.jsonl; config.json keeps the start)")
    report_to: str = arg("none", "also log the metrics to TensorBoard (runs/<name>/tensorboard) or Weights & Biases "
                         "(offline without network)", ("none", "tensorboard", "wandb"))
    toy: bool = arg(False, "the CPU toy world: tiny char-level Qwen2, rule-based PRM, oracle refiner")
    toy_prm_noise: float = arg(0.0, "toy world: probability that the toy PRM flips a step score")
    toy_styles: int = arg(1, "toy world: the warm start writes its solutions in this many styles (1-3, "
                          "harness/toy.py choice 10); > 1 also logs the styles of the correct rollouts")
    toy_refiner_style: str = arg("prefix", "toy world: the oracle refiner continues in the style of the kept "
                                 "prefix, or always writes style k (a foreign voice for a one-style policy)",
                                 ("prefix", "0", "1", "2"))
    repair_advantage: str = arg("keep", "zero = an accepted repair counts in its group's mean, then its own "
                                "advantage is set to 0 (the 'phantom success' control: the mean shift without "
                                "the repair's content; N and the loss normaliser unchanged)", ("keep", "zero"))
    select_tiebreak: str = arg("length", "how the pick among equally promising failures is broken: the shorter "
                               "rollout, or the earlier index (favours no phrasing; in the toy world an empty "
                               "prefix's oracle style is then drawn from the warm start's styles)",
                               ("length", "index"))
    overwrite: bool = arg(False, "allow starting from step 1 in a folder holding a run (a new run under a used "
                          "--run-name, or --resume of a folder without checkpoint): its logs are replaced")
    memory_check: bool = arg(True, "stop before loading when the memory plan (an estimate) exceeds the GPU; "
                             "--no-memory-check starts anyway")
    config: str = arg("", "a YAML file of flags (keys: these flag names, with dashes or underscores); flags typed on "
                      "the command line override it; its values are recorded in config.json like typed ones")
    dry_run: bool = arg(False, "run the pre-flight (flags, folder, data, memory plan), print the resolved Args, exit")
    # --- several GPUs (torchrun; docs/scaling.md)
    fsdp: bool = arg(False, "under torchrun: shard the policy, its gradients and AdamW state over the processes "
                     "(FSDP2) instead of a full copy per GPU (DDP)")
    dist_timeout: float = arg(1800.0, "under torchrun: seconds a process waits for the others before the run "
                              "stops with an error")


# Applied with --toy unless the flag is typed. 30 steps take ~0.5 s each on 2 CPU cores once the warm start is cached.
TOY_DEFAULTS = dict(model="toy", prm="toy", refiner="toy-oracle", dataset="toy", eval_dataset="toy", eval_size=200,
                    backend="hf", device="cpu", steps=30, prompts_per_step=8, group_size=8, max_new_tokens=128,
                    lr=1e-4, micro_batch_size=64, eval_every=10, save_every=10, eval_max_new_tokens=128,
                    gradient_checkpointing=False, logprob_chunk=0, updates_per_batch=1)


# ============================================================ the steps of main, in its order


def rollout(run, problems: list[dict], groups: range, seed: int) -> list[Trajectory]:
    """Step 1: G samples per prompt of `groups` (this rank's; all B in one process) at the rollout temperature,
    one batched call, kept as token ids. vLLM seeds prompt i with seed + i, so a rank samples its slice alone;
    HF generate draws one stream for the whole call, so each rank samples all B prompts and keeps its groups."""
    a = run.args
    todo = groups if run.use_vllm else range(len(problems))
    prompts = [format_prompt(run.tokenizer, problems[b]["question"]) for b in todo]
    run.policy.eval()
    with run.amp_for(run.generator):   # autocast for HF generate only, never around vLLM
        completions = run.generator.generate(prompts, n=a.group_size, temperature=a.temperature,
                                             max_tokens=a.max_new_tokens, seed=seed + todo.start)
    return [Trajectory(question=problems[b]["question"], answer=problems[b]["answer"], group=b, prompt_ids=prompt,
                       response_ids=list(c.ids), text=c.text, finished=c.finished, sampler_logp=c.logprobs)
            for b, prompt, group in zip(todo, prompts, completions) if b in groups for c in group]


def kept_tokens(spans: list[tuple[int, int]], cut: int, n_tokens: int) -> int:
    """Tokens of a failed response kept before its first error: where step `cut` starts, all n_tokens when the
    cut lies past the last step, and none for a response without steps (an empty or bare-EOS response keeps
    nothing: keeping its EOS would train it on-policy with a positive advantage and put the refiner after it)."""
    if not spans:
        return 0
    return spans[cut][0] if cut < len(spans) else n_tokens


def locate_first_errors(trajs: list[Trajectory], prm, args: Args, tokenizer) -> None:
    """Step 3, first-error localisation: the PRM scores the steps of every failed rollout (of every rollout in
    prm-reward mode); the first step below τ is the cut (prm.cut_point). Sets steps, step_scores, cut,
    keep_ratio, prefix_len (the tokens before the first error) and keep_ratio_tokens on each."""
    # BEGIN SOLUTION scope_step
    scored = [t for t in trajs if args.mode == "prm-reward" or not t.correct] if prm else []
    if not scored:
        return
    for t in scored:
        t.steps = split_steps(t.text)
    for t, scores in zip(scored, prm.score_batch([t.question for t in scored], [t.steps for t in scored])):
        t.step_scores = scores
        t.cut = cut_point(scores, args.tau)
        t.keep_ratio = keep_ratio(t.cut, len(t.steps))
        t.prefix_len = kept_tokens(step_token_spans(t.response_ids, t.steps, tokenizer), t.cut, len(t.response_ids))
        t.keep_ratio_tokens = t.prefix_len / max(1, len(t.response_ids))
    # END SOLUTION


def select_failures(trajs: list[Trajectory], groups: range, args: Args) -> list[tuple[int, int]]:
    """Step 4: (index, tokens to keep) of the most promising failure per eligible group (`--rectify-groups any`:
    every group with a failure; `all-fail`: only groups in which every rollout failed): largest keep ratio, then
    higher prefix PRM mean, then shorter (prm.select_candidate). Mode replace keeps nothing of the same pick."""
    # BEGIN SOLUTION scope_step
    if args.mode not in ("scope", "replace"):
        return []
    picks = []
    for b in groups:
        idx = [i for i, t in enumerate(trajs) if t.group == b and not t.correct]
        if not idx or (args.rectify_groups == "all-fail" and any(t.correct for t in trajs if t.group == b)):
            continue   # all-fail only: a group with a success keeps its on-policy signal untouched
        j = select_candidate([trajs[i].keep_ratio for i in idx],
                             [mean_score(trajs[i].step_scores[:trajs[i].cut]) for i in idx],
                             [len(trajs[i].response_ids) for i in idx], tiebreak=args.select_tiebreak)
        if j is not None:
            picks.append((idx[j], 0 if args.mode == "replace" else trajs[idx[j]].prefix_len))
    return picks
    # END SOLUTION


def rectify_failures(run, trajs: list[Trajectory], picks: list[tuple[int, int]], seed: int,
                     ) -> tuple[list[Trajectory], list[dict], bool]:
    """Step 5: rectify the picks (refine.rectify: the prefix ids kept, the refiner writes the rest, regraded,
    merged). A served refiner that stopped answering leaves this step with the rollouts alone.
    Returns (the merged trajectories to train on, traces, whether the refiner was unavailable)."""
    # BEGIN SOLUTION scope_step
    a = run.args
    if not picks:
        return trajs, [], False
    try:
        with run.amp_for(getattr(run.refiner, "generator", None)):
            merged, traces = refine.rectify(trajs, picks, run.refiner, run.tokenizer, attempts=a.refine_attempts,
                                            merge=a.merge, max_new_tokens=a.max_new_tokens, grade_fn=grade, seed=seed)
        return merged, traces, False
    except GeneratorUnavailable as err:
        tqdm.write(f"warning: the refiner did not answer, no rectification this step: {err}")
        return trajs, [], True
    # END SOLUTION


def batch_advantages(trajs: list[Trajectory], groups: range, scale_std: bool) -> torch.Tensor:
    """Step 6: A = r − mean(r) over each merged group (ragged with --merge append)."""
    # BEGIN SOLUTION scope_step
    rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)            # (N,)
    advantages = torch.zeros_like(rewards)                                             # (N,)
    for b in groups:
        idx = torch.tensor([i for i, t in enumerate(trajs) if t.group == b])
        advantages[idx] = group_advantages(rewards[idx], group_size=len(idx), scale_std=scale_std)
    return advantages
    # END SOLUTION


def zero_repair_advantages(trajs: list[Trajectory], advantages: torch.Tensor) -> torch.Tensor:
    """--repair-advantage zero, the phantom-success control: the accepted repairs (source "rectified" or
    "replaced") already counted in their groups' means (batch_advantages); here their own advantage becomes 0,
    so no gradient flows through their tokens while the group's other rollouts keep the shifted baseline."""
    keep = torch.tensor([t.source == "policy" for t in trajs], dtype=advantages.dtype)   # (N,)
    return advantages * keep


def train_on(run, trajs: list[Trajectory], advantages: torch.Tensor) -> dict:
    """Step 7: --updates-per-batch optimizer steps on the merged trajectories, one per mini-batch of whole groups
    (grpo.update_epoch: PPO ratio and clip on the policy's tokens, acting from the second mini-batch on; shaping
    on the refiner's; a truncated importance weight against vLLM's log-probs where the rollout engine returned
    them)."""
    a = run.args
    batch = build_batch([t.prompt_ids for t in trajs], [t.response_ids for t in trajs],
                        [t.offpolicy_mask for t in trajs], advantages, wiring.pad_or_eos(run.tokenizer),
                        sampler_logp=[t.sampler_logp for t in trajs]   # vLLM rollouts only (HF: none)
                        if a.tis_cap > 0 and any(t.sampler_logp for t in trajs) else None)
    batch = {k: v.to(run.device) for k, v in batch.items()}   # tensors (N, L); old_logp: grpo.update_epoch
    if run.use_vllm and a.rollout_sleep:
        run.generator.sleep()   # frees its weights and KV cache for the update; sync_weights wakes the weights
    dist.reshard(run.policy)   # FSDP2: drop the full weights a generation left gathered (else clipping misses them)
    run.policy.train()
    # bf16 autocast around each micro-batch's forward only (run.update_amp); under torchrun: this rank's groups,
    # with Z, the gradient and the metrics global
    stats = update_epoch(run.model, run.optimizer, batch, [t.group for t in trajs],
                         updates_per_batch=a.updates_per_batch, micro_batch_size=a.micro_batch_size,
                         max_grad_norm=1.0, chunk_tokens=a.logprob_chunk, amp=run.update_amp,
                         clip_eps=a.clip_eps, shaping_gamma=a.shaping_gamma, loss_agg=a.loss_agg,
                         offpolicy_credit=a.offpolicy_credit, max_new_tokens=a.max_new_tokens, kl_coef=a.kl_coef,
                         entropy_coef=a.entropy_coef, ref_model=run.ref_model, tis_cap=a.tis_cap,
                         temperature=a.temperature,   # log-probs of the distribution the rollouts came from
                         dist=run.dist if run.dist.world > 1 else None)
    run.policy.eval()
    return stats


def step_metrics(step: int, args: Args, rollouts: list[Trajectory], trained: list[Trajectory], traces: list[dict],
                 stats: dict, times: dict, unavailable: bool) -> tuple[dict, list[dict]]:
    """Everything logged about one step, computed once after it: the policy's own rollouts (comparable across
    modes), the PRM's view of the failures, the repairs, the update, the time per phase. Traces get the
    group's rewards before repair."""
    B, G = args.prompts_per_step, args.group_size
    passed = np.array([t.correct for t in rollouts]).reshape(B, G)
    failed_scored = [t for t in rollouts if not t.correct and t.step_scores is not None]
    accepted = [tr for tr in traces if tr["accepted"]]
    mean = wiring.mean
    m = {"step": step, "mode": args.mode,
         "reward_mean": float(passed.mean()), "frac_all_fail": float((~passed.any(1)).mean()),
         "frac_all_pass": float(passed.all(1).mean()),
         "response_len": float(np.mean([len(t.response_ids) for t in rollouts])),
         "trunc_frac": float(np.mean([not t.finished for t in rollouts])),   # hit max_new_tokens without a stop
         "near_miss_frac": near_miss_at_k([(len(t.steps), t.cut) for t in failed_scored], k=1) if failed_scored else None,
         "discarded_valid_frac": discarded_valid_share([t.keep_ratio for t in failed_scored]) if failed_scored else None,
         "refiner_unavailable": int(unavailable), "rectify_tried": len(traces), "rectify_accepted": len(accepted),
         # κ of what was actually kept: a whole-solution repair (mode replace, or a cut at step 0) keeps nothing
         "keep_ratio_steps": mean(tr["keep_ratio"] if tr["mode"] == "scope" else 0.0 for tr in accepted),
         "keep_ratio_tokens": mean(tr["keep_ratio_tokens"] if tr["mode"] == "scope" else 0.0 for tr in accepted),
         "rectify_all_fail": sum(not passed[tr["group"]].any() for tr in accepted),   # repairs in all-fail groups
         "reward_merged": float(np.mean([t.reward for t in trained])),
         "entropy": stats["entropy_policy"],   # mean over policy-written tokens, before the step
         "loss": stats["loss"], "grad_norm": stats["grad_norm"], "skipped": stats["skipped"],
         "clip_frac": stats.get("clip_frac"), "offpolicy_share": stats.get("offpolicy_share"),
         "tis_weight_mean": stats.get("tis_weight_mean"), "tis_capped_frac": stats.get("tis_capped_frac"),
         "pad_share": stats.get("pad_share"),   # padding share of the positions the update computed
         **{f"time_{k}": v for k, v in times.items()}}
    if args.toy_styles > 1:   # styles of the policy's own correct rollouts, before repair (toy.style_stats)
        styles = toy.style_stats([t.text for t in rollouts if t.correct], args.toy_styles)
        m.update(style_entropy_correct=styles["entropy"], style_share_correct=styles["share"],
                 style_other_correct=styles["other"])
    if args.toy and (args.toy_refiner_style != "prefix" or args.select_tiebreak != "length"
                     or args.repair_advantage != "keep"):   # every style, of all the policy's own rollouts
        styles = toy.style_stats([t.text for t in rollouts], len(toy.STYLES))
        m.update(style_share_all=styles["share"], style_other_all=styles["other"])
    rewards = {b: [t.reward for t in rollouts if t.group == b] for b in range(B)}
    traces = [{**tr, "group_rewards": rewards[tr["group"]], "group_all_fail": bool(not passed[tr["group"]].any())}
              for tr in traces]
    return m, traces


def main(args: Args) -> dict:
    run = wiring.start(args)   # pre-flight (a refusal is one line, exit 2), run folder, models, logs
    if run is None:
        return {"run_dir": preflight.run_dir_of(args), "dry_run": True}
    B, G = args.prompts_per_step, args.group_size
    mine = run.dist.groups(B)   # this rank's whole groups of the same B problems (all of them in one process)
    if run.start_step == 1 and args.eval_every:
        run.eval_before_training()   # step 0 of metrics.jsonl: the "before" of the closing summary
    for step in run.steps():
        times, t0 = {}, time.time()
        torch.manual_seed(seed_for(args.seed, step, "torch"))

        # ---------------------------------------------------------- 1. rollout: G samples per prompt, temperature 1.0
        with timed(times, "rollout"):
            rng = np.random.default_rng(seed_for(args.seed, step, "prompts"))
            n = len(run.train_problems)
            problems = [run.train_problems[i] for i in rng.choice(n, size=B, replace=n < B)]
            trajs = rollout(run, problems, mine, seed=seed_for(args.seed, step, "rollout"))

        # ---------------------------------------------------------- 2. grade: outcome reward 1/0 from the final \boxed{}
        for t in trajs:
            t.correct = grade(t.text, t.answer)
            t.reward = float(t.correct)

        # ---------------------------------------------------------- 3. PRM: score the steps, find each failure's first error
        with timed(times, "prm"), run.prm_on_device():   # back from CPU memory with --prm-offload
            if args.toy and run.prm:
                run.prm.reseed(seed_for(args.seed, step, "prm"))   # the toy PRM's noise: exact on resume
            locate_first_errors(trajs, run.prm, args, run.tokenizer)   # sets t.cut, t.prefix_len, ...
            if args.mode == "prm-reward":   # naive dense PRM reward (Table 3 row "RL with PRM reward")
                for t in trajs:
                    t.reward = float(t.correct) + args.prm_reward_coef * mean_score(t.step_scores or [])

        # ---------------------------------------------------------- 4. select the most promising failure of each group
        picks = select_failures(trajs, mine, args)   # (index, t.prefix_len)

        # ---------------------------------------------------------- 5. rectify: keep the prefix ids, refiner writes the rest
        with timed(times, "refine"):
            seed = seed_for(args.seed, step, "refine") + run.dist.offset(len(picks))   # the picks' global index
            merged, traces, unavailable = rectify_failures(run, trajs, picks, seed=seed)

        # ---------------------------------------------------------- 6. advantages over each merged group: A = r − mean(r)
        advantages = batch_advantages(merged, mine, args.adv_std)
        if args.repair_advantage == "zero":
            advantages = zero_repair_advantages(merged, advantages)

        # ---------------------------------------------------------- 7. update: --updates-per-batch optimizer steps
        with timed(times, "update"):
            stats = train_on(run, merged, advantages)

        # ---------------------------------------------------------- 8. sync: push the new weights into the rollout engine
        with timed(times, "sync"):
            if run.use_vllm:   # FSDP2: every rank gathers the full tensors for its own engine
                run.generator.sync_weights(dist.FullView(run.policy) if args.fsdp else run.policy)

        # ---------------------------------------------------------- 9. log, periodic eval, checkpoint
        trajs, merged, traces, unavailable = run.dist.gather(trajs, merged, traces, [unavailable])   # all ranks' rows
        m, traces = step_metrics(step, args, trajs, merged, traces, stats, times, any(unavailable))
        if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
            m["eval_acc"] = run.evaluate()
        m["time_step"] = time.time() - t0
        run.log(m, traces)   # metrics.jsonl, traces.jsonl, the step's line
        if run.dist.main:    # a few of the step's own rollouts, whole (harness/progress.py: rollouts.jsonl)
            progress.log_rollouts(run.run_dir, step, trajs, seed=seed_for(args.seed, step, "logged"))
        if step % args.save_every == 0 or step == args.steps:
            run.checkpoint(step)
    return run.finish()


# ============================================================ plumbing: the command line, seeds, timers



class OneLineErrors(argparse.ArgumentParser):
    """argparse whose refusals are one line naming the culprit and the --help hint, not the 40-line usage."""

    def error(self, message):
        self.exit(2, f"error: {message} (python scope.py --help lists every flag)\n")


def unknown_argument(word: str, flags: list[str]) -> str:
    """The refusal of a word argparse did not take: the closest flag when one is near ("--step" → "--steps")."""
    if not word.startswith("-"):
        near = difflib.get_close_matches("--" + word.replace("_", "-"), flags, n=1, cutoff=0.75)
        return f"unexpected argument '{word}'" + (f": did you mean {near[0]}?" if near else " (flags start with --)")
    flag = word.split("=", 1)[0]
    near = difflib.get_close_matches(flag.replace("_", "-"), flags, n=1, cutoff=0.6)
    return f"unknown flag {flag}" + (f": did you mean {near[0]}?" if near else "")


def parse_args(argv=None) -> Args:
    """Args from the command line. Precedence: flags typed > the resumed run's settings (config.json with the
    accepted changes of changes.jsonl) > --toy defaults > the dataclass defaults; a new --mode grpo run off the
    toy world gets --prm none unless --prm is typed. On a resume, a typed flag that changes training is refused by
    the pre-flight unless --change-config confirms it. A mistyped flag is one line naming the closest flag."""
    toy_line = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in TOY_DEFAULTS.items())
    parser = OneLineErrors(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                           epilog=f"--toy also sets, unless typed: {toy_line}")
    flags = ["--help"]
    for f in fields(Args):
        kind = dict(action=argparse.BooleanOptionalAction) if isinstance(f.default, bool) else dict(type=type(f.default))
        flags += parser.add_argument("--" + f.name.replace("_", "-"), help=f"{f.metadata['help']} (default: "
                                     f"{f.default!r})", choices=f.metadata["choices"], default=argparse.SUPPRESS,
                                     **kind).option_strings
    argv = cli.expand_config(list(sys.argv[1:] if argv is None else argv), asdict(Args()))   # --config's flags first
    known, unknown = parser.parse_known_args(argv)
    if unknown:   # TRL's name for one of our flags gets ours (harness/cli.py)
        parser.error(cli.trl_hint(unknown[0]) or unknown_argument(unknown[0], flags))
    typed = vars(known)   # only the flags on the command line (the rest are SUPPRESSed)
    values = asdict(Args())
    if typed.get("resume"):   # a checked config: missing folder/file, bad JSON or foreign keys stop in one line
        config = preflight.read_run_config(typed["resume"], set(values))   # flags it predates: as the run had them
        values.update(run_settings(config, read_changes(typed["resume"])))
        values.update(overwrite=False, dry_run=False, change_config=False)   # never inherited from the resumed run
    elif typed.get("toy"):
        values.update(TOY_DEFAULTS)
    values.update(typed)
    if values["mode"] == "grpo" and "prm" not in typed and not typed.get("resume") and not values["toy"]:
        values["prm"] = "none"   # GRPO uses no PRM: the 7B one for the near-miss metrics alone is asked for by name
    return Args(**values)


def seed_for(seed: int, step: int, phase: str) -> int:
    """A seed for one random phase of one step, derived from (seed, step, phase) only: resume is exact."""
    return int(np.random.SeedSequence([seed, step, zlib.crc32(phase.encode())]).generate_state(1)[0] % 2**31)


@contextmanager
def timed(times: dict, phase: str):
    t0 = time.time()
    yield
    times[phase] = time.time() - t0


if __name__ == "__main__":
    cli_args = parse_args()
    with wiring.calm_interrupt(cli_args):   # Ctrl-C / SIGTERM: one line with the --resume command, no traceback
        main(cli_args)
