#!/usr/bin/env python3
"""Which kernels two builds compile to the same SASS.

Reads two `cuobjdump -sass` listings (BEFORE and AFTER, e.g. of
build/local-check/w4a16.o from two commits' cuda/local-check.sh) and, for
every function, says whether its instructions are identical once the
addresses, the encodings' comments and the anonymous namespace's hash are
set aside. --rename 'REGEX=>REPLACEMENT' rewrites BEFORE's names first
(Python's re.sub), for a template parameter the later code removed.

  cuobjdump -sass before.o > before.sass; cuobjdump -sass after.o > after.sass
  python3 evals/sass_diff.py before.sass after.sass [--rename 'REGEX=>REPLACEMENT']
"""
import re
import sys


def functions(path):
    """The listing's functions, "arch name" to its instructions (a fat
    binary holds each kernel once for every architecture)."""
    out, name, body, arch = {}, None, [], "?"
    for line in open(path, errors="replace"):
        m = re.match(r"\s*arch = (\S+)", line)
        if m:
            if name:
                out[name] = body
            name, body, arch = None, [], m.group(1)
            continue
        m = re.search(r"Function : (\S+)", line)
        if m:
            if name:
                out[name] = body
            name, body = arch + " " + m.group(1), []
            continue
        if name is None:
            continue
        line = re.sub(r"/\*[0-9a-f]{4}\*/", "", line)  # addresses
        line = re.sub(r"/\* 0x[0-9a-f]+ \*/", "", line)  # encodings
        line = re.sub(r"_GLOBAL__N__[0-9a-f]+_[0-9]+_\w+?_cu_[0-9a-f]{8}", "NS", line)
        if line.strip():
            body.append(line.strip())
    if name:
        out[name] = body
    return {re.sub(r"_GLOBAL__N__[0-9a-f]+_[0-9]+_\w+?_cu_[0-9a-f]{8}", "NS", k): v for k, v in out.items()}


def main():
    args = [a for i, a in enumerate(sys.argv[1:], 1) if not a.startswith("--") and sys.argv[i - 1] != "--rename"]
    renames = [sys.argv[i + 1].split("=>") for i, a in enumerate(sys.argv) if a == "--rename"]
    before, after = functions(args[0]), functions(args[1])
    for pattern, repl in renames:
        before = {re.sub(pattern, repl, n): body for n, body in before.items()}
    same = sorted(n for n in before if n in after and before[n] == after[n])
    differ = sorted(n for n in before if n in after and before[n] != after[n])
    gone = sorted(n for n in before if n not in after)
    new = sorted(n for n in after if n not in before)
    print(f"{len(same)} identical, {len(differ)} differ, {len(gone)} only before, {len(new)} only after")
    for label, names in (("identical", same), ("differ", differ), ("only before", gone), ("only after", new)):
        for n in names:
            print(f"{label}\t{n}")


if __name__ == "__main__":
    main()
