"""CodeTask reads the three shapes code data comes in (rl/tasks/data/code_*.jsonl samples):
stdin/stdout tests (CodeContests), call-based tests naming a function (APPS / TACO) and
LeetCode `class Solution` methods (LiveCodeBench); right answers pass, wrong ones fail."""

import base64
import json
import pickle
import zlib

import pytest

from rl.tasks.code import PRELUDE, CodeTask, returned
from rl.tasks.jsonl import BUNDLED
from rl.verifiers.code import CodeSandbox, Limits

SHAPES = {
    "stdio": ("code_stdio_codecontests.jsonl",
              {"prompt": "description", "solution": "solutions",
               "tests": ["public_tests", "private_tests", "generated_tests"]}),
    "call": ("code_call_apps.jsonl",
             {"prompt": "question", "tests": "input_output", "solution": "solutions"}),
    "leetcode": ("code_leetcode_livecodebench.jsonl",
                 {"prompt": "question_content", "entry_point": "metadata",
                  "tests": ["public_test_cases", "private_test_cases"]}),
}

# LiveCodeBench ships no solutions; these answer its sample, in the order of the file.
LEETCODE_ANSWERS = [
    ("class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
     "        seen = {}\n        for i, x in enumerate(nums):\n"
     "            if target - x in seen:\n                return [seen[target - x], i]\n"
     "            seen[x] = i\n"),
    ("class Solution:\n    def scoreOfString(self, s: str) -> int:\n"
     "        return sum(abs(ord(a) - ord(b)) for a, b in pairwise(s))\n"),  # the prelude's
    ("class Solution:\n    def isPalindrome(self, x: int) -> bool:\n"
     "        return str(x) == str(x)[::-1]\n"),
]

# One wrong answer per shape, for the first problem of each file.
WRONG = {
    "stdio": "a, b = map(int, input().split())\nprint(a - b)\n",
    "call": "def digital_root(n):\n    return n % 10\n",
    "leetcode": ("class Solution:\n    def twoSum(self, nums: List[int], target: int) -> "
                 "List[int]:\n        return [0, len(nums) - 1]\n"),
}


@pytest.fixture(scope="module")
def pool():
  with CodeSandbox(workers=1, limits=Limits(wall_seconds=5.0)) as sandbox:
    yield sandbox


def _task(shape, pool):
  name, fields = SHAPES[shape]
  path = str(BUNDLED / name)
  return CodeTask(train_path=path, test_path=path, fields=fields, sandbox=pool)


def _fenced(src):
  return f"Here it is.\n```python\n{src}```\n"


def _right_answers(shape, task):
  if shape == "leetcode":
    return LEETCODE_ANSWERS
  return [task.solution(record) for record in task.train.records]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_right_answer_passes_every_test_in_each_shape(shape, pool):
  task = _task(shape, pool)
  records = task.train.records
  assert len(records) == 3
  for record, answer in zip(records, _right_answers(shape, task), strict=True):
    statuses = [r.status for r in task.results(_fenced(answer), record)]
    assert statuses and set(statuses) == {"accepted"}, (record["prompt"], statuses)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_wrong_answer_fails_in_each_shape(shape, pool):
  task = _task(shape, pool)
  record = task.train.records[0]
  statuses = [r.status for r in task.results(_fenced(WRONG[shape]), record)]
  assert "wrong answer" in statuses and not task.verify(_fenced(WRONG[shape]), record), statuses
  assert not task.verify("```python\nprint('passed')\n```", record)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_nonzero_exit_fails_as_a_runtime_error_in_each_shape(shape, pool):
  task = _task(shape, pool)
  record = task.train.records[0]
  # The right answer, then an exit with the status the server once used for "syntax error".
  answer = _right_answers(shape, task)[0] + "import sys\nsys.exit(3)\n"
  statuses = {r.status for r in task.results(_fenced(answer), record)}
  assert statuses == {"runtime error"}, statuses


def test_the_records_carry_every_test_and_the_starter_code():
  stdio = _task("stdio", None).train.records[0]
  assert len(stdio["stdio_tests"]) == 4  # public 1 + private 2 + generated 1
  assert stdio["stdio_tests"][0] == {"stdin": "1 2\n", "stdout": "3\n"}
  call = _task("call", None).train.records[1]
  assert call["entry_point"] == "min_max" and call["program_prefix"] == PRELUDE
  assert "```python\ndef min_max(lst):" in call["prompt"]
  leetcode = _task("leetcode", None).train.records
  # public + private, the private ones of the first and third base64-zlib-pickled
  assert [len(r["assert_tests"]) for r in leetcode] == [3, 3, 4]
  assert leetcode[0]["entry_point"] == "twoSum"
  assert "class Solution:\n    def twoSum" in leetcode[0]["prompt"]


