"""Visual tasks: the three kinds of Kimi k1.5's vision RL data (Kimi Team 2025,
arXiv:2501.12599), drawn with Pillow, each with an exact verifier.

- `Rendered`: text-rendered data. Another text task's prompt drawn as an image (black text on
  white, Pillow's default font), so a problem can be asked as text or as a picture of it.
- `Scenes`: synthetic visual reasoning. Scenes of circles, squares and triangles in four
  colours; kinds "count", "compare" (more X than Y / which of two is larger) and "locate"
  (which cell of a k x k grid).
- `Charts`: chart reading, k1.5's "data analysis" part of real-world data. Bar and line charts
  with numbered gridlines; every value lies on a gridline, so a reader can be exactly right.

Owns the problem generators, the drawing and the verifiers; not how images reach the model.
The record convention the rest of the stack relies on: `images` is a list of PNG-encoded
bytes, `prompt(record)` holds the marker "<image>" once per image, in the order of `images`
(verl's and slime's convention; the stack replaces each marker by the model's vision
placeholder tokens), and every other field is a plain JSON-able value.

Scenes and Charts answer as a completion that is "#<answer>" (letters, digits, '-'), checked
exactly; their records carry `difficulty` (1..5: more objects and distractors, smaller
objects, a finer grid, more bars and gridlines), a field for rl.sampling.field_difficulty.
Record i of a split is a pure function of (seed, split, i); a problem belongs to the test
split iff a stable hash of its description falls in one bucket of ten, so train and test
are disjoint. Rendered keeps the wrapped task's records, splits and verifier.
"""

import dataclasses
import functools
import io
import json
import random
import re
import string
import zlib
from typing import Any, Callable

from PIL import Image, ImageDraw, ImageFont

from models import vision

IMAGE = vision.IMAGE_MARKER
MAX_DIFFICULTY = 5
SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 40, 40), "green": (40, 160, 70), "blue": (40, 90, 220),
           "yellow": (230, 190, 30)}
BAR_COLOUR, LINE_COLOUR, MARKER_COLOUR = (70, 110, 200), (230, 120, 40), (150, 40, 20)
GRID_COLOUR = (200, 200, 200)
_WHITE, _BLACK = (255, 255, 255), (0, 0, 0)
_TEST_BUCKET = 0
_ANSWER = re.compile(r"#([A-Za-z0-9-]+)$")
_FORMAT = re.compile(r"#[A-Za-z0-9-]+")
_MARGIN = 4  # pixels of white around rendered text
_CHART_FONT = 10
_CHART_MARGINS = (24, 10, 6, 16)  # left (tick numbers), top, right, bottom (labels)


def png(image: Image.Image) -> bytes:
  """The image as PNG bytes (Pillow writes no timestamp: equal images, equal bytes)."""
  buffer = io.BytesIO()
  image.save(buffer, format="PNG")
  return buffer.getvalue()


def _is_test(problem: dict[str, Any]) -> bool:
  key = json.dumps(problem, sort_keys=True)
  return zlib.crc32(key.encode()) % 10 == _TEST_BUCKET


@functools.lru_cache(maxsize=None)
def font(size: int) -> ImageFont.FreeTypeFont:
  """Pillow's default font (Aileron, bundled) at `size` pixels; loading it takes ~15 ms."""
  return ImageFont.load_default(size=size)


def _check_range(owner: str, index: int, num_records: int):
  if not 0 <= index < num_records:
    raise IndexError(f"{owner} index {index} out of range [0, {num_records})")


class _ShortAnswer:
  """The answer format of Scenes and Charts: a completion is "#<answer>", nothing else."""

  def solution(self, record: dict[str, Any]) -> str:
    return "#" + record["answer"]

  def well_formed(self, completion: str) -> bool:
    return _FORMAT.fullmatch(completion.strip()) is not None

  def answer(self, completion: str) -> str | None:
    match = _ANSWER.search(completion.strip())
    return match.group(1) if match else None

  def verify(self, completion: str, record: dict[str, Any]) -> bool:
    """True iff the completion ends in "#<the answer>", exactly (case included)."""
    return self.answer(completion) == record["answer"]


