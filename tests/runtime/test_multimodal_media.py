"""Media loading limits without a server: remote URLs resolving to loopback/private addresses are refused even when
remote media is on, data URLs must be base64 images, files stay inside the allowed directory, frames are bounded."""

import base64
import io

import pytest

from braid.runtime.multimodal.media import MediaError, MediaLimits, load_image, load_video
from braid.runtime.multimodal.prompt import MultimodalPreparer, as_video_list


def _png(size=(8, 6)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("url", ["http://127.0.0.1/a.png", "http://localhost:8080/a.png", "https://10.1.2.3/a.png",
                                 "http://[::1]/a.png", "http://169.254.169.254/latest/meta-data"])
def test_remote_urls_to_non_global_addresses_are_refused(url):
    with pytest.raises(MediaError, match="loopback, private or reserved"):
        load_image(url, MediaLimits(allow_remote=True))


def test_remote_urls_need_the_switch_and_other_schemes_are_refused():
    with pytest.raises(MediaError, match="--allow-remote-media"):
        load_image("https://example.com/a.png", MediaLimits())
    with pytest.raises(MediaError, match="scheme 'ftp'"):
        load_image("ftp://example.com/a.png", MediaLimits(allow_remote=True))


def test_data_urls_and_byte_limits():
    good = "data:image/png;base64," + base64.b64encode(_png()).decode()
    assert load_image(good, MediaLimits()).size == (8, 6)
    with pytest.raises(MediaError, match="must be base64"):
        load_image("data:image/png,raw", MediaLimits())
    with pytest.raises(MediaError, match="malformed"):
        load_image("data:image/png;base64,@@@@", MediaLimits())
    with pytest.raises(MediaError, match="at most 10 bytes"):
        load_image(_png(), MediaLimits(max_bytes=10))
    with pytest.raises(MediaError, match="at most 40 pixels"):
        load_image(_png(), MediaLimits(max_pixels=40))


def test_local_files_stay_inside_the_allowed_directory(tmp_path):
    (tmp_path / "inside").mkdir()
    (tmp_path / "inside" / "a.png").write_bytes(_png())
    (tmp_path / "secret.png").write_bytes(_png())
    limits = MediaLimits(allowed_local_path=str(tmp_path / "inside"))
    assert load_image("a.png", limits).size == (8, 6)
    assert load_image("file://" + str(tmp_path / "inside" / "a.png"), limits).size == (8, 6)
    for path in ["../secret.png", str(tmp_path / "secret.png")]:
        with pytest.raises(MediaError, match="outside the allowed directory"):
            load_image(path, limits)
    with pytest.raises(MediaError, match="--allowed-local-media-path"):
        load_image("a.png", MediaLimits())


def test_videos_are_lists_of_frames():
    frame = _png()
    assert len(load_video([frame] * 3, MediaLimits())) == 3
    with pytest.raises(MediaError, match="at most 2 frames"):
        load_video([frame] * 3, MediaLimits(max_frames=2))
    with pytest.raises(MediaError, match="--allowed-local-media-path"):
        load_video("clip.mp4", MediaLimits())  # a video file follows the image rules
    # a list of frames is one video; a list of lists is several
    assert as_video_list([frame, frame]) == [[frame, frame]]
    assert as_video_list([[frame], [frame, frame]]) == [[frame], [frame, frame]]
    assert as_video_list({"frames": [frame]}) == [{"frames": [frame]}]


def test_animated_video_files_decode_with_sampling():
    from PIL import Image

    frames = [Image.new("RGB", (20, 16), (i * 25, 0, 0)) for i in range(10)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=40)
    url = "data:image/gif;base64," + base64.b64encode(buf.getvalue()).decode()
    assert len(load_video(url, MediaLimits())) == 10
    sampled = load_video({"url": url, "num_frames": 4}, MediaLimits())
    reds = [f.getpixel((0, 0))[0] for f in sampled]
    assert len(sampled) == 4 and reds == sorted(reds) and reds[0] < 10 and reds[-1] > 200  # first to last, in order
    with pytest.raises(MediaError, match="pass num_frames"):
        load_video(url, MediaLimits(max_frames=5))
    with pytest.raises(MediaError, match="num_frames must be"):
        load_video({"url": url, "num_frames": 0}, MediaLimits())
    still = "data:image/png;base64," + base64.b64encode(_png()).decode()
    with pytest.raises(MediaError, match="need PyAV"):
        load_video(still, MediaLimits())


def test_too_many_items_in_one_request():
    preparer = MultimodalPreparer(processor=None, image_token_id=1, video_token_id=2, limits=MediaLimits(max_items=2))
    with pytest.raises(MediaError, match="at most 2 images and videos"):
        preparer.prepare(None, "<image><image><image>", [_png()] * 3, None, True)


def test_bench_multimodal_dataset_builds_native_bodies(smollm2_tokenizer):
    from types import SimpleNamespace

    from braid.runtime.bench.datasets import sample_multimodal
    from braid.runtime.bench.serving_clients import build_request_body

    reqs = sample_multimodal(smollm2_tokenizer, 3, 20, 8, 64, 48, images_per_prompt=2, video_frames=3, seed=1)
    assert len({r.image_data[0] for r in reqs}) == 3  # distinct images: no accidental cache hits
    for r in reqs:
        assert r.prompt.count("<image>") == 2 and r.prompt.count("<video>") == 1
        assert [load_image(u, MediaLimits()).size for u in r.image_data] == [(64, 48)] * 2
        assert len(load_video(r.video_data[0], MediaLimits())) == 3
    args = SimpleNamespace(backend="braid", disable_stream=True, disable_ignore_eos=False, extra_request_body=None,
                           model="m")
    body = build_request_body(args, reqs[0])
    assert body["image_data"] == reqs[0].image_data and body["video_data"] == reqs[0].video_data
