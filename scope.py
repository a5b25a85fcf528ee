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
    python scope.py --toy                        # CPU toy world, one command: before/after accuracy (the first
                                                 # run also trains and caches the toy warm start under cache/)
    python scope.py --toy --mode grpo            # the on-policy baseline in the same world (also: replace, prm-reward)
    python scope.py --model Qwen2.5-1.5B         # the real path on one GPU (vLLM rollouts when installed)
    python scope.py --resume runs/NAME           # continue a run exactly where its last checkpoint left it
    python scope.py --model Qwen2.5-1.5B --dry-run   # the pre-flight only: memory plan and resolved Args
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
 9. One checkpoint, `runs/<name>/checkpoint`, replaced every `--save-every` steps and at the end
    (model, tokenizer, optimizer, RNG states, step) without a moment in which no complete one exists;
    a run folder is never clobbered and is locked while a run uses it (runs.py).
10. Before anything loads or is written, the pre-flight (preflight.py) checks every flag, the run folder,
    the GPU, the network, the data and the memory plan; a refusal is one line and exit code 2.
"""
import argparse
import atexit
import contextlib
import json
import os
import random
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import torch
from tqdm import tqdm

from harness import preflight
from eval import discarded_valid_share, evaluate, near_miss_at_k
from harness.generate import GeneratorUnavailable, HFGenerator, format_prompt, load_causal_lm, load_tokenizer, vllm_importable
from harness.grader import grade
from grpo import build_batch, group_advantages, update
from prm import cut_point, keep_ratio, mean_score, select_candidate, split_steps, step_token_spans
from harness.preflight import MODEL_ALIASES
from refine import Refiner, Trajectory, rectify
from harness.runs import acquire_lock, clear_run, recover_checkpoint, release_lock, restore_rng, save_checkpoint, truncate_jsonl

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
    refiner_mem: float = arg(0.25, "GPU memory share of the refiner's own `vllm serve` (started when vLLM is "
                             "installed and --refiner is a separate model without --refiner-url)")
    refiner_timeout: float = arg(600.0, "seconds one served-refiner request may take (2 retries; then the step "
                                 "goes on without rectification)")
    backend: str = arg("auto", "rollout engine; auto = vLLM when importable and CUDA present", ("auto", "vllm", "hf"))
    device: str = arg("auto", "auto = cuda when present; 'cpu' runs a real model on the CPU (slow)")
    # --- data
    dataset: str = arg("math-train", "training problems: anything problems.load_problems takes (name or .jsonl)")
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
    overwrite: bool = arg(False, "allow starting from step 1 in a folder holding a run (a new run under a used "
                          "--run-name, or --resume of a folder without checkpoint): its logs are replaced")
    memory_check: bool = arg(True, "stop before loading when the memory plan (an estimate) exceeds the GPU; "
                             "--no-memory-check starts anyway")
    dry_run: bool = arg(False, "run the pre-flight (flags, folder, data, memory plan), print the resolved Args, exit")


# Applied with --toy unless the flag is typed. 30 steps take ~0.5 s each on 2 CPU cores once the warm start is cached.
TOY_DEFAULTS = dict(model="toy", prm="toy", refiner="toy-oracle", dataset="toy", eval_dataset="toy", eval_size=200,
                    backend="hf", device="cpu", steps=30, prompts_per_step=8, group_size=8, max_new_tokens=128,
                    lr=1e-4, micro_batch_size=64, eval_every=10, save_every=10)

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
    if typed.get("resume"):   # a checked config: missing folder/file, bad JSON or foreign keys stop in one line
        values.update(preflight.read_run_config(typed["resume"], set(values)))
        values.update(overwrite=False, dry_run=False)   # never inherited from the resumed run
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


def mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def base_model_path(args: Args) -> str:
    """Where the policy's starting weights live: the cached toy warm start, an alias's hub id, or the path given."""
    if args.toy and args.model == "toy":
        from harness import toy
        toy.warm_start(CACHE_DIR, seed=0)   # SFT warm start, trained once and cached: the toy "pretrained model"
        return toy.cache_path(CACHE_DIR, seed=0)
    return MODEL_ALIASES.get(args.model, args.model)


def load_policy(args: Args, path: str, base_path: str, device: str):
    """(policy in float32, tokenizer, frozen KL reference or None). float32 master weights: AdamW steps of
    lr 1e-6 would round away in bfloat16. The KL reference is the model we started from, also after a resume."""
    with loading(path):
        policy, tokenizer = load_causal_lm(path, device, torch.float32)
    ref_model = None
    if args.kl_coef > 0:
        with loading(base_path):
            ref_model = load_causal_lm(base_path, device, torch.float32)[0].eval().requires_grad_(False)
    return policy, tokenizer, ref_model


def make_rollout_engine(args: Args, policy, tokenizer, path: str, use_vllm: bool):
    """vLLM in-process (its weights follow the policy through sync_weights after every update) or HF generate."""
    if use_vllm:
        from harness.generate import VLLMGenerator
        return VLLMGenerator(path, tokenizer=tokenizer, seed=args.seed)
    return HFGenerator(policy, tokenizer, micro_batch_size=args.micro_batch_size)


def load_prm(args: Args, device: str, seed: int | None = None):
    """The process reward model, or the toy world's rule-based stand-in; None with --prm none."""
    if args.prm == "none":
        return None
    if args.toy:   # the toy PRM's noise has its own RNG: main reseeds it from (seed, step) so resume is exact
        from harness import toy
        return toy.ToyPRM(args.toy_prm_noise, seed=args.seed if seed is None else seed)
    from prm import ProcessRewardModel
    with loading(args.prm):
        return ProcessRewardModel(args.prm, device=device,
                                  dtype=torch.bfloat16 if device.startswith("cuda") else None)


