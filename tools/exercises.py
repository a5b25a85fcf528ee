"""exercises.py — turn this repository into a course assignment: a copy with the solutions taken out.

The reference code marks each exercise's solution region with two comment lines,

    # BEGIN SOLUTION <exercise name>
    ...                                  (the reference solution)
    # END SOLUTION

(nbgrader's convention, keyed by name so that one exercise may span several functions). This script
copies the repository (the files git tracks plus untracked files it does not ignore; without git, every
file but caches) into an output folder and, for each chosen exercise, replaces each of its regions by

    raise NotImplementedError("exercise N (name): <what to write>; check with: python -m pytest ...")

keeping the signature, the docstring and any argument checks outside the region. The regions of the
exercises not chosen keep their reference code (marker lines removed), so `--only` makes a smaller
assignment. The teacher's tools (this file and its contract test) are not copied.

    python -m tools.exercises --list                       # the table: concept, tests, difficulty, depends on
    python -m tools.exercises --out ../assignment          # every exercise (outside the repository)
    python -m tools.exercises --out ../hw1 --only first_error,keep_ratio

`EXERCISES` below is the one table: each exercise's paper concept, the tests that grade it (pytest node
ids; a parametrised test is named once), its difficulty (1 easy … 4 challenge) and the exercises its
tests call (do those first). `breaks` lists every other test that fails while the exercise is a stub
(tests of functions built on it, end-to-end runs), so `expected_failures` of a chosen set is the union of
`tests` and `breaks`: on a generated copy exactly those tests fail, each with NotImplementedError, and
all others pass (tests/test_exercises.py checks this, and lists any unexpected or missing failure).
When a new test calls an exercise's function, add its node id to that exercise's `tests` (or `breaks`,
for a test of something else that merely runs through it).

The reference is public, so these tests are a self-check for students, not a grader: a graded course
should add its own held-out fixtures.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root
NOT_COPIED = ("tools/exercises.py", "tests/test_exercises.py")
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".hypothesis", "runs"}
BEGIN = re.compile(r"^(?P<indent>[ \t]*)# BEGIN SOLUTION (?P<name>[A-Za-z0-9_]+)[ \t]*$")
END = re.compile(r"^[ \t]*# END SOLUTION[ \t]*$")

# end-to-end runs that go through every exercise of the training step (scope.py subprocess smoke runs and
# the toy-world demo): they fail whenever any exercise they reach is a stub
SCOPE_RUNS = ("tests/test_scope.py::test_each_mode_runs_two_toy_steps",
              "tests/test_scope.py::test_resume_reproduces_the_next_step",
              "tests/test_scope.py::test_real_path_on_cpu_with_self_refinement",
              "tests/test_qwen_tokenizer.py::test_scope_run_with_real_tokenizer_models_on_cpu",
              "tests/test_served.py::test_run_goes_on_without_rectification_when_the_refiner_server_stops",
              "tests/test_runs.py::test_resume_after_a_kill_mid_save_and_a_torn_log_line",
              "tests/test_runs.py::test_folder_without_checkpoint_is_resumed_only_on_purpose",
              "tests/test_runs.py::test_resume_below_the_checkpoint_step_is_refused",
              "tests/test_runs.py::test_second_process_on_a_live_run_stops_at_once",
              "tests/test_runs.py::test_second_run_under_the_same_name_is_refused",
              "tests/test_study_flags.py::test_all_fail_only_never_rectifies_a_group_with_a_success",
              "tests/test_study_flags.py::test_any_rectifies_mixed_groups_and_records_group_rewards",
              "tests/test_study_flags.py::test_model_refiner_goes_through_refiner_and_splice",
              "tests/test_dist.py::test_torchrun_toy_run_and_resume_match_one_process")
# the torchrun gradient check runs build_batch, the log-probs, policy_loss and update, no other exercise
DIST_GRADIENTS = ("tests/test_dist.py::test_ddp_and_fsdp2_gradients_equal_the_one_process_gradient",)
# the regression test of an empty failed response runs scope.locate_first_errors: split_steps, cut_point, keep_ratio
# and step_token_spans
FIRST_ERRORS = ("tests/test_runs.py::test_empty_failed_response_keeps_nothing",)


POLICY_LOSS_TESTS = ("tests/test_grpo.py::test_policy_loss_hand_computed",
                     "tests/test_grpo.py::test_policy_loss_without_clipping_is_luffy_ratio",
                     "tests/test_grpo.py::test_policy_loss_gradient_closed_form",
                     "tests/test_grpo.py::test_kl_and_entropy_gradients",
                     "tests/test_grpo.py::test_junk_outside_its_tokens_gives_no_nan",
                     "tests/test_grpo.py::test_policy_loss_matches_loop",
                     "tests/test_grpo.py::test_policy_loss_with_is_weight_by_hand",
                     "tests/test_study_flags.py::test_unit_credit_hand_numbers")
UPDATE_TESTS = ("tests/test_grpo.py::test_update_micro_batches_equal_full_batch",
                "tests/test_grpo.py::test_update_loss_equals_policy_loss",
                "tests/test_grpo.py::test_update_computes_its_loss_with_policy_loss",
                "tests/test_grpo.py::test_update_changes_every_parameter_tiny_qwen2",
                "tests/test_grpo.py::test_update_kl_from_ref_model",
                "tests/test_grpo.py::test_update_without_old_logp_gives_the_separate_pass_gradient",
                "tests/test_grpo.py::test_update_non_finite_guard",
                "tests/test_grpo.py::test_update_weights_policy_tokens_by_the_truncated_ratio")


@dataclass(frozen=True)
class Exercise:
    name: str          # the marker name: `# BEGIN SOLUTION <name>`
    functions: str     # what the student writes (file.py:function)
    concept: str       # the paper's idea it implements
    tests: tuple       # pytest node ids that grade it
    difficulty: int    # 1 easy … 4 challenge
    depends: tuple = ()  # exercises its tests call: do those first
    breaks: tuple = ()   # every other test that fails while it is a stub (they run through it)
    task: str = ""     # one line for the NotImplementedError message


EXERCISES = [
    Exercise("first_error", "prm.py:first_error, prm.py:cut_point",
             "first-error localisation: the first step the PRM scores below τ, and where the kept prefix ends",
             ("tests/test_prm.py::test_first_error", "tests/test_prm.py::test_cut_point"), 1,
             breaks=SCOPE_RUNS + FIRST_ERRORS + ("tests/test_prm.py::test_keep_ratio",
                                  "tests/test_metrics.py::test_near_miss_with_prm_cut_point"),
             task="return the index of the first step scored below tau (first_error) and the cut point"),
    Exercise("keep_ratio", "prm.py:keep_ratio, prm.py:select_candidate",
             "keep ratio κ and picking the most promising failure of a group",
             ("tests/test_prm.py::test_keep_ratio", "tests/test_prm.py::test_select_candidate"), 1,
             depends=("first_error",), breaks=SCOPE_RUNS + FIRST_ERRORS, task="kappa = cut / n_steps; pick by (kappa, prefix mean, length, index)"),
    Exercise("group_advantages", "grpo.py:group_advantages", "GRPO group-relative advantage A = r − mean(r)",
             ("tests/test_grpo.py::test_group_advantages_hand_computed",
              "tests/test_grpo.py::test_group_advantages_ragged_and_edges"), 1,
             breaks=SCOPE_RUNS, task="A = r - mean of its group (optionally / (std + 1e-6))"),
    Exercise("build_batch", "grpo.py:build_batch",
             "token-space batch layout: prompt + response, response and off-policy (refiner) masks",
             ("tests/test_grpo.py::test_build_batch_layout",), 1,
             breaks=("tests/test_grpo.py::test_token_logprobs_matches_plain_forward",
                     "tests/test_runs.py::test_pad_id_falls_back_to_eos",
                     "tests/test_grpo.py::test_build_batch_lays_out_sampler_logprobs") + UPDATE_TESTS + DIST_GRADIENTS + SCOPE_RUNS,
             task="right-padded input_ids, attention/response/offpolicy masks"),
    Exercise("logprob_entropy", "grpo.py:logprobs_and_entropy, grpo.py:entropy_from_logprobs",
             "per-token log π(token) and entropy from the logits",
             ("tests/test_grpo.py::test_logprobs_and_entropy_hand_computed",
              "tests/test_grpo.py::test_token_logprobs_matches_plain_forward"), 2, depends=("build_batch",),
             breaks=UPDATE_TESTS + DIST_GRADIENTS + SCOPE_RUNS, task="log_softmax, gather, -sum p log p"),
    Exercise("clipped_surrogate", "grpo.py:clipped_surrogate",
             "PPO clipped surrogate on the policy's own tokens (the kept prefix and every other rollout)",
             ("tests/test_grpo.py::test_clipped_surrogate_hand_computed",), 2,
             breaks=POLICY_LOSS_TESTS + UPDATE_TESTS + DIST_GRADIENTS + SCOPE_RUNS,
             task="-min(rho*A, clip(rho, 1-eps, 1+eps)*A) on the mask"),
    Exercise("shaped_offpolicy", "grpo.py:shaped_offpolicy_loss",
             "LUFFY policy shaping f(π) = π/(π+γ) on the refiner's off-policy tokens",
             ("tests/test_grpo.py::test_shaped_offpolicy_loss_hand_computed",), 2,
             breaks=POLICY_LOSS_TESTS + UPDATE_TESTS + DIST_GRADIENTS + SCOPE_RUNS,
             task="-f(pi)*A with f(pi) = pi / (pi + gamma) on the mask"),
    Exercise("policy_loss", "grpo.py:loss_normaliser, grpo.py:policy_loss",
             "the mixed on/off-policy objective with the Dr. GRPO constant normaliser",
             ("tests/test_grpo.py::test_loss_normaliser_hand_computed",) + POLICY_LOSS_TESTS, 2,
             depends=("clipped_surrogate", "shaped_offpolicy"),
             breaks=UPDATE_TESTS + DIST_GRADIENTS + SCOPE_RUNS,
             task="Z, then compose the clipped surrogate, the shaped term, KL and entropy, sum / Z"),
    Exercise("splice", "refine.py:splice",
             "prefix-preserving rectification: the policy's prefix ids kept verbatim + the refiner's suffix",
             ("tests/test_refine.py::test_splice_keeps_the_sampled_prefix_ids",
              "tests/test_refine.py::test_splice_never_retokenises_the_prefix",
              "tests/test_refine.py::test_splice_eos_and_truncation",
              "tests/test_refine.py::test_truncated_refiner_text_gets_no_eos_and_is_judged_truncated",
              "tests/test_qwen_tokenizer.py::test_refiner_splice_on_qwen_tokens",
              "tests/test_qwen_tokenizer.py::test_refiner_suffix_ends_with_the_turn_end_of_a_base_model"), 2,
             breaks=("tests/test_refine.py::test_rectify_fake_refiner_accept_reject_and_merge",
                     "tests/test_refine.py::test_rectify_empty_prefix_is_whole_replacement",
                     "tests/test_refine.py::test_rectify_end_to_end_with_hf_refiner",
                     "tests/test_scope.py::test_each_mode_runs_two_toy_steps[scope-extra0]",   # not grpo,
                     "tests/test_scope.py::test_each_mode_runs_two_toy_steps[replace-extra2]",  # prm-reward
                     "tests/test_scope.py::test_resume_reproduces_the_next_step",
                     "tests/test_scope.py::test_real_path_on_cpu_with_self_refinement") + SCOPE_RUNS[3:],
             task="encode the suffix once, EOS if it fits, cut to the budget, mask 1 on the suffix"),
    Exercise("update", "grpo.py:update",
             "one optimizer step with micro-batch accumulation equal to the full batch (and ρ = 1 without old_logp)",
             UPDATE_TESTS, 3, depends=("build_batch", "logprob_entropy", "policy_loss"),
             breaks=DIST_GRADIENTS + SCOPE_RUNS,
             task="per micro-batch: forward, policy_loss with the whole batch's z, backward; keep each terms dict"),
    Exercise("split_steps", "prm.py:split_steps", "lossless step splitting at blank lines (what the PRM scores)",
             ("tests/test_steps.py::test_split_is_lossless_and_follows_the_rules",
              "tests/test_steps.py::test_blank_lines_separate_and_the_separator_goes_before",
              "tests/test_steps.py::test_spaces_tabs_and_crlf_between_newlines_still_make_a_blank_line",
              "tests/test_steps.py::test_single_newlines_are_used_only_when_there_is_no_blank_line",
              "tests/test_steps.py::test_no_newline_is_one_step_and_empty_is_none",
              "tests/test_steps.py::test_short_pieces_merge_forward_and_a_short_tail_merges_back",
              "tests/test_steps.py::test_max_steps_merges_the_tail_into_the_last_step"), 3,
             breaks=("tests/test_steps.py::test_spans_of_real_encodings_with_eos",
                     "tests/test_steps.py::test_char_tokenizer_and_special_tokens_in_the_middle",
                     "tests/test_steps.py::test_tokenizers_that_rewrite_text_on_decode_use_the_slow_path",
                     "tests/test_steps.py::test_spans_are_linear_time",
                     "tests/test_toy.py::test_prm_split_steps_keeps_one_step_per_operation",
                     "tests/test_qwen_tokenizer.py::test_steps_and_token_spans_on_a_real_solution",
                     "tests/test_qwen_tokenizer.py::test_prm_input_is_the_model_card_format_and_cannot_be_forged")
                    + SCOPE_RUNS + FIRST_ERRORS,
             task='cut after blank lines, merge short pieces; "".join(steps) == text'),
    Exercise("step_token_spans", "prm.py:step_token_spans (and _char_reach)",
             "steps → token ranges, so the kept prefix is the policy's own token ids (straddling tokens go later)",
             ("tests/test_steps.py::test_spans_of_real_encodings_with_eos",
              "tests/test_steps.py::test_a_bpe_token_straddling_a_boundary_goes_to_the_later_step",
              "tests/test_steps.py::test_a_character_split_over_byte_tokens_is_never_cut",
              "tests/test_steps.py::test_char_tokenizer_and_special_tokens_in_the_middle",
              "tests/test_steps.py::test_tokenizers_that_rewrite_text_on_decode_use_the_slow_path",
              "tests/test_steps.py::test_random_ids_match_the_brute_force_reference",
              "tests/test_steps.py::test_spans_are_linear_time",
              "tests/test_qwen_tokenizer.py::test_steps_and_token_spans_on_a_real_solution",
              "tests/test_qwen_tokenizer.py::test_a_step_boundary_inside_a_merged_token"), 4,
             depends=("split_steps",), breaks=SCOPE_RUNS + FIRST_ERRORS,
             task="map token bytes to characters; a token straddling a step boundary belongs to the later step"),
]
BY_NAME = {e.name: e for e in EXERCISES}


def expected_failures(names) -> set:
    """Node ids (as written in the table; a parametrised test once) of the tests that must fail when the
    exercises `names` are stubs: their own tests and every test listed in their `breaks`."""
    return {t for n in names for t in BY_NAME[n].tests + BY_NAME[n].breaks}


def test_command(e: Exercise) -> str:
    return "python -m pytest " + " ".join(e.tests)


def stub_message(e: Exercise) -> str:
    n = EXERCISES.index(e) + 1
    return f"exercise {n} ({e.name}): {e.task}; see EXERCISES.md; check with: {test_command(e)}"


def stub_source(text: str, chosen: set, path: str = "<text>") -> tuple[str, set]:
    """`text` with the regions of `chosen` replaced by a raise and every marker line removed.

    Returns (new text, names of the regions found). A BEGIN without END, a nested BEGIN, an END without
    BEGIN or an unknown name is a ValueError naming the file and line."""
    out, found, current = [], set(), None
    for lineno, line in enumerate(text.splitlines(keepends=True), 1):
        b, e = BEGIN.match(line), END.match(line)
        if b:
            if current is not None:
                raise ValueError(f"{path}:{lineno}: BEGIN SOLUTION inside the region of {current[0]!r}")
            name = b.group("name")
            if name not in BY_NAME:
                raise ValueError(f"{path}:{lineno}: unknown exercise {name!r} (not in exercises.EXERCISES)")
            current = (name, lineno)
            found.add(name)
            if name in chosen:
                out.append(f"{b.group('indent')}raise NotImplementedError({stub_message(BY_NAME[name])!r})\n")
        elif e:
            if current is None:
                raise ValueError(f"{path}:{lineno}: END SOLUTION without a BEGIN SOLUTION")
            current = None
        elif current is None or current[0] not in chosen:
            out.append(line)
    if current is not None:
        raise ValueError(f"{path}:{current[1]}: BEGIN SOLUTION {current[0]} has no END SOLUTION")
    return "".join(out), found


def repo_files(root: str) -> list[str]:
    """Relative paths to copy: git's tracked + untracked-not-ignored files, else a walk without caches."""
    try:
        res = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=root,
                             capture_output=True, check=True)
        files = [f for f in res.stdout.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for d, dirs, names in os.walk(root):
            dirs[:] = [x for x in dirs if x not in SKIP_DIRS]
            files += [os.path.relpath(os.path.join(d, n), root) for n in names]
    return sorted(f for f in files if f not in NOT_COPIED and os.path.isfile(os.path.join(root, f)))


def generate(out_dir: str, only=None, root: str = ROOT) -> list[str]:
    """Write the assignment into `out_dir` (must not exist or be empty). Returns the changed files."""
    chosen = set(BY_NAME) if only is None else set(only)
    unknown = chosen - set(BY_NAME)
    if unknown:
        raise ValueError(f"unknown exercise(s) {sorted(unknown)}; known: {', '.join(BY_NAME)}")
    out_dir = os.path.abspath(out_dir)
    if os.path.abspath(root) == out_dir or out_dir.startswith(os.path.abspath(root) + os.sep + "tests"):
        raise ValueError(f"--out {out_dir} would write into the repository itself")
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise ValueError(f"--out {out_dir} exists and is not empty; choose a new folder")
    changed, seen = [], set()
    for rel in repo_files(root):
        src, dst = os.path.join(root, rel), os.path.join(out_dir, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if rel.endswith(".py"):
            with open(src, encoding="utf-8") as f:
                text = f.read()
            new, found = stub_source(text, chosen, rel)
            seen |= found
            with open(dst, "w", encoding="utf-8") as f:
                f.write(new)
            shutil.copymode(src, dst)
            if found & chosen:
                changed.append(rel)
        else:
            shutil.copy2(src, dst)
    missing = chosen - seen
    if missing:
        raise ValueError(f"no BEGIN SOLUTION region found for {sorted(missing)}")
    with open(os.path.join(out_dir, "EXERCISES.md"), "w", encoding="utf-8") as f:
        f.write("# Exercises\n\nEach stub raises NotImplementedError until you write it. Work easiest first; "
                "an exercise's tests need the exercises it depends on. `python -m pytest tests -q` runs "
                "everything; `python scope.py --toy --mode grpo` (or the default `--mode scope`) trains the toy "
                "world with your code.\n\n" + table(chosen) + "\n")
    return changed


def table(names=None) -> str:
    """The exercise table in Markdown (all exercises, or those in `names`)."""
    rows = ["| # | exercise | write | paper concept | difficulty | depends on | check with |",
            "|---|---|---|---|---|---|---|"]
    for i, e in enumerate(EXERCISES, 1):
        if names is not None and e.name not in names:
            continue
        rows.append(f"| {i} | `{e.name}` | {e.functions} | {e.concept} | {'★' * e.difficulty} | "
                    f"{', '.join(e.depends) or '—'} | `{test_command(e)}` |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Write a copy of this repository with exercise regions stubbed out.")
    ap.add_argument("--out", help="output folder (new or empty)")
    ap.add_argument("--only", help="comma-separated exercise names (default: all); see --list")
    ap.add_argument("--list", action="store_true", help="print the exercise table and exit")
    args = ap.parse_args(argv)
    if args.list:
        print(table())
        return 0
    if not args.out:
        ap.error("--out is required (or --list)")
    only = [x.strip() for x in args.only.split(",") if x.strip()] if args.only else None
    try:
        changed = generate(args.out, only)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = only or [e.name for e in EXERCISES]
    print(f"wrote {args.out}: {len(names)} exercise(s) ({', '.join(names)}) in {', '.join(changed)}")
    print(f"students: cd {args.out} && python -m pytest tests -q   (the stubbed exercises fail with "
          f"NotImplementedError until written); python -m tools.exercises --list in the reference shows the table")
    return 0


if __name__ == "__main__":
    sys.exit(main())
