"""The visual tasks (rl/tasks/visual.py): records, images, verifiers, splits and difficulty,
and that what the images show is what the records say (read back from their pixels)."""

import io
import json
import re

import numpy as np
import pytest
from PIL import Image

from rl import sampling
from rl.tasks import visual
from rl.tasks.arithmetic import Arithmetic
from rl.tasks.math import MathTask

SCENE_KINDS = ("count", "compare", "locate")
CHARTS = [(kind, question) for kind in visual.CHART_KINDS for question in visual.QUESTIONS]
_WHITE = (255, 255, 255)


def _tasks(num_train=60, num_test=20):
  """Every task and kind, small, by name."""
  tasks = {"rendered": visual.Rendered(Arithmetic(num_train=num_train, num_test=num_test))}
  for kind in SCENE_KINDS:
    tasks[f"scenes-{kind}"] = visual.Scenes(kind, num_train=num_train, num_test=num_test)
  for kind, question in CHARTS:
    tasks[f"charts-{kind}-{question}"] = visual.Charts(kind, question, num_train=num_train,
                                                      num_test=num_test)
  return tasks


TASKS = _tasks()


def _pixels(record) -> np.ndarray:
  """u8[height, width, 3] of the record's one image."""
  (data,) = record["images"]
  image = Image.open(io.BytesIO(data))
  assert image.format == "PNG" and image.mode == "RGB"
  return np.asarray(image)


def _problem(record) -> str:
  """The record without its image, as a comparable key."""
  return json.dumps({k: v for k, v in record.items() if k != "images"}, sort_keys=True)


def _wrong(answer: str) -> str:
  if answer.isdigit():
    return str(int(answer) + 1)
  return {"yes": "no", "no": "yes"}.get(answer, answer + "x")


@pytest.mark.parametrize("name", sorted(TASKS))
def test_records_are_deterministic_and_images_are_png_with_one_marker_each(name):
  task, again = TASKS[name], _tasks()[name]
  for split in ("train", "test"):
    for i in (0, 7, 19):
      record = getattr(task, split)[i]
      assert record == getattr(again, split)[i]
      assert task.prompt(record).count("<image>") == len(record["images"]) == 1
      assert all(isinstance(b, bytes) for b in record["images"])
      json.dumps({k: v for k, v in record.items() if k != "images"})  # the rest is JSON
      height, width, _ = _pixels(record).shape
      if name.startswith("scenes"):
        assert (width, height) == (112, 112)
      elif name.startswith("charts"):
        assert (width, height) == (192, 128)
      else:
        assert 56 <= width <= 224 and 56 <= height <= 224
  with pytest.raises(IndexError):
    task.test[20]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_reference_solutions_verify_and_wrong_answers_do_not(name):
  task = TASKS[name]
  for i in range(40):
    record = task.train[i]
    solution = task.solution(record)
    assert task.verify(solution, record) and task.well_formed(solution)
    assert task.answer(solution) == record["answer"]
    assert not task.verify("#" + _wrong(record["answer"]), record)
    assert not task.verify(solution + "!", record) and not task.verify("", record)
    assert task.answer("no answer") is None and not task.well_formed("no answer")
    if not name.startswith("rendered"):
      assert solution == "#" + record["answer"]
      assert not task.well_formed("I think " + solution)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_train_and_test_are_disjoint(name):
  task = _tasks(num_train=300, num_test=100)[name]
  train = {_problem(task.train[i]) for i in range(300)}
  test = {_problem(task.test[i]) for i in range(100)}
  assert len(test) > 50 and not train & test


def test_rendered_draws_the_text_problem_and_keeps_its_records():
  inner = Arithmetic(digits=3, num_train=50, num_test=10)
  task = visual.Rendered(inner)
  seen = set()
  for i in range(20):
    record, text_record = task.train[i], inner.train[i]
    assert {k: v for k, v in record.items() if k != "images"} == text_record
    assert task.text_prompt(record) == inner.prompt(text_record) == record["question"] + "="
    assert task.prompt(record) == "<image>\nSolve the problem in the image."
    pixels = _pixels(record)
    assert (pixels < 100).all(axis=-1).sum() > 20, "black text on the white image"
    seen.add(pixels.tobytes())
  assert len(seen) == 20, "different problems, different images"


