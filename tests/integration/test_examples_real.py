"""Every script in examples/ runs end to end on the real SmolLM2 server (one shared server process)."""

import runpy
from pathlib import Path

import pytest

import braid

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.py"))


class _SharedRuntime:
    """The session's real server, handed to each example in place of a fresh braid.Runtime."""

    def __init__(self, runtime):
        self._runtime = runtime
        self.endpoint = runtime.endpoint
        self.url = runtime.url

    def shutdown(self):
        pass

    def __getattr__(self, name):
        return getattr(self._runtime, name)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_on_real_model(path, runtime, monkeypatch, capsys):
    monkeypatch.setattr(braid, "Runtime", lambda *a, **k: _SharedRuntime(runtime), raising=False)
    monkeypatch.setattr("sys.argv", [str(path)])
    runpy.run_path(str(path), run_name="__main__")
    out = capsys.readouterr().out
    assert out.strip(), f"{path.name} printed nothing"
    info = runtime.endpoint.get_server_info()
    assert info["num_running_reqs"] == 0
