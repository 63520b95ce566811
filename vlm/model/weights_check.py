"""Exported weights are checked against their config before anything loads them.

transformers' `from_pretrained` fills a tensor that the file lacks from uninitialised memory (this
model initialises itself, so its `_init_weights` does nothing), casts a wrong dtype silently (int64
weights trained at loss 6.2 million), and reports a truncated or non-safetensors file with a
traceback that does not name it. `check_exported_weights` reads only safetensors headers and tensors
(never a pickle), compares every tensor's presence, shape and dtype with the model the config
describes (built on the meta device: nothing is allocated), then reads each tensor once to check
that it is finite. The first problem becomes one line that names the file and the tensor.

Then the weight files are compared with the SHA-256 digests the export recorded in `checksums.json`
(written by `ConceptMoEForCausalLM.save_pretrained`, so by every export and `vlm convert`): damage
that leaves every value finite (flipped bytes) is caught too. A mismatch is one line naming the file
and both digests; weights edited on purpose load with `VLM_SKIP_WEIGHT_CHECKSUM=1`. An export
without `checksums.json` (written before they were recorded, or by other tools) loads as before.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from configs.config import ConfigError
from vlm.model.legacy_names import current_key

# the files that fix which text an id means: swapped for another model's, the model reads its
# prompts with ids it was not trained on (empty answers, a score of 0) though every weight is intact.
# An export records them beside its weights (`write_checksums(..., tokenizer=True)`).
TOKENIZER_FILES = (
    "tokenizer.json",
    "vlm_tokenizer.json",
    "byte_tokenizer.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CHECKSUMS = "checksums.json"
SKIP_CHECKSUM_ENV = "VLM_SKIP_WEIGHT_CHECKSUM"
SKIP_HINT = f"if the weights were edited on purpose, load them with {SKIP_CHECKSUM_ENV}=1"
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class WeightsError(ConfigError):
    """Exported weights that do not match their config (one line: the file and the first bad tensor)."""


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of an export directory (one file, or the shards its index lists)."""
    index = path / INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            raise WeightsError(
                f"{index}: not a readable safetensors index ({type(e).__name__})"
            ) from None
        files = [path / s for s in shards]
        for f in files:
            if not f.is_file() or f.resolve().parent != path.resolve():
                raise WeightsError(f"{index}: lists {f.name}, which is not a file in {path}")
        return files
    if (path / SAFETENSORS).is_file():
        return [path / SAFETENSORS]
    others = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    found = f" (found {', '.join(others)}: pickled weights are never loaded)" if others else ""
    raise WeightsError(f"{path}: no {SAFETENSORS}{found}")


