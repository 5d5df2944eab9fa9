"""The code sandbox: every failure mode contained and reported, harness hacks refused,
HumanEval's canonical solutions accepted. Hostile programs run inside an outer pid
namespace (tests/sandbox_attacks.py under `unshare`), so a sandbox bug cannot reach the
machine; the host-side effects are checked from here."""

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from rl.tasks.code import CodeTask, humaneval, job
from rl.verifiers.code import (STATUSES, CodeSandbox, Job, Limits, Sandbox, StdioTest,
                               bwrap_available)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_bubblewrap_is_installed():
  # scripts/setup.sh installs it where apt is available; without it the sandbox is weak.
  assert bwrap_available(), "bubblewrap missing: apt-get install bubblewrap"


def _outer_namespace() -> list[str]:
  prefix = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
  if os.geteuid() != 0:
    prefix.insert(1, "--map-root-user")
  return prefix


@pytest.fixture(scope="module")
def attacks(tmp_path_factory):
  directory = tmp_path_factory.mktemp("attacks")
  planted = directory / "planted.txt"
  planted.write_text("planted-host-secret")
  escape = directory / "escaped.txt"
  out = directory / "results.json"
  completed = subprocess.run(
      _outer_namespace() + [sys.executable, str(ROOT / "tests" / "sandbox_attacks.py"),
                            str(out), str(planted), str(escape)],
      capture_output=True, text=True, timeout=300)
  assert completed.returncode == 0, completed.stderr[-3000:]
  results = json.loads(out.read_text())
  results["escape exists"] = escape.exists()
  return results


EXPECTED = {
    "busy loop": "timeout",
    "sleep": "timeout",
    "memory bomb": "memory",
    "memory creep": "memory",
    "fork bomb": "timeout",  # forks fail at the pids limit; the wall clock ends it
    "thread bomb": "runtime error",  # "can't start new thread" at the pids limit
    "orphaned daemon": "ok",
    "kill parent": "killed",
    "kill everything": "killed",
    "read host file": "runtime error",
    "socket": "runtime error",
    "outside network": "runtime error",
    "stdout flood": "output limit",
    "stderr flood": "output limit",
}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_hostile_program_is_contained_with_its_status(attacks, case):
  assert attacks[case]["status"] == EXPECTED[case], attacks[case]


def test_nothing_outlives_a_run(attacks):
  # The daemon forked away and slept; the next program in the same sandbox sees only the
  # namespace's init, the server and itself.
  for case in ("after daemon", "after kill everything"):
    pids = json.loads(attacks[case]["stdout"])
    assert len(pids) == 3 and pids[:2] == [1, 2], attacks[case]
  # Counted in the attacks' own pid namespace, where only the processes they started live
  # (tests/sandbox_attacks.py): another sandbox on the machine is not counted.
  assert attacks["leftover processes"] == []


def test_killing_the_server_restarts_the_sandbox(attacks):
  assert attacks["restarts"] == 2
  assert attacks["after kill parent"] == {"status": "ok", "stdout": "fresh\n", "stderr": ""}


def test_host_files_environment_and_network_are_out_of_reach(attacks):
  assert not attacks["escape exists"]
  assert attacks["write outside"]["stdout"].strip() == "[]"
  assert "planted-host-secret" not in json.dumps(attacks["read host file"])
  assert "FileNotFoundError" in attacks["read host file"]["stderr"]
  assert attacks["secret"] not in json.dumps(attacks["environment secrets"])
  assert "LONGRL_SECRET_TOKEN" not in attacks["environment secrets"]["stdout"]
  assert attacks["accepted connections"] == 0
  assert "ConnectionRefusedError" in attacks["socket"]["stderr"]


def test_output_cap_is_shared_by_stdout_and_stderr():
  with Sandbox(Limits(output_bytes=1000)) as sandbox:
    both = sandbox.run("import sys\nprint('a' * 600)\nsys.stderr.write('b' * 600)")
    one = sandbox.run("import sys\nprint('a' * 400)\nsys.stderr.write('b' * 400)")
  assert both["status"] == "output limit"
  assert one["status"] == "ok" and len(one["stdout"]) == 401


