"""problems.py — the problems a run trains and is evaluated on: the benchmark table and the loader.

What it owns (SCOPE, Ren et al. 2026, arXiv 2602.24110):
  1. `BENCHMARKS`: the paper's benchmarks and training sets by name, one table row each (where the data
     lives on the Hugging Face hub, which split, which fields hold the question and the answer). Table 1:
     AIME24, AIME25, AMC, MATH-500, Minerva, OlympiadBench; out of domain: ARC-c, GPQA-diamond, MMLU-Pro;
     for training: MATH (lighteval) and GSM8K.
  2. `load_problems(source)`: a name in BENCHMARKS, any Hugging Face dataset id ("owner/name[:config]"), a
     local .jsonl/.json file, or "toy" (the CPU toy world, toy.make_problems) -> a list of
     {"id", "question", "answer"} records, plus "choices" for multiple choice (the answer is then the letter).
  3. The row checks and error rules. A row with a missing or empty question or answer, a .jsonl line that
     is not JSON, or text that is not UTF-8 raises ValueError naming the file (or benchmark) and the line
     (JSONL and a .json file's bytes; a .json or hub row otherwise by its 1-based row number). With
     skip_bad=True such rows are dropped and their count and the first reason are reported through
     warnings.warn (one line). A missing local file (FileNotFoundError), an unknown name (ValueError) and
     a gated data set such as GPQA (RuntimeError: accept the terms and log in) each get their own message.

How to use:
  from harness.data.problems import load_problems
  load_problems("math500"); load_problems("my_problems.jsonl", limit=50, skip_bad=True); load_problems("toy")

Choices the paper leaves open:
  1. Field names come from the BENCHMARKS row, else are auto-detected from _QUESTION_FIELDS /
     _ANSWER_FIELDS / _SOLUTION_FIELDS; with no answer column the last \\boxed{} of a solution is the answer
     (grader.extract_answer), and a GSM8K-style "... #### 42" answer keeps the text after "####".
  2. Gold answers are strings: 142.0 -> "142", a list (OlympiadBench final_answer) -> its first item,
     surrounding $ removed.
  3. Multiple-choice questions are asked with their options appended as "A. ...", one per line, and an
     instruction to box the letter; they are graded on the boxed letter. GPQA's options are shuffled
     deterministically from the record id (the dataset lists the correct answer first).
  4. Rows without an id get "<source name>-<row number>".
"""
import hashlib                  # deterministic choice shuffles
import json
import os
import random                   # deterministic choice shuffles
import warnings                 # skipped-row reports

from harness.data.grader import _BOX_RE, extract_answer

_MC_INSTRUCTION = "Answer with the letter of the correct option in \\boxed{}."
_LETTERS = "ABCDEFGHIJKLMNOP"

