"""bench/README.md's sections on the train step and what it holds in memory, each section's
figures from the bench/results/ file its script writes: attention kernels, long-context steps,
log-probs, RoPE, the RL loop's memory, checkpoints, the mixture's step against the dense one,
where the step's time goes against PyTorch's, and attention and the step on a GPU. The compiled
memory of bench/memory.py is bench_memory's. bench_readme.py covers them with the rest."""

import statistics

from .check import Figure, NotMeasured
from .common import CONFIG, EARLIER, GIB, MACHINE, ROUGH, UNRECORDED

_DOC = "bench/README.md"


def _gib(n_bytes: int) -> str:
  """16083812368 -> '14.98': GiB as the scripts print them."""
  return f"{n_bytes / GIB:.2f}"


# ## `bench/attention.py`: the run of 2026-12-05's kernels and ring lines, the train step of
# 2026-12-02 and the balance of 2026-11-30 (each part's latest run is the one the file keeps),
# and what the text reads in them. The other runs' lines are listed as earlier ones.
ATTENTION = "bench/results/attention.json"
_SEQS = (4096, 16384, 32768, 65536, 131072)


def _gib3(n_bytes: int) -> str:
  return f"{n_bytes / GIB:.3f}"


def _mib(n_bytes: int) -> str:
  return f"{n_bytes / 2**20:.1f}"


def _kernel(kind: str, seq: int) -> str:
  return f"kernels/kind={kind},seq={seq}/"


def _kernel_row(kind: str, seq: int) -> Figure:
  if kind == "dense" and seq > 4096:
    return Figure(_DOC, f"{seq} dense {{}} GiB {{}}", ATTENTION,
                  (_kernel(kind, seq) + "peak_bytes", _kernel(kind, seq) + "note"), (_gib3, "{}"))
  return Figure(_DOC, f"{seq} {kind} {{}} GiB {{}} s {{}}", ATTENTION,
                tuple(_kernel(kind, seq) + key for key in ("peak_bytes", "seconds", "tflops")),
                (_gib3, "{:.2f}", "{:.3f}"))


def _peak_ratio(kind: str, seq: int, over: int, digits: int):
  """The format that reads `kind`'s peak memory at `seq` tokens over at `over`."""
  def ratio(kernels: list[dict]) -> str:
    peak = {r["seq"]: r["peak_bytes"] for r in kernels if r["kind"] == kind}
    return f"{peak[seq] / peak[over]:.{digits}f}"
  return ratio


def _ring_line(seq: int, timed: bool) -> Figure:
  quote = (f"ring context=8 at {seq}: per-device temp over blockwise tiles {{}} MiB, over the C++ "
           "kernel {} MiB, vs single-device blockwise {} MiB: ratios {}, {} (target <= 0.167)")
  keys = ("blockwise_per_device_temp_bytes", "cpu_per_device_temp_bytes",
          "single_device_temp_bytes", "blockwise_ratio", "cpu_ratio")
  fmts = (_mib,) * 3 + ("{:.3f}",) * 2
  if timed:
    quote, keys, fmts = (quote + "; fwd+bwd blockwise {} s, cpu {} s",
                         keys + ("blockwise_seconds", "cpu_seconds"), fmts + ("{:.2f}",) * 2)
  return Figure(_DOC, quote, ATTENTION, tuple(f"ring/seq={seq}/{key}" for key in keys), fmts)


def _kernel_speedups(kernels: list[dict]) -> str:
  """The C++ kernel's least and most speed over blockwise's, of every length: '1.3x to 2.0x'."""
  seconds = {(r["kind"], r["seq"]): r["seconds"] for r in kernels}
  speedups = [seconds["blockwise", seq] / seconds["cpu", seq] for seq in _SEQS]
  return f"{min(speedups):.1f}x to {max(speedups):.1f}x"


def _ring_speedup(ring: list[dict]) -> str:
  """The C++ kernel's speed over blockwise's in the ring, at each timed length: one figure where
  they round alike."""
  speedups = {f"{r['blockwise_seconds'] / r['cpu_seconds']:.1f}" for r in ring
              if "cpu_seconds" in r}
  return " and ".join(sorted(speedups))


