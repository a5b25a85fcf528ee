"""toy.py — the CPU toy world: SCOPE's loop with stand-ins small enough to run on a laptop.

What it implements (the world is described, with its measured statistics, in docs/results.md):
- a task generator of multi-step arithmetic. Question: "Start at 7, add 5, times 2, minus 4, add 9."
  Solution: one step per operation, "So 7 + 5 = 12.", "So 12 * 2 = 24.", ..., then "\\boxed{29}", steps
  separated by a blank line ("\\n\\n") like real solutions, so `prm.split_steps` cuts them as it cuts real
  ones (the "So ... ." makes every step at least 8 non-blank characters, split_steps' default minimum);
- a char-level `PreTrainedTokenizerFast` (one token per character) built with `tokenizers`;
- a difficulty ladder: 1 to 6 operations per question, drawn with weight n^2 (TASK_DEFAULTS, the RL problems);
- a tiny `Qwen2ForCausalLM` config and an SFT warm start on solutions that carry one injected arithmetic
  slip with a probability that grows with the chain (1 - (1 - q)^n), placed late in the chain (weight (k+1)^2)
  to offset the model's own early arithmetic errors, so the starting policy solves short chains mostly, long
  chains rarely (all-fail groups), and its first errors fall across the whole chain (choice 4). Cached on disk; a second call with the same settings loads it in a second;
- `refiner_model`, the model refiner: the warm start trained further on clean solutions only, run by
  scope.py through `refiner.Refiner` + `generate.HFGenerator` like a real refiner (`--refiner toy-model`);
- `ToyPRM`, a rule-based step verifier with the `score`/`score_batch` interface of `prm.ProcessRewardModel`;
- `OracleRefiner`, with the `continue_from` interface of `refiner.Refiner`, that writes the correct remaining
  steps from any prefix.

Paper: Ren et al., "Recycling Failures: Salvaging Exploration in RLVR via Fine-Grained Off-Policy Guidance"
(arXiv 2602.24110). The toy world is ours, not the paper's: it runs the whole loop on a CPU, for the tests
and for students without a GPU.

Run: `python scope.py --toy` uses it; `python -m harness.data.toy` prints a sample problem, its solution and a warm
start cache path (training one if needed).

Choices and departures (numbered):
1. A step is correct iff it applies the k-th operation of the QUESTION to the k-th value of the correct
   chain with the right result. So the first wrong step is where the chain diverges, and a later step that
   does correct arithmetic on a wrong value is still wrong (0.0): the verifier grades against the
   question, like a PRM asked "is this step correct?". A step that cannot be parsed scores 0.0; steps past
   the "\\boxed{}" step score 0.0. Position k counts the items ("So a op b = c." / "\\boxed{v}") stated so
   far, not the steps, so a step holding two items (split_steps merged them) is judged exactly.
2. ToyPRM's noise flips each step score (1.0 <-> 0.0) independently with probability `noise`, from a
   `random.Random(seed)` owned by the instance: the flips are deterministic given the seed AND the order
   of calls.
3. OracleRefiner continues as a real refiner would: from the LAST VALUE stated in the prefix (the start
   value for an empty prefix) it applies the operations that remain (those after the number of items the
   prefix states), one step each, then "\\boxed{}". A prefix that does not end at a blank line gets the
   missing newlines first; the suffix is cut to `max_tokens` characters (= tokens). If the
   prefix already holds an error (possible with a noisy PRM) the continuation is consistent with it and the
   answer is wrong, which is realistic. It is deterministic: the n attempts are identical.
4. Injected slips: the result of step k is off by one of +-1, +-2, +-10 (kept >= 0); later steps continue
   consistently from the wrong value. A solution of n operations carries a slip with probability
   1 - (1 - step_error_rate)^n (q = 0.4), at step k drawn with weight (k + 1) ** `lateness` over the
   operation steps; the "\\boxed{}" copy only with `slip_boxed` (slips on the copy make most of SCOPE's
   picks copy errors, which GRPO fixes alone). Why lateness 2 and not 0 (uniform slips): the sampled policy
   adds its own arithmetic errors, mostly early in the chain, so uniform slips give FRONT-loaded first
   errors (6 operations: 293 / 238 / 150 / 90 / 53 / 38 at steps 0-5); with slips drawn late the sampled
   first errors come out roughly uniform. The SFT result varies a lot with the settings: with lateness 1.0
   or 1.5, or with 1200 instead of 2000 steps, the same recipe gives weaker policies (13-25 % accuracy)
   whose errors are front-loaded again (docs/results.md).
5. Values of the correct chain stay in 0..`max_value`; operations whose result would leave that range are
   not drawn. Wrong chains may leave it (they are written as they are).
6. SFT trains on freshly drawn problems each step (no fixed train set), from a seed stream different from the
   evaluation problems' (`make_problems(n, seed)`); with ~10^7 possible questions and ~4*10^4 drawn,
   overlap with a few hundred held-out problems is negligible.
7. The tokenizer has one token per character the task uses, plus "<|endoftext|>" (EOS and pad), "<extra_0>"
   (the Qwen PRM step separator, so PRM-style code runs) and "<unk>" (a character outside the task maps to it
   instead of raising). No chat template, so `prompt.format_prompt` uses the plain layout
   "Question: {q}\\nSolution:\\n".
8. Defaults: 1-6 operations, values 0..30, operands 1..9, multiplier 2; a 2-layer, 128-wide Qwen2
   (0.30 M parameters); 2000 SFT steps of 32 at lr 3e-3, step_error_rate 0.4, lateness 2. Sampling at temperature 1.0 reproduces the slips. The SFT problems
   (SFT_TASK) are part of the warm start's cache key, the RL problems (TASK_DEFAULTS) are not.
9. The model refiner (REFINER_DEFAULTS): 200 more SFT steps from the warm start at lr 1e-3 on clean
   solutions (step_error_rate 0), another problem stream; same tokenizer, so the splice is exact.
10. Styles (the warm-start setting `styles` = K, default 1): with K > 1 each SFT solution is written in one
   of the first K STYLES, drawn uniformly per solution and kept for all its steps, so correct solutions
   differ in form while being graded the same (choice 1 judges the item, never the phrasing):
       0  "So 7 + 5 = 12."      1  "7 add 5 is 12."      2  "So 12 = 7 + 5."
   (the answer step "\\boxed{41}" is the same in every style). Every style uses only characters the
   tokenizer already has and has >= 8 non-blank characters, and each one tells its style on every
   operation, minus included (a commutative order "So 5 + 7 = 12." has no form for minus, so it is not one
   of them). `style_of` reads a response's style, `style_stats` the shares and entropy over responses.
   OracleRefiner continues in the style of the prefix's last operation step, style 0 for a prefix without
   one; the model refiner is trained on clean solutions of the same K styles. K = 1 leaves the settings
   hash, the SFT stream and every cache path exactly as without the setting. The styles are not equally
   easy for the tiny model: style 2 states the result before the operation. The shipped K = 3 warm start
   (same SFT otherwise) writes each style in about a third of its samples at T = 1.0 but solves 5 % of its
   style-2 samples against 20 % of styles 0 and 1; overall 15.1 % on the ladder (the one-style start:
   21.9 %), and its first errors front-loaded (2115 / 848 / 511 /
   383 / 215 failures with the first error in each fifth of the chain; the one-style start: 920 / 643 /
   819 / 850 / 514), measured as `python -m tools.studies --describe` measures the starts. The K = 2
   warm start (styles 0 and 1, also shipped) has no hard style: 29.7 % of either style's samples are
   correct, 29.4 % on the ladder, first errors spread over the chain (556 / 636 /
   777 / 880 / 542); a stronger start than the one-style one (the SFT outcome moves with its settings,
   choice 4).
"""
import hashlib
import json
import math
import os
import random
import re
import time

