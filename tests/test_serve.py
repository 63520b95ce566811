"""Serving through vLLM (vlm/serve, docs/serving.md): greedy outputs through vLLM equal `vlm chat`'s
token for token (text and image prompts, batch 1 and 8, the ConceptMoE and the MoE baseline), and
`vlm serve` answers 8 concurrent `/v1/chat/completions` requests with `vlm chat`'s answers.

Legend: T tokens, E experts, G Grove groups.

vLLM lives in its own venv (`make serve-venv`, .venv-serve): the tests run it in subprocesses and
compare with the project's own generation in this process; they are skipped where that venv is
absent. One engine per test (about 25 s to start).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from rank_processes import free_port

ROOT = Path(__file__).resolve().parents[1]
SERVE_BIN = ROOT / ".venv-serve" / "bin"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (SERVE_BIN / "python").is_file(),
        reason="no serve venv (.venv-serve): `make serve-venv` installs vLLM there",
    ),
]

MAX_TOKENS = 16
QUESTIONS = [
    "What is in the image?",
    "Describe the colours.",
    "Is it a cat?",
    "Count the shapes.",
    "Where was it taken?",
    "What time is it?",
    "Name one object.",
    "Anything red?",
]


def _prompts(image: str) -> list[dict]:
    """8 prompts: images (one, two) and text, chat turns and raw text, of different lengths."""
    u = lambda text: f"<|user|>{text}<|end|><|assistant|>"  # noqa: E731
    return [
        {"prompt": u("<image>\nWhat is in the image?"), "images": [image]},
        {"prompt": u("hello there")},
        {"prompt": "<image><image> two of them", "images": [image, image]},
        {"prompt": "x"},
        {"prompt": "The quick brown fox jumps over the lazy dog. " * 3},
        {
            "prompt": u("<image>\nDescribe it in detail, every part of it, left to right."),
            "images": [image],
        },
        {"prompt": u("what is 2+2?")},
        {"prompt": "1 2 3 4 5 6 7 8 9 10 11 12"},
    ]


def _reference(final: Path, batches: list[list[dict]]) -> list[list[dict]]:
    """`vlm chat`'s model: ConceptMoEChat.generate, greedy, each batch at once."""
    from vlm.generate import load_eval_model

    chat = load_eval_model(final, device="cpu")
    out = []
    for batch in batches:
        prompts = [r["prompt"] for r in batch]
        images = [[Path(i).read_bytes() for i in r.get("images", [])] for r in batch]
        pb = chat.prompt_batch(prompts, images)
        rows: dict = {}
        chat.generate(
            prompts, images, max_new_tokens=MAX_TOKENS, on_tokens=lambda r: rows.update(r=r)
        )
        out.append(
            [
                {"token_ids": r, "prompt_token_ids": pb.input_ids[i][pb.doc_ids[i] >= 0].tolist()}
                for i, r in enumerate(rows["r"])
            ]
        )
    return out


