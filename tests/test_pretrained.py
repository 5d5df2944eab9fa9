"""A run from a pretrained Hugging Face checkpoint (rl/pretrained.py): a tiny Qwen2 / Qwen3
written by transformers, with a BPE tokenizer trained here and Qwen's chat template, made
competent at column addition outside the RL loop (experiments/tiny_checkpoint.py); then the
tiny GRPO recipe raises each one's held-out accuracy on the embedded engine (the Qwen2's again
through a server process started from its directory, through which the Qwen3 runs two
steps on the weights it reloads), resumes after being killed, and exports a
Hugging Face directory that transformers loads with longrl's logits; the other recipes' tiny
variants run, each of their pieces seen in the prompts, rewards and advantages of every
trajectory they train, and the Qwen3 learns in bf16 over float32 master weights as in float32.
Also the pieces: the math data shapes, the chat format's end of turn, and the errors for a bad
directory."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from experiments import tiny_checkpoint
from models import hf, hf_lora, lora, transformer
from models.tokenizer import ChatPrompts, HFTokenizer
from rl import ConfigError
from rl.checkpoint import Checkpointer
from rl.pretrained import HFCheckpoint
from rl.tasks.math import TEMPLATE, MathTask
from tests import real_sglang

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "experiments/configs/recipes/tiny/grpo_math.gin")


def _command(checkpoint: str, run_dir: str, *extra: str, train: str | None = None,
             test: str | None = None) -> list[str]:
  """The tiny GRPO recipe's command, on the checkpoint's data unless `train` / `test`."""
  return [sys.executable, os.path.join(ROOT, "experiments/run.py"), "--gin", RECIPE,
          "--gin_param", f"CHECKPOINT = {checkpoint!r}",
          "--gin_param", f"TRAIN = {train or f'{checkpoint}/data/train.jsonl'!r}",
          "--gin_param", f"TEST = {test or f'{checkpoint}/data/test.jsonl'!r}",
          "--gin_param", "Hooks.progress = False", "--run_dir", run_dir, *extra]


def _summary(run_dir: str) -> dict:
  with open(os.path.join(run_dir, "summary.json")) as f:
    return json.load(f)


def _kill_after_checkpoint(command: list[str], checkpoint_dir: str, step: int) -> None:
  """Start `command` and SIGKILL it once checkpoint `step` is complete (an interruption)."""
  process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
  deadline = time.monotonic() + 300
  try:
    while not os.path.isdir(os.path.join(checkpoint_dir, str(step))):
      assert process.poll() is None, "the run ended before its checkpoint"
      assert time.monotonic() < deadline, f"no checkpoint {step} within 300 s"
      time.sleep(0.2)
    time.sleep(1.0)  # orbax renames the finished checkpoint into place: it is complete
  finally:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)


def _logits(params, cfg, tokens):
  ones = jnp.ones_like(tokens)
  hidden = transformer.forward(params, cfg, tokens, jnp.arange(tokens.shape[1])[None], ones)
  return np.asarray(hidden @ transformer.output_projection(params, cfg))


# Each family's checkpoint is made once per worker, and its tests run on one worker
# (scripts/test.sh distributes by xdist_group), the lightest first (it makes the checkpoint):
# making one takes longer than a run.
QWEN2, QWEN3 = (pytest.mark.xdist_group(family) for family in ("qwen2", "qwen3"))
# The three RL runs that must gain, shorter than the recipe's 30 steps, on half its prompts a
# step and at half its learning rate: on 16 prompts at the recipe's 2e-4 the Qwen2 overshoots
# and oscillates (three runs of the same command through a server, whose batching varies the
# samples, ended 12 steps at +0.02, +0.08 and +0.27 held-out accuracy). At 1e-4, by step 8
# the Qwen2 gained +0.31 to +0.42 in five runs (three through a server, seeds 0 and 1 on the
# embedded engine) and the Qwen3 +0.51 to +0.52 in three. A checkpoint every 4 steps (the
# interruption comes after the first), evaluated at the start and the end.
STEPS = 8
SHORT = ("--gin_param", f"RLConfig.num_steps = {STEPS}", "--gin_param", "Evaluation.every = 0",
         "--gin_param", "Hooks.checkpoint_every = 4", "--gin_param",
         "RLConfig.prompts_per_step = 16", "--gin_param", "RLConfig.learning_rate = 1e-4")
# A recipe's two steps on a quarter of its prompts.
FEW_PROMPTS = ("--gin_param", "RLConfig.prompts_per_step = 8")
# The tiny Qwen3 was made competent answering without thinking.
NO_THINKING = ("--gin_param", "HFCheckpoint.template_args = {'enable_thinking': False}")


@pytest.fixture(scope="session")
def competent(tmp_path_factory):
  """family -> the tiny checkpoint of that family made competent (tiny_checkpoint.make),
  made on first use and kept for the session."""
  made = {}

  def get(family: str) -> str:
    if family not in made:
      # In a process of its own, its XLA optimising the CPU code that conftest.py has the
      # tests compile without: 400 SFT steps are compute, not compiles (about 25% faster so).
      flags = os.environ["XLA_FLAGS"].replace("--xla_backend_optimization_level=0", "")
      made[family] = str(tmp_path_factory.mktemp(family))
      _run([sys.executable, "experiments/tiny_checkpoint.py", made[family], "--family", family,
            "--sft_steps", "400"], env={**os.environ, "XLA_FLAGS": flags})
    return made[family]

  return get


def _run(command: list[str], env=None) -> subprocess.CompletedProcess:
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def _raised_accuracy(run_dir: str) -> dict:
  summary = _summary(run_dir)
  assert summary["init_from"] is not None and summary["sft_loss"] is None  # no SFT
  assert summary["steps"] == STEPS
  assert summary["rl_accuracy"] >= summary["sft_accuracy"] + 0.15, summary
  assert not os.path.exists(os.path.join(run_dir, "sft"))  # the checkpoint is the reference
  return summary


def _export_is_the_runs_in_transformers(run_dir: str, checkpoint: str) -> None:
  """RUN_DIR/hf is a complete Hugging Face directory: transformers loads the model and the
  tokenizer, and its logits are those of the run's last checkpoint."""
  import torch
  import transformers
  export = os.path.join(run_dir, "hf")
  for name in ("config.json", "tokenizer.json", "tokenizer_config.json",
               "generation_config.json"):
    assert os.path.isfile(os.path.join(export, name)), name
  model = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(export)
  prompt = [{"role": "user", "content": "What is 12+34?"}]
  assert hf_tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) \
      == HFTokenizer(export).apply_chat_template(prompt)
  cfg = HFCheckpoint(checkpoint, dtype="float32")(0)
  saved = Checkpointer(os.path.join(run_dir, "checkpoints"))
  params = saved.restore_params()
  saved.close()
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 20))
  with torch.no_grad():
    want = model(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(_logits(params, cfg, jnp.asarray(tokens)), want, atol=1e-4,
                             rtol=0)


def _through_a_server(checkpoint: str, tmp_path, *extra: str) -> str:
  """A run whose rollouts come from a server process started from the checkpoint directory,
  every weight export of which it loads in bf16 with the tokenizer files; returns the run's
  directory."""
  run_dir = str(tmp_path / "run")
  _run(_command(checkpoint, run_dir, *extra, "--gin_param", "train.engine = @local_engine",
                "--gin_param", "local_engine.checkpoint = %CHECKPOINT",
                "--gin_param", "local_engine.export_dtype = 'bfloat16'",
                "--gin_param", "local_engine.weights_dir = " + repr(str(tmp_path / "weights"))))
  versions = sorted(os.listdir(tmp_path / "weights"))
  assert versions, "no weights exported"
  for version in versions:  # in bf16, with the tokenizer files
    assert os.path.isfile(tmp_path / "weights" / version / "tokenizer_config.json"), version
    with safe_open(str(tmp_path / "weights" / version / "model.safetensors"), "np") as f:
      assert f.get_slice("model.norm.weight").get_dtype() == "BF16", version
  return run_dir


# Every trajectory a step trains, in samples.jsonl: FEW_PROMPTS' 8 groups of sizes.gin's 8
# samples (rl.samples.pick keeps them all, in the step's group-major order).
GROUP = 8
EVERY_TRAJECTORY = ("--gin_param", "Hooks.samples_every = 1", "--gin_param",
                    f"Hooks.samples = {8 * GROUP}")


def _trained_groups(run_dir: str) -> dict[int, list[dict]]:
  """step -> the groups it trained, from samples.jsonl: each {"prompt": its samples' one
  prompt, and "correct", "length" (the policy's tokens, the reward transforms' lengths),
  "reward", "advantage": arrays over its samples}."""
  with open(os.path.join(run_dir, "samples.jsonl")) as f:
    rows = [r for r in map(json.loads, f) if r["split"] == "train"]
  steps: dict[int, list[dict]] = {}
  for row in rows:
    steps.setdefault(row["step"], []).append(row)
  trained = {}
  for step, step_rows in steps.items():
    assert len(step_rows) == 8 * GROUP, (step, len(step_rows))
    trained[step] = []
    for start in range(0, len(step_rows), GROUP):
      group = step_rows[start:start + GROUP]
      prompts = {r["prompt"] for r in group}
      assert len(prompts) == 1, prompts
      trained[step].append({"prompt": prompts.pop(), **{
          key: np.array([r[key] for r in group])
          for key in ("correct", "length", "reward", "advantage")}})
  return trained


def _step_metrics(run_dir: str) -> list[dict]:
  """Each RL step's record in metrics.jsonl."""
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [m for m in map(json.loads, f) if m.get("step", 0) > 0]


def _params_moved(run_dir: str) -> float:
  """The largest change of a parameter from the run's step-0 checkpoint to its last."""
  saved = Checkpointer(os.path.join(run_dir, "checkpoints"))
  try:
    start, end = saved.restore_params(0), saved.restore_params()
  finally:
    saved.close()
  return max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
             for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(end)))


