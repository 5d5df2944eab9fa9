"""bench/README.md, covered a section at a time (`COVERED`): each section's figures from the
bench/results/ file its script writes. The rough lengths of the usage lines ("~6 minutes") are
guides to running a command rather than results, and are listed as such."""

import statistics

from .check import Figure, NotMeasured, Sections
from .common import CONFIG, UNRECORDED

_DOC = "bench/README.md"
_GIB = 2**30
ROUGH = "a command's rough length, a guide to running it and not a result"
MACHINE = "the machine's size, not a measurement"
EARLIER = "an earlier run, whose results file a later one replaced: the doc names the commit"


def _gib(n_bytes: int) -> str:
  """16083812368 -> '14.98': GiB as the scripts print them."""
  return f"{n_bytes / _GIB:.2f}"


def _memory(value: float | list[str]) -> str:
  """bench/memory.py's table: bytes as GiB, and the chips the step fits ('none')."""
  return (", ".join(value) or "none") if isinstance(value, list) else f"{value / _GIB:.1f}Gi"


# ## `bench/long_context.py`: the table's rows, each longer row's growth over the 32k one, and
# the straight line through the three rows' peak memory.
LONG_CONTEXT = "bench/results/long_context.json"


def _growth(key: str, seq: int):
  """The format that reads how many times the 32k row's `key` the row of `seq` tokens has."""
  def growth(rows: list[dict]) -> str:
    return f"{next(r for r in rows if r['seq'] == seq)[key] / rows[0][key]:.2f}"
  return growth


def _memory_line(rows: list[dict]) -> tuple[float, float]:
  """The least-squares line of peak RSS against the step's tokens (its 2 rows): bytes a token,
  and bytes at none."""
  tokens = [2 * r["seq"] for r in rows]
  peaks = [r["peak_rss_bytes"] for r in rows]
  mean_t, mean_p = statistics.mean(tokens), statistics.mean(peaks)
  slope = (sum((t - mean_t) * (p - mean_p) for t, p in zip(tokens, peaks))
           / sum((t - mean_t) ** 2 for t in tokens))
  return slope, mean_p - slope * mean_t


def _fixed_gib(rows: list[dict]) -> str:
  return f"{_memory_line(rows)[1] / _GIB:.1f}"


def _kib_a_token(rows: list[dict]) -> str:
  return f"{_memory_line(rows)[0] / 2**10:.0f}"


def _long_context_growth(seq: int) -> Figure:
  parts = ("peak_rss_bytes", "generate_s", "score_s", "train_s")
  return Figure(_DOC, f"{seq} / 32768 ({seq // 32768}x the tokens): peak RSS {{}}x, generate_s "
                "{}x, score_s {}x, train_s {}x", LONG_CONTEXT, ("",) * 4,
                tuple(_growth(part, seq) for part in parts))


_LONG_CONTEXT = (
    *(Figure(_DOC, f"{seq} {{}} GiB {{}} s {{}} s {{}} s {{}} s", LONG_CONTEXT,
             tuple(f"seq={seq}/{key}" for key in ("peak_rss_bytes", "seconds", "generate_s",
                                                  "score_s", "train_s")),
             (_gib, "{:.0f}", "{:.1f}", "{:.1f}", "{:.1f}"))
      for seq in (32768, 65536, 131072)),
    _long_context_growth(65536),
    _long_context_growth(131072),
    Figure(_DOC, "less than the tokens ({}x for 4x:", LONG_CONTEXT, ("",),
           lambda rows: f"{float(_growth('peak_rss_bytes', 131072)(rows)):.1f}"),
    Figure(_DOC, "puts a fixed part at about {} GiB, then about {} KiB a token", LONG_CONTEXT,
           ("", ""), (_fixed_gib, _kib_a_token)),
)
_LONG_CONTEXT_NOT_MEASURED = (
    NotMeasured(_DOC, "32k, 64k and 128k tokens per row, ~16 minutes", ROUGH),
    NotMeasured(_DOC, "On the 2-core, 24 GiB machine", MACHINE),
)

# ## `bench/logprobs.py`: peak memory and time by tokens and kind.
LOGPROBS = "bench/results/logprobs.json"
_LOGPROBS = (
    *(Figure(_DOC, f"{tokens} {kind} {{}} GiB {{}} s", LOGPROBS,
             (f"kind={kind},tokens={tokens}/peak_bytes", f"kind={kind},tokens={tokens}/seconds"),
             (_gib, "{:.1f}"))
      for tokens, kind in ((8192, "naive"), (8192, "chunked"), (32768, "chunked"))),
    Figure(_DOC, "32768 naive {} GiB {}", LOGPROBS,
           ("kind=naive,tokens=32768/peak_bytes", "kind=naive,tokens=32768/note"), (_gib, "{}")),
)
_LOGPROBS_NOT_MEASURED = (NotMeasured(_DOC, "`.venv/bin/python bench/logprobs.py`, ~7 minutes",
                                      ROUGH),)

# ## `bench/rope.py`: the line bench/rope.py prints, from the turns' times and their ratios
# (the computed step's time over the tables step's, in turn).
ROPE = "bench/results/rope.json"


