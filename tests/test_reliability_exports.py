"""Exported models are not trusted blindly (issue 37 item 2): an export records the SHA-256 of its
weight files in `checksums.json`, every loader (from_pretrained / AutoModel, vlm chat, vlm eval vqa,
train.init_from, train.convert_from, vlm convert's source) refuses weights that no longer match in
one line naming the file and both digests and saying how to skip the check; and transformers' own
`generate` on an export stops at the end of the answer (`<|end|>`) or the eos, which its
generation_config.json states."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from vlm.model.weights_check import CHECKSUMS, SKIP_CHECKSUM_ENV, TOKENIZER_FILES, WeightsError

EMBED = "vlm.lm.embed.weight"


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _recorded(folder) -> dict[str, str]:
    """What an export records: its weights, and the tokenizer files that fix what an id means
    (issue 45: a swapped tokenizer is refused like flipped weights)."""
    names = ["model.safetensors"] + [n for n in TOKENIZER_FILES if (folder / n).is_file()]
    return {n: _sha(folder / n) for n in names}


def _flip(f, tensor: str = EMBED, nbytes: int = 4096, mask: int = 0x20) -> None:
    """XOR `nbytes` of `tensor`'s data in the safetensors file `f` with `mask` (in place): every
    value stays finite (0x20 flips one exponent bit: 2**64 times smaller or larger), as in the
    damaged final/ of the issue."""
    data = bytearray(f.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    start = 8 + n + json.loads(data[8 : 8 + n])[tensor]["data_offsets"][0]
    for i in range(start, start + nbytes):
        data[i] ^= mask
    f.write_bytes(bytes(data))


def _flipped_copy(src, dst):
    """A copy of the export `src` at `dst` whose weights had 4 KB XOR-flipped after export; (dst,
    the digest the export recorded, the digest the file has now)."""
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    want = _sha(f)
    _flip(f)
    return dst, want, _sha(f)


def _assert_one_line(msg: str, bad, want: str, got: str) -> None:
    assert str(bad / "model.safetensors") in msg and want in msg and got in msg, msg
    assert f"{SKIP_CHECKSUM_ENV}=1" in msg and "\n" not in msg, msg


def test_an_export_records_the_sha256_of_its_weight_files(exported_vlm):
    record = json.loads((exported_vlm / CHECKSUMS).read_text())
    assert record == {"algorithm": "sha256", "files": _recorded(exported_vlm)}
    assert {"tokenizer.json", "vlm_tokenizer.json"} <= set(record["files"])


def test_the_trainers_export_records_checksums_and_stop_ids(tiny_vlm, tmp_path):
    """export_final (what `vlm train` writes as RUN_DIR/final) through its ordinary path."""
    from vlm.train.export import export_final

    model, tok = tiny_vlm()
    engine = SimpleNamespace(module=model, zero_optimization_stage=lambda: 0)
    final = export_final(engine, tmp_path, tok, 1.0, True, print)
    assert json.loads((final / CHECKSUMS).read_text())["files"] == _recorded(final)
    assert json.loads((final / "generation_config.json").read_text())["eos_token_id"] == [
        tok.eos_id,
        tok.end_id,
    ]


@pytest.mark.parametrize(
    "loader",
    [
        "load_vlm",
        "AutoModelForCausalLM",
        "load_eval_model",
        "init_from",
        "convert_from",
        "convert_source",
    ],
)
def test_flipped_bytes_are_refused_by_every_loader_in_one_line(
    exported_vlm, tiny_vlm, tmp_path, loader
):
    from transformers import AutoModelForCausalLM

    from vlm.generate import load_eval_model
    from vlm.model.config import ConvertConfig
    from vlm.model.convert import load_source
    from vlm.model.hf import ConceptMoEConfig, load_vlm, save_pretrained
    from vlm.model.multimodal import ConceptMoEVLM
    from vlm.train.stages import convert_pretrained, load_pretrained_weights

    src = exported_vlm
    # `vlm convert` reads a baseline (chunking off) through load_vlm
    if loader == "convert_source":
        model, tok = tiny_vlm()
        src = save_pretrained(
            type(model)(model.model_cfg.baseline(), model.vision_cfg), tmp_path / "base", tok
        )
    bad, want, got = _flipped_copy(src, tmp_path / "final")
    calls = {
        "load_vlm": lambda: load_vlm(bad),
        "AutoModelForCausalLM": lambda: AutoModelForCausalLM.from_pretrained(str(bad)),
        "load_eval_model": lambda: load_eval_model(bad, device="cpu"),
        "init_from": lambda: load_pretrained_weights(
            ConceptMoEVLM(*ConceptMoEConfig.from_pretrained(str(exported_vlm)).build_configs()), bad
        ),
        "convert_from": lambda: convert_pretrained(
            SimpleNamespace(train=SimpleNamespace(convert_from=str(bad)))
        ),
        "convert_source": lambda: load_source(bad, ConvertConfig()),
    }
    with pytest.raises(WeightsError) as e:
        calls[loader]()
    _assert_one_line(str(e.value), bad, want, got)


def test_the_skip_variable_loads_weights_edited_on_purpose(exported_vlm, tmp_path, monkeypatch):
    """The flip leaves every value finite (the structural check passes): only the checksum catches it."""
    from vlm.model.hf import load_vlm

    bad, _, _ = _flipped_copy(exported_vlm, tmp_path / "final")
    monkeypatch.setenv(SKIP_CHECKSUM_ENV, "1")
    model = load_vlm(bad)
    w = model.lm.embed.weight
    assert bool(torch.isfinite(w).all()) and not torch.equal(
        w, load_file(exported_vlm / "model.safetensors")[EMBED]
    )
    assert torch.equal(w, load_file(bad / "model.safetensors")[EMBED])


def test_an_export_without_checksums_loads_as_before(exported_vlm, tmp_path):
    """Exports written before checksums were recorded (or by other tools) have nothing to verify."""
    from vlm.model.hf import load_vlm

    old = tmp_path / "final"
    shutil.copytree(exported_vlm, old)
    (old / CHECKSUMS).unlink()
    want = load_file(old / "model.safetensors")
    got = {f"vlm.{k}": v for k, v in load_vlm(old).state_dict().items()}
    assert all(torch.equal(got[k], v) for k, v in want.items())


@pytest.mark.parametrize(
    "content",
    ["{not json", '{"files": ["model.safetensors"]}', '{"algorithm": "md5", "files": {}}'],
)
def test_an_unreadable_checksum_file_is_refused_in_one_line(exported_vlm, tmp_path, content):
    from vlm.model.hf import load_vlm

    bad = tmp_path / "final"
    shutil.copytree(exported_vlm, bad)
    (bad / CHECKSUMS).write_text(content)
    with pytest.raises(WeightsError) as e:
        load_vlm(bad)
    msg = str(e.value)
    assert (
        msg.startswith(f"{bad / CHECKSUMS}: not a readable checksum file")
        and SKIP_CHECKSUM_ENV in msg
    )
    assert "\n" not in msg


def test_a_damaged_checkpoint_is_refused_by_init_from(tiny_vlm, tmp_path, monkeypatch):
    """train.init_from a checkpoint directory checks the checksums in its meta.json, as a resume does."""
    from configs.config import ConfigError
    from vlm.train.stages import read_model_state

    model, _ = tiny_vlm()
    ckpt = tmp_path / "checkpoints" / "step_00000002"
    (ckpt / "ds").mkdir(parents=True)
    f = ckpt / "ds" / "mp_rank_00_model_states.pt"
    torch.save({"module": model.state_dict()}, f)
    (ckpt / "meta.json").write_text(
        json.dumps({"step": 2, "files": {"ds/mp_rank_00_model_states.pt": _sha(f)}})
    )
    assert torch.equal(read_model_state(ckpt)["lm.embed.weight"], model.lm.embed.weight)
    edited = {k: v.clone() for k, v in model.state_dict().items()}
    edited["lm.embed.weight"][0, 0] += 1
    torch.save({"module": edited}, f)  # the file changed after its checkpoint was written
    with pytest.raises(ConfigError) as e:
        read_model_state(ckpt)
    msg = str(e.value)
    assert msg.startswith(
        f"train.init_from {ckpt}: a damaged checkpoint, "
        "ds/mp_rank_00_model_states.pt (checksum mismatch)"
    ), msg
    assert f"{SKIP_CHECKSUM_ENV}=1" in msg and "\n" not in msg, msg
    monkeypatch.setenv(SKIP_CHECKSUM_ENV, "1")
    assert torch.equal(read_model_state(ckpt)["lm.embed.weight"], edited["lm.embed.weight"])


def test_vlm_chat_and_eval_vqa_refuse_flipped_bytes(
    exported_vlm, tmp_path, subprocess_env, tiny_default, capsys
):
    from vlm.cli import main

    bad, want, got = _flipped_copy(exported_vlm, tmp_path / "final")
    cmd = [sys.executable, "-m", "vlm.cli", "chat", "--ckpt", str(bad), "--max-new-tokens", "4"]
    proc = subprocess.run(
        cmd, input="hello\n", capture_output=True, text=True, env=subprocess_env(), timeout=300
    )
    lines = [ln for ln in proc.stderr.splitlines() if "WARNING" not in ln and ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("vlm chat: "), (
        proc.stderr[-2000:]
    )
    _assert_one_line(lines[0], bad, want, got)
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    proc = subprocess.run(
        cmd,
        input="hello\n",
        capture_output=True,
        text=True,
        env={**subprocess_env(), SKIP_CHECKSUM_ENV: "1"},
        timeout=300,
    )
    # edited on purpose: it answers
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-2000:]

    capsys.readouterr()
    rc = main(["eval", "vqa", "--ckpt", str(bad), "--data", str(tiny_default), "--limit", "2"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("config error: ") and len(err.splitlines()) == 1, err
    _assert_one_line(err, bad, want, got)


def test_vlm_convert_writes_checksums_and_keeps_the_stop_ids(tiny_vlm, tmp_path):
    """`vlm convert` of a project baseline: the converted folder verifies (its
    config.json, rewritten after the weights, is not a weight file) and stops where the
    source's generate stops."""
    from vlm.cli import main
    from vlm.model.hf import load_vlm, save_pretrained

    vlm_model, tok = tiny_vlm()
    src = type(vlm_model)(vlm_model.model_cfg.baseline(), None).eval()
    save_pretrained(src, tmp_path / "base", tok)
    assert (
        main(
            [
                "convert",
                str(tmp_path / "base"),
                "--out",
                str(tmp_path / "ct"),
                "--encoder-layers",
                "1",
                "--decoder-layers",
                "1",
            ]
        )
        == 0
    )
    ct = tmp_path / "ct"
    assert json.loads((ct / CHECKSUMS).read_text())["files"] == _recorded(ct)
    assert json.loads((ct / "generation_config.json").read_text())["eos_token_id"] == [
        tok.eos_id,
        tok.end_id,
    ]
    load_vlm(ct)
    bad, want, got = _flipped_copy(ct, tmp_path / "ct-bad")
    with pytest.raises(WeightsError) as e:
        load_vlm(bad)
    _assert_one_line(str(e.value), bad, want, got)