def load_refiner(args: Args, generator, tokenizer, device: str, run_dir: str):
    """The refiner of --mode scope/replace (None otherwise): the policy itself, a served model (--refiner-url),
    the toy oracle, a separate model on its own `vllm serve` (when vLLM is installed: refiner work never goes
    through HF generate then; generate.serve_with_vllm), or, without vLLM, a separate model through HF generate."""
    if args.mode not in ("scope", "replace"):
        return None
    if args.refiner == "policy":   # self-refinement: the current policy, through the same engine
        return Refiner(generator, tokenizer, prompt_style=args.refine_prompt)
    if args.refiner_url:           # a refiner served elsewhere (`vllm serve MODEL`); also in the toy world
        from harness.generate import OpenAIGenerator
        with loading(args.refiner):
            refiner_tokenizer = load_tokenizer(args.refiner)
        return Refiner(OpenAIGenerator(args.refiner_url, args.refiner, refiner_tokenizer, args.refiner_timeout),
                       refiner_tokenizer, prompt_style=args.refine_prompt)
    if args.toy and args.refiner == "toy-model":   # a stronger toy model through the real Refiner + HF generate
        from harness import toy
        refiner_model, refiner_tokenizer = toy.refiner_model(CACHE_DIR, seed=0)
        return Refiner(HFGenerator(refiner_model.eval(), refiner_tokenizer, args.micro_batch_size),
                       refiner_tokenizer, prompt_style=args.refine_prompt)
    if args.toy:                   # toy-oracle (or its old name, toy): rule-based, never fails
        from harness import toy
        return toy.OracleRefiner()
    if vllm_importable() and args.backend != "hf":   # the refiner on vLLM: its own `vllm serve` (generate.py)
        from harness.generate import serve_with_vllm
        with loading(args.refiner):
            refiner_tokenizer = load_tokenizer(args.refiner)
        log_path = os.path.join(run_dir, "refiner_server.log")
        print(f"starting the refiner server (vllm serve {args.refiner}); log: {log_path}")
        try:
            served = serve_with_vllm(args.refiner, refiner_tokenizer, log_path=log_path,
                                     cpu=not device.startswith("cuda"), gpu_memory_utilization=args.refiner_mem,
                                     timeout=args.refiner_timeout)
            return Refiner(served, refiner_tokenizer, prompt_style=args.refine_prompt)
        except RuntimeError as err:
            print(f"warning: the refiner server did not start, refining through HF generate instead: {err}",
                  file=sys.stderr)
    with loading(args.refiner):    # no vLLM (or its server failed to start): HF generate
        refiner_model, refiner_tokenizer = load_causal_lm(args.refiner, device)   # bf16 on CUDA
    return Refiner(HFGenerator(refiner_model.eval(), refiner_tokenizer, args.micro_batch_size),
                   refiner_tokenizer, prompt_style=args.refine_prompt)


