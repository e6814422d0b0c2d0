"""Kinds are branched on where they are defined, nowhere else: a module that compares a kind setting with a kind's
name (`cfg.loss.kind == "imba"`, `rule.KIND != "none"`) says something about that kind that its own class should
say (its `describe()`, a class attribute), and goes silently wrong when a kind is added. The rule is checked on
the syntax tree of every module, and fails on a planted branch."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# an attribute path's last names -> the modules that define those kinds, the only ones that may branch on them
OWNERS = {
    ("loss", "kind"): {"imba/training_loss.py", "imba/loss_settings.py"},
    ("objective", "kind"): {"imba/objectives.py", "imba/objective_settings.py"},
    ("balance",): {"data/balance.py", "data/online_balance.py", "data/settings.py"},
    ("balance", "KIND"): {"data/balance.py", "data/online_balance.py", "data/settings.py"},
    ("KIND",): {"data/balance.py", "data/online_balance.py", "data/settings.py"},
}


def _path(node: ast.AST) -> tuple[str, ...]:
    """`cfg.loss.kind` -> ("cfg", "loss", "kind"); () for anything but names and attributes."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
        return tuple(reversed(names))
    return ()


def _names_a_kind(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(_names_a_kind(e) for e in node.elts)


def kind_branches(source: str, module: str) -> list[str]:
    """'module:line attribute' for each comparison of a kind setting with a kind's name outside its owners."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        if not any(_names_a_kind(side) for side in sides):
            continue
        for side in sides:
            path = _path(side)
            for tail, owners in OWNERS.items():
                # an attribute (cfg.loss.kind, rule.KIND), not a local name
                if len(path) > len(tail) and path[-len(tail):] == tail and module not in owners:
                    found.append(f"{module}:{node.lineno} {'.'.join(path)}")
                    break
    return found


def modules() -> list[Path]:
    return [REPO / "train.py",
            *sorted(p for folder in ("imba", "data", "models") for p in (REPO / folder).rglob("*.py"))]


def test_no_module_branches_on_a_kind_it_does_not_define():
    found = [hit for path in modules() for hit in kind_branches(path.read_text(), str(path.relative_to(REPO)))]
    assert found == []


def test_a_planted_branch_on_a_kind_is_found():
    planted = {
        "imba/training/model_card.py": 'level = "token" if cfg.loss.kind == "imba" else "sample"\n',
        "train.py": 'if cfg.data.balance.KIND != "none":\n    pass\n',
        "imba/training/inputs.py": 'online = d.balance in ("imba",)\n',
        "imba/training/config.py": 'ddpm = cfg.objective.kind == "ddpm"\n',
    }
    for module, line in planted.items():
        assert len(kind_branches(line, module)) == 1, module
    # and a kind's own module may
    assert kind_branches('x = self.kind == "plain"\n', "imba/training_loss.py") == []
    assert kind_branches('x = cfg.loss.kind == "plain"\n', "imba/loss_settings.py") == []
