"""Generation behind one protocol (engine.py: what an engine does, and the Capabilities it
declares): the embedded JAX engine (jax_engine.py), SGLang servers over HTTP (sglang.py), the
embedded engine served with SGLang's protocol (server.py), images on that protocol at both ends
(image_data.py), and the real sglang-router in front of several (router.py). When rollouts
pause, resume or run ahead is rl/sources.py's."""
