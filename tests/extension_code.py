"""The installed extension's own machine code, function by function.

pyproject.toml keeps the extension's symbols, so a test can read what the build made of a
source with CMakeLists.txt's flags (readelf for where each function lies, objdump for its
instructions) instead of compiling the source again: the generic kernel's blocks took GCC
minutes of a CI run to compile, objdump a fraction of a second to list. A static function
follows the FILE symbol of the translation unit it was compiled in; an exported one, or a
hidden one shared between units, is found by its name.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from typing import Callable, NamedTuple, Optional

from ttile import _kernels


class Function(NamedTuple):
    name: str
    start: int
    stop: int


class Symbols(NamedTuple):
    functions: list[Function]
    units: set[str]      # the FILE symbols seen (translation units with static symbols)


def readable() -> bool:
    return shutil.which("readelf") is not None and shutil.which("objdump") is not None


def functions(in_unit: Callable[[str], bool], named: Callable[[str], bool]) -> Optional[Symbols]:
    """The extension's functions that are static in a unit ``in_unit`` accepts (by its
    FILE name) or whose name ``named`` accepts; None where the extension is stripped or
    binutils are missing."""
    if not readable():
        return None
    table = subprocess.run(["readelf", "-sW", _kernels.__file__], capture_output=True,
                           text=True).stdout.split("Symbol table '.symtab'")
    if len(table) < 2:
        return None   # stripped
    found, units, in_source = [], set(), False
    for line in table[1].splitlines():
        fields = line.split()
        if len(fields) < 8 or not fields[0].endswith(":"):
            continue
        kind, bind, name = fields[3], fields[4], fields[7]
        if kind == "FILE":
            in_source = in_unit(name)
            units.add(name)
        elif kind == "FUNC" and int(fields[2], 0) > 0 and (
                (in_source and bind == "LOCAL") or named(name)):
            start = int(fields[1], 16)
            found.append(Function(name, start, start + int(fields[2], 0)))
    return Symbols(found, units)


def disassembly(function: Function) -> str:
    """objdump's listing of one function (its "<name>:" line first)."""
    return subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", f"--start-address={function.start}",
         f"--stop-address={function.stop}", _kernels.__file__],
        capture_output=True, text=True, check=True).stdout


def matcher(pattern: str) -> Callable[[str], bool]:
    return lambda name: re.fullmatch(pattern, name) is not None
