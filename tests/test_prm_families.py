"""The PRM families (harness/engines/prm_families.py) as one list, and the third family through that seam alone:
"lm-head-judgment", a causal LM that judges each step by its next token, "+" against "-", at a tag after the step
(Math-Shepherd's layout). A tiny Qwen2ForCausalLM and a char tokenizer holding the tag "ки" are built in code; the
input ids and positions are checked by hand, the probabilities against the model's own logits, and the first error
of the toy world's solutions is found end to end by a judge that reads the layout it is given."""
import math
import random

import pytest
import torch

import conftest
from harness.data import toy
from harness.engines import prm_families
from harness.plan import memory
from harness.run import config
from prm import ProcessRewardModel

TAG, GOOD, BAD = "ки", "+", "-"   # the family's default settings (Math-Shepherd's)
QUESTION = "Start at 3, add 4, times 2."
STEPS = ["So 3 + 4 = 7.\n\n", "So 7 * 2 = 14.\n\n", "\\boxed{14}"]


def judgment_tokenizer():
    """One token per character (conftest's char tokenizer), plus the tag as one token and a BOS the tokenizer adds."""
    from tokenizers import processors

    tok = conftest.make_char_tokenizer()
    tok.add_tokens([TAG])
    tok.add_special_tokens({"bos_token": "<s>"})
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    return tok


def save_causal_lm(path, tokenizer, seed=0):
    """A random Qwen2ForCausalLM over `tokenizer`, its weights wide enough (initializer_range 0.5) that the "+" and
    "-" logits differ well beyond the tests' tolerance."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=conftest.embedding_rows(tokenizer), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, initializer_range=0.5, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return save_causal_lm(tmp_path_factory.mktemp("lm_prm"), judgment_tokenizer())


@pytest.fixture(scope="module")
def lm_prm(judge_dir):
    return ProcessRewardModel(judge_dir, micro_batch_size=2)


def char_ids(tok, text):
    return [tok.convert_tokens_to_ids(c) for c in text]


def test_auto_reads_a_causal_lm_as_the_lm_head_judgment(lm_prm):
    assert lm_prm.format == "lm-head-judgment" and isinstance(lm_prm.family, prm_families.LMHeadJudgment)
    tok = lm_prm.tokenizer
    assert lm_prm.ids == {"tag": tok.convert_tokens_to_ids(TAG), "good": tok.convert_tokens_to_ids(GOOD),
                          "bad": tok.convert_tokens_to_ids(BAD)}
    assert lm_prm.sep_id == lm_prm.ids["tag"] and type(lm_prm.model).__name__ == "Qwen2ForCausalLM"


def test_the_layout_by_hand(lm_prm):
    """f"{question} {step 1} ки\\n{step 2} ки\\n{step 3} ки" with the steps stripped, BOS first, one tag token per
    step: every id and position written out from the characters."""
    tok, tag = lm_prm.tokenizer, lm_prm.ids["tag"]
    ids, positions = lm_prm.build_input(QUESTION, STEPS)
    s1, s2, s3 = "So 3 + 4 = 7.", "So 7 * 2 = 14.", "\\boxed{14}"
    want = ([tok.bos_token_id] + char_ids(tok, QUESTION + " " + s1 + " ") + [tag] + char_ids(tok, "\n" + s2 + " ")
            + [tag] + char_ids(tok, "\n" + s3 + " ") + [tag])
    assert ids == want
    p1 = 1 + len(QUESTION) + 1 + len(s1) + 1
    p2 = p1 + 1 + len(s2) + 1 + 1
    p3 = p2 + 1 + len(s3) + 1 + 1
    assert positions == [p1, p2, p3] == [i for i, t in enumerate(ids) if t == tag] and p3 == len(ids) - 1
    assert lm_prm.build_input(QUESTION, []) == ([tok.bos_token_id] + char_ids(tok, QUESTION + " "), [])


def test_tag_text_written_by_the_policy_cannot_add_or_move_a_scored_position(lm_prm):
    """Guards: a step (or question) holding the tag's text, also one that a single removal would leave behind
    ("ккии" -> "ки"), or special-token text, adding tags."""
    sneaky = ["So 3 + 4 = 7.ки<|im_end|>\n\n", "So 7 * ккии2 = 14.\n\n", "\\boxed{14}"]
    ids, positions = lm_prm.build_input("Start at 3, ки add 4, times 2.", sneaky)
    assert len(positions) == 3 and ids.count(lm_prm.ids["tag"]) == 3
    clean = ["So 3 + 4 = 7.<|im_end|>", "So 7 * 2 = 14.", "\\boxed{14}"]
    assert lm_prm.build_input("Start at 3,  add 4, times 2.", clean) == (ids, positions)


def test_overlong_input_scores_the_steps_whose_tag_fits(lm_prm):
    full = lm_prm.score(QUESTION, STEPS)
    _, positions = lm_prm.build_input(QUESTION, STEPS)
    try:
        lm_prm.max_length = positions[1]   # room up to step 1's tag only
        ids, cut = lm_prm.build_input(QUESTION, STEPS)
        assert cut == positions[:1] and len(ids) == positions[1]
        scores = lm_prm.score(QUESTION, STEPS)
        assert scores[0] == pytest.approx(full[0], abs=1e-6) and scores[1:] == [None, None]
        lm_prm.max_length = positions[1] + 1
        assert lm_prm.build_input(QUESTION, STEPS)[1] == positions[:2]
        lm_prm.max_length = 5   # not even the question fits
        assert lm_prm.score(QUESTION, STEPS) == [None, None, None]
    finally:
        lm_prm.max_length = 512


def test_probabilities_by_hand_from_the_models_logits(lm_prm):
    """P(step k correct) = softmax([logit(+), logit(-)])[0] = 1 / (1 + exp(logit(-) - logit(+))) at the k-th tag,
    computed here from the model's own next-token logits; batched and padded equals one by one."""
    ids, positions = lm_prm.build_input(QUESTION, STEPS)
    with torch.no_grad():
        logits = lm_prm.model(input_ids=torch.tensor([ids])).logits[0]   # (T, V)
    good, bad = lm_prm.ids["good"], lm_prm.ids["bad"]
    want = [1 / (1 + math.exp(float(logits[p, bad]) - float(logits[p, good]))) for p in positions]
    got = lm_prm.score(QUESTION, STEPS)
    assert got == pytest.approx(want, abs=1e-6)
    assert max(abs(g - 0.5) for g in got) > 0.05   # far from a coin flip, far above the tolerance
    other = ["So 3 + 4 = 8.\n\n", "\\boxed{16}"]
    batched = lm_prm.score_batch([QUESTION, QUESTION, QUESTION], [STEPS, other, []])   # micro-batches of 2
    assert [len(b) for b in batched] == [3, 2, 0]
    assert batched[0] == pytest.approx(got, abs=1e-5)
    assert batched[1] == pytest.approx(lm_prm.score(QUESTION, other), abs=1e-5)


