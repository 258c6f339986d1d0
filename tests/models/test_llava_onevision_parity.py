"""LLaVA-OneVision on a tiny random config (SigLIP 2 layers, Qwen2 2 layers, 56px tiles of 14px patches, grids up to
3x3): braid's pixels, placeholder counts, prompt logprobs and greedy tokens against HF transformers'
LlavaOnevisionForConditionalGeneration and its PIL image processor, fed the same inputs."""

import dataclasses
import math
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from braid.runtime import Engine
from llava_tiny import IMAGE_TOKEN, PATCH, TILE, VIDEO_TOKEN, make_tiny_llava, test_image as _image

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llava_ov")
    hf, processor = make_tiny_llava(folder)
    engine = Engine(model_path=str(folder), tokenizer_path="smollm2", log_level="warning", max_total_tokens=8192,
                    chunked_prefill_size=-1, device="cpu")
    yield SimpleNamespace(hf=hf, processor=processor, engine=engine, folder=folder)
    engine.shutdown()


def _hf_feature_count(processor, height, width):
    from transformers import LlavaOnevisionProcessor

    fake = SimpleNamespace(image_processor=processor, num_image_tokens=(TILE // PATCH) ** 2,
                           vision_aspect_ratio="anyres_max_9")
    fake._get_unpadded_features = partial(LlavaOnevisionProcessor._get_unpadded_features, fake)
    return LlavaOnevisionProcessor._get_number_of_features(fake, height, width, TILE, TILE)


def _run(llava, prompt, images=(), videos=()):
    out = llava.engine.generate(prompt, {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
                                return_logprob=True, logprob_start_len=0, image_data=list(images) or None,
                                video_data=list(videos) or None)
    ids = [t for _, t in out["meta_info"]["input_token_logprobs"]]
    logprobs = torch.tensor([lp for lp, _ in out["meta_info"]["input_token_logprobs"][1:]])
    return ids, logprobs, out["output_ids"]


def _video_pixels(llava, frames):
    """The frames as HF's image processor prepares an image's base tile (each frame resized to the tile)."""
    tiles = [llava.processor(f, return_tensors="pt")["pixel_values"][0, 0] for f in frames]
    return torch.stack(tiles)[None]


def _compare(llava, ids, logprobs, output_ids, tol=1e-3, **hf_inputs):
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        logits = llava.hf(input_ids=input_ids, **hf_inputs).logits[0].float()
        ref = llava.hf.generate(input_ids=input_ids, **hf_inputs, max_new_tokens=NEW_TOKENS, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    want = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert (logprobs - want).abs().max() <= tol, (logprobs - want).abs().max()
    assert output_ids == ref[0, len(ids):].tolist()


def test_single_image_anyres_non_square(llava):
    img = _image(70, 150, seed=1)  # wide: a 1x3 grid, unpadded rows
    ids, logprobs, output_ids = _run(llava, "Look: <image> What is shown?", images=[img])
    count = ids.count(IMAGE_TOKEN)
    assert count == _hf_feature_count(llava.processor, 70, 150)
    hf_in = llava.processor([img], return_tensors="pt")
    _compare(llava, ids, logprobs, output_ids, pixel_values=hf_in["pixel_values"], image_sizes=hf_in["image_sizes"],
             batch_num_images=hf_in["batch_num_images"])


def test_two_interleaved_images(llava):
    imgs = [_image(90, 60, seed=2), _image(60, 60, seed=3)]
    ids, logprobs, output_ids = _run(llava, "First <image> then <image> which differs?", images=imgs)
    assert ids.count(IMAGE_TOKEN) == 2 * ((TILE // PATCH) ** 2 + 1)  # multi-image: one tile + newline each
    hf_in = llava.processor([imgs], return_tensors="pt")
    _compare(llava, ids, logprobs, output_ids, pixel_values=hf_in["pixel_values"], image_sizes=hf_in["image_sizes"],
             batch_num_images=hf_in["batch_num_images"])


def test_eight_frame_video(llava):
    frames = [_image(48, 64, seed=10 + i) for i in range(8)]
    ids, logprobs, output_ids = _run(llava, "<video> What happens in the clip?", videos=[frames])
    pooled = math.ceil(TILE // PATCH / 2)
    assert ids.count(VIDEO_TOKEN) == 8 * pooled * pooled + 1
    _compare(llava, ids, logprobs, output_ids, pixel_values_videos=_video_pixels(llava, frames))


def test_image_and_video_in_one_prompt(llava):
    img = _image(120, 50, seed=4)  # tall: a 3x1 grid, unpadded columns
    frames = [_image(56, 56, seed=20 + i) for i in range(3)]
    ids, logprobs, output_ids = _run(llava, "Photo <image> and clip <video> same place?", images=[img],
                                     videos=[frames])
    assert ids.count(IMAGE_TOKEN) == _hf_feature_count(llava.processor, 120, 50)
    hf_in = llava.processor([img], return_tensors="pt")
    _compare(llava, ids, logprobs, output_ids, pixel_values=hf_in["pixel_values"], image_sizes=hf_in["image_sizes"],
             batch_num_images=hf_in["batch_num_images"], pixel_values_videos=_video_pixels(llava, frames))


def test_braid_pixels_equal_hf_processor(llava):
    from braid.runtime.loader import load_model_config
    from braid.runtime.config import ServerArgs
    from braid.runtime.multimodal.llava_onevision import LlavaOnevisionProcessor

    mc = load_model_config(ServerArgs.from_kwargs(model_path=str(llava.folder), tokenizer_path="smollm2"))
    ours = LlavaOnevisionProcessor(mc.vision, str(llava.folder))
    for size in [(70, 150), (120, 50), (200, 200), (33, 61)]:
        img = _image(*size, seed=size[0])
        item = ours.image_item(img, anyres=True)
        ref = llava.processor([img], return_tensors="pt")["pixel_values"][0]
        assert item.pixel_values.shape == ref.shape
        assert torch.allclose(item.pixel_values, ref, atol=1e-5)
        assert item.num_tokens == _hf_feature_count(llava.processor, *size)
    imgs = [_image(90, 60, seed=2), _image(40, 70, seed=3)]
    ref = llava.processor([imgs], return_tensors="pt")["pixel_values"]
    for i, img in enumerate(imgs):
        assert torch.allclose(ours.image_item(img, anyres=False).pixel_values[0], ref[i, 0], atol=1e-5)


def test_image_content_moves_the_logits(llava):
    _, first, _ = _run(llava, "Look: <image> What is shown?", images=[_image(70, 150, seed=1)])
    _, other, _ = _run(llava, "Look: <image> What is shown?", images=[_image(70, 150, seed=99)])
    assert first.shape == other.shape and (first[-5:] - other[-5:]).abs().max() > 1e-2


def test_anyres_shrink_matches_hf_packing(llava):
    """anyres_max_1: the unpadded grid holds more than one tile's worth of features, so both shrink it."""
    from braid.runtime.multimodal.llava_onevision import LlavaOnevisionProcessor

    model = llava.engine.scheduler.runner.model
    g, hidden = TILE // PATCH, 64
    height, width = 100, 160  # a 2x3 grid
    tiles = 1 + 2 * 3
    feats = torch.randn(tiles, g * g, hidden)
    saved = model.max_tiles
    model.max_tiles = 1
    try:
        ours = model._pack_anyres(feats, (height, width))
    finally:
        model.max_tiles = saved
    with torch.no_grad():
        ref, _ = llava.hf.model.pack_image_features([feats], torch.tensor([[height, width]]),
                                                    image_newline=model.image_newline, vision_aspect_ratio="anyres_max_1")
    assert ours.shape == ref[0].shape and torch.allclose(ours, ref[0], atol=1e-5)
    from transformers import LlavaOnevisionProcessor as HFProcessor

    processor = LlavaOnevisionProcessor(model.model_config.vision, str(llava.folder))
    processor.config = dataclasses.replace(processor.config, max_tiles=1)
    fake = SimpleNamespace(image_processor=llava.processor, num_image_tokens=g * g, vision_aspect_ratio="anyres_max_1")
    fake._get_unpadded_features = partial(HFProcessor._get_unpadded_features, fake)
    assert processor.image_tokens(height, width, anyres=True) == ours.shape[0] == \
        HFProcessor._get_number_of_features(fake, height, width, TILE, TILE)


@pytest.mark.gpu
def test_gpu_triton_fp32_matches_hf(llava):
    """The same model on CUDA (Triton attention, CUDA-graph decode, fp32): an anyres image and a video in one prompt,
    then two images, against HF on the CPU."""
    gpu = Engine(model_path=str(llava.folder), tokenizer_path="smollm2", log_level="warning", max_total_tokens=8192,
                 device="cuda", dtype="float32", attention_backend="triton")
    try:
        cpu_engine, llava.engine = llava.engine, gpu
        img, frames = _image(120, 50, seed=4), [_image(56, 56, seed=20 + i) for i in range(3)]
        ids, logprobs, output_ids = _run(llava, "Photo <image> and clip <video> same place?", images=[img],
                                         videos=[frames])
        hf_in = llava.processor([img], return_tensors="pt")
        _compare(llava, ids, logprobs, output_ids, tol=2e-3, pixel_values=hf_in["pixel_values"],
                 image_sizes=hf_in["image_sizes"], batch_num_images=hf_in["batch_num_images"],
                 pixel_values_videos=_video_pixels(llava, frames))
        imgs = [_image(90, 60, seed=2), _image(60, 60, seed=3)]
        ids, logprobs, output_ids = _run(llava, "First <image> then <image> which differs?", images=imgs)
        hf_in = llava.processor([imgs], return_tensors="pt")
        _compare(llava, ids, logprobs, output_ids, tol=2e-3, pixel_values=hf_in["pixel_values"],
                 image_sizes=hf_in["image_sizes"], batch_num_images=hf_in["batch_num_images"])
    finally:
        llava.engine = cpu_engine
        gpu.shutdown()


@pytest.mark.parametrize("layout", ["hub", "transformers5"])
def test_checkpoint_name_layouts_load_alike(llava, tmp_path, layout):
    """The hub's llava-onevision-*-ov-hf names (vision_tower.vision_model.*, language_model.model.*) and
    transformers 5's module names (model.language_model.*, model.vision_tower.*) load into the same model."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(llava.folder / "model.safetensors"))
    renames = {"hub": [("vision_tower.", "vision_tower.vision_model.")],
               "transformers5": [("language_model.model.", "model.language_model."),
                                 ("language_model.lm_head.", "lm_head."), ("vision_tower.", "model.vision_tower."),
                                 ("multi_modal_projector.", "model.multi_modal_projector."),
                                 ("image_newline", "model.image_newline")]}[layout]

    def rename(name):
        for old, new in renames:
            if name.startswith(old):
                return new + name[len(old):]
        return name

    save_file({rename(k): v for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    for f in ("config.json", "preprocessor_config.json"):
        shutil.copy(llava.folder / f, tmp_path / f)
    img = _image(70, 150, seed=1)
    want = _run(llava, "Look: <image> What is shown?", images=[img])
    with Engine(model_path=str(tmp_path), tokenizer_path="smollm2", log_level="warning", max_total_tokens=4096,
                device="cpu") as other:
        got = other.generate("Look: <image> What is shown?", {"temperature": 0, "max_new_tokens": NEW_TOKENS,
                                                              "ignore_eos": True}, image_data=[img])
    assert got["output_ids"] == want[2]
