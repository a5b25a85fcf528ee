"""wiring.py — the engine around scope.py's step: the pre-flight, the run folder, the models, the `run.*` verbs
of each step, the logs, the closing summary. Nothing here is SCOPE; it lets scope.py's loop read as the method.

`start(args, paper)` runs the pre-flight (every refusal one line, exit 2, before anything loads), opens the run
folder (lock, resume, config.json) and loads the policy, its rollout engine, the PRM and the refiner, returning a
`Run`, whose verbs scope.main calls in order: `eval_before_training`, `steps`, `rollout`, `prm_phase`,
`refine_phase`, `with_sampler_logprobs`, `with_old_logprobs`, `update_phase`, `push_weights`, `end_step` (gather,
metrics, eval, log, checkpoint), `finish`; each docstring says what it adds to the step's data, or that it changes
none (timers, PRM offload, autocast, vLLM sleep). `paper` holds
the pieces of the five top-level files the engine builds and calls (this package imports none of them). Under
torchrun (harness/engines/dist.py) every rank runs the loop; rank 0 alone writes and prints. Ctrl-C's one line and the
lock's release: `config.run_interrupt`.
"""
import atexit
import contextlib
import functools
import json
import os
import random
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from harness.data import mathverify   # --grader
from harness.data.prompt import format_prompt
from harness.engines import dist, lora, overlap, trainer
from harness.engines.generate import (GeneratorUnavailable, HFGenerator, ServerStartError, load_causal_lm,
                                      load_tokenizer, vllm_importable)
from harness.engines.refiner import MODES_WITH_REFINER, Refiner
from harness.plan import memory, phase_memory
from harness.run import cli, config, export, preflight, progress, trackers   # progress: step k/N + ETA, rollouts.jsonl,
from harness.run.runs import (Done, acquire_lock, append_change, clear_run, environment, format_changes, only_logs,
                              read_changes, read_log, recover_checkpoint, release_lock, removed_on_failure,
                              restore_rng, save_checkpoint, stop, truncate_jsonl)   # curves.png, summary.txt, model/

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repository root
CACHE_DIR = os.path.join(ROOT, "cache")        # toy warm starts (gitignored but for the shipped ones)


@contextlib.contextmanager
def loading(name: str):
    """Turn a failed from_pretrained (missing weights, no network) into one clear error naming the model; a server
    of it that did not start (generate.ServerStartError) into its message with the log's last lines, and a hint
    only where the log names a cause (start_hint)."""
    try:
        yield
    except ServerStartError as e:
        hint = start_hint(name, str(e))
        raise SystemExit(f"error: cannot start '{name}': {str(e).rstrip()}" + (f"\nhint: {hint}" if hint else "")
                         ) from None
    except (OSError, ValueError, RuntimeError) as e:   # prm.ProcessRewardModel wraps its OSError in a RuntimeError
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit(f"error: cannot load '{name}': {first_line} ({missing_model_hint(name)})") from None


def missing_model_hint(name: str) -> str:
    return ("the folder needs config.json, the weights and the tokenizer" if os.path.exists(name) else
            "check the id; without network access, download it first (`hf download " + name + "`) or pass a "
            "local folder")


# the causes a start-up log names most often, by the words it names them with (lower case), first match wins
START_CAUSES = (
    ("memory", ("out of memory", "outofmemoryerror", "no available memory", "free memory on device",
                "not enough memory", "insufficient memory", "available kv cache memory")),
    ("port", ("address already in use", "errno 98")),
    ("version", ("no module named", "cannot open shared object file", "unrecognized arguments",
                 "unexpected keyword argument", "has no attribute", "cannot import name")),
    ("model", ("repository not found", "repositorynotfounderror", "not a valid model identifier",
               "is not a local folder", "localentrynotfounderror", "couldn't connect to", "offline mode",
               "does not appear to have a file", "gated repo", "401 client error")),
)


def start_hint(name: str, log: str) -> str:
    """The hint for an engine that did not start, matched on its log's text; "" when the log names no known cause."""
    text = log.lower()
    cause = next((cause for cause, words in START_CAUSES if any(w in text for w in words)), None)
    return {"memory": "the GPU has less free memory than asked for: another process may hold it (nvidia-smi), or "
                      "the plan is too tight (`--dry-run` prints it with the flags that shrink it)",
            "port": "another process took the server's port as it started; run the command again",
            "version": "the installed vLLM is not the one this project runs on (vllm 0.33, requirements.txt; "
                       "docs/vllm.md)",
            "model": missing_model_hint(name), None: ""}[cause]


@contextlib.contextmanager
def engine_starting(name: str):
    """The in-process vLLM engine's start: a failure prints vLLM's traceback (its log), then one error line naming
    the model, the exception's last line and the hint that fits it (start_hint)."""
    try:
        yield
    except Exception as e:   # vLLM raises ValueError, RuntimeError, AssertionError, ImportError... at start-up
        import traceback
        traceback.print_exc()
        last = (str(e).strip().splitlines() or [""])[-1]
        chain, cause = [], e   # the root cause may sit below a wrapper ("Engine core initialization failed")
        while cause is not None and len(chain) < 8:
            chain.append(f"{type(cause).__name__}: {cause}")
            cause = cause.__cause__ or cause.__context__
        hint = start_hint(name, "\n".join(chain))
        raise SystemExit(f"error: vLLM (in this process) did not start '{name}': {type(e).__name__}: {last}"
                         + (f"\nhint: {hint}" if hint else "")) from None


def mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.mean(xs)) if xs else None


def no_reward_signal(merged: list) -> bool:
    """True when no group of the step's (merged) rows has two different rewards: every advantage is 0."""
    rewards = {}
    for t in merged:
        rewards.setdefault(t.group, set()).add(t.reward)
    return all(len(r) == 1 for r in rewards.values())


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def base_model_path(args) -> str:
    """Where the policy's starting weights live: the cached toy warm start, an alias's hub id, or the path given."""
    if args.toy and args.model == "toy":
        from harness.data import toy
        toy.warm_start(CACHE_DIR, seed=0, **toy_styles(args))   # SFT warm start, trained once and cached: the
        return toy.cache_path(CACHE_DIR, seed=0, **toy_styles(args))   # toy "pretrained model"
    return preflight.model_id(args.model)


