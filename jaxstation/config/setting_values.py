"""The values a setting's text can hold: each parser turns what the user typed (in a flag or a `MOONSHINE_*` variable)
into the value, or a `ConfigError` that names the setting and the text."""

from __future__ import annotations

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class ConfigError(ValueError):
    """A setting that cannot work; the message names the environment variable and the flag to change."""


def parse_bool(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ConfigError(f"{name}={value!r} is not a boolean; use one of 1/0, true/false, yes/no, on/off")


def parse_int(name: str, value: str) -> int:
    try:
        return int(value.strip())
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None


def parse_float(name: str, value: str) -> float:
    try:
        return float(value.strip())
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a number") from None


def parse_str(name: str, value: str) -> str | None:
    return value or None


def parse_names(name: str, value: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in value.split(","))
    if not all(names):
        raise ConfigError(f"{name}={value!r} must be one name or several, comma-separated")
    return names


def parse_lora_modules(name: str, value: str) -> tuple[tuple[str, str], ...]:
    """name=path pairs, separated by commas or spaces (a flag given several values joins them)."""
    pairs = []
    for item in value.replace(",", " ").split():
        adapter, sep, path = item.partition("=")
        if not (sep and adapter and path):
            raise ConfigError(f"{name}={value!r}: {item!r} must be name=path")
        pairs.append((adapter, path))
    names = [n for n, _ in pairs]
    if len(set(names)) < len(names):
        raise ConfigError(f"{name}={value!r} names an adapter twice")
    return tuple(pairs)
