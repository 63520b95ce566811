"""`vlm chat --ckpt DIR [--image PATH ...]`: multi-turn image chat in the terminal, answers streamed
token by token.

Each line is a user turn; `/image PATH` attaches an image to the next turn, `/reset` starts over,
`/quit` (or end of input) leaves. When standard input is not a terminal it reads one turn per line,
prints each answer and exits 0 at the end of input. Every turn prefills the conversation once and
decodes with the concept-level caches.

Inputs are bounded as in the demo: a turn whose conversation would exceed `--max-prompt-tokens` is
refused before the model sees it (a cheap character bound first, so a 5 MB line is never tokenized),
a line that is not UTF-8 is skipped with a message, a conversation holds at most `MAX_IMAGES`
images, and each image is shrunk to the patch grid the model sees when it is attached (its pixel
count checked from the header before anything is decoded): a conversation keeps kilobytes per image,
not the upload's decoded size. The decode buffers of a large image are handed back to the operating
system at once (`release_freed_memory`), so that a long-running process (the demo) does not keep the
largest uploads' memory. Numeric options are checked when they are parsed, and each `--image` before
the model loads: a missing file, a folder, a FIFO or device (never opened: opening a FIFO waits for
a writer), or a file that is not an image is one line and exit 2, not a turn answered without it.
"""

from __future__ import annotations

import ctypes
import functools
import os
import stat
import sys
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from configs.arg_types import finite_number, whole_number
from configs.config import ConfigError
from data_pipelines.schema import IMAGE_TOKEN

HELP = "commands: /image PATH (attach to the next turn), /reset, /quit"
MAX_PROMPT_TOKENS = 4096  # the longest conversation accepted (the demo's default too)
MAX_IMAGES = 8  # images one conversation may hold
# no tokenizer makes fewer tokens than characters / 8: a bound before tokenizing
CHARS_PER_TOKEN = 8
# decoding an image this large (16 MB of RGBX) is followed by release_freed_memory()
TRIM_PIXELS = 4_000_000


# argparse type: a whole number of `unit` >= 1, refused at start (not turn by turn)
count_of = whole_number
# argparse type: 0 decodes greedily
temperature = finite_number("a finite number", 0.0, note="(0: greedy)")


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError, TypeError):
        return None


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the operating system (glibc's
    `malloc_trim`; elsewhere nothing).

    Pillow decodes an image into 16 MB blocks. Once glibc has freed one mapped block it raises its
    mmap threshold past that size, so later decodes come from the heap arenas (one per thread), and
    freeing them keeps the pages: 10 sessions of 7000 x 7000 uploads left the demo 1.7x its starting
    size with nothing alive in them."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


