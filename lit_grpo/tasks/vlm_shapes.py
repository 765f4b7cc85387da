"""The vision-language CPU demo: which of four colours is the square? Images made in code.

Each row is a chat whose user turn holds one image (a square of one of four colours, of random size
and place, on a grey canvas) and the question; the answer is the colour's initial, one token of the
tiny VLM's tokenizer (`r`, `g`, `b`, `y`), scored by `exact_match`. A random-init policy answers at
chance (1/4 among the four, less while it still says other things). Rows carry their image as a
`PIL.Image` in the message's image item (`lit_grpo.tasks.images`), generated from the seed;
held-out rows come from another seed. With `text_every` N > 0 every N-th row is a text row that
names the colour in words instead (rows with and without images, trained together).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from lit_grpo.config import require
from lit_grpo.rewards.registry import get_reward
from lit_grpo.tasks.registry import RewardFn, register_task

COLOURS = {"r": (220, 30, 30), "g": (30, 200, 30), "b": (30, 30, 220), "y": (230, 220, 30)}
"""Answer -> RGB of the square."""
COLOUR_NAMES = {"r": "red", "g": "green", "b": "blue", "y": "yellow"}
"""Answer -> the word a text row says it with."""
QUESTION = "colour of the square? r g b y"
_EVAL_SEED_OFFSET = 1_000_003


@dataclass
class VlmShapesOptions:
    """Options of `task=vlm_shapes` (`conf/task/vlm_shapes.yaml`)."""

    num_rows: int = 512
    """Rows generated (each a new image)."""
    canvas: int = 56
    """Side of the square canvas, pixels (the tiny processor keeps 28..56: 1 to 4 image tokens)."""
    min_side: int = 16
    """Smallest side of the coloured square, pixels (at most `canvas`)."""
    text_every: int = 0
    """Every N-th row (N > 0) holds no image: it names the colour in words. 0: every row has an image."""

    def __post_init__(self) -> None:
        require(self.num_rows >= 1, "task.num_rows", "must be >= 1")
        require(self.canvas >= 28, "task.canvas", f"must be >= 28 pixels, got {self.canvas}")
        require(1 <= self.min_side <= self.canvas, "task.min_side", f"must be in 1..task.canvas, got {self.min_side}")
        require(self.text_every >= 0, "task.text_every", f"must be >= 0 (0: no text rows), got {self.text_every}")


def square_image(colour: str, rng: random.Random, canvas: int = 56, min_side: int = 16):
    """A grey `canvas` × `canvas` RGB image with one square of `COLOURS[colour]` somewhere on it."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (canvas, canvas), (128, 128, 128))
    side = rng.randint(min_side, canvas)
    x, y = rng.randint(0, canvas - side), rng.randint(0, canvas - side)
    ImageDraw.Draw(image).rectangle([x, y, x + side - 1, y + side - 1], fill=COLOURS[colour])
    return image


def make_rows(opts: VlmShapesOptions, seed: int) -> list[dict]:
    """`opts.num_rows` rows, colours drawn uniformly."""
    rng = random.Random(seed)
    rows: list[dict] = []
    for _ in range(opts.num_rows):
        colour = rng.choice(sorted(COLOURS))
        image = square_image(colour, rng, opts.canvas, opts.min_side)  # drawn for text rows too: the same images
        if opts.text_every and len(rows) % opts.text_every == opts.text_every - 1:
            content = [{"type": "text", "text": f"{COLOUR_NAMES[colour]} square? r g b y"}]  # no longer than QUESTION
        else:
            content = [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]
        rows.append({"id": f"square{len(rows)}", "messages": [{"role": "user", "content": content}], "answer": colour})
    return rows


def train_rows(opts: VlmShapesOptions, *, seed: int, max_rows: int) -> list[dict]:
    rows = make_rows(opts, seed)
    return rows[:max_rows] if max_rows else rows


def held_out_rows(opts: VlmShapesOptions, *, seed: int, count: int) -> list[dict]:
    held_out = VlmShapesOptions(min(count, opts.num_rows), opts.canvas, opts.min_side, opts.text_every)
    return make_rows(held_out, seed + _EVAL_SEED_OFFSET)


def reward(opts: VlmShapesOptions) -> RewardFn:
    """The registered `exact_match` reward: the completion against the row's colour initial."""
    return get_reward("exact_match")


register_task("vlm_shapes", options=VlmShapesOptions, rows=train_rows, eval_rows=held_out_rows, reward=reward)
