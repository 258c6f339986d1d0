"""The shared program suite (tests/helpers/programs.py) on the scripted backend: checks the suite itself and
the interpreter paths it uses; the real backends run it from tests/integration."""

import pytest

from lang_scripted_backend import ScriptedBackend

PROGRAM_NAMES = ["few_shot_qa", "multi_turn_chat", "fork_branches", "json_extraction", "select", "gen_choices",
                 "regex_gen", "run_batch", "streaming", "fork_by_index", "post_run_variables", "typed_gen",
                 "api_speculative"]


def test_suite_lists_every_program(programs):
    assert sorted(programs.PROGRAMS) == sorted(PROGRAM_NAMES)


@pytest.mark.parametrize("name", PROGRAM_NAMES)
def test_shared_program_on_scripted_backend(programs, name):
    programs.PROGRAMS[name](ScriptedBackend())


def test_supported_programs_filters_by_capability(programs):
    from braid.backends.base import CAP_FORK, CAP_GEN, CAP_STREAM

    backend = ScriptedBackend(capabilities=frozenset({CAP_GEN, CAP_FORK, CAP_STREAM}))
    assert set(programs.supported_programs(backend)) == {"few_shot_qa", "multi_turn_chat", "fork_branches",
                                                         "run_batch", "streaming", "fork_by_index",
                                                         "post_run_variables", "api_speculative"}
