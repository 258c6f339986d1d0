"""A shared suite of small braid programs, run against every backend.

Each `program_*` function takes a backend (RuntimeEndpoint, Runtime, LocalEngine, OpenAI, ...),
runs one program on it and asserts properties any model must satisfy (constrained output matches its
regex/schema, select returns one of the choices, fork branches join, batch order is kept) — never a
particular answer. Programs are chat-style (gen inside assistant blocks) so chat endpoints run them too,
and keep max_tokens small so a CPU model finishes fast.

    from programs import PROGRAMS, supported_programs
    for name, program in supported_programs(backend).items():
        program(backend)
"""

from __future__ import annotations

import re
from typing import Any, Callable

import braid
from braid.backends.base import CAP_CHOICES_METHODS, CAP_JSON_SCHEMA, CAP_REGEX, CAP_SELECT, CAP_STREAM
from pydantic import BaseModel, Field

SYSTEM = "You are a helpful assistant. Answer briefly."


def _roles(state: braid.ProgramState) -> list[str]:
    return [m["role"] for m in state.messages()]


# ---- few-shot QA ------------------------------------------------------------------------------------
@braid.function
def few_shot_qa(s, question):
    s += braid.system("Answer each question with one word.")
    s += braid.user("Q: What is the capital of France?\nA: Paris\n"
                    "Q: What is the capital of Japan?\nA: Tokyo\n"
                    f"Q: {question}\nA:")
    s += braid.assistant(braid.gen("answer", max_tokens=8, stop="\n"))


def program_few_shot_qa(backend: Any) -> None:
    question = "What is the capital of Italy?"
    state = few_shot_qa.run(question=question, backend=backend, temperature=0)
    answer = state["answer"]
    assert isinstance(answer, str) and "\n" not in answer
    assert _roles(state) == ["system", "user", "assistant"]
    assert state.messages()[-1]["content"] == answer
    assert question in state.text() and answer in state.text()
    meta = state.get_meta_info("answer")
    assert meta["finish_reason"]["type"] in ("stop", "length")
    if "completion_tokens" in meta:
        assert 0 <= meta["completion_tokens"] <= 8


# ---- multi-turn chat --------------------------------------------------------------------------------
@braid.function
def multi_turn_chat(s, first, second):
    s += braid.system(SYSTEM)
    s += braid.user(first)
    s += braid.assistant(braid.gen("reply1", max_tokens=16))
    s += braid.user(second)
    s += braid.assistant(braid.gen("reply2", max_tokens=16))


def program_multi_turn_chat(backend: Any) -> None:
    first, second = "Name a color.", "Name a fruit."
    state = multi_turn_chat.run(first=first, second=second, backend=backend, temperature=0)
    assert _roles(state) == ["system", "user", "assistant", "user", "assistant"]
    msgs = state.messages()
    assert msgs[1]["content"] == first and msgs[3]["content"] == second
    assert msgs[2]["content"] == state["reply1"] and msgs[4]["content"] == state["reply2"]
    text = state.text()
    assert text.index(first) < text.index(second)
    for name in ("reply1", "reply2"):
        meta = state.get_meta_info(name)
        assert meta["finish_reason"]["type"] in ("stop", "length")


# ---- parallel branches with fork --------------------------------------------------------------------
@braid.function
def fork_branches(s, topic, n):
    s += braid.system(SYSTEM)
    s += braid.user(f"We will list {n} facts about {topic}.")
    s += braid.assistant("Sure.")
    forks = s.fork(n)
    forks += lambda i: braid.user(f"Fact number {i + 1}?") + braid.assistant(braid.gen("fact", max_tokens=12))
    forks.join()
    s += braid.user("Pick the best fact, in a few words.")
    s += braid.assistant(braid.gen("best", max_tokens=12))


def program_fork_branches(backend: Any) -> None:
    n = 3
    state = fork_branches.run(topic="the Moon", n=n, backend=backend, temperature=0)
    facts = state["fact"]
    assert isinstance(facts, list) and len(facts) == n and all(isinstance(f, str) for f in facts)
    assert isinstance(state["best"], str)
    # branch text stays in the branches: the parent continues from the fork point
    assert "Fact number" not in state.text()
    assert _roles(state) == ["system", "user", "assistant", "user", "assistant"]


# ---- JSON extraction with a pydantic schema ---------------------------------------------------------
class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=150)


