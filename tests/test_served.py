"""The refiner served by a process we start (generate.ServedModel / serve_with_vllm) and what happens when a
served refiner stops answering. Default stage: a fake OpenAI-compatible server (tests/fake_openai_server.py)
stands in for `vllm serve`; the real `vllm serve` is exercised in tests/test_vllm.py (vLLM stage).

1. start-up waits for GET /health, the log lands in the given file, close() leaves no process behind;
2. a server that dies during start-up is one RuntimeError quoting its log; a served PRM's start that fails keeps
   that log in its run folder, and the error carries the log's tail and a hint only where the log names a cause;
3. a trainer killed with SIGKILL takes its server with it (PR_SET_PDEATHSIG);
4. the client gives up after bounded timeouts and retries (GeneratorUnavailable), never hangs;
5. regression: a `scope.py` run whose refiner server dies or hangs mid-run goes on without rectification,
   marks those steps in the step line and metrics.jsonl, says so at the end, and exits 0.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
FAKE = os.path.join(ROOT, "tests", "fake_openai_server.py")

from harness.engines.generate import GeneratorUnavailable, OpenAIGenerator, ServedModel, free_port  # noqa: E402


def fake_server(tmp_path, *extra, name="server.log"):
    port = free_port()
    return ServedModel([sys.executable, FAKE, "--port", str(port), *extra], url=f"http://127.0.0.1:{port}",
                       log_path=str(tmp_path / name), startup_timeout=30, grace=5)


def gone(pid: int, within: float = 15) -> bool:
    """True once `pid` no longer runs (absent, or a zombie nobody has reaped yet)."""
    deadline = time.time() + within
    while time.time() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.2)
    return False


def test_start_waits_for_health_logs_to_the_file_and_close_leaves_nothing(tmp_path, char_tokenizer):
    server = fake_server(tmp_path, "--startup-delay", "1.5").start()
    try:
        assert server.alive() and server.healthy()
        gen = OpenAIGenerator(server.url, "fake", char_tokenizer, timeout=5, server=server)
        [[c]] = gen.generate([[1, 2, 3]], n=1, max_tokens=50)
        assert c.finished and c.text.endswith("\\boxed{0}.")
    finally:
        server.close()
    assert gone(server.proc.pid) and not server.alive()
    log = (tmp_path / "server.log").read_text()
    assert "fake server on port" in log and "/health" in log and "/v1/completions" in log
    server.close()  # idempotent


def test_server_that_dies_during_start_up_is_one_clear_error(tmp_path):
    bad = ServedModel([sys.executable, "-c", "print('CUDA out of memory (pretend)'); raise SystemExit(3)"],
                      url=f"http://127.0.0.1:{free_port()}", log_path=str(tmp_path / "bad.log"), startup_timeout=30)
    with pytest.raises(RuntimeError, match=r"exit code 3.*\n.*CUDA out of memory \(pretend\)"):
        bad.start()
    slow = fake_server(tmp_path, "--startup-delay", "30", name="slow.log")
    slow.startup_timeout = 2
    t0 = time.time()
    with pytest.raises(RuntimeError, match="did not answer .*/health within 2 s"):
        slow.start()
    assert time.time() - t0 < 15 and gone(slow.proc.pid)


def test_a_served_prm_that_dies_at_start_up_says_why_and_keeps_its_log(tmp_path, monkeypatch):
    """Regression: a served PRM whose `vllm serve` exited at start-up was one line ending "…, last lines:" (the
    tail it announced dropped) with a hub-download hint unrelated to the cause, and the new run folder holding its
    log was deleted."""
    from harness.engines import generate, served_prm
    from harness.run import runs, wiring

    crash = ("import sys; print('INFO 12-03 starting the API server', flush=True)\n"
             "def build(): raise ValueError('Model architectures [Qwen9ForProcessRewardModel] are not supported')\n"
             "build()")
    monkeypatch.setattr(generate, "vllm_serve_command", lambda *a, **k: [sys.executable, "-c", crash])
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text("{}")
    log = run_dir / "prm_server.log"
    with pytest.raises(SystemExit) as exit_:
        with runs.removed_on_failure(str(run_dir), True), wiring.loading("Qwen/Qwen2.5-Math-PRM-7B"):
            served_prm.serve_prm("Qwen/Qwen2.5-Math-PRM-7B", None, sep_id=5, log_path=str(log),
                                 gpu_memory_utilization=0.2, kv_cache_bytes=1 << 30, max_model_len=None,
                                 startup_timeout=30)
    err = str(exit_.value.code)
    assert err.startswith("error: cannot start 'Qwen/Qwen2.5-Math-PRM-7B': the server exited during start-up "
                          f"(exit code 1); log {log}, last lines:")
    assert err.rstrip().endswith("ValueError: Model architectures [Qwen9ForProcessRewardModel] are not supported")
    assert "hint" not in err and "hf download" not in err
    assert log.exists() and "Traceback" in log.read_text()           # the log the error names is there to read
    assert not (run_dir / "config.json").exists() and not runs.holds_run(str(run_dir)) and runs.only_logs(str(run_dir))


def test_a_start_up_hint_only_where_the_log_names_its_cause(tmp_path):
    """The hint follows the log's text (memory, port, vLLM version, a missing model); none for any other cause. The
    in-process engine's failure is its exception's last line, with the hint its cause chain fits."""
    from harness.run.wiring import engine_starting, start_hint

    assert "nvidia-smi" in start_hint("m", "ValueError: Free memory on device (3.1/79.2 GiB) on startup is less than "
                                           "desired GPU memory utilization (0.9, 71.3 GiB)")
    assert "port" in start_hint("m", "OSError: [Errno 98] Address already in use")
    assert "vllm 0.33" in start_hint("m", "vllm: error: unrecognized arguments: --runner pooling")
    assert "hf download Qwen/X" in start_hint("Qwen/X", "huggingface_hub.errors.RepositoryNotFoundError: 404")
    assert start_hint("m", "AssertionError: bias dtype float32 does not match bf16") == ""
    with pytest.raises(SystemExit) as exit_:
        with engine_starting("Qwen/Qwen2.5-1.5B"):
            try:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            except RuntimeError as oom:
                raise RuntimeError("Engine core initialization failed. See root cause above.") from oom
    err = str(exit_.value.code)
    assert err.splitlines()[0] == ("error: vLLM (in this process) did not start 'Qwen/Qwen2.5-1.5B': RuntimeError: "
                                   "Engine core initialization failed. See root cause above.")
    assert "nvidia-smi" in err.splitlines()[1]


@pytest.mark.slow
def test_a_killed_trainer_takes_its_server_with_it(tmp_path):
    """SIGKILL runs no Python cleanup: the kernel's parent-death signal must stop the server."""
    script = (f"import sys, time; sys.path.insert(0, {ROOT!r}); from harness.engines.generate import ServedModel, free_port\n"
              f"port = free_port()\n"
              f"s = ServedModel([sys.executable, {FAKE!r}, '--port', str(port)], url=f'http://127.0.0.1:{{port}}',"
              f" log_path={str(tmp_path / 'k.log')!r}).start()\n"
              f"print(s.proc.pid, flush=True)\ntime.sleep(120)\n")
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    server_pid = int(trainer.stdout.readline())
    assert not gone(server_pid, within=0.5)
    trainer.send_signal(signal.SIGKILL)
    trainer.wait(timeout=10)
    assert gone(server_pid), f"server {server_pid} outlived its killed trainer"


