"""The transformers processor of an exported model: AutoTokenizer / AutoProcessor, the
chat template, and the standard `apply_chat_template` -> `processor(...)` -> `generate`
-> `batch_decode` path."""

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForCausalLM, AutoProcessor, AutoTokenizer

import vlm.model.hf  # noqa: F401  (registers the Auto classes)
from data_pipelines.chat import format_chat
from vlm.generate import ConceptMoEChat


def picture(seed, size=(16, 24)):
    return Image.fromarray(
        np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    )


@pytest.fixture(scope="module")
def proc(exported_vlm):
    return AutoProcessor.from_pretrained(exported_vlm)


@pytest.fixture(scope="module")
def ours(exported_vlm):
    from vlm.generate import load_eval_model

    return load_eval_model(exported_vlm, device="cpu")


def test_auto_classes_load_the_processor_and_the_tokenizer_with_the_chat_template(
    exported_vlm, proc
):
    assert type(proc).__name__ == "ConceptMoEProcessor"
    assert type(proc.image_processor).__name__ == "ConceptMoEImageProcessor"
    tok = AutoTokenizer.from_pretrained(exported_vlm)
    assert tok.chat_template and tok.padding_side == "left"
    turns = [{"role": "user", "content": "hi"}]
    rendered = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert rendered == format_chat(turns, True)


def test_chat_template_renders_content_lists_as_the_trainer_formats_chats(proc):
    """`{"type": "image"}` then text is the trained `<image>\\n<question>`; string contents work too."""
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
        {"role": "user", "content": "And the shape?"},
    ]
    trained = [
        {"role": "user", "content": "<image>\nWhat colour?"},
        {"role": "assistant", "content": "red"},
        {"role": "user", "content": "And the shape?"},
    ]
    assert proc.apply_chat_template(messages, add_generation_prompt=True) == format_chat(
        trained, True
    )
    assert proc.apply_chat_template(messages[:2]) == format_chat(trained[:2])


def test_a_system_message_opens_the_next_user_turn(proc):
    messages = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Colour?"},
    ]
    assert (
        proc.apply_chat_template(messages, add_generation_prompt=True)
        == "<|user|>Answer in one word.\nColour?<|end|><|assistant|>"
    )


def test_processor_builds_the_same_prompt_as_the_project(proc, ours):
    text = proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q?"}]}],
        add_generation_prompt=True,
    )
    img = picture(1)
    inputs = proc(images=[img], text=[text], return_tensors="pt")
    batch = ours.prompt_batch([text], [[img]])
    n = int((batch.doc_ids >= 0).sum())
    assert inputs["input_ids"][0].tolist() == batch.input_ids[0, :n].tolist()
    assert torch.equal(inputs["pixel_patches"], batch.pixel_patches)
    assert torch.equal(inputs["image_grids"], batch.image_grids)


def test_generate_on_processor_inputs_gives_the_projects_answers(exported_vlm, proc, ours):
    """A left-padded batch of two prompts with different image sizes, through AutoModelForCausalLM.generate."""
    model = AutoModelForCausalLM.from_pretrained(exported_vlm).eval()
    convs = [
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}],
        [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "compare"},
                    {"type": "image"},
                    {"type": "image"},
                ],
            },
        ],
    ]
    texts = [proc.apply_chat_template(c, add_generation_prompt=True) for c in convs]
    images = [[picture(2)], [picture(3, (32, 16)), picture(4)]]
    inputs = proc(images=images, text=texts, return_tensors="pt")
    assert inputs["attention_mask"][0, 0] == 0  # the shorter row is padded on the left
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    answers = proc.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answers == ours.generate(texts, images, max_new_tokens=6)


def test_image_count_must_match_the_placeholders(proc):
    with pytest.raises(ValueError, match="1 <image> placeholder"):
        proc(images=[picture(1), picture(2)], text=["<image> one"], return_tensors="pt")


def test_a_text_only_export_gets_a_tokenizer_with_the_template(tmp_path, tiny_vlm):
    from vlm.model.hf import save_pretrained
    from vlm.model.multimodal import ConceptMoEVLM

    vlm_model, tok = tiny_vlm()
    save_pretrained(ConceptMoEVLM(vlm_model.model_cfg, None), tmp_path, tok)
    hf_tok = AutoTokenizer.from_pretrained(tmp_path)
    rendered = hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "<|user|>hi<|end|>"
    assert not (tmp_path / "processor_config.json").exists()


def test_chat_wrapper_and_generate_share_one_model(ours):
    assert isinstance(ours, ConceptMoEChat) and ours.hf.vlm is ours.model
