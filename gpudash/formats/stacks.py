"""Who asked: the call stacks of a trace's events, interned.

PyTorch records the stack of every allocator call (Python frames, and C++ frames with
``stacks="all"``), and a million events of 20-30 frames each would cost gigabytes as Python
objects. A trace keeps them as two tables and one column instead:

- :attr:`StackTable.frames`: each distinct frame once, a :class:`Frame` (file, line, function);
- :attr:`StackTable.stacks`: each distinct stack once, a :class:`Stack` (frame ids, innermost
  first as PyTorch lists them, with the call's ``compile_context`` and ``user_metadata``);
- :attr:`gpudash.trace.Trace.stack`: an ``int32`` stack id per event (-1: none recorded).

A million events stay at 4 bytes each plus the distinct stacks, and every question about who
holds memory is a numpy group-by over stack ids (:mod:`gpudash.trace.holders`).
:meth:`StackTable.frame_arrays` gives the tables as flat arrays (CSR: offsets and frame ids)
for such questions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from .._errors import TraceFormatError

__all__ = ["Frame", "Stack", "StackTable", "STACK_DTYPE"]

#: dtype of :attr:`gpudash.trace.Trace.stack` (an index into the stack table, -1 = none).
STACK_DTYPE = np.int32


class Frame(NamedTuple):
    """One frame of a call stack."""

    filename: str
    line: int
    name: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.line} {self.name}" if self.line else \
            f"{self.filename} {self.name}"


class Stack(NamedTuple):
    """One recorded call stack: frame ids into :attr:`StackTable.frames`, innermost first,
    and what PyTorch recorded with it (``""`` where nothing was)."""

    frames: tuple[int, ...]
    compile_context: str = ""
    user_metadata: str = ""


class StackTable:
    """The distinct frames and stacks of a trace (shared by its slices).

    Parameters
    ----------
    frames : iterable of Frame or (filename, line, name), optional
    stacks : iterable of Stack or (frame ids, compile_context, user_metadata), optional

    Raises
    ------
    TraceFormatError
        A frame that is not (str, int, str), or a stack naming a frame not in the table.
    """

    __slots__ = ("frames", "stacks", "_frame_ids", "_stack_ids", "_arrays")

    def __init__(self, frames: Iterable[Any] = (), stacks: Iterable[Any] = ()) -> None:
        self.frames: list[Frame] = []
        self.stacks: list[Stack] = []
        self._frame_ids: dict[Frame, int] = {}
        self._stack_ids: dict[Stack, int] = {}
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None
        self.extend_json(frames, stacks)

    # ------------------------------------------------------------------ interning
    def _append_frame(self, frame: Frame) -> None:
        """Add ``frame`` at the end, even when the table has it (a table read from a file
        keeps its numbering); lookups find the first."""
        self._frame_ids.setdefault(frame, len(self.frames))
        self.frames.append(frame)

    def _append_stack(self, stack: Stack) -> None:
        self._stack_ids.setdefault(stack, len(self.stacks))
        self.stacks.append(stack)
        self._arrays = None

    def _add_frame(self, frame: Frame) -> int:
        i = self._frame_ids.get(frame)
        if i is None:
            i = self._frame_ids[frame] = len(self.frames)
            self.frames.append(frame)
        return i

    def _add_stack(self, stack: Stack) -> int:
        i = self._stack_ids.get(stack)
        if i is None:
            i = self._stack_ids[stack] = len(self.stacks)
            self.stacks.append(stack)
            self._arrays = None
        return i

    def intern_frame(self, filename: str, line: int, name: str) -> int:
        """The id of a frame, added when new."""
        return self._add_frame(Frame(str(filename), int(line), str(name)))

    def intern(self, frame_ids: Sequence[int], compile_context: str = "",
               user_metadata: str = "") -> int:
        """The id of a stack (frame ids innermost first), added when new."""
        return self._add_stack(Stack(tuple(frame_ids), compile_context or "",
                                     user_metadata or ""))

    def intern_frames(self, frames: Iterable[Any], compile_context: str = "",
                      user_metadata: str = "") -> int:
        """The id of a stack given as frames (:class:`Frame` or (filename, line, name))."""
        return self.intern([self._add_frame(_frame(f, -1)) for f in frames],
                           compile_context, user_metadata)

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return len(self.stacks)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StackTable):
            return NotImplemented
        return self.frames == other.frames and self.stacks == other.stacks

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StackTable(frames={len(self.frames)}, stacks={len(self.stacks)})"

    def frames_of(self, stack_id: int) -> list[Frame]:
        """The frames of a stack, innermost first ([] for -1: none recorded)."""
        if stack_id < 0:
            return []
        frames = self.frames
        return [frames[f] for f in self.stacks[stack_id].frames]

    def frame_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The stacks as CSR arrays: ``offsets`` (int64, one more than stacks) and ``ids``
        (int32 frame ids), stack ``s`` being ``ids[offsets[s]:offsets[s + 1]]``."""
        if self._arrays is None:
            lengths = np.fromiter((len(s.frames) for s in self.stacks), dtype=np.int64,
                                  count=len(self.stacks))
            offsets = np.zeros(len(self.stacks) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            ids = np.fromiter((f for s in self.stacks for f in s.frames), dtype=np.int32,
                              count=int(offsets[-1]))
            self._arrays = (offsets, ids)
        return self._arrays

    def merged(self, other: StackTable) -> tuple[StackTable, np.ndarray]:
        """``self`` with ``other``'s stacks added, and the map of ``other``'s stack ids to the
        merged table's (an array one longer than ``other``, its last entry -1, so that
        ``remap[ids]`` maps -1 to -1)."""
        out = self.copy()
        fmap = [out._add_frame(f) for f in other.frames]
        remap = np.array([out._add_stack(Stack(tuple(fmap[f] for f in s.frames),
                                               s.compile_context, s.user_metadata))
                          for s in other.stacks] + [-1], dtype=STACK_DTYPE)
        return out, remap

    def copy(self) -> StackTable:
        out = StackTable()
        out.frames = list(self.frames)
        out.stacks = list(self.stacks)
        out._frame_ids = dict(self._frame_ids)
        out._stack_ids = dict(self._stack_ids)
        return out

    # ------------------------------------------------------------------ JSON (.gdtrace)
    def extend_json(self, frames: Iterable[Any], stacks: Iterable[Any]) -> None:
        """Append frames, then stacks (which may name them), as a file lists them: each
        numbered after those already in the table, duplicates kept."""
        for f in frames:
            self._append_frame(_frame(f, len(self.frames)))
        for s in stacks:
            self._append_stack(_stack(s, len(self.stacks), len(self.frames)))

    def frames_json(self, start: int = 0) -> list[list]:
        """Frames from ``start`` on as ``[filename, line, name]`` lists."""
        return [list(f) for f in self.frames[start:]]

    def stacks_json(self, start: int = 0) -> list[list]:
        """Stacks from ``start`` on as ``[frame ids, compile_context, user_metadata]``."""
        return [[list(s.frames), s.compile_context, s.user_metadata]
                for s in self.stacks[start:]]


def _frame(value: Any, at: int) -> Frame:
    if isinstance(value, Frame):
        return value
    try:
        filename, line, name = value
    except (TypeError, ValueError):
        raise TraceFormatError(f"stack table: frame {at} must be (filename, line, name); "
                               f"got {value!r:.80}") from None
    if not (isinstance(filename, str) and isinstance(name, str)
            and isinstance(line, int) and not isinstance(line, bool)):
        raise TraceFormatError(f"stack table: frame {at} must be (str, int, str); got "
                               f"{value!r:.80}")
    return Frame(filename, line, name)


def _stack(value: Any, at: int, n_frames: int) -> Stack:
    if isinstance(value, Stack):
        ids, cc, um = value
    else:
        try:
            ids, cc, um = value
        except (TypeError, ValueError):
            raise TraceFormatError(f"stack table: stack {at} must be (frame ids, "
                                   f"compile_context, user_metadata); got {value!r:.80}"
                                   ) from None
    if not (isinstance(ids, (list, tuple)) and isinstance(cc, str) and isinstance(um, str)):
        raise TraceFormatError(f"stack table: stack {at} must be (list of frame ids, str, "
                               f"str); got {value!r:.80}")
    for f in ids:
        if isinstance(f, bool) or not isinstance(f, int) or not 0 <= f < n_frames:
            raise TraceFormatError(f"stack table: stack {at} names frame {f!r:.40}, not in "
                                   f"the table of {n_frames} frames")
    return Stack(tuple(ids), cc, um)
