"""`train.py --help`: the usage line and every setting of the config, read from the section dataclasses and the
kinds' registries of `imba.training.config`, so the list cannot drift from what `load_config` accepts."""

from __future__ import annotations

import dataclasses
import typing

from imba.training.config import (CHOICES, ITEM_KIND_RANGES, ITEM_KIND_SETTINGS, KIND_RANGES, KIND_SETTINGS, RANGES,
                                  SECTIONS, Config, as_data, written)

USAGE = """usage: python train.py [--config FILE] [--resume latest|CHECKPOINT] [section.key=value ...]
       python train.py --export CHECKPOINT_FOLDER [EXPORT_DIR]

Precedence: the defaults below < the YAML file < the section.key=value overrides (values read as YAML).
Each setting with its type, its default, and its allowed values or range; a section's own cross-field checks
(e.g. data.balance.cap with data.balance=cap) run after these. A kind setting (data.balance) takes a kind's
name, or its settings: data.balance=cap data.balance.cap=20000."""


def _kind_lines(key: str, default, registry: dict[str, type]) -> list[str]:
    """--help's lines of a kind setting (`default`: its default value) or of a list of kinds (`default`: a list):
    its kind, then each kind's settings."""
    items = isinstance(default, list)
    head = (f"{'list':<10} default {written(as_data(default))}; each item a kind, default {next(iter(registry))},"
            if items else f"{'kind':<10} default {default.KIND},")
    lines = [f"  {key:<34} {head} one of {', '.join(registry)}"]
    ranges, prefix = (ITEM_KIND_RANGES, f"{key}[]") if items else (KIND_RANGES, key)
    # the items' kinds share their weights: listed once
    shared = set.intersection(*({f.name for f in dataclasses.fields(r)} for r in registry.values())) if items else set()
    for n, (choice, rule) in enumerate(registry.items()):
        hints = typing.get_type_hints(rule)
        for f in dataclasses.fields(rule):
            if f.name in shared and n:
                continue
            type_name = getattr(hints[f.name], "__name__", None) or str(hints[f.name]).replace("typing.", "")
            line = (f"  {f'{prefix}.{f.name}':<34} {type_name:<10} default {written(getattr(rule(), f.name))}"
                    f" ({'every kind' if f.name in shared else f'kind {choice}'})")
            if f.name in rule.CHOICES:
                line += f", one of {', '.join(map(str, rule.CHOICES[f.name]))}"
            elif f.name in rule.RANGES:
                line += f", must be {ranges[f'{key}.{f.name}'][choice]}"
            lines.append(line)
    return lines


def help_text() -> str:
    """`train.py --help`: the usage, then every setting read from the section dataclasses (type, default, choices
    or range), so the list cannot drift from what `load_config` accepts."""
    lines = [USAGE]
    defaults = Config()
    for section, kind in SECTIONS.items():
        lines.append(f"\n{section}:")
        if section in KIND_SETTINGS:
            lines += _kind_lines(section, getattr(defaults, section), KIND_SETTINGS[section])
            continue
        hints = typing.get_type_hints(kind)
        for f in dataclasses.fields(kind):
            key, hint = f"{section}.{f.name}", hints[f.name]
            default = getattr(getattr(defaults, section), f.name)
            if registry := {**KIND_SETTINGS, **ITEM_KIND_SETTINGS}.get(key):
                lines += _kind_lines(key, default, registry)
                continue
            type_name = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
            line = f"  {key:<34} {type_name:<10} default {written(default)}"
            if key in CHOICES:
                line += f", one of {', '.join(map(str, CHOICES[key]))}"
            elif key in RANGES:
                line += f", must be {RANGES[key]}"
            lines.append(line)
    return "\n".join(lines)