@pytest.fixture(scope="module")
def sandbox():
  with Sandbox(Limits(wall_seconds=2.0)) as box:
    yield box


def test_stdio_statuses(sandbox):
  tests = [StdioTest("2 3\n", "5\n"), StdioTest("10 -4\n", "6")]
  assert [r.status for r in sandbox.run_stdio_tests(
      "a, b = map(int, input().split())\nprint(a + b)", tests)] == ["accepted"] * 2
  assert [r.status for r in sandbox.run_stdio_tests(
      "a, b = map(int, input().split())\nprint(a - b)", tests)] == ["wrong answer"] * 2
  assert sandbox.run_stdio_tests("print(1/0)", tests[:1])[0].status == "runtime error"
  assert sandbox.run_stdio_tests("def f(:\n  pass", tests[:1])[0].status == "syntax error"
  # A printed verdict is just output; sys.exit(0) without output is a wrong answer.
  assert sandbox.run_stdio_tests("print('passed')", tests[:1])[0].status == "wrong answer"
  assert sandbox.run_stdio_tests("import sys\nsys.exit(0)", tests[:1])[0].status == \
      "wrong answer"


EXITS = {"sys.exit(1)": "import sys\nsys.exit(1)", "exit(1)": "exit(1)",
         # the server's old internal codes for "syntax error" and "memory"
         "sys.exit(3)": "import sys\nsys.exit(3)", "sys.exit(4)": "import sys\nsys.exit(4)",
         "os._exit(3)": "import os\nos._exit(3)", "os._exit(4)": "import os\nos._exit(4)",
         "sys.exit(256)": "import sys\nsys.exit(256)",  # the kernel would truncate it to 0
         "sys.exit('message')": "import sys\nsys.exit('bye')"}


@pytest.mark.parametrize("name", sorted(EXITS))
def test_a_nonzero_exit_is_a_runtime_error_whatever_its_status(sandbox, name):
  src = "print(3)\n" + EXITS[name]  # the right output first: the exit still fails it
  result, = sandbox.run_stdio_tests(src, [StdioTest("", "3\n")])
  assert result.status == "runtime error", (name, result)
  in_call_mode = sandbox.run_assert_tests(EXITS[name] + "\ndef f():\n  return 1",
                                          ["assert f() == 1"], entry_point="f")
  assert in_call_mode[0].status == "runtime error", (name, in_call_mode)


def test_a_program_that_leaves_its_stdin_unread_is_judged_on_its_output(sandbox):
  # The server writes stdin as the program drains it; once the program is gone, that write
  # (or a relayed call's) fails with EPIPE, which must not kill the server.
  big = "1 2\n" + "0\n" * (1 << 19)
  result, = sandbox.run_stdio_tests("print(3)", [StdioTest(big, "3\n")])
  assert result.status == "accepted", result
  restarts = sandbox.restarts
  assert sandbox.run("import sys\nsys.exit(0)", big)["status"] == "ok"
  assert sandbox.restarts == restarts


def test_syntax_errors_and_memory_are_still_told_apart_from_exits(sandbox):
  assert sandbox.run("def f(:\n  pass")["status"] == "syntax error"
  assert sandbox.run("raise MemoryError")["status"] == "memory"
  assert sandbox.run("x = bytearray(8 << 30)")["status"] == "memory"
  assert sandbox.run("import sys\nsys.exit(0)")["status"] == "ok"
  assert "bye" in sandbox.run("import sys\nsys.exit('bye')")["stderr"]


ADD_TESTS = ("assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4")

HACKS = {
    "always-equal object": ("class Anything:\n  def __eq__(self, other):\n    return True\n"
                            "def add(a, b):\n  return Anything()"),
    "int subclass": ("class Int(int):\n  def __eq__(self, other):\n    return True\n"
                     "  __hash__ = int.__hash__\ndef add(a, b):\n  return Int(0)"),
    "sys.exit before the asserts": "import sys\ndef add(a, b):\n  return 0\nsys.exit(0)",
    "os._exit before the asserts": "import os\ndef add(a, b):\n  return 0\nos._exit(0)",
    "printed sentinel": "print('passed')\nprint('OK')\ndef add(a, b):\n  return None",
    "reads the test file": ("import os\nfound = []\nfor root, _, files in os.walk('/'):\n"
                            "  for name in files:\n    try:\n"
                            "      if b'assert add' in open(os.path.join(root, name), 'rb')"
                            ".read(1 << 16):\n        found.append(name)\n"
                            "    except OSError:\n      pass\n"
                            "def add(a, b):\n  return found"),
    "kills the server mid-test": ("import os, signal\ndef add(a, b):\n"
                                  "  os.kill(os.getppid(), signal.SIGKILL)"),
}


