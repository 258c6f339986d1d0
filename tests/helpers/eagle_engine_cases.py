"""What the EAGLE engine tests (chains and trees) run: the request cases over the random target (grammars, a stop
string picked from the plain output, penalties, min_new_tokens, short limits), the successor target's cases, and
the checks on their results."""

import string
import threading

from braid.runtime import Engine
from eagle_tiny import write_random_heads, write_random_target, write_successor_head, write_successor_target

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"]}
PROMPTS = ["Hello there, how are you?", "abc abc abc abc", "The quick brown fox", "xyz", "Once upon a time",
           "1, 2, 3, 4,", "def f(x):\n    return", "Lorem ipsum dolor sit amet", "q", "The quick brown dog",
           "Tell me a story.", "[1, 2, 3]", "Hello there, how is it going?", "zzzz", "mnop", "A B C D",
           "Paris is the capital of", "print('hi')", "01234", "Hello there, how are you?"]
STOP_CASE = 0  # its stop string is picked from its plain output


def cases(stop: str) -> list[dict]:
    params = [{"temperature": 0, "max_new_tokens": 12 + 3 * (i % 7)} for i in range(len(PROMPTS))]
    params[STOP_CASE]["stop"] = [stop]
    params[1].update(json_schema=SCHEMA, max_new_tokens=40)
    params[2].update(regex="[a-z]{2,6}( [a-z]{2,6}){2,5}", max_new_tokens=40)
    params[3].update(frequency_penalty=0.5)  # never drafts: rides the verify passes alone
    params[4].update(min_new_tokens=10, max_new_tokens=14)
    params[5].update(max_new_tokens=1)
    params[6].update(max_new_tokens=2)
    params[7].update(ignore_eos=True, max_new_tokens=48)
    return params


def pick_stop(text: str) -> str:
    """Two printable ASCII characters from the middle of a plain output (one if there are no two in a row)."""
    ok = set(string.ascii_letters + string.digits + string.punctuation + " ")
    for i in range(3, len(text) - 1):
        if text[i] in ok and text[i + 1] in ok:
            return text[i:i + 2]
    return next((c for c in text[3:] if c in ok), "@")


def run(path: str, stop: str, **kw) -> tuple[list[dict], dict]:
    with Engine(model_path=path, log_level="warning", max_total_tokens=2048, **kw) as engine:
        params = cases(stop)
        batched = engine.generate(PROMPTS, params)
        alone = [engine.generate(PROMPTS[i], params[i]) for i in (0, 2, 9)]
        return batched + alone, engine.get_stats()


def assert_same(plain_out: list[dict], spec_out: list[dict]) -> None:
    for i, (a, b) in enumerate(zip(plain_out, spec_out)):
        assert b["output_ids"] == a["output_ids"], (i, a["text"], b["text"])
        assert b["meta_info"]["finish_reason"] == a["meta_info"]["finish_reason"], i
        assert b["text"] == a["text"], i


def assert_pool_free(stats: dict) -> None:
    assert stats["num_running_reqs"] == 0 and stats["kv_used_tokens"] == 0
    assert stats["kv_free_tokens"] + stats["kv_cached_tokens"] == stats["kv_total_tokens"]


SUCC_PROMPTS = ["Hello there, how are you", "abc abc abc", "The quick brown fox", "xyz", "hello world " * 6,
                "mnop", "Paris is", "k"]


def succ_cases() -> list[dict]:
    params = [{"temperature": 0, "max_new_tokens": 40} for _ in SUCC_PROMPTS]
    params[1]["stop"] = ["pqr"]
    params[2]["regex"] = "[a-z ]{10,60}"
    params[3]["json_schema"] = SCHEMA
    params[4]["max_new_tokens"] = 7
    return params


def run_succ(path: str, **kw) -> tuple[list[dict], dict]:
    with Engine(model_path=path, log_level="warning", max_total_tokens=2048, **kw) as engine:
        return engine.generate(SUCC_PROMPTS, succ_cases()), engine.get_stats()


def write_checkpoints(root) -> dict:
    """The random target with random EAGLE and EAGLE3 heads, and the successor target with its head, under root."""
    eagle, eagle3 = write_random_heads(root)
    return dict(random=write_random_target(root / "random"), eagle=eagle, eagle3=eagle3,
                succ=write_successor_target(root / "succ"), succ_head=write_successor_head(root / "succ_head"))


def plain_outputs(ckpt: dict) -> tuple[str, list[dict]]:
    """(the stop string, the random target's outputs of every case without speculation)."""
    with Engine(model_path=ckpt["random"], log_level="warning", max_total_tokens=2048) as engine:
        stop = pick_stop(engine.generate(PROMPTS[STOP_CASE], {"temperature": 0, "max_new_tokens": 30})["text"])
    return stop, run(ckpt["random"], stop)[0]


def check_sampled_load_and_aborted_streams(ckpt: dict, **spec) -> None:
    """Sampled requests (some seeded) on the successor target with its EAGLE head (flags `spec`), beside streams
    closed after a few chunks, twice: the seeded ones draw the same tokens again, drafts are accepted, and the KV
    pool is fully free after."""
    prompts = [f"{i}: the quick brown fox " * (1 + i % 3) for i in range(12)]
    params = [{"temperature": 0.9, "top_p": 0.95, "max_new_tokens": 10 + 3 * (i % 5),
               **({"seed": i} if i % 3 == 0 else {})} for i in range(12)]
    with Engine(model_path=ckpt["succ"], log_level="warning", max_total_tokens=1024, speculative_algorithm="EAGLE",
                speculative_draft_model_path=ckpt["succ_head"], **spec) as engine:
        results = {}

        def batch():
            results["first"] = engine.generate(prompts, params)

        t = threading.Thread(target=batch)
        t.start()
        for i in range(4):  # streams closed after a few chunks: aborted mid-decode beside the batch
            stream = engine.generate(f"abort {i}: hello", {"temperature": 0.7, "max_new_tokens": 300,
                                                           "ignore_eos": True}, stream=True)
            for n, _ in enumerate(stream):
                if n == 2 + i:
                    break
            stream.close()
        t.join(timeout=300)
        again = engine.generate(prompts, params)
        for _ in range(200):
            stats = engine.get_stats()
            if stats["num_running_reqs"] == 0:
                break
            threading.Event().wait(0.05)
        assert not engine.scheduler.running and not engine.scheduler.resume_queue
    for i, (a, b) in enumerate(zip(results["first"], again)):
        assert len(a["output_ids"]) <= params[i]["max_new_tokens"]
        if "seed" in params[i]:  # a seeded request draws the same tokens again
            assert a["output_ids"] == b["output_ids"]
    assert stats["spec_num_accepted_tokens_total"] > 0
    assert_pool_free(stats)
