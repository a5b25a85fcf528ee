"""prm_checkpoint.py — loading a process reward model's checkpoint for prm.py (through prm_engine.py), without remote code.

`load_prm(name_or_path, device, dtype, prm_format=...)` returns (model, tokenizer, config, family): the PRM family
(harness/engines/prm_families.py) is chosen from config.json's `architectures` and the tokenizer before any weight
loads, and the head it reads decides how the weights load:
- "prm", `Qwen2ForProcessRewardModel` (Qwen2.5-Math-PRM-7B/-72B): `load_qwen2_prm`, our own module
  (`Qwen2ProcessRewardModel`: transformers' Qwen2Model + the 2-layer score head, the layout vLLM 0.32 loads as
  `Qwen2ForProcessRewardModel`) from the safetensors files; a hub id is fetched, or read from the cache. Its keys
  are checked from the file headers first (`check_qwen2_prm_checkpoint`, also run by the pre-flight).
- any other head: the family's transformers Auto class (`*ForTokenClassification` with the family's 2 labels, a
  `*ForCausalLM`), refused when a weight is missing from the files.
Why the PRM runs in the trainer's process and not through the hub's remote code: harness/engines/prm_engine.py.
"""
import json
import os

import torch

from harness.engines import prm_families

PRM_ARCHITECTURE = "Qwen2ForProcessRewardModel"  # config.json `architectures` of Qwen2.5-Math-PRM-7B / -72B


def load_prm(name_or_path: str, device="cpu", dtype=None, served=None,
             prm_format: str = "auto") -> tuple[torch.nn.Module, object, object, prm_families.Family]:
    """(model in eval mode on `device`, tokenizer, config, family) of a PRM checkpoint: a folder or a hub id, read
    as `prm_format` ("auto": prm_families.choose decides). A missing folder, file or network becomes one
    RuntimeError naming the PRM; an unsupported or damaged checkpoint a ValueError. With `served`
    (harness/engines/served_prm.PooledStepScores: the PRM on vLLM's pooling runner) no weight is loaded here: the
    model is `served`, the tokenizer and config are the checkpoint's."""
    import transformers
    from transformers import AutoConfig

    from harness.engines.generate import load_tokenizer

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    name = str(name_or_path)
    try:
        archs = _config_json(name).get("architectures") or []
        tokenizer = load_tokenizer(name)
        family = prm_families.choose(name, archs, tokenizer, prm_format)
        head = family.head(archs)
        if served is not None:
            if head not in family.served:
                raise ValueError(f"PRM {name!r}: vLLM's pooling runner serves {PRM_ARCHITECTURE}; config.json "
                                 f"names {archs}")
            return served, tokenizer, AutoConfig.from_pretrained(name), family
        if head == "prm":
            folder = name
            if not os.path.isdir(folder):
                from huggingface_hub import snapshot_download

                folder = snapshot_download(name, allow_patterns=["*.json", "*.safetensors"])
            model, config = load_qwen2_prm(folder, device, dtype)
        else:
            config = AutoConfig.from_pretrained(name)
            if family.labels and config.num_labels != family.labels:
                raise ValueError(f"PRM {name!r}: a token classifier with {config.num_labels} labels; "
                                 f"a PRM has {family.labels} (incorrect, correct)")
            model, info = getattr(transformers, family.auto_class).from_pretrained(name, dtype=dtype,
                                                                                   output_loading_info=True)
            model.config.use_cache = False  # one forward pass per input: no KV cache
            if info["missing_keys"]:
                raise ValueError(f"PRM {name!r}: weights missing from the checkpoint (they would be "
                                 f"random): {', '.join(sorted(info['missing_keys'])[:6])}")
    except (OSError, ImportError) as e:
        where = "local folder" if os.path.isdir(name) else "no such folder; tried as a Hugging Face id"
        raise RuntimeError(
            f"could not load the PRM {name!r} ({where}): {type(e).__name__}: {e}. Without network "
            "the weights must already be in the Hugging Face cache or a local folder.") from e
    return model.to(device).eval(), tokenizer, config, family


class Qwen2ProcessRewardModel(torch.nn.Module):
    """Qwen2.5-Math-PRM as plain modules: transformers' `Qwen2Model` (the `model.*` weights) and the score head
    `score` = Linear(hidden, hidden) -> ReLU -> Linear(hidden, 2), both linears with a bias (the layout of
    vLLM 0.32's `Qwen2ForProcessRewardModel`, vllm/model_executor/models/qwen2_rm.py). The head runs in float32
    on float32 hidden states, as vLLM's pooling runner does by default (`head_dtype`); the decoder runs in the
    dtype it was loaded in. forward -> logits (B, T, 2); no KV cache (one forward pass per input)."""

    def __init__(self, config):
        from transformers import Qwen2Model

        super().__init__()
        self.model = Qwen2Model(config)
        h = config.hidden_size
        self.score = torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.ReLU(), torch.nn.Linear(h, 2))

    def forward(self, input_ids, attention_mask=None):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask,
                            use_cache=False).last_hidden_state  # (B, T, H)
        return self.score(hidden.to(self.score[0].weight.dtype))  # (B, T, 2)


