"""course_key.py — the teacher's half of the course (tools/exercises.py): never copied into the student copy.

- RUBRICS: per written question (exercises.QUESTIONS, same order), what earns its points. The handout shows
  the points and the deliverable; the rubric stays here (`python -m tools.exercises --rubric` prints it).
- REDACTIONS: (file, text in the reference, text in the copy). Docstrings, comments, docs rows and test
  helpers of the reference that answer a written question, hold a toy-study result, or contain a stubbed
  problem's solution. The generator applies each to the copy and stops with a one-line error when a text is
  no longer in the reference (it changed: update the row here). A row whose text is a regular expression
  replaces its one match, or nothing (text that may already have been reworded); ANSWER_PHRASES still
  stops a copy that carries the answer.
- ANSWER_PHRASES: marked phrases of the answers. The generator refuses to write a copy in which any of them
  appears (case-insensitive), wherever it comes from: a new docstring that answers a question fails the
  generator's test instead of reaching the students.
"""

import re

RUBRICS = [
    # Q1 the shaping gradient
    "4: the chain rule through π = exp(log π) gives −A·γπ/(π+γ)². 3: the magnitude γπ/(π+γ)² has its maximum at "
    "π = γ (derivative (γ(π+γ) − 2γπ)/(π+γ)³ = 0), value γ²/(4γ²) = 1/4, hence ≤ A/4 in size (≤ |A|/4 for any sign of A). 2: unit credit weights "
    "every token by 1 (ignores none); the plain importance weight −Aπ ignores unlikely tokens (π → 0), exactly "
    "the corrected tokens a refiner adds; shaping keeps them (weight γπ/(π+γ)² is largest near π = γ) while "
    "damping tokens the policy already predicts (π → 1: γ/(1+γ)² ≈ 0.083 for γ = 0.1). 1: the autograd check "
    "matches the formula at three values of π.",
    # Q2 GRPO against SCOPE over seeds
    "3: the table of 6 runs with the four numbers per run. 2: the plot drawn by tools.report. 3: the paragraph "
    "reads the numbers honestly (with 3 seeds the difference is usually inside the seed spread; say so). "
    "2: the two traces explain that a group with no success gets a signal only from the repair: the kept "
    "prefix at positive advantage as on-policy text and the refiner's suffix as shaped off-policy text.",
    # Q3 which groups to repair
    "2: accepted repairs per step for both runs (any accepts at least as many). 2: reward_merged − reward_mean "
    "is the share of accepted repairs' reward that replaced failures. 2: all-fail groups have zero advantage "
    "under GRPO (every reward equal) and gain a signal only through a repair; mixed groups already had one, "
    "and a repair there dilutes the negative advantage of their failures.",
    # Q4 replace or append (G = 5, rewards [1, 1, 0, 0, 0], the first failure repaired)
    "2: replace: rewards [1, 1, 1, 0, 0], mean 0.6, A = [0.4, 0.4, 0.4, −0.6, −0.6]; with --adv-std (unbiased "
    "std 0.5477) ≈ [0.730, 0.730, 0.730, −1.095, −1.095]. 2: append: [1, 1, 0, 0, 0, 1], mean 0.5, A = [0.5, "
    "0.5, −0.5, −0.5, −0.5, 0.5]; with --adv-std (std 0.5477) ±0.913. 2: append gives the repair the larger "
    "advantage (0.5 > 0.4); it also raises the other successes (0.4 → 0.5) and the remaining failures "
    "(−0.6 → −0.5), and keeps the repaired failure at −0.5, so the prefix it shares with the repair gets "
    "+0.5 and −0.5, which cancel; replace removes the failure, so its prefix keeps only the repair's +0.4.",
    # Q5 why the prefix is never re-tokenised
    "2: code that builds the tokenizer and finds a cut k with encode(decode(ids[:k])) != ids[:k]. 2: the ids "
    "shown. 2: re-tokenised tokens were never sampled: their log-probs under the old policy are not the "
    "sampler's, so ρ is not 1 and the on-policy PPO term trains on text the policy did not write (a "
    "distribution shift the clip hides).",
    # Q6 length normalisation
    "2: constant: each token's weight is 1/(N·max_new_tokens); token-mean: 1/(Σ_j n_j), the batch's response "
    "tokens (grpo.loss_normaliser): under both every token of a batch gets the same weight, so a sequence's "
    "total weight is proportional to its length and neither favours long or short responses within a batch "
    "(that bias belongs to a per-sequence mean, 1/n_i; an answer that credits it to this code's token-mean "
    "loses these 2 points unless it says the code does not do that). 2: what differs is the scale across "
    "batches: token-mean's per-token weight grows as the batch's responses get shorter (a batch of short "
    "responses takes a larger step per token), the constant's never changes; with a negative advantage "
    "token-mean pushes a short batch's tokens down harder. 2: response_len at the start and the end of both "
    "runs, read honestly (one seed: say whether the difference is larger than the noise).",
    # Q7 credit on refiner tokens
    "2: the table of the 4 runs (entropy, final accuracy). 2: relates γ to Q1's weight γπ/(π+γ)²: a small γ "
    "puts the largest weight on unlikely tokens (the refiner's corrections) and little on likely ones; a "
    "large γ weights tokens more evenly; unit credit weights every token by 1 (no bound). In the toy world "
    "the four runs end at nearly the same entropy and accuracy (the refiner's tokens are few next to the "
    "policy's own and mostly likely under the policy, where the credits differ least): an answer that reports "
    "what its table shows, an ordering or none, and explains it from the weights earns these points; one that "
    "asserts an ordering its table does not show (e.g. unit credit lowering entropy fastest) does not. 2: "
    "honest about noise with one seed per setting.",
]