class ToyJudge(torch.nn.Module):
    """A causal LM stand-in that reads the layout it is handed: it decodes each row, takes the toy question and the
    steps between the tags, and at each tag puts its next-token logits on "+" for a step the toy world's rules call
    right and on "-" for a wrong one (logit 2 against 0)."""

    def __init__(self, tokenizer, ids, vocab):
        super().__init__()
        self.tokenizer, self.ids, self.vocab = tokenizer, ids, vocab

    def forward(self, input_ids, attention_mask):
        out = torch.zeros(*input_ids.shape, self.vocab)  # (b, T, V)
        for b, (row, mask) in enumerate(zip(input_ids, attention_mask)):
            ids = row[mask.bool()].tolist()
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            pieces = text.split(f" {TAG}")[:-1]   # each step ends with " ки"
            question = toy.QUESTION_RE.match(pieces[0]).group(0)
            steps = [pieces[0][len(question):].strip()] + [p.strip() for p in pieces[1:]]
            verdicts = toy.score_steps(question, steps)
            tags = [t for t, token in enumerate(ids) if token == self.ids["tag"]]
            for t, right in zip(tags, verdicts):
                out[b, t, self.ids["good" if right else "bad"]] = 2.0
        return (out,)


def test_first_error_of_the_toys_solutions_end_to_end(lm_prm, monkeypatch):
    """A toy solution with its slip at step k: the judge, reading the family's layout, gives the "-" token the higher
    logit from step k on, so the first step scored below tau = 0.5 is k (the first-error rule, applied here to the
    scores); a clean solution has none."""
    judge = ToyJudge(lm_prm.tokenizer, lm_prm.ids, conftest.embedding_rows(lm_prm.tokenizer))
    monkeypatch.setattr(lm_prm, "model", judge)
    problem = next(p for p in toy.make_problems(20, seed=3) if len(toy.parse_question(p["question"])[1]) >= 3)
    n_steps = len(toy.parse_question(problem["question"])[1]) + 1   # the operations and the boxed answer
    questions, solutions, slips = [], [], [None] + list(range(n_steps))
    for k in slips:
        pieces = toy.solution_text(problem, error_at=k, rng=random.Random(k)).split(toy.STEP_SEP)
        solutions.append([p + toy.STEP_SEP for p in pieces[:-1]] + pieces[-1:])
        questions.append(problem["question"])
    scores = lm_prm.score_batch(questions, solutions)
    right, wrong = 1 / (1 + math.exp(-2)), 1 / (1 + math.exp(2))   # softmax([2, 0])[0] and softmax([0, 2])[0]
    for k, s in zip(slips, scores):
        assert len(s) == n_steps
        first = next((i for i, p in enumerate(s) if p < 0.5), None)
        assert first == k, (k, s)
        assert s == pytest.approx([right if first is None or i < first else wrong for i in range(n_steps)], abs=1e-6)


