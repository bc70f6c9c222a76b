"""JSON Schema keywords the grammar engine would ignore: a schema using one is refused, naming it, rather than
answered with output the schema does not accept. Found by compiling a schema with each keyword and feeding a
violating document (xgrammar 0.2.9: the document was accepted and the end allowed)."""
from __future__ import annotations

import json

from spork_trt.errors import UserError

IGNORED = ("uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else", "dependentRequired",
           "dependentSchemas", "dependencies", "contentEncoding", "contentMediaType", "contentSchema",
           "unevaluatedItems")
ONE = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties", "additionalItems")  # a schema
MANY = ("prefixItems", "anyOf", "oneOf", "allOf")  # a list of schemas
NAMED = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema


def check_schema(source: str) -> None:
    """Raise UserError naming the first keyword of IGNORED the schema uses (and where); text that is not JSON is
    left to the compiler's own error."""
    try:
        schema = json.loads(source)
    except ValueError:
        return
    stack = [(schema, "#")]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict):
            continue
        for key in IGNORED:
            if key in node:
                raise UserError(f"the json_schema keyword {key!r} (at {where}) is not supported: the grammar engine "
                                "cannot enforce it; remove it or express it with supported keywords")
        length = next((k for k in ("minLength", "maxLength") if k in node), None)
        if "pattern" in node and length:  # xgrammar 0.2.9 warns and drops the length
            raise UserError(f"the json_schema keyword {length!r} beside 'pattern' (at {where}) is not supported: "
                            "the grammar engine ignores a length next to a pattern; bound the pattern instead "
                            "(e.g. ^[a-z]{1,8}$)")
        stack += [(node[k], f"{where}/{k}") for k in ONE if k in node]
        stack += [(s, f"{where}/{k}/{i}") for k in MANY if isinstance(node.get(k), list) for i, s in enumerate(node[k])]
        stack += [(s, f"{where}/{k}/{n}") for k in NAMED if isinstance(node.get(k), dict) for n, s in node[k].items()]