def _check_levels(owner: str, low: int, high: int):
  if not 1 <= low <= high <= MAX_DIFFICULTY:
    raise ValueError(f"{owner} needs 1 <= min_difficulty <= max_difficulty <= "
                     f"{MAX_DIFFICULTY}, got min_difficulty={low}, max_difficulty={high}")


def _check_counts(owner: str, num_train: int, num_test: int):
  if num_train < 0 or num_test < 0:
    raise ValueError(f"{owner}.num_train and .num_test must be >= 0, got {num_train}, "
                     f"{num_test}")


@dataclasses.dataclass(frozen=True)
class VisualSource:
  """grain random-access source of drawn problems. Record i draws problems from a generator
  seeded by (name, seed, split, i) until one falls in its split's hash bucket, then adds its
  image: {**problem, "images": [png]}."""

  name: str
  split: str
  num_records: int
  seed: int
  problem: Callable[[random.Random], dict[str, Any]]
  draw: Callable[[dict[str, Any]], Image.Image]

  def __len__(self) -> int:
    return self.num_records

  def __getitem__(self, index: int) -> dict[str, Any]:
    _check_range(f"{self.name}({self.split})", index, self.num_records)
    rng = random.Random(f"{self.name}/{self.seed}/{self.split}/{index}")
    while True:
      problem = self.problem(rng)
      if _is_test(problem) == (self.split == "test"):
        return {**problem, "images": [png(self.draw(problem))]}


# ---------------------------------------------------------------------------------------------
# Rendered: a text task's prompt as an image.


def wrap(text: str, typeface: ImageFont.FreeTypeFont, width: int) -> list[str]:
  """Lines of `text` at most `width` pixels wide in `typeface`: its line breaks kept, words
  packed greedily, a word wider than a line (arithmetic's "4711+815=") split between
  characters."""
  lines = []
  for paragraph in text.split("\n"):
    line = ""
    for word in paragraph.split(" "):
      joined = f"{line} {word}" if line else word
      if typeface.getlength(joined) <= width:
        line = joined
        continue
      if line:
        lines.append(line)
      line = ""
      for char in word:
        if line and typeface.getlength(line + char) > width:
          lines.append(line)
          line = ""
        line += char
    lines.append(line)
  return lines


def render_text(text: str, *, font_size: int, max_width: int, min_side: int) -> Image.Image:
  """`text` in black on white, wrapped to `max_width` pixels, in an RGB image that fits it
  with a 4-pixel margin: width in [min_side, max_width], height at least min_side (more
  lines, taller)."""
  typeface = font(font_size)
  lines = wrap(text, typeface, max_width - 2 * _MARGIN)
  ascent, descent = typeface.getmetrics()
  line_height = ascent + descent
  widest = max(int(typeface.getlength(line)) + 1 for line in lines)
  width = min(max_width, max(min_side, widest + 2 * _MARGIN))
  height = max(min_side, line_height * len(lines) + 2 * _MARGIN)
  image = Image.new("RGB", (width, height), _WHITE)
  draw = ImageDraw.Draw(image)
  for i, line in enumerate(lines):
    draw.text((_MARGIN, _MARGIN + i * line_height), line, fill=_BLACK, font=typeface)
  return image


