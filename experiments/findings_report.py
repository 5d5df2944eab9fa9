"""The findings report's Markdown, from each finding's results.json alone: the summary table,
then per finding its claim, verdict, checks, plot and per-arm table.

experiments/findings.py runs the findings and writes results.json and report.md with this;
bench/figures/ regenerates docs/findings/report.md from the committed results.json files
with it, so this module imports nothing heavier than the standard library. Computing a
finding's numbers is findings.py's business.
"""


def seed_list(seeds: list[int]) -> str:
  """"seeds 0..4", "seeds 0, 1", "seed 0"."""
  if len(seeds) == 1:
    return f"seed {seeds[0]}"
  return "seeds " + (f"{seeds[0]}..{seeds[-1]}" if len(seeds) > 2
                     else ", ".join(map(str, seeds)))


def table(rows: list[dict]) -> str:
  """A Markdown table: the first row's keys as the columns."""
  columns = list(rows[0])
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  return "\n".join(lines + ["| " + " | ".join(str(row[c]) for c in columns) + " |"
                            for row in rows])


def checks_table(checks: list[dict]) -> str:
  """results.json's checks as a table."""
  return table([{"check": c["name"], "predicted": c["predicted"],
                 "mean [95% interval]": c["interval"],
                 "per seed": ", ".join(f"{v:+.3f}" for v in c["per_seed"].values()),
                 "verdict": c["reading"]} for c in checks])


def arms_table(rows: list[dict]) -> str:
  """results.json's per-arm table: each number the mean over seeds [95% interval]."""
  def cell(v):
    if isinstance(v, str):
      return v
    return (f"{v['mean']:.3g}" if v["n"] < 2
            else f"{v['mean']:.3g} [{v['low']:.3g}, {v['high']:.3g}]")
  return table([{column: cell(v) for column, v in row.items()} for row in rows])


def _minutes(value: float | None) -> str:
  return "-" if value is None else f"{value:.1f}"


def report(results: list[dict]) -> str:
  """report.md for these findings' results.json contents, in this order."""
  by_count = {}  # seed count -> the findings' letters, in report order
  for r in results:
    by_count.setdefault(len(r["seeds"]), []).append(r["key"].split("_")[0])
  counts = sorted(by_count)
  if len(counts) == 1:
    command = f"`python experiments/findings.py --all --seeds {counts[0]}`"
    ran = f"Every arm ran on {seed_list(results[0]['seeds'])}"
  else:  # more seeds where the interval was too wide: each group by its own command
    command = " then ".join(f"`python experiments/findings.py {' '.join(by_count[n])} "
                            f"--seeds {n}`" for n in counts)
    ran = "Every arm ran on " + "; ".join(
        f"{seed_list(list(range(n)))} in {', '.join(by_count[n])}" for n in counts)
  ci = {"t": "t", "bootstrap": "percentile-bootstrap"}[results[0]["ci"]]
  tiny = any(r["tiny"] for r in results)
  lines = ["# Findings reproduced in small", "",
           f"Reproduce with {command}"
           + (" (this report: --tiny, a smoke test; its numbers mean nothing)" if tiny
              else "") + f". {ran}, each seed from "
           "its own SFT warm start (`train.seed = k`). Each number is the mean over seeds "
           f"with its 95% {ci} interval [low, high]; a check is a predicted difference "
           "(between arms on the same seeds, or within one arm): reproduced when its "
           "interval excludes zero in the predicted direction, not reproduced when it "
           "excludes zero the other way or lies within the check's margin (no effect), too "
           "wide to tell otherwise. Each finding's numbers, per seed, are in "
           "`<finding>/results.json` beside its plot.", "",
           "| finding | verdict | seeds | minutes (summed over its runs) |", "|---|---|---|---|"]
  lines += [f"| {r['title']} | {r['verdict']} | {len(r['seeds'])} | {_minutes(r['minutes'])} |"
            for r in results]
  for r in results:
    lines += ["", f"## {r['title']}", "", f"Claim: {r['claim']}", "",
              f"**{r['verdict'].capitalize()}.** {r['rule']}", "",
              checks_table(r["checks"]), "", f"![{r['key']}]({r['key']}/plot.png)", "",
              arms_table(r["table"])]
  return "\n".join(lines) + "\n"
