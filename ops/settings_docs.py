"""The README's settings table, generated from every service's settings class."""

from __future__ import annotations

from pydantic import SecretStr

from laneway.settings import settings_classes

__all__ = ["settings_table"]


def settings_table() -> str:
    """Markdown table of every setting (README's settings section is generated from it)."""
    rows = ["| variable | used by | default | meaning |", "|---|---|---|---|"]
    seen: dict[str, list[str]] = {}
    info: dict[str, tuple[str, str]] = {}
    for owner, cls in settings_classes().items():
        for name, field in cls.model_fields.items():
            var = f"LANEWAY_{name.upper()}"
            if var in seen and "all" in seen[var]:
                continue
            seen.setdefault(var, []).append(owner)
            if field.default_factory is not None:
                generated = name == "instance_id"
                default = "(generated)" if generated else repr(field.default_factory())  # type: ignore[call-arg]
            elif isinstance(field.default, SecretStr):
                default = "(secret)"
            else:
                default = repr(field.default)
            info.setdefault(var, (default, field.description or ""))
    for var, owners in seen.items():
        default, meaning = info[var]
        rows.append(f"| `{var}` | {', '.join(owners)} | `{default}` | {meaning} |")
    return "\n".join(rows)
