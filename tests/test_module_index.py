"""docs/architecture.md's index of which tests cover which package is the one tests/helpers/module_index.py draws from the
tests' imports (a new test file or a new import changes it: run `python tests/helpers/module_index.py` and paste)."""

from pathlib import Path

from module_index import BEGIN, END, markdown

ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def test_the_index_in_the_docs_is_current():
    text = ARCHITECTURE.read_text()
    assert BEGIN in text and END in text, "docs/architecture.md has no module index"
    shown = text[text.index(BEGIN):text.index(END) + len(END)]
    assert shown == markdown(), "docs/architecture.md's module index is stale: run `python tests/helpers/module_index.py`"


def test_the_index_names_the_parts_a_reader_looks_for():
    table = markdown()
    for part in ("`runtime/scheduler`", "`runtime/server`", "`runtime/constrained`", "`lang`", "`backends`"):
        assert part in table
    assert "`server/test_server_protocol.py`" in table.split("`runtime/server`", 1)[1].split("\n", 1)[0]
