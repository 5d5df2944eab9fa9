"""Entry points: run.py, gin configs, notebooks. The only place gin is imported."""
