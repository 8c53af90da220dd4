"""Batches that arrive on the device: copied one step ahead on a side CUDA stream.

A training step on a GPU launches its kernels and returns long before they finish; a
loader that then reads the next batch, copies it from pageable memory and only then
launches the next step leaves the GPU idle for the read and the copy. :class:`DeviceFeeder`
takes the next batch from its loader as soon as the consumer asks for the current one, pins
it, and copies it on a side stream (optionally building its neighbour graph there too),
so that both overlap the kernels of the step in flight; the consumer's stream waits for
the copy only when it uses the batch.

It is PyG's :class:`~torch_geometric.loader.PrefetchLoader` mechanism plus what a training
loop of this project needs: the memory of each batch is recorded on the consumer's stream
(``record_stream``), so the caching allocator never hands it to the next copy while a
step still reads it; a function can run on the device batch on the side stream
(``transform``, e.g. :class:`pyg_atompack.graph.NeighbourTransform`); and resuming stays
exact, because the loader's state is taken before the batch ahead is drawn
(``snapshot``). On a CPU (or any device without streams) the same code runs without
streams: the tests exercise the one-ahead order, the states and the transform there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor
from torch_geometric.data.data import BaseData

__all__ = ["DeviceFeed", "DeviceFeeder", "move_to"]


def _map(item: Any, function: Callable[[Any], Any]) -> Any:
    """Applies ``function`` to every tensor or PyG object in ``item`` (lists, tuples, dicts)."""
    if isinstance(item, (Tensor, BaseData)):
        return function(item)
    if isinstance(item, Mapping):
        return {key: _map(value, function) for key, value in item.items()}
    if isinstance(item, (list, tuple)):
        return type(item)(_map(value, function) for value in item)
    return item


def move_to(item: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Moves every tensor or PyG object in ``item`` to ``device``.

    Args:
        item (Any): A ``Tensor``, ``Data``/``Batch`` or a list, tuple or dict of them;
            anything else is returned as it is.
        device (torch.device): The target device.
        non_blocking (bool, optional): Copy asynchronously (from pinned memory).
            (default: :obj:`False`)
    """
    return _map(item, lambda value: value.to(device, non_blocking=non_blocking))


def _pin(value: Tensor | BaseData) -> Tensor | BaseData:
    # pinning an already pinned tensor (a DataLoader with pin_memory=True) returns it as is
    return value.pin_memory()


class _Staged:
    """One batch on its way to the device: the moved batch, its copy event, its state."""

    __slots__ = ("item", "event", "state")

    def __init__(self, item: Any, event: torch.cuda.Event | None, state: Any) -> None:
        self.item = item
        self.event = event
        self.state = state


