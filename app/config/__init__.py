"""The appliance's configuration: one Settings model, layered from CLI, env, recipe and defaults.

    from app.config import load_settings, Settings, ConfigError
    settings = load_settings(["my-model", "--max-num-seqs", "8"])
"""

from app.config.errors import ConfigError
from app.config.loader import Resolved, load_settings, resolve_with_sources
from app.config.settings import Settings
from app.config.sources import Source

__all__ = ["ConfigError", "Resolved", "Settings", "Source", "load_settings", "resolve_with_sources"]
