"""refine.py — prefix-preserving rectification: the trajectory, the token-space splice, the regrade, the merge.

SCOPE (Ren et al., arXiv 2602.24110), step 5: keep the policy's own token prefix up to the cut (prm.py), let a
refiner write the rest, accept the spliced trajectory only if it is now correct, and put it back in its group
with an `offpolicy_mask` on the refiner's tokens (LUFFY's prefix_mask, mirrored: the *suffix* is off-policy):

    merged, traces = rectify(trajs, [(index, prefix_len)], refiner, policy_tok, attempts=2, merge="replace",
                             max_new_tokens=1024, grade_fn=grader.grade)

The refiner continues the kept prefix (`refiner_prompt`); the engine sends that prompt (harness/engines/refiner.py).
Tests: tests/test_refine.py. The prompt, the prefix as text, the splice and its EOS, the budgets, the attempts and
the merge are open choices (docs/choices.md, rows "5 rectify").
"""
from dataclasses import dataclass
from typing import NamedTuple

from harness.engines.generate import turn_end_id

REFINE_PROMPTS, MERGES = ("continue", "hint"), ("replace", "append")   # --refine-prompt's and --merge's choices
HINT = ("\n\nA partial solution follows. It is correct up to where it stops, and the next step would contain "
        "a mistake. Continue it from exactly where it stops, avoid that mistake, and finish the solution.")


@dataclass
class Trajectory:
    """One rollout of one prompt: what the policy (or the refiner) wrote, its reward, and the PRM facts."""

    question: str
    answer: str  # gold answer string
    group: int  # index of the prompt within the step (0..B-1)
    prompt_ids: list[int]
    response_ids: list[int]  # sampled ids (policy) or prefix_ids + suffix_ids (+eos) (rectified)
    text: str  # decoded response (skip special tokens)
    reward: float = 0.0
    correct: bool = False
    offpolicy_mask: list[int] = None  # len == len(response_ids); 1 = refiner token; default all 0
    source: str = "policy"  # "policy" | "rectified" | "replaced" (whole-trajectory, mode replace)
    steps: list[str] | None = None  # split_steps(text), filled for scored failures
    step_scores: list | None = None  # PRM P(correct) per step, None where unscored
    cut: int | None = None  # the cut: k* − 1, the first step NOT kept = the steps kept (prm.cut_point)
    keep_ratio: float | None = None  # κ = cut / len(steps)
    prefix_len: int | None = None  # response tokens before the first error (the kept prefix), set in step 3
    keep_ratio_tokens: float | None = None  # prefix_len / len(response_ids)
    finished: bool = True  # the sampler stopped by itself (False: it hit max_new_tokens, a truncated response)
    sampler_logp: list[float] | None = None  # vLLM's log-probs of response_ids[:len(it)] (a repair: its prefix)

    def __post_init__(self):
        if self.offpolicy_mask is None:
            self.offpolicy_mask = [0] * len(self.response_ids)
        if len(self.offpolicy_mask) != len(self.response_ids):
            raise ValueError(f"Trajectory (group {self.group}): offpolicy_mask has {len(self.offpolicy_mask)} "
                             f"entries but response_ids has {len(self.response_ids)}")


class Suffix(NamedTuple):
    """One refiner attempt: its text (the continuation only, without the prefix it continues), and whether the
    refiner stopped by itself (EOS) rather than at its budget. A refiner's continue_from returns these pairs,
    [pick][attempt]."""
    text: str
    finished: bool


def refiner_prompt(question: str, prefix: str, style: str = "continue") -> tuple[str, str]:
    """The refiner's prompt (--refine-prompt): (the user's turn, the start of the assistant's turn). The refiner
    CONTINUES the kept prefix: the prefix opens its own answer, so what it writes next is the rest of the same
    solution. "hint" also says that the next step would be a mistake (only when something is kept)."""
    if style not in REFINE_PROMPTS:
        raise ValueError(f"refiner_prompt: style must be one of {REFINE_PROMPTS}, got {style!r}")
    return (question + HINT if style == "hint" and prefix else question), prefix