# tiny/dapo_math.gin's overlong shaping: over the last CACHE of its MAX_LENGTH tokens.
MAX_LENGTH, CACHE = 40, 16


@QWEN2
def test_the_dapo_recipe_runs_on_the_qwen2(competent, tmp_path):
  """Two steps of tiny/dapo_math.gin, each piece seen on every trajectory trained: its reward
  is DAPO's, +1 / -1 correctness plus the overlong shaping of its length (arXiv 2503.14476
  eq. 13, some of them shaped); every group has mixed verdicts (dynamic sampling dropped the
  others and drew again); the advantages are group-normalised and no KL to a reference is
  computed (the 'dapo' loss, not grpo's of the recipe it includes); the params moved."""
  run_dir = str(tmp_path / "run")
  _runs_a_few_steps("dapo_math", competent("qwen2"), run_dir, *FEW_PROMPTS, *EVERY_TRAJECTORY)
  trained = _trained_groups(run_dir)
  assert sorted(trained) == [1, 2]
  shaped = 0
  for group in (g for groups in trained.values() for g in groups):
    assert group["correct"].any() and not group["correct"].all(), group
    length = group["length"].astype(np.float64)
    soft = MAX_LENGTH - CACHE
    overlong = np.where(length <= soft, 0.0,
                        np.where(length <= MAX_LENGTH, (soft - length) / CACHE, -1.0))
    reward = group["reward"]
    np.testing.assert_allclose(reward, np.where(group["correct"], 1.0, -1.0) + overlong,
                               atol=1e-6, err_msg=str(group))
    shaped += np.count_nonzero(overlong)
    np.testing.assert_allclose(group["advantage"], (reward - reward.mean()) / (
        reward.std(ddof=1) + 1e-6), atol=1e-5, err_msg=str(group))
  assert shaped, "no completion reached the overlong window"
  metrics = _step_metrics(run_dir)
  assert sum(m["generation_rounds"] for m in metrics) > len(metrics), metrics  # drew again
  assert not any("kl_to_reference" in m for m in metrics)
  assert _params_moved(run_dir) > 0


