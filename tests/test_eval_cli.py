"""eval.py's `evaluate` with hand-computed numbers, its CLI (harness/run/eval_cli.py) end to end on a local JSONL
benchmark with a tiny random model saved to disk (HF backend), and tools/report.py: `--plot` and the `--trace` viewer,
whose files go next to the run."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import eval as ev
from conftest import make_bpe_tokenizer, make_tiny_causal_lm
from harness.engines.generate import Completion
from harness.run import eval_cli
from tools import report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- evaluate() with a scripted generator ----

class ScriptedGenerator:
    """Returns fixed texts per prompt, in order, and records the sampling arguments it was given."""

    def __init__(self, texts_per_prompt):
        self.texts, self.calls = texts_per_prompt, []

    def generate(self, prompts, *, n=1, temperature=1.0, top_p=1.0, max_tokens=256, seed=None):
        self.calls.append(dict(num_prompts=len(prompts), n=n, temperature=temperature, max_tokens=max_tokens,
                               seed=seed))
        out = []
        for _ in prompts:
            texts = self.texts[len(out) + sum(c["num_prompts"] for c in self.calls[:-1])]
            out.append([Completion(ids=[1, 2, 3], text=t, finished=i % 2 == 0) for i, t in enumerate(texts)])
        return out


def test_evaluate_avg_and_pass_at_k_by_hand(bpe_tokenizer):
    right, wrong = "so \\boxed{7}", "so \\boxed{8}"
    problems = [{"id": "p0", "question": "3 + 4?", "answer": "7"},
                {"id": "p1", "question": "2 + 5?", "answer": "7"},
                {"id": "p2", "question": "1 + 6?", "answer": "7"}]
    gen = ScriptedGenerator([[right, wrong, right, wrong], [wrong] * 4, [right] * 4])
    res = ev.evaluate(gen, bpe_tokenizer, problems, n=4, temperature=0.6, max_new_tokens=32, seed=5, batch_size=2)
    # c = 2, 0, 4 of n = 4 -> avg@4 = (0.5 + 0 + 1) / 3 = 0.5
    assert res["acc"] == pytest.approx(0.5)
    # pass@2: p0 = 1 - C(2,2)/C(4,2) = 5/6, p1 = 0, p2 = 1 -> (5/6 + 1) / 3
    assert res["pass@k"][2] == pytest.approx((5 / 6 + 1) / 3)
    assert res["pass@k"][1] == pytest.approx(0.5) and res["pass@k"][4] == pytest.approx(2 / 3)
    assert sorted(res["pass@k"]) == [1, 2, 4]
    assert [r["correct"] for r in res["per_problem"]] == [2, 0, 4]
    assert [r["id"] for r in res["per_problem"]] == ["p0", "p1", "p2"]
    assert res["truncated"] == pytest.approx(0.5)  # samples 1 and 3 of each prompt did not finish
    assert res["num_problems"] == 3 and res["n"] == 4
    # batches of 2 prompts; each batch gets its own seed; sampling settings passed through
    assert [c["num_prompts"] for c in gen.calls] == [2, 1]
    assert [c["seed"] for c in gen.calls] == [5, 7]
    assert all(c["n"] == 4 and c["temperature"] == 0.6 and c["max_tokens"] == 32 for c in gen.calls)


def test_evaluate_keeps_samples_for_diversity(bpe_tokenizer):
    gen = ScriptedGenerator([["a b c d", "a b c e"]])
    res = ev.evaluate(gen, bpe_tokenizer, [{"id": 0, "question": "q", "answer": "1"}], n=2, keep_samples=True)
    assert res["per_problem"][0]["samples"] == ["a b c d", "a b c e"]
    summary = ev.diversity_summary(res["per_problem"])
    assert summary["one_minus_self_rouge"]["median"] == pytest.approx(0.25)  # LCS 3 of 4 tokens -> F1 0.75
    assert set(summary) == {"distinct_1", "distinct_4", "one_minus_self_bleu", "one_minus_self_rouge", "div_score"}


# ---- the CLI end to end, HF backend, tiny random model on disk ----

@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    tok = make_bpe_tokenizer()
    path = tmp_path_factory.mktemp("tiny_lm")
    make_tiny_causal_lm(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_cli_end_to_end_on_local_jsonl(tiny_model_dir, tmp_path, capsys):
    bench = tmp_path / "mini.jsonl"
    rows = [{"id": f"q{i}", "question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(3)]
    bench.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "res.json"
    rc = ev.main(["--model", tiny_model_dir, "--benchmarks", str(bench), "--backend", "hf", "--n", "2",
                  "--max-new-tokens", "6", "--temperature", "1.0", "--diversity", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert {"model", "n", "temperature", "max_new_tokens", "benchmarks", "ood"} <= set(report)
    res = report["benchmarks"][str(bench)]
    assert {"acc", "pass@k", "n", "num_problems", "per_problem", "diversity", "seconds"} <= set(res)
    assert set(res["pass@k"]) == {"1", "2"} and res["num_problems"] == 3 and res["n"] == 2
    assert 0 < res["seconds"] < 600   # the benchmark's own sampling and grading time, to compare with training's
    assert report["environment"]["torch"] == torch.__version__ and "commit" in report["environment"]
    assert 0.0 <= res["acc"] <= 1.0
    assert all(r["n"] == 2 and "samples" not in r for r in res["per_problem"])  # texts only with --save-samples
    printed = capsys.readouterr().out
    assert "avg@2" in printed and "pass@2" in printed and "div-score" in printed


def test_cli_names_the_model_it_cannot_load(tmp_path, capsys):
    bench = tmp_path / "one.jsonl"
    bench.write_text(json.dumps({"question": "1 + 1?", "answer": "2"}) + "\n")
    missing = str(tmp_path / "no_such_model")
    assert ev.main(["--model", missing, "--benchmarks", str(bench), "--backend", "hf"]) == 2
    err = capsys.readouterr().err
    assert f"--model '{missing}': no such folder" in err and "Traceback" not in err
    (tmp_path / "empty").mkdir()   # a folder without a model in it
    assert ev.main(["--model", str(tmp_path / "empty"), "--benchmarks", str(bench), "--backend", "hf"]) == 2
    err = capsys.readouterr().err
    assert "empty: no config.json in that folder, so no model" in err and err.count("\n") == 1


# ---- --plot ----

def test_plot_writes_png_from_metrics_jsonl(tmp_path):
    run_a, run_b = tmp_path / "runs" / "scope", tmp_path / "runs" / "grpo"
    run_a.mkdir(parents=True), run_b.mkdir(parents=True)
    rows_a = [{"step": s, "reward_mean": 0.1 * s, "keep_ratio_steps": 0.6, "rectify_tried": 4, "rectify_accepted": s % 3,
               "entropy": 0.9 - 0.1 * s, "response_len": 100 + s, "near_miss_frac": 0.3, "discarded_valid_frac": 0.2}
              for s in range(1, 6)]
    rows_a[1]["eval_acc"] = 0.25
    rows_a[4]["eval_acc"] = 0.5
    rows_b = [{"step": s, "reward_mean": 0.05 * s, "rectify_tried": 0, "rectify_accepted": 0} for s in range(1, 6)]
    (run_a / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_a))
    (run_b / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_b))
    out = tmp_path / "curves.png"
    assert report.main(["--plot", str(run_a), str(run_b), "--out", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_keeps_one_colour_per_run_across_panels(tmp_path, monkeypatch):
    """Regression: each panel restarted the colour cycle, so a run with no data in a panel (grpo has no keep
    ratio) shifted the colours of the runs after it and the single legend mislabelled that panel."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    runs = {"grpo": [{"step": s, "reward_mean": 0.1 * s} for s in (1, 2)],
            "scope": [{"step": s, "reward_mean": 0.2 * s, "keep_ratio_steps": 0.5} for s in (1, 2)]}
    for name, rows in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    colours, plot = [], Axes.plot
    monkeypatch.setattr(Axes, "plot", lambda self, *a, **kw: colours.append(kw.get("color")) or plot(self, *a, **kw))
    report.plot_runs([str(tmp_path / "grpo"), str(tmp_path / "scope")], str(tmp_path / "c.png"))
    assert colours == ["C0", "C1", "C1"]   # reward: grpo, scope; keep ratio: scope only, still C1


