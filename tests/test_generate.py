"""Tests for generate.py sections 1, 2 and 4: prompts, Completion, HFGenerator, OpenAIGenerator (CPU, tiny models)."""
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from conftest import make_bpe_tokenizer, make_char_tokenizer, make_tiny_causal_lm

from harness.data.prompt import DEFAULT_SYSTEM, format_prompt
from harness.engines.generate import Completion, HFGenerator, OpenAIGenerator, to_completion, token_budget

QUESTIONS = ["Let x = 3. What is 2x + 1?", "Compute 12 * 4 - 5.", "What is \\frac{1}{2} + \\frac{1}{3}?"]


# ---------- section 1: prompts and the Completion record ----------

def test_format_prompt_chat_template(bpe_tokenizer):
    ids = format_prompt(bpe_tokenizer, "What is 2+2?")
    assert bpe_tokenizer.decode(ids) == (f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"
                                         "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    no_system = format_prompt(bpe_tokenizer, "What is 2+2?", system=None)
    assert bpe_tokenizer.decode(no_system) == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert bpe_tokenizer.convert_tokens_to_ids("<|im_start|>") == ids[0]  # specials are single tokens


def test_format_prompt_plain_without_chat_template():
    tok = make_char_tokenizer()
    tok.chat_template = None
    ids = format_prompt(tok, "What is 2+2?")
    assert tok.decode(ids) == "Question: What is 2+2?\nSolution:\n"
    assert len(ids) == len("Question: What is 2+2?\nSolution:\n")  # one id per character, no BOS added


def test_to_completion_cuts_after_first_eos_and_drops_padding(bpe_tokenizer):
    eos, pad = 0, 2
    a, b = bpe_tokenizer.encode("Let x")[:2]
    done = to_completion([a, b, eos, pad, pad], bpe_tokenizer, {eos}, max_tokens=10)
    assert done == Completion(ids=[a, b, eos], text=bpe_tokenizer.decode([a, b]), finished=True)
    cut = to_completion([a, b, a, eos], bpe_tokenizer, {eos}, max_tokens=2)  # EOS beyond the budget
    assert cut.ids == [a, b] and not cut.finished


def test_token_budget_clamps_to_context_and_names_the_prompt():
    assert token_budget(0, [1] * 10, 50, context=40) == 30
    assert token_budget(0, [1] * 10, 5, context=40) == 5
    assert token_budget(0, [1] * 10, 5, context=None) == 5
    with pytest.raises(ValueError, match="prompt 3 has 40 tokens"):
        token_budget(3, [1] * 40, 5, context=40)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        token_budget(1, [], 5, context=40)


# ---------- section 2: HFGenerator ----------

@pytest.fixture
def lm(bpe_tokenizer, tiny_causal_lm):
    """A tiny random model with larger weights (std 0.3): at the default init (0.02) greedy decoding repeats one
    token whatever the context, so a padding bug would go unseen."""
    model = tiny_causal_lm(bpe_tokenizer)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return model


def greedy_by_hand(model, prompt, steps):
    """Reference: argmax decoding with full forward passes, no cache, no padding."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits  # (1, T, V)
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_hf_shapes_n_and_max_tokens(bpe_tokenizer, lm):
    prompts = [format_prompt(bpe_tokenizer, q) for q in QUESTIONS]
    out = HFGenerator(lm, bpe_tokenizer, micro_batch_size=4).generate(prompts, n=3, temperature=1.0,
                                                                       max_tokens=7, seed=0)
    assert len(out) == 3 and all(len(row) == 3 for row in out)
    for row in out:
        for c in row:
            assert len(c.ids) <= 7 and (c.finished or len(c.ids) == 7)
            assert c.text == bpe_tokenizer.decode(c.ids, skip_special_tokens=True)


def test_hf_returns_new_tokens_only_and_matches_plain_greedy(bpe_tokenizer, lm):
    prompt = format_prompt(bpe_tokenizer, QUESTIONS[0])
    [[c]] = HFGenerator(lm, bpe_tokenizer).generate([prompt], n=1, temperature=0, max_tokens=6)
    assert c.ids == greedy_by_hand(lm, prompt, 6)[:len(c.ids)]


def test_hf_left_padding_gives_the_unbatched_greedy_output(bpe_tokenizer, lm):
    """Guards left-padding bugs (missing attention mask / wrong positions): greedy ids must not depend on
    which other prompts share the batch."""
    prompts = [format_prompt(bpe_tokenizer, q) for q in QUESTIONS] + [bpe_tokenizer.encode("x")]
    assert len({len(p) for p in prompts}) == 4  # four different lengths -> real padding
    gen = HFGenerator(lm, bpe_tokenizer, micro_batch_size=8)
    batched = gen.generate(prompts, n=2, temperature=0, max_tokens=12)
    for p, row in zip(prompts, batched):
        [[alone]] = gen.generate([p], n=1, temperature=0, max_tokens=12)
        assert row[0].ids == alone.ids and row[1].ids == alone.ids
    assert len({tuple(row[0].ids) for row in batched}) == 4 and len(set(batched[0][0].ids)) > 3  # not degenerate


def test_hf_seed_reproduces_and_leaves_global_rng_alone(bpe_tokenizer, lm):
    prompts = [format_prompt(bpe_tokenizer, q) for q in QUESTIONS[:2]]
    gen = HFGenerator(lm, bpe_tokenizer, micro_batch_size=3)
    torch.manual_seed(123)
    a = gen.generate(prompts, n=3, temperature=1.0, max_tokens=10, seed=7)
    after = torch.rand(1)
    torch.manual_seed(123)
    expected_after = torch.rand(1)
    b = gen.generate(prompts, n=3, temperature=1.0, max_tokens=10, seed=7)
    c = gen.generate(prompts, n=3, temperature=1.0, max_tokens=10, seed=8)
    assert a == b and a != c
    assert torch.equal(after, expected_after)  # the caller's random stream did not move
    assert len({tuple(x.ids) for x in a[0]}) > 1  # the n samples of one prompt differ


def test_hf_stops_at_eos_keeps_it_and_strips_padding(tiny_causal_lm):
    """With pad != eos, rows that stop early are padded by HF; none of that may leak into `ids`."""
    tok = make_bpe_tokenizer()
    tok.pad_token = "<|im_start|>"
    model = tiny_causal_lm(tok)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    boost = torch.zeros(model.config.vocab_size)  # the embedding's rows, more than the tokenizer's ids
    boost[eos] = 3.0  # about 5 % per token: makes EOS likely enough to stop some samples early
    handle = model.lm_head.register_forward_hook(lambda module, inputs, logits: logits + boost)
    try:
        out = HFGenerator(model, tok, micro_batch_size=8).generate(
            [format_prompt(tok, q) for q in QUESTIONS], n=4, temperature=1.0, max_tokens=12, seed=0)
    finally:
        handle.remove()
    flat = [c for row in out for c in row]
    assert any(c.finished for c in flat) and any(not c.finished for c in flat)
    for c in flat:
        assert pad not in c.ids
        assert c.finished == (len(c.ids) > 0 and c.ids[-1] == eos)
        assert eos not in c.ids[:-1]
        assert len(c.ids) <= 12 and (c.finished or len(c.ids) == 12)


def stopping_qwen2(tok, seed=0):
    """A tiny Qwen2 with one embedding row per tokenizer id (so no ids are suppressed and HFGenerator decodes with
    `lean_decode`), weights large enough (std 0.3) that the context matters, and EOS boosted (+3 on its logit) so
    that rows stop at different steps."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                         tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                                         pad_token_id=tok.pad_token_id, bos_token_id=None)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    boost = torch.zeros(len(tok))
    boost[tok.eos_token_id] = 3.0
    model.lm_head.register_forward_hook(lambda module, inputs, logits: logits + boost)
    return model


@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0])
def test_lean_decode_gives_hf_generates_samples(bpe_tokenizer, temperature):
    """The toy's decode loop (lean_decode) against the library's `model.generate` it replaces: the same tokens for
    the same seed, with left padding, rows that stop early, several generate calls sharing one random stream
    (micro-batches of 5 rows), sampling at T = 1 and 0.6 and greedy."""
    model = stopping_qwen2(bpe_tokenizer)
    prompts = [format_prompt(bpe_tokenizer, q) for q in QUESTIONS] + [bpe_tokenizer.encode("x")]
    for micro_batch in (5, 64):
        gen = HFGenerator(model, bpe_tokenizer, micro_batch_size=micro_batch)
        assert gen.lean
        lean = gen.generate(prompts, n=4, temperature=temperature, max_tokens=24, seed=3)
        gen.lean = False
        library = gen.generate(prompts, n=4, temperature=temperature, max_tokens=24, seed=3)
        assert lean == library
    flat = [c for row in lean for c in row]
    assert any(c.finished for c in flat) and any(not c.finished for c in flat) or not temperature
    assert len({tuple(c.ids) for c in flat}) > 3


