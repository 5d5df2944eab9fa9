"""Our server's entry point: the command line, the model it serves, and `launch`, which
starts one as a subprocess and waits until it accepts connections.

  python -m rollouts.server --hf_checkpoint DIR [--host 127.0.0.1] [--port 0]
                           [--max_batch 64] [--warmup_len TOKENS] [--deterministic]
                           [--dtype auto|float32|bfloat16|float16]
                           [--enable-memory-saver] [--enable-weights-cpu-backup]
                           [--enable-return-routed-experts] [--context-length N]
                           [--api-key KEY] [--admin-api-key KEY]
                           [--enable-lora --max-lora-rank R --lora-target-modules M ...
                            --lora-paths NAME=DIR ... --max-loaded-loras N
                            --max-loras-per-batch N]
  python -m experiments.serve --gin FILE [--gin_param B] [the options above]

(the second serves a model bound in gin, e.g. `load_model.model = @tiny`: gin is the entry
point's business, and this package imports nothing above rollouts/)

prints "listening on http://HOST:PORT" once it serves. --warmup_len compiles every batch
shape for requests up to that many tokens before serving (Scheduler.warmup).
"""

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Sequence

import jax

from models import hf, hf_lora, transformer
from models.config import ModelConfig
from rollouts import sglang
from rollouts.server.adapters import TARGET_MODULES
from rollouts.server.http_server import serve

def served_dtype(config: dict, dtype: str) -> str:
  """The dtype a server started with `--dtype dtype` computes and holds weights in, by
  SGLang's rule (configs/model_config.py L2284-2324): 'auto' is config.json's dtype
  (torch_dtype), and float32 (or none) becomes float16 (bfloat16 for Gemma). A float32
  export served with --dtype auto computes in float16."""
  if dtype != "auto":
    return dtype
  found = config.get("dtype") or config.get("torch_dtype") or "float32"
  if found not in ("float32", "float"):
    return found
  return "bfloat16" if str(config.get("model_type", "")).startswith("gemma") else "float16"


def load_model(*, model=None, hf_checkpoint: str | None = None, seed: int = 0,
               dtype: str = "auto") -> tuple[ModelConfig, Any, str]:
  """(cfg, params, model_path) to serve: a Hugging Face checkpoint directory, in `dtype`
  (served_dtype; a quantized one's projections held as stored, dequantized on the fly, as
  SGLang serves it), or `model` (a config factory such as models.config.tiny, called with the
  character tokenizer's vocabulary) with random weights from `seed`, in its own dtype unless
  `dtype` names one."""
  if hf_checkpoint:
    with open(os.path.join(hf_checkpoint, "config.json")) as f:
      held = served_dtype(json.load(f), dtype)
    cfg, params = hf.load(hf_checkpoint, dtype=held, param_dtype=held, packed=True)
    return cfg, params, hf_checkpoint
  if model is None:
    raise ValueError("load_model: give hf_checkpoint or model")
  from models.tokenizer import CharTokenizer
  cfg = model(CharTokenizer().vocab_size)
  if dtype != "auto":
    cfg = dataclasses.replace(cfg, dtype=dtype, param_dtype=dtype)
  return cfg, transformer.init_params(cfg, jax.random.PRNGKey(seed)), ""


