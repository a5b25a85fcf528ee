"""Tests of problems.py: load_problems, BENCHMARKS, the row checks and error rules.

Nothing is downloaded: local files are written to tmp_path, and the Hugging Face path runs against a fake
`datasets.load_dataset` installed with monkeypatch."""
import json
import sys
import types

import pytest

from harness.data import problems as P
from harness.data.grader import grade


def write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_jsonl_with_auto_detected_fields(tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", [
        {"problem": "1+1?", "answer": "2", "unique_id": "a"},
        {"question": "2+2?", "final_answer": ["$4$"]},                       # OlympiadBench-style list
        {"Problem": "half?", "solution": "It is \\boxed{\\frac{1}{2}}."},     # no answer column: boxed
        {"prompt": "3*3?", "Answer": 9},                                       # numeric answer
        {"question": "GSM?", "answer": "so 3 + 4 = 7\n#### 7"},               # GSM8K style
        {"question": "AMC?", "answer": 142.0},                                 # AMC float answers
    ])
    problems = P.load_problems(src)
    assert [p["answer"] for p in problems] == ["2", "4", "\\frac{1}{2}", "9", "7", "142"]
    assert [p["question"] for p in problems][:2] == ["1+1?", "2+2?"]
    assert problems[0]["id"] == "a" and problems[1]["id"] == "p-2"


def test_json_list_and_limit(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"question": f"q{i}", "answer": str(i)} for i in range(5)]))
    assert [p["answer"] for p in P.load_problems(str(path), limit=3)] == ["0", "1", "2"]
    path.write_text(json.dumps({"data": [{"question": "q", "answer": "1"}]}))
    assert P.load_problems(str(path))[0]["answer"] == "1"


def test_blank_lines_are_ignored_but_counted(tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", [{"question": "a", "answer": "1"}, "", {"question": "", "answer": "2"}])
    with pytest.raises(ValueError, match=r"p\.jsonl: line 3: missing or empty question"):
        P.load_problems(src)


@pytest.mark.parametrize("row,message", [
    ({"question": "q"}, "missing or empty answer"),
    ({"question": "q", "answer": ""}, "missing or empty answer"),
    ({"question": "  ", "answer": "1"}, "missing or empty question"),
    ({"answer": "1"}, "missing or empty question"),
    ({"question": "q", "answer": None}, "missing or empty answer"),
    ([1, 2], "not an object"),
])
def test_bad_row_names_source_and_line(tmp_path, row, message):
    src = write_jsonl(tmp_path / "bad.jsonl", [{"question": "ok", "answer": "1"}, row])
    with pytest.raises(ValueError) as info:
        P.load_problems(src)
    assert "bad.jsonl: line 2" in str(info.value) and message in str(info.value)


def test_skip_bad_reports_the_count(tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", [{"question": "a", "answer": "1"}, {"question": "b"},
                                             {"question": "", "answer": "3"}, {"question": "d", "answer": "4"}])
    with pytest.warns(UserWarning, match=r"skipped 2 bad row\(s\).*line 2"):
        problems = P.load_problems(src, skip_bad=True)
    assert [p["answer"] for p in problems] == ["1", "4"]


def test_invalid_json_line_names_file_and_line(tmp_path):
    src = write_jsonl(tmp_path / "p.jsonl", [{"question": "a", "answer": "1"}, "{not json"])
    with pytest.raises(ValueError, match=r"p\.jsonl: line 2: invalid JSON"):
        P.load_problems(src)


def test_load_problems_names_file_and_line_of_non_utf8(tmp_path):
    """Regression: a non-UTF-8 data file's error had no line number."""
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps({"question": "ok?", "answer": "1"}).encode() + b"\n"
                     + b'{"question": "caf\xe9?", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"latin1\.jsonl: line 2: not UTF-8"):
        P.load_problems(str(path))
    jpath = tmp_path / "latin1.json"
    jpath.write_bytes(b'[\n{"question": "a", "answer": "1"},\n{"question": "caf\xe9", "answer": "2"}\n]')
    with pytest.raises(ValueError, match=r"latin1\.json: line 3: not UTF-8"):
        P.load_problems(str(jpath))
    with pytest.warns(UserWarning, match="line 2: not UTF-8"):
        assert [p["answer"] for p in P.load_problems(str(path), skip_bad=True)] == ["1"]


