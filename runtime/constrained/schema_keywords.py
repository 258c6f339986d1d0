"""Every JSON schema keyword is either enforced by the generated regex or refused with a GrammarError naming it.

outlines-core drops several keywords without a word (numeric bounds, uniqueItems, minProperties, sibling keywords next
to $ref/anyOf, a pattern next to maxLength, allOf beyond one branch...). `checked_schema` walks the whole document
before outlines-core sees it: it refuses what no regex here enforces, rewrites type lists into anyOf branches, and
replaces each bounded integer/number schema by a string constant whose quoted text json_schema.py swaps for an exact
range regex (numeric_range.py) after outlines-core built the rest.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import warnings

from .grammar_errors import GrammarError
from .numeric_range import integer_range_regex, number_range_regex

with warnings.catch_warnings():  # the parser behind `re` measures and inspects `pattern`s
    warnings.simplefilter("ignore", DeprecationWarning)
    import sre_constants
    import sre_parse

ANNOTATION_KEYWORDS = frozenset({"title", "description", "$schema", "$id", "$comment", "default", "examples",
                                 "deprecated", "readOnly", "writeOnly", "discriminator"})
DEFINITION_KEYWORDS = ("$defs", "definitions")
COMBINATOR_KEYWORDS = ("$ref", "anyOf", "oneOf", "allOf", "enum", "const")
TYPE_KEYWORDS = {
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "integer": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}),
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}),
    "array": frozenset({"items", "prefixItems", "minItems", "maxItems", "uniqueItems"}),
    "object": frozenset({"properties", "required", "additionalProperties", "minProperties", "maxProperties",
                         "dependentRequired"}),
    "boolean": frozenset(),
    "null": frozenset(),
}
REFUSED_KEYWORDS = {
    "not": "a regex cannot express 'not' here",
    "if": "conditional schemas (if/then/else) are not supported",
    "then": "conditional schemas (if/then/else) are not supported",
    "else": "conditional schemas (if/then/else) are not supported",
    "patternProperties": "property names matching a pattern are not generated; list the properties instead",
    "propertyNames": "constraints on property names are not supported; list the properties instead",
    "dependentSchemas": "dependent schemas are not supported",
    "dependencies": "dependencies are not supported",
    "contains": "'contains' is not supported",
    "minContains": "'contains' is not supported",
    "maxContains": "'contains' is not supported",
    "unevaluatedProperties": "unevaluatedProperties is not supported",
    "unevaluatedItems": "unevaluatedItems is not supported",
    "nullable": "OpenAPI 'nullable' is not JSON schema; use \"type\": [..., \"null\"] or anyOf with {\"type\": \"null\"}",
    "$dynamicRef": "dynamic references are not supported",
    "$anchor": "anchors are not supported; use $defs and $ref",
}
_PYTHON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
                 "null": (type(None),), "array": (list,), "object": (dict,)}
PLACEHOLDER_PREFIX = "BRAID_NUMERIC_RANGE_"

# Formats as patterns: exact calendar dates (month lengths, leap years) and RFC 3339 times with an offset, where
# outlines-core's own regexes admit 2021-04-31, offset-less date-times, and (email, uri, time) characters that break
# the JSON string. email and uri are safe subsets: every text they admit is a valid address.
_YEAR = "(000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"
_DATE = (f"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
         "|02-(0[1-9]|1[0-9]|2[0-8]))"
         "|([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)-02-29)")
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,9})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_URI_CHARS = "a-zA-Z0-9._%!$'()*+,;=:@-"
FORMAT_PATTERNS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}T{_TIME}",
    "uuid": "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
    "ipv4": rf"({_OCTET}\.){{3}}{_OCTET}",
    "email": r"[a-zA-Z0-9_%+-]{1,32}(\.[a-zA-Z0-9_%+-]{1,32}){0,3}@([a-zA-Z0-9]([a-zA-Z0-9-]{0,30}[a-zA-Z0-9])?\.)"
             "{1,4}[a-zA-Z]{2,12}",
    "uri": rf"(https?|ftp)://[a-zA-Z0-9]([a-zA-Z0-9.-]{{0,60}}[a-zA-Z0-9])?(:[0-9]{{1,5}})?(/[{_URI_CHARS}]{{0,40}}){{0,8}}"
           rf"(\?[/?{_URI_CHARS}]{{0,60}})?(#[/?{_URI_CHARS}]{{0,40}})?",
}


def checked_schema(document: dict) -> tuple[dict, dict[str, str]]:
    """(schema for outlines-core, {placeholder string: numeric regex to put in place of its quoted text})."""
    checker = _Checker(document)
    return checker.schema(document, "#"), checker.numeric_regexes


def _refuse(path: str, keyword: str, reason: str):
    raise GrammarError(f"JSON schema keyword '{keyword}' at {path}: {reason}")


class _Checker:
    def __init__(self, document: dict):
        self.document = document
        self.numeric_regexes: dict[str, str] = {}

    def schema(self, node, path: str):
        if node is True:
            return {}
        if not isinstance(node, dict):
            raise GrammarError(f"JSON schema at {path} must be an object or true, got {node!r}")
        for key in node:
            if key in REFUSED_KEYWORDS:
                _refuse(path, key, REFUSED_KEYWORDS[key])
            known = (key in ANNOTATION_KEYWORDS or key in DEFINITION_KEYWORDS or key in COMBINATOR_KEYWORDS
                     or key == "type" or any(key in keywords for keywords in TYPE_KEYWORDS.values()))
            if not known:
                _refuse(path, key, "unknown keyword; braid refuses what it cannot enforce")
        kept = {key: node[key] for key in node if key in ANNOTATION_KEYWORDS}
        for key in DEFINITION_KEYWORDS:
            if key in node:
                if not isinstance(node[key], dict):
                    _refuse(path, key, "must map names to schemas")
                kept[key] = {name: self.schema(sub, f"{path}/{key}/{name}") for name, sub in node[key].items()}
        combinators = [key for key in COMBINATOR_KEYWORDS if key in node]
        constraints = [key for key in node if key not in kept and key not in combinators]
        if "enum" in node or "const" in node:
            return {**kept, **self.enum(node, path, combinators, constraints)}
        if combinators:
            if len(combinators) > 1 or constraints:
                others = sorted(set(combinators[1:]) | set(constraints))
                _refuse(path, combinators[0], f"cannot be combined with sibling keywords {others}; "
                                              "move them into the referenced or listed schemas")
            return {**kept, **self.combinator(node, combinators[0], path)}
        types = node.get("type")
        if types is None:
            families = {name for name, keywords in TYPE_KEYWORDS.items() if keywords & set(constraints)}
            families.discard("integer")  # numeric keywords imply "number", which includes the integers
            if not families:
                return {**kept}
            if len(families) > 1:
                raise GrammarError(f"JSON schema at {path} has keywords of several types ({sorted(constraints)}) "
                                   "but no 'type'; give one")
            types = families.pop()
        if isinstance(types, str):
            types = [types]
        if not isinstance(types, list) or not types or not all(t in TYPE_KEYWORDS for t in types):
            _refuse(path, "type", f"expected one of {sorted(TYPE_KEYWORDS)} or a non-empty list of them, got {types!r}")
        branches = [self.typed(node, t, path) for t in dict.fromkeys(types)]
        return {**kept, **branches[0]} if len(branches) == 1 else {**kept, "anyOf": branches}

    def enum(self, node: dict, path: str, combinators: list[str], constraints: list[str]) -> dict:
        keyword = "const" if "const" in node else "enum"
        if "const" in node and "enum" in node or len(combinators) > 1:
            _refuse(path, keyword, f"cannot be combined with {[c for c in combinators if c != keyword]}")
        values = [node["const"]] if keyword == "const" else node["enum"]
        if not isinstance(values, list) or not values:
            _refuse(path, "enum", "must be a non-empty list")
        if set(constraints) - {"type"}:
            _refuse(path, keyword, f"cannot be combined with {sorted(set(constraints) - {'type'})}; "
                                   "list only the allowed values")
        if "type" in node:
            types = node["type"] if isinstance(node["type"], list) else [node["type"]]
            for value in values:
                if not any(_has_type(value, t) for t in types):
                    _refuse(path, keyword, f"value {value!r} is not of type {node['type']!r}")
        return {keyword: node[keyword]}

    def combinator(self, node: dict, keyword: str, path: str) -> dict:
        if keyword == "$ref":
            if not isinstance(node["$ref"], str) or not node["$ref"].startswith("#"):
                _refuse(path, "$ref", f"only references inside the schema (#/...) are supported, got {node['$ref']!r}")
            return {"$ref": node["$ref"]}
        branches = node[keyword]
        if not isinstance(branches, list) or not branches:
            _refuse(path, keyword, "must be a non-empty list of schemas")
        checked = [self.schema(branch, f"{path}/{keyword}/{i}") for i, branch in enumerate(branches)]
        if keyword == "allOf":
            if len(checked) > 1:
                _refuse(path, "allOf", "more than one schema to intersect is not supported; merge them into one")
            return {"allOf": checked}
        if keyword == "oneOf":
            for (i, first), (j, second) in itertools.combinations(enumerate(branches), 2):
                if not self.disjoint(first, second):
                    _refuse(path, "oneOf", f"branches {i} and {j} may both match one value, which oneOf forbids and "
                                           "a regex cannot exclude; use anyOf, or tell them apart by type or by a "
                                           "required property with different 'const' values")
        return {"anyOf": checked}

    def resolve(self, node):
        seen = 0
        while isinstance(node, dict) and isinstance(node.get("$ref"), str) and seen < 32:
            target = self.document
            for part in node["$ref"].lstrip("#").strip("/").split("/"):
                if not part:
                    continue
                if not isinstance(target, dict) or part not in target:
                    return None
                target = target[part]
            node, seen = target, seen + 1
        return node

    def disjoint(self, first, second) -> bool:
        first, second = self.resolve(first), self.resolve(second)
        if not isinstance(first, dict) or not isinstance(second, dict):
            return False
        first_types, second_types = _type_set(first), _type_set(second)
        if first_types is not None and second_types is not None and not first_types & second_types:
            return True
        if _single_values(first) and _single_values(second):
            return _single_values(first) != _single_values(second)
        common = set(first.get("required", [])) & set(second.get("required", []))
        for name in common:
            a = _single_values(self.resolve(first.get("properties", {}).get(name)))
            b = _single_values(self.resolve(second.get("properties", {}).get(name)))
            if a and b and a != b:
                return True
        return False

    def typed(self, node: dict, type_name: str, path: str) -> dict:
        keywords = {key: node[key] for key in TYPE_KEYWORDS[type_name] if key in node}
        return getattr(self, f"typed_{type_name}")(keywords, path)

    def typed_boolean(self, keywords: dict, path: str) -> dict:
        return {"type": "boolean"}

    def typed_null(self, keywords: dict, path: str) -> dict:
        return {"type": "null"}

    def typed_string(self, keywords: dict, path: str) -> dict:
        low, high = _count(keywords, "minLength", path), _count(keywords, "maxLength", path)
        if low is not None and high is not None and low > high:
            _refuse(path, "minLength", f"{low} exceeds maxLength {high}")
        if "pattern" in keywords and not isinstance(keywords["pattern"], str):
            _refuse(path, "pattern", "must be a string")
        if "pattern" in keywords and "format" in keywords:
            _refuse(path, "pattern", "cannot be combined with 'format'; keep one")
        if "format" in keywords:
            if keywords["format"] not in FORMAT_PATTERNS:
                _refuse(path, "format", f"{keywords['format']!r} is not generated; supported: {sorted(FORMAT_PATTERNS)}")
            pattern, keyword = FORMAT_PATTERNS[keywords["format"]], "format"
        elif "pattern" in keywords:
            pattern, keyword = keywords["pattern"], "pattern"
            _check_pattern_stays_inside_a_json_string(pattern, path)
        else:
            return {"type": "string", **keywords}
        if low is not None or high is not None:
            # outlines-core drops a pattern next to a length; accept the length only when every match satisfies it
            # (one regex character is one string character: the pattern emits no escapes).
            shortest, longest = _pattern_length_range(pattern)
            if shortest < (low or 0) or (high is not None and longest > high):
                _refuse(path, keyword, f"matches of {pattern!r} have {shortest} to {longest} characters, outside "
                                       f"minLength/maxLength ({low}, {high}); fold the length into the pattern "
                                       "(e.g. [a-z]{1,8})")
        return {"type": "string", "pattern": pattern}

    def typed_integer(self, keywords: dict, path: str) -> dict:
        step = keywords.get("multipleOf")
        if step is not None:
            if not _is_number(step) or step <= 0:
                _refuse(path, "multipleOf", f"must be a positive number, got {step!r}")
            if not (1 / step).is_integer():  # every integer is a multiple of 1, 1/2, 1/3...
                _refuse(path, "multipleOf", f"integers that are multiples of {step} are not expressible here")
        low, high = self.bounds(keywords, path)
        if low is None and high is None:
            return {"type": "integer"}
        low_int = None if low is None else (math.floor(low[0]) + 1 if low[1] else math.ceil(low[0]))
        high_int = None if high is None else (math.ceil(high[0]) - 1 if high[1] else math.floor(high[0]))
        regex = integer_range_regex(low_int, high_int)
        if regex is None:
            _refuse(path, "minimum", f"no integer lies between {low_int} and {high_int}")
        return self.placeholder(regex)

    def typed_number(self, keywords: dict, path: str) -> dict:
        step = keywords.get("multipleOf")
        if step is not None:
            if step != 1:
                _refuse(path, "multipleOf", f"numbers that are multiples of {step!r} are not expressible here "
                                            "(only multipleOf 1, generated as integers)")
            return self.typed_integer(keywords, path)
        low, high = self.bounds(keywords, path)
        if low is None and high is None:
            return {"type": "number"}
        for bound, name in ((low, "minimum"), (high, "maximum")):
            if bound is not None and not float(bound[0]).is_integer():
                _refuse(path, name, f"fractional number bounds ({bound[0]!r}) are not enforced exactly; use "
                                    "whole-number bounds or type integer")
        regex = number_range_regex(None if low is None else int(low[0]), bool(low and low[1]),
                                   None if high is None else int(high[0]), bool(high and high[1]))
        if regex is None:
            _refuse(path, "minimum", "no number satisfies these bounds")
        return self.placeholder(regex)

    def bounds(self, keywords: dict, path: str):
        """((lowest, exclusive) or None, (highest, exclusive) or None): the tighter of inclusive/exclusive bounds."""
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if key in keywords and not _is_number(keywords[key]):
                hint = " (draft-4 boolean form: give the bound itself as exclusiveMinimum/Maximum)" \
                    if isinstance(keywords[key], bool) else ""
                _refuse(path, key, f"must be a number, got {keywords[key]!r}{hint}")
            if key in keywords and not math.isfinite(keywords[key]):
                _refuse(path, key, "must be finite")
        lows = [(keywords["minimum"], False)] if "minimum" in keywords else []
        lows += [(keywords["exclusiveMinimum"], True)] if "exclusiveMinimum" in keywords else []
        highs = [(keywords["maximum"], False)] if "maximum" in keywords else []
        highs += [(keywords["exclusiveMaximum"], True)] if "exclusiveMaximum" in keywords else []
        low = max(lows, key=lambda bound: (bound[0], bound[1])) if lows else None
        high = min(highs, key=lambda bound: (bound[0], not bound[1])) if highs else None
        return low, high

    def placeholder(self, regex: str) -> dict:
        name = f"{PLACEHOLDER_PREFIX}{len(self.numeric_regexes)}"
        self.numeric_regexes[name] = regex
        return {"const": name}

    def typed_array(self, keywords: dict, path: str) -> dict:
        low, high = _count(keywords, "minItems", path), _count(keywords, "maxItems", path)
        if low is not None and high is not None and low > high:
            _refuse(path, "minItems", f"{low} exceeds maxItems {high}")
        if keywords.get("uniqueItems") is True and (high is None or high > 1):
            _refuse(path, "uniqueItems", "distinct items are not expressible as a regex (allowed only with "
                                         "maxItems <= 1)")
        if "prefixItems" in keywords:
            prefix = keywords["prefixItems"]
            if not isinstance(prefix, list) or not prefix:
                _refuse(path, "prefixItems", "must be a non-empty list of schemas")
            # outlines-core generates exactly the prefix items (never extra ones allowed by "items").
            if (low or 0) > len(prefix) or (high is not None and high < len(prefix)):
                _refuse(path, "prefixItems", f"exactly {len(prefix)} items are generated, outside "
                                             f"minItems/maxItems ({low}, {high})")
            return {"type": "array", "prefixItems": [self.schema(item, f"{path}/prefixItems/{i}")
                                                     for i, item in enumerate(prefix)]}
        checked = {"type": "array"}
        if "items" in keywords:
            if keywords["items"] is False:
                if low:
                    _refuse(path, "items", f"false allows no items but minItems is {low}")
                checked["maxItems"] = 0
            else:
                checked["items"] = self.schema(keywords["items"], f"{path}/items")
        for key in ("minItems", "maxItems"):
            if key in keywords:
                checked.setdefault(key, keywords[key])
        return checked

    def typed_object(self, keywords: dict, path: str) -> dict:
        properties = keywords.get("properties")
        required = keywords.get("required", [])
        if properties is not None and not isinstance(properties, dict):
            _refuse(path, "properties", "must map names to schemas")
        if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
            _refuse(path, "required", "must be a list of property names")
        low, high = _count(keywords, "minProperties", path), _count(keywords, "maxProperties", path)
        if properties:
            missing = [name for name in required if name not in properties]
            if missing:
                _refuse(path, "required", f"{missing} not in 'properties', so they would never be generated")
            # Only the listed properties are generated: all required ones plus any subset of the optional ones.
            if (low or 0) > len(set(required)):
                _refuse(path, "minProperties", f"{low} exceeds the {len(set(required))} required properties; mark "
                                               "enough of them required")
            if high is not None and high < len(properties):
                _refuse(path, "maxProperties", f"{high} is below the {len(properties)} listed properties, and which "
                                               "optional ones to leave out is not expressible here")
            for trigger, dependents in keywords.get("dependentRequired", {}).items():
                if trigger in properties and not set(dependents) <= set(required):
                    _refuse(path, "dependentRequired", f"'{trigger}' requires {dependents}; mark them required")
            return {"type": "object", "required": required,
                    "properties": {name: self.schema(sub, f"{path}/properties/{name}")
                                   for name, sub in properties.items()}}
        if required:
            _refuse(path, "required", f"{required} not in 'properties', so they would never be generated")
        for key, value in (("minProperties", low), ("maxProperties", high), ("dependentRequired", None)):
            if key in keywords and (key != "minProperties" or value):
                _refuse(path, key, "only enforced on objects with listed 'properties'")
        extra = keywords.get("additionalProperties", True)
        if extra is False or properties == {}:
            return {"const": {}}
        if extra is True:
            return {"type": "object"}
        return {"type": "object", "additionalProperties": self.schema(extra, f"{path}/additionalProperties")}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _has_type(value, type_name: str) -> bool:
    if type_name not in _PYTHON_TYPES or (isinstance(value, bool) and type_name != "boolean"):
        return False
    if type_name == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _PYTHON_TYPES[type_name])


def _single_values(node) -> list | None:
    """[value] (as JSON text) when the schema admits exactly one value ("const", or a one-item "enum")."""
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return [json.dumps(node["const"], sort_keys=True)]
    if isinstance(node.get("enum"), list) and len(node["enum"]) == 1:
        return [json.dumps(node["enum"][0], sort_keys=True)]
    return None


def _type_set(node: dict) -> set[str] | None:
    """JSON types a schema admits when it says so plainly (integer counted as number); None when unknown."""
    types = node.get("type")
    if isinstance(types, str):
        types = [types]
    if not isinstance(types, list) or not types or "enum" in node or "const" in node:
        return None
    return {"number" if t == "integer" else t for t in types}


def _count(keywords: dict, key: str, path: str) -> int | None:
    value = keywords.get(key)
    if value is not None and (not _is_number(value) or value < 0 or not float(value).is_integer()):
        _refuse(path, key, f"must be a non-negative integer, got {value!r}")
    return None if value is None else int(value)


def _check_pattern_stays_inside_a_json_string(pattern: str, path: str) -> None:
    """outlines-core puts the pattern between the quotes unchanged: refuse one that can emit '"', '\\' or a control
    character, which would end or break the JSON string (the decoded value would differ from what was matched)."""
    try:
        parsed = sre_parse.parse(pattern)
    except re.error:
        return  # Rust-only syntax (e.g. \p{L}): outlines-core parses it; an invalid one fails there
    unsafe = set(range(0x20)) | {ord('"'), ord("\\")}

    def visit(items) -> bool:
        for op, arg in items:
            if op in (sre_constants.ANY, sre_constants.NOT_LITERAL):
                return False
            if op is sre_constants.LITERAL and arg in unsafe:
                return False
            if op is sre_constants.IN:
                for class_op, class_arg in arg:
                    if class_op is sre_constants.NEGATE or (class_op is sre_constants.CATEGORY and class_arg in (
                            sre_constants.CATEGORY_NOT_DIGIT, sre_constants.CATEGORY_NOT_WORD,
                            sre_constants.CATEGORY_SPACE, sre_constants.CATEGORY_NOT_SPACE)):
                        return False
                    if class_op is sre_constants.LITERAL and class_arg in unsafe:
                        return False
                    if class_op is sre_constants.RANGE and any(class_arg[0] <= c <= class_arg[1] for c in unsafe):
                        return False
            elif op is sre_constants.BRANCH:
                if not all(visit(branch) for branch in arg[1]):
                    return False
            elif op is sre_constants.SUBPATTERN:
                if not visit(arg[-1]):
                    return False
            elif op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT, sre_constants.POSSESSIVE_REPEAT):
                if not visit(arg[2]):
                    return False
        return True

    if not visit(parsed):
        _refuse(path, "pattern", f"{pattern!r} can produce '\"', a backslash or a control character, which would "
                                 "break the JSON string; use explicit classes such as [a-zA-Z0-9 ]")


def _pattern_length_range(pattern: str) -> tuple[int, float]:
    """(fewest, most) characters a full match of the pattern has; most is inf when unbounded or unknown."""
    try:
        low, high = sre_parse.parse(pattern).getwidth()
    except re.error:
        return 0, math.inf
    return low, math.inf if high >= sre_constants.MAXREPEAT else high
