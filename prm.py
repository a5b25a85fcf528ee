"""prm.py — steps, the first error, which failure to repair, and the process reward model (PRM) that scores steps.

SCOPE (Ren et al., arXiv 2602.24110) keeps a failed rollout's tokens before its *first wrong step* and lets a
refiner rewrite the rest (paper Fig. 1, 2, 12). In the order of the step: `split_steps` and `step_token_spans`
(a lossless split and each step's token range), `first_error`, `cut_point` and `keep_ratio` (pure), then
`locate_first_errors` (step 3 on a batch), `ProcessRewardModel` (the scoring call; the input layouts of the PRM
families it reads: harness/engines/prm_families.py), then `mean_score`, `select_candidate` and `select_failures`
(step 4).
k* is the paper's first wrong step, counted from 1; the cut is k* − 1: the 0-based index of that step, which is
also the number of steps kept. Tests: tests/test_steps.py, tests/test_prm.py. The step unit, the PRM input,
unscored steps, the cut and the pick are choices the paper leaves open: docs/choices.md, rows "3 PRM", "4 select".
"""
import codecs

from harness.engines.refiner import MODES_WITH_REFINER   # ("scope", "replace"): the modes that repair
from harness.engines.prm_engine import PRMEngine
from harness.engines.prm_families import SEPARATOR   # Qwen2.5-Math-PRM's step tag

TIEBREAKS = ("length", "index")   # select_candidate's last keys: the shorter rollout, or only the earlier index


# ---------------------------------------------------------------------------------------------------
# 3.1 Lossless step splitting (scope.py's step 3 works on steps)
# ---------------------------------------------------------------------------------------------------


def split_steps(text: str, *, min_chars: int = 8, max_steps: int = 40) -> list[str]:
    """Split a response into reasoning steps without losing a character: `"".join(steps) == text`.

    Rules, in order:
    1. Empty text -> `[]`.
    2. Separators are blank lines: a run of two or more newlines, possibly with spaces, tabs or `\\r`
       between them (so `"\\r\\n\\r\\n"` counts). If the text has no blank line, every single `\\n` is a
       separator instead. If it has no newline at all, the whole text is one step.
    3. Each separator belongs to the step *before* it (steps end with their separator; whitespace after
       the last newline of a separator, e.g. indentation, starts the next step).
    4. A piece with fewer than `min_chars` non-whitespace characters (this includes whitespace-only
       pieces, such as a leading blank line) merges into the next piece; a short last piece merges into
       the previous step. A text whose pieces are all short is one step.
    5. At most `max_steps` steps: steps `max_steps-1 ...` are joined into the last one.
    """
    if min_chars < 0 or max_steps < 1:
        raise ValueError(f"split_steps: need min_chars >= 0 and max_steps >= 1, got {min_chars}, {max_steps}")
    if not text:
        return []
    # BEGIN SOLUTION split_steps
    seps = _blank_line_ends(text)
    if not seps:
        seps = [i + 1 for i, ch in enumerate(text) if ch == "\n"]
    pieces = _cut_after(text, seps)

    def is_short(s: str) -> bool:
        return len(s) - sum(ch.isspace() for ch in s) < min_chars

    steps, buf = [], ""
    for piece in pieces:
        buf += piece
        if not is_short(buf):
            steps.append(buf)
            buf = ""
    if buf:  # a short tail: into the previous step, or alone when there is none
        if steps:
            steps[-1] += buf
        else:
            steps.append(buf)
    if len(steps) > max_steps:
        steps = steps[:max_steps - 1] + ["".join(steps[max_steps - 1:])]
    return steps
    # END SOLUTION


# ---------------------------------------------------------------------------------------------------
# 3.2 Step -> token spans
# ---------------------------------------------------------------------------------------------------