_SPECIAL = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def image_file_problem(path: str) -> str | None:
    """Why `path` cannot be an image for the model (None: it can be read as one), from its stat
    and its header alone: a special file is never opened."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "no such file"
    except OSError as e:
        return e.strerror or str(e)
    if not stat.S_ISREG(st.st_mode):
        kind = next((k for test, k in _SPECIAL if test(st.st_mode)), "a special file")
        return f"{kind}, not an image file"
    try:
        # the header only: enough to know it is an image (the processor decodes it later)
        with Image.open(path):
            pass
    except UnidentifiedImageError:
        return "not an image (no image format recognises it)"
    except (OSError, Image.DecompressionBombError) as e:
        return str(e) or type(e).__name__
    return None


class Conversation:
    """The turns so far and their images, in the order their placeholders appear."""

    def __init__(
        self,
        chat,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        max_prompt_tokens: int = MAX_PROMPT_TOKENS,
        max_images: int = MAX_IMAGES,
    ):
        self.chat, self.max_new_tokens, self.temperature = chat, max_new_tokens, temperature
        self.max_prompt_tokens, self.max_images = max_prompt_tokens, max_images
        self.turns: list[dict] = []
        self.images: list[Image.Image] = []
        self.pending: list[Image.Image] = []

    def attach(self, path: str) -> str:
        # torch: imported when a conversation runs, not by `vlm --help`
        from vision.image_processor import ImageError

        if len(self.images) + len(self.pending) >= self.max_images:
            return (
                f"cannot use image {path}: this conversation holds {self.max_images} "
                "images already (the most it takes); start a new one"
            )
        problem = image_file_problem(path)
        if problem is not None:
            return f"cannot use image {path}: {problem}"
        try:
            im = self._load(path)
        except (OSError, UnidentifiedImageError, Image.DecompressionBombError, ImageError) as e:
            return f"cannot use image {path}: {e}"
        self.pending.append(im)
        return f"image {Path(path).name} attached to your next message"

    def _load(self, path: str) -> Image.Image:
        """The image as the model will see it: decoded by the model's processor (pixel limit
        checked on the header, JPEGs decoded at a reduced scale) and resized to its patch grid at
        once, so that the conversation never holds the upload's full decoded size (7000 x 7000 RGB
        is 147 MB)."""
        from vision.image_processor import choose_grid

        processor = getattr(self.chat, "processor", None)
        # a text-only model: the image is refused later, with the model's own message
        if processor is None:
            with Image.open(path) as im:
                im.load()
                return im.copy()
        img = processor.load(path, source=Path(path).name, for_patches=True)
        cfg = processor.cfg
        rows, cols = choose_grid(img.height, img.width, cfg)
        # the processor's own resize (same size, same filter), done once here; on this image it is
        # then a no-op
        small = img.resize((cols * cfg.patch_size, rows * cfg.patch_size), Image.Resampling.BICUBIC)
        large = img.width * img.height >= TRIM_PIXELS
        del img
        if large:  # the decoded pixels are freed now: give their pages back rather than keep them
            release_freed_memory()
        return small

    def prompt_problem(self, text: str) -> str | None:
        """Why `text` cannot be the next turn (the conversation would exceed max_prompt_tokens), or None."""
        if (
            len(text) > self.max_prompt_tokens * CHARS_PER_TOKEN
            or self.prompt_tokens(text) > self.max_prompt_tokens
        ):
            return (
                f"the conversation would exceed {self.max_prompt_tokens} "
                "tokens; shorten the message or start a new conversation"
            )
        return None

    def prompt(self, turns: list[dict]) -> str:
        """The conversation and the generation prompt in the model's own chat format (ours, or a CT source's)."""
        return self.chat.tokenizer.format_chat(turns, add_generation_prompt=True)

    def prompt_tokens(self, text: str) -> int:
        """Tokens of the conversation with `text` as the next user turn (the prompt `ask` will build)."""
        turns, images = self.next_turns(text)
        batch = self.chat.prompt_batch([self.prompt(turns)], [images])
        return int((batch.doc_ids >= 0).sum())

    def reset(self) -> None:
        self.turns, self.images, self.pending = [], [], []

    def next_turns(self, text: str) -> tuple[list[dict], list[Image.Image]]:
        """The turns and images of the conversation with `text` (and the pending images) as the next user turn."""
        content = IMAGE_TOKEN * len(self.pending) + ("\n" if self.pending else "") + text
        return self.turns + [{"role": "user", "content": content}], self.images + self.pending

    def ask(self, text: str, on_text=None) -> str:
        """The assistant's answer to `text` (with the pending images); `on_text(piece)` receives it as it grows."""
        from data_pipelines.chat import END

        turns, images = self.next_turns(text)
        shown = [""]

        def stream(ids: list[int]) -> None:
            now = self.chat.tokenizer.decode(ids)
            if on_text is not None and not now.endswith("\ufffd") and now.startswith(shown[0]):
                on_text(now[len(shown[0]) :])
                shown[0] = now

        answer = self.chat.generate(
            [self.prompt(turns)],
            [images],
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            stop=[END],
            on_tokens=lambda ids: stream(ids[0]),
        )[0]
        if on_text is not None and answer.startswith(shown[0]) and answer != shown[0]:
            on_text(answer[len(shown[0]) :])
        self.turns = turns + [{"role": "assistant", "content": answer}]
        self.images, self.pending = images, []
        return answer


def input_lines(stream, max_bytes: int):
    """Lines of a binary stream as (text, None), or (None, why) for a line that cannot be a turn:
    not UTF-8, or longer than `max_bytes` (the rest of such a line is read and dropped in pieces,
    never held whole)."""
    while True:
        line = stream.readline(max_bytes + 1)
        if not line:
            return
        if len(line) > max_bytes and not line.endswith(b"\n"):
            while (rest := stream.readline(1 << 16)) and not rest.endswith(b"\n"):
                pass
            yield None, f"line skipped: longer than {max_bytes} bytes"
            continue
        try:
            yield line.decode("utf-8"), None
        except UnicodeDecodeError as e:
            yield (
                None,
                f"line skipped: not UTF-8 text (byte {line[e.start]:#04x} at position {e.start})",
            )


