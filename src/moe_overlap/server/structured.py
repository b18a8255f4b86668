"""Structured outputs as each API spells them, read into one ``StructuredOutputs``: OpenAI's
``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs`` (``json``,
``regex``, ``choice``, ``grammar``, ``json_object``) and its older ``guided_json``,
``guided_regex``, ``guided_choice`` and ``guided_grammar``, SGLang's ``json_schema``, ``regex``
and ``ebnf``. A request sets at most one; anything this server cannot honour is a 400 naming
it."""

from __future__ import annotations

from collections.abc import Mapping

from moe_overlap.engine.errors import InvalidRequestError
from moe_overlap.engine.structured import StructuredOutputs

# the request fields that carry a constraint, each the StructuredOutputs field it sets
FLAT_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "json_schema": "json",  # SGLang: a JSON schema as text
    "regex": "regex",
    "ebnf": "grammar",
}
FIELDS = ("response_format", "structured_outputs", *FLAT_FIELDS)
# vLLM's structured_outputs keys: the constraints, and the one option this server always has on
_VLLM_KEYS = {"json", "regex", "choice", "grammar", "json_object"}
_VLLM_ALWAYS = {"disable_any_whitespace": (None, True)}


def structured_outputs(body: Mapping[str, object], where: str = "") -> StructuredOutputs | None:
    """The one constraint that ``body``'s structured-output fields ask for, or None; errors
    name a field as ``where`` + its name (``sampling_params.`` in SGLang's ``/generate``)."""
    found = [
        made
        for name in FIELDS
        if body.get(name) is not None and (made := _read(name, body[name], where)) is not None
    ]
    if len(found) > 1:
        names = " and ".join(so.field for so in found)
        raise InvalidRequestError(f"{names} each constrain the output: send one", found[1].field)
    return found[0] if found else None


def _read(name: str, value: object, where: str) -> StructuredOutputs | None:
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _vllm(value)
    field = where + name
    return StructuredOutputs(**{FLAT_FIELDS[name]: value}, field=field)  # type: ignore[arg-type]


def _response_format(value: object) -> StructuredOutputs | None:
    """OpenAI's ``{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}``."""
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True, field="response_format")
    if kind != "json_schema" or not isinstance(value, Mapping):
        raise InvalidRequestError(
            f"response_format={value!r:.80}: type must be text, json_object or json_schema",
            "response_format",
        )
    where = "response_format.json_schema.schema"
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, Mapping) else None
    if not isinstance(schema, dict | str):
        raise InvalidRequestError(f"{where} is missing: send the JSON schema to follow", where)
    return StructuredOutputs(json=schema, field=where)


def _vllm(value: object) -> StructuredOutputs:
    if not isinstance(value, Mapping):
        raise InvalidRequestError(
            f"structured_outputs={value!r:.60} must be an object", "structured_outputs"
        )
    for key, item in value.items():
        if key in _VLLM_KEYS or (key in _VLLM_ALWAYS and item in _VLLM_ALWAYS[key]):
            continue
        where = f"structured_outputs.{key}"
        raise InvalidRequestError(f"{where}={item!r:.60} is not supported by this server", where)
    set_ = [k for k in _VLLM_KEYS if value.get(k) not in (None, False)]
    field = f"structured_outputs.{set_[0]}" if len(set_) == 1 else "structured_outputs"
    kwargs = {k: value[k] for k in _VLLM_KEYS if value.get(k) is not None}
    return StructuredOutputs(**kwargs, field=field)
