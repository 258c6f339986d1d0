"""JSON Schema as the specification reads it, before an engine compiles it: annotations and unknown keywords
dropped, every validation keyword either kept for the engine or refused by name.

What llguidance (1.9) does with a schema's keywords, measured: it enforces `type enum const anyOf allOf $ref
properties additionalProperties patternProperties required items prefixItems additionalItems min/maxItems
min/maxLength pattern minimum maximum exclusiveMinimum exclusiveMaximum multipleOf`, `oneOf` when it can prove the
branches disjoint, `min/maxProperties` when every listed property is required, and ten string formats; it refuses
(an error naming the keyword) `not if then else dependencies dependentRequired dependentSchemas uniqueItems contains
propertyNames unevaluated* $dynamicRef $recursiveRef`, formats it does not know, and `$schema` URIs outside the five
drafts it knows (it would fetch them); it ignores every other key, including draft-03's `required: true`.

So this module, per subschema (never inside `properties`' names, `enum`, `const` or other data):
- drops annotations and unknown keys (kept only where a local `$ref` points into them);
- drops a `format` llguidance does not implement (an annotation, as JSON Schema 2019-09+ reads it), `uniqueItems`
  when it cannot matter, and a `$schema` that names no draft llguidance knows;
- rewrites what llguidance refuses into what it enforces, exactly: draft-03 `required: true` / `divisibleBy` /
  `extends`; `dependencies` / `dependentRequired` / `dependentSchemas` and `if/then/else` into `anyOf` branches;
  `not S` into the `anyOf` of the negations of S's keywords (where each is expressible: types, bounds, lengths,
  counts, required, properties, const / enum of scalars, nested anyOf / allOf / not / local $ref); `oneOf` into
  `anyOf` when its branches are proved disjoint (types, const / enum, a required property's const / enum), else
  into `anyOf` of each branch with the others' negations;
- leaves in place what it cannot rewrite, for the engine to refuse by name.
"""

from __future__ import annotations

import json
import math
import re

from .grammar_errors import GrammarError

# formats llguidance 1.9 implements (any other makes it refuse the schema)
ENGINE_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid",
                            "uri", "unknown"})

_TYPES = ("null", "boolean", "object", "array", "number", "string")

# formats the specification defines that llguidance lacks: left for it to refuse, since validators assert them
# (json-pointer and relative-json-pointer become patterns, which they are exactly)
_STANDARD_FORMATS = frozenset({"uri-reference", "iri", "iri-reference", "uri-template", "regex", "idn-email",
                               "idn-hostname"})
_FORMAT_PATTERNS = {
    "json-pointer": r"^(?:/(?:[^~/]|~[01])*)*$",
    "relative-json-pointer": r"^(?:0|[1-9][0-9]*)(?:#|(?:/(?:[^~/]|~[01])*)*)$",
}
# keywords a draft does not have, so the specification ignores them in a schema that declares that draft
_NOT_IN_DRAFT = {
    "03": frozenset({"const", "contains", "propertyNames", "if", "then", "else", "dependentRequired",
                     "dependentSchemas", "minContains", "maxContains", "unevaluatedItems", "unevaluatedProperties",
                     "prefixItems"}),
    "04": frozenset({"const", "contains", "propertyNames", "if", "then", "else", "dependentRequired",
                     "dependentSchemas", "minContains", "maxContains", "unevaluatedItems", "unevaluatedProperties",
                     "prefixItems"}),
    "06": frozenset({"if", "then", "else", "dependentRequired", "dependentSchemas", "minContains", "maxContains",
                     "unevaluatedItems", "unevaluatedProperties", "prefixItems"}),
    "07": frozenset({"dependentRequired", "dependentSchemas", "minContains", "maxContains", "unevaluatedItems",
                     "unevaluatedProperties", "prefixItems"}),
    "2019-09": frozenset({"prefixItems"}),
}

