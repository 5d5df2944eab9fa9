"""Multi-turn environments and tools (agentic RL).

An episode is turns of policy tokens and observation tokens; observations are in the
sequence and out of the loss. base.py: the Environment protocol, Turn, Observation, Episode,
the registry; driver.py: episodes over a RolloutEngine (waves, stop strings, budgets, pause and
resume); replay.py: the replay buffer of paused episodes (partial rollouts); formats.py:
tool-call syntax ("tagged" by default, "qwen"); tools.py: the tool registry, `calc` and the
sandboxed `python`; tool_env.py: ToolEnvironment ("tools"), which runs them.

A task with an `environment` attribute (rl/tasks/agentic.py) makes the loop and the evaluation
run episodes instead of single completions (rl/eval.py generate_and_verify).
"""

from rl.envs.base import (ENVIRONMENTS, Environment, Episode, Observation, Turn, encode_text,
                          episode_metrics, make_environment, policy_tokens,
                          register_environment)
from rl.envs.driver import EpisodeState, advance, run_episodes, start
from rl.envs.formats import FORMATS, QwenFormat, TaggedFormat, ToolCall
from rl.envs.replay import EpisodeBuffer, PausedEpisode
from rl.envs.tool_env import ToolEnvironment
from rl.envs.tools import (TOOLS, PythonTool, ToolError, ToolTimeout, calc, open_tools,
                           register_tool, register_tool_factory)

__all__ = ["ENVIRONMENTS", "Environment", "Episode", "EpisodeBuffer", "EpisodeState", "FORMATS",
           "Observation", "PausedEpisode", "PythonTool", "QwenFormat", "TOOLS", "TaggedFormat",
           "ToolCall", "ToolEnvironment", "ToolError", "ToolTimeout", "Turn", "advance", "calc",
           "encode_text", "episode_metrics", "make_environment", "open_tools", "policy_tokens",
           "register_environment", "register_tool", "register_tool_factory", "run_episodes",
           "start"]