@braid.function
def extract_person(s, sentence):
    s += braid.system("Extract the person as JSON.")
    s += braid.user(sentence)
    s += braid.assistant(braid.gen("person", max_tokens=64, json_schema=Person))


def program_json_extraction(backend: Any) -> None:
    state = extract_person.run(sentence="Alice is 30 years old.", backend=backend, temperature=0)
    person = Person.model_validate_json(state["person"])
    assert isinstance(person.name, str) and 0 <= person.age <= 150


# ---- select -----------------------------------------------------------------------------------------
@braid.function
def yes_no(s, question, method):
    s += braid.system(SYSTEM)
    s += braid.user(question + " Answer yes or no.")
    s += braid.assistant(braid.select("answer", ["yes", "no"], choices_method=method))


def program_select(backend: Any) -> None:
    methods = [braid.token_length_normalized]
    if backend_supports(backend, CAP_CHOICES_METHODS):
        methods += [braid.greedy_token_selection, braid.unconditional_likelihood_normalized]
    for method in methods:
        state = yes_no.run(question="Is the sky blue?", method=method, backend=backend)
        assert state["answer"] in ("yes", "no")
        assert state.text().count(state["answer"]) >= 1
        assert state.messages()[-1]["content"] == state["answer"]


@braid.function
def pick_city(s):
    s += braid.system(SYSTEM)
    s += braid.user("Which of these is a city in France?")
    s += braid.assistant(braid.gen("city", choices=["Paris", "Berlin", "Madrid", "Rome"]))


def program_gen_choices(backend: Any) -> None:
    state = pick_city.run(backend=backend)
    assert state["city"] in ("Paris", "Berlin", "Madrid", "Rome")


# ---- regex-constrained gen --------------------------------------------------------------------------
PHONE = r"\d{3}-\d{4}"
IPV4 = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"


@braid.function
def constrained(s):
    s += braid.system(SYSTEM)
    s += braid.user("Make up a phone number.")
    s += braid.assistant(braid.gen("phone", max_tokens=16, regex=PHONE))
    s += braid.user("What is the IP address of a local machine?")
    s += braid.assistant(braid.gen("ip", max_tokens=24, regex=IPV4))
    s += braid.user("How many legs does a spider have?")
    s += braid.assistant(braid.gen_int("legs", max_tokens=4))


def program_regex_gen(backend: Any) -> None:
    state = constrained.run(backend=backend, temperature=0)
    assert re.fullmatch(PHONE, state["phone"]), state["phone"]
    assert re.fullmatch(IPV4, state["ip"]), state["ip"]
    assert isinstance(state["legs"], int)


# ---- run_batch --------------------------------------------------------------------------------------
@braid.function
def short_answer(s, question):
    s += braid.system(SYSTEM)
    s += braid.user(question)
    s += braid.assistant(braid.gen("answer", max_tokens=8))


def program_run_batch(backend: Any) -> None:
    questions = [f"What is {i} plus {i}?" for i in range(8)]
    results = short_answer.run_batch([{"question": q} for q in questions], backend=backend,
                                     progress_bar=False, temperature=0)
    assert len(results) == len(questions)
    for question, state in zip(questions, results):
        assert isinstance(state, braid.ProgramState), state
        assert state.messages()[1]["content"] == question
        assert isinstance(state["answer"], str)


# ---- streaming --------------------------------------------------------------------------------------
def program_streaming(backend: Any) -> None:
    state = short_answer.run(question="Say hello.", backend=backend, stream=True, temperature=0)
    streamed = "".join(state.text_iter("answer"))
    assert streamed == state["answer"]
    assert state.text().endswith(state["answer"] + state.chat_template.role_suffix("assistant"))


# ---- fork branches appended to by index (forks[i] += ..., forks += [...]) ----------------------------
@braid.function
def fork_by_index(s, n):
    s += braid.system(SYSTEM)
    s += braid.user("Name a color.")
    forks = s.fork(n)
    for i in range(n):
        forks[i] += braid.assistant(braid.gen("color", max_tokens=8))
    forks += [braid.user(f"Why color {i + 1}?") for i in range(n)]
    forks.join()


def program_fork_by_index(backend: Any) -> None:
    n = 2
    state = fork_by_index.run(n=n, backend=backend, temperature=0)
    colors = state["color"]
    assert isinstance(colors, list) and len(colors) == n and all(isinstance(c, str) for c in colors)
    assert _roles(state) == ["system", "user"]  # branch turns stay in the branches


