"""Generation behind one protocol (engine.py): the embedded JAX engine (jax_engine.py), SGLang
servers over HTTP (sglang.py), the embedded engine served with SGLang's protocol (server.py),
and partial rollouts (partial.py)."""
