"""Serve a model bound in gin over SGLang's protocol (rollouts/server/):
`python -m experiments.serve --gin FILE [--gin_param BINDING ...] [server options]`.

The gin files bind `load_model` (e.g. `load_model.model = @tiny`, `tiny.hidden_size = 32`,
`load_model.seed = 3`, or `load_model.hf_checkpoint = 'DIR'`); every other option is the
server's (`python -m rollouts.server --help`: --host, --port, --weight_version, --max_batch,
--warmup_len). It lives here, not in rollouts/, because gin and its registrations are the
entry points' business.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gin  # noqa: E402

from experiments import gin_externals  # noqa: E402
from rollouts.server import main as server_main  # noqa: E402


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--gin", action="append", required=True, metavar="FILE",
                      help="gin files binding load_model; repeatable")
  parser.add_argument("--gin_param", action="append", default=[], metavar="BINDING")
  args, rest = parser.parse_known_args(argv)
  for path in args.gin:
    if not os.path.isfile(path):
      parser.error(f"--gin {path}: no such file")
  gin.parse_config_files_and_bindings(args.gin, args.gin_param)
  server_main.main(rest, load=gin_externals.load_model)


if __name__ == "__main__":
  main()