import torch


VERSION = 3  # bump when a change to this file should invalidate cached warm starts
EOS = "<|endoftext|>"
STEP_SEP = "\n\n"
# the RL problems: the difficulty ladder is the number of operations (1 = one step, 6 = six steps), drawn with
# weight n ** ops_power (2: a 6-operation problem is 36x as likely as a 1-operation one, so that about 20 % of
# the warm start's G = 8 groups are all-fail, the regime SCOPE is about; 0: uniform, as the SFT problems)
TASK_DEFAULTS = dict(min_ops=1, max_ops=6, max_value=30, max_operand=9, max_factor=2, ops_power=2.0)
# the warm start's SFT problems (part of its cache key; changing TASK_DEFAULTS does not retrain it)
SFT_TASK = dict(min_ops=1, max_ops=6, max_value=30, max_operand=9, max_factor=2, ops_power=0.0)
# step_error_rate q: a solution of n operations carries one slip with probability 1 - (1 - q)^n, so its
# chance to be right is (1 - q)^n, like a policy that slips at each step; where the slip falls: weight
# (k + 1) ** lateness over the operation steps (0 = uniform), plus the answer copy if slip_boxed
WARM_DEFAULTS = dict(sft_steps=2000, batch_size=32, lr=3e-3, warmup=20, step_error_rate=0.4, lateness=2.0,
                     slip_boxed=False, slips=(1, -1, 2, -2, 10, -10))