def _tflops(kind: str, slow: tuple[int, ...] = ()):
  """The format that reads `kind`'s least and most TFLOP/s but at the lengths of `slow`."""
  def tflops(kernels: list[dict]) -> str:
    values = [r["tflops"] for r in kernels if r["kind"] == kind and r["seq"] not in slow]
    digits = 3 if kind == "cpu" else 2
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}"
  return tflops


def _spread(layout: str) -> Figure:
  return Figure(_DOC, f"{layout} layout, 64k over 8 devices: visible-pair spread {{}}%, "
                "computed-tile spread {}%", ATTENTION,
                (f"balance/layout={layout}/pairs_spread", f"balance/layout={layout}/tiles_spread"),
                lambda spread: f"{100 * spread:.1f}")


def _last_over_first(balance: dict) -> str:
  return f"{balance['pairs_per_device'][-1] / balance['pairs_per_device'][0]:.0f}"


_ATTENTION = (
    *(_kernel_row(kind, seq) for seq in _SEQS for kind in ("dense", "blockwise", "cpu")),
    *(Figure(_DOC, f"{kind} memory ratio 131072/4096 = {{}} for 32x the tokens (linear: 32)",
             ATTENTION, ("kernels",), _peak_ratio(kind, 131072, 4096, 1))
      for kind in ("blockwise", "cpu")),
    *(_ring_line(seq, timed=seq < 131072) for seq in (16384, 65536, 131072)),
    Figure(_DOC, "train step, 4 layers x 256, one packed 32768-token row, vocab 8192: peak RSS {} "
           "GiB (compiled {} GiB) of {} GiB, {} s/step", ATTENTION,
           tuple("train_step/seq=32768/" + key for key in (
               "peak_rss_bytes", "compiled_peak_bytes", "machine_bytes", "step_seconds")),
           (_gib, _gib, lambda n_bytes: f"{n_bytes / GIB:.0f}", "{:.1f}")),
    Figure(_DOC, "(the C++ kernel {} TFLOP/s at every length; blockwise {}, with one slow call",
           ATTENTION, ("kernels", "kernels"), (_tflops("cpu"), _tflops("blockwise", (32768,)))),
    Figure(_DOC, "The C++ kernel is {} faster than blockwise here", ATTENTION, ("kernels",),
           _kernel_speedups),
    Figure(_DOC, "Ring attention over the C++ kernel is {}x faster than over blockwise tiles at "
           "16k and 64k", ATTENTION, ("ring",), _ring_speedup),
    _spread("zigzag"),
    _spread("contiguous"),
    Figure(_DOC, "dense memory grows {}x per 4x length", ATTENTION, ("kernels",),
           _peak_ratio("dense", 16384, 4096, 0)),
    Figure(_DOC, "blockwise grows {}x per 4x (linear)", ATTENTION, ("kernels",),
           _peak_ratio("blockwise", 65536, 16384, 1)),
    Figure(_DOC, "would leave the last device {}x the work of the first", ATTENTION,
           ("balance/layout=contiguous",), _last_over_first),
)
_ATTENTION_NOT_MEASURED = (
    NotMeasured(_DOC, "bench/attention.py # all parts, ~60 minutes on 2 CPU cores", ROUGH),
    NotMeasured(_DOC, "(the visible pairs' two products, backward = 2.5 forwards)",
                "the FLOP count's convention, not a measurement"),
    NotMeasured(_DOC, "the 2-core, 24 GiB CPU machine of 2026-12-02", MACHINE),
    NotMeasured(_DOC, "4096 dense 2.047 GiB 2.68 s 4096 blockwise 0.072 GiB 0.34 s 4096 cpu 0.051 "
                "GiB 0.20 s 16384 dense 32.188 GiB does not fit: needs 32.2 GiB of 24 16384 "
                "blockwise 0.272 GiB 5.03 s 16384 cpu 0.204 GiB 3.17 s 65536 dense 512.752 GiB "
                "does not fit: needs 512.8 GiB of 24 65536 blockwise 1.074 GiB 82.29 s 65536 cpu "
                "0.815 GiB 55.83 s blockwise memory ratio 64k/16k = 3.94 (target <= 4.5) cpu "
                "memory ratio 64k/16k = 3.99 (target <= 4.5) cpu vs blockwise time: 4096: 1.67x, "
                "16384: 1.59x, 65536: 1.47x", EARLIER),
    NotMeasured(_DOC, "(`--parts kernels`, 60 minutes;", ROUGH),
    NotMeasured(_DOC, "(target <= 0.167)", "a target, not a measurement"),
    NotMeasured(_DOC, "did ~300 GFLOP/s of causal attention (forward and backward, counting the "
                "causal half only) at 4k and 16k tokens, 276 at 64k (commit 9fe273d, not "
                "recorded); at bench/peers.py's 8 x 512 tokens it is 2.6x faster than blockwise",
                UNRECORDED),
    NotMeasured(_DOC, "the 2-core, 24 GiB CPU machine of 2026-11-30 (before the C++ kernel; that "
                "machine's CPU is not on record, and it ran blockwise 2.6x slower at 4k than the "
                "one above)", EARLIER),
    NotMeasured(_DOC, "4096 dense 2.047 GiB 3.89 s 4096 blockwise 0.072 GiB 0.88 s 16384 dense "
                "32.188 GiB does not fit: needs 32.2 GiB of 24 16384 blockwise 0.272 GiB 9.89 s "
                "65536 dense 512.752 GiB does not fit: needs 512.8 GiB of 24 65536 blockwise 1.074 "
                "GiB 148.56 s blockwise memory ratio 64k/16k = 3.94 (target <= 4.5) ring context=8 "
                "at 16384: per-device temp 27.6 MiB vs single-device blockwise 151.0 MiB: ratio "
                "0.183 ring context=8 at 65536: per-device temp 94.3 MiB vs single-device "
                "blockwise 587.8 MiB: ratio 0.160 ring context=8 at 131072: per-device temp 183.3 "
                "MiB vs single-device blockwise 1173.0 MiB: ratio 0.156", EARLIER),
    NotMeasured(_DOC, "train step, 4 layers x 256, one packed 32768-token row, vocab 8192: peak "
                "RSS 4.65 GiB (compiled 3.63 GiB) of 24 GiB, 24.6 s/step", EARLIER),
    NotMeasured(_DOC, "was 4.4x faster than dense already at 4k on the CPU of 2026-11-30", EARLIER),
    NotMeasured(_DOC, "at 16k (2,048 tokens per device)", "16k tokens over 8 devices, arithmetic"),
)

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
  return f"{_memory_line(rows)[1] / GIB:.1f}"


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
  return " ".join(f"{peak / GIB:.2f}" for peak in peaks)


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