def _fastest(seconds: list[float]) -> str:
  return f"{min(seconds):.2f}"


def _least(ratios: list[float]) -> str:
  return f"{min(ratios):.2f}"


def _most(ratios: list[float]) -> str:
  return f"{max(ratios):.2f}"


def _tables_faster(ratios: list[float]) -> str:
  """In how many turns the tables step was the faster."""
  return str(sum(ratio > 1 for ratio in ratios))


def _turns(ratios: list[float]) -> str:
  return str(len(ratios))


_ROPE = (
    Figure(_DOC, "fastest step: computed {} s, tables {} s; tables faster by {}x at the median "
           "({}-{}, {} of {} turns)", ROPE,
           ("seconds/computed", "seconds/tables", "speedup") + ("ratios",) * 4,
           (_fastest, _fastest, "{:.3f}", _least, _most, _tables_faster, _turns)),
)
_ROPE_NOT_MEASURED = (NotMeasured(_DOC, "bench/rope.py --rounds 20 # ~6 minutes", ROUGH),)

# ## `bench/loop_memory.py`: peak RSS after each RL step, copying and donating.
LOOP_MEMORY = "bench/results/loop_memory.json"


def _gib_each(peaks: list[int]) -> str:
  """Peak RSS after each step: '1.63 2.01 2.17'."""
  return " ".join(f"{peak / _GIB:.2f}" for peak in peaks)


def _donated_over_copying(peaks: dict) -> str:
  return f"{peaks['donate'][-1] / peaks['copy'][-1]:.2f}"


_LOOP_MEMORY = (
    Figure(_DOC, "copy train step: peak RSS after each RL step (GiB) {} donate", LOOP_MEMORY,
           ("copy",), _gib_each),
    Figure(_DOC, "donate train step: peak RSS after each RL step (GiB) {} donated", LOOP_MEMORY,
           ("donate",), _gib_each),
    Figure(_DOC, "donated / copying, after {} steps: {}", LOOP_MEMORY, ("copy", ""),
           (len, _donated_over_copying)),
)
_LOOP_MEMORY_NOT_MEASURED = (
    NotMeasured(_DOC, "bench/loop_memory.py # ~1 minute", ROUGH),
    NotMeasured(_DOC, "1.64-2.10 GiB copying, 1.51-1.72 GiB donated, 0.82.", EARLIER),
)

# ## `bench/checkpoint_verify.py`: each state's row of the table (sizes in decimal MB and GB,
# as the table writes them), and the whole saves of the larger one.
CHECKPOINT_VERIFY = "bench/results/checkpoint_verify.json"


def _decimal(unit: str):
  """The format of a byte count in `unit` ('MB', 'GB'), one decimal."""
  scale = {"MB": 1e6, "GB": 1e9}[unit]
  return lambda n_bytes: f"{n_bytes / scale:.1f}"


def _checkpoint_row(state: str, quote: str, keys: tuple[str, ...], fmts: tuple) -> Figure:
  return Figure(_DOC, quote, CHECKPOINT_VERIFY, tuple(f"rows/state={state}/{k}" for k in keys),
                fmts)


_CHECKPOINT_VERIFY = (
    _checkpoint_row("quickstart", "| quickstart (params + AdamW) | {} MB / {} MB | {} s | {} s | "
                    "{} -> {} s (noise) |",
                    ("bytes", "stored_bytes", "write_checksums", "verify_checksums",
                     "restore_bare", "restore_verified"),
                    (_decimal("MB"), _decimal("MB")) + ("{:.3f}",) * 4),
    _checkpoint_row("qwen2.5-1.5b", "| Qwen2.5-1.5B params, float32 | {} GB / {} GB, {} files | "
                    "{} s ({} GB/s) | {} s ({} GB/s) | {} -> {} s |",
                    ("bytes", "stored_bytes", "files", "write_checksums", "write_checksums_gb_s",
                     "verify_checksums", "verify_checksums_gb_s", "restore_bare",
                     "restore_verified"),
                    (_decimal("GB"), _decimal("GB"), "{}") + ("{:.1f}",) * 6),
    _checkpoint_row("qwen2.5-1.5b", "(orbax alone {} s, checked {} s:",
                    ("save_bare", "save_verified"), "{:.1f}"),
)
_CHECKPOINT_VERIFY_NOT_MEASURED = (
    NotMeasured(_DOC, "bench/checkpoint_verify.py # ~3 minutes;", ROUGH),
)

# ## `bench/partial_rollouts.py`: the answers' lengths, and the three runs' rounds (the third is
# the results file's; the first two were not recorded) with the third's token counts.
PARTIAL_ROLLOUTS = "bench/results/partial_rollouts.json"


def _partial_mode(mode: str) -> Figure:
  """A mode's line of completed tokens, as bench/partial_rollouts.py prints it."""
  return Figure(_DOC, f"{mode}: {{}} completed tokens ({{}} trajectories, {{}} long) in {{}} s = "
                "{} tokens/s", PARTIAL_ROLLOUTS,
                tuple(f"results/{mode}/{key}" for key in (
                    "completed_tokens", "finished", "long_finished", "seconds",
                    "completed_tokens_per_second")),
                ("{}", "{}", "{}", "{:.2f}", "{:.1f}"))


