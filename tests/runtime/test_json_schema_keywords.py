"""Every JSON schema keyword is enforced by the generated regex or refused: exhaustive integer ranges, number
bounds, random regex samples validated by `jsonschema`, refusals that name the keyword, and one SmolLM2 run."""

import datetime
import json
import random
import re
import warnings
from fractions import Fraction
from typing import Literal, Optional, Union

import jsonschema
import pytest

with warnings.catch_warnings():  # the regex parser behind `re`, used to sample strings from the generated regexes
    warnings.simplefilter("ignore", DeprecationWarning)
    import sre_constants
    import sre_parse

from braid.runtime.constrained import GrammarError, json_schema_to_regex
from braid.runtime.constrained.numeric_range import integer_range_regex, number_range_regex

SAMPLE_ALPHABET = "abcxyz019 .-_\"\\/é"


def sample_from_regex(regex: str, rng: random.Random, max_repeat: int = 4) -> str:
    """One random string of the regex's language (repeats capped at max_repeat beyond their minimum)."""
    out: list[str] = []

    def emit(items):
        for op, arg in items:
            if op is sre_constants.LITERAL:
                out.append(chr(arg))
            elif op is sre_constants.IN:
                out.append(pick_from_class(arg))
            elif op is sre_constants.ANY:
                out.append(rng.choice("abc019"))
            elif op is sre_constants.BRANCH:
                emit(rng.choice(arg[1]))
            elif op is sre_constants.SUBPATTERN:
                emit(arg[-1])
            elif op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT):
                low, high, body = arg
                high = low + max_repeat if high is sre_constants.MAXREPEAT else min(high, low + max_repeat)
                for _ in range(rng.randint(low, high)):
                    emit(body)
            elif op is sre_constants.AT:
                continue
            else:
                raise NotImplementedError(op)

    def pick_from_class(items):
        negated = items and items[0][0] is sre_constants.NEGATE
        candidates = []
        for op, arg in items[1:] if negated else items:
            if op is sre_constants.LITERAL:
                candidates.append(chr(arg))
            elif op is sre_constants.RANGE:
                candidates.extend(chr(c) for c in range(arg[0], min(arg[1], arg[0] + 60) + 1))
            elif op is sre_constants.CATEGORY and arg is sre_constants.CATEGORY_DIGIT:
                candidates.extend("0123456789")
        if negated:
            candidates = [c for c in SAMPLE_ALPHABET if c not in candidates]
        return rng.choice(candidates)

    emit(sre_parse.parse(regex))
    return "".join(out)


# ---------------------------------------------------------------------------------------------- integer ranges

INTEGER_BOUNDS = [None, -1000, -101, -100, -99, -10, -9, -1, 0, 1, 9, 10, 11, 99, 100, 120, 999, 1000, 12345]