def step_token_spans(response_ids, steps: list[str], tokenizer) -> list[tuple[int, int]]:
    """Half-open token ranges `(start, end)` of each step in `response_ids`.

    `response_ids[:spans[k][0]]` is exactly the tokens whose text lies entirely before step k:
    - a token whose bytes straddle a boundary (a BPE merge across it) belongs to the *later* step, so the
      kept prefix never holds text of a wrong step; so do tokens holding the first bytes of a multi-byte
      character that a straddling token finishes, so the prefix always decodes to clean text
      (`decode(ids[:start_k])` is `"".join(steps[:k])` minus at most the straddling part);
    - tokens that decode to nothing (special tokens, e.g. a final EOS) go with the step before them, so
      the spans are contiguous and cover every token, and EOS belongs to the last step;
    - a step in which no token starts gets an empty span (start == end).
    `"".join(steps)` must equal `tokenizer.decode(response_ids, skip_special_tokens=True)` (the text
    `split_steps` got), else ValueError. No steps -> `[]`.

    Byte-level BPE (Qwen, GPT-2) reads token bytes through the byte alphabet and tokenizers whose tokens
    are their own text (the char tokenizer) read them directly: O(n). Other tokenizers (e.g. SentencePiece
    "▁" pieces) fall back to decoding growing prefixes, O(n^2).
    """
    ids = [int(t) for t in response_ids]
    if not steps:
        return []
    text = "".join(steps)
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    if decoded != text:
        diff = next((i for i, (a, b) in enumerate(zip(text, decoded)) if a != b),
                    min(len(text), len(decoded)))
        raise ValueError(f"step_token_spans: the steps do not join to the decoded response ({len(text)} vs "
                         f"{len(decoded)} chars; first difference at char {diff}: "
                         f"{text[diff:diff + 20]!r} vs {decoded[diff:diff + 20]!r})")
    # BEGIN SOLUTION step_token_spans
    last, pending = _char_reach(tokenizer, ids, text)
    starts, t, boundary = [0], 0, 0
    for step in steps[:-1]:
        boundary += len(step)  # index of the first char of the next step
        while t < len(ids) and last[t] < boundary:
            t += 1
        start = t
        while start > starts[-1] and pending[start - 1]:
            start -= 1  # the token before ends inside a character that the straddling token finishes
        starts.append(start)
    ends = starts[1:] + [len(ids)]
    return list(zip(starts, ends))
    # END SOLUTION


def _char_reach(tokenizer, ids: list[int], text: str) -> tuple[list[int], list[bool]]:
    """For each token i: the index of the last character of `text` it holds (a byte of), -1 for leading
    tokens that hold nothing (non-decreasing), and whether it ends inside a multi-byte character.

    Fast path (O(total bytes)): read each token's bytes and feed them through an incremental UTF-8
    decoder. Slow path, only when the fast path does not reproduce the decoded text exactly (tokenizers
    that rewrite spaces on decode): decode growing prefixes, O(n^2)."""
    # BEGIN SOLUTION step_token_spans
    pieces = _token_bytes(tokenizer, ids)
    if pieces is not None:
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        emitted, last, pending, chunks = 0, [], [], []
        for b in pieces:
            chunk = dec.decode(b)
            chunks.append(chunk)
            emitted += len(chunk)
            pending.append(bool(dec.getstate()[0]))  # bytes of an unfinished character are buffered
            last.append(emitted if pending[-1] else emitted - 1)
        chunks.append(dec.decode(b"", final=True))
        if "".join(chunks) == text:
            return last, pending
    last, pending, hi = [], [], -1
    for i in range(len(ids)):
        d = tokenizer.decode(ids[:i + 1], skip_special_tokens=True)
        common = 0
        for a, b in zip(d, text):
            if a != b:
                break
            common += 1
        pending.append(len(d) > common)  # a tail that is not the text: an unfinished character
        hi = max(hi, common if pending[-1] else common - 1)
        last.append(hi)
    return last, pending
    # END SOLUTION


# ---------------------------------------------------------------------------------------------------
# 3.3 First error, the cut, κ (pure)
# ---------------------------------------------------------------------------------------------------


def first_error(scores, tau: float = 0.5) -> int | None:
    """k* − 1, the 0-based index of the first step with score < tau (ProcessBench's "earliest error"); None when
    no scored step is below tau. Scanning stops at the first unscored step (None): scores after it are
    ignored, since the steps before them are not verified."""
    # BEGIN SOLUTION first_error
    for k, s in enumerate(scores):
        if s is None:
            return None
        if s < tau:
            return k
    return None
    # END SOLUTION


def cut_point(scores, tau: float = 0.5) -> int:
    """The cut of a failed rollout, the index of the first step NOT kept (= the steps kept): k* − 1 of the first
    error; else the first unscored step; else the last step (the answer is wrong, so the last step is presumed
    wrong); 0 for no steps."""
    # BEGIN SOLUTION first_error
    if not scores:
        return 0
    err = first_error(scores, tau)
    if err is not None:
        return err
    unscored = next((k for k, s in enumerate(scores) if s is None), None)
    return unscored if unscored is not None else len(scores) - 1
    # END SOLUTION


def keep_ratio(cut: int, n_steps: int) -> float:
    """κ = cut / n_steps, the share of steps kept; 0.0 when there are no steps."""
    # BEGIN SOLUTION first_error
    return cut / n_steps if n_steps > 0 else 0.0
    # END SOLUTION