# ## `bench/moe.py`: each model's row of the table (tokens a second over the step's 8 rows of
# 512 tokens), the shape, and the capacity step against the dense one.
MOE_STEP = "bench/results/moe.json"


def _tokens_a_second(name: str):
  """The format that reads the tokens a second of `name`'s median step."""
  def tokens(results: dict) -> str:
    shape = results["shape"]
    return f"{shape['rows'] * shape['seq'] / results['median_s'][name]:.0f}"
  return tokens


def _moe_row(name: str) -> Figure:
  return Figure(_DOC, f"{name} {{}} {{}} s {{}}x {{}} {{}} GiB", MOE_STEP,
                (f"models/{name}/params", f"median_s/{name}", f"ratio/{name}", "",
                 f"models/{name}/temp_gib"),
                ("{:,d}", "{:.3f}", "{:.2f}", _tokens_a_second(name), "{:.3f}"))


_MOE_STEP = (
    *(_moe_row(name) for name in ("dense", "dropless", "capacity 1.25")),
    Figure(_DOC, "Three {}-layer decoders (width {}, vocab {})", MOE_STEP,
           ("shape/layers", "shape/hidden", "shape/vocab")),
    Figure(_DOC, "Each mixture has {} experts of width {} and sends every token to {} of them",
           MOE_STEP, ("shape/experts", "shape/expert_size", "shape/k")),
    Figure(_DOC, "one k1.5 train step on {} packed rows of {} tokens", MOE_STEP,
           ("shape/rows", "shape/seq")),
    Figure(_DOC, "It is {}x the dense step", MOE_STEP, ("ratio/capacity 1.25",), "{:.2f}"),
)
_MOE_STEP_NOT_MEASURED = (
    NotMeasured(_DOC, "bench/moe.py --rounds 9 # about 4 minutes on 2 CPU cores", ROUGH),
    NotMeasured(_DOC, "with a capacity factor of 1.25", CONFIG),
    NotMeasured(_DOC, "(its cost analysis gave 9x the FLOPs of the grouped product at E = 8, at "
                "commit aca30d1, not recorded)", UNRECORDED),
    NotMeasured(_DOC, "[E, capacity, H] buffers, 1.25 times the active FLOPs", CONFIG),
)