def test_lean_decode_samples_generates_ids(bpe_tokenizer):
    """lean_decode's ids are HF generate's for the same torch RNG state, padding of finished rows included, at a
    temperature where sampling is real (generate's own log-probs of them are not all near 0)."""
    from transformers import GenerationConfig

    from harness.engines.generate import lean_decode

    model = stopping_qwen2(bpe_tokenizer, seed=2)
    prompts = [format_prompt(bpe_tokenizer, q) for q in QUESTIONS]
    width, pad = max(map(len, prompts)), bpe_tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # (3, width), left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(max_new_tokens=20, eos_token_id=[bpe_tokenizer.eos_token_id], pad_token_id=pad,
                              do_sample=True, temperature=0.6, top_p=1.0, top_k=0, output_logits=True,
                              return_dict_in_generate=True)
    torch.manual_seed(11)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    torch.manual_seed(11)
    lean_ids = lean_decode(model, ids, mask, 20, 0.6, {bpe_tokenizer.eos_token_id}, pad)
    sampled = out.sequences[:, width:]  # (3, steps)
    assert lean_ids == sampled.tolist()
    logp = torch.log_softmax(torch.stack(out.logits, dim=1) / 0.6, dim=-1).gather(2, sampled[..., None])[..., 0]
    assert (logp < -0.01).any()   # real sampling, not a saturated distribution


