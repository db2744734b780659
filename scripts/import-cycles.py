#!/usr/bin/env python3
"""Lists the dependencies between the top-level modules of each crate and fails on a cycle.

A module depends on another when one of its files names `crate::<other>`, or an item the
crate root re-exports from it (`crate::Item`), in a `use` or inline (comments and doc links
aside); a `super::` that climbs to the crate root counts as `crate::`. `lib.rs`, the root
that re-exports, is not a module here. With `--verbose`, prints every edge with the first
file that makes it.

    python3 scripts/import-cycles.py [--verbose]
"""

import re
import sys
from pathlib import Path

CRATES = ["src", "actors/src"]

COMMENT = re.compile(r"//.*$")
CRATE = re.compile(r"\bcrate::")
SUPERS = re.compile(r"(?<![A-Za-z0-9_:])(?:super::)+")
REEXPORT = re.compile(r"^pub(?:\(crate\))? use ([A-Za-z_][A-Za-z0-9_]*)::(\{[^}]*\}|[A-Za-z_0-9]+);",
                      re.MULTILINE)


def top_module(root: Path, file: Path):
    rel = file.relative_to(root)
    if rel.parts == ("lib.rs",):
        return None
    first = rel.parts[0]
    return first[:-3] if first.endswith(".rs") else first


def heads(group: str):
    """The first segment of each path of a `{a, b::c, d::{e}}` group."""
    depth, part, parts = 0, "", []
    for ch in group:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(part)
            part = ""
        else:
            part += ch
    parts.append(part)
    for p in parts:
        p = p.strip()
        if p:
            yield re.split(r"[:\s{]", p)[0]


def code_of(text: str) -> str:
    """`text` without comments, on one line (groups may span lines)."""
    return re.sub(r"\s+", " ", "\n".join(COMMENT.sub("", line) for line in text.splitlines()))


def paths(code: str, prefix: re.Pattern):
    """`(match, group or None, name or None)` for each path that `prefix` starts: a braced
    group (balanced) or a single name."""
    for m in prefix.finditer(code):
        i = m.end()
        if code.startswith("{", i):
            depth, j = 0, i
            while j < len(code):
                depth += {"{": 1, "}": -1}.get(code[j], 0)
                if depth == 0:
                    break
                j += 1
            yield m, code[i + 1 : j], None
        else:
            name = re.match(r"[A-Za-z_][A-Za-z0-9_]*", code[i:])
            if name:
                yield m, None, name.group(0)


def names(text: str, depth: int):
    """The first segments of the crate-root paths in `text`, written in a module `depth`
    levels below the root."""
    code = code_of(text)
    found = [(g, n) for _, g, n in paths(code, CRATE)]
    found += [(g, n) for m, g, n in paths(code, SUPERS) if m.group(0).count("super::") >= depth]
    for group, single in found:
        if single:
            yield single
        else:
            yield from heads(group)


def reexports(root: Path):
    """Items the crate root re-exports, by name: the module each comes from."""
    out = {}
    for module, what in REEXPORT.findall(code_of((root / "lib.rs").read_text()).replace("; ", ";\n")):
        for name in heads(what.strip("{}")) if what.startswith("{") else [what]:
            out[name] = module
    return out


def depth_of(root: Path, file: Path) -> int:
    rel = file.relative_to(root)
    return len(rel.parts) - (1 if rel.name == "mod.rs" else 0)


def crate_edges(root: Path):
    modules = {top_module(root, f) for f in root.rglob("*.rs")} - {None}
    items = reexports(root)
    edges = {}
    for f in sorted(root.rglob("*.rs")):
        src = top_module(root, f)
        if src is None:
            continue
        for name in names(f.read_text(), depth_of(root, f)):
            target = name if name in modules else items.get(name)
            if target in modules and target != src:
                edges.setdefault((src, target), str(f))
    return modules, edges


def cycles(modules, edges):
    """Strongly connected components of more than one module (Tarjan)."""
    graph = {m: sorted(b for (a, b) in edges if a == m) for m in modules}
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for m in sorted(modules):
        if m not in index:
            visit(m)
    return out


def main():
    verbose = "--verbose" in sys.argv[1:]
    here = Path(__file__).resolve().parent.parent
    failed = False
    for crate in CRATES:
        root = here / crate
        modules, edges = crate_edges(root)
        if verbose:
            for (a, b), f in sorted(edges.items()):
                print(f"{crate}: {a} -> {b}  ({Path(f).relative_to(here)})")
        found = cycles(modules, edges)
        for comp in found:
            failed = True
            print(f"{crate}: import cycle among {', '.join(comp)}:")
            for (a, b), f in sorted(edges.items()):
                if a in comp and b in comp:
                    print(f"    {a} -> {b} ({Path(f).relative_to(here)})")
        if not found:
            print(f"{crate}: {len(modules)} modules, {len(edges)} edges, no import cycle")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
