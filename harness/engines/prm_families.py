"""prm_families.py — the PRM families: how each kind of process reward model reads a solution's steps.

A family is one adapter: the checkpoints it reads (config.json's `architectures`, and the head each carries), its
input layout (question + steps -> input ids and the positions scored, within `max_length`), how P(step correct) is
read from the model's output there, and whether vLLM's pooling runner serves it. `FAMILIES` is the one list that
`--prm-format`'s choices, the auto detection (`choose`), the loader (harness/engines/prm_checkpoint.py), serving
and the memory plan (`head_kind`, `servable`) read: a new family is one class here and its test. The three:
Qwen2.5-Math-PRM's `<extra_0>` chat (served), TRL's token classifier, a causal LM's "+"/"-" judgment (Math-Shepherd);
why each layout is read where it is: docs/choices.md, rows "3 PRM".
"""
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch

PRM_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
SEPARATOR = "<extra_0>"  # the Qwen2.5-Math-PRM step tag


@dataclass(frozen=True)
class Family:
    """What every family says about itself (the defaults: a 2-class token classifier, class 1 = correct)."""

    name: str = ""                   # --prm-format's value
    heads: tuple = ()                # (config.json architecture pattern, the head it carries), first match wins:
    #                                  "prm" (Qwen2.5-Math-PRM's own module), "token-classification", "lm"
    served: tuple = ()               # the heads vLLM's pooling runner serves in this layout
    auto_class: str = "AutoModelForTokenClassification"   # transformers' loader of its HF checkpoints
    labels: int | None = 2           # the classes its token classifier must have (None: not a classifier)

    def head(self, architectures) -> str | None:
        """The head this family reads in a checkpoint of these architectures; None when it reads none of them."""
        return next((kind for pattern, kind in self.heads for a in architectures if fnmatchcase(a, pattern)), None)

    def tokens(self, tokenizer) -> dict:
        """The token ids the layout and the reading use; ValueError naming a token the tokenizer lacks."""
        return {}

    def fits(self, architectures, tokenizer) -> bool:
        """Auto detection: this family reads the checkpoint (its architecture, its tokenizer)."""
        try:
            self.tokens(tokenizer)
        except ValueError:
            return False
        return self.head(architectures) is not None

    def needs(self) -> str:
        """What this family reads, for the error that lists the families."""
        return " or ".join(pattern for pattern, _ in self.heads)

    def build(self, engine, question: str, steps: list[str]) -> tuple[list[int], list[int]]:
        """(input ids, the positions of the steps that fit in `engine.max_length`)."""
        raise NotImplementedError

    def read(self, engine, logits: torch.Tensor) -> torch.Tensor:
        """(b, T) P(step correct) at every position, from the model's (b, T, 2) logits: softmax, class 1."""
        if logits.dim() != 3 or logits.shape[-1] != 2:
            raise ValueError(f"PRM {engine.name!r} returned logits of shape {tuple(logits.shape)}, "
                             "expected (batch, tokens, 2)")
        return torch.softmax(logits.float(), dim=-1)[..., 1]  # (b, T) P(step correct)


def _one_token(tokenizer, token: str) -> int:
    """The id of a token the tokenizer holds as one (an added tag such as `<extra_0>`); ValueError otherwise."""
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or tid == tokenizer.unk_token_id:
        raise ValueError(f"has no {token!r} token")
    return tid