def test_skip_bad_skips_invalid_json_lines(tmp_path):
    """Regression: `load_problems(..., skip_bad=True)` still raised on an invalid-JSON line."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"question": "a", "answer": "1"}\n{"question": "b", "ans\n{"question": "c", "answer": "3"}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl: line 2: invalid JSON"):
        P.load_problems(str(path))
    with pytest.warns(UserWarning, match="skipped 1 bad row"):
        assert [p["answer"] for p in P.load_problems(str(path), skip_bad=True)] == ["1", "3"]


def test_missing_file_and_unknown_source():
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        P.load_problems("nope.jsonl")
    with pytest.raises(ValueError, match="unknown source 'mathh500'"):
        P.load_problems("mathh500")


def test_local_multiple_choice_rows(tmp_path):
    src = write_jsonl(tmp_path / "mc.jsonl", [
        {"question": "Sky colour?", "choices": ["red", "blue"], "answer": "B"},
        {"question": "Grass?", "choices": ["green", "pink"], "answer": 0},
    ])
    p, q = P.load_problems(src)
    assert p["answer"] == "B" and p["choices"] == ["red", "blue"]
    assert "A. red\nB. blue" in p["question"] and "\\boxed{}" in p["question"]
    assert q["answer"] == "A"
    assert grade("It is \\boxed{(B)}", p["answer"]) and not grade("\\boxed{A}", p["answer"])


REQUIRED = {"hf_id", "config", "split", "question", "answer", "kind"}


def test_benchmark_table_is_complete():
    names = {"math500", "aime24", "aime25", "amc", "minerva", "olympiad", "math-train", "gsm8k",
             "arc-c", "gpqa", "mmlu-pro"}
    assert names <= set(P.BENCHMARKS)
    for name, spec in P.BENCHMARKS.items():
        assert REQUIRED <= set(spec), name
        assert spec["kind"] in ("math", "mc")
    assert P.BENCHMARKS["math-train"]["answer_from"] == "boxed"
    assert {P.BENCHMARKS[n]["kind"] for n in ("arc-c", "gpqa", "mmlu-pro")} == {"mc"}


@pytest.fixture
def fake_hub(monkeypatch):
    """Installs a fake datasets.load_dataset serving rows from `hub[(hf_id, config, split)]`."""
    hub, calls = {}, []

    def load_dataset(hf_id, config=None, split=None):
        calls.append((hf_id, config, split))
        if split is None:
            return {s: rows for (i, c, s), rows in hub.items() if i == hf_id and c == config}
        return hub[(hf_id, config, split)]

    fake = types.ModuleType("datasets")
    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    return hub, calls


def test_math_benchmarks_via_fake_hub(fake_hub):
    hub, calls = fake_hub
    hub[("DigitalLearningGmbH/MATH-lighteval", "default", "train")] = [
        {"problem": "p1", "solution": "so \\boxed{1} then \\boxed{\\frac{3}{4}}", "level": "Level 1"}]
    hub[("openai/gsm8k", "main", "test")] = [{"question": "g", "answer": "work\n#### 1,234"}]
    hub[("opencompass/AIME2025", "AIME2025-I", "test")] = [{"question": "a1", "answer": "70"}]
    hub[("opencompass/AIME2025", "AIME2025-II", "test")] = [{"question": "a2", "answer": "588"}]
    hub[("AI-MO/aimo-validation-amc", None, "train")] = [{"id": 7, "problem": "amc", "answer": 27.0}]
    assert P.load_problems("math-train")[0]["answer"] == "\\frac{3}{4}"
    assert P.load_problems("gsm8k")[0]["answer"] == "1234"
    assert [p["answer"] for p in P.load_problems("aime25")] == ["70", "588"]
    amc = P.load_problems("amc")[0]
    assert amc == {"id": "7", "question": "amc", "answer": "27"}
    assert ("openai/gsm8k", "main", "test") in calls


def test_mc_benchmarks_via_fake_hub(fake_hub):
    hub, _ = fake_hub
    hub[("allenai/ai2_arc", "ARC-Challenge", "test")] = [
        {"id": "x1", "question": "Q?", "choices": {"text": ["a", "b", "c", "d"], "label": ["1", "2", "3", "4"]},
         "answerKey": "3"}]
    hub[("TIGER-Lab/MMLU-Pro", None, "test")] = [
        {"question_id": 5, "question": "M?", "options": [str(k) for k in range(10)], "answer": "J",
         "answer_index": 9}]
    gpqa_row = {"Record ID": "rec42", "Question": "G?", "Correct Answer": "right",
                "Incorrect Answer 1": "w1", "Incorrect Answer 2": "w2", "Incorrect Answer 3": "w3"}
    hub[("Idavidrein/gpqa", "gpqa_diamond", "train")] = [gpqa_row]
    arc = P.load_problems("arc-c")[0]
    assert arc["answer"] == "C" and arc["choices"] == ["a", "b", "c", "d"] and arc["id"] == "x1"
    mmlu = P.load_problems("mmlu-pro")[0]
    assert mmlu["answer"] == "J" and "J. 9" in mmlu["question"]
    g1, g2 = P.load_problems("gpqa")[0], P.load_problems("gpqa")[0]
    assert g1 == g2                                           # the shuffle is deterministic per id
    assert g1["choices"][ord(g1["answer"]) - ord("A")] == "right"
    assert sorted(g1["choices"]) == ["right", "w1", "w2", "w3"]


def test_gpqa_shuffle_spreads_the_correct_letter(fake_hub):
    """Guards against leaving GPQA's correct answer always at A (the dataset lists it first)."""
    hub, _ = fake_hub
    hub[("Idavidrein/gpqa", "gpqa_diamond", "train")] = [
        {"Record ID": f"r{i}", "Question": "G?", "Correct Answer": "right", "Incorrect Answer 1": "w1",
         "Incorrect Answer 2": "w2", "Incorrect Answer 3": "w3"} for i in range(40)]
    letters = {p["answer"] for p in P.load_problems("gpqa")}
    assert len(letters) >= 3