# Kimi k1.5's partial rollouts: an iteration ends once the completions received hold this
# many tokens (a step's 16 x 8 samples hold about 3000), the rest aborted by rid and resumed.
PARTIAL = ("--gin_param", "train.rollouts = @Partial()", "--gin_param",
           "Partial.token_budget = 1500")


def _through_sglang(checkpoint: str, tmp_path, *extra: str) -> str:
  """A run whose rollouts come from the real SGLang 0.5.23 (tests/real_sglang.py) started
  from the checkpoint directory, in float32, token ids in and out (--skip-tokenizer-init, as
  BUILD.md starts it), through remote_engine; returns the run's directory."""
  run_dir, weights = str(tmp_path / "run"), str(tmp_path / "weights")
  server = real_sglang.Server(checkpoint, context_length=512, log=str(tmp_path / "sglang.log"),
                              extra=["--skip-tokenizer-init"])
  try:
    _run(_command(checkpoint, run_dir, *extra, "--gin_param", "train.engine = @remote_engine",
                  "--gin_param", f"remote_engine.urls = [{server.url!r}]",
                  "--gin_param", f"remote_engine.weights_dir = {weights!r}",
                  "--gin_param", "remote_engine.copy_from = %CHECKPOINT",
                  "--gin_param", "remote_engine.export_dtype = 'float32'"))
  finally:
    server.stop()
  assert not server.alive()
  return run_dir


def _mismatch_every_step(run_dir: str, steps: int = STEPS) -> list[float]:
  """Each RL step's engine-vs-trainer mismatch (mean |log-prob difference|) from
  metrics.jsonl, which every step must log."""
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    logged = [line for line in map(json.loads, f) if line.get("step", 0) > 0]
  assert len(logged) == steps and all("engine_logp_diff_mean" in s for s in logged), logged[:1]
  return [s["engine_logp_diff_mean"] for s in logged]


@pytest.mark.slow
@QWEN2
@pytest.mark.parametrize("server", ["ours", "sglang"])
def test_rl_from_a_pretrained_qwen2_through_a_server_with_partial_rollouts(competent, tmp_path,
                                                                          server):
  """+0.15 held-out accuracy in 8 steps with partial rollouts, as on the embedded engine:
  through a server process of ours and through the real SGLang, each started from the
  checkpoint's directory; every step logs the engine-vs-trainer mismatch."""
  checkpoint = competent("qwen2")
  run_dir = (_through_a_server if server == "ours" else _through_sglang)(
      checkpoint, tmp_path, *SHORT, *PARTIAL)
  summary = _raised_accuracy(run_dir)
  mismatch = _mismatch_every_step(run_dir)
  print(f"{server}: accuracy {summary['sft_accuracy']:.2f} -> {summary['rl_accuracy']:.2f}, "
        f"engine-vs-trainer |log-prob difference| per step {np.round(mismatch, 4).tolist()}")
  assert all(np.isfinite(mismatch))


