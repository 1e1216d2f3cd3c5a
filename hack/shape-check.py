#!/usr/bin/env python3
"""The code's shape, checked so that it cannot erode (`make lint` runs this).

For every production Rust file of the workspace (`*/src/**/*.rs`; a file's test module, from
a `#[cfg(test)]` that opens a `mod` on, does not count):

- a module may have at most 600 lines;
- a function may have at most 100 lines (signature to closing brace);
- the modules of one crate may not import each other in a circle (`use crate::…`,
  `use super::…`, and `crate::…` paths in the code).

What is over a bound today is listed in hack/shape-allow.txt with the size it may not grow
past and a reason: a module or function there fails when it grows, and the entry must go
when it is back under the bound (the check says so). New import circles fail; the known
ones are listed there too.

Usage: hack/shape-check.py [--report]   (--report: print every module and function over a
bound and every circle, whatever the allow-list says; exits 0)
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_MODULE = 600
MAX_FUNCTION = 100
ALLOW = os.path.join(ROOT, "hack", "shape-allow.txt")
CRATES = ["api", "agent", "server", "operator", "proxy", "e2e", "e2e/kubelet", "bench"]

FN_RE = re.compile(r"^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?(extern\s+\"[^\"]*\"\s+)?fn\s+([A-Za-z_][A-Za-z0-9_]*)")
TEST_MOD_RE = re.compile(r"^\s*#\[cfg\(test\)\]\s*$")
MOD_RE = re.compile(r"^\s*(pub(\([^)]*\))?\s+)?mod\s+\w+")


def production_lines(lines):
    """The lines before the test module (a `#[cfg(test)]` whose next item is a `mod`)."""
    for i, line in enumerate(lines):
        if TEST_MOD_RE.match(line):
            j = i + 1
            while j < len(lines) and lines[j].strip().startswith("#["):
                j += 1
            if j < len(lines) and MOD_RE.match(lines[j]):
                return lines[:i]
    return lines


def strip_code(text):
    """`text` with comments, strings and char literals blanked (newlines kept), so that
    braces can be counted."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            i = j
            continue
        if text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append("\n" * text.count("\n", i, j))
            i = j
            continue
        m = re.match(r'b?r(#*)"', text[i:i + 40])
        if m and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = '"' + m.group(1)
            j = text.find(end, i + len(m.group(0)))
            j = n if j < 0 else j + len(end)
            out.append("\n" * text.count("\n", i, j))
            i = j
            continue
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append("\n" * text.count("\n", i, j + 1))
            i = j + 1
            continue
        if c == "'":
            # A char literal ('x', '\n', '\u{..}', '{'); anything else is a lifetime.
            m = re.match(r"'(\\u\{[0-9a-fA-F]+\}|\\.|[^\\'])'", text[i:i + 12])
            if m:
                i += len(m.group(0))
                continue
        out.append(c)
        i += 1
    return "".join(out)


def functions(code_lines):
    """(name, first line, length) of every function with a body, nested ones included."""
    found = []
    text = "\n".join(code_lines)
    stripped = strip_code(text).split("\n")
    for idx, line in enumerate(stripped):
        m = FN_RE.match(line)
        if not m:
            continue
        # `nest` counts brackets and parentheses of the signature, so the `;` of an array
        # type (`-> [u8; 32]`) is not taken for the end of a body-less declaration.
        depth, nest, started = 0, 0, False
        for j in range(idx, len(stripped)):
            for ch in stripped[j]:
                if ch == "{":
                    depth += 1
                    started = True
                elif ch == "}":
                    depth -= 1
                elif ch in "[(" and not started:
                    nest += 1
                elif ch in "])" and not started:
                    nest -= 1
                elif ch == ";" and not started and depth == 0 and nest == 0:
                    break
            else:
                if started and depth == 0:
                    found.append((m.group(7), idx + 1, j - idx + 1))
                    break
                continue
            break
    return found


def rust_files():
    for crate in CRATES:
        src = os.path.join(ROOT, crate, "src")
        for dirpath, _, files in os.walk(src):
            for f in sorted(files):
                if f.endswith(".rs"):
                    yield crate, os.path.join(dirpath, f)


def module_path(crate, path):
    """`a::b` for crate/src/a/b.rs (or a/b/mod.rs); '' for lib.rs/main.rs; bins by name."""
    rel = os.path.relpath(path, os.path.join(ROOT, crate, "src"))[:-3].split(os.sep)
    if rel[-1] == "mod":
        rel = rel[:-1]
    if rel in (["lib"], ["main"]):
        return ""
    if rel[0] == "bin":
        return None
    return "::".join(rel)