def test_client_gives_up_after_bounded_timeouts_and_retries(tmp_path, char_tokenizer):
    server = fake_server(tmp_path, "--after", "0", "--then", "hang").start()
    try:
        gen = OpenAIGenerator(server.url, "fake", char_tokenizer, timeout=0.5, retries=1, server=server)
        t0 = time.time()
        with pytest.raises(GeneratorUnavailable, match="no answer after 2 tries of at most 0.5 s"):
            gen.generate([[1, 2]], n=1, max_tokens=8)
        assert time.time() - t0 < 10
    finally:
        server.close()
    with pytest.raises(GeneratorUnavailable, match="has exited"):  # our own server is gone: no waiting at all
        gen.generate([[1, 2]], n=1, max_tokens=8)
    nobody = OpenAIGenerator(f"http://127.0.0.1:{free_port()}", "fake", char_tokenizer, timeout=1, retries=1,
                             max_model_len=100)
    with pytest.raises(GeneratorUnavailable, match="no answer after 2 tries"):  # connection refused
        nobody.generate([[1, 2]], n=1, max_tokens=8)


@pytest.mark.slow
@pytest.mark.parametrize("then", ["exit", "hang"])
def test_run_goes_on_without_rectification_when_the_refiner_server_stops(tmp_path, toy_model_dir, then):
    """Regression: a served refiner that stopped answering hung the run (600 s per request, no limit on
    retries) or killed it with a traceback. Here the server answers 4 requests (a seeded step sends one per pick,
    at most 4 here: the first step's), then exits or hangs; the run must finish its 3 steps, log the later steps
    as refiner_unavailable and say so."""
    port = free_port()
    server = ServedModel([sys.executable, FAKE, "--port", str(port), "--after", "4", "--then", then],
                         url=f"http://127.0.0.1:{port}", log_path=str(tmp_path / "fake.log"), startup_timeout=30)
    server.start()
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.run(
            [sys.executable, os.path.join(ROOT, "scope.py"), "--toy", "--model", toy_model_dir, "--refiner", toy_model_dir,
             "--refiner-url", server.url, "--refiner-timeout", "1", "--steps", "3", "--prompts-per-step", "4",
             "--group-size", "4", "--max-new-tokens", "64", "--eval-every", "0", "--save-every", "100",
             "--run-name", "r"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    finally:
        server.close()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "runs" / "r" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2, 3]
    served = [r for r in rows if r["rectify_tried"] > 0]
    down = [r for r in rows if r["refiner_unavailable"] == 1]
    assert served and served[0]["refiner_unavailable"] == 0  # the first request was answered
    assert down and all(r["rectify_tried"] == 0 and r["step"] > served[0]["step"] for r in down)
    out = proc.stdout + proc.stderr
    assert "REFINER UNAVAILABLE" in out and f"the refiner did not answer on {len(down)} of 3 steps" in out
    assert "Traceback" not in out


# ---- per-pick refiner budgets


class BudgetRecorder:
    """A generator stand-in that records each call's max_tokens and answers a finished "ok" per sample."""

    def __init__(self, tokenizer, per_prompt_budgets: bool):
        from harness.engines.generate import Completion

        self.tokenizer, self.calls, self.Completion = tokenizer, [], Completion
        if per_prompt_budgets:
            self.per_prompt_budgets = True

    def generate(self, prompts, *, n, temperature, top_p, max_tokens, seed):
        self.calls.append(max_tokens)
        return [[self.Completion(ids=[1], text="ok", finished=True) for _ in range(n)] for _ in prompts]


@pytest.mark.parametrize("served", [True, False])
def test_rectify_sends_each_pick_its_own_budget_to_a_served_refiner(char_tokenizer, served):
    """A served (or in-process vLLM) refiner gets one budget per pick: max_new_tokens - its prefix, capped by
    the refiner's max_tokens (--refiner-max-tokens), so no pick decodes past its own. HF generate gets the largest (one random stream: the
    toy world's records stay as they were) and clips each pick to its own."""
    from harness.engines.refiner import Refiner
    from refine import Trajectory, rectify, refiner_prompt

    trajs = [Trajectory(question="1+1?", answer="2", group=g, prompt_ids=[5], response_ids=list(range(7, 7 + 30)),
                        text="x") for g in range(3)]
    gen = BudgetRecorder(char_tokenizer, per_prompt_budgets=served)
    rectify(trajs, [(0, 0), (1, 10), (2, 25)], Refiner(gen, char_tokenizer, prompt=refiner_prompt, max_tokens=35), char_tokenizer,
            attempts=2, max_new_tokens=40, grade_fn=lambda text, answer: False)
    assert gen.calls == ([[35, 30, 15]] if served else [35])


def test_openai_sends_a_request_per_budget_all_at_once(tmp_path, char_tokenizer):
    """Per-pick budgets on a served refiner: one request per distinct budget, all in flight together (the server
    batches them), each prompt's completions back in input order. With a seed, one request per prompt, seeded
    seed + i·n: vLLM's server gives every prompt of a request the same seed, so two picks in one request would
    decode with the same noise."""
    from harness.engines.generate import OpenAIGenerator

    with fake_server(tmp_path, "--startup-delay", "0").start() as server:
        gen = OpenAIGenerator(server.url, "fake", char_tokenizer, timeout=10, max_model_len=4096)
        prompts = [[5, 6], [7], [8, 9, 10]]
        unseeded = gen.requests(prompts, [12, 30, 12], n=2, temperature=0.7, top_p=1.0, seed=None)
        assert [(rows, b["max_tokens"], b["prompt"]) for rows, b in unseeded] == [([0, 2], 12, [[5, 6], [8, 9, 10]]),
                                                                                 ([1], 30, [[7]])]
        assert not any("seed" in b for _, b in unseeded)
        seeded = gen.requests(prompts, [12, 30, 12], n=2, temperature=0.7, top_p=1.0, seed=3)
        assert [(rows, b["max_tokens"], b["prompt"], b["seed"]) for rows, b in seeded] == [
            ([0], 12, [[5, 6]], 3), ([1], 30, [[7]], 5), ([2], 12, [[8, 9, 10]], 7)]
        out = gen.generate(prompts, n=2, temperature=0.7, max_tokens=[12, 30, 12], seed=3)
        assert [len(row) for row in out] == [2, 2, 2] and all(c.finished for row in out for c in row)
        with pytest.raises(ValueError, match="2 max_tokens for 3 prompts"):
            gen.generate(prompts, n=1, max_tokens=[1, 2])


# ---- the in-process vLLM engine's seeds and the evaluation call (a recording stand-in for vllm.LLM)

from test_generate import RecordingLLM, fake_vllm  # noqa: E402,F401  (the fixture, imported for these tests)


def test_vllm_seeds_never_collide_across_prompts(bpe_tokenizer, fake_vllm, monkeypatch, tmp_path):
    """vLLM seeds child j of a request seeded s with s + j: prompt i must take seed + i·n, or prompt 1's first sample
    repeats prompt 0's second (seed + 1) whenever the prompts agree. Greedy copies (n = 1 each) take + c."""
    monkeypatch.setattr(RecordingLLM, "vocab_rows", len(bpe_tokenizer))
    from harness.engines.generate import VLLMGenerator

    gen = VLLMGenerator(str(tmp_path), tokenizer=bpe_tokenizer)
    gen.generate([[1, 2], [1, 2], [3]], n=4, temperature=1.0, max_tokens=5, seed=10)
    gen.generate([[1, 2], [3]], n=3, temperature=0.0, max_tokens=5, seed=10)
    gen.generate([[3]], n=4, temperature=1.0, max_tokens=5, seed=10 + 2 * 4)   # a torchrun rank holding prompt 2 only
    sampled, greedy, rank = (call[1][1] for call in fake_vllm[0].calls)
    assert [p.seed for p in rank] == [18] == [p.seed for p in sampled[2:]]   # the one-process run's seeds
    assert [p.seed for p in sampled] == [10, 14, 18] and all(p.n == 4 for p in sampled)
    children = [p.seed + j for p in sampled for j in range(p.n)]
    assert len(set(children)) == len(children) == 12
    assert [p.seed for p in greedy] == [10, 11, 12, 13, 14, 15] and all(p.n == 1 for p in greedy)
    assert all(p.logprobs == 0 for p in sampled)   # the rollouts' TIS weight needs the sampler's log-probs


def test_evaluation_under_vllm_is_one_call_without_logprobs(bpe_tokenizer, fake_vllm, monkeypatch, tmp_path):
    """Eight sequential calls of 64 prompts would each wait for their own longest answer: under vLLM evaluate sends
    every prompt in one call, and asks for no log-probs (it uses none). HF generate keeps its batches."""
    monkeypatch.setattr(RecordingLLM, "vocab_rows", len(bpe_tokenizer))
    from eval import evaluate
    from harness.engines.generate import VLLMGenerator

    gen = VLLMGenerator(str(tmp_path), tokenizer=bpe_tokenizer)
    problems = [{"id": str(k), "question": f"{k} + 1?", "answer": str(k + 1)} for k in range(5)]
    result = evaluate(gen, bpe_tokenizer, problems, n=2, batch_size=2, max_new_tokens=6, seed=0)
    calls = [c for c in fake_vllm[0].calls if c[0] == "generate"]
    assert len(calls) == 1 and len(calls[0][1][0]) == 5 and result["num_problems"] == 5
    assert all(p.logprobs is None and p.max_tokens == 6 for p in calls[0][1][1])
    assert [p.seed for p in calls[0][1][1]] == [0, 2, 4, 6, 8]


# ---- the PRM on vLLM's pooling runner (harness/engines/served_prm.py), against a stand-in /pooling endpoint


def pooling_stand_in(score_fn):
    """A /pooling endpoint in a thread: each input's reply rows are score_fn(ids) (its [P(wrong), P(correct)] per
    separator, as vLLM's STEP pooling answers); records every body. Returns (url, bodies, close)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    bodies = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append((self.path, body))
            data = [{"index": k, "object": "pooling", "data": score_fn(ids)} for k, ids in enumerate(body["input"])]
            raw = json.dumps({"id": "pool-1", "object": "list", "created": 0, "model": body["model"], "data": data,
                              "usage": {"prompt_tokens": 1, "total_tokens": 1}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{httpd.server_address[1]}", bodies, httpd.shutdown


SOLUTIONS = [("What is 12 * 4 - 5?", ["First, 12 * 4 = 48.\n\n", "Next, 48 - 5 = 43.\n\n", "So \\boxed{43}."]),
             ("Compute 1/2 + 1/3.", ["We have \\frac{1}{2} + \\frac{1}{3} = \\frac{5}{6}."]),
             ("Area of a circle of radius 3?", ["The area is \\pi r^2 = 9\\pi.\n\n", "So \\boxed{9\\pi}."])]


def test_a_served_prm_scores_like_the_in_process_one(tmp_path):
    """prm.ProcessRewardModel with `served`: the same inputs (token ids, separators intact) go to /pooling in one
    request, and the probabilities at each separator come back as the step scores, in order, for every solution.
    The stand-in answers with the in-process model's own softmax, so any misplaced row, lost separator or
    reordered reply changes the scores. A reply with a separator missing is one error naming the server."""
    import conftest
    import real_layout_prm
    from harness.engines.generate import OpenAIGenerator
    from harness.engines.served_prm import PooledStepScores
    from prm import ProcessRewardModel

    if conftest.qwen_tokenizer_file() is None:
        pytest.skip(conftest.QWEN_SKIP)
    import torch

    path = real_layout_prm.write_qwen2_prm(str(tmp_path / "prm"), conftest.make_qwen_tokenizer(prm=True), layers=2)
    hf = ProcessRewardModel(path)

    def softmax_at_separators(ids):
        with torch.no_grad():
            logits = hf.model(input_ids=torch.tensor([ids]))
        logits = logits if torch.is_tensor(logits) else logits.logits
        probs = torch.softmax(logits[0].float(), -1)
        return [probs[t].tolist() for t, token in enumerate(ids) if token == hf.sep_id]

    url, bodies, close = pooling_stand_in(softmax_at_separators)
    try:
        client = OpenAIGenerator(url, "prm", hf.tokenizer, timeout=10, max_model_len=4096)
        served = ProcessRewardModel(path, micro_batch_size=1024, served=PooledStepScores(client, "prm", hf.sep_id))
        questions, steps = [q for q, _ in SOLUTIONS], [s for _, s in SOLUTIONS]
        mine, theirs = hf.score_batch(questions, steps), served.score_batch(questions, steps)
        assert [len(s) for s in theirs] == [3, 1, 2] and all(x is not None for s in theirs for x in s)
        assert theirs == [pytest.approx(s, abs=1e-6) for s in mine]
        (where, body), = bodies   # one request for every solution
        assert where == "/pooling" and body["task"] == "token_classify" and body["add_special_tokens"] is False
        assert sorted(body["input"]) == sorted(hf.build_input(q, s)[0] for q, s in SOLUTIONS)
        broken = PooledStepScores(client, "prm", hf.sep_id)
        broken.client = OpenAIGenerator(pooling_stand_in(lambda ids: softmax_at_separators(ids)[:-1])[0], "prm",
                                        hf.tokenizer, timeout=10, max_model_len=4096)
        with pytest.raises(RuntimeError, match=r"127\.0\.0\.1:\d+ \(/pooling\): input 0 has \d+ separators .* "
                                               r"--runner pooling"):
            ProcessRewardModel(path, micro_batch_size=1024, served=broken).score_batch(questions, steps)
    finally:
        close()


def test_the_served_prm_is_chosen_only_where_vllm_serves_it_and_it_fits():
    """The PRM goes to its own vllm serve only with vLLM, for Qwen2ForProcessRewardModel, when the plan with it fits;
    a 48 GB card keeps it in the trainer (offloaded in the update). A served PRM is never offloaded."""
    import scope
    from harness.plan import memory

    args = scope.Args(model="Qwen2.5-1.5B")
    assert memory.prm_served(args, True, 79.2) and not memory.prm_offloaded(args, "cpu", True, 79.2)
    assert not memory.prm_served(args, False, 79.2)   # no vLLM: HF in the trainer
    assert not memory.prm_served(scope.Args(model="Qwen2.5-1.5B", backend="hf"), True, 79.2)
    refine_self = scope.Args(model="Qwen2.5-1.5B", refiner="policy")
    assert not memory.prm_served(refine_self, True, 47.5) and memory.prm_offloaded(refine_self, "cpu", True, 47.5)
    rows = memory.memory_plan(args, 79.2, True)[0]
    served = [gib for name, gib, phase in rows if name.startswith("PRM: its own vllm serve") and phase == "all"]
    assert served == [pytest.approx(memory.prm_server_need(args)[1])] and 16 < served[0] < 18


def test_fp8_flags_reach_the_served_command_lines(monkeypatch, tmp_path, char_tokenizer):
    """--refiner-quantization / --prm-quantization fp8 put `--quantization fp8` on the refiner's and the PRM's
    `vllm serve` command lines (the exact lines vLLM 0.33's parser reads in tests/test_vllm33_contract.py); the
    default none adds nothing (bf16, the paper's numerics)."""
    import scope
    from harness.engines import generate, served_prm
    from harness.run import wiring

    started = []

    def fake_serve(model, tokenizer, **kw):
        started.append(generate.vllm_serve_command(model, port=1, served_name="m", gpu_memory_utilization=0.25,
                                                   extra=kw.get("extra", ())))
        return OpenAIGenerator("http://127.0.0.1:1", "m", tokenizer)

    monkeypatch.setattr(generate, "serve_with_vllm", fake_serve)
    monkeypatch.setattr(wiring, "vllm_importable", lambda: True)
    monkeypatch.setattr(wiring, "load_tokenizer", lambda name: char_tokenizer)
    for quantization in ("fp8", "none"):
        args = scope.Args(refiner="some/refiner", refiner_quantization=quantization)
        wiring.load_refiner(args, None, char_tokenizer, "cuda", str(tmp_path), scope.refine.refiner_prompt)
        served_prm.serve_prm("some/prm", char_tokenizer, sep_id=7, log_path="", gpu_memory_utilization=0.2,
                             kv_cache_bytes=1 << 30, max_model_len=4096, quantization=quantization)
    fp8_refiner, fp8_prm, bf16_refiner, bf16_prm = started
    assert fp8_refiner[fp8_refiner.index("--quantization") + 1] == "fp8"
    # the PRM: online FP8 of its decoder layers' projections only (attention, embeddings and score head keep their
    # dtype; tests/test_vllm33_contract.py)
    assert fp8_prm[fp8_prm.index("--quantization") + 1] == "online"
    assert json.loads(fp8_prm[fp8_prm.index("--quantization-config") + 1]) == {
        "targets": {"model.layers.*_proj": "fp8_per_tensor"}}
    assert "--runner" in fp8_prm and "--quantization" not in bf16_refiner + bf16_prm


@pytest.mark.parametrize("flags, says", [
    (["--toy", "--refiner-quantization", "fp8"], "only for a refiner on its own `vllm serve`"),
    (["--toy", "--prm-quantization", "fp8"], "only for a PRM on its own `vllm serve --runner pooling`")])
def test_fp8_where_no_server_runs_is_refused(tmp_path, flags, says):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scope.py"), *flags, "--dry-run"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and says in proc.stderr + proc.stdout, proc.stderr + proc.stdout


def test_fp8_without_a_server_stops_instead_of_running_bf16(monkeypatch, tmp_path, char_tokenizer, capsys):
    """A refiner or PRM that would run in this process in bf16 (no vLLM; the PRM not served) stops in one line."""
    import scope
    from harness.run import wiring

    monkeypatch.setattr(wiring, "vllm_importable", lambda: False)
    with pytest.raises(SystemExit):
        wiring.load_refiner(scope.Args(refiner="some/refiner", refiner_quantization="fp8"), None, char_tokenizer,
                            "cpu", str(tmp_path), scope.refine.refiner_prompt)
    said = capsys.readouterr().err.strip()
    assert "\n" not in said and "--refiner-quantization fp8: needs the refiner on its own vllm serve" in said
    with pytest.raises(SystemExit):
        wiring.load_prm(scope.Args(prm_quantization="fp8"), "cpu", scope.prm.ProcessRewardModel)
    said = capsys.readouterr().err.strip()
    assert "\n" not in said and "--prm-quantization fp8: needs the PRM on its own vllm serve" in said


def test_a_torchrun_ranks_refiner_seeds_follow_the_lower_ranks_attempts():
    """Regression: the refine phase's seed on a torchrun rank was offset by the lower ranks' pick count, not by their
    picks × attempts, so with vLLM (pick i's attempts seeded seed + i·n + j) rank 1's first pick repeated rank 0's
    second attempt. One process (offset 0) keeps its seed: the toy world's records stand."""
    import types

    import scope
    from harness.run import wiring

    class Ranks:
        def __init__(self, held):
            self.held, self.rank = held, 0

        def offset(self, n):
            return sum(self.held[:self.rank])

    dist = Ranks([3, 2])
    run = types.SimpleNamespace(args=scope.Args(refine_attempts=2), step=5, dist=dist)
    seeds = []
    for dist.rank, picks in enumerate(dist.held):
        base = wiring.Run.seed(run, "refine", list(range(picks)), per_item=2)
        seeds += [base + i * 2 + j for i in range(picks) for j in range(2)]   # VLLMGenerator: seed + i·n, child + j
    assert len(set(seeds)) == len(seeds) == 10
    assert seeds[:6] == [seeds[0] + k for k in range(6)] and seeds[6] == seeds[0] + 6   # one run's seeds, in order
    one = wiring.Run.seed(types.SimpleNamespace(args=run.args, step=5, dist=Ranks([5])), "refine", [0] * 5, per_item=2)
    assert one == wiring.seed_for(0, 5, "refine")   # one process: the seed as before