def rectify(trajs: list[Trajectory], picks: list[tuple[int, int]], refiner, tokenizer, *, attempts: int = 2,
            merge: str = "replace", max_new_tokens: int, grade_fn, seed: int | None = None,
            ) -> tuple[list[Trajectory], list[dict]]:
    """Step 5: repair the picked failures, recompute their rewards, merge the accepted ones.

    picks: (index into trajs, prefix_len in tokens) per selected failure. `tokenizer` is the POLICY's. Every
    attempt is graded (the trace records each); the first correct one is accepted (`repaired`); a rejected
    pick leaves the list holding the very same Trajectory object. The refiner may write max_new_tokens −
    len(prefix) tokens of its own (--refiner-max-tokens may cap it lower; a suffix clipped there is not finished);
    `splice` then holds the whole response to max_new_tokens policy tokens. Returns (new list, one trace per pick).
    """
    check_picks(trajs, picks, attempts, merge, max_new_tokens)   # a public entry point: one-line errors
    if not picks:
        return list(trajs), []
    originals = [trajs[index] for index, _ in picks]
    prefixes = [t.response_ids[:prefix_len] for t, (_, prefix_len) in zip(originals, picks)]
    prefix_texts = [tokenizer.decode(p, skip_special_tokens=True) for p in prefixes]   # the refiner reads text
    # the refiner reads refiner_prompt(question, prefix text) in its own chat template and tokens
    suffixes = refiner.continue_from([t.question for t in originals], prefix_texts, n=attempts,
                                     max_tokens=[max_new_tokens - len(p) for p in prefixes], seed=seed)
    suffixes = [[Suffix(*s) for s in row] for row in suffixes]   # [pick][attempt]: (text, finished)
    end_id = turn_end_id(tokenizer)  # what ends the assistant turn of the policy's prompt (choice 3)
    accepted: dict[int, Trajectory] = {}  # index of the original -> its repaired trajectory
    traces = []
    for t, (index, _), prefix, prefix_text, tries in zip(originals, picks, prefixes, prefix_texts, suffixes):
        spliced = [splice(prefix, s.text, tokenizer, max_new_tokens=max_new_tokens, eos_id=end_id,
                          finished=s.finished) for s in tries]   # (response_ids, offpolicy_mask) per attempt
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids, _ in spliced]
        verdicts = [bool(grade_fn(text, t.answer)) for text in texts]   # reward recomputation with the grader
        if any(verdicts):
            k = verdicts.index(True)   # the first correct attempt
            accepted[index] = repaired(t, *spliced[k], texts[k], len(prefix), end_id)
        traces.append(trace(t, len(prefix), prefix_text, tries, verdicts, accepted.get(index)))   # the log's
    return merge_into(trajs, accepted, merge), traces


