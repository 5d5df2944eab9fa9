"""Agents written as anyone writes one, against the `openai` package alone (nothing of
longrl): what rl.agents.rollouts.AgentRollouts trains."""
