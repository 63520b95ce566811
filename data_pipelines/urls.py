"""Shard sources given as URLs that webdataset understands: `pipe:CMD`, `http(s)://...` (and
webdataset's other gopen schemes but `hf:`), and `file:PATH`.

A `file:` URL names local files (a folder, glob, brace pattern or file) and is read as a local path.
Every other URL is opened with webdataset's `gopen` and read once, front to back: a stream has no
random access, so resuming at sample k of such a shard streams past its first k samples again, and
counting one without a manifest entry streams it once (nothing is copied to disk). URL sources
expand as webdataset expands them (its `expand_urls`: `::`-separated lists, `${VAR}` from the
environment variable `WDS_VAR`, braces: `shard-{000..009}.tar`).
"""

from __future__ import annotations

import bz2
import gzip
import json
import logging
import lzma
import re
import signal
import subprocess
import tarfile
import zlib
from collections import deque
from pathlib import Path
from typing import Any, Callable
from urllib.request import url2pathname

from webdataset.gopen import Pipe, gopen, gopen_curl, gopen_schemes
from webdataset.shardlists import expand_urls

from data_pipelines.manifest import MANIFEST
from data_pipelines.schema import ShardError

log = logging.getLogger("data_pipelines")
# compressed tar streams, by their magic bytes (as tarfile's "r|*" detects them)
COMPRESSED = ((b"\x1f\x8b", gzip.open), (b"BZh", bz2.open), (b"\xfd7zXZ\x00", lzma.open))
# what reading a broken stream raises (truncated or corrupt data, a failed command)
READ_ERRORS = (tarfile.TarError, OSError, EOFError, zlib.error, lzma.LZMAError, ShardError)
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
_REFUSED = {
    "hf": "hf: URLs download from the Hugging Face hub, which nothing here does at run "
    "time; download the shards and give their local path (or serve them over http)"
}
_COMMAND_EXIT = {126: "the command cannot be executed", 127: "command not found"}
_CURL_EXIT = {
    6: "could not resolve the host",
    7: "could not connect to the server",
    22: "the server answered with an HTTP error: not found (404) or another code >= 400",
    28: "the transfer timed out",
    35: "the TLS handshake failed",
    52: "the server sent nothing",
    56: "the connection broke",
}
_WAIT_S = 10  # for a command to end once its output is closed (it gets SIGPIPE on its next write)


def url_scheme(source: Any) -> str | None:
    """The scheme of a source or shard name that is a URL webdataset opens (`file` included), else
    None: a local path (a Path object always is one)."""
    m = _SCHEME.match(source) if isinstance(source, str) else None
    scheme = m.group(1).lower() if m else None
    return (
        scheme
        if scheme == "file" or (scheme in gopen_schemes and scheme != "__default__")
        else None
    )


def is_stream_url(source: Any) -> bool:
    """A URL read as a stream through gopen: every accepted scheme but `file:`."""
    return url_scheme(source) not in (None, "file")


def file_url_path(url: str) -> str:
    """The local path a `file:` URL names: `file:/abs`, `file:///abs`, `file://localhost/abs` or
    `file:rel` (percent escapes decoded, as gopen does)."""
    rest = url[len("file:") :]
    if rest.startswith("//"):
        host, _, path = rest[2:].partition("/")
        if host not in ("", "localhost"):
            raise ShardError(
                f"{url}: a file: URL names a file on this machine; host {host!r} is not supported"
            )
        rest = "/" + path
    return url2pathname(rest)


def expand_url_pattern(pattern: str) -> list[str]:
    """A URL source -> its shard URLs in webdataset's order (its `expand_urls`), without repeats."""
    try:
        urls = expand_urls(pattern)
    except AssertionError as e:  # webdataset's ${VAR} lookup asserts that WDS_VAR is set
        raise ShardError(f"source {pattern}: {e}") from None
    for u in urls:
        if url_scheme(u) in _REFUSED:
            raise ShardError(f"shard {u}: {_REFUSED[url_scheme(u)]}")
    return list(dict.fromkeys(u for u in urls if u))


def shard_name(shard: Path | str) -> str:
    """A shard's file name (a URL's last path part): what manifests and saved loader positions name it by."""
    return shard.name if isinstance(shard, Path) else shard.rstrip("/").rsplit("/", 1)[-1]


def url_folder(url: str) -> str | None:
    """The folder of a shard URL, where its manifest.json would be; None for `pipe:` (a command has none)."""
    if url_scheme(url) == "pipe" or "/" not in url:
        return None
    return url.rsplit("/", 1)[0]


def fetch_manifest(folder: str) -> dict | None:
    """FOLDER/manifest.json fetched with gopen, or None when there is none (or it is not a manifest)."""
    url = f"{folder}/{MANIFEST}"
    try:
        with UrlStream(url) as s:
            # to the end: the exit status
            data = json.loads(b"".join(iter(lambda: s.read(1 << 16), b"")))
    except (*READ_ERRORS, ValueError) as e:  # a 404 (no manifest), or a page that is no JSON
        log.info("no manifest at %s (%s); shards under it are counted by streaming them", url, e)
        return None
    if not isinstance(data, dict) or not isinstance(data.get("shards"), list):
        log.warning(
            "%s is not a shard manifest (an object with a 'shards' list); it is not used", url
        )
        return None
    # entries this reader can use; a shard without one is counted by streaming it
    data["shards"] = [
        e
        for e in data["shards"]
        if isinstance(e, dict)
        and isinstance(e.get("name"), str)
        and isinstance(e.get("count"), int)
        and e["count"] >= 0
    ]
    return data