@QWEN2
def test_rl_from_a_pretrained_qwen2_raises_accuracy_resumes_and_exports(competent, tmp_path):
  """On the embedded engine: killed after its step-4 checkpoint, resumed by the same
  command, +0.15 held-out accuracy in 8 steps, and an export transformers reads."""
  checkpoint = competent("qwen2")
  run_dir = str(tmp_path / "run")
  _kill_after_checkpoint(_command(checkpoint, run_dir, *SHORT),
                         os.path.join(run_dir, "checkpoints"), 4)
  result = _run(_command(checkpoint, run_dir, *SHORT))
  assert "resuming from" in result.stdout and "at RL step 4" in result.stdout, result.stdout
  assert _raised_accuracy(run_dir)["init_from"] == checkpoint
  _export_is_the_runs_in_transformers(run_dir, checkpoint)


@QWEN2
def test_a_lora_run_from_a_pretrained_qwen2_exports_merged_weights_and_a_peft_adapter(
    competent, tmp_path):
  """Two LoRA steps of the tiny GRPO recipe (every projection adapted, rank 8, lr 10x the
  recipe's): run_dir/hf holds the merged weights, run_dir/hf_adapter a PEFT directory over
  the checkpoint; peft loads it over transformers' checkpoint to the merged export's logits,
  which are ours of the checkpoint with the run's last adapters."""
  import peft
  import torch
  import transformers
  checkpoint, run_dir = competent("qwen2"), str(tmp_path / "run")
  _runs_a_few_steps("grpo_math", checkpoint, run_dir, *FEW_PROMPTS, "--gin_param",
                    "RLConfig.lora = @LoraConfig()", "--gin_param", "LoraConfig.rank = 8",
                    "--gin_param", "RLConfig.learning_rate = 2e-3", records=8)
  adapter_dir = os.path.join(run_dir, "hf_adapter")
  with open(os.path.join(adapter_dir, hf_lora.CONFIG)) as f:
    assert json.load(f)["base_model_name_or_path"] == checkpoint
  assert not os.path.exists(os.path.join(run_dir, "hf_base"))  # the checkpoint is the base
  tokens = torch.tensor(np.random.default_rng(0).integers(0, 100, (2, 20)))
  with torch.no_grad():
    merged = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "hf"))
    want = merged.eval()(tokens).logits.numpy()
    base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    before = base(tokens).logits.numpy()
    got = peft.PeftModel.from_pretrained(base, adapter_dir).eval()(tokens).logits.numpy()
  assert float(np.max(np.abs(want - before))) > 1e-3  # the adapters moved
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  cfg, params = hf.load(checkpoint)
  adapters, _ = hf_lora.load_adapter(adapter_dir, cfg)
  np.testing.assert_allclose(_logits(lora.attach(params, adapters), cfg,
                                     jnp.asarray(tokens.numpy())), want, atol=1e-4, rtol=0)


# The group accuracy from which tiny/k15_qwen3.gin's length penalty applies, lowered from
# the recipe's 0.5: the tiny Qwen3 was made competent answering without thinking, and
# thinking it is right in about 3% of its samples, so that no group reaches 0.5. (The mask
# itself: tests/test_rewards.py.)
K15_THRESHOLD = 0.0


@QWEN3
def test_the_k15_recipe_runs_on_the_qwen3_in_thinking_mode(competent, tmp_path):
  """Three steps of tiny/k15_qwen3.gin. Every prompt is the checkpoint's chat template as
  transformers renders it with enable_thinking=True (without the empty think block that
  False adds); every trajectory's reward is k1.5's, correctness plus 0.1 x its length reward
  (arXiv 2501.12599 sec. 2.3.3) from step 3 on: warmup_steps = 2, and join_schedules
  switches at the loop's step 2, counted from 0, which the records number 3. The
  advantages are the k1.5 loss's mean baseline, its own metric is logged, and the params
  moved."""
  import transformers
  checkpoint, run_dir = competent("qwen3"), str(tmp_path / "run")
  _runs_a_few_steps("k15_qwen3", checkpoint, run_dir, *FEW_PROMPTS, *EVERY_TRAJECTORY,
                    "--gin_param", f"rewards.accuracy_at_least.threshold = {K15_THRESHOLD}",
                    steps=3)
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)

  def shown(problem: str, thinking: bool) -> str:
    """The prompt of `problem` as transformers renders it, decoded as samples.jsonl shows
    prompts (special tokens dropped)."""
    text = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": TEMPLATE.format(problem=problem)}], tokenize=False,
        add_generation_prompt=True, enable_thinking=thinking)
    return hf_tokenizer.decode(hf_tokenizer.encode(text, add_special_tokens=False),
                               skip_special_tokens=True)

  trained = _trained_groups(run_dir)
  assert sorted(trained) == [1, 2, 3]
  penalised = {step: 0 for step in trained}  # completions the length reward would move
  for step, groups in trained.items():
    weight = 0.1 if step >= 3 else 0.0
    for group in groups:
      problem = re.search(r"What is \d+\+\d+\?", group["prompt"]).group()
      assert group["prompt"] == shown(problem, thinking=True) != shown(problem, thinking=False)
      correct, length = group["correct"], group["length"].astype(np.float64)
      span = length.max() - length.min()
      lam = 0.5 - (length - length.min()) / span if span else np.zeros(len(length))
      bonus = np.where(correct, lam, np.minimum(0.0, lam)) * (
          correct.mean() >= K15_THRESHOLD)
      reward = group["reward"]
      np.testing.assert_allclose(reward, correct + weight * bonus, atol=1e-6,
                                 err_msg=str((step, group)))
      np.testing.assert_allclose(group["advantage"], reward - reward.mean(), atol=1e-6)
      penalised[step] += np.count_nonzero(bonus)
  # The warm-up held back a penalty in steps 1 and 2 that step 3 gave.
  assert all(penalised.values()), penalised
  assert all("log_ratio_seq" in m for m in _step_metrics(run_dir))
  assert _params_moved(run_dir) > 0


