"""docs/architecture.md: its one number that looks measured is an example's binding."""

from .check import NotMeasured
from .common import EXAMPLE

FIGURES = ()
NOT_MEASURED = (NotMeasured("docs/architecture.md", "{'my_coef': 0.2, 'kl_coef': 0.01,", EXAMPLE),)
GENERATED = ()