USE_RE = re.compile(r"\b(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
GROUP_RE = re.compile(r"\b(crate|super)::\{([^}]*)\}")


def imports(crate_mods, mod, code):
    """The modules of the same crate that `mod`'s code names."""
    targets = set()
    parts = mod.split("::") if mod else []

    def resolve(kind, rest):
        base = [] if kind == "crate" else parts[:-1]
        path = base + [p for p in rest if p]
        # The longest prefix that is a module of this crate.
        for k in range(len(path), 0, -1):
            cand = "::".join(path[:k])
            if cand in crate_mods:
                return cand
        return None

    for m in USE_RE.finditer(code):
        t = resolve(m.group(1), m.group(2).split("::"))
        if t is not None and t != mod and not mod.startswith(t + "::") and not t.startswith(mod + "::" if mod else "\0"):
            targets.add(t)
    for m in GROUP_RE.finditer(code):
        for item in m.group(2).split(","):
            first = item.strip().split("::")[0].strip()
            if first and first != "self":
                t = resolve(m.group(1), ["", first])
                if t is not None and t != mod and not mod.startswith(t + "::"):
                    targets.add(t)
    return targets


def circles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def measure():
    modules, funcs, graphs = {}, {}, {}
    per_crate = {}
    for crate, path in rust_files():
        rel = os.path.relpath(path, ROOT)
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        prod = production_lines(lines)
        modules[rel] = len(prod)
        for name, line, length in functions(prod):
            funcs[f"{rel}::{name}@{line}"] = (f"{rel}::{name}", length)
        mod = module_path(crate, path)
        if mod is not None:
            per_crate.setdefault(crate, {})[mod] = "\n".join(strip_code("\n".join(prod)).split("\n"))
    for crate, mods in per_crate.items():
        graph = {m: imports(mods, m, code) for m, code in mods.items()}
        graphs[crate] = circles(graph)
    return modules, funcs, graphs


def load_allow():
    allow = {"module": {}, "function": {}, "circle": set()}
    with open(ALLOW, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            kind, rest = line.split(None, 1)
            if kind == "circle":
                allow["circle"].add(rest.split("|")[0].strip())
                continue
            what, size, reason = [p.strip() for p in rest.split("|", 2)]
            if not reason:
                sys.exit(f"{ALLOW}:{n}: an entry needs a reason")
            allow[kind][what] = int(size)
    return allow


def over_bounds(kind, sizes, bound, ceilings, fix):
    """What is over `bound` beyond its ceiling, and allow-list entries no longer needed."""
    out = []
    for what, n in sorted(sizes.items()):
        ceiling = ceilings.get(what)
        if n > bound and (ceiling is None or n > ceiling):
            allowed = f"; allowed up to {ceiling} while it is split" if ceiling else ""
            out.append(f"{kind} {what}: {n} lines (at most {bound}{allowed}): {fix}")
        elif ceiling is not None and n <= bound:
            out.append(f"{kind} {what}: {n} lines, under the bound now: remove its entry from hack/shape-allow.txt")
    for what in ceilings:
        if what not in sizes:
            out.append(f"{kind} {what}: not found any more: remove its entry from hack/shape-allow.txt")
    return out


def main():
    report = "--report" in sys.argv[1:]
    modules, funcs, graphs = measure()
    problems = []
    allow = {"module": {}, "function": {}, "circle": set()} if report else load_allow()

    by_name = {}
    for name, length in funcs.values():
        by_name[name] = max(by_name.get(name, 0), length)
    problems += over_bounds("module", modules, MAX_MODULE, allow["module"],
                            "split it into modules that own one part each")
    problems += over_bounds("function", by_name, MAX_FUNCTION, allow["function"],
                            "give its steps functions of their own")
    for crate, comps in sorted(graphs.items()):
        for comp in comps:
            key = f"{crate}: " + " <-> ".join(comp)
            if key not in allow["circle"]:
                problems.append(f"import circle in {key}: a module that others import must not import them back")
    if report:
        print("\n".join(problems) or "nothing over a bound")
        return 0
    if problems:
        print("shape check failed (hack/shape-check.py; bounds: modules 600 lines, functions 100, no import circles):")
        print("\n".join("  " + p for p in problems))
        return 1
    over_m = sum(1 for n in modules.values() if n > MAX_MODULE)
    over_f = sum(1 for _, l in by_name.items() if l > MAX_FUNCTION)
    known = sum(len(c) for c in graphs.values())
    print(f"shape: {len(modules)} modules, {len(by_name)} functions; allowed while being split: "
          f"{over_m} modules, {over_f} functions, {known} import circles")
    return 0


if __name__ == "__main__":
    sys.exit(main())