# Four updates a step, as recipes/grpo_math.gin makes: with sizes.gin's one, a step moves the
# tiny Qwen3's log-probs by about as much as bf16 rounds them. The server's step-2 mismatch,
# once it reloaded the step-1 export, was 1.2 to 1.5x its step-1 one (the checkpoint itself,
# both in bf16: 0.0058 to 0.0069); a server whose weight loads were made to reread its
# starting checkpoint was at 3.9 to 7.1x (five runs and three, measured; 1.4 and 1.6x with
# one update a step).
RELOADED = 2.5


@pytest.mark.slow
@QWEN3
def test_rl_from_a_pretrained_qwen3_through_a_server_started_from_its_directory(competent,
                                                                                tmp_path):
  """Two steps: the Qwen2 shows the gain through a server, the Qwen3 its gain on the
  embedded engine; here its weights go through the server's reloads. The server samples
  step 1 from the checkpoint as it is and step 2 from the trainer's step-1 export, both in
  bf16: step 2's engine-vs-trainer mismatch stays near step 1's, bf16's alone, and each
  sampled token carries the version being trained."""
  run_dir = _through_a_server(competent("qwen3"), tmp_path, *NO_THINKING, "--gin_param",
                              "RLConfig.num_steps = 2", "--gin_param", "Evaluation.every = 0",
                              "--gin_param", "Evaluation.records = 16", "--gin_param",
                              "RLConfig.minibatches = 4")
  assert _summary(run_dir)["steps"] == 2
  first, second = _mismatch_every_step(run_dir, 2)
  assert 0 < first < 0.02 and second < RELOADED * first, (first, second)
  assert all(m["staleness_max"] == 0 for m in _step_metrics(run_dir))


# The recipes' setting: bf16 compute over float32 master weights (and AdamW moments), the
# engine in bf16 too (recipes/grpo_math.gin); tiny/sizes.gin computes in float32, which a CPU
# runs faster.
BF16 = ("--gin_param", "HFCheckpoint.dtype = 'bfloat16'", "--gin_param",
        "HFCheckpoint.param_dtype = 'float32'", "--gin_param", "embedded_engine.dtype = 'bfloat16'")


@QWEN3
def test_rl_from_a_pretrained_qwen3_on_the_embedded_engine_in_float32_and_bf16(competent,
                                                                              tmp_path):
  """The 8 steps in float32, whose export transformers reads with the run's logits, and in
  the recipes' bf16 setting, which learns as float32 does: its master weights stay float32,
  its held-out gain is within 0.1 of float32's and its mean reward over the last 4 steps
  within 0.05 (measured: +0.515 against +0.52, 0.903 against 0.899; every step's reward
  within 0.031 of float32's)."""
  checkpoint = competent("qwen3")
  runs = {"float32": str(tmp_path / "float32"), "bf16": str(tmp_path / "bf16")}
  gain, late_reward = {}, {}
  for name, extra in (("float32", ()), ("bf16", BF16)):
    _run(_command(checkpoint, runs[name], *SHORT, *NO_THINKING, *extra))
    summary = _raised_accuracy(runs[name])
    gain[name] = summary["rl_accuracy"] - summary["sft_accuracy"]
    late_reward[name] = np.mean([m["reward"] for m in _step_metrics(runs[name])][-4:])
  _export_is_the_runs_in_transformers(runs["float32"], checkpoint)
  saved = Checkpointer(os.path.join(runs["bf16"], "checkpoints"))
  try:
    dtypes = {x.dtype for x in jax.tree.leaves(saved.restore_params())}
  finally:
    saved.close()
  assert dtypes == {jnp.dtype(jnp.float32)}, dtypes
  assert abs(gain["bf16"] - gain["float32"]) <= 0.1, gain
  assert abs(late_reward["bf16"] - late_reward["float32"]) <= 0.05, late_reward


