"""The weights a loader found, each built from the file when it is read and not kept.

A loader (jaxcb.model.hf_loader, jaxcb.model.gguf_loader) declares how each weight of the loader layout is made
from the file (memory-mapped: nothing is read until then) and checks up front what it can without reading: that the
tensors exist and are all used, and their shapes. Its reader, jaxcb.model.llama.params_from_numpy, builds one weight
at a time, converts it (quantized, or cast) and places it on its devices before building the next, a large stack a
layer at a time into its place there: the host holds one weight (or one layer) in float32 beside the file's pages,
not the whole model, and under tensor parallelism each device receives only its own slice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping

import numpy as np

from jaxcb.host.errors import InvalidConfig


class LazyWeights(MutableMapping):
    """{name: array} of the loader layout whose arrays are built when read, checked against `shapes` (a
    ModelConfig's weight_shapes(); `source` names the file in the error). Reading a weight twice builds it twice.
    A weight stacked over layers is also readable a layer at a time (layers(name)).

    The file's side, the loader's: read(tensor, transpose) a tensor's values (a view where it can be), claim(tensor)
    checks that a tensor is there (and counts it as used), header(tensor) its shape as stored."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], source: str, read=None, claim=None, header=None):
        self._make: dict[str, Callable[[], np.ndarray]] = {}
        self._layers: dict[str, list[Callable[[], np.ndarray]]] = {}  # (a stacked weight's: each layer's)
        self._shapes = shapes
        self._source = source
        self._read, self._claim, self._header = read, claim, header

    def one(self, name: str, tensor: str, transpose: bool = False) -> None:
        """`name` from the file's `tensor` whole (its two last axes swapped with `transpose`)."""
        self._claim(tensor)
        self.put(name, lambda: float32(self._read(tensor, transpose)))

    def put(self, name: str, make: Callable[[], np.ndarray]) -> None:
        """How `name` is built (a function of no arguments)."""
        self._make[name] = make
        self._layers.pop(name, None)

    def layered(self, name: str, makes: list[Callable[[], np.ndarray]]) -> None:
        """`name` stacked over layers: makes[n]() gives layer n's array (a view where it can be, cast when copied)."""
        self._layers[name] = makes
        self._make[name] = lambda: filled(self.layers(name), name)

    def then(self, name: str, change: Callable[[np.ndarray], np.ndarray]) -> None:
        """`change` applied to `name` as it is built, after what was declared before: to each layer's array of a
        stacked weight (a change that treats every leading axis alike), to the whole of any other."""
        if name in self._layers:
            self.layered(name, [lambda make=make: change(float32(make())) for make in self._layers[name]])
        else:
            make = self._make[name]
            self._make[name] = lambda: change(make())

    def stack(self, name: str, tensors: list, transpose: bool = False, each=None) -> None:
        """`name` stacked over layers: layer n from the file's tensors[n] (a list of them: the experts of layer n,
        stacked), its two last axes swapped with `transpose`, passed through each(array) if given. Where nothing
        (`each`) changes them, the shapes in the file's header are checked against the config now."""
        flat = [t for group in tensors for t in ([group] if isinstance(group, str) else group)]
        for tensor in flat:
            self._claim(tensor)
        if each is None:
            want = self._shapes.get(name, ())[1 + (not isinstance(tensors[0], str)):]
            for tensor in flat:
                got = tuple(self._header(tensor))
                got = (*got[:-2], got[-1], got[-2]) if transpose and len(got) >= 2 else got
                if want and got != want:
                    raise InvalidConfig(f"{self._source}: tensor {tensor} ({name}) has shape {got}, expected {want}")

        def layer(group):
            read = self._read
            w = read(group, transpose) if isinstance(group, str) else np.stack([read(t, transpose) for t in group])
            return each(w) if each is not None else w

        self.layered(name, [lambda group=group: layer(group) for group in tensors])

    def layers(self, name: str) -> list[Callable[[], np.ndarray]] | None:
        """A stacked weight's layers, each built (checked against the config's shape) when called; None for a
        weight that is not built a layer at a time."""
        if name not in self._layers:
            return None
        want = self._shapes.get(name, (None,))[1:]

        def checked(n, make):
            value = make()
            if want and tuple(value.shape) != want:
                raise InvalidConfig(f"{self._source}: tensor {name} of layer {n} has shape {tuple(value.shape)}, "
                                    f"expected {want}")
            return value

        return [lambda n=n, make=make: checked(n, make) for n, make in enumerate(self._layers[name])]

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The shape the config gives `name` (nothing built)."""
        return self._shapes.get(name)

    def __setitem__(self, name: str, value: np.ndarray) -> None:  # (an array made already)
        self.put(name, lambda: value)

    def __getitem__(self, name: str) -> np.ndarray:
        value = self._make[name]()
        if name in self._shapes and tuple(value.shape) != self._shapes[name]:
            raise InvalidConfig(f"{self._source}: tensor {name} has shape {tuple(value.shape)}, "
                                f"expected {self._shapes[name]}")
        return value

    def __delitem__(self, name: str) -> None:
        del self._make[name]
        self._layers.pop(name, None)

    def __contains__(self, name) -> bool:  # (Mapping's would build the weight)
        return name in self._make

    def __iter__(self) -> Iterator[str]:
        return iter(self._make)

    def __len__(self) -> int:
        return len(self._make)


def float32(value: np.ndarray) -> np.ndarray:
    """A contiguous float32 copy of `value` (a view: of a mapped file, transposed), made in one pass."""
    out = np.empty(value.shape, np.float32)
    out[...] = value
    return out


def filled(makes: list, where: str) -> np.ndarray:
    """One weight stacked over layers (float32), filled a layer at a time: makes[n]() gives layer n's array, a view
    (of a mapped file, transposed) cast and copied into place in one pass (a released checkpoint's experts are most
    of it: no second copy of the stack)."""
    out = None
    for n, make in enumerate(makes):
        value = make()
        if out is None:
            out = np.empty((len(makes), *value.shape), np.float32)
        elif value.shape != out.shape[1:]:
            raise InvalidConfig(f"model: {where} of layer {n} has shape {value.shape}, layer 0's {out.shape[1:]}")
        out[n] = value
    return out
