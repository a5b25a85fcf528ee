"""The refiner served by a process we start (generate.ServedModel / serve_with_vllm) and what happens when a
served refiner stops answering. Default stage: a fake OpenAI-compatible server (tests/fake_openai_server.py)
stands in for `vllm serve`; the real `vllm serve` is exercised in tests/test_vllm.py (vLLM stage).

1. start-up waits for GET /health, the log lands in the given file, close() leaves no process behind;
2. a server that dies during start-up is one RuntimeError quoting its log;
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

from harness.generate import GeneratorUnavailable, OpenAIGenerator, ServedModel, free_port  # noqa: E402


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


@pytest.mark.slow
def test_a_killed_trainer_takes_its_server_with_it(tmp_path):
    """SIGKILL runs no Python cleanup: the kernel's parent-death signal must stop the server."""
    script = (f"import sys, time; sys.path.insert(0, {ROOT!r}); from harness.generate import ServedModel, free_port\n"
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
    retries) or killed it with a traceback. Here the server answers the first refinement request, then exits
    or hangs; the run must finish its 3 steps, log the later steps as refiner_unavailable and say so."""
    port = free_port()
    server = ServedModel([sys.executable, FAKE, "--port", str(port), "--after", "1", "--then", then],
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