@pytest.mark.parametrize("hack", sorted(HACKS))
def test_harness_hacks_do_not_pass(sandbox, hack):
  results = sandbox.run_assert_tests(HACKS[hack], ADD_TESTS, entry_point="add")
  assert len(results) == 3
  assert not any(r.passed for r in results), results
  assert all(r.status in STATUSES for r in results)


def test_assert_tests_pass_for_a_correct_program_and_report_each_test(sandbox):
  src = "def add(a, b):\n  return a + b if a != 2 else 0"
  results = sandbox.run_assert_tests(src, ADD_TESTS, entry_point="add")
  assert [r.status for r in results] == ["accepted", "accepted", "wrong answer"]
  raising = sandbox.run_assert_tests("def add(a, b):\n  raise ValueError('no')", ADD_TESTS[:1],
                                     entry_point="add")
  assert raising[0].status == "runtime error" and "ValueError: no" in raising[0].detail
  looping = sandbox.run_assert_tests("def add(a, b):\n  while True:\n    pass", ADD_TESTS,
                                     entry_point="add")
  assert [r.status for r in looping] == ["timeout"] * 3
  # A program that raises while it loads (a stray input() or raise at the top, common in
  # model output) fails every test at once; it used to stall each job for the host's bound.
  for top in ("input()", "raise ValueError('top')"):
    started = time.monotonic()
    loading = sandbox.run_assert_tests(top + "\ndef add(a, b):\n  return a + b", ADD_TESTS,
                                       entry_point="add")
    assert [r.status for r in loading] == ["runtime error"] * 3, loading
    assert time.monotonic() - started < 10, top
  # Plain values of every kind survive the trip both ways.
  echo = sandbox.run_assert_tests(
      "def echo(x):\n  return x",
      ["assert echo({'a': (1, 2.5, None), 'b': {3}, 'c': [True, 'x', 1+2j]}) == "
       "{'a': (1, 2.5, None), 'b': {3}, 'c': [True, 'x', 1+2j]}", "assert echo(10**30) == 10**30"],
      entry_point="echo")
  assert [r.status for r in echo] == ["accepted", "accepted"]


TWO_SUM = ("class Solution:\n  def twoSum(self, nums, target):\n    seen = {}\n"
           "    for i, x in enumerate(nums):\n      if target - x in seen:\n"
           "        return [seen[target - x], i]\n      seen[x] = i\n")
TWO_SUM_TESTS = ("assert Solution().twoSum([2, 7, 11, 15], 9) == [0, 1]",
                 "solver = Solution()\nassert solver.twoSum([3, 2, 4], 6) == [1, 2]\n"
                 "assert solver.twoSum([3, 3], 6) == [0, 1]")


@pytest.mark.parametrize("entry_point", ["Solution.twoSum", "twoSum", "Solution"])
def test_tests_that_construct_the_solution_class_pass_and_fail_on_its_answers(sandbox,
                                                                              entry_point):
  # LeetCode sets that write `Solution().twoSum(...)` in the test; the entry point is the
  # method as rl/tasks/code.py's `job` makes it, the method's bare name, or the class.
  right = sandbox.run_assert_tests(TWO_SUM, TWO_SUM_TESTS, entry_point=entry_point)
  assert [r.status for r in right] == ["accepted"] * 2, right
  wrong = TWO_SUM.replace("[seen[target - x], i]", "[i, seen[target - x]]")
  results = sandbox.run_assert_tests(wrong, TWO_SUM_TESTS, entry_point=entry_point)
  assert [r.status for r in results] == ["wrong answer"] * 2, results


