"""step.py — one toy GRPO training step: ours (scope.py's code path) against TRL's GRPOTrainer.

Same model (the toy warm start in cache/, trained once by `python -m harness.data.toy` or `python scope.py --toy`),
same batch shape (8 prompts × 8 rollouts, up to 128 new tokens, temperature 1.0, one optimizer step per
batch, no KL, Dr. GRPO loss, AdamW), same reward (`harness.data.grader.grade` of the last \\boxed{}), one CPU thread.
A step is: sample the rollouts, grade them, advantages, one optimizer step. Runs alternate: TRL step k
then our step k (our step runs inside a TRL callback, between two TRL steps), so slow phases of a
shared machine hit both; the medians of `--steps` timed steps are printed after `--warmup` untimed ones, for the
whole step and per phase: rollout (the sampling call: our HFGenerator, TRL's `_generate`), score (rewards,
advantages, batch: the rest of TRL's `_generate_and_score_completions`), update (forward, backward, AdamW).

What differs, said plainly: TRL generates the 64 rollouts in one `generate` call; ours generates in
micro-batches of `--micro-batch-size` (scope.py's toy default 64: one call as well). TRL's step also
does its own logging bookkeeping; ours writes no files. Neither runs a separate old-log-prob forward
(one optimizer step per batch: ρ = 1 in both).

Run: `python -m tools.bench.step` (needs `pip install trl accelerate`; checked with trl 1.16.0, accelerate 1.15.0,
transformers 5.20). Prints one line per timed step and a summary with medians, per phase.
"""
import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repository root


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=7, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per side first")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--micro-batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--old-logp-pass", action="store_true",
                    help="also time our step with a separate no-grad old-log-prob forward "
                         "(same model; the two variants alternate their order every step)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    try:
        import trl
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise SystemExit(f"error: bench_step.py needs TRL: pip install trl accelerate ({e})")

    from harness.data import toy
    from harness.data.grader import grade
    from harness.data.prompt import format_prompt
    from harness.engines.generate import HFGenerator, load_causal_lm
    from grpo import build_batch, group_advantages, token_logprobs, update

    cache = os.path.join(ROOT, "cache")
    path = toy.cache_path(cache, seed=0)
    if not os.path.isdir(path):
        raise SystemExit(f"error: no toy warm start at {path}; run `python -m harness.data.toy` once first")
    n_total = args.prompts * 2 * (args.steps + args.warmup + 2)
    problems = toy.make_problems(n_total, seed=12345)
    answers = {p["question"]: p["answer"] for p in problems}

    # ---------------------------------------------------------------- ours: scope.py's step 1, 2, 6, 7
    ours, tok = load_causal_lm(path, "cpu", torch.float32)
    gen = HFGenerator(ours, tok, micro_batch_size=args.micro_batch_size)
    opt = torch.optim.AdamW(ours.parameters(), lr=args.lr)
    B, G = args.prompts, args.group_size
    state = {"k": 0}

    def our_step(old_logp_pass=False):
        batch_problems = problems[state["k"] * B:(state["k"] + 1) * B]
        state["k"] += 1
        t0 = time.perf_counter()
        prompts = [format_prompt(tok, p["question"]) for p in batch_problems]
        ours.eval()
        completions = gen.generate(prompts, n=G, temperature=1.0, max_tokens=args.max_new_tokens,
                                   seed=1000 + state["k"])
        t_rollout = time.perf_counter()
        rewards = torch.tensor([float(grade(c.text, p["answer"]))
                                for p, group in zip(batch_problems, completions) for c in group])  # (B*G,)
        adv = group_advantages(rewards, G)
        resp = [list(c.ids) for group in completions for c in group]
        batch = build_batch([prompts[i // G] for i in range(B * G)], resp, [None] * (B * G), adv, tok.pad_token_id)
        if old_logp_pass:
            batch["old_logp"], _ = token_logprobs(ours, batch["input_ids"], batch["attention_mask"],
                                                  batch["response_mask"], args.micro_batch_size)
        t_score = time.perf_counter()
        ours.train()
        update(ours, opt, batch, micro_batch_size=args.micro_batch_size, max_grad_norm=1.0,
               loss_agg="constant", max_new_tokens=args.max_new_tokens, chunk_tokens=0)   # as scope.py --toy
        ours.eval()
        t1 = time.perf_counter()
        phases = {"rollout": t_rollout - t0, "score": t_score - t_rollout, "update": t1 - t_score}
        return t1 - t0, float(rewards.mean()), sum(map(len, resp)) / len(resp), phases

    # ---------------------------------------------------------------- TRL: GRPOTrainer on a copy of the same model
    theirs, _ = load_causal_lm(path, "cpu", torch.float32)
    prompt_text = [tok.decode(format_prompt(tok, p["question"])) for p in problems]
    data = Dataset.from_dict({"prompt": prompt_text, "question": [p["question"] for p in problems]})

    def reward_fn(prompts, completions, question, **_):
        return [float(grade(c, answers[q])) for c, q in zip(completions, question)]

    config = GRPOConfig(
        output_dir=os.path.join("/tmp", f"bench_step_trl_{os.getpid()}"), use_cpu=True, bf16=False,
        per_device_train_batch_size=B * G, gradient_accumulation_steps=1, num_generations=G,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, beta=0.0,
        loss_type="dr_grpo", scale_rewards="none", learning_rate=args.lr, max_grad_norm=1.0,
        lr_scheduler_type="constant", warmup_steps=0, num_iterations=1,
        max_steps=args.steps + args.warmup, logging_steps=10_000, save_strategy="no", report_to="none",
        shuffle_dataset=False, seed=0, disable_dropout=True, dataloader_num_workers=0)
    times = {"trl": [], "ours": [], "ours_old_pass": []}
    info = {"ours_len": []}
    phase_times = {side: {"rollout": [], "score": [], "update": []} for side in ("trl", "ours")}
    trl_phase = {}

    class Alternate(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, cb_args, cb_state, control, **k):
            t_trl = time.perf_counter() - self.t0
            step = cb_state.global_step
            order = [False, True] if args.old_logp_pass else [False]
            if step % 2 == 0:
                order.reverse()
            t_old = None
            for old in order:
                t, r, n, phases = our_step(old)
                if old:
                    t_old = t
                else:
                    t_ours, our_phases = t, phases
            counted = step > args.warmup
            if counted:
                times["trl"].append(t_trl)
                times["ours"].append(t_ours)
                if t_old is not None:
                    times["ours_old_pass"].append(t_old)
                info["ours_len"].append(n)
                prepared = trl_phase.get("prepare", 0.0)
                theirs_now = {"rollout": trl_phase.get("generate", 0.0),
                              "score": trl_phase.get("score", 0.0) - trl_phase.get("generate", 0.0),
                              "update": t_trl - prepared}
                for side, values in (("trl", theirs_now), ("ours", our_phases)):
                    for phase, v in values.items():
                        phase_times[side][phase].append(v)
            trl_phase.clear()
            extra = f", ours with the old-log-prob pass {t_old:.3f} s" if t_old is not None else ""
            print(f"step {step}{'' if counted else ' (warm-up)'}: TRL {t_trl:.3f} s, ours {t_ours:.3f} s{extra} "
                  f"(mean response {n:.0f} tokens)", flush=True)

    trainer = GRPOTrainer(model=theirs, reward_funcs=reward_fn, args=config, train_dataset=data,
                          processing_class=tok, callbacks=[Alternate()])
    for method, phase in (("_generate", "generate"), ("_generate_and_score_completions", "score"),
                          ("_prepare_inputs", "prepare")):   # TRL's phases, timed by wrapping its own methods
        setattr(trainer, method, timed(getattr(trainer, method), trl_phase, phase))
    trainer.train()

    med_t, med_o = statistics.median(times["trl"]), statistics.median(times["ours"])
    print(f"\ntoy GRPO step, {B} prompts x {G} rollouts, <= {args.max_new_tokens} new tokens, 1 thread, "
          f"{len(times['ours'])} alternating steps each (trl {trl.__version__}, torch {torch.__version__}):")
    print(f"  ours  median {med_o:.3f} s  (min {min(times['ours']):.3f}, max {max(times['ours']):.3f})")
    if times["ours_old_pass"]:
        o = times["ours_old_pass"]
        print(f"  ours with the separate old-log-prob pass: median {statistics.median(o):.3f} s "
              f"(min {min(o):.3f}, max {max(o):.3f})")
    print(f"  TRL   median {med_t:.3f} s  (min {min(times['trl']):.3f}, max {max(times['trl']):.3f})")
    paired = statistics.median(o / t for o, t in zip(times["ours"], times["trl"]))
    print(f"  median of the paired ratios ours_k / TRL_k = {paired:.2f}")
    print(f"  ours / TRL = {med_o / med_t:.2f}   mean response {statistics.mean(info['ours_len']):.0f} tokens (ours)")
    print("  per phase, medians (ours vs TRL):")
    for phase in ("rollout", "score", "update"):
        o, t = statistics.median(phase_times["ours"][phase]), statistics.median(phase_times["trl"][phase])
        print(f"    {phase:8s} ours {o:.3f} s   TRL {t:.3f} s   ratio {o / t:.2f}" if t > 0 else
              f"    {phase:8s} ours {o:.3f} s   TRL {t:.3f} s")
    return 0


def timed(method, into: dict, name: str):
    """`method` that adds its wall time to into[name] (TRL's phases inside one step)."""
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return method(*a, **k)
        finally:
            into[name] = into.get(name, 0.0) + time.perf_counter() - t0
    return wrapper


if __name__ == "__main__":
    sys.exit(main())