# keywords whose value is one subschema / a list of subschemas / a map of name -> subschema
_ONE = frozenset({"not", "if", "then", "else", "additionalProperties", "additionalItems", "propertyNames",
                  "contains", "unevaluatedItems", "unevaluatedProperties", "contentSchema"})
_LIST = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
_MAP = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
# keywords whose value is data, kept as written
_VALUE = frozenset({"type", "enum", "const", "required", "minimum", "maximum", "exclusiveMinimum",
                    "exclusiveMaximum", "multipleOf", "minLength", "maxLength", "pattern", "format", "minItems",
                    "maxItems", "uniqueItems", "minProperties", "maxProperties", "dependentRequired",
                    "minContains", "maxContains", "$ref", "$dynamicRef", "$recursiveRef", "$id", "$anchor",
                    "$dynamicAnchor", "$recursiveAnchor", "$schema", "$vocabulary"})
# draft-03 validation keywords this module cannot rewrite: refused when the schema declares draft-03
_DRAFT3_REFUSED = ("disallow",)

_DRAFTS = {"03": "http://json-schema.org/draft-04/schema#",  # after the draft-03 rewrites below
           "04": "http://json-schema.org/draft-04/schema#",
           "06": "http://json-schema.org/draft-06/schema#",
           "07": "http://json-schema.org/draft-07/schema#",
           "2019-09": "https://json-schema.org/draft/2019-09/schema",
           "2020-12": "https://json-schema.org/draft/2020-12/schema"}
_DRAFT_URI = re.compile(r"^https?://json-schema\.org/(?:draft-0?(\d)|draft/(\d{4}-\d{2}))/schema#?$")
# x-guidance options a schema may set for itself; the rest (lenient, coerce_one_of) would make the engine unsound
_GUIDANCE_OPTIONS = frozenset({"whitespace_flexible", "whitespace_pattern", "item_separator", "key_separator"})

_MAX_NEGATION_DEPTH = 6
_MAX_BRANCHES = 64


def prepare_schema(schema, *, rewrite: bool = True):
    """`schema` (a parsed JSON Schema: dict or bool) as the llguidance engine should compile it; GrammarError for
    a validation keyword no engine enforces. rewrite=False: only the annotations, formats and drafts (for an engine
    that takes no anyOf / allOf of the rewrites' shapes)."""
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
    if isinstance(schema, bool):
        return schema
    return _Preparer(schema, rewrite).run()


def _draft_of(uri) -> str | None:
    m = _DRAFT_URI.match(uri) if isinstance(uri, str) else None
    if m is None:
        return None
    return ("0" + m.group(1)) if m.group(1) else m.group(2)


def _unescape(token: str) -> str:
    from urllib.parse import unquote

    return unquote(token).replace("~1", "/").replace("~0", "~")


def _pointer_parts(ref: str) -> tuple[str, ...] | None:
    """'#/definitions/a~1b' -> ('definitions', 'a/b'); None for refs that are not local JSON pointers."""
    if ref == "#":
        return ()
    if not ref.startswith("#/"):
        return None
    return tuple(_unescape(p) for p in ref[2:].split("/"))


def resolve_local_ref(root, ref: str):
    """The node a local JSON-pointer $ref ('#', '#/definitions/a') names in `root`, or None."""
    parts = _pointer_parts(ref)
    if parts is None:
        return None
    node = root
    for p in parts:
        if isinstance(node, dict) and p in node:
            node = node[p]
        elif isinstance(node, list) and p.isdigit() and int(p) < len(node):
            node = node[int(p)]
        else:
            return None
    return node