def test_gated_dataset_error_says_what_to_do(fake_hub):
    with pytest.raises(RuntimeError, match="gated.*log in"):
        P.load_problems("gpqa")                   # the fake hub has no gpqa rows: KeyError inside


def test_any_hf_id_and_default_split(fake_hub):
    hub, calls = fake_hub
    hub[("someone/data", None, "train")] = [{"problem": "t", "answer": "1"}]
    hub[("someone/data", None, "test")] = [{"problem": "q", "answer": "2"}]
    assert P.load_problems("someone/data")[0]["answer"] == "2"            # test preferred
    assert P.load_problems("someone/data", split="train")[0]["answer"] == "1"
    hub[("someone/data", "cfg", "test")] = [{"problem": "c", "answer": "3"}]
    assert P.load_problems("someone/data:cfg", split="test")[0]["answer"] == "3"


def test_bad_hf_row_names_source_and_row(fake_hub):
    hub, _ = fake_hub
    hub[("HuggingFaceH4/MATH-500", None, "test")] = [{"problem": "p", "answer": "1"}, {"problem": "p2", "answer": ""}]
    with pytest.raises(ValueError, match="math500: row 2: missing or empty answer"):
        P.load_problems("math500")
    with pytest.warns(UserWarning, match="skipped 1"):
        assert len(P.load_problems("math500", skip_bad=True)) == 1


def test_toy_source_calls_toy_make_problems(monkeypatch):
    calls = []
    fake = types.ModuleType("toy")
    fake.make_problems = lambda n, seed, **kw: calls.append((n, seed)) or [
        {"id": f"t{i}", "question": "q", "answer": "1", "solution_steps": []} for i in range(n)]
    import harness.data
    monkeypatch.setitem(sys.modules, "harness.data.toy", fake)
    monkeypatch.setattr(harness.data, "toy", fake, raising=False)   # `from harness.data import toy` reads it first
    assert len(P.load_problems("toy", limit=3)) == 3
    P.load_problems("toy")
    P.load_problems("toy", split="train", limit=2)
    assert calls == [(3, 0), (500, 0), (2, 1)]


def test_named_fields_read_a_users_own_columns_and_nothing_else(tmp_path):
    """A user's JSONL whose columns have other names could not be trained on: --question-field and
    --answer-field name them; a row without the named column is refused, never read from another column."""
    path = tmp_path / "mine.jsonl"
    path.write_text('{"q": "Start at 3, add 4.", "a": "7", "question": "a decoy", "answer": "9"}\n'
                    '{"q": "Start at 1, add 1."}\n')
    first = P.load_problems(str(path), limit=1, question_field="q", answer_field="a")
    assert [(p["question"], p["answer"]) for p in first] == [("Start at 3, add 4.", "7")]
    with pytest.raises(ValueError, match=r"mine.jsonl: line 2: missing or empty answer \(looked for a\)"):
        P.load_problems(str(path), question_field="q", answer_field="a")
    assert P.load_problems(str(path), limit=1)[0]["question"] == "a decoy"   # without the flags: the usual names