def test_rendered_wraps_a_long_math_prompt_to_its_width():
  task = visual.Rendered(MathTask(), font_size=12, max_width=160)
  record = task.train[0]
  height, width, _ = _pixels(record).shape
  assert width <= 160 and height > 3 * 12, "several lines"
  assert task.verify(task.solution(record), record)
  assert "\\boxed{}" in task.text_prompt(record)
  lines = visual.wrap(task.text_prompt(record), visual.font(12), 152)
  assert len(lines) > 3 and all(visual.font(12).getlength(line) <= 152 for line in lines)
  assert "".join(lines).replace(" ", "") == task.text_prompt(record).replace(" ", "").replace(
      "\n", "")


def _components(mask: np.ndarray) -> list[np.ndarray]:
  """The 4-connected components of a bool[h, w] mask, each as int[n, 2] (row, col)."""
  seen, parts = np.zeros_like(mask), []
  for start in zip(*np.nonzero(mask)):
    if seen[start]:
      continue
    stack, part = [start], []
    seen[start] = True
    while stack:
      r, c = stack.pop()
      part.append((r, c))
      for nr, nc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
        if 0 <= nr < mask.shape[0] and 0 <= nc < mask.shape[1] and mask[nr, nc] \
            and not seen[nr, nc]:
          seen[nr, nc] = True
          stack.append((nr, nc))
    parts.append(np.asarray(part))
  return parts


def _shape_of(part: np.ndarray) -> str:
  """A patch's shape from how much of its bounding box it fills: a square all, a circle
  pi/4, a triangle a half."""
  box = np.ptp(part, axis=0) + 1
  fill = len(part) / (box[0] * box[1])
  return "square" if fill > 0.93 else "circle" if fill > 0.66 else "triangle"


def _read_scene(pixels: np.ndarray) -> list[tuple[str, str, np.ndarray]]:
  """(colour, shape, pixels) of every patch of a shape colour in the image."""
  return [(colour, _shape_of(part), part) for colour, rgb in visual.COLOURS.items()
          for part in _components((pixels == rgb).all(axis=-1))]


def test_count_answers_are_the_counts_of_the_drawn_shapes():
  task = visual.Scenes("count", max_difficulty=2, num_train=30)
  for i in range(30):
    record = task.train[i]
    seen = _read_scene(_pixels(record))
    described = [(o["colour"], o["shape"]) for o in record["objects"]]
    assert sorted((c, s) for c, s, _ in seen) == sorted(described)
    colour, shape = record["question"].split()[2], record["question"].split()[3][:-1]
    assert sum((c, s) == (colour, shape) for c, s, _ in seen) == int(record["answer"])


def test_compare_and_locate_answers_hold_in_the_image():
  larger = visual.Scenes("compare", max_difficulty=2, num_train=40)
  asked_size = 0
  for i in range(40):
    record = larger.train[i]
    if record["answer"] in ("yes", "no"):
      continue
    asked_size += 1
    first, shape, second = re.match(r"Which is larger, the (\w+) (\w+) or the (\w+) ",
                                    record["question"]).groups()
    areas = {c: len(p) for c, s, p in _read_scene(_pixels(record)) if s == shape}
    other = second if record["answer"] == first else first
    assert record["answer"] in (first, second) and areas[record["answer"]] > areas[other]
  assert asked_size > 10
  locate = visual.Scenes("locate", num_train=30)
  for i in range(30):
    record = locate.train[i]
    grid, (target, *_) = record["grid"], record["objects"]
    row, col = "abcdef".index(record["answer"][0]), int(record["answer"][1:]) - 1
    part = next(p for c, s, p in _read_scene(_pixels(record))
                if (c, s) == (target["colour"], target["shape"]))
    lines = [visual.grid_line(i, grid, 112) for i in range(grid + 1)]
    assert ((part[:, 0] > lines[row]) & (part[:, 0] < lines[row + 1])).all()
    assert ((part[:, 1] > lines[col]) & (part[:, 1] < lines[col + 1])).all()