class _Joined:
    """Bytes already read (to see the compression) followed by the rest of a stream, as one read()."""

    def __init__(self, head: bytes, read: Callable[[int], bytes]):
        self._head, self._read = head, read

    def read(self, n: int = -1) -> bytes:
        if not self._head:
            return self._read(n)
        if n < 0:
            data, self._head = self._head + self._read(-1), b""
        else:
            data, self._head = self._head[:n], self._head[n:]
        return data


class UrlStream:
    """One URL opened with webdataset's `gopen`, as a forward-only stream of
    its bytes (decompressed).

    Decompressed here (gzip, bzip2, xz, by magic bytes) rather than by tarfile's "r|*", so that the
    last bytes read stay at hand: tarfile ends silently at a truncated or corrupt header and the
    reader looks at the block where it stopped (`block_at`), which a stream cannot seek back to.
    When the output of a `pipe:` command (or of curl, for http) ends and the command failed, reading
    raises ShardError naming the URL and the exit status. A stream closed before its end stops its
    command (SIGPIPE, as with webdataset).
    """

    # tarfile reads at most one record past the header block it looks at
    KEEP = 4 * tarfile.RECORDSIZE

    def __init__(self, url: str):
        self.url, self.pos = url, 0
        self._tail: deque[bytes] = deque()
        self._held, self._ended, self._closed = 0, False, False
        try:
            self._src = gopen(url, "rb")
        except (OSError, ValueError) as e:  # curl not installed, WDS_SECURE refusing pipe:, ...
            raise ShardError(f"shard {url} cannot be opened: {type(e).__name__}: {e}") from None
        # Pipe.read raises a bare IOError when it happens to see the command's exit; read its stdout
        # instead and report the exit status ourselves, with the URL
        self._raw = self._src.stream if isinstance(self._src, Pipe) else self._src
        try:
            head = self._read_raw(6)
            opener = next((o for m, o in COMPRESSED if head.startswith(m)), None)
            joined = _Joined(head, self._read_raw)
            self._data = opener(joined, "rb") if opener else joined
            # read1: what was decompressed before a truncated stream's end comes out before
            # its EOFError
            self._read_data = self._data.read1 if opener else self._data.read
        except BaseException:
            self.close()
            raise

    def _read_raw(self, n: int) -> bytes:
        if self._ended:
            return b""
        data = self._raw.read(n)
        if not data:
            self._ended = True
            status, killed = self._stop()
            if not killed and isinstance(self._src, Pipe) and status not in self._src.ignore_status:
                raise ShardError(f"shard {self.url} cannot be read: {self._why(status)}")
        return data

    def _stop(self) -> tuple[int | None, bool]:
        """Close the output and wait for the command: (its exit status, whether it had to be killed)."""
        if not isinstance(self._src, Pipe):
            self._src.close()
            return None, False
        self._src.stream.close()
        proc, killed = self._src.proc, False
        try:
            proc.wait(timeout=_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            killed = True
        self._src.status = proc.returncode
        return proc.returncode, killed

    def _why(self, status: int) -> str:
        if status < 0:
            return f"its command was killed by signal {-status}"
        scheme = url_scheme(self.url)
        if scheme == "pipe":
            what, known = f"the command `{self.url[5:]}`", _COMMAND_EXIT.get(status)
        elif gopen_schemes.get(scheme) is gopen_curl:
            what, known = "curl", _CURL_EXIT.get(status)
        else:
            what, known = "its reader command", None
        return f"{what} exited with status {status}" + (f" ({known})" if known else "")

    def read(self, n: int = -1) -> bytes:
        data = self._read_data(n)
        if data:
            self.pos += len(data)
            self._tail.append(data)
            self._held += len(data)
            while self._held - len(self._tail[0]) >= self.KEEP:
                self._held -= len(self._tail.popleft())
        return data

    def block_at(self, offset: int) -> bytes:
        """Up to one tar block of the stream at `offset`, a position tarfile has just read past
        (reading on as far as the block needs; a read error ends it there)."""
        try:
            while self.pos < offset + tarfile.BLOCKSIZE and self.read(tarfile.BLOCKSIZE):
                pass
        except READ_ERRORS:
            pass
        start = offset - (self.pos - self._held)
        if start < 0:
            raise RuntimeError(
                f"{self.url}: tar offset {offset} is no longer held (stream at {self.pos})"
            )
        return b"".join(self._tail)[start : start + tarfile.BLOCKSIZE]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._ended:
            return
        status, killed = self._stop()
        if (
            isinstance(self._src, Pipe)
            and not killed
            and status not in (*self._src.ignore_status, -signal.SIGPIPE)
        ):
            # every sample read was whole; the command failed on its own before we stopped reading
            log.warning("shard %s: %s", self.url, self._why(status))

    def __enter__(self) -> "UrlStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = [
    "COMPRESSED",
    "READ_ERRORS",
    "UrlStream",
    "url_scheme",
    "is_stream_url",
    "file_url_path",
    "expand_url_pattern",
    "shard_name",
    "url_folder",
    "fetch_manifest",
]