# ---------------------------------------------------------------- transformers' generate stops at
# the answer's end
@pytest.fixture(scope="module")
def answering_export(tmp_path_factory, tiny_vlm):
    """The tiny VLM taught one answer ('What colour is the square?' about a red square ->
    'red<|end|>') through the transformers wrapper, exported as a run's final/ is; (final,
    tokenizer, image, prompt)."""
    from PIL import Image
    from transformers import AutoModelForCausalLM, AutoProcessor

    from vlm.model.hf import save_pretrained

    model, tok = tiny_vlm()
    root = tmp_path_factory.mktemp("answering")
    save_pretrained(model, root / "init", tokenizer=tok)
    proc = AutoProcessor.from_pretrained(root / "init")
    image = Image.new("RGB", (16, 16), (255, 0, 0))
    conv = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}],
        }
    ]
    prompt = proc.apply_chat_template(conv, add_generation_prompt=True)
    full = proc.apply_chat_template(conv + [{"role": "assistant", "content": "red"}])
    inputs = proc(images=[image], text=[full], return_tensors="pt")
    n_prompt = proc(images=[image], text=[prompt], return_tensors="pt")["input_ids"].shape[1]
    labels = inputs["input_ids"].clone()
    labels[:, :n_prompt] = -100
    hf = AutoModelForCausalLM.from_pretrained(root / "init").train()
    opt = torch.optim.Adam(hf.parameters(), lr=1e-2)
    for _ in range(60):
        loss = hf(**inputs, labels=labels, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05
    save_pretrained(hf.vlm.eval(), root / "final", tokenizer=tok)
    return root / "final", tok, image, prompt


def test_transformers_generate_stops_at_the_end_of_the_answer(answering_export):
    """AutoModelForCausalLM + AutoProcessor + model.generate with the export's own generation
    config: the answer ends at `<|end|>`, where it ran on into `<eos> objects3<|end|> left, ...`
    before the stop ids were stated."""
    from transformers import AutoModelForCausalLM, AutoProcessor

    final, tok, image, prompt = answering_export
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    proc = AutoProcessor.from_pretrained(final)
    assert model.generation_config.eos_token_id == [tok.eos_id, tok.end_id]
    inputs = proc(images=[image], text=[prompt], return_tensors="pt")
    n = inputs["input_ids"].shape[1]
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert out[0, n:].tolist() == tok.encode("red") + [tok.end_id]
    assert proc.batch_decode(out[:, n:], skip_special_tokens=True) == ["red"]
    # not vacuous: without the stop ids the same model runs on to the token limit
    free = model.generate(**inputs, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert free.shape[1] == n + 12 and free[0, n : n + 4].tolist() == out[0, n:].tolist()


def test_a_sharded_export_records_and_verifies_every_shard(tiny_vlm, tmp_path):
    from vlm.model.hf import ConceptMoEForCausalLM, hf_config_for, load_vlm

    model, _ = tiny_vlm()
    out = tmp_path / "final"
    ConceptMoEForCausalLM(hf_config_for(model), vlm=model).save_pretrained(
        out, max_shard_size="40KB"
    )
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    recorded = json.loads((out / CHECKSUMS).read_text())["files"]
    assert len(shards) > 1 and recorded == {
        n: _sha(out / n) for n in ["model.safetensors.index.json", *shards]
    }
    load_vlm(out)
    f = out / shards[-1]
    want = _sha(f)
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x01  # the last mantissa bit of the shard's last value
    f.write_bytes(bytes(data))
    with pytest.raises(WeightsError) as e:
        load_vlm(out)
    assert str(e.value).startswith(f"{f}: SHA-256 is {_sha(f)}, {CHECKSUMS} recorded {want}"), str(
        e.value
    )