def splice(prefix_ids: list[int], suffix_text: str, tokenizer, *, max_new_tokens: int,
           eos_id: int | None, finished: bool = True) -> tuple[list[int], list[int]]:
    """(response_ids, offpolicy_mask): the original prefix ids untouched + the suffix in POLICY tokens (+ END).

    `eos_id`: the id that ends the assistant turn (rectify passes generate.turn_end_id: <|im_end|> for ChatML).
    `finished`: the refiner stopped by itself. Only then is that id appended (when it fits): a refiner text cut
    at its budget stays a truncated trajectory however few policy tokens it re-tokenises to."""
    prefix_ids = list(prefix_ids)
    budget = max_new_tokens - len(prefix_ids)
    if budget < 0:
        raise ValueError(f"splice: the prefix has {len(prefix_ids)} tokens, more than max_new_tokens={max_new_tokens}")
    # BEGIN SOLUTION splice
    eos_text = tokenizer.decode([eos_id]) if eos_id is not None else ""
    if eos_text and eos_text in suffix_text:  # the text spelled out the EOS token: it ends there
        suffix_text, finished = suffix_text[:suffix_text.index(eos_text)], True
    # the refiner's text is text: "<|im_start|>" written out in it stays plain tokens, never the special id
    suffix_ids = tokenizer(suffix_text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    if finished and len(suffix_ids) < budget and eos_id is not None:
        suffix_ids = suffix_ids + [eos_id]  # the refiner stopped by itself and there is room: it stops here
    else:
        suffix_ids = suffix_ids[:budget]  # cut to fit: a truncated trajectory carries no EOS
    return prefix_ids + suffix_ids, [0] * len(prefix_ids) + [1] * len(suffix_ids)
    # END SOLUTION


def repaired(t: Trajectory, response_ids: list[int], mask: list[int], text: str, prefix_len: int,
              end_id: int | None) -> Trajectory:
    """The accepted repair of failure `t`: reward 1.0, the regrade's 0/1 outcome reward (only a correct repair is
    accepted); source "rectified" ("replaced" for an empty prefix); the refiner's tokens marked; the PRM facts
    copied from the original so the logs show what was salvaged; the sampler's log-probs of the kept prefix only."""
    return Trajectory(
        question=t.question, answer=t.answer, group=t.group, prompt_ids=list(t.prompt_ids),
        response_ids=response_ids, text=text, reward=1.0, correct=True, offpolicy_mask=mask,
        source="rectified" if prefix_len else "replaced", steps=_copy(t.steps), step_scores=_copy(t.step_scores),
        cut=t.cut, keep_ratio=t.keep_ratio, prefix_len=prefix_len, keep_ratio_tokens=t.keep_ratio_tokens,
        finished=bool(response_ids) and response_ids[-1] == end_id,
        sampler_logp=None if t.sampler_logp is None else list(t.sampler_logp[:prefix_len]))


def merge_into(trajs: list[Trajectory], accepted: dict[int, Trajectory], merge: str) -> list[Trajectory]:
    """A new list: each accepted trajectory replaces its original ("replace") or follows the last member of
    its group ("append"); every other entry is the very same object as before."""
    last_of_group = {t.group: i for i, t in enumerate(trajs)}
    out = []
    for i, t in enumerate(trajs):
        out.append(accepted[i] if merge == "replace" and i in accepted else t)
        if merge == "append" and last_of_group[t.group] == i:
            out.extend(accepted[j] for j in sorted(accepted) if trajs[j].group == t.group)
    return out


def repair_credit_only(batch: dict, trajs: list[Trajectory], part: str) -> dict:
    """--repair-credit prefix | suffix, the credit-split controls: an accepted repair keeps its reward and its
    advantage (and its place in the group's mean), but only one part of its tokens carries loss. `prefix`: its
    kept tokens (the policy's own); `suffix`: the refiner's. The other part's tokens leave the response mask, so
    they carry no loss (N and the constant Z unchanged; --loss-agg token-mean's Z counts only the tokens left).
    "all": the batch as it is. batch: build_batch's dict, row i = trajs[i]."""
    if part == "all":
        return batch
    repair = batch["response_mask"].new_tensor([t.source != "policy" for t in trajs]).bool().unsqueeze(1)  # (N, 1)
    off = batch["offpolicy_mask"].bool()  # (N, L) refiner tokens
    drop = repair & (off if part == "prefix" else ~off)  # (N, L)
    return {**batch, "response_mask": batch["response_mask"] * ~drop, "offpolicy_mask": batch["offpolicy_mask"] * ~drop}


# ---------------------------------------------------------------------------------------------------
# Plumbing: rectify's argument checks, its trace of each pick (traces.jsonl), copies
# ---------------------------------------------------------------------------------------------------
def check_picks(trajs: list[Trajectory], picks: list[tuple[int, int]], attempts: int, merge: str,
                max_new_tokens: int) -> None:
    """One-line ValueErrors for `rectify`'s arguments: the merge, the attempts, each pick's index and prefix."""
    if merge not in MERGES:
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


def trace(t: Trajectory, prefix_len: int, prefix_text: str, tries: list[Suffix], verdicts: list[bool],
          accepted: Trajectory | None) -> dict:
    """One pick's trace (traces.jsonl; the viewer of tools/report.py): the PRM facts, the kept text, every
    attempt with its verdict, and the reward before and after."""
    return {"group": t.group, "question": t.question, "answer": t.answer,
            "mode": "scope" if prefix_len else "replace",
            "steps": t.steps, "scores": t.step_scores, "cut": t.cut,
            "keep_ratio": t.keep_ratio, "keep_ratio_tokens": t.keep_ratio_tokens, "prefix_text": prefix_text,
            "suffixes": [s.text for s in tries], "suffix_finished": [s.finished for s in tries],
            "attempt_correct": verdicts, "accepted": accepted is not None,
            "reward_before": t.reward, "reward_after": accepted.reward if accepted is not None else t.reward}


def _copy(values: list | None) -> list | None:
    return None if values is None else list(values)
