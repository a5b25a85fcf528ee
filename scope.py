"""scope.py — SCOPE training, one step top to bottom (Ren et al., "Recycling Failures: Salvaging Exploration in
RLVR via Fine-Grained Off-Policy Guidance", arXiv 2602.24110). GRPO for maths in which a failed rollout is not
thrown away: a process reward model finds its first wrong step, the policy's own tokens before it are kept, a
refiner rewrites the rest, and the repair rejoins its group. `main` is the step, in nine numbered phases:

    rollout → grade → PRM first error (prm.py) → most promising failure per group (prm.py) → rectify (refine.py)
    → advantages over the merged groups → update (grpo.py) → weight sync → log, eval, checkpoint

Run: `python scope.py --toy` (CPU toy world), `--model Qwen2.5-1.5B` (one GPU), `--resume runs/NAME`, `--dry-run`,
`--help` (every flag); several GPUs: docs/scaling.md. The paper's knobs are `Args` below, the engine's flags
harness/run/config.py, each open choice one row of docs/choices.md; the engine is behind `run.*` (harness/run/wiring.py).
"""
from dataclasses import dataclass
from functools import partial

import eval as evaluation   # `eval` would shadow the builtin
import grpo
import prm
import refine
from grpo import build_batch, group_advantages, logprobs_and_entropy, update, warmup_lr, zero_repair_advantages
from harness.run import config, wiring
from harness.run.config import arg
from harness.data.grader import grade
from prm import TIEBREAKS, locate_first_errors, select_failures
from refine import rectify, repair_credit_only

MODES = ("scope", "grpo", "replace", "prm-reward")


# From Python: main({"toy": True, "steps": 5, "run_name": "nb"}) or main(Args(toy=True, ...)), resolved as typed
# flags; a refusal raises harness.run.runs.Refused (a ValueError naming the keys: run_name=...), a dry run returns its plan
@config.library_call(lambda: Args)
def main(args: "Args | dict") -> dict:
    """One training run; returns its closing summary, a dict (from Python: the decorator's comment above)."""
    run = wiring.start(args, paper())   # pre-flight (a refusal is one line, exit 2), run folder, models, logs
    run.eval_before_training()   # a new run with --eval-every: step 0's accuracy, the "before" of the summary
    for step, problems, mine in run.steps():   # B problems drawn from (seed, step); `mine`: this rank's groups
        # ---------------------------------------------- 1. rollout: G samples per prompt, token ids kept
        trajs = run.rollout(problems, mine)   # with --overlap-old-logp it also starts π_old's pass over them
        # ---------------------------------------------- 2. grade: outcome reward 1/0 from the final \boxed{}
        for t, correct in zip(trajs, [grade(t.text, t.answer) for t in trajs]):
            t.correct, t.reward = correct, float(correct)
        # ---------------------------------------------- 3. PRM: score the failures' steps, find each first error
        # (--mode prm-reward: every rollout is scored and its reward becomes outcome + λ · mean step score)
        with run.prm_phase():   # moves the PRM, no data changed; the next line writes the failures' PRM facts
            locate_first_errors(trajs, run.prm, run.tokenizer, args.tau, args.mode, args.prm_reward_coef)
        # ---------------------------------------------- 4. select the most promising failure of each group
        picks = select_failures(trajs, mine, args.mode, args.rectify_groups, args.select_tiebreak)
        # ---------------------------------------------- 5. rectify: keep the prefix ids, a refiner writes the rest
        merged, traces = trajs, []   # also what a refiner that stopped answering leaves (a warning, no repair)
        with run.refine_phase(picks) as seed:   # no data changed; seed: from (seed, step) and the picks' global index
            merged, traces = rectify(trajs, picks, run.refiner, run.tokenizer, attempts=args.refine_attempts,
                                     merge=args.merge, max_new_tokens=args.max_new_tokens, grade_fn=grade, seed=seed)
        # ---------------------------------------------- 6. advantages over each merged group: A = r − mean(r)
        groups = [t.group for t in merged]
        advantages = group_advantages([t.reward for t in merged], groups=groups, scale_std=args.adv_std)
        advantages = zero_repair_advantages(merged, advantages) if args.repair_advantage == "zero" else advantages
        # ---------------------------------------------- 7. update: --updates-per-batch optimizer steps at the step's lr
        batch = build_batch([t.prompt_ids for t in merged], [t.response_ids for t in merged],
                            [t.offpolicy_mask for t in merged], advantages, run.pad_id)
        batch = repair_credit_only(batch, merged, args.repair_credit)   # "all" unless a credit-split control
        batch = run.with_sampler_logprobs(batch, merged)   # + vLLM's log-probs of the policy's tokens, for TIS
        batch = run.with_old_logprobs(batch, merged)   # + π_old from the pass the rollout started, if any
        with run.update_phase():   # the policy in train mode (vLLM asleep, FSDP2 resharded): no data changed
            stats = update(run.model, run.optimizer, run.on_device(batch), groups, clip_eps=args.clip_eps,
                           updates_per_batch=args.updates_per_batch, offpolicy_credit=args.offpolicy_credit,
                           loss_agg=args.loss_agg, max_new_tokens=args.max_new_tokens, shaping_gamma=args.shaping_gamma,
                           kl_coef=args.kl_coef, ref_model=run.ref_model, entropy_coef=args.entropy_coef,
                           tis_cap=args.tis_cap, temperature=args.temperature, max_grad_norm=args.max_grad_norm,
                           lr=warmup_lr(args.lr, step, args.warmup_steps),   # --lr, after a linear --warmup-steps
                           **run.update_engine())   # micro-batches, chunks, autocast, torchrun: the loss unchanged
        # ---------------------------------------------- 8. sync: push the new weights into the rollout engine
        run.push_weights()
        # ---------------------------------------------- 9. log, periodic eval, checkpoint
        run.end_step(step, trajs, merged, traces, stats)
    return run.finish()


