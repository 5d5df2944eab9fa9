"""The learning: pure losses, advantages, transforms, packing, the train step and the loop."""


class ConfigError(ValueError):
  """A configuration that cannot run (unknown loss, sizes that do not fit), raised before any
  compile; entry points print it without a traceback."""