@pytest.mark.parametrize("minimum", INTEGER_BOUNDS)
def test_integer_range_regex_matches_exactly_the_range(minimum):
    for maximum in INTEGER_BOUNDS:
        regex = integer_range_regex(minimum, maximum)
        if minimum is not None and maximum is not None and minimum > maximum:
            assert regex is None
            continue
        pattern = re.compile(regex)
        for value in range(-1300, 13000 if maximum in (None, 12345) else 1300):
            inside = (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
            assert bool(pattern.fullmatch(str(value))) == inside, (minimum, maximum, value, regex)
        for non_canonical in ("-0", "00", "01", "-01", "+1", "1.0", ""):
            assert not pattern.fullmatch(non_canonical), (minimum, maximum, non_canonical)


def test_integer_range_regex_open_ends_and_huge_bounds():
    assert integer_range_regex(0, None) == "([0-9]|[1-9][0-9]{1,18})"  # minimum 0: no minus sign at all
    assert not re.fullmatch(integer_range_regex(1, None), "0")
    big = re.compile(integer_range_regex(None, None))
    assert big.fullmatch(str(10 ** 19 - 1)) and big.fullmatch(str(-(10 ** 19 - 1)))
    assert not big.fullmatch(str(10 ** 19))  # digit runs stay bounded (19 digits), as for plain integers
    near = re.compile(integer_range_regex(10 ** 12 - 3, 10 ** 12 + 3))
    assert [v for v in range(10 ** 12 - 10, 10 ** 12 + 10) if near.fullmatch(str(v))] == list(
        range(10 ** 12 - 3, 10 ** 12 + 4))


NUMBER_TEXTS = ["0", "0.0", "0.5", "0.001", "1", "1.0", "1.00", "1.5", "2", "2.0", "2.01", "9.99", "10", "10.0",
                "10.5", "100.0000", "-0.5", "-1", "-1.0", "-1.5", "-2.0", "-2.5", "-9.9", "-10", "-10.0", "-10.1"]
NUMBER_BOUNDS = [None, -10, -2, -1, 0, 1, 2, 10]


@pytest.mark.parametrize("minimum", NUMBER_BOUNDS)
def test_number_range_regex_matches_exactly_the_bounds(minimum):
    for maximum in NUMBER_BOUNDS:
        for minimum_exclusive in (False, True):
            for maximum_exclusive in (False, True):
                regex = number_range_regex(minimum, minimum_exclusive, maximum, maximum_exclusive)
                pattern = re.compile(regex) if regex else None
                for text in NUMBER_TEXTS:
                    value = Fraction(text)
                    inside = ((minimum is None or (value > minimum if minimum_exclusive else value >= minimum)) and
                              (maximum is None or (value < maximum if maximum_exclusive else value <= maximum)))
                    matched = bool(pattern and pattern.fullmatch(text))
                    assert matched == inside, (minimum, minimum_exclusive, maximum, maximum_exclusive, text, regex)


# ------------------------------------------------------------------------------------- schemas: enforced keywords

ENFORCED_SCHEMAS = {
    "integer_bounds": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                                        "delta": {"type": "integer", "minimum": -50, "maximum": -3},
                                                        "count": {"type": "integer", "exclusiveMinimum": 0}},
                       "required": ["age", "delta", "count"]},
    "integer_fractional_bounds": {"type": "integer", "minimum": -2.5, "exclusiveMaximum": 7.0, "multipleOf": 1},
    "number_bounds": {"type": "object", "properties": {
        "p": {"type": "number", "minimum": 0, "maximum": 1},
        "t": {"type": "number", "exclusiveMinimum": -40, "exclusiveMaximum": 60},
        "w": {"type": "number", "minimum": 0},
        "n": {"type": "number", "maximum": -1}}, "required": ["p", "t", "w", "n"]},
    "number_multiple_of_one": {"type": "number", "minimum": 3, "multipleOf": 1},
    "nullable_bounded": {"type": ["integer", "null"], "minimum": 5, "maximum": 9},
    "untyped_bounds": {"minimum": 10, "maximum": 12},
    "strings": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}, "name": {"type": "string", "minLength": 2,
                                                                              "maxLength": 5},
        "day": {"type": "string", "format": "date"},
        "url": {"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083},  # pydantic's AnyUrl
        "short": {"type": "string", "pattern": "[a-z]{2,4}", "minLength": 2, "maxLength": 4}},
                "required": ["code", "name", "day", "url", "short"]},
    "formats": {"type": "object", "properties": {
        name: {"type": "string", "format": name} for name in ("date", "time", "date-time", "uuid", "ipv4", "email",
                                                              "uri")}, "required": ["date", "date-time", "email"]},
    "arrays": {"type": "object", "properties": {
        "xs": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 6}, "minItems": 2,
               "maxItems": 4},
        "pair": {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0}, {"type": "boolean"}],
                 "minItems": 2},
        "one": {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True, "maxItems": 1}},
        "required": ["xs", "pair", "one"]},
    "objects": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 3}, "b": {"type": "boolean"}, "c": {"type": "null"}},
        "required": ["a", "b"], "minProperties": 2, "maxProperties": 3, "additionalProperties": False,
        "dependentRequired": {"c": ["a"]}},
    "map": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9}},
    "combinators": {"$defs": {"Small": {"type": "integer", "minimum": -3, "maximum": 3}}, "type": "object",
                    "properties": {"s": {"$ref": "#/$defs/Small"},
                                   "u": {"anyOf": [{"$ref": "#/$defs/Small"}, {"type": "string", "maxLength": 2}]},
                                   "o": {"oneOf": [{"type": "integer", "minimum": 100, "maximum": 200},
                                                   {"type": "boolean"}]},
                                   "d": {"oneOf": [{"type": "object", "properties": {"k": {"enum": ["a"]}},
                                                    "required": ["k"]},
                                                   {"type": "object", "properties": {"k": {"const": "b"},
                                                                                     "x": {"type": "null"}},
                                                    "required": ["k", "x"]}]},
                                   "w": {"allOf": [{"type": "integer", "minimum": 7, "maximum": 8}]},
                                   "e": {"type": "integer", "enum": [1, 5, 7]},
                                   "k": {"type": "string", "const": "fixed"}},
                    "required": ["s", "u", "o", "d", "w", "e", "k"]},
}


