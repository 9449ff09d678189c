"""The `code` environment's built-in tasks: twelve small Python functions, each with three unit
tests, for trying the environment (and `grpo-run score`) without a data set of your own.
Your own tasks (MBPP, HumanEval or `{prompt, tests}`) come with `spec.environment.tasks`."""

from __future__ import annotations

import random

from grpo_run.trainer.envs.tasks import Task

CODE_INSTRUCTION = "Answer with the function in a ```python code block."

_PROBLEMS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("add(a, b)", "returns the sum of a and b",
     ("assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(0, 0) == 0")),
    ("is_even(n)", "returns True when the integer n is even, else False",
     ("assert is_even(4) is True", "assert is_even(7) is False", "assert is_even(0) is True")),
    ("reverse_string(s)", "returns the string s reversed",
     ("assert reverse_string('abc') == 'cba'", "assert reverse_string('') == ''", "assert reverse_string('a') == 'a'")),
    ("factorial(n)", "returns n! for an integer n >= 0",
     ("assert factorial(0) == 1", "assert factorial(5) == 120", "assert factorial(1) == 1")),
    ("count_vowels(s)", "returns how many of the characters of s are vowels (a, e, i, o, u, either case)",
     ("assert count_vowels('hello') == 2", "assert count_vowels('xyz') == 0", "assert count_vowels('AEIOU') == 5")),
    ("max_of_list(xs)", "returns the largest number in the non-empty list xs",
     ("assert max_of_list([1, 5, 3]) == 5", "assert max_of_list([-2, -7]) == -2", "assert max_of_list([4]) == 4")),
    ("is_palindrome(s)", "returns True when the string s reads the same backwards, else False",
     ("assert is_palindrome('racecar') is True", "assert is_palindrome('ab') is False",
      "assert is_palindrome('') is True")),
    ("fibonacci(n)", "returns the n-th Fibonacci number, with fibonacci(0) == 0 and fibonacci(1) == 1",
     ("assert fibonacci(0) == 0", "assert fibonacci(1) == 1", "assert fibonacci(10) == 55")),
    ("sum_of_digits(n)", "returns the sum of the decimal digits of the integer n >= 0",
     ("assert sum_of_digits(123) == 6", "assert sum_of_digits(0) == 0", "assert sum_of_digits(9999) == 36")),
    ("remove_duplicates(xs)", "returns the list xs without repeated items, keeping each first occurrence in order",
     ("assert remove_duplicates([1, 2, 1, 3]) == [1, 2, 3]", "assert remove_duplicates([]) == []",
      "assert remove_duplicates(['a', 'a']) == ['a']")),
    ("is_prime(n)", "returns True when the integer n is a prime number, else False",
     ("assert is_prime(2) is True", "assert is_prime(15) is False", "assert is_prime(1) is False")),
    ("word_count(s)", "returns the number of words in s, words being separated by whitespace",
     ("assert word_count('a b  c') == 3", "assert word_count('') == 0", "assert word_count(' hello ') == 1")),
)


def builtin_code_tasks() -> list[Task]:
    """The twelve built-in tasks, in their fixed order: {prompt, tests, entry}."""
    return [{"prompt": f"Write a Python function {signature} that {what}. {CODE_INSTRUCTION}",
             "tests": list(tests), "entry": signature.split("(")[0]}
            for signature, what, tests in _PROBLEMS]


def code_tasks(seed: int, n_train: int | None, n_eval: int | None) -> tuple[list[Task], list[Task]]:
    """The built-in tasks split by the seed: 4 held out and the other 8 for training by default.
    Raises ValueError when the split does not fit in 12."""
    tasks = builtin_code_tasks()
    n_eval = 4 if n_eval is None else n_eval
    n_train = len(tasks) - n_eval if n_train is None else n_train
    if n_eval < 1 or n_train < 1 or n_train + n_eval > len(tasks):
        raise ValueError(f"code has {len(tasks)} built-in tasks; cannot hold out {n_eval} and train on {n_train} "
                         "(give your own with spec.environment.tasks)")
    random.Random(seed).shuffle(tasks)
    return tasks[n_eval:n_eval + n_train], tasks[:n_eval]