@pytest.mark.parametrize("kind", visual.CHART_KINDS)
def test_chart_values_sit_on_gridlines_inside_the_axis(kind):
  task = visual.Charts(kind, num_train=30)
  colour = visual.BAR_COLOUR if kind == "bar" else visual.MARKER_COLOUR
  offset = 0 if kind == "bar" else 2  # a marker is 5 x 5 around its value
  for i in range(30):
    record = task.train[i]
    ticks, pixels = record["ticks"], _pixels(record)
    assert ticks[0] == 0 and len(set(np.diff(ticks))) == 1
    assert all(v in ticks[1:] for v in record["values"])
    assert len(record["values"]) == len(record["labels"]) == len(set(record["labels"]))
    for j, value in enumerate(record["values"]):
      column = visual.label_column(j, len(record["labels"]), 192, 128)
      rows = np.nonzero((pixels[:, column] == colour).all(axis=-1))[0]
      assert rows.min() == visual.value_row(value, ticks[-1], 192, 128) - offset
    gridline = visual.value_row(ticks[1], ticks[-1], 192, 128)
    assert (pixels[gridline, visual.plot_box(192, 128)[2] - 1] == visual.GRID_COLOUR).all()


def test_difficulty_grows_objects_grids_and_charts():
  def by_level(task, measure):
    values = {}
    for i in range(len(task.train)):
      record = task.train[i]
      values.setdefault(record["difficulty"], []).append(measure(record))
    assert sorted(values) == [1, 2, 3, 4, 5]
    return [np.mean(values[level]) for level in sorted(values)]

  count = visual.Scenes("count", num_train=100)
  assert np.all(np.diff(by_level(count, lambda r: len(r["objects"]))) > 0)
  assert np.all(np.diff(by_level(count, lambda r: r["objects"][0]["size"])) < 0)
  assert np.all(np.diff(by_level(visual.Scenes("locate", num_train=100),
                                 lambda r: r["grid"])) > 0)
  charts = visual.Charts("bar", num_train=100)
  assert np.all(np.diff(by_level(charts, lambda r: len(r["labels"]))) > 0)
  assert np.all(np.diff(by_level(charts, lambda r: len(r["ticks"]))) > 0)
  easy = visual.Scenes("compare", min_difficulty=1, max_difficulty=1, num_train=20)
  assert {easy.train[i]["difficulty"] for i in range(20)} == {1}
  weights = np.asarray(sampling.field_difficulty(count, "difficulty"))
  levels = np.asarray([count.train[i]["difficulty"] for i in range(100)])
  np.testing.assert_allclose(weights, (levels - 1) / 4, atol=1e-6)


@pytest.mark.parametrize("make, match", [
    (lambda: visual.Scenes("colour"), "Scenes.kind"),
    (lambda: visual.Scenes("count", size=40), "Scenes.size"),
    (lambda: visual.Scenes("count", min_difficulty=3, max_difficulty=2), "min_difficulty"),
    (lambda: visual.Scenes("count", max_difficulty=6), "max_difficulty"),
    (lambda: visual.Scenes("count", num_train=-1), "num_train"),
    (lambda: visual.Charts("pie"), "Charts.kind"),
    (lambda: visual.Charts("bar", question="mean"), "Charts.question"),
    (lambda: visual.Charts("bar", width=50), "width"),
    (lambda: visual.Rendered(Arithmetic(), font_size=3), "Rendered.font_size"),
    (lambda: visual.Rendered(Arithmetic(), instruction="<image> solve"), "instruction"),
    (lambda: visual.Rendered(Arithmetic(), min_side=300), "min_side"),
    (lambda: visual.Rendered(Arithmetic(), font_size=40, max_width=60), "max_width"),
])
def test_bad_parameters_name_themselves(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_rendered_refuses_a_task_with_images():
  with pytest.raises(ValueError, match="text task"):
    visual.Rendered(visual.Scenes("count")).train[0]


def test_the_tasks_are_configurable_with_gin():
  import gin
  from experiments import gin_externals  # noqa: F401 - registers the tasks
  gin.parse_config("Rendered.task = @Arithmetic()\nArithmetic.digits = 3\n"
                   "Scenes.kind = 'locate'\nCharts.kind = 'line'\nCharts.question = 'max'")
  rendered = gin.get_configurable("Rendered")()
  assert rendered.task == Arithmetic(digits=3)
  assert gin.get_configurable("tasks.Scenes")() == visual.Scenes("locate")
  assert gin.get_configurable("Charts")() == visual.Charts("line", "max")
