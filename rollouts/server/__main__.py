"""python -m rollouts.server: rollouts/server/main.py."""

from rollouts.server.main import main

main()
