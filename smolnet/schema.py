"""JSON Schemas of the documents the project writes, shipped in the package and checked with jsonschema.

A schema name is the document's own `schema` field (`smolnet.links/1`); its file is
`<package>/schemas/<kind>-<version>.json`. smolnet holds the generic checker and its own
schemas; smoltrain's schema module reuses the checker for smoltrain's documents, so the
base layer never needs to know about the layer above.
"""

from __future__ import annotations

import functools
import json
from importlib import resources

from smolnet.errors import UsageError


class SchemaError(UsageError):
    """A document that breaks its schema: one line naming the document, the field and the rule."""


def schema_file(name: str) -> tuple[str, str]:
    """`smolnet.links/1` -> ("smolnet", "links-1.json")."""
    try:
        package, rest = name.split(".", 1)
        kind, version = rest.split("/")
    except ValueError:
        raise SchemaError(f"{name!r} is not a schema name like 'smolnet.links/1'") from None
    return package, f"{kind}-{version}.json"


@functools.cache
def load_schema(name: str) -> dict:
    package, fname = schema_file(name)
    try:
        text = (resources.files(package) / "schemas" / fname).read_text()
    except (ModuleNotFoundError, FileNotFoundError):
        raise SchemaError(f"no schema {name!r} ({package}/schemas/{fname})") from None
    return json.loads(text)


@functools.cache
def _validator(name: str):
    from jsonschema import Draft202012Validator

    schema = load_schema(name)
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def _where(err) -> str:
    return "/".join(str(p) for p in err.absolute_path) or "(top level)"


def _line(err) -> str:
    return f"{_where(err)}: {err.message}".replace("\n", " ")[:300]


def schema_errors(doc, name: str) -> list[str]:
    """Every way doc breaks schema `name`, one line each (empty list: valid)."""
    return sorted(_line(e) for e in _validator(name).iter_errors(doc))


def check(doc, name: str, origin: str = "document"):
    """Return doc when it is a valid `name` document, else raise SchemaError (one line)."""
    from jsonschema.exceptions import best_match

    err = best_match(_validator(name).iter_errors(doc))
    if err is not None:
        got = doc.get("schema") if isinstance(doc, dict) else None
        what = f"not a {name} document" if got != name else f"invalid {name} document"
        raise SchemaError(f"{origin}: {what}: {_line(err)}")
    return doc


def check_any(doc, origin: str = "document", packages: tuple[str, ...] = ("smolnet",)):
    """Validate doc against the schema its own `schema` field names (within `packages`)."""
    name = doc.get("schema") if isinstance(doc, dict) else None
    if not isinstance(name, str) or name.split(".", 1)[0] not in packages:
        raise SchemaError(f"{origin}: no known 'schema' field (got {name!r})")
    return check(doc, name, origin)
