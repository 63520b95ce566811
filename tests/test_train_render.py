"""Dashboard pictures: concept outlines over merged image patches, '|' at text concept boundaries, report.png."""

from __future__ import annotations

import numpy as np
import torch

from configs.batch import IMAGE, TEXT, PackedBatch
from vlm.train.render import concept_ids, render_image_concepts, text_with_boundaries


def test_concept_ids_follow_the_boundary_convention():
    # a boundary closes a concept: tokens 0-1 | 2 | 3-4
    b = torch.tensor([[0, 1, 1, 0, 1]], dtype=torch.bool)
    assert concept_ids(b).tolist() == [[0, 0, 1, 2, 2]]


def test_outlines_only_between_different_concepts():
    # black image, 2x2 merged grid of 10px cells
    pixels = np.zeros((20, 20, 3), dtype=np.uint8)
    # top row one concept
    out = render_image_concepts(pixels, np.array([0, 0, 1, 1]), (2, 2), scale=4)
    assert out.shape == (80, 80, 3)
    white = (out == 255).all(-1)
    assert white[40, 10:30].all(), "no outline between the two concepts (rows)"
    assert not white[10:30, 40].any(), "outline inside one concept (columns of the top row)"
    # cells of different concepts get different tints
    assert not np.array_equal(out[20, 20], out[60, 20])
    assert np.array_equal(out[20, 20], out[20, 60])


def test_text_with_boundaries_marks_concepts_and_collapses_images():
    ids = torch.tensor([[ord("a"), ord("b"), 300, 300, 300, ord("c"), ord("d"), 0]])
    mod = torch.tensor([[TEXT, TEXT, IMAGE, IMAGE, IMAGE, TEXT, TEXT, TEXT]])
    doc = torch.tensor([[0, 0, 0, 0, 0, 0, 0, -1]])
    batch = PackedBatch(ids, ids, doc, torch.arange(8)[None], mod)
    b = torch.tensor([[0, 1, 0, 1, 1, 0, 1, 0]], dtype=torch.bool)
    text = text_with_boundaries(batch, b, lambda xs: "".join(chr(x) for x in xs))
    assert text == "ab|[2 image tokens]|[1 image tokens]|cd|"


def test_report_png_and_summary(tmp_path):
    from vlm.train.report import summary_lines, write_report

    recs = [
        {
            "step": s,
            "loss/lm": 5 - s * 0.1,
            "loss/text_only": 5 - s * 0.05,
            "loss/image_text": 4.8 - s * 0.1,
            "compression/ratio": 2 + 0.01 * s,
            "compression/text": 2.1,
            "compression/image": 3.0 + 0.1 * s,
            "boundary_p/all": 0.5,
            "boundary_p/text": 0.48,
            "boundary_p/image": 0.3,
            "tokens_per_s": 1000.0,
        }
        for s in range(1, 21)
    ]
    recs[-1]["val/loss/lm"] = 3.1
    # the last step's per-document figures: chat prompts unmerged, captions merged whole (no concept
    # on the image)
    recs[-1].update(
        {
            "doc_ratio/chat/text/p10": 1.0,
            "doc_ratio/chat/text/p50": 1.03,
            "doc_ratio/chat/text/p90": 1.2,
            "doc_ratio/chat/text/docs": 8,
            "doc_ratio/chat/text/no_concept": 0.0,
            "doc_ratio/caption/image/p10": 12.0,
            "doc_ratio/caption/image/p50": None,
            "doc_ratio/caption/image/p90": None,
            "doc_ratio/caption/image/docs": 9,
            "doc_ratio/caption/image/no_concept": 0.8,
        }
    )
    out = write_report(recs, tmp_path / "report.png", {"ratio": 2.0})
    assert out.read_bytes()[:4] == b"\x89PNG"
    held = {
        "chat": {
            "image": {
                "p10": 1.0,
                "p50": 1.03,
                "p90": 1.1,
                "aggregate": 1.03,
                "docs": 200,
                "no_concept": 0,
            }
        }
    }
    vqa = {
        "n": 10,
        "split": "test",
        "accuracy": {"colour": 80.0, "all": 70.0},
        "majority_baseline": {"colour": 20.0, "all": 40.0},
        "blind_baseline": {"colour": 15.0, "all": 35.0},
        "held_out_compression": held,
        "prompt_compression": held["chat"],
    }
    text = "\n".join(
        summary_lines(recs, {"ratio": 2.0}, vqa, tmp_path, 60.0, 0, {"corrupt_image": 2})
    )
    assert (
        "  colour        80.0      20.0    15.0" in text
        and "  all           70.0      40.0    35.0" in text
    )
    # the aggregate is never shown alone: the per-kind distribution stands under it
    assert "image  batch aggregate N/M = 4.95" in text
    assert "chat        text          8    1.00    1.03    1.20" in text
    assert "caption     image         9   12.00     inf     inf" in text and "80%" in text
    assert "vqa prompt  image       200    1.00    1.03    1.10      1.03" in text
    assert "held-out LM loss:   3.100" in text and "corrupt_image=2" in text