# ## `bench/step_breakdown.py`: each variant's row of the table and each part's, as
# bench/step_breakdown.py prints them, and what the text reads in them. The two earlier runs'
# tables are listed as earlier ones (the doc names the commits whose results files hold them).
STEP_BREAKDOWN = "bench/results/step_breakdown.json"


_PARTS = {
    "attention": lambda steps: steps["full"] - steps["no_attention"],
    "mlp": lambda steps: steps["full"] - steps["no_mlp"],
    "mlp (mlp_only - rest)": lambda steps: steps["mlp_only"] - steps["rest"],
    "head": lambda steps: steps["full"] - steps["no_head"],
    "rest": lambda steps: steps["rest"],
}  # each part's estimated seconds from a framework's variants, as bench/step_breakdown.py's


def _part_seconds(part: str):
  """The format that reads a framework's estimated seconds of `part`."""
  return lambda steps: f"{_PARTS[part](steps):.2f}"


_STEP_BREAKDOWN = (
    *(Figure(_DOC, f"{variant} {{}} {{}}", STEP_BREAKDOWN,
             (f"ours/{variant}", f"torch/{variant}"), "{:.2f}")
      for variant in ("full", "no_attention", "no_mlp", "no_head", "mlp_only")),
    Figure(_DOC, "mlp_only {} {} rest {} {} part (estimated s)", STEP_BREAKDOWN,
           ("ours/mlp_only", "torch/mlp_only", "ours/rest", "torch/rest"), "{:.2f}"),
    *(Figure(_DOC, f"{part} {{}} {{}}", STEP_BREAKDOWN, ("ours", "torch"), _part_seconds(part))
      for part in ("attention", "mlp", "mlp (mlp_only - rest)", "head")),
    Figure(_DOC, "head {} {} rest {} {} ```", STEP_BREAKDOWN, ("ours", "torch", "ours", "torch"),
           (_part_seconds("head"),) * 2 + (_part_seconds("rest"),) * 2),
    Figure(_DOC, "Attention is now the smallest part of our step ({} s;", STEP_BREAKDOWN,
           ("ours",), _part_seconds("attention")),
    Figure(_DOC, "in seconds its MLP's matmuls most ({} s against {} s)", STEP_BREAKDOWN,
           ("torch", "ours"), (_part_seconds("mlp"),) * 2),
)
_STEP_BREAKDOWN_NOT_MEASURED = (
    NotMeasured(_DOC, "bench/step_breakdown.py --rounds 3 # ~10 minutes;", ROUGH),
    NotMeasured(_DOC, "ours alone measured full 2.61 s and no_attention 1.98 s, 0.63 s of "
                "attention, at commit 9fe273d and not recorded", UNRECORDED),
    NotMeasured(_DOC, "variant (s/step) ours torch full 3.03 2.81 no_attention 2.33 2.42 "
                "no_mlp 1.58 1.34 no_head 2.59 2.38 mlp_only 1.98 2.00 rest 0.64 0.71 part "
                "(estimated s) ours torch attention 0.71 0.40 mlp 1.46 1.47 mlp (mlp_only - rest) "
                "1.34 1.29 head 0.45 0.44 rest 0.64 0.71", EARLIER),
    NotMeasured(_DOC, "attention held the whole gap, 0.71 s against 0.40 s", EARLIER),
    NotMeasured(_DOC, "8 x 512 tokens; this and the tries below timed at commit f47822d, not "
                "recorded), ours took 65-80 ms and PyTorch's SDPA 61-63 ms", UNRECORDED),
    NotMeasured(_DOC, "(~56% of the square); our 256-token tiles compute 3 of 4 tiles (75%)",
                "the shares of the causal square each kernel computes, from their tile sizes"),
    NotMeasured(_DOC, "0.81x/0.95x/1.04-1.10x; attention over batch groups of 2 or 4 rows "
                "(independent work for XLA's two threads) 1.03-1.14x, with turns ranging "
                "0.85-1.30x", UNRECORDED),
    NotMeasured(_DOC, "variant (s/step) ours torch full 6.92 5.08 no_attention 5.66 4.28 "
                "no_mlp 3.94 2.32 no_head 5.77 4.29 mlp_only 4.90 3.61 rest 1.89 1.27 part "
                "(estimated s) ours torch attention 1.25 0.80 mlp 2.97 2.76 mlp (mlp_only - rest) "
                "3.01 2.34 head 1.15 0.79 rest 1.89 1.27", EARLIER),
    NotMeasured(_DOC, "each was 8-57% slower", EARLIER),
    NotMeasured(_DOC, "(XLA's ynn kernels at ~180-230 GFLOP/s on these shapes against MKL's "
                "~225-250 through PyTorch, each measured alone; this and the temp allocation "
                "below at commit 97d3f3c, not recorded)", UNRECORDED),
    NotMeasured(_DOC, "XLA's temp allocation stays ~1.5 GiB", UNRECORDED),
    NotMeasured(_DOC, "2,048- or 4,096-token log-prob chunks", CONFIG),
)