# ---------------------------------------------------------------------------------------------------
# 3.4 Locating the first errors of a batch: scope.py's step 3
# ---------------------------------------------------------------------------------------------------
def kept_tokens(spans: list[tuple[int, int]], cut: int, n_tokens: int) -> int:
    """Tokens of a failed response kept before its cut: where step `cut` starts, all n_tokens when the cut lies
    past the last step, and none for a response without steps (an empty or bare-EOS response keeps nothing:
    keeping its EOS would train it on-policy with a positive advantage and put the refiner after it)."""
    if not spans:
        return 0
    return spans[cut][0] if cut < len(spans) else n_tokens


def locate_first_errors(trajs: list, prm, tokenizer, tau: float, mode: str = "scope",
                        prm_reward_coef: float = 0.5) -> None:
    """Step 3: the PRM scores the steps of every failed rollout; the first step below τ gives the cut
    (`cut_point`). Sets steps, step_scores, cut, keep_ratio, prefix_len (the tokens before the cut) and
    keep_ratio_tokens on each. Mode "prm-reward" (Table 3's "RL with PRM reward") scores every rollout and
    makes its reward outcome + prm_reward_coef · mean step score."""
    # BEGIN SOLUTION scope_step
    scored = [t for t in trajs if mode == "prm-reward" or not t.correct] if prm else []
    for t in scored:
        t.steps = split_steps(t.text)
    for t, scores in zip(scored, prm.score_batch([t.question for t in scored], [t.steps for t in scored])
                         if scored else []):
        t.step_scores = scores
        t.cut = cut_point(scores, tau)
        t.keep_ratio = keep_ratio(t.cut, len(t.steps))
        t.prefix_len = kept_tokens(step_token_spans(t.response_ids, t.steps, tokenizer), t.cut, len(t.response_ids))
        t.keep_ratio_tokens = t.prefix_len / max(1, len(t.response_ids))
    # END SOLUTION
    for t in trajs if mode == "prm-reward" else []:   # a dense PRM reward
        t.reward = float(t.correct) + prm_reward_coef * mean_score(t.step_scores or [])


# ---------------------------------------------------------------------------------------------------
# 3.5 The process reward model: P(step correct) per step (step 3 calls its score_batch)
# ---------------------------------------------------------------------------------------------------


class ProcessRewardModel(PRMEngine):
    """The PRM's scoring call: P(step correct) for each step of a solution. How a PRM reads the steps (its input
    layout and where P(correct) is read: Qwen2.5-Math-PRM's `<extra_0>` chat, TRL's token classifier, an LM head's
    "+"/"-" judgment) is its family's, harness/engines/prm_families.py; the engine (loading without remote code,
    `max_length`, micro-batches, the PRM served on vLLM's pooling runner, `name_or_path` and the keyword
    arguments, `build_input`): harness/engines/prm_engine.py.
    """

    separator = SEPARATOR   # the step tag whose positions the served PRM (Qwen2.5-Math-PRM) scores

    def score(self, question: str, steps: list[str]) -> list[float | None]:
        """P(correct) in [0, 1] for each step; None for steps beyond `max_length`."""
        return self.score_batch([question], [steps])[0]

    def score_batch(self, questions: list[str], list_of_steps: list[list[str]]) -> list[list[float | None]]:
        """`score` for many solutions, in input order: P(correct) at each step's scored position (`probs_at`)."""
        if len(questions) != len(list_of_steps):
            raise ValueError(f"score_batch: {len(questions)} questions but {len(list_of_steps)} step lists")
        probs = self.probs_at([self.build_input(q, s) for q, s in zip(questions, list_of_steps)])
        return [p + [None] * (len(s) - len(p)) for p, s in zip(probs, list_of_steps)]


# ---------------------------------------------------------------------------------------------------
# 4. The most promising failure of each group: scope.py's step 4
# ---------------------------------------------------------------------------------------------------


def mean_score(scores) -> float:
    """Mean PRM score over the scored steps (None skipped); 0.0 when nothing is scored. Used for the
    kept-prefix tie-break (`mean_score(scores[:cut])`) and by the prm-reward ablation."""
    vals = [s for s in scores if s is not None]
    return sum(vals) / len(vals) if vals else 0.0


def select_candidate(keep_ratios: list[float], prefix_means: list[float], lengths: list[int],
                     tiebreak: str = "length") -> int | None:
    """Index of the most promising failure of a group: the largest keep ratio; ties -> the higher mean
    PRM score over the kept prefix; then the shorter rollout (in tokens); then the earlier index.
    None for an empty group. tiebreak="index" drops the length key (ties go to the earlier index: rollouts
    of a group are exchangeable, so this favours no form of solution; "shorter" favours the terser phrasing)."""
    if not (len(keep_ratios) == len(prefix_means) == len(lengths)):
        raise ValueError(f"select_candidate: lengths differ ({len(keep_ratios)} keep ratios, "
                         f"{len(prefix_means)} prefix means, {len(lengths)} lengths)")
    if tiebreak not in TIEBREAKS:
        raise ValueError(f"select_candidate: tiebreak={tiebreak!r} must be {' or '.join(map(repr, TIEBREAKS))}")
    if not keep_ratios:
        return None
    if tiebreak == "index":
        lengths = [0] * len(lengths)   # every length equal: the key below falls through to the index
    # BEGIN SOLUTION first_error
    return min(range(len(keep_ratios)), key=lambda i: (-keep_ratios[i], -prefix_means[i], lengths[i], i))
    # END SOLUTION


