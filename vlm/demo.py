"""`vlm demo --ckpt DIR [--host 127.0.0.1] [--port 7860]`: image chat in the browser (gradio),
answers streamed.

Legend: B rows, T tokens.

Upload an image, ask about it over several turns; beside the answer the demo shows what makes
ConceptMoE different: the image with its merged patches outlined by concept, the conversation text
with its concept boundaries marked (`|`), and the realized compression (tokens per concept) of text
and image so far.

Safe by default: it binds 127.0.0.1 (pass `--host 0.0.0.0` to expose it), uploads are capped in
bytes (`--max-upload-mb`, enforced by gradio's max_file_size and again here) and in pixels (the
processor's `max_pixels`, read from the header before decoding), and a broken image, a file that is
no image or an over-long prompt gives a message in the page, never a traceback. Memory is bounded
per session: an image is shrunk to the patch grid the model sees when it is attached
(`Conversation.attach`, which hands the decode buffers back to the OS), a conversation holds at most
`--max-images` of them, and a session's conversation is dropped when its page closes or after
`SESSION_TTL_S` (gradio's State lifetime). A busy port is one line before the model loads. Needs the
optional extra: `pip install -e ".[demo]"`.

A screenshot of the page with headless Chromium, while the demo runs:

    chromium --headless --no-sandbox --screenshot=demo.png --window-size=1280,900 http://127.0.0.1:7860
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import socket
import sys
import threading
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from configs.arg_types import finite_number, whole_number
from configs.config import ConfigError
from data_pipelines.schema import IMAGE_TOKEN
from vlm.chat_cli import MAX_IMAGES, Conversation, add_generation_options, count_of

log = logging.getLogger(__name__)

DEFAULT_PORT = 7860
MAX_UPLOAD_MB = 10
TITLE = "ConceptMoE image chat"
# a session's conversation (and its images) is dropped an hour after its last use
SESSION_TTL_S = 3600


port_number = whole_number(low=1, high=65535, what="a port number")  # argparse type: a TCP port
# argparse type: the largest upload
upload_mb = finite_number("a size in MB", 0.0, strict=True)


def port_problem(host: str, port: int) -> str | None:
    """Why the demo cannot listen on host:port (one line naming the port and how to pick another),
    or None. Bound as gradio binds (SO_REUSEADDR), so a port it would take is never refused here."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
    except OSError as e:  # socket.gaierror (an unknown host) is an OSError too
        if e.errno == errno.EADDRINUSE:
            return (
                f"port {port} on {host} is in use (another server?); choose another with --port N"
            )
        return f"cannot serve on {host}:{port}: {e.strerror or e}; choose another --host or --port"
    return None


def check_image(path: str, max_bytes: int, max_pixels: int) -> str | None:
    """Why the uploaded file at `path` cannot be used (one line), or None when it is a readable
    image within the byte and pixel limits. The size comes from the header: nothing is decoded
    before the check."""
    name = Path(path).name
    try:
        size = os.path.getsize(path)
    except OSError as e:
        return f"cannot read {name}: {e.strerror or e}"
    if size > max_bytes:
        return f"{name} is {size / 1e6:.1f} MB, over the {max_bytes / 1e6:.0f} MB upload limit"
    try:
        with Image.open(path) as im:
            w, h = im.size
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError, ValueError):
        return f"{name} is not an image that can be read"
    if w * h > max_pixels:
        return f"{name} is {w}x{h} = {w * h} pixels, over the limit of {max_pixels}"
    return None


class Session:
    """One browser session: its conversation and the chat history as shown."""

    def __init__(self, conv: Conversation):
        self.conv, self.history = conv, _history_of(conv)


def _history_of(conv: Conversation) -> list[dict]:
    return [
        {
            "role": t["role"],
            "content": t["content"].replace(IMAGE_TOKEN, "[image] ").replace("] \n", "] "),
        }
        for t in conv.turns
    ]


