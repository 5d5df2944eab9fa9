"""Registers the library's configurable pieces with gin. Importing this module is what makes
names such as `train`, `Arithmetic`, `tiny` or `RLConfig` usable in .gin files; models/ and rl/
never import gin themselves."""

import gin

from models import config
from models import tokenizer
from rl import loop
from rl import rewards
from rl import sampling
from rl.tasks import arithmetic

train = gin.external_configurable(loop.train, module="rl")
for _fn, _module in [
    (loop.RLConfig, "rl"),
    (config.tiny, "models"), (config.ModelConfig, "models"),
    (tokenizer.CharTokenizer, "models"),
    (arithmetic.Arithmetic, "tasks"),
    (rewards.correctness, "rewards"), (rewards.named_chain, "rewards"),
    (sampling.uniform, "sampling"),
]:
  gin.external_configurable(_fn, module=_module)
