"""The named code snippets of a Markdown page, so that a test runs the code the docs show, as they show it.

A snippet is the fenced code block right after a `<!-- snippet: NAME -->` line (invisible when the page is
rendered). A ```diff block is a change to a script: `before()` is the script as it ships (its context and `-`
lines), `after()` the script with the change (its context and `+` lines).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_MARK = re.compile(r"^<!--\s*snippet:\s*([\w.-]+)\s*-->\s*$")
_FENCE = re.compile(r"^(`{3,})\s*(\w*)\s*$")


@dataclass(frozen=True)
class DocSnippet:
    name: str
    language: str
    text: str
    line: int  # of the block's first line in the page

    def before(self) -> str:
        return self._side("-") if self.language == "diff" else self.text

    def after(self) -> str:
        return self._side("+") if self.language == "diff" else self.text

    def _side(self, sign: str) -> str:
        lines = []
        for line in self.text.splitlines():
            if line[:1] not in (" ", "+", "-", ""):
                raise ValueError(f"snippet {self.name!r}: a diff line must start with ' ', '+' or '-': {line!r}")
            if line[:1] in (" ", sign, ""):
                lines.append(line[1:])
        return "\n".join(lines) + "\n"


def doc_snippets(path: Path) -> dict[str, DocSnippet]:
    """{name: snippet} of the page at `path`; a mark not followed by a fenced block, an unclosed block or a name
    used twice is an error."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: dict[str, DocSnippet] = {}
    for number, line in enumerate(lines):
        mark = _MARK.match(line)
        if not mark:
            continue
        name = mark.group(1)
        fence = _FENCE.match(lines[number + 1]) if number + 1 < len(lines) else None
        if fence is None:
            raise ValueError(f"{path.name}:{number + 1}: snippet {name!r} is not followed by a fenced code block")
        end = next((i for i in range(number + 2, len(lines)) if lines[i].strip() == fence.group(1)), None)
        if end is None:
            raise ValueError(f"{path.name}:{number + 2}: the code block of snippet {name!r} is not closed")
        if name in found:
            raise ValueError(f"{path.name}:{number + 1}: snippet {name!r} is named twice")
        found[name] = DocSnippet(name, fence.group(2), "\n".join(lines[number + 2:end]) + "\n", number + 3)
    return found