def _rounds(rounds: list[float]) -> str:
  return ", ".join(f"{ratio:.2f}" for ratio in rounds)


def _short_share(long_share: float) -> str:
  return f"{100 * (1 - long_share):.0f}"


_PARTIAL_ROLLOUTS = (
    Figure(_DOC, "answer with {} tokens {}% of the time and {} tokens otherwise", PARTIAL_ROLLOUTS,
           ("short", "long_share", "long"), ("{}", _short_share, "{}")),
    Figure(_DOC, "partial / wait per round: {}; pooled {} -> {}", PARTIAL_ROLLOUTS,
           ("rounds", "pooled", "ratio"), (_rounds, "{:.2f}", "{:.2f}")),
    _partial_mode("wait"),
    _partial_mode("partial"),
)
_PARTIAL_ROLLOUTS_NOT_MEASURED = (
    NotMeasured(_DOC, "bench/partial_rollouts.py # ~3 minutes", ROUGH),
    NotMeasured(_DOC, "(80% of the short answers' expected tokens)", CONFIG),
    NotMeasured(_DOC, "rows and cache lengths of 1, 1.5, 2, 3, 4, ... times a minimum", CONFIG),
    NotMeasured(_DOC, "the ratio scattered from 1.0 to 1.8 (the runs of commit 17ddbda below)",
                UNRECORDED),
    NotMeasured(_DOC, "partial / wait per round: 1.77, 1.85, 2.04, 1.86; pooled 1.88 -> 1.86 "
                "partial / wait per round: 1.74, 1.81, 1.79, 1.69; pooled 1.76 -> 1.76",
                UNRECORDED),
    NotMeasured(_DOC, "pinned runs gave 1.78, 1.74, 1.84, 1.73 and 1.00 (commit 17ddbda, not "
                "recorded); without the prefix cache 1.10-1.31 (commit defcd10, not recorded). "
                "Partial iterations take ~15 decode steps instead of ~97 (counted at commit "
                "defcd10, not recorded)", UNRECORDED),
    NotMeasured(_DOC, "(up to ~110 tokens)", "the longest a trajectory can be (prompt and long "
                "answer), not a measurement"),
)

# ### Mixtures of experts on 8 devices (in ## `bench/memory.py`): each mesh as the table names
# it and its results file, then the rows (mesh, model, tokens a row) in the table's order: both
# models at 4k and 16k on the float32 meshes, at 16k on the bf16 ones.
_MOE_MESHES = {"fsdp=1 x expert=8": "fsdp1expert8", "fsdp=2 x expert=4": "fsdp2expert4",
               "fsdp=4 x expert=2": "fsdp4expert2", "bf16, fsdp=4 x expert=2": "bf16fsdp4expert2",
               "bf16, fsdp=2 x expert=4": "bf16fsdp2expert4"}
_MOE_ROWS = tuple((mesh, model, tokens) for mesh in tuple(_MOE_MESHES)[:3]
                  for model in ("qwen3-30b-a3b", "moonlight-16b-a3b") for tokens in (4096, 16384)
                  ) + tuple((mesh, model, 16384) for mesh in tuple(_MOE_MESHES)[3:]
                            for model in ("qwen3-30b-a3b", "moonlight-16b-a3b"))
_MOE_MEMORY = tuple(
    Figure(_DOC, f"{mesh} {model} {tokens} {{}} {{}} {{}}",
           f"bench/results/memory_moe/{_MOE_MESHES[mesh]}.json",
           tuple(f"results/model={model},tokens={tokens}/{field}"
                 for field in ("peak", "temporaries", "fits")), _memory)
    for mesh, model, tokens in _MOE_ROWS)

# The sections covered so far, each by its heading after `## `.
COVERED = Sections(_DOC, (
    "`bench/long_context.py`: one RL step on 128k-token rows",
    "`bench/logprobs.py`: memory of per-token log-probs",
    "`bench/rope.py`: RoPE from tables vs cos and sin in the step",
    "`bench/loop_memory.py`: the RL loop's peak memory, copying vs donating train step",
    "`bench/checkpoint_verify.py`: what checksums add to a checkpoint's save and restore",
    "`bench/partial_rollouts.py`: partial rollouts vs waiting for the longest",
))
FIGURES = (_LONG_CONTEXT + _LOGPROBS + _ROPE + _LOOP_MEMORY + _CHECKPOINT_VERIFY
           + _PARTIAL_ROLLOUTS + _MOE_MEMORY)
NOT_MEASURED = (_LONG_CONTEXT_NOT_MEASURED + _LOGPROBS_NOT_MEASURED + _ROPE_NOT_MEASURED
                + _LOOP_MEMORY_NOT_MEASURED + _CHECKPOINT_VERIFY_NOT_MEASURED
                + _PARTIAL_ROLLOUTS_NOT_MEASURED)
GENERATED = ()