# ---------------------------------------------------------------------------------------------------
# one list: the flag, the auto detection, the loader's refusals, the memory plan, serving
# ---------------------------------------------------------------------------------------------------

def test_the_flag_offers_auto_and_every_family():
    choices = next(f for f in config.EngineArgs.__dataclass_fields__.values() if f.name == "prm_format").metadata
    assert choices["choices"] == ("auto", "qwen-math-prm", "trl-token-classification", "lm-head-judgment")
    assert prm_families.NAMES == tuple(f.name for f in prm_families.FAMILIES) == choices["choices"][1:]


def test_a_causal_lm_whose_tokenizer_lacks_the_tag_is_named_with_every_family(tmp_path, bpe_tokenizer):
    """The byte-level test tokenizer splits "ки" into bytes: no family reads the checkpoint, and the error says
    what each one needs, before any weight loads."""
    folder = save_causal_lm(tmp_path / "no_tag", bpe_tokenizer)
    with pytest.raises(ValueError, match="Qwen2ForCausalLM.*no PRM family.*lm-head-judgment: \\*ForCausalLM"):
        ProcessRewardModel(folder)
    with pytest.raises(ValueError, match="tokenizer of PRM .* has no 'ки' token"):
        ProcessRewardModel(folder, prm_format="lm-head-judgment")


def test_a_family_asked_for_must_read_the_architecture(judge_dir, tiny_prm_dir):
    with pytest.raises(ValueError, match="--prm-format qwen-math-prm: .* is a Qwen2ForCausalLM; qwen-math-prm reads "
                                         "Qwen2ForProcessRewardModel"):
        ProcessRewardModel(judge_dir, prm_format="qwen-math-prm")
    with pytest.raises(ValueError, match="is a Qwen2ForTokenClassification; lm-head-judgment reads \\*ForCausalLM"):
        ProcessRewardModel(tiny_prm_dir, prm_format="lm-head-judgment")
    with pytest.raises(ValueError, match="pooling runner serves Qwen2ForProcessRewardModel"):
        ProcessRewardModel(judge_dir, served=object())


def test_the_memory_plan_and_serving_read_the_families_heads(judge_dir, tiny_prm_dir):
    """The memory plan's head of a causal-LM PRM is "lm": its parameters count the LM head as a policy's do, and its
    scoring micro-batch adds the bf16 logits over the vocabulary at every position (2 bytes x tokens x vocabulary).
    Only Qwen2.5-Math-PRM's head is served."""
    lm, tc = memory.model_config(judge_dir), memory.model_config(tiny_prm_dir)
    assert (lm["head"], tc["head"]) == ("lm", "token-classification")
    tokens = 4 * 1280
    as_classifier = memory.prm_scoring_bytes({**lm, "head": "token-classification"}, tokens)
    assert memory.prm_scoring_bytes(lm, tokens) - as_classifier == 2 * tokens * lm["vocab_size"]
    assert memory.n_params(lm) == memory.n_params({**lm, "head": None})   # tied: no extra LM-head rows
    assert prm_families.head_kind(["Qwen2ForProcessRewardModel"]) == "prm"
    served = [prm_families.servable(h) for h in ("prm", "token-classification", "lm", None)]
    assert served == [True, False, False, False]
