"""`dufu configs`: list the packaged recipes, each with the first comment line of its file."""

from __future__ import annotations

from dufu.config import list_recipes, resolve_config_path


def main(argv: list[str]) -> int:
    for name in list_recipes():
        first = ""
        for line in resolve_config_path(name).read_text().splitlines():
            if line.startswith("#"):
                first = line.lstrip("# ").strip()
                break
        print(f"  {name:<16} {first}")
    return 0
