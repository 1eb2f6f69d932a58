"""`tokenspeed config schema`: the JSON schema of a recipe file, so editors can check the YAML."""

from __future__ import annotations

import copy
from typing import Any

from app.config.names import ALIASES
from app.config.settings import Settings

_INTERNAL_KEYS = ("group", "origin")  # field metadata kept on the model, not schema keywords


def recipe_schema() -> dict[str, Any]:
    """Every parameter under its snake_case and kebab-case keys (and the aliases); none is required,
    since a recipe may leave the model to the command line or the environment."""
    base = Settings.model_json_schema()
    properties: dict[str, Any] = {}
    for name, prop in base["properties"].items():
        prop = {k: v for k, v in prop.items() if k not in _INTERNAL_KEYS}
        prop.pop("title", None)
        properties[name] = prop
    for spelling in list(properties) + list(ALIASES):
        target = properties[ALIASES.get(spelling, spelling)]
        if spelling not in properties:
            properties[spelling] = copy.deepcopy(target)
        kebab = spelling.replace("_", "-")
        if kebab != spelling:
            properties[kebab] = copy.deepcopy(target)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "TokenSpeed appliance recipe",
        "description": "A recipe YAML for `tokenspeed serve --config FILE`: a flat mapping of parameter names "
        "(snake_case or kebab-case) to values; JSON-valued parameters are mappings.",
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
    }