# ## `bench/gpu_checks.py`: the H200 run of 2026-12-04. Its settings (the attention check's
# shapes, the train step's heads and MLP, the quickstart's batch) are bench/gpu_checks.py's and
# quickstart.gin's; the sizes the file keeps are quoted from it.
GPU_CHECKS = "bench/results/gpu_checks.json"


def _ms(seconds: float) -> str:
  """0.0119 -> '12.0', 0.172 -> '172': milliseconds as the table writes them."""
  return f"{1e3 * seconds:.0f}" if seconds >= 0.1 else f"{1e3 * seconds:.1f}"


def _errors(kernel: str) -> str:
  """The path to `kernel`'s largest errors in bf16."""
  return f"attention/dtype=bfloat16,kernel={kernel}/"


def _slower(seq: int):
  """The format that reads how many times blockwise's seconds are cudnn's at `seq` tokens."""
  def ratio(rows: list[dict]) -> str:
    seconds = {r["kernel"]: r["seconds"] for r in rows if r["seq"] == seq}
    return f"{seconds['blockwise'] / seconds['cudnn']:.1f}"
  return ratio


def _cudnn_faster(rows: list[dict]) -> str:
  """cudnn's least and most speed over blockwise's: '6-11'."""
  seconds = {(r["kernel"], r["seq"]): r["seconds"] for r in rows}
  ratios = [seconds["blockwise", seq] / seconds["cudnn", seq] for seq in {r["seq"] for r in rows}]
  return f"{min(ratios):.0f}-{max(ratios):.0f}"


def _gpu_attention_row(seq: int) -> Figure:
  cudnn, blockwise = (f"attention_speed/seq={seq},kernel={kernel}/" for kernel in
                      ("cudnn", "blockwise"))
  return Figure(_DOC, f"| {seq:,} | {{}} ms | {{}} ms ({{}}x) | {{}} GiB | {{}} GiB |", GPU_CHECKS,
                (cudnn + "seconds", blockwise + "seconds", "attention_speed",
                 cudnn + "peak_bytes", blockwise + "peak_bytes"),
                (_ms, _ms, _slower(seq), _gib, _gib))