REFINER_DEFAULTS = dict(refiner_steps=200, refiner_lr=1e-3)   # the model refiner: warm start + clean SFT
MODEL_DEFAULTS = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=256, max_position_embeddings=256)
OPS = {"add": "+", "minus": "-", "times": "*"}          # question word -> step symbol
SYMBOLS = {v: k for k, v in OPS.items()}
# the step templates of choice 10 (style k = STYLES[k]); `sym` is the step symbol, `word` the question word
STYLES = ("So {a} {sym} {b} = {c}.", "{a} {word} {b} is {c}.", "So {c} = {a} {sym} {b}.")
ITEM_RE = re.compile(r"So (?P<a0>-?\d+) (?P<s0>[+\-*]) (?P<b0>\d+) = (?P<c0>-?\d+)\."          # style 0
                     r"|(?P<a1>-?\d+) (?P<s1>add|minus|times) (?P<b1>\d+) is (?P<c1>-?\d+)\."   # style 1
                     r"|So (?P<c2>-?\d+) = (?P<a2>-?\d+) (?P<s2>[+\-*]) (?P<b2>\d+)\."        # style 2
                     r"|\\boxed\{(?P<v>-?\d+)\}")                                            # the answer
QUESTION_RE = re.compile(r"Start at (\d+)((?:, (?:add|minus|times) \d+)+)\.")


# ---------------------------------------------------------------- the task

def _apply(value: int, sym: str, arg: int) -> int:
    return value + arg if sym == "+" else value - arg if sym == "-" else value * arg


def format_step(value: int, sym: str, arg: int, result: int, style: int = 0) -> str:
    """One operation step in style `style` (choice 10; 0: "So 7 + 5 = 12.")."""
    return STYLES[style].format(a=value, sym=sym, word=SYMBOLS[sym], b=arg, c=result)


