"""bench/README.md's section on bench/memory.py, the RL train step and the embedded engine
compiled for real models' sizes: each table's rows from the results file it was printed from
(memory.json, memory_context.json, memory_moe/), and what the text reads in them. The chips'
memory is the script's setting. bench_readme.py covers it with the rest."""

from .check import Figure, NotMeasured
from .common import GIB, ROUGH, UNRECORDED

_DOC = "bench/README.md"
MEMORY = "bench/results/memory.json"
CONTEXT = "bench/results/memory_context.json"
CHIPS = "a chip's memory, a setting of bench/memory.py"


def _memory(value: float | list[str]) -> str:
  """bench/memory.py's table: bytes as GiB, and the chips the step fits ('none')."""
  return (", ".join(value) or "none") if isinstance(value, list) else f"{value / GIB:.1f}Gi"


def _billions(params: int) -> str:
  return f"{params / 1e9:.2f}B"


def _row(source: str, model: str, tokens: int, suffix: str = "") -> Figure:
  """A row of the train step's table: parameters, peak, temporaries, estimate and fits."""
  path = f"results/model={model},tokens={tokens}/"
  fields = ("params", "peak", "temporaries", "analytic_total", "fits")
  return Figure(_DOC, f"{model} {{}} {tokens} {{}} {{}} {{}} {{}}{suffix}", source,
                tuple(path + field for field in fields) + ((path + "mesh",) if suffix else ()),
                (_billions,) + (_memory,) * 4
                + ((lambda mesh: f"fsdp={mesh['fsdp']} x context={mesh['context']}",)
                   if suffix else ()))


def _engine_row(model: str) -> Figure:
  """A row of the engine's table; the estimate is the weights and the KV cache."""
  row = f"engine/model={model}"
  return Figure(_DOC, f"{model} {{}} {{}} {{}} {{}} {{}} {{}} {{}}", MEMORY,
                tuple(f"{row}/{field}" for field in ("rows", "prompt", "max_new", "peak",
                                                      "kv_cache")) + (row, f"{row}/recipe"),
                ("{}", "{}", "{}", _memory, _memory,
                 lambda row: _memory(row["weights"] + row["kv_cache"]), "{}"))


def _over_estimate(rows, keep) -> list[float]:
  """XLA's peak over the estimate, less one, of the rows `keep` takes."""
  return [row["peak"] / row["analytic_total"] - 1 for row in rows if keep(row)]


def _within(rows: list[dict]) -> str:
  """The most XLA and the estimate differ at 4k tokens and for Qwen2.5-0.5B, in percent."""
  gaps = _over_estimate(rows, lambda r: r["tokens"] == 4096 or r["model"] == "qwen2.5-0.5b")
  return f"{100 * max(map(abs, gaps)):.0f}"


def _over(models: tuple[str, ...], tokens: int):
  """The format that reads how far XLA passes the estimate for `models` at `tokens`: '35-36'."""
  def over(rows: list[dict]) -> str:
    gaps = _over_estimate(rows, lambda r: r["model"] in models and r["tokens"] == tokens)
    low, high = f"{100 * min(gaps):.0f}", f"{100 * max(gaps):.0f}"
    return low if low == high else f"{low}-{high}"
  return over


def _state_and_gradients(rows: list[dict]) -> str:
  """The float32 state and gradients a chip holds of the 7-8B models: '14.2-15.3'."""
  gib = [(r["analytic"]["state"] + r["analytic"]["gradients"]) / GIB for r in rows
         if r["model"] in ("qwen2.5-7b", "qwen3-8b")]
  return f"{min(gib):.1f}-{max(gib):.1f}"


def _context_growth(rows: list[dict]) -> str:
  """How much the peak grows from 32k to 128k tokens over fsdp=2 x context=4, in GiB."""
  peak = {r["tokens"]: r["peak"] for r in rows if r["model"] == "qwen2.5-1.5b"}
  return f"{(peak[131072] - peak[32768]) / GIB:.0f}"


