"""JAX's multi-controller runtime: joining it, and moving values between one process and all.

One process per host (or, on CPU, per group of simulated devices), one global mesh over all
their devices (models/sharding.py). Owns `initialize` (jax.distributed, from arguments or the
environment), gathering Python values from every process through JAX's collectives, a
process-local copy of globally sharded params (for an engine that generates on this process
alone), one process's error raised on all of them (`checked`), and moving the loop's small
process-local arrays onto the global mesh and back. With one process every function here is
the identity or a no-op, so callers need no branch of their own.

Environment (read when an argument is not given): JAX_COORDINATOR_ADDRESS (host:port of
process 0's coordinator), JAX_NUM_PROCESSES, JAX_PROCESS_ID.
"""

import os
import pickle
import socket
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils


class CoordinatorUnreachable(ConnectionError):
  """A process could not reach the coordinator within its timeout."""


class ProcessFailed(RuntimeError):
  """Another process's part of a step raised: says which process, and its error."""


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, timeout_s: int = 120,
               detect_cluster: bool = False) -> int:
  """Join the group of `num_processes` processes whose coordinator (process 0) listens on
  `coordinator_address`; returns the number of processes. Nothing given and nothing in the
  environment: one process, nothing done. Must run before JAX starts its backend. On CPU the
  processes' collectives go over gloo (TCP on the coordinator's network). A process other
  than 0 that cannot reach the coordinator within `timeout_s` raises CoordinatorUnreachable
  naming the address; process 0 waits as long for the others (then JAX ends it, its log
  naming the address it waited on).
  `detect_cluster` (with nothing given or in the environment): JAX reads all three from the
  cluster it runs in (a Cloud TPU pod slice, SLURM, Open MPI, ...; jax.distributed.initialize's
  own detection). Off by default: a shell inside a SLURM allocation would otherwise wait for
  processes that never start."""
  coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
  if num_processes is None and "JAX_NUM_PROCESSES" in os.environ:
    num_processes = int(os.environ["JAX_NUM_PROCESSES"])
  if process_id is None and "JAX_PROCESS_ID" in os.environ:
    process_id = int(os.environ["JAX_PROCESS_ID"])
  given = {"coordinator_address": coordinator_address, "num_processes": num_processes,
           "process_id": process_id}
  if all(v is None for v in given.values()):
    if detect_cluster and not jax.distributed.is_initialized():
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
      jax.distributed.initialize(initialization_timeout=timeout_s)
    return jax.process_count() if detect_cluster else 1
  missing = [k for k, v in given.items() if v is None]
  if missing:
    raise ValueError(f"distributed initialize: {missing} not set (give all three of "
                     "coordinator_address, num_processes, process_id, or JAX_COORDINATOR_ADDRESS, "
                     "JAX_NUM_PROCESSES, JAX_PROCESS_ID)")
  if not 0 <= process_id < num_processes:
    raise ValueError(f"distributed initialize: process_id={process_id} is not in "
                     f"[0, num_processes={num_processes})")
  if jax.distributed.is_initialized():
    if jax.process_count() != num_processes or jax.process_index() != process_id:
      raise ValueError(f"JAX is already distributed as process {jax.process_index()} of "
                       f"{jax.process_count()}, not {process_id} of {num_processes}")
    return num_processes
  if num_processes == 1:
    return 1
  if process_id != 0:
    # jax.distributed aborts the whole process (a C++ fatal error, no Python exception) when
    # it cannot reach the coordinator: find that out first, and say which address failed.
    _wait_for(coordinator_address, timeout_s, f"process {process_id} of {num_processes}")
  else:
    print(f"JAX coordinator on {coordinator_address}: waiting up to {timeout_s} s for "
          f"{num_processes} processes", file=sys.stderr, flush=True)
  # Must precede the backend: XLA:CPU picks its cross-process collectives when it starts.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address, num_processes, process_id,
                             initialization_timeout=timeout_s)
  return num_processes


def _wait_for(address: str, timeout_s: float, who: str) -> None:
  """Until a TCP connection to host:port succeeds; CoordinatorUnreachable after timeout_s."""
  host, _, port = address.rpartition(":")
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host, int(port)), timeout=2.0):
        return
    except OSError as e:
      if time.monotonic() > deadline:
        raise CoordinatorUnreachable(
            f"{who} could not reach the JAX coordinator at {address} within {timeout_s} s "
            f"(is process 0 running, and is the address reachable from here?): {e}") from None
      time.sleep(0.25)


def is_primary() -> bool:
  """Process 0: the one that writes metrics, plots, logs and config files."""
  return jax.process_index() == 0


def gather(value: Any) -> list[Any]:
  """`value` from every process, in process order (picklable values; through JAX's
  collectives: first the sizes, then the bytes padded to the largest)."""
  if jax.process_count() == 1:
    return [value]
  data = np.frombuffer(pickle.dumps(value), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.int64(data.size)))
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:data.size] = data
  everyone = np.asarray(multihost_utils.process_allgather(padded))
  return [pickle.loads(everyone[i, :sizes[i]].tobytes()) for i in range(len(sizes))]


def checked(fn: Callable[[], Any], *, before_exchange: Callable[[], None] = lambda: None
            ) -> Any:
  """fn() on this process, returned once every process's fn() has returned. When one
  raises, every process raises: that one its own error, the others ProcessFailed naming it
  (rather than waiting forever in the next collective for a process that has left). Wrap
  the parts one process may fail alone (process 0's calls to the rollout servers).
  `before_exchange()` runs between fn() and the collective that exchanges the outcomes (a
  thread that must wait its turn for collectives waits there)."""
  if jax.process_count() == 1:
    return fn()
  try:
    value, error = fn(), None
  except Exception as e:  # noqa: BLE001 - every error must reach the other processes
    value, error = None, e
  before_exchange()
  failures = gather(None if error is None else f"{type(error).__name__}: {error}")
  if error is not None:
    raise error
  failed = [(i, text) for i, text in enumerate(failures) if text]
  if failed:
    raise ProcessFailed(f"JAX process {failed[0][0]} of {len(failures)} failed: "
                        f"{failed[0][1]}")
  return value


def host_copy(tree):
  """Arrays of `tree` (jit outputs: global arrays with several processes) as whole numpy
  arrays on every process; all must call this together."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  return multihost_utils.process_allgather(tree, tiled=True)


def local_copy(tree):
  """`tree` whole on this process's first device: globally sharded arrays are gathered from
  every process (all must call this together). One process: the tree as it is."""
  if jax.process_count() == 1:
    return tree
  device = jax.local_devices()[0]
  return jax.tree.map(lambda x: jax.device_put(jnp.asarray(x), device), host_copy(tree))


def replicated(tree, mesh):
  """Process-local arrays of `tree` (the same values on every process) as global arrays
  replicated over `mesh`; global ones are left as they are. One process: the tree as it is
  (a jit or device_put places local arrays itself, without a replica on every device)."""
  if jax.process_count() == 1:
    return tree
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.tree.map(lambda x: x if is_global(x) else jax.device_put(np.asarray(x), sharding),
                      tree)


def is_global(x) -> bool:
  """Whether `x` is a jax.Array with shards on other processes' devices."""
  return isinstance(x, jax.Array) and not x.is_fully_addressable


def process_local(tree):
  """Replicated global arrays of `tree` back as this process's own arrays."""
  return jax.tree.map(lambda x: jnp.asarray(np.asarray(x.addressable_data(0)))
                      if is_global(x) else x, tree)