def _draw_op(rng: random.Random, value: int, *, max_value: int, max_operand: int, max_factor: int):
    """One operation (symbol, operand) whose result stays in 0..max_value."""
    choices = []
    if value + 1 <= max_value:
        choices.append(("+", rng.randint(1, min(max_operand, max_value - value))))
    if value >= 1:
        choices.append(("-", rng.randint(1, min(max_operand, value))))
    if 1 <= value and 2 * value <= max_value:
        choices.append(("*", rng.randint(2, min(max_factor, max_value // value))))
    return rng.choice(choices)


def _draw_ops(rng: random.Random, lo: int, hi: int, power: float) -> int:
    """Number of operations in lo..hi, weight n ** power (power 0: rng.randint, the v2 stream)."""
    if power == 0:
        return rng.randint(lo, hi)
    return rng.choices(range(lo, hi + 1), weights=[n ** power for n in range(lo, hi + 1)])[0]


def make_problems(n: int, seed: int, **task_kw) -> list[dict]:
    """n problems {"id", "question", "answer", "solution_steps"}; same (n, seed, task_kw) -> same list.

    task_kw: min_ops, max_ops (operations per question, drawn with weight n ** ops_power; 0 = uniform),
    max_value (range of the correct chain),
    max_operand (largest number added/subtracted), max_factor (largest multiplier)."""
    cfg = {**TASK_DEFAULTS, **task_kw}
    unknown = set(cfg) - set(TASK_DEFAULTS)
    if unknown:
        raise TypeError(f"make_problems: unknown task setting(s) {sorted(unknown)}; known: {sorted(TASK_DEFAULTS)}")
    rng = random.Random(seed)
    problems = []
    for i in range(n):
        start = value = rng.randint(1, cfg["max_value"] // 2)
        ops = []
        for _ in range(_draw_ops(rng, cfg["min_ops"], cfg["max_ops"], cfg["ops_power"])):
            sym, arg = _draw_op(rng, value, max_value=cfg["max_value"], max_operand=cfg["max_operand"],
                                max_factor=cfg["max_factor"])
            ops.append((sym, arg))
            value = _apply(value, sym, arg)
        question = f"Start at {start}, " + ", ".join(f"{SYMBOLS[s]} {a}" for s, a in ops) + "."
        steps = _chain_steps(start, ops)
        problems.append({"id": f"toy-{seed}-{i}", "question": question, "answer": str(value),
                         "solution_steps": steps})
    return problems


def _chain_steps(start: int, ops, *, error_at: int | None = None, slip: int = 0, style: int = 0) -> list[str]:
    """Steps "So a op b = c." (in `style`) for each operation, then "\\boxed{final}"; step `error_at` is off by `slip`."""
    steps, value = [], start
    for k, (sym, arg) in enumerate(ops):
        result = _apply(value, sym, arg) + (slip if k == error_at else 0)
        steps.append(format_step(value, sym, arg, result, style))
        value = result
    steps.append(f"\\boxed{{{value + (slip if error_at == len(ops) else 0)}}}")
    return steps


def parse_question(question: str) -> tuple[int, list[tuple[str, int]]]:
    """(start, [(symbol, operand), ...]) of a toy question; ValueError naming the question otherwise."""
    m = QUESTION_RE.search(question)
    if m is None:
        raise ValueError(f"not a toy question: {question!r}")
    ops = [(OPS[word], int(arg)) for word, arg in re.findall(r"(add|minus|times) (\d+)", m.group(2))]
    return int(m.group(1)), ops


def correct_chain(question: str) -> list[int]:
    """Values v_0 (start), v_1, ..., v_n of the correct chain."""
    start, ops = parse_question(question)
    values = [start]
    for sym, arg in ops:
        values.append(_apply(values[-1], sym, arg))
    return values


def draw_error_at(n_ops: int, rng: random.Random, lateness: float, boxed: bool = True) -> int:
    """Index of the slipped step in 0..n_ops (n_ops = the boxed step, drawn only if `boxed`);
    weight (k + 1) ** lateness (0 = uniform)."""
    last = n_ops + 1 if boxed else n_ops
    if last < 1:
        raise ValueError(f"draw_error_at: no step to slip in (n_ops={n_ops}, boxed={boxed})")
    weights = [(k + 1) ** lateness for k in range(last)]
    return rng.choices(range(last), weights=weights)[0]


def slip_probability(n_ops: int, step_error_rate: float) -> float:
    """Chance that an SFT solution of n_ops operations carries a slip: 1 - (1 - q)^n_ops."""
    return 1.0 - (1.0 - step_error_rate) ** n_ops


def solution_text(problem: dict, error_at: int | None = None, rng: random.Random | None = None,
                  slips=WARM_DEFAULTS["slips"], style: int = 0) -> str:
    """The solution, steps joined by "\\n\\n", every step in `style` (choice 10). With `error_at` = k, step
    k's result is off by a slip drawn from `slips` with `rng` (the boxed step when k = number of operations);
    later steps follow the wrong value."""
    if error_at is None and style == 0:
        return STEP_SEP.join(problem["solution_steps"])
    start, ops = parse_question(problem["question"])
    if error_at is None:
        return STEP_SEP.join(_chain_steps(start, ops, style=style))
    if not 0 <= error_at <= len(ops):
        raise ValueError(f"error_at={error_at} outside 0..{len(ops)} for problem {problem.get('id')}")
    rng = rng or random.Random(0)
    right = correct_chain(problem["question"])[min(error_at + 1, len(ops))]
    slip = rng.choice([s for s in slips if right + s >= 0])
    return STEP_SEP.join(_chain_steps(start, ops, error_at=error_at, slip=slip, style=style))


# ---------------------------------------------------------------- tokenizer and model

def make_tokenizer():
    """Char-level PreTrainedTokenizerFast over exactly the characters of the toy task (+ specials)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    text = "Question: Solution:\nStart at, add minus times. So 0123456789 + - * = \\boxed{}"
    specials = [EOS, "<extra_0>", "<unk>"]
    vocab = {s: i for i, s in enumerate(specials)}
    for ch in sorted(set(text)):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, pad_token=EOS, unk_token="<unk>",
                                   additional_special_tokens=["<extra_0>"])


def tiny_config(tokenizer, **kw):
    """A tiny Qwen2Config (defaults: ~0.8 M parameters); keyword arguments override MODEL_DEFAULTS."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=len(tokenizer), tie_word_embeddings=True, bos_token_id=None,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       **{**MODEL_DEFAULTS, **kw})


# ---------------------------------------------------------------- SFT warm start

def _settings(seed: int, kw: dict) -> dict:
    known = set(WARM_DEFAULTS) | set(MODEL_DEFAULTS) | set(SFT_TASK) | {"styles"}
    unknown = set(kw) - known
    if unknown:
        raise TypeError(f"warm_start: unknown setting(s) {sorted(unknown)}; known: {sorted(known)}")
    s = {**WARM_DEFAULTS, **MODEL_DEFAULTS, **SFT_TASK, **kw, "seed": seed, "version": VERSION}
    s["slips"] = list(s["slips"])
    if s.get("styles", 1) == 1:   # one style: hashed as without the setting, so every cache path stays (choice 10)
        s.pop("styles", None)
    elif not (isinstance(s["styles"], int) and 1 <= s["styles"] <= len(STYLES)):
        raise ValueError(f"warm_start: styles={s['styles']!r} must be an integer in 1..{len(STYLES)}")
    return s


def cache_path(cache_dir: str, seed: int = 0, **kw) -> str:
    """Directory of the warm start with these settings: <cache_dir>/toy_warm_<sha256 of settings>[:12]."""
    s = _settings(seed, kw)
    digest = hashlib.sha256(json.dumps(s, sort_keys=True).encode()).hexdigest()[:12]
    return os.path.join(cache_dir, f"toy_warm_{digest}")


def sft_example(tokenizer, problem: dict, solution: str) -> tuple[list[int], list[int]]:
    """(input ids, labels): prompt + solution + EOS; labels -100 on the prompt (loss on the solution only)."""
    from harness.data.prompt import format_prompt

    prompt = format_prompt(tokenizer, problem["question"])
    answer = tokenizer.encode(solution, add_special_tokens=False) + [tokenizer.eos_token_id]
    return prompt + answer, [-100] * len(prompt) + answer


def _sft(model, tokenizer, s: dict) -> list[float]:
    """Train `model` in place on noisy solutions; returns the loss every 10 steps."""
    task_kw = {k: s[k] for k in SFT_TASK}
    rng = random.Random(10_007 * (s["seed"] + 1))       # problem/slip stream, apart from eval seeds
    torch.manual_seed(s["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=s["lr"], weight_decay=0.01)
    # linear warmup, then cosine decay to 10 % of lr
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / s["warmup"]) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t / s["sft_steps"])))))
    model.train()
    losses, t0 = [], time.time()
    for step in range(s["sft_steps"]):
        batch = make_problems(s["batch_size"], rng.randrange(2**31), **task_kw)
        rows = []
        for p in batch:
            n_ops = len(p["solution_steps"]) - 1
            slipped = rng.random() < slip_probability(n_ops, s["step_error_rate"])
            err = draw_error_at(n_ops, rng, s["lateness"], s["slip_boxed"]) if slipped else None
            style = rng.randrange(s["styles"]) if "styles" in s else 0   # one style per solution (choice 10)
            rows.append(sft_example(tokenizer, p, solution_text(p, err, rng, s["slips"], style)))
        width = max(len(ids) for ids, _ in rows)
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])  # (B, L)
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])    # (B, L)
        mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows])
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 10 == 0 or step == s["sft_steps"] - 1:
            losses.append(round(loss.item(), 4))
        if (step + 1) % 50 == 0 or step == s["sft_steps"] - 1:
            print(f"  warm start {step + 1}/{s['sft_steps']}  loss {loss.item():.3f}  ({time.time() - t0:.0f}s)",
                  flush=True)
    model.eval()
    return losses


