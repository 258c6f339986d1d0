import math
import random

import pytest

import braid
from braid.chat_template import CHATML, LLAMA3, chat_template_for, get_chat_template, list_chat_templates
from braid.choices import (choices_regex, greedy_token_selection, resolve_choices_method, token_length_normalized,
                           unconditional_likelihood_normalized)

from lang_scripted_backend import ScriptedBackend

CHOICES = ["organ", "organism", "antidisestablishmentarianism"]
# per-token logprobs: "organ" = [organ], "organism" = [organ, ism], the long word = 3 tokens
LOGPROBS = [[-0.1], [-0.1, -0.3], [-0.4, -0.05, -0.05]]
UNCOND = [[-1.0], [-1.0, -2.0], [-5.0, -1.0, -1.0]]


def test_token_length_normalized_picks_best_mean():
    d = token_length_normalized(CHOICES, LOGPROBS)
    assert d.scores == pytest.approx([-0.1, -0.2, -0.5 / 3])
    assert d.decision == "organ" and d.index == 0
    assert d.meta_info["normalized_prompt_logprobs"] == pytest.approx(d.scores)


def test_greedy_token_selection_breaks_ties_on_later_tokens():
    # first tokens: -0.1, -0.1, -0.4 -> organ and organism tie; second: organ padded with its mean -0.1 vs -0.3
    assert greedy_token_selection(CHOICES, LOGPROBS).decision == "organ"
    # when the longer choice's second token beats the shorter one's mean, it wins
    assert greedy_token_selection(CHOICES, [[-0.5], [-0.5, -0.01], [-0.6, 0.0, 0.0]]).decision == "organism"
    # the highest first token wins even when its mean is worse
    d = greedy_token_selection(["a", "b"], [[-0.2, -9.0], [-0.3, -0.3]])
    assert d.decision == "a" and token_length_normalized(["a", "b"], [[-0.2, -9.0], [-0.3, -0.3]]).decision == "b"


def test_unconditional_likelihood_normalized():
    d = unconditional_likelihood_normalized(CHOICES, LOGPROBS, UNCOND)
    expected = [(-0.1 + 1.0) / 1, (-0.4 + 3.0) / 2, (-0.5 + 7.0) / 3]
    assert d.scores == pytest.approx(expected)
    assert d.decision == "antidisestablishmentarianism"
    assert d.meta_info["unconditional_token_logprobs"] == UNCOND
    with pytest.raises(braid.ProgramError, match="unconditional"):
        unconditional_likelihood_normalized(CHOICES, LOGPROBS)


def test_temperature_samples_in_proportion():
    rng = random.Random(0)
    picks = [token_length_normalized(["a", "b"], [[math.log(0.75)], [math.log(0.25)]], temperature=1.0, rng=rng).index
             for _ in range(2000)]
    assert 0.7 < picks.count(0) / len(picks) < 0.8


def test_empty_choice_scores_minus_infinity():
    d = token_length_normalized(["", "x"], [[], [-3.0]])
    assert d.decision == "x"


def test_resolve_choices_method():
    assert resolve_choices_method(None) is token_length_normalized
    assert resolve_choices_method("greedy_token_selection") is greedy_token_selection


def test_select_strategies_through_the_interpreter():
    lps = dict(zip(CHOICES, LOGPROBS))
    backend = ScriptedBackend(choice_logprobs=lambda prompt, c: lps[c])

    @braid.function
    def prog(s, method):
        s += "word: " + braid.select("w", CHOICES, choices_method=method)

    assert prog.run(method=token_length_normalized, backend=backend)["w"] == "organ"
    state = prog.run(method=unconditional_likelihood_normalized, backend=backend)
    # scripted unconditional logprobs: -0.5 per character -> scores 2.4, 1.8, 4.5
    assert state["w"] == "antidisestablishmentarianism"
    assert state.get_meta_info("w")["scores"] == pytest.approx([2.4, 1.8, 4.5])
    assert state.get_meta_info("w")["choices_method"] == "unconditional_likelihood_normalized"


def test_choices_regex_escapes_metacharacters():
    import re

    r = choices_regex(["1+1", "a (b)", "x|y", "plain text"])
    for c in ["1+1", "a (b)", "x|y", "plain text"]:
        assert re.fullmatch(r, c)
    assert not re.fullmatch(r, "11")


# ---- chat templates -------------------------------------------------------------------------------
def test_chatml_and_llama3_rendering():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert CHATML.render_messages(msgs, add_generation_prompt=True) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n")
    assert LLAMA3.render_messages(msgs) == (
        "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>")


def test_template_detection():
    assert chat_template_for(None, None) is CHATML
    assert chat_template_for("llama-3") is LLAMA3
    assert chat_template_for("{% for m in messages %}<|start_header_id|>{{ m.role }}...") is LLAMA3
    assert chat_template_for("{{ '<|im_start|>' + message['role'] }}") is CHATML
    assert chat_template_for(None, "/models/Meta-Llama-3-8B-Instruct") is LLAMA3
    assert chat_template_for(None, "smollm2") is CHATML
    assert chat_template_for("something unknown", "mystery-model") is CHATML
    assert get_chat_template("ChatML") is CHATML
    assert {"chatml", "llama-3"} <= set(list_chat_templates())
    with pytest.raises(braid.ProgramError, match="unknown chat template"):
        get_chat_template("nope")
    with pytest.raises(braid.ProgramError, match="no role"):
        CHATML.role_prefix("tool")