def _stream_answer(conv: Conversation, text: str):
    """Yields the pieces of the answer to `text` as `conv.ask` produces them (it runs in a worker
    thread); re-raises its error at the end."""
    pieces: queue.Queue = queue.Queue()
    failed: list[BaseException] = []

    def work() -> None:
        try:
            conv.ask(text, on_text=pieces.put)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread below
            failed.append(e)
        finally:
            pieces.put(None)

    worker = threading.Thread(target=work, name="vlm-demo-answer", daemon=True)
    worker.start()
    while (piece := pieces.get()) is not None:
        yield piece
    worker.join()
    if failed:
        raise failed[0]


def target_band(chunk, modality: str) -> dict:
    """What training held this conversation's `modality` tokens to (the ratio groups of
    ChunkModule.ratio_groups): the target ratio, whether it is the modality's own or joint over text
    and image, and, where the per-document band applies (`ChunkConfig.holds_documents`), the band
    [R/s, R*s] a document's ratio was held in (the conversation is one document). A modality left
    out of `modality_target_ratios` had no target."""
    targets = chunk.modality_targets()
    if targets:
        R, scope = targets.get(modality), modality
    else:
        R, scope = chunk.target_ratio, "text and image together"
    if R is None:
        return {"target": None}
    out = {"target": R, "target_of": scope}
    if chunk.holds_documents:
        out["band"] = [round(R / chunk.document_slack, 3), round(R * chunk.document_slack, 3)]
    return out


def concept_panel(chat, turns: list[dict], images: list) -> tuple:
    """(picture of the first image with its concepts outlined or None, the conversation text
    with concept boundaries marked, per-modality compression) of the whole conversation,
    from one prefill."""
    from vision.image_processor import ImageProcessor
    from vlm.model.stats import summarize
    from vlm.train.render import image_concept_picture, text_with_boundaries

    batch = chat.prompt_batch([chat.tokenizer.format_chat(turns)], [images])
    out, _ = chat.model.prefill(batch, max_new_tokens=0)
    if out.chunks is None:
        return None, "(this model has no chunk module)", {}
    b_BT = out.chunks.b_BT
    stats = summarize(out, batch)
    chunk = chat.model.model_cfg.chunk
    compression = {}
    for m in ("text", "image"):
        tokens = int(stats.get(f"tokens/{m}", 0))
        concepts = int(stats.get(f"boundaries/{m}", 0))
        compression[m] = {
            "tokens": tokens,
            "concepts": concepts,
            "compression": round(tokens / concepts, 3) if concepts else None,
            **target_band(chunk, m),
        }
    picture = None
    if chat.processor is not None and images:
        cfg = chat.processor.cfg
        picture = image_concept_picture(
            batch, b_BT, cfg.patch_size, cfg.merge, ImageProcessor(cfg).denormalize
        )
    text = text_with_boundaries(
        batch, b_BT, lambda ids: chat.tokenizer.decode(ids, skip_special=False), max_tokens=4096
    )
    return picture, text, compression