def toy_styles(args) -> dict:
    """The toy warm start's (and model refiner's) style setting: {} for one style, so its cache path is the default's."""
    return {"styles": args.toy_styles} if args.toy_styles > 1 else {}


def load_policy(args, path: str, base_path: str, device: str):
    """(policy in float32, tokenizer, frozen KL reference or None). float32 master weights: AdamW steps of
    lr 1e-6 would round away in bfloat16. The KL reference is the model we started from, also after a resume.
    With --gradient-checkpointing each decoder layer's activations are recomputed in the backward pass.
    With --lora-rank the base stays in the load dtype (bf16 on CUDA) under a float32 adapter (harness/engines/lora.py),
    new or the checkpoint's, and the KL reference is the policy with its adapter switched off."""
    if args.lora_rank:
        with loading(base_path):
            policy, tokenizer = load_causal_lm(base_path, device)
        policy = lora.load(policy, path) if path != base_path else lora.wrap(policy, args.lora_rank,
                                                                            args.lora_alpha, args.lora_targets)
        if args.gradient_checkpointing:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return policy, tokenizer, lora.AdapterOff(policy) if args.kl_coef > 0 else None
    with loading(path):
        policy, tokenizer = load_causal_lm(path, device, torch.float32)
    if args.gradient_checkpointing:   # non-reentrant: works with frozen inputs and nested autograd (grpo's chunks)
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref_model = None
    if args.kl_coef > 0:
        with loading(base_path):
            ref_model = load_causal_lm(base_path, device, torch.float32)[0].eval().requires_grad_(False)
    return policy, tokenizer, ref_model


def make_rollout_engine(args, policy, tokenizer, path: str, use_vllm: bool, world: int = 1):
    """vLLM in-process (its weights follow the policy through sync_weights after every update) or HF generate.
    Under torchrun each rank builds its own engine on its own GPU (`external_launcher`, tensor-parallel size 1, no
    data_parallel_size: TRL's and verl's layout, so no engine step waits on another rank; docs/vllm.md).
    vLLM's KV cache holds the rank's prompts_per_step / world × group_size sequences of an assumed prompt plus --max-new-tokens
    (memory.rollout_kv_need); with --rollout-sleep it can sleep through the update."""
    if use_vllm:
        from harness.engines.generate import VLLMGenerator
        launch = dict(distributed_executor_backend="external_launcher") if world > 1 else {}
        kv_bytes, max_len = memory.rollout_kv_need(args, world)   # sized by need, not a share of the card
        context = getattr(policy.config, "max_position_embeddings", None)
        max_len = min(max_len, context) if context else max_len   # never past the model's own context
        seqs, batched = memory.rollout_engine_limits(args, world)   # vLLM's buffers as the plan sizes them
        with engine_starting(path):   # a failure: vLLM's traceback, then one line with the hint that fits
            return VLLMGenerator(path, tokenizer=tokenizer, seed=args.seed, max_model_len=max_len,
                                 sleep_mode=args.rollout_sleep, kv_cache_memory_bytes=kv_bytes, max_num_seqs=seqs,
                                 max_num_batched_tokens=batched, **launch)
    return HFGenerator(lora.inner(policy), tokenizer, micro_batch_size=args.gen_batch_size)   # LoRA: adapter on


def load_prm(args, device: str, prm_class, use_vllm: bool = False, run_dir: str = ""):
    """The process reward model (`prm_class`: prm.ProcessRewardModel), or the toy world's rule-based stand-in; None
    with --prm none. With vLLM on a GPU a Qwen2.5-Math-PRM runs on its own `vllm serve --runner pooling`
    (harness/engines/served_prm.py), else in this process."""
    if args.prm == "none":
        return None
    if args.toy:   # the toy PRM's noise has its own RNG: the loop reseeds it from (seed, step) so resume is exact
        from harness.data import toy
        return toy.ToyPRM(args.toy_prm_noise, seed=args.seed)
    if device.startswith("cuda") and memory.prm_served(args, use_vllm, torch.cuda.get_device_properties(
            torch.device(device)).total_memory / memory.GIB):
        from harness.engines.served_prm import start_for_run
        with loading(args.prm):   # all failures of a step in one request: the server schedules them
            return prm_class(args.prm, micro_batch_size=1024,
                             served=start_for_run(args, run_dir, prm_class.separator, *memory.prm_server_need(args),
                                                  memory.prm_batched_tokens(args)))
    if args.prm_quantization != "none":   # the in-process PRM runs in bf16: not what was asked for
        stop(f"--prm-quantization {args.prm_quantization}: needs the PRM on its own vllm serve (vLLM installed, a "
             f"GPU, and room in the memory plan: memory.prm_served); here it would run in this process in bf16")
    with loading(args.prm):
        return prm_class(args.prm, device=device, dtype=torch.bfloat16 if device.startswith("cuda") else None,
                         prm_format=args.prm_format)