_SEVEN_EIGHT = ("qwen2.5-7b", "qwen3-8b")
_TRAIN = (
    Figure(_DOC, "fits (peak <= {}% of the chip)", MEMORY, ("fit_fraction",),
           lambda fraction: f"{100 * fraction:.0f}"),
    Figure(_DOC, "A configuration fits a chip when its peak is at most {}% of its memory.", MEMORY,
           ("fit_fraction",), lambda fraction: f"{100 * fraction:.0f}"),
    *(_row(MEMORY, model, tokens) for model in ("qwen2.5-0.5b", "qwen2.5-1.5b") + _SEVEN_EIGHT
      for tokens in (4096, 16384, 32768)),
    Figure(_DOC, "(the float32 state and its gradients alone are {} GiB a chip", MEMORY,
           ("results",), _state_and_gradients),
    Figure(_DOC, "XLA agrees with the estimate within {}% at 4k tokens and for Qwen2.5-0.5B; past "
           "those it passes it as the row grows: Qwen2.5-1.5B by {}% at 32k, the 7-8B models by "
           "{}% at 16k and {}% at 32k", MEMORY, ("results",) * 4,
           (_within, _over(("qwen2.5-1.5b",), 32768), _over(_SEVEN_EIGHT, 16384),
            _over(_SEVEN_EIGHT, 32768))),
    Figure(_DOC, "needed 74.9 GiB per device (now {}), Qwen3-8B 200 GiB (now {};", MEMORY,
           ("results/model=qwen2.5-0.5b,tokens=32768/peak", "results/model=qwen3-8b,tokens=32768/"
            "peak"), lambda n_bytes: f"{n_bytes / GIB:.1f}"),
    *(_row(CONTEXT, model, tokens, " ({})") for model, tokens in (
        ("qwen2.5-1.5b", 32768), ("qwen2.5-1.5b", 131072), ("qwen2.5-7b", 131072))),
    Figure(_DOC, "Qwen2.5-7B on 64 (8 x 8) with {} GiB a device", CONTEXT,
           ("results/model=qwen2.5-7b,tokens=131072/peak",),
           lambda n_bytes: f"{n_bytes / GIB:.0f}"),
    Figure(_DOC, "the peak grows {} GiB for {}x the tokens", CONTEXT, ("results", "results"),
           (_context_growth, lambda rows: f"{rows[1]['tokens'] // rows[0]['tokens']}")),
    Figure(_DOC, "Qwen2.5-7B at 16k tokens needs 26.9 GiB a device over bf16 params against "
           "{} over float32 (arguments 7.1 against {} GiB, temporaries 19.8 against {};", MEMORY,
           tuple(f"results/model=qwen2.5-7b,tokens=16384/{key}"
                 for key in ("peak", "arguments", "temporaries")),
           lambda n_bytes: f"{n_bytes / GIB:.1f}"),
    *(_engine_row(model) for model in ("qwen2.5-1.5b", "qwen3-8b")),
)
_TRAIN_NOT_MEASURED = (
    NotMeasured(_DOC, "(compile only, ~7 min on this 2-core machine;", ROUGH),
    NotMeasured(_DOC, "log-probs in chunks of 2048 tokens", "a setting, not a measurement"),
    NotMeasured(_DOC, "every size here fits an 80 GB and a 141 GB GPU at 32k tokens per row on "
                "eight of them; a 16 GB TPU v5e chip", CHIPS),
    NotMeasured(_DOC, "needed 74.9 GiB per device", UNRECORDED),
    NotMeasured(_DOC, "Qwen3-8B 200 GiB", UNRECORDED),
    NotMeasured(_DOC, "--parts train`, ~2 min,", ROUGH),
    NotMeasured(_DOC, "simulated devices, ~1 min):", ROUGH),
    NotMeasured(_DOC, "trains on 8 GPUs of 80 GB", CHIPS),
    NotMeasured(_DOC, "--out /tmp/memory` (~30 s each)", ROUGH),
    NotMeasured(_DOC, "needs 26.9 GiB a device", UNRECORDED),
    NotMeasured(_DOC, "(arguments 7.1 against", UNRECORDED),
    NotMeasured(_DOC, "temporaries 19.8 against", UNRECORDED),
    NotMeasured(_DOC, "(7.1 GiB, of which only 3.5 donated: peak 30.0 GiB)", UNRECORDED),
    NotMeasured(_DOC, "a bf16 weight of about 0.02 moves in steps of about 1e-4",
                "bf16's spacing near a typical weight, arithmetic and not a measurement"),
    NotMeasured(_DOC, "(the tiny checkpoint: 2% of its weights changed", UNRECORDED),
    NotMeasured(_DOC, "(`--parts engine`, ~3 min;", ROUGH),
    NotMeasured(_DOC, "(a decode loop of 8 Qwen3-8B layers over 16 x 16384 slots holds 17.1 GiB of "
                "temporaries beside an 8.0 GiB bf16 cache; over a float32 cache of 16.0 GiB, 16.1: "
                "no copy)", UNRECORDED),
    NotMeasured(_DOC, "keeps about 1.1 GiB a layer", UNRECORDED),
    NotMeasured(_DOC, "(the Python loop over layers is unrolled: 4 layers 4.4 GiB, 1 layer 1.2)",
                UNRECORDED),
)

# ### Mixtures of experts on 8 devices: each mesh as the table names it and its results file,
# then the rows (mesh, model, tokens a row) in the table's order: both models at 4k and 16k on
# the float32 meshes, at 16k on the bf16 ones.
_MOE_MESHES = {"fsdp=1 x expert=8": "fsdp1expert8", "fsdp=2 x expert=4": "fsdp2expert4",
               "fsdp=4 x expert=2": "fsdp4expert2", "bf16, fsdp=4 x expert=2": "bf16fsdp4expert2",
               "bf16, fsdp=2 x expert=4": "bf16fsdp2expert4"}