def warm_start(cache_dir: str, seed: int = 0, **kw):
    """(model, tokenizer): the SFT-warm-started toy policy, trained once and cached under `cache_dir`.

    kw overrides WARM_DEFAULTS (sft_steps, batch_size, lr, warmup, step_error_rate, lateness, slip_boxed, slips),
    MODEL_DEFAULTS (tiny_config fields) and SFT_TASK (the SFT problem distribution); `styles` = K writes the
    SFT solutions in K styles (choice 10; default 1). Returned in eval mode."""
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

    s = _settings(seed, kw)
    path = cache_path(cache_dir, seed, **kw)
    if os.path.exists(os.path.join(path, "warm_start.json")):
        t0 = time.time()
        model = Qwen2ForCausalLM.from_pretrained(path).eval()
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
        print(f"toy warm start: loaded {path} ({time.time() - t0:.1f}s)", flush=True)
        return model, tokenizer
    tokenizer = make_tokenizer()
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_config(tokenizer, **{k: s[k] for k in MODEL_DEFAULTS}))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"toy warm start: training {n_params / 1e6:.2f} M params, {s['sft_steps']} SFT steps x "
          f"{s['batch_size']} (step_error_rate {s['step_error_rate']}, lateness {s['lateness']}) -> {path}", flush=True)
    t0 = time.time()
    losses = _sft(model, tokenizer, s)
    seconds = time.time() - t0
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "warm_start.json"), "w") as f:   # written last: marks a complete cache
        json.dump({"settings": s, "seconds": round(seconds, 1), "losses": losses,
                   "torch_threads": torch.get_num_threads()}, f, indent=1)
    print(f"toy warm start: done in {seconds:.0f}s, saved to {path}", flush=True)
    return model, tokenizer


