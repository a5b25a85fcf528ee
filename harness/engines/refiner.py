"""refiner.py — the refiner's engine: one batched generate call over any generator, in the refiner's tokens.

Not the paper's (refine.py): `Refiner.continue_from` sends the prompts refine.py builds (`refine.refiner_prompt`,
passed in as `prompt`) through the refiner's chat template and tokenizer and returns (text, finished) pairs, which
`refine.rectify` reads as `refine.Suffix`es and splices onto the policy's own prefix ids. The budgets are open
choices (docs/choices.md, rows "5 rectify").
"""
from harness.data.prompt import DEFAULT_SYSTEM, format_prompt

MODES_WITH_REFINER = ("scope", "replace")   # the modes that repair failures (prm.select_failures, the refiner)


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
