"""`vlm eval ppl`: held-out loss and bits per byte of an exported model."""

import math

from eval.perplexity import perplexity
from vlm.generate import load_eval_model


def test_ppl_reports_loss_and_bits_per_byte_per_kind(exported_vlm, tiny_default):
    chat = load_eval_model(exported_vlm, device="cpu")
    res = perplexity(
        chat, [str(tiny_default / "val")], str(tiny_default), max_batches=8, row_tokens=256
    )
    assert res["batches"] >= 1 and res["loss/lm"] > 0
    assert res["loss/text_only"] > 0 and res["loss/image_text"] > 0
    # byte tokenizer: every predicted text token is one byte or a 0-byte special (eos)
    assert 1.0 <= res["bpb/text"] / (res["loss/text_only"] / math.log(2)) < 1.5


def test_vlm_eval_ppl_command(exported_vlm, tiny_default, tmp_path, capsys):
    from vlm.cli import main

    out = tmp_path / "ppl.json"
    assert (
        main(
            [
                "eval",
                "ppl",
                "--ckpt",
                str(exported_vlm),
                "--data",
                str(tiny_default / "val"),
                "--max-batches",
                "2",
                "--row-tokens",
                "256",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "bits per byte" in capsys.readouterr().out and out.is_file()
