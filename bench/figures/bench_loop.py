"""bench/README.md's sections on generation and the loop around it, each section's figures
from the bench/results/ file its script writes: verifiers, partial rollouts, weight syncs,
quantized engines and hybrid switches. bench_readme.py covers them with the rest."""

from .check import Figure, NotMeasured
from .common import CONFIG, GIB, MACHINE, ROUGH, UNRECORDED, VERIFIERS, count

_DOC = "bench/README.md"


# ## `bench/verifiers.py`: the scored pairs (each backend's row, each class's), then the math and
# code parts of the last full run, in the lines bench/verifiers.py prints.
_PAIRS = "math_pairs/"
_BACKENDS = _PAIRS + "backends/"


def _percent(fraction: float) -> str:
  return f"{100 * fraction:.1f}%"


def _caveated(pairs: dict) -> str:
  """How many pairs carry a `disputed:` or `convention:` note."""
  return str(pairs["pairs"] - pairs["uncaveated_pairs"])


def _pairs_row(backend: str, quote: str) -> Figure:
  return Figure(_DOC, quote, VERIFIERS, tuple(_BACKENDS + backend + "/" + key for key in (
      "accuracy", "accuracy_uncaveated", "false_positives", "false_positives_uncaveated",
      "false_negatives", "timeouts", "pool_checks_per_second", "checks_per_second",
      "slowest_check_s")), (_percent,) * 2 + ("{}",) * 4 + ("{:.0f}",) * 2 + ("{:.3f}",))


def _class_row(name: str) -> Figure:
  return Figure(_DOC, f"| {name} | {{}} | {{}} | {{}} |", VERIFIERS,
                tuple(f"{_PAIRS}by_class/{name}/{key}"
                      for key in ("pairs", "longrl/accuracy", "math_verify/accuracy")),
                ("{}", _percent, _percent))


def _math_line(backend: str, name: str) -> Figure:
  return Figure(_DOC, f"math {name}: {{}} checks/s, slowest {{}} s, accepted {{}}/1000; "
                "adversarial x7 in the pool: {} s, {} timeouts, {} true", VERIFIERS,
                tuple(f"math/{backend}/{key}" for key in (
                    "checks_per_second", "slowest_check_s", "accepted", "adversarial_wall_s",
                    "adversarial_timeouts", "adversarial_true")),
                ("{:.1f}", "{:.3f}", "{}", "{:.2f}", "{}", "{}"))