@pytest.mark.parametrize("name", sorted(ENFORCED_SCHEMAS))
def test_random_regex_samples_validate(name):
    schema = ENFORCED_SCHEMAS[name]
    regex = json_schema_to_regex(schema)
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    rng = random.Random(name)
    for _ in range(300):
        text = sample_from_regex(regex, rng)
        assert re.fullmatch(regex, text), text
        value = json.loads(text)
        errors = [e.message for e in validator.iter_errors(value)]
        assert not errors, (text, errors)


def test_date_formats_are_exact_calendar_dates():
    date_regex = re.compile(json_schema_to_regex({"type": "string", "format": "date"}))
    date_time_regex = re.compile(json_schema_to_regex({"type": "string", "format": "date-time"}))
    for year in (1, 1899, 1900, 1999, 2000, 2023, 2024, 2100, 2400, 9999):
        for month in range(1, 13):
            for day in range(1, 33):
                text = f"{year:04d}-{month:02d}-{day:02d}"
                try:
                    datetime.date(year, month, day)
                    valid = True
                except ValueError:
                    valid = False
                assert bool(date_regex.fullmatch(f'"{text}"')) == valid, text
                assert bool(date_time_regex.fullmatch(f'"{text}T23:59:59.5+01:00"')) == valid, text
    assert not date_regex.fullmatch('"0000-01-01"')
    assert not date_time_regex.fullmatch('"2024-01-01T00:00:00"')  # RFC 3339 needs the offset
    rng = random.Random(1)
    for _ in range(200):
        text = json.loads(sample_from_regex(date_time_regex.pattern, rng))
        assert datetime.datetime.fromisoformat(text).tzinfo is not None, text


def test_out_of_range_values_do_not_match():
    regex = json_schema_to_regex(ENFORCED_SCHEMAS["integer_bounds"])
    assert re.fullmatch(regex, '{"age":120,"delta":-3,"count":1}')
    for bad in ('{"age":121,"delta":-3,"count":1}', '{"age":-1,"delta":-3,"count":1}',
                '{"age":1811944871226391522,"delta":-3,"count":1}', '{"age":5,"delta":-2,"count":1}',
                '{"age":5,"delta":-51,"count":1}', '{"age":5,"delta":-3,"count":0}'):
        assert not re.fullmatch(regex, bad), bad
    numbers = json_schema_to_regex(ENFORCED_SCHEMAS["number_bounds"])
    assert re.fullmatch(numbers, '{"p":1.0,"t":-39.99,"w":1e5,"n":-1}'.replace("1e5", "12.5"))
    for bad in ('{"p":1.01,"t":0,"w":0,"n":-1}', '{"p":0,"t":-40,"w":0,"n":-1}', '{"p":0,"t":60.0,"w":0,"n":-1}',
                '{"p":0,"t":0,"w":-0.5,"n":-1}', '{"p":0,"t":0,"w":0,"n":-0.99}'):
        assert not re.fullmatch(numbers, bad), bad


def test_pydantic_bounded_fields():
    pydantic = pytest.importorskip("pydantic")

    class Cat(pydantic.BaseModel):
        kind: Literal["cat"]
        lives: pydantic.conint(ge=1, le=9)

    class Dog(pydantic.BaseModel):
        kind: Literal["dog"]
        good: bool

    class Person(pydantic.BaseModel):
        age: pydantic.conint(ge=0, le=120)
        height: float = pydantic.Field(gt=0, le=3)
        kids: Optional[int] = pydantic.Field(default=None, ge=0, lt=20)
        pet: Union[Cat, Dog] = pydantic.Field(discriminator="kind")
        pair: tuple[int, str]

    schema = Person.model_json_schema()
    regex = json_schema_to_regex(Person)
    rng = random.Random(0)
    for _ in range(300):
        text = sample_from_regex(regex, rng)
        jsonschema.validate(json.loads(text), schema)
        Person.model_validate_json(text)
    assert re.fullmatch(regex, '{"age":120,"height":3,"kids":19,"pet":{"kind":"cat","lives":9},"pair":[1,"a"]}')
    assert not re.fullmatch(regex, '{"age":121,"height":3,"pet":{"kind":"cat","lives":9},"pair":[1,"a"]}')
    assert not re.fullmatch(regex, '{"age":1,"height":0,"pet":{"kind":"cat","lives":9},"pair":[1,"a"]}')
    assert not re.fullmatch(regex, '{"age":1,"height":1,"kids":20,"pet":{"kind":"dog","good":true},"pair":[1,"a"]}')