def _runs_a_few_steps(recipe: str, checkpoint: str, run_dir: str, *extra: str,
                      records: int = 16, steps: int = 2, **data: str) -> dict:
  """`steps` steps of tiny/`recipe` evaluated on `records` test records (`data`: `train` /
  `test` files other than the checkpoint's); returns the run's summary."""
  command = _command(checkpoint, run_dir, "--gin_param", f"RLConfig.num_steps = {steps}",
                     "--gin_param", f"Evaluation.records = {records}", *extra, **data)
  command[command.index(RECIPE)] = RECIPE.replace("grpo_math", recipe)
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  summary = _summary(run_dir)
  assert summary["steps"] == steps
  return summary


def test_the_code_recipe_runs_in_the_sandbox_and_its_export_is_evaluated_on_code_and_math(
    tmp_path):
  """tiny/grpo_code.gin for two steps on the CodeContests sample: the warm-started tiny
  model's programs end and the sandbox runs them against the tests (it writes no correct
  one: the rewards are 0). Its export then goes through the evaluation ledger on that code
  and on MATH-shaped problems (rl/tasks/data/math_test.jsonl)."""
  from experiments.evaluation import evaluate_checkpoint
  from rl.eval import SampledEval
  from rl.tasks.code import CodeTask
  from rl.tasks.jsonl import BUNDLED
  checkpoint = tiny_checkpoint.make(str(tmp_path / "raw"), sft_steps=0, progress=False)
  run_dir = str(tmp_path / "run")
  sample = str(BUNDLED / "code_stdio_codecontests.jsonl")
  fields = {"prompt": "description", "tests": ["public_tests", "private_tests",
                                                "generated_tests"], "solution": "solutions"}
  summary = _runs_a_few_steps("grpo_code", checkpoint, run_dir, "--gin_param",
                              f"FIELDS = {fields!r}", records=3, train=sample, test=sample)
  assert summary["sft_loss"] is not None  # the recipe's warm start on the sample's programs
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    steps = [m for m in map(json.loads, f) if "reward" in m]
  assert [m["step"] for m in steps] == [1, 2]
  for m in steps:  # completions that ended were run in the sandbox and scored
    assert m["truncated"] < 1 and m["verify_busy_s"] > 0 and 0 <= m["reward"] <= 1, m

  # The export through the ledger: pass@k, maj@k and mean@k per budget, on code and math.
  spec = SampledEval(samples=2, ks=(1, 2), budgets=(64, 128))
  tasks = {"code": CodeTask(train_path=sample, test_path=sample, fields=fields),
           "math": MathTask(train_path=str(BUNDLED / "math_train.jsonl"),
                            test_path=str(BUNDLED / "math_test.jsonl"))}
  for name, task in tasks.items():
    report, paths = evaluate_checkpoint(str(tmp_path / f"eval_{name}"), task=task,
                                        hf_checkpoint=os.path.join(run_dir, "hf"), spec=spec,
                                        num_records=3)
    assert report["prompts"] == 3 and report["samples"] == 2
    for budget in (64, 128):
      metrics = report["budgets"][budget]
      assert set(metrics) == {"accuracy", "pass@1", "pass@2", "maj@1", "maj@2", "mean@1",
                              "mean@2"}, (name, metrics)
      assert all(0 <= value <= 1 for value in metrics.values()), (name, metrics)
    assert paths and all(os.path.isfile(p) for p in paths), paths
    with open(paths[0]) as f:
      assert set(json.load(f)["budgets"]) == {"64", "128"}


# ---- the pieces


def test_math_task_reads_gsm8k_and_math_shapes(tmp_path):
  gsm8k = tmp_path / "gsm8k.jsonl"
  gsm8k.write_text(json.dumps({"question": "Ann has 48 apples and gives half away. Left?",
                               "answer": "She gives 48/2 = <<48/2=24>>24 away.\n#### 1,024"})
                   + "\n")
  task = MathTask(train_path=str(gsm8k), test_path=str(gsm8k), fields={"problem": "question"})
  record = task.train[0]
  assert record["problem"].startswith("Ann has 48") and record["answer"] == "1024"
  assert task.solution(record) == "She gives 48/2 = 24 away.\nThe answer is \\boxed{1024}."
  assert task.verify("so \\boxed{1024}", record) and not task.verify("\\boxed{24}", record)

  math = tmp_path / "math.jsonl"
  math.write_text(json.dumps({"problem": "What is 1/2 + 1/3?",
                              "solution": "Add: $\\frac{3}{6}+\\frac{2}{6}=\\boxed{\\frac{5}{6}}$"})
                  + "\n")
  task = MathTask(train_path=str(math), test_path=str(math))
  assert task.train[0]["answer"] == "\\frac{5}{6}"
  assert task.verify("\\boxed{5/6}", task.train[0])

  # The same GSM8K records as Parquet, as the hub publishes them.
  import pyarrow
  import pyarrow.parquet
  parquet = tmp_path / "gsm8k.parquet"
  pyarrow.parquet.write_table(pyarrow.Table.from_pylist(
      [json.loads(gsm8k.read_text()), {"question": "No answer here", "answer": ""}]), parquet)
  with pytest.raises(ValueError, match=r"gsm8k.parquet:row 2: no answer"):
    MathTask(train_path=str(parquet), test_path=str(gsm8k), fields={"problem": "question"})
  pyarrow.parquet.write_table(pyarrow.Table.from_pylist([json.loads(gsm8k.read_text())]),
                              parquet)
  task = MathTask(train_path=str(parquet), test_path=str(gsm8k), fields={"problem": "question"})
  assert task.train[0]["answer"] == "1024" and task.train[0] == task.test[0]

  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps({"problem": "x"}) + "\n" + json.dumps({"problem": "y",
                                                                  "answer": "1"}) + "\n")
  with pytest.raises(ValueError, match=r"bad.jsonl:1: no answer"):
    MathTask(train_path=str(bad), test_path=str(bad))
  with pytest.raises(ValueError, match=r"MathTask.fields names \['question'\]"):
    MathTask(train_path=str(math), test_path=str(math), fields={"question": "problem"})
  with pytest.raises(ValueError, match="MathTask.train_path is not set"):
    MathTask(train_path=None, test_path=str(math))