def load_refiner(args, generator, tokenizer, device: str, run_dir: str, refiner_prompt):
    """The refiner of --mode scope/replace (None otherwise): a `Refiner` (harness/engines/refiner.py) over the policy
    itself, a served model (--refiner-url), a separate model on its own `vllm serve` (when vLLM is installed:
    refiner work never goes through HF generate then; generate.serve_with_vllm), or, without vLLM, a separate
    model through HF generate; or the toy oracle.
    A server that does not start falls back to HF generate only where preflight.check_refiner_fallback finds
    room (the CPU, or enough free GPU memory); otherwise the run stops in one line naming the flags that fit."""
    if args.mode not in MODES_WITH_REFINER:
        return None
    prompt = functools.partial(refiner_prompt, style=args.refine_prompt)   # refine.refiner_prompt, --refine-prompt
    if args.refiner == "policy":   # self-refinement: the current policy, through the same engine
        return Refiner(generator, tokenizer, prompt=prompt, max_tokens=args.refiner_max_tokens)
    if args.refiner_url:           # a refiner served elsewhere (`vllm serve MODEL`); also in the toy world
        from harness.engines.generate import OpenAIGenerator
        with loading(args.refiner):
            refiner_tokenizer = load_tokenizer(args.refiner)
        return Refiner(OpenAIGenerator(args.refiner_url, args.refiner, refiner_tokenizer, args.refiner_timeout),
                       refiner_tokenizer, prompt=prompt, max_tokens=args.refiner_max_tokens)
    if args.toy and args.refiner == "toy-model":   # a stronger toy model through the real Refiner + HF generate
        from harness.data import toy
        if args.toy_refiner_style != "prefix":
            raise SystemExit(f"--toy-refiner-style {args.toy_refiner_style} needs --refiner toy-oracle: the toy "
                             "model refiner writes the styles it was trained on, continuing the prefix's")
        refiner_model, refiner_tokenizer = toy.refiner_model(CACHE_DIR, seed=0, **toy_styles(args))
        return Refiner(HFGenerator(refiner_model.eval(), refiner_tokenizer, args.gen_batch_size),
                       refiner_tokenizer, prompt=prompt, max_tokens=args.refiner_max_tokens)
    if args.toy:                   # toy-oracle (or its old name, toy): rule-based, never fails
        from harness.data import toy
        return toy.OracleRefiner(None if args.toy_refiner_style == "prefix" else int(args.toy_refiner_style),
                                 args.toy_styles if args.select_tiebreak == "index" else 1)
    if vllm_importable() and args.backend != "hf":   # the refiner on vLLM: its own `vllm serve` (generate.py)
        from harness.engines.generate import quantization_flags, serve_with_vllm
        with loading(args.refiner):
            refiner_tokenizer = load_tokenizer(args.refiner)
        rank = f".rank{os.environ['RANK']}" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""   # torchrun: one each
        log_path = os.path.join(run_dir, f"refiner_server{rank}.log")
        print(f"starting the refiner server (vllm serve {args.refiner}); log: {log_path}")
        try:
            served = serve_with_vllm(args.refiner, refiner_tokenizer, log_path=log_path,
                                     cpu=not device.startswith("cuda"), gpu_memory_utilization=args.refiner_mem,
                                     timeout=args.refiner_timeout, extra=quantization_flags(args.refiner_quantization))
            return Refiner(served, refiner_tokenizer, prompt=prompt, max_tokens=args.refiner_max_tokens)
        except RuntimeError as err:   # HF generate only where it fits; else one line with the flags that do
            try:
                if args.refiner_quantization != "none":   # HF generate would run it in bf16: not what was asked
                    stop(f"--refiner-quantization {args.refiner_quantization}: the refiner's own vllm serve did not "
                         f"start (--refiner-quantization none refines through HF generate in bf16)")
                preflight.check_refiner_fallback(args, device, str(err), log_path)
            except SystemExit:         # the refusal, then what the server's log says and the hint that fits it
                hint = start_hint(args.refiner, str(err))
                print(str(err).rstrip() + (f"\nhint: {hint}" if hint else ""), file=sys.stderr)
                raise
            print(f"warning: the refiner server did not start, refining through HF generate instead: {err}",
                  file=sys.stderr)
    if args.refiner_quantization != "none":   # HF generate would run it in bf16: not what was asked for
        stop(f"--refiner-quantization {args.refiner_quantization}: needs the refiner on its own vllm serve, which "
             f"{'did not start' if vllm_importable() and args.backend != 'hf' else 'needs vLLM installed and --backend auto or vllm'}"
             f" (--refiner-quantization none refines through HF generate in bf16)")
    with loading(args.refiner):    # no vLLM (or its server failed to start where HF generate fits): HF generate
        refiner_model, refiner_tokenizer = load_causal_lm(args.refiner, device)   # bf16 on CUDA
    return Refiner(HFGenerator(refiner_model.eval(), refiner_tokenizer, args.gen_batch_size),
                   refiner_tokenizer, prompt=prompt, max_tokens=args.refiner_max_tokens)


def make_optimizer(args, policy, device: str):
    """AdamW over the parameters that train: the whole policy, or with --lora-rank its adapter alone (the frozen
    base gets no gradient and no optimizer state). Fused on CUDA with --fused-adamw: the same update."""
    trained = [p for p in policy.parameters() if p.requires_grad]
    return torch.optim.AdamW(trained, lr=args.lr, fused=args.fused_adamw and device.startswith("cuda"))


def restore_checkpoint(ckpt: str, optimizer, device: str, model=None, rank: int = 0) -> None:
    """Optimizer and RNG states from the checkpoint (the model loaded from it already); with `model`, an FSDP2
    policy whose optimizer holds shards (dist.load_optimizer); `rank`: whose CUDA RNG state to take."""
    state = torch.load(os.path.join(ckpt, "optimizer.pt"), map_location=device)
    if model is not None:
        dist.load_optimizer(model, optimizer, state)
    else:
        optimizer.load_state_dict(state)
    restore_rng(torch.load(os.path.join(ckpt, "state.pt"), weights_only=False), rank)


def pad_or_eos(tokenizer) -> int:
    """The pad id for build_batch: the tokenizer's pad token, else its EOS (Llama/Mistral-style tokenizers
    have no pad token), as generate.HFGenerator does. Padding is masked out, so any valid id works."""
    for pad in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if pad is not None:
            return pad
    raise ValueError("the tokenizer has neither a pad nor an EOS token: set tokenizer.pad_token")


def open_run(args, run_dir: str, resume_step: int | None) -> tuple[str | None, int]:
    """Take the folder's lock, then: a resume recovers its newest complete checkpoint (a kill mid-save leaves
    it as checkpoint.tmp/.old), keeps config.json as the run was started and appends the flags it changes to
    changes.jsonl with the step they take effect (runs.py rule 6); a new run (or --overwrite) writes config.json
    (its flags, and under "environment" the versions and commit it runs with: runs.environment).
    Returns (checkpoint path or None, the first step to run)."""
    atexit.register(release_lock, acquire_lock(run_dir))
    if resume_step is not None:
        ckpt, step = recover_checkpoint(run_dir)
        for name in ("metrics.jsonl", "traces.jsonl", "rollouts.jsonl"):   # drop what was logged after the checkpoint
            truncate_jsonl(os.path.join(run_dir, name), step)
        changes = preflight.resume_changes(args, run_dir)
        if changes:
            append_change(run_dir, step + 1, changes)
            print(f"{run_dir}: recorded in changes.jsonl {format_changes(read_changes(run_dir)[-1:])[0]}")
        return ckpt, step + 1
    if args.overwrite:
        clear_run(run_dir)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump({**asdict(args), "resume": "", "overwrite": False, "dry_run": False, "change_config": False,
                   "environment": environment()}, f, indent=1)
    return None, 1