def refiner_path(cache_dir: str, seed: int = 0, **kw) -> str:
    """Directory of the model refiner built on the warm start with these settings (see `refiner_model`)."""
    ref = {k: kw.pop(k) for k in list(kw) if k in REFINER_DEFAULTS}
    s = {**_settings(seed, kw), **REFINER_DEFAULTS, **ref}
    digest = hashlib.sha256(json.dumps(s, sort_keys=True).encode()).hexdigest()[:12]
    return os.path.join(cache_dir, f"toy_refiner_{digest}")


def refiner_model(cache_dir: str, seed: int = 0, **kw):
    """(model, tokenizer): the toy MODEL refiner, a stronger policy of the same architecture: the warm start
    trained `refiner_steps` more SFT steps on clean solutions only (no slips), at `refiner_lr`. Cached like
    the warm start (built on it, so the warm start is trained first if it is missing). Returned in eval mode.
    It still errs (capacity errors, sampling at the refiner's temperature): its repairs can fail."""
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

    ref = {k: kw.pop(k) for k in list(kw) if k in REFINER_DEFAULTS}
    path = refiner_path(cache_dir, seed, **kw, **ref)
    if os.path.exists(os.path.join(path, "warm_start.json")):
        model = Qwen2ForCausalLM.from_pretrained(path).eval()
        print(f"toy model refiner: loaded {path}", flush=True)
        return model, PreTrainedTokenizerFast.from_pretrained(path)
    model, tokenizer = warm_start(cache_dir, seed, **kw)
    r = {**REFINER_DEFAULTS, **ref}
    s = {**_settings(seed, kw), "sft_steps": r["refiner_steps"], "lr": r["refiner_lr"], "step_error_rate": 0.0,
         "seed": seed + 1}   # another problem stream than the warm start's
    print(f"toy model refiner: {r['refiner_steps']} clean SFT steps on the warm start -> {path}", flush=True)
    t0 = time.time()
    losses = _sft(model, tokenizer, s)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, "warm_start.json"), "w") as f:   # written last: marks a complete cache
        json.dump({"settings": {**_settings(seed, kw), **r}, "seconds": round(time.time() - t0, 1),
                   "losses": losses}, f, indent=1)
    return model.eval(), tokenizer


