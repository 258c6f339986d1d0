"""Run traces on the scripted backend: off by default and invisible to the program, the tree of scopes and calls,
errors, speculation, the global setting, and the `braid trace` command."""

import json
import subprocess
import sys

import pytest

import braid
from braid.errors import ProgramError
from braid.run_trace import SCHEMA, RunTrace, collected_trace
from lang_scripted_backend import ScriptedBackend


@braid.function
def forked(s, q):
    s += "Q: " + q + "\n"
    forks = s.fork(2)
    forks += lambda i: braid.gen("idea", max_tokens=8, stop="\n")
    forks.join()
    s += "A: " + braid.select("ans", choices=["yes", "no"]) + "\n"
    s += braid.gen("word", max_tokens=4, regex=r"[a-z]+")


def test_recording_is_off_by_default_and_says_how_to_turn_it_on(backend):
    state = forked.run(q="hi", backend=backend)
    assert state._executor.recorder is None
    with pytest.raises(ProgramError, match="trace=True"):
        state.trace()
    with pytest.raises(ProgramError, match="trace must be True or False"):
        forked.run(q="hi", backend=backend, trace="yes")


def test_scopes_calls_and_spans(backend):
    state = forked.run(q="hi", backend=backend, trace=True)
    trace = state.trace()
    assert trace["schema"] == SCHEMA and json.loads(trace.to_json())["calls"] == trace["calls"]
    root, *branches = trace["scopes"]
    assert (root["kind"], root["name"], root["arguments"], root["parent"]) == ("program", "forked", {"q": "hi"}, None)
    assert [(b["kind"], b["parent"], b["index"], b["fork_at"]) for b in branches] == [
        ("fork_branch", 0, 0, len("Q: hi\n")), ("fork_branch", 0, 1, len("Q: hi\n"))]
    assert root["text"] == state.text()
    kinds = [c["kind"] for c in trace["calls"]]
    assert kinds.count("prefill") == 1 and kinds.count("gen") == 3 and kinds.count("select") == 1
    scopes = {s["id"]: s for s in trace["scopes"]}
    for c in trace["calls"]:
        assert c["t_sent"] <= c["t_done"]
        if c["kind"] != "prefill":
            assert scopes[c["scope"]]["text"][c["span"][0]:c["span"][1]] == c["text"]
    word = next(c for c in trace["calls"] if c["name"] == "word")
    assert word["constraint"] == {"type": "regex", "value": "[a-z]+"} and word["args"] == {"max_new_tokens": 4}
    assert [t["logprob"] for t in word["tokens"]] == [-0.5] * len(word["text"])  # asked for by the recorder
    select = next(c for c in trace["calls"] if c["kind"] == "select")
    assert [ch["text"] for ch in select["choices"]] == ["yes", "no"] and select["decision"] in (0, 1)
    assert trace["summary"]["calls"] == 5 and trace["summary"]["selects"] == 1


def test_the_program_sees_no_logprobs_it_did_not_ask_for(backend):
    state = forked.run(q="hi", backend=backend, trace=True)
    assert "output_token_logprobs" not in state.get_meta_info("word")
    asked = braid.function(lambda s: s.__iadd__(braid.gen("x", max_tokens=3, return_logprob=True)))
    state = asked.run(backend=backend, trace=True)
    assert state.get_meta_info("x")["output_token_logprobs"]


def test_run_batch_records_one_tree():
    backend = ScriptedBackend()
    states = forked.run_batch([{"q": "a"}, {"q": "b"}], backend=backend, trace=True, progress_bar=False)
    trace = states[1].trace()
    batch = trace["scopes"][0]
    assert batch["kind"] == "batch" and batch["parent"] is None
    items = [s for s in trace["scopes"] if s["kind"] == "program"]
    assert sorted((s["index"], s["parent"], s["arguments"]["q"]) for s in items) == [(0, 0, "a"), (1, 0, "b")]
    assert trace["summary"]["gens"] == 6


