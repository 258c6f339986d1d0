"""A run trace of a real SmolLM2 run (fork, select, a JSON-schema gen, run_batch) written as a page by `braid trace`
and loaded in headless Chromium: every call's span and time-line bar are in the rendered DOM, and clicking or
hovering shows the call's details."""

import json
import subprocess
import sys

import pytest
from browser_helpers import API_KEY, keep_screenshot
from traced_program import TOPICS, plan

import braid


@pytest.fixture(scope="module")
def traced(server, tmp_path_factory):
    backend = braid.RuntimeEndpoint(server.base_url, api_key=API_KEY)
    states = plan.run_batch(TOPICS, backend=backend, trace=True, temperature=0, progress_bar=False)
    for state in states:
        assert not isinstance(state, Exception), state
    trace = states[0].trace()
    folder = tmp_path_factory.mktemp("trace")
    trace.save(str(folder / "trace.json"))
    page = folder / "trace.html"
    done = subprocess.run([sys.executable, "-m", "braid.cli", "trace", str(folder / "trace.json"), "-o", str(page)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads((folder / "trace.json").read_text()), page


def _calls(trace, kind, name=None):
    return [c for c in trace["calls"] if c["kind"] == kind and (name is None or c["name"] == name)]


def test_the_trace_holds_every_call_of_the_batch(traced):
    trace, _ = traced
    kinds = sorted(s["kind"] for s in trace["scopes"])
    assert kinds == ["batch"] + ["fork_branch"] * 4 + ["program"] * 2
    scopes = {s["id"]: s for s in trace["scopes"]}
    notes, selects, cities = _calls(trace, "gen", "note"), _calls(trace, "select"), _calls(trace, "gen", "city")
    assert len(notes) == 4 and len(selects) == 2 and len(cities) == 2
    assert len(_calls(trace, "prefill")) == 2  # each fork's shared prefix
    for c in notes + cities:
        assert scopes[c["scope"]]["text"][c["span"][0]:c["span"][1]] == c["text"]
        assert c["finish_reason"] in ("stop", "length")
        assert c["prompt_tokens"] > 0 and 0 <= c["cached_tokens"] <= c["prompt_tokens"]
        assert c["t_sent"] <= c["t_first_token"] <= c["t_done"]
        assert c["tokens"] and all(t["logprob"] <= 0 and 1 <= len(t["top"]) <= 5 for t in c["tokens"])
        assert all(isinstance(t["text"], str) for t in c["tokens"])
    # the branches forked from a cached prefix: the server reports its tokens as cached
    assert all(c["cached_tokens"] > 0 for c in notes)
    for c in cities:
        assert c["constraint"]["type"] == "json_schema" and "country" in c["constraint"]["value"]
        json.loads(c["text"])
    for c in selects:
        assert [ch["text"] for ch in c["choices"]] == ["yes", "no"]
        assert all(isinstance(ch["score"], float) and ch["token_logprobs"] for ch in c["choices"])
        assert c["method"] == "token_length_normalized" and c["text"] == ["yes", "no"][c["decision"]]
        # the prompt the choices were scored after, from the prefill that scored them: all of it in the prefix cache
        # but what came after the program's last gen
        assert c["prompt_tokens"] > 0 and 0 < c["cached_tokens"] <= c["prompt_tokens"]
    for c in _calls(trace, "prefill"):  # a fork's shared prefix
        assert c["prompt_tokens"] > 0 and 0 <= c["cached_tokens"] <= c["prompt_tokens"]
    s = trace["summary"]
    assert s["calls"] == 10 and s["gens"] == 6 and s["selects"] == 2
    assert 0 < s["cached_share"] < 1 and s["wall_s"] > 0


def test_the_page_draws_every_span_and_bar(page, traced):
    trace, html_path = traced
    page.goto(html_path.as_uri())
    page.wait_for("document.body.dataset.rendered === 'true'")
    spans = page.eval("[...document.querySelectorAll('#program .span[data-call]')].map(e => +e.dataset.call)")
    assert sorted(spans) == sorted(c["id"] for c in trace["calls"] if c["span"] and c["span"][1] > c["span"][0])
    texts = page.eval("Object.fromEntries([...document.querySelectorAll('#program .span[data-call]')]"
                      ".map(e => [e.dataset.call, e.textContent]))")
    assert all(texts[str(c["id"])] == c["text"] for c in trace["calls"] if c["kind"] != "prefill")
    bars = page.eval("[...document.querySelectorAll('#timeline .bar[data-call]')]"
                     ".map(e => [+e.dataset.call, e.getBoundingClientRect().width])")
    assert sorted(b[0] for b in bars) == [c["id"] for c in trace["calls"]]
    assert all(width >= 2 for _, width in bars)
    # each fork's two branches side by side: same top, the second to the right of the first
    rows = page.eval("[...document.querySelectorAll('.forks')].map(f => [...f.children].map(c => "
                     "{const r = c.getBoundingClientRect(); return [r.top, r.left];}))")
    assert len(rows) == 2
    for (top0, left0), (top1, left1) in rows:
        assert top0 == top1 and left1 > left0
    assert page.eval("document.querySelector('#summary').textContent").startswith("10calls")


def test_click_and_hover_show_a_calls_details(page, traced, tmp_path):
    trace, html_path = traced
    page.goto(html_path.as_uri())
    page.wait_for("document.body.dataset.rendered === 'true'")
    city = _calls(trace, "gen", "city")[0]
    page.click(f"#program .span[data-call='{city['id']}']")
    assert page.eval("document.querySelector('#details-body h3').textContent") == f"gen city  (call {city['id']})"
    details = page.eval("document.querySelector('#details-body').textContent")
    assert "json_schema" in details and "finish reason" in details
    chips = page.eval("[...document.querySelectorAll('#details-body .toks .tok')].map(e => e.style.background)")
    assert len(chips) == len(city["tokens"]) and all(c.startswith("rgb") for c in chips)
    assert page.eval(f"document.querySelector('#timeline .bar[data-call=\"{city['id']}\"]').classList"
                     ".contains('active')")
    # pinned by the click: hovering another call leaves the details alone until a second click frees them
    select = _calls(trace, "select")[0]
    page.hover(f"#timeline .bar[data-call='{select['id']}']")
    assert "gen city" in page.eval("document.querySelector('#details-body h3').textContent")
    page.click(f"#program .span[data-call='{city['id']}']")
    page.hover(f"#timeline .bar[data-call='{select['id']}']")
    assert page.eval("document.querySelector('#details-body h3').textContent") == f"select verdict  (call {select['id']})"
    won = page.eval("[...document.querySelectorAll('#details-body .choice')].map(e => e.classList.contains('won'))")
    assert won == [i == select["decision"] for i in range(2)]
    keep_screenshot(page.screenshot(), "trace_page.png")


def test_openai_backend_trace_leaves_out_what_it_does_not_give(page, server, tmp_path):
    @braid.function
    def ask(s):
        s += braid.user("Name a colour.")
        s += braid.assistant(braid.gen("colour", max_tokens=8))

    backend = braid.OpenAI("smollm2", base_url=server.base_url + "/v1", api_key=API_KEY)
    trace = ask.run(backend=backend, trace=True, temperature=0).trace()
    (call,) = trace["calls"]
    assert call["tokens"] is None and call["t_first_token"] is None  # no logprobs, not streamed
    assert call["prompt_tokens"] > 0 and call["completion_tokens"] > 0 and call["cached_tokens"] is not None
    trace.save_html(str(tmp_path / "openai.html"))
    page.goto((tmp_path / "openai.html").as_uri())
    page.wait_for("document.body.dataset.rendered === 'true'")
    page.click("#program .span[data-call='0']")
    details = page.eval("document.querySelector('#details-body').textContent")
    assert "no token logprobs" in details and "not reported" in details


def test_the_page_fetches_nothing(page, traced):
    # self-contained as rendered, not only as written: the browser loaded no resource and no element points outside
    _, html_path = traced
    page.goto(html_path.as_uri())
    page.wait_for("document.body.dataset.rendered === 'true'")
    assert page.eval("performance.getEntriesByType('resource').map(e => e.name)") == []
    assert page.eval("document.querySelectorAll('[src], [href], link, img, iframe, object, embed').length") == 0
    assert page.eval("[...document.scripts].every(s => !s.src)")
