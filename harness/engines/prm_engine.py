"""prm_engine.py — the PRM's engine under prm.ProcessRewardModel: loading, micro-batched forwards, the served PRM.

Not the paper. prm.py assembles the PRM's input (the steps, the `<extra_0>` separators) and reads P(step
correct) at each separator; `PRMEngine` holds the loaded checkpoint (harness/engines/prm_checkpoint.py: no remote code;
or `served`, the PRM on vLLM's pooling runner, harness/engines/served_prm.py) and runs the forwards:

    engine.probs_at([(input_ids, separator_positions), ...])  ->  [[P(class 1) at each position], ...]

Not the hub's remote code (it does not run on transformers 5). With vLLM on a GPU, `served` takes the same
inputs instead of the module; the head runs in float32 as vLLM's pooling runner does, and tests/test_vllm.py
checks the scores against vLLM's own, in-process and served.

Two input formats, chosen by `prm_checkpoint.prm_format` from the checkpoint (or `--prm-format`):
- "qwen-math-prm" (Qwen2.5-Math-PRM-7B/-72B, any PRM whose tokenizer holds the `<extra_0>` tag): prm.py's
  `build_input`, the model card's chat layout with one `<extra_0>` after each step.
- "trl-token-classification" (a `*ForTokenClassification` trained with TRL's PRMTrainer, e.g.
  HuggingFaceH4/Qwen2.5-Math-1.5B-Instruct-PRM-0.2): `trl_input`, the layout of PRMTrainer's `tokenize_row`.
  Never served: its scores come from this process (HF) also when the rollouts run on vLLM.
"""
import torch

from harness.engines.prm_checkpoint import QWEN_MATH_PRM, load_prm, prm_format as choose_format

TRL_STEP_SEPARATOR = "\n\n"   # the --step_separator of HuggingFaceH4's Qwen2.5-Math-*-Instruct-PRM-0.2 training


class PRMEngine:
    """A loaded 2-class token classifier and its tokenizer; `max_length` is capped at the model's
    `max_position_embeddings`. `separator`: the step tag of the "qwen-math-prm" format, which the tokenizer must
    then hold as one token. `prm_format`: "auto" (prm_checkpoint.prm_format decides) or one of the two formats
    (module docstring); the chosen one is `self.format`."""

    def __init__(self, name_or_path, separator: str, device="cpu", dtype=None, max_length=4096, micro_batch_size=4,
                 served=None, prm_format="auto"):
        self.name = str(name_or_path)
        self.model, self.tokenizer, config = load_prm(self.name, device, dtype, served=served)
        self.format = choose_format(self.name, getattr(config, "architectures", None) or [], self.tokenizer,
                                    separator, prm_format)
        self.device = device
        self.micro_batch_size = int(micro_batch_size)
        if self.micro_batch_size < 1:
            raise ValueError(f"ProcessRewardModel: micro_batch_size must be >= 1, got {micro_batch_size}")
        limit = getattr(config, "max_position_embeddings", None)
        self.max_length = int(min(max_length, limit) if limit else max_length)
        self.sep_id = self.tokenizer.convert_tokens_to_ids(separator)
        if self.format == QWEN_MATH_PRM and (self.sep_id is None or self.sep_id == self.tokenizer.unk_token_id):
            raise ValueError(f"the tokenizer of PRM {self.name!r} has no {separator!r} token")
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)

    @torch.no_grad()
    def probs_at(self, built: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """P(class 1) at each listed position of each input: sorted by length, right-padded, one forward per
        micro-batch (on a served PRM one request each); results in input order, [] for an input without positions."""
        results = [[] for _ in built]
        todo = sorted((i for i, (_, pos) in enumerate(built) if pos), key=lambda i: len(built[i][0]))
        for b0 in range(0, len(todo), self.micro_batch_size):
            chunk = todo[b0:b0 + self.micro_batch_size]
            width = max(len(built[i][0]) for i in chunk)
            input_ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)  # (b, T)
            attention = torch.zeros((len(chunk), width), dtype=torch.long)  # (b, T)
            for row, i in enumerate(chunk):
                ids = built[i][0]
                input_ids[row, :len(ids)] = torch.tensor(ids)
                attention[row, :len(ids)] = 1
            out = self.model(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device))
            logits = out if torch.is_tensor(out) else getattr(out, "logits", None)
            logits = out[0] if logits is None else logits  # (b, T, 2); a tuple's first item
            if logits.dim() != 3 or logits.shape[-1] != 2:
                raise ValueError(f"PRM {self.name!r} returned logits of shape {tuple(logits.shape)}, "
                                 "expected (batch, tokens, 2)")
            probs = torch.softmax(logits.float(), dim=-1)[..., 1].cpu()  # (b, T) P(step correct)
            for row, i in enumerate(chunk):
                results[i] = [float(probs[row, p]) for p in built[i][1]]
        return results

    def trl_input(self, question: str, steps: list[str]) -> tuple[list[int], list[int]]:
        """(input ids, step-end positions of the steps that fit in max_length) in the layout TRL's PRMTrainer
        trained on (`tokenize_row`: trl/trainer/prm_trainer.py from TRL 0.13, trl/experimental/prm/prm_trainer.py
        later; TRL 1.16.0 ships no PRMTrainer): BOS when the tokenizer has one, the question's ids, then for each
        step its own ids and the ids of the separator "\\n\\n" (each encoded alone, no special tokens added, no chat
        template); a step's label sits on its last id, the separator's last token. Steps are stripped of the
        separator they end with in `split_steps` and of surrounding whitespace, since the separator is appended
        here. A step that does not fit whole stays unscored (None), as training's --max_length cut off its label."""
        bos = [self.tokenizer.bos_token_id] if self.tokenizer.bos_token_id is not None else []
        ids = bos + self.tokenizer(question, add_special_tokens=False)["input_ids"]
        sep = self.tokenizer.encode(TRL_STEP_SEPARATOR, add_special_tokens=False)
        positions = []
        for step in steps:
            step_ids = self.tokenizer(step.strip(), add_special_tokens=False)["input_ids"] + sep
            if len(ids) + len(step_ids) > self.max_length:
                break  # this step and every later one stay unscored
            ids += step_ids
            positions.append(len(ids) - 1)
        return ids, positions
