"""A graph's weights by param name, each a tensor or a lazy tensor: a shape, a dtype and a way to
make its values (read from the source file, decoded, concatenated) when asked. A compile that
keeps its weights lazy holds one weight's values at a time, however large the model: reading an
entry makes its values and keeps none of them; only assigning a tensor stores one."""

from __future__ import annotations

import math
from collections.abc import MutableMapping
from typing import Callable, Iterator, NamedTuple

import torch


class LazyTensor(NamedTuple):
    """A tensor's shape and dtype now, its values when `load` is called (a fresh tensor each time)."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]

    def numel(self) -> int:
        return math.prod(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel() * self.dtype.itemsize


Entry = torch.Tensor | LazyTensor


def values_of(entry: Entry) -> torch.Tensor:
    """The entry's values; a lazy one's are checked against the shape and dtype it declared."""
    if isinstance(entry, torch.Tensor):
        return entry
    values = entry.load()
    if tuple(values.shape) != tuple(entry.shape) or values.dtype != entry.dtype:
        raise ValueError(f"a lazy weight made {values.dtype} {list(values.shape)}, "
                         f"declared {entry.dtype} {list(entry.shape)}")
    return values


def as_lazy(entry: Entry) -> LazyTensor:
    if isinstance(entry, LazyTensor):
        return entry
    return LazyTensor(tuple(entry.shape), entry.dtype, lambda: entry)


def as_dtype(entry: Entry, dtype: torch.dtype) -> Entry:
    if isinstance(entry, torch.Tensor):
        return entry.to(dtype)
    return entry if entry.dtype == dtype else LazyTensor(entry.shape, dtype, lambda: values_of(entry).to(dtype))


def contiguous(entry: Entry) -> Entry:
    """The entry with contiguous values (a lazy one's are made so when loaded)."""
    if isinstance(entry, torch.Tensor):
        return entry.contiguous()
    return entry._replace(load=lambda: values_of(entry).contiguous())


class WeightStore(MutableMapping):
    """name -> tensor; lazy entries are made on each read (see the module's docstring)."""

    def __init__(self, entries: dict[str, Entry] | None = None):
        self._entries: dict[str, Entry] = {}
        for name, entry in (entries or {}).items():
            self[name] = entry

    def __getitem__(self, name: str) -> torch.Tensor:
        return values_of(self._entries[name])

    def __setitem__(self, name: str, entry: Entry) -> None:
        if not isinstance(entry, (torch.Tensor, LazyTensor)):
            raise TypeError(f"weight {name!r} is a {type(entry).__name__}, not a tensor")
        self._entries[name] = entry

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name) -> bool:
        return name in self._entries

    def pop(self, name: str, *default):
        """Remove `name`; returns its entry as stored (a lazy one is not made just to be dropped)."""
        return self._entries.pop(name, *default)

    def entry(self, name: str) -> Entry:
        """The stored entry itself: a tensor, or a lazy tensor left unmade."""
        return self._entries[name]

    def is_lazy(self, name: str) -> bool:
        return isinstance(self._entries.get(name), LazyTensor)

    def lazy_count(self) -> int:
        return sum(isinstance(e, LazyTensor) for e in self._entries.values())

    def materialise(self) -> None:
        """Make every lazy entry's values once and keep them (for work that reads weights many
        times, such as timing kernels: a lazy read would be timed as part of the kernel)."""
        made: dict[int, torch.Tensor] = {}   # a lazy tensor under two names is made once
        for name, entry in self._entries.items():
            if isinstance(entry, LazyTensor):
                self._entries[name] = made.setdefault(id(entry), values_of(entry))

    def copy(self) -> WeightStore:
        store = WeightStore()
        store._entries = dict(self._entries)
        return store

    def derive(self, names: list[str], make: Callable[[list[torch.Tensor]], torch.Tensor],
               shape: tuple[int, ...], dtype: torch.dtype) -> Entry:
        """make(values of `names`) as a tensor now when every input is one, else as a lazy tensor
        over the entries as they are now (so it survives their removal from the store)."""
        entries = [self._entries[n] for n in names]
        if not any(isinstance(e, LazyTensor) for e in entries):
            return make(entries)
        return LazyTensor(tuple(shape), dtype, lambda: make([values_of(e) for e in entries]))
