"""lora.py — the policy stored and trained as a LoRA adapter (PEFT) instead of in full: `--lora-rank R`.

W' = W + (α / r) · B A on each target linear layer (Hu et al. 2021); W frozen in the run's dtype (bf16 on a GPU, no
float32 copy, no gradient, no optimizer state), A and B trained in float32. PEFT builds and saves the adapter; the
lines here wire it into the run: `wrap` (a new run), `load` (a resume), `adapter_off` (the KL reference: the
base, with no second model), `merged` (the weights the vLLM push sends), `export_merged` (model/ and its adapter).
B starts at 0, so the adapted model at step 0 is the base, token for token. docs/choices.md: the LoRA row.
"""
import os

import torch

TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"   # every linear layer of a Qwen2/Llama decoder
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")   # what PeftModel.save_pretrained writes


def targets_of(spec) -> tuple[str, ...]:
    """The layers a --lora-targets value names: comma-separated, or all-linear (and '') = TARGETS."""
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec) if n.strip()]
    return tuple(TARGETS.split(",")) if names in ([], ["all-linear"]) else tuple(names)


def alpha_of(rank: int, alpha: float) -> float:
    """--lora-alpha, where 0 means 2 × rank (TRL's pair: r 16, α 32)."""
    return alpha or 2.0 * rank


def wrap(model, rank: int, alpha: float = 0.0, targets: str = TARGETS):
    """`model` (a causal LM) with a fresh LoRA adapter of `rank` on the comma-separated `targets` ("all-linear":
    PEFT's every linear layer but the output head); only the adapter requires grad. No dropout: π_old, π_θ and
    the sampler see the same network."""
    from peft import LoraConfig, get_peft_model

    names = targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
    config = LoraConfig(r=rank, lora_alpha=alpha_of(rank, alpha), lora_dropout=0.0, target_modules=names,
                        task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as err:   # a target the model does not have
        raise SystemExit(f"error: --lora-targets {targets}: {str(err).splitlines()[0]}") from None


def load(model, folder: str):
    """`model` with the trainable adapter saved in `folder` (a checkpoint), bit for bit."""
    from peft import PeftModel

    return PeftModel.from_pretrained(model, folder, is_trainable=True)


def is_adapter(folder: str) -> bool:
    """True for a folder holding a PEFT adapter (a LoRA run's checkpoint)."""
    return os.path.isfile(os.path.join(folder, "adapter_config.json"))


def inner(model):
    """The causal LM itself, its target layers carrying the adapter (PEFT injects it in place): what HF generate
    samples from; `model` as it is when it has no adapter."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class AdapterOff(torch.nn.Module):
    """The KL reference of a LoRA policy: its forward is the policy's with the adapter switched off (the base)."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy

    def forward(self, *args, **kwargs):
        with self.policy.disable_adapter():
            return self.policy(*args, **kwargs)


class Merged:
    """Stands in for a LoRA policy where the vLLM push reads `config` and `state_dict().items()`: each target
    layer's W + (α / r) · B A, computed one layer at a time in float32, under the base model's own names (the ones
    vLLM loads); the adapter's own tensors are left out and the policy is not changed."""

    def __init__(self, policy):
        self.config, self.model = policy.config, inner(policy)

    def state_dict(self):
        return self

    @torch.no_grad()   # the push reads values: no autograd graph per merged tensor
    def items(self):
        layers = {name: module for name, module in self.model.named_modules() if hasattr(module, "get_delta_weight")}
        for name, tensor in self.model.state_dict().items():
            if ".lora_" in name:
                continue
            owner, base, param = name.rpartition(".base_layer.")
            if base and param == "weight":
                delta = layers[owner].get_delta_weight("default")   # (out, in), the adapter's dtype
                tensor = (tensor.to(delta.dtype) + delta).to(tensor.dtype)
            yield name.replace(".base_layer.", "."), tensor


class Saved:
    """Stands in for a LoRA policy where the checkpoint calls `save_pretrained`: the adapter alone, float32, without
    PEFT's look at the base's config.json (on the hub for a hub id) for a changed vocabulary: ours never changes."""

    def __init__(self, policy):
        self.policy = policy

    def save_pretrained(self, path):
        self.policy.save_pretrained(path, save_embedding_layers=False)


def export_merged(ckpt: str, base_path: str | None = None):
    """The checkpoint's adapter merged into its base (`base_path`, else read from adapter_config.json), as a plain
    causal LM in float32: what model/ saves; the adapter files themselves are copied beside it (harness/run/export.py)."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if base_path is None:
        with open(os.path.join(ckpt, "adapter_config.json"), encoding="utf-8") as f:
            base_path = json.load(f)["base_model_name_or_path"]
    try:
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: {ckpt}: cannot load the adapter's base model '{base_path}' "
                         f"({str(err).splitlines()[0]})") from None
    return PeftModel.from_pretrained(base, ckpt).merge_and_unload()
