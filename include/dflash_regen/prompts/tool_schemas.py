"""Tool (function) schemas as OpenAI expects them, repaired the way function-calling datasets write them.

A tool is `{"type": "function", "function": {"name", "description"?, "parameters": <JSON schema of type
object>}}`. Datasets in the wild often write Python or Java type names (`dict`, `float`, `tuple`, `any`,
`String`), leave `type` out of an object schema, put `"required": true` on a property (JSON Schema draft 3)
or list required names that have no property, at any depth. SGLang and the chat template pass schemas
through to the model, so such rows are worth sending once repaired; every repair is recorded by kind
(`REPAIRS`). A schema that cannot be repaired raises `SchemaError` naming the path inside the schema, the
value found and the fix.
"""

from __future__ import annotations

import json

from dflash_regen.errors import SchemaError

JSON_TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")
# Type names of other languages, lower-cased, and the JSON schema type each one means.
TYPE_ALIASES = {
    "dict": "object", "map": "object", "hashmap": "object", "hashtable": "object",
    "float": "number", "double": "number", "decimal": "number",
    "int": "integer", "long": "integer", "short": "integer", "byte": "integer", "bigint": "integer",
    "str": "string", "char": "string",
    "bool": "boolean",
    "list": "array", "tuple": "array", "set": "array", "arraylist": "array", "queue": "array", "stack": "array",
    "none": "null", "nonetype": "null",
}
REPAIRS = {
    "bare_function": "a function schema without the {'type': 'function', 'function': ...} wrapper was wrapped",
    "parameters_missing": "a function without parameters got an empty object schema",
    "parameters_json_string": "parameters written as a JSON string were parsed",
    "type_name": "a Python/Java type name (dict, float, int, str, bool, list, tuple, String, ...) became its "
                 "JSON schema type",
    "type_any": "type 'any' was removed (no type accepts any value)",
    "object_type_missing": "an object schema (parameters, or one with properties) without 'type' got "
                           "'type': 'object'",
    "required_on_property": "'required': true on a property moved into its object's 'required' list",
    "required_absent": "names in 'required' without a property were dropped",
}
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("$defs", "definitions")


def normalize_tool(tool, where: str, repairs: list[str]) -> dict:
    """The OpenAI function tool `tool` (at `where`, e.g. `tools[0]`), repaired; repair kinds go to `repairs`."""
    if not isinstance(tool, dict):
        raise SchemaError(where, tool, "must be an object {'type': 'function', 'function': {...}}")
    if "function" not in tool and "name" in tool:
        tool = {"type": "function", "function": tool}
        repairs.append("bare_function")
    fn = tool.get("function")
    if tool.get("type", "function") != "function" or not isinstance(fn, dict):
        raise SchemaError(where, tool, "must be {'type': 'function', 'function': {'name': ..., 'parameters': ...}}")
    name = fn.get("name")
    if not isinstance(name, str) or not name.strip():
        raise SchemaError(f"{where}.function.name", name, "must be a non-empty string")
    if "parameters" not in fn or fn["parameters"] is None:
        params = {"type": "object", "properties": {}}
        repairs.append("parameters_missing")
    else:
        params = fn["parameters"]
    path = f"{where}.function.parameters"
    if isinstance(params, str):
        try:
            params = json.loads(params)
        except json.JSONDecodeError as exc:
            raise SchemaError(path, params, f"a string but not JSON ({exc.msg}); write the schema as an "
                                            "object") from exc
        repairs.append("parameters_json_string")
    params = _schema(params, path, repairs, object_expected=True)
    if params.get("type") != "object":
        raise SchemaError(f"{path}.type", params.get("type"), "a function's parameters must be a JSON schema of "
                          "type 'object' (put the value in a named property of an object)")
    out = {"name": name.strip(), "parameters": params}
    if isinstance(fn.get("description"), str):
        out["description"] = fn["description"]
    return {"type": "function", "function": out}


def _schema(node, path: str, repairs: list[str], object_expected: bool = False) -> dict:
    if not isinstance(node, dict):
        raise SchemaError(path, node, "must be a JSON schema object, e.g. {'type': 'string'}")
    out = dict(node)
    if "type" in out:
        kind = _type(out["type"], f"{path}.type", repairs)
        if kind is None:
            del out["type"]
        else:
            out["type"] = kind
    elif object_expected or "properties" in out:
        out["type"] = "object"
        repairs.append("object_type_missing")
    properties = out.get("properties")
    flagged: list[str] = []
    if properties is not None:
        if not isinstance(properties, dict):
            raise SchemaError(f"{path}.properties", properties, "must map each property name to its schema")
        repaired = {}
        for name, sub in properties.items():
            if isinstance(sub, dict) and isinstance(sub.get("required"), bool):
                if sub["required"]:
                    flagged.append(name)
                sub = {k: v for k, v in sub.items() if k != "required"}
                repairs.append("required_on_property")
            repaired[name] = _schema(sub, f"{path}.properties.{name}", repairs)
        out["properties"] = repaired
    if "required" in out or flagged:
        required = out.get("required", [])
        if isinstance(required, bool):  # draft 3 on an object that is not a property: nothing to attach it to
            required = []
            repairs.append("required_on_property")
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError(f"{path}.required", required, "must be a list of property names")
        present = [r for r in required if r in (out.get("properties") or {})]
        if len(present) != len(required):
            repairs.append("required_absent")
        out["required"] = list(dict.fromkeys(present + flagged))
    for key in ("items", "additionalProperties", "not"):
        sub = out.get(key)
        if isinstance(sub, dict):
            out[key] = _schema(sub, f"{path}.{key}", repairs)
        elif key == "items" and isinstance(sub, list):  # tuple validation (draft 4)
            out[key] = [_schema(s, f"{path}.items[{i}]", repairs) for i, s in enumerate(sub)]
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_schema(s, f"{path}.{key}[{i}]", repairs) for i, s in enumerate(out[key])]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _schema(s, f"{path}.{key}.{k}", repairs) for k, s in out[key].items()}
    return out


def _type(value, path: str, repairs: list[str]):
    """The JSON schema type for `value` (a name or a list of names); None means any value."""
    if isinstance(value, list):
        kinds = [_type(v, f"{path}[{i}]", repairs) for i, v in enumerate(value)]
        return None if None in kinds else list(dict.fromkeys(kinds))
    if not isinstance(value, str):
        raise SchemaError(path, value, f"not a type name; use one of {', '.join(JSON_TYPES)}")
    if value in JSON_TYPES:
        return value
    key = value.strip().lower()
    if key == "any":
        repairs.append("type_any")
        return None
    if key in JSON_TYPES or key in TYPE_ALIASES:
        repairs.append("type_name")
        return TYPE_ALIASES.get(key, key)
    raise SchemaError(path, value, f"not a JSON schema type; use one of {', '.join(JSON_TYPES)}, or leave "
                                   "'type' out to accept any value")