@dataclass(frozen=True)
class QwenMathPRM(Family):
    """Qwen2.5-Math-PRM-7B's model card: chat template with system = PRM_SYSTEM, user = question, assistant =
    "<extra_0>".join(steps) + "<extra_0>", `add_generation_prompt=False`; the score of step k is softmax(logits at
    the k-th `<extra_0>`)[1]. Input ids are assembled in token space (template head + step ids + separator id +
    ... + template tail), so the separator positions are known exactly. A tokenizer without a chat template gets
    the plain layout `f"{PRM_SYSTEM}\\n\\nQuestion: {question}\\n\\nAnswer:\\n"` followed by the steps and
    separators."""

    name: str = "qwen-math-prm"
    heads: tuple = (("Qwen2ForProcessRewardModel", "prm"), ("*ForTokenClassification", "token-classification"))
    served: tuple = ("prm",)
    tag: str = SEPARATOR

    def tokens(self, tokenizer) -> dict:
        return {"tag": _one_token(tokenizer, self.tag)}

    def needs(self) -> str:
        return f"Qwen2ForProcessRewardModel, or *ForTokenClassification whose tokenizer holds {self.tag}"

    def fits(self, architectures, tokenizer) -> bool:
        return self.head(architectures) == "prm" or super().fits(architectures, tokenizer)

    def build(self, engine, question: str, steps: list[str]) -> tuple[list[int], list[int]]:
        """Steps are stripped and cleaned of "<extra_0>" text (docs/choices.md, row "PRM input"). When everything
        fits, the template tail is appended too (it cannot change the scores: the model is causal)."""
        head, tail = self._head_tail(engine, question)
        ids, positions = list(head), []
        for step in steps:
            step_ids = _encode(engine.tokenizer, step.replace(self.tag, "").strip())
            if engine.sep_id in step_ids:  # cannot happen with split_special_tokens; keep the guard cheap
                step_ids = [t for t in step_ids if t != engine.sep_id]
            if len(ids) + len(step_ids) + 1 > engine.max_length:
                break  # this step and every later one stay unscored
            ids += step_ids + [engine.sep_id]
            positions.append(len(ids) - 1)
        if len(positions) == len(steps) and len(ids) + len(tail) <= engine.max_length:
            ids += tail
        return ids, positions

    def _head_tail(self, engine, question: str) -> tuple[list[int], list[int]]:
        """Token ids before the first step and after the last separator."""
        tokenizer, question = engine.tokenizer, question.replace(self.tag, "")
        if getattr(tokenizer, "chat_template", None):
            messages = [{"role": "system", "content": PRM_SYSTEM}, {"role": "user", "content": question},
                        {"role": "assistant", "content": self.tag}]
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
            if self.tag not in rendered:
                raise ValueError(f"the chat template of PRM {engine.name!r} drops the assistant turn; "
                                 "cannot place the steps")
            head, tail = rendered.rsplit(self.tag, 1)  # the question holds no separator any more
        else:
            head, tail = f"{PRM_SYSTEM}\n\nQuestion: {question}\n\nAnswer:\n", ""
        # the template's own special tokens (<|im_start|> ...) must be parsed as such here
        enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
        return enc(head), enc(tail)


