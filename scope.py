"""scope.py — SCOPE training, top to bottom: one file that reads like the method.

SCOPE = Step-wise Correction for On-Policy Exploration (Ren et al., "Recycling Failures: Salvaging
Exploration in RLVR via Fine-Grained Off-Policy Guidance", arXiv 2602.24110). GRPO for maths in which a
failed rollout is not thrown away: a process reward model (PRM) finds its first wrong step, the policy's own
tokens before that step are kept, a refiner rewrites the rest, and the repaired trajectory rejoins its group.
One training step:

    rollout → grade → PRM first error of the failed rollouts → most promising failure per group →
    rectify (keep the token prefix, refiner writes the suffix, regrade) → advantages over the merged groups →
    old log-probs → update (PPO ratio on policy tokens, LUFFY shaping on refiner tokens) → weight sync →
    log → periodic eval → checkpoint

Run:
    python scope.py --toy                        # CPU toy world, one command: before/after accuracy (the first
                                                 # run also trains and caches the toy warm start under cache/)
    python scope.py --toy --mode grpo            # the on-policy baseline in the same world (also: replace, prm-reward)
    python scope.py --model Qwen2.5-1.5B         # the real path on one GPU (vLLM rollouts when installed)
    python scope.py --resume runs/NAME           # continue a run exactly where its last checkpoint left it
    python scope.py --help                       # every flag with its default

Choices this file makes (the paper leaves them open; each one is a flag unless said otherwise):
 1. `--mode` (paper Table 3): `scope`; `grpo` = no rectification; `replace` = the refiner writes a whole
    solution from an empty prefix for the same selected failure (every token off-policy, LUFFY-like);
    `prm-reward` = reward + λ · mean PRM step score, no refinement.
 2. Rectification is tried in every group with at least one failure (`--rectify-groups any`), or only in
    groups where every rollout failed (`all-fail`), once per group (the largest keep ratio); `replace`
    picks the same failure, so the two modes differ only in the kept prefix. Traces record the group's
    rewards before repair (`group_rewards`, `group_all_fail`); refiner tokens get LUFFY's shaped credit
    or, with `--offpolicy-credit unit`, −A·log π as if sampled.
 3. The PRM scores failed rollouts in every mode that loads one (`--prm none` skips it). In `grpo` mode its
    scores are only logged (near misses, discarded valid trajectories: paper Figs 3 and 7).
 4. `reward_mean`, `frac_all_fail`, `frac_all_pass` and `response_len` describe the policy's own rollouts
    (before rectification), so they compare across modes; `reward_merged` is the mean reward of the batch
    trained on; `entropy` is the mean over that batch's policy-written tokens (refiner tokens left out).
 5. `near_miss_frac` = near-miss@1 (N − K ≤ 1) and `discarded_valid_frac` = share with κ ≥ 0.5, both
    over the zero-reward rollouts the PRM scored (eval.near_miss_at_k, eval.discarded_valid_share).
 6. Every random draw derives from (seed, step): prompt sampling, generation, refinement, the toy PRM's
    noise. So `--resume` reproduces the metrics of an uninterrupted run exactly (tested on CPU).
 7. Real path on a GPU: the policy keeps float32 master weights (AdamW at lr 1e-6 would round away in
    bfloat16) and runs forward passes under bfloat16 autocast; PRM and refiner load in bfloat16.
 8. Periodic evaluation: `--eval-n` samples (1) per problem at temperature 0.6 (LUFFY harness) on `--eval-dataset`;
    `python eval.py` does the full protocol (avg@n, pass@k, diversity) on saved checkpoints.
 9. One checkpoint, `runs/<name>/checkpoint`, overwritten every `--save-every` steps and at the end
    (model, tokenizer, optimizer, RNG states, step), written to a temporary folder first then renamed.
"""
import argparse
import contextlib
import json
import os
import random
import shutil
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import torch
from tqdm import tqdm

