"""The process's host-memory allocator settings under XLA:CPU.

Owns two process-wide choices, and giving freed memory back on demand. First, glibc's malloc
keeps freed memory for reuse instead of handing it back to the kernel. XLA:CPU allocates an
executable's temporary buffer anew for every run, from the thread that runs it (1.7 GB for the
train step of bench/peers.py). glibc serves a block that large, outside the main arena, with a
fresh mmap and frees it with munmap, so every step page-faults its whole working set in again:
~450k page faults and ~1.1 s of kernel time per ~6.5 s step on the 2-core CPU. With one arena,
no mmap and no trimming the block is reused: the faults and the kernel time are gone, and the
step is ~7% faster.

The price: memory freed by the process is not returned to the system until it exits, so its
RSS stays at its peak (which a training process reaches every step anyway). That makes the
second choice necessary. XLA:CPU's asynchronous dispatch frees a run's temporary buffer on a
worker thread after the run's outputs are ready, so the next run, dispatched as soon as they
are, can allocate its own buffer while the last one is still held; the heap then grows by a
whole buffer, for good. With two busy processes beside it on the 2-core CPU, the peak RSS of
bench/peers.py's step went 2.6 -> 4.1 -> 5.6 GiB over six steps in 5 of 5 runs; dispatched
synchronously it stayed at 2.6 GiB in 5 of 5. So runs are dispatched synchronously: a call
returns after its buffer is freed (the step's time did not change).

`keep_freed_memory()` must run before JAX starts its CPU backend (the first array or
computation): threads that already allocated keep their own arenas. Entry points call it first
thing (experiments/run.py, bench/peers.py); in a notebook, call it in the first cell. It does
nothing off glibc (macOS, musl).

`return_freed_memory()` is the opposite, for a moment rather than a process: what is free on
the heap goes back to the kernel now (a server that released its weights between steps).
"""

import ctypes
import logging
import platform

import jax

_log = logging.getLogger("longrl.host_allocator")

# mallopt parameters, from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


def keep_freed_memory() -> bool:
  """Set glibc malloc to one arena, no mmap'd blocks and no trimming, and XLA:CPU's dispatch to
  synchronous; True when applied."""
  if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
    return False
  libc = ctypes.CDLL(None)
  applied = all(libc.mallopt(param, value) == 1 for param, value in (
      (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1)))  # -1: never trim
  jax.config.update("jax_cpu_enable_async_dispatch", False)
  if not applied:
    _log.warning("host allocator: glibc refused a mallopt setting; XLA:CPU's per-run "
                 "buffers will be page-faulted in anew each run")
  return applied


def return_freed_memory() -> bool:
  """Hand the memory this process has freed back to the kernel now (glibc's malloc_trim):
  glibc keeps freed blocks of the sizes a model's arrays have on its heap, so a process that
  drops its weights (a server releasing its memory for a hybrid deployment's trainer) would
  not shrink otherwise. True when glibc returned some."""
  if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
    return False
  # XLA:CPU frees deleted buffers on its own threads; one computation run to its end after
  # the deletes lets those frees happen first (without it, 1 run in 4 kept most of a 0.5B
  # model's weights).
  jax.block_until_ready(jax.numpy.zeros(()) + 1)
  return bool(ctypes.CDLL(None).malloc_trim(0))
