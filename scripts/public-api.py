#!/usr/bin/env python3
"""The public API of both crates, listed and checked.

Reads what `cargo doc --workspace --no-deps --all-features` documented (each crate's
`all.html`: every public item rustdoc shows, `#[doc(hidden)]` internals excluded), and

- compares the list with `public-api.txt` (repository root): an item added, removed or
  moved by accident fails the check; `--update` rewrites the list after a deliberate change
  (the CHANGELOG says which paths moved);
- fails when two distinct public items of the two crates share a name (a re-export of the
  same item under a second path is the same item: rustdoc's source link tells them apart).

    cargo doc --workspace --no-deps --all-features && python3 scripts/public-api.py
    python3 scripts/public-api.py --update
"""

import collections
import html
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIST = ROOT / "public-api.txt"
CRATES = ["tributary", "tributary_actors"]
HEADER = (
    "# The public API of tributary and tributary-actors with every feature on (what\n"
    "# `cargo doc --workspace --no-deps --all-features` documents): checked by\n"
    "# `scripts/public-api.py` in CI; `--update` rewrites it after a deliberate change.\n"
)
# Kinds of item whose names must not repeat across distinct items.
TYPES = {"structs", "enums", "traits", "types", "unions"}


def identity_of(page: pathlib.Path, crate: str):
    """What tells two items apart: the item's own source link into `crate`'s sources. An
    item re-exported from the other crate has none (rustdoc inlines it): `None`, the same
    item as its original."""
    item = page.read_text()
    src = re.search(rf'<a class="src" href="(?:\.\./)*(src/{crate}/[^"#]*)(#[^"]*)?"', item)
    return src.group(1) + (src.group(2) or "") if src else None


def documented(doc: pathlib.Path, crate: str):
    """(path, kind, identity) of every item in `crate`'s all.html."""
    page = doc / crate / "all.html"
    if not page.exists():
        sys.exit(f"public-api: {page} is missing: run `cargo doc --workspace --no-deps --all-features` first")
    text = page.read_text()
    parts = re.split(r'<h3 id="([^"]+)">', text)
    for i in range(1, len(parts), 2):
        kind, body = parts[i], parts[i + 1]
        for href, name in re.findall(r'<li><a href="([^"]+)">([^<]+)</a></li>', body):
            yield f"{crate}::{html.unescape(name)}", kind, identity_of(doc / crate / href, crate)


def main() -> int:
    doc = ROOT / "target" / "doc"
    items = [it for crate in CRATES for it in documented(doc, crate)]
    lines = sorted(f"{kind:<10} {path}" for path, kind, _ in items)
    failed = False

    names = collections.defaultdict(set)
    for path, kind, identity in items:
        if kind in TYPES and identity is not None:
            names[path.rsplit("::", 1)[-1]].add((identity, path))
    for name, defs in sorted(names.items()):
        distinct = {identity for identity, _ in defs}
        if len(distinct) > 1:
            failed = True
            print(f"public-api: {len(distinct)} distinct public items named {name}: "
                  + ", ".join(sorted(p for _, p in defs)))

    if "--update" in sys.argv:
        LIST.write_text(HEADER + "".join(line + "\n" for line in lines))
        print(f"public-api: wrote {len(lines)} items to {LIST.name}")
        return 1 if failed else 0
    want = [l for l in LIST.read_text().splitlines() if not l.startswith("#")] if LIST.exists() else []
    added = sorted(set(lines) - set(want))
    removed = sorted(set(want) - set(lines))
    for line in added:
        print(f"public-api: added   {line}")
    for line in removed:
        print(f"public-api: removed {line}")
    if added or removed:
        failed = True
        print("public-api: the public API changed; if that was meant, run "
              "`python3 scripts/public-api.py --update` and say so in CHANGELOG.md")
    if not failed:
        print(f"public-api: {len(lines)} public items as listed in {LIST.name}, no two distinct types share a name")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