from eval import discarded_valid_share, evaluate, grade, load_problems, near_miss_at_k
from generate import HFGenerator, format_prompt, load_causal_lm, load_tokenizer, vllm_importable
from grpo import build_batch, group_advantages, token_logprobs, update
from prm import cut_point, keep_ratio, mean_score, select_candidate, split_steps, step_token_spans
from refine import Refiner, Trajectory, rectify

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE_DIR = os.path.join(HERE, "cache")        # toy warm starts (gitignored)
MODES = ("scope", "grpo", "replace", "prm-reward")


def arg(default, help, choices=None):
    """A dataclass field whose help text (and choices) become its --flag."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class Args:
    # --- models
    model: str = arg("Qwen2.5-1.5B", "policy: HF id, local path or alias (Qwen2.5-1.5B, Qwen2.5-Math-1.5B, "
                     "Qwen2.5-Math-7B, ...-Instruct); with --toy: 'toy' (cached warm start) or a saved toy model")
    prm: str = arg("Qwen/Qwen2.5-Math-PRM-7B", "process reward model (HF id or path); 'none' = no PRM (grpo only)")
    refiner: str = arg("Qwen/Qwen2.5-Math-7B-Instruct", "refiner: HF id or path, or 'policy' (self-refinement); "
                       "with --toy: 'toy-oracle' (rule-based, never fails) or 'toy-model' (a stronger toy model "
                       "through Refiner + HF generate; can fail)")
    refiner_url: str = arg("", "OpenAI-compatible server (e.g. `vllm serve` of --refiner) to refine through")
    backend: str = arg("auto", "rollout engine; auto = vLLM when importable and CUDA present", ("auto", "vllm", "hf"))
    device: str = arg("auto", "auto = cuda when present; 'cpu' runs a real model on the CPU (slow)")
    # --- data
    dataset: str = arg("math-train", "training problems: anything eval.load_problems takes (name or .jsonl)")
    eval_dataset: str = arg("math500", "held-out problems for the periodic evaluation")
    eval_size: int = arg(500, "number of evaluation problems (0 = all)")
    eval_n: int = arg(1, "samples per evaluation problem (accuracy = avg@n at temperature 0.6)")
    # --- the algorithm
    mode: str = arg("scope", "scope | grpo (no rectification) | replace (whole solution) | prm-reward", MODES)
    steps: int = arg(500, "training steps (one rollout batch and one optimizer step each)")
    prompts_per_step: int = arg(16, "prompts per step (B)")
    group_size: int = arg(8, "rollouts per prompt (G)")
    max_new_tokens: int = arg(1024, "response budget in tokens (clamped to the model context)")
    temperature: float = arg(1.0, "rollout sampling temperature")
    tau: float = arg(0.5, "PRM threshold: the first step scored below it is the first error")
    refine_attempts: int = arg(2, "refiner attempts per selected failure (one batched call); first correct wins")
    refine_prompt: str = arg("continue", "refiner prompt: continue the prefix, or hint that a mistake follows",
                             ("continue", "hint"))
    merge: str = arg("replace", "a repaired trajectory replaces the failure, or joins the group",
                     ("replace", "append"))
    rectify_groups: str = arg("any", "groups eligible for rectification: any group with a failure, or only "
                              "groups where every rollout failed", ("any", "all-fail"))
    prm_reward_coef: float = arg(0.5, "λ of --mode prm-reward: reward = outcome + λ · mean PRM step score")
    # --- the update
    lr: float = arg(1e-6, "AdamW learning rate")
    loss_agg: str = arg("constant", "constant = Σ tokens / (N · max_new_tokens) (Dr. GRPO); token-mean",
                        ("constant", "token-mean"))
    clip_eps: float = arg(0.2, "PPO clip ε on policy tokens")
    shaping_gamma: float = arg(0.1, "LUFFY policy shaping γ on refiner tokens: f(π) = π / (π + γ)")
    offpolicy_credit: str = arg("shaped", "objective on refiner tokens: shaped = −f(π)·A (LUFFY); unit = −A·log π "
                                "(as if the policy had sampled them)", ("shaped", "unit"))
    adv_std: bool = arg(False, "divide group advantages by their std (GRPO) instead of mean-centring only")
    kl_coef: float = arg(0.0, "β of a k3 KL penalty to the initial policy (0 = no reference model)")
    entropy_coef: float = arg(0.0, "entropy bonus coefficient")
    micro_batch_size: int = arg(4, "sequences per forward/backward pass (and per HF generate batch)")
    # --- bookkeeping
    eval_every: int = arg(50, "evaluate every N steps (and before the first and after the last); 0 = never")
    save_every: int = arg(100, "checkpoint every N steps (and after the last)")
    seed: int = arg(0, "seed; every random draw derives from (seed, step)")
    run_name: str = arg("", "logs go to runs/<run_name>; default <mode>-<model>-s<seed>")
    resume: str = arg("", "continue the run in this folder (runs/<name>) from its checkpoint")
    toy: bool = arg(False, "the CPU toy world: tiny char-level Qwen2, rule-based PRM, oracle refiner")
    toy_prm_noise: float = arg(0.0, "toy world: probability that the toy PRM flips a step score")


# Applied with --toy unless the flag is typed. 30 steps take ~0.5 s each on 2 CPU cores once the warm start is cached.
TOY_DEFAULTS = dict(model="toy", prm="toy", refiner="toy-oracle", dataset="toy", eval_dataset="toy", eval_size=200,
                    backend="hf", device="cpu", steps=30, prompts_per_step=8, group_size=8, max_new_tokens=128,
                    lr=1e-4, micro_batch_size=64, eval_every=10, save_every=10)

MODEL_ALIASES = {name: f"Qwen/{name}" for name in (
    "Qwen2.5-0.5B", "Qwen2.5-1.5B", "Qwen2.5-3B", "Qwen2.5-7B", "Qwen2.5-0.5B-Instruct", "Qwen2.5-1.5B-Instruct",
    "Qwen2.5-3B-Instruct", "Qwen2.5-7B-Instruct", "Qwen2.5-32B-Instruct", "Qwen2.5-Math-1.5B", "Qwen2.5-Math-7B",
    "Qwen2.5-Math-1.5B-Instruct", "Qwen2.5-Math-7B-Instruct", "Qwen2.5-Math-PRM-7B")}


def parse_args(argv=None) -> Args:
    """Args from the command line. Precedence: flags typed > the resumed run's config.json > --toy defaults >
    the dataclass defaults."""
    toy_line = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in TOY_DEFAULTS.items())
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     epilog=f"--toy also sets, unless typed: {toy_line}")
    for f in fields(Args):
        kind = dict(action=argparse.BooleanOptionalAction) if isinstance(f.default, bool) else dict(type=type(f.default))
        parser.add_argument("--" + f.name.replace("_", "-"), help=f"{f.metadata['help']} (default: {f.default!r})",
                            choices=f.metadata["choices"], default=argparse.SUPPRESS, **kind)
    typed = vars(parser.parse_args(argv))   # only the flags on the command line (the rest are SUPPRESSed)
    values = asdict(Args())
    if typed.get("resume"):
        with open(os.path.join(typed["resume"], "config.json")) as f:
            values.update(json.load(f))
    elif typed.get("toy"):
        values.update(TOY_DEFAULTS)
    values.update(typed)
    return Args(**values)


def seed_for(seed: int, step: int, phase: str) -> int:
    """A seed for one random phase of one step, derived from (seed, step, phase) only: resume is exact."""
    return int(np.random.SeedSequence([seed, step, zlib.crc32(phase.encode())]).generate_state(1)[0] % 2**31)


@contextlib.contextmanager
def loading(name: str):
    """Turn a failed from_pretrained (missing weights, no network) into one clear error naming the model."""
    try:
        yield
    except (OSError, ValueError, RuntimeError) as e:   # prm.ProcessRewardModel wraps its OSError in a RuntimeError
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit(f"error: cannot load '{name}': {first_line}\n"
                         f"  Check the id or path. Without network access, download it first "
                         f"(`hf download {name}`) or pass a local folder.") from None


def problems_or_exit(source: str, **kw) -> list[dict]:
    """eval.load_problems, with a bad row, a missing file or no network as one clear error."""
    try:
        return load_problems(source, **kw)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: cannot load problems from '{source}': {e}") from None


def save_checkpoint(run_dir: str, step: int, model, tokenizer, optimizer) -> None:
    """runs/<name>/checkpoint: model + tokenizer (save_pretrained), optimizer, RNG states, step."""
    from transformers.utils import logging as hf_logging

    final, tmp = os.path.join(run_dir, "checkpoint"), os.path.join(run_dir, "checkpoint.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    hf_logging.disable_progress_bar()   # keep the per-step lines readable
    model.save_pretrained(tmp)
    hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(tmp)
    torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
    torch.save({"step": step, "python": random.getstate(), "numpy": np.random.get_state(),
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
               os.path.join(tmp, "state.pt"))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def truncate_jsonl(path: str, last_step: int) -> None:
    """Drop lines logged after the checkpoint we resume from (a run killed between two checkpoints)."""
    if os.path.exists(path):
        with open(path) as f:
            lines = [line for line in f if json.loads(line)["step"] <= last_step]
        with open(path, "w") as f:
            f.writelines(lines)


def mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def main(args: Args) -> dict:
    t_start = time.time()
    if args.mode not in MODES:
        raise SystemExit(f"error: --mode {args.mode!r}; choose from {MODES}")

    # ------------------------------------------------------------------ run folder, seeding, device
    run_name = args.run_name or f"{args.mode}-{os.path.basename(args.model.rstrip('/'))}-s{args.seed}"
    run_dir = args.resume or os.path.join("runs", run_name)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump({**asdict(args), "resume": ""}, f, indent=1)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    if args.toy:
        torch.set_num_threads(1)   # a 0.3 M-parameter model gains nothing from threads; on a shared 2-core machine
                                   # two threads per process were ~15x slower (oversubscription)
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    use_vllm = args.backend == "vllm" or (args.backend == "auto" and cuda and vllm_importable())
    if use_vllm and not vllm_importable():
        raise SystemExit("error: --backend vllm, but vllm is not installed (GPU: pip install vllm==0.33.0)")

    # ------------------------------------------------------------------ data (first: a bad file fails fast)
    train_problems = problems_or_exit(args.dataset, split="train")   # toy: another seed than the held-out set
    eval_problems = problems_or_exit(args.eval_dataset, limit=args.eval_size or None)

    # ------------------------------------------------------------------ models: policy, rollout engine, PRM, refiner
    if args.mode in ("scope", "replace", "prm-reward") and args.prm == "none":
        raise SystemExit(f"error: --mode {args.mode} needs a PRM (--prm none only suits --mode grpo)")
    if args.toy:
        import toy
    if args.toy and args.model == "toy":
        toy.warm_start(CACHE_DIR, seed=0)   # SFT warm start, trained once and cached: the toy "pretrained model"
        base_path = toy.cache_path(CACHE_DIR, seed=0)
    else:
        base_path = MODEL_ALIASES.get(args.model, args.model)
    if not cuda and not args.toy:
        print(f"warning: no GPU. Training {base_path} on the CPU takes minutes to hours per step "
              f"({args.prompts_per_step}x{args.group_size} rollouts of up to {args.max_new_tokens} tokens); "
              f"`--toy` shows the method on a CPU in minutes.", file=sys.stderr)
        if args.device == "auto":
            raise SystemExit("error: no CUDA device found; pass --device cpu to train on the CPU anyway.")
    ckpt = os.path.join(run_dir, "checkpoint")
    resuming = bool(args.resume) and os.path.isdir(ckpt)
    if args.resume and not resuming:
        print(f"no checkpoint in {run_dir}: starting from step 1")
    with loading(ckpt if resuming else base_path):   # float32 master weights (bf16 would round lr-1e-6 steps away)
        policy, tokenizer = load_causal_lm(ckpt if resuming else base_path, device, torch.float32)
    n_params = sum(p.numel() for p in policy.parameters())
    ref_model = None
    if args.kl_coef > 0:   # the KL reference is the model we started from, also after a resume
        with loading(base_path):
            ref_model = load_causal_lm(base_path, device, torch.float32)[0].eval().requires_grad_(False)

    if use_vllm:   # in-process engine; its weights follow the policy through sync_weights after every update
        from generate import VLLMGenerator
        generator = VLLMGenerator(ckpt if resuming else base_path, tokenizer=tokenizer, seed=args.seed)
    else:
        generator = HFGenerator(policy, tokenizer, micro_batch_size=args.micro_batch_size)

    prm = refiner = None   # the toy world plugs in stand-ins that answer the same calls as the real models
    if args.prm != "none" and args.toy:
        prm = toy.ToyPRM(args.toy_prm_noise, seed=args.seed)
    elif args.prm != "none":
        from prm import ProcessRewardModel
        with loading(args.prm):
            prm = ProcessRewardModel(args.prm, device=device, dtype=torch.bfloat16 if cuda else None)
    if args.mode in ("scope", "replace"):
        if args.refiner == "policy":   # self-refinement: the current policy, through the same engine
            refiner = Refiner(generator, tokenizer, prompt_style=args.refine_prompt)
        elif args.toy and args.refiner == "toy-model":   # the real refiner code path with a stronger toy model
            refiner_model, refiner_tokenizer = toy.refiner_model(CACHE_DIR, seed=0)
            refiner = Refiner(HFGenerator(refiner_model.eval(), refiner_tokenizer, args.micro_batch_size),
                              refiner_tokenizer, prompt_style=args.refine_prompt)
        elif args.toy and args.refiner in ("toy-oracle", "toy"):
            refiner = toy.OracleRefiner()
        elif args.toy:
            raise SystemExit(f"error: --toy --refiner {args.refiner!r}; choose toy-oracle, toy-model or policy")
        elif args.refiner_url:         # a big refiner served elsewhere (`vllm serve MODEL`)
            from generate import OpenAIGenerator
            with loading(args.refiner):
                refiner_tokenizer = load_tokenizer(args.refiner)
            refiner = Refiner(OpenAIGenerator(args.refiner_url, args.refiner, refiner_tokenizer), refiner_tokenizer,
                              prompt_style=args.refine_prompt)
        else:   # vLLM allows one engine per process: a separate refiner runs through HF generate
            with loading(args.refiner):
                refiner_model, refiner_tokenizer = load_causal_lm(args.refiner, device)   # bf16 on CUDA
            refiner = Refiner(HFGenerator(refiner_model.eval(), refiner_tokenizer, args.micro_batch_size),
                              refiner_tokenizer, prompt_style=args.refine_prompt)

    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    start_step = 1
    if resuming:
        optimizer.load_state_dict(torch.load(os.path.join(ckpt, "optimizer.pt"), map_location=device))
        state = torch.load(os.path.join(ckpt, "state.pt"), weights_only=False)
        restore_rng(state)
        start_step = state["step"] + 1
        for name in ("metrics.jsonl", "traces.jsonl"):
            truncate_jsonl(os.path.join(run_dir, name), state["step"])
        print(f"resumed {run_dir} at step {start_step}")
    metrics_file = open(os.path.join(run_dir, "metrics.jsonl"), "a" if resuming else "w")
    traces_file = open(os.path.join(run_dir, "traces.jsonl"), "a" if resuming else "w")
    print(f"{run_dir}: {args.mode}, policy {n_params / 1e6:.2f} M params on {device} "
          f"({'vLLM' if use_vllm else 'HF generate'}), {len(train_problems)} train / {len(eval_problems)} eval problems")

    def run_eval() -> float:
        with amp():
            result = evaluate(generator, tokenizer, eval_problems, n=args.eval_n, temperature=0.6,
                              max_new_tokens=args.max_new_tokens, seed=args.seed, batch_size=64)
        return result["acc"]

    summary = {"run_dir": run_dir}
    if start_step == 1 and args.eval_every:
        summary["eval_acc_before"] = run_eval()
        metrics_file.write(json.dumps({"step": 0, "mode": args.mode, "eval_acc": summary["eval_acc_before"]}) + "\n")
        metrics_file.flush()
        print(f"eval before training: acc {summary['eval_acc_before']:.3f}")

    B, G = args.prompts_per_step, args.group_size
    history = []   # this process's metrics, for the closing summary
    for step in tqdm(range(start_step, args.steps + 1), initial=start_step - 1, total=args.steps, desc="steps",
                     disable=not sys.stderr.isatty()):
        t0 = time.time()
        torch.manual_seed(seed_for(args.seed, step, "torch"))
        m = {"step": step, "mode": args.mode}

        # ---------------------------------------------------------- 1. rollout: G samples per prompt, temperature 1.0
        rng = np.random.default_rng(seed_for(args.seed, step, "prompts"))
        problems = [train_problems[i] for i in rng.choice(len(train_problems), size=B, replace=len(train_problems) < B)]
        prompts = [format_prompt(tokenizer, p["question"]) for p in problems]
        policy.eval()
        with amp():
            completions = generator.generate(prompts, n=G, temperature=args.temperature, max_tokens=args.max_new_tokens,
                                             seed=seed_for(args.seed, step, "rollout"))
        trajs = [Trajectory(question=p["question"], answer=p["answer"], group=b, prompt_ids=prompts[b],
                            response_ids=list(c.ids), text=c.text)
                 for b, (p, group) in enumerate(zip(problems, completions)) for c in group]
        m["time_rollout"] = time.time() - t0

        # ---------------------------------------------------------- 2. grade: outcome reward 1/0 from the final \boxed{}
        for t in trajs:
            t.correct = grade(t.text, t.answer)
            t.reward = float(t.correct)
        passed = np.array([t.correct for t in trajs]).reshape(B, G)
        m["reward_mean"] = float(passed.mean())
        m["frac_all_fail"] = float((~passed.any(1)).mean())
        m["frac_all_pass"] = float(passed.all(1).mean())
        m["response_len"] = float(np.mean([len(t.response_ids) for t in trajs]))

        # ---------------------------------------------------------- 3. PRM: score the steps, find each failure's first error
        t1 = time.time()
        if args.toy and prm:   # the toy PRM's noise has its own RNG: reseed it from (seed, step) so resume is exact
            prm = toy.ToyPRM(args.toy_prm_noise, seed=seed_for(args.seed, step, "prm"))
        scored = [t for t in trajs if args.mode == "prm-reward" or not t.correct] if prm else []
        prefix_len = {}   # id(trajectory) -> tokens before its first error
        if scored:
            for t in scored:
                t.steps = split_steps(t.text)
            for t, scores in zip(scored, prm.score_batch([t.question for t in scored], [t.steps for t in scored])):
                t.step_scores = scores
                t.cut = cut_point(scores, args.tau)
                t.keep_ratio = keep_ratio(t.cut, len(t.steps))
                spans = step_token_spans(t.response_ids, t.steps, tokenizer)
                prefix_len[id(t)] = spans[t.cut][0] if t.cut < len(spans) else len(t.response_ids)
                t.keep_ratio_tokens = prefix_len[id(t)] / max(1, len(t.response_ids))
        failed_scored = [t for t in scored if not t.correct]
        m["near_miss_frac"] = near_miss_at_k([(len(t.steps), t.cut) for t in failed_scored], k=1) if failed_scored else None
        m["discarded_valid_frac"] = discarded_valid_share([t.keep_ratio for t in failed_scored]) if failed_scored else None
        if args.mode == "prm-reward":   # naive dense PRM reward (Table 3 row "RL with PRM reward")
            for t in scored:
                t.reward = float(t.correct) + args.prm_reward_coef * mean_score(t.step_scores)
        m["time_prm"] = time.time() - t1

        # ---------------------------------------------------------- 4. select the most promising failure of each group
        picks = []
        if args.mode in ("scope", "replace"):
            for b in range(B):
                idx = [i for i, t in enumerate(trajs) if t.group == b and not t.correct]
                if not idx or (args.rectify_groups == "all-fail" and passed[b].any()):
                    continue   # all-fail: a group with a success keeps its on-policy signal untouched
                j = select_candidate([trajs[i].keep_ratio for i in idx],
                                     [mean_score(trajs[i].step_scores[:trajs[i].cut]) for i in idx],
                                     [len(trajs[i].response_ids) for i in idx])
                if j is not None:   # replace: same pick, empty prefix, the refiner writes everything
                    picks.append((idx[j], 0 if args.mode == "replace" else prefix_len[id(trajs[idx[j]])]))

        # ---------------------------------------------------------- 5. rectify: keep the prefix ids, refiner writes the rest
        t1 = time.time()
        traces = []
        group_rewards = {b: [t.reward for t in trajs if t.group == b] for b in range(B)}   # before repair
        if picks:
            with amp():
                trajs, traces = rectify(trajs, picks, refiner, tokenizer, attempts=args.refine_attempts, merge=args.merge,
                                        max_new_tokens=args.max_new_tokens, grade_fn=grade,
                                        seed=seed_for(args.seed, step, "refine"))
        accepted = [tr for tr in traces if tr["accepted"]]
        m["rectify_tried"], m["rectify_accepted"] = len(traces), len(accepted)
        # κ of what was actually kept: a whole-solution repair (mode replace, or a cut at step 0) keeps nothing
        m["keep_ratio_steps"] = mean(tr["keep_ratio"] if tr["mode"] == "scope" else 0.0 for tr in accepted)
        m["keep_ratio_tokens"] = mean(tr["keep_ratio_tokens"] if tr["mode"] == "scope" else 0.0 for tr in accepted)
        m["rectify_all_fail"] = sum(not passed[tr["group"]].any() for tr in accepted)   # repairs in all-fail groups
        for tr in traces:
            traces_file.write(json.dumps({"step": step, **tr, "group_rewards": group_rewards[tr["group"]],
                                          "group_all_fail": bool(not passed[tr["group"]].any())}) + "\n")
        m["time_refine"] = time.time() - t1

        # ---------------------------------------------------------- 6. advantages over each merged group: A = r − mean(r)
        rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)            # (N,)
        advantages = torch.zeros_like(rewards)                                             # (N,)
        for b in range(B):   # groups are ragged with --merge append
            idx = torch.tensor([i for i, t in enumerate(trajs) if t.group == b])
            advantages[idx] = group_advantages(rewards[idx], group_size=len(idx), scale_std=args.adv_std)
        m["reward_merged"] = float(rewards.mean())

        # ---------------------------------------------------------- 7. update: old log-probs, then one optimizer step
        t1 = time.time()
        batch = build_batch([t.prompt_ids for t in trajs], [t.response_ids for t in trajs],
                            [t.offpolicy_mask for t in trajs], advantages, tokenizer.pad_token_id)
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.no_grad(), amp():
            batch["old_logp"], entropy = token_logprobs(policy, batch["input_ids"], batch["attention_mask"],
                                                        batch["response_mask"], args.micro_batch_size)  # (N, L)
        on_policy = batch["response_mask"] * (1 - batch["offpolicy_mask"])                            # (N, L)
        m["entropy"] = float((entropy * on_policy).sum() / on_policy.sum().clamp(min=1))
        policy.train()
        with amp():
            stats = update(policy, optimizer, batch, micro_batch_size=args.micro_batch_size, max_grad_norm=1.0,
                           clip_eps=args.clip_eps, shaping_gamma=args.shaping_gamma, loss_agg=args.loss_agg,
                           offpolicy_credit=args.offpolicy_credit,
                           max_new_tokens=args.max_new_tokens, kl_coef=args.kl_coef, entropy_coef=args.entropy_coef,
                           ref_model=ref_model)
        policy.eval()
        m.update(loss=stats["loss"], grad_norm=stats["grad_norm"], skipped=stats["skipped"],
                 clip_frac=stats.get("clip_frac"), offpolicy_share=stats.get("offpolicy_share"))
        m["time_update"] = time.time() - t1

        # ---------------------------------------------------------- 8. sync: push the new weights into the rollout engine
        t1 = time.time()
        if use_vllm:
            generator.sync_weights(policy)
        m["time_sync"] = time.time() - t1

        # ---------------------------------------------------------- 9. periodic eval, log, checkpoint
        if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
            m["eval_acc"] = summary["eval_acc_after"] = run_eval()
        m["time_step"] = time.time() - t0
        metrics_file.write(json.dumps(m) + "\n")
        metrics_file.flush()
        traces_file.flush()
        tqdm.write(summary_line(m))
        history.append(m)
        if step % args.save_every == 0 or step == args.steps:
            save_checkpoint(run_dir, step, policy, tokenizer, optimizer)

    metrics_file.close()
    traces_file.close()
    summary["minutes"] = (time.time() - t_start) / 60
    before, after = summary.get("eval_acc_before"), summary.get("eval_acc_after")
    print(f"\ndone in {summary['minutes']:.1f} min. eval accuracy: before {_fmt(before)} → after {_fmt(after)}")
    if history:
        k = max(1, len(history) // 5)
        print(f"train reward of the policy's rollouts: first {k} steps {mean(h['reward_mean'] for h in history[:k]):.3f}"
              f" → last {k} steps {mean(h['reward_mean'] for h in history[-k:]):.3f}; rectifications accepted "
              f"{sum(h['rectify_accepted'] for h in history)}/{sum(h['rectify_tried'] for h in history)}")
    print(f"logs: {run_dir}/metrics.jsonl, {run_dir}/traces.jsonl; checkpoint: {run_dir}/checkpoint\n"
          f"plot: python eval.py --plot {run_dir}    rectifications: python eval.py --trace {run_dir}")
    return summary


def summary_line(m: dict) -> str:
    """One line per step with the numbers a person acts on."""
    kr = m["keep_ratio_steps"]
    text = (f"step {m['step']:4d} | reward {m['reward_mean']:.3f} (trained {m['reward_merged']:.3f}) | "
            f"all-fail {m['frac_all_fail']:.2f} all-pass {m['frac_all_pass']:.2f} | "
            f"rectified {m['rectify_accepted']}/{m['rectify_tried']} ({m['rectify_all_fail']} all-fail) κ {_fmt(kr)} | "
            f"len {m['response_len']:.0f} H {m['entropy']:.3f} | loss {m['loss']:+.4f} gn {m['grad_norm']:.3f}"
            f"{' SKIPPED' if m['skipped'] else ''} | {m['time_step']:.1f}s (roll {m['time_rollout']:.1f} "
            f"prm {m['time_prm']:.1f} ref {m['time_refine']:.1f} upd {m['time_update']:.1f})")
    return text + (f" | eval {m['eval_acc']:.3f}" if "eval_acc" in m else "")


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


if __name__ == "__main__":
    main(parse_args())