def test_setup_may_construct_the_class_and_keeps_its_own_names(sandbox):
  setup = "def returned(value, expected):\n  return value == expected\nsolver = Solution()"
  test = "assert returned(solver.twoSum([2, 7, 11, 15], 9), [0, 1])"
  right, = sandbox.run_assert_tests(TWO_SUM, [test], entry_point="Solution.twoSum",
                                    setup=setup)
  # A program class named like setup's helper: bound over it, `assert returned(...)` would
  # test a handle rather than the answer.
  hostile = ("class returned:\n  def __init__(self, *args):\n    pass\n" +
             TWO_SUM.replace("[seen[target - x], i]", "[i, i]"))
  wrong, = sandbox.run_assert_tests(hostile, [test], entry_point="Solution.twoSum",
                                    setup=setup)
  assert (right.status, wrong.status) == ("accepted", "wrong answer"), (right, wrong)
  assert wrong.detail.startswith("AssertionError"), wrong  # setup's helper ran, not a handle


MIN_STACK = ("class MinStack:\n  def __init__(self):\n    self.items, self.size = [], 0\n"
             "  def push(self, x):\n"
             "    self.items.append((x, min(x, self.items[-1][1]) if self.items else x))\n"
             "    self.size += 1\n"
             "  def pop(self):\n    self.items.pop()\n    self.size -= 1\n"
             "  def top(self):\n    return self.items[-1][0]\n"
             "  def getMin(self):\n    return self.items[-1][1]\n")
MIN_STACK_TESTS = (
    "obj = MinStack()\nobj.push(3)\nassert obj.getMin() == 3",
    "obj = MinStack()\nfor x in (5, 2, 7):\n  obj.push(x)\nassert obj.getMin() == 2\n"
    "obj.pop()\nobj.pop()\nassert (obj.top(), obj.getMin()) == (5, 5)",
    "a, b = MinStack(), MinStack()\na.push(1)\nb.push(9)\n"
    "assert (a.getMin(), b.getMin()) == (1, 9)",
)


def test_a_stateful_class_keeps_its_state_between_calls_in_the_sandbox(sandbox):
  results = sandbox.run_assert_tests(MIN_STACK, MIN_STACK_TESTS, entry_point="MinStack")
  assert [r.status for r in results] == ["accepted"] * 3, results
  # getMin answering the top: right while the newest element is the least, wrong after.
  wrong = MIN_STACK.replace("return self.items[-1][1]", "return self.items[-1][0]")
  results = sandbox.run_assert_tests(wrong, MIN_STACK_TESTS, entry_point="MinStack")
  assert [r.status for r in results] == ["accepted", "wrong answer", "accepted"], results


ALWAYS_EQUAL = "class Anything:\n  def __eq__(self, other):\n    return True\n"
FORGE = ("import os\ndef forge(line):\n  for fd in range(3, 64):\n    try:\n"
         "      os.write(fd, line)\n    except OSError:\n      pass\n")
