"""The speculative-decoding switches: SGLang's flags, vLLM's --speculative-config mapped onto them, defaults, and the
combinations refused with a message naming the flag (never silently ignored)."""

import argparse
import json

import pytest

from braid.runtime.config import ServerArgs


def parse(*argv: str) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(list(argv)))


def test_off_by_default():
    sa = ServerArgs()
    assert sa.speculative_algorithm is None
    assert sa.speculative_num_draft_tokens is None and sa.speculative_num_steps is None


def test_ngram_flags_and_defaults():
    sa = parse("--speculative-algorithm", "NGRAM")
    assert (sa.speculative_num_draft_tokens, sa.speculative_num_steps, sa.speculative_eagle_topk) == (5, 4, 1)
    assert (sa.speculative_ngram_min_match_window_size, sa.speculative_ngram_max_match_window_size) == (2, 8)
    sa = parse("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "3",
               "--speculative-ngram-max-match-window-size", "4")
    assert (sa.speculative_num_draft_tokens, sa.speculative_num_steps) == (3, 2)
    assert sa.speculative_ngram_max_match_window_size == 4
    assert parse("--speculative-algorithm", "NGRAM", "--speculative-num-steps", "6").speculative_num_draft_tokens == 7
    # resolved values survive a replace (post_init runs again on them)
    assert sa.replace(port=1).speculative_num_draft_tokens == 3


def test_eagle_flags_and_defaults():
    sa = parse("--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "/x")
    assert (sa.speculative_num_draft_tokens, sa.speculative_num_steps, sa.speculative_eagle_topk) == (4, 3, 1)
    sa = parse("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/x",
               "--speculative-num-steps", "5", "--speculative-eagle-topk", "1")
    assert (sa.speculative_num_draft_tokens, sa.speculative_num_steps) == (6, 5)
    sa = parse("--speculative-config", json.dumps({"method": "eagle", "model": "/x", "num_speculative_tokens": 2}))
    assert (sa.speculative_algorithm, sa.speculative_draft_model_path, sa.speculative_num_steps) == ("EAGLE", "/x", 2)
    assert sa.replace(port=1).speculative_num_draft_tokens == 3


def test_eagle_tree_flags():
    # SGLang's tree: topk nodes at depth 1, topk * topk candidates at each deeper depth, num_draft_tokens - 1 chosen
    sa = parse("--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "/x", "--speculative-eagle-topk",
               "4", "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "8")
    assert (sa.speculative_eagle_topk, sa.speculative_num_steps, sa.speculative_num_draft_tokens) == (4, 3, 8)
    sa = ServerArgs(speculative_algorithm="EAGLE3", speculative_draft_model_path="/x", speculative_eagle_topk=2)
    assert (sa.speculative_num_steps, sa.speculative_num_draft_tokens) == (3, 7)  # defaults: depth 3, 6 nodes
    # the largest tree of depth 2 and width 2: 2 + 4 nodes and the request's last token
    assert ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path="/x", speculative_num_steps=2,
                      speculative_eagle_topk=2, speculative_num_draft_tokens=7).speculative_num_draft_tokens == 7


def test_vllm_config_maps_onto_the_flags():
    cfg = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 3}
    sa = parse("--speculative-config", json.dumps(cfg))
    assert sa.speculative_algorithm == "NGRAM"
    assert (sa.speculative_num_draft_tokens, sa.speculative_num_steps) == (4, 3)
    assert (sa.speculative_ngram_min_match_window_size, sa.speculative_ngram_max_match_window_size) == (3, 5)
    assert sa.replace(port=1).speculative_num_draft_tokens == 4
    # agreeing flags are fine
    assert parse("--speculative-config", json.dumps(cfg), "--speculative-algorithm", "NGRAM").speculative_num_steps == 3
    sa = parse("--speculative-config", json.dumps({"method": "ngram", "disable_by_batch_size": 16}))
    assert sa.speculative_disable_by_batch_size == 16
    assert parse("--speculative-algorithm", "NGRAM", "--speculative-disable-by-batch-size", "8") \
        .speculative_disable_by_batch_size == 8


@pytest.mark.parametrize("kwargs, message", [
    (dict(speculative_num_steps=3), "no effect without --speculative-algorithm"),
    (dict(speculative_ngram_max_match_window_size=4), "no effect without --speculative-algorithm"),
    (dict(speculative_algorithm="MEDUSA"), "not one of NGRAM, EAGLE, EAGLE3"),
    (dict(speculative_algorithm="NGRAM", speculative_draft_model_path="/x"), "NGRAM drafts from the request's own"),
    (dict(speculative_algorithm="NGRAM", speculative_eagle_topk=4), "tree drafts"),
    (dict(speculative_algorithm="NGRAM", speculative_num_steps=3, speculative_num_draft_tokens=8),
     "must be --speculative-num-steps + 1"),
    (dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=1), "between 2 and 64"),
    (dict(speculative_algorithm="NGRAM", speculative_num_steps=0), "--speculative-num-steps must be >= 1"),
    (dict(speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=5,
          speculative_ngram_max_match_window_size=3), "is above --speculative-ngram-max-match-window-size"),
    (dict(speculative_algorithm="EAGLE"), "needs --speculative-draft-model-path"),
    (dict(speculative_algorithm="EAGLE3", speculative_draft_model_path="/x", speculative_ngram_min_match_window_size=2),
     "has no effect with EAGLE3"),
    (dict(speculative_algorithm="EAGLE", speculative_draft_model_path="/x", speculative_num_steps=3,
          speculative_eagle_topk=1, speculative_num_draft_tokens=6), "the draft is a chain"),
    (dict(speculative_algorithm="EAGLE", speculative_draft_model_path="/x", speculative_num_steps=2,
          speculative_eagle_topk=2, speculative_num_draft_tokens=9), "more than a tree of depth"),
    (dict(speculative_algorithm="EAGLE3", speculative_draft_model_path="/x", speculative_num_steps=1,
          speculative_eagle_topk=4, speculative_num_draft_tokens=6), "holds (5, the request's last token"),
    (dict(speculative_algorithm="EAGLE3", speculative_draft_model_path="/x", speculative_num_steps=70),
     "--speculative-num-steps must be below 64"),
    (dict(speculative_algorithm="NGRAM", speculative_disable_by_batch_size=0),
     "--speculative-disable-by-batch-size must be >= 1"),
    (dict(speculative_disable_by_batch_size=4), "no effect without --speculative-algorithm"),
    (dict(speculative_algorithm="EAGLE", speculative_draft_model_path="/x", speculative_disable_by_batch_size=4),
     "not supported with EAGLE yet"),
    (dict(speculative_config="{not json"), "is not JSON"),
    (dict(speculative_config="[1]"), "must be a JSON object"),
    (dict(speculative_config='{"method": "medusa"}'), "method 'medusa' is not one braid runs"),
    (dict(speculative_config='{"method": "ngram", "draft_tensor_parallel_size": 1}'),
     "does not take draft_tensor_parallel_size"),
    (dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 0}'), "integer >= 1"),
    (dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}', speculative_num_draft_tokens=6),
     "give it once"),
    (dict(speculative_config='{"method": "ngram"}', speculative_algorithm="EAGLE"), "give it once"),
])
def test_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("+", r"\+").replace("(", r"\(")):
        ServerArgs(**kwargs)


def test_cli_refuses_lowercase_choice_and_names_the_choices(capsys):
    with pytest.raises(SystemExit):
        parse("--speculative-algorithm", "ngram2")
    assert "NGRAM" in capsys.readouterr().err
