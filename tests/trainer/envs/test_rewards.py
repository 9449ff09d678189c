"""The gsm8k environment's rewards: the final answer, checked by math-verify."""

import pytest

from grpo_run.trainer.envs.rewards import (boxed_format, final_answer, last_boxed, math_correct, reference_answer)

TASK = {"question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether 48+24 = <<48+24=72>>72.\n#### 72"}


def test_a_correct_boxed_answer_scores_1_and_a_wrong_one_0():
    assert math_correct("48 + 24 = 72, so the answer is \\boxed{72}.", TASK) == 1.0
    assert math_correct("48 + 24 = 71, so the answer is \\boxed{71}.", TASK) == 0.0


def test_math_verify_compares_values_not_strings():
    assert math_correct("\\boxed{72.0}", TASK) == 1.0
    assert math_correct("\\boxed{\\frac{144}{2}}", TASK) == 1.0
    assert math_correct("\\boxed{7.2}", TASK) == 0.0


def test_without_a_box_the_last_number_is_the_answer():
    assert math_correct("In May 24, so 48 + 24 = 72", TASK) == 1.0
    assert math_correct("72 is wrong, it is 70", TASK) == 0.0
    assert math_correct("I do not know", TASK) == 0.0
    assert final_answer("it costs 1,250 dollars") == "1250"


def test_the_last_box_wins_and_nested_braces_are_kept():
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{unclosed") is None
    assert reference_answer("work\n#### 1,000") == "1000"


@pytest.mark.parametrize("text,score", [("so \\boxed{72}", 1.0), ("72", 0.0), ("\\boxed{1} \\boxed{72}", 0.0)])
def test_the_format_reward_wants_exactly_one_boxed_answer(text, score):
    assert boxed_format(text, TASK) == score