def test_hf_generate_keeps_the_library_call_where_lean_decode_is_unchecked(bpe_tokenizer, tiny_causal_lm):
    """Embedding rows beyond the tokenizer (suppressed ids) and top-p are generate's own: lean_decode is used only
    where a test holds it to generate."""
    model = tiny_causal_lm(bpe_tokenizer)
    assert model.config.vocab_size > len(bpe_tokenizer) and not HFGenerator(model, bpe_tokenizer).lean
    gen = HFGenerator(stopping_qwen2(bpe_tokenizer), bpe_tokenizer)
    calls = []
    gen.model.generate = lambda **kw: calls.append(kw) or torch.zeros((1, 30), dtype=torch.long)
    gen.generate([[5, 6, 7]], n=1, temperature=1.0, top_p=0.9, max_tokens=4, seed=0)
    gen.generate([[5, 6, 7]], n=1, temperature=1.0, max_tokens=4, seed=0)
    assert len(calls) == 1 and calls[0]["generation_config"].top_p == 0.9


def test_hf_restores_train_mode_and_clamps_to_context(bpe_tokenizer, tiny_causal_lm):
    model = tiny_causal_lm(bpe_tokenizer)
    model.config.max_position_embeddings = 40
    gen = HFGenerator(model, bpe_tokenizer)
    model.train()
    [[c]] = gen.generate([[5] * 35], n=1, temperature=0, max_tokens=20)
    assert model.training  # restored
    assert len(c.ids) <= 5
    model.eval()
    with pytest.raises(ValueError, match="prompt 1 has 40 tokens"):
        gen.generate([[5] * 3, [5] * 40], max_tokens=4)
    assert gen.generate([[5] * 3], n=2, max_tokens=0) == [[Completion([], "", False)] * 2]


# ---------- section 4: OpenAIGenerator against a local fake server ----------