_MOE_ROWS = tuple((mesh, model, tokens) for mesh in tuple(_MOE_MESHES)[:3]
                  for model in ("qwen3-30b-a3b", "moonlight-16b-a3b") for tokens in (4096, 16384)
                  ) + tuple((mesh, model, 16384) for mesh in tuple(_MOE_MESHES)[3:]
                            for model in ("qwen3-30b-a3b", "moonlight-16b-a3b"))


def _moe(mesh: str) -> str:
  return f"bench/results/memory_moe/{_MOE_MESHES[mesh]}.json"


def _state_and_reference(params: int) -> str:
  """What a device holds of the float32 state and the reference: 16 + 4 bytes a parameter over
  8 devices, in GiB."""
  return f"{(16 + 4) * params / 8 / GIB:.0f}"


_MOE_MEMORY = tuple(
    Figure(_DOC, f"{mesh} {model} {tokens} {{}} {{}} {{}}", _moe(mesh),
           tuple(f"results/model={model},tokens={tokens}/{field}"
                 for field in ("peak", "temporaries", "fits")), _memory)
    for mesh, model, tokens in _MOE_ROWS)


def _temporaries(mesh: str, model: str, quote: str) -> Figure:
  """`model`'s temporaries at 16k tokens on `mesh`, as `quote` reads them."""
  return Figure(_DOC, quote, _moe(mesh), (f"results/model={model},tokens=16384/temporaries",),
                lambda n_bytes: f"{n_bytes / GIB:.1f}")


_MOE_MEMORY += (
    Figure(_DOC, "16 + 4 bytes a parameter over 8 devices) is {} GiB a device", _moe(
        "fsdp=4 x expert=2"), ("results/model=qwen3-30b-a3b,tokens=16384/params",),
           _state_and_reference),
    _temporaries("fsdp=4 x expert=2", "qwen3-30b-a3b", "Qwen3-30B-A3B's from {} GiB to"),
    _temporaries("bf16, fsdp=4 x expert=2", "qwen3-30b-a3b", "GiB to {}, Moonlight-16B-A3B's"),
    _temporaries("fsdp=4 x expert=2", "moonlight-16b-a3b", "Moonlight-16B-A3B's from {} GiB to"),
    _temporaries("bf16, fsdp=4 x expert=2", "moonlight-16b-a3b", "GiB to {}), so they"),
)
_MOE_MEMORY_NOT_MEASURED = (
    NotMeasured(_DOC, "(F x P = 8; about 4 minutes a mesh;", ROUGH),
    NotMeasured(_DOC, "The experts run at capacity factor 1.25", "a setting, not a measurement"),
    NotMeasured(_DOC, "fits eight 141 GB GPUs on every mesh", CHIPS),
    NotMeasured(_DOC, "80 GB ones at 4k", CHIPS),
    NotMeasured(_DOC, "fits a 141 GB GPU at 4k tokens", CHIPS),
)

# ### LoRA against full fine-tuning: the table's rows (model, rank), and the temporaries' range.
LORA = "bench/results/memory_lora.json"
_LORA_MODELS = ("qwen2.5-7b", "qwen3-8b", "qwen3-30b-a3b")


def _temporaries_over_full(rows: list[dict]) -> str:
  """LoRA's temporaries over full fine-tuning's, each model's, as a range in percent."""
  by = {(r["model"], r["rank"]): r["temporaries"] for r in rows}
  ratios = [by[m, rank] / by[m, 0] for m, rank in by if rank]
  return f"{100 * min(ratios):.0f}-{100 * max(ratios):.0f}"


_LORA_MEMORY = tuple(
    Figure(_DOC, f"{model} {rank} {{}} {{}} {{}} {{}}", LORA,
           tuple(f"results/model={model},rank={rank}/{field}"
                 for field in ("trained", "state", "peak", "temporaries")),
           (lambda n: f"{n / 1e6:.1f}M", lambda n: f"{n / GIB:.2f}Gi", _memory, _memory))
    for model in _LORA_MODELS for rank in (0, 32)) + (
    Figure(_DOC, "the temporaries stay at {}% of full fine-tuning's", LORA, ("results",),
           _temporaries_over_full),)
_LORA_NOT_MEASURED = (
    NotMeasured(_DOC, "about 25 min on this 2-core machine;", ROUGH),
)

FIGURES = _TRAIN + _MOE_MEMORY + _LORA_MEMORY
NOT_MEASURED = _TRAIN_NOT_MEASURED + _MOE_MEMORY_NOT_MEASURED + _LORA_NOT_MEASURED
