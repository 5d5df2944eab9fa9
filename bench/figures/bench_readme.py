"""bench/README.md, not yet covered whole: the compiled memory of mixtures on 8 devices."""

from .check import Figure


def _memory(value: float | list[str]) -> str:
  """bench/memory.py's table: bytes as GiB, and the chips the step fits ('none')."""
  return (", ".join(value) or "none") if isinstance(value, list) else f"{value / 2**30:.1f}Gi"


# bench/README.md's table of mixtures on 8 devices: each mesh as the table names it and its
# results file, then the rows (mesh, model, tokens a row) in the table's order: both models at
# 4k and 16k on the float32 meshes, at 16k on the bf16 ones.
_MOE_MESHES = {"fsdp=1 x expert=8": "fsdp1expert8", "fsdp=2 x expert=4": "fsdp2expert4",
               "fsdp=4 x expert=2": "fsdp4expert2", "bf16, fsdp=4 x expert=2": "bf16fsdp4expert2",
               "bf16, fsdp=2 x expert=4": "bf16fsdp2expert4"}
_MOE_ROWS = tuple((mesh, model, tokens) for mesh in tuple(_MOE_MESHES)[:3]
                  for model in ("qwen3-30b-a3b", "moonlight-16b-a3b") for tokens in (4096, 16384)
                  ) + tuple((mesh, model, 16384) for mesh in tuple(_MOE_MESHES)[3:]
                            for model in ("qwen3-30b-a3b", "moonlight-16b-a3b"))

FIGURES = tuple(
    Figure("bench/README.md", f"{mesh} {model} {tokens} {{}} {{}} {{}}",
           f"bench/results/memory_moe/{_MOE_MESHES[mesh]}.json",
           tuple(f"results/model={model},tokens={tokens}/{field}"
                 for field in ("peak", "temporaries", "fits")), _memory)
    for mesh, model, tokens in _MOE_ROWS)

NOT_MEASURED = ()
GENERATED = ()
