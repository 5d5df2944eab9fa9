import os

# Sharding and ring-attention tests need a multi-device mesh: XLA simulates 8 CPU devices. Set
# before jax is imported; subprocesses (experiments/run.py) inherit it.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()
# Most tests' time is XLA compiling tiny programs, most of that LLVM optimising the CPU code:
# without it two compile-bound tests took 45 s instead of 66, while 100 SFT steps of the tiny
# checkpoint took 40 s instead of 31. Tests check results, not speed (bench/ measures that).
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

# Many tests compile the same tiny programs (SFT step, sampler, train step), in this process
# and in the subprocesses they start: share compiled executables through JAX's persistent
# cache, in a directory of this session only.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import atexit
  import shutil
  import tempfile
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="longrl-jax-cache-")
  # Removed by the process that made it (pytest-xdist's controller: workers inherit it).
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax
import pytest

from models import config, transformer
from models.tokenizer import CharTokenizer


@pytest.fixture(autouse=True)
def empty_gin_config():
  """Each test starts without bindings: gin's config is global, and a test that parses one
  in-process (run.load_config, the findings) would hand its bindings to whatever runs next."""
  import gin
  gin.clear_config()
  yield
  gin.clear_config()


@pytest.fixture(scope="session")
def tokenizer():
  return CharTokenizer()


@pytest.fixture(scope="session")
def tiny_cfg(tokenizer):
  return config.tiny(tokenizer.vocab_size, hidden_size=32, num_layers=2, num_heads=4,
                     num_kv_heads=2, intermediate_size=64)


@pytest.fixture(scope="session")
def tiny_params(tiny_cfg):
  return transformer.init_params(tiny_cfg, jax.random.PRNGKey(0))