def _train_step(kernel: str) -> str:
  return f"train_step/kernel={kernel}/"


def _blockwise_slower(steps: list[dict]) -> str:
  seconds = {r["kernel"]: r["seconds"] for r in steps}
  return f"{seconds['blockwise'] / seconds['cudnn']:.0f}"


def _sci(digits: int):
  """The format that writes a small number as the text does: 1.5655e-4 -> '1.6e-4'."""
  def sci(x: float) -> str:
    mantissa, exponent = f"{x:.{digits}e}".split("e")
    return f"{mantissa}e{int(exponent)}"
  return sci


def _relative_difference(steps: list[dict]) -> str:
  losses = [r["loss"] for r in steps]
  return _sci(0)(abs(losses[0] - losses[1]) / abs(losses[0]))


_GPU_CHECKS = (
    Figure(_DOC, "bf16 {}^3 matrix product of the same run: {} TFLOP/s", GPU_CHECKS,
           ("peak/0/n", "peak/0/tflops"), ("{}", "{:.0f}")),
    Figure(_DOC, "in bf16 the largest error is {} on the output and {} / {} / {} on dq / dk / dv, "
           "where blockwise in bf16 has {} and {} / {} / {}", GPU_CHECKS,
           tuple(_errors(kernel) + f"{key}_max_err" for kernel in ("cudnn", "blockwise")
                 for key in ("out", "dq", "dk", "dv")), "{:.3f}"),
    *(_gpu_attention_row(seq) for seq in (4096, 16384, 32768)),
    Figure(_DOC, "cuDNN is {}x faster", GPU_CHECKS, ("attention_speed",), _cudnn_faster),
    Figure(_DOC, "({} TFLOP/s counted within documents at 32k)", GPU_CHECKS,
           ("attention_speed/seq=32768,kernel=cudnn/tflops",), "{:.0f}"),
    Figure(_DOC, "width {}, {} layers, 16 / 4 heads, MLP 2816, vocabulary {}; one packed row of "
           "{} tokens, 8 documents): {} s with cudnn attention, {}k tokens/s, {} TFLOP/s ({}% of "
           "the measured matmul peak", GPU_CHECKS,
           tuple(_train_step("cudnn") + key for key in (
               "width", "layers", "vocab", "seq", "seconds", "tokens_per_s", "tflops",
               "mfu_vs_peak")),
           ("{}", "{}", "{:,}", "{:,}", "{:.3f}", lambda n: f"{n / 1e3:.0f}", "{:.0f}",
            lambda share: f"{100 * share:.0f}")),
    Figure(_DOC, "{} s with blockwise ({}x slower", GPU_CHECKS,
           (_train_step("blockwise") + "seconds", "train_step"), ("{:.2f}", _blockwise_slower)),
    Figure(_DOC, "Losses {} and {} (relative difference {})", GPU_CHECKS,
           (_train_step("cudnn") + "loss", _train_step("blockwise") + "loss", "train_step"),
           ("{:.2f}", "{:.2f}", _relative_difference)),
    Figure(_DOC, "{} sequences x {} sampled tokens): {}M tokens/s in float32, {}M in bf16",
           GPU_CHECKS, ("engine/0/sequences", "engine/0/new_tokens", "engine/dtype=float32/"
                        "tokens_per_s", "engine/dtype=bfloat16/tokens_per_s"),
           ("{}", "{}", lambda n: f"{n / 1e6:.2f}", lambda n: f"{n / 1e6:.2f}")),
    Figure(_DOC, "float32 mean {}, max {}; bf16 mean {}, max {}.", GPU_CHECKS,
           tuple(f"engine/dtype={dtype}/logp_diff_{key}" for dtype in ("float32", "bfloat16")
                 for key in ("mean", "max")),
           (_sci(1),) * 3 + ("{:.3f}",)),
    Figure(_DOC, "logged `engine_logp_diff_max` up to {}.", GPU_CHECKS,
           ("quickstart/0/engine_logp_diff_max",), "{:.3f}"),
    Figure(_DOC, "{} RL steps instead of 150): sft_accuracy {}, rl_accuracy {} after {} steps; the "
           "median RL step took {} s", GPU_CHECKS,
           tuple("quickstart/0/" + key for key in ("rl_steps", "sft_accuracy", "rl_accuracy",
                                                   "rl_steps", "step_seconds_median")),
           ("{}", "{:.2f}", "{:.2f}", "{}", "{:.3f}")),
    Figure(_DOC, "Its SFT (600 steps) took {} s", GPU_CHECKS, ("quickstart/0/sft_seconds",),
           "{:.0f}"),
)
_GPU_CHECKS_NOT_MEASURED = (
    NotMeasured(_DOC, "about 7 minutes on an H200;", ROUGH),
    NotMeasured(_DOC, "heads, 1,024 tokens):", CONFIG),
    NotMeasured(_DOC, "At 128k tokens that mask alone would take 16 GiB per row (131,072² bytes), "
                "and the bf16 bias made of it 32 GiB more",
                "the size of a [131072, 131072] mask and its bias, not a measurement"),
    NotMeasured(_DOC, "(54 s for the findings' warm start, timed at commit 3dea3ca and not "
                "recorded)", UNRECORDED),
)