_VERIFIERS = (
    Figure(_DOC, "the {} labelled `(response, gold)` pairs", VERIFIERS, (_PAIRS + "pairs",)),
    Figure(_DOC, "| uncaveated ({}) |", VERIFIERS, (_PAIRS + "uncaveated_pairs",)),
    _pairs_row("longrl", "| longrl | **{}** | {} | {} | **{}** | {} | **{}** | {} | {} | {} s |"),
    _pairs_row("math_verify", "| math-verify 0.9 | {} | {} | {} | {} | {} | {} | {} | {} | {} s |"),
    Figure(_DOC, "leaves out the {} pairs whose label", VERIFIERS, ("math_pairs",), _caveated),
    *(_class_row(name) for name in (
        "relation_interval", "latex", "number_format", "symbolic", "prose_answer", "set",
        "other", "precision", "matrix_vector", "reward_hack", "percent", "worked_gold",
        "complex")),
    Figure(_DOC, "the {} false positives are", VERIFIERS,
           (_BACKENDS + "longrl/false_positives",), count),
    _math_line("longrl", "longrl"),
    _math_line("math_verify", "math_verify"),
    Figure(_DOC, "math speed ratio longrl / math-verify = {} (target >= 1); verdict agreement {}",
           VERIFIERS, ("math/ratio", "math/agreement"), ("{:.2f}", _percent)),
    Figure(_DOC, "code, {} at a time: baseline subprocess {}/s, sandbox ({}) {}/s: ratio {} "
           "(target >= 2); both correct {}/600 of 600", VERIFIERS,
           tuple("code/" + key for key in (
               "workers", "baseline_executions_per_second", "isolation",
               "sandbox_executions_per_second", "ratio", "sandbox_correct")),
           ("{}", "{:.1f}", "{}", "{:.1f}", "{:.2f}", "{}")),
    Figure(_DOC, "HumanEval canonical solutions: {}/164 passed, {} problems/s", VERIFIERS,
           ("code/humaneval_canonical_passed", "code/humaneval_problems_per_second"),
           ("{}", "{:.1f}")),
)
_VERIFIERS_NOT_MEASURED = (
    NotMeasured(_DOC, "bench/verifiers.py # ~2 minutes", ROUGH),
    NotMeasured(_DOC, "the scored comparison alone, ~1 minute", ROUGH),
    NotMeasured(_DOC, "MathVerifier pool (2 workers, 5 s limit)", CONFIG),
    NotMeasured(_DOC, "1,000 chain-of-thought responses (0.2-8 KB,", "the lengths the script "
                "writes its responses in, a setting"),
    NotMeasured(_DOC, "through each backend's pool (5 s limit)", CONFIG),
    NotMeasured(_DOC, "(targets: agreement at least 97%,", "a target, not a measurement"),
    NotMeasured(_DOC, "| math-verify 0.9 |", "the version compared"),
    NotMeasured(_DOC, "took it from 95.2% (4 false positives, 24 false negatives, on the 580 "
                "pairs then; measured at commit f95b55a, not recorded)", UNRECORDED),
    NotMeasured(_DOC, "scores 91.1% on the 640 pairs, with 11 false positives (8 of them "
                "uncaveated; measured at commit f95b55a, not recorded)", UNRECORDED),
    NotMeasured(_DOC, "(`0.3333` vs 1/3, `(0.6, 2.6667]`)", "examples of answers, not figures"),
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

# ## `bench/refit.py`: each row of the table, from the results file of its directory (the 0.5B
# on /dev/shm, the 1.5B on /tmp), and one server against two.
REFIT = {"/dev/shm": "bench/results/refit_shm.json", "/tmp": "bench/results/refit_tmp.json"}


def _refit_row(directory: str, model: str, servers: int) -> Figure:
  return Figure(_DOC, f"{model} {servers} {{}} {{}}s {{}}s {{}}s {{}}s {{}} ({directory})",
                REFIT[directory],
                tuple(f"results/model={model},servers={servers}/{key}" for key in (
                    "gib", "export_s", "servers_s", "total_s", "write_limit_s",
                    "limit_over_export")), "{:.2f}")


_REFIT = (
    _refit_row("/dev/shm", "qwen2.5-0.5b", 1),
    _refit_row("/dev/shm", "qwen2.5-0.5b", 2),
    _refit_row("/tmp", "qwen2.5-1.5b", 1),
    _refit_row("/tmp", "qwen2.5-1.5b", 2),
    Figure(_DOC, "Medians of {} syncs", REFIT["/dev/shm"], ("syncs",)),
    Figure(_DOC, "two load no faster than one ({} -> {} s,", REFIT["/dev/shm"],
           ("results/servers=1/servers_s", "results/servers=2/servers_s"), "{:.2f}"),
    Figure(_DOC, "{} -> {} s); on a GPU node", REFIT["/tmp"],
           ("results/servers=1/servers_s", "results/servers=2/servers_s"), "{:.2f}"),
)
_REFIT_NOT_MEASURED = (
    NotMeasured(_DOC, "(cast on the device, 256 MiB shards written 4 at a time", CONFIG),
    NotMeasured(_DOC, "`limit/export` is 1.0 when the export runs", "the ratio's meaning, not a "
                "measurement"),
    NotMeasured(_DOC, "on the 2-core, 24 GiB CPU machine of 2026-12-05 (the 1.5B", MACHINE),
    NotMeasured(_DOC, "took 2.92 s for the 0.5B (median of 3, the same machine); 256 MiB shards 4 "
                "at a time take 0.93 s alone, 1.3 s with the servers beside it (both timed at "
                "commit 124e46c, not recorded)", UNRECORDED),
    NotMeasured(_DOC, "its limit moved from 1.2 to 6.0 s between runs (as the kernel flushed; the "
                "runs of commit 124e46c, not recorded)", UNRECORDED),
    NotMeasured(_DOC, "two 1.5B servers and the trainer did not fit in 24 GiB", MACHINE),
)

# ## `bench/quantized.py`: each format's row of the table, and what they make of the tied
# embedding, which stays bf16 (Qwen2.5-0.5B's, 151,936 x 896).
QUANTIZED = "bench/results/quantized_cpu.json"
_EMBEDDINGGIB = 151_936 * 896 * 2 / GIB


def _quantized_row(name: str) -> Figure:
  return Figure(_DOC, f"{name} {{}} {{}} {{}} {{}} {{}} {{}}", QUANTIZED,
                tuple(f"formats/{name}/{key}" for key in (
                    "weights_gib", "weights_over_bf16", "refit_export_gib", "update_s",
                    "tokens_per_s", "tokens_per_s_over_bf16")),
                ("{:.3f}", "{:.2f}", "{:.3f}", "{:.2f}", "{:.1f}", "{:.2f}"))


def _projections(name: str):
  """The format that reads `name`'s projections over bf16's: the weights less the embedding."""
  def over_bf16(formats: dict) -> str:
    projections = {key: formats[key]["weights_gib"] - _EMBEDDINGGIB for key in (name, "bf16")}
    return f"{projections[name] / projections['bf16']:.2f}"
  return over_bf16


def _slower(ratio: float) -> str:
  return f"{100 * (1 - ratio):.0f}"


_QUANTIZED = (
    *(_quantized_row(name) for name in ("bf16", "fp8", "int4")),
    Figure(_DOC, "Tokens/s: {} prompts of {} tokens, {} new tokens each", QUANTIZED,
           ("rows", "prompt", "new")),
    Figure(_DOC, "the whole model shrinks to {} and {};", QUANTIZED,
           ("formats/fp8/weights_over_bf16", "formats/int4/weights_over_bf16"), "{:.2f}"),
    Figure(_DOC, "the projections alone to {} (FP8) and {} (INT4:", QUANTIZED,
           ("formats", "formats"), (_projections("fp8"), _projections("int4"))),
    Figure(_DOC, "Tokens/s fall {}% (FP8) and {}% (INT4) here", QUANTIZED,
           ("formats/fp8/tokens_per_s_over_bf16", "formats/int4/tokens_per_s_over_bf16"),
           _slower),
)
_QUANTIZED_NOT_MEASURED = (
    NotMeasured(_DOC, "bench/quantized.py # Qwen2.5-0.5B's shape, 4 min here", ROUGH),
    NotMeasured(_DOC, "(151,936 x 896, 0.25 GiB in bf16)", "the embedding's size, from the "
                "model's shape"),
    NotMeasured(_DOC, "(INT4: 4 bits and a bf16 scale per 32 weights)", CONFIG),
)

# ## `bench/hybrid.py`: each engine's row of the table and the trainer's line, and what a release
# and an update do to the engines' resident memory. The whole iterations beside them were run
# with bench/iteration.py and not recorded (bench/results/iteration.json holds another run).
HYBRID = "bench/results/hybrid.json"
_HYBRID_ROW = "results/model=qwen2.5-0.5b"  # the one model's results


def _hybrid_row(engine: str) -> Figure:
  return Figure(_DOC, f"{engine} {{}}Mi {{}}Mi {{}}Mi {{}}Mi {{}}s {{}}s {{}}s {{}}s", HYBRID,
                (f"{_HYBRID_ROW}/weights_bf16_mib",)
                + tuple(f"{_HYBRID_ROW}/{engine}/{key}" for key in (
                    "rss_before_mib", "rss_released_mib", "rss_resumed_mib", "release_s",
                    "update_s", "switch_to_train_s", "switch_to_inference_s")),
                ("{:.0f}",) * 4 + ("{:.2f}",) * 4)


def _mib_change(engine: str, before: str, after: str):
  """The format that reads `engine`'s resident memory at `after` less at `before`, signed."""
  return lambda result: f"{result[engine][after] - result[engine][before]:+.0f}"


def _offload_rate(trainer: dict) -> str:
  return f"{trainer['state_gib'] / trainer['offload_s']:.1f}"


_HYBRID = (
    _hybrid_row("server"),
    _hybrid_row("embedded"),
    Figure(_DOC, "trainer state {} GiB: offload {} s, reload {} s", HYBRID,
           tuple(f"{_HYBRID_ROW}/trainer/{key}" for key in ("state_gib", "offload_s", "reload_s")),
           "{:.2f}"),
    Figure(_DOC, "the server falls from {} to {} MiB", HYBRID,
           (f"{_HYBRID_ROW}/server/rss_before_mib", f"{_HYBRID_ROW}/server/rss_released_mib"),
           "{:.0f}"),
    Figure(_DOC, "one copy of the weights ({} MiB for {})", HYBRID,
           (_HYBRID_ROW, f"{_HYBRID_ROW}/weights_bf16_mib"),
           (_mib_change("server", "rss_released_mib", "rss_resumed_mib"), "{:.0f}")),
    Figure(_DOC, "falls by its bf16 copy ({} MiB)", HYBRID, (_HYBRID_ROW,),
           _mib_change("embedded", "rss_before_mib", "rss_released_mib")),
    Figure(_DOC, "at this machine's ~{} GiB/s", HYBRID, (f"{_HYBRID_ROW}/trainer",),
           _offload_rate),
)
_HYBRID_NOT_MEASURED = (
    NotMeasured(_DOC, "on the 2-core, 24 GiB CPU machine of 2026-12-05: ``` engine", MACHINE),
    NotMeasured(_DOC, "went from 690 to 670 MiB only (240 MiB of weights; a run of commit "
                "216c4d9, not recorded)", UNRECORDED),
    NotMeasured(_DOC, "includes its 1.3 s export, timed at commit 216c4d9 and not recorded)",
                UNRECORDED),
    NotMeasured(_DOC, "its float32 train state alone is 18 GiB, beside a server on 24 GiB",
                "the state's size from the model's (parameters and two AdamW moments), and the "
                "machine's"),
    NotMeasured(_DOC, "8 x 8 completions of up to 256 tokens", CONFIG),
    NotMeasured(_DOC, "ours_sync_server 5.87 2.82 0.00 0.01 0.00 2.94 0.09 | 2.82 3.04 "
                "ours_server_hybrid 5.90 2.78 0.00 0.01 0.00 2.97 0.10 | 2.79 3.09 "
                "ours_server_hybrid switches (median s): to train 0.020, to inference 0.108 "
                "ours_server_hybrid vs ours_sync_server: 0.99x (0.98-1.00 over 2 turns)",
                UNRECORDED),
    NotMeasured(_DOC, "At this size the turns cost 1% of an iteration", UNRECORDED),
    NotMeasured(_DOC, "on a 63M-parameter model in float32 (240 MiB): the server process 696 -> "
                "318 -> 585 MiB, the embedded engine (its bf16 copy, 120 MiB) 807 -> 624 -> 743 "
                "MiB, in one run of `pytest tests/test_hybrid.py -s` (at commit 216c4d9, not "
                "recorded)", UNRECORDED),
)

# ## `bench/lora_sync.py`: the row of its table, and the ratios the text reads.
LORA_SYNC = "bench/results/lora_sync.json"
_LORA_SYNC = (
    Figure(_DOC, "qwen2.5-0.5b 32 {} {} {} {} {} {} {} {}", LORA_SYNC,
           tuple(f"results/model=qwen2.5-0.5b/{key}" for key in (
               "trained", "full_mib", "full_s", "adapter_mib", "adapter_s", "adapter_write_s",
               "bytes_ratio", "seconds_ratio")),
           (lambda n: f"{n / 1e6:.1f}M", "{:.1f}", "{:.2f}", "{:.1f}", "{:.2f}", "{:.2f}",
            "{:.1f}", "{:.1f}")),
    Figure(_DOC, "**{}x fewer bytes, {}x less time.**", LORA_SYNC,
           ("results/model=qwen2.5-0.5b/bytes_ratio", "results/model=qwen2.5-0.5b/seconds_ratio"),
           ("{:.0f}", "{:.1f}")),
    Figure(_DOC, "Medians of {} syncs each on /dev/shm", LORA_SYNC, ("syncs",)),
)
_LORA_SYNC_NOT_MEASURED = (
    NotMeasured(_DOC, "bench/lora_sync.py --models qwen2.5-0.5b --rank 32 # about a minute",
                ROUGH),
    NotMeasured(_DOC, "about 175 MB in bf16 against 16.4 GB (issue 55's figure, not measured "
                "here)", "issue 55's arithmetic, quoted"),
)

# ## `bench/lora_serving.py`: each shape's row, and the range of the unmerged decode's cost.
LORA_SERVING = "bench/results/lora_serving.json"


def _lora_serving_row(shape: str) -> Figure:
  return Figure(_DOC, f"{shape} 32 {{}} {{}} {{}} {{}}", LORA_SERVING,
                tuple(f"results/shape={shape}/{key}" for key in (
                    "merge_s", "decode_merged_s", "decode_attached_s", "attached_over_merged")),
                ("{:.3f}", "{:.3f}", "{:.3f}", "{:.2f}"))


def _unmerged_range(results: list[dict]) -> str:
  ratios = [r["attached_over_merged"] for r in results]
  return f"{min(ratios):.2f}-{max(ratios):.2f}"


_LORA_SERVING = (
    _lora_serving_row("quickstart"), _lora_serving_row("qwen2.5-0.5b"),
    Figure(_DOC, "Unmerged decoding is {}x slower on every batch", LORA_SERVING, ("results",),
           _unmerged_range),
    Figure(_DOC, "the fastest of {} each. The quickstart", LORA_SERVING, ("rounds",)),
    Figure(_DOC, "The quickstart: {} rows, {}-token prompts, {} new tokens", LORA_SERVING,
           tuple(f"results/shape=quickstart/{k}" for k in ("rows", "prompt", "max_new"))),
    Figure(_DOC, "bf16: {} rows, {}-token prompts, {} new tokens", LORA_SERVING,
           tuple(f"results/shape=qwen2.5-0.5b/{k}" for k in ("rows", "prompt", "max_new"))),
)
_LORA_SERVING_NOT_MEASURED = (
    NotMeasured(_DOC, "bench/lora_serving.py # about 3 minutes", ROUGH),
    NotMeasured(_DOC, "on the 2-core CPU machine of 2026-12-07", MACHINE),
)

# ## `bench/lora_arms.py`: the table's rows and ratios.
LORA_ARMS = "bench/results/lora_arms.json"


def _lora_arms_row(side: str) -> Figure:
  return Figure(_DOC, f"{side} {{}} {{}} {{}}", LORA_ARMS,
                tuple(f"results/arms=4/{side}_{key}" for key in ("s", "generate_s", "train_s")),
                "{:.2f}")


_LORA_ARMS = (
    _lora_arms_row("together"), _lora_arms_row("apart"),
    Figure(_DOC, "apart / together: {} (training alone {})", LORA_ARMS,
           ("results/arms=4/apart_over_together", "results/arms=4/train_apart_over_together"),
           "{:.2f}"),
)
_LORA_ARMS_NOT_MEASURED = (
    NotMeasured(_DOC, "bench/lora_arms.py # about 2 minutes", ROUGH),
    NotMeasured(_DOC, "32 prompts x 8 samples of up to 40 tokens, k1.5, the embedded engine",
                CONFIG),
    NotMeasured(_DOC, "gave 0.81 to 1.36 (not recorded)", UNRECORDED),
    NotMeasured(_DOC, "On the 2-core CPU machine of 2026-12-07: ``` step s", MACHINE),
)

# ## `bench/agent_endpoint.py`: the printed lines, and the prose's derived figures.
AGENT_ENDPOINT = "bench/results/agent_endpoint.json"
_AE = ("per_call/", "concurrent/")


def _engine_slowdown(concurrent: dict) -> str:
  """How many times longer each of the endpoint's engine calls took than each wave's."""
  each = concurrent["engine_in_endpoint_s"] / concurrent["batches"]
  return f"{each / (concurrent['engine_alone_s'] / concurrent['wave_batches']):.1f}"


_AGENT_ENDPOINT = (
    Figure(_DOC, "per call: endpoint {} ms, engine {} ms, endpoint / engine {} ({} ms)",
           AGENT_ENDPOINT, tuple("per_call/" + k for k in (
               "endpoint_s", "engine_s", "endpoint_over_engine", "overhead_ms")),
           (lambda v: f"{1000 * v:.1f}",) * 2 + ("{:.2f}", "{:.1f}")),
    Figure(_DOC, "64 agents: {} episodes/s, {} calls/s; the engine alone {} episodes/s, "
           "through the endpoint {} of it", AGENT_ENDPOINT, tuple("concurrent/" + k for k in (
               "episodes_per_s", "calls_per_s", "engine_alone_episodes_per_s",
               "endpoint_over_engine_alone")), ("{:.2f}", "{:.1f}", "{:.2f}", "{:.2f}")),
    Figure(_DOC, "the engine's calls in the endpoint: {} of {} prompts, {} s; alone: {} of 64, "
           "{} s", AGENT_ENDPOINT, tuple("concurrent/" + k for k in (
               "batches", "mean_batch", "engine_in_endpoint_s", "wave_batches",
               "engine_alone_s")), ("{}", "{:.1f}", "{:.1f}", "{}", "{:.1f}")),
    Figure(_DOC, "A call costs about {} ms more", AGENT_ENDPOINT, ("per_call/overhead_ms",),
           "{:.0f}"),
    Figure(_DOC, "64 agents get {} of what the engine makes", AGENT_ENDPOINT,
           ("concurrent/endpoint_over_engine_alone",), "{:.2f}"),
    Figure(_DOC, "The engine's calls take {} s of the run against {} s in waves",
           AGENT_ENDPOINT, ("concurrent/engine_in_endpoint_s", "concurrent/engine_alone_s"),
           "{:.1f}"),
    Figure(_DOC, "({} of {} prompts on average, against {} of 64)", AGENT_ENDPOINT,
           ("concurrent/batches", "concurrent/mean_batch", "concurrent/wave_batches"),
           ("{}", "{:.0f}", "{}")),
    Figure(_DOC, "each batch takes about {} times as long", AGENT_ENDPOINT, ("concurrent",),
           _engine_slowdown),
)
_AGENT_ENDPOINT_NOT_MEASURED = (
    NotMeasured(_DOC, "bench/agent_endpoint.py # about 1 minute", ROUGH),
    NotMeasured(_DOC, "replies of up to 16 tokens at temperature 1", CONFIG),
    NotMeasured(_DOC, "30 of each alternating", CONFIG),
    NotMeasured(_DOC, "made it worse (26.06 episodes/s, not recorded)", UNRECORDED),
    NotMeasured(_DOC, "sharing the 2 cores", MACHINE),
)

FIGURES = (_AGENT_ENDPOINT + _VERIFIERS + _PARTIAL_ROLLOUTS + _REFIT + _LORA_SYNC + _LORA_SERVING + _LORA_ARMS
           + _QUANTIZED + _HYBRID)
NOT_MEASURED = (_AGENT_ENDPOINT_NOT_MEASURED + _VERIFIERS_NOT_MEASURED + _PARTIAL_ROLLOUTS_NOT_MEASURED + _REFIT_NOT_MEASURED
                + _LORA_SYNC_NOT_MEASURED + _LORA_SERVING_NOT_MEASURED
                + _LORA_ARMS_NOT_MEASURED + _QUANTIZED_NOT_MEASURED + _HYBRID_NOT_MEASURED)