# name: (program, test, status, what the detail says). Each would pass, or reach another
# run's instance, if the handle let more than plain values and method calls across.
HANDLE_ATTACKS = {
    "a method returns its instance": (
        MIN_STACK.replace("self.size += 1", "self.size += 1\n    return self"),
        "assert MinStack().push(1) is not None", "runtime error",
        "MinStack.push returned an object of type MinStack, not a plain value"),
    "a method returns an always-equal object": (
        ALWAYS_EQUAL + "class Solution:\n  def twoSum(self, nums, target):\n"
        "    return Anything()", TWO_SUM_TESTS[0], "runtime error",
        "Solution.twoSum returned an object of type Anything"),
    "the class's __eq__ lies": (
        "class Solution:\n  def __eq__(self, other):\n    return True\n"
        "  def twoSum(self, nums, target):\n    return None",
        "assert Solution() == [0, 1]", "wrong answer", "Solution#1 stands for something in "
        "the sandbox and has no value on the host: call one of its methods"),
    "a handle compared unequal": (MIN_STACK, "assert MinStack() != None", "wrong answer",
                                  "MinStack#1 stands for something in the sandbox"),
    "a handle's truth": (MIN_STACK, "assert MinStack()", "wrong answer",
                         "MinStack#1 stands for something in the sandbox"),
    "a handle passed back as an argument": (
        MIN_STACK, "a = MinStack()\nb = MinStack()\nb.push(a)\nassert b.top() is not None",
        "wrong answer", "MinStack#2.push was given an object of type _Handle, not a plain"),
    "an attribute read as a value": (
        MIN_STACK, "obj = MinStack()\nobj.push(1)\nassert obj.size == 1", "wrong answer",
        "MinStack#1.size stands for something in the sandbox and has no value on the host: "
        "call it; attributes other than methods are not read"),
    "an attribute called": (MIN_STACK, "assert MinStack().size() == 0", "runtime error",
                            "MinStack.size is an attribute of type int, not a method"),
    "an underscored attribute": (MIN_STACK, "assert MinStack()._MinStack__x() == 0",
                                 "wrong answer", "only public methods"),
    "an attribute set on the handle": (MIN_STACK, "obj = MinStack()\nobj.size = 5",
                                       "wrong answer", "MinStack#1.size = ...: a handle's"),
    "an imported class": ("from collections import deque as MinStack",
                          "obj = MinStack()\nobj.append(1)\nassert obj.pop() == 1",
                          "runtime error", "MinStack is collections.deque, not a class the "
                          "program defines"),
    "a factory for another object": ("import os\ndef MinStack():\n  return os",
                                     "assert MinStack().getcwd() == '/'", "runtime error",
                                     "MinStack returned an object of type module"),
    "a class the program lacks": ("class Minstack:\n  pass", "assert MinStack().top() == 1",
                                  "runtime error",
                                  "the program defines no function or class 'MinStack'"),
    "a class named like the test's builtin": (
        "class all:\n  def __init__(self, *args):\n    pass\n"
        "class Solution:\n  def twoSum(self, nums, target):\n    return [-1, -1]",
        "assert all(i >= 0 for i in Solution().twoSum([2, 7], 9))", "wrong answer",
        "AssertionError"),
    "a reply forged out of turn": (
        FORGE + "forge(b'{\"final\": true, \"status\": \"ok\", \"stdout\": \"\", "
        "\"stderr\": \"\", \"seconds\": 0}\\n')\ndef add(a, b):\n  return a + b",
        "assert add(1, 2) == 3", "runtime error", "the program wrote on the call pipe out of "
        "turn"),
    "a handle number of its own": (
        FORGE + "def add(a, b):\n  forge(b'{\"handle\": 7}\\n')\n  os._exit(0)",
        "assert add(1, 2) == 3", "runtime error",
        "add: the sandbox answered with handle 7 where the host asked for #1"),
}


@pytest.mark.parametrize("attack", sorted(HANDLE_ATTACKS))
def test_handles_carry_method_calls_and_plain_values_only(sandbox, attack):
  src, test, status, detail = HANDLE_ATTACKS[attack]
  result, = sandbox.run_assert_tests(src, [test], entry_point="add")
  assert (result.status, detail in result.detail) == (status, True), result


def test_a_handle_refuses_calls_once_its_run_has_ended(sandbox):
  # A handle kept past its run (here in a module, which outlives the tests' namespaces)
  # must not reach the next program, which holds an instance under the same number.
  setup = ("import sys, types\n"
           "kept = sys.modules.setdefault('longrl_kept', types.ModuleType('longrl_kept'))")
  try:
    first = sandbox.run_assert_tests(MIN_STACK, ["kept.stack = MinStack()\nkept.stack.push(1)"],
                                     entry_point="MinStack", setup=setup)
    later = sandbox.run_assert_tests(
        MIN_STACK, ["MinStack().push(5)\nassert kept.stack.getMin() == 5"],
        entry_point="MinStack", setup=setup)
  finally:
    sys.modules.pop("longrl_kept", None)
  assert first[0].status == "accepted", first
  assert later[0].status == "runtime error", later
  assert "MinStack#1.getMin: the run it belongs to has ended" in later[0].detail