def _through_vllm(
    final: Path, batches: list[list[dict]], tmp: Path, log: list | None = None, **engine
) -> list[list[dict]]:
    req, dst = tmp / "requests.json", tmp / "vllm_out.json"
    req.write_text(json.dumps({"max_tokens": MAX_TOKENS, "batches": batches}))
    proc = subprocess.run(
        [
            str(SERVE_BIN / "python"),
            "-m",
            "vlm.serve.offline",
            str(final),
            str(req),
            str(dst),
            json.dumps(engine),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    if log is not None:
        log.append(proc.stdout + proc.stderr)
    return json.loads(dst.read_text())["batches"]


def _assert_equal(ref: list[list[dict]], got: list[list[dict]]) -> None:
    for b, (rb, gb) in enumerate(zip(ref, got, strict=True)):
        for i, (r, g) in enumerate(zip(rb, gb, strict=True)):
            assert g["prompt_token_ids"] == r["prompt_token_ids"], f"batch {b} row {i}: prompt"
            # vlm chat stops at <eos>; vLLM ran on (ignore_eos)
            assert g["token_ids"][: len(r["token_ids"])] == r["token_ids"], f"batch {b} row {i}"


@pytest.fixture(scope="module")
def baseline_export(tmp_path_factory, tiny_vlm) -> Path:
    """The tiny VLM's MoE baseline (chunking off), exported."""
    import dataclasses

    import torch

    from vlm.model.config import ChunkConfig
    from vlm.model.hf import save_pretrained
    from vlm.model.multimodal import ConceptMoEVLM

    model, tok = tiny_vlm()
    torch.manual_seed(1)
    cfg = dataclasses.replace(model.model_cfg, chunk=ChunkConfig(enabled=False))
    out = tmp_path_factory.mktemp("baseline") / "final"
    save_pretrained(ConceptMoEVLM(cfg, model.vision_cfg), out, tokenizer=tok)
    return out


def _batches(final: Path) -> list[list[dict]]:
    p = _prompts(str(final.parent / "a.png"))
    return [[p[0]], [p[1]], p]  # batch 1 image, batch 1 text, batch 8 mixed


def test_concept_model_through_vllm_equals_vlm_chat(exported_vlm, tmp_path):
    """Greedy tokens through vLLM = ConceptMoEChat.generate's, with the concept state at half the
    token capacity and prompts longer than the batch budget (chunked prefill continues a request's
    concept state token by token)."""
    batches = _batches(exported_vlm)
    got = _through_vllm(
        exported_vlm,
        batches,
        tmp_path,
        max_model_len=256,
        concept_capacity=128,
        max_num_batched_tokens=64,
        enable_chunked_prefill=True,
    )
    _assert_equal(_reference(exported_vlm, batches), got)


def test_concept_capacity_overflow_is_counted_not_fatal(exported_vlm, tmp_path):
    """A request that closes more concepts than its slot holds: the engine keeps serving
    (the concepts past the capacity are dropped, as the model's static capacity drops
    them, and logged). The capacity asked for (16) is rounded up to what the state's page holds
    (a token block of 32 tokens' keys and values: 123 concepts of the tiny model beside its chunk
    state), so a prompt of 585 tokens overflows it."""
    p = _prompts(str(exported_vlm.parent / "a.png"))
    long = {"prompt": "The quick brown fox jumps over the lazy dog. " * 13}
    log: list = []
    got = _through_vllm(
        exported_vlm,
        [[long, p[1]]],
        tmp_path,
        log=log,
        max_model_len=1024,
        concept_capacity=16,
        block_size=32,
    )
    assert [len(r["token_ids"]) for r in got[0]] == [MAX_TOKENS, MAX_TOKENS]
    cache = json.loads((tmp_path / "vllm_out.json").read_text())["cache"]
    assert cache["block_size"] == 32 and cache["concept_capacity"] == 123
    assert "concept capacity 123 reached" in log[0]


def test_moe_baseline_through_vllm_equals_vlm_chat(baseline_export, exported_vlm, tmp_path):
    (baseline_export.parent / "a.png").write_bytes((exported_vlm.parent / "a.png").read_bytes())
    batches = _batches(baseline_export)
    got = _through_vllm(baseline_export, batches, tmp_path, max_model_len=256)
    _assert_equal(_reference(baseline_export, batches), got)


def test_concept_state_in_whole_pages_admits_more_requests_than_the_baseline(tmp_path):
    """vLLM gives every state layer one page per request, the size of a token block's page: the
    concept state is cut into whole pages (no padding, the token blocks not raised), so at equal
    cache memory vLLM admits more concurrent requests of max-model-len tokens for the ConceptMoE
    (concepts in a state sized by --concept-capacity) than for its MoE baseline (every layer's
    keys and values per token). The benchmark's models (head of 64: no head padding), at its
    capacity of 304 concepts for 512 tokens."""
    from vlm.serve.bench import build_exports

    got = {}
    for name, final in build_exports(tmp_path).items():
        capacity = 304 if name == "conceptmoe" else None
        _through_vllm(
            final, [], tmp_path, max_model_len=512, concept_capacity=capacity, cache_gib=0.25
        )
        got[name] = json.loads((tmp_path / "vllm_out.json").read_text())["cache"]
    cmoe, base = got["conceptmoe"], got["baseline"]
    assert cmoe["block_size"] == base["block_size"] == 128  # vLLM's CPU default, not raised
    assert cmoe["state_page_fill"] > 0.99 and cmoe["concept_capacity"] >= 304
    # per request: 4 token layers x 4 blocks + 12 state pages, against 8 layers x 4 blocks
    assert cmoe["max_concurrency"] > 1.1 * base["max_concurrency"]


def _post(port: int, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_vlm_serve_answers_8_concurrent_chats_as_vlm_chat(exported_vlm, tmp_path):
    """`vlm serve RUN/final` on 127.0.0.1; 8 concurrent /v1/chat/completions requests (an image as a
    data: URL and a question; two text-only) get `vlm chat`'s answers (same turns, greedy, stopped
    at <|end|>)."""
    from data_pipelines.chat import END
    from data_pipelines.schema import IMAGE_TOKEN
    from vlm.generate import load_eval_model

    png = (exported_vlm.parent / "a.png").read_bytes()
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    port = free_port()
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        [
            str(SERVE_BIN / "vlm"),
            "serve",
            str(exported_vlm),
            "--port",
            str(port),
            "--max-model-len",
            "256",
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        chat = load_eval_model(exported_vlm, device="cpu")
        with_image = [i not in (3, 6) for i in range(8)]
        stops = {chat.tokenizer.eos_id, chat.tokenizer.encode(END)[0]}
        strip = lambda ids: ids[:-1] if ids and ids[-1] in stops else ids  # noqa: E731
        expected = []
        for q, img in zip(QUESTIONS, with_image):
            rows: dict = {}
            turns = [{"role": "user", "content": (IMAGE_TOKEN + "\n" if img else "") + q}]
            prompt = chat.tokenizer.format_chat(turns, add_generation_prompt=True)
            text = chat.generate(
                [prompt],
                [[png] if img else []],
                max_new_tokens=MAX_TOKENS,
                stop=[END],
                on_tokens=lambda r: rows.update(r=r),
            )[0]
            expected.append((strip(rows["r"][0]), text))
        deadline = time.time() + 150
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except OSError:
                assert time.time() < deadline, "the server did not come up in 150 s"
                time.sleep(1)

        def ask(i: int) -> tuple[list[int], str]:
            image = [{"type": "image_url", "image_url": {"url": url}}] if with_image[i] else []
            content = image + [{"type": "text", "text": QUESTIONS[i]}]
            body = {
                "model": str(exported_vlm),
                "temperature": 0,
                "max_tokens": MAX_TOKENS,
                "messages": [{"role": "user", "content": content}],
                "return_token_ids": True,
            }
            choice = _post(port, body)["choices"][0]
            return strip(choice["token_ids"]), choice["message"]["content"]

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(8)))
        # the tokens; the texts too, where both decode the same bytes (vLLM's detokenizer drops a
        # multi-byte character cut at the end, the project's shows U+FFFD)
        assert [a[0] for a in answers] == [e[0] for e in expected]
        for (_, got), (_, want) in zip(answers, expected):
            assert got == want.rstrip("\ufffd") or want.startswith(got)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def _tree_rss(pid: int) -> int:
    """Bytes resident in process `pid` and its descendants."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            for t in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
        except OSError:  # the process ended meanwhile
            pass
    return total


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _rss_all(pid: int) -> tuple[int, int]:
    """(the API server's RSS, with its engine core and worker)."""
    return _rss(pid), _tree_rss(pid)


def _post_status(port: int, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _gradient_png(side: int) -> bytes:
    """A side x side RGB PNG that compresses well (a gradient: a few MB at 7000)."""
    import io

    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:side, 0:side]
    arr = np.stack(
        [x * 255 // (side - 1), y * 255 // (side - 1), (x + y) * 255 // (2 * side - 2)], -1
    ).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def test_vlm_serve_takes_data_images_only_bounded_and_leaves_nothing_behind(exported_vlm, tmp_path):
    """Issue 45's server items, on a running `vlm serve`: an image URL of any scheme but `data:`
    (http to a service on this machine, a redirect, file, https, ftp) is a 400 naming `data:` and
    the local service sees no request; 8 concurrent 7000 x 7000 PNGs are answered (one as `vlm chat`
    answers it) and leave the API server within 1.5x its idle memory; an image over the model's
    max_pixels is a 400; the server leaves no folder in the temp directory."""
    import tempfile
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from vlm.generate import load_eval_model

    hits: list[str] = []
    png = (exported_vlm.parent / "a.png").read_bytes()

    class Local(BaseHTTPRequestHandler):  # a service on this machine the server must not reach
        def do_GET(self):
            hits.append(self.path)
            if self.path == "/redirect":
                self.send_response(302)
                self.send_header("Location", "/secret.png")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args):
            pass

    local = HTTPServer(("127.0.0.1", 0), Local)
    threading.Thread(target=local.serve_forever, daemon=True).start()
    lp = local.server_address[1]
    temp = set(Path(tempfile.gettempdir()).glob("vlm-serve-*"))
    port = free_port()
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        [str(SERVE_BIN / "vlm"), "serve", str(exported_vlm), "--port", str(port)]
        + ["--max-model-len", "256"],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )

    def body(url: str, max_tokens: int = 4) -> dict:
        content = [{"type": "image_url", "image_url": {"url": url}}]
        content.append({"type": "text", "text": "What is in the image?"})
        return {
            "model": str(exported_vlm),
            "temperature": 0,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": content}],
            "return_token_ids": True,
        }

    try:
        big = _gradient_png(7000)
        deadline = time.time() + 150
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except OSError:
                assert time.time() < deadline, "the server did not come up in 150 s"
                time.sleep(1)
        for url in (
            f"http://127.0.0.1:{lp}/a.png",
            f"http://localhost:{lp}/a.png",
            f"http://localhost:{lp}/redirect",
            "file:///etc/hostname",
            "https://example.com/a.png",
            "ftp://example.com/a.png",
        ):
            status, text = _post_status(port, body(url))
            assert status == 400 and "data:" in text, (url, status, text[:300])
        assert hits == []
        ok, _ = _post_status(port, body("data:image/png;base64," + base64.b64encode(png).decode()))
        assert ok == 200
        time.sleep(2)
        idle, idle_all = _rss_all(server.pid)
        url = "data:image/png;base64," + base64.b64encode(big).decode()
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: _post_status(port, body(url, 8)), range(8)))
        assert [a[0] for a in answers] == [200] * 8
        time.sleep(3)
        after, after_all = _rss_all(server.pid)
        print(
            f"RSS: API server {idle / 1e6:.0f} -> {after / 1e6:.0f} MB, with its engine "
            f"{idle_all / 1e6:.0f} -> {after_all / 1e6:.0f} MB"
        )
        assert after <= 1.5 * idle, f"API server RSS {idle / 1e6:.0f} -> {after / 1e6:.0f} MB"
        assert after_all <= 1.5 * idle_all, f"with its engine {idle_all:.3g} -> {after_all:.3g} B"
        # the shrunk image is the one `vlm chat` sees: the same answer
        chat = load_eval_model(exported_vlm, device="cpu")
        prompt = chat.tokenizer.format_chat(
            [{"role": "user", "content": "<image>\nWhat is in the image?"}],
            add_generation_prompt=True,
        )
        rows: dict = {}
        chat.generate([prompt], [[big]], max_new_tokens=8, on_tokens=lambda r: rows.update(r=r))
        served = json.loads(answers[0][1])["choices"][0]["token_ids"]
        assert served[: len(rows["r"][0])] == rows["r"][0][: len(served)]
        status, text = _post_status(
            port, body("data:image/png;base64," + base64.b64encode(_gradient_png(7100)).decode())
        )
        assert status == 400 and "over the limit of 50000000" in text, text[:300]
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        local.shutdown()
    assert set(Path(tempfile.gettempdir()).glob("vlm-serve-*")) == temp


def test_vlm_chat_runs_in_the_serve_venv(exported_vlm):
    """`.venv-serve/bin/vlm chat` (transformers < 5.20 there) answers as the project's venv does."""
    turn = "hello there\n"
    got = [
        subprocess.run(
            [*cmd, "chat", "--ckpt", str(exported_vlm), "--max-new-tokens", "8"],
            input=turn,
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
        )
        for cmd in ([str(SERVE_BIN / "vlm")], [sys.executable, "-m", "vlm.cli"])
    ]
    for p in got:
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert got[0].stdout == got[1].stdout and "model>" in got[0].stdout
