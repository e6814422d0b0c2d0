"""Config files written by earlier versions of the code: keys this version renamed or dropped.

A checkpoint's `config.yaml` (and the run's) holds every config key of the version that wrote it. When a later
version renames or drops a key, `load_config` would refuse that file as naming an unknown key, so the checkpoint
could no longer be exported, nor the run resumed with its own config. Instead each config file is migrated when it is
read: the keys below are moved or removed, and one line says so, e.g.

    config of outputs/tiny/config.yaml: data.foo renamed to data.bar; loss.old dropped (no longer used)

To rename or drop a key, add it here in the same change (dotted keys, `section.key`). A name in these tables must
never become a key again: a file naming it is taken to be older than the change.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

RENAMED: dict[str, str] = {}  # old dotted key → its new dotted key (the value is kept as written)
DROPPED: dict[str, str] = {}  # dotted key → why it went, e.g. "no longer used"
# a setting that became a kind setting (its name was the kind, flat keys beside it its settings): dotted key →
# {old flat dotted key: the setting's name inside it}. A flat key the kind does not read is dropped, as it went unread
# a section that became a kind setting: the keys every config written before held in it, for every kind. A section
# holding all of them is such a config, and the keys its kind does not read are dropped, as they went unread; in any
# other config they are refused
FLAT_SECTIONS: dict[str, tuple[str, ...]] = {
    "loss": ("gamma", "lam", "distance", "reference", "normalize", "estimator"),
    "objective": ("logit_mean", "logit_std", "shift", "beta_schedule", "beta_start", "beta_end"),
}
NESTED: dict[str, dict[str, str]] = {
    "data.balance": {"data.balance_alpha": "alpha", "data.balance_cap": "cap", "data.balance_every": "every",
                     "data.balance_fraction": "fraction", "data.balance_groups": "groups",
                     "data.balance_max": "max_factor", "data.balance_rate": "rate"},
}


def _split(key: str) -> list[str]:
    return key.split(".")


def _pop(tree: dict, key: str):
    """(True, value) after removing `key` from the nested dicts `tree`, or (False, None) if it is not there."""
    *sections, name = _split(key)
    for section in sections:
        tree = tree.get(section)
        if not isinstance(tree, dict):
            return False, None
    if name not in tree:
        return False, None
    return True, tree.pop(name)


def _has(tree: dict, key: str) -> bool:
    *sections, name = _split(key)
    for section in sections:
        tree = tree.get(section)
        if not isinstance(tree, dict):
            return False
    return name in tree


def _put(tree: dict, key: str, value) -> None:
    *sections, name = _split(key)
    for section in sections:
        tree = tree.setdefault(section, {})
    tree[name] = value


def _copy(tree):
    return {k: _copy(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def _drop_unread(tree: dict, key: str, keys: tuple[str, ...], registry: dict[str, type]) -> list[str]:
    """Drop the settings of the kind section `key` its kind does not read, when the section holds every key of
    `keys` (see FLAT_SECTIONS); what changed, as phrases."""
    section = tree.get(key)
    if not isinstance(section, dict) or not all(k in section for k in keys):
        return []
    kind = section.get("kind")
    if not isinstance(kind, str) or kind not in registry:  # the config's own check names the wrong kind
        return []
    reads = {f.name for f in dataclasses.fields(registry[kind])}
    others = {f.name for rule in registry.values() for f in dataclasses.fields(rule)}  # an unknown key is refused
    unread = [k for k in section if k in others - reads]
    for k in unread:
        del section[k]
    return [f"{', '.join(f'{key}.{k}' for k in unread)} dropped (not read by {key} kind {kind})"] if unread else []


def _nest(tree: dict, key: str, flat: dict[str, str], registry: dict[str, type]) -> list[str]:
    """Move the flat keys `flat` of `tree` into the kind setting `key` (see NESTED); what changed, as phrases."""
    present = {}
    for old in flat:
        found, value = _pop(tree, old)
        if found:
            present[old] = value
    if not present:
        return []
    *_, name = _split(key)
    _, base = _pop(tree, key)
    nested = dict(base) if isinstance(base, dict) else ({} if base is None else {"kind": base})
    kind = nested.get("kind")
    known = isinstance(kind, str) and kind in registry  # else the config's own check names the wrong kind
    reads = {f.name for f in dataclasses.fields(registry[kind])} if known else None
    moved, unread = [], []
    for old, value in present.items():
        if reads is not None and flat[old] not in reads:
            unread.append(old)
        elif flat[old] not in nested:  # set in its new place too: that one is read
            nested[flat[old]] = value
            moved.append(old)
    _put(tree, key, nested)
    written = ", ".join(f"{name}: {value}" for name, value in nested.items())
    changes = [f"{', '.join(moved)} became {key}: {{{written}}}"] if moved else []
    if unread:
        changes.append(f"{', '.join(unread)} dropped (not read by {key} kind {kind})")
    return changes


def migrate_config(loaded: dict, source: str, renamed: dict[str, str] | None = None,
                   dropped: dict[str, str] | None = None, log: Callable[[str], None] | None = None,
                   nested: dict[str, dict[str, str]] | None = None) -> dict:
    """`loaded` (a config file's mapping of sections) with the keys of `renamed`/`dropped`/`nested` (default: this
    version's tables) moved or removed, as a new mapping; when anything changed, one line naming `source` says what.
    A renamed key whose new name the file also sets is dropped: the new one is the one this version reads."""
    renamed = RENAMED if renamed is None else renamed
    dropped = DROPPED if dropped is None else dropped
    nested = NESTED if nested is None else nested
    if not isinstance(loaded, dict):
        return loaded
    migrated, changes = _copy(loaded), []
    for key, flat in nested.items():
        changes += _nest(migrated, key, flat, kind_registry(key))
    for key, keys in FLAT_SECTIONS.items():
        changes += _drop_unread(migrated, key, keys, kind_registry(key))
    for old, new in renamed.items():
        present, value = _pop(migrated, old)
        if not present:
            continue
        if _has(migrated, new):
            changes.append(f"{old} dropped ({new}, its new name, is set too)")
        else:
            _put(migrated, new, value)
            changes.append(f"{old} renamed to {new}")
    for key, why in dropped.items():
        present, _ = _pop(migrated, key)
        if present:
            changes.append(f"{key} dropped ({why})")
    if changes:
        (log or _print_once)(f"config of {source}: {'; '.join(changes)}")
    return migrated


def kind_registry(key: str) -> dict[str, type]:
    """The kinds of the kind setting `key` ("loss", "data.balance"), by name."""
    from data.settings import BALANCE_RULES
    from imba.loss_settings import LOSS_SETTINGS
    from imba.objective_settings import OBJECTIVE_SETTINGS

    return {"loss": LOSS_SETTINGS, "objective": OBJECTIVE_SETTINGS, "data.balance": BALANCE_RULES}[key]


def _print_once(line: str) -> None:
    """Print on the first process only: every process of a launch reads the config before any knows its rank."""
    if os.environ.get("RANK", "0") == "0":
        print(line)
