"""Kinds are branched on where they are defined, nowhere else: a module that compares a kind setting with a kind's
name (`cfg.loss.kind == "imba"`, `rule.KIND != "none"`) says something about that kind that its own class should
say (its `describe()`, a class attribute), and goes silently wrong when a kind is added. The rule is checked on
the syntax tree of every module, and fails on a planted branch."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# an attribute path's last names -> the modules that define those kinds, the only ones that may branch on them (the
# longest match decides); a loss kind is a class that builds its own loss, so no module branches on its name
OWNERS = {
    ("kind",): set(),
    ("objective", "kind"): {"imba/objectives.py", "imba/objective_settings.py"},
    ("balance",): {"data/balance.py", "data/online_balance.py", "data/settings.py"},
    ("balance", "KIND"): {"data/balance.py", "data/online_balance.py", "data/settings.py"},
    ("KIND",): {"data/balance.py", "data/online_balance.py", "data/settings.py", "data/sources.py"},
}


@functools.cache
def _kind_classes() -> dict[str, set[str]]:
    """Every registered kind's class name, and the class of the training loss a loss kind builds -> the modules
    that may test for it (`isinstance`): where it is defined and where its registry is."""
    import inspect

    from data.settings import BALANCE_RULES, SOURCE_KINDS
    from imba.loss_settings import LOSS_SETTINGS
    from imba.objective_settings import OBJECTIVE_SETTINGS

    owners = {}
    for registry, home in ((LOSS_SETTINGS, "imba/loss_settings.py"), (OBJECTIVE_SETTINGS, "imba/objective_settings.py"),
                           (BALANCE_RULES, "data/settings.py"), (SOURCE_KINDS, "data/settings.py")):
        for kind in registry.values():
            defined = str(Path(inspect.getfile(kind)).resolve().relative_to(REPO))
            owners[kind.__name__] = {defined, home}
    for kind in LOSS_SETTINGS.values():
        loss = type(kind().build())
        owners[loss.__name__] = {str(Path(inspect.getfile(loss)).resolve().relative_to(REPO))}
    return owners


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
    """'module:line attribute' for each comparison of a kind setting with a kind's name, and each `isinstance` test
    for a registered kind's class, outside its owners."""
    found = []
    classes = _kind_classes()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and _path(node.func) == ("isinstance",) and len(node.args) == 2:
            tested = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            for cls in tested:
                name = _path(cls)[-1:] or ("",)
                if name[0] in classes and module not in classes[name[0]]:
                    found.append(f"{module}:{node.lineno} isinstance {name[0]}")
            continue
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        if not any(_names_a_kind(side) for side in sides):
            continue
        for side in sides:
            path = _path(side)
            # an attribute (cfg.loss.kind, rule.KIND), not a local name
            tails = [tail for tail in OWNERS if len(path) > len(tail) and path[-len(tail):] == tail]
            if tails and module not in OWNERS[max(tails, key=len)]:
                found.append(f"{module}:{node.lineno} {'.'.join(path)}")
    return found


def modules() -> list[Path]:
    return [REPO / "train.py",
            *sorted(p for folder in ("imba", "data", "models") for p in (REPO / folder).rglob("*.py"))]


def test_no_module_branches_on_a_kind_it_does_not_define():
    found = [hit for path in modules() for hit in kind_branches(path.read_text(), str(path.relative_to(REPO)))]
    assert found == []


def test_a_planted_branch_on_a_kind_is_found():
    planted = [  # (module, line, branches in it)
        ("imba/training/model_card.py", 'level = "token" if cfg.loss.kind == "imba" else "sample"\n', 1),
        ("train.py", 'if cfg.data.balance.KIND != "none":\n    pass\n', 1),
        ("imba/training/inputs.py", 'online = d.balance in ("imba",)\n', 1),
        ("imba/training/config.py", 'ddpm = cfg.objective.kind == "ddpm"\n', 1),
        ("data/draw_plan.py", "reads = not isinstance(balance, NoBalance)\n", 1),
        ("imba/training/inputs.py", "own = isinstance(kind, (ShardsSource, data.sources.SyntheticSource))\n", 2),
        ("imba/training/model_card.py", 'named = [s for s in d.sources if s.KIND == "synthetic"]\n', 1),
        ("imba/training_loss.py", 'x = self.kind == "plain"\n', 1),  # a loss kind's own behaviour is its class's
        ("imba/loss_settings.py", 'x = cfg.loss.kind == "plain"\n', 1),
        ("imba/training/step.py", "x = isinstance(self.loss_fn, ImbaTrainingLoss)\n", 1),
        ("imba/training/plan.py", 'x = cfg.loss.KIND in ("imba", "imba_sample")\n', 1),
    ]
    for module, line, branches in planted:
        assert len(kind_branches(line, module)) == branches, line
    # and a kind's own module may
    assert kind_branches('x = cfg.objective.kind == "ddpm"\n', "imba/objective_settings.py") == []
    assert kind_branches("x = isinstance(self.balance, NoBalance)\n", "data/settings.py") == []
    assert kind_branches("x = isinstance(value, PlainLoss)\n", "imba/loss_settings.py") == []
