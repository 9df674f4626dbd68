"""Function symbols of an ELF shared object, read from its symbol tables without loading it.

Only what the probe needs: defined FUNC/IFUNC symbols of ``.dynsym`` (always present in a shared
library) and, for names not exported there, ``.symtab`` (absent in stripped files). The file is
memory-mapped and only the symbol and string tables are touched, which matters for 350-450 MB
libraries such as libnccl and libtorch_cpu.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_ELF_MAGIC = b"\x7fELF"
_ELFCLASS64 = 2
_ELFDATA2LSB = 1
_SHT_SYMTAB = 2
_SHT_DYNSYM = 11
_STT_FUNC = 2
_STT_GNU_IFUNC = 10
_SHN_UNDEF = 0
_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
BINDINGS = {0: "local", 1: "global", 2: "weak", 10: "unique"}


class ElfError(ValueError):
    """The file is not a 64-bit little-endian ELF object we can read."""


@dataclass(frozen=True, slots=True)
class Symbol:
    name: str
    address: int
    """st_value: the virtual address, which bcc turns into a file offset."""
    size_bytes: int
    binding: str
    table: str
    """".dynsym" or ".symtab"."""


def function_symbols(path: str | Path, names: Iterable[str]) -> dict[str, Symbol]:
    """The defined function symbols among ``names`` (absent ones are simply missing)."""
    wanted = {n.encode() for n in names}
    found: dict[str, Symbol] = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        sections = _sections(mm, str(path))
        for table_type, table in ((_SHT_DYNSYM, ".dynsym"), (_SHT_SYMTAB, ".symtab")):
            missing = wanted - {n.encode() for n in found}
            if not missing:
                break
            for sh in sections:
                if sh[1] != table_type:
                    continue
                strtab = sections[sh[6]]
                found.update(_scan(mm, sh, strtab, missing, table))
    return found


def _sections(mm: mmap.mmap, path: str) -> list[tuple[int, ...]]:
    if len(mm) < _EHDR.size or mm[:4] != _ELF_MAGIC:
        raise ElfError(f"{path}: not an ELF file")
    ident = mm[:16]
    if ident[4] != _ELFCLASS64 or ident[5] != _ELFDATA2LSB:
        raise ElfError(f"{path}: not a 64-bit little-endian ELF file")
    ehdr = _EHDR.unpack_from(mm, 0)
    shoff, shentsize, shnum = ehdr[6], ehdr[11], ehdr[12]
    if shoff == 0 or shentsize != _SHDR.size or shoff + shnum * shentsize > len(mm):
        raise ElfError(f"{path}: no usable section header table")
    return [_SHDR.unpack_from(mm, shoff + i * shentsize) for i in range(shnum)]


def _scan(
    mm: mmap.mmap, sh: tuple[int, ...], strtab: tuple[int, ...], wanted: set[bytes], table: str
) -> dict[str, Symbol]:
    offset, size, entsize = sh[4], sh[5], sh[9]
    if entsize != _SYM.size:
        return {}
    str_off, str_size = strtab[4], strtab[5]
    out: dict[str, Symbol] = {}
    for pos in range(offset, offset + size - entsize + 1, entsize):
        st_name, st_info, _other, shndx, value, sym_size = _SYM.unpack_from(mm, pos)
        if shndx == _SHN_UNDEF or (st_info & 0xF) not in (_STT_FUNC, _STT_GNU_IFUNC):
            continue
        start = str_off + st_name
        name = mm[start : mm.find(b"\0", start, str_off + str_size)]
        if name in wanted:
            text = name.decode()
            out[text] = Symbol(text, value, sym_size, BINDINGS.get(st_info >> 4, "other"), table)
    return out