def test_plot_names_a_bad_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{oops\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2"):
        report.plot_runs([str(tmp_path)], str(tmp_path / "x.png"))


# ---- --trace ----

TRACE = {"step": 3, "group": 1, "question": "Compute 2 + 3 * 4.", "answer": "14", "mode": "scope",
         "steps": ["First, 3 * 4 = 12.\n\n", "Then 2 + 12 = 15.\n\n", "So \\boxed{15}."],
         "scores": [0.93, 0.12, None], "cut": 1, "keep_ratio": 1 / 3, "keep_ratio_tokens": 0.4,
         "prefix_text": "First, 3 * 4 = 12.\n\n",
         "suffixes": ["Then 2 + 12 = 13. <script>alert('x')</script> \\boxed{13}", "Then 2 + 12 = 14.\n\n\\boxed{14}"],
         "attempt_correct": [False, True], "accepted": True, "reward_before": 0.0, "reward_after": 1.0}


def write_traces(run_dir):
    earlier = dict(TRACE, step=1, question="an earlier question")
    (run_dir / "traces.jsonl").write_text(json.dumps(earlier) + "\n" + json.dumps(TRACE) + "\n")


def test_trace_terminal_rendering():
    plain = report.render_trace_text(TRACE, color=False)
    assert "\033[" not in plain
    for piece in ("[0.93] kept", "[0.12] FIRST ERROR", "[  -  ] discarded", "cut: the refiner rewrites from here",
                  "refiner attempt 2 (correct, accepted)", "refiner attempt 1 (wrong)", "Then 2 + 12 = 14.", "ACCEPTED", "kept 1/3 steps"):
        assert piece in plain
    assert plain.index("[0.93] kept") < plain.index("cut:") < plain.index("FIRST ERROR") < plain.index("attempt 1")
    coloured = report.render_trace_text(TRACE, color=True)
    assert "\033[32m  [0.93] kept" in coloured  # green kept step
    assert "\033[31m  [0.12] FIRST ERROR" in coloured  # red first error
    assert "\033[34m    Then 2 + 12 = 14." in coloured  # blue refiner text


def test_trace_cli_terminal_and_html(tmp_path):
    """Subprocess run of the real entry point: stdout is a pipe, so no ANSI codes; --html escapes model text."""
    write_traces(tmp_path)
    page = tmp_path / "trace.html"
    proc = subprocess.run([sys.executable, "-m", "tools.report", "--trace", str(tmp_path),
                           "--html", str(page)], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "Compute 2 + 3 * 4." in proc.stdout and "an earlier question" not in proc.stdout  # last step only
    assert "\033[" not in proc.stdout
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and "</html>" in text
    assert "<script>" not in text and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in text
    assert "class='step kept'" in text and "class='step error'" in text and "class='refined'" in text


def test_trace_cli_step_selection(tmp_path, capsys):
    write_traces(tmp_path)
    assert report.main(["--trace", str(tmp_path), "--step", "1", "--no-color"]) == 0
    printed = capsys.readouterr().out
    assert "an earlier question" in printed and "Compute 2 + 3 * 4." not in printed
    assert report.main(["--trace", str(tmp_path), "--step", "2"]) == 0
    out = capsys.readouterr().out   # no metrics.jsonl beside the traces: no range to check, the steps that have some
    assert "no rectification at step 2" in out and "steps with traces: 1, 3" in out


def test_the_trace_viewer_names_its_step_and_the_others(tmp_path, capsys):
    """The viewer showed the last step's repairs with no word of which step that was, nor that others exist."""
    write_traces(tmp_path)   # repairs at steps 1 and 3
    assert report.main(["--trace", str(tmp_path), "--no-color"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"step 3 of {os.path.relpath(tmp_path)} (the last with repairs): ")
    assert first.endswith("other steps with repairs: 1 (--step N shows one)")


def write_metrics(run_dir, steps):
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward_mean": 0.5}) + "\n" for s in steps))


def test_trace_step_outside_the_run_names_the_range(tmp_path, capsys):
    """`--trace RUN --step 99` on a 3-step run exited 0 without saying which steps exist."""
    write_traces(tmp_path)
    write_metrics(tmp_path, [0, 1, 2, 3])
    assert report.main(["--trace", str(tmp_path), "--step", "99"]) == 2
    err = capsys.readouterr().err
    assert "--step 99" in err and "trained steps 1-3" in err
    assert report.main(["--trace", str(tmp_path), "--step", "2"]) == 0   # trained, but nothing repaired there
    assert "no rectification at step 2" in capsys.readouterr().out


def test_trace_of_a_run_without_repairs_says_so(tmp_path, capsys):
    (tmp_path / "traces.jsonl").write_text("")
    write_metrics(tmp_path, [1, 2])
    assert report.main(["--trace", str(tmp_path)]) == 0
    assert "repaired nothing" in capsys.readouterr().out


def test_plot_and_html_go_next_to_the_run(tmp_path, monkeypatch):
    """`eval.py --plot runs/NAME` (the line scope.py printed) wrote curves.png into the working directory, the
    repository root."""
    monkeypatch.chdir(tmp_path)
    for name in ("a", "b"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        write_metrics(tmp_path / "runs" / name, [1, 2])
    write_traces(tmp_path / "runs" / "a")
    assert report.main(["--plot", "runs/a"]) == 0
    assert report.main(["--plot", "runs/a", "runs/b"]) == 0
    assert report.main(["--trace", "runs/a", "--html", "--no-color"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["runs"]
    assert (tmp_path / "runs" / "a" / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "runs" / "curves_a_b.png").read_bytes()[:4] == b"\x89PNG"
    assert "<!DOCTYPE html>" in (tmp_path / "runs" / "a" / "trace_step3.html").read_text()


def test_cli_evaluates_a_toy_checkpoint(tmp_path):
    """`--benchmarks toy`: held-out toy problems from toy.make_problems, a char-tokenizer model on disk."""
    from harness.data import toy
    from harness.run.runs import append_change
    tok = toy.make_tokenizer()
    ckpt = tmp_path / "runs" / "r" / "checkpoint"   # a run's checkpoint, whose run changed --lr on a resume
    make_tiny_causal_lm(tok).save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    append_change(str(ckpt.parent), 11, {"lr": (1e-4, 1e-3)})
    assert ev.main(["--model", str(ckpt), "--benchmarks", "toy", "--limit", "2", "--n", "1",
                    "--max-new-tokens", "4", "--backend", "hf"]) == 0
    out = tmp_path / "runs" / "r" / "eval_checkpoint.json"   # next to the run
    written = json.loads(out.read_text())
    res = written["benchmarks"]["toy"]
    assert res["num_problems"] == 2 and set(res["pass@k"]) == {"1"}
    assert written["run_config_changes"] == ["from step 11: --lr 0.0001 -> 0.001"]



def test_cli_argument_errors_and_grader_bench(capsys):
    with pytest.raises(SystemExit):
        ev.main(["--benchmarks", "math500"])  # no --model and nothing else to do
    assert "--model is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ev.main(["--model", "x", "--diversity", "--n", "1"])
    assert "--n >= 2" in capsys.readouterr().err
    assert ev.main(["--grader-bench"]) == 0
    assert '"pairs_per_s"' in capsys.readouterr().out


def test_trace_terminal_output_neutralises_escape_sequences():
    """Guards against model text driving the terminal: an ESC in a step or suffix is shown, not executed."""
    record = dict(TRACE, suffixes=["\x1b]0;owned\x07 \x1b[2J then 14"], steps=["a \x1b[31m step"])
    text = report.render_trace_text(record, color=False)
    assert "\x1b" not in text and "\x07" not in text and "\\x1b[2J" in text


def test_cli_reports_a_missing_run_or_benchmark_in_one_line(tmp_path, capsys):
    assert report.main(["--trace", str(tmp_path)]) == 2
    assert "traces.jsonl: no such file" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")   # a model folder, so the benchmark is what is refused
    assert ev.main(["--model", str(tmp_path), "--benchmarks", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl" in capsys.readouterr().err


def test_cli_samples_as_the_training_loops_evaluation(tmp_path, capsys):
    """eval.py draws `--gen-batch-size` rows (default 64, training's --gen-batch-size) per HF generate call, so its
    samples are those of the in-training evaluation (Run.evaluate: HFGenerator(..., 64), batches of 64 problems,
    T = 0.6, seed 0) on one thread; off a terminal it prints one progress line per generate call, and it writes the
    pass@k picture beside its report."""
    from harness.data import toy
    from harness.engines.generate import HFGenerator, load_causal_lm
    tok = toy.make_tokenizer()
    ckpt = tmp_path / "model"
    make_tiny_causal_lm(tok, seed=3).save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    out = tmp_path / "toy_eval.json"
    threads = torch.get_num_threads()
    try:
        assert ev.main(["--model", str(ckpt), "--benchmarks", "toy", "--limit", "12", "--n", "4", "--max-new-tokens",
                        "10", "--batch-size", "8", "--backend", "hf", "--save-samples", "--out", str(out)]) == 0
        assert torch.get_num_threads() == 1   # a tiny CPU model samples on one thread, as the toy world trains
        model, tokenizer = load_causal_lm(str(ckpt), "cpu")
        problems = toy.make_problems(12, seed=0)
        training = ev.evaluate(HFGenerator(model.eval(), tokenizer, 64), tokenizer, problems, n=4, temperature=0.6,
                               max_new_tokens=10, seed=0, batch_size=8, keep_samples=True)
    finally:
        torch.set_num_threads(threads)
    ours = json.loads(out.read_text())["benchmarks"]["toy"]["per_problem"]
    assert [r["samples"] for r in ours] == [r["samples"] for r in training["per_problem"]]
    printed = capsys.readouterr().out
    assert "eval toy: 8/12 problems" in printed and "ETA" in printed and "eval toy: 12/12 problems" in printed
    assert (tmp_path / "toy_eval.png").stat().st_size > 1000


def test_pass_at_k_picture_has_a_line_per_benchmark(tmp_path, monkeypatch):
    """plot_pass_at_k draws pass@k against k for every benchmark of the report (math and out-of-domain)."""
    import matplotlib.axes
    drawn = []
    real = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, x, y, **kw: drawn.append((x, y, kw["label"]))
                        or real(self, x, y, **kw))
    report = {"model": "runs/a/checkpoint", "n": 4, "temperature": 0.6,
              "benchmarks": {"math500": {"pass@k": {"1": 0.25, "2": 0.5, "4": 0.75}}},
              "ood": {"arc-c": {"pass@k": {"1": 0.5, "2": 0.6, "4": 0.7}}}}
    path = eval_cli.plot_pass_at_k(report, str(tmp_path / "r.png"))
    assert os.path.getsize(path) > 1000
    assert drawn == [([1, 2, 4], [25.0, 50.0, 75.0], "math500"), ([1, 2, 4], [50.0, 60.0, 70.0], "arc-c")]


def test_an_earlier_report_is_kept_and_the_out_path_is_checked_before_the_work(tmp_path, capsys, monkeypatch):
    """eval.py silently replaced an earlier report (a 500 × 4 one became 8 × 1) and found an unwritable --out
    only after the whole evaluation; its model column said `checkpoint` for every run."""
    bench = tmp_path / "one.jsonl"
    bench.write_text(json.dumps({"question": "What is 1 + 1?", "answer": "2"}) + "\n")
    out = tmp_path / "res.json"
    out.write_text('{"earlier": true}')
    (tmp_path / "runs" / "r" / "checkpoint").mkdir(parents=True)
    (tmp_path / "runs" / "r" / "checkpoint" / "config.json").write_text("{}")
    loaded = []
    monkeypatch.setattr(eval_cli, "make_generator", lambda *a, **k: loaded.append(a) or (_ for _ in ()).throw(OSError))
    argv = ["--model", str(tmp_path / "runs" / "r" / "checkpoint"), "--benchmarks", str(bench), "--out", str(out)]
    assert ev.main(argv) == 2
    assert capsys.readouterr().err == (f"eval.py: {out} already holds a report; pass --overwrite to replace it, or "
                                       f"--out another path\n")
    assert out.read_text() == '{"earlier": true}' and loaded == []   # nothing loaded, nothing replaced
    (tmp_path / "file").write_text("")
    assert ev.main(argv[:-1] + [str(tmp_path / "file" / "res.json")]) == 2
    assert "cannot write there" in capsys.readouterr().err and loaded == []
    assert ev.main(argv + ["--overwrite"]) == 2 and len(loaded) == 1   # --overwrite: on to the model
    assert eval_cli.model_label(str(tmp_path / "runs" / "r" / "checkpoint")) == "r"
    assert eval_cli.model_label("Qwen/Qwen2.5-Math-1.5B") == "Qwen2.5-Math-1.5B"


# ---- eval.py refuses in one line what the input alone decides, before any model loads ----

@pytest.fixture
def no_model_load(monkeypatch):
    """eval_cli.make_generator replaced by a recorder that fails the test's expectations if it is ever reached."""
    loaded = []
    monkeypatch.setattr(eval_cli, "make_generator", lambda *a, **k: loaded.append(a) or (_ for _ in ()).throw(OSError("x")))
    return loaded


def refusal(argv, capsys) -> str:
    """eval.py's one-line refusal (exit 2) of argv, whether argparse or the pre-flight gives it."""
    try:
        rc = ev.main(argv)
    except SystemExit as exit_:
        rc = exit_.code
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, (rc, err)
    return err.strip()


def test_bad_values_and_paths_are_refused_before_the_model_loads(tmp_path, monkeypatch, capsys, no_model_load):
    """--n 0, --limit 0 and --temperature -1 were refused only after the model loaded; a typo'd checkpoint path got
    no "did you mean", a run folder a tokenizer message, a lower-case alias the hub's retries."""
    monkeypatch.chdir(tmp_path)
    for d in ("checkpoint", "model"):
        (tmp_path / "runs" / "r" / d).mkdir(parents=True)
        (tmp_path / "runs" / "r" / d / "config.json").write_text("{}")
    base = ["--model", "runs/r/checkpoint", "--benchmarks", "toy"]
    assert refusal(base + ["--n", "0"], capsys).startswith("eval.py: --n 0: must be an integer >= 1")
    assert refusal(base + ["--limit", "0"], capsys).startswith("eval.py: --limit 0: must be an integer >= 1")
    assert refusal(base + ["--temperature", "-1"], capsys).startswith("eval.py: --temperature -1.0: must be >= 0")
    assert "did you mean --benchmarks?" in refusal(base + ["--benchmark", "toy"], capsys)
    assert "no such folder (did you mean runs/r/checkpoint?)" in refusal(["--model", "runs/r/checkpont"], capsys)
    assert "(did you mean Qwen2.5-1.5B?)" in refusal(["--model", "qwen2.5-1.5b"], capsys)
    line = refusal(["--model", "runs/r", "--benchmarks", "toy"], capsys)
    assert line.startswith("eval.py: --model runs/r: a run folder, not a model; pass runs/r/checkpoint (")
    assert "runs/r/model (" in line
    assert "only for a data set of your own" in refusal(base + ["--question-field", "q"], capsys)
    assert no_model_load == []


def test_no_network_is_one_line_at_once_for_a_model_or_a_benchmark(tmp_path, monkeypatch, capsys, no_model_load):
    """Without network a missing model id cost 55 s of hub retries and the alias Qwen2.5-1.5B was asked for without
    `Qwen/`; a hub benchmark cost 34 s with no hint. The alias resolves as scope.py resolves it (preflight.model_id),
    and both stop at once, naming what to do."""
    import time

    from harness.run import preflight
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(preflight, "offline_now", lambda: True)   # no hub within 3 s (preflight.hub_reachable)
    monkeypatch.setattr(preflight, "in_hub_cache", lambda name: False)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    start = time.time()
    line = refusal(["--model", "Qwen2.5-1.5B", "--benchmarks", "toy"], capsys)
    assert "no network" in line and "'Qwen/Qwen2.5-1.5B' is neither a local folder nor in the local cache" in line
    line = refusal(["--model", "m", "--benchmarks", "math500"], capsys)
    assert line.startswith("eval.py: --benchmarks math500: no network") and "pass a local .jsonl file" in line
    assert time.time() - start < 15 and no_model_load == []
    assert preflight.check_model_name("--model", "Qwen2.5-1.5B") == preflight.model_id("Qwen2.5-1.5B") == \
        "Qwen/Qwen2.5-1.5B"
    (tmp_path / "a").mkdir()   # a LoRA checkpoint whose base is a hub id: the base is what must be cached
    (tmp_path / "a" / "adapter_config.json").write_text('{"base_model_name_or_path": "Qwen/Qwen2.5-1.5B"}')
    line = refusal(["--model", "a", "--benchmarks", "toy"], capsys)
    assert line.startswith("eval.py: --model a: its base Qwen/Qwen2.5-1.5B: no network") and no_model_load == []


def test_the_data_and_prompt_flags_are_scopes_own(tmp_path, monkeypatch):
    """eval.py had no --question-field, --answer-field or --system-prompt, so it refused the JSONL a run trained
    on; they are one definition (harness/run/cli.py DATA_FLAGS) that scope.py's Args and eval.py both read."""
    from dataclasses import fields

    import scope
    from harness.run import cli
    parser_flags = {a.dest: (a.default, a.help) for a in eval_cli.make_parser()._actions}
    args_fields = {f.name: (f.default, f.metadata["help"]) for f in fields(scope.Args)}
    for name, (default, text) in cli.DATA_FLAGS.items():
        assert parser_flags[name] == (default, f"{text} (default: {default!r})")
        assert args_fields[name] == (default, text)
    bench = tmp_path / "own.jsonl"
    bench.write_text(json.dumps({"q": "What is 2 + 2?", "a": "4", "question": "not this"}) + "\n")
    seen = {}
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(eval_cli, "make_generator", lambda *a, **k: (None, None))
    monkeypatch.setattr(ev, "evaluate", lambda gen, tok, problems, **kw: seen.update(problems=problems, **kw)
                        or (_ for _ in ()).throw(KeyboardInterrupt))
    assert ev.main(["--model", str(tmp_path), "--benchmarks", str(bench), "--question-field", "q", "--answer-field",
                    "a", "--system-prompt", "Be brief.", "--out", str(tmp_path / "r.json")]) == 130
    assert seen["problems"][0]["question"] == "What is 2 + 2?" and seen["problems"][0]["answer"] == "4"
    assert seen["system"] == "Be brief."


def test_ctrl_c_keeps_the_finished_benchmarks_in_the_report(tmp_path, monkeypatch, capsys):
    """Ctrl-C printed a 24-line traceback and kept nothing; now one line, exit 130, and the report holds the
    benchmarks that finished, marked as interrupted, with the ones left named."""
    done = {"acc": 0.5, "pass@k": {1: 0.5}, "n": 1, "num_problems": 2, "truncated": 0.0, "response_len": 3.0,
            "per_problem": []}
    calls = []

    def evaluate(gen, tok, problems, **kw):
        calls.append(kw["progress"])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return dict(done)

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(eval_cli, "make_generator", lambda *a, **k: (None, None))
    monkeypatch.setattr(ev, "evaluate", evaluate)
    benches = []
    for name in ("a", "b"):
        benches.append(tmp_path / f"{name}.jsonl")
        benches[-1].write_text(json.dumps({"question": "1 + 1?", "answer": "2"}) + "\n")
    out = tmp_path / "r.json"
    assert ev.main(["--model", str(tmp_path), "--benchmarks", ",".join(map(str, benches)), "--n", "1",
                    "--out", str(out)]) == 130
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"eval.py: interrupted: {out} holds the 1 finished benchmark(s)") and "\n" not in err
    report = json.loads(out.read_text())
    assert report["interrupted"] is True and list(report["benchmarks"]) == [str(benches[0])]
    assert report["not_evaluated"] == [str(benches[1])]
    calls.clear()
    monkeypatch.setattr(ev, "evaluate", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    assert ev.main(["--model", str(tmp_path), "--benchmarks", str(benches[0]), "--out", str(tmp_path / "s.json")]) \
        == 130
    assert "no report written" in capsys.readouterr().err and not (tmp_path / "s.json").exists()


def test_a_log_file_gets_no_loading_bar(tmp_path, capsys):
    """transformers' "Loading weights" bar (carriage returns) went into eval.py's log file; off a terminal it is
    off, as in scope.py (progress.bars_only_on_a_terminal)."""
    from transformers.utils import logging as hf_logging

    from harness.data import toy
    tok = toy.make_tokenizer()
    make_tiny_causal_lm(tok).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    hf_logging.enable_progress_bar()
    assert ev.main(["--model", str(tmp_path / "m"), "--benchmarks", "toy", "--limit", "1", "--n", "1",
                    "--max-new-tokens", "2", "--backend", "hf", "--system-prompt", "Be brief."]) == 0
    captured = capsys.readouterr()
    assert "Loading weights" not in captured.err and "\r" not in captured.err
    assert "note: --system-prompt 'Be brief.' is not used: the tokenizer has no chat template" in captured.out


# ---- a TRL user's habits: the run folder, an --out folder, a LoRA checkpoint, TRL's names, --help's defaults ----

def run_folder_with(root, *models) -> str:
    """runs/r as scope.py leaves it: its config.json (the run's flags and environment) and the model folders."""
    run = root / "runs" / "r"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"mode": "scope", "steps": 2, "environment": {"python": "3"}}))
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    for d in models:
        (run / d).mkdir()
        (run / d / "config.json").write_text('{"model_type": "qwen2"}')
    return str(run)


def test_a_run_folder_is_known_by_what_it_holds(tmp_path, monkeypatch, capsys, no_model_load):
    """`eval.py --model runs/NAME` (TRL's output_dir habit) gave a 5-line tokenizer error: the pointer to checkpoint/
    and model/ looked for a folder without config.json, and every run folder has one (the run's flags). A run folder
    is refused in one line naming both (they are different models: the last checkpoint and the finished export; the
    report is written beside the one evaluated), and one with neither says it has no model yet."""
    monkeypatch.chdir(tmp_path)
    run_folder_with(tmp_path, "checkpoint", "model")
    line = refusal(["--model", "runs/r", "--benchmarks", "toy"], capsys)
    assert line == ("eval.py: --model runs/r: a run folder, not a model; pass runs/r/checkpoint (its last checkpoint, "
                    "which --resume continues) or runs/r/model (the model it wrote when it finished)")
    shutil.rmtree(tmp_path / "runs")
    run_folder_with(tmp_path)
    assert refusal(["--model", "runs/r/", "--benchmarks", "toy"], capsys) == (
        "eval.py: --model runs/r/: a run folder with no model yet (it stopped before its first checkpoint was saved)")
    assert no_model_load == []


def test_an_out_folder_is_refused_before_the_work(tmp_path, monkeypatch, capsys, no_model_load):
    """`--out FOLDER --overwrite` evaluated everything, then failed with "Is a directory" and the results were lost;
    without --overwrite it said the folder "already holds a report". A folder (or a path ending in /) is one line
    up front, naming a file path inside it."""
    monkeypatch.chdir(tmp_path)
    run_folder_with(tmp_path, "checkpoint")
    (tmp_path / "results").mkdir()
    base = ["--model", "runs/r/checkpoint", "--benchmarks", "toy"]
    for out in (["--out", "results"], ["--out", "results", "--overwrite"], ["--out", "new/"]):
        line = refusal(base + out, capsys)
        assert line.startswith(f"eval.py: --out {out[1]}: a folder; the report is a JSON file: pass --out "
                               f"{os.path.join(out[1], 'eval_checkpoint.json')}"), line
    assert no_model_load == [] and os.listdir(tmp_path / "results") == [] and not (tmp_path / "new").exists()


def test_a_lora_checkpoint_is_evaluated_on_its_base(tmp_path, monkeypatch, capsys):
    """A LoRA run's checkpoint/ (the README's eval pattern) was refused: "no config.json in that folder". It holds
    the adapter: eval.py evaluates it merged into the base that adapter_config.json names, as the run's model/ holds
    it, so both draw the same samples; --backend vllm (which loads a model folder) is one line naming model/."""
    from types import SimpleNamespace

    from harness.data import toy
    from harness.engines import lora
    from harness.run import wiring
    from harness.run.runs import save_checkpoint

    base = toy.cache_path(os.path.join(REPO, "cache"), seed=0)   # the shipped toy warm start
    args = SimpleNamespace(lora_rank=4, lora_alpha=0.0, lora_targets=lora.TARGETS, kl_coef=0.0, lr=1e-2,
                           gradient_checkpointing=False, fused_adamw=False)
    torch.manual_seed(0)
    policy, tokenizer, _ = wiring.load_policy(args, base, base, "cpu")
    with torch.no_grad():   # an adapter that moves the policy: B away from 0
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    save_checkpoint(str(run), 1, lora.Saved(policy), tokenizer, wiring.make_optimizer(args, policy, "cpu"))
    (run / "config.json").write_text(json.dumps({"toy": True, "lora_rank": 4, "environment": {}}))
    merged = lora.export_merged(str(run / "checkpoint"))
    merged.save_pretrained(tmp_path / "merged")
    tokenizer.save_pretrained(tmp_path / "merged")
    flags = ["--benchmarks", "toy", "--limit", "3", "--n", "2", "--max-new-tokens", "12", "--backend", "hf",
             "--save-samples"]
    threads = torch.get_num_threads()
    try:
        assert ev.main(["--model", "runs/r/checkpoint", *flags]) == 0
        assert ev.main(["--model", "merged", *flags, "--out", "merged.json"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert "runs/r/checkpoint: a LoRA adapter, evaluated merged into its base" in capsys.readouterr().out
    ours = json.loads((run / "eval_checkpoint.json").read_text())["benchmarks"]["toy"]["per_problem"]
    theirs = json.loads((tmp_path / "merged.json").read_text())["benchmarks"]["toy"]["per_problem"]
    assert [r["samples"] for r in ours] == [r["samples"] for r in theirs] and len(ours) == 3
    assert refusal(["--model", "runs/r/checkpoint", "--backend", "vllm", "--benchmarks", "toy"], capsys) == (
        "eval.py: --model runs/r/checkpoint: a LoRA adapter, which eval.py evaluates on its base with HF generate; "
        "pass --backend hf, or the run's merged model (runs/r/model: python -m harness.run.export runs/r writes it) for "
        "vLLM")


def test_trl_names_are_taken_or_hinted(tmp_path, monkeypatch, capsys, no_model_load):
    """eval.py had no TRL names: `--num_generations 4` was told "did you mean --max-new-tokens?". TRL's names of the
    same meaning are taken as ours, our own flags with underscores too (as scope.py takes them); the others are one
    line naming ours."""
    args = eval_cli.parse_args(["--model_name_or_path", "m", "--max_completion_length", "7", "--top_p", "0.5",
                          "--vllm_gpu_memory_utilization=0.5", "--batch_size", "3"])
    assert (args.model, args.max_new_tokens, args.top_p, args.vllm_mem, args.batch_size) == ("m", 7, 0.5, 0.5, 3)
    assert refusal(["--model", "m", "--num_generations", "4"], capsys) == (
        "eval.py: unknown flag --num_generations: TRL's name; did you mean --n? (samples per problem, for avg@n and "
        "pass@k) (python eval.py --help lists every flag)")
    assert "did you mean --out? (ours is the report's JSON file" in refusal(["--model", "m", "--output_dir", "x"],
                                                                            capsys)
    assert "no such flag here (nucleus sampling only (--top-p))" in refusal(["--model", "m", "--top_k", "5"], capsys)


def test_help_shows_the_defaults(capsys):
    """`eval.py --help` showed no defaults (--n 8, --temperature 0.6, --max-new-tokens 1024, --batch-size 64)."""
    with pytest.raises(SystemExit):
        eval_cli.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, default in (("--n N", "8"), ("--temperature TEMPERATURE", "0.6"), ("--batch-size BATCH_SIZE", "64"),
                          ("--max-new-tokens MAX_NEW_TOKENS", "1024"), ("--seed SEED", "0")):
        entry = text.split(flag + " ", 1)[1].split(" --", 1)[0]
        assert entry.endswith(f"(default: {default})"), (flag, entry)
    assert "(default: None)" not in text and "(default: False)" not in text
