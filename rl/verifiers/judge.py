"""Model-scored rewards: a judge model reads the problem and the response and gives a verdict.

Owns the judge prompt, the parsing of its answer, the time bound of a batch, and how a judge
combines with a rule-based verifier (`JudgedTask`, which wraps any Task). The judge is any
RolloutEngine (a longrl run or a Hugging Face directory on the embedded engine,
rl.distill.load_teacher, or SGLang servers); the template is the user's.

What the judge must answer, in its text (the last match counts; `parse_verdict`):
  "Verdict: correct" / "Verdict: incorrect" (also yes/no, true/false, pass/fail), or
  "Score: 0.8" (a number in [0, 1], correct when >= `threshold`).
Anything else is unparseable. A batch that runs past `timeout` seconds, or an unparseable
verdict, falls back to the rule-based verdict ("fallback" in JudgedVerdict.source): the
reward never waits on, or is decided by, a judge that did not answer.
"""

import concurrent.futures
import dataclasses
import re
from typing import Any, Literal, Sequence

from models.tokenizer import stop_ids
from rollouts.engine import RolloutEngine, SamplingParams

_VERDICT = re.compile(r"verdict\s*[:=]\s*\**\s*(correct|incorrect|yes|no|true|false|pass|fail)\b",
                      re.IGNORECASE)
_SCORE = re.compile(r"score\s*[:=]\s*\**\s*([01](?:\.\d+)?|\.\d+)\b", re.IGNORECASE)
_POSITIVE = {"correct", "yes", "true", "pass"}
DEFAULT_TEMPLATE = ("Problem: {problem}\nReference answer: {answer}\nResponse: {response}\n"
                    "Is the response's final answer correct? Answer 'Verdict: correct' or "
                    "'Verdict: incorrect'.\n")


def parse_verdict(text: str) -> float | None:
  """The judge's score in [0, 1] (a verdict is 1 or 0), from the last verdict or score
  stated in `text`; None when it states neither."""
  found = [(m.start(), 1.0 if m.group(1).lower() in _POSITIVE else 0.0)
           for m in _VERDICT.finditer(text)]
  found += [(m.start(), float(m.group(1))) for m in _SCORE.finditer(text)
            if 0.0 <= float(m.group(1)) <= 1.0]
  return max(found)[1] if found else None


@dataclasses.dataclass(frozen=True)
class JudgedVerdict:
  correct: bool
  score: float | None  # the judge's, None when it gave none
  source: str  # "judge", "fallback: timeout", "fallback: unparseable", "rule"


@dataclasses.dataclass
class Judge:
  """A judge engine with a prompt template. `template` is formatted with `problem`,
  `response` and `answer` (the record's reference answer, "" when it has none)."""
  engine: RolloutEngine
  tokenizer: Any
  template: str = DEFAULT_TEMPLATE
  max_new_tokens: int = 64
  threshold: float = 0.5
  timeout: float = 60.0  # seconds for one batch
  temperature: float = 0.0

  def __post_init__(self):
    missing = [k for k in ("{problem}", "{response}") if k not in self.template]
    if missing:
      raise ValueError(f"Judge.template lacks {missing}: the judge would not see them")
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="judge")

  def scores(self, problems: Sequence[str], responses: Sequence[str],
             answers: Sequence[str]) -> tuple[list[float | None], str | None]:
    """(score or None per item, None or "timeout"): one batched generate for all of them,
    bounded by `timeout` (past it every score is None; the call finishes in the background)."""
    prompts = [self.tokenizer.encode(self.template.format(problem=p, response=r, answer=a),
                                     add_bos=True)
               for p, r, a in zip(problems, responses, answers)]
    sampling = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                              stop_token_ids=stop_ids(self.tokenizer))
    future = self._pool.submit(self.engine.generate, prompts, sampling, seed=0)
    try:
      completions = future.result(timeout=self.timeout)
    except concurrent.futures.TimeoutError:
      return [None] * len(prompts), "timeout"
    return [parse_verdict(self.tokenizer.decode(c.token_ids)) for c in completions], None

  def close(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)


Combine = Literal["judge", "and", "or"]


@dataclasses.dataclass
class JudgedTask:
  """`task` with its verdicts from `judge`. combine: "judge" (the judge's verdict), "and"
  (both the task's rule and the judge), "or" (either). Where the judge gives no verdict
  (timeout, unparseable), the task's rule decides. Everything else is the task's."""
  task: Any
  judge: Judge
  combine: Combine = "judge"

  def __post_init__(self):
    if self.combine not in ("judge", "and", "or"):
      raise ValueError(f"JudgedTask.combine={self.combine!r}; valid: 'judge', 'and', 'or'")

  @property
  def train(self):
    return self.task.train

  @property
  def test(self):
    return self.task.test

  def prompt(self, record: dict[str, Any]) -> str:
    return self.task.prompt(record)

  def solution(self, record: dict[str, Any]) -> str:
    return self.task.solution(record)

  def well_formed(self, completion: str) -> bool:
    return self.task.well_formed(completion)

  def answer(self, completion: str) -> str | None:
    return self.task.answer(completion)

  def verify(self, completion: str, record: dict[str, Any]) -> bool:
    return self.verify_batch([completion], [record])[0]

  def verify_batch(self, completions: Sequence[str], records: Sequence[dict[str, Any]]
                   ) -> list[bool]:
    return [v.correct for v in self.judged(completions, records)]

  def judged(self, completions: Sequence[str], records: Sequence[dict[str, Any]]
             ) -> list[JudgedVerdict]:
    """Every completion's verdict, judged in one batch, with where it came from."""
    rule = [self.task.verify(c, r) for c, r in zip(completions, records)]
    scores, failure = self.judge.scores([self.task.prompt(r) for r in records], completions,
                                        [str(r.get("answer", "")) for r in records])
    verdicts = []
    for by_rule, score in zip(rule, scores):
      if score is None:
        verdicts.append(JudgedVerdict(by_rule, None, f"fallback: {failure or 'unparseable'}"))
        continue
      by_judge = score >= self.judge.threshold
      correct = {"judge": by_judge, "and": by_judge and by_rule,
                 "or": by_judge or by_rule}[self.combine]
      verdicts.append(JudgedVerdict(correct, score, "judge"))
    return verdicts