class _Preparer:
    def __init__(self, root: dict, rewrite: bool = True):
        self.root = root
        self.rewrite = rewrite
        self.draft = _draft_of(root.get("$schema"))
        # local pointers that $refs name: the unknown keys on their way are kept
        self.ref_targets: set[tuple[str, ...]] = set()
        self._collect_refs(root)
        self.ref_prefixes = {t[:i] for t in self.ref_targets for i in range(len(t) + 1)}
        self._prepared_refs: dict[str, object] = {}
        self._before: dict[int, tuple[dict, dict]] = {}

    def run(self):
        out = self.schema(self.root, ())
        if isinstance(out, dict):
            if isinstance(out.get("required"), bool):
                del out["required"]  # draft-03's flag on the root: no property to require
            if "$schema" in self.root:
                out.pop("$schema", None)
                if self.draft in _DRAFTS:
                    out = {"$schema": _DRAFTS[self.draft], **out}
            guidance = self.root.get("x-guidance")
            if isinstance(guidance, dict):
                kept = {k: v for k, v in guidance.items() if k in _GUIDANCE_OPTIONS}
                if kept:
                    out["x-guidance"] = kept
        return out

    def _collect_refs(self, node) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                parts = _pointer_parts(ref)
                if parts is not None:
                    self.ref_targets.add(parts)
            for v in node.values():
                self._collect_refs(v)
        elif isinstance(node, list):
            for v in node:
                self._collect_refs(v)

    # -- walking -------------------------------------------------------------------------------------------------

    def schema(self, node, path: tuple):
        """One subschema at `path`, prepared."""
        if not isinstance(node, dict):
            return node  # a boolean, or something malformed the engine will name
        if self.draft == "03":
            node = self._from_draft3(node, path)
        out: dict = {}
        absent = _NOT_IN_DRAFT.get(self.draft, ())
        for key, value in node.items():
            sub = path + (key,)
            if key in absent:
                if sub in self.ref_prefixes:
                    out[key] = self._container(value, sub)
            elif key in _ONE:
                out[key] = self.schema(value, sub)
            elif key in _LIST:
                out[key] = [self.schema(v, sub + (str(i),)) for i, v in enumerate(value)] \
                    if isinstance(value, list) else value
            elif key in _MAP:
                out[key] = {k: self.schema(v, sub + (k,)) for k, v in value.items()} \
                    if isinstance(value, dict) else value
            elif key == "items":
                out[key] = [self.schema(v, sub + (str(i),)) for i, v in enumerate(value)] \
                    if isinstance(value, list) else self.schema(value, sub)
            elif key == "dependencies":
                out[key] = {k: (self.schema(v, sub + (k,)) if isinstance(v, (dict, bool)) else v)
                            for k, v in value.items()} if isinstance(value, dict) else value
            elif key in _VALUE:
                out[key] = value
            elif key == "id" and self.draft in (None, "03", "04") and isinstance(value, str):
                out[key] = value  # draft-04's $id: it sets the base URI of the refs below it
            elif sub in self.ref_prefixes:
                out[key] = self._container(value, sub)
            # else: an annotation or an unknown keyword, which the specification says to ignore
        self._move_required_flags(out)
        before = dict(out)
        out = self._rewrite(out, path)
        # the form before the rewrites negates better (`not: {not: S}` is S, not the negation of S's negation)
        self._before[id(out)] = (out, before)
        return out

    def _container(self, node, path: tuple):
        """A non-schema value on the way to a $ref target."""
        if path in self.ref_targets:
            return self.schema(node, path)
        if isinstance(node, dict):
            return {k: self._container(v, path + (k,)) for k, v in node.items() if path + (k,) in self.ref_prefixes}
        if isinstance(node, list):
            return [self._container(v, path + (str(i),)) for i, v in enumerate(node)]
        return node

    def _from_draft3(self, node: dict, path: tuple) -> dict:
        for key in _DRAFT3_REFUSED:
            if key in node:
                raise GrammarError(f"draft-03 keyword {key!r} at {_where(path)} is not supported")
        node = dict(node)
        if "divisibleBy" in node:
            node["multipleOf"] = node.pop("divisibleBy")
        if "extends" in node:
            ext = node.pop("extends")
            node["allOf"] = list(node.get("allOf", [])) + (ext if isinstance(ext, list) else [ext])
        if node.get("type") == "any":
            del node["type"]
        elif isinstance(node.get("type"), list):
            if not all(isinstance(t, str) for t in node["type"]):
                raise GrammarError(f"draft-03 'type' with schemas at {_where(path)} is not supported")
            if "any" in node["type"]:
                del node["type"]
        if isinstance(node.get("dependencies"), dict):
            node["dependencies"] = {k: ([v] if isinstance(v, str) else v) for k, v in node["dependencies"].items()}
        return node

    @staticmethod
    def _move_required_flags(out: dict) -> None:
        """Draft-03's `required: true` inside a property -> the property's name in the object's `required`."""
        props = out.get("properties")
        if not isinstance(props, dict):
            return
        required = list(out.get("required", [])) if isinstance(out.get("required"), list) else []
        moved = False
        for name, sub in props.items():
            if isinstance(sub, dict) and isinstance(sub.get("required"), bool):
                flag = sub.pop("required")
                moved = True
                if flag and name not in required:
                    required.append(name)
        if moved and required:
            out["required"] = required

    # -- rewrites ------------------------------------------------------------------------------------------------

    def _rewrite(self, s: dict, path: tuple) -> dict:
        extra: list = []  # conjuncts, appended to allOf
        fmt = s.get("format")
        if isinstance(fmt, str) and fmt not in ENGINE_FORMATS and fmt not in _STANDARD_FORMATS:
            del s["format"]  # unknown to the specification: an annotation
            if fmt in _FORMAT_PATTERNS:
                if "pattern" in s:
                    extra.append({"pattern": _FORMAT_PATTERNS[fmt]})
                else:
                    s["pattern"] = _FORMAT_PATTERNS[fmt]
        if "uniqueItems" in s:
            max_items = s.get("maxItems")
            if s["uniqueItems"] is False or (isinstance(max_items, int) and max_items <= 1):
                del s["uniqueItems"]
        if not self.rewrite:
            if extra:
                s["allOf"] = list(s.get("allOf", [])) + extra if isinstance(s.get("allOf"), list) else extra
            return s
        for key in ("dependencies", "dependentRequired", "dependentSchemas"):
            if isinstance(s.get(key), dict):
                branches = self._dependencies(s[key])
                if branches is not None:
                    del s[key]
                    extra += branches
        if "if" in s:
            cond = self._if_then_else(s)
            if cond is not None:
                for key in ("if", "then", "else"):
                    s.pop(key, None)
                extra.append(cond)
        else:
            s.pop("then", None)
            s.pop("else", None)
        if "not" in s:
            neg = self.negate(s["not"], 0)
            if neg is not None:
                del s["not"]
                extra.append(neg)
        if isinstance(s.get("oneOf"), list):
            s = self._one_of(s, extra)
        if extra:
            extra = [e for e in extra if e is not True]
            if any(e is False for e in extra):
                extra = [False]
            if extra:
                s["allOf"] = list(s.get("allOf", [])) + extra if isinstance(s.get("allOf"), list) else extra
        return s

    def _dependencies(self, deps: dict) -> list | None:
        out = []
        for name, dep in deps.items():
            absent = {"properties": {name: False}}
            if isinstance(dep, list):
                if not all(isinstance(d, str) for d in dep):
                    return None
                if not dep:
                    continue
                out.append({"anyOf": [absent, {"required": [name] + [d for d in dep if d != name]}]})
            elif dep is True:
                continue
            elif isinstance(dep, (dict, bool)):
                present = {"required": [name]} if dep is not False else False
                if isinstance(dep, dict):
                    present = {"required": [name], "allOf": [dep]}
                out.append({"anyOf": [absent, present]} if present is not False else absent)
            else:
                return None
        return out

    def _if_then_else(self, s: dict):
        cond, then, other = s["if"], s.get("then", True), s.get("else", True)
        if then is True and other is True:
            return True
        neg = self.negate(cond, 0)
        if neg is None:
            return None
        return _any_of([_all_of([cond, then]), _all_of([neg, other])])

    def _one_of(self, s: dict, extra: list) -> dict:
        branches = s["oneOf"]
        if len(branches) == 1:
            del s["oneOf"]
            extra.append(branches[0])
            return s
        outer = self._types_of_siblings(s)
        n = len(branches)
        disjoint = [[i == j or self.disjoint(branches[i], branches[j], outer) for j in range(n)] for i in range(n)]
        if all(all(row) for row in disjoint):
            rewritten = {"anyOf": branches}
        else:
            negations = {}
            for j in range(n):
                if not all(disjoint[i][j] for i in range(n)):
                    negations[j] = self.negate(branches[j], 0)
                    if negations[j] is None:
                        return s  # left for the engine, which may prove it disjoint itself, or refuses it
            rewritten = {"anyOf": [_all_of([branches[i]] + [negations[j] for j in range(n) if not disjoint[i][j]])
                                   for i in range(n)]}
        del s["oneOf"]
        if "anyOf" in s:
            extra.append(rewritten)
        else:
            s["anyOf"] = rewritten["anyOf"]
        return s

    # -- reasoning over prepared subschemas ----------------------------------------------------------------------

    def resolve(self, ref: str):
        """The prepared subschema a local $ref names, or None."""
        if ref in self._prepared_refs:
            return self._prepared_refs[ref]
        node = resolve_local_ref(self.root, ref)
        if node is None:
            return None
        self._prepared_refs[ref] = None  # a loop through this ref resolves to "unknown"
        out = self.schema(node, _pointer_parts(ref))
        self._prepared_refs[ref] = out
        return out

    def types(self, s, depth: int = 0) -> frozenset | None:
        """The JSON types `s` can accept ('integer' counted as 'number'), or None when unknown."""
        if s is True:
            return frozenset(_TYPES)
        if s is False:
            return frozenset()
        if not isinstance(s, dict) or depth > _MAX_NEGATION_DEPTH:
            return None
        out = frozenset(_TYPES)
        t = s.get("type")
        if isinstance(t, str):
            t = [t]
        if isinstance(t, list):
            out &= frozenset("number" if x == "integer" else x for x in t if isinstance(x, str))
        if "const" in s:
            out &= {_type_of(s["const"])}
        if isinstance(s.get("enum"), list):
            out &= frozenset(_type_of(v) for v in s["enum"])
        if isinstance(s.get("$ref"), str):
            target = self.resolve(s["$ref"])
            sub = self.types(target, depth + 1) if target is not None else None
            if sub is not None:
                out &= sub
        for b in s.get("allOf", []) if isinstance(s.get("allOf"), list) else []:
            sub = self.types(b, depth + 1)
            if sub is not None:
                out &= sub
        for key in ("anyOf", "oneOf"):
            if isinstance(s.get(key), list):
                union = frozenset()
                for b in s[key]:
                    sub = self.types(b, depth + 1)
                    if sub is None:
                        union = None
                        break
                    union |= sub
                if union is not None:
                    out &= union
        return out

    def _types_of_siblings(self, s: dict) -> frozenset:
        sib = {k: v for k, v in s.items() if k in ("type", "const", "enum", "$ref", "allOf")}
        return self.types(sib) or frozenset(_TYPES)

    def _values(self, s, depth: int = 0):
        """The finite set of values `s` allows (as canonical JSON texts), or None."""
        if not isinstance(s, dict) or depth > _MAX_NEGATION_DEPTH:
            return None
        if "const" in s:
            return {_canon(s["const"])}
        if isinstance(s.get("enum"), list):
            return {_canon(v) for v in s["enum"]}
        if isinstance(s.get("$ref"), str):
            target = self.resolve(s["$ref"])
            return self._values(target, depth + 1)
        return None

    def _required_values(self, s, depth: int = 0) -> dict:
        """name -> finite value set, for properties `s` requires with a const / enum."""
        if not isinstance(s, dict) or depth > _MAX_NEGATION_DEPTH:
            return {}
        out = {}
        if isinstance(s.get("$ref"), str):
            out.update(self._required_values(self.resolve(s["$ref"]), depth + 1))
        for b in s.get("allOf", []) if isinstance(s.get("allOf"), list) else []:
            out.update(self._required_values(b, depth + 1))
        required = s.get("required") if isinstance(s.get("required"), list) else []
        props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
        for name in required:
            values = self._values(props.get(name), depth + 1)
            if values is not None:
                out[name] = values
        return out

    def disjoint(self, a, b, outer: frozenset) -> bool:
        """True when no instance (of the types `outer` allows) can satisfy both `a` and `b`."""
        ta, tb = self.types(a), self.types(b)
        if ta is None or tb is None:
            return False
        common = ta & tb & outer
        if not common:
            return True
        va, vb = self._values(a), self._values(b)
        if va is not None and vb is not None and not (va & vb):
            return True
        if common == {"object"}:
            ra, rb = self._required_values(a), self._required_values(b)
            return any(not (ra[k] & rb[k]) for k in ra.keys() & rb.keys())
        return False

    def negate(self, s, depth: int):
        """A schema accepting exactly the instances `s` rejects, or None when that is not expressible here."""
        if s is True:
            return False
        if s is False:
            return True
        if not isinstance(s, dict) or depth > _MAX_NEGATION_DEPTH:
            return None
        entry = self._before.get(id(s))
        if entry is not None and entry[0] is s and entry[1] != s:
            neg = self._negate_keywords(entry[1], depth)
            if neg is not None:
                return neg
        return self._negate_keywords(s, depth)

    def _negate_keywords(self, s: dict, depth: int):
        branches: list = []
        for key, value in s.items():
            neg = self._negate_keyword(key, value, s, depth)
            if neg is None:
                return None
            if neg is False:
                continue
            if neg is True:
                return True
            branches += neg["anyOf"] if isinstance(neg, dict) and list(neg) == ["anyOf"] else [neg]
            if len(branches) > _MAX_BRANCHES:
                return None
        return _any_of(branches)

    def _negate_keyword(self, key: str, value, s: dict, depth: int):
        """The instances that fail keyword `key` of `s` (False: none do)."""
        if key in ("$defs", "definitions", "$id", "id", "$anchor", "$schema", "$comment"):
            return False
        if key == "type":
            names = [value] if isinstance(value, str) else value
            if not isinstance(names, list) or not all(isinstance(t, str) for t in names):
                return None
            kinds = set(names)
            if "integer" in kinds and "number" not in kinds:
                return None  # numbers that are not integers: no keyword says so
            rest = [t for t in _TYPES if t not in kinds]
            return {"type": rest} if rest else False
        if key in ("const", "enum"):
            values = [value] if key == "const" else value
            return _not_values(values) if isinstance(values, list) else None
        if key == "required":
            if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
                return None
            return _any_of([{"type": "object", "properties": {n: False}} for n in dict.fromkeys(value)])
        if key == "properties":
            if not isinstance(value, dict):
                return None
            out = []
            for name, sub in value.items():
                neg = self.negate(sub, depth + 1)
                if neg is None:
                    return None
                if neg is not False:
                    out.append({"type": "object", "required": [name], "properties": {name: neg}})
            return _any_of(out)
        bound = _negate_bound(key, value, s)
        if bound is not None:
            return bound
        if key in ("exclusiveMinimum", "exclusiveMaximum") and isinstance(value, bool):
            return False  # draft-04 flags: negated with their minimum / maximum
        if key == "uniqueItems" and value is False:
            return False
        if key == "anyOf" and isinstance(value, list):
            negs = [self.negate(b, depth + 1) for b in value]
            return None if any(n is None for n in negs) else _all_of(negs)
        if key == "allOf" and isinstance(value, list):
            negs = [self.negate(b, depth + 1) for b in value]
            return None if any(n is None for n in negs) else _any_of(negs)
        if key == "not":
            return value
        if key == "$ref" and isinstance(value, str):
            target = self.resolve(value)
            return None if target is None else self.negate(target, depth + 1)
        if key == "format" and isinstance(value, str) and value not in ENGINE_FORMATS | _STANDARD_FORMATS:
            return False
        return None