@pytest.fixture(scope="module")
def qwen3_tokenizer_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("qwen3_tok"))
  tiny_checkpoint.write_tokenizer(path, ["What is 1+2? The answer is \\boxed{3}."] * 20,
                                  family="qwen3", vocab_size=300)
  return path


def test_chat_prompts_end_the_turn_and_shape_the_prompt(qwen3_tokenizer_dir):
  tokenizer = HFTokenizer(qwen3_tokenizer_dir)
  chat = ChatPrompts(tokenizer, system_prompt="Be brief.",
                     template_args={"enable_thinking": False})
  im_end = tokenizer.encode("<|im_end|>")
  assert chat.eos_id == im_end[0]  # the template's end of an assistant turn
  prompt = tokenizer.decode(chat.encode("What is 1+2?", add_bos=True))
  assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1+2?"
                    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
  completion = chat.encode("\\boxed{3}", add_eos=True)
  assert completion == tokenizer.encode("\\boxed{3}") + im_end
  assert chat.decode(completion) == "\\boxed{3}"


def test_a_bad_checkpoint_directory_is_named_before_anything_is_built(tmp_path,
                                                                      qwen3_tokenizer_dir):
  with pytest.raises(ConfigError, match="HFCheckpoint.path is not set"):
    HFCheckpoint(None).check()
  with pytest.raises(ConfigError, match="is not a directory"):
    HFCheckpoint(str(tmp_path / "nowhere")).check()
  with pytest.raises(ConfigError, match="has no config.json"):
    HFCheckpoint(qwen3_tokenizer_dir).check()
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
  (tmp_path / "tokenizer.json").write_text(
      open(os.path.join(qwen3_tokenizer_dir, "tokenizer.json")).read())
  with pytest.raises(ConfigError, match="model_type='gpt2'"):
    HFCheckpoint(str(tmp_path)).check()


