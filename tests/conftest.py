"""Shared test fixtures: tokenizers and tiny Qwen2 models built in code (nothing is downloaded).

- `bpe_tokenizer`: a byte-level BPE (the Qwen2.5 scheme) trained in code on a small maths corpus,
  with `<|endoftext|>` as EOS/pad, `<extra_0>` (the Qwen PRM step separator) and a small chat template.
- `char_tokenizer`: one token per character (the toy world's scheme), same special tokens.
- `tiny_causal_lm(tokenizer)`: a random `Qwen2ForCausalLM` of ~100k parameters.
- `tiny_prm_dir`: a random `Qwen2ForTokenClassification` (num_labels=2) + BPE tokenizer saved to disk,
  loadable by `prm.ProcessRewardModel`.
"""
import os
import string

import pytest
import torch

torch.set_num_threads(1)  # 2-core machine; several test processes may run at once
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<extra_0>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "Let x = 3. Then 2x + 1 = 7, so the answer is \\boxed{7}.",
    "First, compute 12 * 4 = 48.\n\nNext, 48 - 5 = 43.\n\nThe answer is \\boxed{43}.",
    "We have \\frac{1}{2} + \\frac{1}{3} = \\frac{5}{6}. Therefore \\boxed{\\frac{5}{6}}.",
    "Step 1: the area is \\pi r^2 = 9\\pi.\n\nStep 2: so \\boxed{9\\pi}. Naïve café — ünïcode ∑ √2",
] * 20


def _wrap(tok_obj):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=tok_obj, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>", "<extra_0>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_bpe_tokenizer(vocab_size=400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return _wrap(tok)


def make_char_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = sorted(set(string.printable) | set("ïéü—∑√"))
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    vocab["[UNK]"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    return _wrap(tok)


def make_tiny_causal_lm(tokenizer, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=True,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      bos_token_id=None)
    return Qwen2ForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def bpe_tokenizer():
    return make_bpe_tokenizer()


@pytest.fixture(scope="session")
def char_tokenizer():
    return make_char_tokenizer()


@pytest.fixture
def tiny_causal_lm():
    return make_tiny_causal_lm


@pytest.fixture(scope="session")
def tiny_prm_dir(tmp_path_factory, bpe_tokenizer):
    from transformers import Qwen2Config, Qwen2ForTokenClassification

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(bpe_tokenizer), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, num_labels=2,
                      pad_token_id=bpe_tokenizer.pad_token_id)
    path = tmp_path_factory.mktemp("tiny_prm")
    Qwen2ForTokenClassification(cfg).save_pretrained(path)
    bpe_tokenizer.save_pretrained(path)
    return str(path)
