"""docs/objectives.md: it measures nothing; its numbers are the losses' defaults, examples'
bindings and citations."""

from .check import NotMeasured
from .common import DEFAULT, EXAMPLE

FIGURES = ()
NOT_MEASURED = tuple(NotMeasured("docs/objectives.md", quote, why) for quote, why in (
    ("`tau=0.01` (OpenKimi", DEFAULT),
    ("`alpha=-1, beta=1, tau=0.01, window='log_ratio'`", DEFAULT),
    ("`eps_low=eps_high=0.2, dual_clip=None`", DEFAULT),
    ("`clip_eps=0.2`, and its KL defaults `kl_coef=0.04, kl_estimator='k3'`", DEFAULT),
    ("`clip_eps=0.2` (`norm_length=None`", DEFAULT),
    ("`eps_low=0.2, eps_high=0.28`", DEFAULT),
    ("`eps_high=0.2` (TRL's cap 5.0 = `eps_high=4`) | MiniMax-M1 sec. 3.1",
     "a default, TRL's and a citation"),
    ("`advantage_clip=5.0` (ours), `reward_weight=0.0`, `eps_low=eps_high=0.2`", DEFAULT),
    ("MOPD (arXiv 2606.30406)", "a citation"),
    ("`beta=0.1` | DPO (Rafailov et al. 2023); k1.5 sec. 2.4", "a default and citations"),
    ("(every loss's default but GRPO's 0.04)", DEFAULT),
    ("`lambda = 0.5 - (len - min)/(max - min)`", "k1.5's formula"),
    ("`target_length, alpha=0.5`", DEFAULT),
    ("`quantile=0.5, rho=0`", DEFAULT),
    ("`multipliers=(0.5, 1, 2)`, `quantile=0.5`", DEFAULT),
    ("`low=0.5, high=5` (ours) | IcePop (Ring-1T, arXiv:2510.18855)", "a default and a citation"),
    ("`low=0.9, high=1.1` (ours)", DEFAULT),
    ("{'my_coef': 0.2}", EXAMPLE),
    ("'kl_coef': 0.01}", EXAMPLE)))
GENERATED = ()