def _where(path: tuple) -> str:
    return "#/" + "/".join(path) if path else "the root"


def _type_of(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def _canon(v) -> str:
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return json.dumps(v, sort_keys=True, separators=(",", ":"))


def _combine(parts: list, keyword: str, unit: bool):
    """anyOf (unit False) / allOf (unit True) of `parts`, with boolean schemas folded away."""
    parts = [p for p in parts if p is not unit]
    if any(p is (not unit) for p in parts):
        return not unit
    if not parts:
        return unit
    return parts[0] if len(parts) == 1 else {keyword: parts}


def _any_of(branches: list):
    return _combine(branches, "anyOf", False)


def _all_of(parts: list):
    return _combine(parts, "allOf", True)


def _negate_bound(key: str, value, s: dict):
    """Bounds on numbers, lengths and counts, negated within their type; None when `key` is none of them."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    counted = {"minLength": ("string", "maxLength", "minLength"), "maxLength": ("string", "minLength", "maxLength"),
               "minItems": ("array", "maxItems", "minItems"), "maxItems": ("array", "minItems", "maxItems"),
               "minProperties": ("object", "maxProperties", "minProperties"),
               "maxProperties": ("object", "minProperties", "maxProperties")}
    if key in counted:
        kind, other, _ = counted[key]
        if key.startswith("min"):
            n = math.ceil(value)
            return False if n <= 0 else {"type": kind, other: n - 1}
        return {"type": kind, other: math.floor(value) + 1}
    if key == "minimum":
        exclusive = s.get("exclusiveMinimum") is True
        return {"type": "number", ("maximum" if exclusive else "exclusiveMaximum"): value}
    if key == "maximum":
        exclusive = s.get("exclusiveMaximum") is True
        return {"type": "number", ("minimum" if exclusive else "exclusiveMinimum"): value}
    if key == "exclusiveMinimum":
        return {"type": "number", "maximum": value}
    if key == "exclusiveMaximum":
        return {"type": "number", "minimum": value}
    return None


def _not_values(values: list):
    """Every instance equal to none of `values` (scalars only), or None."""
    by_type: dict[str, list] = {}
    for v in values:
        t = _type_of(v)
        if t in ("object", "array"):
            return None
        by_type.setdefault(t, []).append(v)
    branches = []
    others = [t for t in _TYPES if t not in by_type]
    if others:
        branches.append({"type": others})
    if "boolean" in by_type:
        left = [b for b in (False, True) if b not in by_type["boolean"]]
        if left:
            branches.append({"const": left[0]} if len(left) == 1 else {"type": "boolean"})
    if "number" in by_type:
        points = sorted(set(by_type["number"]))
        if not all(math.isfinite(p) for p in points):
            return None
        branches.append({"type": "number", "exclusiveMaximum": points[0]})
        for lo, hi in zip(points, points[1:]):
            branches.append({"type": "number", "exclusiveMinimum": lo, "exclusiveMaximum": hi})
        branches.append({"type": "number", "exclusiveMinimum": points[-1]})
    if "string" in by_type:
        branches.append({"type": "string", "pattern": "^(?:" + _not_words(by_type["string"]) + ")$"})
    return _any_of(branches)


def _not_words(words: list[str]) -> str:
    """A regex (no lookarounds) matching every string except `words`."""
    trie: dict = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[None] = {}

    def rx(node: dict) -> str:
        chars = [c for c in node if c is not None]
        alts = [] if None in node else [""]
        if chars:
            alts.append("[^" + "".join(_class_char(c) for c in chars) + "][\\s\\S]*")
            alts += [_literal(c) + "(?:" + rx(node[c]) + ")" for c in chars]
        else:
            alts.append("[\\s\\S]+")
        return "|".join(alts)

    return rx(trie)


def _literal(ch: str) -> str:
    return re.escape(ch) if ch.isascii() and not ch.isalnum() else ch


def _class_char(ch: str) -> str:
    return "\\" + ch if ch in "\\]^-[" else ch
