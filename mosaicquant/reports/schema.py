"""The published JSON Schema of a result record, and a validator for it.

``record.schema.json`` (next to this file, installed with the package) is a JSON Schema
(draft 2020-12) of the records ``mosaicquant run`` writes (:mod:`mosaicquant.harness.results`,
schema ``mosaicquant.result/1``); docs/results-schema.md describes every field. Other tools
may validate records with any JSON Schema library:

    >>> import json, jsonschema  # doctest: +SKIP
    >>> jsonschema.validate(json.load(open(record_file)), record_schema())  # doctest: +SKIP

:func:`validate_record` needs no such library: it checks the subset of JSON Schema the file
uses (``type`` with a list of types, ``const``, ``enum``, ``required``, ``properties``,
``additionalProperties``, ``items``, ``minimum``, ``pattern``). Properties the schema does not
name are allowed except where it says otherwise (a metric's fields), so a newer record with an
extra field still validates; a missing required field, a wrong type or an unknown status does not.
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path
from typing import Any

from mosaicquant.errors import UserInputError

__all__ = ["SCHEMA_PATH", "record_schema", "validate_record", "validate_dir"]

SCHEMA_PATH = Path(__file__).with_name("record.schema.json")

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}
_KNOWN = {"$schema", "$id", "title", "description", "type", "const", "enum", "required", "properties",
          "additionalProperties", "items", "minimum", "pattern"}


@functools.lru_cache(maxsize=1)
def record_schema() -> dict[str, Any]:
    """The record schema as a dict (read once from :data:`SCHEMA_PATH`)."""
    return json.loads(SCHEMA_PATH.read_text())


def _check(value: Any, schema: dict[str, Any], where: str, errors: list[str]) -> None:
    unknown = set(schema) - _KNOWN
    if unknown:  # a keyword this validator would silently ignore: refuse rather than pass a record unchecked
        raise ValueError(f"schema keyword(s) {sorted(unknown)} at {where} are not supported; allowed: {sorted(_KNOWN)}")
    if "const" in schema and value != schema["const"]:
        errors.append(f"{where}: {value!r} is not {schema['const']!r}")
        return
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} is not one of {schema['enum']}")
        return
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not any(_TYPES[t](value) for t in types):
            errors.append(f"{where}: {type(value).__name__} {value!r:.60} is not of type {' or '.join(types)}")
            return
    if "minimum" in schema and _TYPES["number"](value) and not math.isnan(value) and value < schema["minimum"]:
        errors.append(f"{where}: {value!r} is below the minimum {schema['minimum']}")
    if "pattern" in schema and isinstance(value, str) and not re.search(schema["pattern"], value):
        errors.append(f"{where}: {value!r} does not match {schema['pattern']!r}")
    if isinstance(value, dict):
        for key in schema.get("required", ()):
            if key not in value:
                errors.append(f"{where}: required field {key!r} is missing")
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            path = f"{where}.{key}" if where else key
            if key in props:
                _check(item, props[key], path, errors)
            elif extra is False:
                errors.append(f"{where or 'record'}: field {key!r} is not allowed (allowed: {sorted(props)})")
            elif isinstance(extra, dict):
                _check(item, extra, path, errors)
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _check(item, schema["items"], f"{where}[{i}]", errors)


def validate_record(record: dict[str, Any], schema: dict[str, Any] | None = None) -> list[str]:
    """The ways ``record`` breaks the record schema (empty when it is valid).

    Fields a reader adds (names starting with ``_``, such as the ``_path`` of
    :func:`mosaicquant.harness.results.load_records`) are not part of the record and are ignored.

    Example:
        >>> validate_record({"schema": "mosaicquant.result/1"})[:2]
        ["required field 'model' is missing", "required field 'method' is missing"]
    """
    errors: list[str] = []
    record = {k: v for k, v in record.items() if not k.startswith("_")} if isinstance(record, dict) else record
    _check(record, schema or record_schema(), "", errors)
    return [e.removeprefix(": ") for e in errors]


def validate_dir(results_dir: str | Path) -> dict[str, list[str]]:
    """``{file name: errors}`` of every ``*.json`` record of a results directory that breaks the schema.

    JSON files of another schema (other tools' output kept beside the records) are not records and
    are left out; a file that is not valid JSON is reported.

    Raises:
        UserInputError: the directory does not exist.
    """
    folder = Path(results_dir)
    if not folder.is_dir():
        raise UserInputError(f"results directory {str(folder)!r} does not exist")
    out = {}
    for path in sorted(folder.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            out[path.name] = [f"not a readable JSON file: {exc}"]
            continue
        if isinstance(record, dict) and record.get("schema", "").startswith("mosaicquant.result/"):
            errors = validate_record(record)
            if errors:
                out[path.name] = errors
    return out
