"""A tiny random checkpoint in the file layout of Qwen/Qwen2.5-Math-PRM-7B, and a plain-torch reference forward.

Used by tests/test_prm.py, tests/test_vllm.py and tests/test_gpu.py (so by .ci/gpu_check.sh). The layout is the
one vLLM 0.32 loads as `Qwen2ForProcessRewardModel` (vllm/model_executor/models/qwen2_rm.py):

- config.json: `architectures: ["Qwen2ForProcessRewardModel"]`, `model_type: "qwen2"`, an `auto_map` that points
  at remote-code files the folder does not have (the hub's config has one; nothing may follow it), and no
  `pad_token_id`;
- model.safetensors (or two shards and model.safetensors.index.json), bfloat16 as on the hub: the Qwen2 decoder
  under `model.*`, the score head `score.0.{weight,bias}` (hidden -> hidden), `score.2.{weight,bias}`
  (hidden -> 2), and an `lm_head.weight` that a PRM does not use.

`reference_step_probs` recomputes P(step correct) at given positions from the files with plain torch operations
(RMSNorm, rotary embedding, grouped-query causal attention, SwiGLU, the head, softmax): no transformers, no vLLM.
"""
import json
import math
import os

import torch

ARCH = "Qwen2ForProcessRewardModel"


def write_qwen2_prm(path, tokenizer, *, hidden=64, layers=1, heads=2, kv_heads=1, seed=0, drop=(), shards=1,
                    max_position_embeddings=1024) -> str:
    """Save a random PRM in the real layout (module docstring) with `tokenizer` to `path`; `drop`: weight names
    left out (a damaged checkpoint). Head size hidden // heads (vLLM's CPU attention wants 32, 64, 80, ...).
    The head's weights are scaled so that step probabilities spread over (0, 1). Returns `path`."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2Model

    os.makedirs(path, exist_ok=True)
    vocab = len(tokenizer)
    config = {"architectures": [ARCH],
              "auto_map": {"AutoConfig": "configuration_qwen2_rm.Qwen2RMConfig",
                           "AutoModel": "modeling_qwen2_rm.Qwen2ForProcessRewardModel"},
              "model_type": "qwen2", "hidden_act": "silu", "hidden_size": hidden, "intermediate_size": 2 * hidden,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "max_position_embeddings": max_position_embeddings, "max_window_layers": layers,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "sliding_window": max_position_embeddings,
              "use_sliding_window": False, "tie_word_embeddings": False, "attention_dropout": 0.0,
              "initializer_range": 0.2, "bos_token_id": tokenizer.pad_token_id,
              "eos_token_id": tokenizer.eos_token_id, "torch_dtype": "bfloat16", "use_cache": True,
              "vocab_size": vocab}
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    torch.manual_seed(seed)
    body = {k: v for k, v in config.items() if k not in ("architectures", "auto_map", "torch_dtype")}
    decoder = Qwen2Model(Qwen2Config(**body))
    tensors = {f"model.{k}": v for k, v in decoder.state_dict().items()}
    tensors["score.0.weight"] = torch.randn(hidden, hidden) / math.sqrt(hidden)
    tensors["score.0.bias"] = torch.randn(hidden) * 0.1
    tensors["score.2.weight"] = torch.randn(2, hidden) * (2 / math.sqrt(hidden))
    tensors["score.2.bias"] = torch.tensor([0.1, -0.1])
    tensors["lm_head.weight"] = torch.randn(vocab, hidden) * 0.02
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items() if k not in drop}
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i in range(shards):
            shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: tensors[k] for k in names[i::shards]}
            save_file(part, os.path.join(path, shard), metadata={"format": "pt"})
            weight_map.update({k: shard for k in part})
        with open(os.path.join(path, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    tokenizer.save_pretrained(path)
    return path


def _load_all(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    out = {}
    for name in files:
        out.update({k: v.float() for k, v in load_file(os.path.join(path, name)).items()})
    return out


def reference_step_probs(path, ids: list[int], positions: list[int]) -> list[float]:
    """P(class 1) = softmax(score(h_t))[1] at `positions` of one unpadded input, in float32 from the files."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    w = _load_all(path)
    h, n_heads, n_kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, eps, t = h // n_heads, cfg["rms_norm_eps"], len(ids)

    def rms(x, weight):  # RMSNorm
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    inv_freq = 1.0 / cfg["rope_theta"] ** (torch.arange(0, d, 2).float() / d)  # (d/2,)
    angles = torch.outer(torch.arange(t).float(), inv_freq)  # (T, d/2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # (T, d)

    def rope(x):  # x (heads, T, d); rotate-half rotary embedding
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    x = w["model.embed_tokens.weight"][torch.tensor(ids)]  # (T, h)
    causal = torch.full((t, t), float("-inf")).triu(1)  # (T, T)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = rms(x, w[p + "input_layernorm.weight"])
        q = (a @ w[p + "self_attn.q_proj.weight"].T + w[p + "self_attn.q_proj.bias"]).view(t, n_heads, d)
        k = (a @ w[p + "self_attn.k_proj.weight"].T + w[p + "self_attn.k_proj.bias"]).view(t, n_kv, d)
        v = (a @ w[p + "self_attn.v_proj.weight"].T + w[p + "self_attn.v_proj.bias"]).view(t, n_kv, d)
        q, k, v = rope(q.transpose(0, 1)), rope(k.transpose(0, 1)), v.transpose(0, 1)  # (heads, T, d)
        k, v = k.repeat_interleave(n_heads // n_kv, 0), v.repeat_interleave(n_heads // n_kv, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(d) + causal, -1)  # (heads, T, T)
        x = x + (att @ v).transpose(0, 1).reshape(t, h) @ w[p + "self_attn.o_proj.weight"].T
        m = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    x = rms(x, w["model.norm.weight"])  # (T, h)
    hidden = torch.relu(x @ w["score.0.weight"].T + w["score.0.bias"])  # (T, h)
    logits = hidden @ w["score.2.weight"].T + w["score.2.bias"]  # (T, 2)
    return torch.softmax(logits, -1)[positions, 1].tolist()
