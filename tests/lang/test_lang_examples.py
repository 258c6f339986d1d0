"""Every script in examples/ runs end to end, with braid.Runtime swapped for the fake server."""

import runpy
from pathlib import Path

import pytest

import braid
from braid.backends.runtime_endpoint import RuntimeEndpoint

from lang_fake_server import FakeServer

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.py"))


class _FakeRuntime:
    def __init__(self, server):
        self.endpoint = RuntimeEndpoint(server.url)
        self.shut = False

    def shutdown(self):
        self.shut = True


def test_examples_exist():
    names = {p.stem for p in EXAMPLES}
    assert {"few_shot_qa", "multi_turn_chat", "parallel_branches", "json_extraction", "react_tool_loop", "image_qa",
            "run_batch"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs(path, monkeypatch, capsys):
    server = FakeServer(multimodal=path.stem == "image_qa").start()  # the fake server stands in for a vision model
    runtimes = []

    def make_runtime(model_path="smollm2", **kwargs):
        runtimes.append(_FakeRuntime(server))
        return runtimes[-1]

    monkeypatch.setattr(braid, "Runtime", make_runtime, raising=False)
    monkeypatch.setattr("sys.argv", [str(path)])
    try:
        runpy.run_path(str(path), run_name="__main__")
    finally:
        server.stop()
    assert runtimes and all(r.shut for r in runtimes)
    assert server.bodies("/generate")
    assert capsys.readouterr().out.strip()
