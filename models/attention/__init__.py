"""Attention kernels. `reference` is the dense implementation every other kernel is tested against."""
