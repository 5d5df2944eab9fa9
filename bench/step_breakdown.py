"""Where the peer-config train step spends its time, ours against the plain PyTorch loop. Not a test.

  python bench/step_breakdown.py [--rounds 3] [--out bench/results]

The step of bench/peers.py (same config, batch, GRPO loss and AdamW), built again with parts
of the model switched off: attention replaced by an elementwise stand-in of the same shapes
(q * k + v, keys and values repeated over their query-head group), the MLP by the identity,
the output head and log-probs by a cheap function of the hidden states. Every variant of one
framework is compiled (or built) in one process and the variants are timed in turn, `rounds`
times, keeping each one's fastest step, so that the machine's drift hits them alike. A part's
cost is then estimated twice: full step minus the step without it, and (for the MLP) the
MLP-only step minus the step with nothing but projections, norms, embeddings and AdamW ("rest").
PyTorch runs in bench/.venvs/torch (created by bench/peers.py).
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import peers  # noqa: E402

VARIANTS = {  # name -> (attention, mlp, head) kept
    "full": (True, True, True), "no_attention": (False, True, True),
    "no_mlp": (True, False, True), "no_head": (True, True, False),
    "mlp_only": (False, True, False), "rest": (False, False, False)}


def _fastest(steps: dict, rounds: int) -> dict:
  """steps: name -> zero-argument function running one step (and waiting for it)."""
  for fn in steps.values():
    fn()
  best = {name: float("inf") for name in steps}
  for _ in range(rounds):
    for name, fn in steps.items():
      best[name] = min(best[name], peers._timed(fn))
  return best


def ours(rounds: int) -> dict:
  from models import host_allocator
  host_allocator.keep_freed_memory()  # as experiments/run.py and bench/peers.py do
  import jax
  import jax.numpy as jnp
  from models import projections
  from models.attention import dispatch
  from rl import losses
  from rl import train_step as train_step_lib

  cfg, optimizer, state, batch = peers.ours_setup()
  p = peers.PEER
  group = p["heads"] // p["kv_heads"]
  stand_ins = {
      "attention": (dispatch, "attention", lambda q, k, v, segment_ids, kernel="auto":
                    q * jnp.repeat(k, group, axis=2) + jnp.repeat(v, group, axis=2)),
      "mlp": (projections.MLP, "__call__", lambda self, x: x),
      "head": (train_step_lib.logprobs_lib, "token_logprobs",
               lambda hidden, unembed, targets, chunk_size=0:
               (hidden[..., 0] * unembed[0, 0], hidden[..., 1]))}
  steps = {}
  for name, kept in VARIANTS.items():
    saved = {part: getattr(owner, attr) for part, (owner, attr, _) in stand_ins.items()}
    for keep, (part, (owner, attr, stand_in)) in zip(kept, stand_ins.items()):
      if not keep:
        setattr(owner, attr, stand_in)
    step = train_step_lib.make_train_step(cfg, optimizer, losses.bind("grpo", {"kl_coef": 0.0}),
                                          logprob_chunk=1024)
    compiled = step.lower(state, batch).compile()
    for part, (owner, attr, _) in stand_ins.items():
      setattr(owner, attr, saved[part])
    steps[name] = lambda compiled=compiled: jax.block_until_ready(compiled(state, batch)[1])
  return _fastest(steps, rounds)


def torch(rounds: int) -> dict:
  import torch as pt
  from transformers import AttentionInterface

  p = peers.PEER

  def stand_in_attention(module, q, k, v, mask, **kwargs):  # q [b, h, s, d] -> [b, s, h, d]
    group = q.shape[1] // k.shape[1]
    out = q * k.repeat_interleave(group, 1) + v.repeat_interleave(group, 1)
    return out.transpose(1, 2).contiguous(), None

  AttentionInterface.register("stand_in", stand_in_attention)
  tokens, adv = (pt.tensor(x) for x in peers._batch_numpy())
  tokens = tokens.long()
  targets = tokens[:, p["prompt"]:]
  old_logp = pt.full(targets.shape, -9.0)

  def make(attention, mlp, head):
    model = peers.hf_model()
    if not attention:
      model.config._attn_implementation = "stand_in"
    if not mlp:
      for layer in model.model.layers:
        layer.mlp.forward = lambda x: x
    opt = pt.optim.AdamW(model.parameters(), lr=1e-6)

    def one():
      if head:
        logits = model(tokens).logits[:, p["prompt"] - 1:-1]
        loss = peers._grpo_loss_torch(logits, targets, adv, old_logp)
      else:
        hidden = model.model(tokens).last_hidden_state
        loss = (hidden[..., 0] * model.lm_head.weight[0, 0]).mean()
      loss.backward()
      opt.step()
      opt.zero_grad(set_to_none=True)

    return one

  return _fastest({name: make(*kept) for name, kept in VARIANTS.items()}, rounds)


def parts(t: dict) -> dict:
  """Each part's estimated seconds from one framework's variant times."""
  return {"attention": t["full"] - t["no_attention"], "mlp": t["full"] - t["no_mlp"],
          "mlp (mlp_only - rest)": t["mlp_only"] - t["rest"], "head": t["full"] - t["no_head"],
          "rest": t["rest"]}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
  parser.add_argument("--_framework", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args._framework:  # child process: JSON on the last stdout line
    print(json.dumps({"ours": ours, "torch": torch}[args._framework](args.rounds)))
    return
  results = {}
  for framework, python in (("ours", os.path.join(ROOT, ".venv", "bin", "python")),
                            ("torch", peers.venv_python("torch"))):
    print(f"== {framework}", flush=True)
    proc = subprocess.run([python, __file__, "--_framework", framework, "--rounds",
                           str(args.rounds)], stdout=subprocess.PIPE, text=True)
    if proc.returncode:
      raise SystemExit(f"step breakdown of {framework!r} failed (exit {proc.returncode})")
    results[framework] = json.loads(proc.stdout.strip().splitlines()[-1])
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "step_breakdown.json"), "w") as f:
    json.dump(results, f, indent=1)
  print(f"{'variant (s/step)':>24} {'ours':>6} {'torch':>6}")
  for name in VARIANTS:
    print(f"{name:>24} {results['ours'][name]:6.2f} {results['torch'][name]:6.2f}")
  ours_parts, torch_parts = parts(results["ours"]), parts(results["torch"])
  print(f"{'part (estimated s)':>24} {'ours':>6} {'torch':>6}")
  for name in ours_parts:
    print(f"{name:>24} {ours_parts[name]:6.2f} {torch_parts[name]:6.2f}")


if __name__ == "__main__":
  main()
