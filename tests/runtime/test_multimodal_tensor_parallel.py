"""The tiny LLaVA-OneVision over two CPU ranks (gloo): SigLIP heads, projector and Qwen2 split, media sent to both
ranks; greedy tokens equal one rank's."""

from braid.runtime import Engine
from llava_tiny import make_tiny_llava, test_image

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def _outputs(path, tp_size):
    prompts = ["One <image> look.", "Two <image> and <image>.", "Clip <video> now."]
    images = [test_image(70, 150, seed=1), [test_image(50, 50, seed=2), test_image(40, 60, seed=3)], None]
    videos = [None, None, [[test_image(30, 30, seed=4 + i) for i in range(3)]]]
    with Engine(model_path=str(path), tokenizer_path="smollm2", tp_size=tp_size, max_total_tokens=4096,
                log_level="warning", device="cpu") as engine:
        return [r["output_ids"] for r in engine.generate(prompts, GREEDY, image_data=images, video_data=videos)]


def test_two_ranks_equal_one(tmp_path):
    make_tiny_llava(tmp_path)
    single = _outputs(tmp_path, 1)
    assert _outputs(tmp_path, 2) == single
    assert len({tuple(o) for o in single}) == 3