# name -> where the data lives and how to read it. "answer_from": "field" (the answer column as is),
# "boxed" (last \boxed{} of the column), "gsm8k" (text after the last "####"), "letter" (a letter/index key
# into "choices"), "first_choice" (the correct option is the first of "choices"; shuffled per id).
# Field names marked (auto) were not verified against the Hub: the auto-detection lists are tried too.
BENCHMARKS: dict[str, dict] = {
    "math500":    {"hf_id": "HuggingFaceH4/MATH-500", "config": None, "split": "test", "kind": "math",
                   "question": "problem", "answer": "answer", "answer_from": "field", "id": "unique_id"},
    "aime24":     {"hf_id": "HuggingFaceH4/aime_2024", "config": None, "split": "train", "kind": "math",
                   "question": "problem", "answer": "answer", "answer_from": "field", "id": "id"},
    "aime25":     {"hf_id": "opencompass/AIME2025", "config": ["AIME2025-I", "AIME2025-II"], "split": "test",
                   "kind": "math", "question": "question", "answer": "answer", "answer_from": "field", "id": None},
    "amc":        {"hf_id": "AI-MO/aimo-validation-amc", "config": None, "split": "train", "kind": "math",
                   "question": "problem", "answer": "answer", "answer_from": "field", "id": "id"},
    "minerva":    {"hf_id": "math-ai/minervamath", "config": None, "split": "test", "kind": "math",
                   "question": "question", "answer": "answer", "answer_from": "field", "id": None},  # (auto)
    "olympiad":   {"hf_id": "math-ai/olympiadbench", "config": None, "split": "test", "kind": "math",
                   "question": "question", "answer": "final_answer", "answer_from": "field", "id": "id"},  # (auto)
    "math-train": {"hf_id": "DigitalLearningGmbH/MATH-lighteval", "config": "default", "split": "train",
                   "kind": "math", "question": "problem", "answer": "solution", "answer_from": "boxed", "id": None},
    "gsm8k":      {"hf_id": "openai/gsm8k", "config": "main", "split": "test", "kind": "math",
                   "question": "question", "answer": "answer", "answer_from": "gsm8k", "id": None},
    "arc-c":      {"hf_id": "allenai/ai2_arc", "config": "ARC-Challenge", "split": "test", "kind": "mc",
                   "question": "question", "answer": "answerKey", "answer_from": "letter", "id": "id",
                   "choices": "choices"},                  # choices = {"text": [...], "label": [...]}
    "gpqa":       {"hf_id": "Idavidrein/gpqa", "config": "gpqa_diamond", "split": "train", "kind": "mc",
                   "question": "Question", "answer": "Correct Answer", "answer_from": "first_choice",
                   "id": "Record ID", "gated": True,
                   "choices": ["Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"]},
    "mmlu-pro":   {"hf_id": "TIGER-Lab/MMLU-Pro", "config": None, "split": "test", "kind": "mc",
                   "question": "question", "answer": "answer", "answer_from": "letter", "id": "question_id",
                   "choices": "options"},
}
_QUESTION_FIELDS = ("question", "problem", "prompt", "Problem", "Question", "query")
_ANSWER_FIELDS = ("answer", "final_answer", "Answer", "ground_truth", "gt", "target")
_SOLUTION_FIELDS = ("solution", "Solution", "reference_solution")
_ID_FIELDS = ("id", "unique_id", "ID", "idx", "problem_idx", "question_id")


def _answer_text(value) -> str:
    """A gold answer as a string: 142.0 -> "142"; a list (OlympiadBench final_answer) -> its first item."""
    if isinstance(value, (list, tuple)):
        value = value[0] if len(value) else ""
    if isinstance(value, bool) or value is None:
        return ""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, int):
        return str(value)
    return value.strip().strip("$").strip() if isinstance(value, str) else ""


def _pick(row: dict, preferred, candidates):
    """(field name, value) of the first present, non-empty field: `preferred` first, then `candidates`."""
    for name in ([preferred] if preferred else []) + list(candidates):
        value = row.get(name)
        if value not in (None, "", [], ()):
            return name, value
    return None, None


def _mc_options(row: dict, spec: dict, rid: str) -> tuple[list[str], str]:
    """(option texts, gold letter) of a multiple-choice row."""
    field = spec.get("choices")
    if spec.get("answer_from") == "first_choice":                     # GPQA: one column per option
        options = [str(row.get(f, "")).strip() for f in field]
        order = list(range(len(options)))
        random.Random(int(hashlib.sha256(rid.encode()).hexdigest()[:16], 16)).shuffle(order)
        return [options[k] for k in order], _LETTERS[order.index(0)]
    choices = row.get(field if field else "choices", row.get("options"))
    labels = None
    if isinstance(choices, dict):                                     # ARC: {"text": [...], "label": [...]}
        labels, choices = [str(x) for x in choices.get("label", [])], choices.get("text", [])
    if not isinstance(choices, (list, tuple)) or not choices or len(choices) > len(_LETTERS):
        raise ValueError("no usable list of choices")
    key = row.get(spec.get("answer") or "answer")
    if isinstance(key, bool) or key in (None, ""):
        raise ValueError("missing answer key")
    key = str(key).strip()
    if labels and key in labels:
        index = labels.index(key)
    elif key.isdigit() and not labels:
        index = int(key)                                              # a 0-based answer index
    elif len(key) == 1 and key.upper() in _LETTERS:
        index = _LETTERS.index(key.upper())
    else:
        raise ValueError(f"answer key {key!r} is not a letter or index")
    if not 0 <= index < len(choices):
        raise ValueError(f"answer key {key!r} out of range for {len(choices)} choices")
    return [str(c).strip() for c in choices], _LETTERS[index]


