"""Check that every relative link in the repository's Markdown files resolves: the file exists,
and a `#anchor` names a heading of it (GitHub's slugs). Prints each broken link; exit 1 if any.

    python docs/check_links.py
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

repo = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", path.read_text(), re.M)}


def links(path: Path):
    """(line number, target) of each link outside code blocks (a link's text may span lines)."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        fenced ^= line.startswith("```")
        lines.append("" if fenced or line.startswith(("```", "    ")) else line)
    text = "\n".join(lines)
    for m in LINK.finditer(text):
        yield text.count("\n", 0, m.start(1)) + 1, m.group(1)


def main() -> int:
    files = [p for p in repo.rglob("*.md") if not any(part.startswith(".") for part in p.relative_to(repo).parts)
             and "egg-info" not in str(p)]
    broken = 0
    for md in sorted(files):
        for number, target in links(md):
            if re.match(r"^[a-z]+:", target):
                continue  # http:, mailto:, ...
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            if not dest.exists():
                print(f"{md.relative_to(repo)}:{number}: {target}: no such file")
                broken += 1
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                print(f"{md.relative_to(repo)}:{number}: {target}: no heading #{anchor}")
                broken += 1
    print(f"{broken} broken link(s) in {len(files)} Markdown file(s)")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