# ---------------------------------------------------------------- PRM and refiner stand-ins

def _item(m: re.Match) -> tuple[tuple, int | None]:
    """(item, style) of one ITEM_RE match: (("op", a, sym, b, c), k) in style k, or (("boxed", v), None)."""
    if m["v"] is not None:
        return ("boxed", int(m["v"])), None
    k = next(k for k in range(len(STYLES)) if m[f"a{k}"] is not None)
    sym = OPS.get(m[f"s{k}"], m[f"s{k}"])   # style 1 writes the question word
    return ("op", int(m[f"a{k}"]), sym, int(m[f"b{k}"]), int(m[f"c{k}"])), k


def _parse_styled(text: str) -> list[tuple[tuple, int | None]] | None:
    """[(item, style), ...] stated in `text`, in order; None when anything but whitespace is left over."""
    pairs, pos = [], 0
    for m in ITEM_RE.finditer(text):
        if text[pos:m.start()].strip():
            return None
        pairs.append(_item(m))
        pos = m.end()
    return pairs if pairs and not text[pos:].strip() else None


def parse_items(step: str) -> list[tuple] | None:
    """The items a step states, in order: ("op", a, sym, b, c) per operation step in any style ("So a sym b =
    c.", "a word b is c.", "So c = a sym b.") and ("boxed", v); None when anything but whitespace is left over
    (a malformed step)."""
    pairs = _parse_styled(step)
    return None if pairs is None else [item for item, _ in pairs]


def style_of(text: str) -> int | None:
    """The style (index into STYLES, choice 10) of a response: that of all its operation steps when they
    agree; None when they mix styles, when it states no operation, or when anything in it is malformed."""
    pairs = _parse_styled(text)
    styles = {style for _, style in pairs or [] if style is not None}
    return styles.pop() if len(styles) == 1 else None


def style_stats(texts: list[str], styles: int = len(STYLES)) -> dict:
    """Styles among `texts`: "share" = [p_0, ..., p_{K-1}], the share of each of the K = `styles` styles among
    the texts that have one of them, "entropy" = H = -sum_k p_k ln p_k in nats (0 for one style, ln K when
    uniform), "other" = the share of texts with none of them (mixed or unparseable, style_of None), "n" =
    len(texts). share and entropy are None when no text has a style, other when there are no texts."""
    found = [style_of(t) for t in texts]
    counts = [found.count(k) for k in range(styles)]
    styled = sum(counts)
    share = [c / styled for c in counts] if styled else None
    entropy = -sum(p * math.log(p) for p in share if p > 0) if share else None   # Shannon entropy, nats
    return {"share": share, "entropy": entropy, "other": (len(texts) - styled) / len(texts) if texts else None,
            "n": len(texts)}


def score_steps(question: str, steps: list[str]) -> list[float]:
    """1.0/0.0 per step against the correct chain of the question (choice 1).

    The j-th item stated in the whole solution must be the j-th step of the chain ("So v_j sym_j b_j =
    v_{j+1}.") or, for j = number of operations, "\\boxed{v_n}". A step is correct iff it is well formed and
    all its items are right; counting items (not steps) keeps this exact when split_steps merges steps."""
    start, ops = parse_question(question)
    values = correct_chain(question)
    expected = [("op", values[k], sym, arg, values[k + 1]) for k, (sym, arg) in enumerate(ops)]
    expected.append(("boxed", values[-1]))
    scores, j = [], 0
    for step in steps:
        items = parse_items(step)
        if items is None:
            scores.append(0.0)
            continue
        scores.append(float(items == expected[j:j + len(items)]))
        j += len(items)
    return scores