def render_cells(text: str, *, font_size: int, cell: int, max_width: int,
                 min_side: int) -> Image.Image:
  """`text` monospaced, as code is shown: each character centred in a cell `cell` pixels wide
  and 2 * cell tall, lines of at most max_width / cell characters (wrapped at any
  character), no margin; the image padded with white to an even number of cells each way
  and to at least `min_side`. With cell = 14 every glyph fills one column of Qwen2.5-VL's
  14-pixel patches and each 2 x 2 merge block holds two characters, whatever the text."""
  typeface = font(font_size)
  per_line = max(1, max_width // cell)
  lines = [row[k:k + per_line] for row in text.split("\n")
           for k in range(0, max(len(row), 1), per_line)]
  even = lambda n: n + n % 2
  width = max(min_side, cell * even(max(len(line) for line in lines)))
  height = max(min_side, 2 * cell * len(lines))
  image = Image.new("RGB", (even(-(-width // cell)) * cell, even(-(-height // cell)) * cell),
                    _WHITE)
  draw = ImageDraw.Draw(image)
  for row, line in enumerate(lines):
    for col, char in enumerate(line):
      draw.text((col * cell + cell / 2, row * 2 * cell + cell), char, fill=_BLACK,
                font=typeface, anchor="mm")
  return image


@dataclasses.dataclass(frozen=True)
class RenderedSource:
  """The wrapped task's source with each record's prompt drawn: {**record, "images": [png]}."""

  inner: Any
  text_prompt: Callable[[dict[str, Any]], str]
  font_size: int
  max_width: int
  min_side: int
  cell: int

  def __len__(self) -> int:
    return len(self.inner)

  def __getitem__(self, index: int) -> dict[str, Any]:
    record = self.inner[index]
    if "images" in record:
      raise ValueError("Rendered.task must be a text task; its records already have images")
    draw = functools.partial(render_cells, cell=self.cell) if self.cell else render_text
    image = draw(self.text_prompt(record), font_size=self.font_size,
                 max_width=self.max_width, min_side=self.min_side)
    return {**record, "images": [png(image)]}


def _text_record(record: dict[str, Any]) -> dict[str, Any]:
  return {k: v for k, v in record.items() if k != "images"}


@dataclasses.dataclass(frozen=True)
class Rendered:
  """`task` (a text task with short prompts: Arithmetic, MathTask) asked through a picture of
  its prompt. The prompt is "<image>\\n<instruction>"; records are the task's records plus
  `images`; solution, verify, well_formed and answer are the task's. `text_prompt(record)`
  is the same problem's text prompt, for comparing accuracy on the two.

  cell: 0 draws the text proportionally (`render_text`); n > 0 monospaced in cells n pixels
  wide (`render_cells`: with 14, one glyph per column of a Qwen2.5-VL patch, which a tiny
  tower learns to read in minutes).

  transcribe: the reference solution first copies the image's text, then a line break, then
  the task's solution (reading taught token by token, as OCR data does); the format check
  and the answer are the task's on the last line, the verifier the task's on the whole."""

  task: Any
  instruction: str = "Solve the problem in the image."
  font_size: int = 14
  max_width: int = 224
  min_side: int = 56
  cell: int = 0
  transcribe: bool = False

  def __post_init__(self):
    if IMAGE in self.instruction:
      raise ValueError(f"Rendered.instruction must not hold {IMAGE!r}: the prompt puts the one "
                       f"marker first; got {self.instruction!r}")
    if self.font_size < 6:
      raise ValueError(f"Rendered.font_size must be >= 6 pixels, got {self.font_size}")
    if not 1 <= self.min_side <= self.max_width:
      raise ValueError(f"Rendered needs 1 <= min_side <= max_width, got min_side="
                       f"{self.min_side}, max_width={self.max_width}")
    if self.cell < 0 or self.cell > self.max_width:
      raise ValueError(f"Rendered.cell must be in [0, max_width={self.max_width}] pixels, got "
                       f"{self.cell}")
    if self.max_width < 2 * self.font_size + 2 * _MARGIN:
      raise ValueError(f"Rendered.max_width must fit two characters: >= "
                       f"{2 * self.font_size + 2 * _MARGIN} at font_size {self.font_size}, "
                       f"got {self.max_width}")

  def _source(self, inner) -> RenderedSource:
    return RenderedSource(inner, self.task.prompt, self.font_size, self.max_width,
                          self.min_side, self.cell)

  @property
  def train(self) -> RenderedSource:
    return self._source(self.task.train)

  @property
  def test(self) -> RenderedSource:
    return self._source(self.task.test)

  def prompt(self, record: dict[str, Any]) -> str:
    return f"{IMAGE}\n{self.instruction}"

  def text_prompt(self, record: dict[str, Any]) -> str:
    """The wrapped task's prompt of the same problem: the text the image shows."""
    return self.task.prompt(_text_record(record))

  def solution(self, record: dict[str, Any]) -> str:
    solution = self.task.solution(_text_record(record))
    return f"{self.text_prompt(record)}\n{solution}" if self.transcribe else solution

  def verify(self, completion: str, record: dict[str, Any]) -> bool:
    return self.task.verify(completion, _text_record(record))

  def _solved(self, completion: str) -> str:
    return completion.rsplit("\n", 1)[-1] if self.transcribe else completion

  def well_formed(self, completion: str) -> bool:
    return self.task.well_formed(self._solved(completion))

  def answer(self, completion: str) -> str | None:
    return self.task.answer(self._solved(completion))


# ---------------------------------------------------------------------------------------------
# Scenes: shapes to count, compare and locate. An object is {"shape", "colour", "x", "y",
# "size"}: its bounding box is the `size`-pixel square whose top-left pixel is (x, y).


def _others(rng: random.Random, count: int, exclude) -> list[tuple[str, str]]:
  """`count` random (colour, shape) pairs, none of them in `exclude`."""
  pairs = [(c, s) for c in COLOURS for s in SHAPES if (c, s) not in exclude]
  return [rng.choice(pairs) for _ in range(count)]


def _place(rng: random.Random, specs: list[tuple[str, str, int]], side: int,
           gap: int = 2) -> list[dict[str, Any]]:
  """Objects (colour, shape, size) at random places in a side x side scene, inside it and at
  least `gap` pixels apart, so that each is its own patch of colour."""
  boxes = []
  for colour, shape, size in specs:
    for _ in range(2000):
      x, y = (rng.randint(gap, side - size - gap) for _ in range(2))
      if all(x + size + gap <= bx or bx + bs + gap <= x or y + size + gap <= by
             or by + bs + gap <= y for bx, by, bs in boxes):
        break
    else:
      raise RuntimeError(f"no room for {len(specs)} objects in a {side}-pixel scene")
    boxes.append((x, y, size))
  return [{"shape": shape, "colour": colour, "x": x, "y": y, "size": size}
          for (colour, shape, _), (x, y, size) in zip(specs, boxes)]


def _count_scene(rng: random.Random, level: int, side: int) -> dict[str, Any]:
  """2 + 2 * level objects, 1..level+1 of them the asked (colour, shape); smaller at higher
  levels."""
  colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
  count = rng.randint(1, level + 1)
  pairs = [(colour, shape)] * count + _others(rng, 2 + 2 * level - count, {(colour, shape)})
  size = max(6, round(side * (0.22 - 0.02 * level)))
  objects = _place(rng, [(c, s, size) for c, s in pairs], side)
  return {"question": f"How many {colour} {shape}s are there? Answer as #<number>.",
          "answer": str(count), "objects": objects, "grid": 0}


def _more_scene(rng: random.Random, level: int, side: int) -> dict[str, Any]:
  """Two different counts in 1..level+1 of two (colour, shape) pairs, and `level`
  distractors."""
  first, second = rng.sample([(c, s) for c in COLOURS for s in SHAPES], 2)
  counts = rng.sample(range(1, level + 2), 2)
  pairs = [first] * counts[0] + [second] * counts[1] + _others(rng, level, {first, second})
  size = max(6, round(side * (0.2 - 0.02 * level)))
  objects = _place(rng, [(c, s, size) for c, s in pairs], side)
  question = (f"Are there more {first[0]} {first[1]}s than {second[0]} {second[1]}s? "
              "Answer as #yes or #no.")
  return {"question": question, "answer": "yes" if counts[0] > counts[1] else "no",
          "objects": objects, "grid": 0}


def _larger_scene(rng: random.Random, level: int, side: int) -> dict[str, Any]:
  """Two objects of one shape in two colours, one larger by a factor 1 + 0.5 / level (at
  least 2 pixels), and 2 * (level - 1) distractors."""
  shape, (first, second) = rng.choice(SHAPES), rng.sample(list(COLOURS), 2)
  small = max(6, round(side * (0.16 - 0.01 * level)))
  large = max(small + 2, round(small * (1 + 0.5 / level)))
  bigger = rng.choice((first, second))
  specs = [(c, shape, large if c == bigger else small) for c in (first, second)]
  specs += [(c, s, rng.randint(small - 2, large))
            for c, s in _others(rng, 2 * (level - 1), {(first, shape), (second, shape)})]
  question = (f"Which is larger, the {first} {shape} or the {second} {shape}? "
              "Answer as #<colour>.")
  return {"question": question, "answer": bigger, "objects": _place(rng, specs, side),
          "grid": 0}


def _compare_scene(rng: random.Random, level: int, side: int) -> dict[str, Any]:
  """Half the scenes ask which of two kinds is more numerous, half which object is larger."""
  return (_more_scene if rng.random() < 0.5 else _larger_scene)(rng, level, side)


def grid_line(i: int, grid: int, side: int) -> int:
  """The pixel column (and row) of the line between cells i - 1 and i of a grid x grid
  scene."""
  return round(i * side / grid)


def _in_cell(rng: random.Random, i: int, grid: int, side: int, size: int) -> int:
  """A random start for a `size`-pixel box inside cell i, a pixel clear of its lines."""
  low = grid_line(i, grid, side) + 2
  return rng.randint(low, max(low, grid_line(i + 1, grid, side) - size - 2))


def _locate_scene(rng: random.Random, level: int, side: int) -> dict[str, Any]:
  """A (level + 1)-square grid; the asked object and min(2 * level, cells - 1) distractors,
  each alone in its cell. Cells are named by row letter (a = top) and column number
  (1 = left)."""
  grid = level + 1
  cells = rng.sample(range(grid * grid), min(2 * level, grid * grid - 1) + 1)
  target = (rng.choice(list(COLOURS)), rng.choice(SHAPES))
  size = max(4, int(side / grid * 0.6))
  objects = []
  for (colour, shape), cell in zip([target] + _others(rng, len(cells) - 1, {target}), cells):
    row, col = divmod(cell, grid)
    objects.append({"shape": shape, "colour": colour, "x": _in_cell(rng, col, grid, side, size),
                    "y": _in_cell(rng, row, grid, side, size), "size": size})
  row, col = divmod(cells[0], grid)
  rows = string.ascii_lowercase[:grid]
  question = (f"The image is a {grid}x{grid} grid, rows a-{rows[-1]} from the top, columns "
              f"1-{grid} from the left. Which cell holds the {target[0]} {target[1]}? "
              "Answer as #<cell>, e.g. #a1.")
  return {"question": question, "answer": f"{rows[row]}{col + 1}", "objects": objects,
          "grid": grid}


def _draw_object(draw: ImageDraw.ImageDraw, obj: dict[str, Any]):
  x, y, last = obj["x"], obj["y"], obj["size"] - 1
  fill = COLOURS[obj["colour"]]
  if obj["shape"] == "circle":
    draw.ellipse((x, y, x + last, y + last), fill=fill)
  elif obj["shape"] == "square":
    draw.rectangle((x, y, x + last, y + last), fill=fill)
  else:
    draw.polygon([(x + last // 2, y), (x, y + last), (x + last, y + last)], fill=fill)


def draw_scene(problem: dict[str, Any], side: int) -> Image.Image:
  """The scene of `problem` ("objects", "grid": 0 for none) on white, side x side, RGB.
  Shapes are drawn without anti-aliasing: every object pixel is exactly its colour."""
  image = Image.new("RGB", (side, side), _WHITE)
  draw = ImageDraw.Draw(image)
  for i in range(1, problem["grid"]):
    at = grid_line(i, problem["grid"], side)
    draw.line((at, 0, at, side - 1), fill=GRID_COLOUR)
    draw.line((0, at, side - 1, at), fill=GRID_COLOUR)
  for obj in problem["objects"]:
    _draw_object(draw, obj)
  return image


_SCENES = {"count": _count_scene, "compare": _compare_scene, "locate": _locate_scene}


@dataclasses.dataclass(frozen=True)
class Scenes(_ShortAnswer):
  """Synthetic visual reasoning over size x size scenes of shapes. `kind` is one of "count",
  "compare", "locate"; each record's difficulty is drawn uniformly from [min_difficulty,
  max_difficulty]. Records: question, answer, difficulty, kind, objects (the scene, as drawn),
  grid (cells a side, 0 when no grid is drawn), images."""

  kind: str
  size: int = 112
  min_difficulty: int = 1
  max_difficulty: int = MAX_DIFFICULTY
  num_train: int = 10_000
  num_test: int = 500
  seed: int = 0

  def __post_init__(self):
    if self.kind not in _SCENES:
      raise ValueError(f"Scenes.kind must be one of {sorted(_SCENES)}, got {self.kind!r}")
    if self.size < 56:  # the finest grid's cells must hold a 5-pixel shape clear of lines
      raise ValueError(f"Scenes.size must be >= 56 pixels, got {self.size}")
    _check_levels("Scenes", self.min_difficulty, self.max_difficulty)
    _check_counts("Scenes", self.num_train, self.num_test)

  def problem(self, rng: random.Random) -> dict[str, Any]:
    """One scene's description (the record without its image)."""
    level = rng.randint(self.min_difficulty, self.max_difficulty)
    return {"kind": self.kind, "difficulty": level, **_SCENES[self.kind](rng, level, self.size)}

  def draw(self, problem: dict[str, Any]) -> Image.Image:
    return draw_scene(problem, self.size)

  def _source(self, split: str, num_records: int) -> VisualSource:
    return VisualSource(f"scenes/{self.kind}", split, num_records, self.seed, self.problem,
                        self.draw)

  @property
  def train(self) -> VisualSource:
    return self._source("train", self.num_train)

  @property
  def test(self) -> VisualSource:
    return self._source("test", self.num_test)

  def prompt(self, record: dict[str, Any]) -> str:
    return f"{IMAGE}\n{record['question']}"


# ---------------------------------------------------------------------------------------------
# Charts: values read off bar and line charts.


def plot_box(width: int, height: int) -> tuple[int, int, int, int]:
  """(left, top, right, bottom) pixels of a chart's plot area; the axes are its left and
  bottom edges."""
  left, top, right, bottom = _CHART_MARGINS
  return left, top, width - right, height - bottom


def value_row(value: int, top_tick: int, width: int, height: int) -> int:
  """The pixel row of `value` on the y axis, whose gridlines run 0..top_tick."""
  _, top, _, bottom = plot_box(width, height)
  return bottom - round(value * (bottom - top) / top_tick)


def label_column(i: int, count: int, width: int, height: int) -> int:
  """The pixel column of the i-th of `count` bars or points, centred in equal slots."""
  left, _, right, _ = plot_box(width, height)
  return left + round((i + 0.5) * (right - left) / count)


def _chart_problem(rng: random.Random, level: int, question: str) -> dict[str, Any]:
  """2 + level labels (distinct capital letters), 3 + level gridlines above 0 a step of 1, 2,
  5 or 10 apart, and a value on a gridline (> 0) per label, the largest one unique."""
  step, gridlines = rng.choice((1, 2, 5, 10)), 3 + level
  labels = rng.sample(string.ascii_uppercase, 2 + level)
  while True:
    values = [step * rng.randint(1, gridlines) for _ in labels]
    if values.count(max(values)) == 1:
      break
  if question == "value":
    asked = rng.randrange(len(labels))
    text, answer = f"What is the value of {labels[asked]}? Answer as #<number>.", values[asked]
  elif question == "max":
    text, answer = "What is the largest value? Answer as #<number>.", max(values)
  else:
    text = "Which label has the largest value? Answer as #<label>."
    answer = labels[values.index(max(values))]
  return {"question": text, "answer": str(answer), "labels": labels, "values": values,
          "ticks": [step * i for i in range(gridlines + 1)]}


def _draw_axes(draw: ImageDraw.ImageDraw, problem: dict[str, Any], width: int, height: int):
  """Gridlines with their numbers, the two axes and the labels under the x axis."""
  left, top, right, bottom = plot_box(width, height)
  typeface = font(_CHART_FONT)
  for tick in problem["ticks"]:
    row = value_row(tick, problem["ticks"][-1], width, height)
    draw.line((left, row, right, row), fill=GRID_COLOUR)
    draw.text((left - 3, row), str(tick), fill=_BLACK, font=typeface, anchor="rm")
  draw.line((left, top, left, bottom), fill=_BLACK)
  draw.line((left, bottom, right, bottom), fill=_BLACK)
  for i, label in enumerate(problem["labels"]):
    column = label_column(i, len(problem["labels"]), width, height)
    draw.text((column, bottom + 3), label, fill=_BLACK, font=typeface, anchor="mt")


def draw_chart(problem: dict[str, Any], kind: str, width: int, height: int) -> Image.Image:
  """A bar chart (a bar's top row is its value's gridline) or a line chart (5 x 5 markers
  centred on the values, joined by a line) of `problem`, width x height, RGB."""
  image = Image.new("RGB", (width, height), _WHITE)
  draw = ImageDraw.Draw(image)
  _draw_axes(draw, problem, width, height)
  count, top_tick = len(problem["labels"]), problem["ticks"][-1]
  left, _, right, bottom = plot_box(width, height)
  points = [(label_column(i, count, width, height), value_row(v, top_tick, width, height))
            for i, v in enumerate(problem["values"])]
  if kind == "bar":
    half = max(1, (right - left) // count // 3)  # bars two thirds of their slot
    for column, row in points:
      draw.rectangle((column - half, row, column + half, bottom - 1), fill=BAR_COLOUR)
  else:
    draw.line(points, fill=LINE_COLOUR, width=1)
    for column, row in points:
      draw.rectangle((column - 2, row - 2, column + 2, row + 2), fill=MARKER_COLOUR)
  return image


CHART_KINDS = ("bar", "line")
QUESTIONS = ("value", "max", "argmax")


@dataclasses.dataclass(frozen=True)
class Charts(_ShortAnswer):
  """Chart reading: `kind` "bar" or "line", width x height pixels; `question` "value" (the
  value of a named label), "max" (the largest value) or "argmax" (the label of the largest
  value). Records: question, answer, difficulty, kind, labels, values (one per label, each a
  tick), ticks (the gridlines' values, 0 first), images."""

  kind: str
  question: str = "value"
  width: int = 192
  height: int = 128
  min_difficulty: int = 1
  max_difficulty: int = MAX_DIFFICULTY
  num_train: int = 10_000
  num_test: int = 500
  seed: int = 0

  def __post_init__(self):
    if self.kind not in CHART_KINDS:
      raise ValueError(f"Charts.kind must be one of {CHART_KINDS}, got {self.kind!r}")
    if self.question not in QUESTIONS:
      raise ValueError(f"Charts.question must be one of {QUESTIONS}, got {self.question!r}")
    # the densest chart (7 labels, 8 gridlines) keeps bars and gridlines >= 4 pixels apart
    if self.width < 96 or self.height < 64:
      raise ValueError(f"Charts needs width >= 96 and height >= 64 pixels, got width="
                       f"{self.width}, height={self.height}")
    _check_levels("Charts", self.min_difficulty, self.max_difficulty)
    _check_counts("Charts", self.num_train, self.num_test)

  def problem(self, rng: random.Random) -> dict[str, Any]:
    """One chart's description (the record without its image)."""
    level = rng.randint(self.min_difficulty, self.max_difficulty)
    return {"kind": self.kind, "difficulty": level,
            **_chart_problem(rng, level, self.question)}

  def draw(self, problem: dict[str, Any]) -> Image.Image:
    return draw_chart(problem, self.kind, self.width, self.height)

  def _source(self, split: str, num_records: int) -> VisualSource:
    return VisualSource(f"charts/{self.kind}/{self.question}", split, num_records, self.seed,
                        self.problem, self.draw)

  @property
  def train(self) -> VisualSource:
    return self._source("train", self.num_train)

  @property
  def test(self) -> VisualSource:
    return self._source("test", self.num_test)

  def prompt(self, record: dict[str, Any]) -> str:
    return f"{IMAGE}\n{record['question']}"
