"""Tests for prm.split_steps (lossless step splitting) and prm.step_token_spans (step -> token ranges)."""
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import CORPUS
from prm import split_steps, step_token_spans

WHITESPACE_THEN_NEWLINE = re.compile(r"[ \t\r\f\v]*\n")


def nonspace(s):
    return sum(not ch.isspace() for ch in s)


# ---------------------------------------------------------------------------------------------------
# split_steps
# ---------------------------------------------------------------------------------------------------

texts = st.one_of(
    st.text(),  # any unicode
    st.lists(st.sampled_from(["\n", "\r\n", " ", "\t", "a", "bc", "x = 1.", "é√∑", "\\boxed{7}"]),
             max_size=60).map("".join),  # text with lines and paragraphs
    st.text(alphabet=st.sampled_from(["\n", " ", "\r"])),  # only newlines / whitespace
    st.text(alphabet=st.characters(blacklist_characters="\n")),  # no newline at all
)


@settings(max_examples=300, deadline=None)
@given(texts, st.integers(0, 12), st.integers(1, 6))
def test_split_is_lossless_and_follows_the_rules(text, min_chars, max_steps):
    steps = split_steps(text, min_chars=min_chars, max_steps=max_steps)
    assert "".join(steps) == text
    assert (steps == []) == (text == "")
    assert all(steps) and len(steps) <= max_steps
    if len(steps) > 1:  # short pieces were merged away
        assert all(nonspace(s) >= min_chars for s in steps)
    for s in steps[:-1]:  # every step but the last ends with its separator
        assert s.endswith("\n")
    for s in steps[1:]:  # ... so no step starts with (the rest of) a separator
        assert not WHITESPACE_THEN_NEWLINE.match(s)


def test_blank_lines_separate_and_the_separator_goes_before():
    text = "First we compute 2+2.\n\nThen we add 3 to get 7.\n\n\nSo the answer is \\boxed{7}."
    assert split_steps(text) == ["First we compute 2+2.\n\n", "Then we add 3 to get 7.\n\n\n",
                                 "So the answer is \\boxed{7}."]


def test_spaces_tabs_and_crlf_between_newlines_still_make_a_blank_line():
    text = "Step one is here.\n  \t\n  Step two, indented.\r\n\r\nStep three is here."
    assert split_steps(text) == ["Step one is here.\n  \t\n", "  Step two, indented.\r\n\r\n",
                                 "Step three is here."]


def test_single_newlines_are_used_only_when_there_is_no_blank_line():
    lines = "Line one is long.\nLine two is long.\nLine three is long."
    assert split_steps(lines) == ["Line one is long.\n", "Line two is long.\n", "Line three is long."]
    mixed = "Para one, line a.\nline b of para one.\n\nPara two is here."
    assert split_steps(mixed) == ["Para one, line a.\nline b of para one.\n\n", "Para two is here."]


def test_no_newline_is_one_step_and_empty_is_none():
    assert split_steps("just one long step without breaks") == ["just one long step without breaks"]
    assert split_steps("") == []
    assert split_steps("\n\n\n") == ["\n\n\n"]  # only newlines: one (whitespace) step
    assert split_steps("ab") == ["ab"]


def test_short_pieces_merge_forward_and_a_short_tail_merges_back():
    text = "Step 1:\n\nCompute 12 * 4 = 48.\n\nNext 48 - 5 = 43.\n\nSo 43."
    # "Step 1:" has 6 non-space chars < 8 -> joins the next piece; "So 43." is a short tail -> previous
    assert split_steps(text) == ["Step 1:\n\nCompute 12 * 4 = 48.\n\n", "Next 48 - 5 = 43.\n\nSo 43."]
    assert split_steps(text, min_chars=0) == ["Step 1:\n\n", "Compute 12 * 4 = 48.\n\n",
                                              "Next 48 - 5 = 43.\n\n", "So 43."]
    # a leading blank line is a whitespace-only piece: it joins the first real step
    assert split_steps("\n\nThe first real step.\n\nThe second real step.") == [
        "\n\nThe first real step.\n\n", "The second real step."]