def expected_tensors(config) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of every tensor an export of this `ConceptMoEConfig` must hold: the
    model cast to the dtype the export recorded (`dtype`, float32 when absent) the way the export
    was, so that what the model keeps in float32 whatever its dtype (the MoE expert bias) is
    expected in float32."""
    from vlm.model.multimodal import ConceptMoEVLM

    want = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(want, str):
        want = getattr(torch, want.removeprefix("torch."), None)
    if not isinstance(want, torch.dtype) or not want.is_floating_point:
        raise WeightsError(
            f"config dtype {getattr(config, 'dtype', None)!r} is not a floating-point torch dtype"
        )
    with torch.device("meta"):
        model = ConceptMoEVLM(*config.build_configs()).to(want)
    out = {f"vlm.{k}": (tuple(t.shape), t.dtype) for k, t in model.state_dict().items()}
    # transformers stores a tied head once, under the embedding's name
    if config.tie_word_embeddings:
        out.pop("vlm.lm.lm_head.weight", None)
    return out


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_exported_weights(path: str | Path, config, values: bool = True) -> None:
    """Raise WeightsError (one line) unless every tensor of the export at `path` is present,
    of the shape and dtype its `config` (a ConceptMoEConfig) gives, finite, and no other
    tensor is there. `values=False`: headers and checksums only (a reader of a share of the
    tensors checks the values it reads: vlm.model.share_load)."""
    from safetensors import safe_open

    path = Path(path)
    try:
        expected = expected_tensors(config)
    except WeightsError as e:
        raise WeightsError(f"{path / 'config.json'}: {e}") from None
    except (RuntimeError, ValueError, TypeError, OverflowError) as e:
        raise WeightsError(
            f"{path / 'config.json'}: describes no model that can be built ({e})"
        ) from None
    found: dict[str, Path] = {}
    headers: dict[str, tuple[tuple[int, ...], str]] = {}
    stored: dict[str, str] = {}  # today's name -> the file's (legacy_names)
    files = weight_files(path)
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for name in h.keys():
                    sl, k = h.get_slice(name), current_key(name)
                    headers[k] = (tuple(sl.get_shape()), sl.get_dtype())
                    found[k], stored[k] = f, name
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types (and OSError) for unreadable files
            raise WeightsError(f"{f}: not a readable safetensors file ({_reason(e)})") from None
    for k, (shape, dtype) in expected.items():
        if k not in headers:
            raise WeightsError(
                f"{_where(path, files)}: tensor {k} is missing "
                f"(the config needs {list(shape)} {_name(dtype)})"
            )
        got_shape, got_dtype = headers[k]
        if got_shape != shape:
            raise WeightsError(
                f"{found[k]}: tensor {k} has shape "
                f"{list(got_shape)}, the config needs {list(shape)}"
            )
        got = _DTYPES.get(got_dtype)
        if got != dtype:
            raise WeightsError(
                f"{found[k]}: tensor {k} has dtype "
                f"{_name(got) if got else got_dtype}, the config needs {_name(dtype)}"
            )
    extra = [k for k in headers if k not in expected]
    if extra:
        raise WeightsError(
            f"{found[extra[0]]}: tensor {extra[0]} is not part of the model its config describes"
            + (f" ({len(extra) - 1} more)" if len(extra) > 1 else "")
        )
    for f in files if values else []:
        try:
            with safe_open(str(f), framework="pt") as h:
                for k in expected:
                    if found.get(k) != f:
                        continue
                    t = h.get_tensor(stored[k])
                    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                        bad = int((~torch.isfinite(t)).sum())
                        raise WeightsError(
                            f"{f}: tensor {k} has {bad} non-finite "
                            f"values (NaN or inf) of {t.numel()}"
                        )
        except WeightsError:
            raise
        except Exception as e:  # noqa: BLE001
            raise WeightsError(f"{f}: not a readable safetensors file ({_reason(e)})") from None
    verify_checksums(path, files)


def sha256_file(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def write_checksums(path: str | Path, tokenizer: bool = False) -> Path | None:
    """Record the SHA-256 of the export's weight files (and its shard index) in
    `path/checksums.json`, the `files` mapping of a checkpoint's meta.json; an export without
    safetensors weights gets none (a stale one is removed). `tokenizer`: its tokenizer files too
    (TOKENIZER_FILES; what the project's exporters write, once every file is in place). Returns
    the file written."""
    path = Path(path)
    out = path / CHECKSUMS
    try:
        files = weight_files(path)
    except WeightsError:
        out.unlink(missing_ok=True)
        return None
    if (path / INDEX).is_file():
        files = [path / INDEX, *files]
    if tokenizer:
        files += [path / n for n in TOKENIZER_FILES if (path / n).is_file()]
    record = {"algorithm": "sha256", "files": {f.name: sha256_file(f) for f in files}}
    tmp = path / f".{CHECKSUMS}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, out)
    return out


def checksums_skipped() -> bool:
    return os.environ.get(SKIP_CHECKSUM_ENV, "").strip().lower() in ("1", "true", "yes")


def verify_checksums(path: str | Path, files: list[Path] | None = None) -> None:
    """Raise WeightsError (one line: the file, the recorded and the actual digest, how to skip)
    unless every weight file of the export at `path` matches `checksums.json`. Nothing to check
    without that file, or with VLM_SKIP_WEIGHT_CHECKSUM=1."""
    path = Path(path)
    record_file = path / CHECKSUMS
    if checksums_skipped() or not record_file.is_file():
        return
    try:
        record = json.loads(record_file.read_text())
        recorded = record["files"]
        if (
            record.get("algorithm", "sha256") != "sha256"
            or not isinstance(recorded, dict)
            or not all(isinstance(v, str) for v in recorded.values())
        ):
            raise ValueError('expected {"algorithm": "sha256", "files": {name: digest}}')
    except (OSError, ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise WeightsError(
            f"{record_file}: not a readable checksum file ({_reason(e)}); {SKIP_HINT}"
        ) from None
    files = weight_files(path) if files is None else files
    if (path / INDEX).is_file():
        files = [path / INDEX, *files]
    for f in files:
        if f.name not in recorded:
            raise WeightsError(
                f"{f}: not listed in {record_file} (written after the export); {SKIP_HINT}"
            )
    for name, want in recorded.items():
        f = path / name
        if not f.is_file() or f.resolve().parent != path.resolve():
            raise WeightsError(f"{f}: recorded in {record_file} but missing; {SKIP_HINT}")
        got = sha256_file(f)
        if got != want.lower() and name in TOKENIZER_FILES:
            raise WeightsError(
                f"{f}: SHA-256 is {got}, {CHECKSUMS} recorded {want} at export: the tokenizer "
                "changed since (swapped for another model's?), and the model would read text "
                f"with ids it was not trained on; {SKIP_HINT}"
            )
        if got != want.lower():
            raise WeightsError(
                f"{f}: SHA-256 is {got}, {CHECKSUMS} recorded {want} "
                f"at export (the file changed since); {SKIP_HINT}"
            )


def read_json_object(f: Path, what: str) -> dict:
    """A JSON file that must hold an object, or WeightsError naming it."""
    try:
        info = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise WeightsError(f"{f}: not a readable {what} ({_reason(e)})") from None
    if not isinstance(info, dict):
        raise WeightsError(
            f"{f}: not a readable {what} (a JSON {type(info).__name__}, not an object)"
        )
    return info


def read_config(path: Path, config_class):
    """The export's config, or WeightsError naming config.json."""
    cfg_file = path / "config.json"
    read_json_object(cfg_file, "model config")
    try:
        return config_class.from_pretrained(str(path))
    except ConfigError as e:
        raise WeightsError(f"{cfg_file}: {e}") from None
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # transformers' own checks
        raise WeightsError(f"{cfg_file}: not a readable model config ({_reason(e)})") from None


def _where(path: Path, files: list[Path]) -> Path:
    return files[0] if len(files) == 1 else path


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__