def _parser() -> argparse.ArgumentParser:
  """The command line of `main` (the module docstring has its synopsis)."""
  parser = argparse.ArgumentParser(description="Serve the embedded JAX engine over SGLang's "
                                   "HTTP protocol.")
  parser.add_argument("--hf_checkpoint", help="a Hugging Face checkpoint directory to serve")
  parser.add_argument("--host", default="127.0.0.1")
  parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
  parser.add_argument("--weight_version", default="default")
  parser.add_argument("--max_batch", type=int, default=64)
  parser.add_argument("--warmup_len", type=int, default=0, metavar="TOKENS",
                      help="before serving, compile every batch shape for requests of up to "
                      "TOKENS tokens (prompt + new); 0: compile shapes as they come")
  parser.add_argument("--dtype", default="auto",
                      choices=("auto", "float32", "bfloat16", "float16", "half", "float"),
                      help="what the weights are held and computed in; auto: config.json's "
                      "dtype, float32 becoming float16 (SGLang's --dtype, served_dtype)")
  parser.add_argument("--deterministic", "--enable-deterministic-inference",
                      action="store_true",
                      default=os.environ.get(sglang.DETERMINISTIC_ENV) == "1",
                      help="each request's output depends on it alone, not on its batch, "
                      "and sampling_seed is honoured (SGLang's --enable-deterministic-"
                      f"inference; default: on when {sglang.DETERMINISTIC_ENV}=1)")
  parser.add_argument("--enable-memory-saver", "--enable_memory_saver", action="store_true",
                      help="/release_memory_occupation frees the weights and KV cache "
                      "(SGLang's flag; without it a release only flushes the cache)")
  parser.add_argument("--enable-weights-cpu-backup", "--enable_weights_cpu_backup",
                      action="store_true", help="released weights are kept in host memory "
                      "and come back on resume (without: undefined until an update)")
  parser.add_argument("--enable-return-routed-experts", "--enable_return_routed_experts",
                      action="store_true", help="a mixture's experts of every token are "
                      "recorded and returned to requests with return_routed_experts "
                      "(SGLang's flag; without it they get none)")
  parser.add_argument("--context-length", "--context_length", type=int, default=None,
                      help="the most tokens (input + max_new_tokens) a request may hold; "
                      "longer ones are refused with SGLang's 400 (default: config.json's, "
                      "as SGLang derives it)")
  parser.add_argument("--api-key", "--api_key", default=None,
                      help="SGLang's --api-key: every call but /health and /ready needs it")
  parser.add_argument("--admin-api-key", "--admin_api_key", default=None,
                      help="SGLang's --admin-api-key: the control calls need it (and no "
                      "longer take the API key)")
  # LoRA: SGLang's flags (sglang srt/arg_groups/fields/lora.py L34-112; rollouts/server/adapters.py)
  parser.add_argument("--enable-lora", "--enable_lora", action="store_true",
                      help="serve LoRA adapters (/load_lora_adapter; on with --lora-paths)")
  parser.add_argument("--max-lora-rank", "--max_lora_rank", type=int, default=None,
                      help="the largest rank a loaded adapter may have")
  parser.add_argument("--lora-target-modules", "--lora_target_modules", nargs="+",
                      default=None, choices=[*TARGET_MODULES, "all"], metavar="MODULE",
                      help="the projections a loaded adapter may adapt (or all)")
  parser.add_argument("--lora-paths", "--lora_paths", nargs="+", default=None,
                      metavar="NAME=DIR", help="adapters loaded at start (PEFT directories)")
  parser.add_argument("--max-loaded-loras", "--max_loaded_loras", type=int, default=None,
                      help="adapters held at most: a load past it evicts the least recently "
                      "used unpinned one")
  parser.add_argument("--max-loras-per-batch", "--max_loras_per_batch", type=int, default=8,
                      help="SGLang's adapter slots, the base's included (at most this minus "
                      "one adapters pinned)")
  parser.add_argument("--exit_with_parent", action="store_true",
                      help="stop when the process that started this one exits (launch sets it)")
  return parser


def main(argv=None, *, load=None):
  """Serve until interrupted. `load() -> (cfg, params, model_path)` gives the model when the
  caller built it (experiments/serve.py: from gin); else --hf_checkpoint does."""
  parser = _parser()
  args = parser.parse_args(argv)
  if args.exit_with_parent:
    parent = os.getppid()

    def watch():
      while os.getppid() == parent:
        time.sleep(1.0)
      os._exit(0)

    threading.Thread(target=watch, daemon=True).start()
  lora, lora_paths = _lora_options(parser, args)
  dtype = {"half": "float16", "float": "float32"}.get(args.dtype, args.dtype)
  if args.hf_checkpoint:
    cfg, params, path = load_model(hf_checkpoint=args.hf_checkpoint, dtype=dtype)
  elif load is not None:
    cfg, params, path = load(dtype=dtype)
  else:
    parser.error("give --hf_checkpoint DIR (a model bound in gin: python -m experiments.serve "
                 "--gin FILE)")
  # The scheduler thread holds the GIL between decode steps; hand it over sooner so that the
  # HTTP threads answer finished and aborted requests within a step or two, not ~5 ms each.
  sys.setswitchinterval(0.0005)
  server = serve(cfg, params, host=args.host, port=args.port,
                 weight_version=args.weight_version, model_path=path, max_batch=args.max_batch,
                 warmup_len=args.warmup_len, deterministic=args.deterministic,
                 memory_saver=args.enable_memory_saver,
                 weights_cpu_backup=args.enable_weights_cpu_backup,
                 return_routed_experts=args.enable_return_routed_experts,
                 context_length=args.context_length, api_key=args.api_key,
                 admin_api_key=args.admin_api_key, lora=lora, lora_paths=lora_paths)
  server.scheduler.on_crash = lambda: os._exit(1)  # as SGLang's server goes down
  del params  # the scheduler's is then the only reference: a release frees the weights
  host, port = server.server_address[:2]
  print(f"listening on http://{host}:{port}", flush=True)
  try:
    threading.Event().wait()
  except KeyboardInterrupt:
    pass