def test_max_steps_merges_the_tail_into_the_last_step():
    paras = [f"Paragraph number {i}.\n\n" for i in range(50)]
    text = "".join(paras)
    assert split_steps(text, max_steps=50) == paras
    capped = split_steps(text, max_steps=5)
    assert capped[:4] == paras[:4] and capped[4] == "".join(paras[4:])
    assert len(split_steps(text)) == 40  # the default cap
    assert split_steps(text, max_steps=1) == [text]
    # the cap counts steps, after the short pieces merged: "a" and "b" (1 character < 8) join the pieces after
    # them, giving 3 steps, of which the last two join (capping the 5 pieces first would leave 1 step)
    short = "a\n\nParagraph one.\n\nb\n\nParagraph two.\n\nParagraph three.\n\n"
    assert split_steps(short, max_steps=2) == ["a\n\nParagraph one.\n\n", "b\n\nParagraph two.\n\nParagraph three.\n\n"]


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="max_steps"):
        split_steps("x", max_steps=0)


# ---------------------------------------------------------------------------------------------------
# step_token_spans
# ---------------------------------------------------------------------------------------------------

def check_spans(ids, steps, tok):
    """The span contract as properties: contiguous spans covering every token, and each start is a clean,
    longest prefix: decode(ids[:start_k]) is a prefix of "".join(steps[:k]) and one more token is not."""
    spans = step_token_spans(ids, steps, tok)
    assert len(spans) == len(steps)
    assert spans[0][0] == 0 and spans[-1][1] == len(ids)
    for (a, b), (c, _) in zip(spans, spans[1:]):
        assert a <= b == c  # contiguous, non-overlapping
    for k, (start, _) in enumerate(spans[1:], 1):
        before = "".join(steps[:k])
        assert before.startswith(tok.decode(ids[:start], skip_special_tokens=True)), (k, start)
        if start < len(ids):
            assert not before.startswith(tok.decode(ids[:start + 1], skip_special_tokens=True)), (k, start)
    return spans


@pytest.mark.parametrize("which", ["bpe", "char"])
def test_spans_of_real_encodings_with_eos(which, bpe_tokenizer, char_tokenizer):
    tok = bpe_tokenizer if which == "bpe" else char_tokenizer
    text = CORPUS[3] + "\n\n" + CORPUS[1]
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    steps = split_steps(tok.decode(ids, skip_special_tokens=True))
    spans = check_spans(ids, steps, tok)
    for k, (start, _) in enumerate(spans):  # boundaries fall on "\n\n": the prefix is exact
        assert tok.decode(ids[:start], skip_special_tokens=True) == "".join(steps[:k])
    assert ids[spans[-1][1] - 1] == tok.eos_token_id  # EOS belongs to the last step


def test_a_bpe_token_straddling_a_boundary_goes_to_the_later_step(bpe_tokenizer):
    """Guards: keeping a token that holds text of the wrong step (here " compute" across a cut)."""
    tok = bpe_tokenizer
    ids = tok.encode("First, compute 12 * 4 = 48.", add_special_tokens=False)
    assert "Ġcompute" in tok.convert_ids_to_tokens(ids)
    steps = ["First, c", "o", "mpute 12 * 4 = 48."]  # the cut falls inside " compute"
    spans = check_spans(ids, steps, tok)
    k = tok.convert_ids_to_tokens(ids).index("Ġcompute")
    assert spans == [(0, k), (k, k), (k, len(ids))]  # the middle step gets no token: an empty span
    assert tok.decode(ids[:k]) == "First,"  # = steps[0] minus the straddling " c"


