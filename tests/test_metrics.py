"""metrics.jsonl handling."""

from rl import metrics


def test_metrics_truncate_moves_later_records_aside(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  for step in range(6):
    metrics.append(path, {"step": step, "reward": step / 10})
  assert metrics.truncate(path, 3) == 2
  assert [r["step"] for r in metrics.read(path)] == [0, 1, 2, 3]
  assert [r["step"] for r in metrics.read(path + ".discarded")] == [4, 5]
  assert metrics.truncate(path, 3) == 0
