"""Environments and tools: every rollout is an episode of an environment (agentic RL, and
single-turn tasks as the one-turn environment).

An episode is turns of policy tokens and observation tokens; observations are in the
sequence and out of the loss. base.py: the Environment protocol, OneTurn, Turn, Observation,
Episode, the registry; driver.py: trajectories over a RolloutEngine (waves, stop strings,
budgets, pause and resume); formats.py: tool-call syntax ("tagged" by default, "qwen");
tools.py: the tool registry, `calc` and the sandboxed `python`; tool_env.py: ToolEnvironment
("tools"), which runs them.

A task with an `environment` attribute (rl/tasks/agentic.py) runs its episodes; every other
task runs in OneTurn (`environment_of`).
"""

from rl.envs.base import (ENVIRONMENTS, ONE_TURN, Environment, Episode, Observation, OneTurn,
                          Turn, encode_text, environment_of, episode_metrics, make_environment,
                          multi_turn, policy_tokens, register_environment)
from rl.envs.driver import Pause, advance, finish_target, run_episodes, start
from rl.envs.formats import FORMATS, QwenFormat, TaggedFormat, ToolCall
from rl.envs.tool_env import ToolEnvironment
from rl.envs.tools import (TOOLS, PythonTool, ToolError, ToolTimeout, calc, open_tools,
                           register_tool, register_tool_factory)

__all__ = ["ENVIRONMENTS", "Environment", "Episode", "FORMATS", "ONE_TURN", "Observation",
           "OneTurn", "Pause", "PythonTool", "QwenFormat", "TOOLS", "TaggedFormat", "ToolCall",
           "ToolEnvironment", "ToolError", "ToolTimeout", "Turn", "advance", "calc",
           "encode_text", "environment_of", "episode_metrics", "finish_target",
           "make_environment", "multi_turn", "open_tools", "policy_tokens",
           "register_environment", "register_tool", "register_tool_factory", "run_episodes",
           "start"]
