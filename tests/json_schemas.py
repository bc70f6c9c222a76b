"""50 JSON schemas written for the structured-output tests: ten topics in five shapes each (flat with enums and
ranges; optional fields; nested objects; bounded arrays, of strings and of objects; string patterns and numbers
with ranges), each with two prompts. Strings, arrays and numbers are bounded, so a complete document fits
MAX_TOKENS."""
from __future__ import annotations

MAX_TOKENS = 256


def obj(props: dict, optional: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "properties": props, "required": [k for k in props if k not in optional],
            "additionalProperties": False}


def text(most: int = 24) -> dict:
    return {"type": "string", "maxLength": most}


def code(pattern: str) -> dict:
    """A bounded pattern (the grammar engine ignores a length beside a pattern: spec/schema_check.py refuses it)."""
    return {"type": "string", "pattern": pattern}


def whole(low: int, high: int) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high}


def number(low: float, high: float) -> dict:
    return {"type": "number", "minimum": low, "maximum": high}


def enum(*values) -> dict:
    return {"enum": list(values)}


def array(items: dict, low: int, high: int) -> dict:
    return {"type": "array", "items": items, "minItems": low, "maxItems": high}


# topic -> (a name field, a count field with its range, an enum field with its values, a code pattern)
TOPICS = {
    "person": ("name", ("age", 0, 120), ("role", "engineer", "teacher", "doctor"), "^[A-Z]{2}[0-9]{4}$"),
    "book": ("title", ("pages", 10, 2000), ("genre", "fiction", "science", "history"), "^97[89][0-9]{3}$"),
    "city": ("city", ("population_thousands", 1, 40000), ("climate", "cold", "mild", "hot"), "^[A-Z]{3}$"),
    "product": ("product", ("stock", 0, 9999), ("category", "tools", "food", "toys"), "^SKU-[0-9]{5}$"),
    "event": ("event", ("attendees", 1, 100000), ("kind", "concert", "conference", "match"), "^EV[0-9]{3}$"),
    "recipe": ("dish", ("minutes", 1, 600), ("difficulty", "easy", "medium", "hard"), "^R[0-9]{2}[a-z]$"),
    "car": ("model", ("year", 1950, 2030), ("fuel", "petrol", "diesel", "electric"), "^[A-Z]{2}-[0-9]{3}$"),
    "movie": ("title", ("minutes", 30, 300), ("rating", "G", "PG", "R"), "^tt[0-9]{6}$"),
    "planet": ("planet", ("moons", 0, 200), ("type", "rocky", "gas", "ice"), "^P[0-9]{3}$"),
    "company": ("company", ("employees", 1, 500000), ("sector", "energy", "finance", "retail"), "^[A-Z]{3,4}$"),
}


def shapes(topic: str) -> list[dict]:
    name, (count, low, high), (kind, *kinds), pattern = TOPICS[topic]
    flat = {name: text(), count: whole(low, high), kind: enum(*kinds)}
    return [
        obj(flat),
        obj({**flat, "note": text(32), "verified": {"type": "boolean"}}, optional=("note", "verified")),
        obj({name: text(), "details": obj({count: whole(low, high), kind: enum(*kinds),
                                           "origin": obj({"country": text(20), "year": whole(1800, 2030)})})}),
        obj({name: text(), "tags": array(text(12), 1, 3),
             "parts": array(obj({"label": text(12), count: whole(low, high)}), 1, 2)}),
        obj({name: text(), "code": code(pattern), "score": number(0, 10), kind: enum(*kinds)}),
    ]


SCHEMAS = [(f"{topic}_{i}", schema) for topic in TOPICS for i, schema in enumerate(shapes(topic))]  # 50
PROMPTS = ("Describe one {topic} as a JSON object.", "Give me a realistic {topic} record in JSON.")


def cases() -> list[tuple[str, dict, str]]:
    """(schema name, schema, prompt): 100 of them."""
    return [(name, schema, p.format(topic=name.rsplit("_", 1)[0])) for name, schema in SCHEMAS for p in PROMPTS]