class FakeServer:
    """A canned /v1/completions server on 127.0.0.1 (records every request; stops at fixture teardown)."""

    def __init__(self, context=None):
        self.requests = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, code, payload):
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                outer.requests.append(("GET", self.path, None))
                entry = {"id": "tiny-refiner"} | ({"max_model_len": context} if context else {})
                self.reply(200, {"object": "list", "data": [entry]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(("POST", self.path, body))
                if body["model"] != "tiny-refiner":
                    return self.reply(400, {"error": {"message": f"model {body['model']} does not exist"}})
                choices = [{"index": i * body["n"] + s, "text": f" p{i}s{s} so \\boxed{{7}}",
                            "finish_reason": "stop" if s == 0 else "length"}
                           for i in range(len(body["prompt"])) for s in range(body["n"])]
                self.reply(200, {"object": "text_completion", "choices": choices[::-1]})  # any order

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.timeout = 5
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def fake_server():
    servers = []

    def start(context=None):
        servers.append(FakeServer(context))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def test_openai_request_body_and_completions(bpe_tokenizer, fake_server):
    server = fake_server()
    prompts = [format_prompt(bpe_tokenizer, q) for q in QUESTIONS[:2]]
    gen = OpenAIGenerator(server.url + "/v1/", "tiny-refiner", bpe_tokenizer, timeout=10)
    out = gen.generate(prompts, n=2, temperature=0.7, top_p=0.9, max_tokens=33, seed=5)
    posts = sorted((r for r in server.requests if r[0] == "POST"), key=lambda r: r[2]["seed"])
    assert len(posts) == 2  # seeded: one request per prompt, prompt i seeded 5 + i·n (the server seeds a request)
    end = bpe_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for i, (_, path, body) in enumerate(posts):
        assert path == "/v1/completions"
        # the plain distribution (a vllm serve would fill top_k, min_p, repetition_penalty from the checkpoint's
        # generation_config) and both stops of a ChatML prompt: <|endoftext|> (0) and <|im_end|> (2)
        assert body == {"model": "tiny-refiner", "prompt": [prompts[i]], "n": 2, "temperature": 0.7, "top_p": 0.9,
                        "max_tokens": 33, "seed": 5 + 2 * i, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                        "stop_token_ids": sorted({bpe_tokenizer.eos_token_id, end})}
        assert body["stop_token_ids"] == [0, 2]
    for i in range(2):
        for s in range(2):
            c = out[i][s]
            assert c.text == f" p0s{s} so \\boxed{{7}}"   # each request's one prompt is its p0
            tail = [end] if s == 0 else []  # a stopped completion ends with the turn end id
            assert c.ids == bpe_tokenizer.encode(c.text, add_special_tokens=False) + tail
            assert c.finished == (s == 0)


def test_openai_clamps_max_tokens_to_the_served_context(bpe_tokenizer, fake_server):
    server = fake_server(context=40)
    gen = OpenAIGenerator(server.url, "tiny-refiner", bpe_tokenizer, timeout=10)
    out = gen.generate([[5] * 10, [6] * 30, [7] * 12], n=1, temperature=0, max_tokens=25)
    posts = sorted((r[2] for r in server.requests if r[0] == "POST"), key=lambda b: b["max_tokens"])
    assert [(b["max_tokens"], b["prompt"]) for b in posts] == [(10, [[6] * 30]), (25, [[5] * 10, [7] * 12])]
    assert [row[0].text for row in out] == [" p0s0 so \\boxed{7}", " p0s0 so \\boxed{7}", " p1s0 so \\boxed{7}"]
    assert "seed" not in posts[0]


def test_openai_http_error_names_the_url(bpe_tokenizer, fake_server):
    server = fake_server()
    gen = OpenAIGenerator(server.url, "no-such-model", bpe_tokenizer, timeout=10, max_model_len=100)
    with pytest.raises(RuntimeError, match=r"127\.0\.0\.1:\d+/v1/completions answered HTTP 400.*does not exist"):
        gen.generate([[5, 6]], max_tokens=4)


def test_openai_connection_refused_names_the_url(bpe_tokenizer):
    with socket.socket() as s:  # a port that was free a moment ago, now closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gen = OpenAIGenerator(f"http://127.0.0.1:{port}", "m", bpe_tokenizer, timeout=5)
    with pytest.raises(RuntimeError, match=f"cannot reach the completions endpoint http://127.0.0.1:{port}"):
        gen.generate([[5, 6]], max_tokens=4)


def test_hf_never_samples_ids_beyond_the_tokenizer(bpe_tokenizer):
    """Guards Qwen2.5's padded embedding (151936 rows, ~151665 tokenizer ids): an id the tokenizer cannot
    decode must never be sampled, even when the model favours it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    extra = 8
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(bpe_tokenizer) + extra, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                         eos_token_id=bpe_tokenizer.eos_token_id, bos_token_id=None)).eval()
    boost = torch.zeros(len(bpe_tokenizer) + extra)
    boost[len(bpe_tokenizer):] = 4.0
    model.lm_head.register_forward_hook(lambda module, inputs, logits: logits + boost)
    out = HFGenerator(model, bpe_tokenizer).generate([[5, 6, 7]], n=4, temperature=1.0, max_tokens=10, seed=0)
    assert all(t < len(bpe_tokenizer) for c in out[0] for t in c.ids)


def test_autocast_only_around_hf_generate(monkeypatch):
    """Regression: vLLM calls ran inside CUDA autocast. Run.amp_for gives autocast for an HF generator of this
    process on CUDA, and nothing for any other generator (vLLM, a served model, none)."""
    import contextlib
    from types import SimpleNamespace

    from harness.run import wiring

    entered = []
    fake_run = SimpleNamespace(device="cuda:0", amp=lambda: entered.append("amp") or contextlib.nullcontext())
    hf = HFGenerator.__new__(HFGenerator)
    with wiring.Run.amp_for(fake_run, hf):
        pass
    assert entered == ["amp"]
    for other in (object(), None, OpenAIGenerator("http://127.0.0.1:9", "m", make_bpe_tokenizer())):
        assert isinstance(wiring.Run.amp_for(fake_run, other), contextlib.nullcontext)
    assert entered == ["amp"]


# ---- the in-process vLLM backend's requests and engine calls, against a recording stand-in of vllm
# (the real vLLM 0.33 code checks the same calls in tests/test_vllm33_contract.py)


class RecordingLLM:
    """Stands in for vllm.LLM: records every engine call (name, args, kwargs) and answers like vLLM would."""

    vocab_rows = 151936  # Qwen2.5's embedding rows

    def __init__(self, **kwargs):
        from types import SimpleNamespace

        self.kwargs, self.calls = kwargs, []
        self.model_config = SimpleNamespace(max_model_len=kwargs.get("max_model_len") or 4096, dtype=torch.float32,
                                            get_vocab_size=lambda: self.vocab_rows)

    def _record(self, name, *args, **kwargs):
        self.calls.append((name, args, kwargs))

    def generate(self, prompts, sampling_params=None, **kwargs):
        from types import SimpleNamespace

        self._record("generate", prompts, sampling_params, **kwargs)
        return [SimpleNamespace(outputs=[SimpleNamespace(index=k, token_ids=[7], logprobs=None)
                                         for k in range(params.n)]) for params in sampling_params]

    def sleep(self, level=1, mode="abort"):
        self._record("sleep", level=level)

    def wake_up(self, tags=None):
        self._record("wake_up", tags=tags)
        return True

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if kwargs and "weights_iterator" in kwargs:
            kwargs = {**kwargs, "weights_iterator": [name for name, _ in kwargs["weights_iterator"]]}
        self._record("collective_rpc", method, kwargs=kwargs)
        return [None]

    def apply_model(self, func):
        self._record("apply_model")
        return [None]

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self._record("reset_prefix_cache")
        return True


@pytest.fixture
def fake_vllm(monkeypatch):
    """A `vllm` module whose LLM is RecordingLLM and whose SamplingParams / TokensPrompt keep their keywords; the
    platform is CUDA-like (sleep mode on). Yields the list of LLMs built."""
    built = []

    def make_llm(**kwargs):
        built.append(RecordingLLM(**kwargs))
        return built[-1]

    install_vllm_double(monkeypatch, make_llm)
    yield built


def install_vllm_double(monkeypatch, make_llm):
    """`vllm` (LLM = make_llm, SamplingParams / TokensPrompt keeping their keywords) and a CUDA-like
    `vllm.platforms` in sys.modules for this test, in-process engine core."""
    import sys
    from types import ModuleType, SimpleNamespace

    vllm = ModuleType("vllm")
    vllm.LLM = make_llm
    vllm.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    vllm.TokensPrompt = lambda **kw: dict(kw)
    platforms = ModuleType("vllm.platforms")
    platforms.current_platform = SimpleNamespace(is_cpu=lambda: False)
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def test_vllm_request_bans_the_surplus_rows_within_v2s_cap(qwen_tokenizer, fake_vllm, tmp_path):
    """Guards V2's cap: allowed_token_ids listing all 151,665 tokenizer ids would be refused by vLLM 0.33's
    Model Runner V2 (at most 1,024 per request), on every rollout. The 271 surplus rows of Qwen2.5's
    151,936-row embedding are banned through logit_bias (V2's cap for it is also 1,024)."""
    from harness.engines.generate import BANNED, VLLMGenerator

    gen = VLLMGenerator(str(tmp_path), tokenizer=qwen_tokenizer, sleep_mode=True)
    gen.generate([[1, 2, 3], [4, 5]], n=2, temperature=1.0, max_tokens=8, seed=0)
    (_, (prompts, params), kwargs), = fake_vllm[0].calls
    assert kwargs == {"use_tqdm": False} and len(prompts) == len(params) == 2
    for p in params:
        assert getattr(p, "allowed_token_ids", None) is None
        assert sorted(p.logit_bias) == list(range(151665, 151936)) and len(p.logit_bias) == 271 <= 1024
        assert set(p.logit_bias.values()) == {BANNED} and BANNED == -100.0


def test_surplus_ban_refuses_a_ban_list_past_v2s_cap():
    from harness.engines.generate import surplus_ban

    assert surplus_ban(100, 100) is None
    assert surplus_ban(100, 102) == {100: -100.0, 101: -100.0}
    with pytest.raises(ValueError, match="2000 surplus ids exceeds vLLM's 1024"):
        surplus_ban(100, 2100)


def test_vllm_sleep_follows_trls_order(bpe_tokenizer, tiny_causal_lm, fake_vllm, monkeypatch, tmp_path):
    """sleep(level=1) would copy the weights to host memory every step only for the push to overwrite them.
    The order is sleep(level=2) -> wake the weights -> push -> reset the prefix cache -> wake the KV cache
    at the next generate (TRL's GRPOTrainer, colocate mode)."""
    monkeypatch.setattr(RecordingLLM, "vocab_rows", len(bpe_tokenizer) + 8)  # more rows than ids
    from harness.engines.generate import VLLMGenerator

    gen = VLLMGenerator(str(tmp_path), tokenizer=bpe_tokenizer, sleep_mode=True)
    llm = fake_vllm[0]
    assert llm.kwargs["enable_sleep_mode"] is True
    gen.generate([[1, 2]], max_tokens=4)
    gen.sleep()
    gen.sleep()  # a second sleep is a no-op
    model = tiny_causal_lm(bpe_tokenizer)
    gen.sync_weights(model)
    gen.generate([[1, 2]], max_tokens=4)
    names = [(name, kw.get("level", kw.get("tags"))) if name in ("sleep", "wake_up") else name
             for name, _, kw in llm.calls]
    assert names == ["generate", ("sleep", 2), ("wake_up", ["weights"]), "collective_rpc", "apply_model",
                     "reset_prefix_cache", ("wake_up", ["kv_cache"]), "generate"]
    pushed = llm.calls[3][2]["kwargs"]["weights_iterator"]
    assert "model.embed_tokens.weight" in pushed and "lm_head.weight" not in pushed  # tied: pushed once


def test_vllm_generate_after_sleep_without_a_push_is_an_error(bpe_tokenizer, fake_vllm, monkeypatch, tmp_path):
    """Level 2 leaves the engine's weights undefined: generating before sync_weights must fail loudly."""
    monkeypatch.setattr(RecordingLLM, "vocab_rows", len(bpe_tokenizer) + 8)  # more rows than ids
    from harness.engines.generate import VLLMGenerator

    gen = VLLMGenerator(str(tmp_path), tokenizer=bpe_tokenizer, sleep_mode=True)
    gen.sleep()
    with pytest.raises(RuntimeError, match="call sync_weights"):
        gen.generate([[1, 2]], max_tokens=4)
    assert [name for name, _, _ in fake_vllm[0].calls] == ["sleep"]


def test_rollout_engines_under_torchrun_are_independent(fake_vllm, bpe_tokenizer, monkeypatch, tmp_path):
    """Engines built with data_parallel_size = world would make vLLM's engine loop all-reduce across every rank
    at each step (LLMEngine.has_unfinished_requests over the DP group), so a rank with nothing to refine
    (`--refiner policy`) that skipped llm.generate would hang the others. Each rank's engine is its own
    (external_launcher, no data_parallel_size: TRL's and verl's layout)."""
    monkeypatch.setattr(RecordingLLM, "vocab_rows", len(bpe_tokenizer) + 8)  # more rows than ids
    import scope
    from harness.run import wiring

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = scope.parse_args(["--model", "m", "--refiner", "policy", "--backend", "vllm"])
    model = make_tiny_causal_lm(bpe_tokenizer)
    wiring.make_rollout_engine(args, model, bpe_tokenizer, str(tmp_path), use_vllm=True, world=8)
    kwargs = fake_vllm[0].kwargs
    assert kwargs["distributed_executor_backend"] == "external_launcher"
    assert kwargs.get("data_parallel_size", 1) == 1 and kwargs.get("tensor_parallel_size", 1) == 1