# ---- variables written after run() ------------------------------------------------------------------
def program_post_run_variables(backend: Any) -> None:
    state = short_answer.run(question="Say hi.", backend=backend, temperature=0)
    answer, text = state["answer"], state.text()
    state["note"] = "checked"
    state["answer_len"] = len(answer)
    state["answer"] = answer.upper()
    assert state["note"] == "checked" and "note" in state
    assert state.variables()["answer_len"] == len(answer)
    assert state["answer"] == answer.upper()
    assert state.text() == text  # assignments do not append text


# ---- typed gens (dtype int / float / bool / str) ---------------------------------------------------
@braid.function
def typed_answers(s):
    s += braid.system(SYSTEM)
    s += braid.user("How many legs does a spider have? Answer with a number.")
    s += braid.assistant(braid.gen("legs", dtype=int, max_tokens=24))
    s += braid.user("What is half of three? Answer with a number.")
    s += braid.assistant(braid.gen("half", dtype=float, max_tokens=40))
    s += braid.user("Is the sky blue? Answer True or False.")
    s += braid.assistant(braid.gen("sky", dtype=bool, max_tokens=4))
    s += braid.user("Name a color, in double quotes.")
    s += braid.assistant(braid.gen("color", dtype=str, max_tokens=16))


def program_typed_gen(backend: Any) -> None:
    from braid import ir

    state = typed_answers.run(backend=backend, temperature=0)
    replies = [m["content"] for m in state.messages() if m["role"] == "assistant"]
    assert isinstance(state["legs"], int) and re.fullmatch(ir.REGEX_INT, replies[0]), replies[0]
    assert int(replies[0]) == state["legs"]
    assert isinstance(state["half"], float) and re.fullmatch(ir.REGEX_FLOAT, replies[1]), replies[1]
    assert isinstance(state["sky"], bool) and replies[2] == str(state["sky"])
    assert isinstance(state["color"], str)
    for name in ("legs", "half"):  # a number ends by itself (at most 19 digits, one space or newline)
        assert state.get_meta_info(name)["finish_reason"]["type"] == "stop", state.get_meta_info(name)


# ---- API speculative execution ----------------------------------------------------------------------
@braid.function(num_api_spec_tokens=32)
def speculative_split(s, topic):
    s += braid.system(SYSTEM)
    s += braid.user(f"Describe {topic} in one sentence.")
    s += braid.assistant(braid.gen("first_word", max_tokens=8, stop=" ") + " "
                         + braid.gen("rest", max_tokens=32, stop="\n"))


def program_api_speculative(backend: Any) -> None:
    usage = braid.defaults.as_backend(backend).token_usage
    prompt_tokens_before = usage.prompt_tokens
    state = speculative_split.run(topic="the Moon", backend=backend, temperature=0)
    first, rest = state["first_word"], state["rest"]
    assert " " not in first and "\n" not in rest
    assert state.messages()[-1]["content"] == first + " " + rest
    assert _roles(state) == ["system", "user", "assistant"]
    assert usage.prompt_tokens > prompt_tokens_before  # token_usage counts every call


PROGRAMS: dict[str, Callable[[Any], None]] = {
    "few_shot_qa": program_few_shot_qa,
    "multi_turn_chat": program_multi_turn_chat,
    "fork_branches": program_fork_branches,
    "json_extraction": program_json_extraction,
    "select": program_select,
    "gen_choices": program_gen_choices,
    "regex_gen": program_regex_gen,
    "run_batch": program_run_batch,
    "streaming": program_streaming,
    "fork_by_index": program_fork_by_index,
    "post_run_variables": program_post_run_variables,
    "typed_gen": program_typed_gen,
    "api_speculative": program_api_speculative,
}

REQUIRES: dict[str, set[str]] = {
    "json_extraction": {CAP_JSON_SCHEMA},
    "select": {CAP_SELECT},
    "gen_choices": {CAP_SELECT},
    "regex_gen": {CAP_REGEX},
    "streaming": {CAP_STREAM},
    "typed_gen": {CAP_REGEX},
}


def backend_supports(backend: Any, capability: str) -> bool:
    return braid.defaults.as_backend(backend).supports(capability)


def supported_programs(backend: Any) -> dict[str, Callable[[Any], None]]:
    """The programs whose required capabilities `backend` declares."""
    return {name: fn for name, fn in PROGRAMS.items()
            if all(backend_supports(backend, cap) for cap in REQUIRES.get(name, ()))}
