"""refiner.py — the refiner's engine: one batched generate call over any generator, in the refiner's tokens.

Not the paper's (refine.py): `Refiner.continue_from` sends the prompts refine.py builds (`refine.refiner_prompt`,
passed in as `prompt`) through the refiner's chat template and tokenizer and returns (text, finished) pairs, which
`refine.rectify` reads as `refine.Suffix`es and splices onto the policy's own prefix ids. The budgets are open
choices (docs/choices.md, rows "5 rectify"). Below it, rectify's argument checks (`check_picks`) and its log
record of each pick (`trace`, traces.jsonl).
"""
from harness.generate import DEFAULT_SYSTEM, format_prompt


class Refiner:
    """Continues kept prefixes with any generator (HF / vLLM / OpenAI) and the REFINER's tokenizer. `prompt`:
    (question, kept prefix text) → (the user's turn, the start of the assistant's turn), refine.refiner_prompt."""

    def __init__(self, generator, tokenizer, *, prompt, temperature: float = 0.7, top_p: float = 1.0,
                 max_tokens: int | None = None):
        self.generator, self.tokenizer, self.prompt = generator, tokenizer, prompt
        self.temperature, self.top_p = temperature, top_p
        self.max_tokens = max_tokens   # --refiner-max-tokens: no suffix decodes past it (None: the item's budget)

    def prompt_ids(self, question: str, prefix: str) -> list[int]:
        """`prompt`'s user turn in the refiner's chat template, then its assistant start as plain tokens."""
        user, start = self.prompt(question, prefix)
        ids = format_prompt(self.tokenizer, user, DEFAULT_SYSTEM)
        return ids + self.tokenizer.encode(start, add_special_tokens=False) if start else ids

    def continue_from(self, questions: list[str], prefixes: list[str], *, n: int, max_tokens: list[int] | int,
                      seed: int | None = None) -> list[list[tuple[str, bool]]]:
        """(text, finished) [item][attempt]: n continuations of each prefix, one batched generate call. A text
        clipped to its item's budget is not finished (it stopped at the budget, not at EOS)."""
        if len(questions) != len(prefixes):
            raise ValueError(f"continue_from: {len(questions)} questions but {len(prefixes)} prefixes")
        budgets = [max_tokens] * len(questions) if isinstance(max_tokens, int) else list(max_tokens)
        if len(budgets) != len(questions):
            raise ValueError(f"continue_from: {len(budgets)} max_tokens for {len(questions)} questions")
        budgets = budgets if self.max_tokens is None else [min(b, self.max_tokens) for b in budgets]
        if not questions:
            return []
        prompts = [self.prompt_ids(q, p) for q, p in zip(questions, prefixes)]
        # a served or vLLM refiner takes each item's own budget (no item decodes past it); HF generate gets the largest
        # and each item is clipped to its own (its one random stream, and so the toy world's records, stay as they are)
        per_item = getattr(self.generator, "per_prompt_budgets", False)
        outs = self.generator.generate(prompts, n=n, temperature=self.temperature, top_p=self.top_p,
                                       max_tokens=[max(b, 0) for b in budgets] if per_item else max(max(budgets), 0),
                                       seed=seed)
        return [[(c.text, c.finished) if len(c.ids) <= b
                 else (self.tokenizer.decode(c.ids[:max(b, 0)], skip_special_tokens=True), False)
                 for c in row] for row, b in zip(outs, budgets)]


# ---------------------------------------------------------------------------------------------------
# refine.rectify's input checks and its trace (t, repaired: refine.Trajectory)
# ---------------------------------------------------------------------------------------------------
def check_picks(trajs: list, picks: list[tuple[int, int]], attempts: int, merge: str, max_new_tokens: int) -> None:
    """One-line ValueErrors for `rectify`'s arguments: the merge, the attempts, each pick's index and prefix."""
    if merge not in ("replace", "append"):
        raise ValueError(f"merge must be 'replace' or 'append', got {merge!r}")
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    seen = set()
    for k, (index, prefix_len) in enumerate(picks):
        if not 0 <= index < len(trajs):
            raise ValueError(f"rectify: pick {k} names trajectory {index}, but there are {len(trajs)}")
        if not 0 <= prefix_len <= min(len(trajs[index].response_ids), max_new_tokens):
            raise ValueError(f"rectify: pick {k} keeps {prefix_len} tokens of trajectory {index}, which has "
                             f"{len(trajs[index].response_ids)} (max_new_tokens={max_new_tokens})")
        if index in seen:
            raise ValueError(f"rectify: trajectory {index} is picked twice")
        seen.add(index)


def trace(t, prefix_len: int, prefix_text: str, tries: list, verdicts: list[bool], repaired) -> dict:
    """One pick's trace (traces.jsonl; the viewer of tools/report.py): the PRM facts, the kept text, every
    attempt (refine.Suffix) with its verdict, and the reward before and after."""
    return {"group": t.group, "question": t.question, "answer": t.answer,
            "mode": "scope" if prefix_len else "replace",
            "steps": t.steps, "scores": t.step_scores, "cut": t.cut,
            "keep_ratio": t.keep_ratio, "keep_ratio_tokens": t.keep_ratio_tokens, "prefix_text": prefix_text,
            "suffixes": [s.text for s in tries], "suffix_finished": [s.finished for s in tries],
            "attempt_correct": verdicts, "accepted": repaired is not None,
            "reward_before": t.reward, "reward_after": repaired.reward if repaired is not None else t.reward}