EVAL_TEMPERATURE = 0.6   # the periodic evaluation's sampling temperature (Run.evaluate; the LUFFY harness)
README_TOY_EVAL = "64 held-out problems × 16 samples at T = 1.0"   # the setting of the README's toy tables


def samples(n: int, what: str = "sample") -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def describe_refiner(args, refiner) -> str:
    """What rewrites the failures in this run, in words (the closing summary)."""
    server = getattr(getattr(refiner, "generator", None), "server", None)
    if args.refiner == "policy":
        return "the policy itself (self-refinement)"
    if args.refiner_url:
        return f"the model {args.refiner}, served at {args.refiner_url}"
    if args.toy and args.refiner == "toy-model":
        return "a stronger toy model through Refiner and HF generate (it can fail)"
    if args.toy:
        return ("the toy oracle (rule-based: it writes the correct remaining steps, so it fails only where the "
                "token budget cuts them short)")
    return f"the model {args.refiner}" + (", on its own vllm serve" if server is not None else ", through HF generate")


def finish(summary: dict, run_dir: str, t_start: float, start_step: int, refiner, args, n_eval: int,
           main: bool = True) -> dict:
    """The closing lines, from the whole run's logs (also the steps before a resume), each figure with the
    setting it was measured in and no abbreviation: eval accuracy before → after (problems, samples,
    temperature), the reward of the policy's own rollouts first → last steps, the repairs and what the refiner
    is, the steps on which a served refiner did not answer, the accepted config changes, where the logs are;
    our own refiner server is shut down here (also at exit and on error; on every torchrun rank, which alone
    reads and prints nothing)."""
    said_refiner = describe_refiner(args, refiner) if refiner is not None else None
    if refiner is not None and getattr(getattr(refiner, "generator", None), "server", None) is not None:
        refiner.generator.server.close()   # our own vllm serve (also closed at exit and on error)
    if not main:
        return summary
    records = read_log(os.path.join(run_dir, "metrics.jsonl"))
    history = [r for r in records if r.get("step", 0) >= 1]
    before = next((r["eval_acc"] for r in records if r.get("step") == 0 and "eval_acc" in r), None)
    after = next((r["eval_acc"] for r in reversed(history) if r.get("eval_acc") is not None), None)
    summary.update(minutes=(time.time() - t_start) / 60, eval_acc_before=before, eval_acc_after=after)
    resumed = f" (resumed at step {start_step}; the lines below cover the whole run)" if start_step > 1 else ""
    evaluated = (f"eval accuracy on {n_eval} held-out problems × {samples(args.eval_n)} at T = {EVAL_TEMPERATURE}: "
                 f"before {_fmt(before)} → after {_fmt(after)}" if args.eval_every else "no evaluation (--eval-every 0)")
    print(f"\ndone in {progress.duration(summary['minutes'] * 60)}{resumed}. {evaluated}")
    if args.toy and args.eval_every:
        print(f"  (the README's toy tables evaluate {README_TOY_EVAL}: another setting, other numbers)")
    if history:
        k = max(1, len(history) // 5)
        print(f"training reward (share of correct answers among the policy's own {samples(args.prompts_per_step, 'problem')}"
              f" × {samples(args.group_size)} per step at T = {args.temperature}): first {samples(k, 'step')} "
              f"{mean(h['reward_mean'] for h in history[:k]):.3f} → last {samples(k, 'step')} "
              f"{mean(h['reward_mean'] for h in history[-k:]):.3f}")
        tried, repaired = sum(h["rectify_tried"] for h in history), sum(h["rectify_accepted"] for h in history)
        if said_refiner is None:
            print(f"repairs: none (--mode {args.mode} rewrites no failure)")
        else:
            picked = "one per group with a failure" if args.rectify_groups == "any" else "one per all-failed group"
            print(f"repairs: {repaired} of {tried} picked failures ({picked}) came back correct and were trained "
                  f"on; the refiner is {said_refiner}")
    cut = [h["step"] for h in history if h.get("trunc_frac") == 1.0]
    if cut:   # no rollout could finish: the rewards and repairs above say nothing about the method
        print(f"WARNING: on {len(cut)} of {len(history)} steps every rollout hit --max-new-tokens "
              f"{args.max_new_tokens} before finishing (trunc_frac 1.0 in metrics.jsonl): raise --max-new-tokens")
    unavailable = [h["step"] for h in history if h.get("refiner_unavailable")]
    if unavailable:
        summary["refiner_unavailable_steps"] = unavailable
        print(f"WARNING: the refiner did not answer on {len(unavailable)} of {len(history)} steps "
              f"({', '.join(map(str, unavailable[:20]))}{' ...' if len(unavailable) > 20 else ''}): those steps "
              f"trained without rectification (metrics.jsonl: refiner_unavailable)")
    for line in format_changes(read_changes(run_dir)):
        print(f"config changed {line} ({run_dir}/changes.jsonl; config.json: the flags it started with)")
    for line in phase_memory.off_plan(history):   # GPU runs: each phase's measured peak against the memory plan
        print(line)
    has_traces = bool(read_log(os.path.join(run_dir, "traces.jsonl")))
    print(f"logs: {run_dir}/metrics.jsonl" + (f", {run_dir}/traces.jsonl" if has_traces else "")
          + f"; checkpoint: {run_dir}/checkpoint\nplot: python -m tools.report --plot {run_dir}"
          + (f"    repairs: python -m tools.report --trace {run_dir}" if has_traces else ""))
    return summary


@dataclass(frozen=True)
class Paper:
    """The pieces of the five top-level files that the engine builds or calls; scope.py passes them to `start`."""
    trajectory: type               # refine.Trajectory: what `Run.rollout` returns
    prm: type                      # prm.ProcessRewardModel (`load_prm`)
    evaluate: object               # eval.evaluate: the periodic held-out accuracy (`Run.evaluate`)
    near_miss_at_k: object         # eval.near_miss_at_k and ...
    discarded_valid_share: object  # ... eval.discarded_valid_share: two of the step's metrics (`step_metrics`)
    logprobs: object = None        # grpo.logprobs_and_entropy: the π_old pass `rollout` starts (harness/engines/overlap.py)
    refiner_prompt: object = None  # refine.refiner_prompt: what `Refiner` sends the refiner (`load_refiner`)


@dataclass
class Run:
    """One training run as the loop sees it: its settings, models and open logs, and the verbs of one step."""
    args: object
    run_dir: str
    device: str
    use_vllm: bool
    policy: object
    tokenizer: object
    ref_model: object
    generator: object
    prm: object
    refiner: object
    optimizer: object
    train_problems: list
    eval_problems: list
    start_step: int
    metrics_file: object
    traces_file: object
    t_start: float
    tracker: object = None                           # --report-to: TensorBoard or W&B (harness/run/trackers.py)
    summary: dict = field(default_factory=dict)
    dist: object = field(default_factory=dist.Dist)     # this process's rank under torchrun (harness/engines/dist.py)
    model: object = None                             # the module the update trains: policy, DDP or FSDP2
    prm_offload: bool = False                         # the PRM waits in CPU memory between its uses
    paper: Paper = None                               # what the engine calls from the five top-level files
    step: int = 0                                     # the step being run, its phase times, its start time, and
    times: dict = field(default_factory=dict)         # whether a served refiner stopped answering in it
    t0: float = 0.0
    unavailable: bool = False
    said_no_signal: bool = False                      # the note on a step without any reward signal was printed
    said_all_cut: bool = False                        # ... and the one on a step whose rollouts all hit the cap
    grade: object = None                              # --grader of the periodic evaluation (harness/data/mathverify.py)
    clock: object = None                              # step k/N and ETA of the step lines (harness/run/progress.py)
    overlap_old_logp: bool = False                    # --overlap-old-logp, resolved (memory.old_logp_overlapped)
    old_logp: object = None                           # ... this step's π_old pass (overlap.OldLogprobs) and
    old_logp_stream: object = None                    # the CUDA stream every step's pass runs on

    def amp(self):
        """bfloat16 autocast on CUDA (float32 master weights), nothing on the CPU."""
        if self.device.startswith("cuda"):
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def update_amp(self):
        """The context grpo.update enters around each micro-batch's forward: amp(), except under --fsdp, whose
        bf16 compute comes from FSDP2's MixedPrecisionPolicy (dist.mixed_precision)."""
        return contextlib.nullcontext() if self.args.fsdp else self.amp()

    def amp_for(self, generator):
        """amp() around an HF generator of this process; nothing around vLLM or a served model (they run in
        their own dtype: autocast there does nothing but hide what precision the sampler used)."""
        return self.amp() if isinstance(generator, HFGenerator) else contextlib.nullcontext()
    @contextlib.contextmanager
    def prm_on_device(self):
        """The PRM on the GPU for the block; with --prm-offload it lives in CPU memory outside it."""
        if not self.prm_offload:
            yield
            return
        self.prm.model.to(self.device)
        try:
            yield
        finally:
            self.prm.model.to("cpu")
            torch.cuda.empty_cache()   # hand its 14 GiB back to the allocator's pool for the update

    def steps(self):
        """(step, the step's B problems, this rank's groups) for each step still to run, with a progress bar on a
        terminal. Each step's torch seed and its
        problems (drawn with replacement only when there are fewer than B) derive from (seed, step) alone."""
        a = self.args
        B, mine = a.prompts_per_step, self.dist.groups(a.prompts_per_step)   # this rank's whole groups of the B
        self.clock = progress.StepClock(self.start_step, a.steps)   # k/N and ETA, from here: not the eval before
        for step in tqdm(range(self.start_step, a.steps + 1), initial=self.start_step - 1, total=a.steps,
                         desc="steps", disable=not sys.stderr.isatty() or not self.dist.main):
            self.step, self.times, self.t0, self.unavailable = step, {}, time.time(), False
            torch.manual_seed(self.seed("torch"))
            rng, n = np.random.default_rng(self.seed("prompts")), len(self.train_problems)
            yield step, [self.train_problems[i] for i in rng.choice(n, size=B, replace=n < B)], mine

    def seed(self, phase: str, items: list | None = None, per_item: int = 1) -> int:
        """A seed for one random phase of this step, from (seed, step, phase) only, so that a resume is exact;
        with `items` (this rank's picks), plus how many the lower torchrun ranks hold (their global index) times
        the seeds each takes (`per_item`: vLLM seeds item i's n samples seed + i·n ... + i·n + n − 1)."""
        offset = 0 if items is None else self.dist.offset(len(items)) * per_item
        return seed_for(self.args.seed, self.step, phase) + offset

    @contextlib.contextmanager
    def timed(self, name: str):
        """Time the block as time_<name>; on a GPU also its peak memory, against the plan (harness/plan/phase_memory.py)."""
        t0 = time.time()
        with phase_memory.phase(name):
            yield
        self.times[name] = time.time() - t0

    @contextlib.contextmanager
    def prm_phase(self):
        """Step 3's block (time_prm). Changes no data: the PRM sits on the GPU inside it (--prm-offload: in CPU
        memory outside it), and the toy PRM's noise is reseeded from (seed, step)."""
        with self.timed("prm"), self.prm_on_device():
            if self.args.toy and self.prm:
                self.prm.reseed(self.seed("prm"))
            yield

    @contextlib.contextmanager
    def refine_phase(self, picks: list):
        """Step 5's block (time_refine); yields the refiner's seed, from (seed, step) and the picks' global index
        (vLLM: pick i takes seed + i·attempts); autocast around an HF refiner. A served refiner that stops
        answering (GeneratorUnavailable) ends the block with a warning: the step trains on its rollouts unrepaired."""
        with self.timed("refine"):
            seed = self.seed("refine", picks, per_item=self.args.refine_attempts)
            try:
                with self.amp_for(getattr(self.refiner, "generator", None)):
                    yield seed
            except GeneratorUnavailable as err:
                tqdm.write(f"warning: the refiner did not answer, no rectification this step: {err}")
                self.unavailable = True

    @contextlib.contextmanager
    def update_phase(self):
        """Step 7's block (time_update). Changes no data: vLLM asleep (--rollout-sleep: its weights and KV cache
        freed), FSDP2's gathered weights dropped, the policy in train mode inside it."""
        with self.timed("update"):
            if self.old_logp is not None:   # --overlap-old-logp: its pass ends before the policy leaves eval mode
                self.old_logp.result()
                if self.old_logp_stream is not None and not (self.use_vllm and self.args.rollout_sleep):
                    torch.cuda.empty_cache()   # its stream's cached blocks back to the update (nothing sleeps)
            if self.use_vllm and self.args.rollout_sleep:
                self.generator.sleep()   # sync_weights wakes the weights, the next rollout the KV cache
            dist.reshard(self.policy)
            self.policy.train()
            yield
            self.policy.eval()

    def rollout(self, problems: list[dict], groups: range) -> list:
        """Step 1: G samples per prompt of `groups` at the rollout temperature, one batched call, kept as token
        ids (paper.trajectory each). vLLM seeds prompt i with seed + i·G, so a rank samples its slice alone; HF
        generate draws one stream for the whole call, so each rank samples all B prompts and keeps its groups.
        With --overlap-old-logp, π_old of the rows starts here on a worker thread (harness/engines/overlap.py)."""
        with self.timed("rollout"):
            a = self.args
            todo = groups if self.use_vllm else range(len(problems))
            prompts = [format_prompt(self.tokenizer, problems[b]["question"], a.system_prompt or None) for b in todo]
            self.policy.eval()
            with self.amp_for(self.generator):   # autocast for HF generate only, never around vLLM
                completions = self.generator.generate(prompts, n=a.group_size, temperature=a.temperature,
                                                      max_tokens=a.max_new_tokens,
                                                      seed=self.seed("rollout") + todo.start * a.group_size)
            trajs = [self.paper.trajectory(question=problems[b]["question"], answer=problems[b]["answer"], group=b,
                                           prompt_ids=prompt, response_ids=list(c.ids), text=c.text,
                                           finished=c.finished, sampler_logp=c.logprobs)
                     for b, prompt, group in zip(todo, prompts, completions) if b in groups for c in group]
        if self.overlap_old_logp:   # π_old of mini-batches 2..k's rows, on a worker thread through steps 2-5
            if self.old_logp_stream is None and self.device.startswith("cuda"):
                self.old_logp_stream = torch.cuda.Stream(torch.device(self.device))
            later = overlap.later_rows([t.group for t in trajs], a.updates_per_batch)
            self.old_logp = overlap.OldLogprobs(
                self.policy, [t for t, x in zip(trajs, later) if x], self.pad_id, stream=self.old_logp_stream,
                logprobs_fn=self.paper.logprobs, micro_batch_size=a.micro_batch_size, chunk_tokens=a.logprob_chunk,
                amp=self.update_amp, temperature=a.temperature)
        return trajs

    @property
    def pad_id(self) -> int:
        return pad_or_eos(self.tokenizer)

    def with_sampler_logprobs(self, batch: dict, trajs: list) -> dict:
        """The batch plus "sampler_logp" and "sampler_mask" (N, L): vLLM's log-prob of each rollout token (a repair:
        of its kept prefix), read by grpo.truncated_is_weight. The batch as it is with --tis-cap 0 or HF generate
        (it returns none)."""
        if self.args.tis_cap <= 0 or not any(t.sampler_logp for t in trajs):
            return batch
        return {**batch, **trainer.sampler_rows([t.prompt_ids for t in trajs], [t.response_ids for t in trajs],
                                                [t.sampler_logp for t in trajs], batch["input_ids"].shape[1])}

    def with_old_logprobs(self, batch: dict, trajs: list) -> dict:
        """The batch plus "old_logp" (N, L): π_old of mini-batches 2..k's rows (0 on the first's, which never read
        it), from the pass `rollout` started (--overlap-old-logp; its time is time_old_logp), so grpo.update skips
        its own. The batch as it is without that pass, or when some row's policy tokens are no rollout's prefix
        (a warning)."""
        if self.old_logp is None:
            return batch
        pending, self.old_logp = self.old_logp, None
        old = pending.for_batch(batch, overlap.later_rows([t.group for t in trajs], self.args.updates_per_batch))
        self.times["old_logp"] = pending.seconds
        if old is None:
            tqdm.write("warning: a row's policy tokens are no rollout's prefix; π_old computed in the update")
            return batch
        return {**batch, "old_logp": old}

    def on_device(self, batch: dict) -> dict:
        """The batch's tensors on the run's device; no value changed."""
        return {k: v.to(self.device) for k, v in batch.items()}

    def update_engine(self) -> dict:
        """How the engine runs grpo.update, none of it changing the loss: micro-batches, the log-softmax chunk,
        bf16 autocast around each forward (update_amp), torchrun's gradient exchange."""
        a = self.args
        return dict(micro_batch_size=a.micro_batch_size, chunk_tokens=a.logprob_chunk, amp=self.update_amp,
                    dist=self.dist if self.dist.world > 1 else None)

    def push_weights(self) -> None:
        """Step 8: the updated weights into the vLLM rollout engine (FSDP2: every rank gathers the full tensors
        for its own engine); nothing with HF generate, which samples from the policy itself."""
        with self.timed("sync"):
            if self.use_vllm:
                self.generator.sync_weights(dist.FullView(self.policy) if self.args.fsdp else
                                            lora.Merged(self.policy) if self.args.lora_rank else self.policy)

    def end_step(self, step: int, trajs: list, merged: list, traces: list[dict], stats: dict) -> None:
        """Step 9: every rank's rows gathered, the step's metrics, the periodic eval, the log line, the
        checkpoint every --save-every steps and after the last."""
        a = self.args
        trajs, merged, traces, unavailable = self.dist.gather(trajs, merged, traces, [self.unavailable])
        m, traces = step_metrics(step, a, trajs, merged, traces, stats, self.times, any(unavailable), self.paper)
        m["learning_rate"] = self.optimizer.param_groups[0]["lr"]   # what this step's optimizer steps used
        if a.eval_every and (step % a.eval_every == 0 or step == a.steps):
            t_eval = time.time()
            m["eval_acc"] = self.evaluate()
            m["time_eval"] = time.time() - t_eval
        m["time_step"] = time.time() - self.t0
        m.update(phase_memory.step_record())   # GPU runs: each phase's peak memory next to the plan's figure
        self.log(m, traces, line=False)   # metrics.jsonl, traces.jsonl: before the checkpoint, which a resume cuts
        if self.dist.main:    # a few of the step's own rollouts, whole (harness/run/progress.py: rollouts.jsonl)
            progress.log_rollouts(self.run_dir, step, trajs, seed=seed_for(a.seed, step, "logged"))
        saved = None
        if step % a.save_every == 0 or step == a.steps:
            t_save = time.time()
            self.checkpoint(step)
            saved = time.time() - t_save
        self.log(m, traces, write=False, checkpoint_seconds=saved)   # the step's line, its checkpoint's seconds too
        if self.dist.main and not self.said_no_signal and no_reward_signal(merged):
            self.said_no_signal = True
            print(f"note: step {step}: in every group all rewards are equal (all failed, or all passed), so the "
                  f"advantages are 0 and nothing was learned from this batch (said once; frac_all_fail + "
                  f"frac_all_pass = 1 in metrics.jsonl marks every such step)")
        if self.dist.main and not self.said_all_cut and m["trunc_frac"] == 1.0:
            self.said_all_cut = True
            print(f"note: step {step}: every rollout hit --max-new-tokens {a.max_new_tokens} before finishing, so "
                  f"none could reach a \\boxed{{}} answer (nor a repair within the budget left); raise "
                  f"--max-new-tokens (said once; trunc_frac in metrics.jsonl)")

    def evaluate(self) -> float:
        """Accuracy (avg@eval_n at temperature 0.6, up to --eval-max-new-tokens) on the held-out problems. Under
        torchrun with vLLM each rank evaluates its share (seeded by the global problem index) and the shares are
        counted together; HF generate's one random stream per call does not split, so there every rank
        evaluates all of them."""
        a, problems = self.args, self.eval_problems
        share = self.dist.block(len(problems)) if self.use_vllm and self.dist.world > 1 else range(len(problems))
        with self.amp_for(self.generator):
            result = self.paper.evaluate(self.generator, self.tokenizer, problems[share.start:share.stop], n=a.eval_n,
                                         temperature=EVAL_TEMPERATURE, max_new_tokens=a.eval_max_new_tokens,
                                         seed=a.seed + share.start * a.eval_n,   # vLLM: problem i takes seed + i·n
                                         batch_size=64, grade_fn=self.grade, system=a.system_prompt)
        if len(share) == len(problems):
            return result["acc"]
        return self.dist.sum(result["acc"] * len(share)) / len(problems)   # avg@n: a mean over problems

    def record(self, m: dict) -> None:
        """One metrics.jsonl record, also sent to the tracker."""
        self.metrics_file.write(json.dumps(m) + "\n")
        self.metrics_file.flush()
        if self.tracker is not None:
            self.tracker.log(m)

    def eval_before_training(self) -> None:
        """Step 0 of a new run with --eval-every > 0: the accuracy before any update, recorded in metrics.jsonl
        (the closing summary's "before") and printed. Nothing on a resume."""
        if self.start_step != 1 or not self.args.eval_every:
            return
        acc = self.evaluate()
        if self.dist.main:
            self.record({"step": 0, "mode": self.args.mode, "eval_acc": acc})
            print(f"eval before training: acc {acc:.3f}")

    def log(self, m: dict, traces: list[dict], write: bool = True, line: bool = True,
            checkpoint_seconds: float | None = None) -> None:
        """Append one step's metrics and traces (write) and print its line (line; with the seconds of the step's
        checkpoint, saved after the logs were written). Under torchrun every rank holds the same gathered metrics
        and rank 0 writes them."""
        step = m["step"]
        if self.dist.main and write:
            for tr in traces:
                self.traces_file.write(json.dumps({"step": step, **tr}) + "\n")
            self.traces_file.flush()
            self.record(m)
        if self.dist.main and line:
            text = progress.step_line(m, checkpoint_seconds, self.args.log_detail)   # ≤ 160 characters
            tqdm.write(self.clock.line(text, step) if self.clock else text)

    def checkpoint(self, step: int) -> None:
        """runs/<name>/checkpoint in one format for one process, DDP and FSDP2 (rank 0 writes; under FSDP2
        every rank helps gather the full weights and optimizer state first)."""
        model, optimizer = self.policy, self.optimizer
        if self.args.fsdp:
            model, optimizer = dist.full_checkpoint(self.policy, self.optimizer)
        if self.args.lora_rank:   # the adapter alone, float32 (PEFT's save_pretrained)
            model = lora.Saved(model)
        cuda_rng = self.dist.all_gather(torch.cuda.get_rng_state() if torch.cuda.is_available() else None)
        if self.dist.main:   # each rank's CUDA RNG state, of its own GPU: a resume gives each rank its own back
            save_checkpoint(self.run_dir, step, model, self.tokenizer, optimizer,
                            cuda_rng if torch.cuda.is_available() else None,   # + README.md, the adapter's base name
                            functools.partial(export.describe_checkpoint, run_dir=self.run_dir,
                                              tokenizer=self.tokenizer))
        self.dist.barrier()   # a resume after a crash finds the checkpoint every rank trained past

    def finish(self) -> dict:
        for log in (self.metrics_file, self.traces_file):   # None on ranks other than 0
            if log is not None:
                log.close()
        if self.tracker is not None:
            self.tracker.close()
        # the closing summary also as summary.txt; then curves.png and model/ (harness/run/progress.py, export.py)
        with progress.summary_to_file(os.path.join(self.run_dir, "summary.txt"), self.dist.main):
            summary = finish(self.summary, self.run_dir, self.t_start, self.start_step, self.refiner, self.args,
                             len(self.eval_problems), self.dist.main)
            if self.dist.main:
                summary.update(progress.closing_outputs(self.run_dir))
        dist.close()
        return summary


def start(args, paper: Paper) -> Run:
    """The pre-flight, then the run folder and the models; a --dry-run exits after the pre-flight."""
    t_start = time.time()
    progress.bars_only_on_a_terminal()                                # a log file gets lines, not carriage returns
    d = dist.init(args.dist_timeout)                                  # torchrun: the process group; else rank 0 of 1
    if not d.main:
        sys.stdout = open(os.devnull, "w")                            # rank 0 prints; errors still reach stderr
    if args.prompts_per_step % d.world:
        stop(f"--prompts-per-step {args.prompts_per_step}: not divisible by the {d.world} torchrun processes "
             f"(each takes whole groups)")
    if args.fsdp and d.world == 1:
        stop("--fsdp shards the policy over torchrun processes: launch with torchrun --nproc_per_node N")
    arg_notes = preflight.check_args(args, config.notes_of(args))    # every flag: one line and exit 2; notes
    grade = mathverify.for_name(args.grader)                          # the evaluation's grader; missing: one line
    preflight.check_resume(args)                                      # the record kept; a finished run: exit 0
    run_dir = preflight.run_dir_of(args)
    args.run_name = args.run_name or os.path.basename(run_dir)       # the default name, shown and recorded
    device, use_vllm, notes = preflight.choose_device(args)           # the GPU before the data
    offline, hub_notes = preflight.check_hub(args, preflight.resume_step_of(args, run_dir))  # no network: one line
    preflight.check_prm_weights(args)                                 # a damaged PRM checkpoint: one line
    train_problems, eval_problems = preflight.load_data(args, offline, notes)  # non-empty, before any model
    resume_step = preflight.check_run_dir(args, run_dir)              # no clobbering, no resume below the checkpoint
    preflight.check_memory(args, device, use_vllm)                    # printed; stops on a GPU too small
    if device.startswith("cuda"):                                     # each phase's peak, against the plan
        phase_memory.start(memory.memory_plan(args, torch.cuda.get_device_properties(torch.device(device))
                                                 .total_memory / memory.GIB, use_vllm)[0], torch.cuda)
    if args.dry_run:   # the command line exits 0; scope.main called from Python returns the plan
        preflight.print_dry_run(args, run_dir, notes + hub_notes)
        raise Done({"dry_run": True, "run_dir": run_dir, "args": asdict(args), "notes": arg_notes + notes + hub_notes,
                    "memory_plan": [{"what": what, "gib": gib, "phase": phase} for what, gib, phase in
                                    memory.memory_plan(args, None, use_vllm or args.backend != "hf")[0]]})

    d.barrier()                                                       # every rank checked the folder before rank 0 writes
    new_folder = only_logs(run_dir)                                  # no folder, or a failed start's logs
    ckpt, start_step = d.broadcast(open_run(args, run_dir, resume_step) if d.main else None)
    seed_everything(args.seed)
    if args.toy:
        torch.set_num_threads(1)   # a 0.3 M-parameter model gains nothing from threads; on a shared 2-core machine
                                   # two threads per process were ~15x slower (oversubscription)
    with removed_on_failure(run_dir, new_folder and d.main):          # a failed load leaves no run, only server logs
        base_path = base_model_path(args) if d.main else None        # rank 0 trains a missing toy warm start alone
        d.barrier()
        base_path = base_path or base_model_path(args)
        policy, tokenizer, ref_model = load_policy(args, ckpt or base_path, base_path, device)
        model = dist.wrap(policy, d, args.fsdp)                       # DDP or FSDP2 under torchrun; else the policy
        engine_path = base_path if args.lora_rank else ckpt or base_path   # a LoRA checkpoint holds the adapter only
        generator = make_rollout_engine(args, policy, tokenizer, engine_path, use_vllm, d.world)
        if use_vllm and ckpt and args.lora_rank:   # vLLM loaded the base: now the checkpoint's adapter merged in
            generator.sync_weights(lora.Merged(policy))
        prm = load_prm(args, device, paper.prm, use_vllm, run_dir)
        refiner = load_refiner(args, generator, tokenizer, device, run_dir, paper.refiner_prompt)
    optimizer = make_optimizer(args, policy, device)   # after wrap: FSDP2's parameters are shards
    prm_offload = prm is not None and not args.toy and memory.prm_offloaded(args, device, use_vllm)
    if prm_offload:
        prm.model.to("cpu")   # between its uses; Run.prm_on_device brings it back for step 3
    if ckpt:
        restore_checkpoint(ckpt, optimizer, device, policy if args.fsdp else None, d.rank)
        print(f"resumed {run_dir} at step {start_step}")
    mode = "a" if ckpt else "w"
    logs = [open(os.path.join(run_dir, name), mode, encoding="utf-8") if d.main else None
            for name in ("metrics.jsonl", "traces.jsonl")]
    run = Run(args, run_dir, device, use_vllm, policy, tokenizer, ref_model, generator, prm, refiner, optimizer,
              train_problems, eval_problems, start_step, *logs, t_start,
              trackers.open_tracker(args.report_to, run_dir, asdict(args), start_step) if d.main else None,
              summary={"run_dir": run_dir}, dist=d, model=model, prm_offload=prm_offload, paper=paper,
              grade=grade, overlap_old_logp=memory.old_logp_overlapped(args, device, use_vllm))
    unused = cli.unused_system_prompt(tokenizer, args.system_prompt)   # the toy tokenizer has no chat template
    if unused and d.main:
        print(unused)
    n_params = sum(p.numel() for p in policy.parameters())
    trained = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    adapter = f" (LoRA rank {args.lora_rank}: {trained / 1e6:.2f} M trained)" if args.lora_rank else ""
    print(f"{run_dir}: {args.mode}, policy {n_params / 1e6:.2f} M params{adapter} on {device} "
          f"({'vLLM' if use_vllm else 'HF generate'}), {len(train_problems)} train / {len(eval_problems)} eval problems")
    return run


def step_metrics(step: int, args, rollouts: list, trained: list, traces: list[dict], stats: dict, times: dict,
                 unavailable: bool, paper: Paper) -> tuple[dict, list[dict]]:
    """Everything logged about one step, computed once after it: the policy's own rollouts (comparable across
    modes), the PRM's view of the failures, the repairs, the update, the time per phase (docs/metrics.md). Traces
    get the group's rewards before repair."""
    from harness.data import toy
    B, G = args.prompts_per_step, args.group_size
    passed = np.array([t.correct for t in rollouts]).reshape(B, G)
    failed_scored = [t for t in rollouts if not t.correct and t.step_scores is not None]
    accepted = [tr for tr in traces if tr["accepted"]]
    m = {"step": step, "mode": args.mode,
         "reward_mean": float(passed.mean()), "frac_all_fail": float((~passed.any(1)).mean()),
         "frac_all_pass": float(passed.all(1).mean()),
         "response_len": float(np.mean([len(t.response_ids) for t in rollouts])),
         "trunc_frac": float(np.mean([not t.finished for t in rollouts])),   # hit max_new_tokens without a stop
         "near_miss_frac": paper.near_miss_at_k([(len(t.steps), t.cut) for t in failed_scored], k=1) if failed_scored else None,
         "discarded_valid_frac": paper.discarded_valid_share([t.keep_ratio for t in failed_scored]) if failed_scored else None,
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


def seed_for(seed: int, step: int, phase: str) -> int:
    """A seed for one random phase of one step, derived from (seed, step, phase) only: resume is exact."""
    return int(np.random.SeedSequence([seed, step, zlib.crc32(phase.encode())]).generate_state(1)[0] % 2**31)


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"
