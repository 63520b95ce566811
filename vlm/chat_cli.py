"""`vlm chat --ckpt DIR [--image PATH ...]`: multi-turn image chat in the terminal, answers streamed token by token.

Each line is a user turn; `/image PATH` attaches an image to the next turn, `/reset` starts over, `/quit` (or end
of input) leaves. When standard input is not a terminal it reads one turn per line, prints each answer and exits
0 at the end of input. Every turn prefills the conversation once and decodes with the concept-level caches.
"""
from __future__ import annotations

import sys
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from configs.config import ConfigError
from data_pipelines.chat import END, format_chat
from data_pipelines.schema import IMAGE_TOKEN
from vision.image_processor import ImageError

HELP = "commands: /image PATH (attach to the next turn), /reset, /quit"


class Conversation:
    """The turns so far and their images, in the order their placeholders appear."""

    def __init__(self, chat, max_new_tokens: int = 64, temperature: float = 0.0):
        self.chat, self.max_new_tokens, self.temperature = chat, max_new_tokens, temperature
        self.turns: list[dict] = []
        self.images: list[Image.Image] = []
        self.pending: list[Image.Image] = []

    def attach(self, path: str) -> str:
        try:
            with Image.open(path) as im:
                im.load()
                self.pending.append(im.copy())
        except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as e:
            return f"cannot use image {path}: {e}"
        return f"image {Path(path).name} attached to your next message"

    def reset(self) -> None:
        self.turns, self.images, self.pending = [], [], []

    def next_turns(self, text: str) -> tuple[list[dict], list[Image.Image]]:
        """The turns and images of the conversation with `text` (and the pending images) as the next user turn."""
        content = IMAGE_TOKEN * len(self.pending) + ("\n" if self.pending else "") + text
        return self.turns + [{"role": "user", "content": content}], self.images + self.pending

    def ask(self, text: str, on_text=None) -> str:
        """The assistant's answer to `text` (with the pending images); `on_text(piece)` receives it as it grows."""
        turns, images = self.next_turns(text)
        shown = [""]

        def stream(ids: list[int]) -> None:
            now = self.chat.tokenizer.decode(ids)
            if on_text is not None and not now.endswith("\ufffd") and now.startswith(shown[0]):
                on_text(now[len(shown[0]):])
                shown[0] = now

        answer = self.chat.generate([format_chat(turns, add_generation_prompt=True)], [images],
                                    max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                    stop=[END], on_tokens=lambda ids: stream(ids[0]))[0]
        if on_text is not None and answer.startswith(shown[0]) and answer != shown[0]:
            on_text(answer[len(shown[0]):])
        self.turns = turns + [{"role": "assistant", "content": answer}]
        self.images, self.pending = images, []
        return answer


def run_chat(chat, lines, out=sys.stdout, interactive: bool = False, max_new_tokens: int = 64,
             temperature: float = 0.0, images: list[str] = ()) -> int:
    conv = Conversation(chat, max_new_tokens, temperature)
    for path in images:
        print(conv.attach(path), file=out)
    prompt = lambda: print("you> ", end="", file=out, flush=True) if interactive else None  # noqa: E731
    prompt()
    for line in lines:
        text = line.strip()
        if text in ("/quit", "/exit"):
            break
        if text.startswith("/image"):
            print(conv.attach(text[len("/image"):].strip()), file=out)
        elif text == "/reset":
            conv.reset()
            print("conversation cleared", file=out)
        elif text.startswith("/"):
            print(HELP, file=out)
        elif text:
            print("model> ", end="", file=out, flush=True)
            try:
                conv.ask(text, on_text=lambda piece: print(piece, end="", file=out, flush=True))
            except (ImageError, ValueError) as e:   # an image over the limits, a prompt too long, ...
                conv.pending = []
                print(f"[cannot answer: {e}]", end="", file=out)
            print(file=out, flush=True)
        prompt()
    return 0


def add_chat_command(sub) -> None:
    p = sub.add_parser("chat", help="multi-turn image chat in the terminal (streamed answers)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="exported model directory (RUN_DIR/final)")
    p.add_argument("--image", action="append", default=[], metavar="PATH", help="attach to the first turn")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.set_defaults(func=_run)


def _run(args) -> int:
    from vlm.generate import load_eval_model  # torch and the model load when the command runs

    if not (Path(args.ckpt) / "config.json").is_file():
        raise ConfigError(f"--ckpt {args.ckpt}: no exported model there (expected RUN_DIR/final with config.json)")
    chat = load_eval_model(args.ckpt)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {args.ckpt}; {HELP}")
    return run_chat(chat, sys.stdin, interactive=interactive, max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature, images=args.image)