def paper() -> wiring.Paper:
    """What the engine builds and calls from this layer (harness/ imports nothing from the five top-level files)."""
    return wiring.Paper(refine.Trajectory, prm.ProcessRewardModel, evaluation.evaluate,
                        evaluation.near_miss_at_k, evaluation.discarded_valid_share, logprobs_and_entropy,
                        refine.refiner_prompt)


@dataclass
class Args(config.EngineArgs):
    """The paper's knobs (the engine's flags: harness/run/config.py). Each help text is its `--help` line."""
    # --- the three models and the data
    model: str = arg("Qwen2.5-1.5B", "policy: HF id, local path or alias (Qwen2.5-1.5B, Qwen2.5-Math-1.5B, "
                     "Qwen2.5-Math-7B, ...-Instruct); with --toy: 'toy' (cached warm start) or a saved toy model")
    prm: str = arg("Qwen/Qwen2.5-Math-PRM-7B", "process reward model (HF id or path); 'none' = no PRM (grpo "
                   "only, and --mode grpo's default off the toy world: there a PRM only feeds the near-miss metrics)")
    refiner: str = arg("Qwen/Qwen2.5-Math-7B-Instruct", "refiner: HF id or path, or 'policy' (self-refinement); "
                       "with --toy: 'toy-oracle' (rule-based, never fails) or 'toy-model' (a stronger toy model "
                       "through Refiner + HF generate; can fail)")
    dataset: str = arg("math-train", "training problems: anything harness.data.problems.load_problems takes (name or .jsonl)")
    # --- the step
    mode: str = arg("scope", "scope | grpo (no rectification) | replace (whole solution) | prm-reward", MODES)
    steps: int = arg(500, "training steps (one rollout batch each, --updates-per-batch optimizer steps on it)")
    prompts_per_step: int = arg(16, "prompts per step (B)")
    group_size: int = arg(8, "rollouts per prompt (G)")
    max_new_tokens: int = arg(1024, "response budget in tokens (clamped to the model context)")
    temperature: float = arg(1.0, "rollout sampling temperature")
    seed: int = arg(0, "seed; every random draw derives from (seed, step)")
    # --- first error, pick, rectification (steps 3-5)
    tau: float = arg(0.5, "PRM threshold: the first step scored below it is the first error")
    rectify_groups: str = arg("any", "groups eligible for rectification: any group with a failure, or only "
                              "groups where every rollout failed", ("any", "all-fail"))
    select_tiebreak: str = arg("length", "how the pick among equally promising failures is broken: the shorter "
                               "rollout, or the earlier index (favours no phrasing; in the toy world an empty "
                               "prefix's oracle style is then drawn from the warm start's styles)",
                               TIEBREAKS)
    refine_attempts: int = arg(2, "refiner attempts per selected failure (one batched call); first correct wins")
    refiner_max_tokens: int = arg(640, "most new tokens a refiner suffix may take (and at most --max-new-tokens minus "
                                  "the kept prefix); a suffix cut there is graded like any other: rejected unless "
                                  "its text already holds the right answer")
    refine_prompt: str = arg("continue", "refiner prompt: continue the prefix, or hint that a mistake follows "
                             "(refine.refiner_prompt)", refine.REFINE_PROMPTS)
    merge: str = arg("replace", "a repaired trajectory replaces the failure, or joins the group", refine.MERGES)
    prm_reward_coef: float = arg(0.5, "λ of --mode prm-reward: reward = outcome + λ · mean PRM step score")
    repair_advantage: str = arg("keep", "zero = an accepted repair counts in its group's mean, then its own "
                                "advantage is set to 0 (the 'phantom success' control: the mean shift without "
                                "the repair's content; N and the loss normaliser unchanged)", ("keep", "zero"))
    repair_credit: str = arg("all", "which of an accepted repair's tokens carry loss: all, or only the kept prefix "
                             "or only the refiner's suffix (credit-split controls; reward and advantage unchanged)",
                             ("all", "prefix", "suffix"))
    # --- advantages and the update (steps 6-7)
    adv_std: bool = arg(False, "divide group advantages by their std (GRPO) instead of mean-centring only")
    lr: float = arg(1e-6, "AdamW learning rate")
    warmup_steps: int = arg(0, "the learning rate rises linearly from lr/N to --lr over the first N steps; 0 = constant")
    max_grad_norm: float = arg(1.0, "the update's gradient is clipped to this norm before each optimizer step "
                               "(inf = no clip)")
    updates_per_batch: int = arg(2, "optimizer steps per rollout batch, one per mini-batch of whole groups (LUFFY: "
                                 "2); above 1, one no-grad pass gives π_old first, so the PPO ratio and clip act "
                                 "from the second mini-batch on; 1 = ρ ≡ 1, the clip never binds")
    clip_eps: float = arg(0.2, "PPO clip ε on the policy's tokens: ρ clipped to [1 − ε, 1 + ε]; it binds only "
                          "with --updates-per-batch > 1; inf = no clip (LUFFY's script)")
    shaping_gamma: float = arg(0.1, "LUFFY policy shaping γ on refiner tokens: f(π) = π / (π + γ)")
    offpolicy_credit: str = arg("shaped", "objective on refiner tokens: shaped = −f(π)·A (LUFFY); unit = −A·log π "
                                "(as if the policy had sampled them)", grpo.OFFPOLICY_CREDITS)
    loss_agg: str = arg("constant", "constant = Σ tokens / (N · max_new_tokens) (Dr. GRPO); token-mean", grpo.LOSS_AGGS)
    kl_coef: float = arg(0.0, "β of a k3 KL penalty to the initial policy (0 = no reference model)")
    entropy_coef: float = arg(0.0, "entropy bonus coefficient")


parse_args = partial(config.parse_args, Args, description="\n\n".join(__doc__.split("\n\n")[:2]))   # + the phases

if __name__ == "__main__":
    cli_args = parse_args()
    with config.run_interrupt(cli_args):   # Ctrl-C / SIGTERM: one line with the --resume command, no traceback
        main(cli_args)