def restore_checkpoint(ckpt: str, optimizer, device: str) -> None:
    """Optimizer and RNG states from the checkpoint (the model loaded from it already)."""
    optimizer.load_state_dict(torch.load(os.path.join(ckpt, "optimizer.pt"), map_location=device))
    restore_rng(torch.load(os.path.join(ckpt, "state.pt"), weights_only=False))


def kept_tokens(spans: list[tuple[int, int]], cut: int, n_tokens: int) -> int:
    """Tokens of a failed response kept before its first error: where step `cut` starts, all n_tokens when the
    cut lies past the last step, and none for a response without steps (an empty or bare-EOS response keeps
    nothing: keeping its EOS would train it on-policy with a positive advantage and put the refiner after it)."""
    if not spans:
        return 0
    return spans[cut][0] if cut < len(spans) else n_tokens


def pad_token_id(tokenizer) -> int:
    """The pad id for build_batch: the tokenizer's pad token, else its EOS (Llama/Mistral-style tokenizers
    have no pad token), as generate.HFGenerator does. Padding is masked out, so any valid id works."""
    for pad in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if pad is not None:
            return pad
    raise ValueError("the tokenizer has neither a pad nor an EOS token: set tokenizer.pad_token")


def first_errors(trajs: list[Trajectory], prm, args: Args, tokenizer) -> dict[int, int]:
    """Step 3: PRM scores for every failed rollout (all rollouts in prm-reward mode); sets steps, step_scores,
    cut, keep_ratio, keep_ratio_tokens on each. Returns {id(trajectory): tokens before its first error}."""
    scored = [t for t in trajs if args.mode == "prm-reward" or not t.correct] if prm else []
    prefix_len = {}
    if not scored:
        return prefix_len
    for t in scored:
        t.steps = split_steps(t.text)
    for t, scores in zip(scored, prm.score_batch([t.question for t in scored], [t.steps for t in scored])):
        t.step_scores = scores
        t.cut = cut_point(scores, args.tau)
        t.keep_ratio = keep_ratio(t.cut, len(t.steps))
        prefix_len[id(t)] = kept_tokens(step_token_spans(t.response_ids, t.steps, tokenizer), t.cut,
                                        len(t.response_ids))
        t.keep_ratio_tokens = prefix_len[id(t)] / max(1, len(t.response_ids))
    return prefix_len


def select_failures(trajs: list[Trajectory], n_groups: int, prefix_len: dict[int, int], args: Args) -> list[tuple]:
    """Step 4: (index, tokens to keep) of the most promising failure per eligible group (`--rectify-groups any`:
    every group with a failure; `all-fail`: only groups in which every rollout failed): largest keep ratio, then higher prefix PRM mean, then shorter. Mode replace keeps nothing of the same pick."""
    if args.mode not in ("scope", "replace"):
        return []
    picks = []
    for b in range(n_groups):
        idx = [i for i, t in enumerate(trajs) if t.group == b and not t.correct]
        if not idx or (args.rectify_groups == "all-fail" and any(t.correct for t in trajs if t.group == b)):
            continue   # all-fail only: a group with a success keeps its on-policy signal untouched
        j = select_candidate([trajs[i].keep_ratio for i in idx],
                             [mean_score(trajs[i].step_scores[:trajs[i].cut]) for i in idx],
                             [len(trajs[i].response_ids) for i in idx])
        if j is not None:
            picks.append((idx[j], 0 if args.mode == "replace" else prefix_len[id(trajs[idx[j]])]))
    return picks


def open_run(args: Args, run_dir: str, resume_step: int | None) -> tuple[str | None, int]:
    """Take the folder's lock, then: a resume recovers its newest complete checkpoint (a kill mid-save leaves
    it as checkpoint.tmp/.old); --overwrite clears the old run; config.json is (re)written.
    Returns (checkpoint path or None, the first step to run)."""
    atexit.register(release_lock, acquire_lock(run_dir))
    ckpt = None
    if resume_step is not None:
        ckpt, step = recover_checkpoint(run_dir)
        for name in ("metrics.jsonl", "traces.jsonl"):   # drop what was logged after the checkpoint
            truncate_jsonl(os.path.join(run_dir, name), step)
    elif args.overwrite:
        clear_run(run_dir)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump({**asdict(args), "resume": "", "overwrite": False, "dry_run": False}, f, indent=1)
    return ckpt, 1 if resume_step is None else resume_step + 1