# --------------------------------------------------------------------------------------- schemas: refused keywords

REFUSED = [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "integer", "multipleOf": 5}, "multipleOf"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"type": "number", "minimum": 0.5}, "minimum"),
    ({"type": "number", "exclusiveMaximum": 2.25}, "maximum"),
    ({"type": "integer", "minimum": 0, "exclusiveMinimum": True}, "exclusiveMinimum"),
    ({"type": "integer", "minimum": 10, "maximum": 3}, "minimum"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "integer", "if": {"minimum": 0}, "then": {"maximum": 3}}, "if"),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, "patternProperties"),
    ({"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames"),
    ({"type": "object", "minProperties": 1}, "minProperties"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "minProperties": 1}, "minProperties"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "maxProperties": 1},
     "maxProperties"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["zz"]}, "required"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 3}, "prefixItems"),
    ({"type": "string", "pattern": "[a-z]+", "maxLength": 3}, "pattern"),
    ({"type": "string", "format": "date", "maxLength": 8}, "format"),
    ({"type": "string", "format": "date", "pattern": "[0-9]+"}, "pattern"),
    ({"type": "string", "format": "hostname"}, "format"),
    ({"type": "string", "pattern": "a.*"}, "pattern"),
    ({"type": "string", "pattern": "[^,]+"}, "pattern"),
    ({"type": "string", "pattern": r"\s+"}, "pattern"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf"),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}], "type": "string"}, "anyOf"),
    ({"$defs": {"A": {"type": "integer"}}, "$ref": "#/$defs/A", "maximum": 3}, "$ref"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"oneOf": [{"type": "object", "properties": {"k": {"enum": ["a"]}}, "required": ["k"]},
                {"type": "object", "properties": {"k": {"const": "a"}, "x": {"type": "null"}}, "required": ["k"]}]},
     "oneOf"),
    ({"type": "string", "nullable": True}, "nullable"),
    ({"type": "string", "enum": ["a", 3]}, "enum"),
    ({"type": "integer", "minimumValue": 3}, "minimumValue"),
]


@pytest.mark.parametrize("schema,keyword", REFUSED, ids=[json.dumps(s)[:60] for s, _ in REFUSED])
def test_unenforceable_keywords_are_refused_by_name(schema, keyword):
    with pytest.raises(GrammarError, match=re.escape(f"'{keyword}'")):
        json_schema_to_regex(schema)


def test_refusal_inside_nested_definitions_names_the_path():
    schema = {"$defs": {"Item": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
              "type": "object", "properties": {"items": {"$ref": "#/$defs/Item"}}}
    with pytest.raises(GrammarError, match=r"'uniqueItems' at #/\$defs/Item"):
        json_schema_to_regex(schema)


# ------------------------------------------------------------------------------------------------ SmolLM2 engine

def test_engine_sampling_respects_integer_and_number_bounds():
    """At temperature 1.0 every output validates; before, 'age' came out as 1811944871226391522."""
    from braid.runtime import Engine

    schema = {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "floor": {"type": "integer", "minimum": -3, "exclusiveMaximum": 40},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["age", "floor", "ratio"]}
    count = 16
    with Engine(model_path="smollm2", log_level="warning", max_total_tokens=4096, max_running_requests=16) as engine:
        params = [{"temperature": 1.0, "max_new_tokens": 64, "json_schema": json.dumps(schema), "seed": i}
                  for i in range(count)]
        results = engine.generate(["Describe a person as JSON: "] * count, params)
        with pytest.raises(ValueError, match="uniqueItems"):
            engine.generate("x", {"max_new_tokens": 4, "json_schema": json.dumps(
                {"type": "array", "items": {"type": "integer"}, "uniqueItems": True})})
    assert len(results) == count
    for result in results:
        assert result["meta_info"]["finish_reason"]["type"] == "stop", result["text"]
        jsonschema.validate(json.loads(result["text"]), schema)