def _record(row, spec: dict, index: int, name: str) -> dict:
    """One {"id", "question", "answer"(, "choices")} record; ValueError (without the location) if bad."""
    if not isinstance(row, dict):
        raise ValueError(f"row is a {type(row).__name__}, not an object")
    _, question = _pick(row, spec.get("question"), () if "question" in spec.get("named", ()) else _QUESTION_FIELDS)
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"missing or empty question (looked for {spec.get('question') or _QUESTION_FIELDS})")
    _, rid = _pick(row, spec.get("id"), _ID_FIELDS)
    rid = str(rid) if rid is not None else f"{name}-{index}"
    record = {"id": rid, "question": question.strip()}
    mc = spec.get("kind") == "mc" or (not spec and isinstance(row.get("choices", row.get("options")), (list, dict)))
    if mc:
        choices, letter = _mc_options(row, spec, rid)
        lines = "\n".join(f"{_LETTERS[k]}. {c}" for k, c in enumerate(choices))
        record.update(question=f"{record['question']}\n\n{lines}\n\n{_MC_INSTRUCTION}", answer=letter,
                      choices=choices)
        return record
    how = spec.get("answer_from", "field")
    if how == "boxed":
        answer = extract_answer(str(row.get(spec["answer"], ""))) or ""
    elif how == "gsm8k":                                              # "...reasoning...\n#### 1,234"
        text = str(row.get(spec["answer"], ""))
        answer = text.rsplit("####", 1)[-1].replace(",", "") if "####" in text else ""
    else:
        named = "answer" in spec.get("named", ())   # a field the user named: no other field is taken instead
        field, value = _pick(row, spec.get("answer"), () if named else _ANSWER_FIELDS)
        if field is None and not named:                               # no answer column: box of a solution
            _, solution = _pick(row, None, _SOLUTION_FIELDS)
            value = extract_answer(solution) if isinstance(solution, str) else None
        answer = _answer_text(value)
        if "####" in answer:                                          # GSM8K-style answer column
            answer = answer.rsplit("####", 1)[-1]
        elif _BOX_RE.search(answer):
            answer = extract_answer(answer) or ""
    answer = _answer_text(answer)
    if not answer:
        looked = spec.get("answer") or _ANSWER_FIELDS + _SOLUTION_FIELDS
        raise ValueError(f"missing or empty answer (looked for {looked})")
    record["answer"] = answer
    return record


class _BadLine(str):
    """A .jsonl line that could not be read (invalid JSON, not UTF-8): the reason. load_problems raises it
    with the file and line, or skips it with skip_bad=True."""


def _read_local(path: str) -> list[tuple[int, object]]:
    """[(row number, row)] of a .jsonl (row number = line number; an unreadable line is a _BadLine) or .json
    (a list, or {"...": [rows]}). Text must be UTF-8: an error names the file and the line."""
    with open(path, "rb") as f:
        raw = f.read()
    if path.endswith(".jsonl"):
        rows = []
        for lineno, line in enumerate(raw.split(b"\n"), start=1):
            try:
                text = line.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                rows.append((lineno, _BadLine(f"not UTF-8 text (byte {line[e.start]:#04x} at column {e.start + 1})")))
                continue
            if text.strip():
                try:
                    rows.append((lineno, json.loads(text)))
                except json.JSONDecodeError as e:
                    rows.append((lineno, _BadLine(f"invalid JSON ({e.msg})")))
        return rows
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ValueError(f"{path}: line {line}: not UTF-8 text (byte {raw[e.start]:#04x})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON at line {e.lineno} ({e.msg})") from None
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise ValueError(f"{path}: expected a list of rows or an object holding one list")
        data = lists[0]
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of rows")
    return list(enumerate(data, start=1))


def _read_hf(hf_id: str, config, split: str | None) -> list[tuple[int, object]]:
    """[(row number, row)] of a Hugging Face dataset (several configs are concatenated)."""
    import datasets  # lazy: only the HF path needs it

    rows = []
    for cfg in (config if isinstance(config, list) else [config]):
        ds = datasets.load_dataset(hf_id, cfg, split=split) if split else datasets.load_dataset(hf_id, cfg)
        if isinstance(ds, dict):                                      # no split given: prefer test, then train
            key = next((k for k in ("test", "validation", "train") if k in ds), next(iter(ds), None))
            if key is None:
                raise ValueError(f"{hf_id}: the dataset has no splits")
            ds = ds[key]
        rows.extend(dict(r) for r in ds)
    return list(enumerate(rows, start=1))


