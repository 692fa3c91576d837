"""Idempotent: top-level ``runtime`` -> ``recompile.runtime`` in a checkout: ``python3 .ci/rename_runtime.py``
from its root converts what branches written before the rename still import as ``runtime`` (re-runnable; a
one-off for the merge of this session's branches: delete it after).

runtime/**.py: absolute ``runtime`` imports become relative (``from .kernels import``, ``from ..jagged import``);
everywhere else: imports, dotted names in quotes/backticks (mock targets, "runtime._C", ``runtime.x`` in docs,
kernel descriptions) and ``python -m runtime.`` gain the ``recompile.`` prefix. Prints the files it changed.
"""
import pathlib
import re
import subprocess

NAME = r"[A-Za-z_][\w.]*"
OUTSIDE = [  # (pattern, replacement) for every text file but runtime/**.py
    (re.compile(rf"^(\s*)from runtime(\.{NAME})? import ", re.M), r"\1from recompile.runtime\2 import "),
    (re.compile(rf"^(\s*)import runtime(\.{NAME})? as ", re.M), r"\1import recompile.runtime\2 as "),
    (re.compile(r"^(\s*)import runtime(?=[ \t]*(#.*)?$)", re.M), r"\1from recompile import runtime"),
    (re.compile(rf"^(\s*)import runtime(\.{NAME})([ \t]*(#.*)?)$", re.M), r"\1import recompile.runtime\2\3"),
    (re.compile(r"([\"'`])runtime\.(?=[A-Za-z_])"), r"\1recompile.runtime."),
    (re.compile(r"(-m )runtime\.(?=[A-Za-z_])"), r"\1recompile.runtime."),
]


def inside(path: pathlib.Path, text: str) -> str:
    """runtime/**.py: ``from runtime[.a.b] import x`` -> relative to the file's package."""
    depth = len(path.parts) - 1  # runtime/x.py: 1, runtime/triton_kernels/x.py: 2
    package = path.parts[:-1]

    def relative(m):
        target = ("runtime",) + tuple(filter(None, (m.group(2) or "").split(".")))
        common = 0
        while common < min(len(target), len(package)) and target[common] == package[common]:
            common += 1
        dots = "." * (depth - common + 1)
        return f"{m.group(1)}from {dots}{'.'.join(target[common:])} import "

    text = re.sub(rf"^(\s*)from runtime(\.{NAME})? import ", relative, text, flags=re.M)
    for pattern, replacement in OUTSIDE[4:]:  # dotted names in strings and docstrings, python -m
        text = pattern.sub(replacement, text)
    return text


def main():
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], capture_output=True, text=True,
                           check=True).stdout.split()
    for name in files:
        path = pathlib.Path(name)
        if path.suffix not in (".py", ".md", ".cpp", ".h", ".toml", ".yml", ".cfg", ".txt", "") or not path.is_file():
            continue
        if name.startswith((".ci/rename_runtime", "CHANGELOG")):
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        if path.parts[0] == "runtime" and path.suffix == ".py":
            new = inside(path, text)
            if re.search(r"^\s*import runtime", new, re.M):
                print(f"{name}: convert its 'import runtime...' by hand (a relative import names no package)")
        else:
            new = text
            for pattern, replacement in OUTSIDE:
                new = pattern.sub(replacement, new)
        if new != text:
            path.write_text(new)
            print(name)


if __name__ == "__main__":
    main()