def build_app(
    chat,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    max_prompt_tokens: int = 4096,
    max_upload_mb: float = MAX_UPLOAD_MB,
    example: tuple[str, list[str]] | None = None,
    max_images: int = MAX_IMAGES,
):
    """The gradio Blocks of the demo around a loaded `ConceptMoEChat` (launch it with
    `launch_app`). `example` = (image path, questions): every page opens on that conversation,
    answered once here."""
    import gradio as gr

    from vision.image_processor import ImageError

    max_bytes = int(max_upload_mb * 1e6)
    max_pixels = (
        chat.processor.cfg.max_pixels if chat.processor is not None else Image.MAX_IMAGE_PIXELS
    )

    def new_conversation() -> Conversation:
        return Conversation(
            chat,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            max_prompt_tokens=max_prompt_tokens,
            max_images=max_images,
        )

    def respond(message, upload, session):
        """Streams (chat history, session, picture, text, compression, status, message box, upload)."""
        session = session if session is not None else Session(new_conversation())
        conv, history = session.conv, session.history
        text = (message or "").strip()
        keep = (gr.skip(), gr.skip(), gr.skip())

        def say(status):  # a message under the chat; the upload box is emptied, the message kept
            return (list(history), session) + keep + (status, gr.skip(), None)

        if upload:
            path = (
                upload
                if isinstance(upload, str)
                else getattr(upload, "path", None) or upload.get("path")
            )
            problem = check_image(path, max_bytes, max_pixels)
            if problem is None:
                note = conv.attach(path)
                problem = note if note.startswith("cannot") else None
            if problem is not None:
                yield say(f"**Image not used:** {problem}")
                return
        if not text:
            yield say(
                "Image attached: ask something about it." if upload else "Type a message first."
            )
            return
        try:
            if conv.prompt_problem(text) is not None:
                conv.pending = []
                yield say(
                    f"**Prompt too long:** the conversation would exceed {max_prompt_tokens} "
                    "tokens; shorten the message or press *New conversation*."
                )
                return
            n = conv.prompt_tokens(text)
            shown = ("[image] " * len(conv.pending)) + text
            history.append({"role": "user", "content": shown})
            history.append({"role": "assistant", "content": ""})
            yield (list(history), session) + keep + (f"answering ({n} prompt tokens) ...", "", None)
            answer = ""
            for piece in _stream_answer(conv, text):
                answer += piece
                history[-1] = {"role": "assistant", "content": answer}
                yield (list(history), session) + keep + (gr.skip(), gr.skip(), gr.skip())
            picture, boundaries, compression = concept_panel(chat, conv.turns, conv.images)
        except (ImageError, ValueError) as e:
            # an image over the limits, a prompt the model cannot take, ...
            failed = f"**Cannot answer:** {e}"
        except Exception as e:  # the page shows one line, the server log has the traceback
            log.exception("demo: answering failed")
            failed = f"**Internal error:** {type(e).__name__}: {e}"
        else:
            yield (
                list(history),
                session,
                picture,
                boundaries,
                compression,
                "",
                gr.skip(),
                gr.skip(),
            )
            return
        conv.pending = []
        session.history = history = _history_of(conv)  # back to the turns that were answered
        yield say(failed)

    def reset(session):
        if session is not None:
            session.conv.reset()
        return [], None, None, "", {}, "Conversation cleared.", "", None

    opening = None
    if example is not None:
        image, questions = example
        problem = check_image(image, max_bytes, max_pixels)
        if problem is not None:
            raise ImageError(f"--example: {problem}")
        conv = new_conversation()
        conv.attach(image)
        for q in questions:
            conv.ask(q)
        opening = (conv.turns, conv.images, concept_panel(chat, conv.turns, conv.images))

    def end_session(session) -> None:
        """The page closed (or the session expired): its conversation's images go now, not when
        gradio's state holder is next swept."""
        if session is not None:
            session.conv.reset()
            session.history = []

    def load_example(session):
        """Each page gets its own copy of the example conversation (the answers were generated once)."""
        turns, images, (picture, text, compression) = opening
        conv = new_conversation()
        conv.turns, conv.images = list(turns), list(images)
        session = Session(conv)
        return list(session.history), session, picture, text, compression, "", "", None

    # uploads are copied into gradio's cache folder: files older than the session lifetime
    # are deleted
    with gr.Blocks(
        title=TITLE,
        analytics_enabled=False,  # nothing leaves the machine
        delete_cache=(SESSION_TTL_S // 4, SESSION_TTL_S),
    ) as app:
        gr.Markdown(
            f"## {TITLE}\nUpload an image and ask about it; the right "
            "side shows how the model groups image patches and text "
            "tokens into concepts (tokens per concept = compression)."
        )
        state = gr.State(None, time_to_live=SESSION_TTL_S, delete_callback=end_session)
        with gr.Row():
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(label="conversation", height=420)
                # no file_types: gradio would refuse another file with a traceback in the console
                # and a bare "Error" in the page; check_image refuses it in one line under the
                # chat instead
                upload = gr.File(
                    label=f"image (attached to your next message; max {max_upload_mb:g} MB)",
                    type="filepath",
                )
                msg = gr.Textbox(
                    label="message",
                    placeholder="Ask about the image, then press Enter",
                    max_lines=6,
                )
                with gr.Row():
                    send = gr.Button("Send", variant="primary")
                    clear = gr.Button("New conversation")
                status = gr.Markdown("")
            with gr.Column(scale=2):
                picture = gr.Image(
                    label="image concepts (merged patches outlined by concept)",
                    type="numpy",
                    interactive=False,
                )
                compression = gr.JSON(
                    label="compression of this conversation (tokens per concept), "
                    "with the target and the band training held each document in"
                )
                boundaries = gr.Textbox(
                    label="conversation with concept boundaries (|)", lines=10, interactive=False
                )
        outputs = [chatbot, state, picture, boundaries, compression, status, msg, upload]
        inputs = [msg, upload, state]
        msg.submit(respond, inputs, outputs, api_visibility="private", concurrency_id="model")
        send.click(respond, inputs, outputs, api_name="chat", concurrency_id="model")
        clear.click(reset, [state], outputs, api_name="reset")
        if opening is not None:
            app.load(load_example, [state], outputs, api_name="example")
    return app


def launch_app(
    app,
    host: str = "127.0.0.1",
    port: int | None = DEFAULT_PORT,
    max_upload_mb: float = MAX_UPLOAD_MB,
    block: bool = True,
):
    """Serve `app` (one answer at a time: the model is shared); `block=False` returns once it listens."""
    app.queue(default_concurrency_limit=1)
    return app.launch(
        server_name=host,
        server_port=port,
        max_file_size=f"{int(max_upload_mb * 1e6)}b",
        share=False,
        show_error=False,
        prevent_thread_lock=not block,
        quiet=not block,
    )


def add_demo_command(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="image chat in the browser (gradio) with the concept view",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--ckpt", required=True, help="exported model directory (RUN_DIR/final)")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    p.add_argument(
        "--port",
        type=port_number,
        default=DEFAULT_PORT,
        help=f"port to serve on (default {DEFAULT_PORT})",
    )
    add_generation_options(p, max_new_tokens=128)
    p.add_argument(
        "--max-upload-mb", type=upload_mb, default=MAX_UPLOAD_MB, help="largest image upload"
    )
    p.add_argument(
        "--max-images",
        type=count_of("images"),
        default=MAX_IMAGES,
        help="most images one conversation holds",
    )
    p.add_argument(
        "--example",
        nargs="+",
        metavar=("IMAGE", "QUESTION"),
        help="open every page on this image and the model's answers to these questions",
    )
    p.set_defaults(func=_run)


def _run(args) -> int:
    if not (Path(args.ckpt) / "config.json").is_file():
        raise ConfigError(
            f"--ckpt {args.ckpt}: no exported model there (expected RUN_DIR/final with config.json)"
        )
    try:
        import gradio  # noqa: F401  (the optional `demo` extra)
    except ImportError:
        raise ConfigError('vlm demo needs gradio: pip install -e ".[demo]"') from None
    from vlm.generate import load_eval_model  # torch and the model load when the command runs

    if args.example and len(args.example) < 2:
        raise ConfigError(
            "--example needs an image and at least one question: --example IMAGE QUESTION ..."
        )
    from vlm.chat_cli import image_file_problem

    if args.example and (problem := image_file_problem(args.example[0])) is not None:
        raise ConfigError(f"--example: image {args.example[0]}: {problem}")
    from vision.image_processor import ImageError
    from vlm.model.weights_check import WeightsError

    if (problem := port_problem(args.host, args.port)) is not None:  # before the model loads
        print(f"vlm demo: {problem}", file=sys.stderr)
        return 2
    try:
        chat = load_eval_model(args.ckpt)
    except WeightsError as e:
        print(f"vlm demo: {e}", file=sys.stderr)
        return 2
    example = (args.example[0], args.example[1:]) if args.example else None
    try:
        app = build_app(
            chat,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            max_prompt_tokens=args.max_prompt_tokens,
            max_upload_mb=args.max_upload_mb,
            example=example,
            max_images=args.max_images,
        )
    except ImageError as e:
        raise ConfigError(str(e)) from None
    print(f"serving {args.ckpt} on http://{args.host}:{args.port} (Ctrl-C stops)")
    try:
        launch_app(app, args.host, args.port, args.max_upload_mb)
    except OSError as e:
        # the port was taken since the check (gradio's own message names its settings, not ours)
        print(
            f"vlm demo: {port_problem(args.host, args.port) or f'cannot serve: {e}'}",
            file=sys.stderr,
        )
        return 2
    return 0
