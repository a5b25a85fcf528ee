"""The exported model folder (harness/run/export.py) as vLLM 0.33 reads it: its config, tokenizer and generation
config through 0.33's own loading code (what `vllm serve FOLDER` runs before it builds an engine); no engine.

Run with the vLLM 0.33 contract environment (bash .ci/vllm33_contract.sh builds it):
    VLLM33_CONTRACT=1 .venv-vllm33/bin/python -m pytest -m vllm33 tests/test_vllm33_export.py
Without vLLM 0.33 these tests skip with the reason; with VLLM33_CONTRACT=1 that skip is a failure instead.
"""
import os

import pytest
from test_vllm33_contract import _need_vllm33

from harness.data import toy
from harness.run import export
from harness.data.prompt import format_prompt
from harness.engines.generate import load_causal_lm

pytestmark = pytest.mark.vllm33
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = "Question: Start at 7, add 5, times 3.\nSolution:\nSo 7 + 5 = 12.\n\nSo 12 * 3 = 36.\n\n\\boxed{36}"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(the toy warm start as a checkpoint holds it, the same model exported)."""
    _need_vllm33()
    checkpoint = toy.cache_path(os.path.join(ROOT, "cache"), seed=0)
    model, tokenizer = load_causal_lm(checkpoint, "cpu")
    out = export.export_model(model, tokenizer, str(tmp_path_factory.mktemp("vllm33") / "model"),
                              {"toy": True, "mode": "scope", "eval_max_new_tokens": 128}, [])
    return checkpoint, out, tokenizer


def test_vllm33_reads_the_config_and_generation_config(folders):
    _need_vllm33()
    from vllm.config import ModelConfig
    from vllm.transformers_utils.config import get_config

    _, out, _ = folders
    config = get_config(out, trust_remote_code=False)
    assert config.model_type == "qwen2" and config.architectures == ["Qwen2ForCausalLM"]
    model_config = ModelConfig(model=out, dtype="bfloat16")   # what `vllm serve` builds from the folder
    assert model_config.architectures == ["Qwen2ForCausalLM"] and model_config.max_model_len == 256
    assert model_config.get_diff_sampling_param() == {"temperature": 0.6, "top_p": 1.0, "max_tokens": 128}


def test_vllm33_tokenizer_round_trips_the_exported_toy_tokenizer(folders):
    _need_vllm33()
    from vllm.tokenizers.registry import get_tokenizer

    checkpoint, out, trained = folders
    served = get_tokenizer(out)
    ids = served.encode(TEXT, add_special_tokens=False)
    assert ids == trained.encode(TEXT, add_special_tokens=False) and served.decode(ids) == TEXT
    assert served.eos_token_id == trained.eos_token_id
    messages = [{"role": "user", "content": "Start at 7, add 5."}]   # what the chat endpoint renders
    rendered = served.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert served.encode(rendered, add_special_tokens=False) == format_prompt(trained, "Start at 7, add 5.", None)
    # the checkpoint folder itself is misread by vLLM as by AutoTokenizer (Qwen2Tokenizer drops " " and "\n"):
    # why model/ exists
    raw = get_tokenizer(checkpoint)
    assert raw.decode(raw.encode(TEXT, add_special_tokens=False)) != TEXT