def test_a_character_split_over_byte_tokens_is_never_cut(bpe_tokenizer):
    """Guards: a kept prefix ending in half a UTF-8 character (decodes to U+FFFD)."""
    tok = bpe_tokenizer
    ids = tok.convert_tokens_to_ids(["a", "â", "Ī", "ļ", "b"])  # "a" + the 3 bytes of "√" + "b"
    assert tok.decode(ids) == "a√b"
    assert check_spans(ids, ["a", "√b"], tok) == [(0, 1), (1, 5)]
    assert check_spans(ids, ["a√", "b"], tok) == [(0, 4), (4, 5)]
    # "¼nÃ¯" (a BPE token of the fixture) finishes "ü" (bytes C3 BC) and runs on into "nï": it straddles
    # the cut after "ü", so it moves to the later step and the "Ã" (C3) byte token before it goes too
    ids = tok.convert_tokens_to_ids(["a", "Ã", "¼nÃ¯"])
    assert tok.decode(ids) == "aünï"
    assert check_spans(ids, ["aü", "nï"], tok) == [(0, 1), (1, 3)]
    assert tok.decode(ids[:1]) == "a"


def test_char_tokenizer_and_special_tokens_in_the_middle(char_tokenizer):
    tok = char_tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = (tok.encode("Long step one.\n\n", add_special_tokens=False) + [im_end]
           + tok.encode("Long step two.", add_special_tokens=False) + [tok.eos_token_id])
    steps = split_steps(tok.decode(ids, skip_special_tokens=True))
    spans = check_spans(ids, steps, tok)
    assert spans == [(0, 17), (17, 32)]  # the special token (nothing decoded) stays with the step before


def test_tokenizers_that_rewrite_text_on_decode_use_the_slow_path():
    """SentencePiece-style "▁" pieces: token strings are not the text, so prefixes are decoded instead."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["▁First", "▁step", "▁is", "▁long.", "\n\n", "▁Second", "▁one", "▁here."]
    vocab = {"[UNK]": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    sp = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    sp.pre_tokenizer, sp.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=sp, unk_token="[UNK]", eos_token="<eos>")
    ids = list(range(2, 10)) + [1]
    text = tok.decode(ids, skip_special_tokens=True)
    assert text == "First step is long.\n\n Second one here."
    assert check_spans(ids, split_steps(text), tok) == [(0, 5), (5, 9)]
    # " Second" straddles a cut after its space: the whole token goes to the later step
    assert check_spans(ids, ["First step is long.\n\n ", "Second one here."], tok) == [(0, 5), (5, 9)]
    assert check_spans(ids, ["First step is long.\n\n Sec", "ond one here."], tok) == [(0, 5), (5, 9)]


def test_steps_that_do_not_match_the_ids_are_an_error(char_tokenizer):
    ids = char_tokenizer.encode("abc def", add_special_tokens=False)
    with pytest.raises(ValueError, match="do not join"):
        step_token_spans(ids, ["abc", "xyz"], char_tokenizer)
    assert step_token_spans(ids, [], char_tokenizer) == []


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 399), max_size=40), st.lists(st.integers(1, 30), max_size=6))
def test_random_ids_keep_the_span_properties(bpe_tokenizer, ids, cuts):
    """Any sampled id sequence (specials, characters split over tokens) and any cut of its text. With
    invalid UTF-8 (U+FFFD in the text) only the structure is checked: there a lone lead byte is kept out
    of the prefix on purpose (the next step's bytes could complete it)."""
    tok = bpe_tokenizer
    text = tok.decode(ids, skip_special_tokens=True)
    if not text:
        return
    bounds = sorted({min(c, len(text)) for c in cuts} - {len(text)})
    steps = [text[a:b] for a, b in zip([0] + bounds, bounds + [len(text)])]
    if "\ufffd" in text:
        spans = step_token_spans(ids, steps, tok)
        assert spans[0][0] == 0 and spans[-1][1] == len(ids)
        assert all(a <= b == c for (a, b), (c, _) in zip(spans, spans[1:]))
    else:
        check_spans(ids, steps, tok)


def test_spans_are_linear_time(bpe_tokenizer):
    import time

    text = "Let x = 3. Then 2x + 1 = 7, so naïve √2.\n\n" * 200
    ids = bpe_tokenizer.encode(text, add_special_tokens=False)
    t0 = time.perf_counter()
    spans = step_token_spans(ids, split_steps(text), bpe_tokenizer)
    assert time.perf_counter() - t0 < 1.0 and spans[-1][1] == len(ids)