def _lora_options(parser, args) -> tuple[dict | None, dict[str, str]]:
  """serve()'s `lora` and `lora_paths` from the command line, as SGLang checks them at start
  (sglang srt/arg_groups/lora_hook.py): --lora-paths turns LoRA on; without them
  --max-lora-rank and --lora-target-modules are required, else they default to the largest
  rank and every target of the adapters given."""
  paths = {}
  for item in args.lora_paths or ():
    name, sep, path = item.partition("=")
    paths[name if sep else os.path.basename(os.path.normpath(item))] = path if sep else item
  if not (args.enable_lora or paths):
    return None, {}
  if not paths and (not args.max_lora_rank or not args.lora_target_modules):
    parser.error("--enable-lora without --lora-paths needs --max-lora-rank and "
                 "--lora-target-modules (SGLang asserts both at start)")
  if args.lora_target_modules and "all" in args.lora_target_modules and len(
      args.lora_target_modules) > 1:
    parser.error("--lora-target-modules: 'all' stands alone")
  configs = [hf_lora.read_config(path, as_sglang=True) for path in paths.values()]
  rank = args.max_lora_rank or max(c.rank for c in configs)
  targets = args.lora_target_modules or sorted({t for c in configs for t in c.targets})
  if args.max_loaded_loras is not None and args.max_loaded_loras < max(
      args.max_loras_per_batch, len(paths)):
    parser.error("--max-loaded-loras must be at least --max-loras-per-batch and the number "
                 "of --lora-paths")
  return {"max_rank": rank, "targets": targets, "max_loaded": args.max_loaded_loras,
          "max_per_batch": args.max_loras_per_batch}, paths


def launch(args: list[str], *, timeout: float = 300.0, env: dict | None = None,
           module: str = "rollouts.server", cores: Sequence[int] = ()
           ) -> tuple[subprocess.Popen, str]:
  """Start `python -m MODULE ARGS` (this server, or experiments.serve for a gin-bound model)
  and return (process, base URL) once it accepts connections; its stderr goes to ours.
  `cores`: the CPU cores it runs on (taskset; default: ours)."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  pin = ["taskset", "-c", ",".join(map(str, cores))] if cores else []
  process = subprocess.Popen([*pin, sys.executable, "-m", module, *args,
                              "--exit_with_parent"], cwd=root, stdout=subprocess.PIPE,
                             text=True, env=env)
  deadline = time.monotonic() + timeout
  url = None
  while url is None:
    line = process.stdout.readline()
    if not line:
      raise RuntimeError(f"rollouts.server exited with code {process.wait()} before serving "
                         f"(args {args})")
    if line.startswith("listening on "):
      url = line.split()[-1]
    if time.monotonic() > deadline:
      process.kill()
      raise TimeoutError(f"rollouts.server did not start within {timeout} s")
  host, port = url.split("//")[1].split(":")
  while True:
    try:
      with socket.create_connection((host, int(port)), timeout=1):
        return process, url
    except OSError:
      if time.monotonic() > deadline:
        process.kill()
        raise TimeoutError(f"rollouts.server at {url} does not accept connections") from None
      time.sleep(0.05)