def test_fallback_without_bubblewrap_warns_and_still_runs():
  with pytest.warns(RuntimeWarning, match="without namespace isolation"):
    box = Sandbox(Limits(wall_seconds=1.0), isolation="none")
  with box:
    assert box.run("print(6 * 7)")["stdout"] == "42\n"
    assert box.run("while True:\n  pass")["status"] == "timeout"
    assert box.run_assert_tests("def f(x):\n  return x * 2", ["assert f(4) == 8"],
                                entry_point="f")[0].passed


def test_pool_runs_jobs_in_order():
  jobs = [Job(f"print({i} * {i})", stdio_tests=(StdioTest("", f"{i * i}\n"),))
          for i in range(12)]
  jobs[5] = Job("print(-1)", stdio_tests=(StdioTest("", "25\n"),))
  with CodeSandbox(workers=2) as pool:
    results = pool.run_batch(jobs)
  assert [r[0].passed for r in results] == [i != 5 for i in range(12)]


def test_code_task_bundled_sample():
  task = CodeTask()
  for record in list(task.train.records) + list(task.test.records):
    assert task.verify(task.solution(record), record), record["prompt"]
    assert not task.verify("```python\nprint('passed')\n```", record)
  assert task.well_formed("```python\ndef f():\n  return 1\n```")
  assert not task.well_formed("def f(:")
  task.sandbox.close()


def test_code_task_rejects_malformed_records(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text(json.dumps({"prompt": "p", "tests": ["assert f(1)"]}) + "\n")
  with pytest.raises(ValueError, match="entry_point"):
    CodeTask(train_path=str(path), test_path=str(path))
  path.write_text("{not json}\n")
  with pytest.raises(ValueError, match="bad.jsonl:1: not valid JSON"):
    CodeTask(train_path=str(path), test_path=str(path))


@pytest.mark.slow
def test_humaneval_canonical_pass_and_broken_bodies_fail_with_their_status():
  problems = humaneval().records
  assert len(problems) == 164
  bodies = {"canonical": None, "return None": "    return None\n",
            "infinite loop": "    while True:\n        pass\n"}
  expected = {"canonical": "accepted", "return None": "wrong answer", "infinite loop": "timeout"}
  for name, body in bodies.items():
    # The loops only need to outlast a short wall clock; the others get the default limit.
    limits = Limits(wall_seconds=0.1 if name == "infinite loop" else 5.0)
    with CodeSandbox(workers=2, limits=limits) as pool:
      jobs = [job(p, p["canonical_solution"] if body is None else body) for p in problems]
      statuses = [r[0].status for r in pool.run_batch(jobs)]
    wrong = [(p["task_id"], s) for p, s in zip(problems, statuses) if s != expected[name]]
    assert not wrong, (name, wrong)


def test_whole_tree_limits_sit_in_a_cgroup_where_the_host_allows_one():
  limits = Limits(pids=12, memory_bytes=200 << 20)
  with Sandbox(limits) as box:
    assert box.run("print(1)")["status"] == "ok"
    dirs = box._cgroup.dirs
    writable = os.geteuid() == 0 and os.access("/sys/fs/cgroup", os.W_OK)
    if not writable:  # then the rlimits are the only limit, and that must still work
      assert dirs == []
      return
    assert dirs, "root with a writable /sys/fs/cgroup but no cgroup was made"
    values = {p.name: p.read_text().strip() for d in dirs
              for p in d.iterdir() if p.name in ("pids.max", "memory.limit_in_bytes",
                                                 "memory.max")}
    assert values["pids.max"] == "14"
    assert int(values.get("memory.limit_in_bytes", values.get("memory.max"))) == 200 << 20
    for d in dirs:  # the sandbox's tree lives there (the shell that exec'd bubblewrap)
      assert str(box._process.pid) in (d / "cgroup.procs").read_text().split()
  assert all(not d.exists() for d in dirs)  # removed with the sandbox


def test_a_reply_written_just_before_the_exit_is_relayed_every_time(sandbox):
  # The server once took the exit before the reply when the exit came first in its loop, which
  # a loaded machine made happen about once in 75 runs; 300 runs caught it then.
  src, test, _, detail = HANDLE_ATTACKS["a handle number of its own"]
  details = [sandbox.run_assert_tests(src, [test], entry_point="add")[0].detail
             for _ in range(300)]
  assert sum(detail in d for d in details) == 300, {d for d in details if detail not in d}