class DeviceFeeder:
    r"""Iterates over ``batches`` already on ``device``, each copied one step ahead.

    .. code-block:: python

        feeder = DeviceFeeder(loader, "cuda", transform=NeighbourTransform(5.0))
        for batch in feeder:          # on the GPU, edges built on the side stream
            loss = step(model, batch)

    While the consumer works on batch ``k``, batch ``k + 1`` has been drawn, pinned and
    copied (and transformed) on a side stream; at most two batches are on the device at
    a time. On a device other than CUDA the batches are moved and transformed on the
    consumer's thread, one ahead, in the same order.

    Args:
        batches (Iterable): A loader (or any iterable) of ``Data``/``Batch`` objects,
            tensors, or lists, tuples and dicts of them.
        device (torch.device or str): Where batches are handed out.
        transform (Callable, optional): Applied to each batch on the device (on the side
            stream), e.g. to build its neighbour graph. Kernels of a library that ignores
            torch's current stream run on the default stream instead: still in order,
            but without overlapping the step. (default: :obj:`None`)
        pin_memory (bool, optional): Pin batches before copying them to CUDA, so that the
            copy is asynchronous. (default: :obj:`True`)
        snapshot (Callable[[], Any], optional): Returns the loader's resume state; called
            right after each batch is drawn, so :attr:`state` matches the batches
            handed out, not the one drawn ahead. (default: :obj:`None`)
    """

    def __init__(self, batches: Iterable[Any], device: torch.device | str, *,
                 transform: Callable[[Any], Any] | None = None, pin_memory: bool = True,
                 snapshot: Callable[[], Any] | None = None) -> None:
        self.batches = batches
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={str(self.device)!r} but torch sees no CUDA device")
        self.transform = transform
        self.pin_memory = pin_memory
        self.snapshot = snapshot
        #: the loader state matching the batches handed out so far (with ``snapshot``)
        self.state: Any = None
        self._stream: torch.cuda.Stream | None = None

    @property
    def uses_stream(self) -> bool:
        """Whether copies run on a side CUDA stream."""
        return self.device.type == "cuda"

    def _stage(self, item: Any) -> _Staged:
        state = self.snapshot() if self.snapshot is not None else None
        if not self.uses_stream:
            item = move_to(item, self.device)
            if self.transform is not None:
                item = self.transform(item)
            return _Staged(item, None, state)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        if self.pin_memory:
            item = _map(item, _pin)
        with torch.cuda.stream(self._stream):
            item = move_to(item, self.device, non_blocking=True)
            if self.transform is not None:
                item = self.transform(item)
            event = torch.cuda.Event()
            event.record(self._stream)
        return _Staged(item, event, state)

    def _hand_out(self, staged: _Staged) -> Any:
        if staged.event is not None:
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_event(staged.event)
            # memory allocated on the side stream is freed by the consumer's stream:
            # without this the allocator could reuse it for the next copy mid-step
            _map(staged.item, lambda value: value.record_stream(consumer))
        self.state = staged.state
        return staged.item

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self.batches)
        try:
            ahead = self._stage(next(iterator))
        except StopIteration:
            if self.snapshot is not None:
                self.state = self.snapshot()
            return
        while ahead is not None:
            current = ahead
            try:
                ahead = self._stage(next(iterator))
            except StopIteration:
                ahead = None
                if self.snapshot is not None:  # nothing is ahead: the loader's own state
                    current.state = self.snapshot()  # is the consumer's (a finished pass)
            item = self._hand_out(current)
            del current
            yield item
            del item

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.batches!r}, device={str(self.device)!r})"


class DeviceFeed:
    """A loader's ``device=`` option: its passes go through a :class:`DeviceFeeder`.

    The loader calls :meth:`wrap` on each pass's batches and asks :meth:`state` for its
    resume state, which then describes the batches handed out, not the one drawn ahead.

    Args:
        device (torch.device or str): Where batches are handed out.
        transform (Callable, optional): Applied to each batch on the device.
            (default: :obj:`None`)
    """

    def __init__(self, device: torch.device | str,
                 transform: Callable[[Any], Any] | None = None) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={str(self.device)!r} but torch sees no CUDA device")
        self.transform = transform
        self.feeder: DeviceFeeder | None = None

    def wrap(self, batches: Iterable[Any], snapshot: Callable[[], Any] | None) -> Iterator[Any]:
        """The batches of one pass, on the device."""
        self.feeder = DeviceFeeder(batches, self.device, transform=self.transform,
                                   snapshot=snapshot)
        return iter(self.feeder)

    def __getstate__(self) -> dict[str, Any]:
        # a dataset holding the option is pickled into DataLoader workers; a pass is not
        return {**self.__dict__, "feeder": None}

    def reset(self) -> None:
        """Forget the last pass (a state was loaded: the next pass starts from it)."""
        self.feeder = None

    def state(self, current: Callable[[], Any]) -> Any:
        """The loader's state for the batches handed out (``current()`` before the first)."""
        if self.feeder is None or self.feeder.state is None:
            return current()
        return self.feeder.state

    @staticmethod
    def of(device: torch.device | str | None,
           transform: Callable[[Any], Any] | None) -> DeviceFeed | None:
        """The option as a loader stores it: :obj:`None` without a device."""
        if device is None:
            if transform is not None:
                raise ValueError("device_transform needs device=")
            return None
        return DeviceFeed(device, transform)
