"""The one exception family of the conversion layer."""

from __future__ import annotations

import os


class ConvertError(ValueError):
    """A source or destination that cannot be converted.

    The message always names the file (and, where it applies, the structure
    index and the field) so that the command line can print it as one line.

    Args:
        path: The file or directory the problem is about.
        problem: What is wrong, in words.
        index: The structure index inside the source, when known.
    """

    def __init__(self, path: str | os.PathLike, problem: str, index: int | None = None) -> None:
        self.path = os.fspath(path)
        self.problem = problem
        self.index = index
        where = self.path if index is None else f"{self.path} (structure {index})"
        super().__init__(f"{where}: {problem}")