def test_call_tests_reach_a_module_function_or_a_solution_method(pool):
  # The rule APPS and LiveCodeBench grade by: Solution().method when the program defines
  # class Solution, the module's function otherwise, whatever the starter code showed.
  apps, leetcode = _task("call", pool), _task("leetcode", pool)
  as_method = ("class Solution:\n    def digital_root(self, n):\n"
               "        return 0 if n == 0 else 1 + (n - 1) % 9\n")
  as_function = "def isPalindrome(x):\n    return str(x) == str(x)[::-1]\n"
  assert apps.verify(_fenced(as_method), apps.train.records[0])
  assert leetcode.verify(_fenced(as_function), leetcode.train.records[2])
  no_method = "class Solution:\n    def other(self, x):\n        return x\n"
  results = leetcode.results(_fenced(no_method), leetcode.train.records[2])
  assert {r.status for r in results} == {"runtime error"}
  assert "no function 'Solution.isPalindrome'" in results[0].detail


def test_assert_tests_that_construct_the_solution_class(tmp_path, pool):
  # The shape some LeetCode sets use: the test makes the instance itself. The class stays in
  # the sandbox; the test's `Solution()` is a handle whose method calls run there.
  path = _write(tmp_path, [{"prompt": "Two sum.", "entry_point": "twoSum", "tests": [
      "assert Solution().twoSum([2, 7, 11, 15], 9) == [0, 1]",
      "s = Solution()\nassert s.twoSum([3, 2, 4], 6) == [1, 2]"]}])
  task = CodeTask(train_path=path, test_path=path, sandbox=pool)
  record = task.train.records[0]
  # Without the prelude of call tests (assert tests run the program as it is): no `List`.
  right, wrong = (answer.replace("nums: List[int], target: int) -> List[int]", "nums, target)")
                  for answer in (LEETCODE_ANSWERS[0], WRONG["leetcode"]))
  statuses = [r.status for r in task.results(_fenced(right), record)]
  assert statuses == ["accepted"] * 2, statuses
  statuses = [r.status for r in task.results(_fenced(wrong), record)]
  assert statuses == ["wrong answer"] * 2, statuses


def test_returned_reads_tuples_as_lists_and_apps_wrapped_outputs():
  assert returned((1, 5), [1, 5]) and returned({"a": (1, 2)}, {"a": [1, 2]})
  assert returned(7, [7], wrapped=True) and returned((1, 5), [[1, 5]], wrapped=True)
  assert not returned(7, [7]) and not returned(7, [7, 8], wrapped=True)
  assert not returned([1, 5], [5, 1])


def test_returned_dict_keys_compare_as_json_writes_them():
  # A test's expected value went through JSON, which writes every dict key as text.
  assert returned({1: "a", -2: (3,)}, {"1": "a", "-2": [3]})
  assert returned({1: {2: 3}}, [{"1": {"2": 3}}], wrapped=True)
  assert returned({True: 1, None: 2, 1.5: 3}, {"true": 1, "null": 2, "1.5": 3})
  assert returned({"1": "a"}, {1: "a"})  # both sides alike, whichever holds the ints
  assert not returned({1: "a"}, {"1": "b"}) and not returned({"01": "a"}, {"1": "a"})
  assert not returned({(1, 2): "a"}, {"(1, 2)": "a"})  # a key JSON cannot write


def _write(tmp_path, rows):
  path = tmp_path / "rows.jsonl"
  path.write_text("".join(json.dumps(row) + "\n" for row in rows))
  return str(path)


def test_apps_stdin_problems_and_lines_given_as_lists(tmp_path, pool):
  # input_output without fn_name is stdin/stdout; inputs and outputs may be lists of lines.
  tests = {"inputs": [["2", "3 4"], "1\n5\n"], "outputs": [["7"], "5\n"]}
  path = _write(tmp_path, [{"question": "Sum the numbers after the count.",
                            "input_output": json.dumps(tests)}])
  task = CodeTask(train_path=path, test_path=path, sandbox=pool,
                  fields={"prompt": "question", "tests": "input_output"})
  record = task.train.records[0]
  assert record["stdio_tests"][0] == {"stdin": "2\n3 4", "stdout": "7"}
  assert task.verify("input()\nprint(sum(map(int, input().split())))", record)


