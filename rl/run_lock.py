"""The hold of a run directory: one run (one job, of one or several processes) at a time.

Owns RUN_DIR/run.lock. The run's primary process holds an exclusive lock on it (flock) from
the moment the run is built until it closes, and writes there who holds it (host, pid, start
time, command). The kernel lets go of the lock when the process ends, however it ends (an
exception, SIGKILL, the OOM killer), so a dead run never blocks the next one; a second run
on a live directory stops at once with RunDirectoryBusy naming the holder. The lock belongs
to the open file, so a second run built in the same process (a notebook) is refused too.

Shared filesystems: Linux carries flock between hosts on NFS (as a lock over the whole file,
through the NFS server's lock manager) and on Lustre mounted with `-o flock`. Where a
filesystem has no locks at all (gcsfuse and other object-store mounts, Lustre with
`noflock`), taking one fails: the run says that it cannot hold its directory and goes on.
Where locks are local to a host (Lustre with `localflock`), two hosts can each hold the same
directory: give every job a run directory of its own there.
"""

import dataclasses
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from typing import Optional

LOCK_FILE = "run.lock"
# A filesystem without locks says so with one of these.
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunDirectoryBusy(RuntimeError):
  """Another live run holds the run directory."""


@dataclasses.dataclass
class Hold:
  """A held run directory; `release()` lets it go (closing the file does too). A directory
  the hold made, holding nothing else when it is let go (a run refused while it was built),
  is removed: the refused run leaves nothing behind."""
  path: str
  file: Optional[object]
  made_directory: bool = False

  def release(self) -> None:
    if self.file is None:
      return
    directory = os.path.dirname(self.path)
    if self.made_directory and os.listdir(directory) == [LOCK_FILE]:
      os.remove(self.path)  # while still held: nobody takes a lock on a file going away
      os.rmdir(directory)
    else:
      self.file.truncate(0)  # nobody holds it now
    fcntl.flock(self.file, fcntl.LOCK_UN)
    self.file.close()
    self.file = None


def hold(run_dir: str) -> Hold:
  """Take `run_dir` for this run: RunDirectoryBusy when a live run holds it. On a filesystem
  without locks, a warning and a Hold that holds nothing."""
  made_directory = not os.path.isdir(run_dir)
  os.makedirs(run_dir, exist_ok=True)
  path = os.path.join(run_dir, LOCK_FILE)
  file = open(path, "a+")
  try:
    fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    file.close()
    raise RunDirectoryBusy(f"run directory {os.path.abspath(run_dir)} is in use by "
                           f"{_holder(path)}: stop that run first, or give this one another "
                           "run directory") from None
  except OSError as e:
    file.close()
    if e.errno not in _NO_LOCKS:
      raise
    print(f"warning: cannot hold run directory {run_dir} ({os.strerror(e.errno)}: its "
          "filesystem has no locks); make sure no other run uses it", file=sys.stderr)
    return Hold(path, None)
  file.truncate(0)
  json.dump({"host": socket.gethostname(), "pid": os.getpid(),
             "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
             "command": " ".join(sys.argv)}, file)
  file.flush()
  return Hold(path, file, made_directory)


def _holder(path: str) -> str:
  """Who holds the lock at `path`, in words, from what it wrote there."""
  try:
    with open(path) as f:
      who = json.load(f)
    return (f"another run: pid {who['pid']} on host {who['host']}, since {who['since']} "
            f"({who['command']})")
  except (OSError, ValueError, KeyError):  # it has not written yet
    return "another run (which one: not written yet)"
