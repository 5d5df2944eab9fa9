"""`python -m bench.figures` (from the repository root): every problem `problems()` finds, one
a line, and exit status 1 if there is any."""

import sys

from bench.figures import COVERED, problems

listed = problems()
print("\n".join(listed) or f"every figure of {', '.join(COVERED)} agrees with its file")
sys.exit(1 if listed else 0)
