"""The policy network as pure functions of (params, inputs)."""