def test_apps_call_arguments_get_back_the_int_keys_json_took(tmp_path, pool):
  # APPS's grader gives a dict argument whose keys are all ints written as text its int
  # keys back; other dicts ("07" is no int JSON writes, "b" none at all) stay as they are.
  tests = {"fn_name": "key_types", "inputs": [[{"1": "x", "-2": "y"}], [{"1": "x", "b": "y"}],
                                              [{"07": "x"}], [{}]],
           "outputs": [[[["int", -2], ["int", 1]]], [[["str", "1"], ["str", "b"]]],
                       [[["str", "07"]]], [[]]]}
  path = _write(tmp_path, [{"question": "Name each key's type.",
                            "input_output": json.dumps(tests)}])
  task = CodeTask(train_path=path, test_path=path, sandbox=pool,
                  fields={"prompt": "question", "tests": "input_output"})
  record = task.train.records[0]
  assert "candidate({1: 'x', -2: 'y'})" in record["assert_tests"][0]
  answer = "def key_types(d):\n    return sorted((type(k).__name__, k) for k in d)\n"
  statuses = [r.status for r in task.results(_fenced(answer), record)]
  assert statuses == ["accepted"] * 4, statuses


def test_stdout_is_compared_up_to_trailing_whitespace_and_trailing_blank_lines(tmp_path,
                                                                                pool):
  # The sandbox's rule (rl/verifiers/code.py): what the CodeContests and APPS graders ignore
  # at the ends of lines and of the output; a space inside a line or a line's leading space
  # still counts.
  path = _write(tmp_path, [{"description": "Print 1 2, then 3.",
                            "public_tests": {"input": [""], "output": ["1 2\n3\n"]}}])
  task = CodeTask(train_path=path, test_path=path, sandbox=pool,
                  fields={"prompt": "description", "tests": "public_tests"})
  record = task.train.records[0]
  assert task.verify(_fenced("print('1 2   ')\nprint('3\\t')\nprint()\nprint()\n"), record)
  assert task.verify(_fenced("print('1 2\\n3', end='')\n"), record)
  assert not task.verify(_fenced("print('1  2')\nprint(3)\n"), record)
  assert not task.verify(_fenced("print(' 1 2')\nprint(3)\n"), record)
  assert not task.verify(_fenced("print('1 2')\nprint()\nprint(3)\n"), record)


def test_the_batch_verdicts_are_those_of_each_completion(pool):
  task = _task("stdio", pool)
  records = task.train.records
  completions = [_fenced(task.solution(records[0])), _fenced(WRONG["stdio"]),
                 _fenced(task.solution(records[2]))]
  assert task.verify_batch(completions, records) == [True, False, True]


def test_unreadable_or_ambiguous_records_are_named(tmp_path):
  def read(rows, **fields):
    path = _write(tmp_path, rows)
    return CodeTask(train_path=path, test_path=path, fields=fields or None)

  with pytest.raises(ValueError, match=r"fields names \['test'\]"):
    read([{"prompt": "p", "tests": []}], test="x")
  with pytest.raises(ValueError, match="rows.jsonl:1: no tests"):
    read([{"prompt": "p"}])
  with pytest.raises(ValueError, match="several kinds"):
    read([{"prompt": "p", "a": [{"stdin": "", "stdout": ""}], "b": ["assert f()"],
           "entry_point": "f"}], tests=["a", "b"])
  functional = [{"input": "1", "output": "1", "testtype": "functional"}]
  with pytest.raises(ValueError, match="need the function they call"):
    read([{"prompt": "p", "tests": json.dumps(functional)}])
  with pytest.raises(ValueError, match="2 test inputs but 1 outputs"):
    read([{"prompt": "p", "tests": {"input": ["1", "2"], "output": ["1"]}}])
  # A pickle that names a class could run code when loaded: refused, not loaded.
  hostile = base64.b64encode(zlib.compress(pickle.dumps(Limits()))).decode()
  with pytest.raises(ValueError, match="only plain data loads"):
    read([{"prompt": "p", "tests": hostile}])