def test_a_failed_call_is_recorded_with_its_error():
    def responder(prompt, sp):
        raise braid.BackendError("model fell over")

    @braid.function
    def one(s):
        s += "x" + braid.gen("y", max_tokens=2)

    braid.global_config.trace = True  # run() raises; the process-wide collection still has the run
    try:
        with pytest.raises(braid.BackendError):
            one.run(backend=ScriptedBackend(responder))
        trace = collected_trace(clear=True)
    finally:
        braid.global_config.trace = False
    (call,) = trace["calls"]
    assert call["error"] == "BackendError: model fell over" and call["t_done"] is not None
    assert trace["scopes"][0]["error"] == "BackendError: model fell over"


def test_speculated_gens_are_marked():
    @braid.function(num_api_spec_tokens=32)
    def spec(s):
        s += "Name: " + braid.gen("name", stop="\n") + "\nAge: " + braid.gen("age", stop="\n")

    backend = ScriptedBackend(lambda prompt, sp: "Ann\nAge: 7\n")
    trace = spec.run(backend=backend, trace=True).trace()
    cut = [c for c in trace["calls"] if c["speculated"]]
    assert [c["name"] for c in cut] == ["name", "age"] and [c["text"] for c in cut] == ["Ann", "7"]


def test_global_setting_collects_every_run(backend):
    braid.global_config.trace = True
    try:
        forked.run(q="one", backend=backend)
        forked.run(q="two", backend=backend)
        trace = collected_trace(clear=True)
    finally:
        braid.global_config.trace = False
    roots = [s for s in trace["scopes"] if s["parent"] is None]
    assert [r["arguments"]["q"] for r in roots] == ["one", "two"]
    assert {c["scope"] for c in trace["calls"]} <= {s["id"] for s in trace["scopes"]}
    with pytest.raises(ProgramError, match="no traced runs"):
        collected_trace()
    with pytest.raises(TypeError):
        braid.global_config.trace = 1


def test_loading_something_else_is_a_clear_error(tmp_path):
    (tmp_path / "x.json").write_text('{"calls": []}')
    with pytest.raises(ProgramError, match="not a braid trace"):
        RunTrace.load(str(tmp_path / "x.json"))
    (tmp_path / "y.json").write_text("{")
    with pytest.raises(ProgramError, match="is not JSON"):
        RunTrace.load(str(tmp_path / "y.json"))


def test_braid_trace_command(tmp_path, backend):
    forked.run(q="<script>alert(1)</script>", backend=backend, trace=True).trace().save(str(tmp_path / "t.json"))
    cli = [sys.executable, "-m", "braid.cli", "trace"]
    done = subprocess.run(cli + [str(tmp_path / "t.json"), "-o", str(tmp_path / "t.html")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    html = (tmp_path / "t.html").read_text()
    assert "<script>alert" not in html and "http" not in html.split("<body>")[1]  # escaped; nothing fetched
    bad = subprocess.run(cli + [str(tmp_path / "missing.json"), "-o", str(tmp_path / "m.html")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "missing.json" in bad.stderr
    assert subprocess.run(cli + [str(tmp_path / "t.json")], capture_output=True, timeout=120).returncode == 2
    # a script: every run it makes is traced into one page
    script = tmp_path / "prog.py"
    script.write_text(
        "import sys\nsys.path.insert(0, %r)\n" % str(__import__("pathlib").Path(__file__).parent)
        + "import braid\nfrom lang_scripted_backend import ScriptedBackend\n"
        "@braid.function\ndef p(s, n):\n    s += 'n=' + n + braid.gen('x', max_tokens=3)\n"
        "for n in sys.argv[1:]:\n    p.run(n=n, backend=ScriptedBackend())\n")
    done = subprocess.run(cli + [str(script), "a", "b", "-o", str(tmp_path / "s.html"), "--json",
                                 str(tmp_path / "s.json")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    trace = RunTrace.load(str(tmp_path / "s.json"))
    assert [s["arguments"]["n"] for s in trace["scopes"]] == ["a", "b"] and trace["summary"]["gens"] == 2
    assert (tmp_path / "s.html").read_text().startswith("<!DOCTYPE html>")