def maybe_cached(source: str) -> bool:
    """False when a hub data set (a BENCHMARKS name or "owner/name[:config]") is surely not on this machine: no
    folder of it in the hub cache nor in the datasets cache, so loading it needs the network. Checked without
    importing `datasets` (seconds), so that an offline run says so at once."""
    from huggingface_hub import constants

    hf_id = BENCHMARKS[source]["hf_id"] if source in BENCHMARKS else source.partition(":")[0]
    owner, _, name = hf_id.partition("/")
    datasets_cache = os.environ.get("HF_DATASETS_CACHE") or os.path.join(constants.HF_HOME, "datasets")
    wanted = {(constants.HF_HUB_CACHE, f"datasets--{owner}--{name}".lower()),
              (datasets_cache, f"{owner}___{name}".lower())}
    for folder, entry in wanted:
        if os.path.isdir(folder) and entry in (e.lower() for e in os.listdir(folder)):
            return True
    return False


def load_problems(source: str, split: str | None = None, limit: int | None = None, *,
                  skip_bad: bool = False, question_field: str = "", answer_field: str = "") -> list[dict]:
    """Problems as [{"id", "question", "answer"}] (+ "choices" for multiple choice; the answer is a letter).

    source: "toy" (toy.make_problems; split "train" uses seed 1, anything else seed 0), a name in
    BENCHMARKS, a local .jsonl/.json file, or a Hugging Face dataset id ("owner/name" or "owner/name:config";
    split defaults to test, else validation, else train). limit keeps the first `limit` good rows.
    A row with a missing/empty question or answer raises ValueError naming the source and row number
    (the line number for JSONL); with skip_bad=True such rows are skipped and their count is reported
    through warnings.warn. Split is ignored for local files. Multiple-choice rows (a "choices"/"options"
    list, or {"text", "label"} as in ARC) take their key as a letter, a label, or a 0-based index.
    question_field / answer_field: the columns of a local file or hub id to read (then no other column is tried);
    without them the usual names are tried in order (question, problem, prompt, ...; answer, final_answer, ...)."""
    if limit is not None and limit < 0:
        raise ValueError(f"load_problems: limit must be >= 0, got {limit}")
    if source == "toy":
        from harness.data import toy  # lazy: the toy world is only needed for the toy benchmark

        return toy.make_problems(500 if limit is None else limit, seed=1 if split == "train" else 0)
    spec, name = {}, os.path.splitext(os.path.basename(source))[0]
    if source in BENCHMARKS:
        spec, name = BENCHMARKS[source], source
        try:
            rows = _read_hf(spec["hf_id"], spec["config"], split or spec["split"])
        except Exception as e:
            if not spec.get("gated"):
                raise
            raise RuntimeError(f"load_problems: {source} ({spec['hf_id']}) is gated on the Hugging Face hub: "
                               f"accept its terms on the dataset page and log in (`hf auth login` or "
                               f"`huggingface-cli login`). "
                               f"[{type(e).__name__}: {e}]") from e
    elif os.path.exists(source):
        rows = _read_local(source)
    elif source.endswith((".json", ".jsonl")):
        raise FileNotFoundError(f"load_problems: no such file {source!r}")
    elif "/" in source:
        hf_id, _, config = source.partition(":")
        rows = _read_hf(hf_id, config or None, split)
    else:
        raise ValueError(f"load_problems: unknown source {source!r}: not a file, not 'toy', not one of "
                         f"{sorted(BENCHMARKS)} and not a Hugging Face id 'owner/name'")
    named = {k: v for k, v in (("question", question_field), ("answer", answer_field)) if v}
    if named and source not in BENCHMARKS:
        spec = dict(named, named=tuple(named))
    problems, bad = [], []
    for rowno, row in rows:
        if limit is not None and len(problems) >= limit:
            break
        try:
            if isinstance(row, _BadLine):   # an unreadable .jsonl line: reported or skipped like a bad row
                raise ValueError(str(row))
            problems.append(_record(row, spec, rowno, name))
        except ValueError as e:
            where = "line" if source.endswith(".jsonl") else "row"
            if not skip_bad:
                raise ValueError(f"{source}: {where} {rowno}: {e}") from None
            bad.append(f"{where} {rowno}: {e}")
    if bad:
        warnings.warn(f"load_problems: skipped {len(bad)} bad row(s) of {source} (first: {bad[0]})", stacklevel=2)
    return problems