def _encode(tokenizer, text: str) -> list[int]:
    """Plain text -> ids with special-token parsing off (so "<|im_end|>" in a step stays text)."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


@dataclass(frozen=True)
class TRLTokenClassification(Family):
    """The layout TRL's PRMTrainer trained on (`tokenize_row`: trl/trainer/prm_trainer.py from TRL 0.13,
    trl/experimental/prm/prm_trainer.py later; TRL 1.16.0 ships no PRMTrainer): BOS when the tokenizer has one, the
    question's ids, then for each step its own ids and the ids of the separator "\\n\\n" (each encoded alone, no
    special tokens added, no chat template); a step's label sits on its last id, the separator's last token."""

    name: str = "trl-token-classification"
    heads: tuple = (("*ForTokenClassification", "token-classification"),)
    separator: str = "\n\n"   # the --step_separator of HuggingFaceH4's Qwen2.5-Math-*-Instruct-PRM-0.2 training

    def build(self, engine, question: str, steps: list[str]) -> tuple[list[int], list[int]]:
        """Steps are stripped of the separator they end with in `split_steps` and of surrounding whitespace, since
        the separator is appended here. A step that does not fit whole stays unscored (None), as training's
        --max_length cut off its label."""
        tokenizer = engine.tokenizer
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        ids = bos + tokenizer(question, add_special_tokens=False)["input_ids"]
        sep = tokenizer.encode(self.separator, add_special_tokens=False)
        positions = []
        for step in steps:
            step_ids = tokenizer(step.strip(), add_special_tokens=False)["input_ids"] + sep
            if len(ids) + len(step_ids) > engine.max_length:
                break  # this step and every later one stay unscored
            ids += step_ids
            positions.append(len(ids) - 1)
        return ids, positions


@dataclass(frozen=True)
class LMHeadJudgment(Family):
    """Math-Shepherd's reading (peiyi9979/math-shepherd-mistral-7b-prm's model card): the text
    f"{question} {step 1} {tag}\\n{step 2} {tag}..." encoded whole as the card does (with the tokenizer's BOS), the
    steps stripped; at each tag the next-token logits of the good and the bad token give
    P(step correct) = softmax([logit(good), logit(bad)])[0]. The tag, the good and the bad token are its settings
    (the card's "ки", "+", "-"); each must be one token of the tokenizer (the id `tokenizer.encode(t)[-1]` the card
    reads), and the tag must stay one token in the layout. Tag text in the question or a step is removed, so the
    policy cannot add or move a scored position. A step whose tag lies past `max_length` stays unscored."""

    name: str = "lm-head-judgment"
    heads: tuple = (("*ForCausalLM", "lm"),)
    auto_class: str = "AutoModelForCausalLM"
    labels: int | None = None
    tag: str = "ки"
    good: str = "+"
    bad: str = "-"

    def needs(self) -> str:
        return f"*ForCausalLM whose tokenizer holds {self.tag!r}, {self.good!r} and {self.bad!r} as single tokens"

    def tokens(self, tokenizer) -> dict:
        ids = {}
        for what, text in (("tag", self.tag), ("good", self.good), ("bad", self.bad)):
            enc = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(enc) != 1 or tokenizer.decode(enc).strip() != text:   # not one token, or an unknown one
                raise ValueError(f"has no {text!r} token (the {what} token of {self.name}; it encodes to {enc})")
            ids[what] = enc[0]
        probe = tokenizer(f"1 {self.tag}\n2 {self.tag}", add_special_tokens=False)["input_ids"]
        if probe.count(ids["tag"]) != 2:
            raise ValueError(f"does not keep the tag {self.tag!r} as one token in {self.name}'s layout")
        return ids

    def build(self, engine, question: str, steps: list[str]) -> tuple[list[int], list[int]]:
        text = _without(question, self.tag) + " " + "\n".join(f"{_without(s, self.tag).strip()} {self.tag}"
                                                              for s in steps)
        ids = engine.tokenizer(text, split_special_tokens=True)["input_ids"]
        positions = [i for i, t in enumerate(ids) if t == engine.sep_id]
        if len(positions) != len(steps):
            raise ValueError(f"PRM {engine.name!r}: {len(steps)} steps but {len(positions)} tags {self.tag!r} in "
                             "the encoded input")
        return ids[:engine.max_length], [p for p in positions if p < engine.max_length]

    def read(self, engine, logits: torch.Tensor) -> torch.Tensor:
        """(b, T) softmax([logit(good), logit(bad)])[0] from the model's (b, T, vocabulary) logits."""
        good, bad = engine.ids["good"], engine.ids["bad"]
        if logits.dim() != 3 or logits.shape[-1] <= max(good, bad):
            raise ValueError(f"PRM {engine.name!r} returned logits of shape {tuple(logits.shape)}, "
                             "expected (batch, tokens, vocabulary)")
        return torch.softmax(logits[..., [good, bad]].float(), dim=-1)[..., 0]  # (b, T) P(step correct)


def _without(text: str, tag: str) -> str:
    """`text` with every occurrence of `tag` removed, also one that a removal joins together."""
    while tag in text:
        text = text.replace(tag, "")
    return text


FAMILIES = (QwenMathPRM(), TRLTokenClassification(), LMHeadJudgment())   # auto detection tries them in this order
NAMES = tuple(f.name for f in FAMILIES)


def choose(name: str, architectures: list[str], tokenizer, asked: str = "auto") -> Family:
    """The family of a PRM checkpoint: `asked` (--prm-format), which must read its architecture, or auto: the first
    of FAMILIES that reads it; its tokens must be in the tokenizer. ValueError naming the checkpoint otherwise."""
    if asked == "auto":
        family = next((f for f in FAMILIES if f.fits(architectures, tokenizer)), None)
        if family is None:
            raise ValueError(f"PRM {name!r}: config.json names architectures {architectures}; no PRM family reads "
                             "it (" + "; ".join(f"{f.name}: {f.needs()}" for f in FAMILIES) + ")")
    else:
        family = next((f for f in FAMILIES if f.name == asked), None)
        if family is None:
            raise ValueError(f"--prm-format {asked}: use auto, " + ", ".join(NAMES))
        if family.head(architectures) is None:
            raise ValueError(f"--prm-format {asked}: PRM {name!r} is a {', '.join(architectures) or '?'}; {asked} "
                             f"reads {', '.join(p for p, _ in family.heads)}")
    try:
        family.tokens(tokenizer)
    except ValueError as e:
        raise ValueError(f"the tokenizer of PRM {name!r} {e}") from None
    return family


def head_kind(architectures) -> str | None:
    """The memory plan's head of a checkpoint: the head the first family that reads its architecture names."""
    return next((h for h in (f.head(architectures) for f in FAMILIES) if h), None)


def servable(head: str | None) -> bool:
    """Whether vLLM's pooling runner serves a PRM with this head (in the layout of the family that says so)."""
    return any(head in f.served for f in FAMILIES)
