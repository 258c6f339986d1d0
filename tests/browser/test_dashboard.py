"""GET /dashboard loaded in headless Chromium from a real server under load: the page (no external assets) shows
running requests and draws its plots from /get_server_info and /metrics; the route takes the API key like every
route, as a bearer token or a browser's Basic password."""

import re
import threading

import requests
from browser_helpers import API_KEY, keep_screenshot


def test_dashboard_is_behind_the_key_and_self_contained(server):
    bare = requests.get(server.base_url + "/dashboard", timeout=30)
    assert bare.status_code == 401 and bare.headers["WWW-Authenticate"].startswith("Basic ")
    assert requests.get(server.base_url + "/dashboard", auth=("me", "wrong"), timeout=30).status_code == 401
    # a browser's Basic credentials (any user name, the key as password) open the page and the routes it polls
    for path in ("/dashboard", "/get_server_info", "/metrics"):
        assert requests.get(server.base_url + path, auth=("me", API_KEY), timeout=30).status_code == 200, path
    assert requests.post(server.base_url + "/generate", auth=("me", API_KEY), timeout=30,
                         json={"text": "hi", "sampling_params": {"max_new_tokens": 1}}).status_code == 401
    page = server.get("/dashboard")
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//|<link|@import|url\(""", page.text)


def test_dashboard_under_load_shows_running_requests_and_plots(page, server):
    # a grammar request first, so the compile pool has state to show
    r = server.post("/generate", {"text": "Pick:", "sampling_params": {"max_new_tokens": 4, "regex": "[ab]+"}})
    assert r.status_code == 200
    stop = threading.Event()

    def load():
        while not stop.is_set():
            server.post("/generate", {"text": "Tell me a story about a lighthouse.",
                                      "sampling_params": {"max_new_tokens": 48, "ignore_eos": True}})

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        page.set_headers(server.headers)
        page.goto(server.base_url + "/dashboard")
        page.wait_for("+document.querySelector('#running b').textContent > 0", timeout=60)
        # samples enough for finished requests to move the latency histograms
        page.wait_for("[...document.querySelectorAll('#plot-latency polyline')].every("
                      "e => e.getAttribute('points').split(' ').length >= 2)", timeout=120)
        series = page.eval("Object.fromEntries([...document.querySelectorAll('svg.plot polyline')].map("
                           "e => [e.dataset.series, e.getAttribute('points').split(' ').filter(p => p)"
                           ".map(p => p.split(',').map(Number))]))")
        assert set(series) == {"running", "waiting", "kv_use", "cached_share", "gen_tps", "prompt_tps", "ttft_ms",
                               "tpot_ms"}
        height = 150 - 14  # the plots' zero line (dashboard.py: H - 14)
        for name in ("running", "kv_use", "gen_tps", "ttft_ms", "tpot_ms"):
            assert any(y < height for _, y in series[name]), name  # above zero somewhere
        assert page.eval("document.querySelector('#status').textContent") == ""
        grammar = page.eval("Object.fromEntries([...document.querySelectorAll('#grammar tr')].map("
                            "tr => [tr.cells[0].textContent, +tr.cells[1].textContent]))")
        assert grammar["compiles"] >= 1 and "in_flight" in grammar
        keep_screenshot(page.screenshot(), "dashboard.png")
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_dashboard_fetches_only_its_own_server(page, server):
    page.set_headers(server.headers)
    page.goto(server.base_url + "/dashboard")
    page.wait_for("+document.body.dataset.samples >= 2", timeout=60)
    fetched = page.eval("performance.getEntriesByType('resource').map(e => e.name)")
    origin = page.eval("location.origin")
    assert fetched and all(url.startswith(origin + "/") for url in fetched), fetched
    assert {url[len(origin):] for url in fetched} == {"/get_server_info", "/metrics"}
    assert page.eval("document.querySelectorAll('[src], link, img, iframe').length") == 0
