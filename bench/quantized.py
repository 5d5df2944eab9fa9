"""The embedded engine on quantized weights, not a test: what it holds, what a refit moves and
how fast it generates, with bf16, FP8 and INT4 weights at a real model's shape.

  python bench/quantized.py [--model qwen2.5-0.5b] [--rows 16] [--prompt 64] [--new 64]
                            [--out bench/results] [--small]

(writes bench/results/quantized_<backend>.json; runs unchanged on a GPU)

One set of random float32 master weights of the model's shape (bench/memory.py CONFIGS, bf16
compute), then for each format an embedded engine holding them in bf16
(`embedded_engine(dtype='bfloat16', weight_format=None | 'fp8' | 'int4')`):
- weights: the GiB it holds (JaxEngine.weight_bytes) and their ratio to bf16's;
- refit: the GiB of the Hugging Face export a server loads at each refit (models/hf.save with
  that quantization: its files' bytes), and the seconds of the engine's own update_weights
  (the cast, and the quantization, on the device);
- tokens/s: `rows` prompts of `prompt` tokens, `new` tokens each (greedy, no stop token), the
  median of REPEATS timed calls after a warm-up, and its ratio to bf16's.
The engine dequantizes its projections once per generate call and decodes on that copy: the
formats cut the bytes held and moved, not the bytes each decode step reads (SGLang's FP8 and
INT4 Marlin kernels read the packed weights). --small: 2 layers of the same width.
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from memory import CONFIGS  # noqa: E402
from models import hf, transformer  # noqa: E402
from rollouts.engine import SamplingParams  # noqa: E402
from rollouts.jax_engine import embedded_engine  # noqa: E402

FORMATS = {"bf16": None, "fp8": "fp8", "int4": "int4"}
REPEATS = 3
GIB = 2**30


def export_bytes(params, cfg, fmt: str | None) -> int:
  """Bytes of the bf16 Hugging Face export in weight format `fmt` (its safetensors files)."""
  with tempfile.TemporaryDirectory(prefix="quantized-",
                                   dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
    out = hf.save(params, dataclasses.replace(cfg, param_dtype="bfloat16"),
                  os.path.join(d, "export"), quantization=fmt)
    return sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)
               if f.endswith(".safetensors"))


def measure(cfg, params, fmt: str | None, rows: int, prompt: int, new: int) -> dict:
  """One format's figures (the module docstring says which)."""
  engine = embedded_engine(cfg, params, 0, dtype="bfloat16", weight_format=fmt)
  started = time.perf_counter()
  engine.update_weights(params, 1)
  jax.block_until_ready(engine.params)
  update_s = time.perf_counter() - started
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, cfg.vocab_size, prompt).tolist() for _ in range(rows)]
  sampling = SamplingParams(max_new_tokens=new, temperature=0.0)
  engine.generate(prompts, sampling, seed=0)  # compiles
  seconds = []
  for k in range(REPEATS):
    started = time.perf_counter()
    out = engine.generate(prompts, sampling, seed=k)
    seconds.append(time.perf_counter() - started)
  tokens = sum(len(c.token_ids) for c in out)
  return {"weights_gib": engine.weight_bytes / GIB, "refit_export_gib":
          export_bytes(params, cfg, fmt) / GIB, "update_s": update_s,
          "tokens": tokens, "generate_s": statistics.median(seconds),
          "tokens_per_s": tokens / statistics.median(seconds)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(CONFIGS))
  parser.add_argument("--rows", type=int, default=16)
  parser.add_argument("--prompt", type=int, default=64)
  parser.add_argument("--new", type=int, default=64)
  parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
  parser.add_argument("--small", action="store_true")
  args = parser.parse_args()
  shape = dict(CONFIGS[args.model], **({"num_hidden_layers": 2} if args.small else {}))
  cfg = hf.config_from_hf(shape, dtype="bfloat16", param_dtype="float32")
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  backend = jax.default_backend()
  print(f"{args.model}{' (2 layers)' if args.small else ''} on {backend}: {args.rows} rows, "
        f"{args.prompt}-token prompts, {args.new} new tokens")
  print(f"{'format':<8}{'weights GiB':>12}{'/ bf16':>8}{'refit GiB':>11}{'update s':>10}"
        f"{'tokens/s':>10}{'/ bf16':>8}")
  rows = {}
  for name, fmt in FORMATS.items():
    r = rows[name] = measure(cfg, params, fmt, args.rows, args.prompt, args.new)
    base = rows["bf16"]
    r.update(weights_over_bf16=r["weights_gib"] / base["weights_gib"],
             refit_over_bf16=r["refit_export_gib"] / base["refit_export_gib"],
             tokens_per_s_over_bf16=r["tokens_per_s"] / base["tokens_per_s"])
    print(f"{name:<8}{r['weights_gib']:>12.3f}{r['weights_over_bf16']:>8.2f}"
          f"{r['refit_export_gib']:>11.3f}{r['update_s']:>10.2f}{r['tokens_per_s']:>10.1f}"
          f"{r['tokens_per_s_over_bf16']:>8.2f}", flush=True)
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, f"quantized_{backend}.json")
  with open(path, "w") as f:
    json.dump({"model": args.model, "small": args.small, "backend": backend,
               "device": jax.devices()[0].device_kind, "rows": args.rows,
               "prompt": args.prompt, "new": args.new, "formats": rows}, f, indent=2)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
