"""Images in the radix cache and in chunked prefill, on the tiny LLaVA-OneVision checkpoint: a repeated image is
served from the cache without running the vision tower; two different images behind the same file path never share
KV; an image straddling the chunk size gives the same tokens and logprobs as an unchunked prefill."""

import pytest
import torch

from braid.runtime import Engine
from llava_tiny import IMAGE_TOKEN, make_tiny_llava, test_image

GREEDY = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llava_ov")
    make_tiny_llava(path)
    return path


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def engine(folder, media_dir):
    with Engine(model_path=str(folder), tokenizer_path="smollm2", log_level="warning", max_total_tokens=8192,
                allowed_local_media_path=str(media_dir)) as e:
        yield e


def _tower_calls(engine):
    calls = []
    engine.scheduler.runner.model.vision_tower.register_forward_hook(lambda *a: calls.append(a[1][0].shape[0]))
    return calls


def test_same_image_twice_is_served_from_the_cache(engine):
    calls = _tower_calls(engine)
    img = test_image(80, 130, seed=5)
    prompt = "Here is a picture: <image> Describe it in detail please."
    first = engine.generate(prompt, GREEDY, image_data=img)
    second = engine.generate(prompt, GREEDY, image_data=img)
    prompt_tokens = second["meta_info"]["prompt_tokens"]
    assert prompt_tokens > 40
    assert prompt_tokens - second["meta_info"]["cached_tokens"] <= 0.1 * prompt_tokens
    assert len(calls) == 1  # the second request did not encode the image
    assert first["output_ids"] == second["output_ids"]


def test_different_images_behind_one_path_share_no_kv(engine, media_dir):
    path = media_dir / "photo.png"
    prompt = "Same name, new picture: <image> What changed?"
    test_image(64, 64, seed=7).save(path)
    first = engine.generate(prompt, GREEDY, image_data=str(path))
    replaced = test_image(64, 64, seed=8)
    replaced.save(path)
    second = engine.generate(prompt, GREEDY, image_data=str(path))
    text_before = len(engine.tokenizer.encode("Same name, new picture: ", add_special_tokens=False))
    assert second["meta_info"]["cached_tokens"] <= text_before
    test_image(64, 64, seed=7).save(path)  # the first picture again: its own KV, still cached
    again = engine.generate(prompt, GREEDY, image_data=str(path))
    assert again["output_ids"] == first["output_ids"]
    assert again["meta_info"]["cached_tokens"] >= 0.9 * again["meta_info"]["prompt_tokens"]
    engine.flush_cache()
    fresh = engine.generate(prompt, GREEDY, image_data=replaced)
    assert second["output_ids"] == fresh["output_ids"]


def test_prompt_ending_in_an_image_recomputes_it_whole(engine):
    """The last prompt token always runs through the model; the cached prefix is cut back to the image's start."""
    calls = _tower_calls(engine)
    img = test_image(60, 100, seed=9)
    first = engine.generate("Look at this <image>", GREEDY, image_data=img)
    second = engine.generate("Look at this <image>", GREEDY, image_data=img)
    assert len(calls) == 2 and first["output_ids"] == second["output_ids"]
    assert second["meta_info"]["cached_tokens"] == len(engine.tokenizer.encode("Look at this ", add_special_tokens=False))


def test_image_straddling_the_chunk_size_matches_unchunked(engine, folder):
    prefix = "word " * 20  # the image starts near token 20 and is longer than the 24-token chunks
    prompt = prefix + "<image> and then <image> end."
    images = [test_image(70, 50, seed=11), test_image(50, 90, seed=12)]
    kwargs = dict(return_logprob=True, logprob_start_len=0, image_data=images)
    engine.flush_cache()
    whole = engine.generate(prompt, GREEDY, **kwargs)
    ids = [t for _, t in whole["meta_info"]["input_token_logprobs"]]
    first_image = ids.index(IMAGE_TOKEN)
    assert first_image < 24 < first_image + ids.count(IMAGE_TOKEN) // 2
    with Engine(model_path=str(folder), tokenizer_path="smollm2", log_level="warning", max_total_tokens=8192,
                chunked_prefill_size=24) as chunked_engine:
        calls = _tower_calls(chunked_engine)
        chunked = chunked_engine.generate(prompt, GREEDY, **kwargs)
    assert sum(calls) == 2  # each image's single tile encoded once, never split
    assert chunked["output_ids"] == whole["output_ids"]
    got = torch.tensor([lp for lp, _ in chunked["meta_info"]["input_token_logprobs"][1:]])
    want = torch.tensor([lp for lp, _ in whole["meta_info"]["input_token_logprobs"][1:]])
    assert torch.allclose(got, want, atol=1e-4)


def test_dsl_program_on_the_local_engine(folder):
    """braid.image() and braid.video() reach the model through LocalEngine: the same tokens as Engine.generate."""
    import braid

    @braid.function
    def describe(s, picture, clip):
        s += "Picture " + braid.image(picture) + " clip " + braid.video(clip, 2) + " answer:"
        s += braid.gen("out", max_tokens=4, temperature=0)

    picture, clip = test_image(50, 70, seed=40), [test_image(40, 40, seed=41 + i) for i in range(2)]
    backend = braid.LocalEngine(str(folder), tokenizer_path="smollm2", log_level="warning", max_total_tokens=4096)
    try:
        state = describe.run(picture, clip, backend=backend)
        direct = backend.engine.generate("Picture <image> clip <video> answer:", {"temperature": 0, "max_new_tokens": 4},
                                         image_data=picture, video_data=[clip])
    finally:
        backend.engine.shutdown()
    assert state["out"] == direct["text"]
    assert direct["meta_info"]["prompt_tokens"] > 4 * 4 + 2 * 2 * 2
