"""Verifiers that decide correctness: math answers (math.py) and sandboxed code (code.py)."""
