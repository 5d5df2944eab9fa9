"""Generation behind one protocol: the embedded JAX engine now, SGLang servers later."""