def main(args: Args) -> dict:
    t_start = time.time()

    # ------------------------------------------------------------------ pre-flight: nothing loaded or written yet
    preflight.check_args(args)                                        # every flag: one line and exit 2
    run_dir = preflight.run_dir_of(args)
    resume_step = preflight.check_run_dir(args, run_dir)              # no clobbering, no resume below the checkpoint
    device, use_vllm, notes = preflight.choose_device(args)           # the GPU before the data
    offline, hub_notes = preflight.check_hub(args, resume_step)       # no network: one line, no retry noise
    train_problems, eval_problems = preflight.load_data(args, offline, notes)  # non-empty, before any model
    preflight.check_memory(args, device, use_vllm)                    # printed; stops on a GPU too small
    if args.dry_run:
        preflight.print_dry_run(args, run_dir, notes + hub_notes)
        return {"run_dir": run_dir, "dry_run": True}

    # ------------------------------------------------------------------ setup: run folder + lock, seeding, models
    ckpt, start_step = open_run(args, run_dir, resume_step)
    seed_everything(args.seed)
    if args.toy:
        torch.set_num_threads(1)   # a 0.3 M-parameter model gains nothing from threads; on a shared 2-core machine
                                   # two threads per process were ~15x slower (oversubscription)
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.startswith("cuda") else contextlib.nullcontext
    base_path = base_model_path(args)
    policy, tokenizer, ref_model = load_policy(args, ckpt or base_path, base_path, device)
    generator = make_rollout_engine(args, policy, tokenizer, ckpt or base_path, use_vllm)
    prm = load_prm(args, device)
    refiner = load_refiner(args, generator, tokenizer, device, run_dir)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    if ckpt:
        restore_checkpoint(ckpt, optimizer, device)
        print(f"resumed {run_dir} at step {start_step}")
    metrics_file = open(os.path.join(run_dir, "metrics.jsonl"), "a" if ckpt else "w", encoding="utf-8")
    traces_file = open(os.path.join(run_dir, "traces.jsonl"), "a" if ckpt else "w", encoding="utf-8")
    n_params = sum(p.numel() for p in policy.parameters())
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
    unavailable = []   # steps on which the served refiner did not answer
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
        if args.toy and prm:
            prm = load_prm(args, device, seed=seed_for(args.seed, step, "prm"))
        prefix_len = first_errors(trajs, prm, args, tokenizer)   # id(trajectory) -> tokens before its first error
        failed_scored = [t for t in trajs if not t.correct and t.step_scores is not None]
        m["near_miss_frac"] = near_miss_at_k([(len(t.steps), t.cut) for t in failed_scored], k=1) if failed_scored else None
        m["discarded_valid_frac"] = discarded_valid_share([t.keep_ratio for t in failed_scored]) if failed_scored else None
        if args.mode == "prm-reward":   # naive dense PRM reward (Table 3 row "RL with PRM reward")
            for t in trajs:
                t.reward = float(t.correct) + args.prm_reward_coef * mean_score(t.step_scores or [])
        m["time_prm"] = time.time() - t1

        # ---------------------------------------------------------- 4. select the most promising failure of each group
        picks = select_failures(trajs, B, prefix_len, args)

        # ---------------------------------------------------------- 5. rectify: keep the prefix ids, refiner writes the rest
        t1 = time.time()
        traces = []
        m["refiner_unavailable"] = 0
        group_rewards = {b: [t.reward for t in trajs if t.group == b] for b in range(B)}   # before repair
        if picks:
            try:
                with amp():
                    trajs, traces = rectify(trajs, picks, refiner, tokenizer, attempts=args.refine_attempts,
                                            merge=args.merge, max_new_tokens=args.max_new_tokens, grade_fn=grade,
                                            seed=seed_for(args.seed, step, "refine"))
            except GeneratorUnavailable as err:   # a served refiner that stopped answering: this step trains
                m["refiner_unavailable"] = 1       # on the policy's rollouts alone (no rectification)
                unavailable.append(step)
                tqdm.write(f"warning: step {step}: the refiner did not answer, no rectification this step: {err}")
        accepted = [tr for tr in traces if tr["accepted"]]
        m["rectify_tried"], m["rectify_accepted"] = len(traces), len(accepted)
        # κ of what was actually kept: a whole-solution repair (mode replace, or a cut at step 0) keeps nothing
        m["keep_ratio_steps"] = mean(tr["keep_ratio"] if tr["mode"] == "scope" else 0.0 for tr in accepted)
        m["keep_ratio_tokens"] = mean(tr["keep_ratio_tokens"] if tr["mode"] == "scope" else 0.0 for tr in accepted)
        m["rectify_all_fail"] = sum(not passed[tr["group"]].any() for tr in accepted)   # repairs in all-fail groups
        traces = [{**tr, "group_rewards": group_rewards[tr["group"]], "group_all_fail": bool(not passed[tr["group"]].any())}
                  for tr in traces]
        m["time_refine"] = time.time() - t1

        # ---------------------------------------------------------- 6. advantages over each merged group: A = r − mean(r)
        rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)            # (N,)
        advantages = torch.zeros_like(rewards)                                             # (N,)
        for b in range(B):   # groups are ragged with --merge append
            idx = torch.tensor([i for i, t in enumerate(trajs) if t.group == b])
            advantages[idx] = group_advantages(rewards[idx], group_size=len(idx), scale_std=args.adv_std)
        m["reward_merged"] = float(rewards.mean())

        # ---------------------------------------------------------- 7. update: one optimizer step (ρ = 1: no old-log-prob pass)
        t1 = time.time()
        batch = build_batch([t.prompt_ids for t in trajs], [t.response_ids for t in trajs],
                            [t.offpolicy_mask for t in trajs], advantages, pad_token_id(tokenizer))
        batch = {k: v.to(device) for k, v in batch.items()}   # no old_logp: update uses its own, detached
        policy.train()
        with amp():
            stats = update(policy, optimizer, batch, micro_batch_size=args.micro_batch_size, max_grad_norm=1.0,
                           clip_eps=args.clip_eps, shaping_gamma=args.shaping_gamma, loss_agg=args.loss_agg,
                           offpolicy_credit=args.offpolicy_credit,
                           max_new_tokens=args.max_new_tokens, kl_coef=args.kl_coef, entropy_coef=args.entropy_coef,
                           ref_model=ref_model)
        policy.eval()
        m["entropy"] = stats["entropy_policy"]   # mean over policy-written tokens, before the step
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
        for tr in traces:
            traces_file.write(json.dumps({"step": step, **tr}) + "\n")
        traces_file.flush()
        metrics_file.write(json.dumps(m) + "\n")
        metrics_file.flush()
        tqdm.write(summary_line(m))
        history.append(m)
        if step % args.save_every == 0 or step == args.steps:
            save_checkpoint(run_dir, step, policy, tokenizer, optimizer)

    metrics_file.close()
    traces_file.close()
    return finish(summary, history, run_dir, t_start, unavailable, refiner)


