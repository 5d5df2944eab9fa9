"""Teachers for on-policy distillation: which teacher scores which prompt, and the scoring.

Owns `Teachers` (named teacher engines and the routing table from a prompt record's domain
and effort to a teacher) and `teacher_logprobs` (one batched prefill per teacher over a
step's trajectories, with the versions and the student-teacher gap reported). A teacher is
any `rollouts.engine.Scorer`: the embedded JaxEngine over a longrl run or a Hugging Face
directory (`load_teacher`), or an SGLangEngine over servers. The loss that reads the scores
is `opd` (rl/losses.py); K3 (and MOPD, arXiv 2606.30406) merge domain and effort experts
into one student this way.
"""

import dataclasses
import os
import time
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from models import hf, transformer
from models.config import ModelConfig
from rl import ConfigError, checkpoint
from rl.trajectory import Trajectory
from rollouts.engine import Scorer
from rollouts.jax_engine import JaxEngine


@dataclasses.dataclass
class Teachers:
  """Teacher engines by name, and the routes from a record to one of them.

  routes: keys "domain/effort", "domain" or "*" (anything), tried in that order with the
  record's "domain" and "effort" fields (missing ones read as ""); values name an engine.
  top_k > 0 also asks each teacher for its k most likely tokens at every position (top-k
  distillation, the loss's topk_coef): engines with a `score_top_k` (JaxEngine, and
  SGLangEngine through SGLang's top_logprobs_num on the input tokens).
  """
  engines: Mapping[str, Scorer]
  routes: Mapping[str, str]
  top_k: int = 0

  def __post_init__(self):
    unknown = sorted({t for t in self.routes.values() if t not in self.engines})
    if unknown:
      raise ConfigError(f"Teachers.routes name teacher(s) {unknown} that are not among the "
                        f"engines {sorted(self.engines)}")
    if not self.routes:
      raise ConfigError("Teachers.routes is empty: map a domain (or '*') to a teacher")
    without = sorted(n for n, e in self.engines.items() if not hasattr(e, "score_top_k"))
    if self.top_k and without:
      raise ConfigError(f"Teachers.top_k={self.top_k}: teacher(s) {without} cannot give top-k "
                        "tokens (they have no score_top_k; JaxEngine and SGLangEngine do)")

  def route(self, record: Mapping[str, Any]) -> str:
    domain, effort = str(record.get("domain", "")), str(record.get("effort", ""))
    for key in (f"{domain}/{effort}", domain, "*"):
      if key in self.routes:
        return self.routes[key]
    raise ConfigError(f"no teacher for a record of domain {domain!r}, effort {effort!r}: "
                      f"Teachers.routes has {sorted(self.routes)}; add one of "
                      f"{[f'{domain}/{effort}', domain, '*']}")

  def close(self) -> None:
    for engine in self.engines.values():
      close = getattr(engine, "close", None)
      if close is not None:
        close()


def load_teacher(path: str, cfg: ModelConfig, *, version: int = 0) -> JaxEngine:
  """An embedded teacher over `path`: a longrl run directory (its latest params, which must
  have `cfg`'s shapes) or a Hugging Face checkpoint directory (its own config)."""
  if os.path.isdir(os.path.join(path, "checkpoints")):
    like = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0)))
    try:
      return JaxEngine(cfg, checkpoint.load_policy(path, like=like), version=version)
    except ValueError as e:
      raise ConfigError(f"teacher {path}: {e}") from None
  if os.path.exists(os.path.join(path, "config.json")):
    teacher_cfg, params = hf.load(path)
    if teacher_cfg.vocab_size != cfg.vocab_size:
      raise ConfigError(f"teacher {path}: vocab_size {teacher_cfg.vocab_size}, the student's "
                        f"is {cfg.vocab_size}; a teacher must share the student's tokenizer")
    return JaxEngine(teacher_cfg, params, version=version)
  raise ConfigError(f"teacher {path!r} is neither a longrl run (no checkpoints/) nor a "
                    "Hugging Face directory (no config.json)")


def teacher_logprobs(teachers: Teachers, trajectories: Sequence[Trajectory]):
  """Each trajectory's continuation scored by its record's teacher: (f32[n] per trajectory,
  with Teachers.top_k the (i32[n, k], f32[n, k]) top-k per trajectory else None, metrics).
  One `score` call per teacher over all of its trajectories. Metrics: each teacher's weight
  version and share of the trajectories, and the student-teacher gap over all continuation
  tokens, mean(old_logp - teacher_logp) (the k1 estimate of KL(student || teacher) on the
  student's samples)."""
  names = [teachers.route(t.record) for t in trajectories]
  scores: list[np.ndarray | None] = [None] * len(trajectories)
  tops: list[Any] = [None] * len(trajectories)
  metrics: dict[str, float] = {}
  for name in sorted(set(names)):
    index = [i for i, n in enumerate(names) if n == name]
    engine = teachers.engines[name]
    asked = ([trajectories[i].prompt_ids for i in index],
             [trajectories[i].token_ids for i in index])
    if teachers.top_k:  # one prefill for both
      for i, (s, ids, top_logp) in zip(index, engine.score_top_k(*asked, teachers.top_k)):
        scores[i], tops[i] = np.asarray(s, np.float32), (ids, top_logp)
    else:
      for i, s in zip(index, engine.score(*asked)):
        scores[i] = np.asarray(s, np.float32)
    metrics[f"teacher_version/{name}"] = float(engine.version)
    metrics[f"teacher_share/{name}"] = len(index) / len(trajectories)
  gaps = [np.asarray(t.logprobs, np.float32) - s for t, s in zip(trajectories, scores) if len(s)]
  metrics["student_teacher_kl"] = float(np.concatenate(gaps).mean()) if gaps else 0.0
  return scores, (tops if teachers.top_k else None), metrics


def teacher_fields(teachers: Teachers, trajectories: Sequence[Trajectory], reads
                   ) -> tuple[dict[str, list], dict[str, float]]:
  """The "teacher" TrainBatch fields among `reads` (rl.types.optional_field), per trajectory,
  and the scoring's metrics (teacher_logprobs's, and teacher_s: its seconds)."""
  started = time.perf_counter()
  scores, tops, metrics = teacher_logprobs(teachers, trajectories)
  fields = {"teacher_logp": scores,
            "teacher_topk_ids": None if tops is None else [ids for ids, _ in tops],
            "teacher_topk_logp": None if tops is None else [logp for _, logp in tops]}
  metrics["teacher_s"] = time.perf_counter() - started
  return {name: values for name, values in fields.items() if name in reads}, metrics


def from_checkpoints(cfg: ModelConfig, *, paths: Mapping[str, str],
                     routes: Mapping[str, str], top_k: int = 0) -> Teachers:
  """train.teachers over embedded teachers: `paths` maps a teacher's name to a longrl run or a
  Hugging Face directory (load_teacher); `routes` and `top_k` as in Teachers."""
  missing = sorted(set(routes.values()) - set(paths))
  if missing:
    raise ConfigError(f"from_checkpoints: routes name teacher(s) {missing} without a path; "
                      f"paths has {sorted(paths)}")
  return Teachers({name: load_teacher(path, cfg) for name, path in paths.items()}, routes,
                  top_k)