class ToyPRM:
    """Rule-based step verifier playing the PRM: 1.0 for a correct step, 0.0 otherwise (choice 1),
    each score flipped with probability `noise` (choice 2). Same score/score_batch as ProcessRewardModel."""

    def __init__(self, noise: float = 0.0, seed: int = 0):
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"ToyPRM noise={noise} must be in [0, 1]")
        self.noise = noise
        self.rng = random.Random(seed)

    def reseed(self, seed: int) -> None:
        """A fresh noise stream (scope.py draws one per step from (seed, step), so a resume is exact)."""
        self.rng = random.Random(seed)

    def score(self, question: str, steps: list[str]) -> list[float]:
        scores = score_steps(question, steps)
        if self.noise > 0:
            scores = [1.0 - s if self.rng.random() < self.noise else s for s in scores]
        return scores

    def score_batch(self, questions: list[str], list_of_steps: list[list[str]]) -> list[list[float]]:
        if len(questions) != len(list_of_steps):
            raise ValueError(f"score_batch: {len(questions)} questions but {len(list_of_steps)} step lists")
        return [self.score(q, steps) for q, steps in zip(questions, list_of_steps)]


class OracleRefiner:
    """Writes the remaining steps correctly from the prefix's last value (choice 3), in the style of the
    prefix's last operation step (style 0 without one, choice 10); deterministic.
    Same continue_from as refiner.Refiner: (text, finished) pairs (unfinished when cut at max_tokens), in the
    toy tokenizer's vocabulary.

    `style` = k (scope.py --toy-refiner-style k) writes every suffix in style k whatever the prefix's style:
    a foreign voice for a policy that never wrote style k (a prefix-keeping repair becomes a mixed text, a
    whole replacement is all style k). `empty_styles` = K > 1 (with --select-tiebreak index) draws the style
    of a suffix after an empty prefix uniformly from the first K styles, from random.Random(seed + i) for the
    i-th prefix of the call, instead of style 0 (so an empty prefix favours no style); still deterministic
    given the seed."""

    def __init__(self, style: int | None = None, empty_styles: int = 1):
        if style is not None and not 0 <= style < len(STYLES):
            raise ValueError(f"OracleRefiner: style={style!r} must be in 0..{len(STYLES) - 1} or None (the prefix's)")
        if not 1 <= empty_styles <= len(STYLES):
            raise ValueError(f"OracleRefiner: empty_styles={empty_styles!r} must be in 1..{len(STYLES)}")
        self.style, self.empty_styles = style, empty_styles

    def continue_from(self, questions: list[str], prefixes: list[str], *, n: int, max_tokens, seed=None
                      ) -> list[list[tuple[str, bool]]]:
        if len(questions) != len(prefixes):
            raise ValueError(f"continue_from: {len(questions)} questions but {len(prefixes)} prefixes")
        if isinstance(max_tokens, int):
            max_tokens = [max_tokens] * len(questions)
        out = []
        for i, (question, prefix, limit) in enumerate(zip(questions, prefixes, max_tokens)):
            start, ops = parse_question(question)
            done = [_item(m) for m in ITEM_RE.finditer(prefix) if m["v"] is None]
            value = done[-1][0][4] if done else start        # the last value the prefix states
            style = done[-1][1] if done else 0               # ... and the style it was written in
            if not done and self.empty_styles > 1:           # no style to continue: draw one, favour none
                style = random.Random((seed or 0) + i).randrange(self.empty_styles)
            if self.style is not None:                       # a refiner with its own voice
                style = self.style
            steps = []
            for sym, arg in ops[len(done):]:
                steps.append(format_step(value, sym, arg, _apply(value, sym, arg), style))
                value = _apply(value, sym, arg)
            steps.append(f"\\boxed{{{value}}}")
            # join onto the prefix at a step boundary, adding whatever part of "\n\n" it lacks
            lead = "" if not prefix or prefix.endswith(STEP_SEP) else ("\n" if prefix.endswith("\n") else STEP_SEP)
            full = lead + STEP_SEP.join(steps)
            suffix = (full[:max(0, limit)], len(full) <= limit)   # one char = one token
            out.append([suffix] * n)
        return out


if __name__ == "__main__":
    problem = make_problems(1, seed=0)[0]
    print(problem["question"], "\n---\n" + solution_text(problem), "\n---")
    print(solution_text(problem, error_at=2, rng=random.Random(0)))
    print(cache_path("runs/cache"))