def finish(summary: dict, history: list[dict], run_dir: str, t_start: float, unavailable: list[int], refiner) -> dict:
    """The closing lines: eval accuracy before → after, train reward first → last steps, the steps on which a served
    refiner did not answer, where the logs are; our own refiner server is shut down here (also at exit and on error)."""
    summary["minutes"] = (time.time() - t_start) / 60
    before, after = summary.get("eval_acc_before"), summary.get("eval_acc_after")
    print(f"\ndone in {summary['minutes']:.1f} min. eval accuracy: before {_fmt(before)} → after {_fmt(after)}")
    if history:
        k = max(1, len(history) // 5)
        print(f"train reward of the policy's rollouts: first {k} steps {mean(h['reward_mean'] for h in history[:k]):.3f}"
              f" → last {k} steps {mean(h['reward_mean'] for h in history[-k:]):.3f}; rectifications accepted "
              f"{sum(h['rectify_accepted'] for h in history)}/{sum(h['rectify_tried'] for h in history)}")
    if unavailable:
        summary["refiner_unavailable_steps"] = unavailable
        print(f"WARNING: the refiner did not answer on {len(unavailable)} of {len(history)} steps "
              f"({', '.join(map(str, unavailable[:20]))}{' ...' if len(unavailable) > 20 else ''}): those steps "
              f"trained without rectification (metrics.jsonl: refiner_unavailable)")
    if refiner is not None and getattr(getattr(refiner, "generator", None), "server", None) is not None:
        refiner.generator.server.close()   # our own vllm serve (also closed at exit and on error)
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
    text += " | REFINER UNAVAILABLE: no rectification" if m.get("refiner_unavailable") else ""
    return text + (f" | eval {m['eval_acc']:.3f}" if "eval_acc" in m else "")


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


if __name__ == "__main__":
    main(parse_args())