# ## `bench/lora_step.py`: each shape's row, and the share LoRA saves at 0.5B.
LORA_STEP = "bench/results/lora_step.json"


def _lora_step_row(shape: str, rows: int, tokens: int) -> Figure:
  return Figure(_DOC, f"{shape} {rows} x {tokens} 32 {{}} {{}} {{}}", LORA_STEP,
                tuple(f"results/shape={shape}/{key}" for key in (
                    "full_s", "lora_s", "lora_over_full")), ("{:.3f}", "{:.3f}", "{:.2f}"))


_LORA_STEP = (
    _lora_step_row("quickstart", 256, 128), _lora_step_row("qwen2.5-0.5b", 4, 512),
    Figure(_DOC, "at its step's {} rows of {} tokens (unpacked)", LORA_STEP,
           ("results/shape=quickstart/rows", "results/shape=quickstart/tokens")),
    Figure(_DOC, "bf16 compute) at {} rows of {} tokens.", LORA_STEP,
           ("results/shape=qwen2.5-0.5b/rows", "results/shape=qwen2.5-0.5b/tokens")),
    Figure(_DOC, "the fastest of {} each. On the 2-core", LORA_STEP, ("rounds",)),
    Figure(_DOC, "**At 0.5B it saves {}%,", LORA_STEP,
           ("results/shape=qwen2.5-0.5b/lora_over_full",),
           lambda ratio: f"{100 * (1 - ratio):.0f}"),
)
_LORA_STEP_NOT_MEASURED = (
    NotMeasured(_DOC, "bench/lora_step.py # about 9 minutes on 2 CPU cores", ROUGH),
    NotMeasured(_DOC, "a first run of the same script gave 0.90 (53.8 s against 48.2 s, not "
                "recorded)", UNRECORDED),
    NotMeasured(_DOC, "CPU machine of 2026-12-07:", MACHINE),
)

FIGURES = (_ATTENTION + _LONG_CONTEXT + _LOGPROBS + _ROPE + _LOOP_MEMORY
           + _CHECKPOINT_VERIFY + _MOE_STEP + _LORA_STEP + _STEP_BREAKDOWN + _GPU_CHECKS)
NOT_MEASURED = (_ATTENTION_NOT_MEASURED + _LONG_CONTEXT_NOT_MEASURED + _LOGPROBS_NOT_MEASURED
                + _ROPE_NOT_MEASURED + _LOOP_MEMORY_NOT_MEASURED + _CHECKPOINT_VERIFY_NOT_MEASURED
                + _MOE_STEP_NOT_MEASURED + _LORA_STEP_NOT_MEASURED + _STEP_BREAKDOWN_NOT_MEASURED
                + _GPU_CHECKS_NOT_MEASURED)