REDACTIONS = [
    # Q1: the peak of the shaping weight and why it matters
    ("grpo.py",
     "Gradients (tested in closed form): a refiner token gives dL/dlogp = −A·γπ/(π+γ)² / Z, largest at π = γ, so\n"
     "unlikely refiner tokens still teach; a policy token inside the clip range gives −A·ρ / Z, and a clipped one 0.",
     "Gradients (tested in closed form): a policy token inside the clip range gives dL/dlogp = −A·ρ / Z, and a\n"
     "clipped one 0; the refiner token's is the handout's Q1."),
    ("docs/choices.md",
     "its weight γπ/(π+γ)² is ≤ 0.25 and peaks at π = γ, so unlikely refiner tokens are not ignored. `unit` = "
     "−A·log π, as if the policy had sampled them. In the toy study's traces the corrected token sits at π ≈ "
     "0.63 and gets ≈ 0.12 of A, the other refiner tokens (π ≈ 0.98) ≈ 0.08; unit credit gave +0.006 "
     "[−0.027, +0.040] vs +0.000 for shaped, within noise |",
     "why: the handout's Q1. `unit` = −A·log π, as if the policy had sampled them |"),
    # Q3: which groups gain a signal only through a repair; toy-study result
    ("docs/choices.md",
     "`all-fail` only where every rollout failed, the groups GRPO gets no gradient from, so a mixed group keeps "
     "its negative signal. The toy study does not separate them (+0.000 vs +0.005 with append, −0.003 vs "
     "+0.001 with replace, all within ±0.03) |",
     "`all-fail` only where every rollout failed (why one or the other: the handout's Q3) |"),
    # Q4: what append does to the other rollouts; toy-study result
    ("docs/choices.md",
     "with `append` the shared prefix gets (1−m)+(0−m) and partly cancels. In the toy study neither separates "
     "from GRPO (append +0.000 [−0.024, +0.024], replace −0.003 [−0.035, +0.029]), so the default stays the "
     "paper's;",
     "`append` grows the group by one (the handout's Q4); the default is the paper's;"),
    ("docs/choices.md",
     "can fail. In the toy study the model refiner (97.6 % accepted) gave the same result, +0.000 [−0.024, "
     "+0.025] |",
     "can fail |"),
    # Q6: the length bias
    ("docs/choices.md",
     "(Dr. GRPO; LUFFY's `loss_remove_token_mean`): no length bias between prefix and suffix; `token-mean` "
     "divides by the number of response tokens.",
     "(Dr. GRPO; LUFFY's `loss_remove_token_mean`); `token-mean` divides by the number of response tokens "
     "(how they differ: the handout's Q6)."),
    # pointers to the teacher's tools, which the copy does not hold
    ("grpo.py", "choices: docs/choices.md (\"6 advantages\", \"7 update\"). `# BEGIN/END SOLUTION` mark the course's "
     "exercises.", "choices: docs/choices.md (\"6 advantages\", \"7 update\")."),
    ("tools/__init__.py", " course/ (the course assignment, `python -m tools.exercises`; the teacher's key,\n"
     "course_key.py),", ""),
    # Q2/Q3: the study's findings in the because stage's docstring (patterns: that text is being reworded)
    ("tools/studies/why_it_helps.py", re.compile(r"; (?:52 %|about half) of (?:its )?G = 8 groups all-fail"), ""),
    ("tools/studies/why_it_helps.py", re.compile(r"(?:The regime map\s+found the strong start's only interval|On this start the\s+"
                                    r"regime map's only SCOPE cell).*?sit at GRPO's level.*?\.\s", re.DOTALL), ""),
    # toy-study results in the regime tool's docstring
    ("tools/studies/when_it_helps.py", "whose G = 8 groups are 20 %, 52 % and 59 % all-fail at the start, as measured by choice 2",
     "whose all-fail share at the start is measured by choice 2"),
    ("tools/studies/when_it_helps.py", " (two such starts here)", ""),
    ("tools/studies/where_it_helps.py", "{} = the main warm start, whose 6-operation groups are\n    only ~28 % all-fail;",
     "{} = the main warm start, a stronger\n    one;"),
    # Q1: a finished autograd check of the shaped gradient
    ("tests/test_study_flags.py",
     "    assert logp.grad.tolist()[0] == pytest.approx([-0.125, -0.125, -0.125], rel=1e-6)\n\n"
     "    logp2 = pi.log().clone().requires_grad_(True)\n"
     "    loss2, _ = grpo.policy_loss(logp2, **kw, shaping_gamma=0.1)   # default: shaped\n"
     "    want2 = (-0.5 - 0.5 * 0.77 / 0.87 - 0.5 * 0.97 / 1.07) / 4\n"
     "    assert loss2.item() == pytest.approx(want2, rel=1e-6)\n"
     "    loss2.backward()\n"
     "    # the corrected token at π = 0.77 gets γπ/(π+γ)² ≈ 0.102 of the unit gradient\n"
     "    assert logp2.grad[0, 1].item() == pytest.approx(-0.5 * 0.1 * 0.77 / 0.87 ** 2 / 4, rel=1e-5)\n"
     "    assert logp2.grad[0, 1].item() / logp.grad[0, 1].item() == pytest.approx(0.1017, abs=1e-3)\n",
     "    assert logp.grad.tolist()[0] == pytest.approx([-0.125, -0.125, -0.125], rel=1e-6)\n"),
    ("tests/test_study_flags.py", "unit: ℓ = −A·log π, dℓ/dlogp = −A; shaped: ℓ = −A·π/(π+γ).",
     "unit: ℓ = −A·log π, dℓ/dlogp = −A."),
    # Q5: the counterexample (a prefix whose text re-encodes to other ids); the copy's test watches what the
    # splice encodes instead
    ("tests/test_refine.py",
     '''    """Guards the bug of splicing text instead of ids: 'L','e','t' sampled one by one decode to 'Let',
    which the BPE would re-encode as one token, shifting every on-policy log-prob after it."""
    singles = [bpe_tokenizer.convert_tokens_to_ids(ch) for ch in "Let"]
    assert bpe_tokenizer.encode("Let", add_special_tokens=False) != singles  # re-tokenising would differ
    ids, mask = splice(singles, " x = 3", bpe_tokenizer, max_new_tokens=50, eos_id=bpe_tokenizer.eos_token_id)
    assert ids[:3] == singles and mask[:3] == [0, 0, 0]
''',
     '''    """Guards the bug of splicing text instead of ids: the splice encodes the suffix, never the prefix's text."""
    class Watched:   # the tokenizer, recording every text it is asked to encode
        def __init__(self, tok):
            self.tok, self.texts = tok, []

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def __call__(self, text, **kw):
            self.texts.append(text)
            return self.tok(text, **kw)

        def encode(self, text, **kw):
            self.texts.append(text)
            return self.tok.encode(text, **kw)

    prefix = bpe_tokenizer.encode("Let a = 2", add_special_tokens=False)
    tok = Watched(bpe_tokenizer)
    ids, mask = splice(prefix, " x = 3", tok, max_new_tokens=50, eos_id=bpe_tokenizer.eos_token_id)
    assert ids[:len(prefix)] == prefix and mask[:len(prefix)] == [0] * len(prefix)
    assert tok.texts and not [t for t in tok.texts if "Let" in t], f"the prefix's text was encoded: {tok.texts}"
'''),
    # problem 8's solution in a test helper: the plain pass uses the student's own logprobs_and_entropy
    ("tests/test_grpo.py",
     "    lp_all = torch.log_softmax(logits[:, :-1], -1)  # (N, L-1, V)\n"
     "    resp = batch[\"response_mask\"].to(lp_all.dtype)\n"
     "    taken = lp_all.gather(-1, batch[\"input_ids\"][:, 1:].unsqueeze(-1)).squeeze(-1)  # (N, L-1)\n"
     "    logp = torch.nn.functional.pad(taken, (1, 0)) * resp  # (N, L)\n"
     "    ent = torch.nn.functional.pad(-(lp_all.exp() * lp_all).sum(-1), (1, 0)) * resp  # (N, L)\n",
     "    taken, ent = logprobs_and_entropy(logits[:, :-1], batch[\"input_ids\"][:, 1:], entropy_grad=True)  # problem 8\n"
     "    resp = batch[\"response_mask\"].to(taken.dtype)\n"
     "    logp = torch.nn.functional.pad(taken, (1, 0)) * resp  # (N, L)\n"
     "    ent = torch.nn.functional.pad(ent, (1, 0)) * resp  # (N, L)\n"),
]

ANSWER_PHRASES = [
    "largest at π = γ", "peaks at π = γ", "refiner tokens are not ignored", "GRPO gets no gradient from",
    "(1−m)+(0−m)", "no length bias", "[0.4, 0.4, 0.4, −0.6, −0.6]", "0.730, 0.730",
    "97.6 % accepted", "+0.000 [−0.024", "52 % and 59 %", "lp_all.gather(", "(lp_all.exp() * lp_all)",
    # Q1's bound and a finished autograd check of it; Q5's counterexample
    "≤ A/4", "≈ 0.102 of the unit gradient", "re-tokenising would differ",
    # Q2/Q3: the study's findings and its starts' all-fail shares
    "sit at GRPO's level", "ends at GRPO's level", "% of G = 8 groups all-fail",
    "% all-fail",
]
