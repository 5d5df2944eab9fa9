"""Generation behind one protocol (engine.py: what an engine does, and the Capabilities it
declares): the decoding programs (decoding.py), the embedded JAX engine around them
(jax_engine.py), the SGLang client over HTTP (sglang.py) and the engines over SGLang servers
(sglang_engine.py: remote_engine for a deployment, local_engine for our own server's
processes), the embedded engine's programs served with SGLang's protocol (server/), images on
that protocol at both ends (image_data.py), and the real sglang-router in front of several
(router.py). When rollouts pause, resume or run ahead is rl/sources.py's."""