def test_a_conversation_trains_on_the_assistants_tokens_only(tmp_path):
  tiny_checkpoint.write_tokenizer(str(tmp_path), ["What is 1+2? The answer is 3."] * 20,
                                  family="qwen2", vocab_size=300)
  chat = HFCheckpoint(str(tmp_path)).tokenizer()
  messages = [{"role": "user", "content": "What is 1+2?"},
              {"role": "assistant", "content": "The answer is 3."},
              {"role": "user", "content": "And 2+2?"}, {"role": "assistant", "content": "4"}]
  ids, mask = chat.encode_conversation(messages)
  tokenizer = chat.tokenizer
  assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages,
                                                                add_generation_prompt=False)
  learned = tokenizer.decode([i for i, m in zip(ids, mask) if m])
  assert learned == "The answer is 3.<|im_end|>4<|im_end|>"  # not the "\n" after each turn
  prompt, targets, target_mask = __import__("rl.sft", fromlist=["x"]).conversation_example(
      chat, messages, "here")
  assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
  assert tokenizer.decode(targets).endswith("4<|im_end|>") and target_mask[-1]

  # A template that renders an earlier assistant turn otherwise once later turns follow.
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  config["chat_template"] = ("{%- for m in messages %}{%- if m.role == 'assistant' and not "
                             "loop.last %}{{- '<|im_start|>assistant\\n<|im_end|>\\n' }}"
                             "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + "
                             "'<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
                             "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                             "{%- endif %}")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  with pytest.raises(ValueError, match="renders assistant turn 1 differently"):
    HFCheckpoint(str(tmp_path)).tokenizer().encode_conversation(messages)


def test_an_sft_stage_then_its_export_evaluated_and_a_run_from_its_params(tmp_path):
  """WarmStart over a pretrained checkpoint fine-tunes its params (not a random model) on
  the demonstrations, and the result is the reference policy; the run's export goes through
  the sampled evaluation (pass@k, maj@k at two budgets) on GSM8K-shaped data; a new run
  starts from its params (FromRun) on the same pretrained model."""
  checkpoint = tiny_checkpoint.make(str(tmp_path / "raw"), sft_steps=0, progress=False)
  run_dir = str(tmp_path / "run")
  result = subprocess.run(_command(
      checkpoint, run_dir, "--gin_param", "train.start = @WarmStart()",
      "--gin_param", f"WarmStart.demonstrations = '{checkpoint}/data/sft.jsonl'",
      "--gin_param", "WarmStart.steps = 150", "--gin_param", "WarmStart.batch_size = 32",
      "--gin_param", "RLConfig.num_steps = 2", "--gin_param", "Evaluation.every = 0"),
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  summary = _summary(run_dir)
  assert summary["sft_loss"] < 1.0 and summary["init_from"] is None, summary
  # It learned where a turn ends: untrained, every answer runs to the 40-token limit.
  assert summary["sft_length"] < 35, summary
  assert "after SFT: held-out accuracy" in result.stdout
  assert os.path.isdir(os.path.join(run_dir, "sft"))  # the reference: the fine-tuned params

  # Its export through the evaluation ledger: pass@k, maj@k and mean@k at two budgets.
  from experiments.evaluation import evaluate_checkpoint
  from rl.eval import SampledEval
  task = MathTask(train_path=f"{checkpoint}/data/train.jsonl",
                  test_path=f"{checkpoint}/data/test.jsonl", fields={"problem": "question"})
  report, paths = evaluate_checkpoint(
      str(tmp_path / "eval"), task=task, hf_checkpoint=os.path.join(run_dir, "hf"),
      spec=SampledEval(samples=4, ks=(1, 4), budgets=(20, 40)), num_records=8)
  for budget in (20, 40):
    assert {"pass@1", "pass@4", "maj@4", "mean@4"} <= set(report["budgets"][budget])
  assert paths and all(os.path.isfile(p) for p in paths)

  # A new run from this one's params (init_from) on the same pretrained model.
  from models import hf
  from rl import trainer
  model = HFCheckpoint(checkpoint, dtype="float32")
  hooks = trainer.Hooks(evaluation=trainer.Evaluation(records=16), progress=False,
                        tensorboard=False)
  run = trainer.build(str(tmp_path / "from_run"), task=task, model=model,
                      start=trainer.FromRun(run_dir), hooks=hooks)
  try:
    saved = Checkpointer(os.path.join(run_dir, "checkpoints"))
    want = saved.restore_params()
    saved.close()
    for got, expected in zip(jax.tree.leaves(run.state.train.params), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
  finally:
    run.close()

  # With no SFT step, the params are the checkpoint's: the stage starts from them.
  run = trainer.build(str(tmp_path / "zero"), task=task, model=model, start=trainer.WarmStart(
      steps=0, demonstrations=f"{checkpoint}/data/sft.jsonl"), hooks=hooks)
  try:
    _, want = hf.load(checkpoint, model(0))
    for got, expected in zip(jax.tree.leaves(run.state.train.params), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
  finally:
    run.close()


def test_prompts_that_leave_no_room_for_a_completion_are_refused(tmp_path):
  """A chat template and system prompt can outgrow RLConfig.seq_len: said before anything
  is built, not found as completions truncated after a token or two."""
  from rl import trainer
  from rl.config import RLConfig
  checkpoint = tiny_checkpoint.make(str(tmp_path / "raw"), sft_steps=0, progress=False)
  task = MathTask(train_path=f"{checkpoint}/data/train.jsonl",
                  test_path=f"{checkpoint}/data/test.jsonl", fields={"problem": "question"})
  with pytest.raises(ConfigError, match=r"a training prompt has \d+ tokens .* RLConfig.seq_len=48"
                     r" leaves \d+ for its completion"):
    trainer.build(str(tmp_path / "run"), task=task, model=HFCheckpoint(checkpoint),
                  rl=RLConfig(seq_len=48, max_new_tokens=40, prompts_per_step=4),
                  hooks=trainer.Hooks(evaluation=trainer.Evaluation(records=16)))
  assert not os.path.exists(tmp_path / "run")  # nothing written


def test_the_bundled_gsm8k_sample_reads_and_its_solutions_verify():
  from rl.tasks.jsonl import BUNDLED
  task = MathTask(train_path=str(BUNDLED / "gsm8k_train.jsonl"),
                  test_path=str(BUNDLED / "gsm8k_test.jsonl"), fields={"problem": "question"})
  assert len(task.train) == 40 and len(task.test) == 16
  assert not {r["problem"] for r in task.train.records} & {r["problem"] for r in task.test.records}
  for record in task.train.records + task.test.records:
    assert task.verify(task.solution(record), record), record
    assert "<<" not in task.solution(record)