def _checkpoint_shapes(folder: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Weight name -> (shape, shard file) from the safetensors headers of `folder` (no tensor is read):
    `model.safetensors.index.json` and its shards, or a single `model.safetensors`."""
    from safetensors import safe_open

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(folder, "model.safetensors")):
        shards = ["model.safetensors"]
    else:
        raise ValueError(f"PRM {folder!r}: no model.safetensors or model.safetensors.index.json in the folder")
    out = {}
    for shard in shards:
        path = os.path.join(folder, shard)
        if not os.path.isfile(path):
            raise ValueError(f"PRM {folder!r}: the shard {shard!r} named by model.safetensors.index.json is missing")
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                out[key] = (tuple(f.get_slice(key).get_shape()), path)
    return out


def _empty_qwen2_prm(folder: str) -> tuple[Qwen2ProcessRewardModel, object]:
    """(the module on the meta device, its Qwen2Config) for a checkpoint folder: no memory, no random init.
    The config is read as a plain Qwen2Config: its `auto_map` (remote code) is never followed."""
    from transformers import Qwen2Config

    config = Qwen2Config.from_pretrained(folder)  # a config without pad_token_id reads as pad_token_id=None
    if config.model_type != "qwen2":
        raise ValueError(f"PRM {folder!r}: {PRM_ARCHITECTURE} needs model_type 'qwen2', config.json has "
                         f"{config.model_type!r}")
    with torch.device("meta"):
        module = Qwen2ProcessRewardModel(config)
    return module, config


def check_qwen2_prm_checkpoint(folder: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """The weight names and shapes of a Qwen2.5-Math-PRM checkpoint against `Qwen2ProcessRewardModel`, from
    the file headers only. `lm_head.*` (saved by some exports, unused by a PRM) is ignored. Returns the
    checkpoint's name -> (shape, shard) map; raises ValueError, one line naming the keys, on a missing,
    unexpected or misshapen weight (a missing score head would otherwise be left at random initialisation)."""
    module, _ = _empty_qwen2_prm(folder)
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    found = {k: v for k, v in _checkpoint_shapes(folder).items() if not k.startswith("lm_head.")}
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    misshapen = sorted(k for k in set(expected) & set(found) if expected[k] != found[k][0])

    def some(keys):
        return ", ".join(keys[:6]) + (f" (+{len(keys) - 6} more)" if len(keys) > 6 else "")

    problems = [f"missing {some(missing)}" if missing else "", f"unexpected {some(unexpected)}" if unexpected else "",
                "wrong shape " + some([f"{k} {found[k][0]} (expected {expected[k]})" for k in misshapen])
                if misshapen else ""]
    if any(problems):
        raise ValueError(f"PRM {folder!r} is not a {PRM_ARCHITECTURE} checkpoint (model.* + score.0 + score.2): "
                         + "; ".join(p for p in problems if p))
    return found


def indexed_device(device) -> str:
    """`device` as a string with its index: a bare "cuda" becomes "cuda:N", N the current CUDA device (the
    rank's GPU under torchrun: dist.init sets it). torch reads a bare "cuda" as the current device, but a library
    that is not torch may not: safetensors' safe_open maps it to cuda:0, which would put every rank's PRM on
    rank 0's GPU."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def load_qwen2_prm(folder: str, device="cpu", dtype=None) -> tuple[Qwen2ProcessRewardModel, object]:
    """(module, config) of a Qwen2.5-Math-PRM checkpoint folder, without remote code: keys checked first
    (`check_qwen2_prm_checkpoint`), then each tensor read straight onto `device` and assigned in place of the
    meta parameters (peak memory = one copy of the weights). The decoder gets `dtype` (default float32), the
    score head float32."""
    dtype = dtype or torch.float32
    found = check_qwen2_prm_checkpoint(folder)
    module, config = _empty_qwen2_prm(folder)
    from safetensors import safe_open

    state = {}
    for shard in sorted({path for _, path in found.values()}):
        with safe_open(shard, framework="pt", device=indexed_device(device)) as f:   # "cuda" is cuda:0 there
            for key in f.keys():
                if key in found:
                    state[key] = f.get_tensor(key).to(torch.float32 if key.startswith("score.") else dtype)
    module.load_state_dict(state, strict=True, assign=True)
    # the rotary inverse frequencies are a computed buffer, not a weight: build them on the device
    module.model.rotary_emb = type(module.model.rotary_emb)(config).to(device)
    left = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"PRM {folder!r}: no weights for {', '.join(left[:6])}")
    return module.eval().requires_grad_(False), config


def _config_json(name: str) -> dict:
    """config.json of a local folder or of a hub id (downloaded, or from the cache when offline)."""
    path = os.path.join(name, "config.json")
    if not os.path.isdir(name):
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import HFValidationError

        try:
            path = hf_hub_download(name, "config.json")
        except HFValidationError as e:  # not a folder, and not a hub id either
            raise OSError(str(e)) from e
    with open(path, encoding="utf-8") as f:
        return json.load(f)