def select_failures(trajs: list, groups, mode: str = "scope", rectify_groups: str = "any",
                    tiebreak: str = "length") -> list[tuple[int, int]]:
    """Step 4: (index, tokens to keep) of the most promising failure of each eligible group of `groups`
    (rectify_groups "any": every group with a failure; "all-fail": only groups in which every rollout failed):
    largest keep ratio, then higher prefix PRM mean, then shorter (`select_candidate`). Mode "replace" keeps
    nothing of the same pick; modes other than "scope" and "replace" pick nothing."""
    # BEGIN SOLUTION scope_step
    if mode not in MODES_WITH_REFINER:   # grpo, prm-reward: no repair
        return []
    picks = []
    for b in groups:
        idx = [i for i, t in enumerate(trajs) if t.group == b and not t.correct]
        if not idx or (rectify_groups == "all-fail" and any(t.correct for t in trajs if t.group == b)):
            continue   # all-fail only: a group with a success keeps its on-policy signal untouched
        j = select_candidate([trajs[i].keep_ratio for i in idx],
                             [mean_score(trajs[i].step_scores[:trajs[i].cut]) for i in idx],
                             [len(trajs[i].response_ids) for i in idx], tiebreak=tiebreak)
        if j is None:
            continue
        if mode == "replace":   # Table 3's "replace": the refiner rewrites the whole solution of the same pick
            picks.append((idx[j], 0))
        else:                   # SCOPE: keep the policy's own tokens before the first error
            picks.append((idx[j], trajs[idx[j]].prefix_len))
    return picks
    # END SOLUTION


# ---------------------------------------------------------------------------------------------------
# Plumbing: cutting text, reading token bytes
# ---------------------------------------------------------------------------------------------------


def _cut_after(text: str, seps: list[int]) -> list[str]:
    """Pieces of `text` cut after each position in `seps` (sorted ends of separators); lossless."""
    pieces, start = [], 0
    for end in seps:
        pieces.append(text[start:end])
        start = end
    if start < len(text):
        pieces.append(text[start:])
    return pieces


def _blank_line_ends(text: str) -> list[int]:
    """End offsets of blank-line separators: a run of >= 2 newlines with only spaces/tabs/\\r between."""
    ends, i, n = [], 0, len(text)
    while i < n:
        if text[i] != "\n":
            i += 1
            continue
        # text[i] is a newline; extend over (horizontal whitespace)* newline, as often as possible
        end, newlines, j = i + 1, 1, i + 1
        while j < n:
            while j < n and text[j] in " \t\r\f\v":
                j += 1
            if j < n and text[j] == "\n":
                newlines += 1
                j += 1
                end = j
            else:
                break
        if newlines >= 2:
            ends.append(end)
        i = end
    return ends


def _byte_level_inverse() -> dict[str, int]:
    """GPT-2 / Qwen byte-level alphabet, char -> byte: printable bytes stand for themselves, the other
    bytes are mapped in order onto chr(256), chr(257), ..."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    inverse, extra = {}, 0
    for b in range(256):
        if b in printable:
            inverse[chr(b)] = b
        else:
            inverse[chr(256 + extra)] = b
            extra += 1
    return inverse


_BYTE_OF = _byte_level_inverse()


def _token_bytes(tokenizer, ids: list[int]) -> list[bytes] | None:
    """The bytes each token contributes to `decode(ids, skip_special_tokens=True)`, or None when this
    tokenizer's pieces cannot be read directly (the caller then verifies or falls back)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    try:
        byte_level = type(tokenizer.backend_tokenizer.decoder).__name__ == "ByteLevel"
    except AttributeError:
        byte_level = False
    pieces = tokenizer.convert_ids_to_tokens(list(ids))
    out = []
    for tid, piece in zip(ids, pieces):
        if tid in special or (tid in added and added[tid].special) or piece is None:
            out.append(b"")  # skipped by decode(skip_special_tokens=True); unknown ids decode to nothing
        elif tid in added:
            out.append(added[tid].content.encode("utf-8"))
        elif byte_level:
            try:
                out.append(bytes(_BYTE_OF[ch] for ch in piece))
            except KeyError:
                return None
        else:
            out.append(piece.encode("utf-8"))
    return out