def run_chat(
    chat,
    lines,
    out=sys.stdout,
    interactive: bool = False,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    images: list[str] = (),
    max_prompt_tokens: int = MAX_PROMPT_TOKENS,
) -> int:
    """`lines`: strings, or (text, None) / (None, why) pairs from `input_lines`."""
    from vision.image_processor import ImageError

    conv = Conversation(chat, max_new_tokens, temperature, max_prompt_tokens=max_prompt_tokens)
    for path in images:
        message = conv.attach(path)
        if message.startswith("cannot use image"):
            # asked for on the command line: a first turn answered without it would look like an
            # answer about it
            print(f"vlm chat: --image {message.removeprefix('cannot use image ')}", file=sys.stderr)
            return 2
        print(message, file=out)
    prompt = lambda: print("you> ", end="", file=out, flush=True) if interactive else None  # noqa: E731
    prompt()
    for line in lines:
        line, why = line if isinstance(line, tuple) else (line, None)
        if why is not None:
            print(f"[{why}]", file=out, flush=True)
            prompt()
            continue
        text = line.strip()
        if text in ("/quit", "/exit"):
            break
        if text.startswith("/image"):
            print(conv.attach(text[len("/image") :].strip()), file=out)
        elif text == "/reset":
            conv.reset()
            print("conversation cleared", file=out)
        elif text.startswith("/"):
            print(HELP, file=out)
        elif text:
            print("model> ", end="", file=out, flush=True)
            try:
                problem = conv.prompt_problem(text)
                if problem is not None:
                    raise ValueError(f"prompt too long: {problem}")
                conv.ask(text, on_text=lambda piece: print(piece, end="", file=out, flush=True))
            except (ImageError, ValueError) as e:
                # an image over the limits, a prompt too long, ...
                conv.pending = []
                print(f"[cannot answer: {e}]", end="", file=out)
            print(file=out, flush=True)
        prompt()
    return 0


def add_chat_command(sub) -> None:
    p = sub.add_parser(
        "chat",
        help="multi-turn image chat in the terminal (streamed answers)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--ckpt", required=True, help="exported model directory (RUN_DIR/final)")
    p.add_argument(
        "--image", action="append", default=[], metavar="PATH", help="attach to the first turn"
    )
    add_generation_options(p, max_new_tokens=64)
    p.set_defaults(func=_run)


def add_generation_options(p, max_new_tokens: int) -> None:
    """--max-new-tokens, --temperature, --max-prompt-tokens (chat and demo), each checked when parsed."""
    p.add_argument(
        "--max-new-tokens",
        type=count_of("tokens"),
        default=max_new_tokens,
        help=f"longest answer (default {max_new_tokens})",
    )
    p.add_argument(
        "--temperature",
        type=temperature,
        default=0.0,
        help="sampling temperature (default 0: greedy)",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=count_of("tokens"),
        default=MAX_PROMPT_TOKENS,
        help=f"longest conversation accepted, in tokens (default {MAX_PROMPT_TOKENS})",
    )


def _run(args) -> int:
    from vlm.generate import load_eval_model  # torch and the model load when the command runs

    if not (Path(args.ckpt) / "config.json").is_file():
        raise ConfigError(
            f"--ckpt {args.ckpt}: no exported model there (expected RUN_DIR/final with config.json)"
        )
    for path in args.image:  # before the model loads
        problem = image_file_problem(path)
        if problem is not None:
            print(f"vlm chat: --image {path}: {problem}", file=sys.stderr)
            return 2
    from vlm.model.weights_check import WeightsError

    try:
        chat = load_eval_model(args.ckpt)
    except WeightsError as e:
        print(f"vlm chat: {e}", file=sys.stderr)
        return 2
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {args.ckpt}; {HELP}")
    max_bytes = args.max_prompt_tokens * CHARS_PER_TOKEN * 4  # UTF-8: at most 4 bytes a character
    return run_chat(
        chat,
        input_lines(sys.stdin.buffer, max_bytes),
        interactive=interactive,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        images=args.image,
        max_prompt_tokens=args.max_prompt_tokens,
    )
