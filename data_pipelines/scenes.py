"""Synthetic scenes for the embedded default dataset: objects with shape, colour, size and
a 3x3 position.

Every scene comes from its own `random.Random(f"{seed}:{split}:{index}")`, so a scene's bytes
depend only on (seed, split, index), never on what else was generated. The held-out split uses
(colour, shape) combinations that train and val never show, so answering about them needs
attributes learnt apart.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

COLOURS = {
    "red": (220, 40, 40),
    "green": (30, 160, 60),
    "blue": (40, 80, 225),
    "yellow": (240, 205, 20),
    "purple": (140, 55, 185),
    "orange": (250, 130, 20),
}
SHAPES = ("circle", "square", "triangle", "diamond")
SIZES = ("small", "large")
# one colour per shape never appears outside the test split
HELD_OUT = frozenset(
    {("green", "circle"), ("blue", "square"), ("red", "triangle"), ("yellow", "diamond")}
)
ALL_COMBOS = tuple((c, s) for c in COLOURS for s in SHAPES)
SEEN_COMBOS = tuple(cs for cs in ALL_COMBOS if cs not in HELD_OUT)
CELL_PHRASE = {
    (0, 0): "at the top left",
    (0, 1): "at the top",
    (0, 2): "at the top right",
    (1, 0): "on the left",
    (1, 1): "in the center",
    (1, 2): "on the right",
    (2, 0): "at the bottom left",
    (2, 1): "at the bottom",
    (2, 2): "at the bottom right",
}


@dataclass
class SceneObject:
    shape: str
    colour: str
    size: str
    row: int  # 3x3 cell
    col: int
    cx: float  # pixel centre
    cy: float
    radius: float

    @property
    def combo(self) -> tuple[str, str]:
        return self.colour, self.shape

    def describe(self) -> str:
        return f"{self.size} {self.colour} {self.shape}"


@dataclass
class Scene:
    width: int
    height: int
    background: tuple[int, int, int]
    objects: list[SceneObject]

    def to_meta(self) -> dict:
        return {
            "width": self.width,
            "height": self.height,
            "objects": [
                {"shape": o.shape, "colour": o.colour, "size": o.size, "row": o.row, "col": o.col}
                for o in self.objects
            ],
        }


def sample_scene(
    rng: random.Random, min_size: int, max_size: int, max_objects: int, heldout: bool
) -> Scene:
    """Random scene; `heldout` scenes contain at least one held-out (colour, shape) object, others none."""
    width, height = rng.randint(min_size, max_size), rng.randint(min_size, max_size)
    background = tuple(rng.randint(215, 250) for _ in range(3))
    n = rng.randint(1, max_objects)
    cells = rng.sample(range(9), n)
    if heldout:
        combos = [rng.choice(sorted(HELD_OUT))]
        combos += rng.sample([c for c in ALL_COMBOS if c != combos[0]], n - 1)
        rng.shuffle(combos)
    else:
        combos = rng.sample(SEEN_COMBOS, n)
    cw, ch = width / 3, height / 3
    objects = []
    for cell, (colour, shape) in zip(cells, combos):
        row, col = divmod(cell, 3)
        size = rng.choice(SIZES)
        radius = (0.42 if size == "large" else 0.24) * min(cw, ch)
        slack_x, slack_y = max(cw / 2 - radius, 0) * 0.6, max(ch / 2 - radius, 0) * 0.6
        cx = (col + 0.5) * cw + rng.uniform(-slack_x, slack_x)
        cy = (row + 0.5) * ch + rng.uniform(-slack_y, slack_y)
        objects.append(
            SceneObject(shape, colour, size, row, col, round(cx, 2), round(cy, 2), round(radius, 2))
        )
    return Scene(width, height, background, objects)


def render_scene(scene: Scene) -> bytes:
    """PNG bytes (deterministic for a given Pillow/zlib)."""
    img = Image.new("RGB", (scene.width, scene.height), scene.background)
    draw = ImageDraw.Draw(img)
    for o in scene.objects:
        fill, r, x, y = COLOURS[o.colour], o.radius, o.cx, o.cy
        if o.shape == "circle":
            draw.ellipse((x - r, y - r, x + r, y + r), fill=fill)
        elif o.shape == "square":
            s = r * 0.85
            draw.rectangle((x - s, y - s, x + s, y + s), fill=fill)
        elif o.shape == "triangle":
            draw.polygon(
                [(x, y - r), (x + r * 0.95, y + r * 0.75), (x - r * 0.95, y + r * 0.75)], fill=fill
            )
        else:  # diamond
            draw.polygon([(x, y - r), (x + r * 0.8, y), (x, y + r), (x - r * 0.8, y)], fill=fill)
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


def caption(scene: Scene) -> str:
    objs = sorted(scene.objects, key=lambda o: (o.row, o.col))
    parts = [f"a {o.describe()} {CELL_PHRASE[(o.row, o.col)]}" for o in objs]
    text = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return text[0].upper() + text[1:] + "."


def relations(rng: random.Random, scene: Scene) -> str:
    """One sentence per pair of objects that share a row or a column, each pair in a random
    direction: "Relative to the yellow diamond, the red triangle is to the left." Both objects
    are named before the relation, as in the position questions: "The red triangle is left of
    the ..." would ask for the relation before saying which object it is relative to, which no
    model can know."""
    out = []
    for i, first in enumerate(scene.objects):
        for second in scene.objects[i + 1 :]:
            if first.row != second.row and first.col != second.col:
                continue
            a, b = (second, first) if rng.random() < 0.5 else (first, second)
            rel = (
                ("to the left" if a.col < b.col else "to the right")
                if a.row == b.row
                else ("above" if a.row < b.row else "below")
            )
            out.append(f"Relative to the {b.colour} {b.shape}, the {a.colour} {a.shape} is {rel}.")
    return " ".join(out)


def _unique(objs: list[SceneObject], o: SceneObject, attrs: tuple[str, ...]) -> bool:
    return sum(all(getattr(p, a) == getattr(o, a) for a in attrs) for p in objs) == 1


def _ref(
    objs: list[SceneObject], o: SceneObject, options: tuple[tuple[str, ...], ...]
) -> str | None:
    """Shortest description of `o` (attributes in `options` order) that no other object shares."""
    for attrs in options:
        if _unique(objs, o, attrs):
            return " ".join(getattr(o, a) for a in attrs)
    return None


def q_colour(rng, scene, combos):
    objs = scene.objects
    cands = [(o, r) for o in objs if (r := _ref(objs, o, (("shape",), ("size", "shape"))))]
    if not cands:
        return None
    o, r = rng.choice(cands)
    return f"What colour is the {r}?", o.colour, o


def q_shape(rng, scene, combos):
    objs = scene.objects
    cands = [(o, r) for o in objs if (r := _ref(objs, o, (("colour",), ("size", "colour"))))]
    if not cands:
        return None
    o, r = rng.choice(cands)
    return f"What shape is the {r} object?", o.shape, o


def q_count(rng, scene, combos):
    mode = rng.choice(("shape", "colour", "all"))
    if mode == "shape":
        s = rng.choice(SHAPES)
        return f"How many {s}s are there?", str(sum(o.shape == s for o in scene.objects)), None
    if mode == "colour":
        c = rng.choice(sorted(COLOURS))
        return (
            f"How many {c} objects are there?",
            str(sum(o.colour == c for o in scene.objects)),
            None,
        )
    return "How many objects are there?", str(len(scene.objects)), None


def q_position(rng, scene, combos):
    pairs = [
        (a, b)
        for a in scene.objects
        for b in scene.objects
        if a is not b and (a.row == b.row or a.col == b.col)
    ]
    if not pairs:
        return None
    a, b = rng.choice(pairs)
    ans = (
        ("left" if a.col < b.col else "right")
        if a.row == b.row
        else ("above" if a.row < b.row else "below")
    )
    return (
        f"Where is the {a.colour} {a.shape} relative to the {b.colour} {b.shape}?",
        ans,
        a if a.combo in HELD_OUT else b,
    )


def q_yesno(rng, scene, combos):
    present = {o.combo for o in scene.objects}
    if rng.random() < 0.5:
        o = rng.choice(scene.objects)
        return f"Is there a {o.colour} {o.shape}?", "yes", o
    absent = [c for c in combos if c not in present]
    colour, shape = rng.choice(absent)
    return f"Is there a {colour} {shape}?", "no", None


QUESTION_TYPES = {
    "colour": q_colour,
    "shape": q_shape,
    "count": q_count,
    "position": q_position,
    "yesno": q_yesno,
}


def questions(rng: random.Random, scene: Scene, k: int, heldout: bool) -> list[dict]:
    """Up to `k` questions of distinct types (in random order), each {question, answer, type, heldout}."""
    combos = ALL_COMBOS if heldout else SEEN_COMBOS
    types = list(QUESTION_TYPES)
    rng.shuffle(types)
    out = []
    for t in types:
        if len(out) == k:
            break
        q = QUESTION_TYPES[t](rng, scene, combos)
        if q is None:
            continue
        question, answer, about = q
        out.append(
            {
                "question": question,
                "answer": answer,
                "type": t,
                "heldout": bool(about is not None and about.combo in HELD_OUT),
            }
        )
    return out
